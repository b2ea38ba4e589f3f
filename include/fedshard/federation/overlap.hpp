#pragma once
/// The federation sync of a heterogeneous mesh (mesh/mesh.hpp: groups of different shapes):
/// which element ranges each rank exchanges, and with which ranks of the other groups.
///
/// Ranges: group g cuts unit u (numel_u elements) into S_g shards of n_g(u) elements each
/// (its shard policy's layout, padded per shard count: shard/flat_layout.hpp), so one element
/// lies in different shards, at different offsets, in different groups. In model-element
/// space (the unit's real elements [0, numel_u), never its padding) every group's shard
/// boundaries together cut the unit into segments; each segment has exactly one holder per
/// group (shard floor(e / n_h(u)) of group h), which keeps it at a known offset of its packed
/// fragment buffer. Segments with the same holders that lie back to back in every holder's
/// buffer (e.g. shard s of consecutive units when the groups cut alike) are merged.
///
/// Who talks: replica 0 of each group. The G holders of a segment all-reduce it (avg) among
/// themselves, on the sub-communicator of their federation axis ranks (comm_op::members, a
/// bit per federation axis rank: sum_{h<g} S_h + s for replica 0), which
/// interpreter::split_members makes once per holder set, at the first sync, and caches; the
/// reduction runs in group order, so the result is bit-identical to averaging the groups'
/// full models in group order. Then replica 0 broadcasts the whole fragment to its group's
/// other replicas over the replica axis (as sync_mode::reference does), whatever the policy's
/// sync mode. No rank ever holds more than its own shard.
///
/// Price: a replica-0 rank of group g puts 2 (G - 1) / G x 4 bytes x (the real elements of
/// its shard) on the federation axis (ring all-reduce, summed over its segments); other
/// replicas none, they receive the fragment over the replica axis. On a uniform mesh the
/// hierarchical mode spreads the same bytes over R replicas; a heterogeneous mesh puts them
/// all on replica 0 (R_g times the per-rank federation bytes of a hierarchical sync).
///
/// Token weights (weighted_average): the group's tokens are summed over the group axis, the
/// groups' leaders (replica 0, shard 0) all-gather them among themselves, and each leader
/// broadcasts the G counts over its group axis.
///
/// Limits: at most 64 shards over all groups (member sets are 64-bit masks); every group's
/// shard policy must cut units into its S_g shards (a policy that replicates units over
/// S_g > 1 shards is refused).

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/federation/federation_policy.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/shard/flat_layout.hpp"

namespace fedshard::federation {

/// How every group of a heterogeneous mesh cuts the model, and where this rank sits.
struct overlap_map {
  std::vector<group_shape> groups;                    ///< R_g x S_g, by group
  std::vector<std::vector<std::size_t>> shard_numel;  ///< n_g(u): [group][unit]
  std::vector<std::size_t> unit_numel;                ///< numel_u (real elements), by unit
  mesh_coords coords{};                               ///< this rank

  int num_groups() const noexcept { return static_cast<int>(groups.size()); }
  /// The federation axis rank of replica 0, shard s of group g: sum_{h<g} S_h + s.
  int federation_rank(int g, int s) const {
    int k = 0;
    for (int h = 0; h < g; ++h) k += groups[static_cast<std::size_t>(h)].shards;
    return k + s;
  }
  /// The member set of the groups' leaders (replica 0, shard 0).
  std::uint64_t leaders() const {
    std::uint64_t m = 0;
    for (int g = 0; g < num_groups(); ++g) m |= std::uint64_t{1} << federation_rank(g, 0);
    return m;
  }
};

/// One segment (or run of merged segments) of a fragment: its holder shard and buffer offset
/// in each group, its length, and its holders' member set.
struct overlap_segment {
  std::vector<int> holder;           ///< shard of group g holding it
  std::vector<std::int64_t> offset;  ///< where group g's holder keeps it in its fragment buffer
  std::int64_t count = 0;            ///< elements
  std::uint64_t members = 0;         ///< bit federation_rank(g, holder[g]) for every g
};

/// The overlap map of mesh m for a rank whose layout is `mine` under shard policy P, or null
/// on a uniform mesh (every group cuts the model alike).
template <class P, class Mesh>
std::shared_ptr<const overlap_map> overlap_of(const Mesh& m, const flat_layout& mine);

/// The map of a mesh of `groups` for the rank at `coords`, whose layout is `mine`;
/// `layout_shards(view)` is the shard policy's layout_shards of a group's view {G, R_g, S_g}.
/// invalid_argument unless every group's layout has S_g shards and all shards number <= 64.
template <class LayoutShards>
std::shared_ptr<const overlap_map> make_overlap_map(const flat_layout& mine,
                                                    const std::vector<group_shape>& groups,
                                                    mesh_coords coords,
                                                    LayoutShards&& layout_shards) {
  auto m = std::make_shared<overlap_map>();
  m->groups = groups;
  m->coords = coords;
  const auto G = static_cast<int>(groups.size());
  int total_shards = 0;
  for (const auto& g : groups) total_shards += g.shards;
  FEDSHARD_EXPECTS(total_shards <= 64, "heterogeneous mesh: the federation sync supports at most ",
                   "64 shards over all groups, found ", total_shards, " (group shapes ",
                   to_string(groups), ")");
  const std::vector<unit_spec> specs = unit_specs(mine);
  for (const auto& u : mine.units()) m->unit_numel.push_back(u.numel);
  for (int g = 0; g < G; ++g) {
    const group_shape& gs = groups[static_cast<std::size_t>(g)];
    const int L = layout_shards(mesh_shape{G, gs.replicas, gs.shards});
    FEDSHARD_EXPECTS(L == gs.shards, "heterogeneous mesh: the federation sync maps each group's ",
                     "shards, so group g's layout must have S_g shards; group ", g, " (",
                     gs.replicas, 'x', gs.shards, ") expected ", gs.shards,
                     " layout shards, found ", L,
                     " (a shard policy that replicates units runs on groups with S = 1 only)");
    const flat_layout theirs(specs, L);
    std::vector<std::size_t> n;
    for (const auto& u : theirs.units()) n.push_back(u.shard_numel);
    m->shard_numel.push_back(std::move(n));
  }
  return m;
}

/// The segments of the fragment packing `units` (in that order), in an order every rank
/// computes alike; merged where the holders and their buffers allow.
inline std::vector<overlap_segment> overlap_segments(const overlap_map& m,
                                                     const std::vector<int>& units) {
  const int G = m.num_groups();
  const auto GG = static_cast<std::size_t>(G);
  std::vector<overlap_segment> out;
  std::map<std::uint64_t, std::size_t> last;  // the latest segment of each member set
  std::vector<std::int64_t> at(GG, 0);        // each group's offset of the unit in its buffer
  for (int u : units) {
    const auto uu = static_cast<std::size_t>(u);
    const std::size_t numel = m.unit_numel.at(uu);
    std::vector<std::size_t> cuts{0, numel};
    for (int g = 0; g < G; ++g) {
      const std::size_t n = m.shard_numel[static_cast<std::size_t>(g)].at(uu);
      for (std::size_t e = n; e < numel; e += n) cuts.push_back(e);
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    for (std::size_t i = 0; i + 1 < cuts.size(); ++i) {
      overlap_segment seg;
      seg.count = static_cast<std::int64_t>(cuts[i + 1] - cuts[i]);
      for (int g = 0; g < G; ++g) {
        const std::size_t n = m.shard_numel[static_cast<std::size_t>(g)][uu];
        const auto s = static_cast<int>(cuts[i] / n);
        seg.holder.push_back(s);
        seg.offset.push_back(at[static_cast<std::size_t>(g)] +
                             static_cast<std::int64_t>(cuts[i] - static_cast<std::size_t>(s) * n));
        seg.members |= std::uint64_t{1} << m.federation_rank(g, s);
      }
      if (auto it = last.find(seg.members); it != last.end()) {
        overlap_segment& prev = out[it->second];
        bool adjacent = true;
        for (std::size_t g = 0; g < GG && adjacent; ++g)
          adjacent = prev.offset[g] + prev.count == seg.offset[g];
        if (adjacent) {
          prev.count += seg.count;
          continue;
        }
      }
      last[seg.members] = out.size();
      out.push_back(std::move(seg));
    }
    for (int g = 0; g < G; ++g)
      at[static_cast<std::size_t>(g)] +=
          static_cast<std::int64_t>(m.shard_numel[static_cast<std::size_t>(g)][uu]);
  }
  return out;
}

/// Every member set the sync of these fragments (each a list of units) uses, the leaders'
/// first, in an order every rank computes alike: what interpreter::split_members takes.
inline std::vector<std::uint64_t> overlap_member_sets(const overlap_map& m,
                                                      const std::vector<std::vector<int>>& frags) {
  std::vector<std::uint64_t> sets{m.leaders()};
  for (const auto& units : frags)
    for (const auto& seg : overlap_segments(m, units))
      if (std::find(sets.begin(), sets.end(), seg.members) == sets.end())
        sets.push_back(seg.members);
  return sets;
}

/// The ops that average `what` (ctx.numel f32 elements packing `units`) over the groups of a
/// heterogeneous mesh for this rank (see the file comment): on replica 0, one avg all_reduce
/// among the holders of each segment its shard holds, at `start`; then, with R_g > 1, the
/// fragment's broadcast from replica 0 over the replica axis at `finish`.
inline plan overlap_average_ops(const overlap_map& m, const std::vector<int>& units, int fragment,
                                std::size_t numel, operand what, trigger start, trigger finish) {
  plan p;
  const mesh_coords& c = m.coords;
  const int G = m.num_groups();
  const group_shape& mine = m.groups.at(static_cast<std::size_t>(c.group));
  if (c.replica == 0) {
    for (const auto& seg : overlap_segments(m, units)) {
      if (seg.holder[static_cast<std::size_t>(c.group)] != c.shard) continue;
      operand range = what;
      range.offset = seg.offset[static_cast<std::size_t>(c.group)];
      range.count = seg.count;
      p.ops.push_back({.kind = comm_kind::all_reduce,
                       .axis = axis::federation,
                       .dtype = dtype::f32,
                       .bytes = seg.count * static_cast<std::int64_t>(sizeof(float)),
                       .ranks = G,
                       .reduce = reduce_op::avg,
                       .trigger = start,
                       .phase = phase::sync,
                       .fragment = fragment,
                       .in = range,
                       .out = range,
                       .overlappable = false,
                       .members = seg.members});
    }
  }
  if (mine.replicas > 1)
    p.ops.push_back({.kind = comm_kind::broadcast,
                     .axis = axis::replica,
                     .dtype = dtype::f32,
                     .bytes = static_cast<std::int64_t>(numel * sizeof(float)),
                     .ranks = mine.replicas,
                     .trigger = finish,
                     .phase = phase::sync,
                     .fragment = fragment,
                     .out = what,
                     .overlappable = false});
  return p;
}

/// The ops that exchange the groups' token counts on a heterogeneous mesh (see the file
/// comment): role tokens summed over the group, all-gathered among the groups' leaders into
/// role group_tokens, broadcast over the group.
inline plan overlap_weights_ops(const overlap_map& m, int fragment) {
  plan p;
  const mesh_coords& c = m.coords;
  const int G = m.num_groups();
  const int group_ranks = m.groups.at(static_cast<std::size_t>(c.group)).size();
  comm_op sum{.kind = comm_kind::all_reduce,
              .axis = axis::group,
              .dtype = dtype::f64,
              .bytes = 8,
              .ranks = group_ranks,
              .reduce = reduce_op::sum,
              .trigger = trigger::sync_prepare,
              .phase = phase::sync,
              .fragment = fragment,
              .in = {.role = role::tokens},
              .out = {.role = role::tokens},
              .overlappable = false};
  p.ops.push_back(sum);
  if (c.replica == 0 && c.shard == 0) {
    comm_op gather = sum;
    gather.kind = comm_kind::all_gather;
    gather.axis = axis::federation;
    gather.bytes = 8 * static_cast<std::int64_t>(G);
    gather.ranks = G;
    gather.reduce.reset();
    gather.out = {.role = role::group_tokens};
    gather.members = m.leaders();
    p.ops.push_back(gather);
  }
  if (group_ranks > 1) {
    comm_op share = sum;
    share.kind = comm_kind::broadcast;
    share.bytes = 8 * static_cast<std::int64_t>(G);
    share.reduce.reset();
    share.in = {};
    share.out = {.role = role::group_tokens};
    p.ops.push_back(share);
  }
  return p;
}

/// The units of a context's packed fragment, in order.
inline std::vector<int> unit_ids(const std::vector<packed_unit>& units) {
  std::vector<int> ids;
  for (const auto& u : units) ids.push_back(u.unit);
  return ids;
}

template <class P, class Mesh>
std::shared_ptr<const overlap_map> overlap_of(const Mesh& m, const flat_layout& mine) {
  if (m.uniform()) return nullptr;
  return make_overlap_map(mine, m.group_shapes(), m.coords(),
                          [](const mesh_shape& v) { return P::layout_shards(v); });
}

}  // namespace fedshard::federation
