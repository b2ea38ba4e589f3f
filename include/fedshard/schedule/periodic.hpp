#pragma once
/// periodic<K>: local steps with a whole-model sync every K steps (FL+FSDP, FL+HSDP,
/// DiLoCo's H, local SGD).

#include <cstdint>
#include <string_view>
#include <vector>

#include "fedshard/schedule/sync_schedule.hpp"

namespace fedshard::schedule {

/// True when K is a usable period for periodic<K> (K >= 1); periodic<K> static_asserts it.
template <int K>
concept valid_period = K >= 1;

/// One fragment (the whole model), start_and_apply after steps K-1, 2K-1, ... (0-based:
/// `(step + 1) % K == 0`) and after the final step; α = 1. periodic<1> is every_step.
template <int K>
struct periodic {
  static_assert(valid_period<K>,
                "fedshard::schedule::periodic<K>: K, the number of steps between syncs, must be "
                ">= 1");

  /// No settings (the period is the template argument).
  struct config {};

  /// The schedule.
  periodic() = default;
  /// The schedule (config has no settings).
  explicit periodic(const config&) {}

  /// The schedule's name.
  static constexpr std::string_view name = "periodic";
  /// K, the steps between syncs.
  static constexpr int period = K;

  /// 1.
  int fragments() const noexcept { return 1; }

  /// start_and_apply when (step + 1) % K == 0 or step is the final step, else none.
  sync_action action(int fragment, std::int64_t step, std::int64_t total_steps) const {
    detail::check_action_args(name, fragment, 1, step);
    const bool sync = (step + 1) % K == 0 || detail::is_final_step(step, total_steps);
    return sync ? sync_action::start_and_apply : sync_action::none;
  }

  /// 1: the synchronised parameters replace the local ones.
  float mixing() const noexcept { return 1.0f; }

  /// All units, ascending.
  std::vector<int> fragment_units(int fragment, int num_units) const {
    return detail::strided_units(name, fragment, 1, num_units);
  }

  /// Throws invalid_argument when num_units < 1.
  void check(int num_units) const { detail::check_units(name, 1, num_units); }
};

}  // namespace fedshard::schedule
