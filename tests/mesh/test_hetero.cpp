// Meshes of groups of different shapes: coordinates, each rank's group view, the axis
// communicators, and the errors for shapes that cannot make a mesh.
#include <doctest/doctest.h>

#include <span>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/comm/request.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "support/spawn_ranks.hpp"

namespace {

using fedshard::axis;
using fedshard::group_shape;
using fedshard::mesh_coords;
using fedshard::mesh_shape;
using fedshard::inproc::communicator;

/// The world ranks of a communicator's members, in its rank order.
std::vector<int> members(communicator& c, int world_rank) {
  const double mine = world_rank;
  std::vector<double> all(static_cast<std::size_t>(c.size()), -1.0);
  fedshard::all_gather(c, std::span<const double>(&mine, 1), std::span<double>(all));
  return {all.begin(), all.end()};
}

}  // namespace

TEST_CASE("coordinates of a mesh of groups 2x2 and 1x2 are contiguous blocks in group order") {
  const std::vector<group_shape> groups{{2, 2}, {1, 2}};
  const std::vector<mesh_coords> want{{0, 0, 0}, {0, 0, 1}, {0, 1, 0},
                                      {0, 1, 1}, {1, 0, 0}, {1, 0, 1}};
  for (int r = 0; r < 6; ++r) {
    CHECK(fedshard::coords_of(groups, r) == want[static_cast<std::size_t>(r)]);
    CHECK(fedshard::rank_of(groups, want[static_cast<std::size_t>(r)]) == r);
  }
  CHECK_THROWS_AS((void)fedshard::coords_of(groups, 6), fedshard::invalid_argument);
  CHECK_THROWS_AS((void)fedshard::rank_of(groups, {1, 1, 0}), fedshard::invalid_argument);
  CHECK(fedshard::to_string(groups) == "2x2,1x2");
  CHECK(fedshard::parse_group_shapes("2x2,1x2") == groups);
  CHECK(fedshard::parse_group_shapes("4x1") == std::vector<group_shape>{{4, 1}});
  for (const char* bad : {"", "2x", "x2", "2x2,", "0x2", "2x0", "2*2", "2x2x2", "-1x2"}) {
    CAPTURE(bad);
    try {
      (void)fedshard::parse_group_shapes(bad);
      FAIL("accepted");
    } catch (const fedshard::invalid_argument& e) {
      const std::string msg = e.what();
      CHECK(msg.find("expected RxS") != std::string::npos);
      CHECK(msg.find(std::string("'") + bad + "'") != std::string::npos);
    }
  }
}

TEST_CASE("a heterogeneous mesh gives each rank its group's view and axes") {
  const std::vector<group_shape> groups{{2, 2}, {1, 2}};
  fedshard::test::spawn_ranks(6, [&](communicator& world) {
    fedshard::mesh m(world, groups);
    const int w = world.rank();
    const mesh_coords c = fedshard::coords_of(groups, w);
    CHECK(m.coords() == c);
    CHECK_FALSE(m.uniform());
    CHECK(m.size() == 6);
    CHECK(m.group_shapes() == groups);
    const group_shape& gs = groups[static_cast<std::size_t>(c.group)];
    CHECK(m.shape() == mesh_shape{2, gs.replicas, gs.shards});
    CHECK(m.group_view(1) == mesh_shape{2, 1, 2});
    const int base = c.group == 0 ? 0 : 4;
    std::vector<int> shard, replica, group, fed;
    for (int s = 0; s < gs.shards; ++s) shard.push_back(base + c.replica * gs.shards + s);
    for (int r = 0; r < gs.replicas; ++r) replica.push_back(base + r * gs.shards + c.shard);
    for (int l = 0; l < gs.size(); ++l) group.push_back(base + l);
    fed = c.replica == 0 ? std::vector<int>{0, 1, 4, 5} : std::vector<int>{2, 3};
    CHECK(members(m.shard(), w) == shard);
    CHECK(members(m.replica(), w) == replica);
    CHECK(members(m.group(), w) == group);
    CHECK(members(m.federation(), w) == fed);
    CHECK(m.axis_size(axis::federation) == static_cast<int>(fed.size()));
    CHECK(m.axis_rank(axis::federation) == (c.replica == 0 ? (c.group == 0 ? 0 : 2) : 0) + c.shard);
    CHECK(m.axis_size(axis::world) == 6);
  });
}

TEST_CASE("groups of one shape make the same mesh as G x R x S") {
  fedshard::test::spawn_ranks(8, [&](communicator& world) {
    fedshard::mesh a(world, mesh_shape{2, 2, 2});
    fedshard::mesh b(world, std::vector<group_shape>{{2, 2}, {2, 2}});
    CHECK(b.uniform());
    CHECK(a.shape() == b.shape());
    CHECK(a.coords() == b.coords());
    for (axis x : fedshard::all_axes) {
      CHECK(a.axis_size(x) == b.axis_size(x));
      CHECK(a.axis_rank(x) == b.axis_rank(x));
      CHECK(members(a.comm(x), world.rank()) == members(b.comm(x), world.rank()));
    }
  });
}

TEST_CASE("bad group shapes throw invalid_argument on every rank, saying what was expected") {
  struct bad_case {
    int world;
    std::vector<group_shape> groups;
    std::vector<std::string> says;
  };
  const std::vector<bad_case> cases = {
      {6, {{2, 2}, {1, 1}}, {"world size 6", "(2x2,1x1) = 5"}},
      {4, {{2, 2}, {1, 2}}, {"world size 4", "(2x2,1x2) = 6"}},
      {4, {{2, 2}, {0, 2}}, {"group 1", ">= 1", "0 x 2"}},
      {4, {{2, -1}, {1, 2}}, {"group 0", ">= 1", "2 x -1"}},
      {2, {}, {"at least one group"}},
  };
  for (const bad_case& bc : cases) {
    CAPTURE(fedshard::to_string(bc.groups));
    std::vector<std::string> outcome(static_cast<std::size_t>(bc.world), "no exception");
    fedshard::test::spawn_ranks(bc.world, [&](communicator& world) {
      try {
        fedshard::mesh m(world, bc.groups);
      } catch (const fedshard::invalid_argument& e) {
        outcome[static_cast<std::size_t>(world.rank())] = e.what();
      }
      double one = 1.0;  // no collective started: the world is still in step
      fedshard::all_reduce(world, std::span<double>(&one, 1), fedshard::reduce_op::sum);
      CHECK(one == double(bc.world));
    });
    for (const std::string& msg : outcome) {
      CAPTURE(msg);
      for (const std::string& s : bc.says) CHECK(msg.find(s) != std::string::npos);
    }
  }
}
