#pragma once
/// trainer<Model, Algorithm, Optimizer, Communicator>: the policy triple composed into a
/// training loop.
///
/// A step: the shard engine fires the ShardPolicy's plan as the model's hooks ask, the inner
/// optimizer updates the rank's master shard, then the federation sync state machine
/// (federation/sync.hpp) fires the FederationPolicy's sync plan where the SyncSchedule says.
/// Every collective, the trainer's own included (layout check, means, checkpoint agreement),
/// runs through the engine's interpreter, so traffic() counts at the wire all that moved.
///
/// How a run ends: `while (!t.done()) t.step(next_batch());`. Under a step schedule
/// (periodic, streaming, ...) done() is step_count() >= total_steps (never, when total_steps
/// is 0: the caller counts). Under a progress schedule (token_budget, wall_clock) groups take
/// different numbers of steps, so a run cannot end on a step count: done() turns true right
/// after the group's run_syncs()-th sync, the same sync on every group, and a step after it
/// is refused (it would wait for a sync no other group makes). World collectives (save,
/// load, mean_over_world, parameters) then belong right after a sync (synced()), where every
/// group's k-th sync pairs up, or after done().

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/core/buffer.hpp"
#include "fedshard/error.hpp"
#include "fedshard/federation/heal.hpp"
#include "fedshard/federation/sync.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/optimizer.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/plan/interpreter.hpp"
#include "fedshard/shard/engine.hpp"
#include "fedshard/space/space_of.hpp"
#include "fedshard/trainer/algorithm.hpp"
#include "fedshard/trainer/checkpoint.hpp"
#include "fedshard/trainer/model.hpp"
#include "fedshard/trainer/reshard.hpp"

namespace fedshard {

/// Settings of a trainer beyond the optimizer's.
template <Algorithm A>
struct trainer_options {
  /// Parameter dtype on the wire and gradient reduce dtype (master is always f32).
  shard::precision precision{};
  /// Planned number of steps (the schedules sync on the final one); 0 = unknown.
  std::int64_t total_steps = 0;
  /// Gathered units alive at once through prefetching.
  int max_live_units = 2;
  /// Learning rate of each 0-based step; empty = the optimizer config's lr throughout.
  std::function<float(std::int64_t)> lr_schedule{};
  /// The federation policy's settings (sync mode, outer optimizer, ...).
  typename A::federation_policy::config federation{};
  /// The schedule's settings (K, H, fragments, delay, mixing), from the algorithm's defaults.
  typename A::sync_schedule::config schedule = A::default_schedule();
  /// The shard policy's settings (shard::sparse's density, refresh period); none for most.
  shard::settings_of_t<typename A::shard_policy> shard{};
  /// Where the trainer's log lines go (what a resharding load dropped or initialised), on
  /// every rank; empty = world rank 0 prints them to stderr.
  std::function<void(const std::string&)> log{};
};

/// The op of trainer::mean_over_world: an average all_reduce of one f64 (role value) over
/// the world of `world_size` ranks.
inline comm_op world_mean_op(int world_size) {
  return {.kind = comm_kind::all_reduce,
          .axis = axis::world,
          .dtype = dtype::f64,
          .bytes = 8,
          .ranks = world_size,
          .reduce = reduce_op::avg,
          .in = {.role = role::value},
          .out = {.role = role::value},
          .overlappable = false};
}

/// Trains ModelT (a fedshard::Model) with A (an Algorithm) and the inner ShardOptimizer O on
/// one rank of a mesh over Communicator C. Its buffers (parameters, gradients, optimizer and
/// federation state) live in memory space S, by default C's (space/space_of.hpp): host memory
/// for inproc, shaped and mpi, the GPU for nccl and gpu_inproc. Another S works with a host
/// communicator when the host can read S's memory (S::host_accessible; tests run the trainer
/// on space::checked_space that way).
template <class ModelT, Algorithm A, optim::ShardOptimizer O, Communicator C,
          space::MemorySpace S = space::space_of_t<C>>
class trainer final : private detail::unit_hooks<S> {
  static_assert(std::is_same_v<S, space::space_of_t<C>> || S::host_accessible,
                "fedshard::trainer: a space other than the communicator's must be one the host "
                "can read (the communicator reads and writes its buffers on the host)");

 public:
  using space_type = S;
  using shard_policy = typename A::shard_policy;
  using federation_policy = typename A::federation_policy;
  using sync_schedule = typename A::sync_schedule;
  using engine_type = shard::engine<shard_policy, C, space_type>;
  using optimizer_type = optim::in_space_t<O, space_type>;
  using sync_type = federation::synchronizer<federation_policy, sync_schedule, space_type>;
  using context_type = basic_step_context<space_type>;
  using options = trainer_options<A>;

  /// Collective over the mesh's world (every rank constructs its trainer with the same model
  /// declaration and settings).
  trainer(mesh<C>& m, ModelT model, typename O::config opt = {}, options o = {})
      : space_(make_space(m.world())),
        model_(std::move(model)),
        opts_(std::move(o)),
        engine_(m, *space_, model_.units(), opts_.precision, shard::ownership_of(opts_.federation),
                opts_.shard),
        optimizer_(opt, engine_.master().size(), *space_),
        base_lr_(opt.lr),
        sync_(opts_.federation, opts_.schedule, engine_.layout(), m.shape(), m.coords(),
              static_cast<int>(optimizer_.state().size()), *space_,
              overlap_of(m, engine_.layout())) {
    FEDSHARD_EXPECTS(opts_.total_steps >= 0, "trainer: total_steps must be >= 0, found ",
                     opts_.total_steps);
    if constexpr (sync_type::by_progress) {
      FEDSHARD_EXPECTS(
          opts_.total_steps == 0, "trainer: total_steps must be 0 with the ", sync_schedule::name,
          " schedule (groups take different numbers of steps; the run ends after its ",
          sync_.schedule().run_syncs(), " syncs: trainer::done()), found ", opts_.total_steps);
      // Groups step at their own pace: a per-step collective across groups would wait for
      // a step the other groups take at another time (or never).
      for (const comm_op& op : engine_.step_plan().ops)
        FEDSHARD_EXPECTS(
            m.shape().groups == 1 || (op.axis != axis::federation && op.axis != axis::world),
            "trainer: the ", sync_schedule::name,
            " schedule lets groups take different numbers of steps, so every step op must "
            "stay inside a group; the ",
            shard_policy::name, " step plan has ", fedshard::describe(op));
    }
    engine_.set_max_live_units(opts_.max_live_units);
    engine_.attach_optimizer(optimizer_, opt);
    if constexpr (requires { model_.initial_values(engine_.layout(), std::size_t{0}); }) {
      for (std::size_t u = 0; u < engine_.layout().num_units(); ++u)
        if (engine_.holds(u)) engine_.set_unit(u, model_.initial_values(engine_.layout(), u));
    }
  }

  trainer(const trainer&) = delete;
  trainer& operator=(const trainer&) = delete;

 private:
  /// How every group of a heterogeneous mesh cuts the model (federation/overlap.hpp); null
  /// on a uniform mesh.
  /// Checkpoints describe one G x R x S mesh: refused (on every rank alike) on groups of
  /// different shapes.
  void uniform_mesh_only(const char* what) {
    const auto& m = engine_.topology();
    FEDSHARD_EXPECTS(m.uniform(), "trainer: ", what, " expect groups of one shape (a G x R x S ",
                     "mesh), found group shapes ", to_string(m.group_shapes()));
  }
  static std::shared_ptr<const federation::overlap_map> overlap_of(const mesh<C>& m,
                                                                   const flat_layout& l) {
    if (m.uniform()) return nullptr;
    return federation::make_overlap_map(l, m.group_shapes(), m.coords(), [](const mesh_shape& v) {
      return shard_policy::layout_shards(v);
    });
  }

 public:
  /// Waits for a save_async() still writing (its error, if any, goes to the log: the
  /// destructor cannot agree with the other ranks).
  ~trainer() override {
    if (!pending_save_) return;
    pending_save_->thread.join();
    if (pending_save_->error) {
      try {
        std::rethrow_exception(pending_save_->error);
      } catch (const std::exception& e) {
        log(fedshard::detail::concat("fedshard: checkpoint: a save_async into '",
                                     pending_save_->dir.string(),
                                     "' failed and its trainer was destroyed before "
                                     "wait_for_save(): ",
                                     e.what()),
            true);
      }
    }
  }

  /// One training step on this rank's batch; returns the rank's loss.
  template <class Batch>
  float step(const Batch& batch) {
    static_assert(fedshard::Model<ModelT, Batch, space_type>,
                  "fedshard::trainer::step: the model must provide units() and "
                  "forward_backward(basic_step_context<S>&, const Batch&) -> float, with S the "
                  "communicator's memory space (step_context for host memory)");
    static_assert(!(sync_type::by_progress && elastic_federation),
                  "fedshard::trainer: a progress schedule (token_budget, wall_clock) on an "
                  "elastic federation axis is not supported; use a step schedule (periodic)");
    if constexpr (sync_type::by_progress)
      FEDSHARD_EXPECTS(!done(), "trainer::step: the run is done: ", sync_schedule::name,
                       " ends a run after ", sync_.schedule().run_syncs(), " syncs, found ",
                       syncs_applied(),
                       " applied (another step would wait for a sync no other group makes); "
                       "loop while !done()");
    auto& compute = engine_.compute_stream();
    if (!started_) {
      sync_.reset(engine_.master(), compute);  // anchors start from the initial parameters
      sync_.start_clock();
      started_ = true;
    }
    engine_.begin_step();
    context_type ctx(*this, true, step_, engine_.topology().rank());
    const float loss = static_cast<float>(model_.forward_backward(ctx, batch));
    engine_.finish_backward();
    const float lr = opts_.lr_schedule ? opts_.lr_schedule(step_) : base_lr_;
    engine_.optimizer_step(optimizer_, lr);
    sync_.add_tokens(tokens_of(model_, batch));
    if constexpr (elastic_federation) begin_elastic_round(compute);
    const std::int64_t syncs = sync_.syncs_applied();
    sync_.after_step(engine_.interp(), step_, opts_.total_steps, engine_.master(),
                     optimizer_.state(), compute);
    if (sync_.syncs_applied() != syncs) engine_.parameters_changed();
    ++step_;
    return loss;
  }

  /// The model's loss on a batch without training (uses Model::evaluate); the units it reads
  /// are gathered as in forward.
  template <class Batch>
  float evaluate(const Batch& batch) {
    // A named concept: nvcc 13 rejects this requires-expression written inline here.
    static_assert(Evaluates<ModelT, Batch, space_type>,
                  "fedshard::trainer::evaluate: the model must provide "
                  "evaluate(basic_step_context<S>&, const Batch&)");
    engine_.begin_step();
    context_type ctx(*this, false, step_, engine_.topology().rank());
    const float loss = static_cast<float>(model_.evaluate(ctx, batch));
    engine_.begin_step();  // frees what evaluation gathered
    return loss;
  }

  /// Collective over the world: the mean of a value over all ranks (e.g. an evaluation
  /// loss), world_mean_op run through the interpreter.
  double mean_over_world(double value) {
    engine_.run(world_mean_op(engine_.topology().size()), {&value, 1, dtype::f64});
    return value;
  }

  /// Collective over the shard axis: unit u's full parameters (numel values).
  std::vector<float> unit_parameters(std::size_t u) { return engine_.gather_unit(u); }
  /// Collective over the shard axis: one tensor's full values.
  std::vector<float> tensor(std::string_view name) {
    const auto where = engine_.layout().find(name);
    FEDSHARD_EXPECTS(where.has_value(), "trainer::tensor: no tensor named '", name, "'");
    const auto& slot = engine_.layout().unit(where->first).tensors[where->second];
    auto full = engine_.gather_unit(where->first);
    return {full.begin() + static_cast<std::ptrdiff_t>(slot.offset),
            full.begin() + static_cast<std::ptrdiff_t>(slot.offset + slot.numel)};
  }
  /// Collective over the shard axis: all units' full parameters, concatenated (numel each).
  std::vector<float> parameters() {
    std::vector<float> all;
    for (std::size_t u = 0; u < engine_.layout().num_units(); ++u) {
      auto v = engine_.gather_unit(u);
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  }
  /// Sets a tensor's values (the same on every rank); only before the first step.
  void set_tensor(std::string_view name, std::span<const float> values) {
    FEDSHARD_EXPECTS(!started_,
                     "trainer::set_tensor: parameters can only be set before the first step");
    engine_.set_tensor(name, values);
  }

  /// Steps taken.
  std::int64_t step_count() const noexcept { return step_; }
  /// What this rank moved so far, per axis, as counted at the wire.
  traffic_counters& traffic() noexcept { return engine_.traffic(); }
  /// Every call at the wire (enable with wire().keep_calls(true)) and the counters.
  wire_log& wire() noexcept { return engine_.interp().wire(); }
  /// The comm_ops of one inner step.
  const plan& step_plan() const noexcept { return engine_.step_plan(); }
  /// The comm_ops one sync of fragment f moves for this rank.
  const plan& sync_plan(int f = 0) const { return sync_.sync_plan(f); }
  /// The comm_ops construction ran (the layout check).
  const plan& setup_plan() const noexcept { return engine_.setup_plan(); }
  /// Number of federation syncs applied so far (all fragments).
  std::int64_t syncs_applied() const noexcept { return sync_.syncs_applied(); }
  /// Step numbers at which fragment f applied a sync.
  const std::vector<std::int64_t>& sync_steps(int f = 0) const { return sync_.sync_steps(f); }
  /// True when the run is over (see the file comment): after run_syncs() syncs under a
  /// progress schedule, else once total_steps (> 0) steps are taken.
  bool done() const noexcept {
    if constexpr (sync_type::by_progress)
      return sync_.syncs_applied() >= sync_.schedule().run_syncs();
    else
      return opts_.total_steps > 0 && step_ >= opts_.total_steps;
  }
  /// True when the latest step applied a sync (of any fragment): a point where every group
  /// stands at the same sync.
  bool synced() const {
    for (int f = 0; f < sync_.fragments(); ++f) {
      const auto& at = sync_.sync_steps(f);
      if (!at.empty() && at.back() == step_ - 1) return true;
    }
    return false;
  }
  /// The group's progress as its ranks agreed on it after the latest step (progress
  /// schedules: tokens since the last sync, seconds since the start, syncs).
  const schedule::sync_progress& progress() const noexcept { return sync_.progress(); }
  /// The ops run after every step to agree on the group's progress (progress_op under a
  /// progress schedule, else none).
  const plan& progress_plan() const noexcept { return sync_.progress_plan(); }

  /// Collective over the world: writes every rank's whole state (master shard, inner and
  /// outer optimizer state, anchors, schedule phase, step) into directory dir, with a
  /// manifest of the mesh and layout (checkpoint::save), written last: a save that stops
  /// half-way leaves the previous checkpoint in dir loadable. A sync still in flight is
  /// completed (not applied) first, so the restored run applies it at the same step.
  void save(const std::filesystem::path& dir) {
    wait_for_save();
    uniform_mesh_only("checkpoints");
    sync_.complete_in_flight(engine_.interp());
    auto& m = engine_.topology();
    checkpoint::save(
        dir, m.rank(), m.size(), manifest(), agree(),
        [&](checkpoint::file_writer& w) { write_state(w); },
        [&](checkpoint::file_writer& w) { describe(w); }, &staging_);
  }

  /// Collective over the world: save(dir) without waiting for the files. The rank's state is
  /// copied into host memory (a snapshot: training goes on changing the live state) and
  /// written by a thread of its own; world rank 0 writes the manifest once every rank's file
  /// is there (so dir must be one that every rank sees, as for load). At most one save is in
  /// flight: another save, save_async or load waits for it first.
  void save_async(const std::filesystem::path& dir) {
    wait_for_save();
    uniform_mesh_only("checkpoints");
    sync_.complete_in_flight(engine_.interp());
    auto& m = engine_.topology();
    auto job = checkpoint::prepare_save(
        dir, m.rank(), m.size(), manifest(), agree(),
        [&](checkpoint::file_writer& w) { write_state(w); },
        [&](checkpoint::file_writer& w) { describe(w); }, &staging_);
    pending_save_ = std::make_unique<pending_save>();
    pending_save_->dir = dir;
    pending_save_->thread = std::thread([job = std::move(job), p = pending_save_.get()]() mutable {
      try {
        job.run(true);
      } catch (...) {
        p->error = std::current_exception();
      }
      p->used.recycle(std::move(job.rank_file));  // for the next save's snapshot
      p->done.store(true, std::memory_order_release);
    });
  }

  /// Collective over the world: waits until the save_async() in flight, if any, is written
  /// (manifest included); its failure on any rank throws on every rank.
  void wait_for_save() {
    if (!pending_save_) return;
    pending_save_->thread.join();
    const std::exception_ptr error = pending_save_->error;
    staging_.recycle(std::move(pending_save_->used));
    pending_save_.reset();
    auto& m = engine_.topology();
    auto a = agree();
    checkpoint::detail::all_ok(error, "writing a checkpoint in the background", m.rank(), m.size(),
                               a);
  }
  /// True while this rank's part of a save_async() is still being written.
  bool save_in_flight() const noexcept {
    return pending_save_ && !pending_save_->done.load(std::memory_order_acquire);
  }

  /// Collective over the world: restores the state saved by save(dir) (checkpoint::load).
  /// A checkpoint of this very setup (mesh, layout, algorithm, optimizer, precision) is
  /// restored rank by rank, bit-identically. Any other one of the same model is resharded:
  /// each rank reads exactly the element ranges it now owns (master, inner optimizer state,
  /// anchors and outer-optimizer state), group g from the saver's group g mod G; state this
  /// run has no use for is dropped and state it needs but the checkpoint lacks starts as at a
  /// fresh start, each said in one log line. Another model, a missing, torn, truncated or
  /// corrupt file are refused on every rank, and nothing is changed unless every rank read
  /// and verified everything it needs.
  void load(const std::filesystem::path& dir) {
    wait_for_save();
    uniform_mesh_only("checkpoints");
    auto& m = engine_.topology();
    checkpoint::load(
        dir, m.rank(), m.size(), agree(),
        [&](const checkpoint::saved_checkpoint& saved) { return prepare_load(saved); });
  }

  /// True when the federation axis is an elastic link (comm/elastic.hpp): groups that are
  /// jobs of their own, meeting in rounds.
  static constexpr bool elastic_federation = requires(C & c) {
    c.federation_side().begin_round(std::int64_t{});
  };

  /// The host waits for the work queued on the compute stream (to read the master or the
  /// optimizer state in a host-accessible space).
  void synchronize() { space_->synchronize(engine_.compute_stream()); }

  const flat_layout& layout() const override { return engine_.layout(); }
  /// The memory space of the trainer's buffers.
  space_type& space() override { return *space_; }
  engine_type& engine() noexcept { return engine_; }
  optimizer_type& optimizer() noexcept { return optimizer_; }
  typename sync_type::policy_type& federation() noexcept { return sync_.policy(); }
  const sync_schedule& schedule() const noexcept { return sync_.schedule(); }
  ModelT& model() noexcept { return model_; }
  mesh<C>& topology() noexcept { return engine_.topology(); }
  const options& settings() const noexcept { return opts_; }

 private:
  // unit_hooks: the step context forwards here.
  typename space_type::stream& compute_stream() override { return engine_.compute_stream(); }
  std::span<const float> acquire(std::size_t u, phase ph) override {
    return engine_.acquire(u, ph);
  }
  std::span<const float> params(std::size_t u) override { return engine_.params(u); }
  bool holds(std::size_t u) const override { return engine_.holds(u); }
  void release(std::size_t u) override { engine_.release(u); }
  std::span<float> grad_buffer(std::size_t u) override { return engine_.grad_buffer(u); }
  void grads_ready(std::size_t u) override { engine_.grads_ready(u); }
  const_buffer_view acquire_as(std::size_t u, phase ph, dtype t) override {
    return engine_.acquire_as(u, ph, t);
  }
  buffer_view grad_buffer_as(std::size_t u, dtype t) override {
    return engine_.grad_buffer_as(u, t);
  }

  /// Where a sync starts after this step and the federation axis is elastic: the round
  /// (elastic::link::begin_round), healing its joiners, and the groups the sync combines.
  template <class Stream>
  void begin_elastic_round(Stream& compute) {
    bool starts = false;
    for (int f = 0; f < sync_.fragments(); ++f)
      starts = starts || schedule::starts(sync_.schedule().action(f, step_, opts_.total_steps));
    if (!starts) return;
    auto& link = engine_.topology().federation().federation_side();
    const auto& round = link.begin_round(step_);
    if (!round.joiners.empty()) {
      space_->synchronize(compute);
      heal_joiners(round);
    }
    sync_.set_included_source([&link] { return link.included(); });
  }

  /// The donor sends its whole state (what a checkpoint holds: parameters, inner and outer
  /// optimizer state, step) to the round's joiners, rank by rank, as the heal plan
  /// (federation/heal.hpp) run by the interpreter; a joiner verifies it and takes it, so it
  /// syncs from the donor's step on.
  template <class Round>
  void heal_joiners(const Round& round) {
    auto& m = engine_.topology();
    const auto h = federation::heal(
        engine_.interp(),
        {.ranks = m.axis_size(axis::federation),
         .donor = round.donor,
         .joiners = round.joiners,
         .me = m.axis_rank(axis::federation)},
        [this] {
          checkpoint::file_writer w;
          write_state(w);
          return w.bytes();
        },
        [&](std::string blob) {
          const checkpoint::file_reader r(
              std::move(blob), fedshard::detail::concat("the state of group ", round.donor));
          restore(r, false);
          restore(r, true);
        });
    if (h.received)
      log(fedshard::detail::concat("fedshard: heal: group ", m.coords().group,
                                   " took the state of group ", round.donor, " (", h.state_bytes,
                                   " bytes) in round ", round.round),
          true);
  }

  /// How checkpoints agree across the world: agreement_op through the interpreter.
  auto agree() {
    return [this](double x, reduce_op op) {
      engine_.run(checkpoint::agreement_op(op, engine_.topology().size()), {&x, 1, dtype::f64});
      return x;
    };
  }

  /// What a checkpoint of this run must match.
  checkpoint::manifest manifest() {
    checkpoint::manifest m;
    char fp[24];
    std::snprintf(fp, sizeof fp, "%016llx",
                  static_cast<unsigned long long>(engine_.layout().fingerprint()));
    m.fields["format"] = "2";
    m.fields["mesh"] = to_string(engine_.topology().shape());
    m.fields["layout"] = fp;
    m.fields["layout_summary"] = engine_.layout().summary();
    m.fields["shard_policy"] = std::string(shard_policy::name);
    m.fields["federation_policy"] = std::string(federation_policy::name);
    m.fields["sync_schedule"] =
        fedshard::detail::concat(sync_schedule::name, " with ", sync_.fragments(), " fragment(s)");
    m.fields["precision"] = fedshard::detail::concat(to_string(opts_.precision.param), "/",
                                                     to_string(opts_.precision.reduce));
    std::string names;
    for (const auto& t : optimizer_.state()) names += t.name + " ";
    m.fields["optimizer_state"] = names;
    if (const std::string o = ownership_field(); !o.empty()) m.fields["ownership"] = o;
    return m;
  }

  /// The manifest's "ownership" field: each unit's holders, or "" when every group holds
  /// every unit (then the field is left out).
  std::string ownership_field() const {
    const shard::ownership& o = engine_.owners();
    if (o.everyone()) return {};
    std::string s = fedshard::detail::concat(o.groups, " groups:");
    for (const shard::group_set h : o.holders) s += " " + group_list(h);
    return s;
  }

  /// The manifest's description of this rank's layout (checkpoint::saved_layout), which a
  /// resharding load of another setup reads.
  void describe(checkpoint::file_writer& w) {
    const auto units = static_cast<int>(engine_.layout().num_units());
    std::vector<std::vector<int>> fragments;
    for (int f = 0; f < sync_.fragments(); ++f)
      fragments.push_back(sync_.schedule().fragment_units(f, units));
    std::vector<std::string> inner, outer;
    for (const auto& t : optimizer_.state()) inner.push_back(t.name);
    for (const auto& t : sync_.policy().state()) outer.push_back(t.name);
    checkpoint::saved_layout::describe(w, engine_.topology().shape(), engine_.layout(), fragments,
                                       inner, outer);
  }

  /// What load() runs before any rank changes anything: reads and checks this rank's state;
  /// returns what applies it.
  std::function<void()> prepare_load(const checkpoint::saved_checkpoint& saved) {
    // Ownership masks change which units a rank stores: only the same masks load (rank by
    // rank); resharding across masks is not supported yet.
    const auto it = saved.fields().fields.find("ownership");
    const std::string theirs = it == saved.fields().fields.end() ? "" : it->second;
    const std::string ours = ownership_field();
    FEDSHARD_EXPECTS(theirs == ours, "checkpoint '", saved.dir().string(),
                     "' was saved with other ownership masks (",
                     theirs.empty() ? "every group holds every unit" : theirs,
                     ") than this run's (", ours.empty() ? "every group holds every unit" : ours,
                     "); loading across ownership masks is not supported yet");
    if (!manifest().differences(saved.fields()).empty()) return prepare_reshard(saved);
    const int rank = engine_.topology().rank();
    FEDSHARD_EXPECTS(saved.world_size() == engine_.topology().size(), "checkpoint '",
                     saved.dir().string(), "' was saved by ", saved.world_size(),
                     " ranks, its manifest names this run's mesh of ", engine_.topology().size());
    const checkpoint::file_reader file = saved.rank_file_in_memory(rank);
    restore(file, false);
    return [this, file] { restore(file, true); };
  }

  /// prepare_load() for a checkpoint of another mesh, shard policy, algorithm, optimizer or
  /// precision (reshard.hpp): every buffer is filled from the saved runs that overlap this
  /// rank's, group g from the saver's group g mod G and replica r from its replica r mod R.
  std::function<void()> prepare_reshard(const checkpoint::saved_checkpoint& saved) {
    using checkpoint::element_run;
    using checkpoint::saved_buffer;
    using fedshard::detail::concat;
    const auto sv = checkpoint::saved_layout::read(saved.manifest_file());
    const auto& mine = engine_.layout();
    if (const std::string d = sv.model_differences(mine); !d.empty())
      throw invalid_argument(concat("fedshard: checkpoint '", saved.dir().string(),
                                    "' holds another model than this run's: ", d));
    const flat_layout old = sv.layout();
    if (old.shards() > 1 && old.shards() != sv.shape.shards)
      saved.manifest_file().fail("is corrupt: its layout has ", old.shards(),
                                 " shards on a mesh of ", sv.shape.shards);
    const mesh_coords c = engine_.topology().coords();
    const int src_group = c.group % sv.shape.groups, src_replica = c.replica % sv.shape.replicas;
    const int my_shard = mine.shards() > 1 ? c.shard : 0;
    // The saved ranks whose buffers this rank reads: one per layout shard of the source group
    // and replica (one of any shard when the saver's layout was not sharded).
    std::vector<std::pair<int, int>> holders;  // (layout shard, saved world rank)
    for (int s = 0; s < old.shards(); ++s)
      holders.emplace_back(
          s, rank_of(sv.shape,
                     {src_group, src_replica, old.shards() > 1 ? s : c.shard % sv.shape.shards}));
    const auto& first = saved.rank_file(holders.front().second);
    auto from = [&](auto runs_of, const std::string& section) {
      std::vector<saved_buffer> v;
      for (const auto& [s, r] : holders) v.push_back({r, section, runs_of(s)});
      return v;
    };
    auto contains = [](const std::vector<std::string>& v, const std::string& x) {
      return std::find(v.begin(), v.end(), x) != v.end();
    };
    std::vector<std::string> dropped, fresh;

    struct staged_state {
      std::vector<float> master;
      std::vector<std::vector<float>> inner, outer;
      std::int64_t inner_steps = 0, syncs = 0, step = 0;
      bool started = false, restart_federation = false;
      std::vector<std::int64_t> tokens, outer_steps;
      std::int64_t progress_tokens = 0;
      double progress_seconds = 0;
      std::vector<std::vector<std::int64_t>> applied_at;
      std::vector<std::vector<float>> codec;  // the sync plans' residuals, in plan order
    };
    auto st = std::make_shared<staged_state>();
    auto master_of_old = [&](int s) { return checkpoint::master_runs(old, s); };
    const auto want_master = checkpoint::master_runs(mine, my_shard);
    st->master.assign(engine_.master().size(), 0.0f);
    checkpoint::fill_elements(saved, st->master, want_master, from(master_of_old, "master"),
                              "master");

    bool all_inner = true;
    for (const auto& t : optimizer_.state()) {
      auto& v = st->inner.emplace_back(t.data.size(), 0.0f);
      if (contains(sv.optimizer_state, t.name)) {
        checkpoint::fill_elements(saved, v, want_master, from(master_of_old, "optimizer." + t.name),
                                  "optimizer state '" + t.name + "'");
      } else {
        all_inner = false;
        fresh.push_back("optimizer state '" + t.name + "'");
      }
    }
    for (const auto& n : sv.optimizer_state) {
      bool used = false;
      for (const auto& t : optimizer_.state()) used = used || t.name == n;
      if (!used) dropped.push_back("optimizer state '" + n + "'");
    }
    st->inner_steps = all_inner ? first.read_value<std::int64_t>("optimizer.step_count") : 0;

    // Federation state: "fragment<f>.<key>", fragment-shaped; key k of this run's fragment f
    // comes from key k of the saver's fragments that hold f's units.
    auto split = [](const std::string& name) -> std::pair<int, std::string> {
      const auto dot = name.find('.');
      if (name.rfind("fragment", 0) != 0 || dot == std::string::npos) return {-1, name};
      return {std::stoi(name.substr(8, dot - 8)), name.substr(dot + 1)};
    };
    const int units = static_cast<int>(mine.num_units());
    std::vector<std::string> used_keys;
    bool any_outer = false;
    for (const auto& t : sync_.policy().state()) {
      auto& v = st->outer.emplace_back(t.data.size(), 0.0f);
      const auto [f, key] = split(t.name);
      std::vector<saved_buffer> sources;
      for (std::size_t fo = 0; fo < sv.fragments.size(); ++fo) {
        const std::string name = concat("fragment", fo, ".", key);
        if (!contains(sv.federation_state, name)) continue;
        used_keys.push_back(name);
        const auto& fu = sv.fragments[fo];
        auto runs = [&](int s) { return checkpoint::fragment_runs(old, fu, s); };
        for (auto& b : from(runs, "federation." + name)) sources.push_back(std::move(b));
      }
      if (f < 0 || sources.empty()) {
        fresh.push_back("federation state '" + t.name + "'");
        continue;
      }
      any_outer = true;
      const auto fu = sync_.schedule().fragment_units(f, units);
      checkpoint::fill_elements(saved, v, checkpoint::fragment_runs(mine, fu, my_shard), sources,
                                "federation state '" + t.name + "'");
    }
    for (const auto& n : sv.federation_state)
      if (!contains(used_keys, n)) dropped.push_back("federation state '" + n + "'");
    // None of this run's federation state is in the checkpoint: it starts as a fresh run's
    // does, from the (loaded) parameters at the next step.
    st->restart_federation = !sync_.policy().state().empty() && !any_outer;

    // Each fragment's counters come from the saver's fragment holding its first unit.
    auto saved_fragment_of = [&](int u) {
      for (std::size_t fo = 0; fo < sv.fragments.size(); ++fo)
        if (contains_unit(sv.fragments[fo], u)) return static_cast<int>(fo);
      return -1;
    };
    for (int f = 0; f < sync_.fragments(); ++f) {
      const auto fu = sync_.schedule().fragment_units(f, units);
      const int fo = fu.empty() ? -1 : saved_fragment_of(fu.front());
      if (fo < 0) {
        st->tokens.push_back(0);
        st->applied_at.emplace_back();
        st->outer_steps.push_back(0);
        continue;
      }
      const std::string p = concat("fragment", fo, ".");
      st->tokens.push_back(first.read_value<std::int64_t>(p + "tokens"));
      const std::size_t n = first.section_size(p + "applied_at") / sizeof(std::int64_t);
      auto& at = st->applied_at.emplace_back(n);
      first.read_span(p + "applied_at", std::span<std::int64_t>(at));
      st->outer_steps.push_back(
          first.has(p + "outer_steps") ? first.read_value<std::int64_t>(p + "outer_steps") : 0);
    }
    for (std::size_t fo = 0; fo < sv.fragments.size(); ++fo)
      if (first.read_value<federation::sync_stage>(concat("fragment", fo, ".stage")) !=
          federation::sync_stage::idle)
        dropped.push_back(concat("the sync of fragment ", fo, " in flight"));
    st->syncs = first.read_value<std::int64_t>("federation.syncs_applied");
    if constexpr (sync_type::by_progress) {
      // A progress schedule goes on from the saved group's tokens and seconds: they are the
      // k-th sync's, which every group must share; a checkpoint of a step schedule has none.
      FEDSHARD_EXPECTS(
          first.has("schedule.seconds") && first.has("schedule.group_tokens"), "checkpoint '",
          saved.dir().string(), "' was saved with the sync schedule '",
          saved.fields().fields.count("sync_schedule") ? saved.fields().fields.at("sync_schedule")
                                                       : std::string("unknown"),
          "', which keeps no progress (tokens since the last sync, seconds since the start); a ",
          sync_schedule::name, " run loads only checkpoints of token_budget or wall_clock runs");
      st->progress_tokens = first.read_value<std::int64_t>("schedule.group_tokens");
      st->progress_seconds = first.read_value<double>("schedule.seconds");
    }
    // Error-feedback residuals of the sync plans' encoded ops on a fragment (or on one
    // replica's piece of it): resharded when the saver ran the same federation policy, so the
    // same plan, op for op; the others start at zero, as in a fresh run.
    std::vector<std::string> used_codec;
    const auto saved_policy = saved.fields().fields.find("federation_policy");
    const bool same_policy = saved_policy != saved.fields().fields.end() &&
                             saved_policy->second == federation_policy::name;
    for (int f = 0; f < sync_.fragments(); ++f) {
      const plan& p = sync_.sync_plan(f);
      for (std::size_t i = 0; i < p.ops.size(); ++i) {
        const comm_op& op = p.ops[i];
        if (!encoded(op) || !op.codec.stateful) continue;
        const std::string name = concat("codec.fragment", f, ".op", i);
        const auto live = engine_.interp().codec_state(op);
        auto& v = st->codec.emplace_back(live.size(), 0.0f);
        const bool by_replica = op.in.piece == axis::replica;
        if (!same_policy || op.in.role != role::fragment || (op.in.piece && !by_replica)) {
          fresh.push_back("codec residual '" + name + "'");
          continue;
        }
        const auto fu = sync_.schedule().fragment_units(f, units);
        std::size_t numel = 0;
        for (int u : fu) numel += mine.unit(static_cast<std::size_t>(u)).shard_numel;
        const int pieces = by_replica ? engine_.topology().shape().replicas : 1;
        const std::size_t len =
            federation::padded_fragment_numel(numel, engine_.topology().shape().replicas) /
            static_cast<std::size_t>(pieces);
        if (len != live.size()) {
          fresh.push_back("codec residual '" + name + "'");
          continue;
        }
        std::vector<saved_buffer> sources;
        for (std::size_t fo = 0; fo < sv.fragments.size(); ++fo) {
          const std::string section = concat("codec.fragment", fo, ".op", i);
          if (!first.has(section)) continue;
          used_codec.push_back(section);
          const auto& fuo = sv.fragments[fo];
          std::size_t numel_old = 0;
          for (int u : fuo) numel_old += old.unit(static_cast<std::size_t>(u)).shard_numel;
          const int pieces_old = by_replica ? sv.shape.replicas : 1;
          const std::size_t len_old =
              federation::padded_fragment_numel(numel_old, sv.shape.replicas) /
              static_cast<std::size_t>(pieces_old);
          for (int r = 0; r < pieces_old; ++r)
            for (int s = 0; s < old.shards(); ++s) {
              const int rank =
                  rank_of(sv.shape, {src_group, by_replica ? r : src_replica,
                                     old.shards() > 1 ? s : c.shard % sv.shape.shards});
              sources.push_back(
                  {rank, section,
                   checkpoint::window_runs(checkpoint::fragment_runs(old, fuo, s),
                                           static_cast<std::size_t>(r) * len_old, len_old)});
            }
        }
        if (sources.empty()) {
          fresh.push_back("codec residual '" + name + "'");
          continue;
        }
        const int k = by_replica ? c.replica : 0;
        checkpoint::fill_elements(
            saved, v,
            checkpoint::window_runs(checkpoint::fragment_runs(mine, fu, my_shard),
                                    static_cast<std::size_t>(k) * len, len),
            sources, "codec residual '" + name + "'");
      }
    }
    for_each_codec_state([&](const std::string& name, std::span<float>) {
      if (name.rfind("codec.step", 0) == 0) fresh.push_back("codec residual '" + name + "'");
    });
    for (const auto& n : first.names())
      if (n.rfind("codec.", 0) == 0 && !contains(used_codec, n))
        dropped.push_back("codec residual '" + n + "'");
    st->step = first.read_value<std::int64_t>("trainer.step");
    st->started = first.read_value<bool>("trainer.started");

    std::vector<std::string> lines;
    auto dims = [](const mesh_shape& x) {
      return concat(x.groups, "x", x.replicas, "x", x.shards);
    };
    lines.push_back(concat("fedshard: checkpoint '", saved.dir().string(), "' of ", dims(sv.shape),
                           " resharded onto ", dims(engine_.topology().shape()), " (",
                           shard_policy::name, ", ", federation_policy::name,
                           "); group g reads the saved group g mod ", sv.shape.groups));
    auto join = [](const std::vector<std::string>& v) {
      std::string s;
      for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
      return s;
    };
    if (!dropped.empty())
      lines.push_back(
          concat("fedshard: checkpoint: dropped what this run has no use for: ", join(dropped)));
    if (!fresh.empty())
      lines.push_back(
          concat("fedshard: checkpoint: started as at a fresh start (not in the "
                 "checkpoint): ",
                 join(fresh)));
    return [this, st, lines] {
      engine_.upload(st->master, engine_.master());
      const auto inner = optimizer_.state();
      for (std::size_t k = 0; k < inner.size(); ++k) engine_.upload(st->inner[k], inner[k].data);
      const auto outer = sync_.policy().state();
      for (std::size_t k = 0; k < outer.size(); ++k) engine_.upload(st->outer[k], outer[k].data);
      optimizer_.set_step_count(st->inner_steps);
      for (int f = 0; f < sync_.fragments(); ++f) {
        const auto i = static_cast<std::size_t>(f);
        sync_.set_fragment_state(f, st->tokens[i], st->applied_at[i], st->outer_steps[i]);
      }
      sync_.set_syncs_applied(st->syncs);
      if constexpr (sync_type::by_progress)
        sync_.set_progress(st->progress_tokens, st->progress_seconds);
      std::size_t k = 0;
      for_each_codec_state([&](const std::string& name, std::span<float> r) {
        if (name.rfind("codec.fragment", 0) == 0 && k < st->codec.size())
          std::copy(st->codec[k].begin(), st->codec[k].end(), r.begin()), ++k;
        else
          std::fill(r.begin(), r.end(), 0.0f);
      });
      step_ = st->step;
      started_ = st->started && !st->restart_federation;
      for (const auto& l : lines) log(l, false);
    };
  }

  static bool contains_unit(const std::vector<int>& units, int u) {
    return std::find(units.begin(), units.end(), u) != units.end();
  }

  /// A log line: to options::log on every rank, else to stderr on world rank 0 (or on every
  /// rank when `every_rank`).
  void log(const std::string& line, bool every_rank) {
    if (opts_.log)
      opts_.log(line);
    else if (every_rank || engine_.topology().rank() == 0)
      std::fprintf(stderr, "%s\n", line.c_str());
  }

  /// Adds this rank's whole state to w (copied from the space straight into w's sections).
  void write_state(checkpoint::file_writer& w) {
    const auto master = engine_.master();
    engine_.download(master, w.add_elements<float>("master", master.size()));
    w.add_value("optimizer.step_count", optimizer_.step_count());
    for (const auto& t : optimizer_.state())
      engine_.download(t.data, w.add_elements<float>("optimizer." + t.name, t.data.size()));
    sync_.save(w);
    for_each_codec_state([&](const std::string& name, std::span<float> st) {
      w.add_span(name, std::span<const float>(st));
    });
    w.add_value("trainer.step", step_);
    w.add_value("trainer.started", started_);
  }

  /// Reads every section into scratch (commit = false: only verifies) or into the live state.
  void restore(const checkpoint::file_reader& r, bool commit) {
    auto into = [&](const std::string& name, std::span<float> live) {
      std::vector<float> scratch(live.size());
      r.read_span(name, std::span<float>(scratch));
      if (commit) engine_.upload(scratch, live);
    };
    into("master", engine_.master());
    const auto opt_steps = r.read_value<std::int64_t>("optimizer.step_count");
    for (const auto& t : optimizer_.state()) into("optimizer." + t.name, t.data);
    sync_.restore(r, commit);
    for_each_codec_state([&](const std::string& name, std::span<float> st) {
      std::vector<float> scratch(st.size());
      r.read_span(name, std::span<float>(scratch));
      if (commit) std::copy(scratch.begin(), scratch.end(), st.begin());
    });
    const auto step = r.read_value<std::int64_t>("trainer.step");
    const auto started = r.read_value<bool>("trainer.started");
    if (!commit) return;
    optimizer_.set_step_count(opt_steps);
    step_ = step;
    started_ = started;
  }

  /// f(name, state) for the state of every stateful codec of the plans this rank runs (the
  /// error-feedback residuals, host memory: interpreter::codec_state), named by plan and op.
  template <class F>
  void for_each_codec_state(F&& f) {
    auto visit = [&](const plan& p, const std::string& prefix) {
      for (std::size_t i = 0; i < p.ops.size(); ++i)
        if (encoded(p.ops[i]) && p.ops[i].codec.stateful)
          f(prefix + ".op" + std::to_string(i), engine_.interp().codec_state(p.ops[i]));
    };
    visit(engine_.step_plan(), "codec.step");
    for (int fr = 0; fr < sync_.fragments(); ++fr)
      visit(sync_.sync_plan(fr), "codec.fragment" + std::to_string(fr));
  }

  /// The communicator's own space for it (bound to its device), or a default S.
  static std::unique_ptr<S> make_space(C& world) {
    if constexpr (std::is_same_v<S, space::space_of_t<C>>)
      return space::make_space(world);
    else
      return std::make_unique<S>();
  }

  std::unique_ptr<space_type> space_;  // first: every buffer below goes back to it
  ModelT model_;
  options opts_;
  engine_type engine_;
  optimizer_type optimizer_;
  float base_lr_;
  sync_type sync_;
  std::int64_t step_ = 0;
  bool started_ = false;
  /// A save_async() being written by a thread of its own.
  struct pending_save {
    std::filesystem::path dir;
    std::thread thread;
    std::exception_ptr error;
    checkpoint::file_writer used;  // its snapshot's buffers, once written
    std::atomic<bool> done{false};
  };
  std::unique_ptr<pending_save> pending_save_;
  /// The host buffers of the last save's snapshot, which the next one fills again (no
  /// allocation or page faults on the step that saves; the cost is one copy of the rank's
  /// state kept in host memory between saves).
  checkpoint::file_writer staging_;
};

}  // namespace fedshard
