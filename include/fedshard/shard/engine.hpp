#pragma once
/// The shard engine: one rank's parameter and gradient storage under a ShardPolicy, in a
/// memory space, and the triggers that run the policy's step plan through the interpreter.
///
/// Storage, in the space's memory (space/memory_space.hpp): master() holds the rank's f32
/// master parameters (each unit's shard, back to back, in unit order; the whole padded unit
/// when the layout is not sharded) and grad() the reduced gradients in the same layout; the
/// optimizer acts on these two spans. A unit the plan gathers (an op writes its role
/// `params`) has a gathered buffer of its own; a unit whose gradient the plan reduces into
/// another buffer (an op reads role `grad` and writes elsewhere) has a full gradient buffer
/// of its own, otherwise the model writes into its gradient shard. These buffers are kept
/// from step to step at one address (no allocation per step after the first), so a tensor
/// view a model keeps of them (torch::from_blob) stays valid.
///
/// Streams: the model and the optimizer compute on compute_stream(); gathers run on a gather
/// stream, reductions on a reduce stream (FSDP2's scheme). A gather waits for the compute
/// work queued before it (the master it reads, the last use of the buffer it writes); the
/// compute stream waits for a unit's gather before the unit is handed to the model, and a
/// reduction waits for the compute work that wrote the gradients; with a stream-ordered
/// communicator none of this waits on the host. In a host-accessible space the host waits for
/// the compute stream before it hands the model a span to read or write.
///
/// A step: begin_step(); for each unit acquire(u, phase::forward), release(u); in backward
/// acquire(u, phase::backward), write gradients into grad_buffer(u), release(u) and call
/// grads_ready(u); finish_backward() reduces whatever is left, and the compute stream waits
/// for every reduction. Each hook fires its trigger (the interpreter runs the plan's ops for
/// it); what the engine keeps or frees follows from the plan: a unit the plan gathers again
/// for backward is freed (not live) when released, a unit gathered once is freed when its
/// gradients are ready. Acquiring a unit prefetches the next unit of the same phase, in the
/// order the plan gathers them, while at most max_live_units() gathered units are live.
///
/// Ownership (shard/ownership.hpp): a unit this rank's group does not hold has no storage
/// here (master(), grad() and the optimizer state leave it out; unit shards of the held units
/// back to back), no op in the step plan, and every hook that names it throws
/// invalid_argument saying so; holds(u) tells.
///
/// A policy with run-time state (P::runtime<S>, shard::sparse; shard/shard_policy.hpp,
/// requirement 6) gets its settings (settings_of_t<P>) here; at each step's start it says
/// which plan the step fires (begin_step, told whether every gathered buffer still holds
/// what the previous step gathered), it binds the roles the engine does not hold, takes the
/// optimizer step (optimizer_step) and is told when the master was written from outside
/// (parameters_changed). Everything it moves or packs is an op of its plans.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/state_registry.hpp"
#include "fedshard/error.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/plan/interpreter.hpp"
#include "fedshard/shard/flat_layout.hpp"
#include "fedshard/shard/ownership.hpp"
#include "fedshard/shard/shard_policy.hpp"
#include "fedshard/space/memory_space.hpp"
#include "fedshard/space/space_of.hpp"

namespace fedshard::shard {

/// Runs ShardPolicy P for one rank of a mesh over Communicator C, with its buffers in memory
/// space S (C's).
template <ShardPolicy P, Communicator C, space::MemorySpace S = space::space_of_t<C>>
class engine {
 public:
  using space_type = S;
  using stream_type = typename S::stream;

  /// Collective over the mesh's world: checks the policy against the mesh and the plan, the
  /// ownership against the layout and the mesh, and that every rank declared the same units.
  /// The space s outlives the engine.
  /// `gradient_free`: names of units trained without gradients (zeroth-order: see
  /// takes_gradients()).
  engine(mesh<C>& m, S& s, std::vector<unit_spec> units, precision prec = {},
         const ownership& owners = {}, const settings_of_t<P>& settings = {},
         const std::vector<std::string>& gradient_free = {})
      : engine(m, space::space_ref<S>(s), std::move(units), prec, owners, settings, gradient_free) {
  }
  /// With a space of its own (default-constructed S).
  engine(mesh<C>& m, std::vector<unit_spec> units, precision prec = {},
         const ownership& owners = {}, const settings_of_t<P>& settings = {},
         const std::vector<std::string>& gradient_free = {})
      : engine(m, space::space_ref<S>::make(), std::move(units), prec, owners, settings,
               gradient_free) {}

  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

 private:
  engine(mesh<C>& m, space::space_ref<S> sr, std::vector<unit_spec> units, precision prec,
         const ownership& owners, const settings_of_t<P>& settings,
         const std::vector<std::string>& gradient_free)
      : mesh_(&m),
        space_(std::move(sr)),
        prec_((prec.check(), prec)),
        layout_((check_groups(m), std::move(units)), P::layout_shards(m.shape())),
        owners_((owners.check(layout_, m.shape().groups), owners)),
        held_(owners_.held_by(m.coords().group, layout_.num_units())),
        offsets_(held_offsets(layout_, held_)),
        free_(units_named(layout_, gradient_free, "gradient-free unit")),
        plan_(only_held(without_backward_of_free(
            without_one_rank_identities(step_plan_of<P>(layout_, m.shape(), prec_, settings))))),
        read_plan_(only_held(ops::read_units(layout_, m.shape()))),
        setup_plan_(layout_check_plan(axis::world, m.size())),
        interp_(m, *space_),
        compute_(space_->make_stream()),
        gather_(space_->make_stream()),
        reduce_(space_->make_stream()),
        master_(space_->template allocate<float>(offsets_.back())),
        grad_(space_->template allocate<float>(offsets_.back())),
        units_(layout_.num_units()) {
    plan_.check();
    learn_from_plan();
    // Groups of different shapes cut the same units differently: compare the units.
    verify_same_layout(m.uniform() ? layout_ : flat_layout(unit_specs(layout_), 1), m.rank(),
                       m.size(), setup_plan_,
                       [&](const comm_op& op, buffer_view b) { run(op, b); });
    if constexpr (has_runtime)
      rt_.emplace(layout_, m.shape(), m.coords().shard, held_, offsets_, settings, plan_);
  }

  static std::string_view without_prefix(std::string_view m) {
    constexpr std::string_view p = "fedshard: ";
    return m.substr(0, p.size()) == p ? m.substr(p.size()) : m;
  }
  /// P::check of every group's view, on every rank alike (a group P cannot run on fails
  /// every rank, naming the group).
  static void check_groups(const mesh<C>& m) {
    if (m.uniform()) return P::check(m.shape());
    for (int g = 0; g < m.shape().groups; ++g) {
      const mesh_shape v = m.group_view(g);
      try {
        P::check(v);
      } catch (const invalid_argument& e) {
        throw invalid_argument(fedshard::detail::concat(
            "fedshard: mesh of group shapes ", to_string(m.group_shapes()), ": group ", g, " (",
            v.replicas, 'x', v.shards, ", replicas x shards): ", without_prefix(e.what())));
      }
    }
  }

 public:
  /// True when P has run-time state (P::runtime<S>).
  static constexpr bool has_runtime = runtime_of<P, S>::stateful;

  const flat_layout& layout() const noexcept { return layout_; }
  const precision& mixed_precision() const noexcept { return prec_; }
  /// Which groups hold which units (empty: every group holds every unit).
  const ownership& owners() const noexcept { return owners_; }
  /// True when this rank's group holds unit u (has storage for it).
  bool holds(std::size_t u) const { return u < held_.size() && held_[u]; }
  /// True when unit u is trained with gradients. A gradient-free unit (named at
  /// construction: a zeroth-order unit) has no backward gathers and no gradient reductions
  /// in the plan and no full gradient buffer; a model skips its backward (and everything
  /// below it that only it needs), and the hooks of its backward refuse it. Its part of
  /// grad() stays zero.
  bool takes_gradients(std::size_t u) const { return u < free_.size() && !free_[u]; }
  /// The comm_ops of one step (a policy with run-time state: of its dense steps; its
  /// runtime() has the others).
  const plan& step_plan() const noexcept { return plan_; }
  /// The policy's run-time state (policies with P::runtime<S> only).
  auto& runtime() requires has_runtime { return *rt_; }

  /// The optimizer step of this rank's master from grad(), queued on the compute stream:
  /// o's own step, or the policy's (its runtime's optimizer_step).
  template <class O>
  void optimizer_step(O& o, float lr) {
    if constexpr (has_runtime)
      rt_->optimizer_step(o, master(), std::span<const float>(grad()), lr, compute_, interp_);
    else
      o.step(master(), std::span<const float>(grad()), lr, compute_);
  }
  /// Tells the policy's runtime of the optimizer o (made with config cfg) the trainer steps.
  template <class O, class Config>
  void attach_optimizer(O& o, const Config& cfg) {
    if constexpr (has_runtime) rt_->attach(o, cfg, *space_);
  }
  /// The master was written by something other than optimizer_step (a federation sync, a
  /// checkpoint load): a policy's runtime drops what it derived from it.
  void parameters_changed() {
    if constexpr (has_runtime) rt_->invalidate();
  }
  /// The on-demand ops that read each unit's full parameters (gather_unit).
  const plan& read_plan() const noexcept { return read_plan_; }
  /// The ops construction ran (the layout check over the world).
  const plan& setup_plan() const noexcept { return setup_plan_; }
  /// What this rank moved so far, per axis, as counted at the wire.
  traffic_counters& traffic() noexcept { return interp_.traffic(); }
  /// The interpreter that runs every collective of this engine.
  interpreter<C, S>& interp() noexcept { return interp_; }
  /// The memory space of the engine's buffers.
  S& space() noexcept { return *space_; }
  /// The stream the model and the optimizer compute on.
  stream_type& compute_stream() noexcept { return compute_; }
  mesh<C>& topology() noexcept { return *mesh_; }
  const mesh<C>& topology() const noexcept { return *mesh_; }

  /// Registers the engine's state: the master (the model's parameters, "master"), the
  /// residuals of the step plan's stateful codecs (a step's: they start at zero on another
  /// setup) and the policy's runtime's state.
  void register_state(state_registry& reg) {
    reg.add_elements(
        {.name = "master", .extent = state_extent::master, .parameters = true}, master_.size(),
        [this](std::span<float> h) { download(master(), h); },
        [this](std::span<const float> h) { upload(h, master()); });
    interp_.register_codec_states(reg, plan_, "step", [](const comm_op&) {
      return state_entry{.name = {}, .survives_policy_change = false, .reshards = false};
    });
    if constexpr (has_runtime) rt_->register_state(reg, interp_);
  }

  /// This rank's f32 master parameters (unit shards back to back; padding stays zero), in
  /// the space's memory.
  std::span<float> master() noexcept { return master_.span(); }
  std::span<const float> master() const noexcept { return master_.span(); }
  /// This rank's reduced f32 gradients, laid out like master(), in the space's memory.
  std::span<float> grad() noexcept { return grad_.span(); }
  /// The part of master() that belongs to unit u.
  std::span<float> master_of(std::size_t u) { return slice_of(master_.span(), u); }
  std::span<const float> master_of(std::size_t u) const { return slice_of(master_.span(), u); }
  /// The part of grad() that belongs to unit u.
  std::span<float> grad_of(std::size_t u) { return slice_of(grad_.span(), u); }

  /// Sets unit u's parameters from its full values (numel elements on the host, the same on
  /// every rank); each rank keeps its part.
  void set_unit(std::size_t u, std::span<const float> values) {
    check_unit(u);
    const auto& ul = layout_.unit(u);
    FEDSHARD_EXPECTS(values.size() == ul.numel, "set_unit: unit '", ul.name, "' has ", ul.numel,
                     " elements, got ", values.size());
    const std::size_t begin = first_element(u);
    std::vector<float> mine(ul.shard_numel);
    for (std::size_t i = 0; i < mine.size(); ++i)
      mine[i] = (begin + i < ul.numel) ? values[begin + i] : 0.0f;
    upload(mine, master_of(u));
  }

  /// Sets one tensor's values (on the host, the same on every rank).
  void set_tensor(std::string_view name, std::span<const float> values) {
    const auto where = layout_.find(name);
    FEDSHARD_EXPECTS(where.has_value(), "set_tensor: no tensor named '", name, "' in the layout");
    const auto [u, t] = *where;
    const auto& ts = layout_.unit(u).tensors[t];
    FEDSHARD_EXPECTS(values.size() == ts.numel, "set_tensor: tensor '", name, "' has ", ts.numel,
                     " elements, got ", values.size());
    std::vector<float> mine = download(master_of(u));
    const std::size_t begin = first_element(u);
    for (std::size_t i = 0; i < ts.numel; ++i) {
      const std::size_t e = ts.offset + i;
      if (e >= begin && e < begin + mine.size()) mine[e - begin] = values[i];
    }
    upload(mine, master_of(u));
  }

  /// The elements of a span of the space's memory, copied to the host (after the compute
  /// work queued so far).
  std::vector<float> download(std::span<const float> from) {
    std::vector<float> host(from.size());
    space_->to_host(compute_, cview(from), view(std::span<float>(host)));
    space_->synchronize(compute_);
    return host;
  }
  /// The elements of a span of the space's memory, copied into `host` (of the same size; after
  /// the compute work queued so far).
  void download(std::span<const float> from, std::span<float> host) {
    FEDSHARD_EXPECTS(host.size() == from.size(), "download: ", from.size(), " elements into ",
                     host.size(), " values");
    space_->to_host(compute_, cview(from), view(host));
    space_->synchronize(compute_);
  }
  /// Copies host values into a span of the space's memory (before the compute work queued
  /// after this call).
  void upload(std::span<const float> host, std::span<float> to) {
    FEDSHARD_EXPECTS(host.size() == to.size(), "upload: ", host.size(), " values for ", to.size(),
                     " elements");
    space_->from_host(compute_, cview(host), view(to));
    space_->synchronize(compute_);
    parameters_changed();
  }

  /// Collective over the shard axis: one tensor's full values.
  std::vector<float> gather_tensor(std::string_view name) {
    const auto where = layout_.find(name);
    FEDSHARD_EXPECTS(where.has_value(), "trainer::tensor: no tensor named '", name, "'");
    const auto& slot = layout_.unit(where->first).tensors[where->second];
    auto full = gather_unit(where->first);
    return {full.begin() + static_cast<std::ptrdiff_t>(slot.offset),
            full.begin() + static_cast<std::ptrdiff_t>(slot.offset + slot.numel)};
  }
  /// Collective over the shard axis: all units' full parameters, concatenated (numel each).
  std::vector<float> gather_all() {
    std::vector<float> all;
    for (std::size_t u = 0; u < layout_.num_units(); ++u) {
      auto v = gather_unit(u);
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  }

  /// Collective over the axis the layout is sharded on (the read_plan's op for u; nothing
  /// moves when the layout is not sharded): unit u's full f32 master values (numel elements,
  /// on the host).
  std::vector<float> gather_unit(std::size_t u) {
    check_unit(u);
    const auto& ul = layout_.unit(u);
    const trigger_point at{.trigger = trigger::on_demand, .unit = static_cast<int>(u)};
    std::vector<float> full;
    if (read_plan_.at(at).ops.empty()) {
      full = download(master_of(u));
    } else {
      auto& tmp = scratch(ul.padded_numel * sizeof(float));
      const buffer_view out{tmp.data(), ul.padded_numel, dtype::f32};
      gather_after_compute();
      interp_.join(interp_.fire(
                       read_plan_, at,
                       [&](const comm_op& op, const operand& o) {
                         return o.role == role::value ? out : bind(op, o);
                       },
                       gather_),
                   compute_);
      full = download(std::span<const float>(static_cast<const float*>(out.data), out.count));
    }
    full.resize(ul.numel);
    return full;
  }

  /// Runs an on-demand op whose value operands are the host buffer b (both in and out),
  /// through the interpreter (counted on its axis), staged through the space's memory.
  void run(const comm_op& op, buffer_view b) {
    auto& tmp = scratch(b.size_bytes());
    const buffer_view in_space{tmp.data(), b.count, b.type};
    auto& st = interp_.own_stream();
    space_->from_host(st, const_buffer_view(b), in_space);
    interp_.run(op, [&](const comm_op& o, const operand& which) {
      return which.role == role::value ? in_space : bind(o, which);
    });
    space_->to_host(st, const_buffer_view(in_space), b);
    space_->synchronize(st);
  }

  /// Runs a model's point-to-point ops (a context_plan's forward or backward ops: send_recv,
  /// send and recv of role value, index 0 or 1), in order, each to completion, through the
  /// interpreter (counted on their axis), with the model's buffers area0 and area1 (in S's
  /// memory, the compute stream's work on them done); invalid_argument naming the op for any
  /// other op.
  void exchange(const plan& p, buffer_view area0, buffer_view area1) {
    for (const comm_op& op : p.ops)
      FEDSHARD_EXPECTS(
          point_to_point(op.kind) && (!has_input(op.kind) || op.in.role == role::value) &&
              (!has_output(op.kind) || op.out.role == role::value),
          "engine::exchange: expected point-to-point ops on value buffers, found ", describe(op));
    space_->synchronize(compute_);
    for (const comm_op& op : p.ops)
      interp_.run(op, [&](const comm_op&, const operand& which) {
        FEDSHARD_EXPECTS(which.index == 0 || which.index == 1,
                         "engine::exchange: a value operand names area 0 or 1, found ",
                         which.index);
        return which.index == 0 ? area0 : area1;
      });
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
  /// True while unit u's gathered parameters are valid or being gathered.
  bool is_live(std::size_t u) const { return units_.at(u).live; }
  /// True while unit u's gather is in flight: started (by an acquire or a prefetch) and not
  /// waited for yet. Whether the collective already completed underneath does not matter
  /// (that depends on the peers' timing).
  bool in_flight(std::size_t u) const {
    const auto& s = units_.at(u);
    return s.live && !s.gather_waited;
  }
  /// Gradient reductions started and not finished yet.
  std::size_t reductions_in_flight() const {
    std::size_t n = 0;
    for (const auto& s : units_) n += s.reduced && !interp_.done(s.reduction) ? 1 : 0;
    return n;
  }
  /// The phase of the step so far: forward until a unit is acquired for backward or its
  /// gradients are ready.
  fedshard::phase step_phase() const noexcept { return phase_; }

  /// Starts a step: the compute stream waits for this engine's gathers and reductions in
  /// flight (not for other firings of its interpreter, e.g. a federation sync that stays in
  /// flight across steps); no unit is live and no gradient reduced.
  void begin_step() {
    join_own();
    bool kept = true;  // every gathered buffer holds what the last step gathered into it
    for (std::size_t u = 0; u < units_.size(); ++u)
      if (held_[u] && plans_[u].own_params)
        kept = kept && (units_[u].gathered_for[0] || units_[u].gathered_for[1]);
    for (std::size_t u = 0; u < units_.size(); ++u) {
      free(u);
      auto& s = units_[u];
      s.gathered_for = {false, false};
      s.reduced = false;
      s.grad_touched = false;
      s.narrow_grad_type = dtype::f32;
      s.rounded = false;  // the master changed since the last step
    }
    phase_ = phase::forward;
    if constexpr (has_runtime) rt_->begin_step(kept);
  }

  /// Unit u's parameters for phase ph (padded_numel f32 values in the space's memory; use
  /// layout().tensor_view for tensors): fires the plan's gathers of (acquire, ph, u) unless u
  /// is live, prefetches the next unit of phase ph, and makes the compute stream wait for u.
  std::span<const float> acquire(std::size_t u, fedshard::phase ph = phase::forward) {
    check_unit(u);
    FEDSHARD_EXPECTS(ph == phase::forward || ph == phase::backward,
                     "acquire: the phase must be forward or backward, found ", to_string(ph));
    if (ph == phase::backward) check_takes_gradients(u, "acquire for backward");
    if (ph == phase::backward) phase_ = phase::backward;
    ensure(u, ph);
    prefetch(u, ph);
    return ready(u);
  }

  /// Mixed precision as in FSDP2: unit u's parameters for phase ph in the compute dtype t
  /// (f32, bf16 or f16; padded_numel elements in the space's memory), as acquire() does,
  /// then made on the compute stream from the gathered values, which the gather rounded
  /// through the param dtype (so with t == precision().param the copy is exact). The f32
  /// master stays where it is; the copy is kept from step to step at one address.
  const_buffer_view acquire_as(std::size_t u, fedshard::phase ph, dtype t) {
    const std::span<const float> p = acquire(u, ph);
    return compute_copy(u, p, t);
  }

  /// Unit u's parameters without prefetching, gathered for the step's phase (step_phase())
  /// if they are not live: a model that calls no hook gets its units gathered on first use.
  std::span<const float> params(std::size_t u) {
    check_unit(u);
    ensure(u, phase_);
    return ready(u);
  }

  /// The model is done with unit u's parameters for now: freed when the plan gathers u again
  /// for backward.
  void release(std::size_t u) {
    check_unit(u);
    if (has_gather(u, phase::backward) || free_[u]) free(u);  // a gradient-free unit: done
  }

  /// Unit u's full f32 gradient buffer (padded_numel, in the space's memory), zeroed on first
  /// use in a step; the model accumulates its gradients here, then calls grads_ready(u).
  std::span<float> grad_buffer(std::size_t u) {
    check_unit(u);
    check_takes_gradients(u, "grad_buffer");
    auto& s = units_[u];
    FEDSHARD_EXPECTS(!s.reduced, "grad_buffer: unit ", u, " ('", layout_.unit(u).name,
                     "') was already reduced in this step");
    FEDSHARD_EXPECTS(s.narrow_grad_type == dtype::f32, "grad_buffer: unit ", u, " ('",
                     layout_.unit(u).name, "') already has gradients in ",
                     to_string(s.narrow_grad_type), " (grad_buffer_as) in this step");
    const std::span<float> g = full_grad(u);
    if (!s.grad_touched) space_->fill(compute_, view(g), 0.0);
    s.grad_touched = true;
    host_ready();
    return g;
  }

  /// Unit u's gradient buffer in the compute dtype t (padded_numel elements, zero on first
  /// use in a step): a model computing in bf16 or f16 writes its gradients here, and
  /// grads_ready(u) widens them into the f32 gradient on the compute stream before the plan
  /// reduces them in the reduce dtype. A unit's gradients go either here or into
  /// grad_buffer(u) in one step, not both.
  buffer_view grad_buffer_as(std::size_t u, dtype t) {
    if (t == dtype::f32) return view(grad_buffer(u));
    check_unit(u);
    check_takes_gradients(u, "grad_buffer_as");
    check_compute_dtype(t);
    auto& s = units_[u];
    FEDSHARD_EXPECTS(!s.reduced, "grad_buffer_as: unit ", u, " ('", layout_.unit(u).name,
                     "') was already reduced in this step");
    FEDSHARD_EXPECTS(
        !s.grad_touched || s.narrow_grad_type == t, "grad_buffer_as: unit ", u, " ('",
        layout_.unit(u).name, "') already has gradients in ",
        s.narrow_grad_type == dtype::f32 ? "f32 (grad_buffer)" : to_string(s.narrow_grad_type),
        " in this step, asked for ", to_string(t));
    const std::size_t n = layout_.unit(u).padded_numel;
    if (s.narrow_grad.size() != n * size_of(t))
      s.narrow_grad = space_->template allocate<std::byte>(n * size_of(t));
    const buffer_view g{s.narrow_grad.data(), n, t};
    if (!s.grad_touched) space_->fill(compute_, g, 0.0);
    s.grad_touched = true;
    s.narrow_grad_type = t;
    host_ready();
    return g;
  }

  /// Unit u's gradients are complete (written on the compute stream, or on the host):
  /// fires the plan's reductions of (grads_ready, u) on the reduce stream, which average them
  /// over the group into grad_of(u) and overlap what the model does next.
  void grads_ready(std::size_t u) {
    check_unit(u);
    check_takes_gradients(u, "grads_ready");
    auto& s = units_[u];
    FEDSHARD_EXPECTS(!s.reduced, "grads_ready: unit ", u, " ('", layout_.unit(u).name,
                     "') was already reduced in this step");
    if (!s.grad_touched) grad_buffer(u);     // no gradient written: contribute zeros
    if (s.narrow_grad_type != dtype::f32) {  // written in a compute dtype: widen into f32
      space_->cast(
          compute_,
          const_buffer_view{s.narrow_grad.data(), layout_.unit(u).padded_numel, s.narrow_grad_type},
          view(full_grad(u)));
      s.narrow_grad_type = dtype::f32;
    }
    phase_ = phase::backward;
    s.reduced = true;
    s.grad_touched = false;
    if (!has_gather(u, phase::backward)) free(u);  // gathered once: kept until now
    space_->wait(reduce_, space_->record(compute_));
    s.reduction = interp_.fire(
        fired(),
        {.trigger = trigger::grads_ready, .phase = phase::backward, .unit = static_cast<int>(u)},
        binder(), reduce_);
    interp_.progress();
  }

  /// Reduces the gradients of every unit not reduced yet (in backward order), fires
  /// end_of_backward, and makes the compute stream wait for every reduction: then grad()
  /// holds the step's averaged gradients for the work queued on it.
  void finish_backward() {
    for (std::size_t u = units_.size(); u-- > 0;)
      if (held_[u] && !free_[u] && !units_[u].reduced) grads_ready(u);
    space_->wait(reduce_, space_->record(compute_));
    interp_.join(
        interp_.fire(fired(), {.trigger = trigger::end_of_backward, .phase = phase::backward},
                     binder(), reduce_),
        compute_);
    join_own();
    for (std::size_t u = 0; u < units_.size(); ++u) free(u);
  }

 private:
  struct unit_state {
    bool live = false;                   // gathered parameters valid or in flight
    std::array<bool, 2> gathered_for{};  // gathered this step for forward / backward
    bool reduced = false;
    bool grad_touched = false;
    bool rounded = false;                 // params holds the master rounded to the param dtype
    dtype narrow_grad_type = dtype::f32;  // the dtype of this step's gradients if not f32
    bool gather_waited = true;            // the compute stream joined the last gather started
    ticket gather;
    ticket reduction;
    typename S::template buffer<float> params;           // gathered (or rounded) f32 parameters
    typename S::template buffer<float> full_grad;        // the model's full gradient, when reduced
    typename S::template buffer<std::byte> rounding;     // the master in the param dtype
    typename S::template buffer<std::byte> compute;      // acquire_as's copy
    typename S::template buffer<std::byte> narrow_grad;  // grad_buffer_as's gradients
  };

  /// What the plan says about unit u.
  struct unit_plan {
    std::array<bool, 2> gathers{};  // the plan gathers u when acquired for forward / backward
    bool own_params = false;        // some op writes role params of u
    bool own_grad = false;          // some op reads role grad of u into another buffer
  };

  static std::size_t phase_index(fedshard::phase ph) { return ph == phase::backward ? 1 : 0; }

  /// The compute stream waits for this engine's own firings: every unit's gather and
  /// reduction.
  void join_own() {
    for (auto& s : units_) {
      join_gather(s);
      interp_.join(s.reduction, compute_);
    }
  }

  /// Gathers queued from now on wait for the compute work queued so far (the master they
  /// read, the last use of the buffers they write).
  void gather_after_compute() { space_->wait(gather_, space_->record(compute_)); }

  /// In a host-accessible space, the host waits for the compute stream (the model reads and
  /// writes spans on the host).
  void host_ready() {
    if constexpr (S::host_accessible) space_->synchronize(compute_);
  }

  /// A scratch buffer of the space of at least `bytes`, kept for later calls.
  typename S::template buffer<std::byte>& scratch(std::size_t bytes) {
    auto& b = scratch_[bytes];
    if (b.size() < bytes) b = space_->template allocate<std::byte>(bytes);
    return b;
  }

  void learn_from_plan() {
    plans_.resize(units_.size());
    for (const comm_op& op : plan_.ops) {
      FEDSHARD_EXPECTS(op.unit >= 0 && static_cast<std::size_t>(op.unit) < units_.size(), "the ",
                       P::name, " plan's ", describe(op), " names no unit of the layout's ",
                       units_.size());
      for (const operand* o : {&op.in, &op.out}) {
        const bool held = o->role == role::param_shard || o->role == role::params ||
                          o->role == role::grad || o->role == role::grad_shard ||
                          o->role == role::none;  // a broadcast reads no input
        FEDSHARD_EXPECTS(held, "the ", P::name, " plan's ", describe(op), " uses role ",
                         describe(*o),
                         ", but the shard engine holds only param_shard, params, grad and "
                         "grad_shard of a unit");
      }
      auto& up = plans_[static_cast<std::size_t>(op.unit)];
      if (op.out.role == role::params) up.own_params = true;
      if (op.trigger == trigger::acquire) {
        up.gathers[phase_index(op.phase)] = true;
        auto& order = order_[phase_index(op.phase)];
        if (std::find(order.begin(), order.end(), op.unit) == order.end()) order.push_back(op.unit);
      }
      if (op.in.role == role::grad && op.out.role != role::grad) up.own_grad = true;
    }
    for (std::size_t u = 0; u < units_.size(); ++u)
      FEDSHARD_EXPECTS(
          !held_[u] || free_[u] || plans_[u].own_grad ||
              layout_.unit(u).shard_numel == layout_.unit(u).padded_numel,
          "the ", P::name, " plan reduces no gradient of unit ", u, " ('", layout_.unit(u).name,
          "') into its shard, so the model would write its gradients into the "
          "shard, which holds ",
          layout_.unit(u).shard_numel, " of its ", layout_.unit(u).padded_numel, " elements");
  }

  /// The plan the hooks fire: plan_, or the one the policy's runtime composed for the step.
  const plan& fired() const {
    if constexpr (has_runtime)
      return rt_->active();
    else
      return plan_;
  }

  bool has_gather(std::size_t u, fedshard::phase ph) const {
    return plans_[u].gathers[phase_index(ph)];
  }

  void check_takes_gradients(std::size_t u, std::string_view what) const {
    FEDSHARD_EXPECTS(!free_[u], what, ": unit ", u, " ('", layout_.unit(u).name,
                     "') is trained without gradients (a gradient-free unit): it has no backward "
                     "and no gradient buffer; a model skips its backward when "
                     "takes_gradients(u) is false");
  }
  void check_unit(std::size_t u) const {
    FEDSHARD_EXPECTS(u < units_.size(), "unit index must be < ", units_.size(), ", found ", u);
    FEDSHARD_EXPECTS(held_[u], "unit ", u, " ('", layout_.unit(u).name, "') is not held by group ",
                     mesh_->coords().group, " (its holders are groups ",
                     group_list(owners_.holders_of(u, mesh_->shape().groups)),
                     "): this group has no storage for it, so a model must not touch it here "
                     "(step_context::holds(u) says which units are held)");
  }
  template <class T>
  std::span<T> slice_of(std::span<T> all, std::size_t u) const {
    check_unit(u);
    return all.subspan(offsets_[u], layout_.unit(u).shard_numel);
  }
  /// The ops of p on units this group holds.
  /// p without the collectives over one rank that change nothing (one_rank_identity): a
  /// group of one rank runs no per-step op, and an unsharded unit's params and gradients are
  /// its shard's own buffers. A policy with run-time state composes its own plans from p and
  /// keeps every op.
  static plan without_one_rank_identities(plan p) {
    if constexpr (has_runtime)
      return p;
    else
      return p.select([](const comm_op& op) { return !one_rank_identity(op); });
  }
  /// p without the backward gathers and gradient reductions of gradient-free units.
  plan without_backward_of_free(plan p) const {
    return p.select([&](const comm_op& op) {
      const bool backward = (op.trigger == trigger::acquire && op.phase == phase::backward) ||
                            op.trigger == trigger::grads_ready;
      return !(backward && op.unit >= 0 && free_.at(static_cast<std::size_t>(op.unit)));
    });
  }
  /// By unit: true for the units of l named in `names` (each must name one; `what` says what
  /// they are in the error).
  static std::vector<bool> units_named(const flat_layout& l, const std::vector<std::string>& names,
                                       std::string_view what) {
    std::vector<bool> out(l.num_units(), false);
    for (const auto& n : names) {
      bool found = false;
      for (std::size_t u = 0; u < l.num_units(); ++u)
        if (l.unit(u).name == n) out[u] = found = true;
      FEDSHARD_EXPECTS(found, "shard engine: no unit named '", n, "' for a ", what,
                       "; the units are ", unit_names(l));
    }
    return out;
  }
  static std::string unit_names(const flat_layout& l) {
    std::string s;
    for (std::size_t u = 0; u < l.num_units(); ++u)
      s += (u > 0 ? ", '" : "'") + l.unit(u).name + "'";
    return s;
  }
  plan only_held(plan p) const {
    if (owners_.everyone()) return p;
    return p.select([&](const comm_op& op) {
      return op.unit < 0 || held_.at(static_cast<std::size_t>(op.unit));
    });
  }
  /// Index inside the unit of the first element this rank's master holds.
  std::size_t first_element(std::size_t u) const {
    return layout_.shards() > 1 ? layout_.shard_of(u, mesh_->coords().shard).begin : 0;
  }

  /// The buffers of the roles this engine holds.
  auto binder() {
    return [this](const comm_op& op, const operand& o) { return bind(op, o); };
  }
  buffer_view bind(const comm_op& op, const operand& o) {
    FEDSHARD_EXPECTS(op.unit >= 0 && static_cast<std::size_t>(op.unit) < units_.size(), "the ",
                     P::name, " plan's ", describe(op), " names no unit of the layout");
    const auto u = static_cast<std::size_t>(op.unit);
    switch (o.role) {
      case role::param_shard: return view(master_of(u));
      case role::params: return view(gathered(u));
      case role::grad: return view(full_grad(u));
      case role::grad_shard: return view(grad_of(u));
      default:
        if constexpr (has_runtime) return rt_->bind(op, o, interp_);
        break;
    }
    throw invalid_argument(
        fedshard::detail::concat("fedshard: the shard engine holds no buffer of role ", describe(o),
                                 " (", describe(op), ")"));
  }

  std::span<float> gathered(std::size_t u) {
    auto& s = units_[u];
    const std::size_t n = layout_.unit(u).padded_numel;
    if (s.params.size() != n) s.params = space_->template allocate<float>(n);
    return s.params.span();
  }
  std::span<float> full_grad(std::size_t u) {
    if (!plans_[u].own_grad) return grad_of(u);
    auto& s = units_[u];
    const std::size_t n = layout_.unit(u).padded_numel;
    if (s.full_grad.size() != n) s.full_grad = space_->template allocate<float>(n);
    return s.full_grad.span();
  }

  /// The compute stream waits for unit s's last gather.
  void join_gather(unit_state& s) {
    interp_.join(s.gather, compute_);
    s.gather_waited = true;
  }

  /// Starts the gathers of (acquire, ph, u) unless unit u is live.
  void ensure(std::size_t u, fedshard::phase ph) {
    auto& s = units_[u];
    if (!plans_[u].own_params || s.live) return;  // the master itself (see ready), or live
    FEDSHARD_EXPECTS(has_gather(u, ph), "acquire: unit ", u, " ('", layout_.unit(u).name,
                     "') is not gathered and the ", P::name, " plan gathers it only for ",
                     has_gather(u, phase::forward) ? "forward" : "backward", ", not for ",
                     to_string(ph));
    start_gather(u, ph);
  }

  void start_gather(std::size_t u, fedshard::phase ph) {
    auto& s = units_[u];
    set_live(s, true);
    s.gathered_for[phase_index(ph)] = true;
    gather_after_compute();
    s.gather_waited = false;
    s.gather = interp_.fire(fired(),
                            {.trigger = trigger::acquire, .phase = ph, .unit = static_cast<int>(u)},
                            binder(), gather_);
  }

  /// Starts the gather of the unit after u in phase ph's order, if the limit allows.
  void prefetch(std::size_t u, fedshard::phase ph) {
    const auto& order = order_[phase_index(ph)];
    const auto it = std::find(order.begin(), order.end(), static_cast<int>(u));
    if (it == order.end() || it + 1 == order.end()) return;
    const auto v = static_cast<std::size_t>(*(it + 1));
    const auto& s = units_[v];
    if (s.live || s.gathered_for[phase_index(ph)] || s.reduced || live_ >= max_live_) return;
    start_gather(v, ph);
  }

  /// Unit u's parameters as the model computes with them: the compute stream waits for its
  /// gather (or the master rounded through the param dtype is queued on it), and in a
  /// host-accessible space the host waits for the compute stream.
  std::span<const float> ready(std::size_t u) {
    auto& s = units_[u];
    std::span<const float> p;
    if (plans_[u].own_params) {
      join_gather(s);
      p = s.params.span();
    } else if (prec_.param == dtype::f32) {
      p = master_of(u);
    } else {  // not gathered but computed with in the param dtype: the master rounded
      const std::span<float> r = gathered(u);
      if (!s.rounded) {
        const auto m = master_of(u);
        if (s.rounding.size() != m.size() * size_of(prec_.param))
          s.rounding = space_->template allocate<std::byte>(m.size() * size_of(prec_.param));
        const buffer_view narrow{s.rounding.data(), m.size(), prec_.param};
        space_->cast(compute_, cview(m), narrow);
        space_->cast(compute_, const_buffer_view(narrow), view(r));
        s.rounded = true;
      }
      p = r;
    }
    host_ready();
    return p;
  }

  static void check_compute_dtype(dtype t) {
    FEDSHARD_EXPECTS(t == dtype::f32 || t == dtype::bf16 || t == dtype::f16,
                     "the compute dtype must be f32, bf16 or f16, found ", to_string(t));
  }

  /// The parameters p of unit u in dtype t: p itself for f32, else a copy cast on the compute
  /// stream into the unit's compute buffer.
  const_buffer_view compute_copy(std::size_t u, std::span<const float> p, dtype t) {
    check_compute_dtype(t);
    if (t == dtype::f32) return cview(p);
    auto& s = units_[u];
    if (s.compute.size() != p.size() * size_of(t))
      s.compute = space_->template allocate<std::byte>(p.size() * size_of(t));
    const buffer_view c{s.compute.data(), p.size(), t};
    space_->cast(compute_, cview(p), c);
    host_ready();
    return const_buffer_view(c);
  }

  /// Unit u is no longer live (its buffer stays; a later gather waits for the compute work
  /// queued before it).
  void free(std::size_t u) { set_live(units_[u], false); }

  void set_live(unit_state& s, bool is) {
    live_ += static_cast<int>(is) - static_cast<int>(s.live);
    peak_live_ = std::max(peak_live_, live_);
    s.live = is;
  }

  mesh<C>* mesh_;
  space::space_ref<S> space_;  // first: the buffers below go back to it
  precision prec_;
  flat_layout layout_;
  ownership owners_;
  std::vector<bool> held_;            // by unit: this group holds it
  std::vector<std::size_t> offsets_;  // by unit: its shard's offset in master_ (then the size)
  std::vector<bool> free_;            // by unit: trained without gradients (gradient_free)
  plan plan_;
  plan read_plan_;
  plan setup_plan_;
  // P::runtime<S>, if any; before interp_: its buffers outlive the collectives in flight
  std::optional<typename runtime_of<P, S>::type> rt_;
  interpreter<C, S> interp_;
  stream_type compute_;
  stream_type gather_;
  stream_type reduce_;
  typename S::template buffer<float> master_;
  typename S::template buffer<float> grad_;
  std::vector<unit_state> units_;
  std::map<std::size_t, typename S::template buffer<std::byte>> scratch_;
  std::vector<unit_plan> plans_;
  std::array<std::vector<int>, 2> order_;  // units in the order the plan gathers them
  fedshard::phase phase_ = phase::forward;
  int max_live_ = 2;
  int live_ = 0;
  int peak_live_ = 0;
};

}  // namespace fedshard::shard
