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
  static constexpr shard_traits traits{
      .shards_params = true, .regather_for_backward = true, .reduce_over_replicas = false};
  static int layout_shards(const mesh_shape& s) { return s.shards; }
  static void check(const mesh_shape& s) {
    FEDSHARD_EXPECTS(s.replicas == 1,
                     "full_shard shards over all ranks of a group, so the mesh "
                     "needs replicas == 1, found ",
                     s.replicas, " (use hybrid_shard to replicate shards)");
  }
  static plan step_plan(const flat_layout& l, const mesh_shape& s, const precision& p) {
    return detail::sharded_step_plan(traits, l, s, p);
  }
};

}  // namespace fedshard::shard
