#pragma once
/// token_budget: each group synchronises the whole model once it has processed N tokens
/// since its last sync, however many steps that takes it; a run ends after a set number of
/// syncs. A group with small batches takes more steps per sync than one with large batches,
/// and the k-th sync of every group meets the k-th of the others.

#include <cstdint>
#include <string_view>

#include "fedshard/error.hpp"
#include "fedshard/schedule/sync_schedule.hpp"

namespace fedshard::schedule {

/// A progress schedule (ProgressSchedule): one fragment (the whole model), start_and_apply
/// after the step at which the group's tokens since its last sync (summed over its ranks,
/// sync_progress::tokens) reach N; the count restarts from zero at each sync (what a step
/// carries beyond N is not carried over). α = 1.
class token_budget : public whole_model<token_budget> {
 public:
  /// The settings.
  struct config {
    std::int64_t tokens = 65536;  ///< N, the group's tokens between syncs; >= 1
    std::int64_t syncs = 10;      ///< the syncs of a run (trainer::done() after the last); >= 1
  };

  /// N = 65536, 10 syncs.
  token_budget() = default;
  /// Throws invalid_argument unless N >= 1 and syncs >= 1.
  explicit token_budget(const config& c) : config_(c) {
    FEDSHARD_EXPECTS(c.tokens >= 1, name,
                     ": tokens (N, the group's tokens between syncs) must be >= 1, found ",
                     c.tokens);
    FEDSHARD_EXPECTS(c.syncs >= 1, name,
                     ": syncs (the syncs after which a run ends) must be >= 1, found ", c.syncs);
  }

  /// The schedule's name.
  static constexpr std::string_view name = "token_budget";

  /// The settings.
  const config& settings() const noexcept { return config_; }
  /// The syncs of a run.
  std::int64_t run_syncs() const noexcept { return config_.syncs; }

  /// start_and_apply when p.tokens >= N, else none.
  sync_action action(int fragment, const sync_progress& p) const {
    detail::check_action_args(name, fragment, 1, p.step);
    return p.tokens >= config_.tokens ? sync_action::start_and_apply : sync_action::none;
  }

 private:
  config config_;
};

}  // namespace fedshard::schedule
