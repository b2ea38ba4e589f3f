#pragma once
/// streaming: Streaming DiLoCo's schedule. The model is cut into P strided fragments; each
/// fragment syncs once per period of H steps at its own offset, its all_reduce starts τ
/// steps before it is applied (overlapping inner steps), and the result is mixed into the
/// local weights with factor α.

#include <cstdint>
#include <string_view>
#include <vector>

#include "fedshard/schedule/sync_schedule.hpp"

namespace fedshard::schedule {

/// Streaming DiLoCo's fragment schedule (arXiv 2501.18512).
///
/// Fragments: fragment p holds the units u with u % P == p.
///
/// Sync points: fragment p syncs after the steps t with (t + 1) % H == offset(p), where
/// offset(p) = floor(H·(p + 1) / P) % H, i.e. once per period, at step floor(H·(p + 1)/P) - 1
/// of it (the last fragment at the period's last step, offset 0). With P <= H the offsets are
/// distinct. At a sync point the action is apply; τ steps earlier (step t - τ) it is start;
/// with τ = 0 both fall on the same step: start_and_apply.
///
/// Delay: τ < floor(H / P). Inside a period the sync points of fragments 0, 1, ..., P-1 follow
/// each other with gaps of floor(H/P) or ceil(H/P) steps, and the first lies floor(H/P) steps
/// after the period starts. A fragment's all_reduce is in flight from its start at t - τ to
/// its apply at t, so τ < floor(H/P) is exactly the condition under which every start comes
/// strictly after the previous apply (of any fragment, hence also of its own, H steps
/// earlier): at most one fragment is in flight at any time (one snapshot buffer), and the
/// first period's first sync point, step floor(H/P) - 1, starts at a step >= 0. τ = 0 is
/// always valid.
///
/// Final step F = total_steps - 1 (when total_steps > 0): every fragment syncs there. A
/// fragment whose all_reduce is in flight (started before F, due after or at F) is applied
/// at F; every other fragment gets start_and_apply at F (a blocking sync, as periodic's final
/// sync). After F, should the run continue, the regular pattern resumes; the sync points whose
/// all_reduce started at or before F were consumed at F.
class streaming {
 public:
  /// The settings (the defaults are a valid schedule).
  struct config {
    int period = 100;    ///< H, steps per period; >= 1
    int fragments = 2;   ///< P, fragments; 1 <= P <= H
    int delay = 0;       ///< τ, steps between a fragment's start and its apply; < floor(H/P)
    float alpha = 1.0f;  ///< α, mixing factor in (0, 1]; 1 replaces the local weights
  };

  /// H = 100, P = 2, τ = 0, α = 1.
  streaming() = default;
  /// Throws invalid_argument unless H >= 1, 1 <= P <= H, 0 <= τ < floor(H/P), 0 < α <= 1.
  explicit streaming(const config& c) : config_(c) {
    FEDSHARD_EXPECTS(c.period >= 1, name, ": period (H) must be >= 1, found ", c.period);
    FEDSHARD_EXPECTS(c.fragments >= 1, name, ": fragments (P) must be >= 1, found ", c.fragments);
    FEDSHARD_EXPECTS(c.fragments <= c.period, name,
                     ": fragments (P) must be <= period (H) so that each fragment has its own "
                     "sync step, found P = ",
                     c.fragments, " > H = ", c.period);
    FEDSHARD_EXPECTS(c.delay >= 0 && c.delay < c.period, name,
                     ": delay (tau) must be in [0, period) = [0, ", c.period, "), found ", c.delay);
    FEDSHARD_EXPECTS(c.delay < c.period / c.fragments, name,
                     ": delay (tau) must be < floor(period / fragments) = floor(", c.period, " / ",
                     c.fragments, ") = ", c.period / c.fragments,
                     " so that a fragment's all_reduce starts after the previous fragment's is "
                     "applied, found ",
                     c.delay);
    FEDSHARD_EXPECTS(c.alpha > 0.0f && c.alpha <= 1.0f, name,
                     ": alpha (mixing factor) must be in (0, 1], found ", c.alpha);
  }

  /// The schedule's name.
  static constexpr std::string_view name = "streaming";

  /// The settings.
  const config& settings() const noexcept { return config_; }

  /// P.
  int fragments() const noexcept { return config_.fragments; }

  /// Fragment p's sync points are the steps t with (t + 1) % H == offset(p); in [0, H).
  int offset(int fragment) const {
    FEDSHARD_EXPECTS(fragment >= 0 && fragment < config_.fragments, name,
                     ": fragment must be in [0, ", config_.fragments, "), found ", fragment);
    const std::int64_t h = config_.period;
    return static_cast<int>(h * (fragment + 1) / config_.fragments % h);
  }

  /// The fragment's action after `step` (see the class comment).
  sync_action action(int fragment, std::int64_t step, std::int64_t total_steps) const {
    detail::check_action_args(name, fragment, config_.fragments, step);
    const std::int64_t h = config_.period;
    const std::int64_t tau = config_.delay;
    const std::int64_t off = offset(fragment);
    const std::int64_t phase = step % h;  // step's position in its period
    const bool regular_start = (phase + tau + 1) % h == off;
    const bool regular_apply = (phase + 1) % h == off;
    if (total_steps <= 0 || step < total_steps - 1)
      return detail::make_action(regular_start, regular_apply);
    const std::int64_t final_step = total_steps - 1;
    if (step == final_step) {
      const std::int64_t to_next_sync = ((off - phase - 1) % h + h) % h;
      return to_next_sync < tau ? sync_action::apply : sync_action::start_and_apply;
    }
    return detail::make_action(regular_start, regular_apply && step - tau > final_step);
  }

  /// α.
  float mixing() const noexcept { return config_.alpha; }

  /// The units u with u % P == fragment, ascending; invalid_argument when P > num_units.
  std::vector<int> fragment_units(int fragment, int num_units) const {
    return detail::strided_units(name, fragment, config_.fragments, num_units);
  }

  /// Throws invalid_argument when the model has fewer units than P (a fragment would be
  /// empty).
  void check(int num_units) const { detail::check_units(name, config_.fragments, num_units); }

 private:
  config config_;
};

}  // namespace fedshard::schedule
