// element_average (FEAST / Collate: sub-models at element granularity): each element is the
// (token-weighted) mean over the groups that hold it, bit for bit as a per-element loop
// computes it, for FEAST's fixed width slices and for Collate's masks that change every round;
// (a) sub-communicators and (b) the masked SUM give the same bits; every group holding
// everything is `average`; the wire moves the closed form; 70 groups; bad input refused.
#include "fedshard/federation/element_average.hpp"

#include <doctest/doctest.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/federation/average.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/policy_checks.hpp"
#include "support/spawn_ranks.hpp"

using namespace fedshard;
using federation::element_aggregation;
using federation::element_average;

namespace {

constexpr int units_n = 2;
constexpr std::size_t unit_numel[units_n] = {16, 10};

/// Unit "a": w [4, 3] and b [4]; unit "c": w [5, 2]. Every group starts from the same values;
/// in step s group g's gradient of element i of unit u is grad(g, s, u, i), so after a step
/// (SGD, lr 1: p - g) the groups differ and the sync combines them.
struct grid_model {
  int group = 0;
  std::int64_t weight = 1;  ///< tokens per batch

  std::int64_t tokens(int) const { return weight; }
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
           0.125f * static_cast<float>(s) - 0.03f * static_cast<float>(u) +
           0.001f * static_cast<float>(g * g);
  }
  float forward_backward(step_context& ctx, int) {
    for (std::size_t u = 0; u < units_n; ++u) {
      ctx.acquire(u);
      ctx.release(u);
    }
    for (std::size_t u = units_n; u-- > 0;) {
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

using element_sgd = algorithm<shard::hybrid_shard, element_average, schedule::periodic>;
using average_sgd = algorithm<shard::hybrid_shard, federation::average, schedule::periodic>;
template <class A>
using grid_trainer = trainer<grid_model, A, optim::sgd, inproc::communicator>;

/// A sync after every step (period 1).
template <class A>
trainer_options<A> every_step(std::int64_t steps, typename A::federation_policy::config fed = {}) {
  trainer_options<A> o;
  o.total_steps = steps;
  o.schedule.period = 1;
  o.federation = fed;
  return o;
}

flat_layout grid_layout() {
  return flat_layout(grid_model{}.units(), 1);
}

/// The global model after `steps` steps, element by element, as rule 2 states it: each group
/// steps p - g from the global value; the holders' values (scaled by |H| w_g / Σ_H w when
/// weighted) are summed in group order from 0 and divided by |H|; an element nobody holds takes
/// group 0's value.
std::vector<std::vector<float>> reference(
    int G, std::int64_t steps, const std::function<shard::element_ownership(std::int64_t)>& owners,
    const std::vector<double>& w) {
  std::vector<std::vector<float>> theta(units_n);
  for (std::size_t u = 0; u < units_n; ++u)
    for (std::size_t i = 0; i < unit_numel[u]; ++i) theta[u].push_back(grid_model::start(u, i));
  for (std::int64_t s = 0; s < steps; ++s) {
    const shard::element_ownership o = owners(s);
    for (std::size_t u = 0; u < units_n; ++u)
      for (std::size_t i = 0; i < unit_numel[u]; ++i) {
        auto local = [&](int g) { return theta[u][i] - grid_model::grad(g, s, u, i); };
        int k = 0;
        double total = 0;
        for (int g = 0; g < G; ++g)
          if (o.holds(g, u, i)) {
            ++k;
            total += w[static_cast<std::size_t>(g)];
          }
        if (k == 0) {
          theta[u][i] = local(0);
          continue;
        }
        float sum = 0;
        for (int g = 0; g < G; ++g)
          if (o.holds(g, u, i)) {
            const double scale = total > 0 ? k * w[static_cast<std::size_t>(g)] / total : 1.0;
            sum += scale == 1.0 ? local(g) : local(g) * static_cast<float>(scale);
          }
        theta[u][i] = sum / static_cast<float>(k);
      }
  }
  return theta;
}

/// Runs body(mesh, group) on every rank of shape, its mesh over an inproc world.
template <class F>
void on_groups(const mesh_shape& shape, F body) {
  test::spawn_ranks(shape.size(), [&](inproc::communicator& world) {
    mesh m(world, shape);
    body(m, m.coords().group);
  });
}

/// Trains `steps` steps on shape with fed and checks every element of every unit, on every
/// rank, against reference() with weights w (tokens per group per step).
void check_against_reference(const mesh_shape& shape, std::int64_t steps,
                             const element_average::config& fed) {
  const int G = shape.groups;
  std::vector<double> w(static_cast<std::size_t>(G), 1.0);
  if (fed.weighted)
    for (int g = 0; g < G; ++g)
      w[static_cast<std::size_t>(g)] =
          static_cast<double>((g % 3 + 1) * shape.replicas * shape.shards);
  const auto want = reference(G, steps, fed.masks, w);
  on_groups(shape, [&](auto& m, int g) {
    grid_trainer<element_sgd> t(m, {g, g % 3 + 1}, {.lr = 1.0f},
                                every_step<element_sgd>(steps, fed));
    for (std::int64_t s = 0; s < steps; ++s) t.step(0);
    for (std::size_t u = 0; u < units_n; ++u) {
      const auto v = t.unit_parameters(u);
      REQUIRE(v.size() == unit_numel[u]);
      for (std::size_t i = 0; i < v.size(); ++i) {
        CAPTURE(u);
        CAPTURE(i);
        CHECK(v[i] == want[u][i]);
      }
    }
  });
}

}  // namespace

TEST_CASE("element_average models FederationPolicy") {
  test::check_federation_policy<element_average>("element_average", true);
}

TEST_CASE("FEAST slices: each element is the mean over its holders, by (a) and by (b)") {
  const flat_layout l = grid_layout();
  const std::vector<double> caps{1.0, 0.5, 0.5, 0.25};
  auto slices = [&](std::int64_t) { return shard::feast_slices(l, caps); };
  for (const auto how : {element_aggregation::masked, element_aggregation::members}) {
    for (const bool weighted : {false, true}) {
      CAPTURE(static_cast<int>(how));
      CAPTURE(weighted);
      check_against_reference(
          {4, 1, 1}, 3, {.masks = slices, .fixed = true, .weighted = weighted, .aggregation = how});
    }
  }
  // (b) over 2 shards and over 2 replicas: the shard windows map to the units' elements
  check_against_reference({2, 1, 2}, 2, {.masks = [&](std::int64_t) {
                            const double c[] = {1.0, 0.5};
                            return shard::feast_slices(l, c);
                          }});
  check_against_reference({2, 2, 1}, 2,
                          {.masks =
                               [&](std::int64_t) {
                                 const double c[] = {0.25, 0.75};  // rows 3.. of each: nobody's
                                 return shard::feast_slices(l, c);
                               },
                           .weighted = true});
}

TEST_CASE("Collate masks change every round; each round's sync is its masks' mean") {
  const flat_layout l = grid_layout();
  const shard::collate_config c{.groups = 3, .fraction = 0.5, .seed = 11, .block = 2};
  auto masks = [&](std::int64_t r) { return shard::collate_masks(l, c, r); };
  CHECK(masks(0).held != masks(1).held);
  CHECK(masks(1).held != masks(2).held);
  for (const bool weighted : {false, true}) {
    CAPTURE(weighted);
    check_against_reference({3, 1, 1}, 4, {.masks = masks, .weighted = weighted});
    check_against_reference({3, 1, 2}, 3, {.masks = masks, .weighted = weighted});
  }
}
