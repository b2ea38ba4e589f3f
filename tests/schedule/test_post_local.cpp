#include "fedshard/schedule/post_local.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "fedshard/error.hpp"
#include "support/schedule_steps.hpp"

namespace fs = fedshard::schedule;
using fs::sync_action;

using fedshard::test::steps;
using fedshard::test::sync_steps;

TEST_CASE("post_local syncs every step before switch_step, then every k steps and at the end") {
  const fs::post_local s({.switch_step = 4, .k = 3});
  CHECK(sync_steps(s, 12, 12) == steps{0, 1, 2, 3, 6, 9, 11});
  CHECK(sync_steps(s, 10, 10) == steps{0, 1, 2, 3, 6, 9});
  CHECK(sync_steps(s, 0, 12) == steps{0, 1, 2, 3, 6, 9});
  CHECK(sync_steps(s, 3, 3) == steps{0, 1, 2});
  CHECK(s.settings().switch_step == 4);
  CHECK(s.settings().k == 3);
}

TEST_CASE("post_local with a switch after the run syncs every step") {
  const fs::post_local s({.switch_step = 100, .k = 5});
  CHECK(sync_steps(s, 6, 6) == steps{0, 1, 2, 3, 4, 5});
}

TEST_CASE("post_local with k larger than the rest of the run syncs at the final step") {
  const fs::post_local s({.switch_step = 2, .k = 50});
  CHECK(sync_steps(s, 7, 7) == steps{0, 1, 6});
  CHECK(sync_steps(s, -1, 7) == steps{0, 1});
}

TEST_CASE("post_local defaults to every_step; switch_step = 0 is periodic<k>") {
  const fs::post_local every;
  CHECK(sync_steps(every, 5, 5) == steps{0, 1, 2, 3, 4});
  const fs::post_local k3({.switch_step = 0, .k = 3});
  for (std::int64_t total = 1; total <= 10; ++total) {
    steps expected;
    for (std::int64_t step = 0; step < total; ++step)
      if ((step + 1) % 3 == 0 || step == total - 1) expected.push_back(step);
    CHECK(sync_steps(k3, total, total) == expected);
  }
}

TEST_CASE("post_local rejects k < 1 and switch_step < 0, naming the value") {
  CHECK_THROWS_WITH_AS(
      fs::post_local({.switch_step = 4, .k = 0}),
      doctest::Contains(
          "post_local: k (steps between syncs after switch_step) must be >= 1, found 0"),
      fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(fs::post_local({.k = -2}), doctest::Contains("found -2"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(fs::post_local({.switch_step = -1, .k = 2}),
                       doctest::Contains("post_local: switch_step must be >= 0, found -1"),
                       fedshard::invalid_argument);
}

TEST_CASE("post_local's one fragment holds every unit; bad arguments throw") {
  const fs::post_local s({.switch_step = 1, .k = 2});
  CHECK(s.fragments() == 1);
  CHECK(s.mixing() == 1.0f);
  CHECK(s.fragment_units(0, 2) == std::vector<int>{0, 1});
  CHECK_THROWS_AS(s.check(0), fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(s.action(1, 0, 5), doctest::Contains("fragment must be in [0, 1), found 1"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(s.action(0, -1, 5), doctest::Contains("step must be >= 0, found -1"),
                       fedshard::invalid_argument);
}
