#pragma once
/// Outer optimizers of a federation: the rules that move the anchor (the model every group
/// starts a round from) along the mean pseudo-gradient d = mean over groups of
/// (θ_anchor − θ_group), with outer state sharded like the parameters: each rank builds a
/// rule for its own anchor shard and keeps that shard's state only.
///
/// Rules: outer_sgd (FedAvg; lr 1 is plain averaging), nesterov (DiLoCo), fedmom, fedadam,
/// fedyogi. Their formulas and the rounding of every op are in kernels/outer.hpp. The
/// momentum and FedAdam's and FedYogi's first moment m start at zero; their second moment v
/// starts at τ² by default (`adaptive_config::initial_v`), as v₋₁ ≥ τ² in Algorithm 2 of
/// Reddi et al. (2021, "Adaptive Federated Optimization"), so that the first steps are not
/// oversized where d is tiny. No bias correction is applied (PAPERS.md section 3).
///
/// An OuterRule R provides:
///  1. `R::config`, a default-constructible aggregate of float hyper-parameters that holds
///     at least `lr`, with the paper's defaults.
///  2. `R(config, n)`: validates the config (fedshard::invalid_argument naming the bad
///     value) and owns outer state for an anchor shard of n elements, each buffer set to
///     its documented start (zero, or τ² for v); `R()` is R(config{}, 0).
///  3. `step(anchor, d)`: one outer update, in place, of the n elements of anchor
///     (std::span<float>) from the mean pseudo-gradient d (std::span<const float>); throws
///     invalid_argument, before changing anything, unless both spans hold n elements.
///     d does not overlap anchor unless it is anchor itself.
///  4. Element-wise updates: element i's update reads only anchor[i], d[i], element i of
///     each state buffer and the hyper-parameters (not the step count). So a shard split
///     among any number of rule objects (ranks) evolves bit for bit as the whole would.
///  5. `state()`: a std::vector<state_tensor>, one per state buffer, each of n writable
///     floats aliasing the live state, in a fixed order and with fixed names (for
///     checkpoints, whose restore overwrites the starting values): none for outer_sgd,
///     {"momentum"} for nesterov and fedmom, {"m", "v"} for fedadam and fedyogi.
///  6. `step_count()` (std::int64_t): the outer steps taken so far; `set_step_count(s)`
///     (s >= 0) restores it with the state buffers from a checkpoint.
///  7. `size()` (std::size_t): n.
///  8. `R::name`, a static constexpr std::string_view naming the rule.
///  9. Movable.

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "fedshard/core/buffer.hpp"
#include "fedshard/error.hpp"
#include "fedshard/kernels/outer.hpp"
#include "fedshard/optim/optimizer.hpp"

namespace fedshard::federation {

/// One named outer-state buffer of a rule: the name and the shard's elements.
using state_tensor = optim::state_tensor;

/// An outer optimizer of one rank's anchor shard with its own sharded state; see the list
/// above.
template <class R>
concept OuterRule = std::movable<R> && std::default_initializable<R> &&
    std::default_initializable<typename R::config> &&
    std::constructible_from<R, typename R::config, std::size_t> &&
    std::same_as<std::remove_cv_t<decltype(R::name)>, std::string_view> &&
    requires(R& r, const R& cr, const typename R::config& c, std::span<float> anchor,
             std::span<const float> d, std::int64_t steps) {
  { c.lr } -> std::convertible_to<float>;
  typename std::integral_constant<std::size_t, R::name.size()>;
  r.step(anchor, d);
  { r.state() } -> std::same_as<std::vector<state_tensor>>;
  { cr.step_count() } -> std::same_as<std::int64_t>;
  r.set_step_count(steps);
  { cr.size() } -> std::same_as<std::size_t>;
};

namespace detail {

inline void check_lr(std::string_view rule, float lr) {
  FEDSHARD_EXPECTS(std::isfinite(lr) && lr >= 0.0f, rule,
                   ": config.lr must be a finite number >= 0, found ", lr);
}

inline void check_unit_interval(std::string_view rule, std::string_view field, float x) {
  FEDSHARD_EXPECTS(x >= 0.0f && x < 1.0f, rule, ": config.", field, " must be in [0, 1), found ",
                   x);
}

inline void check_tau(std::string_view rule, float tau) {
  FEDSHARD_EXPECTS(std::isfinite(tau) && tau > 0.0f, rule,
                   ": config.tau must be a finite number > 0, found ", tau);
}

inline void check_step_sizes(std::string_view rule, std::size_t n, std::size_t anchor,
                             std::size_t d) {
  FEDSHARD_EXPECTS(anchor == n && d == n, rule, "::step: anchor and d must both have ", n,
                   " elements (the shard size), found anchor ", anchor, " and d ", d);
}

inline void check_step_count(std::string_view rule, std::int64_t steps) {
  FEDSHARD_EXPECTS(steps >= 0, rule, "::set_step_count: steps must be >= 0, found ", steps);
}

}  // namespace detail

/// Outer SGD (FedAvg): θ ← θ − η·d; with η = 1 the anchor becomes the groups' mean model.
class outer_sgd {
 public:
  /// The learning rate η.
  struct config {
    float lr = 1.0f;
  };

  /// The rule's name in messages and logs.
  static constexpr std::string_view name = "outer_sgd";

  /// A rule for an empty shard with the default config.
  outer_sgd() : outer_sgd(config{}, 0) {}

  /// Validates cfg; outer SGD has no state.
  explicit outer_sgd(config cfg, std::size_t n) : cfg_(validated(cfg)), size_(n) {}

  /// One outer step of the anchor shard.
  void step(std::span<float> anchor, std::span<const float> d) {
    detail::check_step_sizes(name, size_, anchor.size(), d.size());
    kernels::outer_sgd_step(anchor, d, kernels::make_outer_sgd_scalars(cfg_.lr));
    ++step_count_;
  }

  /// No state buffers.
  std::vector<state_tensor> state() { return {}; }

  /// The outer steps taken so far.
  std::int64_t step_count() const noexcept { return step_count_; }

  /// Restores the step count from a checkpoint.
  void set_step_count(std::int64_t steps) {
    detail::check_step_count(name, steps);
    step_count_ = steps;
  }

  /// The number of elements of the anchor shard.
  std::size_t size() const noexcept { return size_; }

  /// The hyper-parameters.
  const config& settings() const noexcept { return cfg_; }

 private:
  static config validated(const config& cfg) {
    detail::check_lr(name, cfg.lr);
    return cfg;
  }

  config cfg_;
  std::size_t size_ = 0;
  std::int64_t step_count_ = 0;
};

/// Nesterov momentum, DiLoCo's outer optimizer: m ← μ·m + d; θ ← θ − η·(μ·m + d).
class nesterov {
 public:
  /// The learning rate η and momentum μ, with DiLoCo's values.
  struct config {
    float lr = 0.7f;
    float momentum = 0.9f;
  };

  /// The rule's name in messages and logs.
  static constexpr std::string_view name = "nesterov";

  /// A rule for an empty shard with the default config.
  nesterov() : nesterov(config{}, 0) {}

  /// Validates cfg and allocates the zero momentum of n elements.
  explicit nesterov(config cfg, std::size_t n) : cfg_(validated(cfg)), size_(n), momentum_(n) {}

  /// One outer step of the anchor shard.
  void step(std::span<float> anchor, std::span<const float> d) {
    detail::check_step_sizes(name, size_, anchor.size(), d.size());
    kernels::outer_nesterov_step(anchor, d, momentum_.span(),
                                 kernels::make_outer_momentum_scalars(cfg_.lr, cfg_.momentum));
    ++step_count_;
  }

  /// The state buffers: {"momentum"}.
  std::vector<state_tensor> state() { return {{"momentum", momentum_.span()}}; }

  /// The outer steps taken so far.
  std::int64_t step_count() const noexcept { return step_count_; }

  /// Restores the step count from a checkpoint.
  void set_step_count(std::int64_t steps) {
    detail::check_step_count(name, steps);
    step_count_ = steps;
  }

  /// The number of elements of the anchor shard.
  std::size_t size() const noexcept { return size_; }

  /// The hyper-parameters.
  const config& settings() const noexcept { return cfg_; }

 private:
  static config validated(const config& cfg) {
    detail::check_lr(name, cfg.lr);
    detail::check_unit_interval(name, "momentum", cfg.momentum);
    return cfg;
  }

  config cfg_;
  std::size_t size_ = 0;
  std::int64_t step_count_ = 0;
  aligned_buffer<float> momentum_;
};

/// Heavy-ball momentum (FedMom): m ← μ·m + d; θ ← θ − η·m.
class fedmom {
 public:
  /// The learning rate η and momentum μ.
  struct config {
    float lr = 1.0f;
    float momentum = 0.9f;
  };

  /// The rule's name in messages and logs.
  static constexpr std::string_view name = "fedmom";

  /// A rule for an empty shard with the default config.
  fedmom() : fedmom(config{}, 0) {}

  /// Validates cfg and allocates the zero momentum of n elements.
  explicit fedmom(config cfg, std::size_t n) : cfg_(validated(cfg)), size_(n), momentum_(n) {}

  /// One outer step of the anchor shard.
  void step(std::span<float> anchor, std::span<const float> d) {
    detail::check_step_sizes(name, size_, anchor.size(), d.size());
    kernels::outer_fedmom_step(anchor, d, momentum_.span(),
                               kernels::make_outer_momentum_scalars(cfg_.lr, cfg_.momentum));
    ++step_count_;
  }

  /// The state buffers: {"momentum"}.
  std::vector<state_tensor> state() { return {{"momentum", momentum_.span()}}; }

  /// The outer steps taken so far.
  std::int64_t step_count() const noexcept { return step_count_; }

  /// Restores the step count from a checkpoint.
  void set_step_count(std::int64_t steps) {
    detail::check_step_count(name, steps);
    step_count_ = steps;
  }

  /// The number of elements of the anchor shard.
  std::size_t size() const noexcept { return size_; }

  /// The hyper-parameters.
  const config& settings() const noexcept { return cfg_; }

 private:
  static config validated(const config& cfg) {
    detail::check_lr(name, cfg.lr);
    detail::check_unit_interval(name, "momentum", cfg.momentum);
    return cfg;
  }

  config cfg_;
  std::size_t size_ = 0;
  std::int64_t step_count_ = 0;
  aligned_buffer<float> momentum_;
};

/// The hyper-parameters of fedadam and fedyogi: the learning rate η, the moment decays β1
/// and β2, the adaptivity τ, and where the second moment v starts.
struct adaptive_config {
  /// The value of `initial_v` that stands for τ² (this config's τ, squared in float).
  static constexpr float tau_squared = -1.0f;

  float lr = 1e-2f;
  float beta1 = 0.9f;
  float beta2 = 0.99f;
  float tau = 1e-3f;
  /// v before the first step: `tau_squared` (Algorithm 2 of Reddi et al. asks v₋₁ ≥ τ²), or
  /// any finite value >= 0 (0 reproduces implementations that start v at zero).
  float initial_v = tau_squared;
};

namespace detail {

/// The value v starts at under cfg: fl(τ·τ) for adaptive_config::tau_squared, else
/// cfg.initial_v.
inline float initial_v(const adaptive_config& cfg) noexcept {
  return cfg.initial_v == adaptive_config::tau_squared ? kernels::detail::mul_rn(cfg.tau, cfg.tau)
                                                       : cfg.initial_v;
}

inline void check_initial_v(std::string_view rule, const adaptive_config& cfg) {
  FEDSHARD_EXPECTS(cfg.initial_v == adaptive_config::tau_squared ||
                       (std::isfinite(cfg.initial_v) && cfg.initial_v >= 0.0f),
                   rule,
                   ": config.initial_v must be a finite number >= 0, or "
                   "adaptive_config::tau_squared (-1) for tau^2, found ",
                   cfg.initial_v);
  FEDSHARD_EXPECTS(std::isfinite(initial_v(cfg)), rule,
                   ": config.initial_v is tau_squared, so v starts at tau^2, which must be "
                   "finite; found tau ",
                   cfg.tau, " (tau^2 = ", initial_v(cfg), ")");
}

/// FedAdam and FedYogi, which differ only in the update of v: Derived supplies `name` and
/// `kernel`, its host loop from kernels/outer.hpp.
template <class Derived>
class adaptive_rule {
 public:
  /// The hyper-parameters, shared by fedadam and fedyogi.
  using config = adaptive_config;

  /// A rule for an empty shard with the default config.
  adaptive_rule() : adaptive_rule(config{}, 0) {}

  /// Validates cfg and allocates the moments m (zero) and v (initial_v(cfg)) of n elements.
  explicit adaptive_rule(config cfg, std::size_t n) : cfg_(validated(cfg)), size_(n), m_(n), v_(n) {
    std::fill(v_.begin(), v_.end(), initial_v(cfg_));
  }

  /// One outer step of the anchor shard.
  void step(std::span<float> anchor, std::span<const float> d) {
    check_step_sizes(Derived::name, size_, anchor.size(), d.size());
    Derived::kernel(
        anchor, d, m_.span(), v_.span(),
        kernels::make_outer_adaptive_scalars(cfg_.lr, cfg_.beta1, cfg_.beta2, cfg_.tau));
    ++step_count_;
  }

  /// The state buffers: {"m", "v"}.
  std::vector<state_tensor> state() { return {{"m", m_.span()}, {"v", v_.span()}}; }

  /// The outer steps taken so far.
  std::int64_t step_count() const noexcept { return step_count_; }

  /// Restores the step count from a checkpoint.
  void set_step_count(std::int64_t steps) {
    check_step_count(Derived::name, steps);
    step_count_ = steps;
  }

  /// The number of elements of the anchor shard.
  std::size_t size() const noexcept { return size_; }

  /// The hyper-parameters.
  const config& settings() const noexcept { return cfg_; }

 private:
  static config validated(const config& cfg) {
    check_lr(Derived::name, cfg.lr);
    check_unit_interval(Derived::name, "beta1", cfg.beta1);
    check_unit_interval(Derived::name, "beta2", cfg.beta2);
    check_tau(Derived::name, cfg.tau);
    check_initial_v(Derived::name, cfg);
    return cfg;
  }

  config cfg_;
  std::size_t size_ = 0;
  std::int64_t step_count_ = 0;
  aligned_buffer<float> m_;
  aligned_buffer<float> v_;
};

}  // namespace detail

/// FedAdam: m ← β1·m + (1−β1)·d; v ← β2·v + (1−β2)·d²; θ ← θ − η·m / (√v + τ).
class fedadam : public detail::adaptive_rule<fedadam> {
 public:
  using adaptive_rule::adaptive_rule;
  /// The rule's name in messages and logs.
  static constexpr std::string_view name = "fedadam";
  /// The host loop of one step.
  static constexpr auto kernel = &kernels::outer_fedadam_step;
};

/// FedYogi: as FedAdam, with v ← v − (1−β2)·d²·sign(v − d²).
class fedyogi : public detail::adaptive_rule<fedyogi> {
 public:
  using adaptive_rule::adaptive_rule;
  /// The rule's name in messages and logs.
  static constexpr std::string_view name = "fedyogi";
  /// The host loop of one step.
  static constexpr auto kernel = &kernels::outer_fedyogi_step;
};

static_assert(OuterRule<outer_sgd>);
static_assert(OuterRule<nesterov>);
static_assert(OuterRule<fedmom>);
static_assert(OuterRule<fedadam>);
static_assert(OuterRule<fedyogi>);

}  // namespace fedshard::federation
