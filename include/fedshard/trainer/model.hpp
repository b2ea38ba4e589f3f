#pragma once
/// The tensor-backend boundary: the Model concept and the step_context a model computes with.
///
/// A Model M, trained on batches of type B, provides:
///  1. `m.units()` -> std::vector<unit_spec>: its units and tensor shapes, declared once.
///  2. `m.forward_backward(ctx, batch)` -> float: computes the batch's loss, reading
///     parameters and writing gradients through the step context (basic_step_context<S> of
///     the trainer's memory space S; step_context for host memory); returns the loss.
///  3. Optionally `m.initial_values(layout, u)` -> std::vector<float>: unit u's starting
///     values (numel elements, the same on every rank); otherwise parameters start at zero.
///  4. Optionally `m.evaluate(ctx, batch)` -> float: the loss without gradients.
///  5. Optionally `m.tokens(batch)` -> std::int64_t: tokens (or samples) in the batch, the
///     weight of weighted federation; otherwise std::size(batch) if the batch is a range,
///     else 1.
/// The optional members 3 to 5 are detected in model_capabilities<M> alone; the trainer
/// instantiates it at its declaration, where a near-miss name (initial_value, init_values,
/// eval, evaluation, token, num_tokens) or an initial_values of another signature is a
/// compile error naming the member meant.
/// Phases and triggers: in forward_backward the model calls `ctx.acquire(u)` (forward) before
/// it reads unit u in forward, `ctx.release(u)` when done with it, and in backward
/// `ctx.acquire(u, fedshard::phase::backward)` before it reads u again, then
/// `ctx.grads_ready(u)` once u's gradients are written. Each call fires the trigger of the
/// shard policy's plan with that phase (the gathers of (acquire, phase, u), the reductions of
/// (grads_ready, u)): a unit that the plan frees after forward (FSDP) is gathered again for
/// backward, the next unit's gather is prefetched while u computes, and u's reduction
/// overlaps the rest of backward. A backend driven by autograd fires the backward triggers
/// from its backward functions (examples/libtorch). A model that calls none of these gets
/// each unit gathered on first use (params(u)) and everything reduced after
/// forward_backward: correct, just without overlap.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/member_names.hpp"
#include "fedshard/error.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/shard/flat_layout.hpp"
#include "fedshard/space/host_space.hpp"

#ifndef FEDSHARD_CHECKED_VIEWS
#ifdef NDEBUG
#define FEDSHARD_CHECKED_VIEWS 0
#else
/// Bounds-checked tensor views (on by default in debug builds).
#define FEDSHARD_CHECKED_VIEWS 1
#endif
#endif

namespace fedshard {

/// A tensor's elements inside a unit buffer; operator[] is bounds-checked when
/// FEDSHARD_CHECKED_VIEWS is 1 (debug builds), so a model writing outside its declared shape
/// gets an invalid_argument naming the tensor instead of corrupting its neighbours.
template <class T>
class tensor_view {
 public:
  tensor_view() = default;
  tensor_view(std::span<T> data, const tensor_slot* slot) : data_(data), slot_(slot) {}

  T& operator[](std::size_t i) const {
#if FEDSHARD_CHECKED_VIEWS
    if (i >= data_.size())
      throw invalid_argument(detail::concat("fedshard: index ", i, " is outside tensor '",
                                            slot_ ? slot_->name : std::string("?"), "' of ",
                                            data_.size(), " elements"));
#endif
    return data_[i];
  }
  T* data() const noexcept {
    return data_.data();
  }
  std::size_t size() const noexcept {
    return data_.size();
  }
  auto begin() const noexcept {
    return data_.begin();
  }
  auto end() const noexcept {
    return data_.end();
  }
  std::span<T> span() const noexcept {
    return data_;
  }
  operator std::span<T>() const noexcept {
    return data_;
  }  // NOLINT
  /// The tensor's declared shape.
  const std::vector<std::int64_t>& shape() const {
    return slot_->shape;
  }

 private:
  std::span<T> data_;
  const tensor_slot* slot_ = nullptr;
};

namespace detail {
/// What a step_context forwards to (implemented by the trainer over its shard engine), for
/// buffers in memory space S.
template <class S = space::host_space>
class unit_hooks {
 public:
  virtual ~unit_hooks() = default;
  virtual const flat_layout& layout() const = 0;
  virtual S& space() = 0;
  virtual typename S::stream& compute_stream() = 0;
  virtual std::span<const float> acquire(std::size_t u, phase ph) = 0;
  virtual std::span<const float> params(std::size_t u) = 0;
  virtual void release(std::size_t u) = 0;
  virtual std::span<float> grad_buffer(std::size_t u) = 0;
  virtual void grads_ready(std::size_t u) = 0;
  virtual const_buffer_view acquire_as(std::size_t u, phase ph, dtype t) = 0;
  virtual buffer_view grad_buffer_as(std::size_t u, dtype t) = 0;
  /// True when this rank's group holds unit u (shard/ownership.hpp).
  virtual bool holds(std::size_t) const { return true; }
  /// True when unit u is trained with gradients (false: a zeroth-order unit).
  virtual bool takes_gradients(std::size_t) const { return true; }
  /// The axis whose ranks share each batch (trainer_options::context_axis), if any.
  virtual std::optional<axis> context_axis() const { return std::nullopt; }
  /// This rank's rank on axis a, and the ranks on it (hooks without a mesh: one rank).
  virtual int axis_rank(axis) const { return 0; }
  virtual int axis_size(axis) const { return 1; }
  /// Runs point-to-point ops on the model's buffers (shard::engine::exchange); hooks without
  /// a mesh run none: one rank has no one to exchange with.
  virtual void exchange(const plan& p, buffer_view, buffer_view) {
    FEDSHARD_EXPECTS(p.ops.empty(), "step_context::exchange: these unit hooks have no mesh to ",
                     "run ", p.ops.size(), " point-to-point ops on");
  }
  /// Runs op (an all_reduce of f64 values, shard::engine::run) on v; hooks without a mesh
  /// leave v as it is: one rank agrees with itself.
  virtual void agree(const comm_op& op, std::span<double> v) {
    (void)op;
    (void)v;
  }
};

/// unit_hooks over a shard engine (shard/engine.hpp): each hook is the engine's member of
/// the same name.
template <class Engine, class S>
class engine_hooks final : public unit_hooks<S> {
 public:
  /// Hooks over e; `context`: trainer_options::context_axis.
  explicit engine_hooks(Engine& e, std::optional<axis> context = std::nullopt)
      : e_(&e), context_(context) {}
  std::optional<axis> context_axis() const override { return context_; }
  const flat_layout& layout() const override { return e_->layout(); }
  S& space() override { return e_->space(); }
  typename S::stream& compute_stream() override { return e_->compute_stream(); }
  std::span<const float> acquire(std::size_t u, phase ph) override { return e_->acquire(u, ph); }
  std::span<const float> params(std::size_t u) override { return e_->params(u); }
  void release(std::size_t u) override { e_->release(u); }
  std::span<float> grad_buffer(std::size_t u) override { return e_->grad_buffer(u); }
  void grads_ready(std::size_t u) override { e_->grads_ready(u); }
  const_buffer_view acquire_as(std::size_t u, phase ph, dtype t) override {
    return e_->acquire_as(u, ph, t);
  }
  buffer_view grad_buffer_as(std::size_t u, dtype t) override { return e_->grad_buffer_as(u, t); }
  bool holds(std::size_t u) const override { return e_->holds(u); }
  bool takes_gradients(std::size_t u) const override { return e_->takes_gradients(u); }
  int axis_rank(axis a) const override { return e_->topology().axis_rank(a); }
  int axis_size(axis a) const override { return e_->topology().axis_size(a); }
  void exchange(const plan& p, buffer_view area0, buffer_view area1) override {
    e_->exchange(p, area0, area1);
  }
  void agree(const comm_op& op, std::span<double> v) override {
    FEDSHARD_EXPECTS(op.kind == comm_kind::all_reduce && op.dtype == dtype::f64 &&
                         op.in.role == role::value && op.out.role == role::value &&
                         op.bytes == static_cast<std::int64_t>(8 * v.size()),
                     "step_context::agree: expected an all_reduce of ", v.size(),
                     " f64 values (role value), found ", describe(op));
    e_->run(op, {v.data(), v.size(), dtype::f64});
  }

 private:
  Engine* e_;
  std::optional<axis> context_;
};
}  // namespace detail

/// The model's view of one step, for buffers in memory space S: parameters to read,
/// gradient buffers to write (spans in S's memory), the stream to compute on, unit hooks.
/// In a host-accessible space (host_space) the spans may be read and written on the host
/// when a hook returns them; on a device, queue the work that uses them on stream().
template <class S = space::host_space>
class basic_step_context {
 public:
  using space_type = S;

  basic_step_context(detail::unit_hooks<S>& hooks, bool training, std::int64_t step, int rank)
      : hooks_(&hooks), training_(training), step_(step), rank_(rank) {}

  const flat_layout& layout() const { return hooks_->layout(); }
  /// The memory space of the spans the hooks return.
  S& space() { return hooks_->space(); }
  /// The stream to compute on: it waits for the gathers of acquired units, and the
  /// reductions started by grads_ready wait for the work queued on it.
  typename S::stream& stream() { return hooks_->compute_stream(); }
  /// True in training steps; false in evaluation (no gradients).
  bool training() const noexcept { return training_; }
  /// The 0-based step number.
  std::int64_t step() const noexcept { return step_; }
  /// This rank's world rank.
  int rank() const noexcept { return rank_; }

  /// Unit u's padded parameters for phase ph (forward or backward): fires the plan's
  /// gathers of (acquire, ph, u) unless u is live, and prefetches the next unit of ph.
  std::span<const float> acquire(std::size_t u, phase ph = phase::forward) {
    return hooks_->acquire(u, ph);
  }
  /// Done with unit u's parameters for now.
  void release(std::size_t u) { hooks_->release(u); }
  /// Unit u's gradients are written: start their reduction.
  void grads_ready(std::size_t u) {
    require_training("grads_ready");
    hooks_->grads_ready(u);
  }

  /// Mixed precision (FSDP2's): unit u's padded parameters for phase ph in the compute type
  /// T (float, bf16 or f16), a copy of the gathered values made on stream(); the f32 master
  /// is kept. With T the param dtype of the trainer's precision, the values are exactly the
  /// gathered ones.
  template <class T>
  std::span<const T> acquire_as(std::size_t u, phase ph = phase::forward) {
    const const_buffer_view v = hooks_->acquire_as(u, ph, dtype_of<T>);
    return {static_cast<const T*>(v.data), v.count};
  }
  /// Unit u's padded gradient buffer in the compute type T (zero at the start of the step):
  /// grads_ready(u) widens it into f32 and reduces it in the reduce dtype. A unit's gradients
  /// are written through grad_buffer or grad_buffer_as<T>, not both, in one step.
  template <class T>
  std::span<T> grad_buffer_as(std::size_t u) {
    require_training("grad_buffer_as");
    const buffer_view v = hooks_->grad_buffer_as(u, dtype_of<T>);
    return {static_cast<T*>(v.data), v.count};
  }

  /// True when this rank's group holds unit u: a unit it does not hold (an expert placed on
  /// other groups, shard/ownership.hpp) has no storage here, and every hook refuses it.
  bool holds(std::size_t u) const { return hooks_->holds(u); }
  /// True when unit u is trained with gradients. A zeroth-order unit (a local rule's
  /// gradient-free unit, trainer/local_rule.hpp) takes none: skip its backward, and that of
  /// the units below it that only it would need; its backward hooks refuse it.
  bool takes_gradients(std::size_t u) const { return hooks_->takes_gradients(u); }
  /// Context parallelism: the axis whose ranks were all given this batch, to spread over
  /// them (trainer_options::context_axis; fcp: the group's), or none (the batch is this
  /// rank's alone).
  std::optional<axis> context_axis() const { return hooks_->context_axis(); }
  /// This rank's rank on axis a of the trainer's mesh (a context-parallel group's rank: a
  /// model spreading a batch of sequences over the ranks of its group reads it here).
  int axis_rank(axis a) const { return hooks_->axis_rank(a); }
  /// The ranks on axis a.
  int axis_size(axis a) const { return hooks_->axis_size(a); }
  /// Context parallelism: runs point-to-point ops between the ranks of an axis on the
  /// model's buffers area0 and area1 (role value, index 0 and 1; in S's memory), in order,
  /// each done when this returns; counted at the wire on the ops' axis like the trainer's
  /// own calls. The ops of a context_plan (plan/context_plan.hpp: a model computing attention
  /// over blocks placed on its group's ranks sends its key/value blocks and their gradients
  /// with them; examples/charlm/attention_model.hpp). Every rank of the axis runs the ops of
  /// the same plan at the same point of its step.
  void exchange(const plan& ops, buffer_view area0, buffer_view area1) {
    hooks_->exchange(ops, area0, area1);
  }
  /// Runs op, an all_reduce of the f64 values v over an axis, with every rank of that axis at
  /// the same point of its step, counted at the wire; for checks that those ranks agree
  /// (context parallelism: plan/context_plan.hpp's check_same_batch). One rank: v unchanged.
  void agree(const comm_op& op, std::span<double> v) { hooks_->agree(op, v); }
  /// Unit u's padded parameters, gathered on first use if the unit was not acquired.
  std::span<const float> params(std::size_t u) { return hooks_->params(u); }
  /// Unit u's padded gradient buffer (zero at the start of the step).
  std::span<float> grad_buffer(std::size_t u) {
    require_training("grad_buffer");
    return hooks_->grad_buffer(u);
  }

  /// Tensor t of unit u (gathered on first use if the unit was not acquired).
  tensor_view<const float> param(std::size_t u, std::size_t t) {
    return {layout().tensor_view(hooks_->params(u), u, t), &slot(u, t)};
  }
  /// A tensor by name ("name" or "unit.name").
  tensor_view<const float> param(std::string_view name) {
    const auto [u, t] = find(name);
    return param(u, t);
  }
  /// The gradient buffer of tensor t of unit u (zero at the start of the step).
  tensor_view<float> grad(std::size_t u, std::size_t t) {
    require_training("grad");
    return {layout().tensor_view(hooks_->grad_buffer(u), u, t), &slot(u, t)};
  }
  /// A tensor's gradient by name.
  tensor_view<float> grad(std::string_view name) {
    const auto [u, t] = find(name);
    return grad(u, t);
  }

 private:
  const tensor_slot& slot(std::size_t u, std::size_t t) const {
    return layout().unit(u).tensors.at(t);
  }
  std::pair<std::size_t, std::size_t> find(std::string_view name) const {
    auto where = layout().find(name);
    FEDSHARD_EXPECTS(where.has_value(), "step_context: no tensor named '", name, "'");
    return *where;
  }
  void require_training(const char* what) const {
    FEDSHARD_EXPECTS(training_, "step_context::", what, " called during evaluation");
  }
  detail::unit_hooks<S>* hooks_;
  bool training_;
  std::int64_t step_;
  int rank_;
};

/// The step context of host buffers.
using step_context = basic_step_context<>;

/// See the numbered requirements above (with the step context of space S).
template <class M, class B, class S = space::host_space>
concept Model = requires(M& m, basic_step_context<S>& ctx, const B& batch) {
  { m.units() } -> std::convertible_to<std::vector<unit_spec>>;
  { m.forward_backward(ctx, batch) } -> std::convertible_to<float>;
};

/// M provides requirement 1 (units), the part of Model a trainer checks at its construction
/// (the batch type, and with it the rest of Model, is known only at step()).
template <class M>
concept ModelUnits = requires(M& m) {
  { m.units() } -> std::convertible_to<std::vector<unit_spec>>;
};

/// M provides requirement 4 (evaluate) with the step context of space S.
template <class M, class B, class S = space::host_space>
concept Evaluates = requires(M& m, basic_step_context<S>& ctx, const B& batch) {
  { m.evaluate(ctx, batch) } -> std::convertible_to<float>;
};

namespace detail {
// The member names model_capabilities<M> looks for: its own and near misses of them.
FEDSHARD_MEMBER_NAME(initial_values)
FEDSHARD_MEMBER_NAME(initial_value)
FEDSHARD_MEMBER_NAME(init_values)
FEDSHARD_MEMBER_NAME(eval)
FEDSHARD_MEMBER_NAME(evaluation)
FEDSHARD_MEMBER_NAME(token)
FEDSHARD_MEMBER_NAME(num_tokens)
}  // namespace detail

/// The optional requirement 3 of Model M, detected here and nowhere else (4 and 5 depend on
/// the batch type: Evaluates and tokens_of), and the checks for near-miss names of 3 to 5.
template <class M>
struct model_capabilities {
  /// 3.
  static constexpr bool initial_values = requires(M & m, const flat_layout& l, std::size_t u) {
    { m.initial_values(l, u) } -> std::convertible_to<std::vector<float>>;
  };

  static_assert(!detail::names_initial_value<M> && !detail::names_init_values<M>,
                "Model: the model has a member `initial_value` or `init_values`; did you mean "
                "`initial_values(const flat_layout&, std::size_t unit) -> std::vector<float>` "
                "(requirement 3, trainer/model.hpp)? Without it parameters start at zero");
  static_assert(!detail::names_initial_values<M> || initial_values,
                "Model: the model's `initial_values` is not callable as `initial_values(const "
                "flat_layout&, std::size_t unit) -> std::vector<float>` (requirement 3): "
                "parameters would start at zero");
  static_assert(!detail::names_eval<M> && !detail::names_evaluation<M>,
                "Model: the model has a member `eval` or `evaluation`; did you mean "
                "`evaluate(ctx, batch) -> float` (requirement 4, trainer/model.hpp)?");
  static_assert(!detail::names_token<M> && !detail::names_num_tokens<M>,
                "Model: the model has a member `token` or `num_tokens`; did you mean "
                "`tokens(batch) -> std::int64_t` (requirement 5, trainer/model.hpp)? Without it "
                "a batch weighs std::size(batch)");

  /// True once the checks above compiled.
  static constexpr bool checked = true;
};

/// Tokens (or samples) in a batch, as requirement 5 above says.
template <class M, class B>
std::int64_t tokens_of(M&& m, const B& batch) {
  if constexpr (requires {
                  { m.tokens(batch) } -> std::convertible_to<std::int64_t>;
                })
    return m.tokens(batch);
  else if constexpr (requires { std::size(batch); })
    return static_cast<std::int64_t>(std::size(batch));
  else
    return 1;
}

}  // namespace fedshard
