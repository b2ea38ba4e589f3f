// Element ownership: FEAST width slices (the first ceil(c x rows) rows of each tensor), Collate's
// seeded per-round masks (a pure function of seed, round, group, unit), more than 64 groups,
// and bad ranges refused with the group, unit and numbers.
#include "fedshard/shard/element_ownership.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

using namespace fedshard;
using shard::element_range;
using shard::element_ranges;

namespace {

/// Unit "a": w [4, 3] (elements 0..11), b [4] (12..15); unit "s": a scalar (element 0).
flat_layout two_units() {
  return flat_layout({{"a", {{"w", {4, 3}}, {"b", {4}}}}, {"s", {{"x", {}}}}}, 1);
}

}  // namespace

TEST_CASE("feast_slices: the first ceil(c x rows) rows of each tensor") {
  const flat_layout l = two_units();
  const double caps[] = {1.0, 0.5, 0.3};
  const auto o = shard::feast_slices(l, caps);
  REQUIRE(o.groups() == 3);
  o.check(l, 3);
  // c = 1: all 4 rows of w and b, touching: one range [0, 16); the scalar: [0, 1).
  CHECK(o.held[0][0] == element_ranges{{0, 16}});
  // c = 0.5: 2 rows of w (elements 0..5) and 2 of b (12, 13).
  CHECK(o.held[1][0] == element_ranges{{0, 6}, {12, 14}});
  // c = 0.3: ceil(1.2) = 2 rows of w and b: the same as c = 0.5.
  CHECK(o.held[2][0] == element_ranges{{0, 6}, {12, 14}});
  // a scalar is one row, held by every capability: ceil(0.3 x 1) = 1.
  for (int g = 0; g < 3; ++g)
    CHECK(o.held[static_cast<std::size_t>(g)][1] == element_ranges{{0, 1}});
  CHECK(o.holds(1, 0, 13));
  CHECK_FALSE(o.holds(1, 0, 6));
  CHECK(o.held_count(1, 0, 16) == 8);
  const double bad[] = {1.0, 0.0};
  CHECK_THROWS_WITH_AS(
      shard::feast_slices(l, bad),
      doctest::Contains("feast_slices: group 1's capability must be in (0, 1], found 0"),
      invalid_argument);
}

TEST_CASE("collate_masks: a pure function of (seed, round, group, unit); rounds differ") {
  const flat_layout l({{"u", {{"w", {1000}}}}}, 1);
  const shard::collate_config c{.groups = 3, .fraction = 0.25, .seed = 7, .block = 10};
  const auto r0 = shard::collate_masks(l, c, 0), again = shard::collate_masks(l, c, 0);
  const auto r1 = shard::collate_masks(l, c, 1);
  r0.check(l, 3);
  r1.check(l, 3);
  CHECK(r0.held == again.held);
  CHECK(r0.held != r1.held);
  CHECK(r0.held[0] != r0.held[1]);
  for (int g = 0; g < 3; ++g) {
    const std::size_t n = r0.held_count(g, 0, 1000);
    CHECK(n % 10 == 0);  // whole blocks of 10
    CHECK(n > 100);      // about 250 of 1000 elements
    CHECK(n < 400);
    for (std::size_t e = 0; e < 1000; ++e)
      CHECK(r0.holds(g, 0, e) == shard::collate_holds(c, 0, g, 0, e / 10));
  }
  // The draw by hand: mix64 chained over seed, round, group, unit, block; the top 53 bits
  // scaled to [0, 1) against the fraction.
  std::uint64_t h = mix64(mix64(mix64(mix64(mix64(7) ^ 1) ^ 2) ^ 0) ^ 5);
  CHECK(shard::collate_holds(c, 1, 2, 0, 5) == (static_cast<double>(h >> 11) * 0x1p-53 < 0.25));
  const shard::collate_config full{.groups = 2, .fraction = 1.0};
  CHECK(shard::collate_masks(l, full, 3).held[1][0] == element_ranges{{0, 1000}});
}

TEST_CASE("more than 64 groups") {
  const flat_layout l = two_units();
  std::vector<double> caps(70);
  for (std::size_t g = 0; g < caps.size(); ++g) caps[g] = static_cast<double>(g + 1) / 70.0;
  const auto o = shard::feast_slices(l, caps);
  o.check(l, 70);
  CHECK(o.held[69][0] == element_ranges{{0, 16}});
  CHECK(o.held[0][0] == element_ranges{{0, 3}, {12, 13}});  // ceil(4 / 70) = 1 row
  const auto m = shard::collate_masks(l, {.groups = 70, .fraction = 0.5, .seed = 1}, 4);
  m.check(l, 70);
}

TEST_CASE("bad ownership is refused with the group, unit and numbers") {
  const flat_layout l = two_units();
  using E = shard::element_ownership;
  const E ok{{{{{0, 16}}, {}}, {{{2, 3}, {5, 8}}, {{0, 1}}}}};
  ok.check(l, 2);
  CHECK_THROWS_WITH_AS(
      ok.check(l, 3),
      doctest::Contains("element_ownership: it lists the elements of 2 groups, but the mesh has 3"),
      invalid_argument);
  const E few{{{{{0, 16}}}}};
  CHECK_THROWS_WITH_AS(
      few.check(l, 1),
      doctest::Contains("element_ownership: group 0 lists ranges of 1 units, but the model "
                        "declares 2"),
      invalid_argument);
  const E past{{{{{0, 17}}, {}}}};
  CHECK_THROWS_WITH_AS(
      past.check(l, 1),
      doctest::Contains("element_ownership: group 0, unit 'a': range 0 [0, 17) runs past the "
                        "unit's 16 elements"),
      invalid_argument);
  const E overlap{{{{{0, 5}, {4, 8}}, {}}}};
  CHECK_THROWS_WITH_AS(
      overlap.check(l, 1),
      doctest::Contains("element_ownership: group 0, unit 'a': range 1 [4, 8) starts before the "
                        "end 5 of the range before it; expected sorted, disjoint ranges"),
      invalid_argument);
  const E empty{{{{{3, 3}}, {}}}};
  CHECK_THROWS_WITH_AS(
      empty.check(l, 1),
      doctest::Contains("element_ownership: group 0, unit 'a': range 0 is [3, 3); expected a "
                        "non-empty range (begin < end)"),
      invalid_argument);
}
