#pragma once
/// full_shard (FSDP): each unit is gathered over the shard axis before forward, freed after
/// use, gathered again before backward; gradients are reduce-scattered. Shards over all ranks
/// of a group, so the mesh must have R = 1 (use hybrid_shard for R > 1).

#include <string_view>

#include "fedshard/shard/shard_policy.hpp"

namespace fedshard::shard {

/// FSDP FULL_SHARD over the group's S ranks.
struct full_shard {
  static constexpr std::string_view name = "full_shard";
  static int layout_shards(const mesh_shape& s) { return s.shards; }
  static void check(const mesh_shape& s) {
    FEDSHARD_EXPECTS(s.replicas == 1,
                     "full_shard shards over all ranks of a group, so the mesh "
                     "needs replicas == 1, found ",
                     s.replicas, " (use hybrid_shard to replicate shards)");
  }
  /// Forward gathers; per unit backward: gather again, reduce_scatter.
  static plan step_plan(const flat_layout& l, const mesh_shape& s, const precision& p) {
    plan out = ops::forward_gathers(l, s, p.param);
    for (int u : ops::backward_order(l)) {
      out.ops.push_back(ops::gather(l, s, p.param, u, phase::backward));
      out.ops.push_back(ops::reduce_scatter(l, s, p.reduce, u));
    }
    return out;
  }
};

}  // namespace fedshard::shard
