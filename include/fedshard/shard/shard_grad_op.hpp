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
  static constexpr shard_traits traits{
      .shards_params = true, .regather_for_backward = false, .reduce_over_replicas = true};
  static int layout_shards(const mesh_shape& s) { return s.shards; }
  static void check(const mesh_shape&) {}
  static plan step_plan(const flat_layout& l, const mesh_shape& s, const precision& p) {
    return detail::sharded_step_plan(traits, l, s, p);
  }
};

}  // namespace fedshard::shard
