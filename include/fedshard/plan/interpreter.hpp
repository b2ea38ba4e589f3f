#pragma once
/// The interpreter: runs a plan's ops on a mesh when their triggers fire, in a memory space.
///
/// fire(plan, point, bind, stream) takes the ops of `plan` that run at trigger point `point`,
/// in plan order, asks `bind(op, operand)` for the buffer of each operand's role (a
/// buffer_view, in the space's memory, in the buffer's own dtype; only the operands its kind
/// has: no input for broadcast and recv, no output for send), checks every size against
/// the op, and runs them as a chain: each op after the previous one. An op whose dtype
/// differs from its buffers' dtype runs through staging buffers of the space (cast before,
/// cast back after), queued on `stream`, which is also where the firing completes: join(t,
/// st) makes another stream wait for it, wait(t) makes the host wait.
///
/// Two ways to run a chain, chosen by the communicator (space/space_of.hpp):
///  - stream-ordered communicators (NCCL, gpu_inproc): the whole chain is queued at fire
///    time, each call made to wait for an event of the work before it and the stream made to
///    wait for the call's event; nothing waits on the host.
///  - other communicators (inproc, shaped, mpi: host memory): before a call the host waits
///    for the work queued on `stream` (the inputs and their casts), the call runs as an async
///    request, and follow-up ops start when it completed. Every rank must issue the calls of
///    a communicator in the same order: firings happen at the same points of every rank's
///    program, so their first calls are issued in the same order; follow-up calls are issued
///    in firing order (a chain with a follow-up pending holds back the follow-ups of later
///    chains), and before a firing issues its first call on an axis, every earlier chain's
///    pending calls on that axis are issued first.
///
/// Vouching (capability 12 of comm/communicator.hpp, where C has it): each collective call of
/// a firing is made with the fingerprint of the firing's collective calls on its
/// communicator (kind, dtype, bytes, ranks, reduction and root of each, in order; point-to-
/// point calls, whose two sides differ, are left out) and whether it is the firing's first
/// there; gloo's checked mode then checks the first call with the fingerprint and, once the
/// ranks agreed on it, not the others. The order rules above keep a firing's calls on one
/// communicator together: every earlier chain's calls there are issued before its first.
///
/// Every call goes through a wire_tap per axis, so traffic() counts what moved. Local ops
/// (pack, unpack, zero: plan/comm_op.hpp) are no calls: they run in chain order on the
/// firing's stream through the space's gather_index, scatter_index and fill.
///
/// Ranges and member groups: an operand with an element range (operand::offset, count) binds
/// that range of its role's buffer (then its piece, if any). A federation op among member
/// groups (comm_op::members) runs on the sub-communicator of those groups, which
/// split_members() made beforehand (collective over the axis, once; kept for later firings);
/// its calls are tapped on the federation axis.
///
/// Encoded ops (an op with a codec, plan/comm_op.hpp) run on host memory (with a
/// stream-ordered communicator the host waits for the call and decodes): the rank's codec
/// object for the op's buffer (made from the op's codec::spec when the op first runs, kept
/// for later firings: it holds the error-feedback residual) encodes the input into this
/// rank's slot of a wire buffer, the slots are all-gathered as f32 words, and when the call
/// completed every slot is decoded in rank order into the zeroed output, accumulating in
/// f32 (then divided by the ranks for avg).
///
/// Included ranks (set_included): the federation stage that decides which groups a sync
/// combines (federation/participation.hpp) gives the interpreter a mask over an axis's ranks;
/// the combining ops fired on that axis afterwards combine only the ranks it marks, on any
/// backend. An encoded op decodes only their wires; a plain all_reduce, reduce_scatter or
/// all_gather runs as an all_gather of every rank's input (the wire tap records that
/// all_gather) and, once it completed, the host reduces the included ranks' blocks in rank
/// order with the backends' own reduction (comm/detail/reduction.hpp: avg divides by the
/// included count), or, for an all_gather, keeps their blocks and zeroes the others'. With
/// every rank included the result is bit-identical to the backends' own collective. Such
/// ops run on host memory. Nobody included: a rank keeps its own input.
/// Between the gather and the reduction a screening stage (set_screen) may leave more ranks
/// out.

#include <algorithm>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <utility>
#include <vector>

#include "fedshard/codec/spec.hpp"
#include "fedshard/comm/communicator.hpp"
#include "fedshard/comm/detail/reduction.hpp"
#include "fedshard/comm/request.hpp"
#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/state_registry.hpp"
#include "fedshard/error.hpp"
#include "fedshard/kernels/cast.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/plan/start_op.hpp"
#include "fedshard/plan/traffic.hpp"
#include "fedshard/plan/wire_tap.hpp"
#include "fedshard/space/host_space.hpp"
#include "fedshard/space/memory_space.hpp"
#include "fedshard/space/space_of.hpp"

namespace fedshard {

/// A firing of the interpreter, to wait for. A default ticket is complete.
struct ticket {
  std::uint64_t id = 0;
  friend bool operator==(const ticket&, const ticket&) = default;
};

/// The inputs a masked op gathered (interpreter::set_screen): `ranks` blocks of `count`
/// elements of `type`, `stride` bytes apart, in rank order.
struct gathered_inputs {
  const std::byte* blocks = nullptr;
  std::size_t stride = 0;
  int ranks = 0;
  std::int64_t count = 0;
  dtype type = dtype::f32;
};
/// A screening stage: clears the ranks of `included` whose gathered input it rejects.
using screen_fn = std::function<void(const gathered_inputs&, std::vector<std::uint8_t>& included)>;

/// Runs plans on the communicators of a mesh over Communicator C, with buffers in memory space
/// S (C's: space/space_of.hpp); see the file comment.
template <Communicator C, space::MemorySpace S = space::space_of_t<C>>
class interpreter {
 public:
  using space_type = S;
  using stream_type = typename S::stream;

  /// Taps every axis communicator of m, with buffers in space s (m and s outlive the
  /// interpreter).
  interpreter(mesh<C>& m, S& s) : interpreter(m, space::space_ref<S>(s)) {}
  /// With a space of its own (default-constructed S).
  explicit interpreter(mesh<C>& m) : interpreter(m, space::space_ref<S>::make()) {}
  interpreter(const interpreter&) = delete;
  interpreter& operator=(const interpreter&) = delete;
  ~interpreter() {
    chains_.clear();  // their requests complete before the space and streams go
    staging_.clear();
  }

  /// Starts the ops of p that run at point t on stream st (see the file comment);
  /// bind(op, operand) returns the buffer of an operand's role. The buffers and st must stay
  /// valid until the firing completed.
  template <class Bind>
  ticket fire(const plan& p, const trigger_point& t, Bind&& bind, stream_type& st) {
    chain c;
    c.stream = &st;
    for (const comm_op& op : p.ops)
      if (t.matches(op)) c.ops.push_back(prepare(op, bind));
    return launch(std::move(c));
  }
  /// fire() on the interpreter's own stream.
  template <class Bind>
  ticket fire(const plan& p, const trigger_point& t, Bind&& bind) {
    return fire(p, t, std::forward<Bind>(bind), own_stream_);
  }

  /// Runs one op to completion on the interpreter's own stream; bind as for fire().
  template <class Bind>
  void run(const comm_op& op, Bind&& bind) {
    chain c;
    c.stream = &own_stream_;
    c.ops.push_back(prepare(op, bind));
    wait(launch(std::move(c)));
  }

  /// Makes stream st wait for the firing t, without the host waiting where the communicator
  /// is stream-ordered (otherwise the host waits for t's calls, not for its queued casts).
  void join(ticket t, stream_type& st) {
    if (t.id < first_id_) return;
    drive(t);
    if (t.id < first_id_) return;
    space_->wait(st, at(t).done);
  }

  /// Blocks the host until the firing t completed, its results in memory (rethrows what its
  /// collectives threw).
  void wait(ticket t) {
    if (t.id < first_id_) return;
    drive(t);
    if (t.id < first_id_) return;
    space_->synchronize(at(t).done);
  }

  /// True once the firing t completed.
  bool done(ticket t) const {
    if (t.id < first_id_) return true;
    const auto i = static_cast<std::size_t>(t.id - first_id_);
    return i >= chains_.size() || (chains_[i].finished() && space_->ready(chains_[i].done));
  }

  /// Issues the calls of t (and those the order rules put before them), waiting on the host
  /// for the calls of host communicators.
  void drive(ticket t) {
    while (t.id >= first_id_ && !at(t).finished()) {
      progress();
      if (t.id < first_id_ || at(t).finished()) return;
      chain& c = at(t);
      chain* blocker = &c;
      if (c.has_follow_up())
        for (auto& e : chains_) {
          if (&e == &c) break;
          if (!e.finished() && e.has_follow_up()) {
            blocker = &e;
            break;
          }
        }
      step(*blocker, /*block=*/true);
    }
  }

  /// Moves every chain on as far as it goes without blocking (see the file comment).
  void progress() {
    if constexpr (ordered) {
      while (!chains_.empty() && space_->ready(chains_.front().done)) {
        chains_.pop_front();
        ++first_id_;
      }
      return;
    }
    bool fifo_open = true;
    for (auto& c : chains_) {
      if (c.finished()) continue;
      if (!c.has_follow_up()) {
        step(c, false);
        continue;
      }
      if (!fifo_open) continue;
      step(c, false);
      if (!c.finished() && c.has_follow_up()) fifo_open = false;
    }
    while (!chains_.empty() && chains_.front().finished() && space_->ready(chains_.front().done)) {
      chains_.pop_front();
      ++first_id_;
    }
  }

  /// Blocks until every firing completed.
  void wait_all() {
    while (!chains_.empty()) {
      wait(ticket{first_id_});
      progress();
      if (!chains_.empty() && chains_.front().finished()) {  // completed: drop it
        chains_.pop_front();
        ++first_id_;
      }
    }
  }

  /// The state (error-feedback residual) of this rank's codec object of encoded op `op`,
  /// made now if the op has not run yet (checkpoints save and restore it); empty for a
  /// stateless codec. `n` is the elements the rank encodes (codec_elements(op)).
  std::span<float> codec_state(const comm_op& op) {
    FEDSHARD_EXPECTS(encoded(op), "interpreter::codec_state: ", describe(op), " has no codec");
    return coder(op).state();
  }

  /// Registers the state of the stateful codec of each of p's encoded ops (its
  /// error-feedback residual, in host memory) as the entry "codec.<plan>.op<i>" (i: the op's
  /// index in p; a family "codec.<family>.op<i>" when describe gives one), described by
  /// `describe(op)` (extent, fragment, how it starts).
  template <class Describe>
  void register_codec_states(state_registry& reg, const plan& p, const std::string& name,
                             Describe&& describe) {
    const std::string prefix = "codec.";
    reg.add_kind({.prefix = prefix, .noun = "codec residual", .strip = false});
    for (std::size_t i = 0; i < p.ops.size(); ++i) {
      if (!encoded(p.ops[i]) || !p.ops[i].codec.stateful) continue;
      state_entry e = describe(p.ops[i]);
      e.name = prefix + name + ".op" + std::to_string(i);
      if (!e.family.empty()) e.family = prefix + e.family + ".op" + std::to_string(i);
      reg.add_host_span(std::move(e), codec_state(p.ops[i]));
    }
  }

  /// Which ranks of axis a the combining ops fired from now on combine (1) and which they
  /// leave out (0), by axis rank; empty = all (the default). See the file comment. The
  /// federation stage that decides a sync's participants (federation/sync.hpp) sets it; the
  /// interpreter asks no backend.
  void set_included(axis a, std::vector<std::uint8_t> mask) {
    FEDSHARD_EXPECTS(mask.empty() || static_cast<int>(mask.size()) == mesh_->axis_size(a),
                     "interpreter::set_included: a mask of ", mesh_->axis_size(a), " ranks (the ",
                     to_string(a), " axis) or none, found ", mask.size());
    included_[index(a)] = std::move(mask);
  }

  /// Called by a masked all_reduce or reduce_scatter of axis a once every rank's input is
  /// gathered, before the included blocks are reduced: it may clear ranks of the mask (the
  /// federation's screening: federation/participation.hpp); those stay cleared for the ops
  /// fired later, until the next set_included. Empty: none.
  void set_screen(axis a, screen_fn f) { screens_[index(a)] = std::move(f); }

  /// Collective over axis a (every rank of it passes the same sets in the same order): makes
  /// the sub-communicator of each set of axis ranks (bit k: rank k of the axis) that this
  /// rank belongs to, for the ops whose `members` name it; a set made before is skipped on
  /// every rank. Only the federation axis has member ops.
  void split_members(axis a, const std::vector<std::uint64_t>& sets) {
    FEDSHARD_EXPECTS(a == axis::federation, "interpreter::split_members: only the federation ",
                     "axis has member ops, asked for ", to_string(a));
    const int me = mesh_->axis_rank(a);
    for (const std::uint64_t set : sets) {
      if (set == 0 || !split_sets_.insert(set).second) continue;
      const bool in = ((set >> me) & 1u) != 0;
      std::optional<C> made;
      try {
        made.emplace(mesh_->comm(a).split(in ? 0 : 1, me));
      } catch (const invalid_argument& e) {
        throw invalid_argument(fedshard::detail::concat(
            "fedshard: interpreter::split_members: ops among member groups ", group_list(set),
            " need a sub-communicator of the ", to_string(a),
            " axis, which its communicator cannot make: ", e.what()));
      }
      C sub = std::move(*made);
      if (!in) continue;
      auto& m = members_.emplace(set, member_comm{std::move(sub), std::nullopt}).first->second;
      m.tap.emplace(m.comm, a, log_);
    }
  }

  /// What this rank's calls moved, per axis, as the wire taps recorded it.
  wire_log& wire() noexcept { return log_; }
  const wire_log& wire() const noexcept { return log_; }
  /// The per-axis totals of wire().
  traffic_counters& traffic() noexcept { return log_.traffic(); }
  /// The algorithm op runs with on this rank's communicator of its axis (of its members):
  /// what the plan's closed forms follow, traffic_counters::of(p, times, algo) with
  /// algo = [&](const comm_op& op) { return in.algorithm_of(op); }.
  wire_algorithm algorithm_of(const comm_op& op) const {
    if (op.members == 0) return algorithm_on(*taps_[index(op.axis)], op);
    const auto m = members_.find(op.members);
    return m == members_.end() ? wire_algorithm::ring : algorithm_on(*m->second.tap, op);
  }
  /// The mesh the interpreter runs on.
  mesh<C>& topology() noexcept { return *mesh_; }
  const mesh<C>& topology() const noexcept { return *mesh_; }
  /// The memory space of the buffers it binds.
  S& space() noexcept { return *space_; }
  /// The stream fire() and run() use when given none.
  stream_type& own_stream() noexcept { return own_stream_; }

 private:
  /// True when C's calls are queued on a stream of S (the whole chain queued at fire time).
  static constexpr bool ordered = space::StreamOrdered<wire_tap<C>, S>;

  interpreter(mesh<C>& m, space::space_ref<S> sr)
      : mesh_(&m), space_(std::move(sr)), own_stream_(space_->make_stream()) {
    for (axis a : all_axes) taps_[index(a)].emplace(mesh_->comm(a), a, log_);
  }
  /// An op with its buffers bound.
  struct bound_op {
    comm_op op;
    buffer_view in;                 // the input in its own dtype (broadcast: none)
    buffer_view out;                // the output in its own dtype
    buffer_view index;              // pack and unpack: the indices (u32 bit patterns as f32)
    bool staged = false;            // a buffer's dtype differs from op.dtype: run through staging
    std::byte* stage_in = nullptr;  // the input in op.dtype (set when a staged op starts)
    std::byte* stage_out = nullptr;
    codec::erased* coder = nullptr;      // encoded ops: the rank's codec object
    std::byte* wire = nullptr;           // encoded ops: every rank's slot (ranks x slot bytes)
    std::vector<std::uint8_t> included;  // encoded and masked ops: the ranks combined
    bool masked = false;                 // a plain op combining the included ranks only
    void* masked_out = nullptr;          // where a masked op's result goes (in op.dtype)
    std::uint64_t vouch = 0;  // the fingerprint of its firing's calls on its communicator
    bool first = false;       // whether it is the firing's first call there
    request req;
  };

  struct chain {
    std::vector<bound_op> ops;
    std::size_t next = 0;           // the op running (or, once finished, ops.size())
    stream_type* stream = nullptr;  // where its casts run and it completes
    typename S::event done{};       // recorded on *stream once every op was issued
    bool finished() const { return next >= ops.size(); }
    bool has_follow_up() const { return next + 1 < ops.size(); }
  };

  static std::size_t index(axis a) { return static_cast<std::size_t>(a); }

  chain& at(ticket t) { return chains_[static_cast<std::size_t>(t.id - first_id_)]; }

  ticket launch(chain c) {
    if (c.ops.empty()) return {};
    if constexpr (comm_capabilities<C>::vouch) fingerprint(c);
    if constexpr (ordered) {
      for (bound_op& b : c.ops) start(b, *c.stream);
      c.next = c.ops.size();
      c.done = space_->record(*c.stream);
      chains_.push_back(std::move(c));
      return ticket{first_id_ + chains_.size() - 1};
    } else {
      for (const bound_op& b : c.ops)
        if (!local(b.op.kind)) {
          settle(b.op.axis);  // its first call's axis
          break;
        }
      start(c.ops.front(), *c.stream);
      chains_.push_back(std::move(c));
      const ticket t{first_id_ + chains_.size() - 1};
      progress();
      return t;
    }
  }

  /// The call op b makes on its communicator (an encoded op's all_gather of the wires, a
  /// masked op's all_gather of the inputs).
  static comm_op call_of(const bound_op& b) {
    if (b.coder != nullptr) return carried(b.op);
    return b.masked ? gathered(b.op) : b.op;
  }

  /// Sets every collective op's vouch (the FNV-1a hash of the calls of c on its
  /// communicator: the axis, or its member groups) and first (see the file comment).
  static void fingerprint(chain& c) {
    std::map<std::pair<axis, std::uint64_t>, std::uint64_t> hashes;
    const auto mix = [](std::uint64_t h, std::uint64_t v) {
      for (int i = 0; i < 8; ++i, v >>= 8) h = (h ^ (v & 0xffu)) * 0x100000001b3ull;
      return h;
    };
    for (bound_op& b : c.ops) {
      if (local(b.op.kind) || point_to_point(b.op.kind)) continue;
      const comm_op op = call_of(b);
      const auto [it, first] =
          hashes.try_emplace({op.axis, op.members}, std::uint64_t{0xcbf29ce484222325ull});
      b.first = first;
      std::uint64_t& h = it->second;
      for (const std::int64_t v :
           {static_cast<std::int64_t>(op.kind), static_cast<std::int64_t>(op.dtype), op.bytes,
            std::int64_t{op.ranks}, op.reduce ? static_cast<std::int64_t>(*op.reduce) + 1 : 0,
            std::int64_t{op.root}})
        h = mix(h, static_cast<std::uint64_t>(v));
    }
    for (bound_op& b : c.ops)
      if (!local(b.op.kind) && !point_to_point(b.op.kind))
        b.vouch = std::max<std::uint64_t>(hashes.at({b.op.axis, b.op.members}), 1);
  }

  /// Makes a call of b on c with b's vouch (where C has capability 12), cleared after it.
  template <class Call>
  request vouched(const bound_op& b, wire_tap<C>& c, Call&& call) {
    if constexpr (comm_capabilities<C>::vouch) {
      c.inner().vouch(b.vouch, b.first);
      try {
        request r = call();
        c.inner().vouch(0, true);
        return r;
      } catch (...) {
        c.inner().vouch(0, true);
        throw;
      }
    } else {
      return call();
    }
  }

  /// Issues every earlier chain's not yet started ops on axis a (blocking as needed).
  void settle(axis a) {
    for (;;) {
      chain* holder = nullptr;
      for (auto& c : chains_)
        for (std::size_t i = c.next + 1; i < c.ops.size() && !holder; ++i)
          if (c.ops[i].op.axis == a && !local(c.ops[i].op.kind)) holder = &c;
      if (!holder) return;
      chain* first = holder;
      for (auto& c : chains_) {
        if (&c == holder) break;
        if (!c.finished() && c.has_follow_up()) {
          first = &c;
          break;
        }
      }
      step(*first, true);
    }
  }

  /// Moves chain c on (host path): completes its running op (blocking if asked) and starts
  /// the next; records its completion once the last op completed.
  void step(chain& c, bool block) {
    while (!c.finished()) {
      bound_op& b = c.ops[c.next];
      if (!block && !b.req.test()) return;
      b.req.wait();
      if (b.coder != nullptr) decode(b);
      if (b.masked) combine_included(b);
      if (b.staged) cast_back(b, *c.stream);
      ++c.next;
      if (c.finished()) {
        c.done = space_->record(*c.stream);
        return;
      }
      start(c.ops[c.next], *c.stream);
      block = false;
    }
  }

  template <class Bind>
  bound_op prepare(const comm_op& op, Bind& bind) {
    check(op);
    if (local(op.kind)) return prepare_local(op, bind);
    if (op.members != 0) {
      FEDSHARD_EXPECTS(((op.members >> mesh_->axis_rank(op.axis)) & 1u) != 0,
                       "interpreter: ", describe(op), ": this rank's group (",
                       mesh_->axis_rank(op.axis), ") is not one of its members");
      FEDSHARD_EXPECTS(members_.count(op.members) != 0, "interpreter: ", describe(op),
                       ": no sub-communicator of its member groups; split_members() makes it");
    } else {
      const int ranks = mesh_->axis_size(op.axis);
      FEDSHARD_EXPECTS(op.ranks == ranks, "interpreter: ", describe(op), " was planned for ",
                       op.ranks, " ranks but the mesh's ", to_string(op.axis), " axis has ", ranks);
    }
    bound_op b;
    b.op = op;
    const bool reads = has_input(op.kind), writes = has_output(op.kind);
    if (writes) b.out = resolve(op, op.out, bind);
    if (reads) b.in = resolve(op, op.in, bind);
    const auto n =
        static_cast<std::size_t>(op.bytes / static_cast<std::int64_t>(size_of(op.dtype)));
    const auto per = n / static_cast<std::size_t>(op.ranks);
    std::size_t want_in = n, want_out = n;
    if (op.kind == comm_kind::all_gather) want_in = per;
    if (op.kind == comm_kind::reduce_scatter) want_out = per;
    if (writes) expect_size(op, "output", op.out, b.out.count, want_out);
    if (reads) expect_size(op, "input", op.in, b.in.count, want_in);
    if (point_to_point(op.kind)) check_peer(b);
    b.staged = (writes && b.out.type != op.dtype) || (reads && b.in.type != op.dtype);
    if (encoded(op)) {
      FEDSHARD_EXPECTS(S::host_accessible, "interpreter: ", describe(op),
                       ": codecs run on host memory, but the buffers are in ", S::name, " memory");
      FEDSHARD_EXPECTS(b.in.type == dtype::f32, "interpreter: ", describe(op),
                       ": a codec encodes an f32 input, found ", to_string(b.in.type), " (",
                       describe(op.in), ")");
      b.coder = &coder(op);
      b.included = included_[index(op.axis)];
      b.wire =
          staging(&codecs_.find(site_of(op))->second, static_cast<std::size_t>(carried(op).bytes));
      // An output in another dtype: decoded into f32 staging, then cast (cast_back).
      if (b.staged) b.stage_out = staging(b.out.data, b.out.count * sizeof(float));
    } else if (masks(op)) {
      FEDSHARD_EXPECTS(S::host_accessible, "interpreter: ", describe(op),
                       ": combining the included ranks runs on host memory, but the buffers are "
                       "in ",
                       S::name, " memory");
      b.masked = true;
      b.included = included_[index(op.axis)];
      // Every rank's input, and past them a reduce_scatter's whole result.
      const auto bytes = static_cast<std::size_t>(
          gathered(op).bytes + (op.kind == comm_kind::reduce_scatter ? op.bytes : 0));
      auto& buf = gathers_[site_of(op)];
      if (buf.size() < bytes) buf = space_->template allocate<std::byte>(bytes);
      b.wire = buf.data();
    }
    return b;
  }

  /// True when op combines only set_included's ranks through combine_included.
  bool masks(const comm_op& op) const {
    const auto a = index(op.axis);
    const bool combines = op.kind == comm_kind::all_reduce ||
                          op.kind == comm_kind::reduce_scatter || op.kind == comm_kind::all_gather;
    return combines && op.members == 0 && !included_[a].empty();
  }
  /// The all_gather a masked op runs as: every rank's input (op.dtype).
  static comm_op gathered(const comm_op& op) {
    comm_op g = op;
    g.kind = comm_kind::all_gather;
    if (op.kind != comm_kind::all_gather) g.bytes = op.bytes * op.ranks;
    g.reduce.reset();
    return g;
  }

  /// A local op with its buffers bound: f32 buffers, the packed side (pack: output, unpack:
  /// input) and the indices of bytes / 4 elements; a zero op's output of bytes / 4.
  template <class Bind>
  bound_op prepare_local(const comm_op& op, Bind& bind) {
    bound_op b;
    b.op = op;
    b.out = resolve(op, op.out, bind);
    const auto n = static_cast<std::size_t>(op.bytes / static_cast<std::int64_t>(sizeof(float)));
    FEDSHARD_EXPECTS(op.dtype == dtype::f32 && b.out.type == dtype::f32,
                     "interpreter: ", describe(op), ": local ops run on f32 buffers, found ",
                     to_string(b.out.type));
    if (op.kind == comm_kind::zero) {
      expect_size(op, "output", op.out, b.out.count, n);
      return b;
    }
    b.in = resolve(op, op.in, bind);
    b.index = resolve(op, op.index, bind);
    FEDSHARD_EXPECTS(b.in.type == dtype::f32 && b.index.type == dtype::f32,
                     "interpreter: ", describe(op),
                     ": expected an f32 input and indices as f32 views");
    expect_size(op, "indices", op.index, b.index.count, n);
    if (op.kind == comm_kind::pack)
      expect_size(op, "output", op.out, b.out.count, n);
    else
      expect_size(op, "input", op.in, b.in.count, n);
    return b;
  }

  /// Queues local op b on st.
  void run_local(const bound_op& b, stream_type& st) {
    const std::span<float> out(static_cast<float*>(b.out.data), b.out.count);
    if (b.op.kind == comm_kind::zero) return space_->fill(st, b.out, 0.0);
    const std::span<const float> in(static_cast<const float*>(b.in.data), b.in.count);
    const std::span<const std::uint32_t> idx(static_cast<const std::uint32_t*>(b.index.data),
                                             b.index.count);
    if (b.op.kind == comm_kind::pack)
      space_->gather_index(st, in, idx, 0, out);
    else
      space_->scatter_index(st, in, idx, 0, out);
  }

  /// A point-to-point op names another rank of its axis as its peer, and a send_recv's
  /// input and output do not overlap (the receive may land before the send has read its
  /// input).
  void check_peer(const bound_op& b) const {
    const int me = mesh_->axis_rank(b.op.axis);
    FEDSHARD_EXPECTS(b.op.peer != me, "interpreter: ", describe(b.op), ": a rank cannot ",
                     b.op.kind == comm_kind::send_recv ? "exchange with"
                     : b.op.kind == comm_kind::send    ? "send to"
                                                       : "receive from",
                     " itself (it is axis rank ", me, ")");
    if (b.op.kind != comm_kind::send_recv) return;
    FEDSHARD_EXPECTS(
        !detail::overlaps(b.in.data, b.in.size_bytes(), b.out.data, b.out.size_bytes()),
        "interpreter: ", describe(b.op), ": its input (", describe(b.op.in), ") and output (",
        describe(b.op.out), ") overlap; an exchange needs both");
  }

  template <class Bind>
  buffer_view resolve(const comm_op& op, const operand& o, Bind& bind) {
    buffer_view v = bind(op, o);
    if (o.count >= 0) {
      FEDSHARD_EXPECTS(static_cast<std::size_t>(o.offset + o.count) <= v.count,
                       "interpreter: ", describe(op), ": the range of ", describe(o),
                       " ends past its ", v.count, " elements");
      v.data =
          static_cast<std::byte*>(v.data) + static_cast<std::size_t>(o.offset) * size_of(v.type);
      v.count = static_cast<std::size_t>(o.count);
    }
    if (!o.piece) return v;
    const int n = mesh_->axis_size(*o.piece);
    const int k = mesh_->axis_rank(*o.piece);
    FEDSHARD_EXPECTS(v.count % static_cast<std::size_t>(n) == 0, "interpreter: ", describe(op),
                     ": the ", describe(o), " has ", v.count, " elements, which do not split into ",
                     n, " equal pieces");
    const std::size_t len = v.count / static_cast<std::size_t>(n);
    v.data = static_cast<std::byte*>(v.data) + len * static_cast<std::size_t>(k) * size_of(v.type);
    v.count = len;
    return v;
  }

  static void expect_size(const comm_op& op, const char* which, const operand& o, std::size_t have,
                          std::size_t want) {
    FEDSHARD_EXPECTS(have == want, "interpreter: ", describe(op), ": its ", which, " (",
                     describe(o), ") holds ", have, " elements, the op needs ", want);
  }

  /// Byte offset of `inner` inside `outer` (same dtype), or -1 when it does not lie inside.
  static std::ptrdiff_t offset_within(const buffer_view& inner, const buffer_view& outer) {
    if (inner.type != outer.type || inner.data == nullptr || outer.data == nullptr) return -1;
    const auto* i = static_cast<const std::byte*>(inner.data);
    const auto* o = static_cast<const std::byte*>(outer.data);
    if (i < o || i + inner.size_bytes() > o + outer.size_bytes()) return -1;
    return i - o;
  }

  /// A staging buffer of the space of at least `bytes` for the buffer at `key`, kept for
  /// later steps.
  std::byte* staging(const void* key, std::size_t bytes) {
    auto& buf = staging_[key];
    if (buf.size() < bytes) buf = space_->template allocate<std::byte>(bytes);
    return buf.data();
  }

  /// Points the op at staging buffers in op.dtype (an input that lies inside the output, or
  /// the other way round, keeps its place there) and casts the input (a broadcast's buffer)
  /// into them. Done when the op starts: the previous op of its chain has completed, so a
  /// staging buffer it shares is free.
  void stage(bound_op& b, stream_type& st) {
    const comm_op& op = b.op;
    const std::size_t esz = size_of(op.dtype);
    if (op.kind == comm_kind::broadcast) {
      b.stage_out = staging(b.out.data, b.out.count * esz);
      space_->cast(st, const_buffer_view(b.out), buffer_view{b.stage_out, b.out.count, op.dtype});
      return;
    }
    if (op.kind == comm_kind::recv) {  // overwritten whole: nothing to cast in
      b.stage_out = staging(b.out.data, b.out.count * esz);
      return;
    }
    if (op.kind == comm_kind::send) {
      b.stage_in = staging(b.in.data, b.in.count * esz);
      space_->cast(st, const_buffer_view(b.in), buffer_view{b.stage_in, b.in.count, op.dtype});
      return;
    }
    const std::ptrdiff_t in_at = offset_within(b.in, b.out);
    const std::ptrdiff_t out_at = in_at < 0 ? offset_within(b.out, b.in) : -1;
    if (in_at >= 0) {
      b.stage_out = staging(b.out.data, b.out.count * esz);
      b.stage_in = b.stage_out + static_cast<std::size_t>(in_at) / size_of(b.out.type) * esz;
    } else if (out_at >= 0) {
      b.stage_in = staging(b.in.data, b.in.count * esz);
      b.stage_out = b.stage_in + static_cast<std::size_t>(out_at) / size_of(b.in.type) * esz;
    } else {
      b.stage_out = staging(b.out.data, b.out.count * esz);
      b.stage_in = staging(b.in.data, b.in.count * esz);
    }
    space_->cast(st, const_buffer_view(b.in), buffer_view{b.stage_in, b.in.count, op.dtype});
  }

  /// Issues op b after the work queued on st: stream-ordered, the call waits for an event of
  /// st and st waits for the call (and casts back after it); otherwise the host waits for
  /// st first.
  void start(bound_op& b, stream_type& st) {
    const comm_op& op = b.op;
    if (local(op.kind)) return run_local(b, st);  // b.req stays complete
    wire_tap<C>& c = op.members != 0 ? *members_.at(op.members).tap : *taps_[index(op.axis)];
    if (b.coder != nullptr) {  // host memory: encode on the host once st reached the op
      space_->synchronize(st);
      if constexpr (ordered) {  // the call queued after that, the host waits for it, decodes
        c.after(space_->record(st));
        b.req = start_op(c, carried(op), encode(b), b.wire);
        space_->synchronize(c.record());
        decode(b);
        if (b.staged) cast_back(b, st);
      } else {  // decoded when the call completed (step)
        b.req = vouched(b, c, [&] { return start_op(c, carried(op), encode(b), b.wire); });
      }
      return;
    }
    const void* in = b.in.data;
    void* out = b.out.data;
    if (b.staged) {
      stage(b, st);
      in = b.stage_in;
      out = b.stage_out;
    }
    if (b.masked) {
      start_masked(b, c, st, in, out);
      return;
    }
    if constexpr (ordered) {
      c.after(space_->record(st));
      b.req = start_op(c, op, in, out);
      space_->wait(st, c.record());
      if (b.staged) cast_back(b, st);
    } else {
      space_->synchronize(st);
      b.req = vouched(b, c, [&] { return start_op(c, op, in, out); });
    }
  }

  /// Starts masked op b (see the file comment): the all_gather of every rank's input into
  /// b.wire, on the host once st reached the op; combined when it completed (step), or at
  /// once where the communicator is stream-ordered.
  void start_masked(bound_op& b, wire_tap<C>& c, stream_type& st, const void* in, void* out) {
    b.masked_out = out;
    space_->synchronize(st);
    if constexpr (ordered) {
      c.after(space_->record(st));
      b.req = start_op(c, gathered(b.op), in, b.wire);
      space_->synchronize(c.record());
      combine_included(b);
      if (b.staged) cast_back(b, st);
    } else {
      b.req = vouched(b, c, [&] { return start_op(c, gathered(b.op), in, b.wire); });
    }
  }

  /// Combines the included ranks' blocks of masked op b's gathered inputs into its output
  /// (see the file comment).
  void combine_included(bound_op& b) {
    const comm_op& op = b.op;
    const std::size_t esz = size_of(op.dtype);
    const auto n = static_cast<std::size_t>(op.bytes) / esz;  // the op's whole array
    const auto ranks = static_cast<std::size_t>(op.ranks);
    const std::size_t block = (op.kind == comm_kind::all_gather ? n / ranks : n) * esz;
    auto* out = static_cast<std::byte*>(b.masked_out);
    if (op.kind == comm_kind::all_gather) {
      for (std::size_t r = 0; r < ranks; ++r)
        if (b.included[r] != 0)
          std::memcpy(out + r * block, b.wire + r * block, block);
        else
          std::memset(out + r * block, 0, block);
      return;
    }
    const auto me = static_cast<std::size_t>(mesh_->axis_rank(op.axis));
    screen(b, block);
    std::size_t used = 0;  // the included blocks, moved to the front in rank order
    for (std::size_t r = 0; r < ranks; ++r) {
      if (b.included[r] == 0) continue;
      if (used != r) std::memmove(b.wire + used * block, b.wire + r * block, block);
      ++used;
    }
    // A reduce_scatter reduces its whole array past the blocks, then keeps this rank's part.
    std::byte* whole = op.kind == comm_kind::all_reduce ? out : b.wire + ranks * block;
    if (used == 0)  // nobody included: this rank's own input (its block is still in place)
      std::memmove(whole, b.wire + me * block, block);
    else
      fedshard::detail::reduce_blocks(op.dtype, op.reduce.value(), b.wire, block,
                                      static_cast<int>(used), whole, static_cast<std::int64_t>(n));
    if (op.kind == comm_kind::reduce_scatter)
      std::memcpy(out, whole + me * (block / ranks), block / ranks);
  }

  /// Runs the axis's screening stage on masked op b's gathered blocks (`block` bytes each):
  /// the ranks it clears leave b's mask and the axis's.
  void screen(bound_op& b, std::size_t block) {
    const screen_fn& f = screens_[index(b.op.axis)];
    if (!f) return;
    const auto before = b.included;
    f(gathered_inputs{.blocks = b.wire,
                      .stride = block,
                      .ranks = b.op.ranks,
                      .count = static_cast<std::int64_t>(block / size_of(b.op.dtype)),
                      .type = b.op.dtype},
      b.included);
    FEDSHARD_EXPECTS(b.included.size() == before.size(), "interpreter: the screening stage of ",
                     describe(b.op), " changed the mask's size from ", before.size(), " to ",
                     b.included.size());
    auto& axis_mask = included_[index(b.op.axis)];
    for (std::size_t r = 0; r < before.size(); ++r)
      if (before[r] != 0 && b.included[r] == 0 && r < axis_mask.size()) axis_mask[r] = 0;
  }

  /// Where an encoded op's codec object is kept: the op's place in the plans (its trigger,
  /// unit or fragment, axis, kind and input), so that later firings of it find the same
  /// object.
  struct site {
    fedshard::trigger trigger = fedshard::trigger::on_demand;
    fedshard::phase phase = fedshard::phase::setup;
    int unit = -1;
    int fragment = -1;
    fedshard::axis axis = fedshard::axis::world;
    comm_kind kind = comm_kind::all_reduce;
    role in_role = role::none;
    int in_index = 0;
    std::optional<fedshard::axis> in_piece{};

    friend auto operator<=>(const site&, const site&) = default;
  };
  static site site_of(const comm_op& op) {
    return {.trigger = op.trigger,
            .phase = op.phase,
            .unit = op.unit,
            .fragment = op.fragment,
            .axis = op.axis,
            .kind = op.kind,
            .in_role = op.in.role,
            .in_index = op.in.index,
            .in_piece = op.in.piece};
  }
  struct coded {
    std::unique_ptr<codec::erased> object;
    codec::spec spec;
    std::int64_t elements = 0;
  };
  /// The rank's codec object of encoded op `op` (made on first use).
  codec::erased& coder(const comm_op& op) {
    coded& c = codecs_[site_of(op)];
    const std::int64_t n = codec_elements(op);
    if (!c.object || !(c.spec == op.codec) || c.elements != n) {
      c.object = op.codec.make(static_cast<std::size_t>(n));
      c.spec = op.codec;
      c.elements = n;
    }
    return *c.object;
  }
  /// Encodes b's input into this rank's slot of b.wire (padding zeroed); returns the slot.
  std::byte* encode(bound_op& b) {
    const comm_op& op = b.op;
    const auto slot = static_cast<std::size_t>(codec_slot_bytes(op));
    const auto n = static_cast<std::size_t>(codec_elements(op));
    const std::size_t e = op.codec.encoded_bytes(n);
    std::byte* mine = b.wire + slot * static_cast<std::size_t>(mesh_->axis_rank(op.axis));
    b.coder->encode(std::span<const float>(static_cast<const float*>(b.in.data), n),
                    std::span<std::byte>(mine, e));
    std::memset(mine + e, 0, slot - e);
    return mine;
  }
  /// Decodes every rank's wire of b, in rank order, into its output (see the file comment).
  void decode(bound_op& b) {
    const comm_op& op = b.op;
    const auto slot = static_cast<std::size_t>(codec_slot_bytes(op));
    const auto n = static_cast<std::size_t>(codec_elements(op));
    const std::size_t e = op.codec.encoded_bytes(n);
    auto* out = static_cast<float*>(b.staged ? static_cast<void*>(b.stage_out) : b.out.data);
    const bool gather = op.kind == comm_kind::all_gather;
    std::fill(out, out + b.out.count, 0.0f);
    // Only the ranks included when the op was fired (set_included) are combined.
    const std::vector<std::uint8_t>& included = b.included;
    int combined = 0;
    for (int r = 0; r < op.ranks; ++r) {
      const auto rr = static_cast<std::size_t>(r);
      if (!included.empty() && included[rr] == 0) continue;
      ++combined;
      b.coder->decode_add(std::span<const std::byte>(b.wire + slot * rr, e),
                          std::span<float>(out + (gather ? n * rr : 0), n));
    }
    if (op.reduce == reduce_op::avg) {
      const auto div = static_cast<float>(std::max(combined, 1));
      for (std::size_t i = 0; i < n; ++i) out[i] = out[i] / div;
    }
  }

  /// Casts a staged op's result back into its output, on st (a send has none).
  void cast_back(bound_op& b, stream_type& st) {
    if (!has_output(b.op.kind)) return;
    space_->cast(st, const_buffer_view{b.stage_out, b.out.count, b.op.dtype}, b.out);
  }

  mesh<C>* mesh_;
  space::space_ref<S> space_;  // first: the staging buffers and streams below go back to it
  stream_type own_stream_;
  wire_log log_;
  std::optional<wire_tap<C>> taps_[5];
  std::vector<std::uint8_t> included_[5];                           // by axis: set_included's masks
  screen_fn screens_[5];                                            // by axis: set_screen's stages
  std::map<site, typename S::template buffer<std::byte>> gathers_;  // masked ops' inputs
  struct member_comm {
    C comm;
    std::optional<wire_tap<C>> tap;  // on comm, recording on the federation axis
  };
  std::map<std::uint64_t, member_comm> members_;  // split_members' sub-communicators, by set
  std::set<std::uint64_t> split_sets_;            // every set split so far (members or not)
  std::deque<chain> chains_;
  std::uint64_t first_id_ = 1;  // the id of chains_.front(); ticket 0 is always complete
  std::map<const void*, typename S::template buffer<std::byte>> staging_;
  std::map<site, coded> codecs_;  // encoded ops' codec objects, by site_of
};

}  // namespace fedshard
