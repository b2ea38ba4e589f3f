#include "fedshard/mesh/axis.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <set>
#include <string>
#include <string_view>

using fedshard::axis;

TEST_CASE("all_axes lists the five axes once, innermost first") {
  static_assert(std::size(fedshard::all_axes) == 5);
  const axis expected[] = {axis::shard, axis::replica, axis::federation, axis::group, axis::world};
  for (std::size_t i = 0; i < 5; ++i) CHECK(fedshard::all_axes[i] == expected[i]);
}

TEST_CASE("to_string names every axis") {
  static_assert(fedshard::to_string(axis::federation) == "federation");
  CHECK(fedshard::to_string(axis::shard) == "shard");
  CHECK(fedshard::to_string(axis::replica) == "replica");
  CHECK(fedshard::to_string(axis::federation) == "federation");
  CHECK(fedshard::to_string(axis::group) == "group");
  CHECK(fedshard::to_string(axis::world) == "world");
  std::set<std::string_view> names;
  for (axis a : fedshard::all_axes) names.insert(fedshard::to_string(a));
  CHECK(names.size() == 5);
}

TEST_CASE("to_string of a value outside the enum says so") {
  CHECK(fedshard::to_string(static_cast<axis>(200)) == "unknown-axis");
}
