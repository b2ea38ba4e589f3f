#include "fedshard/schedule/every_step.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "fedshard/error.hpp"

namespace fs = fedshard::schedule;
using fs::sync_action;

TEST_CASE("every_step syncs the whole model after every step") {
  const fs::every_step s;
  CHECK(s.fragments() == 1);
  CHECK(s.mixing() == 1.0f);
  for (std::int64_t total : {-1, 0, 1, 5})
    for (std::int64_t step = 0; step < 8; ++step)
      CHECK(s.action(0, step, total) == sync_action::start_and_apply);
  CHECK(s.action(0, std::int64_t{1} << 40, 0) == sync_action::start_and_apply);
}

TEST_CASE("every_step's one fragment holds every unit") {
  const fs::every_step s{fs::every_step::config{}};
  CHECK(s.fragment_units(0, 1) == std::vector<int>{0});
  CHECK(s.fragment_units(0, 4) == std::vector<int>{0, 1, 2, 3});
  s.check(1);
  s.check(100);
}

TEST_CASE("every_step rejects bad fragments, steps and unit counts") {
  const fs::every_step s;
  CHECK_THROWS_WITH_AS(s.action(1, 0, 5), doctest::Contains("fragment must be in [0, 1), found 1"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(s.action(0, -3, 5), doctest::Contains("step must be >= 0, found -3"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(
      s.check(0), doctest::Contains("every_step: the model must have at least one unit, found 0"),
      fedshard::invalid_argument);
  CHECK_THROWS_AS(s.fragment_units(1, 4), fedshard::invalid_argument);
  CHECK_THROWS_AS(s.fragment_units(0, -1), fedshard::invalid_argument);
}
