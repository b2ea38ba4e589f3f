#pragma once
/// The ShardPolicy concept: how a group's ranks hold and move parameters every step.
///
/// A ShardPolicy P provides:
///  1. `P::name`, a std::string_view.
///  2. `P::traits`, a shard_traits saying what each rank keeps and what is re-gathered.
///  3. `P::layout_shards(shape)`: how many pieces each unit is cut into (1 when parameters are
///     replicated, else the mesh's S).
///  4. `P::check(shape)`: throws invalid_argument when the policy cannot run on that mesh.
///  5. `P::step_plan(layout, shape, precision)`: the comm_ops of one training step, in issue
///     order (forward gathers by ascending unit, then backward ops by descending unit).
/// The engine (shard/engine.hpp) executes the plan: it runs a unit's gathers when the model
/// acquires the unit and its reductions when the model reports the unit's gradients ready.

#include <concepts>
#include <cstdint>
#include <string_view>

#include "fedshard/core/dtype.hpp"
#include "fedshard/error.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/shard/flat_layout.hpp"

namespace fedshard::shard {

/// Mixed precision: parameters travel (and are computed with) in `param`, gradients are
/// reduced in `reduce`; master parameters, gradients given to the optimizer and optimizer
/// state are always f32.
struct precision {
  dtype param = dtype::f32;
  dtype reduce = dtype::f32;

  friend bool operator==(const precision&, const precision&) = default;
  /// Throws invalid_argument unless param is f32/bf16/f16 and reduce is f32/bf16.
  void check() const {
    FEDSHARD_EXPECTS(param == dtype::f32 || param == dtype::bf16 || param == dtype::f16,
                     "precision: param dtype must be f32, bf16 or f16, found ", to_string(param));
    FEDSHARD_EXPECTS(reduce == dtype::f32 || reduce == dtype::bf16,
                     "precision: reduce dtype must be f32 or bf16, found ", to_string(reduce));
  }
};

/// What a policy keeps on each rank between and during steps.
struct shard_traits {
  bool shards_params = true;          ///< master parameters are 1/S of each unit (else full)
  bool regather_for_backward = true;  ///< a unit is freed after forward and gathered again
  bool reduce_over_replicas = false;  ///< gradient shards are all-reduced over the replica axis
};

/// See the numbered requirements above.
template <class P>
concept ShardPolicy = requires(const mesh_shape& shape, const flat_layout& layout,
                               const precision& prec) {
  { P::name } -> std::convertible_to<std::string_view>;
  { P::traits } -> std::convertible_to<shard_traits>;
  { P::layout_shards(shape) } -> std::convertible_to<int>;
  P::check(shape);
  { P::step_plan(layout, shape, prec) } -> std::same_as<plan>;
};

namespace detail {

/// The step plan every sharding policy follows, driven by its traits.
inline plan sharded_step_plan(const shard_traits& t, const flat_layout& layout,
                              const mesh_shape& shape, const precision& prec) {
  plan p;
  const auto units = static_cast<int>(layout.num_units());
  const auto wire = static_cast<std::int64_t>(size_of(prec.param));
  const auto red = static_cast<std::int64_t>(size_of(prec.reduce));
  auto unit_elems = [&](int u) {
    return static_cast<std::int64_t>(layout.unit(static_cast<std::size_t>(u)).padded_numel);
  };
  if (!t.shards_params) {  // replicated parameters: one gradient all_reduce over the group
    for (int u = units - 1; u >= 0; --u)
      p.ops.push_back({comm_kind::all_reduce, axis::group, unit_elems(u) * red, prec.reduce, u,
                       phase::backward, shape.replicas * shape.shards});
    return p;
  }
  for (int u = 0; u < units; ++u)
    p.ops.push_back({comm_kind::all_gather, axis::shard, unit_elems(u) * wire, prec.param, u,
                     phase::forward, shape.shards});
  for (int u = units - 1; u >= 0; --u) {
    if (t.regather_for_backward)
      p.ops.push_back({comm_kind::all_gather, axis::shard, unit_elems(u) * wire, prec.param, u,
                       phase::backward, shape.shards});
    p.ops.push_back({comm_kind::reduce_scatter, axis::shard, unit_elems(u) * red, prec.reduce, u,
                     phase::backward, shape.shards});
    if (t.reduce_over_replicas && shape.replicas > 1)
      p.ops.push_back({comm_kind::all_reduce, axis::replica, unit_elems(u) / shape.shards * red,
                       prec.reduce, u, phase::backward, shape.replicas});
  }
  return p;
}

}  // namespace detail
}  // namespace fedshard::shard
