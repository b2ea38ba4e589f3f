// Zeroth-order units through the trainer's local rule (trainer/local_zeroth_order.hpp) on
// fl_fsdp, 2 groups of 2 shards (inproc), tiny_mlp with its first layer ("layer0", 144
// elements) zeroth-order: each step's update of that layer is exactly the replay of the
// step's records on its values before the step (weight decay and the other units' backprop
// leave it alone), the loss falls, the groups draw their own directions; the engine plans no
// backward for the layer (ops and bytes worked by hand below) and allocates no full gradient
// for it; a model without evaluate() and an unknown unit are refused with a message.

#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/federation/average.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/optim/zeroth_order.hpp"
#include "fedshard/shard/engine.hpp"
#include "fedshard/shard/full_shard.hpp"
#include "fedshard/trainer/local_zeroth_order.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/files.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

namespace {

using namespace fedshard;
using test::mlp_model;

using trainer_t = trainer<mlp_model, fl_fsdp, optim::adamw, inproc::communicator>;
const mesh_shape shape{2, 1, 2};
constexpr float kLr = 2e-2f;
const optim::zeroth_order_settings kZo{.eps = 1e-3f, .probes = 2, .seed = 9};

trainer_options<fl_fsdp> zo_options() {
  trainer_options<fl_fsdp> o;
  o.total_steps = 30;
  o.schedule.period = 3;
  o.log = [](const std::string&) {};
  o.local_rule = zeroth_order_rule(kZo, {"layer0"});
  return o;
}

/// tiny_mlp without evaluate(): the zeroth-order rule cannot ask it for a loss.
struct no_evaluate_model {
  mlp_model m;
  std::vector<unit_spec> units() const { return m.units(); }
  std::vector<float> initial_values(const flat_layout& l, std::size_t u) const {
    return m.initial_values(l, u);
  }
  template <class Ctx>
  float forward_backward(Ctx& ctx, const std::vector<test::sample>& batch) {
    return m.forward_backward(ctx, batch);
  }
};

}  // namespace

TEST_CASE("zeroth order: each step's update of the layer is the replay of the step's records") {
  test::spawn_ranks(shape.size(), [&](inproc::communicator& world) {
    mesh m(world, shape);
    trainer_t t(m, mlp_model{}, {.lr = kLr, .weight_decay = 0.1f}, zo_options());
    auto* rule = dynamic_cast<local_zeroth_order*>(t.local());
    REQUIRE(rule != nullptr);
    const auto c = t.topology().coords();
    auto batch = [&](int s) {
      return t.model().batch(3, s, c.group, shape.groups, c.shard, shape.shards, 4);
    };
    const auto held = batch(1000);
    const double first = t.mean_over_world(t.evaluate(held));
    CHECK(rule->seed() == optim::zo_group_seed(9, c.group));
    int replayed = 0;
    for (int s = 0; s < 12; ++s) {
      const auto before = t.unit_parameters(0);
      const auto syncs = t.syncs_applied();
      t.step(batch(s));
      const auto after = t.unit_parameters(0);
      const auto& recs = rule->records();
      REQUIRE(recs.size() == 2);
      CHECK(recs[0].step == s);
      CHECK(recs[1].probe == 1);
      CHECK(recs[0].seed == rule->seed());
      if (t.syncs_applied() != syncs) continue;  // a sync averaged the groups' layers
      auto replay = before;
      const optim::zo_slice whole[] = {{replay, 0}};  // layer0's elements start the model's
      optim::zo_apply(
          whole, recs, [](std::int64_t) { return kLr; }, kZo.probes);
      CHECK(test::bit_equal(replay, after));
      ++replayed;
    }
    CHECK(replayed == 8);  // 12 steps, 4 of them syncs (after steps 2, 5, 8, 11)
    const double last = t.mean_over_world(t.evaluate(held));
    CHECK(last < 0.8 * first);
  });
}

TEST_CASE("zeroth order: the engine plans no backward for the layer and keeps no gradient") {
  // FSDP over 2 shards, 3 units: a forward gather, a backward gather and a reduce-scatter
  // each, 9 ops. layer0 (144 elements: 72 per shard rounded up to 80, padded 160, 640 B)
  // without gradients loses its backward gather and its reduce-scatter: 7 ops, and
  // 2 x 640 = 1280 B less on the shard axis per step. Its grads_ready and grad_buffer
  // refuse it.
  test::mlp_model model;
  test::spawn_ranks(2, [&](inproc::communicator& world) {
    mesh m(world, {1, 1, 2});
    using E = shard::engine<shard::full_shard, inproc::communicator>;
    E plain(m, model.units());
    E zo(m, model.units(), {}, {}, {}, {"layer0"});
    CHECK(plain.step_plan().ops.size() == 9);
    CHECK(zo.step_plan().ops.size() == 7);
    CHECK_FALSE(zo.takes_gradients(0));
    CHECK(zo.takes_gradients(1));
    const std::vector<test::sample> batch{model.net.make_sample(1, 0)};
    std::int64_t bytes[2] = {};
    int k = 0;
    for (E* e : {&plain, &zo}) {
      for (std::size_t u = 0; u < 3; ++u) e->set_unit(u, model.net.init_unit(e->layout(), u, 3));
      const auto before = e->traffic()[axis::shard].payload_bytes;
      e->begin_step();
      model.net.forward_backward(*e, std::span<const test::sample>(batch));
      e->finish_backward();
      bytes[k++] = e->traffic()[axis::shard].payload_bytes - before;
    }
    CHECK(bytes[0] - bytes[1] == 1280);
    CHECK_THROWS_WITH_AS(zo.grad_buffer(0), doctest::Contains("trained without gradients"),
                         invalid_argument);
    CHECK_THROWS_WITH_AS(zo.acquire(0, phase::backward),
                         doctest::Contains("'layer0') is trained without gradients"),
                         invalid_argument);
  });
}

TEST_CASE("zeroth order: bad input is refused with what was expected") {
  test::mlp_model model;
  test::spawn_ranks(2, [&](inproc::communicator& world) {
    mesh m(world, {1, 1, 2});
    using E = shard::engine<shard::full_shard, inproc::communicator>;
    CHECK_THROWS_WITH_AS(
        E(m, model.units(), {}, {}, {}, {"layer9"}),
        doctest::Contains("no unit named 'layer9' for a gradient-free unit; the units are "
                          "'layer0', 'layer1', 'head'"),
        invalid_argument);
  });
  test::spawn_ranks(shape.size(), [&](inproc::communicator& world) {
    mesh m(world, shape);
    auto o = zo_options();
    trainer<no_evaluate_model, fl_fsdp, optim::adamw, inproc::communicator> t(
        m, no_evaluate_model{}, {.lr = kLr}, o);
    const auto c = t.topology().coords();
    CHECK_THROWS_WITH_AS(
        t.step(t.model().m.batch(3, 0, c.group, shape.groups, c.shard, shape.shards, 4)),
        doctest::Contains("asks for the step's loss, but the model has no evaluate(ctx, batch)"),
        invalid_argument);
  });
  CHECK_THROWS_WITH_AS(zeroth_order_rule({.eps = -1.0f}, {"layer0"}),
                       doctest::Contains("eps must be finite and > 0, found -1"), invalid_argument);
  CHECK_THROWS_WITH_AS(zeroth_order_rule(kZo, {}), doctest::Contains("name at least one unit"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(zeroth_order_lower_rule(kZo, 0),
                       doctest::Contains("train at least one lower unit zeroth-order, found 0"),
                       invalid_argument);
  // tiny_mlp has 3 units: all 3 zeroth-order would leave none to backprop.
  test::spawn_ranks(shape.size(), [&](inproc::communicator& world) {
    mesh m(world, shape);
    auto o = zo_options();
    o.local_rule = zeroth_order_lower_rule(kZo, 3);
    CHECK_THROWS_WITH_AS(trainer_t(m, mlp_model{}, {.lr = kLr}, o),
                         doctest::Contains("3 lower units zeroth-order leave none to train by "
                                           "backprop: expected fewer than the model's 3 units"),
                         invalid_argument);
  });
}
