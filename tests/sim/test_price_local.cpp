// Pricing local rules (sim/local_rule.hpp): zeroth-order units with their records sent as
// seeds, and a local soup. The small case, worked by hand below: fl_fsdp (full_shard,
// average, periodic K = 4) on 2 groups of 2 shards (G x R x S = 2 x 1 x 2), test::mlp_model's
// units "layer0", "layer1", "head" of 144, 272 and 68 f32. Over S = 2 each unit's shard is
// rounded up to 16 elements: shards of 80, 144 and 48, padded units of 160, 288 and 96.
// Parameters travel as bf16 (320, 576, 192 B gathered), gradients as f32 (640, 1152, 384 B
// reduce-scattered); an all_gather or reduce_scatter over 2 ranks sends half its bytes.
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/error.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/optim/zeroth_order.hpp"
#include "fedshard/plan/traffic.hpp"
#include "fedshard/sim/local_rule.hpp"
#include "fedshard/sim/price.hpp"
#include "fedshard/sim/run.hpp"
#include "fedshard/trainer/local_soup.hpp"
#include "fedshard/trainer/local_zeroth_order.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/sim.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;
using namespace fedshard::sim;
using namespace fedshard::test;  // the fixtures of support/sim.hpp

namespace {

const mesh_shape kShape{2, 1, 2};
const shard::precision kPrec{dtype::bf16, dtype::f32};

/// fl_fsdp, K = 4, with local rule r.
algorithm_desc fl_fsdp_with(const local_rule_desc& r) {
  return algorithm_by_name("fl_fsdp", {.period = 4, .local = r});
}

/// Zeroth-order layer0 with P = 2 probes.
local_rule_desc zo_layer0(bool seeds = true) {
  return {.zeroth_order = {.units = {"layer0"}, .probes = 2, .seeds_on_wire = seeds}};
}

/// Free links, and a memory bandwidth of 1e6 B/s so that a pass over n f32 costs 4n us.
cluster slow_memory() {
  cluster c = free_links(a100_4gpu_node());
  c.memory_bandwidth = 1e6;
  return c;
}

price_options with_precision() {
  price_options o;
  o.precision = kPrec;
  return o;
}

const axis_price& of(const step_price& p, int rank, axis a) {
  return p.ranks[static_cast<std::size_t>(rank)].axes[static_cast<std::size_t>(a)];
}

}  // namespace

TEST_CASE("zeroth-order units: no backward, 2P forward passes and loss means, seeds at a sync") {
  // Plain step, per rank on the shard axis: 3 forward and 3 backward bf16 gathers and 3 f32
  // reduce_scatters: (2 x 1088 + 2176) / 2 = 2176 B in 9 calls. layer0 zeroth-order drops its
  // backward gather and reduce_scatter: 2176 - (320 + 640) / 2 = 1696 B in 7 calls.
  // Each of the 2P = 4 loss evaluations gathers the 3 units for forward again (1088 / 2 =
  // 544 B, 3 calls) and averages the loss over the group (an all_reduce of 8 B over 2 ranks,
  // sending 2 (2 - 1) / 2 x 8 = 8 B): 4 x 544 = 2176 B in 12 calls on the shard axis, 32 B in
  // 4 calls on the group axis. Shard axis: 1696 + 2176 = 3872 B in 19 calls.
  // Sync (hierarchical, R = 1): the plain fragment packs 80 + 144 + 48 = 272 f32 (1088 B,
  // all-reduced over 2 groups: 1088 B sent). With seeds on the wire layer0 leaves it:
  // 144 + 48 = 192 f32, 768 B sent. After it each group's rank 0 (shard 0: world ranks 0
  // and 2) all-gathers the groups' record counts (2 x 8 = 16 B, 8 B sent) and their
  // K P = 4 x 2 records of 24 B (2 x 192 = 384 B, 192 B sent): 768 + 8 + 192 = 968 B in 3
  // calls, 242 B per step (K = 4); the shard-1 ranks send 768 B in 1 call. Each group's rank
  // 0 then broadcasts the 16 B and the 384 B to its 2 ranks (bus factor 1, counted on both):
  // 400 B in 2 calls on the group axis, a step's 32 B + 400 / 4 = 132 B per step.
  const step_price plain = price_plans(fl_fsdp_with({}), mlp_model{}.units(), kShape, slow_memory(),
                                       1.0, 1.0, with_precision());
  const step_price zo = price_plans(fl_fsdp_with(zo_layer0()), mlp_model{}.units(), kShape,
                                    slow_memory(), 1.0, 1.0, with_precision());
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(of(plain, r, axis::shard).step_bytes == 2176);
    CHECK(of(plain, r, axis::shard).step_calls == 9);
    CHECK(of(plain, r, axis::federation).sync_bytes == 1088);
    CHECK(of(zo, r, axis::shard).step_bytes == 3872);
    CHECK(of(zo, r, axis::shard).step_calls == 19);
    CHECK(of(zo, r, axis::group).step_bytes == 32);
    CHECK(of(zo, r, axis::group).step_calls == 4);
    const bool first = r % 2 == 0;  // shard 0
    CHECK(of(zo, r, axis::federation).sync_bytes == (first ? 968 : 768));
    CHECK(of(zo, r, axis::federation).sync_calls == (first ? 3 : 1));
    CHECK(of(zo, r, axis::federation).bytes_per_step == (first ? 242 : 192));
    CHECK(of(zo, r, axis::group).sync_bytes == 400);
    CHECK(of(zo, r, axis::group).sync_calls == 2);
    CHECK(of(zo, r, axis::group).bytes_per_step == 132);
  }
  // Compute, C = 1 s: layer0's backward share, 2/3 x 144 / 484 = 96 / 484, is not computed;
  // the 4 evaluations cost C / 3 each; the passes over layer0's 80-element shard: 8 P + 6 =
  // 22 passes of 320 B = 7040 B, 7.04 ms at 1e6 B/s; at a sync the replay, 2 G K P = 32
  // passes, and the anchor's copies, 6: 38 passes, 12160 B, 12.16 ms, once per 4 steps:
  // 3.04 ms per step. The links are free.
  CHECK(zo.local.main_compute == doctest::Approx(388.0 / 484.0));
  CHECK(zo.local.evaluations == doctest::Approx(4.0 / 3.0));
  CHECK(zo.local.passes == doctest::Approx(7040e-6));
  CHECK(zo.local.replay == doctest::Approx(12160e-6));
  CHECK(zo.local.replay_per_step == doctest::Approx(3040e-6));
  CHECK(zo.compute == doctest::Approx(388.0 / 484.0 + 4.0 / 3.0 + 7040e-6 + 3040e-6));
  CHECK(zo.step == doctest::Approx(zo.compute));
  CHECK(plain.step == doctest::Approx(1.0));
  CHECK(plain.local.compute() == 0);
}

TEST_CASE("zeroth-order units synced as parameters keep the plain sync, without records") {
  // seeds_on_wire off: the fragment keeps layer0 (1088 B sent), no records op, no replay; the
  // step is as above (3872 B on the shard axis, 32 B on the group axis).
  const step_price p = price_plans(fl_fsdp_with(zo_layer0(false)), mlp_model{}.units(), kShape,
                                   slow_memory(), 1.0, 1.0, with_precision());
  CHECK(p[axis::federation].sync_bytes == 1088);
  CHECK(p[axis::federation].sync_calls == 1);
  CHECK(p[axis::shard].step_bytes == 3872);
  CHECK(p[axis::group].step_bytes == 32);
  CHECK(p.local.replay == 0);
}

TEST_CASE("run_traffic counts the local rule's ops every step and the records at each sync") {
  // 8 steps of K = 4 (syncs after steps 3 and 7): rank 0 sends 8 x 3872 B on the shard axis,
  // 8 x 32 + 2 x 400 B in 8 x 4 + 2 x 2 calls on the group axis and 2 x 968 B in 2 x 3 calls
  // on the federation axis.
  const traffic_counters t =
      run_traffic(fl_fsdp_with(zo_layer0()), mlp_model{}.units(), kShape, 0, 8, 0, kPrec);
  CHECK(t[axis::shard].wire_bytes == 8 * 3872);
  CHECK(t[axis::shard].calls == 8 * 19);
  CHECK(t[axis::group].wire_bytes == 8 * 32 + 2 * 400);
  CHECK(t[axis::group].calls == 8 * 4 + 2 * 2);
  CHECK(t[axis::federation].wire_bytes == 2 * 968);
  CHECK(t[axis::federation].calls == 2 * 3);
}

/// What each rank's wire recorded in the last of `steps` steps (no sync yet: K = 4) of the
/// trainer of fl_fsdp on `shape` with local rule `rule`.
std::vector<traffic_counters> last_step_wire(const mesh_shape& shape, int steps,
                                             const local_rule_factory& rule) {
  std::vector<traffic_counters> seen(static_cast<std::size_t>(shape.size()));
  spawn_ranks(shape.size(), [&](inproc::communicator& world) {
    mesh m(world, shape);
    trainer_options<fl_fsdp> o;
    o.precision = kPrec;
    o.schedule.period = 4;
    o.log = [](const std::string&) {};
    o.local_rule = rule;
    trainer<mlp_model, fl_fsdp, optim::adamw, inproc::communicator> t(m, mlp_model{}, {.lr = 1e-2f},
                                                                      o);
    const int g = m.coords().group;
    for (int s = 0; s < steps; ++s) {
      t.traffic().reset();  // the last step only
      t.step(t.model().batch(3, s, g, shape.groups, m.coords().shard, shape.shards, 2));
    }
    seen[static_cast<std::size_t>(world.rank())] = t.traffic();
  });
  return seen;
}

/// Every rank's priced step bytes and calls, axis by axis, equal what its wire recorded.
void check_wire(const step_price& p, const std::vector<traffic_counters>& seen) {
  REQUIRE(p.ranks.size() == seen.size());
  for (int r = 0; r < static_cast<int>(seen.size()); ++r)
    for (axis ax : all_axes) {
      CAPTURE(r);
      CAPTURE(to_string(ax));
      CHECK(of(p, r, ax).step_bytes == seen[static_cast<std::size_t>(r)][ax].wire_bytes);
      CHECK(of(p, r, ax).step_calls == seen[static_cast<std::size_t>(r)][ax].calls);
    }
}

TEST_CASE("the priced step of a local rule is what the trainer's wire records") {
  // Zeroth-order layer0 (P = 2), one step: 3872 B on the shard axis and 32 B on the group
  // axis, by hand above. A soup of
  // M = 3 whose members join at once (first_steps 0, add_every 1: 2 members at step 0, 3 at
  // step 1), at step 2, its pool full: 2176 + 32 B on the shard axis (above).
  const local_rule_factory zo =
      zeroth_order_rule({.eps = 1e-3f, .probes = 2, .seed = 9}, {"layer0"});
  check_wire(price_plans(fl_fsdp_with(zo_layer0()), mlp_model{}.units(), kShape, slow_memory(), 1.0,
                         1.0, with_precision()),
             last_step_wire(kShape, 1, zo));
  // Groups of one rank (2 x 1 x 1): the 4 loss means are still run, calls of no bytes. (On
  // the shard axis the simulator's step plan keeps the one-rank f32 reduce_scatters the
  // engine elides, 2 calls of no bytes: so only the group axis is compared here.)
  const mesh_shape single{2, 1, 1};
  const step_price one = price_plans(fl_fsdp_with(zo_layer0()), mlp_model{}.units(), single,
                                     slow_memory(), 1.0, 1.0, with_precision());
  const std::vector<traffic_counters> wire = last_step_wire(single, 1, zo);
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(of(one, r, axis::group).step_calls == 4);
    CHECK(of(one, r, axis::group).step_calls ==
          wire[static_cast<std::size_t>(r)][axis::group].calls);
    CHECK(of(one, r, axis::group).step_bytes == 0);
    CHECK(wire[static_cast<std::size_t>(r)][axis::group].wire_bytes == 0);
  }
  CHECK(of(price_plans(fl_fsdp_with(zo_layer0()), mlp_model{}.units(), kShape, slow_memory(), 1.0,
                       1.0, with_precision()),
           0, axis::shard)
            .step_bytes == 3872);
  const step_price soup = price_plans(fl_fsdp_with({.soup = {.members = 3}}), mlp_model{}.units(),
                                      kShape, slow_memory(), 1.0, 1.0, with_precision());
  CHECK(soup[axis::shard].step_bytes == 2176 + 32);
  check_wire(soup,
             last_step_wire(kShape, 3,
                            local_soup_rule({.pool_size = 3, .first_steps = 0, .add_every = 1})));
}

TEST_CASE("memory: zeroth-order units drop their full gradients, a soup holds M + 1 shards") {
  // layer0 zeroth-order: its reduce_scatter reads a full gradient (160 f32, 640 B) that is
  // no longer kept; each step saves its 80-element shard (320 B) and, with seeds on the wire,
  // the anchor is a second copy (320 B): 640 B more, 640 B less. As parameters: 320 B more.
  const local_memory zo = local_memory_of(fl_fsdp_with(zo_layer0()), mlp_model{}.units(), kShape);
  CHECK(zo.gradient_saved == 640);
  CHECK(zo.zeroth_order_copy == 640);
  CHECK(zo.soup_pool == 0);
  CHECK(zo.added() == 0);
  const local_memory as_params =
      local_memory_of(fl_fsdp_with(zo_layer0(false)), mlp_model{}.units(), kShape);
  CHECK(as_params.zeroth_order_copy == 320);
  CHECK(as_params.added() == -320);
  // A soup of M = 3: the master shard is 80 + 144 + 48 = 272 f32 (1088 B); the pool holds
  // 3 members and the anchor: 4 x 1088 = 4352 B.
  const local_memory soup =
      local_memory_of(fl_fsdp_with({.soup = {.members = 3}}), mlp_model{}.units(), kShape);
  CHECK(soup.soup_pool == 4352);
  CHECK(soup.gradient_saved == 0);
  CHECK(soup.added() == 4352);
  CHECK(local_memory_of(fl_fsdp_with({}), mlp_model{}.units(), kShape).added() == 0);
}

TEST_CASE("a soup: its distance sum over the shards and its passes over the master shard") {
  // M = 3 with diversity, members joining at once (first_steps 0, add_every 1: 2 members at
  // local step 0, 3 from step 1). Priced at the full pool: each step sums M (M - 1) / 2 + 1 =
  // 4 f64 (32 B) over the 2 shards, an all_reduce sending 2 (2 - 1) / 2 x 32 = 32 B,
  // blocking; the plain step is unchanged (2176 B, 9 calls). Passes over the 272-element
  // master shard (1088 B) with k members: interpolation k + 1, regularisers' gradient k + 3,
  // copies 4, average k + 1, distances k (k - 1) + 2: 19 with 2 members, 26 with 3; over a
  // round of K = 4 steps (2, 3, 3, 3 members) (19 + 3 x 26) / 4 = 24.25 passes, 26384 B,
  // 26.384 ms at 1e6 B/s. Without diversity: no distance sum, 15 and 18 passes, 17.25 on
  // average (18768 B, 18.768 ms).
  const soup_pool_size at_once{.members = 3, .first_steps = 0};
  const step_price p = price_plans(fl_fsdp_with({.soup = at_once}), mlp_model{}.units(), kShape,
                                   slow_memory(), 1.0, 1.0, with_precision());
  CHECK(p[axis::shard].step_bytes == 2176 + 32);
  CHECK(p[axis::shard].step_calls == 10);
  CHECK(p[axis::federation].sync_bytes == 1088);
  CHECK(p.local.passes == doctest::Approx(26384e-6));
  CHECK(p.local.main_compute == 1.0);
  CHECK(p.compute == doctest::Approx(1.0 + 26384e-6));
  soup_pool_size plain = at_once;
  plain.diversity = false;
  const step_price q = price_plans(fl_fsdp_with({.soup = plain}), mlp_model{}.units(), kShape,
                                   slow_memory(), 1.0, 1.0, with_precision());
  CHECK(q[axis::shard].step_bytes == 2176);
  CHECK(q.local.passes == doctest::Approx(18768e-6));
}

TEST_CASE("run_traffic follows the round: the soup's members, the records of a short round") {
  // A soup of M = 3, member 0 alone 1 step, the next every 2 (first_steps 1, add_every 2): in
  // each round of K = 4 steps 1, 2, 2, 3 members: distance sums of none, 2, 2 and 4 f64
  // (16, 16, 32 B sent over the 2 shards): 64 B in 3 calls per round. 8 steps: 8 x 2176 +
  // 2 x 64 = 17536 B in 8 x 9 + 6 = 78 calls on the shard axis.
  const traffic_counters soup =
      run_traffic(fl_fsdp_with({.soup = {.members = 3, .first_steps = 1, .add_every = 2}}),
                  mlp_model{}.units(), kShape, 0, 8, 0, kPrec);
  CHECK(soup[axis::shard].wire_bytes == 17536);
  CHECK(soup[axis::shard].calls == 78);
  // Zeroth-order layer0 (P = 2), 7 steps of a 7-step run: syncs after step 3 (K = 4) and,
  // the run's last, after step 6 (K = 3). World rank 0 on the federation axis: 2 x 768 B
  // of parameters, 2 x 8 B of counts, then 192 B and 2 x 3 x 2 x 24 / 2 = 144 B of records:
  // 1888 B in 6 calls; on the group axis the 7 steps' 7 x 32 B of loss means, and the
  // broadcasts 2 x 16 + 384 + 288 B: 928 B in 7 x 4 + 4 = 32 calls.
  const traffic_counters zo =
      run_traffic(fl_fsdp_with(zo_layer0()), mlp_model{}.units(), kShape, 0, 7, 7, kPrec);
  CHECK(zo[axis::federation].wire_bytes == 1888);
  CHECK(zo[axis::federation].calls == 6);
  CHECK(zo[axis::group].wire_bytes == 928);
  CHECK(zo[axis::group].calls == 32);
}

TEST_CASE("local rule settings out of range are refused, naming them") {
  auto refused = [](const local_rule_desc& r, const char* part) {
    const std::string m = error_of([&] {
      (void)price_plans(fl_fsdp_with(r), mlp_model{}.units(), kShape, slow_memory(), 1.0, 1.0);
    });
    CAPTURE(m);
    return m.find(part) != std::string::npos;
  };
  CHECK(refused({.zeroth_order = {.units = {"layer9"}}},
                "no unit named 'layer9' for a zeroth-order unit; the units are 'layer0', "
                "'layer1', 'head'"));
  CHECK(refused({.zeroth_order = {.units = {"layer0"}, .probes = 0}}, "probes >= 1"));
  CHECK(refused({.soup = {.members = 17}}, "0 (no soup) to 16 members, found 17"));
  CHECK(refused({.zeroth_order = {.units = {"layer0"}}, .soup = {.members = 2}}, "one local rule"));
  // Every unit zeroth-order with seeds on the wire: the federation would sync nothing.
  CHECK(refused({.zeroth_order = {.units = {"layer0", "layer1", "head"}}},
                "fragment 0 of the periodic schedule holds zeroth-order units only"));
}

TEST_CASE("by name on GPT-2: the embedding's records cross the federation link, not its values") {
  // fl_fsdp (K = 8) on 2 groups of 4 shards, GPT-2 small (bf16 units), "embed" zeroth-order
  // with P = 1. The embedding has 50257 x 768 + 1024 x 768 = 39383808 elements: a shard of
  // 9845952 (a multiple of 32, the bf16 alignment), so every shard and fragment stays a
  // multiple of 32 elements and no padding moves. The hierarchical sync (R = 1) all-reduces
  // the f32 fragment over 2 groups, sending its bytes: leaving the embedding out saves
  // 9845952 x 4 = 39383808 B; on world rank 0 (its group's rank 0) the exchange adds the
  // counts (2 x 8 B gathered, 8 B sent) and the records (2 x 8 x 1 x 24 = 384 B gathered,
  // 192 B sent): 39383608 B less per sync, the embedding's part 196919x smaller
  // (39383808 / 200).
  const mesh_shape shape{2, 1, 4};
  run_settings plain{.algorithm = {.period = 8}};
  run_settings zo = plain;
  zo.algorithm.local = {.zeroth_order = {.units = {"embed"}, .probes = 1}};
  const run_price a = price_named("fl_fsdp", plain, small_gpt(), shape, a100_4gpu_node());
  const run_price b = price_named("fl_fsdp", zo, small_gpt(), shape, a100_4gpu_node());
  REQUIRE(a.each_step.has_value());
  REQUIRE(b.each_step.has_value());
  const double saved = of(*a.each_step, 0, axis::federation).sync_bytes -
                       of(*b.each_step, 0, axis::federation).sync_bytes;
  CHECK(saved == 39383608);
  CHECK(of(*b.each_step, 0, axis::federation).sync_calls ==
        of(*a.each_step, 0, axis::federation).sync_calls + 2);
  // Each step evaluates the loss twice, each a forward pass: 2 x C / 3 more compute.
  const double c = compute_seconds_of(small_gpt(), a100_4gpu_node());
  CHECK(b.each_step->local.evaluations == doctest::Approx(2 * c / 3));
  CHECK(b.step > a.step);
}

TEST_CASE("the evaluations' gathers hide behind their compute; the loss means are exposed") {
  // On the A100 node's links, the local ops' seconds: the loss means are the group axis's
  // only ops, each evaluation's forward gathers are what one more probe (two evaluations)
  // adds on the shard axis. With ample compute (C = 10 s) the gathers hide behind the
  // evaluations' 2P C / 3 and only the means are exposed; with none (C = 0) everything is.
  const cluster c = a100_4gpu_node();
  auto priced = [&](int probes, double compute) {
    local_rule_desc r = zo_layer0();
    r.zeroth_order.probes = probes;
    return price_plans(fl_fsdp_with(r), mlp_model{}.units(), kShape, c, compute, 1.0,
                       with_precision());
  };
  const step_price ample = priced(2, 10.0);
  const double means = ample[axis::group].step_seconds;
  CHECK(means > 0);
  CHECK(ample.local.exposed_ops == doctest::Approx(means));
  const step_price none = priced(2, 0.0);
  const double one_probe_gathers =
      none[axis::shard].step_seconds - priced(1, 0.0)[axis::shard].step_seconds;
  CHECK(one_probe_gathers > 0);
  CHECK(none.local.exposed_ops == doctest::Approx(means + 2 * one_probe_gathers));
  CHECK(none.step == doctest::Approx(none.compute + none.exposed_comm()));
  CHECK(ample.step == doctest::Approx(ample.compute + ample.exposed_comm()));
}

TEST_CASE("the lower units by position, and the catalogue's hofl and lss defaults") {
  // lower = 1 on test::mlp_model is layer0: the same plans as naming it (3872 B, 968 B on
  // world rank 0, as above); lower = 4 of its 3 units is refused.
  const step_price by_position =
      price_plans(fl_fsdp_with({.zeroth_order = {.lower = 1, .probes = 2}}), mlp_model{}.units(),
                  kShape, slow_memory(), 1.0, 1.0, with_precision());
  CHECK(of(by_position, 0, axis::shard).step_bytes == 3872);
  CHECK(of(by_position, 0, axis::federation).sync_bytes == 968);
  const std::string m = error_of([] {
    (void)price_plans(fl_fsdp_with({.zeroth_order = {.lower = 4}}), mlp_model{}.units(), kShape,
                      slow_memory(), 1.0, 1.0);
  });
  CHECK(m.find("4 lower units are to be zeroth-order, but the model has 3") != std::string::npos);
  // hofl: the two lowest units, one probe, records as seeds; lss: a soup of 3 with diversity;
  // the other aliases none (trainer/algorithm.hpp's defaults).
  const local_rule_desc hofl = catalogue_local_rule("hofl");
  CHECK(hofl.zeroth_order.lower == 2);
  CHECK(hofl.zeroth_order.units.empty());
  CHECK(hofl.zeroth_order.probes == 1);
  CHECK(hofl.zeroth_order.seeds_on_wire);
  CHECK_FALSE(hofl.soup_on());
  const local_rule_desc lss = catalogue_local_rule("lss");
  CHECK(lss.soup.members == 3);
  CHECK(lss.soup.diversity);
  CHECK_FALSE(lss.zeroth_order_on());
  CHECK_FALSE(catalogue_local_rule("fl_hsdp").active());
}
