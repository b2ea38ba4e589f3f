#pragma once
/// every_step: the groups synchronise the whole model after every step (synchronous data
/// parallelism across the federation axis).

#include <cstdint>
#include <string_view>
#include <vector>

#include "fedshard/schedule/sync_schedule.hpp"

namespace fedshard::schedule {

/// One fragment (the whole model), start_and_apply after every step, α = 1.
struct every_step {
  /// No settings.
  struct config {};

  /// The schedule.
  every_step() = default;
  /// The schedule (config has no settings).
  explicit every_step(const config&) {}

  /// The schedule's name.
  static constexpr std::string_view name = "every_step";

  /// 1.
  int fragments() const noexcept { return 1; }

  /// start_and_apply at every step.
  sync_action action(int fragment, std::int64_t step, std::int64_t /*total_steps*/) const {
    detail::check_action_args(name, fragment, 1, step);
    return sync_action::start_and_apply;
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
