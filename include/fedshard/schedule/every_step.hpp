#pragma once
/// every_step: the groups synchronise the whole model after every step (synchronous data
/// parallelism across the federation axis).

#include <cstdint>
#include <string_view>
#include <vector>

#include "fedshard/schedule/sync_schedule.hpp"

namespace fedshard::schedule {

/// One fragment (the whole model), start_and_apply after every step, α = 1.
struct every_step : whole_model<every_step> {
  /// No settings.
  struct config {};

  /// The schedule.
  every_step() = default;
  /// The schedule (config has no settings).
  explicit every_step(const config&) {}

  /// The schedule's name.
  static constexpr std::string_view name = "every_step";

  /// start_and_apply at every step.
  sync_action action(int fragment, std::int64_t step, std::int64_t /*total_steps*/) const {
    detail::check_action_args(name, fragment, 1, step);
    return sync_action::start_and_apply;
  }
};

}  // namespace fedshard::schedule
