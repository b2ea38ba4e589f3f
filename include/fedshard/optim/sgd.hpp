#pragma once
/// SGD with momentum, dampening, Nesterov and weight decay on one rank's f32 shard, with the
/// momentum buffer of that shard.
///
/// Each step is torch.optim.SGD's (foreach=False, maximize=False), bit for bit as torch's
/// vectorised CPU kernels compute it; kernels/sgd.hpp states the formulas and the rounding
/// of every op. The hyper-parameters are floats: torch gets the same results when its
/// Python hyper-parameters hold the same (float) values. As in torch, the first step sets
/// the momentum buffer to the gradient (weight decay included) instead of decaying it;
/// "first" means step_count() == 0, so a restored checkpoint sets the count too. With
/// `momentum_start::zero` the buffer starts at zero instead and every step decays it, the
/// first included: the outer optimizers of federation/outer_rules.hpp run SGD so on the
/// pseudo-gradient.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <new>
#include <span>
#include <utility>
#include <vector>

#include "fedshard/core/buffer.hpp"
#include "fedshard/error.hpp"
#include "fedshard/kernels/sgd.hpp"
#include "fedshard/optim/optimizer.hpp"
#include "fedshard/space/host_space.hpp"
#include "fedshard/space/memory_space.hpp"

namespace fedshard::optim {

/// Where SGD's momentum buffer starts.
enum class momentum_start {
  /// torch's: no buffer before the first step, which sets it to the gradient.
  first_gradient,
  /// A buffer of zeros, kept for every momentum (0 included), that every step decays and
  /// adds to: buf = momentum * buf + (1 - dampening) * g from the first step on.
  zero,
};

/// torch.optim.SGD's hyper-parameters and defaults (lr is the base rate of the schedule),
/// and where the momentum buffer starts (torch's way by default).
struct sgd_config {
  float lr = 1e-3f;
  float momentum = 0.0f;
  float dampening = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
  momentum_start start = momentum_start::first_gradient;
};

/// SGD on a shard of n floats in memory space S; models ShardOptimizer (sgd is the host
/// one).
template <space::MemorySpace S = space::host_space>
class basic_sgd : public space::same_in_every_space<basic_sgd> {
 public:
  using config = sgd_config;

  /// Validates cfg as torch does and allocates the zeroed momentum buffer in s (when
  /// has_buffer(cfg)).
  basic_sgd(config cfg, std::size_t n, S& s)
      : basic_sgd(validated(cfg), n, space::space_ref<S>(s)) {}
  /// With a space of its own (default-constructed S).
  basic_sgd(config cfg, std::size_t n)
      : basic_sgd(validated(cfg), n, space::space_ref<S>::make()) {}
  basic_sgd(basic_sgd&&) noexcept = default;
  /// Takes o's state. The buffer it had go back to its space before that space goes (an
  /// owned one): destroyed in reverse order, then moved into, where a member-wise assignment
  /// would drop the space first and then hand the buffer back to it.
  basic_sgd& operator=(basic_sgd&& o) noexcept {
    if (this != &o) {
      this->~basic_sgd();
      ::new (static_cast<void*>(this)) basic_sgd(std::move(o));
    }
    return *this;
  }

  /// One SGD step of the shard with learning rate lr, queued on stream st of the space.
  void step(std::span<float> param, std::span<const float> grad, float lr, typename S::stream& st) {
    FEDSHARD_EXPECTS(param.size() == size_, "sgd::step: param must have ", size_,
                     " elements (the shard size), found ", param.size());
    FEDSHARD_EXPECTS(grad.size() == size_, "sgd::step: grad must have ", size_,
                     " elements (the shard size), found ", grad.size());
    FEDSHARD_EXPECTS(lr >= 0.0f, "sgd::step: lr must be >= 0, found ", lr);
    const bool first = cfg_.start == momentum_start::first_gradient && step_count_ == 0;
    const kernels::sgd_scalars s = kernels::make_sgd_scalars(
        lr, cfg_.momentum, cfg_.dampening, cfg_.weight_decay, cfg_.nesterov, first);
    if (has_buffer(cfg_))
      space_->for_each(st, kernels::sgd_update{s}, param, grad, momentum_buffer_.span());
    else
      space_->for_each(st, kernels::sgd_update{s}, param, grad);
    ++step_count_;
  }
  /// step() on the optimizer's own stream (done when it returns in host_space).
  void step(std::span<float> param, std::span<const float> grad, float lr) {
    step(param, grad, lr, stream_);
    space_->synchronize(stream_);
  }

  /// The state buffers: {"momentum_buffer"} when has_buffer(settings()), else none.
  std::vector<state_tensor> state() {
    std::vector<state_tensor> out;
    if (has_buffer(cfg_)) out.push_back({"momentum_buffer", momentum_buffer_.span()});
    return out;
  }

  /// Whether SGD under cfg keeps a momentum buffer: momentum != 0, or a buffer that starts
  /// at zero.
  static bool has_buffer(const config& cfg) noexcept {
    return cfg.momentum != 0.0f || cfg.start == momentum_start::zero;
  }

  /// The steps taken so far.
  std::int64_t step_count() const noexcept { return step_count_; }

  /// Restores the step count from a checkpoint (0 makes the next step the first).
  void set_step_count(std::int64_t steps) {
    FEDSHARD_EXPECTS(steps >= 0, "sgd::set_step_count: steps must be >= 0, found ", steps);
    step_count_ = steps;
  }

  /// The number of elements of the shard.
  std::size_t size() const noexcept { return size_; }

  /// The hyper-parameters.
  const config& settings() const noexcept { return cfg_; }

 private:
  basic_sgd(config cfg, std::size_t n, space::space_ref<S> sr)
      : space_(std::move(sr)),
        stream_(space_->make_stream()),
        cfg_(cfg),
        size_(n),
        momentum_buffer_(space_->template allocate<float>(has_buffer(cfg) ? n : 0)) {}

  static config validated(const config& cfg) {
    FEDSHARD_EXPECTS(cfg.lr >= 0.0f, "sgd: config.lr must be >= 0, found ", cfg.lr);
    FEDSHARD_EXPECTS(cfg.momentum >= 0.0f, "sgd: config.momentum must be >= 0, found ",
                     cfg.momentum);
    FEDSHARD_EXPECTS(std::isfinite(cfg.dampening),
                     "sgd: config.dampening must be a finite number, found ", cfg.dampening);
    FEDSHARD_EXPECTS(cfg.weight_decay >= 0.0f, "sgd: config.weight_decay must be >= 0, found ",
                     cfg.weight_decay);
    FEDSHARD_EXPECTS(
        cfg.start == momentum_start::first_gradient || cfg.start == momentum_start::zero,
        "sgd: config.start must be momentum_start::first_gradient or zero, found ",
        static_cast<int>(cfg.start));
    if (cfg.start == momentum_start::zero)
      FEDSHARD_EXPECTS(!cfg.nesterov || cfg.dampening == 0.0f,
                       "sgd: config.nesterov requires dampening == 0, found dampening ",
                       cfg.dampening);
    else
      FEDSHARD_EXPECTS(!cfg.nesterov || (cfg.momentum > 0.0f && cfg.dampening == 0.0f),
                       "sgd: config.nesterov requires momentum > 0 and dampening == 0, found "
                       "momentum ",
                       cfg.momentum, " and dampening ", cfg.dampening);
    return cfg;
  }

  space::space_ref<S> space_;  // first: the buffer below goes back to it
  typename S::stream stream_;
  config cfg_;
  std::size_t size_ = 0;
  std::int64_t step_count_ = 0;
  typename S::template buffer<float> momentum_buffer_;
};

/// SGD on a host shard.
using sgd = basic_sgd<>;

static_assert(ShardOptimizer<sgd>);

}  // namespace fedshard::optim
