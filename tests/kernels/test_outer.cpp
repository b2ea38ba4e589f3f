#include "fedshard/kernels/outer.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "fedshard/kernels/sgd.hpp"

namespace {

namespace kernels = fedshard::kernels;

/// The value rounded to a float and stored, so no later operation can fuse with the op
/// that produced it.
float rounded(float x) {
  const volatile float v = x;
  return v;
}

bool same_bits(float a, float b) {
  return std::memcmp(&a, &b, sizeof(float)) == 0;
}

bool bitwise_equal(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// The op order of kernels/outer.hpp's file comment, written out with plain float operations.

float reference_sgd(float theta, float d, float lr) {
  return std::fma(d, -lr, theta);
}

void reference_nesterov(float& theta, float d, float& m, float lr, float mu) {
  m = rounded(rounded(m * mu) + d);
  const float u = std::fma(m, mu, d);
  theta = std::fma(u, -lr, theta);
}

void reference_fedmom(float& theta, float d, float& m, float lr, float mu) {
  m = rounded(rounded(m * mu) + d);
  theta = std::fma(m, -lr, theta);
}

void reference_adaptive(bool yogi, float& theta, float d, float& m, float& v, float lr, float beta1,
                        float beta2, float tau) {
  const float c1 = rounded(1.0f - beta1);
  const float c2 = rounded(1.0f - beta2);
  m = std::fma(d, c1, rounded(m * beta1));
  const float d2 = rounded(d * d);
  if (yogi) {
    const float t = rounded(c2 * d2);
    if (v > d2) {
      v = rounded(v - t);
    } else if (v < d2) {
      v = rounded(v + t);
    }
  } else {
    v = std::fma(d2, c2, rounded(v * beta2));
  }
  const float q = rounded(rounded(std::sqrt(v)) + tau);
  theta = std::fma(rounded(m / q), -lr, theta);
}

/// Values over many orders of magnitude, of both signs.
std::vector<float> random_vector(std::size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> exponent(-5.0f, 3.0f);
  std::vector<float> out(n);
  for (float& x : out) x = normal(rng) * std::pow(10.0f, exponent(rng));
  return out;
}

std::vector<float> random_nonnegative(std::size_t n, std::mt19937& rng) {
  std::vector<float> out = random_vector(n, rng);
  for (float& x : out) x = std::fabs(x);
  return out;
}

TEST_CASE("the scalars: -lr, and 1 - beta rounded once to float") {
  CHECK(kernels::make_outer_sgd_scalars(0.7f).neg_lr == -0.7f);
  const auto m = kernels::make_outer_momentum_scalars(0.7f, 0.9f);
  CHECK(m.neg_lr == -0.7f);
  CHECK(m.momentum == 0.9f);
  for (const float beta : {0.0f, 1e-3f, 0.3f, 0.9f, 0.99f, 0.999f}) {
    CAPTURE(beta);
    const auto s = kernels::make_outer_adaptive_scalars(1e-2f, beta, beta, 1e-3f);
    // 1 - beta is exact in double for these betas, so one rounding to float is the result.
    const float expected = static_cast<float>(1.0 - static_cast<double>(beta));
    CHECK(same_bits(s.one_minus_beta1, expected));
    CHECK(same_bits(s.one_minus_beta2, expected));
    CHECK(s.beta1 == beta);
    CHECK(s.beta2 == beta);
    CHECK(s.neg_lr == -1e-2f);
    CHECK(s.tau == 1e-3f);
  }
}

TEST_CASE("each functor follows the documented op order bit for bit") {
  std::mt19937 rng(11);
  const std::size_t n = 4000;
  const std::vector<float> theta = random_vector(n, rng);
  const std::vector<float> d = random_vector(n, rng);
  const std::vector<float> m = random_vector(n, rng);
  const std::vector<float> v = random_nonnegative(n, rng);
  const float lr = 0.37f, mu = 0.85f, beta1 = 0.8f, beta2 = 0.995f, tau = 3e-4f;

  const kernels::outer_sgd_update sgd{kernels::make_outer_sgd_scalars(lr)};
  const kernels::outer_nesterov_update nest{kernels::make_outer_momentum_scalars(lr, mu)};
  const kernels::outer_fedmom_update mom{kernels::make_outer_momentum_scalars(lr, mu)};
  const auto adaptive = kernels::make_outer_adaptive_scalars(lr, beta1, beta2, tau);
  const kernels::outer_fedadam_update adam{adaptive};
  const kernels::outer_fedyogi_update yogi{adaptive};

  std::size_t yogi_down = 0, yogi_up = 0;
  for (std::size_t i = 0; i < n; ++i) {
    CAPTURE(i);
    float t = theta[i];
    sgd(t, d[i]);
    CHECK(same_bits(t, reference_sgd(theta[i], d[i], lr)));

    float t1 = theta[i], m1 = m[i], t2 = theta[i], m2 = m[i];
    nest(t1, d[i], m1);
    reference_nesterov(t2, d[i], m2, lr, mu);
    CHECK(same_bits(t1, t2));
    CHECK(same_bits(m1, m2));

    t1 = theta[i], m1 = m[i], t2 = theta[i], m2 = m[i];
    mom(t1, d[i], m1);
    reference_fedmom(t2, d[i], m2, lr, mu);
    CHECK(same_bits(t1, t2));
    CHECK(same_bits(m1, m2));

    for (const bool is_yogi : {false, true}) {
      float ta = theta[i], ma = m[i], va = v[i];
      float tb = theta[i], mb = m[i], vb = v[i];
      if (is_yogi) {
        yogi(ta, d[i], ma, va);
      } else {
        adam(ta, d[i], ma, va);
      }
      reference_adaptive(is_yogi, tb, d[i], mb, vb, lr, beta1, beta2, tau);
      CHECK(same_bits(ta, tb));
      CHECK(same_bits(ma, mb));
      CHECK(same_bits(va, vb));
      CHECK(va >= 0.0f);
      if (is_yogi) (va < v[i] ? yogi_down : yogi_up) += 1;
    }
  }
  // Both branches of sign(v - d²) were exercised.
  CHECK(yogi_down > n / 10);
  CHECK(yogi_up > n / 10);
}

TEST_CASE("the host loops apply the functor to every element") {
  for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{17}, std::size_t{1000}}) {
    CAPTURE(n);
    std::mt19937 rng(static_cast<unsigned>(n + 5));
    const std::vector<float> theta0 = random_vector(n, rng);
    const std::vector<float> d = random_vector(n, rng);
    const std::vector<float> m0 = random_vector(n, rng);
    const std::vector<float> v0 = random_nonnegative(n, rng);

    const auto ss = kernels::make_outer_sgd_scalars(0.5f);
    const auto ms = kernels::make_outer_momentum_scalars(0.7f, 0.9f);
    const auto as = kernels::make_outer_adaptive_scalars(1e-2f, 0.9f, 0.99f, 1e-3f);

    std::vector<float> theta = theta0, expected = theta0;
    kernels::outer_sgd_step(theta, d, ss);
    for (std::size_t i = 0; i < n; ++i) kernels::outer_sgd_update{ss}(expected[i], d[i]);
    CHECK(bitwise_equal(theta, expected));

    std::vector<float> m = m0, em = m0;
    theta = theta0, expected = theta0;
    kernels::outer_nesterov_step(theta, d, m, ms);
    for (std::size_t i = 0; i < n; ++i)
      kernels::outer_nesterov_update{ms}(expected[i], d[i], em[i]);
    CHECK(bitwise_equal(theta, expected));
    CHECK(bitwise_equal(m, em));

    m = m0, em = m0, theta = theta0, expected = theta0;
    kernels::outer_fedmom_step(theta, d, m, ms);
    for (std::size_t i = 0; i < n; ++i) kernels::outer_fedmom_update{ms}(expected[i], d[i], em[i]);
    CHECK(bitwise_equal(theta, expected));
    CHECK(bitwise_equal(m, em));

    std::vector<float> v = v0, ev = v0;
    m = m0, em = m0, theta = theta0, expected = theta0;
    kernels::outer_fedadam_step(theta, d, m, v, as);
    for (std::size_t i = 0; i < n; ++i)
      kernels::outer_fedadam_update{as}(expected[i], d[i], em[i], ev[i]);
    CHECK(bitwise_equal(theta, expected));
    CHECK(bitwise_equal(m, em));
    CHECK(bitwise_equal(v, ev));

    v = v0, ev = v0, m = m0, em = m0, theta = theta0, expected = theta0;
    kernels::outer_fedyogi_step(theta, d, m, v, as);
    for (std::size_t i = 0; i < n; ++i)
      kernels::outer_fedyogi_update{as}(expected[i], d[i], em[i], ev[i]);
    CHECK(bitwise_equal(theta, expected));
    CHECK(bitwise_equal(m, em));
    CHECK(bitwise_equal(v, ev));
  }
}

TEST_CASE("outer SGD with lr 1 is one rounded subtraction, also when d is the anchor itself") {
  std::mt19937 rng(2);
  const std::vector<float> theta0 = random_vector(1000, rng);
  const std::vector<float> d = random_vector(1000, rng);
  std::vector<float> theta = theta0;
  kernels::outer_sgd_step(theta, d, kernels::make_outer_sgd_scalars(1.0f));
  for (std::size_t i = 0; i < theta.size(); ++i) CHECK(same_bits(theta[i], theta0[i] - d[i]));

  // d aliasing the anchor: every element becomes exactly 0.
  kernels::outer_sgd_step(theta, theta, kernels::make_outer_sgd_scalars(1.0f));
  for (const float x : theta) CHECK(x == 0.0f);
}

TEST_CASE("nesterov and fedmom round as torch SGD's later steps (kernels/sgd.hpp)") {
  std::mt19937 rng(9);
  const std::size_t n = 2000;
  const std::vector<float> theta = random_vector(n, rng);
  const std::vector<float> d = random_vector(n, rng);
  const std::vector<float> m = random_vector(n, rng);
  for (const bool is_nesterov : {false, true}) {
    CAPTURE(is_nesterov);
    const kernels::sgd_update torch_sgd{
        kernels::make_sgd_scalars(0.7, 0.9, 0.0, 0.0, is_nesterov, /*first_step=*/false)};
    const auto s = kernels::make_outer_momentum_scalars(0.7f, 0.9f);
    for (std::size_t i = 0; i < n; ++i) {
      float t1 = theta[i], m1 = m[i], t2 = theta[i], m2 = m[i];
      if (is_nesterov) {
        kernels::outer_nesterov_update{s}(t1, d[i], m1);
      } else {
        kernels::outer_fedmom_update{s}(t1, d[i], m1);
      }
      torch_sgd(t2, d[i], m2);
      CHECK(same_bits(t1, t2));
      CHECK(same_bits(m1, m2));
    }
  }
}

TEST_CASE("the SGD-family functors keep the op order also on zeros, infinities, subnormals") {
  // outer_sgd_update, outer_nesterov_update and outer_fedmom_update hand their scalars to
  // sgd_update; on every combination of these values the result is the op order written
  // out above, bit for bit, signs of zero included. A NaN is compared as NaN: which NaN
  // comes out where two meet (m·μ and d) is left open by IEEE 754.
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float sub = std::numeric_limits<float>::denorm_min();
  const float big = std::numeric_limits<float>::max();
  const std::vector<float> values{0.0f, -0.0f, 1.0f, -1.5f, inf, -inf, nan, sub, -sub, big};
  auto same = [](float a, float b) { return same_bits(a, b) || (std::isnan(a) && std::isnan(b)); };
  std::size_t compared = 0, signed_zeros = 0;
  for (const float lr : {0.0f, 0.7f, 1.0f})
    for (const float mu : {0.0f, 0.9f})
      for (const float theta : values)
        for (const float d : values)
          for (const float m : values) {
            const kernels::outer_sgd_update sgd{kernels::make_outer_sgd_scalars(lr)};
            const auto ms = kernels::make_outer_momentum_scalars(lr, mu);
            float t = theta;
            sgd(t, d);
            bool ok = same(t, reference_sgd(theta, d, lr));
            float t1 = theta, m1 = m, t2 = theta, m2 = m;
            kernels::outer_nesterov_update{ms}(t1, d, m1);
            reference_nesterov(t2, d, m2, lr, mu);
            ok = ok && same(t1, t2) && same(m1, m2);
            signed_zeros += t1 == 0.0f && std::signbit(t1);
            t1 = theta, m1 = m, t2 = theta, m2 = m;
            kernels::outer_fedmom_update{ms}(t1, d, m1);
            reference_fedmom(t2, d, m2, lr, mu);
            ok = ok && same(t1, t2) && same(m1, m2);
            if (!ok) {
              CAPTURE(lr);
              CAPTURE(mu);
              CAPTURE(theta);
              CAPTURE(d);
              CAPTURE(m);
              CHECK(ok);
            }
            ++compared;
          }
  CHECK(compared == 3 * 2 * 10 * 10 * 10);
  CHECK(signed_zeros > 0);  // -0 results were among those compared
}

TEST_CASE("fedyogi keeps v when v == d² and when d is NaN, and never makes v negative") {
  const auto s = kernels::make_outer_adaptive_scalars(1e-2f, 0.9f, 0.99f, 1e-3f);
  const kernels::outer_fedyogi_update yogi{s};

  float theta = 1.0f, m = 0.0f, v = 0.25f;
  yogi(theta, 0.5f, m, v);  // d² = 0.25 == v
  CHECK(v == 0.25f);
  CHECK(m == rounded(0.5f * s.one_minus_beta1));
  CHECK(theta < 1.0f);

  float nan_theta = 1.0f, nan_m = 0.0f, nan_v = 2.0f;
  yogi(nan_theta, std::numeric_limits<float>::quiet_NaN(), nan_m, nan_v);
  CHECK(nan_v == 2.0f);
  CHECK(std::isnan(nan_m));
  CHECK(std::isnan(nan_theta));

  // beta2 = 0 subtracts all of d² when v > d², which leaves v - d² > 0.
  const kernels::outer_fedyogi_update hard{
      kernels::make_outer_adaptive_scalars(1e-2f, 0.9f, 0.0f, 1e-3f)};
  float t = 0.0f, mm = 0.0f, vv = std::nextafter(1.0f, 2.0f);
  hard(t, 1.0f, mm, vv);
  CHECK(vv == std::nextafter(1.0f, 2.0f) - 1.0f);
  CHECK(vv > 0.0f);
}

}  // namespace
