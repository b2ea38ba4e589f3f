#include "fedshard/federation/outer_rules.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/optim/sgd.hpp"

namespace {

namespace federation = fedshard::federation;
using federation::fedadam;
using federation::fedmom;
using federation::fedyogi;
using federation::nesterov;
using federation::outer_sgd;
using federation::OuterRule;

static_assert(OuterRule<outer_sgd>);
static_assert(OuterRule<nesterov>);
static_assert(OuterRule<fedmom>);
static_assert(OuterRule<fedadam>);
static_assert(OuterRule<fedyogi>);
static_assert(!OuterRule<fedshard::optim::sgd>, "a shard optimizer is not an outer rule");

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

// Plain per-element references, in the op order kernels/outer.hpp documents.

struct reference_outer_sgd {
  outer_sgd::config cfg;
  explicit reference_outer_sgd(outer_sgd::config c, std::size_t) : cfg(c) {}
  void step(std::vector<float>& theta, const std::vector<float>& d) {
    for (std::size_t i = 0; i < theta.size(); ++i) theta[i] = std::fma(d[i], -cfg.lr, theta[i]);
  }
  std::vector<std::vector<float>> state() const { return {}; }
};

struct reference_nesterov {
  nesterov::config cfg;
  std::vector<float> m;
  explicit reference_nesterov(nesterov::config c, std::size_t n) : cfg(c), m(n, 0.0f) {}
  void step(std::vector<float>& theta, const std::vector<float>& d) {
    for (std::size_t i = 0; i < theta.size(); ++i) {
      m[i] = rounded(rounded(m[i] * cfg.momentum) + d[i]);
      const float u = std::fma(m[i], cfg.momentum, d[i]);
      theta[i] = std::fma(u, -cfg.lr, theta[i]);
    }
  }
  std::vector<std::vector<float>> state() const { return {m}; }
};

struct reference_fedmom {
  fedmom::config cfg;
  std::vector<float> m;
  explicit reference_fedmom(fedmom::config c, std::size_t n) : cfg(c), m(n, 0.0f) {}
  void step(std::vector<float>& theta, const std::vector<float>& d) {
    for (std::size_t i = 0; i < theta.size(); ++i) {
      m[i] = rounded(rounded(m[i] * cfg.momentum) + d[i]);
      theta[i] = std::fma(m[i], -cfg.lr, theta[i]);
    }
  }
  std::vector<std::vector<float>> state() const { return {m}; }
};

/// Where v starts: τ² rounded to float by default (Reddi et al. 2021, Algorithm 2).
float start_of_v(const federation::adaptive_config& cfg) {
  return cfg.initial_v == federation::adaptive_config::tau_squared ? rounded(cfg.tau * cfg.tau)
                                                                   : cfg.initial_v;
}

template <bool Yogi>
struct reference_adaptive {
  federation::adaptive_config cfg;
  std::vector<float> m, v;
  std::size_t v_decreased = 0, v_increased = 0;
  explicit reference_adaptive(federation::adaptive_config c, std::size_t n)
      : cfg(c), m(n, 0.0f), v(n, start_of_v(c)) {}
  void step(std::vector<float>& theta, const std::vector<float>& d) {
    const float c1 = rounded(1.0f - cfg.beta1);
    const float c2 = rounded(1.0f - cfg.beta2);
    for (std::size_t i = 0; i < theta.size(); ++i) {
      m[i] = std::fma(d[i], c1, rounded(m[i] * cfg.beta1));
      const float d2 = rounded(d[i] * d[i]);
      if (Yogi) {
        const float t = rounded(c2 * d2);
        if (v[i] > d2) {
          v[i] = rounded(v[i] - t);
          ++v_decreased;
        } else if (v[i] < d2) {
          v[i] = rounded(v[i] + t);
          ++v_increased;
        }
      } else {
        v[i] = std::fma(d2, c2, rounded(v[i] * cfg.beta2));
      }
      const float q = rounded(rounded(std::sqrt(v[i])) + cfg.tau);
      theta[i] = std::fma(rounded(m[i] / q), -cfg.lr, theta[i]);
    }
  }
  std::vector<std::vector<float>> state() const { return {m, v}; }
};

/// Values over many orders of magnitude, of both signs.
std::vector<float> random_vector(std::size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> exponent(-3.0f, 1.0f);
  std::vector<float> out(n);
  for (float& x : out) x = scale * normal(rng) * std::pow(10.0f, exponent(rng));
  return out;
}

/// Runs rule and reference side by side for 50 steps on shards of 0, 1, 17 and 1000
/// elements and checks anchor, state and step count bit for bit.
template <class Rule, class Reference>
void check_against_reference(typename Rule::config cfg) {
  for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{17}, std::size_t{1000}}) {
    CAPTURE(n);
    std::mt19937 rng(static_cast<unsigned>(n * 13 + 1));
    std::vector<float> anchor = random_vector(n, rng, 1.0f);
    std::vector<float> expected = anchor;
    Rule rule(cfg, n);
    Reference ref(cfg, n);
    for (int step = 0; step < 50; ++step) {
      // Pseudo-gradients whose scale changes from round to round.
      const std::vector<float> d = random_vector(n, rng, 0.01f * static_cast<float>(1 + step % 5));
      rule.step(anchor, d);
      ref.step(expected, d);
    }
    CHECK(rule.step_count() == 50);
    CHECK(bitwise_equal(anchor, expected));
    const auto state = rule.state();
    const auto ref_state = ref.state();
    REQUIRE(state.size() == ref_state.size());
    for (std::size_t k = 0; k < state.size(); ++k) {
      CAPTURE(state[k].name);
      CHECK(bitwise_equal(state[k].data, ref_state[k]));
    }
    if constexpr (std::is_same_v<Reference, reference_adaptive<true>>) {
      if (n == 1000) {  // both branches of sign(v - d²) were taken
        CHECK(ref.v_decreased > 1000);
        CHECK(ref.v_increased > 1000);
      }
    }
  }
}

TEST_CASE("every rule matches its plain per-element reference bit for bit over 50 steps") {
  SUBCASE("outer_sgd") {
    check_against_reference<outer_sgd, reference_outer_sgd>({});
    check_against_reference<outer_sgd, reference_outer_sgd>({.lr = 0.7f});
  }
  SUBCASE("nesterov") {
    check_against_reference<nesterov, reference_nesterov>({});
    check_against_reference<nesterov, reference_nesterov>({.lr = 0.25f, .momentum = 0.5f});
  }
  SUBCASE("fedmom") {
    check_against_reference<fedmom, reference_fedmom>({});
    check_against_reference<fedmom, reference_fedmom>({.lr = 0.6f, .momentum = 0.95f});
  }
  SUBCASE("fedadam") {
    check_against_reference<fedadam, reference_adaptive<false>>({});
    check_against_reference<fedadam, reference_adaptive<false>>(
        {.lr = 0.1f, .beta1 = 0.5f, .beta2 = 0.999f, .tau = 1e-6f});
    check_against_reference<fedadam, reference_adaptive<false>>({.initial_v = 0.0f});
    check_against_reference<fedadam, reference_adaptive<false>>({.initial_v = 2.5e-4f});
  }
  SUBCASE("fedyogi") {
    check_against_reference<fedyogi, reference_adaptive<true>>({});
    check_against_reference<fedyogi, reference_adaptive<true>>(
        {.lr = 0.1f, .beta1 = 0.5f, .beta2 = 0.999f, .tau = 1e-6f});
    check_against_reference<fedyogi, reference_adaptive<true>>({.initial_v = 0.0f});
    check_against_reference<fedyogi, reference_adaptive<true>>({.initial_v = 2.5e-4f});
  }
}

TEST_CASE("the defaults are the papers' values and R() is an empty shard") {
  CHECK(outer_sgd{}.settings().lr == 1.0f);
  CHECK(nesterov{}.settings().lr == 0.7f);
  CHECK(nesterov{}.settings().momentum == 0.9f);
  CHECK(fedmom{}.settings().lr == 1.0f);
  CHECK(fedmom{}.settings().momentum == 0.9f);
  const fedadam adam;
  CHECK(adam.settings().lr == 1e-2f);
  CHECK(adam.settings().beta1 == 0.9f);
  CHECK(adam.settings().beta2 == 0.99f);
  CHECK(adam.settings().tau == 1e-3f);
  CHECK(adam.settings().initial_v == federation::adaptive_config::tau_squared);
  CHECK(fedyogi{}.settings().tau == 1e-3f);
  CHECK(fedyogi{}.settings().initial_v == federation::adaptive_config::tau_squared);
  CHECK(adam.size() == 0);
  CHECK(adam.step_count() == 0);

  fedyogi empty;
  std::vector<float> none;
  empty.step(none, none);
  CHECK(empty.step_count() == 1);
  CHECK(outer_sgd::name == "outer_sgd");
  CHECK(nesterov::name == "nesterov");
  CHECK(fedmom::name == "fedmom");
  CHECK(fedadam::name == "fedadam");
  CHECK(fedyogi::name == "fedyogi");
}

TEST_CASE("outer_sgd with lr 1 turns the anchor into the mean of the groups' models") {
  SUBCASE("an exactly representable example") {
    outer_sgd avg({}, 2);
    std::vector<float> anchor{3.0f, -1.0f};
    // Groups at {1, 0} and {2, -4}: mean {1.5, -2}, d = anchor - mean = {1.5, 1}.
    const std::vector<float> d{1.5f, 1.0f};
    avg.step(anchor, d);
    CHECK(anchor == std::vector<float>{1.5f, -2.0f});
  }
  SUBCASE("random groups after local training") {
    const std::size_t n = 1000, groups = 4;
    std::mt19937 rng(42);
    // Anchor elements of magnitude 0.5 to 2 and drifts below 0.1: no mean is near 0, so the
    // rounding of d and of the subtraction stays within about an ulp of the mean.
    std::uniform_real_distribution<float> magnitude(0.5f, 2.0f);
    std::uniform_real_distribution<float> drift(-0.1f, 0.1f);
    std::vector<float> start(n);
    for (std::size_t i = 0; i < n; ++i) start[i] = (i % 2 == 0 ? 1.0f : -1.0f) * magnitude(rng);
    std::vector<std::vector<float>> models;
    for (std::size_t g = 0; g < groups; ++g) {
      std::vector<float> model = start;
      for (float& x : model) x -= drift(rng);
      models.push_back(model);
    }
    std::vector<float> mean(n), d(n);
    for (std::size_t i = 0; i < n; ++i) {
      float sum = 0.0f;
      for (const auto& model : models) sum += model[i];
      mean[i] = sum / static_cast<float>(groups);
      d[i] = start[i] - mean[i];
    }
    std::vector<float> anchor = start;
    outer_sgd avg({.lr = 1.0f}, n);
    avg.step(anchor, d);
    std::size_t moved = 0;
    for (std::size_t i = 0; i < n; ++i) {
      CAPTURE(i);
      CHECK(std::fabs(anchor[i] - mean[i]) <= 1e-6f * std::fabs(mean[i]));
      moved += anchor[i] != start[i];
    }
    CHECK(moved > n / 2);
  }
}

TEST_CASE("nesterov's first steps with DiLoCo's lr 0.7 and momentum 0.9 on d = 1") {
  nesterov rule({}, 3);
  std::vector<float> anchor{2.0f, -1.0f, 0.5f};
  const std::vector<float> start = anchor;
  const std::vector<float> ones(3, 1.0f);
  rule.step(anchor, ones);
  const auto momentum = rule.state()[0].data;
  for (std::size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(momentum[i] == 1.0f);  // m = 0.9 * 0 + 1
    // θ − 0.7 · (0.9 · 1 + 1); 0.9f + 1 = 1.9f exactly.
    CHECK(anchor[i] == std::fma(1.9f, -0.7f, start[i]));
    CHECK(std::fabs(static_cast<double>(anchor[i]) - (start[i] - 0.7 * 1.9)) <= 1e-6);
  }
  const std::vector<float> first = anchor;
  rule.step(anchor, ones);
  for (std::size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    // m = 0.9 · 1 + 1 = 1.9; θ − 0.7 · (0.9 · 1.9 + 1).
    CHECK(std::fabs(momentum[i] - 1.9f) <= 1e-6f);
    CHECK(std::fabs(static_cast<double>(anchor[i]) - (first[i] - 0.7 * 2.71)) <= 1e-6);
  }
}

TEST_CASE("nesterov and fedmom equal torch SGD with momentum on the pseudo-gradient") {
  const std::size_t n = 257;
  for (const bool use_nesterov : {false, true}) {
    CAPTURE(use_nesterov);
    std::mt19937 rng(5);
    std::vector<float> anchor = random_vector(n, rng, 1.0f);
    std::vector<float> torch_anchor = anchor;
    fedshard::optim::sgd torch_sgd({.lr = 0.7f, .momentum = 0.9f, .nesterov = use_nesterov}, n);
    nesterov nest({.lr = 0.7f, .momentum = 0.9f}, n);
    fedmom mom({.lr = 0.7f, .momentum = 0.9f}, n);
    for (int step = 0; step < 50; ++step) {
      const std::vector<float> d = random_vector(n, rng, 0.1f);
      if (use_nesterov) {
        nest.step(anchor, d);
      } else {
        mom.step(anchor, d);
      }
      torch_sgd.step(torch_anchor, d, 0.7f);
    }
    CHECK(bitwise_equal(anchor, torch_anchor));
    const auto ours = use_nesterov ? nest.state() : mom.state();
    CHECK(bitwise_equal(ours[0].data, torch_sgd.state()[0].data));
  }
}

/// One object on the whole shard against two on its halves (lower half first), 50 steps.
template <class Rule>
void check_sharded_state(typename Rule::config cfg) {
  for (const std::size_t n : {std::size_t{1}, std::size_t{17}, std::size_t{1000}}) {
    CAPTURE(n);
    const std::size_t half = n / 2;
    std::mt19937 rng(static_cast<unsigned>(n + 99));
    std::vector<float> whole = random_vector(n, rng, 1.0f);
    std::vector<float> split = whole;
    Rule one(cfg, n);
    Rule lower(cfg, half);
    Rule upper(cfg, n - half);
    const std::span<float> split_all(split);
    for (int step = 0; step < 50; ++step) {
      const std::vector<float> d = random_vector(n, rng, 0.02f);
      const std::span<const float> d_all(d);
      one.step(whole, d);
      lower.step(split_all.first(half), d_all.first(half));
      upper.step(split_all.subspan(half), d_all.subspan(half));
    }
    CHECK(bitwise_equal(whole, split));
    const auto state = one.state();
    const auto state_lower = lower.state();
    const auto state_upper = upper.state();
    REQUIRE(state_lower.size() == state.size());
    REQUIRE(state_upper.size() == state.size());
    for (std::size_t k = 0; k < state.size(); ++k) {
      CAPTURE(state[k].name);
      std::vector<float> joined(state_lower[k].data.begin(), state_lower[k].data.end());
      joined.insert(joined.end(), state_upper[k].data.begin(), state_upper[k].data.end());
      CHECK(bitwise_equal(state[k].data, joined));
    }
  }
}

TEST_CASE("outer state sharded in two halves evolves bit for bit as the whole") {
  check_sharded_state<outer_sgd>({.lr = 0.8f});
  check_sharded_state<nesterov>({});
  check_sharded_state<fedmom>({});
  check_sharded_state<fedadam>({});
  check_sharded_state<fedyogi>({});
}

/// The state of a fresh rule: the names, 7 elements each, every element at its start.
template <class Rule>
void check_state_layout(const std::vector<std::string>& names, const std::vector<float>& starts) {
  CAPTURE(Rule::name);
  Rule rule({}, 7);
  auto state = rule.state();
  REQUIRE(state.size() == names.size());
  for (std::size_t k = 0; k < names.size(); ++k) {
    CHECK(state[k].name == names[k]);
    CHECK(state[k].data.size() == 7);
    const float start = starts[k];
    CHECK(std::all_of(state[k].data.begin(), state[k].data.end(),
                      [&](float x) { return same_bits(x, start); }));
  }
  // The spans alias the live state: a step changes what they show.
  std::vector<float> anchor(7, 1.0f);
  const std::vector<float> d(7, 0.5f);
  rule.step(anchor, d);
  for (std::size_t k = 0; k < names.size(); ++k) CHECK(state[k].data[3] != starts[k]);
}

TEST_CASE("state() names, sizes and starting values: zero, and tau² for v") {
  const float tau2 = rounded(1e-3f * 1e-3f);
  check_state_layout<outer_sgd>({}, {});
  check_state_layout<nesterov>({"momentum"}, {0.0f});
  check_state_layout<fedmom>({"momentum"}, {0.0f});
  check_state_layout<fedadam>({"m", "v"}, {0.0f, tau2});
  check_state_layout<fedyogi>({"m", "v"}, {0.0f, tau2});
}

/// Ten steps, a restore of state and step count into a fresh object, ten more steps.
template <class Rule>
void check_resume(typename Rule::config cfg) {
  CAPTURE(Rule::name);
  const std::size_t n = 33;
  std::mt19937 rng(8);
  std::vector<float> anchor = random_vector(n, rng, 1.0f);
  Rule original(cfg, n);
  for (int step = 0; step < 10; ++step) original.step(anchor, random_vector(n, rng, 0.1f));

  std::vector<float> resumed_anchor = anchor;
  Rule resumed(cfg, n);
  const auto from = original.state();
  const auto to = resumed.state();
  for (std::size_t k = 0; k < from.size(); ++k)
    std::copy(from[k].data.begin(), from[k].data.end(), to[k].data.begin());
  resumed.set_step_count(original.step_count());

  for (int step = 0; step < 10; ++step) {
    const std::vector<float> d = random_vector(n, rng, 0.1f);
    original.step(anchor, d);
    resumed.step(resumed_anchor, d);
  }
  CHECK(bitwise_equal(anchor, resumed_anchor));
  CHECK(resumed.step_count() == 20);
}

TEST_CASE("a rule restored from state() and step_count() continues bit for bit") {
  check_resume<outer_sgd>({});
  check_resume<nesterov>({});
  check_resume<fedmom>({});
  check_resume<fedadam>({});
  check_resume<fedyogi>({});
}

TEST_CASE("fedadam's first step starts from v = tau², by hand") {
  // Defaults: lr 0.01, beta1 0.9, beta2 0.99, tau 0.001; v starts at fl(tau · tau).
  const federation::adaptive_config cfg{};
  fedadam adam(cfg, 2);
  std::vector<float> anchor{1.0f, -0.5f};
  const std::vector<float> start = anchor;
  const std::vector<float> d{2e-3f, -1e-5f};  // d² above tau², and far below it
  adam.step(anchor, d);
  const float tau2 = rounded(cfg.tau * cfg.tau);
  const float c1 = rounded(1.0f - cfg.beta1);
  const float c2 = rounded(1.0f - cfg.beta2);
  for (std::size_t i = 0; i < 2; ++i) {
    CAPTURE(i);
    // The op order of kernels/outer.hpp with m = 0 and v = tau².
    const float m1 = std::fma(d[i], c1, rounded(0.0f * cfg.beta1));
    const float v1 = std::fma(rounded(d[i] * d[i]), c2, rounded(tau2 * cfg.beta2));
    const float q = rounded(rounded(std::sqrt(v1)) + cfg.tau);
    const float theta = std::fma(rounded(m1 / q), -cfg.lr, start[i]);
    CHECK(same_bits(adam.state()[0].data[i], m1));
    CHECK(same_bits(adam.state()[1].data[i], v1));
    CHECK(same_bits(anchor[i], theta));
    // The formula in double: θ − η (1 − β1) d / (√(β2 τ² + (1 − β2) d²) + τ).
    const double dd = d[i], tau = cfg.tau;
    const double step = 0.01 * 0.1 * dd / (std::sqrt(0.99 * tau * tau + 0.01 * dd * dd) + tau);
    CHECK(std::fabs(static_cast<double>(anchor[i]) - (start[i] - step)) <= 1e-7);
  }
  // Where d is tiny the step is about η (1 − β1) d / (2τ) (√(β2 τ²) ≈ τ), half of the
  // η (1 − β1) d / τ a start from v = 0 would take.
  const double tiny_step = static_cast<double>(start[1]) - static_cast<double>(anchor[1]);
  CHECK(std::fabs(tiny_step / (0.01 * 0.1 * -1e-5 / (2 * 1e-3)) - 1) <= 0.02);
}

TEST_CASE("fedyogi's first step from v = tau² differs from fedadam's, by hand") {
  const federation::adaptive_config cfg{};
  fedadam adam(cfg, 1);
  fedyogi yogi(cfg, 1);
  std::vector<float> adam_anchor{1.0f}, yogi_anchor{1.0f};
  const std::vector<float> d{2e-3f};  // d² = 4e-6 > tau² = 1e-6
  adam.step(adam_anchor, d);
  yogi.step(yogi_anchor, d);

  const float tau2 = rounded(cfg.tau * cfg.tau);
  const float c1 = rounded(1.0f - cfg.beta1);
  const float c2 = rounded(1.0f - cfg.beta2);
  const float d2 = rounded(d[0] * d[0]);
  const float m1 = std::fma(d[0], c1, 0.0f);
  // Yogi: v < d², so v + (1 − β2) d²; Adam: β2 v + (1 − β2) d².
  const float yogi_v = rounded(tau2 + rounded(c2 * d2));
  const float adam_v = std::fma(d2, c2, rounded(tau2 * cfg.beta2));
  CHECK(same_bits(yogi.state()[1].data[0], yogi_v));
  CHECK(same_bits(adam.state()[1].data[0], adam_v));
  CHECK(std::fabs(yogi_v - 1.04e-6f) <= 1e-12f);
  CHECK(std::fabs(adam_v - 1.03e-6f) <= 1e-12f);
  const float yogi_q = rounded(rounded(std::sqrt(yogi_v)) + cfg.tau);
  CHECK(same_bits(yogi_anchor[0], std::fma(rounded(m1 / yogi_q), -cfg.lr, 1.0f)));
  CHECK(bitwise_equal(adam.state()[0].data, yogi.state()[0].data));  // m is the same
  // Larger v, smaller step: Yogi's anchor moved less.
  CHECK(yogi_anchor[0] > adam_anchor[0]);
}

TEST_CASE("fedyogi differs from fedadam once v > d², and only in v's update") {
  // initial_v = 0: from v = 0 < d² both add (1 − β2)·d², an identical first step.
  const federation::adaptive_config cfg{.initial_v = 0.0f};
  fedadam adam(cfg, 1);
  fedyogi yogi(cfg, 1);
  CHECK(adam.state()[1].data[0] == 0.0f);
  std::vector<float> adam_anchor{1.0f}, yogi_anchor{1.0f};

  const std::vector<float> big{10.0f};
  adam.step(adam_anchor, big);
  yogi.step(yogi_anchor, big);
  CHECK(bitwise_equal(adam_anchor, yogi_anchor));
  CHECK(bitwise_equal(adam.state()[1].data, yogi.state()[1].data));
  const float v1 = yogi.state()[1].data[0];
  CHECK(std::fabs(v1 - 1.0f) <= 1e-6f);  // 0.01 · 100

  // v ≈ 1 > d² = 0.01: Yogi subtracts (1 − β2)·d², Adam decays v by β2.
  const std::vector<float> small{0.1f};
  adam.step(adam_anchor, small);
  yogi.step(yogi_anchor, small);
  const float c2 = rounded(1.0f - cfg.beta2);
  const float d2 = rounded(0.1f * 0.1f);
  const float yogi_v = yogi.state()[1].data[0];
  const float adam_v = adam.state()[1].data[0];
  CHECK(yogi_v == rounded(v1 - rounded(c2 * d2)));
  CHECK(std::fabs(yogi_v - 0.9999f) <= 1e-6f);
  CHECK(std::fabs(adam_v - 0.9901f) <= 1e-6f);
  CHECK(bitwise_equal(adam.state()[0].data, yogi.state()[0].data));  // m is the same
  // Larger v, smaller step: Yogi's anchor moved less.
  CHECK(yogi_anchor[0] > adam_anchor[0]);
}

TEST_CASE("initial_v sets where v starts; a restore of state() overwrites it") {
  fedyogi yogi({.tau = 0.5f, .initial_v = 0.125f}, 3);
  // state() returns views by value: keep the vector alive across the loop.
  const auto yogi_state = yogi.state();
  for (const float v : yogi_state[1].data) CHECK(v == 0.125f);
  fedadam default_start({.tau = 0.5f}, 3);
  const auto default_state = default_start.state();
  for (const float v : default_state[1].data) CHECK(v == 0.25f);  // tau², exact

  // A checkpoint restore writes v through state(); the next step starts from that v.
  fedadam restored({.tau = 0.5f}, 1);
  restored.state()[1].data[0] = 4.0f;
  fedadam from_four({.tau = 0.5f, .initial_v = 4.0f}, 1);
  std::vector<float> a{1.0f}, b{1.0f};
  const std::vector<float> d{0.25f};
  restored.step(a, d);
  from_four.step(b, d);
  CHECK(bitwise_equal(a, b));
  CHECK(bitwise_equal(restored.state()[1].data, from_four.state()[1].data));
}

TEST_CASE("invalid configs throw invalid_argument naming the value") {
  using fedshard::invalid_argument;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  CHECK_THROWS_WITH_AS(outer_sgd({.lr = -1.0f}, 4),
                       doctest::Contains("outer_sgd: config.lr must be a finite number >= 0, "
                                         "found -1"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(outer_sgd({.lr = nan}, 4), doctest::Contains("found nan"), invalid_argument);
  CHECK_THROWS_WITH_AS(nesterov({.lr = inf}, 4), doctest::Contains("config.lr"), invalid_argument);
  CHECK_THROWS_WITH_AS(nesterov({.momentum = 1.0f}, 4),
                       doctest::Contains("nesterov: config.momentum must be in [0, 1), found 1"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(fedmom({.momentum = -0.25f}, 4),
                       doctest::Contains("fedmom: config.momentum must be in [0, 1), found -0.25"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(fedmom({.lr = -0.5f}, 4), doctest::Contains("found -0.5"), invalid_argument);
  CHECK_THROWS_WITH_AS(fedadam({.beta1 = 1.0f}, 4),
                       doctest::Contains("fedadam: config.beta1 must be in [0, 1), found 1"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(fedadam({.beta2 = 1.5f}, 4),
                       doctest::Contains("config.beta2 must be in [0, 1), found 1.5"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(fedyogi({.beta2 = nan}, 4), doctest::Contains("config.beta2"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(
      fedyogi({.tau = 0.0f}, 4),
      doctest::Contains("fedyogi: config.tau must be a finite number > 0, found 0"),
      invalid_argument);
  CHECK_THROWS_WITH_AS(fedadam({.tau = -0.001f}, 4), doctest::Contains("found -0.001"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(fedadam({.tau = inf}, 4), doctest::Contains("found inf"), invalid_argument);
  CHECK_THROWS_WITH_AS(fedadam({.initial_v = -0.5f}, 4),
                       doctest::Contains("fedadam: config.initial_v must be a finite number >= 0, "
                                         "or adaptive_config::tau_squared (-1) for tau^2, found "
                                         "-0.5"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(fedyogi({.initial_v = nan}, 4),
                       doctest::Contains("fedyogi: config.initial_v must be"), invalid_argument);
  CHECK_THROWS_WITH_AS(fedyogi({.initial_v = inf}, 4), doctest::Contains("found inf"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(fedadam({.tau = 1e20f}, 4),
                       doctest::Contains("fedadam: config.initial_v is tau_squared, so v starts "
                                         "at tau^2, which must be finite; found tau 1e+20"),
                       invalid_argument);
  // The edges that are allowed.
  CHECK_NOTHROW(outer_sgd({.lr = 0.0f}, 4));
  CHECK_NOTHROW(nesterov({.lr = 0.0f, .momentum = 0.0f}, 4));
  CHECK_NOTHROW(fedyogi({.lr = 0.0f, .beta1 = 0.0f, .beta2 = 0.0f, .tau = 1e-30f}, 4));
  CHECK_NOTHROW(fedadam({.initial_v = 0.0f}, 4));
  CHECK_NOTHROW(fedadam({.tau = 1e20f, .initial_v = 1.0f}, 4));
}

template <class Rule>
void check_size_mismatch() {
  CAPTURE(Rule::name);
  Rule rule({}, 4);
  std::vector<float> short_anchor{1.0f, 2.0f, 3.0f}, anchor{1.0f, 2.0f, 3.0f, 4.0f};
  const std::vector<float> d(4, 1.0f), long_d(5, 1.0f);
  CHECK_THROWS_WITH_AS(
      rule.step(short_anchor, d),
      doctest::Contains((std::string(Rule::name) + "::step: anchor and d must both have 4 elements "
                                                   "(the shard size), found anchor 3 and d 4")
                            .c_str()),
      fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(rule.step(anchor, long_d), doctest::Contains("found anchor 4 and d 5"),
                       fedshard::invalid_argument);
  CHECK(short_anchor == std::vector<float>{1.0f, 2.0f, 3.0f});
  CHECK(anchor == std::vector<float>{1.0f, 2.0f, 3.0f, 4.0f});
  CHECK(rule.step_count() == 0);
  Rule fresh({}, 4);
  const auto state = rule.state(), fresh_state = fresh.state();
  for (std::size_t k = 0; k < state.size(); ++k)
    CHECK(bitwise_equal(state[k].data, fresh_state[k].data));
  CHECK_THROWS_WITH_AS(rule.set_step_count(-3), doctest::Contains("found -3"),
                       fedshard::invalid_argument);
  rule.set_step_count(12);
  CHECK(rule.step_count() == 12);
}

TEST_CASE("step rejects spans of the wrong size, naming both, and changes nothing") {
  check_size_mismatch<outer_sgd>();
  check_size_mismatch<nesterov>();
  check_size_mismatch<fedmom>();
  check_size_mismatch<fedadam>();
  check_size_mismatch<fedyogi>();
}

}  // namespace
