#pragma once
/// weighted_average: the groups' parameters averaged with weights w_g = tokens (or samples)
/// group g processed since the fragment's last sync, so unequal groups combine correctly:
/// θ = Σ_g w_g θ_g / Σ_g w_g.
///
/// The sync plan exchanges the weights first (weights_ops: every rank sees all of them), then
/// averages (G w_g / W) θ_g with W = Σ w: equal weights give a scale of exactly 1, so the
/// result is then bit-identical to `average`. When the sync combines only some groups
/// (sync_info::included: the others' weights are zero), G is the number combined. A negative
/// weight, or all weights zero, is an invalid_argument on every rank.

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/federation/federation_policy.hpp"
#include "fedshard/federation/sync_plan.hpp"
#include "fedshard/kernels/sync.hpp"
#include "fedshard/space/host_space.hpp"
#include "fedshard/space/memory_space.hpp"

namespace fedshard::federation {

/// The settings of weighted_average.
struct weighted_average_config {
  sync_mode sync = sync_mode::hierarchical;
};

/// Token-weighted averaging of the groups' parameters, in memory space S (weighted_average
/// is the host one).
template <space::MemorySpace S = space::host_space>
class basic_weighted_average : public detail::begins_only<basic_weighted_average<S>>,
                               public space::same_in_every_space<basic_weighted_average> {
 public:
  using config = weighted_average_config;
  static constexpr std::string_view name = "weighted_average";
  static constexpr bool syncs = true;
  /// Syncs groups of different shapes too (federation/overlap.hpp).
  static constexpr bool heterogeneous_groups = true;

  basic_weighted_average() : space_(space::space_ref<S>::make()) {}
  basic_weighted_average(config c, std::vector<std::size_t>)
      : config_(c), space_(space::space_ref<S>::make()) {}
  basic_weighted_average(config c, std::vector<std::size_t>, S& s)
      : config_(c), space_(space::space_ref<S>(s)) {}

  /// The weights' exchange (weights_ops), then the parameters' average.
  plan sync_plan(const sync_context& ctx) const {
    plan p = weights_ops(ctx);
    return p.append(parameter_average_ops(ctx, config_.sync));
  }

  /// G w_g / W for this rank's group g, from the exchanged weights; invalid_argument naming
  /// every group's weight unless all are >= 0 and not all zero.
  static double weight_scale(const sync_info& info) {
    double total = 0;
    bool negative = false;
    std::string listing;
    for (std::size_t g = 0; g < info.group_tokens.size(); ++g) {
      total += info.group_tokens[g];
      negative = negative || info.group_tokens[g] < 0;
      listing += fedshard::detail::concat(g ? ", " : "", "group ", g, ": ", info.group_tokens[g]);
    }
    FEDSHARD_EXPECTS(
        info.group_tokens.size() == static_cast<std::size_t>(info.groups) && info.groups > 0,
        "weighted_average: expected the token counts of ", info.groups, " groups, found ",
        info.group_tokens.size());
    FEDSHARD_EXPECTS(!negative && total > 0,
                     "weighted_average: weights (tokens since the last sync) must be >= 0 and not "
                     "all zero, found ",
                     listing);
    return static_cast<double>(info.included_count()) *
           info.group_tokens[static_cast<std::size_t>(info.group)] / total;
  }
  /// buf: θ_g -> (G w_g / W) θ_g, queued on st.
  void begin(int, std::span<float> buf, const sync_info& info, typename S::stream& st) {
    const double scale = weight_scale(info);
    if (scale == 1.0) return;
    space_->for_each(st, kernels::scale_by_update{static_cast<float>(scale)}, buf);
  }
  /// begin() without a stream, done when it returns (host buffers); end() and reset():
  /// nothing to do.
  using detail::begins_only<basic_weighted_average>::begin;
  /// The memory space its work runs in.
  S& space() noexcept { return *space_; }

 private:
  config config_{};
  space::space_ref<S> space_;
};

/// Token-weighted averaging of host buffers.
using weighted_average = basic_weighted_average<>;

}  // namespace fedshard::federation
