#include "fedshard/optim/sgd.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "fedshard/error.hpp"

namespace {

using fedshard::optim::sgd;

/// The value rounded to a float and stored, so no later operation can fuse with the op
/// that produced it.
float rounded(float x) {
  const volatile float v = x;
  return v;
}

/// torch's _single_tensor_sgd on float32 tensors, element by element, written from its
/// Python source: the scalars are doubles turned into floats when they enter a kernel;
/// `add(other, alpha)` is one fused multiply-add, as in torch's vectorised CPU kernels.
struct reference_sgd {
  double momentum, dampening, weight_decay;
  bool nesterov;
  std::vector<float> buf;
  bool has_buf = false;

  void step(std::vector<float>& param, const std::vector<float>& grad, double lr) {
    if (momentum != 0 && !has_buf) buf.assign(param.size(), 0.0f);
    for (std::size_t i = 0; i < param.size(); ++i) {
      float g = grad[i];
      if (weight_decay != 0)  // grad = grad.add(param, alpha=weight_decay)
        g = std::fma(param[i], static_cast<float>(weight_decay), g);
      if (momentum != 0) {
        if (!has_buf) {  // buf = grad.detach().clone()
          buf[i] = g;
        } else {  // buf.mul_(momentum).add_(grad, alpha=1 - dampening)
          const float decayed = rounded(buf[i] * static_cast<float>(momentum));
          buf[i] = std::fma(g, static_cast<float>(1.0 - dampening), decayed);
        }
        g = nesterov ? std::fma(buf[i], static_cast<float>(momentum), g) : buf[i];
      }
      param[i] = std::fma(g, static_cast<float>(-lr), param[i]);  // param.add_(grad, alpha=-lr)
    }
    if (momentum != 0) has_buf = true;
  }
};

std::vector<float> random_vector(std::size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> exponent(-4.0f, 2.0f);
  std::vector<float> v(n);
  for (float& x : v) x = scale * normal(rng) * std::pow(10.0f, exponent(rng));
  return v;
}

/// max |a - b| / |b| over the elements (0 where both are 0).
double max_relative_difference(std::span<const float> a, std::span<const float> b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
    if (d != 0) worst = std::max(worst, d / std::fabs(static_cast<double>(b[i])));
  }
  return worst;
}

bool bitwise_equal(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

/// A learning rate that changes every step, as a schedule would give it.
float lr_at(int step) {
  return 0.05f / static_cast<float>(1 + step % 7);
}

}  // namespace

TEST_CASE("sgd matches torch's update formulas over 100 steps for every option combination") {
  for (const std::size_t n :
       {std::size_t{0}, std::size_t{1}, std::size_t{2}, std::size_t{17}, std::size_t{1009}}) {
    for (const float momentum : {0.0f, 0.9f}) {
      for (const float dampening : {0.0f, 0.1f}) {
        for (const float weight_decay : {0.0f, 0.01f}) {
          for (const bool nesterov : {false, true}) {
            if (nesterov && (momentum == 0.0f || dampening != 0.0f)) continue;
            CAPTURE(n);
            CAPTURE(momentum);
            CAPTURE(dampening);
            CAPTURE(weight_decay);
            CAPTURE(nesterov);
            std::mt19937 rng(static_cast<unsigned>(n * 31 + 7));
            std::vector<float> param = random_vector(n, rng, 1.0f);
            std::vector<float> expected = param;
            sgd opt({.lr = 0.05f,
                     .momentum = momentum,
                     .dampening = dampening,
                     .weight_decay = weight_decay,
                     .nesterov = nesterov},
                    n);
            reference_sgd ref{momentum, dampening, weight_decay, nesterov, {}};
            for (int step = 0; step < 100; ++step) {
              const std::vector<float> grad = random_vector(n, rng, 1.0f);
              opt.step(param, grad, lr_at(step));
              ref.step(expected, grad, lr_at(step));
            }
            CHECK(opt.step_count() == 100);
            CHECK(max_relative_difference(param, expected) <= 1e-7);
            CHECK(bitwise_equal(param, expected));
            if (momentum != 0.0f) {
              const auto state = opt.state();
              REQUIRE(state.size() == 1);
              CHECK(max_relative_difference(state[0].data, ref.buf) <= 1e-7);
              CHECK(bitwise_equal(state[0].data, ref.buf));
            }
          }
        }
      }
    }
  }
}

TEST_CASE("sgd state: a momentum buffer of n elements only when momentum != 0") {
  sgd plain({.lr = 0.1f}, 5);
  CHECK(plain.state().empty());
  CHECK(plain.size() == 5);

  sgd heavy({.lr = 0.1f, .momentum = 0.9f}, 5);
  const auto state = heavy.state();
  REQUIRE(state.size() == 1);
  CHECK(state[0].name == "momentum_buffer");
  CHECK(state[0].data.size() == 5);
  CHECK(std::all_of(state[0].data.begin(), state[0].data.end(), [](float x) { return x == 0; }));
  CHECK(heavy.settings().momentum == 0.9f);
}

TEST_CASE("sgd's first step sets the momentum buffer to the decayed gradient, as torch does") {
  sgd opt({.lr = 0.5f, .momentum = 0.9f, .dampening = 0.5f, .weight_decay = 0.25f}, 2);
  std::vector<float> param{1.0f, -2.0f};
  const std::vector<float> grad{4.0f, 8.0f};
  opt.step(param, grad, 0.5f);
  // g = grad + 0.25 * param; no dampening on the first step.
  const auto buf = opt.state()[0].data;
  CHECK(buf[0] == 4.25f);
  CHECK(buf[1] == 7.5f);
  CHECK(param[0] == 1.0f - 0.5f * 4.25f);
  CHECK(param[1] == -2.0f - 0.5f * 7.5f);
  CHECK(opt.step_count() == 1);

  // Step count 0 makes the next step a first step again (torch: no buffer yet).
  opt.set_step_count(0);
  const float before = param[0];
  opt.step(param, grad, 0.5f);
  CHECK(buf[0] == std::fma(before, 0.25f, 4.0f));
}

TEST_CASE("sgd resumed from its state and step count continues bit for bit") {
  const std::size_t n = 101;
  const sgd::config cfg{.lr = 0.1f, .momentum = 0.9f, .dampening = 0.1f, .weight_decay = 1e-3f};
  std::mt19937 rng(3);
  std::vector<float> param = random_vector(n, rng, 1.0f);
  sgd original(cfg, n);
  for (int step = 0; step < 10; ++step) original.step(param, random_vector(n, rng, 1.0f), 0.1f);

  std::vector<float> resumed_param = param;
  sgd resumed(cfg, n);
  const auto from = original.state();
  const auto to = resumed.state();
  std::copy(from[0].data.begin(), from[0].data.end(), to[0].data.begin());
  resumed.set_step_count(original.step_count());

  for (int step = 0; step < 10; ++step) {
    const std::vector<float> grad = random_vector(n, rng, 1.0f);
    original.step(param, grad, 0.05f);
    resumed.step(resumed_param, grad, 0.05f);
  }
  CHECK(bitwise_equal(param, resumed_param));
  CHECK(bitwise_equal(original.state()[0].data, resumed.state()[0].data));
  CHECK(resumed.step_count() == 20);
}

TEST_CASE("sgd rejects invalid configs with a message that names the value") {
  using fedshard::invalid_argument;
  CHECK_THROWS_WITH_AS(sgd({.lr = -0.5f}, 4),
                       doctest::Contains("config.lr must be >= 0, found -0.5"), invalid_argument);
  CHECK_THROWS_WITH_AS(sgd({.lr = std::nanf("")}, 4), doctest::Contains("config.lr"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(sgd({.momentum = -0.25f}, 4),
                       doctest::Contains("config.momentum must be >= 0, found -0.25"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(sgd({.weight_decay = -1.0f}, 4),
                       doctest::Contains("config.weight_decay must be >= 0, found -1"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(sgd({.dampening = INFINITY}, 4),
                       doctest::Contains("config.dampening must be a finite number, found inf"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(sgd({.momentum = 0.0f, .nesterov = true}, 4),
                       doctest::Contains("nesterov requires momentum > 0 and dampening == 0, "
                                         "found momentum 0 and dampening 0"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(sgd({.momentum = 0.9f, .dampening = 0.125f, .nesterov = true}, 4),
                       doctest::Contains("found momentum 0.9 and dampening 0.125"),
                       invalid_argument);
  CHECK_NOTHROW(sgd({.lr = 0.0f, .momentum = 0.9f, .nesterov = true}, 0));
}

TEST_CASE("sgd::step rejects spans of the wrong size and a negative lr, changing nothing") {
  sgd opt({.lr = 0.1f, .momentum = 0.9f}, 3);
  std::vector<float> param{1.0f, 2.0f, 3.0f};
  const std::vector<float> grad{1.0f, 1.0f, 1.0f};
  std::vector<float> long_param{1.0f, 2.0f, 3.0f, 4.0f};
  const std::vector<float> short_grad{1.0f, 1.0f};
  CHECK_THROWS_WITH_AS(opt.step(long_param, grad, 0.1f),
                       doctest::Contains("param must have 3 elements (the shard size), found 4"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(opt.step(param, short_grad, 0.1f),
                       doctest::Contains("grad must have 3 elements (the shard size), found 2"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(opt.step(param, grad, -0.125f),
                       doctest::Contains("lr must be >= 0, found -0.125"),
                       fedshard::invalid_argument);
  CHECK(param == std::vector<float>{1.0f, 2.0f, 3.0f});
  CHECK(opt.step_count() == 0);
  CHECK_THROWS_WITH_AS(opt.set_step_count(-2), doctest::Contains("found -2"),
                       fedshard::invalid_argument);
}

TEST_CASE("momentum_start::zero decays a zero buffer from the first step on, by hand") {
  using fedshard::optim::momentum_start;
  // lr 0.5, momentum 0.5, dampening 0.5, grad (4, -8), param (1, -2):
  //   torch's start: buf = g = (4, -8);                  param = (1 - 2, -2 + 4) = (-1, 2)
  //   zero start:    buf = 0.5 · 0 + 0.5 g = (2, -4);    param = (1 - 1, -2 + 2) = (0, 0)
  //   then, same grad: buf = 0.5 (2, -4) + 0.5 (4, -8) = (3, -6); param = (-1.5, 3)
  sgd torch_start({.lr = 0.5f, .momentum = 0.5f, .dampening = 0.5f}, 2);
  sgd zero_start({.lr = 0.5f, .momentum = 0.5f, .dampening = 0.5f, .start = momentum_start::zero},
                 2);
  std::vector<float> p1{1.0f, -2.0f}, p2 = p1;
  const std::vector<float> grad{4.0f, -8.0f};
  torch_start.step(p1, grad, 0.5f);
  zero_start.step(p2, grad, 0.5f);
  CHECK(p1 == std::vector<float>{-1.0f, 2.0f});
  CHECK(p2 == std::vector<float>{0.0f, 0.0f});
  const auto buf = zero_start.state()[0].data;
  CHECK(std::vector<float>(buf.begin(), buf.end()) == std::vector<float>{2.0f, -4.0f});
  zero_start.step(p2, grad, 0.5f);
  CHECK(std::vector<float>(buf.begin(), buf.end()) == std::vector<float>{3.0f, -6.0f});
  CHECK(p2 == std::vector<float>{-1.5f, 3.0f});
  // A step count of 0 (a restore) does not make the next step a first step.
  zero_start.set_step_count(0);
  zero_start.step(p2, grad, 0.0f);
  CHECK(std::vector<float>(buf.begin(), buf.end()) == std::vector<float>{3.5f, -7.0f});
}

TEST_CASE("momentum_start::zero keeps a buffer for momentum 0 and takes nesterov there") {
  using fedshard::optim::momentum_start;
  sgd plain({.lr = 1.0f, .momentum = 0.0f, .nesterov = true, .start = momentum_start::zero}, 3);
  const auto state = plain.state();
  REQUIRE(state.size() == 1);
  CHECK(state[0].name == "momentum_buffer");
  // buf = 0 · 0 + g = g; nesterov: g + 0 · buf = g; param = 0 - g.
  std::vector<float> param(3, 0.0f);
  const std::vector<float> grad{1.0f, -0.5f, 2.0f};
  plain.step(param, grad, 1.0f);
  CHECK(param == std::vector<float>{-1.0f, 0.5f, -2.0f});
  CHECK(std::vector<float>(state[0].data.begin(), state[0].data.end()) == grad);

  // Where the start shows in the bits: g = -0. torch's first step copies it (buf = -0);
  // the zero start adds it to 0 · 0.9 (buf = fl(+0 + -0) = +0).
  sgd torch_start({.lr = 1.0f, .momentum = 0.9f}, 1);
  sgd zero_start({.lr = 1.0f, .momentum = 0.9f, .start = momentum_start::zero}, 1);
  std::vector<float> a{1.0f}, b{1.0f};
  const std::vector<float> negative_zero{-0.0f};
  torch_start.step(a, negative_zero, 1.0f);
  zero_start.step(b, negative_zero, 1.0f);
  CHECK(std::signbit(torch_start.state()[0].data[0]));
  CHECK_FALSE(std::signbit(zero_start.state()[0].data[0]));

  using fedshard::invalid_argument;
  CHECK_THROWS_WITH_AS(
      sgd({.momentum = 0.9f, .dampening = 0.5f, .nesterov = true, .start = momentum_start::zero},
          4),
      doctest::Contains("sgd: config.nesterov requires dampening == 0, found dampening 0.5"),
      invalid_argument);
  CHECK_THROWS_WITH_AS(sgd({.start = static_cast<momentum_start>(7)}, 4),
                       doctest::Contains("config.start must be momentum_start::first_gradient or "
                                         "zero, found 7"),
                       invalid_argument);
}

TEST_CASE("an sgd owning its space, move-assigned over another, keeps the moved state") {
  // The optimizer assigned over gives its buffer back to its own space before that space
  // goes (a member-wise assignment dropped the space first, then returned the buffer to it).
  sgd a({.momentum = 0.9f}, 7), b({.momentum = 0.9f}, 7);
  std::vector<float> pa(7, 1.0f), pb(7, 1.0f);
  const std::vector<float> grad(7, 0.5f);
  a.step(pa, grad, 0.1f);
  b.step(pb, grad, 0.1f);
  b.step(pb, grad, 0.1f);
  a = std::move(b);
  CHECK(a.step_count() == 2);
  CHECK(a.state()[0].data[3] == 0.5f * 0.9f + 0.5f);  // b's buffer: 0.5, then 0.95
  a.step(pb, grad, 0.1f);
  CHECK(a.state()[0].data[3] == (0.5f * 0.9f + 0.5f) * 0.9f + 0.5f);
}
