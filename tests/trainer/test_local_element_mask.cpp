// local_element_mask: a group steps only the elements it holds this round, with optimizer
// state for those only; an element held again keeps its state, a newly held one starts from
// zero state; elements not held keep their values bit for bit. With element_average and
// Collate's per-round masks, a run equals the per-element reference (masks change per round
// inside the policy and the rule: the trainer's loop is untouched).
#include "fedshard/trainer/local_element_mask.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/federation/element_average.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/spawn_ranks.hpp"

using namespace fedshard;
using shard::element_ranges;

namespace {

/// Group 1 holds a[0, 4) and b[2, 5) in round 0, a[2, 6) and b[0, 3) in round 1 (a: 8
/// elements, b: 6); group 0 holds everything.
shard::element_ownership two_rounds(const flat_layout&, int, std::int64_t r) {
  const std::vector<element_ranges> all{{{0, 8}}, {{0, 6}}};
  if (r == 0) return {{all, {{{0, 4}}, {{2, 5}}}}};
  return {{all, {{{2, 6}}, {{0, 3}}}}};
}

/// The model of two_rounds: unit a of 8 elements, unit b of 6, unsharded.
const flat_layout ab({{"a", {{"w", {8}}}}, {"b", {{"w", {6}}}}}, 1);

}  // namespace

TEST_CASE("the step touches the held elements only; state for those only, zero when new") {
  // SGD, lr 0.5, momentum 0.5, with dyadic values so every op is exact: the first step sets
  // buf = g, later ones buf = 0.5 buf + g; p -= 0.5 buf.
  local_element_mask<optim::sgd> rule(two_rounds, {.lr = 0.5f, .momentum = 0.5f});
  rule.bind({.master_size = 14,
             .group = 1,
             .units = {{"a", 0, 8, 0}, {"b", 8, 6, 8}},  // master: a then b
             .layout = &ab,
             .groups = 2});
  std::vector<float> master(14), grad(14);
  for (std::size_t i = 0; i < 14; ++i) master[i] = static_cast<float>(i);
  local_access a{.master = master,
                 .grad = grad,
                 .step = 0,
                 .optimizer_step = {},
                 .sum_over_shards = {},
                 .loss = {}};
  auto step = [&](float g) {
    for (std::size_t i = 0; i < 14; ++i) grad[i] = g * static_cast<float>(i + 1);
    rule.optimizer_step(a, 0.5f);
  };
  step(0.25f);  // round 0, step 1
  step(0.5f);   // round 0, step 2
  // held in round 0: a[0, 4) = master 0..3, b[2, 5) = master 10..12
  CHECK(std::vector<std::size_t>(rule.held().begin(), rule.held().end()) ==
        std::vector<std::size_t>{0, 1, 2, 3, 10, 11, 12});
  CHECK(rule.optimizer().size() == 7);
  // element i held: buf = 0.25 (i+1), then 0.125 (i+1) + 0.5 (i+1) = 0.625 (i+1);
  // p = i - 0.125 (i+1) - 0.3125 (i+1) = i - 0.4375 (i+1)
  for (std::size_t i = 0; i < 14; ++i) {
    const bool held = i < 4 || (i >= 10 && i < 13);
    const float n = static_cast<float>(i + 1);
    CHECK(master[i] == (held ? static_cast<float>(i) - 0.4375f * n : static_cast<float>(i)));
  }
  local_sync s;
  rule.after_sync(a, s);
  CHECK(rule.round() == 1);
  for (std::size_t i = 0; i < 14; ++i) master[i] = static_cast<float>(i);  // the global values
  step(1.0f);  // round 1: a[2, 6) = master 2..5, b[0, 3) = master 8..10
  CHECK(std::vector<std::size_t>(rule.held().begin(), rule.held().end()) ==
        std::vector<std::size_t>{2, 3, 4, 5, 8, 9, 10});
  const auto buf = rule.optimizer().state().at(0).data;
  REQUIRE(buf.size() == 7);
  // kept (2, 3, 10): buf = 0.5 x 0.625 (i+1) + (i+1) = 1.3125 (i+1); new (4, 5, 8, 9): i+1
  const std::size_t idx[] = {2, 3, 4, 5, 8, 9, 10};
  for (std::size_t j = 0; j < 7; ++j) {
    const std::size_t i = idx[j];
    const float n = static_cast<float>(i + 1);
    const bool kept = i == 2 || i == 3 || i == 10;
    CAPTURE(i);
    CHECK(buf[j] == (kept ? 1.3125f * n : n));
    CHECK(master[i] == static_cast<float>(i) - 0.5f * buf[j]);
  }
  for (const std::size_t i : {0, 1, 6, 7, 11, 12, 13}) CHECK(master[i] == static_cast<float>(i));
}

TEST_CASE("bad input: no layout, masks of too few groups") {
  local_element_mask<optim::sgd> rule(two_rounds, {});
  CHECK_THROWS_WITH_AS(
      rule.bind({.master_size = 8, .group = 0, .units = {{"a", 0, 8, 0}}}),
      doctest::Contains("expected the model's layout in the local setup, found none"),
      invalid_argument);
  CHECK_THROWS_WITH_AS(element_mask_rule<optim::sgd>({}, {}),
                       doctest::Contains("expected a mask source, found none"), invalid_argument);
  local_element_mask<optim::sgd> far(two_rounds, {});
  far.bind({.master_size = 8, .group = 2, .units = {{"a", 0, 8, 0}}, .layout = &ab, .groups = 3});
  std::vector<float> m(8), g(8);
  local_access a{
      .master = m, .grad = g, .step = 0, .optimizer_step = {}, .sum_over_shards = {}, .loss = {}};
  CHECK_THROWS_WITH_AS(
      far.optimizer_step(a, 0.1f),
      doctest::Contains("round 0's masks list 2 groups; expected unit 0 of group 2"),
      invalid_argument);
}

namespace {

constexpr std::size_t numel_of[2] = {16, 10};

/// Unit "a": w [4, 3], b [4]; unit "c": w [5, 2]; the same start on every group; group g's
/// gradient in step s of element i of unit u is grad(g, s, u, i).
struct grid_model {
  int group = 0;
  std::vector<unit_spec> units() const {
    return {{"a", {{"w", {4, 3}}, {"b", {4}}}}, {"c", {{"w", {5, 2}}}}};
  }
  std::vector<float> initial_values(const flat_layout& l, std::size_t u) const {
    std::vector<float> v(l.unit(u).numel);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = start(u, i);
    return v;
  }
  static float start(std::size_t u, std::size_t i) {
    return 0.25f * static_cast<float>(i + 1) - 0.5f * static_cast<float>(u);
  }
  static float grad(int g, std::int64_t s, std::size_t u, std::size_t i) {
    return 0.01f * static_cast<float>((g + 1) * (static_cast<int>(i) + 1)) +
           0.125f * static_cast<float>(s) - 0.03f * static_cast<float>(u);
  }
  float forward_backward(step_context& ctx, int) {
    for (std::size_t u = 0; u < 2; ++u) {
      ctx.acquire(u);
      ctx.release(u);
    }
    for (std::size_t u = 2; u-- > 0;) {
      ctx.acquire(u, phase::backward);
      const auto& slots = ctx.layout().unit(u).tensors;
      for (std::size_t t = 0; t < slots.size(); ++t) {
        auto gv = ctx.grad(u, t);
        for (std::size_t j = 0; j < gv.size(); ++j)
          gv[j] = grad(group, ctx.step(), u, slots[t].offset + j);
      }
      ctx.release(u);
      ctx.grads_ready(u);
    }
    return 0.0f;
  }
};

using element_sgd = algorithm<shard::hybrid_shard, federation::element_average, schedule::periodic>;

}  // namespace

TEST_CASE("Collate run: groups step what they hold; each sync averages it over the holders") {
  // Per element and round: a holder steps p - g (SGD, lr 1, no state), a non-holder keeps p;
  // the new global value is the holders' sum in group order over their count, or p when
  // nobody holds it.
  const flat_layout l({{"a", {{"w", {4, 3}}, {"b", {4}}}}, {"c", {{"w", {5, 2}}}}}, 1);
  const int G = 3;
  const shard::collate_config c{.groups = G, .fraction = 0.4, .seed = 5, .block = 3};
  auto masks = [&](const flat_layout& model, int groups, std::int64_t r) {
    CHECK(model.num_units() == 2);
    CHECK(groups == G);
    return shard::collate_masks(l, c, r);
  };
  const std::int64_t steps = 4;
  std::vector<std::vector<float>> want(2);
  for (std::size_t u = 0; u < 2; ++u)
    for (std::size_t i = 0; i < numel_of[u]; ++i) want[u].push_back(grid_model::start(u, i));
  int nobody = 0;
  for (std::int64_t s = 0; s < steps; ++s) {
    const auto o = masks(l, G, s);
    for (std::size_t u = 0; u < 2; ++u)
      for (std::size_t i = 0; i < numel_of[u]; ++i) {
        float sum = 0;
        int k = 0;
        for (int g = 0; g < G; ++g)
          if (o.holds(g, u, i)) {
            sum += want[u][i] - grid_model::grad(g, s, u, i);
            ++k;
          }
        nobody += k == 0;
        if (k > 0) want[u][i] = sum / static_cast<float>(k);
      }
  }
  CHECK(nobody > 0);  // 0.6^3 of the blocks: the rule that keeps them is exercised
  for (const mesh_shape shape : {mesh_shape{G, 1, 1}, mesh_shape{G, 1, 2}}) {
    test::spawn_ranks(shape.size(), [&](inproc::communicator& world) {
      mesh m(world, shape);
      trainer_options<element_sgd> o;
      o.total_steps = steps;
      o.schedule.period = 1;
      o.federation = {.masks = masks};
      o.local_rule = element_mask_rule<optim::sgd>(masks, {.lr = 1.0f});
      trainer<grid_model, element_sgd, optim::sgd, inproc::communicator> t(m, {m.coords().group},
                                                                           {.lr = 1.0f}, o);
      for (std::int64_t s = 0; s < steps; ++s) t.step(0);
      for (std::size_t u = 0; u < 2; ++u) {
        const auto v = t.unit_parameters(u);
        for (std::size_t i = 0; i < v.size(); ++i) {
          CAPTURE(u);
          CAPTURE(i);
          CHECK(v[i] == want[u][i]);
        }
      }
    });
  }
}

TEST_CASE("the state saves as bytes and loads into a fresh rule: held elements, buffers, round") {
  auto make = [] {
    auto r = std::make_unique<local_element_mask<optim::sgd>>(
        two_rounds, optim::sgd_config{.lr = 0.5f, .momentum = 0.5f});
    r->bind({.master_size = 14,
             .group = 1,
             .units = {{"a", 0, 8, 0}, {"b", 8, 6, 8}},
             .layout = &ab,
             .groups = 2});
    return r;
  };
  auto saved = make();
  std::vector<float> master(14, 1.0f), grad(14, 0.25f);
  local_access a{.master = master,
                 .grad = grad,
                 .step = 0,
                 .optimizer_step = {},
                 .sum_over_shards = {},
                 .loss = {}};
  saved->optimizer_step(a, 0.5f);
  saved->after_sync(a, {});
  state_registry from;
  saved->register_state(from);
  const state_entry* e = from.find("element_mask.state");
  REQUIRE(e != nullptr);
  // 4 int64 of head, 7 held offsets (8 B each), 7 momentum values (4 B each)
  REQUIRE(e->bytes() == 32 + 7 * 8 + 7 * 4);
  std::vector<std::byte> bytes(e->bytes());
  e->save(bytes);
  auto loaded = make();
  state_registry to;
  loaded->register_state(to);
  to.find("element_mask.state")->load(bytes);
  CHECK(loaded->round() == 1);
  CHECK(std::vector<std::size_t>(loaded->held().begin(), loaded->held().end()) ==
        std::vector<std::size_t>{0, 1, 2, 3, 10, 11, 12});
  CHECK(loaded->optimizer().step_count() == 1);
  const auto state = loaded->optimizer().state();  // the spans point into its buffers
  for (const float b : state.at(0).data) CHECK(b == 0.25f);
  bytes.pop_back();
  CHECK_THROWS_WITH_AS(to.find("element_mask.state")->load(bytes),
                       doctest::Contains("a saved state of 115 bytes; expected 116 for 7 held"),
                       invalid_argument);
}
