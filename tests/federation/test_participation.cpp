/// Tests of the federation's participation stage (federation/participation.hpp): the sample's
/// size, its values for fixed seeds (worked out apart from the library: a Fisher-Yates
/// shuffle driven by splitmix64, seeded with seed ^ mix(round), first k kept, ascending),
/// masks drawn among eligible groups, and the settings it refuses.

#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/federation/participation.hpp"

namespace {
using namespace fedshard;
using federation::participation;
using federation::sample_of;
using federation::sampled_mask;
using mask = std::vector<std::uint8_t>;
}  // namespace

TEST_CASE("participation: samples of fixed seeds, round by round") {
  // 4 groups, fraction 0.5, seed 42: k = ceil(0.5 x 4) = 2.
  const participation half{.fraction = 0.5, .min_groups = 1, .seed = 42};
  CHECK(sample_of({0, 1, 2, 3}, half, 0) == std::vector<int>{0, 2});
  CHECK(sample_of({0, 1, 2, 3}, half, 1) == std::vector<int>{0, 3});
  CHECK(sample_of({0, 1, 2, 3}, half, 2) == std::vector<int>{1, 2});
  CHECK(sample_of({0, 1, 2, 3}, half, 3) == std::vector<int>{2, 3});
  // 10 groups, fraction 0.3, seed 7: k = 3.
  const participation third{.fraction = 0.3, .min_groups = 1, .seed = 7};
  const std::vector<int> ten{0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  CHECK(sample_of(ten, third, 0) == std::vector<int>{0, 1, 4});
  CHECK(sample_of(ten, third, 1) == std::vector<int>{2, 4, 6});
}

TEST_CASE("participation: how many groups a sample holds") {
  const std::vector<int> ten{0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  CHECK(sample_of(ten, {.fraction = 1.0}, 5) == ten);                           // everyone
  CHECK(sample_of(ten, {.fraction = 0.1, .min_groups = 5}, 5).size() == 5);     // min_groups
  CHECK(sample_of({3, 8}, {.fraction = 0.1, .min_groups = 9}, 5).size() == 2);  // at most all
  CHECK(sample_of({}, {.fraction = 0.5}, 5).empty());
  CHECK(sample_of({6}, {.fraction = 0.01}, 5) == std::vector<int>{6});  // at least one
}

TEST_CASE("participation: a mask drawn among the eligible groups") {
  // Eligible {1, 2, 4, 5} of 6 (e.g. an elastic round whose groups 0 and 3 are joiners):
  // the sample of round 0 with seed 42 picks positions {0, 2} of that list, i.e. groups 1, 4.
  const participation half{.fraction = 0.5, .min_groups = 1, .seed = 42};
  CHECK(sampled_mask(6, mask{0, 1, 1, 0, 1, 1}, half, 0) == mask{0, 1, 0, 0, 1, 0});
  CHECK(sampled_mask(4, {}, half, 1) == mask{1, 0, 0, 1});  // all eligible: {0, 3}
  CHECK(sampled_mask(3, {}, {}, 9) == mask{1, 1, 1});
  CHECK_THROWS_WITH_AS((void)sampled_mask(3, mask{1, 1}, half, 0),
                       doctest::Contains("a mask of 3 groups or none, found 2"), invalid_argument);
}

TEST_CASE("participation: settings it cannot use are refused with what was expected") {
  CHECK_THROWS_WITH_AS(federation::check({.fraction = 0}),
                       doctest::Contains("fraction must be in (0, 1], found 0"), invalid_argument);
  CHECK_THROWS_WITH_AS(federation::check({.fraction = 1.5}),
                       doctest::Contains("fraction must be in (0, 1], found 1.5"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(federation::check({.fraction = 0.5, .min_groups = 0}),
                       doctest::Contains("min_groups must be >= 1, found 0"), invalid_argument);
  CHECK_NOTHROW(federation::check({}));
}
