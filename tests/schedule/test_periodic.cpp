#include "fedshard/schedule/periodic.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "fedshard/error.hpp"
#include "support/schedule_steps.hpp"

namespace fs = fedshard::schedule;
using fs::sync_action;

namespace {

using fedshard::test::steps;
using fedshard::test::sync_steps;

fs::periodic every(int k) {
  return fs::periodic({.period = k});
}

}  // namespace

TEST_CASE("periodic syncs after steps K-1, 2K-1, ... and the final step") {
  const fs::periodic s = every(3);
  CHECK(s.period() == 3);
  CHECK(s.settings().period == 3);
  CHECK(sync_steps(s, 9, 9) == steps{2, 5, 8});
  CHECK(sync_steps(s, 10, 10) == steps{2, 5, 8, 9});
  CHECK(sync_steps(s, 11, 11) == steps{2, 5, 8, 10});
  CHECK(sync_steps(s, 1, 1) == steps{0});
  CHECK(sync_steps(s, 2, 2) == steps{1});
}

TEST_CASE("periodic with K = 1 syncs every step") {
  const fs::periodic s = every(1);
  CHECK(sync_steps(s, 5, 5) == steps{0, 1, 2, 3, 4});
  CHECK(sync_steps(s, 0, 4) == steps{0, 1, 2, 3});
}

TEST_CASE("periodic with K larger than the run syncs only at the final step") {
  const fs::periodic s;  // K = 8 by default
  CHECK(s.period() == 8);
  CHECK(sync_steps(s, 5, 5) == steps{4});
  CHECK(sync_steps(s, 8, 8) == steps{7});
}

TEST_CASE("periodic with an unknown total has no final-step sync") {
  const fs::periodic s = every(4);
  CHECK(sync_steps(s, 0, 10) == steps{3, 7});
  CHECK(sync_steps(s, -1, 10) == steps{3, 7});
}

TEST_CASE("periodic past the final step keeps its period") {
  const fs::periodic s = every(4);
  CHECK(sync_steps(s, 6, 13) == steps{3, 5, 7, 11});
}

TEST_CASE("periodic refuses K < 1, naming the value") {
  CHECK_THROWS_WITH_AS(
      every(0),
      doctest::Contains("periodic: period (K, the number of steps between syncs) must be >= 1, "
                        "found 0"),
      fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(every(-5), doctest::Contains("found -5"), fedshard::invalid_argument);
  CHECK(every(500).period() == 500);
}

TEST_CASE("periodic's one fragment holds every unit; bad arguments throw") {
  const fs::periodic s{fs::periodic::config{.period = 2}};
  CHECK(s.fragments() == 1);
  CHECK(s.mixing() == 1.0f);
  CHECK(s.fragment_units(0, 3) == std::vector<int>{0, 1, 2});
  s.check(3);
  CHECK_THROWS_WITH_AS(s.check(0),
                       doctest::Contains("periodic: the model must have at least one unit"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(s.action(2, 0, 5), doctest::Contains("fragment must be in [0, 1), found 2"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(s.action(0, -1, 5), doctest::Contains("step must be >= 0, found -1"),
                       fedshard::invalid_argument);
}
