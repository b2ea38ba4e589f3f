#include "fedshard/schedule/streaming.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <set>
#include <vector>

#include "fedshard/error.hpp"

namespace fs = fedshard::schedule;
using fs::sync_action;

namespace {

using steps = std::vector<std::int64_t>;

// The steps in [0, n) at which `fragment` gets `wanted`.
steps steps_with(const fs::streaming& s, int fragment, sync_action wanted, std::int64_t total,
                 std::int64_t n) {
  steps out;
  for (std::int64_t step = 0; step < n; ++step)
    if (s.action(fragment, step, total) == wanted) out.push_back(step);
  return out;
}

// The H = 12, P = 3 example: offsets floor(12·(p+1)/3) % 12 = 4, 8, 0, so fragment p syncs
// after step 3, 7 or 11 of each period.
constexpr std::int64_t first_sync_h12_p3[] = {3, 7, 11};

}  // namespace

TEST_CASE("streaming offsets are floor(H·(p+1)/P) % H and distinct") {
  const fs::streaming s({.period = 12, .fragments = 3});
  CHECK(s.offset(0) == 4);
  CHECK(s.offset(1) == 8);
  CHECK(s.offset(2) == 0);
  const fs::streaming s5({.period = 10, .fragments = 4});
  CHECK(s5.offset(0) == 2);
  CHECK(s5.offset(1) == 5);
  CHECK(s5.offset(2) == 7);
  CHECK(s5.offset(3) == 0);
  for (int h = 1; h <= 16; ++h)
    for (int p_count = 1; p_count <= h; ++p_count) {
      const fs::streaming sp({.period = h, .fragments = p_count});
      std::set<int> offsets;
      for (int p = 0; p < p_count; ++p) {
        CHECK(sp.offset(p) >= 0);
        CHECK(sp.offset(p) < h);
        offsets.insert(sp.offset(p));
      }
      CHECK(offsets.size() == static_cast<std::size_t>(p_count));
    }
  CHECK_THROWS_AS(s.offset(3), fedshard::invalid_argument);
}

TEST_CASE("streaming syncs each fragment once per period at its offset (tau = 0)") {
  const fs::streaming s({.period = 12, .fragments = 3, .delay = 0});
  const std::int64_t periods = 4;
  for (int p = 0; p < 3; ++p) {
    steps expected;
    for (std::int64_t n = 0; n < periods; ++n) expected.push_back(n * 12 + first_sync_h12_p3[p]);
    CHECK(steps_with(s, p, sync_action::start_and_apply, 0, periods * 12) == expected);
    CHECK(steps_with(s, p, sync_action::start, 0, periods * 12).empty());
    CHECK(steps_with(s, p, sync_action::apply, 0, periods * 12).empty());
    for (std::int64_t step : expected) CHECK((step + 1) % 12 == s.offset(p));
  }
}

TEST_CASE("streaming starts each fragment's all_reduce tau steps before it applies it") {
  const fs::streaming s({.period = 12, .fragments = 3, .delay = 2});
  const std::int64_t periods = 4;
  for (int p = 0; p < 3; ++p) {
    steps applies;
    steps starts;
    for (std::int64_t n = 0; n < periods; ++n) {
      applies.push_back(n * 12 + first_sync_h12_p3[p]);
      starts.push_back(n * 12 + first_sync_h12_p3[p] - 2);
    }
    CHECK(steps_with(s, p, sync_action::apply, -1, periods * 12) == applies);
    CHECK(steps_with(s, p, sync_action::start, -1, periods * 12) == starts);
    CHECK(steps_with(s, p, sync_action::start_and_apply, -1, periods * 12).empty());
  }
}

TEST_CASE("streaming keeps at most one fragment in flight and every sync starts inside the run") {
  for (int h = 1; h <= 12; ++h)
    for (int p_count = 1; p_count <= h; ++p_count)
      for (int tau = 0; tau < h / p_count; ++tau) {
        const fs::streaming s({.period = h, .fragments = p_count, .delay = tau});
        std::vector<std::int64_t> started(static_cast<std::size_t>(p_count), -1);
        std::vector<int> syncs(static_cast<std::size_t>(p_count), 0);
        for (std::int64_t step = 0; step < 3 * h; ++step) {
          for (int p = 0; p < p_count; ++p) {
            const sync_action a = s.action(p, step, 0);
            auto& from = started[static_cast<std::size_t>(p)];
            if (a == sync_action::start) {
              CHECK(from == -1);
              from = step;
            } else if (a == sync_action::apply) {
              REQUIRE(from >= 0);
              CHECK(step - from == tau);
              from = -1;
            }
            if (fs::applies(a)) {
              ++syncs[static_cast<std::size_t>(p)];
              CHECK((step + 1) % h == s.offset(p));
            }
          }
          int in_flight = 0;
          for (auto from : started) in_flight += from >= 0 ? 1 : 0;
          CHECK(in_flight <= 1);
        }
        for (int c : syncs) CHECK(c == 3);
      }
}

TEST_CASE("streaming's final step syncs every fragment") {
  // H = 12, P = 3, tau = 2: fragment p starts at steps 1, 5, 9 (+12n), applies at 3, 7, 11.
  const fs::streaming s({.period = 12, .fragments = 3, .delay = 2});
  SUBCASE("an in-flight fragment is applied early, the others sync at once") {
    // Final step 10: fragment 2 started at 9 (due at 11) -> apply.
    CHECK(s.action(0, 10, 11) == sync_action::start_and_apply);
    CHECK(s.action(1, 10, 11) == sync_action::start_and_apply);
    CHECK(s.action(2, 9, 11) == sync_action::start);
    CHECK(s.action(2, 10, 11) == sync_action::apply);
  }
  SUBCASE("a fragment due at the final step is applied there") {
    CHECK(s.action(2, 11, 12) == sync_action::apply);
    CHECK(s.action(0, 11, 12) == sync_action::start_and_apply);
    CHECK(s.action(1, 11, 12) == sync_action::start_and_apply);
  }
  SUBCASE("a start that falls on the final step becomes start_and_apply") {
    CHECK(s.action(2, 9, 10) == sync_action::start_and_apply);
  }
  SUBCASE("a short run: the first fragment is in flight at the final step") {
    CHECK(s.action(0, 0, 3) == sync_action::none);
    CHECK(s.action(0, 1, 3) == sync_action::start);
    CHECK(s.action(0, 2, 3) == sync_action::apply);
    CHECK(s.action(1, 2, 3) == sync_action::start_and_apply);
    CHECK(s.action(2, 2, 3) == sync_action::start_and_apply);
    CHECK(s.action(0, 0, 1) == sync_action::start_and_apply);
  }
  SUBCASE("after the final step the regular pattern resumes; consumed syncs are not applied") {
    CHECK(s.action(2, 11, 11) == sync_action::none);  // its all_reduce was applied at 10
    CHECK(s.action(0, 13, 11) == sync_action::start);
    CHECK(s.action(0, 15, 11) == sync_action::apply);
    CHECK(s.action(2, 21, 11) == sync_action::start);
    CHECK(s.action(2, 23, 11) == sync_action::apply);
  }
  SUBCASE("with tau = 0 the final step is start_and_apply for every fragment") {
    const fs::streaming s0({.period = 12, .fragments = 3, .delay = 0});
    for (int p = 0; p < 3; ++p)
      for (std::int64_t total : {1, 5, 11, 12, 30})
        CHECK(s0.action(p, total - 1, total) == sync_action::start_and_apply);
  }
}

TEST_CASE("streaming fragments are strided unit sets that partition the model") {
  const fs::streaming s({.period = 12, .fragments = 3});
  CHECK(s.fragment_units(0, 7) == std::vector<int>{0, 3, 6});
  CHECK(s.fragment_units(1, 7) == std::vector<int>{1, 4});
  CHECK(s.fragment_units(2, 7) == std::vector<int>{2, 5});
  CHECK(s.fragment_units(2, 3) == std::vector<int>{2});
  s.check(3);
  s.check(32);
}

TEST_CASE("streaming mixes with alpha and exposes its settings") {
  const fs::streaming s({.period = 12, .fragments = 3, .delay = 1, .alpha = 0.5f});
  CHECK(s.mixing() == 0.5f);
  CHECK(s.fragments() == 3);
  CHECK(s.settings().period == 12);
  CHECK(s.settings().delay == 1);
  const fs::streaming defaults;
  CHECK(defaults.settings().period == 100);
  CHECK(defaults.fragments() == 2);
  CHECK(defaults.settings().delay == 0);
  CHECK(defaults.mixing() == 1.0f);
}

TEST_CASE("streaming rejects configurations that cannot work, naming the numbers") {
  using cfg = fs::streaming::config;
  auto make = [](cfg c) { return fs::streaming(c); };
  CHECK_THROWS_WITH_AS(make({.period = 0}), doctest::Contains("period (H) must be >= 1, found 0"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(make({.period = 12, .fragments = 0}),
                       doctest::Contains("fragments (P) must be >= 1, found 0"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(make({.period = 12, .fragments = 13}),
                       doctest::Contains("found P = 13 > H = 12"), fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(make({.period = 12, .fragments = 3, .delay = 12}),
                       doctest::Contains("delay (tau) must be in [0, period) = [0, 12), found 12"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(make({.period = 12, .fragments = 3, .delay = -1}),
                       doctest::Contains("found -1"), fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(
      make({.period = 12, .fragments = 3, .delay = 4}),
      doctest::Contains("delay (tau) must be < floor(period / fragments) = floor(12 / 3) = 4"),
      fedshard::invalid_argument);
  CHECK_NOTHROW(make({.period = 12, .fragments = 3, .delay = 3}));
  CHECK_NOTHROW(make({.period = 12, .fragments = 12, .delay = 0}));
  CHECK_THROWS_AS(make({.period = 12, .fragments = 12, .delay = 1}), fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(make({.period = 12, .fragments = 3, .alpha = 0.0f}),
                       doctest::Contains("alpha (mixing factor) must be in (0, 1], found 0"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(make({.period = 12, .fragments = 3, .alpha = 1.5f}),
                       doctest::Contains("found 1.5"), fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(make({.period = 12, .fragments = 3, .alpha = -0.25f}),
                       doctest::Contains("found -0.25"), fedshard::invalid_argument);
  CHECK_THROWS_AS(make({.period = 12, .fragments = 3, .alpha = std::nanf("")}),
                  fedshard::invalid_argument);
}

TEST_CASE("streaming rejects more fragments than units and bad action arguments") {
  const fs::streaming s({.period = 12, .fragments = 4});
  CHECK_THROWS_WITH_AS(s.check(3),
                       doctest::Contains("streaming: 4 fragments but the model has only 3 units"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(s.fragment_units(0, 3),
                       doctest::Contains("streaming: 4 fragments but the model has only 3 units"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(s.action(4, 0, 10), doctest::Contains("fragment must be in [0, 4), found 4"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(s.action(0, -2, 10), doctest::Contains("step must be >= 0, found -2"),
                       fedshard::invalid_argument);
}
