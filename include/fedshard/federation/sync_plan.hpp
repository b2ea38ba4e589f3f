#pragma once
/// The comm_ops of one federation sync of a fragment, for one rank of the mesh.

#include <cstddef>
#include <cstdint>

#include "fedshard/error.hpp"
#include "fedshard/federation/federation_policy.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/comm_op.hpp"

namespace fedshard::federation {

/// Elements a fragment buffer of `numel` parameters is padded to: a multiple of 16 * R, so
/// each of the R replicas owns an equal, 64-byte aligned piece (hierarchical sync).
inline std::size_t padded_fragment_numel(std::size_t numel, int replicas) {
  const std::size_t q = 16 * static_cast<std::size_t>(replicas);
  return (numel + q - 1) / q * q;
}

/// The ops one rank runs to average a padded fragment buffer of `numel` f32 values over the
/// federation axis (then share it with the other replicas of its group).
inline plan average_plan(const mesh_shape& shape, const mesh_coords& me, sync_mode mode,
                         std::size_t numel) {
  plan p;
  const auto bytes = static_cast<std::int64_t>(numel * sizeof(float));
  const int G = shape.groups, R = shape.replicas;
  FEDSHARD_EXPECTS(mode != sync_mode::hierarchical || numel % static_cast<std::size_t>(R) == 0,
                   "average_plan: a hierarchical sync splits the fragment over ", R,
                   " replicas, but its ", numel,
                   " elements do not divide evenly (pad it with "
                   "padded_fragment_numel)");
  if (mode == sync_mode::hierarchical) {
    p.ops.push_back({comm_kind::all_reduce, axis::federation, bytes / R, dtype::f32, -1,
                     phase::sync, G, reduce_op::avg, false});
    if (R > 1)
      p.ops.push_back({comm_kind::all_gather, axis::replica, bytes, dtype::f32, -1, phase::sync, R,
                       reduce_op::avg, false});
  } else {
    if (me.replica == 0)
      p.ops.push_back({comm_kind::all_reduce, axis::federation, bytes, dtype::f32, -1, phase::sync,
                       G, reduce_op::avg, false});
    if (R > 1)
      p.ops.push_back({comm_kind::broadcast, axis::replica, bytes, dtype::f32, -1, phase::sync, R,
                       reduce_op::avg, false});
  }
  return p;
}

/// The ops that exchange the groups' weights (tokens since the last sync): a sum over the
/// group, then an all_gather over the federation axis.
inline plan weights_plan(const mesh_shape& shape) {
  plan p;
  p.ops.push_back({comm_kind::all_reduce, axis::group, 8, dtype::f64, -1, phase::sync,
                   shape.replicas * shape.shards, reduce_op::sum, false});
  p.ops.push_back({comm_kind::all_gather, axis::federation, 8 * shape.groups, dtype::f64, -1,
                   phase::sync, shape.groups, reduce_op::sum, false});
  return p;
}

/// Everything one sync of a fragment moves for this rank: weights (if the policy uses
/// them), the parameters, and each inner-optimizer state buffer when moments are averaged.
inline plan sync_plan(const mesh_shape& shape, const mesh_coords& me, sync_mode mode,
                      std::size_t numel, bool weights, int moment_buffers) {
  plan p;
  if (weights) p.append(weights_plan(shape));
  const plan avg = average_plan(shape, me, mode, numel);
  for (int i = 0; i <= moment_buffers; ++i) p.append(avg);
  return p;
}

}  // namespace fedshard::federation
