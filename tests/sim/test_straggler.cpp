// Stragglers, fabric contention, measured compute and the sync dtype in the simulator: the
// max-of-normals moments against known values, the straggler cost growing with the ranks a
// step joins and with the groups a sync joins, cv = 0 and oversubscription 1 changing nothing,
// oversubscription dividing a level's bandwidth, seconds_per_token replacing the FLOP model,
// and a bf16 sync priced from the plans of the cast-codec federation.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/sim/collective_cost.hpp"
#include "fedshard/sim/price.hpp"
#include "fedshard/sim/straggler.hpp"

#include "support/sim.hpp"

using namespace fedshard;
using namespace fedshard::sim;
using namespace fedshard::test;  // the fixtures of support/sim.hpp

namespace {

price_options with_cv(double cv) {
  price_options o;
  o.stragglers.cv = cv;
  return o;
}

/// Every field of two prices, bit for bit.
void check_equal(const step_price& a, const step_price& b) {
  CHECK(a.algorithm == b.algorithm);
  CHECK(a.shape == b.shape);
  CHECK(a.period == b.period);
  CHECK(a.fragments == b.fragments);
  CHECK(a.in_flight == b.in_flight);
  CHECK(a.syncs == b.syncs);
  CHECK(a.compute == b.compute);
  CHECK(a.overlappable == b.overlappable);
  CHECK(a.hidden == b.hidden);
  CHECK(a.exposed_step == b.exposed_step);
  CHECK(a.sync == b.sync);
  CHECK(a.sync_per_step == b.sync_per_step);
  CHECK(a.sync_hidden == b.sync_hidden);
  CHECK(a.step == b.step);
  CHECK(a.straggler_wait == b.straggler_wait);
  CHECK(a.straggler_sync == b.straggler_sync);
  CHECK(a.step_component == b.step_component);
  CHECK(a.sync_components == b.sync_components);
  CHECK(a.tokens_per_gpu == b.tokens_per_gpu);
  CHECK(a.tokens_per_s_per_gpu == b.tokens_per_s_per_gpu);
  CHECK(a.critical_rank == b.critical_rank);
  REQUIRE(a.ranks.size() == b.ranks.size());
  for (std::size_t r = 0; r < a.ranks.size(); ++r) {
    CHECK(a.ranks[r].step == b.ranks[r].step);
    for (std::size_t i = 0; i < a.axes.size(); ++i) {
      const axis_price &x = a.ranks[r].axes[i], &y = b.ranks[r].axes[i];
      CHECK(x.level == y.level);
      CHECK(x.ranks == y.ranks);
      CHECK(x.step_bytes == y.step_bytes);
      CHECK(x.sync_bytes == y.sync_bytes);
      CHECK(x.bytes_per_step == y.bytes_per_step);
      CHECK(x.step_node_bytes == y.step_node_bytes);
      CHECK(x.sync_node_bytes == y.sync_node_bytes);
      CHECK(x.node_bytes_per_step == y.node_bytes_per_step);
      CHECK(x.step_calls == y.step_calls);
      CHECK(x.sync_calls == y.sync_calls);
      CHECK(x.step_seconds == y.step_seconds);
      CHECK(x.sync_seconds == y.sync_seconds);
      CHECK(x.sync_seconds_per_step == y.sync_seconds_per_step);
      CHECK(x.exposed == y.exposed);
    }
  }
}

}  // namespace

TEST_CASE("e(n) and s(n): the moments of the max of n standard normals") {
  CHECK(expected_max_normal(1) == 0.0);
  CHECK(sd_max_normal(1) == 1.0);
  // e(2) = 1/sqrt(pi), e(3) = 3 / (2 sqrt(pi)); e(10) and e(100) from the tables of the
  // expected normal order statistics (Harter 1961).
  CHECK(expected_max_normal(2) == doctest::Approx(1 / std::sqrt(std::acos(-1.0))).epsilon(1e-7));
  CHECK(expected_max_normal(3) == doctest::Approx(1.5 / std::sqrt(std::acos(-1.0))).epsilon(1e-7));
  CHECK(expected_max_normal(10) == doctest::Approx(1.538753).epsilon(1e-6));
  CHECK(expected_max_normal(100) == doctest::Approx(2.507594).epsilon(1e-6));
  // Var(max of 2) = 1 - 1/pi.
  CHECK(sd_max_normal(2) == doctest::Approx(std::sqrt(1 - 1 / std::acos(-1.0))).epsilon(1e-7));
  // s(n) falls as n grows, slowly (about 1 / sqrt(2 ln n)).
  double last_e = 0, last_s = 1;
  for (long long n : {2LL, 4LL, 16LL, 128LL, 1024LL, 100000LL}) {
    CAPTURE(n);
    CHECK(expected_max_normal(n) > last_e);
    CHECK(sd_max_normal(n) < last_s);
    CHECK(sd_max_normal(n) > 0.2);
    last_e = expected_max_normal(n);
    last_s = sd_max_normal(n);
  }
  CHECK(expected_max_normal(100000) == doctest::Approx(4.3).epsilon(0.03));
  // Fast enough to tabulate on the fly: new sizes up to 1e5 in well under a second.
  const auto t0 = std::chrono::steady_clock::now();
  for (long long n = 99990; n < 100000; ++n) (void)expected_max_normal(n);
  CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 1.0);
  CHECK_THROWS_AS((void)max_of_normals(0), invalid_argument);
}

TEST_CASE("stragglers: a larger step component pays more, a sync waits for the slowest group") {
  const cluster c = free_links(a100_4gpu_node());
  const workload w = small_gpt();
  const algorithm_desc fsdp = algorithm_by_name("fsdp");
  // Free links: without stragglers the step is the compute whatever the world size; with
  // cv = 5% it grows strictly with the ranks FSDP joins every step.
  double last = 0;
  for (int gpus : {8, 64, 512}) {
    CAPTURE(gpus);
    const step_price plain = price(fsdp, w, {1, 1, gpus}, c);
    const step_price p = price(fsdp, w, {1, 1, gpus}, c, with_cv(0.05));
    CHECK(plain.step == plain.compute);
    CHECK(p.step_component == gpus);
    CHECK(p.straggler_wait == doctest::Approx(p.compute * 0.05 * expected_max_normal(gpus)));
    CHECK(p.straggler_sync == 0);
    CHECK(p.step == doctest::Approx(p.compute + p.straggler_wait + p.exposed_comm()));
    CHECK(p.step > last);
    last = p.step;
  }
  // The same with the paper's cluster (links priced): still strictly growing.
  last = 0;
  for (int gpus : {8, 64, 512}) {
    const step_price p = price(fsdp, w, {1, 1, gpus}, a100_4gpu_node(), with_cv(0.05));
    CHECK(p.step > last);
    last = p.step;
  }
  // fl_fsdp: FSDP inside a 4-GPU node, G groups synced every K = 8 steps. The step part
  // stays that of 4 ranks; the sync part grows with G.
  const algorithm_desc fl = algorithm_by_name("fl_fsdp", {.period = 8});
  double last_sync = 0;
  for (int g : {2, 8, 32}) {
    CAPTURE(g);
    const step_price p = price(fl, w, {g, 1, 4}, c, with_cv(0.05));
    CHECK(p.step_component == 4);
    CHECK(p.sync_components == g);
    CHECK(p.straggler_sync == doctest::Approx(p.compute * 0.05 * sd_max_normal(4) *
                                              expected_max_normal(g) / std::sqrt(8.0)));
    CHECK(p.straggler_wait - p.straggler_sync ==
          doctest::Approx(p.compute * 0.05 * expected_max_normal(4)));
    CHECK(p.straggler_sync > last_sync);
    last_sync = p.straggler_sync;
  }
  // A longer K amortises the wait: per step it falls as 1 / sqrt(K).
  const step_price k8 = price(fl, w, {8, 1, 4}, c, with_cv(0.05));
  const step_price k32 =
      price(algorithm_by_name("fl_fsdp", {.period = 32}), w, {8, 1, 4}, c, with_cv(0.05));
  CHECK(k32.straggler_sync == doctest::Approx(k8.straggler_sync / 2));
  // fl_hsdp: the step joins the whole group (R x S), the sync the G groups.
  const step_price h = price(algorithm_by_name("fl_hsdp"), w, {4, 2, 4}, c, with_cv(0.05));
  CHECK(h.step_component == 8);
  CHECK(h.sync_components == 4);
  // An algorithm whose step communicates nothing: one rank per component.
  const step_price one = price(algorithm_by_name("fl_fsdp"), w, {8, 1, 1}, c, with_cv(0.05));
  CHECK(one.step_component == 1);
  CHECK(one.sync_components == 8);
  CHECK(one.straggler_wait == doctest::Approx(one.straggler_sync));
  CHECK_THROWS_AS((void)price(fsdp, w, {1, 1, 8}, c, with_cv(-0.1)), invalid_argument);
}

TEST_CASE("cv = 0 and oversubscription 1 price every field exactly as without them") {
  const workload w = small_gpt();
  cluster c = a100_4gpu_node();
  c.sites = 2;
  cluster contended = c;
  contended.intra.oversubscription = 1;
  contended.inter.oversubscription = 1;
  contended.wan.oversubscription = 1;
  struct run {
    const char* algo;
    algorithm_settings s;
    mesh_shape shape;
  };
  const std::vector<run> runs{
      {"fsdp", {}, {1, 1, 16}},
      {"hsdp", {}, {1, 4, 4}},
      {"fl_fsdp", {.period = 8}, {4, 1, 4}},
      {"fl_hsdp", {.period = 8, .sync = federation::sync_mode::reference}, {2, 2, 4}},
      {"streaming_diloco", {.period = 12, .fragments = 3, .delay = 1}, {2, 2, 4}},
      {"sparseloco", {}, {4, 1, 4}}};
  for (const auto& r : runs) {
    CAPTURE(r.algo);
    const algorithm_desc a = algorithm_by_name(r.algo, r.s);
    const step_price base = price(a, w, r.shape, c);
    check_equal(base, price(a, w, r.shape, c, with_cv(0)));
    check_equal(base, price(a, w, r.shape, contended));
    CHECK(base.straggler_wait == 0);
  }
}

TEST_CASE("oversubscription divides the bandwidth of its level") {
  const cluster c = a100_4gpu_node();
  auto with = [&](level_kind k, double f) {
    cluster x = c;
    (k == level_kind::intra   ? x.intra
     : k == level_kind::inter ? x.inter
                              : x.wan)
        .oversubscription = f;
    return x;
  };
  const double bytes = 1e9;
  const auto ring = collective_algorithm::ring;
  // Across 8 nodes, one member on each: the network's share halves, the transfer doubles.
  const comm_span across{8, 8, 1, 1};
  const auto base = price_collective(comm_kind::all_reduce, bytes, across, {}, c, ring);
  const auto net2 =
      price_collective(comm_kind::all_reduce, bytes, across, {}, with(level_kind::inter, 2), ring);
  CHECK(net2.transfer == doctest::Approx(2 * base.transfer));
  CHECK(net2.latency == base.latency);
  CHECK(sim::detail::ring_bandwidth(across, {4, 1}, with(level_kind::inter, 2)) ==
        doctest::Approx(sim::detail::ring_bandwidth(across, {4, 1}, c) / 2));
  // 1 changes nothing; NVLink contention does not touch a ring with one member per node.
  const auto net1 =
      price_collective(comm_kind::all_reduce, bytes, across, {}, with(level_kind::inter, 1), ring);
  CHECK(net1.seconds == base.seconds);
  CHECK(price_collective(comm_kind::all_reduce, bytes, across, {}, with(level_kind::intra, 3), ring)
            .seconds == base.seconds);
  // Inside a node: NVLink busbw divided.
  const comm_span node{4, 1, 4, 1};
  const auto in = price_collective(comm_kind::all_gather, bytes, node, {}, c, ring);
  const auto in2 =
      price_collective(comm_kind::all_gather, bytes, node, {}, with(level_kind::intra, 2), ring);
  CHECK(in2.transfer == doctest::Approx(2 * in.transfer));
  // Across sites: the uplink divided.
  const comm_span sites{2, 2, 1, 2};
  const auto wan = price_collective(comm_kind::all_reduce, bytes, sites, {}, c, ring);
  const auto wan4 =
      price_collective(comm_kind::all_reduce, bytes, sites, {}, with(level_kind::wan, 4), ring);
  CHECK(wan4.transfer == doctest::Approx(4 * wan.transfer));
  CHECK_THROWS_AS(
      (void)price_collective(comm_kind::all_reduce, bytes, across, {}, with(level_kind::inter, 0)),
      invalid_argument);
  // In a priced step: fsdp across nodes on a slow network is transfer-bound, so halving the
  // network rate (about) doubles its exposed communication.
  cluster slow = c;
  slow.nic_bandwidth = gbit_per_s(1);
  cluster slow2 = slow;
  slow2.inter.oversubscription = 2;
  const auto fsdp = algorithm_by_name("fsdp");
  const step_price p1 = price(fsdp, small_gpt(), {1, 1, 16}, slow);
  const step_price p2 = price(fsdp, small_gpt(), {1, 1, 16}, slow2);
  CHECK(p2.overlappable == doctest::Approx(2 * p1.overlappable).epsilon(0.01));
}

TEST_CASE("seconds_per_token replaces the FLOP model") {
  const cluster c = a100_4gpu_node();
  workload w = small_gpt();
  const auto a = algorithm_by_name("fsdp");
  const double flop_model = price(a, w, {1, 1, 8}, c).compute;
  w.seconds_per_token = 2e-5;
  const step_price p = price(a, w, {1, 1, 8}, c);
  CHECK(p.compute == doctest::Approx(2e-5 * w.tokens_per_gpu()));
  CHECK(p.compute != doctest::Approx(flop_model));
  w.mfu = 0.1;  // no longer matters
  w.recompute = true;
  CHECK(price(a, w, {1, 1, 8}, c).compute == p.compute);
  w.seconds_per_token = -1;
  CHECK_THROWS_AS((void)price(a, w, {1, 1, 8}, c), invalid_argument);
}

TEST_CASE("sync dtype bf16: the federation's average all-reduced at half of f32's bytes") {
  const cluster c = a100_4gpu_node();
  const workload w = small_gpt();
  const auto f32 = algorithm_by_name("fl_fsdp");
  const auto bf16 = algorithm_by_name("fl_fsdp", {.sync_dtype = dtype::bf16});
  CHECK(bf16.federation_policy() == f32.federation_policy());
  CHECK(bf16.cadence().period() == 8);
  // The plan: the cross-group average is an all_reduce of bf16, no codec.
  const flat_layout layout = bf16.layout(transformer_units(w.model, dtype::bf16), {2, 1, 4});
  const auto plans = bf16.sync_plans(layout, {2, 1, 4}, 0);
  REQUIRE(!plans.empty());
  int narrow = 0;
  for (const auto& op : plans[0].ops)
    if (op.axis == axis::federation) {
      CHECK_FALSE(encoded(op));
      CHECK(op.kind == comm_kind::all_reduce);
      narrow += op.dtype == dtype::bf16;
    }
  CHECK(narrow > 0);
  // A ring all_reduce of half-size elements: half the bytes at any G (the cast codec's
  // all-gather of every group's wire sent (G-1)/2 buffers: twice f32's at G = 8).
  for (int g : {2, 8}) {
    CAPTURE(g);
    const double b32 = price(f32, w, {g, 1, 4}, c)[axis::federation].sync_bytes;
    const double b16 = price(bf16, w, {g, 1, 4}, c)[axis::federation].sync_bytes;
    CHECK(b16 / b32 == doctest::Approx(0.5).epsilon(1e-9));
  }
  // Refused where it cannot apply, with the reason.
  CHECK(error_of([] {
          (void)algorithm_by_name("fsdp", {.sync_dtype = dtype::bf16});
        }).find("fsdp: a bf16 sync needs an algorithm that federates") != std::string::npos);
  const auto sloco = algorithm_by_name("sparseloco", {.sync_dtype = dtype::bf16});
  CHECK(error_of([&] {
          (void)sloco.sync_plans(sloco.layout(transformer_units(w.model, dtype::bf16), {2, 1, 4}),
                                 {2, 1, 4}, 0);
        }).find("sends its average encoded") != std::string::npos);
  CHECK(error_of([] {
          (void)algorithm_by_name("fl_fsdp", {.sync_dtype = dtype::f64});
        }).find("the sync dtype must be f32, bf16 or f16, found f64") != std::string::npos);
  // The sync dtype is the algorithm's: price_options' precision.sync is refused.
  price_options po;
  po.precision.sync = dtype::bf16;
  CHECK(error_of([&] {
          (void)price(f32, w, {2, 1, 4}, c, po);
        }).find("price_options::precision.sync must be f32, found bf16") != std::string::npos);
}
