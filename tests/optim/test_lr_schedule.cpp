#include "fedshard/optim/lr_schedule.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>

#include "fedshard/error.hpp"

namespace {

using fedshard::optim::constant_lr;
using fedshard::optim::LrSchedule;
using fedshard::optim::warmup_cosine;

struct returns_double {
  double operator()(std::int64_t) const { return 0.1; }
};
struct not_const {
  float operator()(std::int64_t) { return 0.1f; }
};
using lambda_schedule = decltype([](std::int64_t step) {
  return 1.0f / static_cast<float>(step + 1);
});

static_assert(LrSchedule<constant_lr>);
static_assert(LrSchedule<warmup_cosine>);
static_assert(LrSchedule<lambda_schedule>);
static_assert(!LrSchedule<returns_double>);
static_assert(!LrSchedule<not_const>);
static_assert(!LrSchedule<float>);

/// The cosine part of the documented formula, evaluated independently in long double.
float cosine_at(double peak, double low, std::int64_t warmup, std::int64_t total,
                std::int64_t step) {
  const long double progress = static_cast<long double>(step - warmup) / (total - warmup);
  const long double c = std::cos(std::numbers::pi_v<long double> * progress);
  return static_cast<float>(low + (peak - low) * (1 + c) / 2);
}

}  // namespace

TEST_CASE("constant_lr gives its rate at every step") {
  const constant_lr s(3e-4f);
  CHECK(s(0) == 3e-4f);
  CHECK(s(1) == 3e-4f);
  CHECK(s(1'000'000'000'000) == 3e-4f);
  CHECK(s.lr() == 3e-4f);
  CHECK(constant_lr(0.0f)(5) == 0.0f);
}

TEST_CASE("warmup_cosine at its key steps") {
  const float peak = 1e-3f;
  const float low = 1e-4f;
  const warmup_cosine s(peak, 10, 110, low);

  SUBCASE("linear warm-up that reaches the peak at step warmup - 1") {
    CHECK(s(0) == static_cast<float>(static_cast<double>(peak) / 10));
    CHECK(s(4) == static_cast<float>(static_cast<double>(peak) * 5 / 10));
    CHECK(s(9) == peak);
    for (std::int64_t step = 1; step < 10; ++step) CHECK(s(step) > s(step - 1));
  }
  SUBCASE("cosine from the peak at step warmup down towards min_lr") {
    CHECK(s(10) == peak);
    CHECK(s(60) == doctest::Approx((peak + low) / 2).epsilon(1e-6));
    CHECK(s(60) == cosine_at(peak, low, 10, 110, 60));
    CHECK(s(35) == cosine_at(peak, low, 10, 110, 35));
    CHECK(s(109) == cosine_at(peak, low, 10, 110, 109));
    CHECK(s(109) > low);
    CHECK(s(109) < low + 1e-6f);
    for (std::int64_t step = 11; step < 110; ++step) CHECK(s(step) < s(step - 1));
  }
  SUBCASE("min_lr from total_steps on") {
    CHECK(s(110) == low);
    CHECK(s(111) == low);
    CHECK(s(std::numeric_limits<std::int64_t>::max()) == low);
  }
  CHECK(s.peak_lr() == peak);
  CHECK(s.min_lr() == low);
  CHECK(s.warmup_steps() == 10);
  CHECK(s.total_steps() == 110);
}

TEST_CASE("warmup_cosine edge cases: no warm-up, no cosine, min_lr defaults to 0") {
  const warmup_cosine cosine_only(2.0f, 0, 4);
  CHECK(cosine_only(0) == 2.0f);
  CHECK(cosine_only(2) == doctest::Approx(1.0f));
  CHECK(cosine_only(4) == 0.0f);

  const warmup_cosine warmup_only(2.0f, 4, 4, 0.5f);
  CHECK(warmup_only(0) == 0.5f);
  CHECK(warmup_only(3) == 2.0f);
  CHECK(warmup_only(4) == 0.5f);

  const warmup_cosine flat(1.0f, 2, 10, 1.0f);
  for (std::int64_t step = 2; step < 12; ++step) CHECK(flat(step) == 1.0f);

  const warmup_cosine nothing(1.0f, 0, 0, 0.25f);
  CHECK(nothing(0) == 0.25f);
}

TEST_CASE("lr schedules reject bad arguments with a message that names the value") {
  using fedshard::invalid_argument;
  CHECK_THROWS_WITH_AS(constant_lr(-1.0f), doctest::Contains("found -1"), invalid_argument);
  CHECK_THROWS_WITH_AS(constant_lr{std::numeric_limits<float>::infinity()},
                       doctest::Contains("found inf"), invalid_argument);
  CHECK_THROWS_WITH_AS(constant_lr(0.1f)(-1), doctest::Contains("step must be >= 0, found -1"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(warmup_cosine(-1e-3f, 1, 2),
                       doctest::Contains("peak_lr must be finite and >= 0, found -0.001"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(warmup_cosine(std::nanf(""), 1, 2), doctest::Contains("peak_lr"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(warmup_cosine(1e-3f, 1, 2, 2e-3f),
                       doctest::Contains("min_lr must be in [0, peak_lr = 0.001], found 0.002"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(warmup_cosine(1e-3f, 1, 2, -1.0f), doctest::Contains("found -1"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(warmup_cosine(1e-3f, -3, 2),
                       doctest::Contains("warmup_steps must be >= 0, found -3"), invalid_argument);
  CHECK_THROWS_WITH_AS(warmup_cosine(1e-3f, 5, 4),
                       doctest::Contains("total_steps must be >= warmup_steps = 5, found 4"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(warmup_cosine(1e-3f, 5, 10)(-7), doctest::Contains("found -7"),
                       invalid_argument);
}
