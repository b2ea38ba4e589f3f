// Pricing a step: the priced plans are the trainer's (bytes equal its traffic counters), the
// limits behave, and hierarchical federation sync moves R times fewer inter-group bytes.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/error.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/plan/traffic.hpp"
#include "fedshard/sim/price.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;
using namespace fedshard::sim;

namespace {

constexpr double inf = std::numeric_limits<double>::infinity();

/// A cluster whose links cost nothing.
cluster free_links(cluster c) {
  c.intra = {0, inf};
  c.inter = {0, inf};
  c.wan = {0, inf};
  c.nic_bandwidth = inf;
  c.op_latency = 0;
  return c;
}

workload small_gpt() {
  return {gpt2_small(), 2, 1024, 0, false};
}

/// What a trainer run on inproc ranks recorded, per world rank.
struct recorded {
  std::vector<traffic_counters> traffic;
  std::vector<plan> step_plans, sync_plans;
};

template <class Algorithm>
recorded train(mesh_shape shape, int steps, trainer_options<Algorithm> opts) {
  recorded out;
  const int W = shape.size();
  out.traffic.resize(W);
  out.step_plans.resize(W);
  out.sync_plans.resize(W);
  opts.total_steps = steps;
  test::spawn_ranks(W, [&](inproc::communicator& world) {
    mesh m(world, shape);
    trainer<test::mlp_model, Algorithm, optim::adamw> t(m, test::mlp_model{}, {.lr = 1e-2f}, opts);
    const int gs = shape.replicas * shape.shards;
    const int local = m.coords().replica * shape.shards + m.coords().shard;
    for (int s = 0; s < steps; ++s)
      t.step(t.model().batch(3, s, m.coords().group, shape.groups, local, gs, 2));
    const auto r = static_cast<std::size_t>(world.rank());
    out.traffic[r] = t.traffic();
    out.step_plans[r] = t.step_plan();
    out.sync_plans[r] = t.sync_plan();
  });
  return out;
}

}  // namespace

TEST_CASE_TEMPLATE("priced bytes equal the executor's traffic counters for the same plan", A,
                   fl_hsdp<2>, fl_fsdp<2>, hsdp) {
  constexpr int K = 2, steps = 4;
  const mesh_shape shape =
      std::is_same_v<A, fl_fsdp<2>> ? mesh_shape{2, 1, 3} : mesh_shape{2, 2, 2};
  const shard::precision prec{dtype::bf16, dtype::f32};
  trainer_options<A> opts;
  opts.precision = prec;
  const recorded run = train<A>(shape, steps, opts);

  const algorithm_desc a = describe<A>("under test");
  const int syncs = a.syncs ? steps / K : 0;
  const flat_layout layout = layout_of(a, test::mlp_model{}.units(), shape);
  price_options po;
  po.precision = prec;
  const step_price p =
      price_plans(a, test::mlp_model{}.units(), shape, a100_4gpu_node(), 1.0, 1.0, po);
  CHECK(p.period == (a.syncs ? K : 1));
  for (int r = 0; r < shape.size(); ++r) {
    CAPTURE(r);
    const auto ur = static_cast<std::size_t>(r);
    // The simulator builds the trainer's very plans...
    CHECK(step_plan_of(a, layout, shape, prec).ops == run.step_plans[ur].ops);
    CHECK(sync_plan_of(a, layout, shape, r).ops == run.sync_plans[ur].ops);
    // ...so what it prices is what the executor counted, axis by axis.
    for (axis ax : all_axes) {
      CAPTURE(to_string(ax));
      const axis_price& priced = p.ranks[ur].axes[static_cast<std::size_t>(ax)];
      const axis_traffic& counted = run.traffic[ur][ax];
      CHECK(counted.wire_bytes ==
            doctest::Approx(steps * priced.step_bytes + syncs * priced.sync_bytes));
      CHECK(counted.calls == steps * priced.step_calls + syncs * priced.sync_calls);
      CHECK(priced.bytes_per_step == doctest::Approx(priced.step_bytes + priced.sync_bytes / K));
    }
  }
}

TEST_CASE("infinite bandwidth and zero latency give the compute time") {
  const cluster c = free_links(a100_4gpu_node());
  const workload w = small_gpt();
  const compute_model cm{c.peak_flops, c.default_mfu, false};
  const double compute = cm.seconds(w.model, w.tokens_per_gpu(), w.seq);
  for (const auto& [name, shape] :
       std::vector<std::pair<std::string, mesh_shape>>{{"fsdp", {1, 1, 64}},
                                                       {"hsdp", {1, 16, 4}},
                                                       {"fl_fsdp", {16, 1, 4}},
                                                       {"fl_hsdp", {4, 4, 4}},
                                                       {"ddp", {1, 1, 64}}}) {
    CAPTURE(name);
    const step_price p = price(algorithm_by_name(name, 4), w, shape, c);
    CHECK(p.compute == doctest::Approx(compute));
    CHECK(p.step == doctest::Approx(compute));
    CHECK(p.tokens_per_s_per_gpu == doctest::Approx(w.tokens_per_gpu() / compute));
    CHECK(p.exposed_comm() == 0);
  }
  // Infinite bandwidth alone leaves only latency: a small step over many ranks.
  cluster latency_only = c;
  latency_only.intra.alpha = latency_only.inter.alpha = 1e-5;
  const step_price p = price(algorithm_by_name("fl_fsdp", 4), w, {16, 1, 4}, latency_only);
  CHECK(p.step > compute);
  CHECK(p.step < compute + 1e-2);
}

TEST_CASE("K to infinity removes the federation cost; the cost falls as K grows") {
  const cluster c = a100_4gpu_node();
  const workload w = small_gpt();
  const mesh_shape shape{16, 1, 4};
  // fl_fsdp and fsdp share the step plan on this mesh (full_shard over each group).
  algorithm_desc plain = describe<fsdp>("fsdp inside groups");
  const step_price no_sync = price(plain, w, shape, c);
  double previous = inf;
  for (int k : {1, 4, 64, 1 << 20, std::numeric_limits<int>::max()}) {
    CAPTURE(k);
    const step_price p = price(algorithm_by_name("fl_fsdp", k), w, shape, c);
    CHECK(p.sync > 0);
    CHECK(p.sync_per_step == doctest::Approx(p.sync / k));
    CHECK(p.step <= previous);
    previous = p.step;
  }
  CHECK(previous == doctest::Approx(no_sync.step).epsilon(1e-9));
  CHECK(no_sync.sync == 0);
}

TEST_CASE("hierarchical federation sync prices R times fewer inter-group bytes per rank") {
  const cluster c = a100_4gpu_node();
  const workload w = small_gpt();
  const mesh_shape shape{4, 4, 2};  // R = 4
  const auto hier =
      price(algorithm_by_name("fl_hsdp", 8, federation::sync_mode::hierarchical), w, shape, c);
  const auto ref =
      price(algorithm_by_name("fl_hsdp", 8, federation::sync_mode::reference), w, shape, c);
  const int replica0 = rank_of(shape, {1, 0, 1});
  const double h = hier.ranks[replica0].axes[static_cast<std::size_t>(axis::federation)].sync_bytes;
  const double r = ref.ranks[replica0].axes[static_cast<std::size_t>(axis::federation)].sync_bytes;
  CHECK(h > 0);
  CHECK(r == doctest::Approx(4 * h));
  // Hierarchically every replica carries its share; in the reference mode only replica 0.
  const int replica2 = rank_of(shape, {1, 2, 1});
  CHECK(hier.ranks[replica2].axes[static_cast<std::size_t>(axis::federation)].sync_bytes == h);
  CHECK(ref.ranks[replica2].axes[static_cast<std::size_t>(axis::federation)].sync_bytes == 0);
  // And the federation axis costs less time per sync.
  CHECK(hier[axis::federation].sync_seconds < ref[axis::federation].sync_seconds);
  // The slowest rank in the reference mode is a replica 0 (it does the inter-group work).
  CHECK(coords_of(shape, ref.critical_rank).replica == 0);
}

TEST_CASE("overlap: overlappable step ops hide behind compute, syncs are exposed") {
  const cluster c = a100_4gpu_node();
  workload w = small_gpt();
  const mesh_shape shape{16, 1, 4};
  const auto a = algorithm_by_name("fl_fsdp", 4);
  // Lots of compute: the FSDP gathers and reduce-scatters hide entirely.
  w.micro_batch = 512;
  const step_price slow = price(a, w, shape, c);
  CHECK(slow.overlappable > 0);
  CHECK(slow.hidden == doctest::Approx(slow.overlappable));
  CHECK(slow.exposed_step == 0);
  CHECK(slow.step == doctest::Approx(slow.compute + slow.sync / 4));
  // Infinitely fast compute: nothing hides.
  const step_price fast = price_plans(a, transformer_units(w.model), shape, c, 0.0, 1.0);
  CHECK(fast.hidden == 0);
  CHECK(fast.step == doctest::Approx(fast.overlappable + fast.sync / 4));
  // The exposed time per axis adds up to step - compute.
  for (const step_price* p : {&slow, &fast}) {
    double sum = 0;
    for (axis ax : all_axes) sum += (*p)[ax].exposed;
    CHECK(sum == doctest::Approx(p->step - p->compute));
  }
}

TEST_CASE("bandwidth-bound, the step-time ratio is the ratio of bytes leaving a node") {
  cluster c = free_links(a100_4gpu_node());
  c.nic_bandwidth = 1e3;  // a trickle: the network is all that counts
  const workload w = small_gpt();
  price_options ring;  // node bytes count ring traffic; a hierarchical one moves a bit less
  ring.collectives = collective_algorithm::ring;
  const auto f = price(algorithm_by_name("fsdp"), w, {1, 1, 64}, c, ring);
  const auto fl = price(algorithm_by_name("fl_fsdp", 8), w, {16, 1, 4}, c, ring);
  auto egress = [](const step_price& p) {
    double e = 0;
    for (axis ax : all_axes) e += p[ax].node_bytes_per_step;
    return e;
  };
  CHECK(egress(f) == doctest::Approx(f[axis::shard].bytes_per_step));  // one ring per node
  CHECK(egress(fl) == doctest::Approx(4 * fl[axis::federation].bytes_per_step));  // four
  CHECK(f.step / fl.step == doctest::Approx(egress(f) / egress(fl)).epsilon(1e-3));
}

TEST_CASE("the bytes per axis are the plan's wire bytes, as traffic_counters::of counts them") {
  const cluster c = a100_4gpu_node();
  const workload w{llama31_8b(), 2, 2048, 0, false};
  const mesh_shape shape{16, 8, 4};
  const auto a = algorithm_by_name("fl_hsdp", 8);
  const step_price p = price(a, w, shape, c);
  const flat_layout layout = layout_of(a, transformer_units(w.model), shape);
  const int r = p.critical_rank;
  const auto steps =
      traffic_counters::of(step_plan_of(a, layout, shape, price_options{}.precision));
  const auto syncs = traffic_counters::of(sync_plan_of(a, layout, shape, r));
  for (axis ax : all_axes) {
    CHECK(p[ax].step_bytes == steps[ax].wire_bytes);
    CHECK(p[ax].sync_bytes == syncs[ax].wire_bytes);
  }
  CHECK(p[axis::shard].level == level_kind::intra);
  CHECK(p[axis::replica].level == level_kind::inter);
  CHECK(p[axis::federation].level == level_kind::inter);
}

TEST_CASE("bad input is refused") {
  const cluster c = a100_4gpu_node();
  CHECK_THROWS_AS(algorithm_by_name("fedsgd"), invalid_argument);
  CHECK_THROWS_AS(algorithm_by_name("fl_fsdp", 0), invalid_argument);
  // full_shard needs R = 1.
  CHECK_THROWS_AS(price(algorithm_by_name("fl_fsdp", 8), small_gpt(), {2, 2, 2}, c),
                  invalid_argument);
  CHECK_THROWS_AS(price(algorithm_by_name("fsdp"), {gpt2_small(), 0, 1024, 0, false}, {1, 1, 4}, c),
                  invalid_argument);
}
