#pragma once
/// shard_grad_op (ZeRO-2): parameters gathered over the shard axis once per step and kept
/// through backward; gradients reduce-scattered; master parameters and optimizer state
/// sharded. With R > 1 the gradient shards are also averaged over the replica axis.

#include <string_view>

#include "fedshard/shard/shard_policy.hpp"

namespace fedshard::shard {

/// ZeRO-2: one gather per step, gradient reduce_scatter, sharded optimizer state.
struct shard_grad_op {
  static constexpr std::string_view name = "shard_grad_op";
  static int layout_shards(const mesh_shape& s) { return s.shards; }
  static void check(const mesh_shape&) {}
  /// Forward gathers only (kept through backward); per unit: reduce_scatter, then the
  /// replicas' average when R > 1.
  static plan step_plan(const flat_layout& l, const mesh_shape& s, const precision& p) {
    plan out = ops::forward_gathers(l, s, p.param);
    for (int u : ops::backward_order(l)) {
      out.ops.push_back(ops::reduce_scatter(l, s, p.reduce, u));
      if (s.replicas > 1) out.ops.push_back(ops::replica_average(l, s, p.reduce, u));
    }
    return out;
  }
};

}  // namespace fedshard::shard
