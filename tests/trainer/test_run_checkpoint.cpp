/// The manifest's ownership field (trainer/run_checkpoint.hpp): left out when every group
/// holds every unit, else the group count and each unit's holders, written out by hand.

#include <doctest/doctest.h>

#include <string>

#include "fedshard/shard/ownership.hpp"
#include "fedshard/trainer/run_checkpoint.hpp"

TEST_CASE("run_checkpoint: the ownership field names each unit's holders, or nothing") {
  using fedshard::checkpoint::ownership_field;
  CHECK(ownership_field(fedshard::shard::ownership{}).empty());  // every group holds every unit
  // 3 groups, 3 units: unit 0 held by group 0, unit 1 by groups 0 and 1, unit 2 by all.
  fedshard::shard::ownership o;
  o.groups = 3;
  o.holders = {0b001, 0b011, 0b111};
  CHECK(ownership_field(o) == "3 groups: {0} {0, 1} {0, 1, 2}");
}
