// optim::soup_pool (Local Superior Soups): the regularisers' gradients equal their closed
// forms on small hand-worked cases (whole and sharded), one member without regularisers is
// the identity, the schedule adds members as the pool's mean, the weights are seeded and
// uniform on the simplex, the pool's memory and average, and bad input is refused.
#include "fedshard/optim/soup.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "fedshard/error.hpp"

using fedshard::optim::soup_config;
using fedshard::optim::soup_pool;

namespace {

void set(std::span<float> dst, const std::vector<float>& v) {
  REQUIRE(dst.size() == v.size());
  for (std::size_t i = 0; i < v.size(); ++i) dst[i] = v[i];
}

std::vector<float> to_vector(std::span<const float> s) {
  return {s.begin(), s.end()};
}

bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::string message_of(const soup_config& cfg) {
  try {
    soup_pool p(cfg, 4);
  } catch (const fedshard::invalid_argument& e) {
    return e.what();
  }
  return "";
}

/// The M = 2, n = 3 case: anchor a = (0, 0, 0), v0 = (1, 2, 3), trained v1 = (2, 2, 1),
/// lambda_a = 0.5, lambda_d = 0.25.
soup_pool two_member_pool() {
  soup_pool p({.pool_size = 2, .affinity = 0.5f, .diversity = 0.25f, .first_steps = 0}, 3);
  p.start_round(0, std::vector<float>{0, 0, 0});
  REQUIRE(p.maybe_add_member(0));  // first_steps 0: the second member joins at step 0
  set(p.member(0), {1, 2, 3});
  set(p.member(1), {2, 2, 1});
  return p;
}

}  // namespace

TEST_CASE("soup_pool holds (M + 1) x n floats from construction") {
  // M = 3 members and the anchor over n = 5 floats: 4 x 5 x 4 = 80 bytes.
  CHECK(soup_pool({.pool_size = 3}, 5).held_bytes() == 80);
  // M = 1: 2 x 7 x 4 = 56 bytes.
  CHECK(soup_pool({.pool_size = 1}, 7).held_bytes() == 56);
  // M = 16, n = 1000: 17 x 1000 x 4 = 68000 bytes.
  CHECK(soup_pool({.pool_size = 16}, 1000).held_bytes() == 68000);
}

TEST_CASE("soup_config refuses bad settings, saying what it expected and found") {
  CHECK(message_of({.pool_size = 0}).find("pool_size must be in [1, 16], found 0") !=
        std::string::npos);
  CHECK(message_of({.pool_size = 17}).find("found 17") != std::string::npos);
  CHECK(message_of({.affinity = -1.0f}).find("affinity must be finite and >= 0, found -1") !=
        std::string::npos);
  CHECK(message_of({.diversity = NAN}).find("diversity must be finite and >= 0") !=
        std::string::npos);
  CHECK(message_of({.first_steps = -1}).find("first_steps must be >= 0, found -1") !=
        std::string::npos);
  CHECK(message_of({.add_every = 0}).find("add_every must be >= 1, found 0") != std::string::npos);
  CHECK(message_of({}).empty());
}

TEST_CASE("soup_pool refuses calls before start_round and mismatched sizes") {
  soup_pool p({.pool_size = 2}, 3);
  CHECK_THROWS_AS(p.weights(0), fedshard::invalid_argument);
  CHECK_THROWS_AS(p.maybe_add_member(0), fedshard::invalid_argument);
  std::vector<float> out(3);
  CHECK_THROWS_WITH_AS(p.average(out), doctest::Contains("call start_round first"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(p.start_round(0, std::vector<float>(4)),
                       doctest::Contains("must have 3 elements (the shard size), found 4"),
                       fedshard::invalid_argument);
  p.start_round(0, std::vector<float>(3));
  CHECK_THROWS_WITH_AS(p.interpolate(std::vector<float>{0.5f, 0.5f}, out),
                       doctest::Contains("expected one weight per member (1), found 2"),
                       fedshard::invalid_argument);
  std::vector<double> d(2);
  CHECK_THROWS_WITH_AS(p.shard_distances(d), doctest::Contains("must have 1 entries"),
                       fedshard::invalid_argument);
  CHECK_THROWS_AS(p.resume(0, 3), fedshard::invalid_argument);
}

TEST_CASE("one member without regularisers is the base algorithm, bit for bit") {
  soup_pool p({.pool_size = 1, .affinity = 0.0f, .diversity = 0.0f, .first_steps = 2}, 5);
  const std::vector<float> master{0.1f, -0.0f, 3.5e-8f, -7.25f, 1e30f};
  p.start_round(3, master);
  std::vector<float> out(5);
  for (std::int64_t step = 0; step < 20; ++step) {
    CHECK_FALSE(p.maybe_add_member(step));
    const std::vector<float> w = p.weights(step);
    REQUIRE(w.size() == 1);
    CHECK(w[0] == 1.0f);
    p.interpolate(w, out);
    CHECK(same_bits(out, master));
    CHECK_FALSE(p.needs_distances());
    // A gradient with a -0, a subnormal and a large value keeps its bits.
    std::vector<float> grad{-0.0f, 1e-40f, -3.75f, 0.3f, 6e37f};
    const std::vector<float> before = grad;
    p.add_regularizer_gradients(w, p.regularizer({}), grad);
    CHECK(same_bits(grad, before));
  }
  CHECK(p.members() == 1);
  CHECK(p.trained_member().data() == p.member(0).data());
  p.average(out);
  CHECK(same_bits(out, master));
}

TEST_CASE("regulariser gradients equal their closed forms: M = 2, n = 3") {
  soup_pool p = two_member_pool();
  // D_01 = ||v0 - v1||^2 = (1-2)^2 + (2-2)^2 + (3-1)^2 = 5; ||v1 - a||^2 = 4 + 4 + 1 = 9.
  std::vector<double> d(p.distance_count());
  REQUIRE(d.size() == 2);
  p.shard_distances(d);
  CHECK(d == std::vector<double>{5.0, 9.0});
  CHECK(p.needs_distances());
  const auto reg = p.regularizer(d);
  // Two members: the Cayley-Menger matrix [[0,5,1],[5,0,1],[1,1,0]] has det 10, the norm
  // 0!^2 2^1 = 2, so vol = 5 = D_01. Losses: lambda_a 9 = 4.5, -lambda_d vol = -1.25.
  CHECK(reg.volume == doctest::Approx(5.0));
  CHECK(reg.affinity_loss == doctest::Approx(4.5));
  CHECK(reg.diversity_loss == doctest::Approx(-1.25));
  // d/dv1 of -lambda_d ||v1 - v0||^2 = -2 lambda_d (v1 - v0) = -0.5 (v1 - v0): coef[0] = -0.5.
  CHECK(reg.affinity_coef == 1.0f);
  CHECK(reg.coef[0] == doctest::Approx(-0.5));
  CHECK(reg.coef[1] == 0.0f);
  // w = (0.25, 0.75), gradient at the interpolated point g = (4, -8, 2):
  //   w1 g                            = (3, -6, 1.5)
  //   + 2 lambda_a (v1 - a) = (2,2,1) = (5, -4, 2.5)
  //   - 0.5 (v1 - v0) = -0.5 (1,0,-2) = (4.5, -4, 3.5)
  std::vector<float> grad{4, -8, 2};
  p.add_regularizer_gradients(std::vector<float>{0.25f, 0.75f}, reg, grad);
  CHECK(grad == std::vector<float>{4.5f, -4.0f, 3.5f});
}

TEST_CASE("sharded: the shards' distances sum to the whole's, the gradients are its slices") {
  // The M = 2 case split into elements {0, 1} and {2}: shard A has v0 = (1, 2), v1 = (2, 2),
  // a = (0, 0): D_01 = 1, ||v1 - a||^2 = 8; shard B has v0 = 3, v1 = 1, a = 0: D_01 = 4,
  // ||v1 - a||^2 = 1. Sums: (5, 9), the whole's.
  const soup_config cfg{.pool_size = 2, .affinity = 0.5f, .diversity = 0.25f, .first_steps = 0};
  soup_pool a(cfg, 2), b(cfg, 1);
  a.start_round(0, std::vector<float>{0, 0});
  b.start_round(0, std::vector<float>{0});
  a.maybe_add_member(0);
  b.maybe_add_member(0);
  set(a.member(0), {1, 2});
  set(a.member(1), {2, 2});
  set(b.member(0), {3});
  set(b.member(1), {1});
  std::vector<double> da(2), db(2);
  a.shard_distances(da);
  b.shard_distances(db);
  CHECK(da == std::vector<double>{1.0, 8.0});
  CHECK(db == std::vector<double>{4.0, 1.0});
  const std::vector<double> sum{da[0] + db[0], da[1] + db[1]};
  const std::vector<float> w{0.25f, 0.75f};
  std::vector<float> ga{4, -8}, gb{2};
  a.add_regularizer_gradients(w, a.regularizer(sum), ga);
  b.add_regularizer_gradients(w, b.regularizer(sum), gb);
  // The whole's gradient (previous case) is (4.5, -4, 3.5).
  CHECK(ga == std::vector<float>{4.5f, -4.0f});
  CHECK(gb == std::vector<float>{3.5f});
}

TEST_CASE("diversity gradient with three members: the triangle's squared area") {
  // n = 2: v0 = (0, 0), v1 = (4, 0), trained v2 = (x, y) = (0, 3), lambda_d = 0.5,
  // lambda_a = 0. The squared area is A^2 = (4 |y| / 2)^2 = 4 y^2 = 36; its gradient in v2 is
  // (0, 8 y) = (0, 24), so the diversity term -lambda_d A^2 adds (0, -12).
  soup_pool p({.pool_size = 3, .affinity = 0.0f, .diversity = 0.5f, .first_steps = 0}, 2);
  p.start_round(0, std::vector<float>{0, 0});
  p.maybe_add_member(1);
  REQUIRE(p.members() == 3);
  set(p.member(1), {4, 0});
  set(p.member(2), {0, 3});
  std::vector<double> d(4);
  p.shard_distances(d);
  // Pairs (0,1), (0,2), (1,2): 16, 9, 16 + 9 = 25; ||v2 - a||^2 = 9.
  CHECK(d == std::vector<double>{16.0, 9.0, 25.0, 9.0});
  const auto reg = p.regularizer(d);
  CHECK(reg.volume == doctest::Approx(36.0));
  CHECK(reg.diversity_loss == doctest::Approx(-18.0));
  CHECK(reg.affinity_loss == 0.0);
  // Cofactors of CM = [[0,16,9,1],[16,0,25,1],[9,25,0,1],[1,1,1,0]] (det -576 = -16 A^2):
  // C_20 = det[[16,9,1],[0,25,1],[1,1,0]] = -16 + 9 - 25 = -32,
  // C_21 = -det[[0,9,1],[16,25,1],[1,1,0]] = -(9 - 9) = 0. coef[j] = -lambda_d 4 sign C_2j
  // / (2!^2 2^2) = C_2j / 8: coef = (-4, 0); -4 (v2 - v0) = (0, -12), as above.
  CHECK(reg.coef[0] == doctest::Approx(-4.0));
  CHECK(std::fabs(reg.coef[1]) < 1e-6f);
  std::vector<float> grad{0, 0};
  p.add_regularizer_gradients(std::vector<float>{0.25f, 0.25f, 0.5f}, reg, grad);
  CHECK(std::fabs(grad[0]) < 1e-5f);
  CHECK(grad[1] == doctest::Approx(-12.0f));
}

TEST_CASE("a member that just joined spans no volume: affinity gradient only") {
  // a = (1, 2, 3); member 0 trained to (3, 2, 1); member 1 joins as their mean (3, 2, 1):
  // D_01 = 0, so det CM = 0 and the diversity gradient is 0 (torch's abs has sign(0) = 0);
  // ||v1 - a||^2 = 4 + 0 + 4 = 8, affinity loss 0.5 x 8 = 4.
  soup_pool p({.pool_size = 2, .affinity = 0.5f, .diversity = 0.25f, .first_steps = 3}, 3);
  p.start_round(0, std::vector<float>{1, 2, 3});
  CHECK_FALSE(p.maybe_add_member(2));
  set(p.member(0), {3, 2, 1});
  CHECK(p.maybe_add_member(3));
  CHECK(to_vector(p.member(1)) == std::vector<float>{3, 2, 1});
  std::vector<double> d(2);
  p.shard_distances(d);
  const auto reg = p.regularizer(d);
  CHECK(reg.volume == 0.0);
  CHECK(reg.affinity_loss == 4.0);
  CHECK(reg.coef == std::vector<float>{0.0f, 0.0f});
  // 0.5 (2, 4, 6) + 1.0 ((3, 2, 1) - (1, 2, 3)) = (1, 2, 3) + (2, 0, -2) = (3, 2, 1).
  std::vector<float> grad{2, 4, 6};
  p.add_regularizer_gradients(std::vector<float>{0.5f, 0.5f}, reg, grad);
  CHECK(grad == std::vector<float>{3, 2, 1});
}

TEST_CASE("members join on the schedule as the mean of the pool, up to M") {
  // M = 3, first_steps 4, add_every 2: one member for steps 0-3, two from step 4, three from
  // step 6 on.
  soup_pool p({.pool_size = 3, .first_steps = 4, .add_every = 2}, 2);
  p.start_round(0, std::vector<float>{2, 4});
  CHECK(p.scheduled_members(3) == 1);
  CHECK(p.scheduled_members(4) == 2);
  CHECK(p.scheduled_members(5) == 2);
  CHECK(p.scheduled_members(6) == 3);
  CHECK(p.scheduled_members(1000) == 3);
  for (std::int64_t s = 0; s < 4; ++s) CHECK_FALSE(p.maybe_add_member(s));
  set(p.member(0), {1, 3});
  CHECK(p.maybe_add_member(4));  // member 1 = mean of {(1, 3)} = (1, 3)
  CHECK(to_vector(p.member(1)) == std::vector<float>{1, 3});
  CHECK(p.trained_member().data() == p.member(1).data());
  set(p.member(1), {5, 8});
  CHECK_FALSE(p.maybe_add_member(5));
  CHECK(p.maybe_add_member(6));  // member 2 = ((1 + 5) / 2, (3 + 8) / 2) = (3, 5.5)
  CHECK(to_vector(p.member(2)) == std::vector<float>{3, 5.5f});
  for (std::int64_t s = 7; s < 12; ++s) CHECK_FALSE(p.maybe_add_member(s));
  CHECK(p.members() == 3);
  CHECK(to_vector(p.anchor()) == std::vector<float>{2, 4});
  // A new round starts from one member again.
  p.start_round(1, std::vector<float>{7, 7});
  CHECK(p.members() == 1);
  // Jumping to step 6 adds both: member 1 = (7, 7), member 2 = mean((7,7), (7,7)) = (7, 7).
  CHECK(p.maybe_add_member(6));
  CHECK(p.members() == 3);
  CHECK(to_vector(p.member(2)) == std::vector<float>{7, 7});
}

TEST_CASE("interpolate and average on a hand-set pool") {
  soup_pool p({.pool_size = 3, .first_steps = 0}, 2);
  p.start_round(0, std::vector<float>{0, 0});
  p.maybe_add_member(1);
  set(p.member(0), {1, 2});
  set(p.member(1), {3, 4});
  set(p.member(2), {5, 9});
  std::vector<float> out(2);
  // 0.5 (1, 2) + 0.25 (3, 4) + 0.25 (5, 9) = (0.5 + 0.75 + 1.25, 1 + 1 + 2.25) = (2.5, 4.25).
  p.interpolate(std::vector<float>{0.5f, 0.25f, 0.25f}, out);
  CHECK(out == std::vector<float>{2.5f, 4.25f});
  // (1 + 3 + 5) / 3 = 3, (2 + 4 + 9) / 3 = 5.
  p.average(out);
  CHECK(out == std::vector<float>{3, 5});
}

TEST_CASE("weights: seeded, the same on every pool with the seed, uniform on the simplex") {
  const soup_config cfg{.pool_size = 4, .first_steps = 0, .seed = 42};
  soup_config other = cfg;
  other.seed = 43;
  soup_pool a(cfg, 1), b(cfg, 1), c(other, 1);
  for (soup_pool* p : {&a, &b, &c}) {
    p->start_round(5, std::vector<float>{0});
    p->maybe_add_member(2);
    REQUIRE(p->members() == 4);
  }
  int differs_by_seed = 0, differs_by_step = 0;
  for (std::int64_t s = 0; s < 50; ++s) {
    const std::vector<float> w = a.weights(s);
    CHECK(w == b.weights(s));
    differs_by_seed += w != c.weights(s);
    differs_by_step += w != a.weights(s + 1);
    CHECK(w != a.weights(s, 1));  // another draw of the same step
    double sum = 0;
    for (float x : w) {
      CHECK(x >= 0.0f);
      CHECK(x <= 1.0f);
      sum += x;
    }
    CHECK(sum == doctest::Approx(1.0).epsilon(1e-6));
  }
  CHECK(differs_by_seed == 50);
  CHECK(differs_by_step == 50);
  // The round keys the weights too.
  const std::vector<float> w5 = a.weights(0);
  a.start_round(6, std::vector<float>{0});
  a.maybe_add_member(2);
  CHECK(a.weights(0) != w5);
  // Dirichlet(1, 1, 1, 1): E[w_i] = 1/4, E[w_i^2] = 2 / (4 x 5) = 0.1. Over 20000 draws the
  // means' standard errors are below 0.0014 and 0.0011; allow 0.01.
  double m[4] = {}, m2[4] = {};
  const int draws = 20000;
  for (int s = 0; s < draws; ++s) {
    const std::vector<float> w = a.weights(s);
    for (int i = 0; i < 4; ++i) {
      m[i] += w[i] / draws;
      m2[i] += double(w[i]) * w[i] / draws;
    }
  }
  for (int i = 0; i < 4; ++i) {
    CHECK(std::fabs(m[i] - 0.25) < 0.01);
    CHECK(std::fabs(m2[i] - 0.1) < 0.01);
  }
}

TEST_CASE("diversity gradient with four members: the tetrahedron's squared volume") {
  // n = 3: v0 = 0, v1 = (1, 0, 0), v2 = (0, 2, 0), trained v3 = (x, y, z) = (0.5, 0.5, 3).
  // V = |det[v1; v2; v3]| / 6 = |1 (2 z - 0 y)| / 6 = z / 3 = 1, so vol = V^2 = z^2 / 9 = 1
  // (the Cayley-Menger norm is 3!^2 2^3 = 288); its gradient in v3 is (0, 0, 2 z / 9) =
  // (0, 0, 2/3), and -lambda_d vol with lambda_d = 0.75 adds (0, 0, -0.5).
  soup_pool p({.pool_size = 4, .affinity = 0.0f, .diversity = 0.75f, .first_steps = 0}, 3);
  p.start_round(0, std::vector<float>{0, 0, 0});
  p.maybe_add_member(2);
  REQUIRE(p.members() == 4);
  set(p.member(1), {1, 0, 0});
  set(p.member(2), {0, 2, 0});
  set(p.member(3), {0.5f, 0.5f, 3});
  std::vector<double> d(p.distance_count());
  REQUIRE(d.size() == 7);
  p.shard_distances(d);
  const auto reg = p.regularizer(d);
  CHECK(reg.volume == doctest::Approx(1.0));
  CHECK(reg.diversity_loss == doctest::Approx(-0.75));
  std::vector<float> grad{0, 0, 0};
  p.add_regularizer_gradients(std::vector<float>{0, 0, 0, 1}, reg, grad);
  CHECK(std::fabs(grad[0]) < 1e-5f);
  CHECK(std::fabs(grad[1]) < 1e-5f);
  CHECK(grad[2] == doctest::Approx(-0.5f));
}
