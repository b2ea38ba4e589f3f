#pragma once
/// replicate (DDP): every rank of a group holds all parameters; gradients are all-reduced
/// (averaged) over the group after backward.

#include <string_view>

#include "fedshard/shard/shard_policy.hpp"

namespace fedshard::shard {

/// DDP: full parameters on every rank, gradient all_reduce over the group.
struct replicate {
  static constexpr std::string_view name = "replicate";
  static constexpr shard_traits traits{
      .shards_params = false, .regather_for_backward = false, .reduce_over_replicas = false};
  static int layout_shards(const mesh_shape&) { return 1; }
  static void check(const mesh_shape&) {}
  static plan step_plan(const flat_layout& l, const mesh_shape& s, const precision& p) {
    return detail::sharded_step_plan(traits, l, s, p);
  }
};

}  // namespace fedshard::shard
