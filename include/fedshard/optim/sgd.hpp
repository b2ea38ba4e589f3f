#pragma once
/// SGD with momentum, dampening, Nesterov and weight decay on one rank's f32 shard, with the
/// momentum buffer of that shard.
///
/// Each step is torch.optim.SGD's (foreach=False, maximize=False), bit for bit as torch's
/// vectorised CPU kernels compute it; kernels/sgd.hpp states the formulas and the rounding
/// of every op. The hyper-parameters are floats: torch gets the same results when its
/// Python hyper-parameters hold the same (float) values. As in torch, the first step sets
/// the momentum buffer to the gradient (weight decay included) instead of decaying it;
/// "first" means step_count() == 0, so a restored checkpoint sets the count too.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "fedshard/core/buffer.hpp"
#include "fedshard/error.hpp"
#include "fedshard/kernels/sgd.hpp"
#include "fedshard/optim/optimizer.hpp"

namespace fedshard::optim {

/// SGD on a shard of n floats; models ShardOptimizer.
class sgd {
 public:
  /// torch.optim.SGD's hyper-parameters and defaults (lr is the base rate of the schedule).
  struct config {
    float lr = 1e-3f;
    float momentum = 0.0f;
    float dampening = 0.0f;
    float weight_decay = 0.0f;
    bool nesterov = false;
  };

  /// Validates cfg as torch does and allocates the momentum buffer (when momentum != 0).
  explicit sgd(config cfg, std::size_t n)
      : cfg_(validated(cfg)), size_(n), momentum_buffer_(cfg.momentum != 0.0f ? n : 0) {}

  /// One SGD step of the shard with learning rate lr.
  void step(std::span<float> param, std::span<const float> grad, float lr) {
    FEDSHARD_EXPECTS(param.size() == size_, "sgd::step: param must have ", size_,
                     " elements (the shard size), found ", param.size());
    FEDSHARD_EXPECTS(grad.size() == size_, "sgd::step: grad must have ", size_,
                     " elements (the shard size), found ", grad.size());
    FEDSHARD_EXPECTS(lr >= 0.0f, "sgd::step: lr must be >= 0, found ", lr);
    const kernels::sgd_scalars s = kernels::make_sgd_scalars(
        lr, cfg_.momentum, cfg_.dampening, cfg_.weight_decay, cfg_.nesterov, step_count_ == 0);
    kernels::sgd_step(param, grad, momentum_buffer_.span(), s);
    ++step_count_;
  }

  /// The state buffers: {"momentum_buffer"} when momentum != 0, else none.
  std::vector<state_tensor> state() {
    std::vector<state_tensor> out;
    if (cfg_.momentum != 0.0f) out.push_back({"momentum_buffer", momentum_buffer_.span()});
    return out;
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
  static config validated(const config& cfg) {
    FEDSHARD_EXPECTS(cfg.lr >= 0.0f, "sgd: config.lr must be >= 0, found ", cfg.lr);
    FEDSHARD_EXPECTS(cfg.momentum >= 0.0f, "sgd: config.momentum must be >= 0, found ",
                     cfg.momentum);
    FEDSHARD_EXPECTS(std::isfinite(cfg.dampening),
                     "sgd: config.dampening must be a finite number, found ", cfg.dampening);
    FEDSHARD_EXPECTS(cfg.weight_decay >= 0.0f, "sgd: config.weight_decay must be >= 0, found ",
                     cfg.weight_decay);
    FEDSHARD_EXPECTS(!cfg.nesterov || (cfg.momentum > 0.0f && cfg.dampening == 0.0f),
                     "sgd: config.nesterov requires momentum > 0 and dampening == 0, found "
                     "momentum ",
                     cfg.momentum, " and dampening ", cfg.dampening);
    return cfg;
  }

  config cfg_;
  std::size_t size_ = 0;
  std::int64_t step_count_ = 0;
  aligned_buffer<float> momentum_buffer_;
};

static_assert(ShardOptimizer<sgd>);

}  // namespace fedshard::optim
