#pragma once
/// sparse<Base> (SCAPE, arXiv 2607.01678): ShardPolicy Base whose gradient reductions and
/// parameter gathers carry only the elements of a mask that every rank of the group agrees on.
///
/// The mask: for each unit, each rank takes the top k_u elements of its own shard by |first
/// moment| of its optimizer state (AdamW's exp_avg, SGD's momentum_buffer; an optimizer
/// without one is refused when the trainer is built), ties broken by the lower index. So the
/// mask is computed shard by shard on the rank that owns that optimizer state, and every shard
/// of unit u has exactly k_u masked elements. By default k_u = round(density x shard_numel)
/// (at least 1) and one top-k runs over the whole shard. A shard spans several tensors whose
/// |first moment| scales can differ by orders of magnitude (embeddings, matrices, biases), so
/// one top-k can starve whole tensors; two settings give each tensor its share (mask_slices):
///  - per_tensor: each tensor's slice of the shard (the part of the tensor inside it) gets
///    its own top round(density x slice size) elements, at least 1;
///  - dense_below N: every element of a tensor of fewer than N elements is always masked
///    (its slice's quota is the slice; e.g. biases, norm gains, a small embedding table).
/// The quotas of a shard are taken first, then the rest of its k_u by |first moment| among
/// its other elements; k_u = max(round(density x shard_numel), the largest sum of quotas of
/// any shard of u) (masked_counts), the same on every rank and at every step, so the packed
/// sizes and the closed forms below hold with it.
/// Each rank packs its bits (its master's elements back to back, 32 to a word) and the words
/// are all-gathered over the shard axis: one f32 all_gather (the words travel as 4-byte bit
/// patterns, copied, never computed with) of
///     S x ceil(N_shard / 32) words,  N_shard = sum over the held units of shard_numel,
/// so each rank sends (S - 1) x 4 x ceil(N_shard / 32) bytes per refresh, about
/// (numel / 8) x (S - 1) / S. Replicas hold the same optimizer state, so they compute the
/// same mask without exchanging it. The exchange is issued after the optimizer step that
/// refreshes the mask and waited for at the next step's first gradient reduction: it
/// overlaps that step's forward pass, and the mask is used from that step on (one step late).
///
/// Steps: the first `dense_steps` steps (settings; at least 1) are Base's dense steps; the
/// mask is computed after the last of them and after every `refresh_period` steps from then.
/// With `dense_every` N > 0, steps N - 1, 2N - 1, ... are dense too (every element's gradient
/// reduced and stepped, so every first moment moves). A step with a mask:
///  - reduce: each unit's gradient is packed at the mask's elements in element order (no
///    indices travel: every rank knows the mask), S x k_u values, reduce-scattered into the
///    rank's k_u (then averaged over the replicas, packed, where Base does that) and unpacked
///    into its gradient shard (zero elsewhere).
///  - optimizer: only masked elements are updated, by optim::masked (optim/masked.hpp): the
///    masked parameters, gradients and optimizer state are packed into a second optimizer
///    object of sum k_u elements, which takes the step (with the step count of the main
///    one) and is unpacked back; the main optimizer's step count then advances by one. An
///    element-wise optimizer (optim/optimizer.hpp, requirement 4) gives bit for bit what a
///    full step gives at the masked elements, and unmasked elements keep their parameter and
///    their whole optimizer state (no weight decay either, as in the paper). The cost is
///    O(sum k_u) per step.
///  - gather: Base's dense gathers, except where Base gathers each unit once per step, in
///    forward, and keeps it through backward (sparse_gathers_packable: shard_grad_op): there
///    the gathered buffers are kept to the next step, and after a masked update only the
///    parameters it changed (its mask) are packed from each rank's master, all-gathered, S x
///    k_u values, and written into the unit's gathered buffer, whose other elements still
///    hold the current values. A step after a dense update, or after the master was written
///    otherwise, gathers densely.
/// So with full_shard or hybrid_shard a masked step carries Base's gathers and k_u /
/// shard_numel of Base's reductions; with shard_grad_op k_u / shard_numel of both (after a
/// masked update).
///
/// Memory: per rank, Base's (master, gradients, optimizer state, and the gathered units
/// Base's plan holds: FSDP's one unit at a time with full_shard) plus what held_bytes()
/// counts: the mask in use (by unit its S x k_u indices, and this rank's k_u as offsets in
/// its shard and in its master: 4 x (S + 2) x sum k_u bytes), the packed gradients and
/// gradient shards ((S + 1) x sum k_u floats), the packed optimizer (its state and
/// parameters over sum k_u elements) and the mask words (4 x ceil(N_shard / 32) x (S + 1)
/// bytes). Where the gathers are packed (shard_grad_op, whose gathered units are all live at
/// the end of forward anyway) also the gathered buffers kept between steps, the mask of the
/// last masked update when it is another (4 x (S + 2) x sum k_u bytes) and the packed gather
/// buffers ((S + 1) x sum k_u floats).
///
/// A kept gathered buffer is valid until something else writes the master: the engine's
/// set_unit, set_tensor and upload (checkpoint loads) and the trainer after a federation
/// sync call invalidate(), and the next gathers are Base's dense ones.
///
/// Checkpoints (register_state, through the engine's): what decides the next steps is the
/// mask in use (the group's bits as exchanged; an exchange still on its way is waited for
/// when saving: the next reduction would wait for it anyway) and the step and refresh
/// counters (records "sparse.mask" and "sparse.progress"); the packed optimizer is refilled
/// from the main one at every masked step, the rest is scratch. A load of the same setup
/// restores them, so the run goes on bit for bit as the one that saved: the same masks, the
/// same dense and masked steps, the same parameters. Not saved: the gathered copies (a full
/// model per rank, the engine's buffers) and so the mask of the last masked update, of use
/// only with them: the load writes the master, so the first gathers after it are dense (the
/// same values; a packed gather would have sent k_u of each unit's elements per shard).
/// A resharding load, a load from another federation policy, a checkpoint without them
/// (a full_shard run's, or one written before they were saved) or a mask of other counts
/// than this run's (another density) start them fresh: no mask, dense steps first.
///
/// Plans: each step is of a kind (sparse_step_kind: packed gathers or not, packed
/// reductions or not; sparse_kind_of says which, for the run-time object and the simulator
/// alike), and each kind has its plan (kind_plan, sparse_kind_plan), which the engine fires
/// as it fires any policy's: Base's step plan with its gathers and reductions taken from
/// sparse_plan() (ops of role `packed`, op for op Base's with the packed sizes) as the kind
/// says, each packed op with the local ops (plan/comm_op.hpp) that pack its input and
/// unpack its output by the mask's indices (role mask), which the interpreter runs through
/// the space's gather_index / scatter_index (kernels/index.hpp). mask_plan() is the
/// exchange. The run-time object keeps its masks, packed buffers and top-k on the host, so
/// it runs on host memory only.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include "fedshard/core/buffer.hpp"
#include "fedshard/core/state_registry.hpp"
#include "fedshard/error.hpp"
#include "fedshard/optim/masked.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/plan/interpreter.hpp"
#include "fedshard/shard/flat_layout.hpp"
#include "fedshard/shard/ownership.hpp"
#include "fedshard/shard/shard_policy.hpp"
#include "fedshard/space/host_space.hpp"

namespace fedshard::shard {

/// shard::sparse's run-time settings.
struct sparse_settings {
  double density = 0.1;    ///< fraction of each unit shard's elements in the mask, in (0, 1]
  int refresh_period = 1;  ///< steps between two mask computations, >= 1
  int dense_steps = 1;     ///< Base's dense steps before the first mask, >= 1
  /// 0, or every dense_every-th step (steps dense_every - 1, 2 dense_every - 1, ...) is a dense
  /// one: every element's gradient reduced and every element stepped, >= 0
  int dense_every = 0;
  /// Each tensor's slice of a shard gets its own top round(density x slice) (at least 1).
  bool per_tensor = false;
  /// Tensors of fewer elements than this are always in the mask (0: none), >= 0. Each such
  /// tensor costs its whole size in every packed reduction and gather (masked_counts).
  std::int64_t dense_below = 0;

  friend bool operator==(const sparse_settings&, const sparse_settings&) = default;
  /// invalid_argument naming the bad setting, what was expected and what was found.
  void check() const {
    FEDSHARD_EXPECTS(density > 0.0 && density <= 1.0,
                     "shard::sparse: density must be in (0, 1], found ", density);
    FEDSHARD_EXPECTS(refresh_period >= 1, "shard::sparse: refresh_period must be >= 1, found ",
                     refresh_period);
    FEDSHARD_EXPECTS(dense_steps >= 1, "shard::sparse: dense_steps must be >= 1, found ",
                     dense_steps);
    FEDSHARD_EXPECTS(dense_every >= 0, "shard::sparse: dense_every must be >= 0, found ",
                     dense_every);
    FEDSHARD_EXPECTS(dense_below >= 0, "shard::sparse: dense_below must be >= 0, found ",
                     dense_below);
  }
};

/// The masked elements of a shard of n elements: round(density x n), at least 1 (0 when n
/// is 0), at most n.
inline std::size_t masked_per_shard(std::size_t n, double density) {
  if (n == 0) return 0;
  const auto k = static_cast<std::size_t>(std::llround(density * static_cast<double>(n)));
  return std::clamp<std::size_t>(k, 1, n);
}

/// One tensor's part of a shard: elements [begin, end) of the shard (0 = its first) and the
/// quota of them always taken by their own top-k (see the file comment).
struct mask_slice {
  std::size_t begin = 0, end = 0, quota = 0;
  friend bool operator==(const mask_slice&, const mask_slice&) = default;
};

/// The slices of shard s of unit ul with a quota under settings c (in tensor order; none
/// without per_tensor or dense_below).
inline std::vector<mask_slice> mask_slices(const unit_layout& ul, std::size_t s,
                                           const sparse_settings& c) {
  std::vector<mask_slice> out;
  if (!c.per_tensor && c.dense_below == 0) return out;
  const std::size_t n = ul.shard_numel, b0 = s * n, e0 = b0 + n;
  for (const tensor_slot& t : ul.tensors) {
    const std::size_t b = std::max(t.offset, b0), e = std::min(t.offset + t.numel, e0);
    if (b >= e) continue;
    std::size_t q = 0;
    if (static_cast<std::int64_t>(t.numel) < c.dense_below)
      q = e - b;
    else if (c.per_tensor)
      q = masked_per_shard(e - b, c.density);
    if (q > 0) out.push_back({b - b0, e - b0, q});
  }
  return out;
}

/// Per unit of l, k_u (masked_per_shard of its shard_numel) with one top-k per shard.
inline std::vector<std::size_t> masked_counts(const flat_layout& l, double density) {
  std::vector<std::size_t> k(l.num_units());
  for (std::size_t u = 0; u < k.size(); ++u)
    k[u] = masked_per_shard(l.unit(u).shard_numel, density);
  return k;
}

/// Per unit of l, k_u under settings c: masked_per_shard of its shard_numel, or the largest
/// sum of quotas (mask_slices) of any of its shards if that is more.
inline std::vector<std::size_t> masked_counts(const flat_layout& l, const sparse_settings& c) {
  std::vector<std::size_t> k = masked_counts(l, c.density);
  for (std::size_t u = 0; u < k.size(); ++u)
    for (int s = 0; s < l.shards(); ++s) {
      std::size_t q = 0;
      for (const mask_slice& m : mask_slices(l.unit(u), static_cast<std::size_t>(s), c))
        q += m.quota;
      k[u] = std::max(k[u], q);
    }
  return k;
}

/// The words of one rank's mask bits for a master of n elements: ceil(n / 32).
constexpr std::size_t mask_words(std::size_t n) noexcept {
  return (n + 31) / 32;
}

/// The op that agrees on a mask: the f32 all_gather over the shard axis of every rank's mask
/// words (role value: index 0 this rank's words, 1 everyone's), on demand, `n_shard` the
/// elements of a rank's master.
inline comm_op mask_exchange(std::size_t n_shard, const mesh_shape& s) {
  return {.kind = comm_kind::all_gather,
          .axis = axis::shard,
          .dtype = dtype::f32,
          .bytes = static_cast<std::int64_t>(mask_words(n_shard) * 4 *
                                             static_cast<std::size_t>(s.shards)),
          .ranks = s.shards,
          .trigger = trigger::on_demand,
          .phase = phase::optimizer,
          .in = {.role = role::value, .index = 0},
          .out = {.role = role::value, .index = 1}};
}

/// The packed counterpart of a Base step op on unit u, whose shards have k masked elements
/// each: a gather of params from param_shard, a reduce_scatter of grad into grad_shard, an
/// all_reduce of grad_shard over the replica axis; invalid_argument for any other op.
inline comm_op packed_op(const comm_op& op, std::size_t k) {
  comm_op p = op;
  const auto esz = static_cast<std::int64_t>(size_of(op.dtype));
  const auto per = static_cast<std::int64_t>(k);
  const bool plain = !encoded(op) && op.members == 0 && op.in.count < 0 && op.out.count < 0 &&
                     !op.in.piece && !op.out.piece;
  if (plain && op.kind == comm_kind::all_gather && op.axis == axis::shard &&
      op.trigger == trigger::acquire && op.in.role == role::param_shard &&
      op.out.role == role::params) {
    p.bytes = per * op.ranks * esz;
    p.in = packed_operand(packed_of::param_shard);
    p.out = packed_operand(packed_of::params);
    return p;
  }
  if (plain && op.kind == comm_kind::reduce_scatter && op.axis == axis::shard &&
      op.in.role == role::grad && op.out.role == role::grad_shard) {
    p.bytes = per * op.ranks * esz;
    p.in = packed_operand(packed_of::grad);
    p.out = packed_operand(packed_of::grad_shard);
    return p;
  }
  if (plain && op.kind == comm_kind::all_reduce && op.axis == axis::replica &&
      op.in.role == role::grad_shard && op.out.role == role::grad_shard) {
    p.bytes = per * esz;
    p.in = p.out = packed_operand(packed_of::grad_shard);
    return p;
  }
  throw invalid_argument(fedshard::detail::concat(
      "fedshard: shard::sparse packs the shard-axis gathers and reduce_scatters of its base "
      "policy and the replica averages of gradient shards, but the base plan has ",
      describe(op), " (wrap full_shard, shard_grad_op or hybrid_shard)"));
}

/// Base's plan with every op packed (packed_op) for the counts k (by unit).
inline plan sparsify(const plan& base, const std::vector<std::size_t>& k) {
  plan out;
  for (const comm_op& op : base.ops) {
    FEDSHARD_EXPECTS(op.unit >= 0 && static_cast<std::size_t>(op.unit) < k.size(),
                     "shard::sparse: ", describe(op), " names no unit of the layout's ", k.size());
    out.ops.push_back(packed_op(op, k[static_cast<std::size_t>(op.unit)]));
  }
  return out;
}

/// What one step of shard::sparse<Base> carries: the one definition of its step kinds, which
/// the run-time object runs and the simulator prices (see the file comment's "Steps").
struct sparse_step_kind {
  bool packed_gathers = false;     ///< the gathers carry the last masked update's elements
  bool packed_reductions = false;  ///< the reductions carry the mask's elements (masked step)
  /// The mask exchange issued after the previous step's optimizer step is on its way when
  /// this step starts (its first packed reduction waits for it).
  bool mask_exchange = false;
  friend auto operator<=>(const sparse_step_kind&, const sparse_step_kind&) = default;
};

/// True when step t (from 0) under settings c is a masked one, given whether a mask is in use:
/// every step with a mask except the dense ones of dense_every.
inline bool sparse_reduces_packed(const sparse_settings& c, std::int64_t t, bool has_mask) {
  return has_mask && !(c.dense_every > 0 && (t + 1) % c.dense_every == 0);
}

/// True when a mask is computed (and its exchange issued) after step t under settings c.
inline bool sparse_refreshes_after(const sparse_settings& c, std::int64_t t) {
  const std::int64_t after = t + 1 - c.dense_steps;
  return after >= 0 && after % c.refresh_period == 0;
}

/// The kind of step t under settings c: `has_mask` whether a mask is in use, `copies_current`
/// whether the previous step was a masked update and nothing else wrote the master since.
inline sparse_step_kind sparse_kind_of(const sparse_settings& c, std::int64_t t, bool has_mask,
                                       bool copies_current) {
  return {.packed_gathers = copies_current,
          .packed_reductions = sparse_reduces_packed(c, t, has_mask),
          .mask_exchange = t > 0 && sparse_refreshes_after(c, t - 1)};
}

/// True when the gathers of Base's step plan `base` may be packed: Base gathers each unit
/// once per step, in forward, and keeps it through backward (shard_grad_op), so every unit's
/// gathered parameters are live at the end of forward anyway and keeping them until the next
/// step adds nothing to Base's peak memory. A Base that gathers units again for backward
/// (full_shard, hybrid_shard) holds one unit at a time: its gathers stay dense.
inline bool sparse_gathers_packable(const plan& base) {
  for (const comm_op& op : base.ops)
    if (op.trigger == trigger::acquire && op.phase != phase::forward) return false;
  return true;
}

/// The kind of step t of a run from step 0 under settings c (no checkpoint load on the way),
/// `packable` sparse_gathers_packable of Base's plan: a mask is in use from step dense_steps
/// on; `written` says whether something else than the previous step's update (a federation
/// sync) wrote the master after it.
inline sparse_step_kind sparse_kind_in_run(const sparse_settings& c, std::int64_t t, bool written,
                                           bool packable) {
  const bool previous_masked = t > 0 && sparse_reduces_packed(c, t - 1, t - 1 >= c.dense_steps);
  return sparse_kind_of(c, t, t >= c.dense_steps, packable && previous_masked && !written);
}

/// The plan of a step of kind k: Base's step plan `dense` with its acquire ops from `packed`
/// (sparsify's) when k.packed_gathers and its other ops from it when k.packed_reductions,
/// op for op; the mask exchange is not in it (it is fired on demand after the optimizer step).
inline plan sparse_step_plan(const plan& dense, const plan& packed, const sparse_step_kind& k) {
  FEDSHARD_EXPECTS(dense.ops.size() == packed.ops.size(), "shard::sparse: the packed plan has ",
                   packed.ops.size(), " ops, the base plan ", dense.ops.size());
  plan out;
  out.ops.reserve(dense.ops.size());
  for (std::size_t i = 0; i < dense.ops.size(); ++i) {
    const bool gather = dense.ops[i].trigger == trigger::acquire;
    out.ops.push_back((gather ? k.packed_gathers : k.packed_reductions) ? packed.ops[i]
                                                                        : dense.ops[i]);
  }
  return out;
}

namespace detail {

/// A local op (kind: pack, unpack or zero) of `n` packed elements next to collective op c
/// (same trigger and unit), from `in` into `out` by the indices `idx`.
inline comm_op local_op(const comm_op& c, comm_kind kind, operand in, operand out, mask_of idx,
                        std::size_t n) {
  comm_op op = c;
  op.kind = kind;
  op.dtype = dtype::f32;
  op.bytes = static_cast<std::int64_t>(n * sizeof(float));
  op.reduce.reset();
  op.codec = {};
  op.in = in;
  op.out = out;
  op.index = kind == comm_kind::zero ? operand{}
                                     : operand{.role = role::mask, .index = static_cast<int>(idx)};
  return op;
}

}  // namespace detail

/// The plan a step of kind k runs, as the engine fires it: sparse_step_plan's collectives
/// (of Base's plan `dense` and its packed ops `packed`, for the counts k_u `k` of layout l
/// on a shard axis of `shards`) with their local ops (plan/comm_op.hpp). A packed gather of
/// unit u packs this rank's masked master values (pack, the gathers' mask) and writes the
/// gathered ones into u's gathered buffer (unpack); a packed reduction packs u's gradient
/// (pack, the reductions' mask), and after u's last packed reduction u's gradient shard is
/// zeroed and the reduced values written into it (zero, unpack).
inline plan sparse_kind_plan(const plan& dense, const plan& packed,
                             const std::vector<std::size_t>& k, const flat_layout& l, int shards,
                             const sparse_step_kind& kind) {
  using detail::local_op;
  const plan p = sparse_step_plan(dense, packed, kind);
  const operand shard_packed = packed_operand(packed_of::grad_shard);
  std::vector<std::size_t> last(k.size(), p.ops.size());
  for (std::size_t i = 0; i < p.ops.size(); ++i)
    if (p.ops[i].out == shard_packed) last[static_cast<std::size_t>(p.ops[i].unit)] = i;
  plan out;
  for (std::size_t i = 0; i < p.ops.size(); ++i) {
    const comm_op& c = p.ops[i];
    const auto u = static_cast<std::size_t>(c.unit);
    const std::size_t n = static_cast<std::size_t>(shards) * k[u];
    if (c.in == packed_operand(packed_of::param_shard))
      out.ops.push_back(local_op(c, comm_kind::pack, {.role = role::param_shard}, c.in,
                                 mask_of::gather_own, k[u]));
    if (c.in == packed_operand(packed_of::grad))
      out.ops.push_back(
          local_op(c, comm_kind::pack, {.role = role::grad}, c.in, mask_of::reduce_unit, n));
    out.ops.push_back(c);
    if (c.out == packed_operand(packed_of::params))
      out.ops.push_back(
          local_op(c, comm_kind::unpack, c.out, {.role = role::params}, mask_of::gather_unit, n));
    if (last[u] != i) continue;
    out.ops.push_back(local_op(c, comm_kind::zero, {}, {.role = role::grad_shard},
                               mask_of::reduce_own, l.unit(u).shard_numel));
    out.ops.push_back(local_op(c, comm_kind::unpack, shard_packed, {.role = role::grad_shard},
                               mask_of::reduce_own, k[u]));
  }
  return out;
}

/// shard::sparse's counters as its checkpoint record "sparse.progress" holds them.
struct sparse_progress {
  std::int64_t steps = 0;      ///< optimizer steps taken through shard::sparse
  std::int64_t refreshes = 0;  ///< masks computed (exchanges issued)
  std::int64_t has_mask = 0;   ///< 1: a mask is in use ("sparse.mask" holds it), else 0
};

/// One rank's state of shard::sparse in memory space S (host memory only); the shard engine
/// holds it and calls its hooks, the trainer its optimizer step. See the file comment.
template <class S>
class sparse_runtime {
  static_assert(std::is_same_v<S, space::host_space>,
                "fedshard::shard::sparse runs on host memory only (space::host_space): there are "
                "no device kernels for its mask, pack and unpack yet");
  /// A mask: by unit, its S x k_u indices into the padded unit; and this rank's k_u of each
  /// held unit, back to back (unit u's from poff_[u] on), as offsets in its shard of the
  /// unit (own) and in its master (own_master).
  struct mask_set {
    std::vector<std::vector<std::uint32_t>> unit;
    std::vector<std::uint32_t> own, own_master;
  };

 public:
  /// For the mesh shape s (this rank at shard index `shard`), the units `held` (empty: all)
  /// at master offsets `offsets`, and the dense plan `dense` of those units.
  sparse_runtime(const flat_layout& l, const mesh_shape& s, int shard,
                 const std::vector<bool>& held, const std::vector<std::size_t>& offsets,
                 const sparse_settings& cfg, plan dense)
      : cfg_((cfg.check(), cfg)),
        layout_(&l),
        shape_(s),
        shard_(shard),
        offsets_(offsets),
        k_(shard::masked_counts(l, cfg)),
        dense_(std::move(dense)),
        sparse_(sparsify(dense_, k_)),
        mask_op_(mask_exchange(offsets.back(), s)),
        packable_(sparse_gathers_packable(dense_)) {
    const std::size_t U = l.num_units();
    constexpr std::size_t most = std::numeric_limits<std::uint32_t>::max();
    FEDSHARD_EXPECTS(offsets.back() <= most, "shard::sparse: a rank's master must hold at most ",
                     most, " elements (masks are 32-bit indices), found ", offsets.back());
    for (std::size_t u = 0; u < U; ++u)
      FEDSHARD_EXPECTS(l.unit(u).padded_numel <= most, "shard::sparse: unit ", u, " ('",
                       l.unit(u).name, "') must have at most ", most,
                       " elements (masks are 32-bit indices), found ", l.unit(u).padded_numel);
    held_.assign(U, true);
    for (std::size_t u = 0; u < U; ++u)
      if (!held.empty() && !held[u]) held_[u] = false;
    poff_.assign(U + 1, 0);
    for (std::size_t u = 0; u < U; ++u) poff_[u + 1] = poff_[u] + (held_[u] ? k_[u] : 0);
    const std::size_t K = poff_.back(), SK = K * static_cast<std::size_t>(s.shards);
    if (packable_) {  // the packed gathers' buffers
      pshard_.assign(K, 0.0f);
      pgathered_.assign(SK, 0.0f);
    }
    pgrad_.assign(SK, 0.0f);
    pgrad_shard_.assign(K, 0.0f);
    words_mine_.assign(mask_words(offsets.back()), 0u);
    words_all_.assign(words_mine_.size() * static_cast<std::size_t>(s.shards), 0u);
    for (int g = 0; g < 2; ++g)  // without packable gathers, no kind packs them
      for (int r = 0; r < 2; ++r)
        plans_[g][r] =
            sparse_kind_plan(dense_, sparse_, k_, l, s.shards,
                             {.packed_gathers = g == 1 && packable_, .packed_reductions = r == 1});
    active_ = &plans_[0][0];
  }

  /// The settings it runs with.
  const sparse_settings& settings() const noexcept { return cfg_; }
  /// The plan of the steps with a mask.
  const plan& sparse_plan() const noexcept { return sparse_; }
  /// The mask exchange (one op, run after each refresh).
  plan mask_plan() const { return plan{{mask_op_}}; }
  /// The plan this step runs (chosen at begin_step).
  const plan& active() const noexcept { return *active_; }
  /// k_u of every unit.
  const std::vector<std::size_t>& masked_counts() const noexcept { return k_; }
  /// True once a mask is in use (or agreed and waited for at the next reduction).
  bool has_mask() const noexcept { return rmask_ != nullptr || pending_; }
  /// Masks computed so far (exchanges issued).
  std::int64_t refreshes() const noexcept { return refreshes_; }
  /// The elements (indices into the padded unit u, ascending, S x k_u of them) of the mask
  /// the reductions and the optimizer use; empty before the first mask.
  std::vector<std::uint32_t> mask(std::size_t u) const {
    return rmask_ ? rmask_->unit[u] : std::vector<std::uint32_t>{};
  }
  /// The mask's bits as this rank exchanged them last: its words (its master, 32 elements
  /// to a word) and everyone's, in shard order.
  std::span<const std::uint32_t> mask_words_mine() const noexcept { return words_mine_; }
  std::span<const std::uint32_t> mask_words_all() const noexcept { return words_all_; }

  /// The gathered copies no longer hold the current parameters (the master was written by
  /// something else than a masked step): the next gathers are dense.
  void invalidate() noexcept { written_ = true; }

  /// A step starts: its kind (sparse_kind_of) and the plan of that kind (the engine fires
  /// it). `kept_gathers`: every gathered buffer holds what the previous step gathered into
  /// it; then the gathers are packed when the previous step was a masked update and nothing
  /// else wrote the master since. The reductions are packed when a mask is in use (or on its
  /// way).
  const plan& begin_step(bool kept_gathers) {
    const bool current =
        packable_ && kept_gathers && last_masked_ && !written_ && gmask_ != nullptr;
    kind_ = sparse_kind_of(cfg_, steps_, has_mask(), current);
    written_ = false;  // this step's gathers write every copy afresh
    active_ = &plans_[kind_.packed_gathers ? 1 : 0][kind_.packed_reductions ? 1 : 0];
    return *active_;
  }

  /// The kind of the step begun last.
  const sparse_step_kind& kind() const noexcept { return kind_; }
  /// True when its gathers may be packed (sparse_gathers_packable of its dense plan).
  bool packs_gathers() const noexcept { return packable_; }

  /// The bytes it holds from step to step (see the file comment's "Memory"): the masks (the
  /// one in use and, where the gathers are packed, the last masked update's when it is
  /// another), the packed buffers, the packed optimizer (after attach) and the mask words.
  std::size_t held_bytes() const noexcept {
    const auto mask_bytes = [](const mask_set* m) {
      if (m == nullptr) return std::size_t{0};
      std::size_t n = m->own.size() + m->own_master.size();
      for (const auto& v : m->unit) n += v.size();
      return n * sizeof(std::uint32_t);
    };
    const std::size_t floats =
        pshard_.size() + pgathered_.size() + pgrad_.size() + pgrad_shard_.size();
    const std::size_t words = words_mine_.size() + words_all_.size() + loaded_.size();
    return mask_bytes(rmask_.get()) + (gmask_ != rmask_ ? mask_bytes(gmask_.get()) : 0) +
           floats * sizeof(float) + packed_opt_bytes_ + words * sizeof(std::uint32_t);
  }

  /// The buffer of an operand of op that the runtime holds: a packed buffer (role packed) or
  /// a mask's indices (role mask, as an f32 view of their bits); binding the mask of the
  /// reductions waits for the mask on its way, if any (through interp).
  template <class Interp>
  buffer_view bind(const comm_op& op, const operand& o, Interp& interp) {
    if (o.role != role::mask) return bind(op, o);
    const auto u = static_cast<std::size_t>(op.unit);
    const auto of = static_cast<mask_of>(o.index);
    if (of == mask_of::reduce_own || of == mask_of::reduce_unit) agree(interp);
    const mask_set* m =
        of == mask_of::gather_own || of == mask_of::gather_unit ? gmask_.get() : rmask_.get();
    FEDSHARD_EXPECTS(m != nullptr && u < k_.size() && held_[u], "shard::sparse: ", describe(op),
                     " needs a mask this rank does not have");
    const std::span<const std::uint32_t> idx =
        of == mask_of::gather_unit || of == mask_of::reduce_unit ? std::span(m->unit[u])
                                                                 : own(*m, u);
    return {const_cast<std::uint32_t*>(idx.data()), idx.size(), dtype::f32};
  }

  /// The buffer of a packed operand of op.
  buffer_view bind(const comm_op& op, const operand& o) {
    const auto u = static_cast<std::size_t>(op.unit);
    const std::size_t n = static_cast<std::size_t>(shape_.shards), k = k_[u];
    if (o.role == role::packed) switch (static_cast<packed_of>(o.index)) {
        case packed_of::param_shard: return view(std::span<float>(pshard_).subspan(poff_[u], k));
        case packed_of::params:
          return view(std::span<float>(pgathered_).subspan(poff_[u] * n, k * n));
        case packed_of::grad: return view(std::span<float>(pgrad_).subspan(poff_[u] * n, k * n));
        case packed_of::grad_shard:
          return view(std::span<float>(pgrad_shard_).subspan(poff_[u], k));
        default: break;
      }
    throw invalid_argument(fedshard::detail::concat(
        "fedshard: shard::sparse holds no buffer of role ", describe(o), " (", describe(op), ")"));
  }

  /// Makes the packed optimizer (an O of sum k_u elements with the main one's settings) and
  /// finds the main one's first moment: invalid_argument when it has none.
  template <class O>
  void attach(O& main, const typename O::config& cfg, S& space) {
    const auto st = main.state();
    std::string names;
    first_ = -1;
    for (std::size_t i = 0; i < st.size(); ++i) {
      names += fedshard::detail::concat(i ? ", '" : "'", st[i].name, "'");
      if (first_ < 0 && (st[i].name == "exp_avg" || st[i].name == "momentum_buffer"))
        first_ = static_cast<int>(i);
    }
    FEDSHARD_EXPECTS(first_ >= 0,
                     "shard::sparse: the mask is the top fraction of elements by |first moment|, "
                     "so the optimizer needs a state 'exp_avg' (adamw) or 'momentum_buffer' (sgd "
                     "with momentum > 0); found state {",
                     names, "}");
    auto masked = std::make_shared<optim::masked<O, S>>(cfg, poff_.back(), space);
    packed_opt_bytes_ = masked->bytes();
    packed_opt_ = std::move(masked);
    packed_type_ = &typeid(O);
  }

  /// The optimizer step of this rank's master (with its reduced gradients grad): main's
  /// dense step, or the masked step (see the file comment); then the mask is refreshed when
  /// due and its exchange issued through interp.
  template <class O, class Interp>
  void optimizer_step(O& main, std::span<float> master, std::span<const float> grad, float lr,
                      typename S::stream& st, Interp& interp) {
    FEDSHARD_EXPECTS(packed_type_ != nullptr && *packed_type_ == typeid(O),
                     "shard::sparse: optimizer_step needs the optimizer given to attach()");
    if (!kind_.packed_reductions) {
      main.step(master, grad, lr, st);
    } else {
      agree(interp);
      static_cast<optim::masked<O, S>*>(packed_opt_.get())
          ->step(main, master, pgrad_shard_, rmask_->own_master, lr, st);
      if (packable_) gmask_ = rmask_;  // the copies now differ at its elements only
    }
    last_masked_ = kind_.packed_reductions;
    if (sparse_refreshes_after(cfg_, steps_++)) refresh(main, interp);
  }

 private:
  std::size_t shard_numel(std::size_t u) const { return layout_->unit(u).shard_numel; }

  /// This rank's k_u masked elements of unit u in mask m, as offsets in its shard of u.
  std::span<const std::uint32_t> own(const mask_set& m, std::size_t u) const {
    return std::span<const std::uint32_t>(m.own).subspan(poff_[u], k_[u]);
  }

  /// Computes this rank's mask bits from main's first moment and issues their exchange.
  template <class O, class Interp>
  void refresh(O& main, Interp& interp) {
    agree(interp);  // the words of an exchange still on its way are not reused
    interp.space().synchronize(interp.own_stream());
    const std::span<const float> m = main.state()[static_cast<std::size_t>(first_)].data;
    std::fill(words_mine_.begin(), words_mine_.end(), 0u);
    std::vector<std::uint32_t> order;
    std::vector<char> taken;
    for (std::size_t u = 0; u < k_.size(); ++u) {
      if (!held_[u]) continue;
      const std::size_t n = shard_numel(u), at = offsets_[u];
      auto key = [&](std::uint32_t i) {
        const float v = std::abs(m[at + i]);
        return std::isnan(v) ? std::numeric_limits<float>::infinity() : v;
      };
      auto before = [&](std::uint32_t a, std::uint32_t b) {
        const float ka = key(a), kb = key(b);
        return ka > kb || (ka == kb && a < b);
      };
      // The top `want` of order, marked taken.
      auto top = [&](std::size_t want) {
        const auto kth = order.begin() + static_cast<std::ptrdiff_t>(want);
        std::nth_element(order.begin(), kth, order.end(), before);
        for (auto it = order.begin(); it != kth; ++it) taken[*it] = 1;
      };
      taken.assign(n, 0);
      std::size_t quotas = 0;
      for (const mask_slice& sl :
           mask_slices(layout_->unit(u), static_cast<std::size_t>(shard_), cfg_)) {
        order.resize(sl.end - sl.begin);
        std::iota(order.begin(), order.end(), static_cast<std::uint32_t>(sl.begin));
        top(sl.quota);
        quotas += sl.quota;
      }
      order.clear();
      for (std::uint32_t i = 0; i < n; ++i)
        if (!taken[i]) order.push_back(i);
      top(k_[u] - quotas);  // k_u >= every shard's sum of quotas (masked_counts)
      for (std::size_t i = 0; i < n; ++i)
        if (taken[i]) words_mine_[(at + i) / 32] |= std::uint32_t{1} << ((at + i) % 32);
    }
    const std::size_t W = words_mine_.size();
    auto bind = [this, W](const comm_op&, const operand& o) {
      return o.index == 0 ? buffer_view{words_mine_.data(), W, dtype::f32}
                          : buffer_view{words_all_.data(), words_all_.size(), dtype::f32};
    };
    ticket_ =
        interp.fire(mask_plan(), {.trigger = trigger::on_demand, .phase = phase::optimizer}, bind);
    pending_ = true;
    ++refreshes_;
  }

 public:
  /// Waits for the mask on its way, if any, and decodes everyone's bits into the mask the
  /// next reductions use (the next reduction does this anyway).
  template <class Interp>
  void agree(Interp& interp) {
    if (!pending_) return;
    interp.wait(ticket_);
    pending_ = false;
    std::string why;
    auto next = decode(words_all_, why);
    FEDSHARD_EXPECTS(next != nullptr, "shard::sparse: ", why,
                     " (the ranks disagree on the layout or the density)");
    rmask_ = std::move(next);
  }

  /// Registers the state that decides its next steps (see the file comment), as records
  /// that start fresh (no mask, no step taken: dense steps first) on a resharding load, a
  /// load from another policy or from a checkpoint without them: "sparse.mask", the mask in
  /// use (everyone's bits, S x W words as exchanged; an exchange on its way is waited for
  /// first), and "sparse.progress" (sparse_progress), loaded after it: it puts the loaded
  /// mask in use.
  template <class Interp>
  void register_state(state_registry& reg, Interp& interp) {
    reg.add_kind({.prefix = "sparse.", .noun = "SCAPE state"});
    const state_entry fresh{.name = {}, .survives_policy_change = false, .reshards = false};
    state_entry mask = fresh;
    mask.name = "sparse.mask";
    mask.present = [this] { return has_mask(); };
    mask.element_size = sizeof(std::uint32_t);
    mask.bytes = [this] { return words_all_.size() * sizeof(std::uint32_t); };
    mask.save = [this, &interp](std::span<std::byte> out) {
      agree(interp);  // words_all_ then holds rmask_'s bits
      if (!out.empty()) std::memcpy(out.data(), words_all_.data(), out.size());
    };
    mask.load = [this, &interp](std::span<const std::byte> in) {
      agree(interp);  // no exchange is left writing words_all_
      loaded_.assign(words_all_.size(), 0u);
      if (!in.empty()) std::memcpy(loaded_.data(), in.data(), in.size());
    };
    reg.add(std::move(mask));
    state_entry progress = fresh;
    progress.name = "sparse.progress";
    progress.present = [] { return true; };
    progress.element_size = sizeof(sparse_progress);
    progress.bytes = [] { return sizeof(sparse_progress); };
    progress.save = [this, &interp](std::span<std::byte> out) {
      agree(interp);
      const sparse_progress p{.steps = steps_, .refreshes = refreshes_, .has_mask = has_mask()};
      std::memcpy(out.data(), &p, sizeof p);
    };
    progress.check = [](std::span<const std::byte> in) { (void)progress_of(in); };
    progress.load = [this](std::span<const std::byte> in) { restore(progress_of(in)); };
    reg.add(std::move(progress));
  }

 private:
  /// Everyone's bits `all` (S x W words) as a mask (by unit, S x k_u indices); null when a
  /// shard of a unit has another count than k_u, which `why` then names.
  std::shared_ptr<const mask_set> decode(std::span<const std::uint32_t> all,
                                         std::string& why) const {
    const std::size_t W = words_mine_.size(), shards = static_cast<std::size_t>(shape_.shards);
    auto next = std::make_shared<mask_set>();
    next->unit.resize(k_.size());
    next->own.reserve(poff_.back());
    next->own_master.reserve(poff_.back());
    for (std::size_t u = 0; u < k_.size(); ++u) {
      if (!held_[u]) continue;
      auto& idx = next->unit[u];
      idx.reserve(k_[u] * shards);
      const std::size_t n = shard_numel(u), at = offsets_[u];
      for (std::size_t s = 0; s < shards; ++s) {
        const std::uint32_t* w = all.data() + s * W;
        const std::size_t before = idx.size();
        for (std::size_t i = 0; i < n; ++i)
          if ((w[(at + i) / 32] >> ((at + i) % 32)) & 1u)
            idx.push_back(static_cast<std::uint32_t>(s * n + i));
        if (idx.size() - before == k_[u]) continue;
        why = fedshard::detail::concat("shard ", s, "'s mask of unit ", u, " ('",
                                       layout_->unit(u).name, "') has ", idx.size() - before,
                                       " elements, expected ", k_[u]);
        return nullptr;
      }
      const std::size_t mine = static_cast<std::size_t>(shard_) * k_[u];
      for (std::size_t j = 0; j < k_[u]; ++j) {
        const std::size_t i = idx[mine + j] - static_cast<std::size_t>(shard_) * n;
        next->own.push_back(static_cast<std::uint32_t>(i));
        next->own_master.push_back(static_cast<std::uint32_t>(at + i));
      }
    }
    return next;
  }

  /// A "sparse.progress" record's bytes, checked: invalid_argument naming the bad field.
  static sparse_progress progress_of(std::span<const std::byte> in) {
    sparse_progress p;
    std::memcpy(&p, in.data(), sizeof p);
    FEDSHARD_EXPECTS(p.steps >= 0 && p.refreshes >= 0 && p.refreshes <= p.steps,
                     "shard::sparse: state 'sparse.progress' holds ", p.steps, " steps and ",
                     p.refreshes, " refreshes; expected 0 <= refreshes <= steps");
    FEDSHARD_EXPECTS(p.has_mask == 0 || p.has_mask == 1,
                     "shard::sparse: state 'sparse.progress' says has_mask = ", p.has_mask,
                     ", expected 0 or 1");
    return p;
  }

  /// A load's last step: the counters of p and the mask the load staged (loaded_) when p
  /// has one. A mask of other counts than this run's k_u (a run of another density, on the
  /// same mesh and layout) cannot be used: everything starts fresh then. The gathered
  /// copies are not restored (the engine's master was written: the next gathers are dense).
  void restore(const sparse_progress& p) {
    std::string why;
    auto m =
        p.has_mask == 1 && loaded_.size() == words_all_.size() ? decode(loaded_, why) : nullptr;
    const bool usable = p.has_mask == 0 || m != nullptr;
    steps_ = usable ? p.steps : 0;
    refreshes_ = usable ? p.refreshes : 0;
    rmask_ = std::move(m);
    if (rmask_ != nullptr)
      words_all_ = loaded_;
    else
      std::fill(words_all_.begin(), words_all_.end(), 0u);
    const auto mine =
        words_all_.begin() +
        static_cast<std::ptrdiff_t>(static_cast<std::size_t>(shard_) * words_mine_.size());
    std::copy_n(mine, words_mine_.size(), words_mine_.begin());
    loaded_.clear();
    pending_ = false;
    gmask_ = nullptr;  // of use only with the gathered copies
    invalidate();
  }

 private:
  sparse_settings cfg_;
  const flat_layout* layout_;
  mesh_shape shape_;
  int shard_ = 0;
  std::vector<std::size_t> offsets_;
  std::vector<std::size_t> k_;
  std::vector<bool> held_;
  std::vector<std::size_t> poff_;  // by unit: its k_u's offset among the packed shards
  plan dense_, sparse_;
  plan plans_[2][2];  // by packed gathers, packed reductions: the step plans (executable)
  const plan* active_ = nullptr;
  comm_op mask_op_;
  bool packable_ = false;     // sparse_gathers_packable(dense_)
  bool last_masked_ = false;  // the last optimizer step was a masked one
  bool written_ = false;      // something else wrote the master since the last step began
  sparse_step_kind kind_;
  bool pending_ = false;
  ticket ticket_{};
  std::int64_t steps_ = 0;
  std::int64_t refreshes_ = 0;
  std::shared_ptr<const mask_set> rmask_;  // the reductions' and the optimizer's mask
  std::shared_ptr<const mask_set> gmask_;  // the last masked update's mask: the gathers'
  std::vector<float> pshard_, pgathered_, pgrad_, pgrad_shard_;
  std::vector<std::uint32_t> words_mine_, words_all_;
  std::vector<std::uint32_t> loaded_;  // a load's "sparse.mask", until "sparse.progress"
  int first_ = -1;
  std::shared_ptr<void> packed_opt_;
  std::size_t packed_opt_bytes_ = 0;
  const std::type_info* packed_type_ = nullptr;
};

/// SCAPE's sparse sharded data parallelism around ShardPolicy Base (full_shard,
/// shard_grad_op or hybrid_shard); settings: sparse_settings (trainer_options::shard).
template <ShardPolicy Base>
struct sparse {
  using base_policy = Base;
  using settings = sparse_settings;
  template <class S>
  using runtime = sparse_runtime<S>;
  static constexpr std::string_view name = Base::name;
  static int layout_shards(const mesh_shape& s) { return Base::layout_shards(s); }
  static void check(const mesh_shape& s) { Base::check(s); }
  /// The dense steps' plan: Base's.
  static plan step_plan(const flat_layout& l, const mesh_shape& s, const precision& p) {
    return Base::step_plan(l, s, p);
  }
  /// The plan of a step with a mask of settings c (every unit held).
  static plan sparse_plan(const flat_layout& l, const mesh_shape& s, const precision& p,
                          const settings& c) {
    c.check();
    return sparsify(Base::step_plan(l, s, p), shard::masked_counts(l, c));
  }
  /// The plan of a step of kind k under settings c (every unit held), local ops included:
  /// what the engine fires (sparse_kind_plan).
  static plan kind_plan(const flat_layout& l, const mesh_shape& s, const precision& p,
                        const settings& c, const sparse_step_kind& k) {
    return sparse_kind_plan(step_plan(l, s, p), sparse_plan(l, s, p, c), shard::masked_counts(l, c),
                            l, s.shards, k);
  }
};

}  // namespace fedshard::shard
