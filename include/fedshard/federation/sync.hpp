#pragma once
/// The federation sync state machine: fragments, their buffers and stages, and the firing of
/// the FederationPolicy's sync plan at the points the SyncSchedule names.
///
/// A fragment is a set of units (the schedule's fragment_units). After each inner step the
/// schedule's action for each fragment says whether a sync starts (snapshot the fragment's
/// part of the master into its buffer, exchange what sync_prepare moves, let the policy's
/// begin() transform it, fire sync_exchange: the averaging may stay in flight for the
/// schedule's delay) and whether it applies (finish the averaging: sync_finish; the policy's
/// end(); mix the result into the master with the schedule's α; then sync_after, e.g. the
/// inner-optimizer moments). Every collective is an op of the policy's sync_plan, run by the
/// interpreter with this object binding the roles fragment, moment, tokens and group_tokens.
///
/// Under a progress schedule (schedule::ProgressSchedule: token_budget, wall_clock) the
/// decision depends on the group's tokens and time, which its ranks see differently; so
/// after every step the group agrees on them first: progress_op, one 16-byte all_reduce over
/// the group axis, sums every rank's tokens of the step with the seconds since the start on
/// the group's rank 0 (the other ranks add zero), and every rank decides from the same
/// sync_progress. A sync is then a federation collective like any other: the k-th sync of a
/// group meets the k-th of the others, however many steps each took to get there.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
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
#include "fedshard/federation/federation_policy.hpp"
#include "fedshard/federation/overlap.hpp"
#include "fedshard/federation/participation.hpp"
#include "fedshard/federation/sync_plan.hpp"
#include "fedshard/kernels/sync.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/optimizer.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/plan/interpreter.hpp"
#include "fedshard/schedule/sync_schedule.hpp"
#include "fedshard/shard/flat_layout.hpp"
#include "fedshard/shard/ownership.hpp"
#include "fedshard/space/host_space.hpp"
#include "fedshard/space/memory_space.hpp"

namespace fedshard::federation {

/// The units of each of the schedule's fragments of `layout`, and (offset, length) of each
/// unit's shard in a rank's master (shard::engine's layout: unit shards back to back).
struct fragment_slices {
  std::vector<std::pair<std::size_t, std::size_t>> slices;
  std::vector<packed_unit> units;  ///< the unit of each slice and its length
  std::size_t numel = 0;           ///< elements of the fragment in a rank's master
  std::size_t padded = 0;          ///< its packed buffer's size (padded_fragment_numel)
};

/// The fragments a SyncSchedule cuts a layout into, for a mesh of `replicas` replicas;
/// invalid_argument when the schedule cannot cut this layout. `held` (by unit; empty: all)
/// leaves out the units the rank's group does not hold (shard/ownership.hpp): the master
/// holds the others' shards back to back. `left_out` (by unit; empty: none) leaves out units
/// the master holds but another stage syncs (a local rule's: local_rule::synced_units).
template <schedule::SyncSchedule S>
std::vector<fragment_slices> fragments_of(const S& schedule, const flat_layout& layout,
                                          int replicas, const std::vector<bool>& held = {},
                                          const std::vector<bool>& left_out = {}) {
  const auto offsets = shard::held_offsets(layout, held);
  const auto units = static_cast<int>(layout.num_units());
  schedule.check(units);
  FEDSHARD_EXPECTS(left_out.empty() || left_out.size() == layout.num_units(),
                   "fragments_of: left_out names units by index: expected ", layout.num_units(),
                   " flags, found ", left_out.size());
  std::vector<fragment_slices> out(static_cast<std::size_t>(schedule.fragments()));
  for (int f = 0; f < schedule.fragments(); ++f) {
    auto& fr = out[static_cast<std::size_t>(f)];
    for (int u : schedule.fragment_units(f, units)) {
      const auto uu = static_cast<std::size_t>(u);
      if (offsets[uu] == shard::not_held || (!left_out.empty() && left_out[uu])) continue;
      fr.slices.emplace_back(offsets[uu], layout.unit(uu).shard_numel);
      fr.units.push_back({.unit = u, .numel = layout.unit(uu).shard_numel});
      fr.numel += layout.unit(uu).shard_numel;
    }
    fr.padded = padded_fragment_numel(fr.numel, replicas);
  }
  return out;
}

/// The sync plan of each fragment for the rank at `coords`: what a synchronizer with this
/// policy and schedule runs (a policy's sync_plan depends on its config alone, so `policy`
/// may be one built for no fragments; nothing of the model's size is allocated); `held` as
/// and `left_out` as for fragments_of; at the fragments' sync number `round`
/// (sync_context::round; plan_per_round policies only); on a heterogeneous mesh, `overlap`
/// (sync_context::overlap); averaging in `reduce` (sync_context::reduce).
template <class F, schedule::SyncSchedule S>
requires requires(const F& f, const sync_context& ctx) {
  { f.sync_plan(ctx) } -> std::same_as<plan>;
}
std::vector<plan> sync_plans_of(const F& policy, const S& schedule, const flat_layout& layout,
                                const mesh_shape& shape, const mesh_coords& coords,
                                int inner_state_buffers, const std::vector<bool>& held = {},
                                std::int64_t round = 0,
                                std::shared_ptr<const overlap_map> overlap = nullptr,
                                const std::vector<bool>& left_out = {}, dtype reduce = dtype::f32) {
  std::vector<plan> out;
  const auto fragments = fragments_of(schedule, layout, shape.replicas, held, left_out);
  for (std::size_t f = 0; f < fragments.size(); ++f) {
    out.push_back(policy.sync_plan({.shape = shape,
                                    .coords = coords,
                                    .fragment = static_cast<int>(f),
                                    .numel = fragments[f].padded,
                                    .inner_state_buffers = inner_state_buffers,
                                    .units = fragments[f].units,
                                    .round = round,
                                    .overlap = overlap,
                                    .layout = &layout,
                                    .reduce = reduce}));
    out.back().check();
  }
  return out;
}

/// The op of a progress schedule's agreement, after every step: a sum all_reduce over the
/// group axis of two f64 (role value): the rank's tokens of the step, and the seconds since
/// the run started on the group's rank 0 (zero on the others). Every rank of the group gets
/// the group's tokens and its rank 0's clock, bit-identical (rank-order reduction).
inline comm_op progress_op(const mesh_shape& shape) {
  return {.kind = comm_kind::all_reduce,
          .axis = axis::group,
          .dtype = dtype::f64,
          .bytes = 16,
          .ranks = shape.replicas * shape.shards,
          .reduce = reduce_op::sum,
          .trigger = trigger::on_demand,
          .phase = phase::sync,
          .in = {.role = role::value},
          .out = {.role = role::value},
          .overlappable = false};
}

/// Where a fragment's sync stands.
enum class sync_stage : std::uint8_t {
  idle,         ///< no sync in flight
  in_flight,    ///< started: the averaging runs
  communicated  ///< the averaged buffer is complete, not applied yet
};

/// The sync state machine of FederationPolicy F under SyncSchedule Sch for one rank, with
/// its buffers in memory space S. Its work is queued on a stream of its own (the sync
/// stream), ordered against the compute stream the caller passes with events.
template <FederationPolicy F, schedule::SyncSchedule Sch, space::MemorySpace S = space::host_space>
class synchronizer {
 public:
  /// The policy in space S.
  using policy_type = in_space_t<F, S>;
  using stream_type = typename S::stream;
  static_assert(capabilities<F>::checked && capabilities<policy_type>::checked &&
                schedule::capabilities<Sch>::checked);

  /// Fragments of `layout` (a rank's master holds each unit's shard, as shard::engine lays it
  /// out) on this rank of a mesh of `shape`, with buffers in space s (which outlives the
  /// synchronizer); `inner_state_buffers` is the inner optimizer's state count (role
  /// moment); on a heterogeneous mesh, `overlap` says how every group cuts the model
  /// (federation/overlap.hpp; the policy must have heterogeneous_groups); `left_out` (by
  /// unit; empty: none) names units another stage syncs (a local rule's records), left out of
  /// every fragment; `reduce` is the dtype its averages combine in (shard::precision::sync;
  /// invalid_argument when it is not f32 and the policy's plans average nothing in it: a
  /// policy that does not average through average_ops). Throws invalid_argument for
  /// settings that cannot work.
  synchronizer(const typename F::config& fed, const typename Sch::config& sched,
               const flat_layout& layout, const mesh_shape& shape, const mesh_coords& coords,
               int inner_state_buffers, S& s, std::shared_ptr<const overlap_map> overlap = nullptr,
               std::vector<bool> left_out = {}, dtype reduce = dtype::f32)
      : synchronizer(fed, sched, layout, shape, coords, inner_state_buffers, space::space_ref<S>(s),
                     std::move(overlap), std::move(left_out), reduce) {}
  /// With a space of its own (default-constructed S).
  synchronizer(const typename F::config& fed, const typename Sch::config& sched,
               const flat_layout& layout, const mesh_shape& shape, const mesh_coords& coords,
               int inner_state_buffers)
      : synchronizer(fed, sched, layout, shape, coords, inner_state_buffers,
                     space::space_ref<S>::make()) {}

  synchronizer(const synchronizer&) = delete;
  synchronizer& operator=(const synchronizer&) = delete;

  const Sch& schedule() const noexcept { return schedule_; }
  policy_type& policy() noexcept { return policy_; }
  const policy_type& policy() const noexcept { return policy_; }
  /// P, the schedule's fragments.
  int fragments() const noexcept { return static_cast<int>(fragments_.size()); }
  /// The ops one sync of fragment f moves for this rank (for a plan_per_round policy: the
  /// plan of its latest sync started, or of its first before it started one).
  const plan& sync_plan(int f) const { return at(f).plan; }
  /// Syncs applied so far (all fragments).
  std::int64_t syncs_applied() const noexcept { return syncs_applied_; }
  /// The steps after which fragment f applied a sync.
  const std::vector<std::int64_t>& sync_steps(int f) const { return at(f).applied_at; }
  /// Fragment f's stage.
  sync_stage stage(int f) const { return at(f).stage; }
  /// The units fragment f syncs: the schedule's, less the left-out ones (whether or not
  /// this rank's group holds them).
  std::vector<int> synced_units(int f, int units) const {
    std::vector<int> out;
    for (int u : schedule_.fragment_units(checked_fragment(f), units))
      if (left_out_.empty() || !left_out_.at(static_cast<std::size_t>(u))) out.push_back(u);
    return out;
  }

  /// Whom the latest applied sync combined, and with what weights.
  struct applied_sync {
    /// Which groups it combined (1) or left out (0), by group; empty: every group.
    std::vector<std::uint8_t> included;
    /// Every group's tokens since its previous sync, when the policy's plan exchanged them
    /// (a token-weighted policy), else empty.
    std::vector<double> group_tokens;
  };
  /// The latest applied sync's (applied_sync): what a stage that syncs the left-out units
  /// alongside it (a local rule) combines by, so that it weighs the groups as the policy does.
  const applied_sync& last_applied() const noexcept { return applied_; }
  /// True under a progress schedule (token_budget, wall_clock).
  static constexpr bool by_progress = schedule::ProgressSchedule<Sch>;
  /// The ops run after every step to agree on the group's progress: progress_op under a
  /// progress schedule, else none.
  const plan& progress_plan() const noexcept { return progress_plan_; }
  /// The group's progress as its ranks agreed on it after the latest step (progress
  /// schedules only; zeros before the first step).
  const schedule::sync_progress& progress() const noexcept { return progress_; }
  /// After a resharding load: the group's tokens since its last sync and its seconds since
  /// the start (the clock goes on from there).
  void set_progress(std::int64_t group_tokens, double seconds) {
    progress_.tokens = group_tokens;
    progress_.seconds = seconds;
    progress_.syncs = syncs_applied_;
    clock_started_ = false;
  }

  /// (Re)starts every fragment's policy state (anchors) from the master parameters (in the
  /// space's memory, as the work queued on `compute` leaves them); `compute` waits for it.
  void reset(std::span<const float> master, stream_type& compute) {
    space_->wait(sync_, space_->record(compute));
    for (int f = 0; f < fragments(); ++f) {
      auto& fr = at(f);
      pack(fr, master, fr.buf.span());
      policy_.reset(f, fr.buf.span(), sync_);
    }
    space_->wait(compute, space_->record(sync_));
  }
  /// reset() on a stream of its own, done when it returns.
  void reset(std::span<const float> master) {
    auto st = space_->make_stream();
    reset(master, st);
    space_->synchronize(st);
  }
  /// Restarts the clock of a progress schedule (the run's first step starts now).
  void start_clock() {
    start_time_ = std::chrono::steady_clock::now();
    clock_started_ = true;
  }

  /// Where sync_info::included comes from (a federation axis whose groups come and go, e.g.
  /// elastic::link::included); asked at every begin() and end(). Unset: every group.
  void set_included_source(std::function<std::vector<std::uint8_t>()> source) {
    hooks_.included = std::move(source);
  }
  /// What a federation axis with rounds offers the participation stage (its groups, an
  /// agreement for screening, where verdicts go): federation/heal.hpp sets it each round.
  void set_round_hooks(round_hooks h) { hooks_ = std::move(h); }

  /// Which groups each sync combines (federation/participation.hpp); invalid_argument for
  /// settings it cannot use. Default: every group.
  void set_participation(const participation& p) {
    federation::check(p);
    participation_ = p;
  }
  /// The participation settings (set_participation).
  const participation& participation_settings() const noexcept { return participation_; }
  /// Robust aggregation's settings (federation/participation.hpp); invalid_argument for
  /// settings it cannot use. Default: off (the trainer turns it on over an elastic link).
  void set_screening(const screening& s) {
    federation::check(s);
    screening_ = s;
  }
  /// The screening settings (set_screening).
  const screening& screening_settings() const noexcept { return screening_; }

  /// Counts a step's tokens toward every fragment's weight.
  void add_tokens(std::int64_t tokens) {
    for (auto& fr : fragments_) fr.tokens += tokens;
    step_tokens_ += tokens;
  }

  /// After the optimizer step of 0-based `step` of a run of `total_steps`: starts and
  /// applies the syncs the schedule names. `master` and `inner` (the inner optimizer's state,
  /// laid out like the master, for plans that average it) are in the space's memory, as the
  /// work queued on `compute` leaves them; `compute` waits for what a sync writes into them.
  template <Communicator C>
  void after_step(interpreter<C, S>& interp, std::int64_t step, std::int64_t total_steps,
                  std::span<float> master, const std::vector<optim::state_tensor>& inner,
                  stream_type& compute) {
    if constexpr (by_progress) {
      const auto a = schedule_.action(0, agree_progress(interp, step, compute));
      if (schedule::starts(a)) start(interp, 0, step, master, compute);
      if (schedule::applies(a)) {
        apply(interp, 0, step, master, inner, compute);
        progress_.tokens = 0;
        progress_.syncs = syncs_applied_;
      }
    } else if constexpr (F::syncs) {  // a policy that never communicates has nothing to do
      for (int f = 0; f < fragments(); ++f) {
        const auto a = schedule_.action(f, step, total_steps);
        if (schedule::starts(a)) start(interp, f, step, master, compute);
        if (schedule::applies(a)) apply(interp, f, step, master, inner, compute);
      }
    }
  }
  /// after_step() with a compute stream of its own, done when it returns.
  template <Communicator C>
  void after_step(interpreter<C, S>& interp, std::int64_t step, std::int64_t total_steps,
                  std::span<float> master, const std::vector<optim::state_tensor>& inner) {
    auto st = space_->make_stream();
    after_step(interp, step, total_steps, master, inner, st);
    space_->synchronize(st);
  }

  /// Completes, without applying, every sync in flight (before a checkpoint, so a restored
  /// run applies it at the same step); the host waits for it.
  template <Communicator C>
  void complete_in_flight(interpreter<C, S>& interp) {
    for (int f = 0; f < fragments(); ++f)
      if (at(f).stage == sync_stage::in_flight) communicate(interp, f);
    space_->synchronize(sync_);
  }

  /// Checks a run of `total_steps` (0: unknown) whose steps run `step_plan` (of the shard
  /// policy `shard_policy`): under a progress schedule groups take different numbers of
  /// steps, so a run ends after run_syncs() syncs (total_steps must be 0) and every step op
  /// must stay inside a group (a collective across groups would wait for a step the others
  /// take at another time, or never).
  void check_run(std::int64_t total_steps, const plan& step_plan,
                 std::string_view shard_policy) const {
    if constexpr (by_progress) {
      FEDSHARD_EXPECTS(total_steps == 0, "trainer: total_steps must be 0 with the ", Sch::name,
                       " schedule (groups take different numbers of steps; the run ends after "
                       "its ",
                       schedule_.run_syncs(), " syncs: trainer::done()), found ", total_steps);
      for (const comm_op& op : step_plan.ops)
        FEDSHARD_EXPECTS(
            shape_.groups == 1 || (op.axis != axis::federation && op.axis != axis::world),
            "trainer: the ", Sch::name,
            " schedule lets groups take different numbers of steps, so every step op must "
            "stay inside a group; the ",
            shard_policy, " step plan has ", fedshard::describe(op));
    }
  }

  /// True when a run of `total_steps` (0: the caller counts) is over after `steps` steps:
  /// after run_syncs() syncs under a progress schedule, else once total_steps are taken.
  bool done(std::int64_t steps, std::int64_t total_steps) const noexcept {
    if constexpr (by_progress)
      return syncs_applied_ >= schedule_.run_syncs();
    else
      return total_steps > 0 && steps >= total_steps;
  }
  /// True when the step numbered `step` applied a sync (of any fragment).
  bool synced_after(std::int64_t step) const {
    for (const auto& fr : fragments_)
      if (!fr.applied_at.empty() && fr.applied_at.back() == step) return true;
    return false;
  }

  /// The policy's buffers as the federation state names them ("fragment<f>.<name>").
  std::vector<std::string> state_names() {
    std::vector<std::string> out;
    for (const auto& t : policy_.state()) out.push_back(policy_key(t));
    return out;
  }

  /// Registers the synchronizer's state (core/state_registry.hpp): the policy's buffers
  /// ("federation.fragment<f>.<name>", laid out like fragment f), each fragment's stage,
  /// counters and buffer in flight ("fragment<f>.<key>"), the syncs applied, a progress
  /// schedule's progress, and the residuals of the sync plans' stateful codecs (run by
  /// `interp`).
  template <Communicator C>
  void register_state(state_registry& reg, interpreter<C, S>& interp) {
    reg.add_kind({.prefix = "federation.", .noun = "federation state"});
    for (const auto& t : policy_.state()) register_policy_buffer(reg, t);
    for (int f = 0; f < fragments(); ++f) register_fragment(reg, f);
    reg.add_value({.name = "federation.syncs_applied"}, &syncs_applied_);
    if constexpr (by_progress) register_progress(reg);
    for (int f = 0; f < fragments(); ++f)
      interp.register_codec_states(
          reg, sync_plan(f), "fragment" + std::to_string(f), [f](const comm_op& op) {
            // A residual of a fragment (or of a replica's piece of it) reshards like the
            // fragment, within the same policy (the same plan, op for op).
            const bool piece = op.in.piece == axis::replica;
            if (op.in.role != role::fragment || (op.in.piece && !piece))
              return state_entry{.name = {}, .survives_policy_change = false, .reshards = false};
            return state_entry{.name = {},
                               .family = "fragment{f}",
                               .extent = state_extent::fragment,
                               .fragment = f,
                               .replica_piece = piece,
                               .survives_policy_change = false};
          });
  }

 private:
  struct fragment {
    std::vector<std::pair<std::size_t, std::size_t>> slices;  // (offset, length) in the master
    std::vector<packed_unit> units;                           // the unit of each slice
    typename S::template buffer<float> buf;                   // packed fragment (role fragment)
    std::vector<typename S::template buffer<float>>
        moments;                                           // packed inner state k (role moment k)
    typename S::template buffer<double> tokens_buf;        // role tokens
    typename S::template buffer<double> group_tokens_buf;  // role group_tokens
    fedshard::plan plan;
    sync_stage stage = sync_stage::idle;
    ticket start;                      // the sync_exchange firing in flight
    ticket finish;                     // the sync_finish firing
    std::int64_t tokens = 0;           // this rank's tokens since the last sync started
    std::vector<double> group_tokens;  // every group's, on the host
    std::vector<std::int64_t> applied_at;
    bool exchanges_tokens = false;  // the plan gathers role group_tokens
  };

  synchronizer(const typename F::config& fed, const typename Sch::config& sched,
               const flat_layout& layout, const mesh_shape& shape, const mesh_coords& coords,
               int inner_state_buffers, space::space_ref<S> sr,
               std::shared_ptr<const overlap_map> overlap = nullptr,
               std::vector<bool> left_out = {}, dtype reduce = dtype::f32)
      : space_(std::move(sr)),
        sync_(space_->make_stream()),
        schedule_(sched),
        shape_(shape),
        coords_(coords),
        layout_(layout),
        overlap_(checked_overlap(std::move(overlap))),
        left_out_(std::move(left_out)),
        fragments_(
            cut(*space_, schedule_, layout, shape, held_of(fed, layout, shape, coords), left_out_)),
        policy_(make_policy(fed, sizes(fragments_), *space_)),
        inner_state_buffers_(inner_state_buffers),
        reduce_(reduce) {
    if constexpr (by_progress) {
      FEDSHARD_EXPECTS(schedule_.fragments() == 1, Sch::name,
                       ": a progress schedule syncs the whole model as one fragment, found ",
                       schedule_.fragments(), " fragments");
      progress_plan_.ops.push_back(progress_op(shape));
      progress_plan_.check();
      progress_buf_ = space_->template allocate<double>(2);
    }
    const auto plans =
        sync_plans_of(policy_, schedule_, layout, shape, coords, inner_state_buffers,
                      held_of(fed, layout, shape, coords), 0, overlap_, left_out_, reduce_);
    check_reduce(fed, plans);
    if (overlap_ && coords_.replica == 0) {  // the holder sets every replica-0 rank splits
      std::vector<std::vector<int>> units;
      for (const auto& fr : fragments_) units.push_back(unit_ids(fr.units));
      overlap_sets_ = overlap_member_sets(*overlap_, units);
    }
    for (int f = 0; f < fragments(); ++f) {
      auto& fr = at(f);
      fr.plan = plans[static_cast<std::size_t>(f)];
      std::size_t moments = 0;
      for (const comm_op& op : fr.plan.ops) {
        fr.exchanges_tokens = fr.exchanges_tokens || op.out.role == role::group_tokens;
        for (const operand& o : {op.in, op.out}) {
          if (o.role != role::moment) continue;
          FEDSHARD_EXPECTS(o.index >= 0 && o.index < inner_state_buffers, F::name,
                           ": the sync plan averages inner-optimizer state ", o.index,
                           " but the optimizer has ", inner_state_buffers, " state buffers");
          moments = std::max(moments, static_cast<std::size_t>(o.index) + 1);
        }
      }
      for (std::size_t k = 0; k < moments; ++k)
        fr.moments.push_back(space_->template allocate<float>(fr.buf.size()));
    }
  }

  /// invalid_argument when the averages are to combine in a narrow dtype but the policy
  /// averages nothing in it (it does not average through average_ops, or a heterogeneous
  /// mesh's overlap averages do, which are f32). Decided from the plans of world rank 0's
  /// coordinates (`plans` when they are this rank's), so every rank decides alike: another
  /// rank's plans may have no federation op (a replica that only receives the average, a
  /// group with nothing to share).
  void check_reduce(const typename F::config& fed, const std::vector<plan>& plans) const {
    if (reduce_ == dtype::f32 || !F::syncs) return;
    const mesh_coords first{};
    const std::vector<plan> theirs =
        coords_ == first
            ? plans
            : sync_plans_of(policy_, schedule_, layout_, shape_, first, inner_state_buffers_,
                            held_of(fed, layout_, shape_, first), 0, overlap_, left_out_, reduce_);
    for (const plan& p : theirs)
      for (const comm_op& op : p.ops)
        if (op.axis == axis::federation && op.dtype == reduce_) return;
    throw invalid_argument(fedshard::detail::concat(
        "fedshard: precision.sync = ", to_string(reduce_), ", but federation policy ", F::name,
        overlap_ ? " on groups of different shapes" : "",
        " averages nothing in it; expected f32 there (a narrow sync dtype applies to average, "
        "weighted_average, holder_average and the outer optimizers, on groups of one shape, "
        "without a codec)"));
  }

  /// A heterogeneous mesh's map, refused (on every rank alike) for a policy that cannot
  /// sync one.
  static std::shared_ptr<const overlap_map> checked_overlap(std::shared_ptr<const overlap_map> m) {
    if (m && F::syncs && !heterogeneous_groups_v<F>)
      throw invalid_argument(fedshard::detail::concat(
          "fedshard: federation policy ", F::name,
          " cannot sync groups of different shapes: "
          "expected groups of one shape, found group shapes ",
          to_string(m->groups),
          " (average, weighted_average and the outer optimizers, without a codec, sync them)"));
    return m;
  }

  static policy_type make_policy(const typename F::config& fed, std::vector<std::size_t> sizes,
                                 S& s) {
    if constexpr (std::is_constructible_v<policy_type, typename F::config, std::vector<std::size_t>,
                                          S&>)
      return policy_type(fed, std::move(sizes), s);
    else
      return policy_type(fed, std::move(sizes));
  }

  /// The units this rank's group holds (all unless the policy's config has owners).
  static std::vector<bool> held_of(const typename F::config& fed, const flat_layout& layout,
                                   const mesh_shape& shape, const mesh_coords& coords) {
    const shard::ownership owners = owners_of<F>(fed);
    owners.check(layout, shape.groups);
    return owners.everyone() ? std::vector<bool>{}
                             : owners.held_by(coords.group, layout.num_units());
  }

  /// The schedule's fragments of the layout, with their buffers.
  static std::vector<fragment> cut(S& s, const Sch& schedule, const flat_layout& layout,
                                   const mesh_shape& shape, const std::vector<bool>& held,
                                   const std::vector<bool>& left_out) {
    std::vector<fragment> out;
    for (auto& f : fragments_of(schedule, layout, shape.replicas, held, left_out)) {
      FEDSHARD_EXPECTS(left_out.empty() || !f.units.empty(), "synchronizer: fragment ", out.size(),
                       " has no unit left to sync: every one of its units is synced by "
                       "another stage (a local rule's synced_units); expected at least one");
      fragment fr;
      fr.slices = std::move(f.slices);
      fr.units = std::move(f.units);
      fr.buf = s.template allocate<float>(f.padded);
      fr.group_tokens.assign(static_cast<std::size_t>(shape.groups), 0.0);
      fr.tokens_buf = s.template allocate<double>(1);
      fr.group_tokens_buf = s.template allocate<double>(fr.group_tokens.size());
      out.push_back(std::move(fr));
    }
    return out;
  }
  static std::vector<std::size_t> sizes(const std::vector<fragment>& fragments) {
    std::vector<std::size_t> n;
    for (const auto& fr : fragments) n.push_back(fr.buf.size());
    return n;
  }

  int checked_fragment(int f) const { return static_cast<int>(checked(f)); }
  std::size_t checked(int f) const {
    FEDSHARD_EXPECTS(f >= 0 && f < fragments(), "synchronizer: fragment must be in [0, ",
                     fragments(), "), found ", f);
    return static_cast<std::size_t>(f);
  }
  fragment& at(int f) { return fragments_[checked(f)]; }
  const fragment& at(int f) const { return fragments_[checked(f)]; }

  /// The fragment's part of a master-shaped span into dst (zero padding), queued on the sync
  /// stream.
  void pack(const fragment& fr, std::span<const float> src, std::span<float> dst) {
    std::size_t at = 0;
    for (const auto& [off, len] : fr.slices) {
      space_->copy(sync_, cview(src.subspan(off, len)), view(dst.subspan(at, len)));
      at += len;
    }
    if (at < dst.size()) space_->fill(sync_, view(dst.subspan(at)), 0.0);
  }
  /// dst = (1 - alpha) dst + alpha src over the fragment's part of a master-shaped span
  /// (a copy for alpha = 1), queued on the sync stream.
  void unpack(const fragment& fr, std::span<const float> src, std::span<float> dst, float alpha) {
    std::size_t at = 0;
    for (const auto& [off, len] : fr.slices) {
      if (alpha == 1.0f)
        space_->copy(sync_, cview(src.subspan(at, len)), view(dst.subspan(off, len)));
      else
        space_->for_each(sync_, kernels::mix_update{alpha}, dst.subspan(off, len),
                         src.subspan(at, len));
      at += len;
    }
  }

  /// "fragment<f>.<name>": a policy buffer's name among the federation state.
  static std::string policy_key(const optim::state_tensor& t) {
    return fedshard::detail::concat("fragment", t.fragment, ".", t.name);
  }
  /// A policy buffer of fragment t.fragment, read and written through the host.
  void register_policy_buffer(state_registry& reg, const optim::state_tensor& t) {
    reg.add_elements(
        {.name = "federation." + policy_key(t),
         .family = "federation.fragment{f}." + t.name,
         .extent = state_extent::fragment,
         .fragment = t.fragment,
         .missing = t.missing,
         .same_in_every_group = t.same_in_every_group},
        t.data.size(), [this, d = t.data](std::span<float> h) { copy_out(d, h); },
        [this, d = t.data](std::span<const float> h) { copy_in(h, d); });
  }

  /// Fragment f's records: its stage (a resharding load starts idle: a sync in flight is not
  /// carried over), its counters (from the saver's fragment holding its first unit), the
  /// groups' tokens and the buffer of a sync in flight.
  void register_fragment(state_registry& reg, int f) {
    auto& fr = at(f);
    const std::string p = fedshard::detail::concat("fragment", f, "."), family = "fragment{f}.";
    reg.add({.name = p + "stage",
             .reshards = false,
             .element_size = sizeof(sync_stage),
             .bytes = [] { return sizeof(sync_stage); },
             .save = [&fr](std::span<std::byte> o) { std::memcpy(o.data(), &fr.stage, 1); },
             .check = [f](std::span<const std::byte> in) { check_stage(f, in); },
             .load =
                 [&fr](std::span<const std::byte> in) {
                   std::memcpy(&fr.stage, in.data(), sizeof fr.stage);
                   fr.start = {};
                   fr.finish = {};
                 }});
    if constexpr (capabilities<policy_type>::outer_steps)
      reg.add({.name = p + "outer_steps",
               .family = family + "outer_steps",
               .fragment = f,
               .element_size = sizeof(std::int64_t),
               .bytes = [] { return sizeof(std::int64_t); },
               .save =
                   [this, f](std::span<std::byte> o) {
                     const std::int64_t n = policy_.outer_steps(f);
                     std::memcpy(o.data(), &n, sizeof n);
                   },
               .load =
                   [this, f](std::span<const std::byte> in) {
                     std::int64_t n = 0;
                     std::memcpy(&n, in.data(), sizeof n);
                     policy_.set_outer_steps(f, n);
                   }});
    reg.add_value({.name = p + "tokens", .family = family + "tokens", .fragment = f}, &fr.tokens);
    register_vector(reg, {.name = p + "group_tokens", .reshards = false}, fr.group_tokens, false);
    register_vector(reg, {.name = p + "applied_at", .family = family + "applied_at", .fragment = f},
                    fr.applied_at, true);
    reg.add_elements(
        {.name = p + "buffer",
         .reshards = false,
         .present = [&fr] { return fr.stage != sync_stage::idle; }},
        fr.buf.size(), [this, &fr](std::span<float> h) { copy_out(fr.buf.span(), h); },
        [this, &fr](std::span<const float> h) { copy_in(h, fr.buf.span()); });
  }

  /// A record holding a host vector of trivially copyable values (of a size that may change
  /// with `grows`).
  template <class T>
  static void register_vector(state_registry& reg, state_entry e, std::vector<T>& v, bool grows) {
    e.variable_size = grows;
    e.element_size = sizeof(T);
    e.bytes = [&v] { return v.size() * sizeof(T); };
    e.save = [&v](std::span<std::byte> o) {
      if (!o.empty()) std::memcpy(o.data(), v.data(), o.size());
    };
    e.load = [&v, grows](std::span<const std::byte> in) {
      if (grows) v.resize(in.size() / sizeof(T));
      if (!in.empty()) std::memcpy(v.data(), in.data(), in.size());
    };
    reg.add(std::move(e));
  }

  /// A progress schedule's group tokens and seconds (the k-th sync's, which every group
  /// shares): a checkpoint without them is refused.
  void register_progress(state_registry& reg) {
    auto note = [](const std::map<std::string, std::string>& saved) {
      const auto it = saved.find("sync_schedule");
      return fedshard::detail::concat(
          "it was saved with the sync schedule '",
          it == saved.end() ? std::string("unknown") : it->second,
          "', which keeps no progress (tokens since the last sync, seconds since the "
          "start); a ",
          Sch::name, " run loads only checkpoints of token_budget or wall_clock runs");
    };
    reg.add_value(
        {.name = "schedule.group_tokens", .missing = state_start::refuse, .refuse_note = note},
        &progress_.tokens);
    reg.add({.name = "schedule.seconds",
             .missing = state_start::refuse,
             .element_size = sizeof(double),
             .refuse_note = note,
             .bytes = [] { return sizeof(double); },
             .save =
                 [this](std::span<std::byte> o) {
                   std::memcpy(o.data(), &progress_.seconds, sizeof(double));
                 },
             .load =
                 [this](std::span<const std::byte> in) {
                   double seconds = 0;
                   std::memcpy(&seconds, in.data(), sizeof seconds);
                   set_progress(progress_.tokens, seconds);
                 }});
  }

  static void check_stage(int f, std::span<const std::byte> in) {
    sync_stage stage{};
    std::memcpy(&stage, in.data(), sizeof stage);
    FEDSHARD_EXPECTS(stage == sync_stage::idle || stage == sync_stage::communicated,
                     "checkpoint: fragment ", f, " has an invalid sync stage ",
                     static_cast<int>(stage));
  }

  /// Copies between the space's memory and the host (after the sync stream's work).
  void copy_out(std::span<const float> from, std::span<float> host) {
    space_->to_host(sync_, cview(from), view(host));
    space_->synchronize(sync_);
  }
  void copy_in(std::span<const float> host, std::span<float> to) {
    space_->from_host(sync_, cview(host), view(to));
    space_->synchronize(sync_);
  }

  /// The participation stage's mask of fragment f's current sync, into included_.
  void refresh_included(int f) {
    if (hooks_.included)  // the round's own participants (sampled in begin_elastic_round)
      included_ = hooks_.included();
    else if (participation_.fraction < 1)  // the participation stage: this sync's sample
      included_ = sampled_mask(shape_.groups, {}, participation_, round(f));
    else if (screening_.on())  // every group, screened
      included_.assign(static_cast<std::size_t>(shape_.groups), 1);
    else
      included_.clear();
  }

  sync_info info(int f) {
    const auto& fr = at(f);
    refresh_included(f);
    return {.fragment = f,
            .groups = shape_.groups,
            .group = coords_.group,
            .group_tokens = fr.exchanges_tokens ? std::span<const double>(fr.group_tokens)
                                                : std::span<const double>(),
            .included = std::span<const std::uint8_t>(included_),
            .units = std::span<const packed_unit>(fr.units),
            .round = round(f),
            .shard = coords_.shard,
            .layout = &layout_};
  }

  /// Fragment f's syncs started before its current one (sync_context::round).
  std::int64_t round(int f) const { return static_cast<std::int64_t>(at(f).applied_at.size()); }

  auto binder(int f) {
    return [this, f](const comm_op& op, const operand& o) -> buffer_view {
      auto& fr = at(f);
      switch (o.role) {
        case role::fragment: return fr.buf.view();
        case role::moment: return fr.moments.at(static_cast<std::size_t>(o.index)).view();
        case role::tokens: return fr.tokens_buf.view();
        case role::group_tokens: return fr.group_tokens_buf.view();
        case role::gathered:  // a policy's std::span<float> of G copies of the fragment, if any
          if constexpr (capabilities<policy_type>::gathered_per_peer)  // or its buffer `index`
                                                                       // (gossip)
            return view(std::span<float>(policy_.gathered(f, o.index)));
          else if constexpr (capabilities<policy_type>::gathered)
            return view(std::span<float>(policy_.gathered(f)));
          break;
        default: break;
      }
      throw invalid_argument(
          fedshard::detail::concat("fedshard: the federation sync holds no buffer of role ",
                                   describe(o), " (", describe(op), ")"));
    };
  }

  /// The group's progress after `step`, agreed through progress_op (see the file comment).
  template <Communicator C>
  const schedule::sync_progress& agree_progress(interpreter<C, S>& interp, std::int64_t step,
                                                stream_type& compute) {
    if (!clock_started_) {  // a restored run: its clock goes on from the saved seconds
      start_time_ = std::chrono::steady_clock::now() -
                    std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                        std::chrono::duration<double>(progress_.seconds));
      clock_started_ = true;
    }
    const bool root = coords_.replica == 0 && coords_.shard == 0;  // rank 0 of the group axis
    // A schedule that reads the clock gets the time the step's work is done, not the time
    // the host queued it (the same on host spaces, where the work ran in order). Every rank
    // of the group waits, not only the root: the root's step completes only once its peers'
    // step collectives ran, and they wait for the root's clock at progress_op anyway.
    if constexpr (schedule::capabilities<Sch>::uses_clock) space_->synchronize(compute);
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start_time_;
    const double mine[2] = {static_cast<double>(step_tokens_), root ? elapsed.count() : 0.0};
    space_->from_host(sync_, const_buffer_view{mine, 2, dtype::f64}, progress_buf_.view());
    interp.wait(interp.fire(
        progress_plan_, {.trigger = trigger::on_demand, .phase = phase::sync},
        [this](const comm_op&, const operand&) { return progress_buf_.view(); }, sync_));
    double agreed[2] = {0, 0};
    space_->to_host(sync_, const_buffer_view(progress_buf_.view()),
                    view(std::span<double>(agreed)));
    space_->synchronize(sync_);
    step_tokens_ = 0;
    progress_.step = step;
    progress_.tokens += static_cast<std::int64_t>(agreed[0]);
    progress_.seconds = agreed[1];
    progress_.syncs = syncs_applied_;
    return progress_;
  }

  template <Communicator C>
  void start(interpreter<C, S>& interp, int f, std::int64_t step, std::span<float> master,
             stream_type& compute) {
    auto& fr = at(f);
    FEDSHARD_EXPECTS(fr.stage == sync_stage::idle, "synchronizer: fragment ", f,
                     " starts a sync while its previous one is still in flight (step ", step, ")");
    if constexpr (plan_per_round_v<F>) {  // this sync's plan (e.g. this round's gossip peers)
      fr.plan = policy_.sync_plan({.shape = shape_,
                                   .coords = coords_,
                                   .fragment = f,
                                   .numel = fr.buf.size(),
                                   .inner_state_buffers = inner_state_buffers_,
                                   .units = fr.units,
                                   .round = round(f),
                                   .overlap = overlap_,
                                   .layout = &layout_,
                                   .reduce = reduce_});
      fr.plan.check();
    }
    space_->wait(sync_, space_->record(compute));  // the master after the optimizer step
    if constexpr (capabilities<policy_type>::member_sets) {
      // The sub-communicators of the policy's member ops, made once (collective over the
      // federation axis: every rank's first sync start lists the same sets).
      if (!members_split_) interp.split_members(axis::federation, policy_.member_sets(shape_));
      members_split_ = true;
    }
    if (!overlap_sets_.empty()) {  // a heterogeneous mesh's holder sets, made once
      interp.split_members(axis::federation, overlap_sets_);
      overlap_sets_.clear();
    }
    // The groups this sync combines, from its first op (the weights' gather) on.
    refresh_included(f);
    interp.set_included(axis::federation, included_);
    set_screen(interp);
    if (fr.exchanges_tokens) {  // the weights, on the host for the policy's begin()
      const double mine = static_cast<double>(fr.tokens);
      space_->from_host(sync_, const_buffer_view{&mine, 1, dtype::f64}, fr.tokens_buf.view());
      interp.wait(interp.fire(fr.plan, point(trigger::sync_prepare, f), binder(f), sync_));
      space_->to_host(sync_, const_buffer_view(fr.group_tokens_buf.view()),
                      view(std::span<double>(fr.group_tokens)));
      space_->synchronize(sync_);
    } else {
      interp.join(interp.fire(fr.plan, point(trigger::sync_prepare, f), binder(f), sync_), sync_);
    }
    fr.tokens = 0;
    pack(fr, master, fr.buf.span());
    // The compute stream writes the master again (the next optimizer step) only once the
    // snapshot has read it; it does not wait for the averaging, which stays in flight.
    space_->wait(compute, space_->record(sync_));
    policy_.begin(f, fr.buf.span(), info(f), sync_);
    fr.start = interp.fire(fr.plan, point(trigger::sync_exchange, f), binder(f), sync_);
    fr.stage = sync_stage::in_flight;
  }

  /// Installs the screening stage (federation/participation.hpp) on the federation axis.
  template <Communicator C>
  void set_screen(interpreter<C, S>& interp) {
    if (!screening_.on() && !hooks_.included) {
      interp.set_screen(axis::federation, {});
      return;
    }
    FEDSHARD_EXPECTS(!screening_.on() || hooks_.agree || shape_.replicas * shape_.shards == 1,
                     "synchronizer: screening (reject_nonfinite, clip_ratio) gives one verdict "
                     "per group through the federation axis's agreement (an elastic link); "
                     "without one it needs groups of one rank, found ",
                     shape_.replicas, " x ", shape_.shards, " (turn it off: screening::off())");
    interp.set_screen(axis::federation,
                      [this](const gathered_inputs& in, std::vector<std::uint8_t>& included) {
                        screen(in, included, screening_, hooks_);
                      });
  }

  /// Finishes the averaging in flight inside the group (sync_finish), queued on the sync
  /// stream.
  template <Communicator C>
  void communicate(interpreter<C, S>& interp, int f) {
    auto& fr = at(f);
    interp.join(fr.start, sync_);
    fr.finish = interp.fire(fr.plan, point(trigger::sync_finish, f), binder(f), sync_);
    interp.join(fr.finish, sync_);
    fr.stage = sync_stage::communicated;
  }

  template <Communicator C>
  void apply(interpreter<C, S>& interp, int f, std::int64_t step, std::span<float> master,
             const std::vector<optim::state_tensor>& inner, stream_type& compute) {
    auto& fr = at(f);
    FEDSHARD_EXPECTS(fr.stage != sync_stage::idle, "synchronizer: fragment ", f,
                     " applies a sync that was never started (step ", step, ")");
    if (fr.stage == sync_stage::in_flight) communicate(interp, f);
    space_->wait(sync_, space_->record(compute));  // the master and inner state it updates
    policy_.end(f, fr.buf.span(), info(f), sync_);
    applied_.included = included_;
    applied_.group_tokens.clear();
    if (fr.exchanges_tokens) applied_.group_tokens = fr.group_tokens;
    unpack(fr, fr.buf.span(), master, schedule_.mixing());
    for (std::size_t k = 0; k < fr.moments.size(); ++k)
      pack(fr, inner.at(k).data, fr.moments[k].span());
    interp.join(interp.fire(fr.plan, point(trigger::sync_after, f), binder(f), sync_), sync_);
    for (std::size_t k = 0; k < fr.moments.size(); ++k)
      unpack(fr, fr.moments[k].span(), inner.at(k).data, 1.0f);
    space_->wait(compute, space_->record(sync_));
    fr.stage = sync_stage::idle;
    fr.applied_at.push_back(step);
    ++syncs_applied_;
  }

  static trigger_point point(trigger t, int f) {
    return {.trigger = t, .phase = phase::sync, .fragment = f};
  }

  space::space_ref<S> space_;  // first: the buffers below go back to it
  stream_type sync_;
  Sch schedule_;
  mesh_shape shape_;
  mesh_coords coords_;
  flat_layout layout_;  // the model's (sync_context::layout, sync_info::layout)
  std::shared_ptr<const overlap_map> overlap_;  // heterogeneous meshes only
  std::vector<bool> left_out_;                  // units another stage syncs, by unit
  std::vector<fragment> fragments_;
  policy_type policy_;
  int inner_state_buffers_ = 0;
  dtype reduce_ = dtype::f32;  // the averages' dtype (shard::precision::sync)
  std::int64_t syncs_applied_ = 0;
  round_hooks hooks_;  // a federation axis with rounds (set_round_hooks)
  participation participation_{};
  screening screening_ = screening::off();
  std::vector<std::uint8_t> included_;
  applied_sync applied_;                     // the latest applied sync's groups and weights
  bool members_split_ = false;               // split_members ran for the policy's member_sets
  std::vector<std::uint64_t> overlap_sets_;  // holder sets still to split (overlap.hpp)
  // A progress schedule's agreement (by_progress only).
  plan progress_plan_;
  typename S::template buffer<double> progress_buf_;  // role value of progress_op
  std::int64_t step_tokens_ = 0;                      // this rank's tokens of the current step
  schedule::sync_progress progress_;                  // the group's, as agreed
  std::chrono::steady_clock::time_point start_time_;  // the run's start on this rank
  bool clock_started_ = false;
};

}  // namespace fedshard::federation
