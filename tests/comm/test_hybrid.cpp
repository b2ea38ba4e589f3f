/// Tests of hybrid<C, F>: a world made of each group's own communicator and a federation
/// link per local rank behaves as one world of G*R*S ranks: the same ranks, collectives
/// bit-identical to inproc's, the mesh's splits, and a trainer on it ends bit for bit where
/// the same run on one inproc world ends, moving the same bytes on every axis.

#include <doctest/doctest.h>

#include <cstring>
#include <vector>

#include "fedshard/comm/hybrid.hpp"
#include "fedshard/comm/inproc.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "support/collective_checks.hpp"
#include "support/federated_run.hpp"
#include "support/spawn_ranks.hpp"

namespace fedshard::test {
/// Throws check_failed with the parts unless ok.
template <class... Args>
void expect(bool ok, Args&&... parts) {
  if (!ok) fail(std::forward<Args>(parts)...);
}
}  // namespace fedshard::test

namespace {

using fedshard::dtype;
using fedshard::reduce_op;
using fedshard::inproc::communicator;
namespace ft = fedshard::test;
using world_t = fedshard::hybrid<communicator, communicator>;

/// The hybrid world of rank `world` of an inproc world of G*RS ranks: the group's ranks and
/// the link of its local rank, both split from the inproc world.
world_t make_hybrid(communicator& world, int rs) {
  const int g = world.rank() / rs, l = world.rank() % rs;
  communicator group = world.split(g, l);
  communicator link = world.split(l, g);
  return world_t(std::move(group), std::move(link));
}

}  // namespace

TEST_CASE("hybrid: a world of groups and links has the ranks and results of one world") {
  for (int rs : {1, 2, 3}) {
    const int G = 3, W = G * rs;
    CAPTURE(rs);
    auto results = ft::collect_ranks(W, [&](communicator& plain) {
      world_t w = make_hybrid(plain, rs);
      ft::expect(w.rank() == plain.rank(), "rank ", w.rank(), " != ", plain.rank());
      ft::expect(w.size() == W, "size ", w.size());
      std::vector<std::vector<float>> out;
      for (reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::min}) {
        std::vector<float> a(1001), b(1001);
        for (std::size_t i = 0; i < a.size(); ++i)
          a[i] = b[i] = ft::input_value<float>(5, plain.rank(), static_cast<std::int64_t>(i));
        w.all_reduce(a.data(), a.data(), 1001, dtype::f32, op);
        plain.all_reduce(b.data(), b.data(), 1001, dtype::f32, op);
        ft::expect(std::memcmp(a.data(), b.data(), a.size() * 4) == 0, "all_reduce differs");
      }
      std::vector<double> mine(7 * static_cast<std::size_t>(W)), rs_out(7), rs_ref(7);
      for (std::size_t i = 0; i < mine.size(); ++i)
        mine[i] = ft::input_value<double>(6, plain.rank(), static_cast<std::int64_t>(i));
      w.reduce_scatter(mine.data(), rs_out.data(), 7, dtype::f64, reduce_op::sum);
      plain.reduce_scatter(mine.data(), rs_ref.data(), 7, dtype::f64, reduce_op::sum);
      ft::expect(rs_out == rs_ref, "reduce_scatter differs");
      double v = plain.rank() == W - 1 ? 42.0 : 0.0;
      w.broadcast(&v, 1, dtype::f64, W - 1);
      ft::expect(v == 42.0, "broadcast gave ", v);
      std::vector<double> all(static_cast<std::size_t>(W));
      const double me = plain.rank();
      w.all_gather(&me, all.data(), 1, dtype::f64);
      for (int p = 0; p < W; ++p) ft::expect(all[p] == p, "all_gather slot ", p, " = ", all[p]);
      w.barrier();
      // Point to point within the group and along the link.
      if (rs > 1) {
        const int base = plain.rank() / rs * rs, l = plain.rank() % rs;
        const int to = base + (l + 1) % rs, from = base + (l + rs - 1) % rs;
        double got = -1, sent = plain.rank();
        auto r = w.recv_async(&got, 1, dtype::f64, from, 3);
        w.send(&sent, 1, dtype::f64, to, 3);
        r.wait();
        ft::expect(got == from, "group message from ", from, " was ", got);
      }
      const int across = (plain.rank() + rs) % W;
      const int from = (plain.rank() - rs + W) % W;
      double got = -1, sent = plain.rank();
      auto r = w.recv_async(&got, 1, dtype::f64, from, 4);
      w.send(&sent, 1, dtype::f64, across, 4);
      r.wait();
      ft::expect(got == from, "link message from ", from, " was ", got);
      return 0;
    });
    CHECK(results.size() == static_cast<std::size_t>(W));
  }
}

TEST_CASE("hybrid: the mesh's splits work, any other cross-group split is refused everywhere") {
  auto seen = ft::collect_ranks(6, [&](communicator& plain) {
    world_t w = make_hybrid(plain, 2);
    fedshard::mesh m(w, {3, 1, 2});
    ft::expect(m.federation().which() == world_t::side::federation, "federation is not a link");
    ft::expect(m.shard().which() == world_t::side::group, "shard axis is not group-side");
    std::string what;
    try {
      (void)w.split(plain.rank() < 3 ? 0 : 1, 0);  // ranks 0..2 span groups 0 and 1
    } catch (const fedshard::invalid_argument& e) {
      what = e.what();
    }
    return what;
  });
  for (const auto& what : seen) {
    CAPTURE(what);
    CHECK(what.find("mixes ranks of several groups") != std::string::npos);
  }
}

TEST_CASE("hybrid: a trainer over groups and links ends where one inproc world ends, bit for bit") {
  const fedshard::mesh_shape shape{3, 1, 2};
  auto plain = ft::collect_ranks(
      6, [&](communicator& c) { return ft::train_mlp<fedshard::fl_hsdp>(c, shape, 9, 3); });
  auto split = ft::collect_ranks(6, [&](communicator& c) {
    world_t w = make_hybrid(c, 2);
    return ft::train_mlp<fedshard::fl_hsdp>(w, shape, 9, 3);
  });
  for (std::size_t r = 0; r < plain.size(); ++r) {
    CAPTURE(r);
    REQUIRE(plain[r].params.size() == split[r].params.size());
    CHECK(std::memcmp(plain[r].params.data(), split[r].params.data(),
                      plain[r].params.size() * sizeof(float)) == 0);
    CHECK(plain[r].losses == split[r].losses);
    CHECK(split[r].syncs == 3);
    CHECK(plain[r].traffic.same_traffic(split[r].traffic));
    CHECK(split[r].traffic[fedshard::axis::federation].calls == 3);
  }
}

TEST_CASE("hybrid: both levels report what they move; the world's reductions gather all") {
  // G = 2 groups of RS = 2 ranks; every world call of 100 f32 (S = 400 B), W = 4 ranks.
  std::vector<fedshard::moved_bytes> ar(4), ag(4), bc(4);
  ft::spawn_ranks(4, [&](communicator& inproc_world) {
    world_t w = make_hybrid(inproc_world, 2);
    const auto r = static_cast<std::size_t>(w.rank());
    CHECK(w.algorithm_of(fedshard::collective::all_reduce, 100, dtype::f32) ==
          fedshard::wire_algorithm::gather_all);
    CHECK(w.algorithm_of(fedshard::collective::all_gather, 100, dtype::f32) ==
          fedshard::wire_algorithm::ring);
    std::vector<float> x(100, 1.0f), y(400);
    auto before = w.moved();
    w.all_reduce(x.data(), x.data(), 100, dtype::f32, reduce_op::sum);
    ar[r] = w.moved() - before;
    before = w.moved();
    w.all_gather(x.data(), y.data(), 100, dtype::f32);
    ag[r] = w.moved() - before;
    before = w.moved();
    w.broadcast(x.data(), 100, dtype::f32, 1);
    bc[r] = w.moved() - before;
    CHECK(x[0] == 4.0f);
  });
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    // all_reduce and all_gather: the group's all_gather (400 B to and from the other rank),
    // then the link's all_gather of the groups' 800-B blocks: 400 + 800 = 1200 B each way;
    // for all_reduce that is (W-1) S, the gather-all's n (n-1) S = 4800 B over the 4 ranks.
    CHECK(ar[static_cast<std::size_t>(r)] == fedshard::moved_bytes{1200, 1200});
    CHECK(ag[static_cast<std::size_t>(r)] == fedshard::moved_bytes{1200, 1200});
  }
  // broadcast from world rank 1 (group 0, local 1): group 0 broadcasts (rank 1 -> rank 0),
  // then each link from group 0 to group 1 (rank 0 -> 2, rank 1 -> 3): 3 x 400 B in all,
  // (W-1) S as a ring.
  CHECK(bc[0] == fedshard::moved_bytes{400, 400});
  CHECK(bc[1] == fedshard::moved_bytes{800, 0});
  CHECK(bc[2] == fedshard::moved_bytes{0, 400});
  CHECK(bc[3] == fedshard::moved_bytes{0, 400});
}
