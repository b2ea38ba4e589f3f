#pragma once
/// holder_average: each element is averaged over the groups that hold it (FoMoE's experts
/// placed on groups, FEAST / Collate's sub-models; shard/ownership.hpp). A unit held by every
/// group is averaged everywhere, as `average` does; a unit held by one group is left as it
/// is (nothing moves); a unit held by k groups is averaged over those k.
///
/// The plan moves only held ranges. A fragment buffer packs the units this rank's group
/// holds, back to back in unit order (sync_context::units); units with consecutive indices and
/// the same holder set form a run (every holder of the set forms the same runs: it holds the
/// same units of the set, and a schedule lists a fragment's units in ascending order), and
/// each run of k >= 2 holders is one AVG all_reduce of that element range among its holders
/// (comm_op::members), on a sub-communicator of those groups that the interpreter makes once
/// (interpreter::split_members, listed by member_sets) and keeps. Runs are listed in unit
/// order, the same on every group, so any two groups issue the calls they share in the same
/// order.
///
/// Why sub-communicators, not a masked reduce with counts: a masked reduce all-reduces the
/// whole model over all G groups (zeros where a group holds nothing, plus a count per element
/// to divide by), so every rank sends 2 (G-1)/G x (all units' bytes) and must allocate the
/// units it does not hold. Per holder set H it is 2 (|H|-1)/|H| x (H's units' bytes), which
/// is never more (|H| <= G and H's units are a subset) and, for experts spread over G groups
/// one copy each, about the dense part alone: E experts cost nothing instead of
/// 2 (G-1)/G x E x expert bytes. What sub-communicators cost is one split per holder set
/// (made once, not per sync) and one call per run (latency): small next to the bytes saved
/// for any unit worth placing.
///
/// With R > 1 replicas, a run whose length divides by R is averaged hierarchically (each
/// replica its 1/R piece, then the replicas all-gather), otherwise as in the reference mode
/// (replica 0 averages it, then broadcasts). Every group holding every unit gives exactly
/// average's plan, so the result is bit-identical to `average`.
///
/// Token weights (config::weighted): as weighted_average, the groups' token counts are
/// exchanged first (weights_ops: every group's, a few bytes), then begin() scales each run
/// of holder set H by |H| w_g / Σ_{h in H} w_h, so the run's average is Σ w_h θ_h / Σ w_h
/// over its holders; equal weights give a scale of exactly 1 (bit-identical to unweighted).
/// Not yet: a per-round rule for the masks, groups that come and go (sync_info::included).

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/federation/federation_policy.hpp"
#include "fedshard/federation/sync_plan.hpp"
#include "fedshard/kernels/sync.hpp"
#include "fedshard/shard/ownership.hpp"
#include "fedshard/space/host_space.hpp"
#include "fedshard/space/memory_space.hpp"

namespace fedshard::federation {

/// The settings of holder_average.
struct holder_average_config {
  sync_mode sync = sync_mode::hierarchical;
  /// Which groups hold which units (empty: every group holds every unit).
  shard::ownership owners{};
  /// Weigh each group by its tokens since the fragment's last sync (see the file comment).
  bool weighted = false;
};

/// Averaging of each unit over the groups that hold it, in memory space S (holder_average
/// is the host one); see the file comment.
template <space::MemorySpace S = space::host_space>
class basic_holder_average : public detail::begins_only<basic_holder_average<S>>,
                             public space::same_in_every_space<basic_holder_average> {
 public:
  using config = holder_average_config;
  static constexpr std::string_view name = "holder_average";
  static constexpr bool syncs = true;

  basic_holder_average() : space_(space::space_ref<S>::make()) {}
  basic_holder_average(config c, std::vector<std::size_t>)
      : config_(std::move(c)), space_(space::space_ref<S>::make()) {}
  basic_holder_average(config c, std::vector<std::size_t>, S& s)
      : config_(std::move(c)), space_(space::space_ref<S>(s)) {}

  /// The settings it was built with.
  const config& settings() const noexcept { return config_; }

  /// The holder sets whose member ops need a sub-communicator of their own (2 or more
  /// holders, not all G), each once, in unit order: the same list on every rank.
  std::vector<std::uint64_t> member_sets(const mesh_shape& shape) const {
    std::vector<std::uint64_t> sets;
    for (const shard::group_set h : config_.owners.holders) {
      if (std::popcount(h) < 2 || h == shard::all_groups(shape.groups)) continue;
      bool seen = false;
      for (auto s : sets) seen = seen || s == h;
      if (!seen) sets.push_back(h);
    }
    return sets;
  }

  /// The ops of one sync of fragment ctx.fragment: the weights' exchange if weighted, then
  /// average's plan when every unit of it is held by every group, else one average per run
  /// of units with 2 or more holders.
  plan sync_plan(const sync_context& ctx) const {
    plan p = config_.weighted ? weights_ops(ctx) : plan{};
    return p.append(average_plan(ctx));
  }

  /// Weighted: scales each run of buf (the fragment's held units, info.units) by |H| w_g /
  /// Σ_{h in H} w_h, queued on st; invalid_argument (on every rank) naming every group's
  /// weight unless they are >= 0 and every holder set's are not all zero.
  void begin(int, std::span<float> buf, const sync_info& info, typename S::stream& st) {
    if (!config_.weighted) return;
    const int G = info.groups;
    FEDSHARD_EXPECTS(info.group_tokens.size() == static_cast<std::size_t>(G),
                     "holder_average: expected the token counts of ", G, " groups, found ",
                     info.group_tokens.size());
    std::string listing;
    bool negative = false;
    for (int g = 0; g < G; ++g) {
      const double w = info.group_tokens[static_cast<std::size_t>(g)];
      negative = negative || w < 0;
      listing += fedshard::detail::concat(g ? ", " : "", "group ", g, ": ", w);
    }
    FEDSHARD_EXPECTS(!negative,
                     "holder_average: weights (tokens since the last sync) must be "
                     ">= 0, found ",
                     listing);
    // Every holder set is checked, not only this group's, so that every rank refuses the same
    // weights (each one has every group's).
    std::vector<shard::group_set> sets{shard::all_groups(G)};
    for (const shard::group_set h : config_.owners.holders)
      if (std::popcount(h) >= 2) sets.push_back(h);
    for (const shard::group_set h : sets) {
      double total = 0;
      for (int g = 0; g < G; ++g)
        if ((h >> g) & 1u) total += info.group_tokens[static_cast<std::size_t>(g)];
      FEDSHARD_EXPECTS(total > 0, "holder_average: the holders ", group_list(h),
                       " of a unit have no tokens since the last sync; found ", listing);
    }
    const auto everyone_holds = [&](std::size_t) { return shard::all_groups(G); };
    std::size_t at = 0;
    for (const auto& r : runs(info.units, G, everyone_holds)) {
      if (std::popcount(r.holders) >= 2) {
        double total = 0;
        for (int g = 0; g < G; ++g)
          if ((r.holders >> g) & 1u) total += info.group_tokens[static_cast<std::size_t>(g)];
        const double scale = std::popcount(r.holders) *
                             info.group_tokens[static_cast<std::size_t>(info.group)] / total;
        if (scale != 1.0)
          space_->for_each(st, kernels::scale_by_update{static_cast<float>(scale)},
                           buf.subspan(at, r.numel));
      }
      at += r.numel;
    }
  }
  /// begin() without a stream, done when it returns (host buffers); end() and reset():
  /// nothing to do.
  using detail::begins_only<basic_holder_average>::begin;
  /// The memory space its work runs in.
  S& space() noexcept { return *space_; }

 private:
  /// A run: consecutive units (by index) with the same holders, back to back in the buffer.
  struct run {
    shard::group_set holders = 0;
    std::size_t numel = 0;
  };
  /// The runs of the packed units; holders of a unit from the ownership (or `fallback(u)`
  /// when it lists none).
  template <class Fallback>
  std::vector<run> runs(std::span<const packed_unit> units, int G, Fallback fallback) const {
    const auto& owners = config_.owners;
    auto holders = [&](int u) {
      const auto uu = static_cast<std::size_t>(u);
      return owners.everyone() ? fallback(uu) : owners.holders_of(uu, G);
    };
    std::vector<run> out;
    for (std::size_t i = 0; i < units.size(); ++i) {
      const shard::group_set h = holders(units[i].unit);
      if (i > 0 && units[i].unit == units[i - 1].unit + 1 && out.back().holders == h)
        out.back().numel += units[i].numel;
      else
        out.push_back({h, units[i].numel});
    }
    return out;
  }

  /// The averaging ops (sync_plan without the weights' exchange).
  plan average_plan(const sync_context& ctx) const {
    const int G = ctx.shape.groups;
    const auto& owners = config_.owners;
    if (owners.everyone()) return parameter_average_ops(ctx, config_.sync);
    FEDSHARD_EXPECTS(owners.groups == G, "holder_average: the holders were written for ",
                     owners.groups, " groups, but the mesh has ", G);
    std::size_t packed = 0;
    bool all_everywhere = true;
    for (const packed_unit& pu : ctx.units) {
      FEDSHARD_EXPECTS(pu.unit >= 0 && static_cast<std::size_t>(pu.unit) < owners.holders.size(),
                       "holder_average: fragment ", ctx.fragment, " packs unit ", pu.unit,
                       ", but the ownership lists ", owners.holders.size(), " units");
      FEDSHARD_EXPECTS(owners.holds(ctx.coords.group, static_cast<std::size_t>(pu.unit)),
                       "holder_average: fragment ", ctx.fragment, " of group ", ctx.coords.group,
                       " packs unit ", pu.unit, ", which the group does not hold");
      all_everywhere = all_everywhere && owners.holders_of(static_cast<std::size_t>(pu.unit), G) ==
                                             shard::all_groups(G);
      packed += pu.numel;
    }
    FEDSHARD_EXPECTS(packed <= ctx.numel && (ctx.numel == 0 || !ctx.units.empty()),
                     "holder_average: fragment ", ctx.fragment, " has ", ctx.numel,
                     " elements but the sync context lists units of ", packed,
                     " (a masked sync needs the fragment's units: sync_context::units)");
    if (all_everywhere && !ctx.units.empty()) return parameter_average_ops(ctx, config_.sync);
    plan p;
    std::size_t at = 0;
    for (const run& r : runs(ctx.units, G, [&](std::size_t) { return shard::all_groups(G); })) {
      if (std::popcount(r.holders) >= 2) run_ops(p, ctx, r.holders, at, r.numel);
      at += r.numel;
    }
    return p;
  }

  /// The ops averaging elements [at, at + n) of the fragment among the groups of h, in
  /// ctx.reduce.
  void run_ops(plan& p, const sync_context& ctx, shard::group_set h, std::size_t at,
               std::size_t n) const {
    const int G = ctx.shape.groups, R = ctx.shape.replicas;
    const operand range{.role = role::fragment,
                        .offset = static_cast<std::int64_t>(at),
                        .count = static_cast<std::int64_t>(n)};
    const auto bytes = static_cast<std::int64_t>(n * size_of(ctx.reduce));
    const comm_op across{.kind = comm_kind::all_reduce,
                         .axis = axis::federation,
                         .dtype = ctx.reduce,
                         .bytes = bytes,
                         .ranks = std::popcount(h),
                         .reduce = reduce_op::avg,
                         .trigger = trigger::sync_exchange,
                         .phase = phase::sync,
                         .fragment = ctx.fragment,
                         .in = range,
                         .out = range,
                         .overlappable = false,
                         .members = h == shard::all_groups(G) ? 0 : h};
    append_average(p, across,
                   config_.sync == sync_mode::hierarchical && n % static_cast<std::size_t>(R) == 0,
                   ctx.coords.replica, R, trigger::sync_finish);
  }

  config config_{};
  space::space_ref<S> space_;
};

/// Holder averaging of host buffers.
using holder_average = basic_holder_average<>;

}  // namespace fedshard::federation
