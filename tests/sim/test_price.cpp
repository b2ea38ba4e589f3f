// Pricing a step: the priced plans are the trainer's (bytes equal what its wire recorded, for
// every alias, streaming_diloco and custom algorithms included), the cadence comes from the
// schedule, the limits behave, hierarchical federation sync moves R times fewer inter-group
// bytes, and streaming's delay hides its all_reduce behind compute.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/error.hpp"
#include "fedshard/federation/heal.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/plan/traffic.hpp"
#include "fedshard/sim/price.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

#include "support/sim.hpp"

using namespace fedshard;
using namespace fedshard::sim;
using namespace fedshard::test;  // the fixtures of support/sim.hpp

namespace {

constexpr double inf = std::numeric_limits<double>::infinity();

/// What a trainer run on inproc ranks recorded, per world rank.
struct recorded {
  std::vector<traffic_counters> traffic;
  std::vector<plan> step_plans;
  std::vector<std::vector<plan>> sync_plans;  // per rank, per fragment
};

/// Trains test::mlp_model with A and AdamW for `steps` steps of a run of `total_steps`
/// (trainer_options::total_steps) on inproc ranks, with the simulator's settings o; counts what
/// the wire recorded after construction.
template <Algorithm A>
recorded train(mesh_shape shape, int steps, std::int64_t total_steps, const algorithm_options<A>& o,
               const shard::precision& prec) {
  recorded out;
  const int W = shape.size();
  out.traffic.resize(W);
  out.step_plans.resize(W);
  out.sync_plans.resize(W);
  trainer_options<A> opts;
  opts.precision = prec;
  opts.precision.sync = o.sync_dtype;  // the simulator's is the algorithm's setting
  opts.total_steps = total_steps;
  opts.federation = o.federation;
  opts.schedule = o.schedule;
  test::spawn_ranks(W, [&](inproc::communicator& world) {
    mesh m(world, shape);
    trainer<test::mlp_model, A, optim::adamw, inproc::communicator> t(m, test::mlp_model{},
                                                                      {.lr = 1e-2f}, opts);
    CHECK(static_cast<int>(t.optimizer().state().size()) == o.inner_state_buffers);
    t.traffic().reset();  // count training only, not the construction's layout check
    const int gs = shape.replicas * shape.shards;
    const int local = m.coords().replica * shape.shards + m.coords().shard;
    for (int s = 0; s < steps; ++s)
      t.step(t.model().batch(3, s, m.coords().group, shape.groups, local, gs, 2));
    const auto r = static_cast<std::size_t>(world.rank());
    out.traffic[r] = t.traffic();
    out.step_plans[r] = t.step_plan();
    for (int f = 0; f < t.schedule().fragments(); ++f) out.sync_plans[r].push_back(t.sync_plan(f));
  });
  return out;
}

/// A 2 x 2 x 2 mesh when A's shard policy accepts replicas, else 2 x 1 x 3.
template <Algorithm A>
mesh_shape test_mesh() {
  const mesh_shape replicated{2, 2, 2};
  return error_of([&] { A::shard_policy::check(replicated); }).empty() ? replicated
                                                                       : mesh_shape{2, 1, 3};
}

/// Trains A with settings o twice on its test mesh and checks, on every rank and axis, that
/// what the wire recorded is what the simulator says: (1) the trainer's plans are the
/// simulator's; (2) a run of 7 steps with total_steps = 7 (final-step syncs) moves
/// run_traffic's calls and bytes; (3) a run of 12 steps of unknown length (a whole number of
/// patterns: K = 2 or 3, H = 6, every step, post-local's window of 12) moves 12 x the priced
/// bytes per step and, with one fragment, 12 x step_calls plus sync_calls per sync.
template <Algorithm A>
void check_against_wire(std::string_view name, const algorithm_desc& a,
                        const algorithm_options<A>& o) {
  CAPTURE(name);
  const mesh_shape shape = test_mesh<A>();
  CAPTURE(to_string(shape));
  const shard::precision prec{dtype::bf16, dtype::f32};
  const auto units = test::mlp_model{}.units();
  price_options po;
  po.precision = prec;

  const recorded finite = train<A>(shape, 7, 7, o, prec);
  const flat_layout layout = layout_of(a, units, shape);
  for (int r = 0; r < shape.size(); ++r) {
    CAPTURE(r);
    const auto ur = static_cast<std::size_t>(r);
    // The simulator builds the trainer's very plans...
    CHECK(step_plan_of(a, layout, shape, prec).ops == finite.step_plans[ur].ops);
    const auto syncs = sync_plans_of(a, layout, shape, r);
    REQUIRE(syncs.size() == finite.sync_plans[ur].size());
    for (std::size_t f = 0; f < syncs.size(); ++f)
      CHECK(syncs[f].ops == finite.sync_plans[ur][f].ops);
    // ...and fires them as the trainer does: the same calls and bytes, axis by axis.
    const traffic_counters sim = run_traffic(a, units, shape, r, 7, 7, prec);
    for (axis ax : all_axes) {
      CAPTURE(to_string(ax));
      CHECK(finite.traffic[ur][ax].calls == sim[ax].calls);
      CHECK(finite.traffic[ur][ax].payload_bytes == sim[ax].payload_bytes);
      CHECK(finite.traffic[ur][ax].wire_bytes == sim[ax].wire_bytes);
    }
  }

  // 12 steps are a whole number of the pattern of every setting below, so the priced bytes
  // per step, times 12, are what the wire recorded.
  const recorded open = train<A>(shape, 12, 0, o, prec);
  const step_price p = price_plans(a, units, shape, a100_4gpu_node(), 1.0, 1.0, po);
  const double syncs_in_run = 12 * a.cadence().starts_per_step();
  for (int r = 0; r < shape.size(); ++r) {
    CAPTURE(r);
    const auto ur = static_cast<std::size_t>(r);
    CHECK(run_traffic(a, units, shape, r, 12, 0, prec).same_traffic(open.traffic[ur]));
    for (axis ax : all_axes) {
      CAPTURE(to_string(ax));
      const axis_price& priced = p.ranks[ur].axes[static_cast<std::size_t>(ax)];
      const axis_traffic& counted = open.traffic[ur][ax];
      CHECK(counted.wire_bytes == doctest::Approx(12 * priced.bytes_per_step));
      if (a.fragments() == 1)  // then every sync runs sync_calls calls
        CHECK(static_cast<double>(counted.calls) ==
              doctest::Approx(12.0 * static_cast<double>(priced.step_calls) +
                              syncs_in_run * static_cast<double>(priced.sync_calls)));
    }
  }
}

/// fl_hsdp's sync with token weights and Photon's averaged inner moments (sync_prepare and
/// sync_after ops), on ZeRO-2 inside groups and a post-local schedule: a custom algorithm.
using weighted_post_local =
    algorithm<shard::shard_grad_op, federation::weighted_average, schedule::post_local>;
using photon_like =
    algorithm<shard::hybrid_shard, federation::outer_optimizer<federation::fedmom>,
              schedule::periodic, defaults<schedule::periodic::config{.period = 3}>>;

}  // namespace

TEST_CASE("priced bytes equal the trainer's wire traffic, for every alias") {
  int aliases = 0;
  for (auto mode : {federation::sync_mode::hierarchical, federation::sync_mode::reference}) {
    CAPTURE(to_string(mode));
    for_each_algorithm([&]<class A>(std::string_view name) {
      ++aliases;
      // K = 2 for the periodic aliases; streaming: H = 6, 3 fragments (one unit each), a
      // fragment in flight for 1 step, mixing 0.5.
      algorithm_settings s{.period = 2, .sync = mode};
      if constexpr (requires(typename A::sync_schedule::config c) { c.fragments; })
        s = {.period = 6, .fragments = 3, .delay = 1, .alpha = 0.5f, .sync = mode};
      const algorithm_options<A> o = options_for<A>(name, s);
      const algorithm_desc a = describe<A>(std::string(name), o);
      // The by-name description is the same algorithm with the same settings.
      const algorithm_desc by_name = algorithm_by_name(name, s);
      CHECK(by_name.shard_policy() == a.shard_policy());
      CHECK(by_name.federation_policy() == a.federation_policy());
      CHECK(by_name.sync_schedule() == a.sync_schedule());
      CHECK(by_name.cadence().window == a.cadence().window);
      CHECK(by_name.cadence().mean_in_flight() == a.cadence().mean_in_flight());
      // SCAPE's steps run different plans: test_price_sparse.cpp checks its runs on the wire.
      // A local rule's traffic (hofl, lss) is checked against the trainer's wire in
      // test_price_local.cpp: its records ops are not the synchronizer's plan, and a soup's
      // per-step price is the full pool's (run_traffic follows the round).
      if constexpr (!steps_vary_v<A>)
        if (!A::default_local_rule()) check_against_wire<A>(name, a, o);
    });
  }
  CHECK(aliases == 2 * static_cast<int>(algorithm_names().size()));
}

TEST_CASE("bf16 and f16 syncs: the simulator prices the trainer's plans, and refuses as it does") {
  // The aliases whose federation averages in the narrow dtype (average, holder_average, the
  // outer optimizers); sparseloco (a codec), gasloc (gossip), feast and collate
  // (element_average) are refused alike; SCAPE's varying steps and the local rules (hofl,
  // lss) are checked elsewhere.
  const std::set<std::string> narrow{"fl_fsdp",          "fl_hsdp", "fl_hsdp_int8", "diloco",
                                     "streaming_diloco", "fomoe",   "fcp"};
  for (dtype d : {dtype::bf16, dtype::f16}) {
    CAPTURE(to_string(d));
    std::set<std::string> accepted;
    for_each_algorithm([&]<class A>(std::string_view name) {
      if constexpr (!steps_vary_v<A> && A::federation_policy::syncs) {
        if (A::default_local_rule()) return;
        CAPTURE(name);
        algorithm_settings s{.period = 2, .sync_dtype = d};
        if constexpr (requires(typename A::sync_schedule::config c) { c.fragments; })
          s = {.period = 6, .fragments = 3, .delay = 1, .alpha = 0.5f, .sync_dtype = d};
        const algorithm_options<A> o = options_for<A>(name, s);
        algorithm_options<A> narrowed = o;
        narrowed.sync_dtype = d;
        const algorithm_desc a = describe<A>(std::string(name), narrowed);
        const mesh_shape shape = test_mesh<A>();
        const flat_layout layout = layout_of(a, test::mlp_model{}.units(), shape);
        const std::string sim_error = error_of([&] { (void)sync_plans_of(a, layout, shape, 0); });
        const std::string trainer_error = error_of([&] {
          (void)train<A>(shape, 1, 1, narrowed, {dtype::bf16, dtype::f32});
        });
        CHECK(sim_error.empty() == trainer_error.empty());
        if (!sim_error.empty()) {
          CHECK(sim_error.find(std::string(to_string(d)) + ", but federation policy") !=
                std::string::npos);
          return;
        }
        accepted.emplace(name);
        // Every federation op that averages travels in d: half of an f32 op's bytes.
        for (const plan& p : sync_plans_of(a, layout, shape, 0))
          for (const comm_op& op : p.ops)
            if (op.axis == axis::federation) CHECK(op.dtype == d);
        check_against_wire<A>(name, a, narrowed);
      }
    });
    CHECK(accepted == narrow);
  }
}

TEST_CASE("priced bytes equal the trainer's wire traffic, for custom algorithms") {
  SUBCASE("token-weighted averaging, ZeRO-2, post-local SGD") {
    // Synchronous for 2 steps, then every 5: syncs after steps 0, 1, 6 and 11 of 12. The
    // cadence is read over those 12 steps.
    algorithm_options<weighted_post_local> o{.schedule = {.switch_step = 2, .k = 5},
                                             .cadence_window = 12};
    const algorithm_desc a = describe<weighted_post_local>("weighted post-local", o);
    CHECK(a.cadence().fragments.at(0).starts == 4);
    check_against_wire<weighted_post_local>("weighted post-local", a, o);
  }
  SUBCASE("an outer optimizer that averages the inner moments too (Photon)") {
    algorithm_options<photon_like> o;
    o.federation.average_inner_moments = true;
    const algorithm_desc a = describe<photon_like>("photon-like", o);
    CHECK(a.cadence().window == 3);
    check_against_wire<photon_like>("photon-like", a, o);
  }
}

TEST_CASE("the cadence is read from the schedule's actions") {
  SUBCASE("periodic: one blocking sync per K steps") {
    const sync_cadence c = cadence_of(schedule::periodic({.period = 5}), 5);
    REQUIRE(c.fragments.size() == 1);
    CHECK(c.fragments[0].starts == 1);
    CHECK(c.fragments[0].applies == 1);
    CHECK(c.fragments[0].in_flight == std::vector<std::int64_t>{0});
    CHECK(c.period() == 5);
    CHECK(c.mean_in_flight() == 0);
  }
  SUBCASE("streaming: each fragment once per H steps, in flight tau steps") {
    const schedule::streaming s({.period = 10, .fragments = 2, .delay = 3, .alpha = 1.0f});
    const sync_cadence c = cadence_of(s, 10);
    REQUIRE(c.fragments.size() == 2);
    for (const auto& f : c.fragments) {
      CHECK(f.starts == 1);
      CHECK(f.applies == 1);
      CHECK(f.in_flight == std::vector<std::int64_t>{3});
    }
    CHECK(c.period() == 10);
    CHECK(c.mean_in_flight() == 3);
  }
  SUBCASE("every_step over any window") {
    const sync_cadence c = cadence_of(schedule::every_step{}, 7);
    CHECK(c.fragments.at(0).starts == 7);
    CHECK(c.period() == 1);
  }
  SUBCASE("the alias's run-time settings set the window") {
    CHECK(algorithm_by_name("fl_hsdp").cadence().window == 8);  // the alias's default K
    CHECK(algorithm_by_name("diloco").cadence().window == 500);
    CHECK(algorithm_by_name("fl_hsdp", {.period = 3}).cadence().window == 3);
    const algorithm_desc s =
        algorithm_by_name("streaming_diloco", {.period = 40, .fragments = 4, .delay = 2});
    CHECK(s.fragments() == 4);
    CHECK(s.cadence().window == 40);
    CHECK(s.cadence().period() == 40);
    CHECK(s.cadence().mean_in_flight() == 2);
  }
  SUBCASE("windows that cannot be scanned are refused") {
    CHECK(error_of([] { cadence_of(schedule::periodic({.period = 5}), 0); }).find("[1, ") !=
          std::string::npos);
    CHECK(error_of([] {
            algorithm_by_name("fl_fsdp", {.period = int{max_cadence_window} + 1});
          }).find("cannot be scanned") != std::string::npos);
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
                                                       {"ddp", {1, 1, 64}},
                                                       {"zero2", {1, 1, 64}},
                                                       {"diloco", {4, 4, 4}},
                                                       {"streaming_diloco", {4, 4, 4}}}) {
    CAPTURE(name);
    const step_price p = price(algorithm_by_name(name, {.period = 4}), w, shape, c);
    CHECK(p.compute == doctest::Approx(compute));
    CHECK(p.step == doctest::Approx(compute));
    CHECK(p.tokens_per_s_per_gpu == doctest::Approx(w.tokens_per_gpu() / compute));
    CHECK(p.exposed_comm() == 0);
  }
  // Infinite bandwidth alone leaves only latency: a small step over many ranks.
  cluster latency_only = c;
  latency_only.intra.alpha = latency_only.inter.alpha = 1e-5;
  const step_price p =
      price(algorithm_by_name("fl_fsdp", {.period = 4}), w, {16, 1, 4}, latency_only);
  CHECK(p.step > compute);
  CHECK(p.step < compute + 1e-2);
}

TEST_CASE("K to infinity removes the federation cost; the cost falls as K grows") {
  const cluster c = a100_4gpu_node();
  const workload w = small_gpt();
  const mesh_shape shape{16, 1, 4};
  // fl_fsdp and fsdp share the step plan on this mesh (full_shard over each group).
  const step_price no_sync = price(describe<fsdp>("fsdp inside groups"), w, shape, c);
  double previous = inf;
  for (int k : {1, 4, 64, 1 << 20, int{max_cadence_window}}) {
    CAPTURE(k);
    const step_price p = price(algorithm_by_name("fl_fsdp", {.period = k}), w, shape, c);
    CHECK(p.period == k);
    CHECK(p.sync > 0);
    CHECK(p.sync_per_step == doctest::Approx(p.sync / k));
    CHECK(p.step <= previous);
    CHECK(p.step - no_sync.step == doctest::Approx(p.sync / k).epsilon(1e-6));
    previous = p.step;
  }
  CHECK(previous == doctest::Approx(no_sync.step).epsilon(1e-7));
  CHECK(no_sync.sync == 0);
}

TEST_CASE("hierarchical federation sync prices R times fewer inter-group bytes per rank") {
  const cluster c = a100_4gpu_node();
  const workload w = small_gpt();
  const mesh_shape shape{4, 4, 2};  // R = 4
  const auto hier = price(
      algorithm_by_name("fl_hsdp", {.period = 8, .sync = federation::sync_mode::hierarchical}), w,
      shape, c);
  const auto ref =
      price(algorithm_by_name("fl_hsdp", {.period = 8, .sync = federation::sync_mode::reference}),
            w, shape, c);
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

TEST_CASE("run_traffic fires gossip's plan of each round: an odd G's idle group moves") {
  // 3 groups at degree 1: one group idles each round, a different one as the matchings
  // change; 8 steps syncing every 2, so 4 rounds, on a 3 x 1 x 2 mesh.
  const shard::precision prec{dtype::bf16, dtype::f32};
  algorithm_options<gasloc> o;
  o.schedule.period = 2;
  o.federation = {.degree = 1, .alpha = 0.5f, .seed = 1};
  const algorithm_desc a = describe<gasloc>("gasloc", o);
  CHECK(a.plan_per_round());
  const mesh_shape shape{3, 1, 2};
  const auto units = test::mlp_model{}.units();
  const recorded run = train<gasloc>(shape, 8, 8, o, prec);
  std::set<std::int64_t> calls_seen;
  for (int r = 0; r < shape.size(); ++r) {
    CAPTURE(r);
    const auto ur = static_cast<std::size_t>(r);
    const traffic_counters sim = run_traffic(a, units, shape, r, 8, 8, prec);
    CHECK(sim.same_traffic(run.traffic[ur]));
    calls_seen.insert(sim[axis::federation].calls);
  }
  CHECK(calls_seen.size() > 1);  // the groups idled in different numbers of rounds
}

TEST_CASE("gossip's federation time per sync does not grow with G; average's does") {
  // One group per site: every exchange and every all_reduce crosses the WAN. gasloc sends
  // its fragment to one peer per sync whatever G; diloco's ring all_reduce takes 2 (G - 1)
  // steps of the WAN's latency.
  const workload w = small_gpt();
  double gossip_sync = -1, average_sync = 0;
  for (int G : {2, 4, 8, 16}) {
    CAPTURE(G);
    cluster c = a100_4gpu_node();
    c.sites = G;
    const mesh_shape shape{G, 1, 4};
    const step_price g =
        price(describe<gasloc>("gasloc", {.schedule = {.period = 8}}), w, shape, c);
    const step_price a =
        price(describe<diloco>("diloco", {.schedule = {.period = 8}}), w, shape, c);
    const axis_price& gf = g.axes[static_cast<std::size_t>(axis::federation)];
    const axis_price& af = a.axes[static_cast<std::size_t>(axis::federation)];
    CHECK(gf.level == level_kind::wan);
    CHECK(gf.sync_calls == 1);  // degree 1, G even: one exchange per rank
    CHECK(gf.sync_seconds > 0);
    if (gossip_sync < 0) gossip_sync = gf.sync_seconds;
    CHECK(gf.sync_seconds == doctest::Approx(gossip_sync).epsilon(1e-12));
    CHECK(af.sync_seconds > average_sync);
    average_sync = af.sync_seconds;
    // The priced bytes are the plan's: the rank's fragment shard, once each way.
    const flat_layout l = describe<gasloc>("gasloc", {.schedule = {.period = 8}})
                              .layout(transformer_units(w.model, dtype::bf16), shape);
    const auto plans =
        describe<gasloc>("gasloc", {.schedule = {.period = 8}}).sync_plans(l, shape, 0);
    CHECK(gf.sync_bytes == plans.at(0).wire_bytes_on(axis::federation));
  }
  CHECK(average_sync > 2 * gossip_sync);  // at G = 16
}

TEST_CASE("codecs: encoded bytes are priced as their wires, plus the codec kernels' passes") {
  cluster c = a100_4gpu_node();
  const workload w = small_gpt();
  const mesh_shape shape{4, 2, 2};
  const int r = rank_of(shape, {1, 1, 1});
  const auto fed = static_cast<std::size_t>(axis::federation);
  const auto sh = static_cast<std::size_t>(axis::shard);
  // sparseloco's outer step vs diloco's (same H). Its wire is 110.7x smaller than the f32
  // buffer, but at G = 4 each rank sends G - 1 = 3 wires against the ring all_reduce's
  // 2 (G - 1) / G = 1.5 buffers: 110.7 x 1.5 / 3 = 55x fewer bytes.
  const auto sparse = price(algorithm_by_name("sparseloco", {.period = 30}), w, shape, c);
  const auto dense = price(algorithm_by_name("diloco", {.period = 30}), w, shape, c);
  const double sb = sparse.ranks[r].axes[fed].sync_bytes, db = dense.ranks[r].axes[fed].sync_bytes;
  CHECK(db / sb == doctest::Approx(16384.0 / 148 * 1.5 / 3).epsilon(0.01));
  // fl_hsdp_int8: the shard axis carries int8 + scales (about 4x fewer bytes than f32 params;
  // the workload gathers bf16, so about 2x fewer here).
  const auto int8 = price(algorithm_by_name("fl_hsdp_int8", {.period = 8}), w, shape, c);
  const auto f32 = price(algorithm_by_name("fl_hsdp", {.period = 8}), w, shape, c);
  CHECK(int8.ranks[r].axes[sh].step_bytes < f32.ranks[r].axes[sh].step_bytes);
  // The codec kernels cost time at the GPU's memory bandwidth: infinitely fast memory makes
  // the federation sync cheaper, and without a codec it changes nothing.
  cluster fast = c;
  fast.memory_bandwidth = 0;  // priced at nothing
  const auto sparse_free = price(algorithm_by_name("sparseloco", {.period = 30}), w, shape, fast);
  CHECK(sparse_free[axis::federation].sync_seconds < sparse[axis::federation].sync_seconds);
  const auto dense_free = price(algorithm_by_name("diloco", {.period = 30}), w, shape, fast);
  CHECK(dense_free[axis::federation].sync_seconds == dense[axis::federation].sync_seconds);
}

TEST_CASE("overlap: overlappable step ops hide behind compute, blocking syncs are exposed") {
  const cluster c = a100_4gpu_node();
  workload w = small_gpt();
  const mesh_shape shape{16, 1, 4};
  const auto a = algorithm_by_name("fl_fsdp", {.period = 4});
  price_options channel;
  channel.overlap = step_overlap::channel;
  // Lots of compute: under the channel model the FSDP gathers and reduce-scatters hide
  // entirely.
  w.micro_batch = 512;
  const step_price slow = price(a, w, shape, c, channel);
  CHECK(slow.overlappable > 0);
  CHECK(slow.hidden == doctest::Approx(slow.overlappable));
  CHECK(slow.exposed_step == 0);
  CHECK(slow.sync_hidden == 0);  // K syncs are blocking: nothing in flight
  CHECK(slow.step == doctest::Approx(slow.compute + slow.sync / 4));
  // The timeline (the default) exposes what the compute waits for even then: the first
  // forward gather, the first backward gather (nothing prefetches across phases) and the
  // last reduce_scatter, and nothing else.
  const step_price timed = price(a, w, shape, c);
  CHECK(timed.exposed_step > 0);
  CHECK(timed.exposed_step < timed.overlappable / 4);
  CHECK(timed.step == doctest::Approx(timed.compute + timed.exposed_step + timed.sync / 4));
  // Infinitely fast compute: nothing hides, under either model.
  for (const price_options& o : {channel, price_options{}}) {
    const step_price fast = price_plans(a, transformer_units(w.model), shape, c, 0.0, 1.0, o);
    CHECK(fast.hidden == 0);
    CHECK(fast.step == doctest::Approx(fast.overlappable + fast.sync / 4));
  }
  const step_price fast = price_plans(a, transformer_units(w.model), shape, c, 0.0, 1.0);
  // The exposed time per axis adds up to step - compute.
  for (const step_price* p : {&slow, &timed, &fast}) {
    double sum = 0;
    for (axis ax : all_axes) sum += (*p)[ax].exposed;
    CHECK(sum == doctest::Approx(p->step - p->compute));
  }
}

TEST_CASE("streaming_diloco: each fragment once per H steps, and a delay hides its all_reduce") {
  const cluster c = a100_4gpu_node();
  // 14 units (fragments of 4, 4, 3 and 3), and enough compute for a fragment's all_reduce to
  // fit behind two steps.
  const workload w{gpt2_small(), 64, 1024, 0, false};
  const mesh_shape shape{4, 2, 4};
  constexpr int H = 100, P = 4;
  const algorithm_desc blocking =
      algorithm_by_name("streaming_diloco", {.period = H, .fragments = P, .delay = 0});
  const step_price p0 = price(blocking, w, shape, c);
  CHECK(p0.fragments == P);
  CHECK(p0.period == H);
  CHECK(p0.in_flight == 0);

  // Federation bytes per step: every fragment's sync bytes once per H steps, i.e. the whole
  // model's sync bytes / H.
  const flat_layout layout = layout_of(blocking, transformer_units(w.model), shape);
  const auto syncs = sync_plans_of(blocking, layout, shape, p0.critical_rank);
  REQUIRE(syncs.size() == P);
  double model_sync = 0;
  for (const plan& f : syncs) {
    CHECK(f.wire_bytes_on(axis::federation) > 0);
    model_sync += f.wire_bytes_on(axis::federation);
  }
  CHECK(p0[axis::federation].sync_bytes == doctest::Approx(model_sync));
  CHECK(p0[axis::federation].bytes_per_step == doctest::Approx(model_sync / H));
  // That is DiLoCo's per-step federation bytes at K = H, up to each fragment's padding.
  const step_price diloco = price(algorithm_by_name("diloco", {.period = H}), w, shape, c);
  const double padding = P * 16.0 * shape.replicas * sizeof(float) / shape.replicas *
                         bus_factor(comm_kind::all_reduce, shape.groups) / H;
  CHECK(std::abs(p0[axis::federation].bytes_per_step - diloco[axis::federation].bytes_per_step) <=
        padding);
  // Blocking (tau = 0), a round of P fragment syncs costs what one whole-model sync per H
  // steps costs, give or take the latency of P smaller messages.
  CHECK(p0.sync_per_step == doctest::Approx(p0.sync / H));
  CHECK(p0.sync_hidden == 0);

  // tau = 2: the fragments' all_reduces run behind two inner steps of compute each.
  const algorithm_desc delayed =
      algorithm_by_name("streaming_diloco", {.period = H, .fragments = P, .delay = 2});
  const step_price p2 = price(delayed, w, shape, c);
  CHECK(p2.in_flight == 2);
  for (axis ax : all_axes) {
    CAPTURE(to_string(ax));
    CHECK(p2[ax].bytes_per_step == p0[ax].bytes_per_step);  // the same bytes move
  }
  CHECK(p2.sync_hidden > 0);
  CHECK(p2.sync_per_step < p0.sync_per_step);
  CHECK(p2.step < p0.step);
  CHECK(p2.sync_per_step + p2.sync_hidden == doctest::Approx(p0.sync_per_step));
  // Here compute leaves enough slack for the whole all_reduce: the federation axis (the
  // sync_exchange ops) is fully hidden; the replicas' all_gather (sync_finish) still blocks.
  CHECK(p2[axis::federation].exposed == 0);
  CHECK(p0[axis::federation].exposed > 0);
  CHECK(p2[axis::replica].exposed == doctest::Approx(p0[axis::replica].exposed));
  double sum = 0;
  for (axis ax : all_axes) sum += p2[ax].exposed;
  CHECK(sum == doctest::Approx(p2.step - p2.compute));

  // No compute to hide behind: the delay hides nothing.
  const auto units = transformer_units(w.model);
  const step_price f0 = price_plans(blocking, units, shape, c, 0.0, 1.0);
  const step_price f2 = price_plans(delayed, units, shape, c, 0.0, 1.0);
  CHECK(f2.sync_hidden == 0);
  CHECK(f2.step == doctest::Approx(f0.step));
}

TEST_CASE("bandwidth-bound, the step-time ratio is the ratio of bytes leaving a node") {
  cluster c = free_links(a100_4gpu_node());
  c.nic_bandwidth = 1e3;  // a trickle: the network is all that counts
  const workload w = small_gpt();
  price_options ring;  // node bytes count ring traffic; a hierarchical one moves a bit less
  ring.collectives = collective_algorithm::ring;
  const auto f = price(algorithm_by_name("fsdp"), w, {1, 1, 64}, c, ring);
  const auto fl = price(algorithm_by_name("fl_fsdp", {.period = 8}), w, {16, 1, 4}, c, ring);
  auto egress = [](const step_price& p) {
    double e = 0;
    for (axis ax : all_axes) e += p[ax].node_bytes_per_step;
    return e;
  };
  CHECK(egress(f) == doctest::Approx(f[axis::shard].bytes_per_step));  // one ring per node
  CHECK(egress(fl) == doctest::Approx(4 * fl[axis::federation].bytes_per_step));  // four
  CHECK(f.step / fl.step == doctest::Approx(egress(f) / egress(fl)).epsilon(1e-3));
}

TEST_CASE("the priced bytes per axis are a real run's wire, and what a small case works out to") {
  // fl_hsdp, K = 2, on a 2 x 2 x 2 mesh (G x R x S), test::mlp_model: units of 144, 272 and
  // 68 f32. Over S = 2 shards each unit's shard is rounded up to 16 elements (64 B of f32):
  // shards of 80, 144 and 48, padded units of 160, 288 and 96. Parameters travel as bf16,
  // gradients as f32. One step, on every rank (bytes each rank sends):
  //  - shard: 2 all_gathers of each unit in bf16 (forward and backward: 320, 576, 192 B) and
  //    a reduce_scatter in f32 (640, 1152, 384 B), each over 2 ranks, sending (2 - 1) / 2 of
  //    it: (2 x 1088 + 2176) / 2 = 2176 B in 9 calls;
  //  - replica: an all_reduce of each f32 gradient shard (320, 576, 192 B) over 2 replicas,
  //    sending 2 (2 - 1) / 2 of it: 1088 B in 3 calls.
  // One sync: the rank's fragment packs its shards, 80 + 144 + 48 = 272 f32, padded to a
  // multiple of 16 R = 32: 288 f32 = 1152 B.
  //  - hierarchical: each replica all-reduces its half (576 B) over the 2 groups, sending
  //    2 (2 - 1) / 2 x 576 = 576 B, then the replicas all-gather the 1152 B, sending
  //    (2 - 1) / 2 x 1152 = 576 B: one call on each axis, on every rank;
  //  - reference: replica 0 all-reduces the 1152 B over the groups, sending 1152 B, then
  //    broadcasts them to replica 1 (bus factor 1: 1152 B, counted on both replicas).
  // The real run is the trainer on inproc ranks: one step (no sync yet), then two steps (the
  // sync after the second), as its wire counted them; a sync is the difference.
  using fedshard::fl_hsdp;
  const mesh_shape shape{2, 2, 2};
  const shard::precision prec{dtype::bf16, dtype::f32};
  price_options po;
  po.precision = prec;
  struct by_hand {
    double step_shard, step_replica, sync_federation, sync_replica;
    std::int64_t sync_calls_federation;
  };
  for (auto mode : {federation::sync_mode::hierarchical, federation::sync_mode::reference}) {
    CAPTURE(to_string(mode));
    const algorithm_settings settings{.period = 2, .sync = mode};
    const algorithm_desc a = algorithm_by_name("fl_hsdp", settings);
    const step_price p =
        price_plans(a, test::mlp_model{}.units(), shape, a100_4gpu_node(), 1.0, 1.0, po);
    const auto o = options_for<fl_hsdp>("fl_hsdp", settings);
    const recorded one = train<fl_hsdp>(shape, 1, 0, o, prec);
    const recorded two = train<fl_hsdp>(shape, 2, 0, o, prec);
    REQUIRE(p.ranks.size() == 8);
    for (int r = 0; r < 8; ++r) {
      CAPTURE(r);
      const auto ur = static_cast<std::size_t>(r);
      const bool replica0 = r / 2 % 2 == 0;  // world rank = (g R + replica) S + shard
      const by_hand want =
          mode == federation::sync_mode::hierarchical
              ? by_hand{2176, 1088, 576, 576, 1}
              : by_hand{2176, 1088, replica0 ? 1152.0 : 0.0, 1152, replica0 ? 1 : 0};
      auto priced = [&](axis ax) -> const axis_price& {
        return p.ranks[ur].axes[static_cast<std::size_t>(ax)];
      };
      for (axis ax : all_axes) {
        CAPTURE(to_string(ax));
        const axis_traffic& step = one.traffic[ur][ax];
        const axis_traffic& run = two.traffic[ur][ax];
        CHECK(priced(ax).step_bytes == step.wire_bytes);
        CHECK(priced(ax).step_calls == step.calls);
        CHECK(priced(ax).sync_bytes == run.wire_bytes - 2 * step.wire_bytes);
        CHECK(priced(ax).sync_calls == run.calls - 2 * step.calls);
      }
      CHECK(priced(axis::shard).step_bytes == want.step_shard);
      CHECK(priced(axis::shard).step_calls == 9);
      CHECK(priced(axis::replica).step_bytes == want.step_replica);
      CHECK(priced(axis::replica).step_calls == 3);
      CHECK(priced(axis::federation).step_bytes == 0);
      CHECK(priced(axis::federation).sync_bytes == want.sync_federation);
      CHECK(priced(axis::federation).sync_calls == want.sync_calls_federation);
      CHECK(priced(axis::replica).sync_bytes == want.sync_replica);
      CHECK(priced(axis::replica).sync_calls == 1);
      CHECK(priced(axis::shard).sync_bytes == 0);
      CHECK(priced(axis::group).step_bytes + priced(axis::group).sync_bytes == 0);
      CHECK(priced(axis::world).step_bytes + priced(axis::world).sync_bytes == 0);
      // K = 2: a step's bytes plus half a sync's
      CHECK(priced(axis::replica).bytes_per_step == want.step_replica + want.sync_replica / 2);
    }
  }
}

TEST_CASE("on 4-GPU nodes a 16 x 8 x 4 mesh keeps the shards inside a node") {
  const step_price p = price(algorithm_by_name("fl_hsdp"), {llama31_8b(), 2, 2048, 0, false},
                             {16, 8, 4}, a100_4gpu_node());
  CHECK(p[axis::shard].level == level_kind::intra);
  CHECK(p[axis::replica].level == level_kind::inter);
  CHECK(p[axis::federation].level == level_kind::inter);
}

TEST_CASE("the names are for_each_algorithm's aliases") {
  const std::vector<std::string> aliases{"ddp",          "zero2",         "fsdp",
                                         "hsdp",         "fl_fsdp",       "fl_hsdp",
                                         "fl_hsdp_int8", "diloco",        "streaming_diloco",
                                         "sparseloco",   "gasloc",        "fomoe",
                                         "scape_fsdp",   "fl_scape_fsdp", "hofl",
                                         "lss",          "fcp",           "feast",
                                         "collate"};
  CHECK(algorithm_names() == aliases);
  std::vector<std::string> visited;
  for_each_algorithm([&]<class A>(std::string_view n) { visited.emplace_back(n); });
  CHECK(visited == aliases);
  for (const auto& n : aliases) CHECK(algorithm_by_name(n).name() == n);
  // Each keeps its own default cadence unless told otherwise; K changes only those that
  // federate.
  CHECK(algorithm_by_name("streaming_diloco").cadence().period() == 100);
  CHECK_FALSE(algorithm_by_name("fsdp", {.period = 5}).syncs());
  CHECK(price(algorithm_by_name("fsdp", {.period = 5}), small_gpt(), {1, 1, 8}, a100_4gpu_node())
            .period == 1);
}

TEST_CASE("bad input is refused with a clear message") {
  const cluster c = a100_4gpu_node();
  const std::string unknown = error_of([] { algorithm_by_name("fedsgd"); });
  CHECK(unknown.find("unknown algorithm 'fedsgd'") != std::string::npos);
  for (const auto& n : algorithm_names()) CHECK(unknown.find(n) != std::string::npos);
  for (const char* name : {"fl_fsdp", "streaming_diloco", "fsdp"}) {
    CAPTURE(name);
    CHECK(error_of([&] {
            algorithm_by_name(name, {.period = 0});
          }).find("K (period, the steps between syncs) must be >= 1, found 0") !=
          std::string::npos);
  }
  CHECK(error_of([] {
          algorithm_by_name("fl_hsdp", {.fragments = 4});
        }).find("fl_hsdp: its schedule 'periodic' has no 'fragments' setting") !=
        std::string::npos);
  CHECK(error_of([] {
          algorithm_by_name("streaming_diloco", {.period = 8, .fragments = 4, .delay = 2});
        }).find("delay (tau) must be < floor(period / fragments)") != std::string::npos);
  // full_shard needs R = 1.
  const std::string mesh = error_of([&] {
    price(algorithm_by_name("fl_fsdp", {.period = 8}), small_gpt(), {2, 2, 2}, c);
  });
  CHECK(mesh.find("fl_fsdp cannot run on mesh 2x2x2") != std::string::npos);
  CHECK(mesh.find("replicas == 1, found 2") != std::string::npos);
  // More fragments than units.
  CHECK(error_of([&] {
          price_plans(algorithm_by_name("streaming_diloco", {.fragments = 4}),
                      test::mlp_model{}.units(), {2, 1, 1}, c, 1.0, 1.0);
        }).find("4 fragments but the model has only 3 units") != std::string::npos);
  CHECK_THROWS_AS(price(algorithm_by_name("fsdp"), {gpt2_small(), 0, 1024, 0, false}, {1, 1, 4}, c),
                  invalid_argument);
  CHECK(error_of([] { algorithm_desc{}.syncs(); }).find("empty description") != std::string::npos);
}

TEST_CASE("a heal of S bytes between two sites is priced as one message: L + S / B") {
  // 3 groups of one rank, one per node and one per site: the federation link between two
  // groups is the WAN, latency L = 0.05 s, bandwidth B = 1e8 B/s (the NICs, 1e12 B/s, and the
  // other levels' latencies do not count for a message that crosses sites once).
  cluster c;
  c.gpus_per_node = 1;
  c.nics_per_node = 1;
  c.nic_bandwidth = 1e12;
  c.intra = {.alpha = 1e-6, .bandwidth = 1e12};
  c.inter = {.alpha = 1e-5, .bandwidth = 1e12};
  c.wan = {.alpha = 0.05, .bandwidth = 1e8};
  c.sites = 3;
  const placement where({3, 1, 1}, c);
  // Donor 0 heals joiner 2 with a state of S = 1e6 bytes (125000 f64 words): the size op,
  // 0.05 + 8 / 1e8 = 0.05000008 s, then the state, 0.05 + 1e6 / 1e8 = 0.06 s.
  federation::heal_round r{.ranks = 3, .donor = 0, .joiners = {2}, .me = 0};
  const plan donor = federation::heal_plan(r, 1000000);
  CHECK(price_chain(plan{{donor.ops[1]}}, where, 0, c) == doctest::Approx(0.06).epsilon(1e-12));
  CHECK(price_chain(donor, where, 0, c) == doctest::Approx(0.11000008).epsilon(1e-12));
  // The joiner waits as long for the same messages; group 1 takes no part.
  r.me = 2;
  CHECK(price_chain(federation::heal_plan(r, 1000000), where, 2, c) ==
        doctest::Approx(0.11000008).epsilon(1e-12));
  r.me = 1;
  CHECK(price_chain(federation::heal_plan(r, 1000000), where, 1, c) == 0.0);
  // Inside one site the message crosses the network instead: 1e-5 + 1e6 / 1e12 s.
  c.sites = 1;
  r.me = 0;
  CHECK(price_chain(plan{{federation::heal_plan(r, 1000000).ops[1]}}, placement({3, 1, 1}, c), 0,
                    c) == doctest::Approx(1.1e-5).epsilon(1e-12));
  // A plan for another axis size is refused.
  r.ranks = 4;
  r.me = 0;
  CHECK(error_of([&] {
          price_chain(federation::heal_plan(r, 8), where, 0, c);
        }).find("has 4 ranks but rank 0's communicator has 3") != std::string::npos);
}

TEST_CASE("a backend that gathers small all_reduces is priced as a gather, not a ring") {
  // ddp on 4 ranks: every gradient all_reduce of S bytes is, as a ring, 2 (4-1)/4 S = 1.5 S
  // sent per rank; gathered (mpi's and gloo's small all_reduce), (4-1) S = 3 S: twice as many.
  const cluster c = a100_4gpu_node();
  const workload w = small_gpt();
  const algorithm_desc ddp = algorithm_by_name("ddp");
  price_options gather;
  gather.gather_all_bytes = std::int64_t{1} << 50;  // every all_reduce is "small"
  const step_price ring = price(ddp, w, {1, 1, 4}, c);
  const step_price gathered = price(ddp, w, {1, 1, 4}, c, gather);
  double ring_bytes = 0, gathered_bytes = 0;
  for (axis a : all_axes) {
    ring_bytes += ring[a].step_bytes;
    gathered_bytes += gathered[a].step_bytes;
    CHECK(gathered[a].step_calls == ring[a].step_calls);
  }
  CHECK(ring_bytes > 0);
  CHECK(gathered_bytes == doctest::Approx(2.0 * ring_bytes));
  CHECK(gathered.step > ring.step);  // the same links carry twice the bytes
  // a threshold below every all_reduce changes nothing
  price_options tiny;
  tiny.gather_all_bytes = 1;
  double tiny_bytes = 0;
  for (axis a : all_axes) tiny_bytes += price(ddp, w, {1, 1, 4}, c, tiny)[a].step_bytes;
  CHECK(tiny_bytes == ring_bytes);
}
