#pragma once
/// A fedshard::Model backed by a LibTorch torch::nn::Sequential: torch computes forward and
/// backward, fedshard owns the parameters and gradients and moves them, and autograd drives
/// the plan's phases unit by unit (FSDP2's scheme).
///
/// Units: every child of the Sequential that has parameters (e.g. each torch::nn::Linear, with
/// its weight and bias; a child with nested modules is one unit with all their parameters) is
/// one unit, in the Sequential's order; a unit's tensors are the child's parameters in
/// registration order, and a tensor's qualified name "unit.tensor" is torch's parameter name
/// ("0.weight"). The starting values are the module's own, so build one module and give every
/// rank a deep_copy of it.
///
/// A training step: the loss function receives a Sequential that runs the same children, each
/// unit through a custom autograd function (unit_function):
///  - forward: acquire(u, forward) right before the unit runs, its parameters pointed at
///    torch::from_blob views of the gathered unit (no copy) and their .grad at views of
///    grad_buffer(u); release(u) right after. The unit's own autograd graph is recorded on a
///    detached input, and its saved tensors alias the gathered buffer.
///  - backward: when the gradient of the unit's output arrives, acquire(u, backward), which
///    gathers again into the same memory (the engine keeps each unit's buffers at one address),
///    then the unit's backward runs (a reentrant autograd call) and accumulates its parameters'
///    gradients in place into grad_buffer(u) (copied there if autograd replaced a .grad);
///    then grads_ready(u) starts the unit's reductions and release(u) frees it.
///  A dummy tensor that requires grad goes through every unit_function, so the backward side
///  runs for the first unit too, whose input does not require grad. So FSDP's backward
///  re-gathers run, at most max_live_units gathered units are live, and the wire carries the
///  plan. Evaluation acquires and releases each unit in forward only, without autograd.
/// Afterwards the module's parameters point back at the module's own storage, which keeps the
/// starting values until load_from copies the trained ones in.
///
/// Memory spaces: forward_backward and evaluate take the trainer's basic_step_context<S>.
///  - S host-accessible (host_space, inproc/mpi/gloo): the CPU path above; the module's
///    parameters are CPU tensors.
///  - S a CUDA space (gpu::cuda_space: gpu_inproc, nccl), with FEDSHARD_TORCH_CUDA defined (a
///    LibTorch with CUDA; torch_cuda_binding.hpp): the module's parameters are CUDA tensors on
///    ctx.space().device(); the views are torch::from_blob of the device buffers on
///    torch::Device(kCUDA, ctx.space().device()), and the whole step (the loss function,
///    backward, each unit's reentrant backward, gradient copies, loss.item()) runs on the
///    trainer's compute stream, c10::cuda::getStreamFromExternal(ctx.stream().get(), device),
///    made current with a stream guard. Batches may live anywhere: the loss function moves
///    them to the device, and that copy is on the step's stream too. Without
///    FEDSHARD_TORCH_CUDA a device space is a compile error that says so. A module on another
///    device than the step's space (CPU module, CUDA space; CUDA module, host space; another
///    GPU) is refused when the step starts.
///  Threads on the device path: autograd runs the backward of CUDA nodes on its device thread,
///  one per GPU for the whole process, so the ranks of gpu_inproc that share a GPU share that
///  thread. A hook that meets the other ranks (acquire's gathers, grads_ready's reductions:
///  every gpu_inproc call blocks its caller until its peers make the matching call) must not
///  run there: it would wait for a peer whose backward is queued behind it on the same thread.
///  And cuda_space / gpu_inproc take the device of a rank's thread for granted (the rank's
///  thread has it current). So on the device path no trainer hook runs on autograd's thread:
///  units are chained by a CPU token, and between unit u + 1 and unit u sits a CPU-only
///  autograd function (unit_gate), which autograd runs on the thread that called
///  loss.backward(), the rank's: there it calls grads_ready(u + 1), release(u + 1) and
///  acquire(u, backward), in the order of the CPU path. The unit's own backward (device
///  thread) only computes, on the step's stream, into the gradient buffer the gate fetched.
///  The last unit is acquired for backward just before loss.backward(), unit 0's
///  grads_ready and release come after it (finish_backward). The trainer is never called
///  from two threads at once: the rank's thread is inside loss.backward() while the device
///  thread computes, and autograd's ready queues order the two.
///
/// Limits: the module is a torch::nn::Sequential whose children each map one tensor to one
/// tensor (units and parameter-free modules); the loss function uses it only through
/// net->forward(), once per step (a unit's parameters are bound only while it runs, and the
/// Sequential it receives has no parameters of its own: a penalty on the parameters belongs to
/// fedshard's optimizer, e.g. adamw's weight decay); a unit does not modify its input in place;
/// no double backward. f32 parameters that require grad, all on the CPU (host spaces) or all
/// on the step's CUDA device (CUDA spaces); module buffers (e.g. batch-norm running
/// statistics) are not parameters, so each rank keeps its own. A copy of a torch_model shares
/// the module and its step state, so copies must not train concurrently. On a CUDA space the
/// f32 compute dtype only (no acquire_as), and a program that includes LibTorch must be
/// compiled by the host compiler: LibTorch's headers do not compile with nvcc in C++20, so the
/// trainer on a CUDA space lives in another unit (torch_device_bridge.hpp).

#include <c10/core/StreamGuard.h>
#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/shard/flat_layout.hpp"
#include "fedshard/trainer/model.hpp"

#ifdef FEDSHARD_TORCH_CUDA
#include "torch_cuda_binding.hpp"
#endif

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

namespace detail {

/// What the driver uses of the step under way, whatever the step context's memory space.
class step_hooks {
 public:
  virtual ~step_hooks() = default;
  virtual const fedshard::flat_layout& layout() const = 0;
  virtual std::span<const float> acquire(std::size_t u, fedshard::phase ph) = 0;
  virtual void release(std::size_t u) = 0;
  virtual std::span<float> grad_buffer(std::size_t u) = 0;
  virtual void grads_ready(std::size_t u) = 0;
};

/// step_hooks forwarding to a step context Ctx (basic_step_context<S>, or any type with its
/// layout, acquire, release, grad_buffer and grads_ready).
template <class Ctx>
class context_hooks final : public step_hooks {
 public:
  explicit context_hooks(Ctx& ctx) noexcept : ctx_(&ctx) {}
  const fedshard::flat_layout& layout() const override { return ctx_->layout(); }
  std::span<const float> acquire(std::size_t u, fedshard::phase ph) override {
    return ctx_->acquire(u, ph);
  }
  void release(std::size_t u) override { ctx_->release(u); }
  std::span<float> grad_buffer(std::size_t u) override { return ctx_->grad_buffer(u); }
  void grads_ready(std::size_t u) override { ctx_->grads_ready(u); }

 private:
  Ctx* ctx_;
};

template <class S>
inline constexpr bool dependent_false_v = false;

/// Where the step context Ctx computes: the CPU for a host-accessible space, else its CUDA
/// device (torch_cuda_binding.hpp; needs FEDSHARD_TORCH_CUDA).
template <class Ctx>
torch::Device step_device(Ctx& ctx) {
  using S = typename Ctx::space_type;
  if constexpr (S::host_accessible) {
    (void)ctx;
    return torch::Device(torch::kCPU);
  } else {
#ifdef FEDSHARD_TORCH_CUDA
    return cuda_binding::device(ctx);
#else
    static_assert(dependent_false_v<S>,
                  "fedshard_torch::torch_model on a device memory space needs a LibTorch with "
                  "CUDA: define FEDSHARD_TORCH_CUDA (examples/libtorch/CMakeLists.txt does when "
                  "the found LibTorch has CUDA)");
    return torch::Device(torch::kCPU);
#endif
  }
}

/// The torch stream the step computes on: none for a host-accessible space (torch's own CPU
/// execution), else the step context's compute stream wrapped for torch.
template <class Ctx>
c10::optional<c10::Stream> step_stream(Ctx& ctx) {
  using S = typename Ctx::space_type;
  if constexpr (S::host_accessible) {
    (void)ctx;
    return c10::nullopt;
  } else {
#ifdef FEDSHARD_TORCH_CUDA
    return cuda_binding::stream(ctx);
#else
    static_assert(dependent_false_v<S>, "see step_device");
    return c10::nullopt;
#endif
  }
}

class unit_driver;

/// What unit u's forward left for its backward: its input (a detached leaf) and output, whose
/// autograd graph computes the unit's gradients.
struct unit_record : torch::CustomClassHolder {
  unit_record(unit_driver* d, std::size_t u) : driver(d), unit(u) {}
  unit_driver* driver;
  std::size_t unit;
  torch::Tensor input;
  torch::Tensor output;
};

/// The autograd function that runs one unit: forward acquires, binds and runs it, backward
/// re-acquires it, runs its backward and signals its gradients ready (see the file comment).
struct unit_function : torch::autograd::Function<unit_function> {
  /// Runs unit u of driver on x; dummy requires grad, so the backward always runs.
  static torch::Tensor forward(torch::autograd::AutogradContext* ac, const torch::Tensor& x,
                               const torch::Tensor& dummy, unit_driver* driver, std::int64_t u);
  /// The gradient of the unit's input (undefined when the input did not require grad).
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ac,
                                                 torch::autograd::variable_list grads);
};

/// The device path's autograd function of one unit: as unit_function, but the unit's
/// backward runs on autograd's device thread, so it leaves the trainer alone: the unit's
/// backward acquire comes before it from unit_gate (or forward_backward for the last unit),
/// and its grads_ready and release after it from the next unit_gate (or finish_backward).
/// Besides x it takes and returns a CPU token that chains the units and their gates.
struct device_unit_function : torch::autograd::Function<device_unit_function> {
  /// {unit u's output for x, the token for the unit's gate}.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ac,
                                                const torch::Tensor& x, const torch::Tensor& token,
                                                unit_driver* driver, std::int64_t u);
  /// {the gradient of x, of the token}.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ac,
                                                 torch::autograd::variable_list grads);
};

/// The device path's gate after unit u: a CPU-only autograd function on the token chain,
/// whose backward autograd runs on the thread that called loss.backward() (the rank's),
/// after unit u + 1's backward and before unit u's: there it ends unit u + 1's backward
/// (grads_ready, release) and acquires unit u for backward.
struct unit_gate : torch::autograd::Function<unit_gate> {
  /// A new token.
  static torch::Tensor forward(torch::autograd::AutogradContext* ac, const torch::Tensor& token,
                               unit_driver* driver, std::int64_t u);
  /// {the gradient of the token}.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ac,
                                                 torch::autograd::variable_list grads);
};

/// The state a torch_model shares with the modules of its driven Sequential: the units, the
/// step context of the step under way, and what each unit did in it.
class unit_driver {
 public:
  /// A unit: one child of the Sequential that has parameters.
  struct unit_binding {
    std::string name;
    torch::nn::AnyModule module;
    std::vector<std::string> tensor_names;
    std::vector<torch::Tensor> params;  // the module's parameters (same tensor objects)
    std::vector<torch::Tensor> home;    // the module's own storage
  };

  /// The units of net, and the driven Sequential over its children.
  explicit unit_driver(const torch::nn::Sequential& net);
  unit_driver(const unit_driver&) = delete;
  unit_driver& operator=(const unit_driver&) = delete;

  /// The units, in the Sequential's order.
  const std::vector<unit_binding>& units() const noexcept { return units_; }
  /// The Sequential the loss function receives: the same children, units run through
  /// unit_function.
  torch::nn::Sequential& driven() noexcept { return driven_; }
  /// Times a gradient had to be copied into fedshard's buffer because autograd replaced the
  /// .grad view instead of accumulating into it.
  std::int64_t grad_copies() const noexcept { return grad_copies_; }

  /// Starts a step (training: with gradients) computing through ctx on device, on stream
  /// (device spaces) or on the CPU (no stream).
  void begin(step_hooks& ctx, bool training, torch::Device device,
             c10::optional<c10::Stream> stream);
  /// True when the step computes on a device (the token-chained backward).
  bool on_device() const noexcept { return stream_.has_value(); }
  /// The device path, before loss.backward(): acquires the last unit for backward (its
  /// backward has no gate after it).
  void begin_last_backward();
  /// Ends the step: the parameters point back at the module's storage and lose their .grad.
  void end() noexcept;
  /// Throws unless every unit ran forward in this training step.
  void check_all_forwarded() const;
  /// Fires the backward triggers of every unit that ran forward but whose backward did not
  /// run (its output did not reach the loss), in backward order, so the step still carries
  /// the plan.
  void finish_backward();

  /// Runs unit u on x (called by the driven Sequential's unit modules).
  torch::Tensor run(std::size_t u, const torch::Tensor& x);

  /// unit_function's forward: acquire, bind, record the unit's graph, release.
  torch::Tensor forward_unit(unit_record& rec, const torch::Tensor& x);
  /// unit_function's backward: re-acquire, backward through the unit's graph, grads_ready,
  /// release; returns the gradient of the unit's input.
  torch::Tensor backward_unit(unit_record& rec, const torch::Tensor& grad_output);
  /// device_unit_function's backward, on autograd's device thread: on the step's stream,
  /// backward through the unit's graph into the gradient buffer that unit_gate fetched;
  /// no call into the trainer. Returns the gradient of the unit's input.
  torch::Tensor backward_unit_on_device(unit_record& rec, const torch::Tensor& grad_output);
  /// unit_gate's backward (the rank's thread): ends unit u + 1's backward, acquires unit u.
  void gate_backward(std::size_t u);

 private:
  step_hooks& context() const;
  void bind_params(std::size_t u, std::span<const float> unit_params);
  void bind_grads(std::size_t u, std::span<float> grads);
  void collect_grads(std::size_t u, std::span<float> grads);
  void end_backward(std::size_t u);
  void acquire_for_backward(std::size_t u);
  torch::TensorOptions options() const { return torch::dtype(torch::kFloat32).device(device_); }

  std::vector<unit_binding> units_;
  torch::nn::Sequential driven_;
  torch::Tensor dummy_;  // requires grad; routes every unit's backward through unit_function
  step_hooks* ctx_ = nullptr;
  const fedshard::flat_layout* layout_ = nullptr;  // the step's (read by the device thread)
  bool training_ = false;
  torch::Device device_ = torch::Device(torch::kCPU);
  c10::optional<c10::Stream> stream_;         // the step's stream (device path only)
  torch::Tensor token_;                       // the device path's token chain, as far as it got
  std::vector<char> forwarded_, backwarded_;  // per unit, in the current step
  std::vector<char> acquired_, ended_;        // the device path: backward acquire, end done
  std::vector<const float*> bound_;           // the gathered buffer each unit was bound to
  std::vector<std::span<float>> grads_;       // the device path: each unit's gradient buffer
  std::int64_t grad_copies_ = 0;
};

/// A parameter-free module standing for unit u in the driven Sequential.
class unit_module_impl : public torch::nn::Module {
 public:
  /// Stands for unit u of driver.
  unit_module_impl(unit_driver* driver, std::size_t u) : driver_(driver), unit_(u) {}
  /// Unit u's output for x, computed through fedshard's buffers.
  torch::Tensor forward(const torch::Tensor& x) { return driver_->run(unit_, x); }

 private:
  unit_driver* driver_;
  std::size_t unit_;
};
TORCH_MODULE_IMPL(unit_module, unit_module_impl);

inline unit_driver::unit_driver(const torch::nn::Sequential& net)
    : dummy_(torch::zeros({0}, torch::requires_grad())) {
  const auto children = net->named_children();
  FEDSHARD_EXPECTS(children.size() == net->size(), "torch_model: the Sequential has ", net->size(),
                   " modules but ", children.size(), " children");
  for (std::size_t i = 0; i < net->size(); ++i) {
    const torch::nn::AnyModule& any = *(net->begin() + static_cast<std::ptrdiff_t>(i));
    const std::string& name = children[i].key();
    FEDSHARD_EXPECTS(children[i].value().get() == any.ptr().get(), "torch_model: child ", i,
                     " of the Sequential is not its module ", i);
    unit_binding ub{.name = name, .module = any, .tensor_names = {}, .params = {}, .home = {}};
    for (const auto& p : any.ptr()->named_parameters(/*recurse=*/true)) {
      const torch::Tensor& t = p.value();
      FEDSHARD_EXPECTS(t.scalar_type() == torch::kFloat32 && (t.is_cpu() || t.is_cuda()),
                       "torch_model: parameter '", name, ".", p.key(),
                       "' must be a float32 CPU or CUDA tensor, found ", t.toString());
      FEDSHARD_EXPECTS(t.requires_grad(), "torch_model: parameter '", name, ".", p.key(),
                       "' does not require grad; register a frozen tensor as a buffer instead");
      ub.tensor_names.push_back(p.key());
      ub.params.push_back(t);
      ub.home.push_back(t.data());
    }
    if (ub.params.empty()) {
      driven_->push_back(std::string(name), any);  // parameter-free: runs as it is
    } else {
      driven_->push_back(std::string(name), unit_module(this, units_.size()));
      units_.push_back(std::move(ub));
    }
  }
  FEDSHARD_EXPECTS(!units_.empty(), "torch_model: the module has no parameters");
  forwarded_.assign(units_.size(), 0);
  backwarded_.assign(units_.size(), 0);
  bound_.assign(units_.size(), nullptr);
}

inline void unit_driver::begin(step_hooks& ctx, bool training, torch::Device device,
                               c10::optional<c10::Stream> stream) {
  FEDSHARD_EXPECTS(ctx.layout().num_units() == units_.size(), "torch_model: the layout has ",
                   ctx.layout().num_units(), " units, the module ", units_.size());
  FEDSHARD_EXPECTS(ctx_ == nullptr, "torch_model: a step is already under way on this model");
  for (const auto& ub : units_)
    for (std::size_t t = 0; t < ub.params.size(); ++t)
      FEDSHARD_EXPECTS(ub.home[t].device() == device, "torch_model: parameter '", ub.name, ".",
                       ub.tensor_names[t], "' is on ", ub.home[t].device().str(),
                       " but the trainer's memory space computes on ", device.str(),
                       "; build the module there (net->to(", device.str(),
                       ")) before the torch_model");
  ctx_ = &ctx;
  layout_ = &ctx.layout();
  training_ = training;
  device_ = device;
  stream_ = stream;
  forwarded_.assign(units_.size(), 0);
  backwarded_.assign(units_.size(), 0);
  bound_.assign(units_.size(), nullptr);
  if (stream_) {
    acquired_.assign(units_.size(), 0);
    ended_.assign(units_.size(), 0);
    grads_.assign(units_.size(), {});
    token_ = dummy_;
  }
}

inline void unit_driver::end() noexcept {
  try {
    torch::NoGradGuard no_grad;
    for (auto& ub : units_)
      for (std::size_t t = 0; t < ub.params.size(); ++t) {
        ub.params[t].set_data(ub.home[t]);
        ub.params[t].mutable_grad() = torch::Tensor();
      }
  } catch (...) {  // set_data to the tensor's own storage; nothing to report
  }
  token_ = torch::Tensor();
  stream_.reset();
  ctx_ = nullptr;
}

inline void unit_driver::check_all_forwarded() const {
  for (std::size_t u = 0; u < units_.size(); ++u)
    FEDSHARD_EXPECTS(forwarded_[u], "torch_model: unit '", units_[u].name,
                     "' did not run in the loss function; call net->forward() once per step");
}

inline void unit_driver::finish_backward() {
  if (!on_device()) {
    for (std::size_t u = units_.size(); u-- > 0;)
      if (forwarded_[u] && !backwarded_[u]) {
        context().acquire(u, fedshard::phase::backward);
        end_backward(u);
      }
    return;
  }
  for (std::size_t u = units_.size(); u-- > 0;)
    if (forwarded_[u] && !ended_[u]) {
      if (!acquired_[u]) acquire_for_backward(u);
      end_backward(u);
    }
}

inline void unit_driver::begin_last_backward() {
  const std::size_t last = units_.size() - 1;
  if (forwarded_[last] && !acquired_[last]) acquire_for_backward(last);
}

inline step_hooks& unit_driver::context() const {
  FEDSHARD_EXPECTS(ctx_ != nullptr,
                   "torch_model: the driven module runs only inside a step (the loss function)");
  return *ctx_;
}

inline torch::Tensor unit_driver::run(std::size_t u, const torch::Tensor& x) {
  step_hooks& ctx = context();
  if (!training_) {
    bind_params(u, ctx.acquire(u, fedshard::phase::forward));
    torch::Tensor y = units_[u].module.forward(x);
    ctx.release(u);
    return y;
  }
  FEDSHARD_EXPECTS(!forwarded_[u], "torch_model: unit '", units_[u].name,
                   "' ran twice in one step; the loss function must call net->forward() once");
  forwarded_[u] = 1;
  if (!on_device()) return unit_function::apply(x, dummy_, this, static_cast<std::int64_t>(u));
  const auto iu = static_cast<std::int64_t>(u);
  torch::autograd::variable_list out = device_unit_function::apply(x, token_, this, iu);
  token_ = unit_gate::apply(out.at(1), this, iu);
  return out.at(0);
}

inline torch::Tensor unit_driver::forward_unit(unit_record& rec, const torch::Tensor& x) {
  step_hooks& ctx = context();
  const std::size_t u = rec.unit;
  const std::span<const float> params = ctx.acquire(u, fedshard::phase::forward);
  bind_params(u, params);
  bound_[u] = params.data();
  bind_grads(u, ctx.grad_buffer(u));
  {
    // unit_function's forward runs without grad mode; the unit's own graph is recorded here,
    // on a detached input, and run by backward_unit.
    torch::AutoGradMode grad_mode(true);
    rec.input = x.detach();
    if (x.requires_grad()) rec.input.requires_grad_(true);
    rec.output = units_[u].module.forward(rec.input);
  }
  ctx.release(u);
  return rec.output.detach();
}

inline torch::Tensor unit_driver::backward_unit(unit_record& rec,
                                                const torch::Tensor& grad_output) {
  step_hooks& ctx = context();
  const std::size_t u = rec.unit;
  const std::span<const float> params = ctx.acquire(u, fedshard::phase::backward);
  // The unit's saved tensors alias the buffer it was bound to in forward.
  FEDSHARD_EXPECTS(params.data() == bound_[u], "torch_model: unit '", units_[u].name,
                   "' was gathered for backward into other memory than for forward");
  if (rec.output.requires_grad()) torch::autograd::backward({rec.output}, {grad_output});
  torch::Tensor grad_input = rec.input.requires_grad() ? rec.input.grad() : torch::Tensor();
  rec.input = torch::Tensor();
  rec.output = torch::Tensor();
  end_backward(u);
  return grad_input;
}

inline torch::Tensor unit_driver::backward_unit_on_device(unit_record& rec,
                                                          const torch::Tensor& grad_output) {
  const std::size_t u = rec.unit;
  // The engine runs this node on the stream its forward ran on (the step's); say so anyway,
  // for the unit's reentrant backward and the gradient copies.
  c10::OptionalStreamGuard on_stream(stream_);
  FEDSHARD_EXPECTS(acquired_[u], "torch_model: unit '", units_[u].name,
                   "' reached its backward before its gate acquired it");
  if (rec.output.requires_grad() && grad_output.defined())
    torch::autograd::backward({rec.output}, {grad_output});
  torch::Tensor grad_input = rec.input.requires_grad() ? rec.input.grad() : torch::Tensor();
  rec.input = torch::Tensor();
  rec.output = torch::Tensor();
  collect_grads(u, grads_[u]);
  backwarded_[u] = 1;
  return grad_input;
}

inline void unit_driver::gate_backward(std::size_t u) {
  if (u + 1 < units_.size() && !ended_[u + 1]) end_backward(u + 1);
  if (!acquired_[u]) acquire_for_backward(u);
}

inline void unit_driver::acquire_for_backward(std::size_t u) {
  step_hooks& ctx = context();
  const std::span<const float> params = ctx.acquire(u, fedshard::phase::backward);
  // The unit's saved tensors alias the buffer it was bound to in forward.
  FEDSHARD_EXPECTS(params.data() == bound_[u], "torch_model: unit '", units_[u].name,
                   "' was gathered for backward into other memory than for forward");
  grads_[u] = ctx.grad_buffer(u);
  acquired_[u] = 1;
}

inline void unit_driver::end_backward(std::size_t u) {
  step_hooks& ctx = context();
  if (!on_device()) {
    collect_grads(u, ctx.grad_buffer(u));
    backwarded_[u] = 1;
  } else {
    ended_[u] = 1;  // its gradients were collected on autograd's device thread
  }
  ctx.grads_ready(u);
  ctx.release(u);
}

inline void unit_driver::bind_params(std::size_t u, std::span<const float> unit_params) {
  const fedshard::flat_layout& layout = context().layout();
  torch::NoGradGuard no_grad;
  auto& ub = units_[u];
  for (std::size_t t = 0; t < ub.params.size(); ++t) {
    // from_blob needs a mutable pointer; parameter views are only read (fedshard's optimizer,
    // not torch, updates the parameters).
    const std::span<const float> v = layout.tensor_view(unit_params, u, t);
    ub.params[t].set_data(
        torch::from_blob(const_cast<float*>(v.data()), layout.unit(u).tensors[t].shape, options()));
  }
}

inline void unit_driver::bind_grads(std::size_t u, std::span<float> grads) {
  const fedshard::flat_layout& layout = context().layout();
  auto& ub = units_[u];
  for (std::size_t t = 0; t < ub.params.size(); ++t) {
    const auto g = layout.tensor_view(grads, u, t);
    ub.params[t].mutable_grad() =
        torch::from_blob(g.data(), layout.unit(u).tensors[t].shape, options());
  }
}

/// Autograd accumulates into the bound .grad in place; if it replaced the tensor instead (a
/// hook, a layout it would not write into), the values are copied into the buffer (on the
/// device path: queued on the step's stream, the current one there).
inline void unit_driver::collect_grads(std::size_t u, std::span<float> grads) {
  const fedshard::flat_layout& layout = *layout_;
  torch::NoGradGuard no_grad;
  auto& ub = units_[u];
  for (std::size_t t = 0; t < ub.params.size(); ++t) {
    const auto g = layout.tensor_view(grads, u, t);
    const torch::Tensor& got = ub.params[t].grad();
    if (!got.defined() || got.data_ptr() == static_cast<void*>(g.data())) continue;
    torch::from_blob(g.data(), layout.unit(u).tensors[t].shape, options()).copy_(got);
    ++grad_copies_;
  }
}

inline torch::Tensor unit_function::forward(torch::autograd::AutogradContext* ac,
                                            const torch::Tensor& x, const torch::Tensor& dummy,
                                            unit_driver* driver, std::int64_t u) {
  (void)dummy;
  auto rec = c10::make_intrusive<unit_record>(driver, static_cast<std::size_t>(u));
  torch::Tensor y = driver->forward_unit(*rec, x);
  ac->saved_data["unit"] = c10::IValue::make_capsule(std::move(rec));
  return y;
}

inline torch::autograd::variable_list unit_function::backward(
    torch::autograd::AutogradContext* ac, torch::autograd::variable_list grads) {
  const auto it = ac->saved_data.find("unit");
  FEDSHARD_EXPECTS(it != ac->saved_data.end(),
                   "torch_model: a unit's backward ran twice (retain_graph is not supported)");
  auto rec = c10::static_intrusive_pointer_cast<unit_record>(it->second.toCapsule());
  ac->saved_data.erase(it);  // frees the unit's graph once its backward is done
  torch::Tensor grad_input = rec->driver->backward_unit(*rec, grads.at(0));
  return {grad_input, torch::Tensor(), torch::Tensor(), torch::Tensor()};
}

/// An empty CPU tensor: a token of the device path's chain, or its gradient.
inline torch::Tensor empty_token() {
  return torch::empty({0}, torch::kFloat32);
}

inline torch::autograd::variable_list device_unit_function::forward(
    torch::autograd::AutogradContext* ac, const torch::Tensor& x, const torch::Tensor& token,
    unit_driver* driver, std::int64_t u) {
  (void)token;
  auto rec = c10::make_intrusive<unit_record>(driver, static_cast<std::size_t>(u));
  torch::Tensor y = driver->forward_unit(*rec, x);
  ac->saved_data["unit"] = c10::IValue::make_capsule(std::move(rec));
  return {y, empty_token()};
}

inline torch::autograd::variable_list device_unit_function::backward(
    torch::autograd::AutogradContext* ac, torch::autograd::variable_list grads) {
  const auto it = ac->saved_data.find("unit");
  FEDSHARD_EXPECTS(it != ac->saved_data.end(),
                   "torch_model: a unit's backward ran twice (retain_graph is not supported)");
  auto rec = c10::static_intrusive_pointer_cast<unit_record>(it->second.toCapsule());
  ac->saved_data.erase(it);
  const std::size_t u = rec->unit;
  torch::Tensor grad_input = rec->driver->backward_unit_on_device(*rec, grads.at(0));
  // Unit 0's token is the driver's leaf dummy: no gradient for it, none accumulated.
  return {grad_input, u == 0 ? torch::Tensor() : empty_token(), torch::Tensor(), torch::Tensor()};
}

inline torch::Tensor unit_gate::forward(torch::autograd::AutogradContext* ac,
                                        const torch::Tensor& token, unit_driver* driver,
                                        std::int64_t u) {
  (void)token;
  ac->saved_data["driver"] = reinterpret_cast<std::int64_t>(driver);
  ac->saved_data["unit"] = u;
  return empty_token();
}

inline torch::autograd::variable_list unit_gate::backward(torch::autograd::AutogradContext* ac,
                                                          torch::autograd::variable_list grads) {
  (void)grads;
  auto* driver = reinterpret_cast<unit_driver*>(ac->saved_data.at("driver").toInt());
  driver->gate_backward(static_cast<std::size_t>(ac->saved_data.at("unit").toInt()));
  return {empty_token(), torch::Tensor(), torch::Tensor()};
}

}  // namespace detail

/// A fedshard::Model over Batch computing with the torch::nn::Sequential Net and a loss
/// function loss(net, batch) -> scalar tensor (see the file comment).
template <class Net, class Batch = batch>
class torch_model {
  static_assert(std::is_same_v<Net, torch::nn::Sequential>,
                "fedshard_torch::torch_model drives a torch::nn::Sequential of units and "
                "parameter-free modules; wrap other modules as children of one");

 public:
  /// loss(net, batch): the batch's scalar loss, computed through net->forward() once.
  using loss_function = std::function<torch::Tensor(Net&, const Batch&)>;

  /// Trains net (its children become the units) on loss; every rank passes its own copy.
  torch_model(Net net, loss_function loss)
      : net_(std::move(net)),
        loss_(std::move(loss)),
        driver_(std::make_shared<detail::unit_driver>(net_)) {
    FEDSHARD_EXPECTS(static_cast<bool>(loss_), "torch_model: the loss function is empty");
  }

  /// The torch module (holding the starting values, or the trained ones after load_from).
  Net& net() noexcept { return net_; }

  /// Gradients copied into fedshard's buffers because autograd replaced a .grad view (0 when
  /// every gradient was accumulated in place).
  std::int64_t grad_copies() const noexcept { return driver_->grad_copies(); }

  /// One unit per child owning parameters, one tensor per parameter.
  std::vector<fedshard::unit_spec> units() const {
    std::vector<fedshard::unit_spec> out;
    for (const auto& ub : driver_->units()) {
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
      const torch::Tensor src = driver_->units().at(u).home[t].to(torch::kCPU).contiguous();
      std::copy_n(src.data_ptr<float>(), ul.tensors[t].numel, v.begin() + ul.tensors[t].offset);
    }
    return v;
  }

  /// Samples in a batch (the weight of weighted federation).
  std::int64_t tokens(const Batch& b) const requires requires(const Batch& x) { x.input.size(0); }
  { return b.input.size(0); }

  /// Forward, loss and backward, each unit acquired and released by its autograd function
  /// (on a device space: by its gate, see the file comment); Ctx is the trainer's
  /// basic_step_context<S>.
  template <class Ctx>
  float forward_backward(Ctx& ctx, const Batch& b) {
    detail::context_hooks<Ctx> hooks(ctx);
    const c10::optional<c10::Stream> stream = detail::step_stream(ctx);
    c10::OptionalStreamGuard on_stream(stream);  // the whole step runs on ctx.stream()
    step_scope scope(*driver_, hooks, true, detail::step_device(ctx), stream);
    const torch::Tensor loss = loss_(driver_->driven(), b);
    FEDSHARD_EXPECTS(loss.numel() == 1, "torch_model: the loss function must return a scalar, ",
                     "found a tensor of ", loss.numel(), " elements");
    driver_->check_all_forwarded();
    if (driver_->on_device()) driver_->begin_last_backward();
    loss.backward();
    driver_->finish_backward();
    return loss.item<float>();
  }

  /// The loss without gradients: each unit acquired for forward and released.
  template <class Ctx>
  float evaluate(Ctx& ctx, const Batch& b) {
    torch::NoGradGuard no_grad;
    detail::context_hooks<Ctx> hooks(ctx);
    const c10::optional<c10::Stream> stream = detail::step_stream(ctx);
    c10::OptionalStreamGuard on_stream(stream);
    step_scope scope(*driver_, hooks, false, detail::step_device(ctx), stream);
    return loss_(driver_->driven(), b).template item<float>();
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
      const std::span<const float> s = values.subspan(slot.offset, slot.numel);
      driver_->units().at(u).home[t].copy_(
          torch::from_blob(const_cast<float*>(s.data()), slot.shape, torch::kFloat32));
    }
  }

  /// Collective over the trainer's shard axis: the module takes the trained parameters.
  template <class Trainer>
  void load_from(Trainer& t) {
    for (std::size_t u = 0; u < driver_->units().size(); ++u)
      load_unit(t.layout(), u, t.unit_parameters(u));
  }

 private:
  /// A step of the driver, ended (parameters back on the module's storage) on every exit.
  class step_scope {
   public:
    step_scope(detail::unit_driver& d, detail::step_hooks& ctx, bool training, torch::Device device,
               c10::optional<c10::Stream> stream)
        : d_(&d) {
      d.begin(ctx, training, device, stream);
    }
    step_scope(const step_scope&) = delete;
    step_scope& operator=(const step_scope&) = delete;
    ~step_scope() { d_->end(); }

   private:
    detail::unit_driver* d_;
  };

  Net net_;
  loss_function loss_;
  std::shared_ptr<detail::unit_driver> driver_;
};

}  // namespace fedshard_torch
