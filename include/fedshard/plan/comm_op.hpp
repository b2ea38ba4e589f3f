#pragma once
/// The schedule as data: comm_op (one collective, executable) and plan (a list of them).
///
/// An op says what moves (kind, axis, dtype, bytes, reduce op), which buffers it reads and
/// writes, by role (the parameter shard of unit u, the gathered unit u, the fragment f of a
/// sync, ...; see `role`), and when it runs: its trigger (the model acquires unit u in a
/// phase, u's gradients are ready, a sync of fragment f starts, ...). Policies emit plans;
/// the interpreter (plan/interpreter.hpp) binds roles to real buffers and runs each op when
/// its trigger fires; the wire tap (plan/wire_tap.hpp) counts what actually moved; the
/// simulator prices the same plans.
///
/// `bytes` is the size of the whole array in the nccl-tests sense (the gathered buffer for
/// all_gather, the input for reduce_scatter, the buffer for all_reduce and broadcast); the
/// bytes each rank sends follow from the bus factor of the kind and the ranks on the axis.
/// Ops of one trigger run in plan order, each after the previous one completed (a chain).
///
/// Point-to-point kinds name the other rank in `peer` (an axis rank; -1 on every other kind):
///  - send_recv is an exchange with one peer: the rank sends its `in` (bytes) to axis rank
///    `peer` and receives the peer's into `out` (bytes too; `in` and `out` must not overlap).
///    Its peer sends back with an op of its own naming this rank, at the same place in its
///    plan. On the wire it is one message of `bytes` each way (bus factor 1);
///  - send and recv are the two halves of a one-way transfer (healing a joining group from a
///    donor: federation/heal.hpp): a send op reads `in` (no `out`) and sends it to axis rank
///    `peer`; the peer runs a recv op (`out`, no `in`) naming the sender, at the same place in
///    its plan, and receives the same bytes into `out`. The sender sends `bytes` (bus factor
///    1), the receiver none (bus factor 0), though a recv takes as long as its message.
/// `ranks` stays the ranks on the axis (the interpreter checks it against the mesh); every
/// message is recorded by its sender as a send_recv call of 2 ranks (wire_call::of).
///
/// An op may carry a codec (codec/spec.hpp; the identity by default): an f32 all_reduce
/// (sum or avg) or all_gather whose values travel encoded. Each rank encodes what it
/// contributes (its whole buffer for all_reduce, its block for all_gather) into a wire of
/// codec_slot_bytes(op); the wires are all-gathered; every rank decodes each rank's wire in
/// rank order, accumulating in f32 (never summing in the narrow type), into the output.
/// What the wire carries is carried(op): that all_gather, of 4-byte words. `bytes` stays the
/// f32 array the op stands for; the traffic, the tap and the simulator count carried(op).
///
/// Local kinds (pack, unpack, zero) move nothing between ranks: the interpreter runs them on
/// the firing's stream, in chain order, through the memory space's kernels (gather_index,
/// scatter_index, fill); a pack or unpack op's `index` operand (role mask) names 32-bit
/// indices (bound as f32 views of their bit patterns), and `bytes` is the packed side's size.
/// They are not calls: the wire tap, the traffic counters and the simulator skip them.
///
/// An operand may name an element range of its role's buffer (operand::offset, count: a
/// holder set's units inside a packed fragment), and a federation op may run among a subset
/// of the groups only (comm_op::members, a bit per group; the interpreter runs it on a
/// sub-communicator made once by split_members and cached).

#include <bit>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fedshard/codec/spec.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/error.hpp"
#include "fedshard/mesh/axis.hpp"

namespace fedshard {

/// What a comm_op does.
enum class comm_kind : std::uint8_t {
  all_gather,
  reduce_scatter,
  all_reduce,
  broadcast,
  send_recv,  ///< an exchange with axis rank `peer` (see the file comment)
  send,       ///< a one-way transfer to axis rank `peer`: the sending half
  recv,       ///< a one-way transfer from axis rank `peer`: the receiving half
  /// Local kinds (see the file comment): no communication, run on the firing's stream.
  pack,    ///< out[j] = in[index[j]] for the indices of operand `index` (role mask)
  unpack,  ///< out[index[j]] = in[j] for the indices of operand `index` (role mask)
  zero     ///< out = 0 (no input)
};

/// The part of training an op belongs to.
enum class phase : std::uint8_t { forward, backward, optimizer, sync, setup };

/// The event that runs an op.
///
/// A sync of a fragment fires four events, in this order (federation/sync.hpp):
/// sync_prepare, then the policy's begin() transforms the packed buffer, then sync_exchange
/// (which may stay in flight across steps), and when the sync is applied sync_finish, the
/// policy's end(), the mix into the master, sync_after. sync_prepare and sync_exchange are two
/// moments, not synonyms: what begin() needs (the groups' token counts for weights) must
/// have arrived before it runs, and what is averaged exists only after it ran.
enum class trigger : std::uint8_t {
  acquire,          ///< the model acquires `unit` for `phase` (forward or backward)
  grads_ready,      ///< the model's gradients of `unit` are complete
  end_of_backward,  ///< backward is over, before the optimizer step
  sync_prepare,     ///< a sync of `fragment` starts: what the policy's begin() needs (token
                    ///< counts), before the fragment is packed and transformed; blocks
  sync_exchange,    ///< begin() transformed the buffer: the exchange (the averaging) starts;
                    ///< may stay in flight across steps until sync_finish
  sync_finish,      ///< the sync of `fragment` is applied: finish it inside the group
  sync_after,       ///< after the policy's end(): what else the sync moves (inner moments)
  on_demand,        ///< a library call asks for it (layout check, means, checkpoints, reads)
};

/// The buffer an operand names; the engine, the sync state machine or the caller binds it.
enum class role : std::uint8_t {
  none,          ///< no buffer (a broadcast's input)
  param_shard,   ///< this rank's f32 master parameters of `unit` (the whole unit if unsharded)
  params,        ///< the gathered parameters of `unit` (padded unit) the model computes with
  grad,          ///< the full (padded) gradient of `unit` as the model wrote it
  grad_shard,    ///< this rank's reduced f32 gradient of `unit`, laid out like param_shard
  fragment,      ///< the packed f32 sync buffer of `fragment` (padded)
  moment,        ///< the packed f32 buffer of inner-optimizer state `index` of `fragment`
  tokens,        ///< this rank's token count since the fragment's last sync (one f64)
  group_tokens,  ///< every group's token count (G f64, ordered by group)
  value,         ///< a buffer the caller of an on-demand op passes
  gathered,      ///< the policy's buffer holding every group's copy of the sync `fragment`
                 ///< (G x its f32 elements, ordered by group)
  packed,        ///< shard::sparse: the masked elements of `unit`, packed in element order,
                 ///< of the buffer its index names (a packed_of)
  state_size,    ///< the size in bytes of a serialized state (one f64; federation/heal.hpp)
  state,         ///< a serialized state, as f64 words (its bytes, zero-padded to whole words)
  mask,          ///< shard::sparse: 32-bit indices of a pack or unpack op (index: a mask_of)
};

/// Whose masked elements a role::packed operand holds: its operand::index (packed_operand).
enum class packed_of : int { param_shard, params, grad, grad_shard };

/// Which indices a role::mask operand names (its operand::index), for unit `unit` of the op:
/// the mask of the last masked update (the gathers') or the one in use (the reductions'),
/// this rank's elements of it (offsets in its shard of the unit) or the whole unit's.
enum class mask_of : int { gather_own, gather_unit, reduce_own, reduce_unit };

/// A buffer reference: a role, which instance of it (index: the inner-optimizer state of a
/// `moment`), optionally only the element range [offset, offset + count) of it (count -1:
/// the whole buffer), and optionally only this rank's 1/n piece (of the range) along an axis
/// of n ranks.
struct operand {
  fedshard::role role = fedshard::role::none;
  int index = 0;
  std::optional<fedshard::axis> piece{};
  std::int64_t offset = 0;  ///< first element of the range
  std::int64_t count = -1;  ///< elements of the range; -1: the whole buffer

  friend bool operator==(const operand&, const operand&) = default;
};

/// The role::packed operand holding the masked elements of `of`.
constexpr operand packed_operand(packed_of of) noexcept {
  return {.role = role::packed, .index = static_cast<int>(of)};
}

/// One collective of a plan: what moves, between which buffers, and when.
struct comm_op {
  comm_kind kind = comm_kind::all_reduce;
  fedshard::axis axis = fedshard::axis::world;
  fedshard::dtype dtype = fedshard::dtype::f32;
  std::int64_t bytes = 0;             ///< size of the whole array (nccl-tests S) in `dtype`
  int ranks = 1;                      ///< ranks on the axis
  std::optional<reduce_op> reduce{};  ///< the reduction (reducing kinds only)
  int root = 0;                       ///< broadcast root, as a rank of the axis
  int peer = -1;  ///< point-to-point kinds: the other rank, as a rank of the axis; else -1
  fedshard::trigger trigger = fedshard::trigger::on_demand;
  fedshard::phase phase = fedshard::phase::setup;
  int unit = -1;                  ///< the unit of a unit trigger or unit role, else -1
  int fragment = -1;              ///< the fragment of a sync trigger or fragment role, else -1
  operand in{};                   ///< what it reads (ignored by broadcast)
  operand out{};                  ///< what it writes
  bool overlappable = true;       ///< may run behind compute (the simulator's overlap model)
  fedshard::codec::spec codec{};  ///< how the values travel (default: as they are)
  /// Federation ops only: the ranks of the federation axis taking part (bit k: axis rank k,
  /// which is group k on a uniform mesh; `ranks` of them), run on a sub-communicator of the
  /// federation axis; 0: every rank of the axis.
  std::uint64_t members = 0;
  operand index{};  ///< pack and unpack only: the indices (role mask); else role none

  friend bool operator==(const comm_op&, const comm_op&) = default;
};

/// True when op's values travel encoded (a codec other than the identity).
constexpr bool encoded(const comm_op& op) noexcept {
  return !op.codec.is_identity();
}

/// True when op changes nothing a reader of its output could see: a collective over one rank
/// that moves f32 values as they are (no codec, no narrow dtype to round through, no member
/// subset), whose output is its input (in place) or a buffer the same size that the reader
/// may read in its place (a gather of an unsharded unit: the params are the shard). Such ops
/// are elided when a shard engine builds its step plan.
constexpr bool one_rank_identity(const comm_op& op) noexcept {
  const bool collective = op.kind == comm_kind::all_reduce || op.kind == comm_kind::all_gather ||
                          op.kind == comm_kind::reduce_scatter;
  return collective && op.ranks == 1 && op.dtype == fedshard::dtype::f32 && !encoded(op) &&
         op.members == 0 && op.in.count < 0 && op.out.count < 0 && op.in.offset == 0 &&
         op.out.offset == 0;
}

/// The f32 elements each rank encodes for an encoded op: the whole buffer of an all_reduce,
/// its block of an all_gather.
constexpr std::int64_t codec_elements(const comm_op& op) noexcept {
  const std::int64_t n = op.bytes / static_cast<std::int64_t>(size_of(op.dtype));
  return op.kind == comm_kind::all_gather && op.ranks > 0 ? n / op.ranks : n;
}

/// The bytes of one rank's wire of an encoded op: the codec's encoded_bytes of
/// codec_elements(op), rounded up to whole 4-byte words (the words are gathered as f32,
/// padding zeroed).
inline std::int64_t codec_slot_bytes(const comm_op& op) {
  const auto e = static_cast<std::int64_t>(
      op.codec.encoded_bytes(static_cast<std::size_t>(codec_elements(op))));
  return (e + 3) / 4 * 4;
}

/// What moves on the wire for op: op itself, or for an encoded op the all_gather of every
/// rank's wire (ranks x codec_slot_bytes, as f32 words, no codec).
inline comm_op carried(const comm_op& op) {
  if (!encoded(op)) return op;
  comm_op c = op;
  c.kind = comm_kind::all_gather;
  c.dtype = dtype::f32;
  c.bytes = codec_slot_bytes(op) * op.ranks;
  c.reduce.reset();
  c.codec = {};
  return c;
}

/// The names of the enumerators.
constexpr std::string_view to_string(comm_kind k) noexcept {
  switch (k) {
    case comm_kind::all_gather: return "all_gather";
    case comm_kind::reduce_scatter: return "reduce_scatter";
    case comm_kind::all_reduce: return "all_reduce";
    case comm_kind::broadcast: return "broadcast";
    case comm_kind::send_recv: return "send_recv";
    case comm_kind::send: return "send";
    case comm_kind::recv: return "recv";
    case comm_kind::pack: return "pack";
    case comm_kind::unpack: return "unpack";
    case comm_kind::zero: return "zero";
  }
  return "unknown-kind";
}
constexpr std::string_view to_string(phase p) noexcept {
  switch (p) {
    case phase::forward: return "forward";
    case phase::backward: return "backward";
    case phase::optimizer: return "optimizer";
    case phase::sync: return "sync";
    case phase::setup: return "setup";
  }
  return "unknown-phase";
}
constexpr std::string_view to_string(trigger t) noexcept {
  switch (t) {
    case trigger::acquire: return "acquire";
    case trigger::grads_ready: return "grads_ready";
    case trigger::end_of_backward: return "end_of_backward";
    case trigger::sync_prepare: return "sync_prepare";
    case trigger::sync_exchange: return "sync_exchange";
    case trigger::sync_finish: return "sync_finish";
    case trigger::sync_after: return "sync_after";
    case trigger::on_demand: return "on_demand";
  }
  return "unknown-trigger";
}
constexpr std::string_view to_string(packed_of p) noexcept {
  switch (p) {
    case packed_of::param_shard: return "param_shard";
    case packed_of::params: return "params";
    case packed_of::grad: return "grad";
    case packed_of::grad_shard: return "grad_shard";
  }
  return "unknown-packed";
}
constexpr std::string_view to_string(role r) noexcept {
  switch (r) {
    case role::none: return "none";
    case role::param_shard: return "param_shard";
    case role::params: return "params";
    case role::grad: return "grad";
    case role::grad_shard: return "grad_shard";
    case role::fragment: return "fragment";
    case role::moment: return "moment";
    case role::tokens: return "tokens";
    case role::group_tokens: return "group_tokens";
    case role::value: return "value";
    case role::gathered: return "gathered";
    case role::packed: return "packed";
    case role::state_size: return "state_size";
    case role::state: return "state";
    case role::mask: return "mask";
  }
  return "unknown-role";
}

/// True for the kinds that combine values (all_reduce, reduce_scatter).
constexpr bool reduces(comm_kind k) noexcept {
  return k == comm_kind::all_reduce || k == comm_kind::reduce_scatter;
}

/// True for the local kinds (pack, unpack, zero): no communication (see the file comment).
constexpr bool local(comm_kind k) noexcept {
  return k == comm_kind::pack || k == comm_kind::unpack || k == comm_kind::zero;
}

/// True for the kinds that move a message between two ranks (send_recv, send, recv).
constexpr bool point_to_point(comm_kind k) noexcept {
  return k == comm_kind::send_recv || k == comm_kind::send || k == comm_kind::recv;
}
/// True when an op of kind k reads an input (all but broadcast, recv and zero).
constexpr bool has_input(comm_kind k) noexcept {
  return k != comm_kind::broadcast && k != comm_kind::recv && k != comm_kind::zero;
}
/// True when an op of kind k writes an output (all but send).
constexpr bool has_output(comm_kind k) noexcept {
  return k != comm_kind::send;
}

/// nccl-tests bus factor: bytes each rank sends = factor x bytes (ring algorithms; a recv
/// sends nothing).
constexpr double bus_factor(comm_kind k, int ranks) noexcept {
  if (ranks <= 1) return 0.0;
  const double n = ranks;
  switch (k) {
    case comm_kind::all_reduce: return 2.0 * (n - 1) / n;
    case comm_kind::all_gather:
    case comm_kind::reduce_scatter: return (n - 1) / n;
    case comm_kind::broadcast:
    case comm_kind::send_recv:
    case comm_kind::send: return 1.0;
    case comm_kind::recv:
    case comm_kind::pack:
    case comm_kind::unpack:
    case comm_kind::zero: return 0.0;
  }
  return 0.0;
}

/// Bytes one rank sends to run op (bus factor x array bytes of what is carried).
inline double wire_bytes(const comm_op& op) {
  const comm_op c = carried(op);
  return bus_factor(c.kind, c.ranks) * static_cast<double>(c.bytes);
}

/// "{0, 2, 3}": the groups whose bits are set in mask.
inline std::string group_list(std::uint64_t mask) {
  std::string s = "{";
  for (int g = 0; g < 64; ++g)
    if ((mask >> g) & 1u) s += detail::concat(s.size() > 1 ? ", " : "", g);
  return s + "}";
}

/// "fragment 2", "param_shard", "moment 1 (piece on replica)", "packed params" (an index
/// that names no packed_of: "packed 7").
inline std::string describe(const operand& o) {
  std::string s(to_string(o.role));
  const bool named =
      o.role == role::packed && o.index >= 0 && o.index <= static_cast<int>(packed_of::grad_shard);
  if (named) s += detail::concat(' ', to_string(static_cast<packed_of>(o.index)));
  if (o.role == role::mask) s += detail::concat(' ', o.index);
  if (o.role == role::moment || (o.role == role::packed && !named))
    s += detail::concat(' ', o.index);
  if (o.count >= 0) s += detail::concat(" [", o.offset, ", ", o.offset + o.count, ')');
  if (o.piece) s += detail::concat(" (piece on ", to_string(*o.piece), ')');
  return s;
}

/// A human-readable line for op.
inline std::string describe(const comm_op& op) {
  std::string s = detail::concat(to_string(op.kind), " on ", to_string(op.axis), " (", op.ranks,
                                 " ranks), ", op.bytes, " B of ", to_string(op.dtype));
  if (op.reduce) s += detail::concat(", ", to_string(*op.reduce));
  if (point_to_point(op.kind))
    s += detail::concat(op.kind == comm_kind::send   ? ", to"
                        : op.kind == comm_kind::recv ? ", from"
                                                     : ", with",
                        " axis rank ", op.peer);
  if (encoded(op))
    s += detail::concat(", codec ", op.codec.name, " (", codec_slot_bytes(op), " B per rank)");
  if (op.members != 0) s += detail::concat(", among groups ", group_list(op.members));
  if (op.unit >= 0) s += detail::concat(", unit ", op.unit);
  if (op.fragment >= 0) s += detail::concat(", fragment ", op.fragment);
  s += detail::concat(", ", to_string(op.trigger), " in ", to_string(op.phase));
  if (has_input(op.kind)) s += detail::concat(", ", describe(op.in));
  if (has_output(op.kind)) s += detail::concat(" -> ", describe(op.out));
  if (op.index.role != role::none) s += detail::concat(", by ", describe(op.index));
  return s;
}

/// Throws invalid_argument naming op unless its fields are consistent: a known kind, ranks
/// >= 1, whole elements that split evenly over the ranks where the kind cuts the array, a
/// reduce op exactly on reducing kinds, a root on the axis, a peer on the axis exactly on
/// point-to-point kinds, roles for exactly the operands its kind reads and writes (broadcast
/// ignores its input), a unit for unit triggers and a fragment for sync triggers.
inline void check(const comm_op& op) {
  using detail::concat;
  FEDSHARD_EXPECTS(op.ranks >= 1, "plan: ", describe(op), ": ranks must be >= 1");
  FEDSHARD_EXPECTS(!point_to_point(op.kind) || op.ranks >= 2, "plan: ", describe(op), ": a ",
                   to_string(op.kind), " op needs a peer: ranks must be >= 2, found ", op.ranks);
  FEDSHARD_EXPECTS(is_valid(op.dtype), "plan: ", describe(op), ": invalid dtype");
  const auto esz = static_cast<std::int64_t>(size_of(op.dtype));
  FEDSHARD_EXPECTS(op.bytes >= 0 && op.bytes % esz == 0, "plan: ", describe(op),
                   ": bytes must be a whole number of ", esz, "-byte elements");
  if (op.kind == comm_kind::all_gather || op.kind == comm_kind::reduce_scatter)
    FEDSHARD_EXPECTS(op.bytes / esz % op.ranks == 0, "plan: ", describe(op), ": ", op.bytes / esz,
                     " elements do not split evenly over ", op.ranks, " ranks");
  FEDSHARD_EXPECTS(reduces(op.kind) == op.reduce.has_value(), "plan: ", describe(op),
                   reduces(op.kind) ? ": a reducing op needs a reduce op"
                                    : ": only all_reduce and reduce_scatter carry a reduce op");
  FEDSHARD_EXPECTS(op.root >= 0 && op.root < op.ranks, "plan: ", describe(op),
                   ": root must be a rank of the axis, in [0, ", op.ranks, ")");
  if (point_to_point(op.kind))
    FEDSHARD_EXPECTS(op.peer >= 0 && op.peer < op.ranks, "plan: ", describe(op),
                     ": the peer must be a rank of the axis, in [0, ", op.ranks, "), found ",
                     op.peer);
  else
    FEDSHARD_EXPECTS(op.peer == -1, "plan: ", describe(op), ": only send_recv, send and recv ",
                     "name a peer, expected -1, found ", op.peer);
  FEDSHARD_EXPECTS(
      has_output(op.kind) == (op.out.role != role::none), "plan: ", describe(op),
      has_output(op.kind) ? ": the output has no role" : ": a send op has no output, found one");
  FEDSHARD_EXPECTS(
      op.kind == comm_kind::broadcast || has_input(op.kind) == (op.in.role != role::none),
      "plan: ", describe(op),
      has_input(op.kind) ? ": the input has no role" : ": a recv op has no input, found one");
  const bool indexed = op.kind == comm_kind::pack || op.kind == comm_kind::unpack;
  FEDSHARD_EXPECTS(indexed == (op.index.role == role::mask), "plan: ", describe(op),
                   indexed ? ": a pack or unpack op needs indices (an index operand of role mask)"
                           : ": only pack and unpack ops have an index operand");
  const bool unit_trigger = op.trigger == trigger::acquire || op.trigger == trigger::grads_ready;
  FEDSHARD_EXPECTS(!unit_trigger || op.unit >= 0, "plan: ", describe(op), ": a ",
                   to_string(op.trigger), " op needs a unit");
  FEDSHARD_EXPECTS(
      op.trigger != trigger::acquire || op.phase == phase::forward || op.phase == phase::backward,
      "plan: ", describe(op), ": acquire ops run in forward or backward");
  if (encoded(op)) {
    FEDSHARD_EXPECTS(op.kind == comm_kind::all_gather ||
                         (op.kind == comm_kind::all_reduce &&
                          (op.reduce == reduce_op::sum || op.reduce == reduce_op::avg)),
                     "plan: ", describe(op),
                     ": a codec encodes all_gather and all_reduce (sum or avg) ops only");
    FEDSHARD_EXPECTS(op.dtype == dtype::f32, "plan: ", describe(op),
                     ": a codec encodes f32 values, found ", to_string(op.dtype));
  }
  for (const operand* o : {&op.in, &op.out})
    FEDSHARD_EXPECTS(o->offset >= 0 && o->count >= -1 && (o->count >= 0 || o->offset == 0),
                     "plan: ", describe(op), ": the element range of ", describe(*o),
                     " must have offset >= 0 and count >= 0 (or count -1 and offset 0, the whole "
                     "buffer)");
  if (op.members != 0) {
    FEDSHARD_EXPECTS(op.axis == axis::federation, "plan: ", describe(op),
                     ": only federation ops run among a subset of the groups (members)");
    FEDSHARD_EXPECTS(std::popcount(op.members) == op.ranks, "plan: ", describe(op), ": ",
                     std::popcount(op.members), " member groups but ranks = ", op.ranks);
    FEDSHARD_EXPECTS(!encoded(op), "plan: ", describe(op),
                     ": a codec runs on the whole axis, not among member groups");
  }
  const bool sync_trigger = op.trigger == trigger::sync_prepare ||
                            op.trigger == trigger::sync_exchange ||
                            op.trigger == trigger::sync_finish || op.trigger == trigger::sync_after;
  FEDSHARD_EXPECTS(!sync_trigger || op.fragment >= 0, "plan: ", describe(op), ": a ",
                   to_string(op.trigger), " op needs a fragment");
}

/// The moment a trigger fires: which event, in which phase, for which unit or fragment.
struct trigger_point {
  fedshard::trigger trigger = fedshard::trigger::on_demand;
  fedshard::phase phase = fedshard::phase::setup;
  int unit = -1;
  int fragment = -1;

  /// True when op runs at this point.
  bool matches(const comm_op& op) const noexcept {
    if (op.trigger != trigger || op.unit != unit || op.fragment != fragment) return false;
    return trigger != fedshard::trigger::acquire || op.phase == phase;
  }
};

/// A list of comm_ops in the order they are issued.
struct plan {
  std::vector<comm_op> ops;

  /// Bytes one rank sends on axis a over the whole plan.
  double wire_bytes_on(fedshard::axis a) const {
    double b = 0;
    for (const auto& op : ops)
      if (op.axis == a) b += wire_bytes(op);
    return b;
  }
  /// Number of ops on axis a that are calls (local ops are not).
  std::int64_t calls_on(fedshard::axis a) const {
    std::int64_t c = 0;
    for (const auto& op : ops) c += (op.axis == a && !local(op.kind)) ? 1 : 0;
    return c;
  }
  /// Appends the ops of another plan.
  plan& append(const plan& other) {
    const std::size_t n = other.ops.size();  // other may be *this
    ops.reserve(ops.size() + n);
    for (std::size_t i = 0; i < n; ++i) ops.push_back(other.ops[i]);
    return *this;
  }
  /// The ops for which keep(op) is true, in order.
  template <class Pred>
  plan select(Pred keep) const {
    plan p;
    for (const auto& op : ops)
      if (keep(op)) p.ops.push_back(op);
    return p;
  }
  /// The ops that run at trigger point t, in order.
  plan at(const trigger_point& t) const {
    return select([&](const comm_op& op) { return t.matches(op); });
  }
  /// True when some op writes (out) role r of unit u.
  bool writes(fedshard::role r, int u) const {
    for (const auto& op : ops)
      if (op.out.role == r && op.unit == u) return true;
    return false;
  }
  /// True when some op reads (in) role r of unit u.
  bool reads(fedshard::role r, int u) const {
    for (const auto& op : ops)
      if (op.in.role == r && op.unit == u && op.kind != comm_kind::broadcast) return true;
    return false;
  }
  /// Checks every op (see fedshard::check(const comm_op&)).
  void check() const {
    for (const auto& op : ops) fedshard::check(op);
  }
};

}  // namespace fedshard
