#include "fedshard/mesh/mesh.hpp"

#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/comm/request.hpp"
#include "support/spawn_ranks.hpp"

namespace {

using fedshard::axis;
using fedshard::mesh_coords;
using fedshard::mesh_shape;
using fedshard::inproc::communicator;

/// Every G x R x S with G*R*S = n.
std::vector<mesh_shape> factorizations(int n) {
  std::vector<mesh_shape> out;
  for (int g = 1; g <= n; ++g)
    for (int r = 1; g * r <= n; ++r)
      if (n % (g * r) == 0) out.push_back({g, r, n / (g * r)});
  return out;
}

/// The world ranks on each axis through `world_rank`, in axis order, written out from the
/// block layout (world rank = g*R*S + r*S + s) without calling the library.
std::vector<int> expected_members(const mesh_shape& m, int world_rank, axis a) {
  const int G = m.groups, R = m.replicas, S = m.shards;
  const int g = world_rank / (R * S), r = world_rank / S % R, s = world_rank % S;
  std::vector<int> out;
  switch (a) {
    case axis::shard:
      for (int i = 0; i < S; ++i) out.push_back(g * R * S + r * S + i);
      break;
    case axis::replica:
      for (int i = 0; i < R; ++i) out.push_back(g * R * S + i * S + s);
      break;
    case axis::federation:
      for (int i = 0; i < G; ++i) out.push_back(i * R * S + r * S + s);
      break;
    case axis::group:
      for (int i = 0; i < R * S; ++i) out.push_back(g * R * S + i);
      break;
    case axis::world:
      for (int i = 0; i < G * R * S; ++i) out.push_back(i);
      break;
  }
  return out;
}

/// The world ranks of a communicator's members, in its rank order (an all_gather).
std::vector<int> gathered_world_ranks(communicator& c, int world_rank) {
  const double mine = world_rank;
  std::vector<double> all(static_cast<std::size_t>(c.size()), -1.0);
  fedshard::all_gather(c, std::span<const double>(&mine, 1), std::span<double>(all));
  return {all.begin(), all.end()};
}

}  // namespace

TEST_CASE("coords_of and rank_of follow the block layout and invert each other") {
  static_assert(fedshard::coords_of({2, 2, 2}, 5) == mesh_coords{1, 0, 1});
  static_assert(fedshard::rank_of({2, 2, 2}, {1, 0, 1}) == 5);
  static_assert(fedshard::coords_of({3, 1, 4}, 7) == mesh_coords{1, 0, 3});
  for (int n = 1; n <= 12; ++n)
    for (const mesh_shape& m : factorizations(n)) {
      CAPTURE(fedshard::to_string(m));
      int expected = 0;
      for (int g = 0; g < m.groups; ++g)
        for (int r = 0; r < m.replicas; ++r)
          for (int s = 0; s < m.shards; ++s, ++expected) {
            CHECK(fedshard::rank_of(m, {g, r, s}) == expected);
            CHECK(fedshard::coords_of(m, expected) == mesh_coords{g, r, s});
          }
    }
}

TEST_CASE("coords_of and rank_of reject ranks and coordinates outside the mesh") {
  CHECK_THROWS_AS((void)fedshard::coords_of({2, 2, 2}, 8), fedshard::invalid_argument);
  CHECK_THROWS_AS((void)fedshard::coords_of({2, 2, 2}, -1), fedshard::invalid_argument);
  CHECK_THROWS_AS((void)fedshard::coords_of({0, 2, 2}, 0), fedshard::invalid_argument);
  CHECK_THROWS_AS((void)fedshard::rank_of({2, 2, 2}, {0, 2, 0}), fedshard::invalid_argument);
  CHECK_THROWS_AS((void)fedshard::rank_of({2, 2, 2}, {0, 0, -1}), fedshard::invalid_argument);
}

TEST_CASE("to_string of a shape and of coordinates") {
  CHECK(fedshard::to_string(mesh_shape{2, 2, 2}) == "2x2x2 (groups x replicas x shards)");
  CHECK(fedshard::to_string(mesh_shape{4, 1, 3}) == "4x1x3 (groups x replicas x shards)");
  CHECK(fedshard::to_string(mesh_coords{1, 0, 2}) == "(group 1, replica 0, shard 2)");
  CHECK(mesh_shape{2, 3, 4}.size() == 24);
}

TEST_CASE("every mesh of up to 8 ranks: coordinates, axis sizes and axis members") {
  int shapes = 0;
  for (int n = 1; n <= 8; ++n)
    for (const mesh_shape& shape : factorizations(n)) {
      ++shapes;
      CAPTURE(fedshard::to_string(shape));
      std::vector<std::string> failures(static_cast<std::size_t>(n));
      fedshard::test::spawn_ranks(n, [&](communicator& world) {
        std::string& fail = failures[static_cast<std::size_t>(world.rank())];
        fedshard::mesh m(world, shape);
        const int w = world.rank();
        const int R = shape.replicas, S = shape.shards;
        const mesh_coords expect{w / (R * S), w % (R * S) / S, w % S};
        if (!(m.coords() == expect)) fail += "coords " + fedshard::to_string(m.coords()) + "; ";
        if (m.rank() != w || m.size() != n || !(m.shape() == shape)) fail += "rank/size/shape; ";
        if (&m.world() != &world) fail += "world is not the caller's communicator; ";
        const int expected_rank[] = {expect.shard, expect.replica, expect.group,
                                     expect.replica * S + expect.shard, w};
        const int expected_size[] = {S, R, shape.groups, R * S, n};
        int i = 0;
        for (axis a : fedshard::all_axes) {
          communicator& c = m.comm(a);
          const std::string name(fedshard::to_string(a));
          if (m.axis_size(a) != expected_size[i] || c.size() != expected_size[i])
            fail += name + " size; ";
          if (m.axis_rank(a) != expected_rank[i] || c.rank() != expected_rank[i])
            fail += name + " rank; ";
          if (gathered_world_ranks(c, w) != expected_members(shape, w, a))
            fail += name + " members; ";
          ++i;
        }
        if (&m.shard() != &m.comm(axis::shard) || &m.replica() != &m.comm(axis::replica) ||
            &m.federation() != &m.comm(axis::federation) || &m.group() != &m.comm(axis::group))
          fail += "named accessors differ from comm(axis); ";
      });
      for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        CHECK(failures[static_cast<std::size_t>(r)] == "");
      }
    }
  CHECK(shapes == 38);  // sum over n = 1..8 of the ordered factorizations into 3 factors
}

TEST_CASE("axis communicators run collectives concurrently, started in rank-dependent order") {
  for (const mesh_shape shape : {mesh_shape{2, 2, 2}, mesh_shape{2, 1, 4}, mesh_shape{3, 2, 1}}) {
    CAPTURE(fedshard::to_string(shape));
    const int n = shape.size();
    std::vector<std::string> failures(static_cast<std::size_t>(n));
    fedshard::test::spawn_ranks(n, [&](communicator& world) {
      fedshard::mesh m(world, shape);
      const int w = world.rank();
      // One in-flight all_reduce per axis, each started in an order that depends on the rank,
      // so a rank may wait on one axis while its peers are still starting another.
      constexpr int rounds = 20;
      std::array<std::vector<double>, 5> bufs;
      for (int round = 0; round < rounds; ++round) {
        std::vector<fedshard::request> pending;
        for (int k = 0; k < 5; ++k) {
          const int i = (k + w + round) % 5;
          const axis a = fedshard::all_axes[i];
          bufs[static_cast<std::size_t>(i)].assign(64, double(w + 1) * (round + 1));
          pending.push_back(fedshard::all_reduce_async(
              m.comm(a), std::span<double>(bufs[static_cast<std::size_t>(i)]),
              fedshard::reduce_op::sum));
        }
        fedshard::wait_all(pending);
        for (int i = 0; i < 5; ++i) {
          double expected = 0;
          for (int member : expected_members(shape, w, fedshard::all_axes[i]))
            expected += double(member + 1) * (round + 1);
          for (double v : bufs[static_cast<std::size_t>(i)])
            if (v != expected) {
              failures[static_cast<std::size_t>(w)] +=
                  std::string(fedshard::to_string(fedshard::all_axes[i])) + " sum wrong; ";
              break;
            }
        }
      }
    });
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CHECK(failures[static_cast<std::size_t>(r)] == "");
    }
  }
}

TEST_CASE("a mesh over a split communicator uses that communicator's ranks") {
  std::vector<std::string> failures(8);
  fedshard::test::spawn_ranks(8, [&](communicator& world) {
    const int w = world.rank();
    communicator half = world.split(w % 2, w);  // even and odd world ranks
    fedshard::mesh m(half, {.groups = 2, .replicas = 1, .shards = 2});
    std::string& fail = failures[static_cast<std::size_t>(w)];
    if (m.rank() != w / 2) fail += "rank; ";
    // Shard partners are the neighbouring rank of the same parity.
    const auto members = gathered_world_ranks(m.shard(), w);
    const int base = (w / 4) * 4 + w % 2;
    if (members != std::vector<int>{base, base + 2}) fail += "shard members; ";
    const auto fed = gathered_world_ranks(m.federation(), w);
    const int first = (w / 2 % 2) * 2 + w % 2;
    if (fed != std::vector<int>{first, first + 4}) fail += "federation members; ";
  });
  for (int r = 0; r < 8; ++r) {
    CAPTURE(r);
    CHECK(failures[static_cast<std::size_t>(r)] == "");
  }
}

TEST_CASE("a moved mesh keeps working") {
  fedshard::test::spawn_ranks(4, [](communicator& world) {
    fedshard::mesh first(world, {.groups = 2, .replicas = 1, .shards = 2});
    fedshard::mesh<communicator> m = std::move(first);
    std::vector<double> v(3, 1.0);
    fedshard::all_reduce(m.federation(), std::span<double>(v), fedshard::reduce_op::sum);
    fedshard::all_reduce(m.world(), std::span<double>(v), fedshard::reduce_op::sum);
    if (v[0] != 8.0) throw fedshard::error("moved mesh: wrong sum");
  });
}

namespace {
struct bad_case {
  int world;
  mesh_shape shape;
  std::vector<std::string> words;  // every one must appear in the message
};
}  // namespace

TEST_CASE("invalid shapes throw invalid_argument on every rank, naming the numbers") {
  const std::vector<bad_case> cases = {
      {8, {2, 2, 3}, {"world size 8", "2 x 2 x 3 = 12"}},
      {4, {1, 1, 1}, {"world size 4", "1 x 1 x 1 = 1"}},
      {1, {2, 1, 1}, {"world size 1", "2 x 1 x 1 = 2"}},
      {6, {2, 2, 2}, {"world size 6", "2 x 2 x 2 = 8"}},
      {4, {0, 2, 2}, {">= 1", "0 x 2 x 2"}},
      {4, {2, 0, 2}, {">= 1", "2 x 0 x 2"}},
      {4, {2, 2, 0}, {">= 1", "2 x 2 x 0"}},
      {4, {-1, -2, 2}, {">= 1", "-1 x -2 x 2"}},
      {2, {-1, 1, -2}, {">= 1", "-1 x 1 x -2"}},
      // The product is computed without overflow.
      {8, {65536, 65536, 2}, {"world size 8", "65536 x 65536 x 2 = 8589934592"}},
  };
  for (const bad_case& bc : cases) {
    CAPTURE(bc.world);
    CAPTURE(fedshard::to_string(bc.shape));
    std::vector<std::string> outcome(static_cast<std::size_t>(bc.world), "no exception");
    std::vector<int> usable(static_cast<std::size_t>(bc.world), 0);
    fedshard::test::spawn_ranks(bc.world, [&](communicator& world) {
      const auto me = static_cast<std::size_t>(world.rank());
      try {
        fedshard::mesh m(world, bc.shape);
      } catch (const fedshard::invalid_argument& e) {
        outcome[me] = e.what();
      } catch (const std::exception& e) {
        outcome[me] = std::string("wrong exception type: ") + e.what();
      }
      // No collective was started, so the world is still in step.
      double one = 1.0;
      fedshard::all_reduce(world, std::span<double>(&one, 1), fedshard::reduce_op::sum);
      usable[me] = one == double(bc.world);
    });
    for (int r = 0; r < bc.world; ++r) {
      CAPTURE(r);
      const std::string& msg = outcome[static_cast<std::size_t>(r)];
      CAPTURE(msg);
      CHECK(msg.find("mesh") != std::string::npos);
      for (const std::string& w : bc.words) CHECK(msg.find(w) != std::string::npos);
      CHECK(usable[static_cast<std::size_t>(r)] == 1);
    }
  }
}
