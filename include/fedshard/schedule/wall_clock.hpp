#pragma once
/// wall_clock: the groups synchronise the whole model every T seconds, whatever the number
/// of steps each did in that time, so a slow site does not stall a fast one; with a
/// token-weighted federation policy (federation::weighted_average) a group that did more
/// steps weighs more. A run ends after a set number of syncs.

#include <cmath>
#include <cstdint>
#include <string_view>

#include "fedshard/error.hpp"
#include "fedshard/schedule/sync_schedule.hpp"

namespace fedshard::schedule {

/// A progress schedule (ProgressSchedule): one fragment (the whole model), start_and_apply
/// after the step at which the group's seconds since the run started (sync_progress::seconds,
/// its rank 0's clock) reach (k + 1)·T, k being the syncs it applied so far. The k-th sync is
/// due at k·T from the start, not T after the previous one, so the time a fast group waits
/// for a slow one at a sync does not shift its later syncs, and the k-th syncs of all groups
/// fall within one step (of the slowest group) of k·T. A group whose step is longer than T
/// syncs after every step until it has caught up. α = 1.
class wall_clock : public whole_model<wall_clock> {
 public:
  /// The settings.
  struct config {
    double seconds = 60.0;    ///< T, seconds between syncs; finite and > 0
    std::int64_t syncs = 10;  ///< the syncs of a run (trainer::done() after the last); >= 1
  };

  /// T = 60 s, 10 syncs.
  wall_clock() = default;
  /// Throws invalid_argument unless T is finite and > 0 and syncs >= 1.
  explicit wall_clock(const config& c) : config_(c) {
    FEDSHARD_EXPECTS(std::isfinite(c.seconds) && c.seconds > 0, name,
                     ": seconds (T, the time between syncs) must be finite and > 0, found ",
                     c.seconds);
    FEDSHARD_EXPECTS(c.syncs >= 1, name,
                     ": syncs (the syncs after which a run ends) must be >= 1, found ", c.syncs);
  }

  /// The schedule's name.
  static constexpr std::string_view name = "wall_clock";
  /// The decision reads the clock: the synchronizer reads it once the step's work is done
  /// (on a device, not when the host has merely queued it).
  static constexpr bool uses_clock = true;

  /// The settings.
  const config& settings() const noexcept { return config_; }
  /// The syncs of a run.
  std::int64_t run_syncs() const noexcept { return config_.syncs; }
  /// When sync k (0-based) is due: (k + 1)·T seconds after the start.
  double due(std::int64_t k) const noexcept { return static_cast<double>(k + 1) * config_.seconds; }

  /// start_and_apply when p.seconds >= due(p.syncs), else none.
  sync_action action(int fragment, const sync_progress& p) const {
    detail::check_action_args(name, fragment, 1, p.step);
    return p.seconds >= due(p.syncs) ? sync_action::start_and_apply : sync_action::none;
  }

 private:
  config config_;
};

}  // namespace fedshard::schedule
