#include "fedshard/schedule/wall_clock.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "fedshard/error.hpp"
#include "support/schedule_steps.hpp"

namespace fs = fedshard::schedule;
using fs::sync_action;

using fedshard::test::clock_sync_steps;
using fedshard::test::steps;

TEST_CASE("wall_clock syncs sync k once the group's clock reaches (k + 1) T, without drift") {
  const fs::wall_clock s({.seconds = 1.0, .syncs = 4});
  CHECK(s.run_syncs() == 4);
  static_assert(fs::wall_clock::uses_clock);  // the synchronizer reads the clock after the step
  CHECK(s.due(0) == 1.0);
  CHECK(s.due(2) == 3.0);
  // A fast group (0.3 s a step) and a slow one (0.9 s a step) make their k-th syncs at the
  // first step ending at or after k seconds: different steps, the same count.
  const auto fast = clock_sync_steps(s, 14, [](std::int64_t i) { return 0.3 * double(i + 1); });
  const auto slow = clock_sync_steps(s, 5, [](std::int64_t i) { return 0.9 * double(i + 1); });
  CHECK(fast == steps{3, 6, 9, 13});  // 1.2 s, 2.1 s, 3.0 s, 4.2 s
  CHECK(slow == steps{1, 2, 3, 4});   // 1.8 s, 2.7 s, 3.6 s, 4.5 s
  // Waiting at a sync does not shift the next due time: a step that ends late (2.5 s) is
  // followed by the next sync at 3 s, not 3.5 s.
  const std::vector<double> t{0.5, 1.0, 2.5, 2.9, 3.0, 3.1};
  CHECK(clock_sync_steps(s, 6, [&](std::int64_t i) { return t[static_cast<std::size_t>(i)]; }) ==
        steps{1, 2, 4});
  // A group slower than T syncs after every step until it caught up.
  CHECK(clock_sync_steps(s, 3, [](std::int64_t i) { return 2.5 * double(i + 1); }) ==
        steps{0, 1, 2});
}

TEST_CASE("wall_clock refuses bad settings and arguments, naming what it found") {
  CHECK_THROWS_WITH_AS(
      fs::wall_clock({.seconds = 0.0}),
      doctest::Contains(
          "wall_clock: seconds (T, the time between syncs) must be finite and > 0, found 0"),
      fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(fs::wall_clock({.seconds = -2.5}), doctest::Contains("found -2.5"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(fs::wall_clock({.seconds = std::numeric_limits<double>::quiet_NaN()}),
                       doctest::Contains("found nan"), fedshard::invalid_argument);
  CHECK_THROWS_AS(fs::wall_clock({.seconds = std::numeric_limits<double>::infinity()}),
                  fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(fs::wall_clock({.seconds = 1.0, .syncs = -1}),
                       doctest::Contains("wall_clock: syncs (the syncs after which a run ends) "
                                         "must be >= 1, found -1"),
                       fedshard::invalid_argument);
  const fs::wall_clock s;
  CHECK(s.settings().seconds == 60.0);
  CHECK_THROWS_AS(s.action(2, {}), fedshard::invalid_argument);
}
