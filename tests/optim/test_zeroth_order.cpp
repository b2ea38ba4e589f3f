/// Tests of the zeroth-order (SPSA) updates and their records (optim/zeroth_order.hpp,
/// kernels/zeroth_order.hpp): directions are signs that any shard regenerates from global
/// indices, the projected gradient of a quadratic is z . (theta - t), the step size rounds as
/// stated, records alone reproduce a group's update bit for bit, groups combining the same
/// records on differently sharded anchors agree bit for bit, and bad settings are refused.

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/optim/zeroth_order.hpp"

namespace {

using namespace fedshard;
using optim::zo_record;
using optim::zo_slice;

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// L(theta) = 1/2 sum (theta_i - t_i)^2 over a whole vector, in double.
double quadratic(const std::vector<float>& theta, const std::vector<float>& t) {
  double l = 0;
  for (std::size_t i = 0; i < theta.size(); ++i) {
    const double d = static_cast<double>(theta[i]) - static_cast<double>(t[i]);
    l += 0.5 * d * d;
  }
  return l;
}

}  // namespace

TEST_CASE("zeroth order: directions are signs, regenerated from global indices by any shard") {
  const auto key = kernels::zo_key(7, 3, 0);
  const std::size_t n = 100000;
  int plus = 0;
  std::vector<float> full(n, 0.0f);
  kernels::zo_add(full, 0, key, 1.0f);
  for (float z : full) {
    REQUIRE((z == 1.0f || z == -1.0f));
    plus += z > 0 ? 1 : 0;
  }
  // Fair signs: 50000 +- 1000 is more than 6 standard deviations (sqrt(n) / 2 = 158).
  CHECK(plus > 49000);
  CHECK(plus < 51000);
  // Two shards, [0, 37) and [37, n) with their offsets, regenerate the same direction.
  std::vector<float> a(37, 0.0f), b(n - 37, 0.0f);
  const zo_slice slices[] = {{a, 0}, {b, 37}};
  optim::zo_add(slices, key, 1.0f);
  a.insert(a.end(), b.begin(), b.end());
  CHECK(same_bits(a, full));
  // Another step, probe or seed draws another direction (about half the signs agree).
  for (auto other :
       {kernels::zo_key(7, 4, 0), kernels::zo_key(7, 3, 1), kernels::zo_key(8, 3, 0)}) {
    int agree = 0;
    for (std::size_t i = 0; i < n; ++i) agree += kernels::zo_sign(other, i) == full[i] ? 1 : 0;
    CHECK(agree > 49000);
    CHECK(agree < 51000);
  }
}

TEST_CASE(
    "zeroth order: the projected gradient of a quadratic is z . (theta - t), restored after") {
  // theta = (1, 2, -1, 0.5), t = 0, eps = 1/4: every perturbed value and loss is exact, so
  // (L+ - L-) / (2 eps) = sum_i z_i theta_i exactly, and the round trip restores theta.
  std::vector<float> theta{1.0f, 2.0f, -1.0f, 0.5f};
  const std::vector<float> t(4, 0.0f);
  const zo_slice slice[] = {{theta, 0}};
  const optim::zeroth_order_settings s{.eps = 0.25f, .probes = 1, .seed = 11};
  int calls = 0;
  const auto r = optim::spsa_probe(slice, s, 11, 5, 0, [&] {
    ++calls;
    return quadratic(theta, t);
  });
  CHECK(calls == 2);
  CHECK(r.seed == 11);
  CHECK(r.step == 5);
  CHECK(r.probe == 0);
  const auto key = kernels::zo_key(11, 5, 0);
  const double want = 1.0 * kernels::zo_sign(key, 0) + 2.0 * kernels::zo_sign(key, 1) -
                      1.0 * kernels::zo_sign(key, 2) + 0.5 * kernels::zo_sign(key, 3);
  CHECK(r.scalar == static_cast<float>(want));
  CHECK(theta == std::vector<float>{1.0f, 2.0f, -1.0f, 0.5f});
}

TEST_CASE("zeroth order: the step size is fl(fl(fl(lr g) w) / P)") {
  // fl(0.1f * 3) = 0.3f (0.30000000447 is nearer 0.30000001192 than 0.29999998212);
  // 0.3f * 0.5 = 0.15000000596 and / 2 = 0.07500000298, both exact.
  const zo_record r{.seed = 1, .step = 0, .probe = 0, .scalar = 3.0f};
  CHECK(optim::zo_step_size(r, 0.1f, 2, 0.5f) == 0.075000002980232239f);
  CHECK(optim::zo_step_size(r, 0.1f, 1) == 0.3f);
}

TEST_CASE("zeroth order: a group's records alone reproduce its update bit for bit") {
  // Dyadic values (theta in quarters, t = 0, eps = 1/4, lr = 1/8, 2 probes) keep every
  // perturbation exact over 5 steps, so the group's own parameters after its steps equal
  // the replay of its records on the starting values, bit for bit. 5 steps x 2 probes = 10
  // records of 24 bytes: 240 bytes, whatever the number of parameters (here 6 x 4 = 24 B).
  const std::vector<float> start{1.0f, -0.5f, 0.25f, 2.0f, -1.25f, 0.75f};
  const std::vector<float> t(6, 0.0f);
  std::vector<float> lo(start.begin(), start.begin() + 2), hi(start.begin() + 2, start.end());
  const zo_slice group[] = {{lo, 0}, {hi, 2}};  // the group's two ranks' shards
  const optim::zeroth_order_settings s{.eps = 0.25f, .probes = 2, .seed = 3};
  const float lr = 0.125f;
  std::vector<zo_record> records;
  for (std::int64_t k = 0; k < 5; ++k) {
    const auto step = optim::spsa_step(group, s, s.seed, k, lr, [&] {
      std::vector<float> all(lo);
      all.insert(all.end(), hi.begin(), hi.end());
      return quadratic(all, t);
    });
    records.insert(records.end(), step.begin(), step.end());
  }
  REQUIRE(records.size() == 10);
  CHECK(records.size() * sizeof(zo_record) == 240);
  std::vector<float> trained(lo);
  trained.insert(trained.end(), hi.begin(), hi.end());
  CHECK_FALSE(same_bits(trained, start));  // it moved
  CHECK(quadratic(trained, t) < quadratic(start, t));
  std::vector<float> replayed(start);
  const zo_slice whole[] = {{replayed, 0}};
  optim::zo_apply(
      whole, records, [lr](std::int64_t) { return lr; }, s.probes);
  CHECK(same_bits(replayed, trained));
}

TEST_CASE("zeroth order: groups combining the same records on differently sharded anchors agree") {
  // Two groups' records from arbitrary values; the combination (weights 1/4 and 3/4) on an
  // anchor held whole and on the same anchor held in three shards gives the same bits, and
  // element 0 matches the combination worked out from its two updates.
  std::vector<std::vector<zo_record>> recs(2);
  for (int g = 0; g < 2; ++g)
    for (std::int64_t k = 0; k < 3; ++k)
      recs[static_cast<std::size_t>(g)].push_back(
          {.seed = optim::zo_group_seed(9, g),
           .step = k,
           .probe = 0,
           .scalar = 0.37f * static_cast<float>(k + 1) * (g == 0 ? 1.0f : -2.0f)});
  const std::vector<float> weights{0.25f, 0.75f};
  auto lr_of = [](std::int64_t step) { return 0.01f * static_cast<float>(step + 1); };
  std::vector<float> anchor(50);
  for (std::size_t i = 0; i < anchor.size(); ++i) anchor[i] = 0.1f * static_cast<float>(i) - 2.3f;

  std::vector<float> whole(anchor);
  const zo_slice one[] = {{whole, 0}};
  optim::zo_combine(one, recs, weights, lr_of, 1);

  std::vector<float> a(anchor.begin(), anchor.begin() + 7),
      b(anchor.begin() + 7, anchor.begin() + 30), c(anchor.begin() + 30, anchor.end());
  const zo_slice three[] = {{a, 0}, {b, 7}, {c, 30}};
  optim::zo_combine(three, recs, weights, lr_of, 1);
  a.insert(a.end(), b.begin(), b.end());
  a.insert(a.end(), c.begin(), c.end());
  CHECK(same_bits(a, whole));

  float e0 = anchor[0];
  for (int g = 0; g < 2; ++g)
    for (const auto& r : recs[static_cast<std::size_t>(g)]) {
      const float step = lr_of(r.step) * r.scalar;  // fl(lr g), then fl(. w), then / 1
      e0 = e0 - (step * weights[static_cast<std::size_t>(g)]) * kernels::zo_sign(r.key(), 0);
    }
  CHECK(whole[0] == e0);
  CHECK_FALSE(same_bits(whole, anchor));
}

TEST_CASE("zeroth order: bad settings are refused with what was expected") {
  CHECK_THROWS_WITH_AS(optim::check(optim::zeroth_order_settings{.eps = 0.0f}),
                       doctest::Contains("eps must be finite and > 0, found 0"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(optim::check(optim::zeroth_order_settings{.probes = 0}),
                       doctest::Contains("probes must be >= 1, found 0"),
                       fedshard::invalid_argument);
  std::vector<float> v(3);
  const zo_slice s[] = {{v, 0}};
  const std::vector<std::vector<zo_record>> recs(2);
  const std::vector<float> w{1.0f};
  CHECK_THROWS_WITH_AS(
      optim::zo_combine(
          s, recs, w, [](std::int64_t) { return 1.0f; }, 1),
      doctest::Contains("one weight per group expected, found 1 weights for 2 groups"),
      fedshard::invalid_argument);
}
