#include "fedshard/optim/adamw.hpp"

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

using fedshard::optim::adamw;

/// The value rounded to a float and stored, so no later operation can fuse with the op
/// that produced it.
float rounded(float x) {
  const volatile float v = x;
  return v;
}

/// The same for a double (Python's scalar arithmetic rounds every op).
double rounded(double x) {
  const volatile double v = x;
  return v;
}

/// torch's _single_tensor_adam with decoupled weight decay (AdamW) on float32 tensors,
/// element by element, written from its Python source. Scalars are Python doubles that
/// become floats when they enter a kernel; lerp, add(alpha) and addcmul are fused
/// multiply-adds as in torch's vectorised CPU kernels; sqrt is IEEE (see kernels/adamw.hpp).
struct reference_adamw {
  double beta1, beta2, eps, weight_decay;
  std::vector<float> exp_avg, exp_avg_sq;
  double step_t = 0;

  void step(std::vector<float>& param, const std::vector<float>& grad, double lr) {
    exp_avg.resize(param.size());
    exp_avg_sq.resize(param.size());
    step_t += 1;
    const float decay = static_cast<float>(1 - rounded(lr * weight_decay));
    const float weight = static_cast<float>(1 - beta1);
    const double bias_correction1 = 1 - std::pow(beta1, step_t);
    const double bias_correction2 = 1 - std::pow(beta2, step_t);
    const double step_size = lr / bias_correction1;
    const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
    for (std::size_t i = 0; i < param.size(); ++i) {
      float p = param[i];
      if (weight_decay != 0) p = rounded(p * decay);  // param.mul_(1 - lr * weight_decay)
      // exp_avg.lerp_(grad, 1 - beta1)
      const float diff = rounded(grad[i] - exp_avg[i]);
      exp_avg[i] = weight < 0.5f ? std::fma(weight, diff, exp_avg[i])
                                 : std::fma(rounded(weight - 1.0f), diff, grad[i]);
      // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
      const float decayed = rounded(exp_avg_sq[i] * static_cast<float>(beta2));
      const float scaled = rounded(static_cast<float>(1 - beta2) * grad[i]);
      exp_avg_sq[i] = std::fma(scaled, grad[i], decayed);
      // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
      const float root = rounded(std::sqrt(exp_avg_sq[i]));
      const float denom = rounded(rounded(root / static_cast<float>(bias_correction2_sqrt)) +
                                  static_cast<float>(eps));
      // param.addcdiv_(exp_avg, denom, value=-step_size)
      const float numerator = rounded(static_cast<float>(-step_size) * exp_avg[i]);
      param[i] = rounded(p + rounded(numerator / denom));
    }
  }
};

std::vector<float> random_vector(std::size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> exponent(-4.0f, 2.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng) * std::pow(10.0f, exponent(rng));
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

/// Warm-up then decay, as a schedule would give it.
float lr_at(int step) {
  return step < 10 ? 1e-3f * static_cast<float>(step + 1) : 1e-2f / static_cast<float>(step - 8);
}

}  // namespace

TEST_CASE("adamw matches torch's update formulas over 100 steps") {
  struct case_t {
    adamw::config cfg;
    const char* what;
  };
  const case_t cases[] = {
      {{}, "torch defaults"},
      {{.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f}, "FL+FSDP paper"},
      {{.beta1 = 0.3f, .beta2 = 0.5f, .eps = 1e-6f, .weight_decay = 0.0f}, "lerp weight >= 0.5"},
      {{.beta1 = 0.5f, .beta2 = 0.9f, .eps = 0.0f, .weight_decay = 0.05f}, "weight 0.5, eps 0"},
      {{.beta1 = 0.0f, .beta2 = 0.0f, .eps = 1e-8f, .weight_decay = 0.0f}, "no averaging"},
  };
  for (const case_t& c : cases) {
    for (const std::size_t n :
         {std::size_t{0}, std::size_t{1}, std::size_t{2}, std::size_t{17}, std::size_t{1009}}) {
      CAPTURE(c.what);
      CAPTURE(n);
      std::mt19937 rng(static_cast<unsigned>(n * 17 + 1));
      std::vector<float> param = random_vector(n, rng);
      std::vector<float> expected = param;
      adamw opt(c.cfg, n);
      reference_adamw ref{c.cfg.beta1, c.cfg.beta2, c.cfg.eps, c.cfg.weight_decay, {}, {}};
      for (int step = 0; step < 100; ++step) {
        const std::vector<float> grad = random_vector(n, rng);
        opt.step(param, grad, lr_at(step));
        ref.step(expected, grad, lr_at(step));
      }
      CHECK(opt.step_count() == 100);
      const auto state = opt.state();
      REQUIRE(state.size() == 2);
      CHECK(max_relative_difference(param, expected) <= 1e-7);
      CHECK(max_relative_difference(state[0].data, ref.exp_avg) <= 1e-7);
      CHECK(max_relative_difference(state[1].data, ref.exp_avg_sq) <= 1e-7);
      CHECK(bitwise_equal(param, expected));
      CHECK(bitwise_equal(state[0].data, ref.exp_avg));
      CHECK(bitwise_equal(state[1].data, ref.exp_avg_sq));
    }
  }
}

TEST_CASE("adamw's first step moves every element by lr (bias correction), decay first") {
  // After one step m = (1 - b1) g and v = (1 - b2) g^2, so the bias-corrected update is
  // lr * g / (|g| + eps'): about lr * sign(g) for |g| >> eps.
  adamw opt({.lr = 0.01f, .weight_decay = 0.5f}, 3);
  std::vector<float> param{1.0f, -1.0f, 0.0f};
  opt.step(param, std::vector<float>{3.0f, -0.5f, 1e3f}, 0.01f);
  CHECK(param[0] == doctest::Approx(1.0f * (1 - 0.01f * 0.5f) - 0.01f).epsilon(1e-6));
  CHECK(param[1] == doctest::Approx(-1.0f * (1 - 0.01f * 0.5f) + 0.01f).epsilon(1e-6));
  CHECK(param[2] == doctest::Approx(-0.01f).epsilon(1e-6));
}

TEST_CASE("adamw state: exp_avg and exp_avg_sq of n zeroed elements") {
  adamw opt({}, 7);
  const auto state = opt.state();
  REQUIRE(state.size() == 2);
  CHECK(state[0].name == "exp_avg");
  CHECK(state[1].name == "exp_avg_sq");
  for (const auto& t : state) {
    CHECK(t.data.size() == 7);
    CHECK(std::all_of(t.data.begin(), t.data.end(), [](float x) { return x == 0; }));
  }
  CHECK(opt.size() == 7);
  CHECK(opt.step_count() == 0);
  CHECK(opt.settings().weight_decay == 1e-2f);
  CHECK(adamw(adamw::config{}, 0).state()[0].data.empty());
}

TEST_CASE("adamw resumed from its state and step count continues bit for bit") {
  const std::size_t n = 64;
  const adamw::config cfg{.lr = 3e-4f, .beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = 0.1f};
  std::mt19937 rng(5);
  std::vector<float> param = random_vector(n, rng);
  adamw original(cfg, n);
  for (int step = 0; step < 7; ++step) original.step(param, random_vector(n, rng), 3e-4f);

  std::vector<float> resumed_param = param;
  adamw resumed(cfg, n);
  const auto from = original.state();
  const auto to = resumed.state();
  for (std::size_t k = 0; k < from.size(); ++k)
    std::copy(from[k].data.begin(), from[k].data.end(), to[k].data.begin());
  resumed.set_step_count(original.step_count());

  for (int step = 0; step < 5; ++step) {
    const std::vector<float> grad = random_vector(n, rng);
    original.step(param, grad, 2e-4f);
    resumed.step(resumed_param, grad, 2e-4f);
  }
  CHECK(bitwise_equal(param, resumed_param));
  CHECK(bitwise_equal(original.state()[1].data, resumed.state()[1].data));
  CHECK(resumed.step_count() == 12);

  // The step count drives the bias correction: the same state with another count differs.
  std::vector<float> wrong_param = param;
  adamw wrong(cfg, n);
  const auto latest = original.state();
  const auto wrong_state = wrong.state();
  for (std::size_t k = 0; k < latest.size(); ++k)
    std::copy(latest[k].data.begin(), latest[k].data.end(), wrong_state[k].data.begin());
  const std::vector<float> grad = random_vector(n, rng);
  original.step(param, grad, 2e-4f);
  wrong.step(wrong_param, grad, 2e-4f);
  CHECK_FALSE(bitwise_equal(param, wrong_param));
}

TEST_CASE("adamw rejects invalid configs with a message that names the value") {
  using fedshard::invalid_argument;
  CHECK_THROWS_WITH_AS(adamw({.lr = -1e-3f}, 4),
                       doctest::Contains("config.lr must be >= 0, found -0.001"), invalid_argument);
  CHECK_THROWS_WITH_AS(adamw({.beta1 = 1.0f}, 4),
                       doctest::Contains("config.beta1 must be in [0, 1), found 1"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(adamw({.beta1 = -0.5f}, 4),
                       doctest::Contains("config.beta1 must be in [0, 1), found -0.5"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(adamw({.beta2 = 1.5f}, 4),
                       doctest::Contains("config.beta2 must be in [0, 1), found 1.5"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(adamw({.beta2 = std::nanf("")}, 4), doctest::Contains("config.beta2"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(adamw({.eps = -1e-8f}, 4),
                       doctest::Contains("config.eps must be >= 0, found -1e-08"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(adamw({.weight_decay = -0.25f}, 4),
                       doctest::Contains("config.weight_decay must be >= 0, found -0.25"),
                       invalid_argument);
  CHECK_NOTHROW(adamw({.lr = 0.0f, .beta1 = 0.0f, .beta2 = 0.0f, .eps = 0.0f}, 1));
}

TEST_CASE("adamw::step rejects spans of the wrong size and a negative lr, changing nothing") {
  adamw opt({}, 3);
  std::vector<float> param{1.0f, 2.0f, 3.0f};
  const std::vector<float> grad{1.0f, 1.0f, 1.0f};
  std::vector<float> short_param{1.0f};
  const std::vector<float> long_grad{1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
  CHECK_THROWS_WITH_AS(opt.step(short_param, grad, 1e-3f),
                       doctest::Contains("param must have 3 elements (the shard size), found 1"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(opt.step(param, long_grad, 1e-3f),
                       doctest::Contains("grad must have 3 elements (the shard size), found 5"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(opt.step(param, grad, -1.0f), doctest::Contains("lr must be >= 0, found -1"),
                       fedshard::invalid_argument);
  CHECK(param == std::vector<float>{1.0f, 2.0f, 3.0f});
  CHECK(opt.step_count() == 0);
  CHECK(std::all_of(opt.state()[0].data.begin(), opt.state()[0].data.end(),
                    [](float x) { return x == 0; }));
  CHECK_THROWS_WITH_AS(opt.set_step_count(-1), doctest::Contains("found -1"),
                       fedshard::invalid_argument);
}

TEST_CASE("an adamw owning its space, move-assigned over another, keeps the moved state") {
  // As sgd's: the buffers assigned over go back to their own space before it goes.
  adamw a({}, 5), b({}, 5);
  std::vector<float> pa(5, 1.0f), pb(5, 1.0f);
  const std::vector<float> grad(5, 0.25f);
  a.step(pa, grad, 0.1f);
  b.step(pb, grad, 0.1f);
  b.step(pb, grad, 0.1f);
  const std::vector<float> avg(b.state()[0].data.begin(), b.state()[0].data.end());
  a = std::move(b);
  CHECK(a.step_count() == 2);
  CHECK(std::vector<float>(a.state()[0].data.begin(), a.state()[0].data.end()) == avg);
  a.step(pb, grad, 0.1f);
  CHECK(a.step_count() == 3);
}
