#pragma once
/// periodic: local steps with a whole-model sync every K steps (FL+FSDP, FL+HSDP, DiLoCo's H,
/// local SGD). K is a run-time setting.

#include <cstdint>
#include <string_view>
#include <vector>

#include "fedshard/schedule/sync_schedule.hpp"

namespace fedshard::schedule {

/// One fragment (the whole model), start_and_apply after steps K-1, 2K-1, ... (0-based:
/// `(step + 1) % K == 0`) and after the final step; α = 1. K = 1 is every_step.
class periodic : public whole_model<periodic> {
 public:
  /// The settings.
  struct config {
    int period = 8;  ///< K, the steps between syncs; >= 1
  };

  /// K = 8.
  periodic() = default;
  /// Throws invalid_argument unless K >= 1.
  explicit periodic(const config& c) : config_(c) {
    FEDSHARD_EXPECTS(c.period >= 1, name,
                     ": period (K, the number of steps between syncs) must be >= 1, found ",
                     c.period);
  }

  /// The schedule's name.
  static constexpr std::string_view name = "periodic";

  /// The settings.
  const config& settings() const noexcept { return config_; }
  /// K, the steps between syncs.
  int period() const noexcept { return config_.period; }

  /// start_and_apply when (step + 1) % K == 0 or step is the final step, else none.
  sync_action action(int fragment, std::int64_t step, std::int64_t total_steps) const {
    detail::check_action_args(name, fragment, 1, step);
    const bool sync = (step + 1) % config_.period == 0 || detail::is_final_step(step, total_steps);
    return sync ? sync_action::start_and_apply : sync_action::none;
  }

 private:
  config config_;
};

}  // namespace fedshard::schedule
