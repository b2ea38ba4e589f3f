#include "fedshard/schedule/sync_schedule.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/schedule/every_step.hpp"
#include "fedshard/schedule/periodic.hpp"
#include "fedshard/schedule/post_local.hpp"
#include "fedshard/schedule/streaming.hpp"
#include "fedshard/schedule/token_budget.hpp"
#include "fedshard/schedule/wall_clock.hpp"

namespace fs = fedshard::schedule;
using fs::sync_action;

namespace probe {

// A complete schedule written only against the requirements, to check that the concept
// accepts exactly what its comment lists; each variant below drops or breaks one member.
struct minimal {
  struct config {
    int n = 0;
  };
  minimal() = default;
  explicit minimal(const config&) {}
  static constexpr std::string_view name = "minimal";
  int fragments() const { return 1; }
  sync_action action(int, std::int64_t, std::int64_t) const { return sync_action::none; }
  float mixing() const { return 1.0f; }
  std::vector<int> fragment_units(int, int) const { return {}; }
  void check(int) const {}
};

struct no_name : minimal {
  using minimal::minimal;
  static constexpr int name = 0;  // not a string_view
};
struct no_config {
  no_config() = default;
  static constexpr std::string_view name = "no_config";
  int fragments() const { return 1; }
  sync_action action(int, std::int64_t, std::int64_t) const { return sync_action::none; }
  float mixing() const { return 1.0f; }
  std::vector<int> fragment_units(int, int) const { return {}; }
  void check(int) const {}
};
struct config_not_aggregate : minimal {
  struct config {
    explicit config(int) {}
  };
};
struct no_config_constructor : minimal {
  struct config {};
};
struct action_returns_bool : minimal {
  bool action(int, std::int64_t, std::int64_t) const { return false; }
};
struct no_mixing {
  struct config {};
  no_mixing() = default;
  explicit no_mixing(const config&) {}
  static constexpr std::string_view name = "no_mixing";
  int fragments() const { return 1; }
  sync_action action(int, std::int64_t, std::int64_t) const { return sync_action::none; }
  std::vector<int> fragment_units(int, int) const { return {}; }
  void check(int) const {}
};
struct no_check {
  struct config {};
  no_check() = default;
  explicit no_check(const config&) {}
  static constexpr std::string_view name = "no_check";
  int fragments() const { return 1; }
  sync_action action(int, std::int64_t, std::int64_t) const { return sync_action::none; }
  float mixing() const { return 1.0f; }
  std::vector<int> fragment_units(int, int) const { return {}; }
};
// action(fragment, progress) but no run_syncs(): a run could not end.
struct progress_without_run_syncs {
  struct config {};
  progress_without_run_syncs() = default;
  explicit progress_without_run_syncs(const config&) {}
  static constexpr std::string_view name = "progress_without_run_syncs";
  int fragments() const { return 1; }
  sync_action action(int, const fs::sync_progress&) const { return sync_action::none; }
  float mixing() const { return 1.0f; }
  std::vector<int> fragment_units(int, int) const { return {}; }
  void check(int) const {}
};
struct no_default_constructor : minimal {
  no_default_constructor() = delete;
  using minimal::minimal;
};

}  // namespace probe

using probe::action_returns_bool;
using probe::config_not_aggregate;
using probe::minimal;
using probe::no_check;
using probe::no_config;
using probe::no_config_constructor;
using probe::no_default_constructor;
using probe::no_mixing;
using probe::no_name;
using probe::progress_without_run_syncs;

TEST_CASE("the schedules model SyncSchedule: four by step, two by progress") {
  static_assert(fs::SyncSchedule<fs::every_step>);
  static_assert(fs::SyncSchedule<fs::periodic>);
  static_assert(fs::SyncSchedule<fs::post_local>);
  static_assert(fs::SyncSchedule<fs::streaming>);
  static_assert(fs::SyncSchedule<minimal>);
  static_assert(fs::SyncSchedule<fs::token_budget> && fs::ProgressSchedule<fs::token_budget>);
  static_assert(fs::SyncSchedule<fs::wall_clock> && fs::ProgressSchedule<fs::wall_clock>);
  static_assert(!fs::StepSchedule<fs::token_budget> && !fs::StepSchedule<fs::wall_clock>);
  static_assert(fs::StepSchedule<fs::periodic> && !fs::ProgressSchedule<fs::periodic>);
  static_assert(!fs::SyncSchedule<progress_without_run_syncs>);
  CHECK(fs::every_step::name == "every_step");
  CHECK(fs::periodic::name == "periodic");
  CHECK(fs::post_local::name == "post_local");
  CHECK(fs::streaming::name == "streaming");
}

TEST_CASE("a type missing or breaking one requirement is not a SyncSchedule") {
  static_assert(!fs::SyncSchedule<no_name>);
  static_assert(!fs::SyncSchedule<no_config>);
  static_assert(!fs::SyncSchedule<config_not_aggregate>);
  static_assert(!fs::SyncSchedule<no_config_constructor>);
  static_assert(!fs::SyncSchedule<action_returns_bool>);
  static_assert(!fs::SyncSchedule<no_mixing>);
  static_assert(!fs::SyncSchedule<no_check>);
  static_assert(!fs::SyncSchedule<no_default_constructor>);
  static_assert(!fs::SyncSchedule<int>);
}

TEST_CASE("sync_action names, starts and applies") {
  CHECK(fs::to_string(sync_action::none) == "none");
  CHECK(fs::to_string(sync_action::start) == "start");
  CHECK(fs::to_string(sync_action::apply) == "apply");
  CHECK(fs::to_string(sync_action::start_and_apply) == "start_and_apply");
  CHECK(fs::to_string(static_cast<sync_action>(9)) == "unknown-sync_action");
  CHECK_FALSE(fs::starts(sync_action::none));
  CHECK(fs::starts(sync_action::start));
  CHECK_FALSE(fs::starts(sync_action::apply));
  CHECK(fs::starts(sync_action::start_and_apply));
  CHECK_FALSE(fs::applies(sync_action::none));
  CHECK_FALSE(fs::applies(sync_action::start));
  CHECK(fs::applies(sync_action::apply));
  CHECK(fs::applies(sync_action::start_and_apply));
}

TEST_CASE("strided_units partitions the units by u % P, ascending") {
  for (int p_count = 1; p_count <= 5; ++p_count) {
    for (int n = p_count; n <= 11; ++n) {
      std::vector<int> seen(static_cast<std::size_t>(n), 0);
      for (int p = 0; p < p_count; ++p) {
        const auto units = fs::detail::strided_units("t", p, p_count, n);
        CHECK_FALSE(units.empty());
        for (std::size_t i = 0; i < units.size(); ++i) {
          CHECK(units[i] % p_count == p);
          if (i > 0) CHECK(units[i] > units[i - 1]);
          ++seen[static_cast<std::size_t>(units[i])];
        }
      }
      for (int c : seen) CHECK(c == 1);
    }
  }
  CHECK(fs::detail::strided_units("t", 1, 3, 7) == std::vector<int>{1, 4});
}

TEST_CASE("strided_units and check_units reject impossible cuts") {
  CHECK_THROWS_WITH_AS(fs::detail::strided_units("streaming", 0, 4, 3),
                       doctest::Contains("streaming: 4 fragments but the model has only 3 units"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(fs::detail::check_units("every_step", 1, 0),
                       doctest::Contains("at least one unit, found 0"), fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(fs::detail::strided_units("t", 3, 3, 9),
                       doctest::Contains("fragment must be in [0, 3), found 3"),
                       fedshard::invalid_argument);
  CHECK_THROWS_AS(fs::detail::strided_units("t", -1, 3, 9), fedshard::invalid_argument);
}

// ---- The guarantees of requirement 3, checked on every schedule the same way ----

namespace {

// Replays steps [0, last] and checks: the answer is repeatable; starts and applies alternate
// per fragment, beginning with a start; a blocking_only schedule (non-streaming) returns only
// none or start_and_apply; the final step (total > 0) applies every fragment and leaves none
// in flight.
template <class S>
void check_guarantees(const S& s, std::int64_t total, std::int64_t last, bool blocking_only) {
  const int p_count = s.fragments();
  std::vector<bool> in_flight(static_cast<std::size_t>(p_count), false);
  for (std::int64_t step = 0; step <= last; ++step) {
    for (int p = 0; p < p_count; ++p) {
      const sync_action a = s.action(p, step, total);
      CHECK(a == s.action(p, step, total));
      if (blocking_only) CHECK((a == sync_action::none || a == sync_action::start_and_apply));
      auto flight = in_flight[static_cast<std::size_t>(p)];
      if (a == sync_action::start) CHECK_FALSE(flight);
      if (a == sync_action::apply) CHECK(flight);
      if (a == sync_action::start_and_apply) CHECK_FALSE(flight);
      if (a == sync_action::start) in_flight[static_cast<std::size_t>(p)] = true;
      if (a == sync_action::apply) in_flight[static_cast<std::size_t>(p)] = false;
      if (total > 0 && step == total - 1) {
        INFO("fragment ", p, " at the final step ", step);
        CHECK(fs::applies(a));
        CHECK_FALSE(in_flight[static_cast<std::size_t>(p)]);
      }
    }
  }
}

template <class S>
void check_bad_arguments(const S& s) {
  CHECK_THROWS_WITH_AS(
      s.action(s.fragments(), 0, 10),
      doctest::Contains(("fragment must be in [0, " + std::to_string(s.fragments()) + "), found " +
                         std::to_string(s.fragments()))
                            .c_str()),
      fedshard::invalid_argument);
  CHECK_THROWS_AS(s.action(-1, 0, 10), fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(s.action(0, -1, 10), doctest::Contains("step must be >= 0, found -1"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(s.check(0), doctest::Contains(std::string(S::name).c_str()),
                       fedshard::invalid_argument);
  CHECK_THROWS_AS(s.fragment_units(0, 0), fedshard::invalid_argument);
}

}  // namespace

TEST_CASE("every_step and periodic keep requirement 3's guarantees") {
  auto check_one = [](const auto& s) {
    for (std::int64_t total : {-1, 0, 1, 2, 3, 6, 7, 10}) check_guarantees(s, total, 12, true);
    check_bad_arguments(s);
    CHECK(s.fragments() == 1);
    CHECK(s.mixing() == 1.0f);
    s.check(1);
  };
  check_one(fs::every_step{});
  for (int k : {1, 3, 7, 8}) check_one(fs::periodic({.period = k}));
}

TEST_CASE("post_local and streaming keep requirement 3's guarantees") {
  for (const fs::post_local::config c :
       {fs::post_local::config{}, fs::post_local::config{3, 2}, fs::post_local::config{0, 4}}) {
    const fs::post_local s(c);
    for (std::int64_t total : {0, 1, 2, 5, 9}) check_guarantees(s, total, 12, true);
    check_bad_arguments(s);
  }
  for (const fs::streaming::config c :
       {fs::streaming::config{}, fs::streaming::config{12, 3, 0, 1.0f},
        fs::streaming::config{12, 3, 3, 0.5f}, fs::streaming::config{5, 5, 0, 1.0f}}) {
    const fs::streaming s(c);
    for (std::int64_t total : {0, 1, 4, 11, 12, 13, 25})
      check_guarantees(s, total, 3 * c.period, false);
    check_bad_arguments(s);
  }
}
