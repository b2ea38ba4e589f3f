#pragma once
/// trainer<Model, Algorithm, Optimizer>: the policy triple composed into a training loop.
///
/// A step: the shard engine gathers and reduces as the model's hooks ask (ShardPolicy), the
/// inner optimizer updates the rank's master shard, then the SyncSchedule says which
/// fragments start or apply a federation sync, and the FederationPolicy combines the groups'
/// parameters over the federation axis. Everything the trainer moves goes through the
/// engine's executor, so traffic() counts it all, per axis.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/comm/inproc.hpp"
#include "fedshard/core/buffer.hpp"
#include "fedshard/error.hpp"
#include "fedshard/federation/federation_policy.hpp"
#include "fedshard/federation/sync_plan.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/optimizer.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/plan/executor.hpp"
#include "fedshard/schedule/sync_schedule.hpp"
#include "fedshard/shard/engine.hpp"
#include "fedshard/trainer/algorithm.hpp"
#include "fedshard/trainer/checkpoint.hpp"
#include "fedshard/trainer/model.hpp"

namespace fedshard {

/// Settings of a trainer beyond the optimizer's.
template <class Algorithm>
struct trainer_options {
  /// Parameter dtype on the wire and gradient reduce dtype (master is always f32).
  shard::precision precision{};
  /// Planned number of steps (the schedules sync on the final one); 0 = unknown.
  std::int64_t total_steps = 0;
  /// Gathered units alive at once through prefetching.
  int max_live_units = 2;
  /// Learning rate of each 0-based step; empty = the optimizer config's lr throughout.
  std::function<float(std::int64_t)> lr_schedule{};
  typename Algorithm::federation_policy::config federation{};
  typename Algorithm::sync_schedule::config schedule{};
};

/// Trains ModelT (a fedshard::Model) with Algorithm (an algorithm<ShardPolicy, FederationPolicy,
/// SyncSchedule>) and the inner ShardOptimizer Optimizer on one rank of a mesh over Communicator C.
template <class ModelT, class Algorithm, optim::ShardOptimizer Optimizer,
          Communicator C = inproc::communicator>
class trainer final : private detail::unit_hooks {
 public:
  using shard_policy = typename Algorithm::shard_policy;
  using federation_policy = typename Algorithm::federation_policy;
  using sync_schedule = typename Algorithm::sync_schedule;
  using engine_type = shard::engine<shard_policy, C>;
  using options = trainer_options<Algorithm>;

  /// Collective over the mesh's world (every rank constructs its trainer with the same model
  /// declaration and settings).
  trainer(mesh<C>& m, ModelT model, typename Optimizer::config opt = {}, options o = {})
      : model_(std::move(model)),
        opts_(std::move(o)),
        engine_(m, model_.units(), opts_.precision),
        optimizer_(opt, engine_.master().size()),
        base_lr_(opt.lr),
        schedule_(opts_.schedule),
        fed_(opts_.federation, fragment_sizes(schedule_, engine_)) {
    FEDSHARD_EXPECTS(opts_.total_steps >= 0, "trainer: total_steps must be >= 0, found ",
                     opts_.total_steps);
    engine_.set_max_live_units(opts_.max_live_units);
    const auto units = static_cast<int>(engine_.layout().num_units());
    for (int f = 0; f < schedule_.fragments(); ++f) {
      fragment fr;
      fr.units = schedule_.fragment_units(f, units);
      fr.buf =
          aligned_buffer<float>(fragment_sizes(schedule_, engine_)[static_cast<std::size_t>(f)]);
      fragments_.push_back(std::move(fr));
    }
    if constexpr (requires { model_.initial_values(engine_.layout(), std::size_t{0}); }) {
      for (std::size_t u = 0; u < engine_.layout().num_units(); ++u)
        engine_.set_unit(u, model_.initial_values(engine_.layout(), u));
    }
  }

  trainer(const trainer&) = delete;
  trainer& operator=(const trainer&) = delete;
  ~trainer() override = default;

  /// One training step on this rank's batch; returns the rank's loss.
  template <class Batch>
  float step(const Batch& batch) {
    static_assert(fedshard::Model<ModelT, Batch>,
                  "fedshard::trainer::step: the model must provide units() and "
                  "forward_backward(step_context&, const Batch&) -> float");
    if (!started_) start();
    engine_.begin_step();
    step_context ctx(*this, true, step_, engine_.topology().rank());
    const float loss = static_cast<float>(model_.forward_backward(ctx, batch));
    engine_.finish_backward();
    const float lr = opts_.lr_schedule ? opts_.lr_schedule(step_) : base_lr_;
    optimizer_.step(engine_.master(), std::span<const float>(engine_.grad()), lr);
    const std::int64_t tokens = tokens_of(model_, batch);
    for (auto& f : fragments_) f.tokens += tokens;
    if constexpr (federation_policy::syncs) federate();
    ++step_;
    return loss;
  }

  /// The model's loss on a batch without training (uses Model::evaluate).
  template <class Batch>
  float evaluate(const Batch& batch) {
    static_assert(
        requires(ModelT & m, step_context & c) {
          { m.evaluate(c, batch) } -> std::convertible_to<float>;
        },
        "fedshard::trainer::evaluate: the model must provide evaluate(step_context&, const "
        "Batch&)");
    engine_.begin_step();
    step_context ctx(*this, false, step_, engine_.topology().rank());
    const float loss = static_cast<float>(model_.evaluate(ctx, batch));
    engine_.begin_step();  // frees what evaluation gathered
    return loss;
  }

  /// Mean of a value over all ranks of the world (e.g. an evaluation loss); counted on the
  /// world axis.
  double mean_over_world(double value) {
    const comm_op op{
        comm_kind::all_reduce,     axis::world,    8,    dtype::f64, -1, phase::forward,
        engine_.topology().size(), reduce_op::avg, false};
    engine_.exec().run(op, &value, &value);
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
  /// What this rank moved so far, per axis.
  traffic_counters& traffic() noexcept { return engine_.traffic(); }
  /// The comm_ops of one inner step.
  const plan& step_plan() const noexcept { return engine_.step_plan(); }
  /// The comm_ops one sync of fragment f moves for this rank.
  plan sync_plan(int f = 0) const {
    if constexpr (!federation_policy::syncs) return plan{};
    const auto& m = const_cast<engine_type&>(engine_).topology();
    const int moments = fed_.averages_inner_moments()
                            ? static_cast<int>(const_cast<Optimizer&>(optimizer_).state().size())
                            : 0;
    return federation::sync_plan(m.shape(), m.coords(), opts_.federation.sync,
                                 fragments_.at(static_cast<std::size_t>(f)).buf.size(),
                                 federation_policy::uses_weights, moments);
  }
  /// Number of federation syncs applied so far (all fragments).
  std::int64_t syncs_applied() const noexcept { return syncs_applied_; }
  /// Step numbers at which fragment f applied a sync.
  const std::vector<std::int64_t>& sync_steps(int f = 0) const {
    return fragments_.at(static_cast<std::size_t>(f)).applied_at;
  }

  /// Collective over the world: writes every rank's whole state (master shard, inner and
  /// outer optimizer state, anchors, schedule phase, step) into directory dir, with a
  /// manifest of the mesh and layout. A sync still in flight is completed (not applied)
  /// first, so the restored run applies it at the same step.
  void save(const std::filesystem::path& dir) {
    for (auto& fr : fragments_)
      if (fr.stage == sync_stage::in_flight) {
        finish_average(fr, fr.buf.span());
        fr.stage = sync_stage::communicated;
      }
    const int rank = engine_.topology().rank();
    std::exception_ptr error;
    if (rank == 0) error = attempt([&] { std::filesystem::create_directories(dir); });
    all_ok(error, "creating the checkpoint directory");
    const std::uint64_t id = save_id();
    error = attempt([&] {
      checkpoint::file_writer w = rank_state();
      w.add_value("save_id", id);
      w.write(dir / checkpoint::rank_file_name(rank));
    });
    all_ok(error, "writing the rank files");
    if (rank == 0) {
      error = attempt([&] {
        checkpoint::file_writer w;
        w.add_text("manifest", manifest().text());
        w.add_value("save_id", id);
        w.write(dir / "manifest.bin");
      });
    }
    all_ok(error, "writing the manifest");
  }

  /// Collective over the world: restores the state saved by save(dir). A checkpoint from
  /// another mesh, layout or algorithm is refused with an error naming the difference, and
  /// a torn or truncated file is refused on every rank; nothing is changed unless every
  /// rank read and verified its whole state.
  void load(const std::filesystem::path& dir) {
    const int rank = engine_.topology().rank();
    std::optional<checkpoint::file_reader> file;
    std::exception_ptr error = attempt([&] {
      const auto m = checkpoint::file_reader::open(dir / "manifest.bin");
      manifest().require_same(checkpoint::manifest::parse(m.section("manifest")), dir.string());
      const auto path = dir / checkpoint::rank_file_name(rank);
      file.emplace(checkpoint::file_reader::open(path));
      manifest().require_same(checkpoint::manifest::parse(file->section("manifest")),
                              path.string());
      const auto id = m.read_value<std::uint64_t>("save_id");
      const auto file_id = file->read_value<std::uint64_t>("save_id");
      if (file_id != id)
        throw invalid_argument(fedshard::detail::concat(
            "fedshard: checkpoint file '", path.string(), "' belongs to another save (id ", file_id,
            ") than its manifest '", (dir / "manifest.bin").string(), "' (id ", id,
            "): a save stopped half-way"));
      restore(*file, /*commit=*/false);  // every section present with the right size
    });
    all_ok(error, "reading the checkpoint");
    restore(*file, /*commit=*/true);
  }

  const flat_layout& layout() const override { return engine_.layout(); }
  engine_type& engine() noexcept { return engine_; }
  Optimizer& optimizer() noexcept { return optimizer_; }
  federation_policy& federation() noexcept { return fed_; }
  const sync_schedule& schedule() const noexcept { return schedule_; }
  ModelT& model() noexcept { return model_; }
  mesh<C>& topology() noexcept { return engine_.topology(); }
  const options& settings() const noexcept { return opts_; }

 private:
  enum class sync_stage : std::uint8_t { idle, in_flight, communicated };

  struct fragment {
    std::vector<int> units;
    aligned_buffer<float> buf;  // packed fragment, padded (federation::padded_fragment_numel)
    std::vector<pending_op> ops;
    sync_stage stage = sync_stage::idle;
    std::int64_t tokens = 0;  // this rank's tokens since the fragment's last sync started
    federation::sync_info info{};
    std::vector<std::int64_t> applied_at;
  };

  static std::vector<std::size_t> fragment_sizes(const sync_schedule& s, const engine_type& e) {
    const auto units = static_cast<int>(e.layout().num_units());
    s.check(units);
    std::vector<std::size_t> sizes;
    auto& m = const_cast<engine_type&>(e).topology();
    for (int f = 0; f < s.fragments(); ++f) {
      std::size_t n = 0;
      for (int u : s.fragment_units(f, units))
        n += const_cast<engine_type&>(e).master_of(static_cast<std::size_t>(u)).size();
      sizes.push_back(federation::padded_fragment_numel(n, m.shape().replicas));
    }
    return sizes;
  }

  // unit_hooks: the step_context forwards here.
  std::span<const float> acquire(std::size_t u) override { return engine_.acquire(u); }
  std::span<const float> params(std::size_t u) override { return engine_.params(u); }
  void release(std::size_t u) override { engine_.release(u); }
  std::span<float> grad_buffer(std::size_t u) override { return engine_.grad_buffer(u); }
  void grads_ready(std::size_t u) override { engine_.grads_ready(u); }

  /// First step: anchors start from the initial parameters.
  void start() {
    started_ = true;
    for (std::size_t f = 0; f < fragments_.size(); ++f) {
      pack(fragments_[f], engine_.master());
      fed_.reset(static_cast<int>(f), fragments_[f].buf.span());
    }
  }

  /// Copies the fragment's part of a master-shaped span into its buffer (zero padding).
  void pack(fragment& fr, std::span<const float> src) {
    std::size_t at = 0;
    for (int u : fr.units) {
      const auto [off, len] = unit_slice(static_cast<std::size_t>(u));
      std::copy_n(src.begin() + static_cast<std::ptrdiff_t>(off), len, fr.buf.begin() + at);
      at += len;
    }
    std::fill(fr.buf.begin() + at, fr.buf.end(), 0.0f);
  }
  /// dst = (1 - alpha) dst + alpha buf over the fragment's part of a master-shaped span.
  void unpack(const fragment& fr, std::span<float> dst, float alpha) {
    std::size_t at = 0;
    for (int u : fr.units) {
      const auto [off, len] = unit_slice(static_cast<std::size_t>(u));
      float* d = dst.data() + off;
      const float* s = fr.buf.data() + at;
      if (alpha == 1.0f)
        std::copy_n(s, len, d);
      else
        for (std::size_t i = 0; i < len; ++i) d[i] += alpha * (s[i] - d[i]);
      at += len;
    }
  }
  std::pair<std::size_t, std::size_t> unit_slice(std::size_t u) {
    auto m = engine_.master();
    auto mu = engine_.master_of(u);
    return {static_cast<std::size_t>(mu.data() - m.data()), mu.size()};
  }

  /// Asks the schedule what each fragment does after this step.
  void federate() {
    for (int f = 0; f < static_cast<int>(fragments_.size()); ++f) {
      const auto a = schedule_.action(f, step_, opts_.total_steps);
      if (schedule::starts(a)) start_sync(f);
      if (schedule::applies(a)) apply_sync(f);
    }
  }

  void start_sync(int f) {
    auto& fr = fragments_[static_cast<std::size_t>(f)];
    FEDSHARD_EXPECTS(fr.stage == sync_stage::idle, "trainer: fragment ", f,
                     " starts a sync while its previous one is still in flight (step ", step_, ")");
    auto& m = engine_.topology();
    fr.info = {f, m.shape().groups, 1.0};
    if constexpr (federation_policy::uses_weights) fr.info.weight_scale = exchange_weights(fr);
    fr.tokens = 0;
    pack(fr, engine_.master());
    fed_.begin(f, fr.buf.span(), fr.info);
    start_average(fr, fr.buf.span());
    fr.stage = sync_stage::in_flight;
  }

  /// Starts the federation all_reduce of buf (this rank's piece of it, hierarchically).
  void start_average(fragment& fr, std::span<float> buf) {
    auto& m = engine_.topology();
    const plan p =
        federation::average_plan(m.shape(), m.coords(), opts_.federation.sync, buf.size());
    const comm_op& ar = p.ops.front();
    if (ar.kind != comm_kind::all_reduce) return;  // reference mode, replica r > 0: receives only
    float* piece = buf.data();
    if (opts_.federation.sync == federation::sync_mode::hierarchical)
      piece += buf.size() / static_cast<std::size_t>(m.shape().replicas) *
               static_cast<std::size_t>(m.coords().replica);
    fr.ops.push_back(engine_.exec().start(ar, piece, piece));
  }

  /// Waits for the all_reduce and shares the result with the group's other replicas.
  void finish_average(fragment& fr, std::span<float> buf) {
    for (auto& op : fr.ops) engine_.exec().wait(op);
    fr.ops.clear();
    auto& m = engine_.topology();
    const plan p =
        federation::average_plan(m.shape(), m.coords(), opts_.federation.sync, buf.size());
    for (const comm_op& op : p.ops) {
      if (op.on != axis::replica) continue;
      if (op.kind == comm_kind::all_gather) {
        const std::size_t piece = buf.size() / static_cast<std::size_t>(m.shape().replicas);
        engine_.exec().run(op, buf.data() + piece * static_cast<std::size_t>(m.coords().replica),
                           buf.data());
      } else {
        engine_.exec().run(op, buf.data(), buf.data());
      }
    }
  }

  void apply_sync(int f) {
    auto& fr = fragments_[static_cast<std::size_t>(f)];
    FEDSHARD_EXPECTS(fr.stage != sync_stage::idle, "trainer: fragment ", f,
                     " applies a sync that was never started (step ", step_, ")");
    if (fr.stage == sync_stage::in_flight) finish_average(fr, fr.buf.span());
    fed_.end(f, fr.buf.span(), fr.info);
    unpack(fr, engine_.master(), schedule_.mixing());
    if (fed_.averages_inner_moments()) {
      for (auto& st : optimizer_.state()) {
        pack(fr, st.data);
        start_average(fr, fr.buf.span());
        finish_average(fr, fr.buf.span());
        unpack(fr, st.data, 1.0f);
      }
    }
    fr.stage = sync_stage::idle;
    fr.applied_at.push_back(step_);
    ++syncs_applied_;
  }

  /// Exchanges the groups' tokens since the last sync; returns G * w_g / W. Every rank sees
  /// every group's weight, so bad weights fail on every rank.
  double exchange_weights(const fragment& fr) {
    auto& m = engine_.topology();
    const plan p = federation::weights_plan(m.shape());
    double mine = static_cast<double>(fr.tokens);
    engine_.exec().run(p.ops[0], &mine, &mine);  // the group's tokens
    std::vector<double> all(static_cast<std::size_t>(m.shape().groups));
    engine_.exec().run(p.ops[1], &mine, all.data());
    double total = 0;
    std::string listing;
    bool negative = false;
    for (std::size_t g = 0; g < all.size(); ++g) {
      total += all[g];
      negative = negative || all[g] < 0;
      listing += fedshard::detail::concat(g ? ", " : "", "group ", g, ": ", all[g]);
    }
    FEDSHARD_EXPECTS(!negative && total > 0,
                     "weighted_average: weights (tokens since the last sync) must be >= 0 and not "
                     "all zero, found ",
                     listing);
    return static_cast<double>(m.shape().groups) * all[static_cast<std::size_t>(m.coords().group)] /
           total;
  }

  /// What a checkpoint of this run must match.
  checkpoint::manifest manifest() const {
    auto& e = const_cast<engine_type&>(engine_);
    checkpoint::manifest m;
    char fp[24];
    std::snprintf(fp, sizeof fp, "%016llx",
                  static_cast<unsigned long long>(e.layout().fingerprint()));
    m.fields["format"] = "1";
    m.fields["mesh"] = to_string(e.topology().shape());
    m.fields["layout"] = fp;
    m.fields["layout_summary"] = e.layout().summary();
    m.fields["shard_policy"] = std::string(shard_policy::name);
    m.fields["federation_policy"] = std::string(federation_policy::name);
    m.fields["sync_schedule"] = fedshard::detail::concat(sync_schedule::name, " with ",
                                                         schedule_.fragments(), " fragment(s)");
    m.fields["precision"] = fedshard::detail::concat(to_string(opts_.precision.param), "/",
                                                     to_string(opts_.precision.reduce));
    std::string names;
    for (const auto& t : const_cast<Optimizer&>(optimizer_).state()) names += t.name + " ";
    m.fields["optimizer_state"] = names;
    return m;
  }

  checkpoint::file_writer rank_state() {
    checkpoint::file_writer w;
    w.add_text("manifest", manifest().text());
    w.add_span("master", std::span<const float>(engine_.master()));
    w.add_value("optimizer.step_count", optimizer_.step_count());
    for (const auto& t : optimizer_.state())
      w.add_span("optimizer." + t.name, std::span<const float>(t.data));
    for (const auto& t : fed_.state())
      w.add_span("federation." + t.name, std::span<const float>(t.data));
    for (std::size_t f = 0; f < fragments_.size(); ++f) {
      const auto& fr = fragments_[f];
      const std::string p = "fragment" + std::to_string(f) + ".";
      if constexpr (requires { fed_.outer_steps(0); })
        w.add_value(p + "outer_steps", fed_.outer_steps(static_cast<int>(f)));
      w.add_value(p + "stage", fr.stage);
      w.add_value(p + "tokens", fr.tokens);
      w.add_value(p + "weight_scale", fr.info.weight_scale);
      w.add_span(p + "applied_at", std::span<const std::int64_t>(fr.applied_at));
      if (fr.stage != sync_stage::idle)
        w.add_span(p + "buffer", std::span<const float>(fr.buf.span()));
    }
    w.add_value("trainer.step", step_);
    w.add_value("trainer.syncs_applied", syncs_applied_);
    w.add_value("trainer.started", started_);
    return w;
  }

  /// Reads every section into scratch (commit = false: only verifies) or into the live state.
  void restore(const checkpoint::file_reader& r, bool commit) {
    auto into = [&](const std::string& name, std::span<float> live) {
      std::vector<float> scratch(live.size());
      r.read_span(name, std::span<float>(scratch));
      if (commit) std::copy(scratch.begin(), scratch.end(), live.begin());
    };
    into("master", engine_.master());
    const auto opt_steps = r.read_value<std::int64_t>("optimizer.step_count");
    for (const auto& t : optimizer_.state()) into("optimizer." + t.name, t.data);
    for (const auto& t : fed_.state()) into("federation." + t.name, t.data);
    for (std::size_t f = 0; f < fragments_.size(); ++f) {
      auto& fr = fragments_[f];
      const std::string p = "fragment" + std::to_string(f) + ".";
      const auto stage = r.read_value<sync_stage>(p + "stage");
      FEDSHARD_EXPECTS(stage == sync_stage::idle || stage == sync_stage::communicated,
                       "checkpoint: fragment ", f, " has an invalid sync stage ",
                       static_cast<int>(stage));
      const std::string& at = r.section(p + "applied_at");
      FEDSHARD_EXPECTS(at.size() % sizeof(std::int64_t) == 0, "checkpoint: section '", p,
                       "applied_at' has ", at.size(), " bytes, not a multiple of 8");
      std::vector<std::int64_t> applied(at.size() / sizeof(std::int64_t));
      r.read_span(p + "applied_at", std::span<std::int64_t>(applied));
      const auto tokens = r.read_value<std::int64_t>(p + "tokens");
      const auto scale = r.read_value<double>(p + "weight_scale");
      if (stage != sync_stage::idle) into(p + "buffer", fr.buf.span());
      std::int64_t outer = 0;
      if constexpr (requires { fed_.outer_steps(0); })
        outer = r.read_value<std::int64_t>(p + "outer_steps");
      if (!commit) continue;
      fr.stage = stage;
      fr.applied_at = std::move(applied);
      fr.tokens = tokens;
      fr.info = {static_cast<int>(f), engine_.topology().shape().groups, scale};
      fr.ops.clear();
      if constexpr (requires { fed_.outer_steps(0); })
        fed_.set_outer_steps(static_cast<int>(f), outer);
    }
    const auto step = r.read_value<std::int64_t>("trainer.step");
    const auto syncs = r.read_value<std::int64_t>("trainer.syncs_applied");
    const auto started = r.read_value<bool>("trainer.started");
    if (!commit) return;
    optimizer_.set_step_count(opt_steps);
    step_ = step;
    syncs_applied_ = syncs;
    started_ = started;
  }

  /// Rank 0's checkpoint::new_save_id(), agreed on by every rank (collective over the world).
  std::uint64_t save_id() {
    auto& m = engine_.topology();
    const comm_op op{comm_kind::all_reduce, axis::world, 8, dtype::f64, -1, phase::sync, m.size(),
                     reduce_op::max,        false};
    double id = m.rank() == 0 ? static_cast<double>(checkpoint::new_save_id()) : 0.0;
    engine_.exec().run(op, &id, &id);
    return static_cast<std::uint64_t>(id);
  }

  /// Runs f; returns what it threw, or null when it succeeded.
  template <class F>
  static std::exception_ptr attempt(F&& f) {
    try {
      f();
      return nullptr;
    } catch (...) {
      return std::current_exception();
    }
  }

  /// Collective over the world: throws on every rank unless no rank has an `error`.
  void all_ok(const std::exception_ptr& error, const char* what) {
    auto& m = engine_.topology();
    const comm_op op{comm_kind::all_reduce, axis::world, 8, dtype::f64, -1, phase::sync, m.size(),
                     reduce_op::min,        false};
    double ok = error ? static_cast<double>(m.rank()) : static_cast<double>(m.size());
    engine_.exec().run(op, &ok, &ok);
    if (error) std::rethrow_exception(error);
    if (ok < m.size())
      throw invalid_argument(fedshard::detail::concat(
          "fedshard: checkpoint: ", what, " failed on world rank ", static_cast<int>(ok),
          " (that rank reports why); no state was changed on this rank"));
  }

  ModelT model_;
  options opts_;
  engine_type engine_;
  Optimizer optimizer_;
  float base_lr_;
  sync_schedule schedule_;
  federation_policy fed_;
  std::vector<fragment> fragments_;
  std::int64_t step_ = 0;
  std::int64_t syncs_applied_ = 0;
  bool started_ = false;
};

}  // namespace fedshard
