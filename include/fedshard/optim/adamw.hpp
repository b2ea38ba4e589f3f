#pragma once
/// AdamW on one rank's f32 shard, with the two moment buffers of that shard.
///
/// Each step is torch.optim.AdamW's (foreach=False, fused=False, amsgrad=False,
/// maximize=False), bit for bit as torch's vectorised CPU kernels compute it;
/// kernels/adamw.hpp states the formulas and the rounding of every op. The hyper-parameters
/// are floats: torch gets the same results when its Python hyper-parameters hold the same
/// (float) values, e.g. betas=(float32(0.9), float32(0.999)). The step count is an exact
/// integer (torch keeps it in a float32 tensor, which stops counting at 2^24).

#include <cstddef>
#include <cstdint>
#include <new>
#include <span>
#include <utility>
#include <vector>

#include "fedshard/core/buffer.hpp"
#include "fedshard/error.hpp"
#include "fedshard/kernels/adamw.hpp"
#include "fedshard/optim/optimizer.hpp"
#include "fedshard/space/host_space.hpp"
#include "fedshard/space/memory_space.hpp"

namespace fedshard::optim {

/// torch.optim.AdamW's hyper-parameters and defaults (lr is the base rate of the schedule).
struct adamw_config {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 1e-2f;
};

/// AdamW on a shard of n floats in memory space S; models ShardOptimizer (adamw is the host
/// one).
template <space::MemorySpace S = space::host_space>
class basic_adamw : public space::same_in_every_space<basic_adamw> {
 public:
  using config = adamw_config;

  /// Validates cfg as torch does and allocates the two zeroed moment buffers in s.
  basic_adamw(config cfg, std::size_t n, S& s)
      : basic_adamw(validated(cfg), n, space::space_ref<S>(s)) {}
  /// With a space of its own (default-constructed S).
  basic_adamw(config cfg, std::size_t n)
      : basic_adamw(validated(cfg), n, space::space_ref<S>::make()) {}
  basic_adamw(basic_adamw&&) noexcept = default;
  /// Takes o's state. The buffers it had go back to its space before that space goes (an
  /// owned one): destroyed in reverse order, then moved into, where a member-wise assignment
  /// would drop the space first and then hand the buffers back to it.
  basic_adamw& operator=(basic_adamw&& o) noexcept {
    if (this != &o) {
      this->~basic_adamw();
      ::new (static_cast<void*>(this)) basic_adamw(std::move(o));
    }
    return *this;
  }

  /// One AdamW step of the shard with learning rate lr, queued on stream st of the space.
  void step(std::span<float> param, std::span<const float> grad, float lr, typename S::stream& st) {
    FEDSHARD_EXPECTS(param.size() == size_, "adamw::step: param must have ", size_,
                     " elements (the shard size), found ", param.size());
    FEDSHARD_EXPECTS(grad.size() == size_, "adamw::step: grad must have ", size_,
                     " elements (the shard size), found ", grad.size());
    FEDSHARD_EXPECTS(lr >= 0.0f, "adamw::step: lr must be >= 0, found ", lr);
    const kernels::adamw_scalars s = kernels::make_adamw_scalars(
        lr, cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay, step_count_ + 1);
    space_->for_each(st, kernels::adamw_update{s}, param, grad, exp_avg_.span(),
                     exp_avg_sq_.span());
    ++step_count_;
  }
  /// step() on the optimizer's own stream (done when it returns in host_space).
  void step(std::span<float> param, std::span<const float> grad, float lr) {
    step(param, grad, lr, stream_);
    space_->synchronize(stream_);
  }

  /// The state buffers: {"exp_avg", "exp_avg_sq"}.
  std::vector<state_tensor> state() {
    return {{"exp_avg", exp_avg_.span()}, {"exp_avg_sq", exp_avg_sq_.span()}};
  }

  /// The steps taken so far (torch's state["step"]).
  std::int64_t step_count() const noexcept { return step_count_; }

  /// Restores the step count from a checkpoint; it sets the next bias corrections.
  void set_step_count(std::int64_t steps) {
    FEDSHARD_EXPECTS(steps >= 0, "adamw::set_step_count: steps must be >= 0, found ", steps);
    step_count_ = steps;
  }

  /// The number of elements of the shard.
  std::size_t size() const noexcept { return size_; }

  /// The hyper-parameters.
  const config& settings() const noexcept { return cfg_; }

 private:
  basic_adamw(config cfg, std::size_t n, space::space_ref<S> sr)
      : space_(std::move(sr)),
        stream_(space_->make_stream()),
        cfg_(cfg),
        size_(n),
        exp_avg_(space_->template allocate<float>(n)),
        exp_avg_sq_(space_->template allocate<float>(n)) {}

  static config validated(const config& cfg) {
    FEDSHARD_EXPECTS(cfg.lr >= 0.0f, "adamw: config.lr must be >= 0, found ", cfg.lr);
    FEDSHARD_EXPECTS(cfg.beta1 >= 0.0f && cfg.beta1 < 1.0f,
                     "adamw: config.beta1 must be in [0, 1), found ", cfg.beta1);
    FEDSHARD_EXPECTS(cfg.beta2 >= 0.0f && cfg.beta2 < 1.0f,
                     "adamw: config.beta2 must be in [0, 1), found ", cfg.beta2);
    FEDSHARD_EXPECTS(cfg.eps >= 0.0f, "adamw: config.eps must be >= 0, found ", cfg.eps);
    FEDSHARD_EXPECTS(cfg.weight_decay >= 0.0f, "adamw: config.weight_decay must be >= 0, found ",
                     cfg.weight_decay);
    return cfg;
  }

  space::space_ref<S> space_;  // first: the buffers below go back to it
  typename S::stream stream_;
  config cfg_;
  std::size_t size_ = 0;
  std::int64_t step_count_ = 0;
  typename S::template buffer<float> exp_avg_;
  typename S::template buffer<float> exp_avg_sq_;
};

/// AdamW on a host shard.
using adamw = basic_adamw<>;

static_assert(ShardOptimizer<adamw>);

}  // namespace fedshard::optim
