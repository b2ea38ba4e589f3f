#pragma once
/// The host-compiler side of torch_device_bridge.hpp: a torch_model as a bridge::device_model,
/// its steps run through a bridge::device_context (torch_model's device path: parameters and
/// gradients are torch::from_blob views of the CUDA buffers, and torch computes on the
/// trainer's compute stream). Needs FEDSHARD_TORCH_CUDA.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <utility>
#include <vector>

#include "torch_device_bridge.hpp"
#include "torch_model.hpp"

namespace fedshard_torch {

/// torch_model<Net, Batch> with batches made by index (batch(i); i = -1 for evaluation).
template <class Net, class Batch = batch>
class torch_device_model final : public bridge::device_model {
 public:
  using model_type = torch_model<Net, Batch>;

  torch_device_model(model_type m, std::function<Batch(std::int64_t)> batch)
      : m_(std::move(m)), batch_(std::move(batch)) {}

  /// The torch_model (its net() holds the trained values after the run).
  model_type& model() noexcept { return m_; }

  std::vector<fedshard::unit_spec> units() const override { return m_.units(); }
  std::vector<float> initial_values(const fedshard::flat_layout& layout,
                                    std::size_t u) const override {
    return m_.initial_values(layout, u);
  }
  float forward_backward(bridge::device_step& step, std::int64_t i) override {
    bridge::device_context ctx(step);
    return m_.forward_backward(ctx, batch_(i));
  }
  float evaluate(bridge::device_step& step, std::int64_t i) override {
    bridge::device_context ctx(step);
    return m_.evaluate(ctx, batch_(i));
  }
  std::int64_t tokens(std::int64_t i) const override { return m_.tokens(batch_(i)); }
  void load_unit(const fedshard::flat_layout& layout, std::size_t u,
                 std::span<const float> values) override {
    m_.load_unit(layout, u, values);
  }

 private:
  model_type m_;
  std::function<Batch(std::int64_t)> batch_;
};

}  // namespace fedshard_torch
