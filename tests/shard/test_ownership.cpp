// Ownership masks: which groups hold which units. A bad mask is refused with the unit and the
// numbers; a group's shard engine allocates only the units it holds, plans only their ops,
// and refuses the others in every hook.
#include "fedshard/shard/ownership.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/shard/engine.hpp"
#include "fedshard/shard/hybrid_shard.hpp"
#include "support/spawn_ranks.hpp"

using namespace fedshard;
using shard::groups_of;

namespace {

std::vector<unit_spec> three_units() {
  return {{"dense", {{"w", {100}}}}, {"e0", {{"w", {40}}}}, {"e1", {{"w", {40}}}}};
}

}  // namespace

TEST_CASE("group sets, holds, and the offsets of the held units") {
  CHECK(groups_of({0, 2}) == 0b101);
  CHECK(shard::all_groups(3) == 0b111);
  const shard::ownership none;
  CHECK(none.everyone());
  CHECK(none.holds(5, 1));
  const shard::ownership o{.groups = 2, .holders = {0b11, 0b01, 0b10}};
  CHECK(o.holds(0, 1));
  CHECK_FALSE(o.holds(1, 1));
  CHECK(o.held_by(1, 3) == std::vector<bool>{true, false, true});
  const flat_layout l(three_units(), 2);  // shard_numel: 64, 32, 32
  const auto all = shard::held_offsets(l, {});
  CHECK(all == std::vector<std::size_t>{0, 64, 96, 128});
  const auto mine = shard::held_offsets(l, o.held_by(1, 3));
  CHECK(mine == std::vector<std::size_t>{0, shard::not_held, 64, 96});
}

TEST_CASE("bad masks say what is wrong") {
  const flat_layout l(three_units(), 1);
  auto error = [&](const shard::ownership& o, int G) {
    try {
      o.check(l, G);
    } catch (const invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(error({.groups = 2, .holders = {0b11, 0b01, 0b10}}, 2).empty());
  CHECK(error({.groups = 2, .holders = {0b11, 0, 0b10}}, 2).find("unit 1 ('e0') is held by no") !=
        std::string::npos);
  CHECK(error({.groups = 2, .holders = {0b11, 0b01, 0b10}}, 3)
            .find("written for 2 groups, but the mesh has 3") != std::string::npos);
  CHECK(error({.groups = 2, .holders = {0b11}}, 2)
            .find("holders of 1 units, but the model "
                  "declares 3") != std::string::npos);
  CHECK(error({.groups = 2, .holders = {0b11, 0b100, 0b10}}, 2).find("groups 0 to 1 only") !=
        std::string::npos);
}

TEST_CASE("an engine stores and plans only the units its group holds") {
  // 2 groups x 2 shards; e0 on group 0, e1 on group 1.
  test::spawn_ranks(4, [](inproc::communicator& world) {
    mesh<inproc::communicator> m(world, {2, 1, 2});
    const shard::ownership o{.groups = 2, .holders = {0b11, 0b01, 0b10}};
    shard::engine<shard::hybrid_shard, inproc::communicator> e(m, three_units(), {}, o);
    const int g = m.coords().group;
    const std::size_t mine = g == 0 ? 1 : 2, other = 3 - mine;
    CHECK(e.holds(0));
    CHECK(e.holds(mine));
    CHECK_FALSE(e.holds(other));
    const flat_layout& l = e.layout();
    CHECK(e.master().size() == l.unit(0).shard_numel + l.unit(mine).shard_numel);
    CHECK(e.grad().size() == e.master().size());
    CHECK(e.master().size() < l.total_shard_numel());
    for (const comm_op& op : e.step_plan().ops) CHECK(op.unit != static_cast<int>(other));
    // a step over the held units runs; the unheld one is refused by every hook
    e.begin_step();
    for (std::size_t u : {std::size_t{0}, mine}) {
      e.acquire(u);
      e.release(u);
    }
    CHECK_THROWS_WITH_AS(e.acquire(other), doctest::Contains("is not held by group"),
                         invalid_argument);
    CHECK_THROWS_WITH_AS(e.grad_buffer(other), doctest::Contains("has no storage for it"),
                         invalid_argument);
    CHECK_THROWS_AS(e.grad_buffer_as(other, dtype::bf16), invalid_argument);
    CHECK_THROWS_AS(e.grads_ready(other), invalid_argument);
    CHECK_THROWS_AS(e.master_of(other), invalid_argument);
    e.finish_backward();  // reduces the held units only
    CHECK(e.gather_unit(0).size() == 100);
  });
}
