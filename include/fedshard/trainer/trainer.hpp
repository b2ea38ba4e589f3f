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
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/core/buffer.hpp"
#include "fedshard/core/state_registry.hpp"
#include "fedshard/error.hpp"
#include "fedshard/federation/heal.hpp"
#include "fedshard/federation/sync.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/optimizer.hpp"
#include "fedshard/shard/engine.hpp"
#include "fedshard/space/space_of.hpp"
#include "fedshard/trainer/algorithm.hpp"
#include "fedshard/trainer/checkpointer.hpp"
#include "fedshard/trainer/diagnostics.hpp"
#include "fedshard/trainer/local_rule.hpp"
#include "fedshard/trainer/model.hpp"
#include "fedshard/trainer/options.hpp"
#include "fedshard/trainer/run_checkpoint.hpp"
#include "fedshard/trainer/state_io.hpp"

namespace fedshard {

/// Trains ModelT (a fedshard::Model) with A (an Algorithm) and the inner ShardOptimizer O on
/// one rank of a mesh over Communicator C. Its buffers (parameters, gradients, optimizer and
/// federation state) live in memory space S, by default C's (space/space_of.hpp): host memory
/// for inproc, shaped and mpi, the GPU for nccl and gpu_inproc. Another S works with a host
/// communicator when the host can read S's memory (S::host_accessible; tests run the trainer
/// on space::checked_space that way).
template <class ModelT, class A, optim::ShardOptimizer O, Communicator C,
          space::MemorySpace S = space::space_of_t<C>>
class trainer final {
  // A is unconstrained so that a policy or schedule put in its place gets the message of
  // detail::trainer_algorithm (what to write instead) rather than the concept's checks.
  using algorithm_type = typename detail::trainer_algorithm<A>::type;
  static_assert(ModelUnits<ModelT>,
                "fedshard::trainer<Model, ...>: the model must provide units() -> "
                "std::vector<unit_spec> (requirement 1 of the Model concept, trainer/model.hpp): "
                "the trainer lays out, shards and initialises the model's parameters from it at "
                "construction");
  static_assert(model_capabilities<ModelT>::checked);
  static_assert(std::is_same_v<S, space::space_of_t<C>> || S::host_accessible,
                "fedshard::trainer: a space other than the communicator's must be one the host "
                "can read (the communicator reads and writes its buffers on the host)");

 public:
  using space_type = S;
  using shard_policy = typename algorithm_type::shard_policy;
  using federation_policy = typename algorithm_type::federation_policy;
  using sync_schedule = typename algorithm_type::sync_schedule;
  using engine_type = shard::engine<shard_policy, C, space_type>;
  using optimizer_type = optim::in_space_t<O, space_type>;
  using sync_type = federation::synchronizer<federation_policy, sync_schedule, space_type>;
  using context_type = basic_step_context<space_type>;
  using options = trainer_options<algorithm_type>;

  /// Collective over the mesh's world (every rank constructs its trainer with the same model
  /// declaration and settings).
  trainer(mesh<C>& m, ModelT model, typename O::config opt = {}, options o = {})
      : space_(make_space(m.world())),
        model_(std::move(model)),
        opts_(std::move(o)),
        local_(make_local_rule(opts_, model_.units())),
        engine_(m, *space_, model_.units(), opts_.precision,
                federation::owners_of<federation_policy>(opts_.federation), opts_.shard,
                local_ ? local_->gradient_free_units() : std::vector<std::string>{}),
        optimizer_(opt, rule_owns_optimizer() ? 0 : engine_.master().size(), *space_),
        base_lr_(opt.lr),
        sync_(opts_.federation, opts_.schedule, engine_.layout(), m.shape(), m.coords(),
              static_cast<int>(inner_state().size()), *space_,
              federation::overlap_of<shard_policy>(m, engine_.layout()),
              left_out_of(local_.get(), engine_.layout(), m.uniform()), opts_.precision.sync) {
    FEDSHARD_EXPECTS(opts_.total_steps >= 0, "trainer: total_steps must be >= 0, found ",
                     opts_.total_steps);
    sync_.set_participation(opts_.participation);
    sync_.set_screening(opts_.screening.value_or(
        elastic_federation ? federation::screening{} : federation::screening::off()));
    sync_.check_run(opts_.total_steps, engine_.step_plan(), shard_policy::name);
    engine_.set_max_live_units(opts_.max_live_units);
    FEDSHARD_EXPECTS(!(engine_type::has_runtime && rule_owns_optimizer()),
                     "trainer: the local rule '", local_ ? local_->name() : "",
                     "' steps an optimizer of its own, which ", shard_policy::name,
                     " (a policy that steps the inner optimizer itself) ",
                     "does not support; expected a shard policy without a runtime");
    if (!rule_owns_optimizer()) engine_.attach_optimizer(optimizer_, opt);
    if constexpr (model_capabilities<ModelT>::initial_values) {
      for (std::size_t u = 0; u < engine_.layout().num_units(); ++u)
        if (engine_.holds(u)) engine_.set_unit(u, model_.initial_values(engine_.layout(), u));
    }
    if (local_) local_->bind(local_setup_of());
    register_state();
  }

  trainer(const trainer&) = delete;
  trainer& operator=(const trainer&) = delete;

  /// Waits for a save_async() still writing (its error, if any, goes to the log: the
  /// destructor cannot agree with the other ranks).
  ~trainer() {
    checkpoints_.abandon([this](const std::string& line) { log(line, true); });
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
    local_access local = local_access_now(batch);
    if (local_ && local_->before_forward(local)) engine_.parameters_changed();
    context_type ctx(hooks_, true, step_, engine_.topology().rank());
    const float loss = static_cast<float>(model_.forward_backward(ctx, batch));
    engine_.finish_backward();
    const float lr = opts_.lr_schedule ? opts_.lr_schedule(step_) : base_lr_;
    if (local_) {
      synchronize();
      local_->after_backward(local);
      local_->optimizer_step(local, lr);
    } else {
      engine_.optimizer_step(optimizer_, lr);
    }
    sync_.add_tokens(tokens_of(model_, batch));
    if constexpr (elastic_federation) {
      const std::string healed = federation::begin_elastic_round(
          sync_, engine_.topology(), step_, opts_.total_steps,
          [this](const federation::heal_round& r) { return heal(r); });
      if (!healed.empty()) log(healed, true);
    }
    const std::int64_t syncs = sync_.syncs_applied();
    sync_.after_step(engine_.interp(), step_, opts_.total_steps, engine_.master(), inner_state(),
                     compute);
    if constexpr (elastic_federation) engine_.topology().federation().federation_side().end_round();
    if (sync_.syncs_applied() != syncs) {
      engine_.parameters_changed();
      if (local_) {
        synchronize();
        local_->after_sync(local, local_sync_now());
        local_->parameters_changed();
      }
    }
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
    context_type ctx(hooks_, false, step_, engine_.topology().rank());
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
  std::vector<float> tensor(std::string_view name) { return engine_.gather_tensor(name); }
  /// Collective over the shard axis: all units' full parameters, concatenated (numel each).
  std::vector<float> parameters() { return engine_.gather_all(); }
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
  /// Whom the latest applied federation sync combined (its included mask; empty: every
  /// group) and, under a token-weighted policy, every group's tokens.
  const typename sync_type::applied_sync& last_sync() const noexcept {
    return sync_.last_applied();
  }
  /// Number of federation syncs applied so far (all fragments).
  std::int64_t syncs_applied() const noexcept { return sync_.syncs_applied(); }
  /// Step numbers at which fragment f applied a sync.
  const std::vector<std::int64_t>& sync_steps(int f = 0) const { return sync_.sync_steps(f); }
  /// True when the run is over (see the file comment): after run_syncs() syncs under a
  /// progress schedule, else once total_steps (> 0) steps are taken.
  bool done() const noexcept { return sync_.done(step_, opts_.total_steps); }
  /// True when the latest step applied a sync (of any fragment): a point where every group
  /// stands at the same sync.
  bool synced() const { return sync_.synced_after(step_ - 1); }
  /// The group's progress as its ranks agreed on it after the latest step (progress
  /// schedules: tokens since the last sync, seconds since the start, syncs).
  const schedule::sync_progress& progress() const noexcept { return sync_.progress(); }
  /// The ops run after every step to agree on the group's progress (progress_op under a
  /// progress schedule, else none).
  const plan& progress_plan() const noexcept { return sync_.progress_plan(); }

  /// Collective over the world: writes every rank's state (every entry of state(): master
  /// shard, inner and outer optimizer state, anchors, schedule phase, step) into directory
  /// dir, with a manifest of the mesh and layout (checkpoint::save), written last: a save
  /// that stops half-way leaves the previous checkpoint in dir loadable. A sync still in
  /// flight is completed (not applied) first, so the restored run applies it at the same step.
  void save(const std::filesystem::path& dir) {
    checkpoints_.wait_for_save(checkpoint_run());
    before_save();
    checkpoints_.save(dir, checkpoint_run());
  }

  /// Collective over the world: save(dir) without waiting for the files. The rank's state is
  /// copied into host memory (a snapshot: training goes on changing the live state) and
  /// written by a thread of its own; world rank 0 writes the manifest once every rank's file
  /// is there (so dir must be one that every rank sees, as for load). At most one save is in
  /// flight: another save, save_async or load waits for it first.
  void save_async(const std::filesystem::path& dir) {
    checkpoints_.wait_for_save(checkpoint_run());
    before_save();
    checkpoints_.save_async(dir, checkpoint_run());
  }

  /// Collective over the world: waits until the save_async() in flight, if any, is written
  /// (manifest included); its failure on any rank throws on every rank.
  void wait_for_save() { checkpoints_.wait_for_save(checkpoint_run()); }
  /// True while this rank's part of a save_async() is still being written.
  bool save_in_flight() const noexcept { return checkpoints_.save_in_flight(); }

  /// Collective over the world: restores the state saved by save(dir) (checkpoint::load).
  /// A checkpoint of this very setup (mesh, layout, algorithm, optimizer, precision) is
  /// restored rank by rank, bit-identically. Any other one of the same model is resharded:
  /// each rank reads exactly the element ranges it now owns (master, inner optimizer state,
  /// anchors and outer-optimizer state), group g from the saver's group g mod G; state this
  /// run has no use for is dropped and state it needs but the checkpoint lacks starts as at a
  /// fresh start, each said in one log line. Another model, a missing, torn, truncated or
  /// corrupt file are refused on every rank, and nothing is changed unless every rank read
  /// and verified everything it needs.
  void load(const std::filesystem::path& dir) { checkpoints_.load(dir, checkpoint_run()); }

  /// Collective over the federation axis: the joiners of round r take the donor's whole
  /// state (every entry of state()), moved by the heal plan (federation/heal.hpp) through
  /// the interpreter and checked before anything changes; returns what this rank moved.
  /// With several donors (r.donors) and state held alike in every group (anchors,
  /// outer-optimizer state: state_entry::same_in_every_group), the donor sends the rest and
  /// the others that state, in pieces, side by side.
  federation::heal_report heal(const federation::heal_round& r) {
    synchronize();
    const auto geometry = checkpoint::geometry_of(engine_, sync_);
    if (r.donors.size() >= 2 && checkpoint::has_shared(registry_)) {
      federation::heal_round named = r;
      named.digest = checkpoint::file_digest;  // checked with every chunk when taken
      return federation::heal_from_donors(
          engine_.interp(), named,
          [this] { return checkpoint::serialize(registry_, checkpoint::entries::own); },
          [this] { return checkpoint::serialize(registry_, checkpoint::entries::shared); },
          [&](federation::heal_parts p) {
            checkpoint::deserialize(
                registry_, std::move(p.own),
                fedshard::detail::concat("the state of group ", r.donor), std::move(p.shared),
                fedshard::detail::concat("the shared state of groups ", r.donors_text()), geometry);
          });
    }
    federation::heal_round one = r;
    one.donors.clear();
    return federation::heal(
        engine_.interp(), one, [this] { return checkpoint::serialize(registry_); },
        [&](std::string blob) {
          checkpoint::deserialize(registry_, std::move(blob),
                                  fedshard::detail::concat("the state of group ", r.donor),
                                  geometry);
        });
  }

  /// Every piece of state of this run, as its components registered it (what save, load,
  /// resharding and healing move).
  const state_registry& state() const noexcept { return registry_; }

  /// True when the federation axis is an elastic link (comm/elastic.hpp): groups that are
  /// jobs of their own, meeting in rounds.
  static constexpr bool elastic_federation = comm_capabilities<C>::elastic_federation;

  /// The host waits for the work queued on the compute stream (to read the master or the
  /// optimizer state in a host-accessible space).
  void synchronize() { space_->synchronize(engine_.compute_stream()); }

  const flat_layout& layout() const { return engine_.layout(); }
  /// trainer_options::local_rule's rule (null without one).
  local_rule* local() noexcept { return local_.get(); }
  /// The memory space of the trainer's buffers.
  space_type& space() { return *space_; }
  engine_type& engine() noexcept { return engine_; }
  /// The inner optimizer (of no elements when the local rule owns its optimizer).
  optimizer_type& optimizer() noexcept { return optimizer_; }
  typename sync_type::policy_type& federation() noexcept { return sync_.policy(); }
  const sync_schedule& schedule() const noexcept { return sync_.schedule(); }
  ModelT& model() noexcept { return model_; }
  mesh<C>& topology() noexcept { return engine_.topology(); }
  const options& settings() const noexcept { return opts_; }

 private:
  /// A log line: to options::log on every rank, else to stderr on world rank 0 (or on every
  /// rank when `every_rank`).
  void log(const std::string& line, bool every_rank) {
    if (opts_.log)
      opts_.log(line);
    else if (every_rank || engine_.topology().rank() == 0)
      std::fprintf(stderr, "%s\n", line.c_str());
  }

  /// Registers the state of the trainer's parts (engine, inner optimizer, synchronizer)
  /// and its own (the step count, whether the run started).
  void register_state() {
    engine_.register_state(registry_);
    if (!rule_owns_optimizer())
      optim::register_state(
          registry_, optimizer_,
          [this](std::span<const float> live, std::span<float> h) { engine_.download(live, h); },
          [this](std::span<const float> h, std::span<float> live) { engine_.upload(h, live); });
    sync_.register_state(registry_, engine_.interp());
    if (local_) local_->register_state(registry_);
    registry_.add_value({.name = "trainer.step"}, &step_);
    registry_.add_value({.name = "trainer.started"}, &started_);
  }

  /// True when the local rule steps an optimizer of its own (local_rule::owns_optimizer):
  /// the inner optimizer then has no elements and no state is registered or synced for it.
  bool rule_owns_optimizer() const { return local_ && local_->owns_optimizer(); }
  /// The inner optimizer's state buffers; none when the local rule owns its optimizer.
  std::vector<optim::state_tensor> inner_state() {
    if (rule_owns_optimizer()) return {};
    return optimizer_.state();
  }

  /// o.context_axis, which names an axis inside a group (shard, replica or group): the
  /// ranks that share a batch exchange keys and values on it every step.
  static std::optional<axis> checked_context_axis(const options& o) {
    const std::optional<axis> a = o.context_axis;
    FEDSHARD_EXPECTS(!a || *a == axis::shard || *a == axis::replica || *a == axis::group,
                     "trainer_options::context_axis: context parallelism runs inside a group "
                     "(the shard, replica or group axis), found the ",
                     a ? to_string(*a) : "", " axis");
    return a;
  }
  /// trainer_options::local_rule's rule, or none.
  static std::unique_ptr<local_rule> make_local_rule(const options& o,
                                                     const std::vector<unit_spec>& units) {
    if (!o.local_rule) return nullptr;
    FEDSHARD_EXPECTS(S::host_accessible,
                     "trainer: a local rule (trainer_options::local_rule) "
                     "runs on memory the host can read; this trainer's space is not");
    auto r = o.local_rule();
    FEDSHARD_EXPECTS(r != nullptr, "trainer: trainer_options::local_rule made no rule");
    std::vector<std::string> names;
    for (const auto& u : units) names.push_back(u.name);
    r->model_units(names);
    return r;
  }

  /// Where this rank's master holds each unit (local_rule::bind).
  local_setup local_setup_of() {
    const auto& l = engine_.layout();
    local_setup out;
    out.master_size = engine_.master().size();
    out.group = engine_.topology().coords().group;
    out.layout = &l;
    out.groups = engine_.topology().shape().groups;
    const auto master = engine_.master();
    std::uint64_t base = 0;
    for (std::size_t u = 0; u < l.num_units(); ++u) {
      const auto& ul = l.unit(u);
      if (engine_.holds(u)) {
        const std::size_t first =
            l.shards() > 1 ? l.shard_of(u, engine_.topology().coords().shard).begin : 0;
        const std::size_t real = first < ul.numel ? std::min(ul.shard_numel, ul.numel - first) : 0;
        out.units.push_back(
            {.name = ul.name,
             .offset = static_cast<std::size_t>(engine_.master_of(u).data() - master.data()),
             .count = real,
             .element = base + first});
      }
      base += ul.numel;
    }
    return out;
  }

  /// By unit: the ones the local rule syncs itself (local_rule::synced_units), which the
  /// federation policy leaves out; invalid_argument for a name the model lacks.
  static std::vector<bool> left_out_of(const local_rule* r, const flat_layout& l, bool uniform) {
    if (r == nullptr) return {};
    const auto names = r->synced_units();
    if (names.empty()) return {};
    FEDSHARD_EXPECTS(!elastic_federation, "trainer: the local rule '", r->name(),
                     "' syncs units itself (synced_units), which an elastic federation axis "
                     "does not support yet; expected a federation axis of fixed groups");
    FEDSHARD_EXPECTS(uniform, "trainer: the local rule '", r->name(),
                     "' syncs units itself (synced_units), which groups of different shapes do "
                     "not support yet; expected groups of one shape (zeroth-order units: "
                     "zo_sync::parameters syncs them through the federation policy)");
    std::vector<bool> out(l.num_units(), false);
    for (const auto& n : names) {
      std::size_t u = 0;
      while (u < l.num_units() && l.unit(u).name != n) ++u;
      FEDSHARD_EXPECTS(u < l.num_units(), "trainer: the local rule '", r->name(), "' syncs unit '",
                       n, "', which the model does not declare");
      out[u] = true;
    }
    return out;
  }

  /// What the local rule's after_sync sees of the sync just applied (local_sync).
  local_sync local_sync_now() {
    const auto& applied = sync_.last_applied();
    const auto& sh = engine_.topology().shape();
    return {.groups = sh.groups,
            .group = engine_.topology().coords().group,
            .included = applied.included,
            .group_tokens = applied.group_tokens,
            .all_gather = [this, groups = sh.groups](std::span<const double> mine,
                                                     std::span<double> all) {
              FEDSHARD_EXPECTS(all.size() == mine.size() * static_cast<std::size_t>(groups),
                               "local_sync::all_gather: expected ", groups, " x ", mine.size(),
                               " values out, found ", all.size());
              federation_gather(mine, all);
            }};
  }

  /// local_sync::all_gather: the group's rank 0 all gathers `mine` over its federation link
  /// into `all` (federation_gather_op, staged through the space's memory), then broadcasts
  /// it to the group's other ranks (group_broadcast_op).
  void federation_gather(std::span<const double> mine, std::span<double> all) {
    const auto& sh = engine_.topology().shape();
    const auto c = engine_.topology().coords();
    if (c.replica == 0 && c.shard == 0) gather_over_federation(sh.groups, mine, all);
    if (sh.replicas * sh.shards > 1)
      engine_.run(
          group_broadcast_op(sh.replicas * sh.shards, static_cast<std::int64_t>(all.size())),
          {all.data(), all.size(), dtype::f64});
  }
  /// The rank's own federation link: all gathers `mine` over its `groups` groups into `all`.
  void gather_over_federation(int groups, std::span<const double> mine, std::span<double> all) {
    auto in = space_->template allocate<double>(mine.size());
    auto out = space_->template allocate<double>(all.size());
    auto& interp = engine_.interp();
    auto& st = interp.own_stream();
    space_->from_host(st, const_buffer_view{mine.data(), mine.size(), dtype::f64}, in.view());
    interp.run(
        federation_gather_op(groups, static_cast<std::int64_t>(mine.size())),
        [&](const comm_op&, const operand& o) { return o.index == 0 ? in.view() : out.view(); });
    space_->to_host(st, const_buffer_view(out.view()), view(all));
    space_->synchronize(st);
  }

  /// The group's mean loss of `batch` at the current master (local_access::loss): the
  /// model's evaluate, then a group average of one f64 through the interpreter.
  template <class Batch>
  double group_mean_loss(const Batch& batch) {
    if constexpr (Evaluates<ModelT, Batch, space_type>) {
      engine_.parameters_changed();
      engine_.begin_step();
      context_type ctx(hooks_, false, step_, engine_.topology().rank());
      double loss = static_cast<double>(model_.evaluate(ctx, batch));
      engine_.begin_step();  // frees what evaluation gathered
      const auto& sh = engine_.topology().shape();
      engine_.run(group_mean_op(sh.replicas * sh.shards), {&loss, 1, dtype::f64});
      return loss;
    } else {
      throw invalid_argument(fedshard::detail::concat(
          "fedshard: the local rule '", local_->name(),
          "' asks for the step's loss, but the model has no evaluate(ctx, batch) (requirement "
          "4 of the Model concept, trainer/model.hpp)"));
    }
  }

  /// What the local rule's hooks see now (trainer/local_rule.hpp); the host waits for the
  /// compute stream first.
  template <class Batch>
  local_access local_access_now(const Batch& batch) {
    if (!local_) return {};
    synchronize();
    return {.master = engine_.master(),
            .grad = engine_.grad(),
            .step = step_,
            .optimizer_step =
                [this](float lr) {
                  FEDSHARD_EXPECTS(!rule_owns_optimizer(), "trainer: the local rule '",
                                   local_->name(),
                                   "' owns its optimizer (owns_optimizer) yet ran the inner one, "
                                   "which holds no state; expected it to step its own");
                  engine_.optimizer_step(optimizer_, lr);
                  synchronize();
                },
            .sum_over_shards =
                [this](std::span<double> v) {
                  const int shards = static_cast<int>(engine_.layout().shards());
                  if (shards > 1)
                    engine_.run(shard_sum_op(shards, static_cast<std::int64_t>(v.size())),
                                {v.data(), v.size(), dtype::f64});
                },
            .loss = [this, &batch] { return group_mean_loss(batch); }};
  }

  /// What a save or load needs of this run (trainer/run_checkpoint.hpp).
  checkpoint::checkpoint_run checkpoint_run() {
    std::vector<std::string> inner;
    for (const auto& t : inner_state()) inner.push_back(t.name);
    return checkpoint::checkpoint_run_of<algorithm_type>(
        engine_, std::move(inner), sync_, opts_.precision,
        [this](const std::string& l) { log(l, false); });
  }

  /// Before a save: a sync still in flight is completed (not applied).
  void before_save() { sync_.complete_in_flight(engine_.interp()); }

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
  std::unique_ptr<local_rule> local_;  // trainer_options::local_rule's, or none
  engine_type engine_;
  optimizer_type optimizer_;
  float base_lr_;
  sync_type sync_;
  std::int64_t step_ = 0;
  bool started_ = false;
  // the models' step contexts
  detail::engine_hooks<engine_type, space_type> hooks_{engine_, checked_context_axis(opts_)};
  state_registry registry_;
  checkpoint::checkpointer checkpoints_{registry_};
};

}  // namespace fedshard
