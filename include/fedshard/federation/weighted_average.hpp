#pragma once
/// weighted_average: the groups' parameters averaged with weights w_g = tokens (or samples)
/// group g processed since the fragment's last sync, so unequal groups combine correctly:
/// θ = Σ_g w_g θ_g / Σ_g w_g.
///
/// Computed as the plain mean of (G w_g / W) θ_g with W = Σ w: equal weights give a scale of
/// exactly 1, so the result is then bit-identical to `average`. The weights are exchanged at
/// each sync (every rank sees all of them); a negative weight, or all weights zero, is an
/// invalid_argument on every rank.

#include <cstddef>
#include <span>
#include <string_view>
#include <vector>

#include "fedshard/federation/federation_policy.hpp"

namespace fedshard::federation {

/// Token-weighted averaging of the groups' parameters.
struct weighted_average {
  struct config {
    sync_mode sync = sync_mode::hierarchical;
  };
  static constexpr std::string_view name = "weighted_average";
  static constexpr bool syncs = true;
  static constexpr bool uses_weights = true;

  weighted_average() = default;
  weighted_average(config, std::vector<std::size_t>) {}
  void begin(int, std::span<float> buf, const sync_info& info) {
    if (info.weight_scale == 1.0) return;
    const auto s = static_cast<float>(info.weight_scale);
    for (float& x : buf) x *= s;
  }
  void end(int, std::span<float>, const sync_info&) {}
  void reset(int, std::span<const float>) {}
  std::vector<optim::state_tensor> state() { return {}; }
  bool averages_inner_moments() const { return false; }
};

}  // namespace fedshard::federation
