#pragma once
/// The shard engine: one rank's parameter and gradient storage under a ShardPolicy, and the
/// execution of the policy's step plan through unit hooks.
///
/// Storage: master() holds the rank's f32 master parameters (each unit's shard, back to back,
/// in unit order; the whole padded unit when the policy replicates) and grad() the reduced
/// gradients in the same layout; the optimizer acts on these two spans.
/// A step: begin_step(); for each unit acquire(u) (gathers it: the first acquire of a step is
/// forward, the second backward), release(u); write gradients into grad_buffer(u) and call
/// grads_ready(u) (reduces them); finish_backward() reduces whatever is left. Every
/// collective is one of the plan's comm_ops, run by the executor, so the traffic counters
/// equal the plan.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/error.hpp"
#include "fedshard/kernels/cast.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/plan/executor.hpp"
#include "fedshard/shard/flat_layout.hpp"
#include "fedshard/shard/shard_policy.hpp"

namespace fedshard::shard {

/// Executes ShardPolicy P for one rank of a mesh over Communicator C.
template <ShardPolicy P, Communicator C>
class engine {
 public:
  /// Collective over the mesh's world: checks the policy against the mesh and that every rank
  /// declared the same units.
  engine(mesh<C>& m, std::vector<unit_spec> units, precision prec = {})
      : mesh_(&m),
        prec_((prec.check(), prec)),
        layout_((P::check(m.shape()), std::move(units)), P::layout_shards(m.shape())),
        plan_(P::step_plan(layout_, m.shape(), prec_)),
        exec_(m),
        master_(layout_.total_shard_numel()),
        grad_(layout_.total_shard_numel()),
        units_(layout_.num_units()) {
    verify_same_layout(m.world(), layout_);
  }

  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  const flat_layout& layout() const noexcept { return layout_; }
  const precision& mixed_precision() const noexcept { return prec_; }
  /// The comm_ops of one step.
  const plan& step_plan() const noexcept { return plan_; }
  /// What this rank ran so far, per axis.
  traffic_counters& traffic() noexcept { return exec_.traffic(); }
  executor<C>& exec() noexcept { return exec_; }
  mesh<C>& topology() noexcept { return *mesh_; }

  /// This rank's f32 master parameters (unit shards back to back; padding stays zero).
  std::span<float> master() noexcept { return master_.span(); }
  /// This rank's reduced f32 gradients, laid out like master().
  std::span<float> grad() noexcept { return grad_.span(); }
  /// The part of master() that belongs to unit u.
  std::span<float> master_of(std::size_t u) {
    return master_.span().subspan(slice(u).first, slice(u).second);
  }
  /// The part of grad() that belongs to unit u.
  std::span<float> grad_of(std::size_t u) {
    return grad_.span().subspan(slice(u).first, slice(u).second);
  }

  /// Sets unit u's parameters from its full values (numel elements, the same on every rank);
  /// each rank keeps its part.
  void set_unit(std::size_t u, std::span<const float> values) {
    check_unit(u);
    const auto& ul = layout_.unit(u);
    FEDSHARD_EXPECTS(values.size() == ul.numel, "set_unit: unit '", ul.name, "' has ", ul.numel,
                     " elements, got ", values.size());
    const auto [off, len] = slice(u);
    const std::size_t begin = first_element(u);
    std::span<float> dst = master_.span().subspan(off, len);
    for (std::size_t i = 0; i < len; ++i)
      dst[i] = (begin + i < ul.numel) ? values[begin + i] : 0.0f;
  }

  /// Sets one tensor's values (the same on every rank).
  void set_tensor(std::string_view name, std::span<const float> values) {
    const auto where = layout_.find(name);
    FEDSHARD_EXPECTS(where.has_value(), "set_tensor: no tensor named '", name, "' in the layout");
    const auto [u, t] = *where;
    const auto& ts = layout_.unit(u).tensors[t];
    FEDSHARD_EXPECTS(values.size() == ts.numel, "set_tensor: tensor '", name, "' has ", ts.numel,
                     " elements, got ", values.size());
    const auto [off, len] = slice(u);
    const std::size_t begin = first_element(u);
    for (std::size_t i = 0; i < ts.numel; ++i) {
      const std::size_t e = ts.offset + i;
      if (e >= begin && e < begin + len) master_[off + (e - begin)] = values[i];
    }
  }

  /// Collective over the shard axis: unit u's full f32 master values (numel elements).
  std::vector<float> gather_unit(std::size_t u) {
    check_unit(u);
    const auto& ul = layout_.unit(u);
    std::vector<float> full(ul.padded_numel);
    if (!P::traits.shards_params) {
      auto m = master_of(u);
      std::copy(m.begin(), m.end(), full.begin());
    } else {
      auto m = master_of(u);
      mesh_->shard().all_gather(m.data(), full.data(), static_cast<std::int64_t>(m.size()),
                                dtype::f32);
    }
    full.resize(ul.numel);
    return full;
  }

  /// How many gathered units may be alive at once through prefetching (FSDP's
  /// limit_all_gathers); a unit the model asks for is always gathered.
  void set_max_live_units(int n) {
    FEDSHARD_EXPECTS(n >= 1, "max_live_units must be >= 1, found ", n);
    max_live_ = n;
  }
  int max_live_units() const noexcept { return max_live_; }
  /// Gathered (or gathering) units alive now, and the most seen since construction.
  int live_units() const noexcept { return live_; }
  int peak_live_units() const noexcept { return peak_live_; }
  /// True while unit u's parameters are gathered or being gathered.
  bool is_live(std::size_t u) const { return units_.at(u).state != gather_state::idle; }
  /// True while unit u's gather is in flight (started by a prefetch, not waited for yet).
  bool in_flight(std::size_t u) const { return units_.at(u).state == gather_state::gathering; }
  /// Gradient reductions started and not finished yet.
  std::size_t reductions_in_flight() const noexcept { return pending_.size(); }

  /// Starts a step: completes whatever is in flight, every unit becomes not gathered and no
  /// gradients are reduced.
  void begin_step() {
    drain_reductions();
    for (std::size_t u = 0; u < units_.size(); ++u) {
      auto& s = units_[u];
      free_params(u);  // the master changed since the last gather
      s.acquisitions = 0;
      s.reduced = false;
      s.grad_touched = false;
    }
  }

  /// Unit u's parameters as the model computes with them (padded_numel f32 values; use
  /// layout().tensor_view for tensors), gathering them if needed. The first acquire of a
  /// step is forward, the next backward; each prefetches the next unit in its direction
  /// (u + 1 forward, u - 1 backward) while the model computes.
  std::span<const float> acquire(std::size_t u) {
    check_unit(u);
    auto& s = units_[u];
    const phase ph = (s.acquisitions++ == 0) ? phase::forward : phase::backward;
    if (s.state == gather_state::idle) start_gather(u, ph);
    if (s.state == gather_state::gathering) complete_gather(u);
    if (ph == phase::forward && u + 1 < units_.size()) prefetch(u + 1, phase::forward);
    if (ph == phase::backward && u > 0) prefetch(u - 1, phase::backward);
    return params_view(u);
  }

  /// Unit u's parameters without counting an acquisition: gathers them if they are not
  /// live (a model that calls no hook gets its units gathered on first use, kept until the
  /// end of the step).
  std::span<const float> params(std::size_t u) {
    check_unit(u);
    auto& s = units_[u];
    if (s.state == gather_state::idle) {
      if (s.acquisitions == 0) s.acquisitions = 1;
      start_gather(u, s.acquisitions <= 1 ? phase::forward : phase::backward);
    }
    if (s.state == gather_state::gathering) complete_gather(u);
    return params_view(u);
  }

  /// The model is done with unit u's parameters for now (freed by policies that re-gather).
  void release(std::size_t u) {
    check_unit(u);
    if (P::traits.shards_params && P::traits.regather_for_backward) free_params(u);
  }

  /// Unit u's full f32 gradient buffer (padded_numel), zeroed on first use in a step; the
  /// model accumulates its gradients here, then calls grads_ready(u).
  std::span<float> grad_buffer(std::size_t u) {
    check_unit(u);
    auto& s = units_[u];
    FEDSHARD_EXPECTS(!s.reduced, "grad_buffer: unit ", u, " ('", layout_.unit(u).name,
                     "') was already reduced in this step");
    const std::size_t n = layout_.unit(u).padded_numel;
    if (!P::traits.shards_params) {
      auto g = grad_of(u);
      if (!s.grad_touched) std::fill(g.begin(), g.end(), 0.0f);
      s.grad_touched = true;
      return g;
    }
    if (s.full_grad.size() != n)
      s.full_grad = aligned_buffer<float>(n);
    else if (!s.grad_touched)
      std::fill(s.full_grad.begin(), s.full_grad.end(), 0.0f);
    s.grad_touched = true;
    return s.full_grad.span();
  }

  /// Unit u's gradients are complete: starts their reduction (averaged over the group's
  /// ranks) into grad_of(u); it overlaps whatever the model does next.
  void grads_ready(std::size_t u) {
    check_unit(u);
    auto& s = units_[u];
    FEDSHARD_EXPECTS(!s.reduced, "grads_ready: unit ", u, " ('", layout_.unit(u).name,
                     "') was already reduced in this step");
    if (!s.grad_touched) grad_buffer(u);  // no gradient written: contribute zeros
    s.reduced = true;
    s.grad_touched = false;
    if (P::traits.shards_params && !P::traits.regather_for_backward) free_params(u);
    start_reduction(u);
    advance_reductions(false);
  }

  /// Reduces the gradients of every unit not reduced yet (in backward order) and waits for
  /// all reductions: afterwards grad() holds the step's averaged gradients.
  void finish_backward() {
    for (std::size_t u = units_.size(); u-- > 0;)
      if (!units_[u].reduced) grads_ready(u);
    drain_reductions();
    for (std::size_t u = 0; u < units_.size(); ++u)
      if (P::traits.shards_params) free_params(u);
  }

 private:
  enum class gather_state : std::uint8_t { idle, gathering, gathered };
  enum class reduce_stage : std::uint8_t { scatter, replicas };

  struct unit_state {
    int acquisitions = 0;
    gather_state state = gather_state::idle;
    bool reduced = false;
    bool grad_touched = false;
    aligned_buffer<float> params;        // gathered f32 parameters
    aligned_buffer<std::byte> wire_in;   // parameter shard in the wire dtype
    aligned_buffer<std::byte> wire_out;  // gathered unit in the wire dtype
    pending_op gather_op;
    aligned_buffer<float> full_grad;          // full f32 gradients (sharded policies)
    aligned_buffer<std::byte> grad_wire_in;   // gradients in the reduce dtype
    aligned_buffer<std::byte> grad_wire_out;  // reduced gradient shard in the reduce dtype
  };

  struct reduction {
    std::size_t unit;
    reduce_stage stage;
    pending_op op;
  };

  void check_unit(std::size_t u) const {
    FEDSHARD_EXPECTS(u < units_.size(), "unit index must be < ", units_.size(), ", found ", u);
  }
  /// (offset, length) of unit u in master()/grad().
  std::pair<std::size_t, std::size_t> slice(std::size_t u) const {
    const std::size_t len =
        P::traits.shards_params ? layout_.unit(u).shard_numel : layout_.unit(u).padded_numel;
    return {layout_.shard_offset(u), len};
  }
  /// Index inside the unit of the first element this rank's master holds.
  std::size_t first_element(std::size_t u) const {
    return P::traits.shards_params ? layout_.shard_of(u, mesh_->coords().shard).begin : 0;
  }
  const comm_op& find_op(std::size_t u, comm_kind k, phase ph, axis a) const {
    for (const auto& op : plan_.ops)
      if (op.unit == static_cast<int>(u) && op.kind == k && op.when == ph && op.on == a) return op;
    throw invalid_argument(fedshard::detail::concat("fedshard: the ", P::name, " plan has no ",
                                                    to_string(k), " on the ", to_string(a),
                                                    " axis for unit ", u, " in ", to_string(ph)));
  }
  std::span<const float> params_view(std::size_t u) {
    if (!P::traits.shards_params && prec_.param == dtype::f32) return master_of(u);
    return units_[u].params.span();
  }

  void prefetch(std::size_t v, phase ph) {
    const auto& s = units_[v];
    const int expected = (ph == phase::forward) ? 0 : 1;
    if (s.state != gather_state::idle || s.acquisitions != expected || live_ >= max_live_) return;
    if (ph == phase::backward && !P::traits.regather_for_backward) return;
    start_gather(v, ph);
  }

  void start_gather(std::size_t u, phase ph) {
    auto& s = units_[u];
    const std::size_t n = layout_.unit(u).padded_numel;
    auto m = master_of(u);
    set_live(s, gather_state::gathering);
    if (s.params.size() != n) s.params = aligned_buffer<float>(n);
    if (!P::traits.shards_params) {  // replicated: at most a precision round trip
      if (prec_.param != dtype::f32) round_trip(m, s.params.span(), prec_.param);
      s.state = gather_state::gathered;
      return;
    }
    const comm_op& op = find_op(u, comm_kind::all_gather, ph, axis::shard);
    if (prec_.param == dtype::f32) {
      s.gather_op = exec_.start(op, m.data(), s.params.data());
      return;
    }
    const std::size_t esz = size_of(prec_.param);
    s.wire_in = aligned_buffer<std::byte>(m.size() * esz);
    s.wire_out = aligned_buffer<std::byte>(n * esz);
    kernels::cast(cview(m), buffer_view{s.wire_in.data(), m.size(), prec_.param});
    s.gather_op = exec_.start(op, s.wire_in.data(), s.wire_out.data());
  }

  void complete_gather(std::size_t u) {
    auto& s = units_[u];
    exec_.wait(s.gather_op);
    if (prec_.param != dtype::f32 && P::traits.shards_params) {
      kernels::cast(const_buffer_view{s.wire_out.data(), s.params.size(), prec_.param},
                    view(s.params.span()));
      s.wire_in = aligned_buffer<std::byte>();
      s.wire_out = aligned_buffer<std::byte>();
    }
    s.state = gather_state::gathered;
  }

  void free_params(std::size_t u) {
    auto& s = units_[u];
    if (s.state == gather_state::gathering) complete_gather(u);
    if (s.state == gather_state::idle) return;
    if (P::traits.shards_params) s.params = aligned_buffer<float>();
    set_live(s, gather_state::idle);
  }

  void set_live(unit_state& s, gather_state next) {
    const bool was = s.state != gather_state::idle, is = next != gather_state::idle;
    live_ += static_cast<int>(is) - static_cast<int>(was);
    peak_live_ = std::max(peak_live_, live_);
    s.state = next;
  }

  void start_reduction(std::size_t u) {
    auto& s = units_[u];
    auto g = grad_of(u);
    if (!P::traits.shards_params) {
      const comm_op& op = find_op(u, comm_kind::all_reduce, phase::backward, axis::group);
      pending_.push_back({u, reduce_stage::replicas, start_in_reduce_dtype(op, u, g)});
      return;
    }
    const comm_op& rs = find_op(u, comm_kind::reduce_scatter, phase::backward, axis::shard);
    if (prec_.reduce == dtype::f32) {
      pending_.push_back({u, reduce_stage::scatter, exec_.start(rs, s.full_grad.data(), g.data())});
      return;
    }
    const std::size_t esz = size_of(prec_.reduce);
    const std::size_t n = s.full_grad.size();
    s.grad_wire_in = aligned_buffer<std::byte>(n * esz);
    s.grad_wire_out = aligned_buffer<std::byte>(g.size() * esz);
    kernels::cast(cview(s.full_grad.span()), buffer_view{s.grad_wire_in.data(), n, prec_.reduce});
    pending_.push_back(
        {u, reduce_stage::scatter, exec_.start(rs, s.grad_wire_in.data(), s.grad_wire_out.data())});
  }

  /// Replicated policies reduce the whole unit over the group, in the reduce dtype.
  pending_op start_in_reduce_dtype(const comm_op& op, std::size_t u, std::span<float> g) {
    auto& s = units_[u];
    if (op.type == dtype::f32) return exec_.start(op, g.data(), g.data());
    s.grad_wire_out = aligned_buffer<std::byte>(g.size() * size_of(op.type));
    kernels::cast(cview(g), buffer_view{s.grad_wire_out.data(), g.size(), op.type});
    return exec_.start(op, s.grad_wire_out.data(), s.grad_wire_out.data());
  }

  /// Moves finished reductions on to their next stage, in the order they were started (so
  /// every rank issues the follow-up all_reduces in the same order). With wait = false only
  /// reductions that already completed move on.
  void advance_reductions(bool wait) {
    while (!pending_.empty()) {
      reduction& r = pending_.front();
      if (!wait && !r.op.req.test()) return;
      exec_.wait(r.op);
      auto& s = units_[r.unit];
      auto g = grad_of(r.unit);
      const bool wire = prec_.reduce != dtype::f32;
      if (r.stage == reduce_stage::scatter) {
        s.full_grad = aligned_buffer<float>();
        s.grad_wire_in = aligned_buffer<std::byte>();
        if (P::traits.reduce_over_replicas && mesh_->shape().replicas > 1) {
          const comm_op& ar =
              find_op(r.unit, comm_kind::all_reduce, phase::backward, axis::replica);
          void* buf = wire ? static_cast<void*>(s.grad_wire_out.data()) : g.data();
          r.stage = reduce_stage::replicas;
          r.op = exec_.start(ar, buf, buf);
          pending_.push_back(std::move(r));
          pending_.pop_front();
          continue;
        }
      }
      if (wire) {
        kernels::cast(const_buffer_view{s.grad_wire_out.data(), g.size(), prec_.reduce}, view(g));
        s.grad_wire_out = aligned_buffer<std::byte>();
      }
      pending_.pop_front();
    }
  }

  void drain_reductions() { advance_reductions(true); }

  /// dst = src rounded to dtype t and back to f32.
  static void round_trip(std::span<const float> src, std::span<float> dst, dtype t) {
    aligned_buffer<std::byte> tmp(src.size() * size_of(t));
    kernels::cast(cview(src), buffer_view{tmp.data(), src.size(), t});
    kernels::cast(const_buffer_view{tmp.data(), src.size(), t}, view(dst));
  }

  mesh<C>* mesh_;
  precision prec_;
  flat_layout layout_;
  plan plan_;
  executor<C> exec_;
  aligned_buffer<float> master_;
  aligned_buffer<float> grad_;
  std::vector<unit_state> units_;
  std::deque<reduction> pending_;
  int max_live_ = 2;
  int live_ = 0;
  int peak_live_ = 0;
};

}  // namespace fedshard::shard
