#pragma once
/// hybrid_shard (HSDP): full_shard over the S ranks of a replica, plus an all_reduce
/// (average) of the gradient shards over the R replicas of a group.

#include <string_view>

#include "fedshard/shard/shard_policy.hpp"

namespace fedshard::shard {

/// HSDP: FSDP inside a replica, gradient-shard all_reduce across replicas.
struct hybrid_shard {
  static constexpr std::string_view name = "hybrid_shard";
  static int layout_shards(const mesh_shape& s) { return s.shards; }
  static void check(const mesh_shape&) {}
  /// full_shard's plan inside each replica; each reduce_scatter is followed by the
  /// replicas' average when R > 1.
  static plan step_plan(const flat_layout& l, const mesh_shape& s, const precision& p) {
    plan out = ops::forward_gathers(l, s, p.param);
    for (int u : ops::backward_order(l)) {
      out.ops.push_back(ops::gather(l, s, p.param, u, phase::backward));
      out.ops.push_back(ops::reduce_scatter(l, s, p.reduce, u));
      if (s.replicas > 1) out.ops.push_back(ops::replica_average(l, s, p.reduce, u));
    }
    return out;
  }
};

}  // namespace fedshard::shard
