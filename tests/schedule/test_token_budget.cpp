#include "fedshard/schedule/token_budget.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "fedshard/error.hpp"
#include "support/schedule_steps.hpp"

namespace fs = fedshard::schedule;
using fs::sync_action;

using fedshard::test::steps;
using fedshard::test::token_sync_steps;

TEST_CASE("token_budget syncs after the step at which the tokens since the last sync reach N") {
  const fs::token_budget s({.tokens = 10, .syncs = 3});
  CHECK(s.run_syncs() == 3);
  CHECK(s.settings().tokens == 10);
  CHECK(s.fragments() == 1);
  CHECK(s.mixing() == 1.0f);
  // 5 per step: exactly N after every second step.
  CHECK(token_sync_steps(s, 8, [](std::int64_t) { return 5; }) == steps{1, 3, 5, 7});
  // 4 per step: 12 >= 10 after step 2; the 2 beyond N are not carried over.
  CHECK(token_sync_steps(s, 9, [](std::int64_t) { return 4; }) == steps{2, 5, 8});
  // Uneven steps: 3, 9 | 1, 1, 20 | 10
  const std::vector<std::int64_t> t{3, 9, 1, 1, 20, 10, 0};
  CHECK(token_sync_steps(s, 7, [&](std::int64_t i) { return t[static_cast<std::size_t>(i)]; }) ==
        steps{1, 4, 5});
  // A step of more than N tokens syncs alone.
  CHECK(token_sync_steps(s, 3, [](std::int64_t) { return 25; }) == steps{0, 1, 2});
}

TEST_CASE("token_budget's answer depends on the progress alone, not on the step") {
  const fs::token_budget s({.tokens = 100, .syncs = 1});
  CHECK(s.action(0, {.step = 0, .tokens = 100, .seconds = 0, .syncs = 0}) ==
        sync_action::start_and_apply);
  CHECK(s.action(0, {.step = 1000, .tokens = 99, .seconds = 1e9, .syncs = 0}) == sync_action::none);
}

TEST_CASE("token_budget refuses bad settings and arguments, naming what it found") {
  CHECK_THROWS_WITH_AS(
      fs::token_budget({.tokens = 0}),
      doctest::Contains(
          "token_budget: tokens (N, the group's tokens between syncs) must be >= 1, found 0"),
      fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(fs::token_budget({.tokens = -3}), doctest::Contains("found -3"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(
      fs::token_budget({.tokens = 8, .syncs = 0}),
      doctest::Contains("token_budget: syncs (the syncs after which a run ends) must be >= 1, "
                        "found 0"),
      fedshard::invalid_argument);
  const fs::token_budget s;
  CHECK(s.settings().tokens == 65536);
  CHECK_THROWS_WITH_AS(s.action(1, {}), doctest::Contains("fragment must be in [0, 1), found 1"),
                       fedshard::invalid_argument);
  CHECK_THROWS_AS(s.action(0, {.step = -1}), fedshard::invalid_argument);
}
