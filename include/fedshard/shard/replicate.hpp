#pragma once
/// replicate (DDP): every rank of a group holds all parameters; gradients are all-reduced
/// (averaged) over the group after backward.

#include <string_view>

#include "fedshard/shard/shard_policy.hpp"

namespace fedshard::shard {

/// DDP: full parameters on every rank, gradient all_reduce over the group.
struct replicate {
  static constexpr std::string_view name = "replicate";
  static int layout_shards(const mesh_shape&) { return 1; }
  static void check(const mesh_shape&) {}
  /// No gathers; per unit, in backward order, the group's average of its gradient.
  static plan step_plan(const flat_layout& l, const mesh_shape& s, const precision& p) {
    plan out;
    for (int u : ops::backward_order(l)) out.ops.push_back(ops::group_average(l, s, p.reduce, u));
    return out;
  }
};

}  // namespace fedshard::shard
