// The simulator's price of a heterogeneous mesh's sync: its bytes per rank are what the
// trainer's wire tap records for the same mesh, and its time follows the WAN.
#include "fedshard/sim/hetero.hpp"

#include <doctest/doctest.h>

#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/sim/compute.hpp"
#include "fedshard/sim/model_layout.hpp"
#include "fedshard/trainer/algorithm.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;

namespace {

/// Every rank's federation and replica wire bytes after one sync of A on a mesh of groups.
template <class A>
std::vector<std::pair<double, double>> measured(const std::vector<group_shape>& groups) {
  int world = 0;
  for (const auto& g : groups) world += g.size();
  return test::collect_ranks(world, [&](inproc::communicator& w) {
    mesh m(w, groups);
    trainer_options<A> o;
    o.total_steps = 1;
    o.schedule.period = 1;
    trainer<test::mlp_model, A, optim::adamw, inproc::communicator> t(m, test::mlp_model{}, {}, o);
    const auto fed0 = t.traffic()[axis::federation].wire_bytes;
    const auto rep0 = t.traffic()[axis::replica].wire_bytes;
    const mesh_coords c = m.coords();
    t.step(t.model().batch(3, 0, c.group, 2, c.replica * m.shape().shards + c.shard,
                           m.shape().replicas * m.shape().shards, 1));
    // The step's own replica traffic (HSDP's gradient all-reduce) is the step plan's.
    const double step_replica = t.step_plan().wire_bytes_on(axis::replica);
    return std::pair{t.traffic()[axis::federation].wire_bytes - fed0,
                     t.traffic()[axis::replica].wire_bytes - rep0 - step_replica};
  });
}

}  // namespace

TEST_CASE("the price of a heterogeneous sync moves what the trainer's wire records") {
  const std::vector<group_shape> groups{{2, 2}, {1, 3}};
  sim::cluster c = sim::a100_4gpu_node();
  c.sites = 2;
  const auto units = test::mlp_model{}.units();
  for (bool weights : {false, true}) {
    CAPTURE(weights);
    const auto price = sim::price_hetero_sync(units, groups, c, weights);
    const auto wire =
        weights
            ? measured<
                  algorithm<shard::hybrid_shard, federation::weighted_average, schedule::periodic>>(
                  groups)
            : measured<fl_hsdp>(groups);
    REQUIRE(wire.size() == 7);
    for (std::size_t r = 0; r < wire.size(); ++r) {
      CAPTURE(r);
      CHECK(price.federation_bytes[r] == doctest::Approx(wire[r].first).epsilon(1e-12));
      CHECK(price.replica_bytes[r] == doctest::Approx(wire[r].second).epsilon(1e-12));
    }
    CHECK(price.sync_seconds > 0);
    CHECK(price.member_sets >= 3);  // the leaders and at least one holder set per shard pair
  }
}

TEST_CASE("a slower WAN makes a heterogeneous sync slower, replica 0 carrying the bytes") {
  const std::vector<group_shape> groups{{2, 4}, {1, 2}};
  sim::cluster c = sim::a100_4gpu_node();
  c.sites = 2;
  const auto units = sim::transformer_units(sim::llama31_8b(), dtype::bf16);
  const auto fast = sim::price_hetero_sync(units, groups, c);
  c.wan.bandwidth /= 10;
  const auto slow = sim::price_hetero_sync(units, groups, c);
  CHECK(slow.sync_seconds > 5 * fast.sync_seconds);
  // Group 1's 2 shards each hold half the model, group 0's 4 a quarter: twice the bytes.
  CHECK(fast.group_federation_bytes(1) ==
        doctest::Approx(2 * fast.group_federation_bytes(0)).epsilon(1e-3));
  CHECK(fast.federation_bytes[4] == 0);  // replica 1 of group 0 (world rank 4) only receives
}
