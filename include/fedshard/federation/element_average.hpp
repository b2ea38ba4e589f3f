#pragma once
/// element_average: each element is averaged over the groups that hold it, optionally weighted
/// by tokens, with the ownership at element granularity (shard/element_ownership.hpp: FEAST's
/// width slices, Collate's per-round masks). Every group stores the whole model; a group
/// trains the elements it holds; after each sync every group has the global value of every
/// element.
///
/// Rules:
///  1. The ownership of a sync is config::masks(layout, G, sync_info::round), a pure function
///     of the model's layout, the group count and the round, so masks change per round inside the
///     policy: the trainer's loop is untouched.
///  2. An element is averaged over its holders among the included groups, in group order:
///     Σ_h s_h θ_h / |H|, s_h = |H| w_h / Σ_H w (1 unweighted; also 1 when every holder's
///     weight is 0). An element held by nobody keeps the lowest included group's value: the
///     global value when no group changes what it does not hold (trainer/local_element_mask.hpp's
///     masked step does not).
///  3. A range a group newly holds in a round starts from the current global value (rule 2
///     gives every group the global value of every element at every sync); its inner optimizer
///     state is the local rule's business (local_element_mask: it starts at zero).
///
/// Two ways to move it (both give the same bits: the rank-order sum of the holders' values,
/// then one division by |H|; comm/detail/reduction.hpp):
///  (b) masked: every group zero-fills what it does not hold and scales what it holds, then
///      one SUM all_reduce of the whole fragment over the G groups, then each element is
///      divided by its holder count. The counts travel on no wire: the masks are a pure
///      function of public data (rule 1), so every rank computes them. Bus bytes per element
///      summed over the G groups: 2 (G-1) x 4.
///  (a) members: per run of consecutive elements with the same holder set H (1 <= |H| < G),
///      an AVG all_reduce among H on a sub-communicator (|H| >= 2), then a broadcast of the
///      run from H's lowest group to all G, since non-holders store the element too; H = all
///      G: one AVG over G; H empty: nothing. Per element summed over the G groups:
///      (2 (|H|-1) + G) x 4 for 1 <= |H| < G, 2 (G-1) x 4 for |H| = G, 0 for |H| = 0.
/// So (a) moves fewer bytes than (b) exactly where |H| < G/2, and costs 2 calls per run and
/// one sub-communicator per holder set, made once (interpreter::split_members). Numbers:
///  - FEAST, G = 4, capabilities {1, .75, .5, .25}: quarters of each tensor held by 4, 3, 2, 1
///    groups: (a) 6, 8, 6, 4 = mean 6 x 4 bytes, (b) 6 x 4: equal, (b) wins by calls;
///    capabilities {1, .25, .25, .25}: (a) 1/4 x 6 + 3/4 x 4 = 4.5, (b) 6: (a) moves 25% less;
///    G = 16, one group at 1 and 15 at .25: (a) 1/4 x 30 + 3/4 x 16 = 19.5, (b) 30.
///  - Collate, fraction p: E|H| = G p; at p = 1/2, (a) ~ (b) in bytes, and the holder sets
///    (up to 2^G) change every round: a split (a world collective) per set per round and a
///    call per block-sized run. (b) is the only choice when masks change per round.
/// The choice (config::aggregation = automatic) is made per fragment, the same on every rank:
/// (a) when the ownership is fixed (config::fixed), G <= 64 (comm_op::members), R = 1, and
///   bytes_a + calls_a x call_bytes < bytes_b + call_bytes
/// with the bytes and calls of the whole fragment over every shard and group, counted from
/// masks(0) (members_cost; call_bytes: what a link moves in one call's latency).

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/federation/federation_policy.hpp"
#include "fedshard/federation/sync_plan.hpp"
#include "fedshard/shard/element_ownership.hpp"
#include "fedshard/space/host_space.hpp"
#include "fedshard/space/memory_space.hpp"

namespace fedshard::federation {

/// How element_average moves a fragment (see the file comment).
enum class element_aggregation : std::uint8_t { automatic, masked, members };

/// The settings of element_average.
struct element_average_config {
  sync_mode sync = sync_mode::hierarchical;
  /// The ownership of each round, from the model's layout (sync_context::layout /
  /// sync_info::layout), the number of groups and sync_info::round; empty: every group holds
  /// every element (then the plan is average's).
  std::function<shard::element_ownership(const flat_layout& layout, int groups, std::int64_t round)>
      masks{};
  /// True when masks gives the same ownership every round (FEAST): (a) may be chosen, and
  /// masks is called for round 0 only.
  bool fixed = false;
  /// Weigh each group by its tokens since the fragment's last sync.
  bool weighted = false;
  /// (a), (b), or the cheaper by the closed form.
  element_aggregation aggregation = element_aggregation::automatic;
  /// Bytes a link moves in the latency of one call (the closed form's price of a call): 64 KiB
  /// is about 25 us at 2.5 GB/s (a cross-site link); inside an NVLink node the simulator
  /// prices a call at about 1 MB's worth (sim/element.hpp's test).
  double call_bytes = 65536;
};

/// The bus bytes (summed over every group and shard) and calls of one sync of a set of
/// elements by (a) and by (b), from their holder sets: see the file comment.
struct element_sync_cost {
  double bytes_a = 0, bytes_b = 0;
  double calls_a = 0, calls_b = 1;
};

namespace detail {

/// Adds, over the elements [lo, lo + n) of unit u, Σ weight[g] of the included groups that
/// hold each element to sum[], and 1 to count[] (both n long).
inline void holder_sums(const shard::element_ownership& o, std::size_t u, std::size_t lo,
                        std::size_t n, std::span<const double> weight, std::span<double> sum,
                        std::span<int> count) {
  for (int g = 0; g < o.groups(); ++g) {
    const double w = weight[static_cast<std::size_t>(g)];
    if (w < 0) continue;  // left out of this sync
    for (const shard::element_range& r : o.held[static_cast<std::size_t>(g)].at(u)) {
      const std::size_t b = std::max(r.begin, lo), e = std::min(r.end, lo + n);
      for (std::size_t i = b; i < e; ++i) {
        sum[i - lo] += w;
        ++count[i - lo];
      }
    }
  }
}

/// The holder set of each element [lo, lo + n) of unit u (G <= 64).
inline std::vector<std::uint64_t> holder_sets(const shard::element_ownership& o, std::size_t u,
                                              std::size_t lo, std::size_t n) {
  std::vector<std::uint64_t> h(n, 0);
  for (int g = 0; g < o.groups(); ++g)
    for (const shard::element_range& r : o.held[static_cast<std::size_t>(g)].at(u)) {
      const std::size_t b = std::max(r.begin, lo), e = std::min(r.end, lo + n);
      for (std::size_t i = b; i < e; ++i) h[i - lo] |= std::uint64_t{1} << g;
    }
  return h;
}

}  // namespace detail

/// The cost of syncing the listed units by (a) and by (b) under ownership o on G <= 64
/// groups, over each unit's extent (its elements up to the last one any group holds), the
/// runs counted over the whole extent (shard boundaries split a few more): see the file comment.
inline element_sync_cost members_cost(const shard::element_ownership& o,
                                      std::span<const packed_unit> units, int G) {
  element_sync_cost c;
  for (const packed_unit& pu : units) {
    const auto u = static_cast<std::size_t>(pu.unit);
    std::size_t extent = 0;
    for (const auto& per_unit : o.held)
      if (!per_unit.at(u).empty()) extent = std::max(extent, per_unit[u].back().end);
    c.bytes_b += 2.0 * (G - 1) * 4.0 * static_cast<double>(extent);
    const auto sets = detail::holder_sets(o, u, 0, extent);
    for (std::size_t e = 0; e < extent; ++e) {
      const int k = std::popcount(sets[e]);
      if (k == 0) continue;
      c.bytes_a += 4.0 * (k == G ? 2.0 * (G - 1) : 2.0 * (k - 1) + G);
      if (e == 0 || sets[e] != sets[e - 1]) c.calls_a += (k == G || k == 1) ? 1 : 2;
    }
  }
  return c;
}

/// Averaging of each element over the groups that hold it, on host buffers; see the file
/// comment.
template <space::MemorySpace S>
class element_average_in;

class element_average : public detail::stateless {
 public:
  using config = element_average_config;
  static constexpr std::string_view name = "element_average";
  static constexpr bool syncs = true;
  /// The policy in memory space T (federation_policy.hpp's requirement 10): itself on host
  /// memory, element_average_in<T> on another host-accessible space.
  template <space::MemorySpace T>
  using in_space = std::conditional_t<std::is_same_v<T, space::host_space>, element_average,
                                      element_average_in<T>>;

  element_average() = default;
  element_average(config c, std::vector<std::size_t> sizes)
      : config_(std::move(c)), divisors_(sizes.size()) {}

  /// The settings it was built with.
  const config& settings() const noexcept { return config_; }

  /// The holder sets (2 or more groups, not all G) of masks(0), each once, in order of
  /// first appearance by unit and element, when (a) may be chosen; else none.
  std::vector<std::uint64_t> member_sets(const mesh_shape& shape) const;

  /// True when a sync of these units on G groups runs as (a): see the file comment.
  /// `layout`: the model's (null once masks(0) was called with one).
  bool uses_members(std::span<const packed_unit> units, int G,
                    const flat_layout* layout = nullptr) const;

  /// The ops of one sync: the weights' exchange if weighted, then average's plan when no
  /// ownership is given, (a)'s runs, or (b)'s SUM all_reduce.
  plan sync_plan(const sync_context& ctx) const;

  /// (b): zero-fills what this group does not hold and scales what it holds (rule 2);
  /// (a): scales each run by |H| w_g / Σ_H w when weighted. invalid_argument (on every rank)
  /// for a negative weight or an ownership of another number of groups or units.
  void begin(int f, std::span<float> buf, const sync_info& info, space::host_space::stream&);
  /// (b): divides each element by its holder count.
  void end(int f, std::span<float> buf, const sync_info&, space::host_space::stream&) {
    const auto& d = divisors_.at(static_cast<std::size_t>(f));
    if (d.empty()) return;
    FEDSHARD_EXPECTS(d.size() == buf.size(), "element_average: fragment ", f, " began with ",
                     d.size(), " elements and ends with ", buf.size());
    for (std::size_t i = 0; i < buf.size(); ++i)
      if (d[i] != 1.0f) buf[i] /= d[i];
  }
  /// Without a stream (host buffers).
  void begin(int f, std::span<float> buf, const sync_info& info) {
    space::host_space::stream st;
    begin(f, buf, info, st);
  }
  void end(int f, std::span<float> buf, const sync_info& info) {
    space::host_space::stream st;
    end(f, buf, info, st);
  }
  using detail::stateless::reset;

 private:
  /// The ownership of round r, checked against G groups and the packed units.
  /// A fixed ownership is computed once, as round 0's; a null layout takes it from the cache.
  const shard::element_ownership& owners_at(std::int64_t r, int G,
                                            std::span<const packed_unit> units,
                                            const flat_layout* layout) const;
  /// Each group's weight in this sync: its tokens (1 unweighted), -1 when left out.
  std::vector<double> weights_of(const sync_info& info) const;
  void begin_masked(std::vector<float>& div, std::span<float> buf, const sync_info& info,
                    std::span<const double> w) const;
  void begin_everyone(std::vector<float>& div, std::span<float> buf, const sync_info& info,
                      std::span<const double> w) const;
  void begin_members(std::span<float> buf, const sync_info& info, std::span<const double> w) const;
  void run_ops(plan& p, const sync_context& ctx, std::uint64_t h, std::size_t at,
               std::size_t n) const;

  config config_{};
  std::vector<std::vector<float>> divisors_;  // per fragment, (b)'s holder counts; else empty
  mutable std::map<std::int64_t, shard::element_ownership> cache_;  // the latest round's
};

inline std::vector<std::uint64_t> element_average::member_sets(const mesh_shape& shape) const {
  std::vector<std::uint64_t> sets;
  const int G = shape.groups;
  if (!config_.masks || !config_.fixed || G > 64 ||
      config_.aggregation == element_aggregation::masked)
    return sets;
  const shard::element_ownership& o = owners_at(0, G, {}, nullptr);
  const std::size_t units = o.held.empty() ? 0 : o.held.front().size();
  for (std::size_t u = 0; u < units; ++u) {
    std::size_t extent = 0;
    for (const auto& per_unit : o.held)
      if (!per_unit[u].empty()) extent = std::max(extent, per_unit[u].back().end);
    for (const std::uint64_t h : detail::holder_sets(o, u, 0, extent))
      if (std::popcount(h) >= 2 && h != shard::all_groups(G) &&
          std::find(sets.begin(), sets.end(), h) == sets.end())
        sets.push_back(h);
  }
  return sets;
}

inline bool element_average::uses_members(std::span<const packed_unit> units, int G,
                                          const flat_layout* layout) const {
  if (!config_.masks || config_.aggregation == element_aggregation::masked) return false;
  const bool possible = config_.fixed && G <= 64;
  if (config_.aggregation == element_aggregation::members) {
    FEDSHARD_EXPECTS(possible,
                     "element_average: aggregation by members needs a fixed ownership and at "
                     "most 64 groups; found fixed = ",
                     config_.fixed ? "true" : "false", " and ", G, " groups");
    return true;
  }
  if (!possible) return false;
  const auto& o = owners_at(0, G, units, layout);
  if (o.everyone()) return false;
  const auto c = members_cost(o, units, G);
  return c.bytes_a + c.calls_a * config_.call_bytes < c.bytes_b + c.calls_b * config_.call_bytes;
}

inline plan element_average::sync_plan(const sync_context& ctx) const {
  plan p = config_.weighted ? weights_ops(ctx) : plan{};
  if (!config_.masks) return p.append(parameter_average_ops(ctx, config_.sync));
  FEDSHARD_EXPECTS(!ctx.overlap, "element_average: groups of different shapes are not supported");
  FEDSHARD_EXPECTS(ctx.layout != nullptr,
                   "element_average: the masks need the model's layout (sync_context::layout), "
                   "found none");
  if (!uses_members(ctx.units, ctx.shape.groups, ctx.layout)) {  // (b): SUM, divided in end()
    plan avg = parameter_average_ops(ctx, config_.sync);
    for (comm_op& op : avg.ops)
      if (op.kind == comm_kind::all_reduce) op.reduce = reduce_op::sum;
    return p.append(avg);
  }
  const auto& o = owners_at(0, ctx.shape.groups, ctx.units, ctx.layout);
  std::size_t at = 0;
  if (ctx.coords.replica == 0)  // (a) runs on replica 0, which then broadcasts in the group
    for (const packed_unit& pu : ctx.units) {
      const auto sets =
          detail::holder_sets(o, static_cast<std::size_t>(pu.unit),
                              static_cast<std::size_t>(ctx.coords.shard) * pu.numel, pu.numel);
      for (std::size_t i = 0; i < pu.numel;) {
        std::size_t j = i + 1;
        while (j < pu.numel && sets[j] == sets[i]) ++j;
        if (sets[i] != 0) run_ops(p, ctx, sets[i], at + i, j - i);
        i = j;
      }
      at += pu.numel;
    }
  if (ctx.shape.replicas > 1)
    p.ops.push_back({.kind = comm_kind::broadcast,
                     .axis = axis::replica,
                     .dtype = dtype::f32,
                     .bytes = static_cast<std::int64_t>(ctx.numel * sizeof(float)),
                     .ranks = ctx.shape.replicas,
                     .trigger = trigger::sync_finish,
                     .phase = phase::sync,
                     .fragment = ctx.fragment,
                     .in = {.role = role::fragment},
                     .out = {.role = role::fragment},
                     .overlappable = false});
  return p;
}

inline void element_average::run_ops(plan& p, const sync_context& ctx, std::uint64_t h,
                                     std::size_t at, std::size_t n) const {
  const int G = ctx.shape.groups, k = std::popcount(h);
  const operand range{.role = role::fragment,
                      .offset = static_cast<std::int64_t>(at),
                      .count = static_cast<std::int64_t>(n)};
  comm_op op{.kind = comm_kind::all_reduce,
             .axis = axis::federation,
             .dtype = dtype::f32,
             .bytes = static_cast<std::int64_t>(n * sizeof(float)),
             .ranks = k,
             .reduce = reduce_op::avg,
             .trigger = trigger::sync_exchange,
             .phase = phase::sync,
             .fragment = ctx.fragment,
             .in = range,
             .out = range,
             .overlappable = false,
             .members = h == shard::all_groups(G) ? 0 : h};
  if (k >= 2 && ((h >> ctx.coords.group) & 1u) != 0) p.ops.push_back(op);
  if (k == G) return;
  op.kind = comm_kind::broadcast;  // to the groups that store it without holding it
  op.ranks = G;
  op.reduce.reset();
  op.members = 0;
  op.root = std::countr_zero(h);
  p.ops.push_back(op);
}

inline const shard::element_ownership& element_average::owners_at(
    std::int64_t r, int G, std::span<const packed_unit> units, const flat_layout* layout) const {
  if (config_.fixed) r = 0;
  if (auto it = cache_.find(r); it != cache_.end()) return it->second;
  FEDSHARD_EXPECTS(layout != nullptr,
                   "element_average: the masks need the model's layout (sync_context::layout / "
                   "sync_info::layout), found none at round ",
                   r);
  shard::element_ownership o = config_.masks(*layout, G, r);
  FEDSHARD_EXPECTS(o.everyone() || o.groups() == G, "element_average: round ", r,
                   "'s ownership lists ", o.groups(), " groups, but the mesh has ", G);
  for (std::size_t g = 0; g < o.held.size(); ++g)
    for (const packed_unit& pu : units)
      FEDSHARD_EXPECTS(static_cast<std::size_t>(pu.unit) < o.held[g].size(),
                       "element_average: round ", r, "'s ownership lists ", o.held[g].size(),
                       " units for group ", g, ", but the fragment packs unit ", pu.unit);
  cache_.clear();  // the latest round only
  return cache_.emplace(r, std::move(o)).first->second;
}

inline std::vector<double> element_average::weights_of(const sync_info& info) const {
  const int G = info.groups;
  std::vector<double> w(static_cast<std::size_t>(G), 1.0);
  if (config_.weighted) {
    FEDSHARD_EXPECTS(info.group_tokens.size() == w.size(),
                     "element_average: expected the token counts of ", G, " groups, found ",
                     info.group_tokens.size());
    for (int g = 0; g < G; ++g) {
      const double t = info.group_tokens[static_cast<std::size_t>(g)];
      FEDSHARD_EXPECTS(t >= 0,
                       "element_average: weights (tokens since the last sync) must be >= 0, "
                       "found ",
                       t, " for group ", g);
      w[static_cast<std::size_t>(g)] = t;
    }
  }
  for (int g = 0; g < G; ++g)
    if (!info.includes(g)) w[static_cast<std::size_t>(g)] = -1;
  return w;
}

inline void element_average::begin(int f, std::span<float> buf, const sync_info& info,
                                   space::host_space::stream&) {
  auto& div = divisors_.at(static_cast<std::size_t>(f));
  div.clear();
  if (!config_.masks) return;
  const std::vector<double> w = weights_of(info);
  if (uses_members(info.units, info.groups, info.layout)) {
    FEDSHARD_EXPECTS(info.included_count() == info.groups,
                     "element_average: aggregation by members combines every group; this sync "
                     "leaves out ",
                     info.groups - info.included_count(), " of ", info.groups);
    begin_members(buf, info, w);
  } else {
    begin_masked(div, buf, info, w);
  }
}

inline void element_average::begin_masked(std::vector<float>& div, std::span<float> buf,
                                          const sync_info& info, std::span<const double> w) const {
  const auto& o = owners_at(info.round, info.groups, info.units, info.layout);
  if (o.everyone()) return begin_everyone(div, buf, info, w);
  int keeper = 0;  // the lowest included group keeps what nobody holds
  while (keeper < info.groups && w[static_cast<std::size_t>(keeper)] < 0) ++keeper;
  const double mine = w[static_cast<std::size_t>(info.group)];
  div.assign(buf.size(), 1.0f);
  std::size_t at = 0;
  for (const packed_unit& pu : info.units) {
    const std::size_t lo = static_cast<std::size_t>(info.shard) * pu.numel;
    const auto u = static_cast<std::size_t>(pu.unit);
    std::vector<double> sum(pu.numel, 0.0);
    std::vector<int> count(pu.numel, 0);
    detail::holder_sums(o, u, lo, pu.numel, w, sum, count);
    std::vector<std::uint8_t> held(pu.numel, 0);
    if (mine >= 0)
      for (const shard::element_range& r : o.held[static_cast<std::size_t>(info.group)][u])
        for (std::size_t e = std::max(r.begin, lo); e < std::min(r.end, lo + pu.numel); ++e)
          held[e - lo] = 1;
    for (std::size_t i = 0; i < pu.numel; ++i) {
      float& x = buf[at + i];
      if (count[i] == 0) {
        if (info.group != keeper) x = 0.0f;
        continue;
      }
      div[at + i] = static_cast<float>(count[i]);
      if (!held[i]) {
        x = 0.0f;
        continue;
      }
      const double scale = sum[i] > 0 ? count[i] * mine / sum[i] : 1.0;
      if (scale != 1.0) x *= static_cast<float>(scale);
    }
    at += pu.numel;
  }
  for (; at < buf.size(); ++at)  // the fragment's padding: nobody's
    if (info.group != keeper) buf[at] = 0.0f;
}

inline void element_average::begin_everyone(std::vector<float>& div, std::span<float> buf,
                                            const sync_info& info,
                                            std::span<const double> w) const {
  int count = 0;
  double sum = 0;
  for (const double x : w)
    if (x >= 0) {
      ++count;
      sum += x;
    }
  const double mine = w[static_cast<std::size_t>(info.group)];
  const double scale = mine < 0 ? 0.0 : sum > 0 ? count * mine / sum : 1.0;
  div.assign(buf.size(), static_cast<float>(count));
  if (scale != 1.0)
    for (float& x : buf) x *= static_cast<float>(scale);
}

inline void element_average::begin_members(std::span<float> buf, const sync_info& info,
                                           std::span<const double> w) const {
  if (!config_.weighted) return;
  const auto& o = owners_at(0, info.groups, info.units, info.layout);
  const double mine = w[static_cast<std::size_t>(info.group)];
  std::size_t at = 0;
  for (const packed_unit& pu : info.units) {
    const auto sets =
        detail::holder_sets(o, static_cast<std::size_t>(pu.unit),
                            static_cast<std::size_t>(info.shard) * pu.numel, pu.numel);
    for (std::size_t i = 0; i < pu.numel; ++i) {
      const std::uint64_t h = sets[i];
      if (std::popcount(h) < 2 || ((h >> info.group) & 1u) == 0) continue;
      double total = 0;
      for (int g = 0; g < info.groups; ++g)
        if ((h >> g) & 1u) total += std::max(0.0, w[static_cast<std::size_t>(g)]);
      const double scale = total > 0 ? std::popcount(h) * mine / total : 1.0;
      if (scale != 1.0) buf[at + i] *= static_cast<float>(scale);
    }
    at += pu.numel;
  }
}

/// element_average in a host-accessible memory space S other than host memory (a
/// checked_space, whose streams defer their work): begin and end synchronize the sync stream
/// (the fragment's buffer as the queued work leaves it), then run element_average's host work
/// on the buffer, done when they return.
template <space::MemorySpace S>
class element_average_in : public element_average {
  static_assert(S::host_accessible,
                "federation::element_average combines the groups' masks on the host: its memory "
                "space must be host-accessible (host_space, checked_space); a device kernel for "
                "it is not written yet");

 public:
  element_average_in(config c, std::vector<std::size_t> sizes, S& s)
      : element_average(std::move(c), std::move(sizes)), space_(&s) {}
  using element_average::begin;
  using element_average::end;
  void begin(int f, std::span<float> buf, const sync_info& info, typename S::stream& st) {
    space_->synchronize(st);
    element_average::begin(f, buf, info);
  }
  void end(int f, std::span<float> buf, const sync_info& info, typename S::stream& st) {
    space_->synchronize(st);
    element_average::end(f, buf, info);
  }

 private:
  S* space_;
};

}  // namespace fedshard::federation
