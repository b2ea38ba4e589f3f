#pragma once
/// Learning-rate schedules: the LrSchedule concept, constant_lr, and warmup_cosine (linear
/// warm-up then cosine decay).
///
/// An LrSchedule S provides:
///  1. `float operator()(std::int64_t step) const`: the learning rate (>= 0) of the 0-based
///     optimizer step `step`; invalid_argument for step < 0.
///  2. Purity: the value depends on step alone, so every rank computes the same rate without
///     communicating and a run restored at step k continues with the same rates.
///  3. Copyable.

#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <numbers>

#include "fedshard/error.hpp"

namespace fedshard::optim {

/// A learning-rate schedule; see the list above.
template <class S>
concept LrSchedule = std::copy_constructible<S> && requires(const S& s, std::int64_t step) {
  { s(step) } -> std::same_as<float>;
};

/// The same learning rate at every step.
class constant_lr {
 public:
  /// lr must be finite and >= 0.
  explicit constant_lr(float lr) : lr_(lr) {
    FEDSHARD_EXPECTS(lr >= 0.0f && lr <= std::numeric_limits<float>::max(),
                     "constant_lr: lr must be finite and >= 0, found ", lr);
  }

  /// lr at every step >= 0.
  float operator()(std::int64_t step) const {
    FEDSHARD_EXPECTS(step >= 0, "constant_lr: step must be >= 0, found ", step);
    return lr_;
  }

  /// The rate.
  float lr() const noexcept { return lr_; }

 private:
  float lr_;
};

/// Linear warm-up to peak_lr, then cosine decay to min_lr, then min_lr. With W warm-up and T
/// total steps, computed in double and rounded to float once:
///
///   step <  W:       peak * (step + 1) / W                 (reaches peak at step W - 1)
///   W <= step < T:   min + (peak - min) * (1 + cos(pi * (step - W) / (T - W))) / 2
///                                                          (peak at step W, above min at T - 1)
///   step >= T:       min
///
/// W = 0 starts with the cosine; W = T ends the warm-up at peak and then holds min.
class warmup_cosine {
 public:
  /// 0 <= min_lr <= peak_lr (finite), 0 <= warmup_steps <= total_steps.
  warmup_cosine(float peak_lr, std::int64_t warmup_steps, std::int64_t total_steps,
                float min_lr = 0.0f)
      : peak_(peak_lr), min_(min_lr), warmup_(warmup_steps), total_(total_steps) {
    FEDSHARD_EXPECTS(peak_lr >= 0.0f && peak_lr <= std::numeric_limits<float>::max(),
                     "warmup_cosine: peak_lr must be finite and >= 0, found ", peak_lr);
    FEDSHARD_EXPECTS(min_lr >= 0.0f && min_lr <= peak_lr,
                     "warmup_cosine: min_lr must be in [0, peak_lr = ", peak_lr, "], found ",
                     min_lr);
    FEDSHARD_EXPECTS(warmup_steps >= 0, "warmup_cosine: warmup_steps must be >= 0, found ",
                     warmup_steps);
    FEDSHARD_EXPECTS(total_steps >= warmup_steps,
                     "warmup_cosine: total_steps must be >= warmup_steps = ", warmup_steps,
                     ", found ", total_steps);
  }

  /// The rate of 0-based step `step` (formula above).
  float operator()(std::int64_t step) const {
    FEDSHARD_EXPECTS(step >= 0, "warmup_cosine: step must be >= 0, found ", step);
    const double peak = peak_;
    const double low = min_;
    if (step < warmup_)
      return static_cast<float>(peak *
                                (static_cast<double>(step + 1) / static_cast<double>(warmup_)));
    if (step >= total_) return min_;
    const double progress =
        static_cast<double>(step - warmup_) / static_cast<double>(total_ - warmup_);
    return static_cast<float>(low +
                              (peak - low) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress)));
  }

  /// The rate at the end of the warm-up.
  float peak_lr() const noexcept { return peak_; }
  /// The rate from total_steps() on.
  float min_lr() const noexcept { return min_; }
  /// The number of warm-up steps.
  std::int64_t warmup_steps() const noexcept { return warmup_; }
  /// The step from which the rate is min_lr().
  std::int64_t total_steps() const noexcept { return total_; }

 private:
  float peak_;
  float min_;
  std::int64_t warmup_;
  std::int64_t total_;
};

static_assert(LrSchedule<constant_lr>);
static_assert(LrSchedule<warmup_cosine>);

}  // namespace fedshard::optim
