// The simulator's price of shard::sparse (SCAPE): its shard-axis bytes per rank over a run are
// what the trainer's wire tap records, density 1 prices as its base, and the mask exchange
// is priced once per refresh.
#include "fedshard/sim/sparse.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/shard/shard_grad_op.hpp"
#include "fedshard/sim/model_layout.hpp"
#include "fedshard/trainer/algorithm.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;

namespace {

constexpr std::uint64_t kData = 23;

/// SCAPE around shard_grad_op, federated: its gathers are packed after a masked update.
using fl_sparse_zero2 =
    algorithm<shard::sparse<shard::shard_grad_op>, federation::average, schedule::periodic>;

/// Every rank's shard-axis wire bytes and mask refreshes over `steps` steps of A (with K =
/// `period` when it federates).
template <class A>
std::vector<std::pair<double, std::int64_t>> measured(const mesh_shape& shape,
                                                      const shard::sparse_settings& s, int steps,
                                                      int period = 1) {
  return test::collect_ranks(shape.size(), [&](inproc::communicator& w) {
    mesh m(w, shape);
    trainer_options<A> o;
    o.shard = s;
    o.total_steps = steps;
    if constexpr (requires { o.schedule.period; }) o.schedule.period = period;
    trainer<test::mlp_model, A, optim::adamw, inproc::communicator> t(m, {}, {}, o);
    t.traffic().reset();
    const int g = m.coords().group, local = m.coords().shard;
    for (int k = 0; k < steps; ++k)
      t.step(t.model().batch(kData, k, g, shape.groups, local, shape.shards, 2));
    return std::pair{t.traffic()[axis::shard].wire_bytes, t.engine().runtime().refreshes()};
  });
}

template <class A>
sim::sparse_run_price priced(const mesh_shape& shape, const shard::sparse_settings& s, int steps,
                             int period = 1) {
  sim::price_options po;
  po.precision = trainer_options<A>{}.precision;  // the trainer's wire dtypes
  sim::algorithm_options<A> o;
  if constexpr (requires { o.schedule.period; }) o.schedule.period = period;
  return sim::price_sparse<A>("scape", o, s, test::mlp_model{}.units(), shape,
                              sim::a100_4gpu_node(), 1e-3, 64, steps, po);
}

template <class A>
void check_wire(const mesh_shape& shape, const shard::sparse_settings& s, int steps,
                int period = 1) {
  const auto p = priced<A>(shape, s, steps, period);
  const auto wire = measured<A>(shape, s, steps, period);
  REQUIRE(wire.size() == static_cast<std::size_t>(shape.size()));
  for (const auto& [bytes, refreshes] : wire) {
    CHECK(p.run_step_wire_bytes(axis::shard) == doctest::Approx(bytes).epsilon(1e-12));
    CHECK(p.mask_exchanges == refreshes);
  }
  std::int64_t counted = 0;
  for (const auto& k : p.kinds) counted += k.count;
  CHECK(counted == steps);
}

}  // namespace

TEST_CASE("a priced scape run moves, on the shard axis, what the trainer's wire records") {
  for (const shard::sparse_settings s :
       {shard::sparse_settings{.density = 0.1},
        shard::sparse_settings{.density = 0.1, .refresh_period = 3, .dense_steps = 2},
        shard::sparse_settings{.density = 0.1, .refresh_period = 2, .dense_every = 4}}) {
    CAPTURE(s.refresh_period);
    CAPTURE(s.dense_steps);
    CAPTURE(s.dense_every);
    check_wire<scape_fsdp>({1, 1, 4}, s, 9);
    check_wire<fl_scape_fsdp>({2, 1, 2}, s, 9, 3);
    // Packed gathers (shard_grad_op keeps its gathered units): a sync every 3 steps writes
    // the master, so the next step's gathers are dense.
    check_wire<fl_sparse_zero2>({2, 1, 2}, s, 9, 3);
  }
}

TEST_CASE("the mask exchange is priced once per refresh, and density 1 prices as the base") {
  const mesh_shape shape{1, 1, 8};
  const sim::cluster c = sim::a100_4gpu_node();
  const auto units = sim::transformer_units(sim::llama31_8b(), dtype::bf16);
  const sim::step_price fsdp_price =
      sim::price_plans(sim::describe<fsdp>("fsdp"), units, shape, c, 1.0, 2048);
  const auto full = sim::price_sparse<scape_fsdp>(
      "scape_fsdp", {}, {.density = 1.0, .refresh_period = 1000}, units, shape, c, 1.0, 2048, 2);
  // Step 0 is Base's own; step 1 packs every element and runs the exchange first.
  REQUIRE(full.kinds.size() == 2);
  CHECK(full.kinds[0].price.step == doctest::Approx(fsdp_price.step).epsilon(1e-12));
  CHECK(full.kinds[0].price[axis::shard].step_bytes ==
        doctest::Approx(fsdp_price[axis::shard].step_bytes).epsilon(1e-12));
  CHECK(full.kinds[1].price[axis::shard].step_bytes ==
        doctest::Approx(fsdp_price[axis::shard].step_bytes + full.mask_wire_bytes).epsilon(1e-12));

  const shard::sparse_settings s{.density = 0.05, .refresh_period = 4};
  const auto p = sim::price_sparse<scape_fsdp>("scape_fsdp", {}, s, units, shape, c, 1.0, 2048, 41);
  CHECK(p.mask_exchanges == 11);  // after steps 0, 4, ..., 40
  std::int64_t with_mask = 0;
  for (const auto& k : p.kinds) {
    const auto ops = k.price[axis::shard].step_calls;
    const auto base_ops = fsdp_price[axis::shard].step_calls;
    CHECK(ops == base_ops + (k.kind.mask_exchange ? 1 : 0));
    if (k.kind.mask_exchange) with_mask += k.count;
  }
  CHECK(with_mask == 10);  // steps 1, 5, ..., 37 run them (40's is after the run)
  CHECK(p.mask_wire_bytes == doctest::Approx(7.0 * 4 * shard::mask_words(p.shard_numel)));
  // fsdp's shard bytes per step are, per unit, a forward and a backward all_gather and a
  // reduce_scatter of the same f32 array: 3 parts. scape_fsdp keeps full_shard's dense
  // gathers (no gathered copy between steps) and packs 5% of each reduction, plus a mask
  // exchange every 4 steps of 1/32 of a reduction's bytes (one bit per 4-byte element): so
  // (2 + 0.05 + 1 / 128) / 3 = 0.686 of fsdp's, between 2/3 and 0.7; and no slower.
  CHECK(p.bytes_per_step(axis::shard) > 2.0 / 3 * fsdp_price[axis::shard].bytes_per_step);
  CHECK(p.bytes_per_step(axis::shard) < 0.7 * fsdp_price[axis::shard].bytes_per_step);
  CHECK(p.step() <= fsdp_price.step * (1 + 1e-9));
}
