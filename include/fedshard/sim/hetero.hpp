#pragma once
/// Prices the federation sync of a heterogeneous mesh (groups of different shapes,
/// mesh/mesh.hpp) from its overlap exchanges: every rank's ops are the very ones the
/// synchronizer runs (federation::overlap_average_ops and, for token weights,
/// federation::overlap_weights_ops: what average_ops and weights_ops build when
/// sync_context::overlap is set), for a hybrid_shard layout (group g cuts units into S_g
/// shards) and one fragment.
///
/// Placement: each group is a site of its own (groups are sites: the federation ops cross
/// the WAN), its ranks packed on nodes of cluster::gpus_per_node in world order. The time
/// model:
///  - a member all-reduce among a segment's G holders spans G sites, one member per node and
///    site; the replica-0 ranks of a site all run their chains at the same time, so up to S_g
///    of them share the site's uplink (and the node's NICs, for those on one node);
///  - each rank's ops run one after the other (a chain, as the interpreter runs them): its
///    sync seconds are the sum of its ops' prices; the replica broadcast of the fragment
///    (R_g > 1) is priced on the group's replica communicator after the exchange;
///  - the sync takes the slowest rank's seconds.
/// Bytes per rank are the plans' wire bytes (bus factor x array bytes), so they equal what the
/// wire tap records for the trainer's sync on the same mesh.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/federation/overlap.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/shard/flat_layout.hpp"
#include "fedshard/sim/collective_cost.hpp"
#include "fedshard/sim/topology.hpp"

namespace fedshard::sim {

/// One sync of a heterogeneous mesh, priced (see the file comment).
struct hetero_sync_price {
  std::vector<group_shape> groups;
  std::vector<double> federation_bytes;  ///< by world rank: bytes sent on the federation axis
  std::vector<double> replica_bytes;     ///< by world rank: bytes sent on the replica axis
  std::vector<double> seconds;           ///< by world rank: its ops one after the other
  std::vector<int> ops;                  ///< by world rank: its federation ops
  int member_sets = 0;                   ///< sub-communicators the sync splits (once)
  double sync_seconds = 0;               ///< the slowest rank's

  /// The most federation bytes any rank of group g sends.
  double group_federation_bytes(int g) const {
    const auto at = fedshard::detail::group_starts(groups);
    double b = 0;
    for (int r = at[static_cast<std::size_t>(g)]; r < at[static_cast<std::size_t>(g) + 1]; ++r)
      b = std::max(b, federation_bytes[static_cast<std::size_t>(r)]);
    return b;
  }
};

/// The span of a communicator of a site's ranks with these local indices, gpn per node.
inline comm_span span_within_site(const std::vector<int>& locals, int gpn) {
  std::vector<int> per;  // members on each node
  for (int l : locals) {
    const auto node = static_cast<std::size_t>(l / gpn);
    if (per.size() <= node) per.resize(node + 1, 0);
    ++per[node];
  }
  const auto nodes =
      static_cast<int>(std::count_if(per.begin(), per.end(), [](int n) { return n > 0; }));
  return {.ranks = static_cast<int>(locals.size()),
          .nodes = std::max(nodes, 1),
          .per_node = std::max(1, *std::max_element(per.begin(), per.end())),
          .sites = 1};
}

/// Prices one sync of `units` (f32 master, the sync buffer's dtype) over a mesh of `groups`
/// on cluster c (each group a site), with the token weights' exchange when `weights`.
inline hetero_sync_price price_hetero_sync(const std::vector<unit_spec>& units,
                                           const std::vector<group_shape>& groups, const cluster& c,
                                           bool weights = false) {
  FEDSHARD_EXPECTS(groups.size() >= 2, "sim::price_hetero_sync: expected at least 2 groups, ",
                   "found ", groups.size());
  c.check();
  hetero_sync_price out;
  out.groups = groups;
  const auto at = fedshard::detail::group_starts(groups);
  const auto world = static_cast<std::size_t>(at.back());
  out.federation_bytes.assign(world, 0.0);
  out.replica_bytes.assign(world, 0.0);
  out.seconds.assign(world, 0.0);
  out.ops.assign(world, 0);
  const int gpn = std::max(1, c.gpus_per_node);
  std::vector<int> all_units;
  for (std::size_t u = 0; u < units.size(); ++u) all_units.push_back(static_cast<int>(u));
  for (int w = 0; w < at.back(); ++w) {
    const mesh_coords me = coords_of(groups, w);
    const group_shape& gs = groups[static_cast<std::size_t>(me.group)];
    const flat_layout mine(units, gs.shards);
    const auto map = federation::make_overlap_map(mine, groups, me,
                                                  [](const mesh_shape& v) { return v.shards; });
    if (w == 0)
      out.member_sets = static_cast<int>(federation::overlap_member_sets(*map, {all_units}).size());
    const std::size_t numel = mine.total_shard_numel();
    const std::size_t padded = (numel + 16 * static_cast<std::size_t>(gs.replicas) - 1) /
                               (16 * static_cast<std::size_t>(gs.replicas)) * 16 *
                               static_cast<std::size_t>(gs.replicas);
    plan p;
    if (weights) p.append(federation::overlap_weights_ops(*map, 0));
    p.append(federation::overlap_average_ops(*map, all_units, 0, padded, {.role = role::fragment},
                                             trigger::sync_exchange, trigger::sync_finish));
    const auto ww = static_cast<std::size_t>(w);
    for (const comm_op& op : p.ops) {
      comm_span span;
      link_sharing share;
      if (op.axis == axis::federation) {
        span = {.ranks = op.ranks, .nodes = op.ranks, .per_node = 1, .sites = op.ranks};
        const int leaving = op.members == map->leaders() && op.kind == comm_kind::all_gather
                                ? 1
                                : std::min(gs.shards, gs.size());
        share = {.per_node = std::min(leaving, gpn), .per_site = leaving};
        out.federation_bytes[ww] += wire_bytes(op);
        ++out.ops[ww];
      } else if (op.axis == axis::replica) {  // members r*S + s of the group, r < R
        std::vector<int> locals;
        for (int r = 0; r < gs.replicas; ++r) locals.push_back(r * gs.shards + me.shard);
        span = span_within_site(locals, gpn);
        share = {.per_node = std::min(gs.shards, gpn), .per_site = gs.shards};
        out.replica_bytes[ww] += wire_bytes(op);
      } else {  // the group's token sum over all its ranks
        std::vector<int> locals;
        for (int l = 0; l < gs.size(); ++l) locals.push_back(l);
        span = span_within_site(locals, gpn);
      }
      out.seconds[ww] +=
          price_collective(op.kind, static_cast<double>(op.bytes), span, share, c).seconds;
    }
    out.sync_seconds = std::max(out.sync_seconds, out.seconds[ww]);
  }
  return out;
}

}  // namespace fedshard::sim
