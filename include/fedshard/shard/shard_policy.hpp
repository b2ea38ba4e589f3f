#pragma once
/// The ShardPolicy concept: how a group's ranks hold and move parameters every step.
///
/// A ShardPolicy P provides:
///  1. `P::name`, a std::string_view.
///  2. `P::layout_shards(shape)`: how many pieces each unit is cut into (1 when parameters are
///     replicated, else the mesh's S); each rank's master parameters are its piece.
///  3. `P::check(shape)`: throws invalid_argument when the policy cannot run on that mesh.
///  4. `P::step_plan(layout, shape, precision)`: the executable comm_ops of one training step
///     (plan/comm_op.hpp), each with its buffers by role and its trigger: the gathers run when
///     the model acquires a unit (role params, phase forward or backward), the reductions when
///     a unit's gradients are ready (role grad into grad_shard). Order: forward gathers by
///     ascending unit, then backward ops by descending unit.
///  5. Optionally, `P::settings` (run-time settings: trainer_options::shard, settings_of_t),
///     with `P::step_plan(layout, shape, precision, settings)` when the step plan depends on
///     them (with_gather_codec's codec settings; step_plan_of calls the one P has).
///  6. Optionally, `P::runtime<S>`: run-time state for memory space S that the engine holds
///     (shard::sparse's masks and packed buffers), for a policy whose steps run different
///     plans. Its members, all called by the engine (shard/engine.hpp) and nowhere else:
///     a. `R(layout, shape, shard, held, offsets, settings, plan)`: for this rank (shard
///        index `shard`), the held units (by unit; empty: all) at master offsets `offsets`,
///        and the step plan of those units;
///     b. `begin_step(kept)` -> const plan&: the plan this step fires (`kept`: every
///        gathered buffer holds what the previous step gathered into it); `active()` the
///        same plan afterwards;
///     c. `bind(op, operand, interp)` -> buffer_view: the buffers of the roles the engine
///        does not hold (role packed, role mask);
///     d. `attach(optimizer, config, space)` and `optimizer_step(optimizer, master, grad, lr,
///        stream, interp)`: the optimizer step of this rank's master;
///     e. `invalidate()`: the master was written from outside (a sync, a load);
///     f. `register_state(registry, interp)`: its state, for checkpoints.
/// The shard engine (shard/engine.hpp) runs the plan through the interpreter; what it stores
/// and frees follows from the plan (a unit gathered again in backward is freed after
/// forward), never from the policy's identity. The builders in `shard::ops` make the ops.

#include <concepts>
#include <cstdint>
#include <string_view>
#include <vector>

#include "fedshard/core/dtype.hpp"
#include "fedshard/core/member_names.hpp"
#include "fedshard/error.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/shard/flat_layout.hpp"

namespace fedshard::shard {

/// Mixed precision: parameters travel (and are computed with) in `param`, gradients are
/// reduced in `reduce`, and the federation's averages (federation::average_ops: the
/// cross-group all_reduce and the replicas' share of it) travel and combine in `sync`;
/// master parameters, gradients given to the optimizer and optimizer state are always f32.
/// A reduction in a narrow type casts each rank's f32 input to it, the backend sums every
/// element in f32 in rank order and rounds the result once to it (comm/detail/reduction.hpp),
/// and the result is widened back to f32: half the bytes of f32 on the wire, each input and
/// the result rounded once.
struct precision {
  dtype param = dtype::f32;
  dtype reduce = dtype::f32;
  dtype sync = dtype::f32;

  friend bool operator==(const precision&, const precision&) = default;
  /// Throws invalid_argument unless param, reduce and sync are f32, bf16 or f16.
  void check() const {
    FEDSHARD_EXPECTS(param == dtype::f32 || param == dtype::bf16 || param == dtype::f16,
                     "precision: param dtype must be f32, bf16 or f16, found ", to_string(param));
    FEDSHARD_EXPECTS(reduce == dtype::f32 || reduce == dtype::bf16 || reduce == dtype::f16,
                     "precision: reduce dtype must be f32, bf16 or f16, found ", to_string(reduce));
    FEDSHARD_EXPECTS(sync == dtype::f32 || sync == dtype::bf16 || sync == dtype::f16,
                     "precision: sync dtype must be f32, bf16 or f16, found ", to_string(sync));
  }
};

/// See the numbered requirements above.
template <class P>
concept ShardPolicy = requires(const mesh_shape& shape, const flat_layout& layout,
                               const precision& prec) {
  { P::name } -> std::convertible_to<std::string_view>;
  { P::layout_shards(shape) } -> std::convertible_to<int>;
  P::check(shape);
  { P::step_plan(layout, shape, prec) } -> std::same_as<plan>;
};

/// The run-time settings of a policy without any (the shard engine's default).
struct no_settings {
  friend bool operator==(const no_settings&, const no_settings&) = default;
};

/// P::settings when the policy has run-time settings (shard::sparse), else no_settings.
FEDSHARD_MEMBER_TYPE_OR(settings_of, settings, no_settings)

/// P::runtime<S> (requirement 6), or an empty type for a policy without run-time state.
template <class P, class S>
struct runtime_of {
  struct type {};
  static constexpr bool stateful = false;
};
template <class P, class S>
requires requires {
  typename P::template runtime<S>;
}
struct runtime_of<P, S> {
  using type = typename P::template runtime<S>;
  static constexpr bool stateful = true;
};

/// P's step plan with settings c (requirement 5): P::step_plan(l, s, p, c) where P declares
/// it, else P::step_plan(l, s, p).
template <ShardPolicy P>
plan step_plan_of(const flat_layout& l, const mesh_shape& s, const precision& p,
                  const settings_of_t<P>& c) {
  if constexpr (requires { P::step_plan(l, s, p, c); })
    return P::step_plan(l, s, p, c);
  else
    return P::step_plan(l, s, p);
}

/// Builders of the ops shard policies are made of.
namespace ops {

namespace detail {
inline std::int64_t bytes(std::size_t elems, dtype t) {
  return static_cast<std::int64_t>(elems * size_of(t));
}
inline std::size_t padded(const flat_layout& l, int u) {
  return l.unit(static_cast<std::size_t>(u)).padded_numel;
}
}  // namespace detail

/// The all_gather over the shard axis, in dtype `param`, that rebuilds unit u (role params)
/// from every rank's master shard when the model acquires u in phase ph.
inline comm_op gather(const flat_layout& l, const mesh_shape& s, dtype param, int u, phase ph) {
  return {.kind = comm_kind::all_gather,
          .axis = axis::shard,
          .dtype = param,
          .bytes = detail::bytes(detail::padded(l, u), param),
          .ranks = s.shards,
          .trigger = trigger::acquire,
          .phase = ph,
          .unit = u,
          .in = {.role = role::param_shard},
          .out = {.role = role::params}};
}

/// The reduce_scatter (average) over the shard axis, in dtype `reduce`, of unit u's gradient
/// into this rank's gradient shard, when u's gradients are ready.
inline comm_op reduce_scatter(const flat_layout& l, const mesh_shape& s, dtype reduce, int u) {
  return {.kind = comm_kind::reduce_scatter,
          .axis = axis::shard,
          .dtype = reduce,
          .bytes = detail::bytes(detail::padded(l, u), reduce),
          .ranks = s.shards,
          .reduce = reduce_op::avg,
          .trigger = trigger::grads_ready,
          .phase = phase::backward,
          .unit = u,
          .in = {.role = role::grad},
          .out = {.role = role::grad_shard}};
}

/// The all_reduce (average) over the replica axis, in dtype `reduce`, of unit u's gradient
/// shard, in place (after its reduce_scatter).
inline comm_op replica_average(const flat_layout& l, const mesh_shape& s, dtype reduce, int u) {
  return {.kind = comm_kind::all_reduce,
          .axis = axis::replica,
          .dtype = reduce,
          .bytes = detail::bytes(l.unit(static_cast<std::size_t>(u)).shard_numel, reduce),
          .ranks = s.replicas,
          .reduce = reduce_op::avg,
          .trigger = trigger::grads_ready,
          .phase = phase::backward,
          .unit = u,
          .in = {.role = role::grad_shard},
          .out = {.role = role::grad_shard}};
}

/// The all_reduce (average) over the group axis, in dtype `reduce`, of unit u's whole
/// gradient, in place: replicated parameters (the gradient is the gradient shard).
inline comm_op group_average(const flat_layout& l, const mesh_shape& s, dtype reduce, int u) {
  return {.kind = comm_kind::all_reduce,
          .axis = axis::group,
          .dtype = reduce,
          .bytes = detail::bytes(detail::padded(l, u), reduce),
          .ranks = s.replicas * s.shards,
          .reduce = reduce_op::avg,
          .trigger = trigger::grads_ready,
          .phase = phase::backward,
          .unit = u,
          .in = {.role = role::grad},
          .out = {.role = role::grad}};
}

/// The units in the order forward visits them (ascending).
inline std::vector<int> forward_order(const flat_layout& l) {
  std::vector<int> order(l.num_units());
  for (std::size_t u = 0; u < order.size(); ++u) order[u] = static_cast<int>(u);
  return order;
}

/// The units in the order backward visits them (descending).
inline std::vector<int> backward_order(const flat_layout& l) {
  std::vector<int> order = forward_order(l);
  return {order.rbegin(), order.rend()};
}

/// The forward gathers of every unit, in forward order.
inline plan forward_gathers(const flat_layout& l, const mesh_shape& s, dtype param) {
  plan p;
  for (int u : forward_order(l)) p.ops.push_back(gather(l, s, param, u, phase::forward));
  return p;
}

/// The f32 all_gathers over the shard axis that read each unit's full master values into a
/// caller's buffer (role value; on demand), when the layout is sharded; none otherwise
/// (each rank's master then holds the whole unit).
inline plan read_units(const flat_layout& l, const mesh_shape& s) {
  plan p;
  if (l.shards() <= 1) return p;
  for (int u : forward_order(l)) {
    comm_op op = gather(l, s, dtype::f32, u, phase::setup);
    op.trigger = trigger::on_demand;
    op.out = {.role = role::value};
    op.overlappable = false;
    p.ops.push_back(op);
  }
  return p;
}

}  // namespace ops
}  // namespace fedshard::shard
