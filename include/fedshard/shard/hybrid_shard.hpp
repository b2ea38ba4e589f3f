#pragma once
/// hybrid_shard (HSDP): full_shard over the S ranks of a replica, plus an all_reduce
/// (average) of the gradient shards over the R replicas of a group.

#include <string_view>

#include "fedshard/shard/shard_policy.hpp"

namespace fedshard::shard {

/// HSDP: FSDP inside a replica, gradient-shard all_reduce across replicas.
struct hybrid_shard {
  static constexpr std::string_view name = "hybrid_shard";
  static constexpr shard_traits traits{
      .shards_params = true, .regather_for_backward = true, .reduce_over_replicas = true};
  static int layout_shards(const mesh_shape& s) { return s.shards; }
  static void check(const mesh_shape&) {}
  static plan step_plan(const flat_layout& l, const mesh_shape& s, const precision& p) {
    return detail::sharded_step_plan(traits, l, s, p);
  }
};

}  // namespace fedshard::shard
