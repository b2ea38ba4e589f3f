#pragma once
/// A fedshard::Model backed by a LibTorch module: torch computes forward and backward,
/// fedshard owns the parameters and gradients and moves them.
///
/// Units: every submodule that owns parameters itself (e.g. each torch::nn::Linear of a
/// Sequential, with its weight and bias) is one unit, in torch's module order; a unit's
/// tensors are the submodule's parameters in registration order, and a tensor's qualified
/// name "unit.tensor" is torch's parameter name ("0.weight"). The starting values are the
/// module's own, so build one module and give every rank a deep_copy of it.
///
/// In a step, every parameter is pointed at a torch::from_blob view of its slice of the
/// gathered unit (no copy) and its .grad at a view of the unit's gradient buffer, which
/// autograd accumulates into in place. Afterwards the module's parameters point back at the
/// module's own storage, which keeps the starting values until load_from copies the trained
/// ones in.
///
/// Limits: f32 CPU parameters that require grad; module buffers (e.g. batch-norm running
/// statistics) are not parameters, so each rank keeps its own; a copy of a torch_model
/// shares the module.

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/shard/flat_layout.hpp"
#include "fedshard/trainer/model.hpp"

namespace fedshard_torch {

/// Inputs and targets of a batch; the first dimension counts samples.
struct batch {
  torch::Tensor input;
  torch::Tensor target;
};

/// A deep copy of a module holder (torch::nn::Sequential, a TORCH_MODULE type): the same
/// values in storage of its own.
template <class Net>
Net deep_copy(const Net& net) {
  auto copy = std::dynamic_pointer_cast<typename Net::ContainedType>(net->clone());
  FEDSHARD_EXPECTS(copy != nullptr, "deep_copy: the module's clone() returned another type");
  return Net(std::move(copy));
}

/// A fedshard::Model over Batch computing with the torch module Net (a module holder) and a
/// loss function loss(net, batch) -> scalar tensor.
template <class Net, class Batch = batch>
class torch_model {
 public:
  using loss_function = std::function<torch::Tensor(Net&, const Batch&)>;

  torch_model(Net net, loss_function loss) : net_(std::move(net)), loss_(std::move(loss)) {
    FEDSHARD_EXPECTS(static_cast<bool>(loss_), "torch_model: the loss function is empty");
    for (const auto& m : net_->named_modules()) {
      unit_binding ub;
      ub.name = m.key().empty() ? std::string("root") : m.key();
      for (const auto& p : m.value()->named_parameters(/*recurse=*/false)) {
        const torch::Tensor& t = p.value();
        FEDSHARD_EXPECTS(t.scalar_type() == torch::kFloat32 && t.device().is_cpu(),
                         "torch_model: parameter '", ub.name, ".", p.key(),
                         "' must be a float32 CPU tensor, found ", t.toString());
        FEDSHARD_EXPECTS(t.requires_grad(), "torch_model: parameter '", ub.name, ".", p.key(),
                         "' does not require grad; register a frozen tensor as a buffer instead");
        ub.tensor_names.push_back(p.key());
        ub.params.push_back(t);
        ub.home.push_back(t.data());
      }
      if (!ub.params.empty()) units_.push_back(std::move(ub));
    }
    FEDSHARD_EXPECTS(!units_.empty(), "torch_model: the module has no parameters");
  }

  /// The torch module (holding the starting values, or the trained ones after load_from).
  Net& net() noexcept { return net_; }

  /// One unit per submodule owning parameters, one tensor per parameter.
  std::vector<fedshard::unit_spec> units() const {
    std::vector<fedshard::unit_spec> out;
    for (const auto& ub : units_) {
      fedshard::unit_spec us{ub.name, {}};
      for (std::size_t t = 0; t < ub.params.size(); ++t)
        us.tensors.push_back({ub.tensor_names[t], ub.params[t].sizes().vec()});
      out.push_back(std::move(us));
    }
    return out;
  }

  /// Unit u's values as the module holds them (its initialisation).
  std::vector<float> initial_values(const fedshard::flat_layout& layout, std::size_t u) const {
    const auto& ul = layout.unit(u);
    std::vector<float> v(ul.numel);
    for (std::size_t t = 0; t < ul.tensors.size(); ++t) {
      const torch::Tensor src = units_.at(u).home[t].contiguous();
      std::copy_n(src.data_ptr<float>(), ul.tensors[t].numel, v.begin() + ul.tensors[t].offset);
    }
    return v;
  }

  /// Samples in a batch (the weight of weighted federation).
  std::int64_t tokens(const Batch& b) const requires requires(const Batch& x) { x.input.size(0); }
  { return b.input.size(0); }

  /// Forward, loss and backward with the parameters and gradients in fedshard's buffers.
  float forward_backward(fedshard::step_context& ctx, const Batch& b) {
    const fedshard::flat_layout& layout = ctx.layout();
    check_layout(layout);
    // Autograd saves tensors it needs for backward (a linear layer saves its weight to compute
    // the input's gradient) and reads them through the parameters' storage when backward runs.
    // So every unit is acquired in forward order and released only after backward is done:
    // the whole model is gathered during a step.
    rebinding bound(units_);
    for (std::size_t u = 0; u < units_.size(); ++u) {
      bind_params(layout, u, ctx.acquire(u));
      bind_grads(layout, u, ctx.grad_buffer(u));
    }
    const torch::Tensor loss = loss_(net_, b);
    FEDSHARD_EXPECTS(loss.numel() == 1, "torch_model: the loss function must return a scalar, ",
                     "found a tensor of ", loss.numel(), " elements");
    loss.backward();
    for (std::size_t u = 0; u < units_.size(); ++u) collect_grads(layout, u, ctx.grad_buffer(u));
    bound.restore();
    for (std::size_t u = units_.size(); u-- > 0;) {
      ctx.grads_ready(u);
      ctx.release(u);
    }
    return loss.item<float>();
  }

  /// The loss without gradients.
  float evaluate(fedshard::step_context& ctx, const Batch& b) {
    const fedshard::flat_layout& layout = ctx.layout();
    check_layout(layout);
    torch::NoGradGuard no_grad;
    rebinding bound(units_);
    for (std::size_t u = 0; u < units_.size(); ++u) bind_params(layout, u, ctx.acquire(u));
    const float loss = loss_(net_, b).template item<float>();
    bound.restore();
    for (std::size_t u = 0; u < units_.size(); ++u) ctx.release(u);
    return loss;
  }

  /// Copies unit u's full values (numel, e.g. trainer::unit_parameters(u)) into the module.
  void load_unit(const fedshard::flat_layout& layout, std::size_t u,
                 std::span<const float> values) {
    const auto& ul = layout.unit(u);
    FEDSHARD_EXPECTS(values.size() == ul.numel, "torch_model::load_unit: unit '", ul.name, "' has ",
                     ul.numel, " elements, found ", values.size(), " values");
    torch::NoGradGuard no_grad;
    for (std::size_t t = 0; t < ul.tensors.size(); ++t) {
      const auto& slot = ul.tensors[t];
      units_.at(u).home[t].copy_(from_span(values.subspan(slot.offset, slot.numel), slot.shape));
    }
  }

  /// Collective over the trainer's shard axis: the module takes the trained parameters.
  template <class Trainer>
  void load_from(Trainer& t) {
    for (std::size_t u = 0; u < units_.size(); ++u) load_unit(t.layout(), u, t.unit_parameters(u));
  }

 private:
  struct unit_binding {
    std::string name;
    std::vector<std::string> tensor_names;
    std::vector<torch::Tensor> params;  // the module's parameters (same tensor objects)
    std::vector<torch::Tensor> home;    // the module's own storage
  };

  /// Points the parameters back at the module's own storage and drops their gradients, on
  /// restore() or when leaving the scope early.
  class rebinding {
   public:
    explicit rebinding(std::vector<unit_binding>& units) : units_(&units) {}
    rebinding(const rebinding&) = delete;
    rebinding& operator=(const rebinding&) = delete;
    ~rebinding() {
      try {
        restore();
      } catch (...) {  // set_data to the tensor's own storage; nothing to report
      }
    }
    void restore() {
      if (done_) return;
      done_ = true;
      torch::NoGradGuard no_grad;
      for (auto& ub : *units_)
        for (std::size_t t = 0; t < ub.params.size(); ++t) {
          ub.params[t].set_data(ub.home[t]);
          ub.params[t].mutable_grad() = torch::Tensor();
        }
    }

   private:
    std::vector<unit_binding>* units_;
    bool done_ = false;
  };

  static torch::Tensor from_span(std::span<const float> s, const std::vector<std::int64_t>& shape) {
    // from_blob needs a mutable pointer; parameter views are only read (fedshard's optimizer,
    // not torch, updates the parameters).
    return torch::from_blob(const_cast<float*>(s.data()), shape, torch::kFloat32);
  }

  void check_layout(const fedshard::flat_layout& layout) const {
    FEDSHARD_EXPECTS(layout.num_units() == units_.size(), "torch_model: the layout has ",
                     layout.num_units(), " units, the module ", units_.size());
  }

  void bind_params(const fedshard::flat_layout& layout, std::size_t u,
                   std::span<const float> unit_params) {
    torch::NoGradGuard no_grad;
    auto& ub = units_[u];
    for (std::size_t t = 0; t < ub.params.size(); ++t)
      ub.params[t].set_data(
          from_span(layout.tensor_view(unit_params, u, t), layout.unit(u).tensors[t].shape));
  }

  void bind_grads(const fedshard::flat_layout& layout, std::size_t u, std::span<float> grads) {
    auto& ub = units_[u];
    for (std::size_t t = 0; t < ub.params.size(); ++t) {
      const auto g = layout.tensor_view(grads, u, t);
      ub.params[t].mutable_grad() =
          torch::from_blob(g.data(), layout.unit(u).tensors[t].shape, torch::kFloat32);
    }
  }

  /// Autograd accumulates into the bound .grad in place; if it replaced the tensor instead
  /// (a hook, a layout it would not write into), the values are copied into the buffer.
  void collect_grads(const fedshard::flat_layout& layout, std::size_t u, std::span<float> grads) {
    torch::NoGradGuard no_grad;
    auto& ub = units_[u];
    for (std::size_t t = 0; t < ub.params.size(); ++t) {
      const auto g = layout.tensor_view(grads, u, t);
      const torch::Tensor& got = ub.params[t].grad();
      if (!got.defined() || got.data_ptr() == static_cast<void*>(g.data())) continue;
      torch::from_blob(g.data(), layout.unit(u).tensors[t].shape, torch::kFloat32).copy_(got);
    }
  }

  Net net_;
  loss_function loss_;
  std::vector<unit_binding> units_;
};

}  // namespace fedshard_torch
