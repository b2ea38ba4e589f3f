#pragma once
/// post_local: synchronise after every step until a switch step, then every k steps
/// (post-local SGD: a synchronous warm-up, then local steps).

#include <cstdint>
#include <string_view>
#include <vector>

#include "fedshard/schedule/sync_schedule.hpp"

namespace fedshard::schedule {

/// One fragment (the whole model), α = 1. start_and_apply after every step < switch_step,
/// then after the steps with (step + 1 - switch_step) % k == 0 (switch_step + k - 1,
/// switch_step + 2k - 1, ...), and after the final step. switch_step = 0 is periodic<k>;
/// k = 1 is every_step.
class post_local : public whole_model<post_local> {
 public:
  /// The settings.
  struct config {
    std::int64_t switch_step = 0;  ///< the first step that is not synchronised unconditionally
    int k = 1;                     ///< steps between syncs from switch_step on
  };

  /// switch_step = 0, k = 1.
  post_local() = default;
  /// Throws invalid_argument unless switch_step >= 0 and k >= 1.
  explicit post_local(const config& c) : config_(c) {
    FEDSHARD_EXPECTS(c.switch_step >= 0, name, ": switch_step must be >= 0, found ", c.switch_step);
    FEDSHARD_EXPECTS(c.k >= 1, name,
                     ": k (steps between syncs after switch_step) must be >= 1, found ", c.k);
  }

  /// The schedule's name.
  static constexpr std::string_view name = "post_local";

  /// The settings.
  const config& settings() const noexcept { return config_; }

  /// start_and_apply at the sync steps described above, else none.
  sync_action action(int fragment, std::int64_t step, std::int64_t total_steps) const {
    detail::check_action_args(name, fragment, 1, step);
    const bool sync = step < config_.switch_step ||
                      (step + 1 - config_.switch_step) % config_.k == 0 ||
                      detail::is_final_step(step, total_steps);
    return sync ? sync_action::start_and_apply : sync_action::none;
  }

 private:
  config config_;
};

}  // namespace fedshard::schedule
