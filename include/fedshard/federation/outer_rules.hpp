#pragma once
/// Outer optimizers of a federation: the rules that move the anchor (the model every group
/// starts a round from) along the mean pseudo-gradient d = mean over groups of
/// (θ_anchor − θ_group), with outer state sharded like the parameters: each rank builds a
/// rule for its own anchor shard and keeps that shard's state only.
///
/// Rules:
///  - `as_outer<O>`: any shard optimizer O (optim/optimizer.hpp) as the outer one, O's own
///    step with the anchor as its parameters, d as its gradient and config.lr as its
///    learning rate (torchft's DiLoCo takes any torch optimizer so).
///  - outer_sgd (FedAvg; lr 1 is plain averaging), nesterov (DiLoCo) and fedmom (heavy
///    ball): optim::sgd run so (optimizer_rule below), with its momentum buffer starting at
///    zero and decayed from the first step on (optim::momentum_start::zero); kernels/sgd.hpp
///    rounds every op, kernels/outer.hpp states the formulas.
///  - fedadam and fedyogi: rules of their own (kernels/outer.hpp). Their first moment m
///    starts at zero, their second moment v at τ² by default
///    (`adaptive_config::initial_v`), as v₋₁ ≥ τ² in Algorithm 2 of Reddi et al. (2021,
///    "Adaptive Federated Optimization"), so that the first steps are not oversized where
///    d is tiny. No bias correction is applied (PAPERS.md section 3).
///
/// An OuterRule R provides:
///  1. `R::config`, a default-constructible aggregate of hyper-parameters that holds at
///     least a float `lr`, with the paper's defaults.
///  2. `R(config, n)`: validates the config (fedshard::invalid_argument naming the bad
///     value) and owns outer state for an anchor shard of n elements, each buffer set to
///     its documented start (zero, or τ² for v); `R()` is R(config{}, 0).
///  3. `step(anchor, d)`: one outer update, in place, of the n elements of anchor
///     (std::span<float>) from the mean pseudo-gradient d (std::span<const float>); throws
///     invalid_argument, before changing anything, unless both spans hold n elements.
///     d does not overlap anchor; the rules of this file other than as_outer<O> also take
///     d that is anchor itself.
///  3b. Memory spaces: `R::in_space<S>` is the same rule for an anchor shard in memory space
///     S (space/memory_space.hpp), with R's config: built from (config, n, S&), its state in
///     S, `step(anchor, d, stream)` queued on a stream of S; R itself keeps its state in host
///     memory.
///  4. Element-wise updates: element i's update reads only anchor[i], d[i], element i of
///     each state buffer, the hyper-parameters and the step count (which every shard's rule
///     counts alike; only as_outer<O> may read it). So a shard split among any number of
///     rule objects (ranks) evolves bit for bit as the whole would.
///  5. `state()`: a std::vector<state_tensor>, one per state buffer, each of n writable
///     floats aliasing the live state, in a fixed order and with fixed names (for
///     checkpoints, whose restore overwrites the starting values): none for outer_sgd,
///     {"momentum"} for nesterov and fedmom, {"m", "v"} for fedadam and fedyogi, O's own
///     for as_outer<O>.
///  6. `step_count()` (std::int64_t): the outer steps taken so far; `set_step_count(s)`
///     (s >= 0) restores it with the state buffers from a checkpoint.
///  7. `size()` (std::size_t): n.
///  8. `R::name`, a static constexpr std::string_view naming the rule.
///  9. Movable.

#include <algorithm>
#include <array>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "fedshard/core/buffer.hpp"
#include "fedshard/error.hpp"
#include "fedshard/kernels/for_each.hpp"
#include "fedshard/kernels/outer.hpp"
#include "fedshard/optim/optimizer.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/space/host_space.hpp"
#include "fedshard/space/memory_space.hpp"

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

/// Optimizer O for a shard of n elements with config cfg, in space s where O is built with
/// a space (ShardOptimizer requirement 9), else in host memory of its own.
template <class O, space::MemorySpace S>
O make_optimizer(const typename O::config& cfg, std::size_t n, S& s) {
  if constexpr (std::constructible_from<O, const typename O::config&, std::size_t, S&>)
    return O(cfg, n, s);
  else
    return O(cfg, n);
}

/// An outer rule that is the shard optimizer Spec::optimizer stepping the anchor: the anchor
/// shard is its parameter shard, d its gradient, and config.lr its learning rate on every
/// step; its state and step count are the rule's. Spec supplies:
///  - `optimizer`, a ShardOptimizer (optim/optimizer.hpp), and the rule's `config` and
///    `name`;
///  - `validate(cfg)`, which throws invalid_argument naming a bad value;
///  - `optimizer_config(cfg)`, the optimizer's config under the rule's cfg;
///  - `state_name(name)`, the rule's name (std::string) for the optimizer's state `name`.
template <class Spec, space::MemorySpace S = space::host_space>
class optimizer_rule {
 public:
  /// The hyper-parameters.
  using config = typename Spec::config;
  /// The optimizer that steps the anchor, in memory space S.
  using optimizer_type = optim::in_space_t<typename Spec::optimizer, S>;
  /// The rule for an anchor shard in memory space T.
  template <space::MemorySpace T>
  using in_space = optimizer_rule<Spec, T>;

  /// The rule's name in messages and logs.
  static constexpr std::string_view name = Spec::name;

  /// A rule for an empty shard with the default config.
  optimizer_rule() : optimizer_rule(config{}, 0) {}

  /// Validates cfg and builds the optimizer for n elements, its state in s.
  optimizer_rule(config cfg, std::size_t n, S& s)
      : cfg_(validated(cfg)),
        optimizer_(make_optimizer<optimizer_type>(Spec::optimizer_config(cfg_), n, s)) {}
  /// With a space of its own.
  explicit optimizer_rule(config cfg, std::size_t n)
      : cfg_(validated(cfg)), optimizer_(Spec::optimizer_config(cfg_), n) {}

  /// One outer step of the anchor shard, queued on stream st of the space.
  void step(std::span<float> anchor, std::span<const float> d, typename S::stream& st) {
    check_step_sizes(name, size(), anchor.size(), d.size());
    if constexpr (std::is_same_v<S, space::host_space>)
      optimizer_.step(anchor, d, cfg_.lr);  // done when it returns; st has nothing queued
    else
      optimizer_.step(anchor, d, cfg_.lr, st);
  }
  /// step() on the optimizer's own stream (done when it returns in host_space).
  void step(std::span<float> anchor, std::span<const float> d) {
    check_step_sizes(name, size(), anchor.size(), d.size());
    optimizer_.step(anchor, d, cfg_.lr);
  }

  /// The optimizer's state buffers, renamed by Spec::state_name.
  std::vector<state_tensor> state() {
    std::vector<state_tensor> out = optimizer_.state();
    for (state_tensor& t : out) t.name = Spec::state_name(t.name);
    return out;
  }

  /// The outer steps taken so far (the optimizer's step count).
  std::int64_t step_count() const noexcept { return optimizer_.step_count(); }

  /// Restores the step count from a checkpoint.
  void set_step_count(std::int64_t steps) {
    check_step_count(name, steps);
    optimizer_.set_step_count(steps);
  }

  /// The number of elements of the anchor shard.
  std::size_t size() const noexcept { return optimizer_.size(); }

  /// The hyper-parameters.
  const config& settings() const noexcept { return cfg_; }

  /// The optimizer that steps the anchor.
  const optimizer_type& optimizer() const noexcept { return optimizer_; }

 private:
  static config validated(const config& cfg) {
    Spec::validate(cfg);
    return cfg;
  }

  config cfg_;
  optimizer_type optimizer_;
};

/// as_outer<O>'s part of optimizer_rule: O's config, validation and state names.
template <class O>
struct as_outer_spec {
  using optimizer = O;
  using config = typename O::config;
  static constexpr std::string_view name = "as_outer";
  static void validate(const config& cfg) { check_lr(name, static_cast<float>(cfg.lr)); }
  static const config& optimizer_config(const config& cfg) noexcept { return cfg; }
  static std::string state_name(const std::string& n) { return n; }
};

/// outer_sgd's part of optimizer_rule: optim::sgd without momentum, so without state.
struct outer_sgd_spec {
  using optimizer = optim::sgd;
  /// The learning rate η.
  struct config {
    float lr = 1.0f;
  };
  static constexpr std::string_view name = "outer_sgd";
  static void validate(const config& cfg) { check_lr(name, cfg.lr); }
  static optim::sgd_config optimizer_config(const config& cfg) noexcept { return {.lr = cfg.lr}; }
  static std::string state_name(const std::string& n) { return n; }
};

/// nesterov's and fedmom's part of optimizer_rule: optim::sgd with momentum μ, Nesterov's
/// or not (Traits::nesterov), no dampening or weight decay, and a momentum buffer that
/// starts at zero and is named "momentum"; Traits also gives `name` and the default `lr`.
template <class Traits>
struct momentum_spec {
  using optimizer = optim::sgd;
  /// The learning rate η and the momentum μ.
  struct config {
    float lr = Traits::lr;
    float momentum = 0.9f;
  };
  static constexpr std::string_view name = Traits::name;
  static void validate(const config& cfg) {
    check_lr(name, cfg.lr);
    check_unit_interval(name, "momentum", cfg.momentum);
  }
  static optim::sgd_config optimizer_config(const config& cfg) noexcept {
    return {.lr = cfg.lr,
            .momentum = cfg.momentum,
            .nesterov = Traits::nesterov,
            .start = optim::momentum_start::zero};
  }
  static std::string state_name(const std::string&) { return "momentum"; }
};

}  // namespace detail

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

/// What fedadam and fedyogi are: validated hyper-parameters, a step count, and K state
/// buffers of n floats, stepped element by element by a functor of kernels/outer.hpp.
/// Spec supplies the rest:
///  - `config`, `name`, and `state_names`, a std::array of the K buffer names;
///  - `validate(cfg)`, which throws invalid_argument naming a bad value;
///  - `update(cfg)`, the element functor of one step, called as f(θ, d, state...);
///  - `start(cfg)`, a std::array of the K values the buffers start at.
template <class Spec, space::MemorySpace S = space::host_space>
class outer_rule {
 public:
  /// The hyper-parameters.
  using config = typename Spec::config;
  /// The rule for an anchor shard in memory space T.
  template <space::MemorySpace T>
  using in_space = outer_rule<Spec, T>;

  /// The rule's name in messages and logs.
  static constexpr std::string_view name = Spec::name;

  /// A rule for an empty shard with the default config.
  outer_rule() : outer_rule(config{}, 0) {}

  /// Validates cfg and allocates the state buffers of n elements in s at their start values.
  outer_rule(config cfg, std::size_t n, S& s)
      : outer_rule(validated(cfg), n, space::space_ref<S>(s)) {}
  /// With a space of its own (default-constructed S).
  explicit outer_rule(config cfg, std::size_t n)
      : outer_rule(validated(cfg), n, space::space_ref<S>::make()) {}

  /// One outer step of the anchor shard, queued on stream st of the space.
  void step(std::span<float> anchor, std::span<const float> d, typename S::stream& st) {
    check_step_sizes(name, size_, anchor.size(), d.size());
    step_elements(st, anchor, d, std::make_index_sequence<states>{});
    ++step_count_;
  }
  /// step() on the rule's own stream (done when it returns in host_space).
  void step(std::span<float> anchor, std::span<const float> d) {
    step(anchor, d, stream_);
    space_->synchronize(stream_);
  }

  /// The state buffers, named Spec::state_names in that order.
  std::vector<state_tensor> state() {
    std::vector<state_tensor> out;
    for (std::size_t k = 0; k < states; ++k)
      out.push_back({std::string(Spec::state_names[k]), state_[k].span()});
    return out;
  }

  /// The outer steps taken so far.
  std::int64_t step_count() const noexcept { return step_count_; }

  /// Restores the step count from a checkpoint.
  void set_step_count(std::int64_t steps) {
    check_step_count(name, steps);
    step_count_ = steps;
  }

  /// The number of elements of the anchor shard.
  std::size_t size() const noexcept { return size_; }

  /// The hyper-parameters.
  const config& settings() const noexcept { return cfg_; }

 private:
  static constexpr std::size_t states = Spec::state_names.size();

  outer_rule(config cfg, std::size_t n, space::space_ref<S> sr)
      : space_(std::move(sr)), stream_(space_->make_stream()), cfg_(cfg), size_(n) {
    const auto start = Spec::start(cfg_);
    for (std::size_t k = 0; k < states; ++k) {
      state_[k] = space_->template allocate<float>(n);
      if (start[k] != 0.0f) space_->fill(stream_, state_[k].view(), start[k]);
    }
    space_->synchronize(stream_);
  }

  static config validated(const config& cfg) {
    Spec::validate(cfg);
    return cfg;
  }

  template <std::size_t... K>
  void step_elements(typename S::stream& st, std::span<float> anchor, std::span<const float> d,
                     std::index_sequence<K...>) {
    space_->for_each(st, Spec::update(cfg_), anchor, d, state_[K].span()...);
  }

  space::space_ref<S> space_;  // first: the buffers below go back to it
  typename S::stream stream_;
  config cfg_;
  std::size_t size_ = 0;
  std::int64_t step_count_ = 0;
  std::array<typename S::template buffer<float>, states> state_;
};

/// fedadam's and fedyogi's part of outer_rule: the moments m (from zero) and v (from
/// initial_v(cfg)). They differ in the element functor Update and in Traits::name.
template <class Update, class Traits>
struct adaptive_spec {
  using config = adaptive_config;
  static constexpr std::string_view name = Traits::name;
  static constexpr std::array<std::string_view, 2> state_names{"m", "v"};
  static void validate(const config& cfg) {
    check_lr(name, cfg.lr);
    check_unit_interval(name, "beta1", cfg.beta1);
    check_unit_interval(name, "beta2", cfg.beta2);
    check_tau(name, cfg.tau);
    check_initial_v(name, cfg);
  }
  static Update update(const config& cfg) {
    return {kernels::make_outer_adaptive_scalars(cfg.lr, cfg.beta1, cfg.beta2, cfg.tau)};
  }
  static std::array<float, 2> start(const config& cfg) { return {0.0f, initial_v(cfg)}; }
};

/// DiLoCo's values for nesterov.
struct nesterov_traits {
  static constexpr std::string_view name = "nesterov";
  static constexpr float lr = 0.7f;
  static constexpr bool nesterov = true;
};

/// FedMom's defaults.
struct fedmom_traits {
  static constexpr std::string_view name = "fedmom";
  static constexpr float lr = 1.0f;
  static constexpr bool nesterov = false;
};

/// FedAdam's name.
struct fedadam_traits {
  static constexpr std::string_view name = "fedadam";
};

/// FedYogi's name.
struct fedyogi_traits {
  static constexpr std::string_view name = "fedyogi";
};

}  // namespace detail

/// Shard optimizer O (optim/optimizer.hpp) as the outer optimizer: each outer step is one
/// step of O with the anchor shard as its parameters, the mean pseudo-gradient d as its
/// gradient and `config.lr` (O's config) as its learning rate; the state is O's, under O's
/// names. E.g. `outer_optimizer<as_outer<optim::adamw>>`. d must not overlap the anchor.
template <optim::ShardOptimizer O>
using as_outer = detail::optimizer_rule<detail::as_outer_spec<O>>;

/// Outer SGD (FedAvg): θ ← θ − η·d; with η = 1 the anchor becomes the groups' mean model.
/// Default lr 1. optim::sgd without momentum.
using outer_sgd = detail::optimizer_rule<detail::outer_sgd_spec>;

/// Nesterov momentum, DiLoCo's outer optimizer: m ← μ·m + d; θ ← θ − η·(μ·m + d). Defaults
/// are DiLoCo's: lr 0.7, momentum 0.9. optim::sgd with nesterov, its buffer from zero.
using nesterov = detail::optimizer_rule<detail::momentum_spec<detail::nesterov_traits>>;

/// Heavy-ball momentum (FedMom): m ← μ·m + d; θ ← θ − η·m. Defaults lr 1, momentum 0.9.
/// optim::sgd with momentum, its buffer from zero.
using fedmom = detail::optimizer_rule<detail::momentum_spec<detail::fedmom_traits>>;

/// FedAdam: m ← β1·m + (1−β1)·d; v ← β2·v + (1−β2)·d²; θ ← θ − η·m / (√v + τ).
using fedadam = detail::outer_rule<
    detail::adaptive_spec<kernels::outer_fedadam_update, detail::fedadam_traits>>;

/// FedYogi: as FedAdam, with v ← v − (1−β2)·d²·sign(v − d²).
using fedyogi = detail::outer_rule<
    detail::adaptive_spec<kernels::outer_fedyogi_update, detail::fedyogi_traits>>;

static_assert(OuterRule<outer_sgd>);
static_assert(OuterRule<nesterov>);
static_assert(OuterRule<fedmom>);
static_assert(OuterRule<fedadam>);
static_assert(OuterRule<fedyogi>);
static_assert(OuterRule<as_outer<optim::sgd>>);

}  // namespace fedshard::federation
