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
std::vector<std::vector<float>> reference(int G, std::int64_t steps,
                                          const element_average::config& fed,
                                          const std::vector<double>& w) {
  std::vector<std::vector<float>> theta(units_n);
  for (std::size_t u = 0; u < units_n; ++u)
    for (std::size_t i = 0; i < unit_numel[u]; ++i) theta[u].push_back(grid_model::start(u, i));
  for (std::int64_t s = 0; s < steps; ++s) {
    const shard::element_ownership o = fed.masks(grid_layout(), G, s);
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
  const auto want = reference(G, steps, fed, w);
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
  auto slices = [&](const flat_layout&, int, std::int64_t) { return shard::feast_slices(l, caps); };
  for (const auto how : {element_aggregation::masked, element_aggregation::members}) {
    for (const bool weighted : {false, true}) {
      CAPTURE(static_cast<int>(how));
      CAPTURE(weighted);
      check_against_reference(
          {4, 1, 1}, 3, {.masks = slices, .fixed = true, .weighted = weighted, .aggregation = how});
    }
  }
  // (b) over 2 shards and over 2 replicas: the shard windows map to the units' elements
  check_against_reference({2, 1, 2}, 2, {.masks = [&](const flat_layout&, int, std::int64_t) {
                            const double c[] = {1.0, 0.5};
                            return shard::feast_slices(l, c);
                          }});
  check_against_reference({2, 2, 1}, 2,
                          {.masks =
                               [&](const flat_layout&, int, std::int64_t) {
                                 const double c[] = {0.25, 0.75};  // rows 3.. of each: nobody's
                                 return shard::feast_slices(l, c);
                               },
                           .weighted = true});
}

TEST_CASE("Collate masks change every round; each round's sync is its masks' mean") {
  const flat_layout l = grid_layout();
  const shard::collate_config c{.groups = 3, .fraction = 0.5, .seed = 11, .block = 2};
  auto masks = [&](const flat_layout&, int, std::int64_t r) {
    return shard::collate_masks(l, c, r);
  };
  CHECK(masks(l, 3, 0).held != masks(l, 3, 1).held);
  CHECK(masks(l, 3, 1).held != masks(l, 3, 2).held);
  for (const bool weighted : {false, true}) {
    CAPTURE(weighted);
    check_against_reference({3, 1, 1}, 4, {.masks = masks, .weighted = weighted});
    check_against_reference({3, 1, 2}, 3, {.masks = masks, .weighted = weighted});
  }
}

TEST_CASE("every group holding everything is `average`, bit for bit") {
  const flat_layout l = grid_layout();
  const std::vector<element_average::config> alls{
      {},  // no masks
      {.masks = [&](const flat_layout&, int,
                    std::int64_t) { return shard::feast_slices(l, std::vector<double>(4, 1.0)); },
       .aggregation = element_aggregation::masked},  // (b), all held
      {.masks = [&](const flat_layout&, int,
                    std::int64_t) { return shard::element_ownership{}; }},  // everyone()
      {.masks =
           [&](const flat_layout&, int, std::int64_t r) {
             return shard::collate_masks(l, {.groups = 4, .fraction = 1.0}, r);
           }},
  };
  for (std::size_t k = 0; k < alls.size(); ++k) {
    CAPTURE(k);
    for (const mesh_shape shape : {mesh_shape{4, 1, 1}, mesh_shape{4, 2, 1}, mesh_shape{4, 1, 2}}) {
      on_groups(shape, [&](auto& m, int g) {
        grid_trainer<element_sgd> e(m, {g}, {.lr = 1.0f}, every_step<element_sgd>(2, alls[k]));
        grid_trainer<average_sgd> a(m, {g}, {.lr = 1.0f}, every_step<average_sgd>(2));
        for (int s = 0; s < 2; ++s) {
          e.step(0);
          a.step(0);
        }
        const auto pe = e.parameters(), pa = a.parameters();
        REQUIRE(pe.size() == pa.size());
        CHECK(std::memcmp(pe.data(), pa.data(), pe.size() * sizeof(float)) == 0);
        CHECK(e.traffic()[axis::federation].wire_bytes == a.traffic()[axis::federation].wire_bytes);
      });
    }
  }
}

TEST_CASE("the wire moves the closed form: (b) 2 (G-1)/G of the fragment, (a) per run") {
  // G = 4 groups of one rank; capabilities {1, .25, .25, .25}: the small groups hold row 0 of
  // each tensor (ceil(.25 x 4) = 1 row of a.w [4, 3] and a.b [4]; ceil(.25 x 5) = 2 rows of
  // c.w [5, 2]). The fragment packs a (16 elements) and c (10, padded to 16): 32 f32.
  //  (b): one SUM all_reduce of 128 B over 4: 2 x 3/4 x 128 = 192 B per rank and sync.
  //  (a): runs a[0, 3) all, a[3, 12) {0}, a[12, 13) all, a[13, 16) {0}, c[0, 4) all,
  //       c[4, 10) {0}, c padding nobody's: AVG over 4 of 12 + 4 + 16 = 32 B (x 1.5 = 48 B),
  //       broadcasts from group 0 of 36 + 12 + 24 = 72 B (x 1): 120 B per rank, 6 calls.
  const flat_layout l = grid_layout();
  const std::vector<double> caps{1.0, 0.25, 0.25, 0.25};
  auto slices = [&](const flat_layout&, int, std::int64_t) { return shard::feast_slices(l, caps); };
  struct expect {
    element_average::config fed;
    double bytes;
    std::int64_t calls;
  };
  const expect cases[] = {
      {{.masks = slices, .fixed = true}, 192, 1},  // automatic: 6 calls cost more than 72 B
      {{.masks = slices, .fixed = true, .aggregation = element_aggregation::members}, 120, 6},
      {{.masks = slices, .fixed = true, .call_bytes = 0}, 120, 6},  // automatic, calls free
      {{.masks = slices}, 192, 1},                                  // not fixed: (b)
  };
  // The closed form of the whole model (members_cost), over the extents 16 and 10:
  //  (b) 2 x 3 x 4 B x 26 = 624; (a) 8 elements held by all x 4 B x 6 + 18 by {0} x 4 B x 4
  //  = 192 + 288 = 480, in 4 + 2 runs.
  const std::vector<federation::packed_unit> units{{0, 16}, {1, 16}};
  const auto cost = federation::members_cost(slices(l, 4, 0), units, 4);
  CHECK(cost.bytes_b == 624);
  CHECK(cost.bytes_a == 480);
  CHECK(cost.calls_a == 6);
  for (const expect& c : cases) {
    CAPTURE(c.bytes);
    on_groups({4, 1, 1}, [&](auto& m, int g) {
      grid_trainer<element_sgd> t(m, {g}, {.lr = 1.0f}, every_step<element_sgd>(2, c.fed));
      t.step(0);
      t.step(0);
      CHECK(t.traffic()[axis::federation].wire_bytes == 2 * c.bytes);
      CHECK(t.traffic()[axis::federation].calls == 2 * c.calls);
    });
  }
}

TEST_CASE("70 groups: begin, the rank-order sum, end give the per-element mean") {
  // Without a wire: each group's begin(), then the buffers summed in group order (what the
  // SUM all_reduce computes), then end() on the sum.
  const flat_layout l({{"u", {{"w", {64}}}}}, 1);
  const int G = 70;
  const shard::collate_config c{.groups = G, .fraction = 0.05, .seed = 3, .block = 1};
  auto masks = [&](const flat_layout&, int, std::int64_t r) {
    return shard::collate_masks(l, c, r);
  };
  const std::vector<federation::packed_unit> units{{0, 64}};
  auto value = [](int g, std::size_t i) { return 0.5f * static_cast<float>(g) + 0.01f * i; };
  for (std::int64_t round : {0, 1}) {
    std::vector<float> sum(64, 0.0f);
    for (int g = 0; g < G; ++g) {
      element_average p({.masks = masks}, {64});
      std::vector<float> buf(64);
      for (std::size_t i = 0; i < 64; ++i) buf[i] = value(g, i);
      p.begin(
          0, buf,
          {.fragment = 0, .groups = G, .group = g, .units = units, .round = round, .layout = &l});
      for (std::size_t i = 0; i < 64; ++i) sum[i] += buf[i];
    }
    element_average last({.masks = masks}, {64});
    std::vector<float> scratch(64);
    const federation::sync_info info{
        .fragment = 0, .groups = G, .group = 0, .units = units, .round = round, .layout = &l};
    last.begin(0, scratch, info);
    last.end(0, sum, info);
    const auto o = masks(l, G, round);
    int nobody = 0;
    for (std::size_t i = 0; i < 64; ++i) {
      float s = 0;
      int k = 0;
      for (int g = 0; g < G; ++g)
        if (o.holds(g, 0, i)) {
          s += value(g, i);
          ++k;
        }
      nobody += k == 0;
      CHECK(sum[i] == (k == 0 ? value(0, i) : s / static_cast<float>(k)));
    }
    CHECK(nobody < 10);  // 0.95^70 = 2.8% of 64
  }
}

TEST_CASE("bad input is refused with what was expected") {
  const flat_layout l = grid_layout();
  const std::vector<federation::packed_unit> units{{0, 16}, {1, 16}};
  std::vector<float> buf(32);
  auto three = [&](const flat_layout&, int, std::int64_t) {
    return shard::feast_slices(l, std::vector<double>(3, 1.0));
  };
  element_average p({.masks = three}, {32});
  CHECK_THROWS_WITH_AS(
      p.begin(0, buf, {.fragment = 0, .groups = 4, .group = 0, .units = units, .layout = &l}),
      doctest::Contains("element_average: round 0's ownership lists 3 groups, "
                        "but the mesh has 4"),
      invalid_argument);
  auto one_unit = [&](const flat_layout&, int, std::int64_t) {
    return shard::element_ownership{{{{{0, 4}}}, {{{0, 4}}}}};
  };
  element_average q({.masks = one_unit}, {32});
  CHECK_THROWS_WITH_AS(
      q.begin(0, buf, {.fragment = 0, .groups = 2, .group = 0, .units = units, .layout = &l}),
      doctest::Contains("lists 1 units for group 0, but the fragment packs unit 1"),
      invalid_argument);
  // Masks without the model's layout (a caller that sets no sync_context::layout).
  element_average blind({.masks = one_unit}, {32});
  CHECK_THROWS_WITH_AS(blind.sync_plan({.shape = {2, 1, 1}, .numel = 32, .units = units}),
                       doctest::Contains("the masks need the model's layout"), invalid_argument);
  CHECK_THROWS_WITH_AS(
      blind.begin(0, buf, {.fragment = 0, .groups = 2, .group = 0, .units = units}),
      doctest::Contains("found none at round 0"), invalid_argument);
  const double tokens[] = {3, -1};
  auto two = [&](const flat_layout&, int, std::int64_t) {
    return shard::feast_slices(l, std::vector<double>{1.0, 0.5});
  };
  element_average w({.masks = two, .weighted = true}, {32});
  CHECK_THROWS_WITH_AS(
      w.begin(0, buf,
              {.fragment = 0,
               .groups = 2,
               .group = 0,
               .group_tokens = tokens,
               .units = units,
               .layout = &l}),
      doctest::Contains("weights (tokens since the last sync) must be >= 0, found -1 for group 1"),
      invalid_argument);
  element_average per_round({.masks = two, .aggregation = element_aggregation::members}, {32});
  CHECK_THROWS_WITH_AS(
      per_round.sync_plan({.shape = {2, 1, 1}, .numel = 32, .units = units, .layout = &l}),
      doctest::Contains("aggregation by members needs a fixed ownership and at most 64 groups; "
                        "found fixed = false"),
      invalid_argument);
}
