/// Tests of the shaped communicator: the backend-generic test cases of comm/backend_tests.hpp
/// on shaped<inproc> worlds of 1 to 8 ranks on two sites, and the emulated link's delays.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "comm/backend_tests.hpp"
#include "fedshard/comm/inproc.hpp"
#include "fedshard/comm/shaped.hpp"
#include "support/spawn_ranks.hpp"

using namespace fedshard;
using shaped_comm = shaped::communicator<inproc::communicator>;
static_assert(Communicator<shaped_comm>);

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// The traits of shaped<inproc> for comm/backend_tests.hpp: every run is an inproc world whose
/// even and odd ranks sit on two sites joined by a fast link without latency, so that every
/// communicator of two ranks or more crosses it.
struct shaped_inproc_ranks {
  using comm = shaped_comm;
  static constexpr int determinism_runs = 5;
  static int max_ranks() { return 8; }
  template <class F>
  static auto run(int n, F&& body) {
    shaped::topology sites{.site_of_rank = {},
                           .wan = {.bandwidth_bytes_per_s = 1e12, .latency_s = 0.0}};
    for (int r = 0; r < n; ++r) sites.site_of_rank.push_back(r % 2);
    auto net = shaped::network::create(std::move(sites));
    return test::every_rank([&] {
      return test::collect_ranks(n, [&](inproc::communicator& w) {
        shaped_comm c(std::move(w), net);
        return body(c);
      });
    });
  }
};
}  // namespace

TYPE_TO_STRING_AS("shaped<inproc>", shaped_inproc_ranks);
FEDSHARD_COMM_TESTS(shaped_inproc_ranks)
FEDSHARD_COMM_CHECKED_TESTS(shaped_inproc_ranks)

TEST_CASE("a collective spanning sites waits latency + bus bytes / bandwidth; results unchanged") {
  const shaped::link wan{.bandwidth_bytes_per_s = 1e6, .latency_s = 0.01};
  std::vector<double> elapsed(4);
  std::vector<shaped::link_stats> world_stats(4), site_stats(4);
  auto net = shaped::network::create(shaped::topology::blocks(4, 2, wan));
  test::spawn_ranks(4, [&](inproc::communicator& w) {
    const int r = w.rank();
    shaped_comm world(std::move(w), net);
    CHECK(world.crosses_sites());
    std::vector<float> x(1000, float(r + 1)), y(1000);
    world.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    world.all_reduce(x.data(), y.data(), 1000, dtype::f32, reduce_op::sum);
    elapsed[static_cast<std::size_t>(r)] = seconds_since(t0);
    for (float v : y) CHECK(v == 10.0f);
    // ranks {0,1} and {2,3} are the two sites: a split by site never crosses
    auto site = world.split(r / 2, r);
    CHECK_FALSE(site.crosses_sites());
    site.all_reduce(x.data(), y.data(), 1000, dtype::f32, reduce_op::sum);
    CHECK(y[0] == (r < 2 ? 3.0f : 7.0f));
    // a split across sites does
    auto across = world.split(r % 2, r);
    CHECK(across.crosses_sites());
    auto req = across.all_gather_async(x.data(), y.data(), 500, dtype::f32);
    req.wait();
    CHECK(y[0] == float(r % 2 + 1));
    CHECK(y[500] == float(r % 2 + 3));
    world_stats[static_cast<std::size_t>(r)] = world.stats();
    site_stats[static_cast<std::size_t>(r)] = site.stats();
  });
  // 2 (n-1)/n x 4000 B = 6000 B at 1 MB/s = 6 ms, plus 10 ms latency, counted from the
  // last rank's arrival.
  CHECK(*std::max_element(elapsed.begin(), elapsed.end()) >= 0.016);
  for (int r = 0; r < 4; ++r) {
    CHECK(world_stats[r].crossing_bytes == doctest::Approx(6000.0 + 0.0));
    CHECK(site_stats[r].crossing_ops == 0);
  }
}

TEST_CASE("concurrent cross-site collectives queue on the one link") {
  const shaped::link wan{.bandwidth_bytes_per_s = 1e6, .latency_s = 0.0};
  std::vector<double> elapsed(4);
  auto net = shaped::network::create(shaped::topology::blocks(4, 2, wan));
  test::spawn_ranks(4, [&](inproc::communicator& w) {
    const int r = w.rank();
    shaped_comm world(std::move(w), net);
    auto across = world.split(r % 2, r);  // two communicators, each spanning both sites
    std::vector<float> x(5000, 1.0f);
    world.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    across.all_reduce(x.data(), x.data(), 5000, dtype::f32, reduce_op::sum);  // 20 kB each
    world.barrier();
    elapsed[static_cast<std::size_t>(r)] = seconds_since(t0);
  });
  // two 20 kB (bus) all_reduces share 1 MB/s: the later one ends 40 ms after the first began
  CHECK(*std::max_element(elapsed.begin(), elapsed.end()) >= 0.040);
}

TEST_CASE("a collective's link time starts when its last member arrives") {
  // Rank 1 arrives 30 ms after rank 0 (it waits for rank 0's arrival, then sleeps): both
  // finish no earlier than rank 1's arrival + the 20 ms latency (counted from the first
  // arrival they would finish 30 ms after rank 0 arrived). The times are absolute: the
  // ranks leave a barrier at slightly different moments.
  const shaped::link wan{.bandwidth_bytes_per_s = 1e12, .latency_s = 0.02};
  using clock = std::chrono::steady_clock;
  std::vector<clock::time_point> arrived(2), finished(2);
  std::atomic<bool> first_arrived{false};
  auto net = shaped::network::create(shaped::topology::blocks(2, 2, wan));
  test::spawn_ranks(2, [&](inproc::communicator& w) {
    const int r = w.rank();
    shaped_comm world(std::move(w), net);
    float x = 1.0f, y = 0.0f;
    world.inner().barrier();  // the wrapped barrier: no link latency
    if (r == 1) {
      while (!first_arrived.load()) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
    }
    arrived[static_cast<std::size_t>(r)] = clock::now();
    if (r == 0) first_arrived.store(true);
    auto req = world.all_reduce_async(&x, &y, 1, dtype::f32, reduce_op::sum);
    while (!req.test()) std::this_thread::yield();  // test() alone completes it too
    req.wait();
    finished[static_cast<std::size_t>(r)] = clock::now();
    CHECK(y == 2.0f);
  });
  const auto after_last = [&](int r) {
    return std::chrono::duration<double>(finished[static_cast<std::size_t>(r)] - arrived[1])
        .count();
  };
  CHECK(std::chrono::duration<double>(arrived[1] - arrived[0]).count() >= 0.030);
  CHECK(after_last(0) >= 0.020);
  CHECK(after_last(1) >= 0.020);
}

TEST_CASE("bad topologies are refused") {
  CHECK_THROWS_WITH_AS(shaped::network({{0, 1}, {.bandwidth_bytes_per_s = 0}}),
                       doctest::Contains("bandwidth must be > 0"), invalid_argument);
  CHECK_THROWS_WITH_AS(shaped::topology::blocks(6, 4),
                       doctest::Contains("6 ranks do not split into 4"), invalid_argument);
  test::spawn_ranks(2, [&](inproc::communicator& w) {
    auto four = shaped::network::create(shaped::topology::blocks(4, 2));
    CHECK_THROWS_WITH_AS(shaped_comm(std::move(w), four),
                         doctest::Contains("places 4 ranks but the world has 2"), invalid_argument);
  });
}

TEST_CASE("a link per site: a pair talks at the slower of its two links") {
  // 4 ranks on 4 sites; site 3's link is 10x slower (bandwidth / 10, latency x 10).
  const shaped::link wan{.bandwidth_bytes_per_s = 1e6, .latency_s = 0.001};
  const auto topo = shaped::topology::blocks_with_slow_site(4, 4, wan, 3, 10.0);
  REQUIRE(topo.num_sites() == 4);
  CHECK(topo.between({0, 1}).bandwidth_bytes_per_s == 1e6);
  CHECK(topo.between({0, 1}).latency_s == 0.001);
  CHECK(topo.between({0, 3}).bandwidth_bytes_per_s == doctest::Approx(1e5));
  CHECK(topo.between({0, 3}).latency_s == doctest::Approx(0.01));
  CHECK(topo.between({0, 1, 2, 3}).bandwidth_bytes_per_s == doctest::Approx(1e5));
  // the model: a transfer touching the slow site takes 10x as long
  CHECK(topo.transfer_seconds(4000, {2, 3}) ==
        doctest::Approx(10.0 * topo.transfer_seconds(4000, {0, 1})));
  // without site links every pair uses wan
  const auto even = shaped::topology::blocks(4, 4, wan);
  CHECK(even.transfer_seconds(4000, {0, 3}) ==
        doctest::Approx(even.transfer_seconds(4000, {0, 1})));

  std::vector<shaped::link_stats> pair_stats(4), p2p_stats(4), family(4);
  std::vector<double> elapsed(4);
  std::vector<float> sums(4);
  auto net = shaped::network::create(topo);
  test::spawn_ranks(4, [&](inproc::communicator& w) {
    const int r = w.rank();
    shaped_comm world(std::move(w), net);
    auto pair = world.split(r / 2, r);  // {0,1}: fast sites; {2,3}: touches the slow site
    CHECK(pair.crosses_sites());
    std::vector<float> x(1000, float(r + 1)), y(1000);
    world.inner().barrier();
    const auto t0 = std::chrono::steady_clock::now();
    pair.all_reduce(x.data(), y.data(), 1000, dtype::f32, reduce_op::sum);
    elapsed[static_cast<std::size_t>(r)] = seconds_since(t0);
    sums[static_cast<std::size_t>(r)] = y[0];
    pair_stats[static_cast<std::size_t>(r)] = pair.stats();
    // point to point: 0 -> 1 (fast pair), 2 -> 3 (slow pair)
    float v = float(r);
    if (r % 2 == 0)
      world.send(&v, 1, dtype::f32, r + 1);
    else
      world.recv(&v, 1, dtype::f32, r - 1);
    CHECK(v == float(r - r % 2));
    p2p_stats[static_cast<std::size_t>(r)] = world.stats();
    family[static_cast<std::size_t>(r)] = world.family_stats();
  });
  CHECK(sums[0] == 3.0f);
  CHECK(sums[3] == 7.0f);
  // all_reduce of 4000 B over 2 ranks: 4000 B on the wire; fast 4 ms + 1 ms, slow 40 + 10 ms
  for (int r = 0; r < 4; ++r) {
    CHECK(pair_stats[r].crossing_bytes == doctest::Approx(4000.0));
    CHECK(pair_stats[r].link_s == doctest::Approx(r < 2 ? 0.005 : 0.050));
    // the sender counts a message once (4 B); the receiver waits as long but counts nothing
    CHECK(p2p_stats[r].link_s == doctest::Approx(r % 2 == 1 ? 0.0 : r < 2 ? 0.001004 : 0.01004));
    CHECK(p2p_stats[r].crossing_bytes == doctest::Approx(r % 2 == 1 ? 0.0 : 4.0));
    // the world's family: its own sends and the all_reduce of the pair split from it
    CHECK(family[r].crossing_bytes == doctest::Approx(r % 2 == 1 ? 4000.0 : 4004.0));
    CHECK(family[r].crossing_ops == (r % 2 == 1 ? 1 : 2));
  }
  CHECK(pair_stats[2].link_s == doctest::Approx(10.0 * pair_stats[0].link_s));
  // the slow pair really waited (a lower bound only: wall clocks on a loaded machine run late)
  CHECK(elapsed[2] >= 0.050);
  CHECK(elapsed[3] >= 0.050);
}

TEST_CASE("site links: collectives over disjoint sites do not queue; sharing a site does") {
  // On the network's model (its completion times, not wall clocks): 20 kB at 1 MB/s = 20 ms.
  const shaped::link wan{.bandwidth_bytes_per_s = 1e6, .latency_s = 0.0};
  shaped::network net(shaped::topology::blocks_with_slow_site(4, 4, wan, 3, 1.0));
  auto done = [&](const std::string& key, std::vector<int> sites) {
    net.arrive(key, 20000, 1, sites);
    return *net.completion(key, 1, true);
  };
  const auto a = done("a", {0, 1});
  const auto b = done("b", {2, 3});  // disjoint: in parallel with a
  CHECK(std::chrono::duration<double>(b - a).count() < 0.020);
  const auto c = done("c", {1, 2});  // shares site 1 with a and site 2 with b: after both
  CHECK(std::chrono::duration<double>(c - std::max(a, b)).count() == doctest::Approx(0.020));
}

TEST_CASE("without site links, the collectives of a world of 4 sites share its one link") {
  // Two pairs of sites, each all_reduce 20 kB on the wire at 1 MB/s: 20 ms each; on the one
  // shared link (as before site links existed) the later ends >= 40 ms after the start.
  const shaped::link wan{.bandwidth_bytes_per_s = 1e6, .latency_s = 0.0};
  auto shared = shaped::topology::blocks(4, 4, wan);
  std::vector<double> elapsed(4);
  auto net = shaped::network::create(shared);
  test::spawn_ranks(4, [&](inproc::communicator& w) {
    const int r = w.rank();
    shaped_comm world(std::move(w), net);
    auto pair = world.split(r / 2, r);
    std::vector<float> x(10000, 1.0f);
    world.inner().barrier();
    const auto t0 = std::chrono::steady_clock::now();
    pair.all_reduce(x.data(), x.data(), 10000, dtype::f32, reduce_op::sum);
    world.inner().barrier();
    elapsed[static_cast<std::size_t>(r)] = seconds_since(t0);
  });
  CHECK(*std::max_element(elapsed.begin(), elapsed.end()) >= 0.040);
}

TEST_CASE("bad site links are refused") {
  shaped::topology t = shaped::topology::blocks(4, 4);
  t.site_links.assign(2, shaped::link{});
  CHECK_THROWS_WITH_AS(shaped::network{t},
                       doctest::Contains("names 2 links but the ranks sit on 4"), invalid_argument);
  CHECK_THROWS_WITH_AS(shaped::topology::blocks_with_slow_site(4, 4, {}, 4, 10.0),
                       doctest::Contains("slow site 4"), invalid_argument);
}
