#pragma once
/// Prices training before it runs: the plans the trainer executes, placed on a modelled
/// cluster, give the step time, split into compute and exposed communication per axis, the
/// tokens per second per GPU and the bytes per axis.
///
/// What is priced is what the trainer runs, for any Algorithm type and its run-time settings
/// (describe<A>), or for a named alias (algorithm_by_name, over fedshard::for_each_algorithm):
///  - every inner step: the ShardPolicy's step_plan(layout, shape, precision);
///  - at the sync points: each fragment's sync plan for each rank, from
///    federation::sync_plans_of (the FederationPolicy's sync_plan over the schedule's
///    fragments), with the cadence read from the SyncSchedule object itself: its action() over
///    a window of steps (cadence_of) says how often each fragment starts and applies a sync,
///    and how many steps each started sync stays in flight before it is applied (τ).
///
/// The time model, for each rank, with C the compute seconds of one step:
///  - every comm_op is priced by price_collective on the communicator of its axis (a
///    point-to-point op, send_recv, send or recv, on the links between the pair it joins:
///    detail::op_span; a plan
///    that changes every sync, gossip's, is priced at its first round), the
///    communicators of every rank that runs the same op at the same time sharing NICs;
///  - step ops: those the plan marks overlappable (FSDP's gathers and reduce_scatters, HSDP's
///    replica all_reduce), O seconds in all, run behind compute and only what exceeds C is
///    exposed; the others are exposed;
///  - sync ops: the ops of the triggers sync_prepare, sync_finish and sync_after block training
///    and are exposed. The sync_exchange ops (the averaging) of a sync that stays in flight τ > 0
///    steps run on the one communication channel while those τ inner steps compute, in the
///    compute time the steps' own overlappable ops leave free (slack = max(0, C - O) per
///    step): of their S seconds, min(S, τ x slack) are hidden and the rest exposed when the
///    sync is applied. With τ = 0 (start_and_apply: periodic, every_step) they are exposed.
///    Syncs of different fragments are not in flight at the same time (streaming's τ <
///    floor(H/P) guarantees it), so each has its own τ steps of slack;
///  - the exposed sync seconds of the window's syncs, divided by the window's steps, are added
///    to each step (a sync every K steps adds sync / K);
///  - step = max(C, O) + exposed step ops + exposed sync seconds per step; the job's step is
///    the slowest rank's (collectives wait for every member);
///  - stragglers (price_options::stragglers, straggler.hpp; off by default): with per-rank
///    compute of coefficient of variation cv, C above becomes C (1 + cv e(n_step)), n_step the
///    ranks the step plan's ops join, and each step pays C cv s(n_step) e(G_sync) / sqrt(k)
///    more, G_sync the components of n_step ranks the sync plans join and k the mean steps
///    between two syncs (1 / the cadence's starts per step, at least 1). step_price reports
///    both in straggler_wait.
/// Bytes per axis are the plans' per-rank wire bytes (bus factor x array bytes), so they equal
/// what the wire tap records for the same plans; run_traffic gives what a run of n steps
/// moves, step by step as the trainer fires the plans (final-step syncs included).
///
/// A local rule (algorithm_options::local, algorithm_settings::local; sim/local_rule.hpp, off
/// by default) changes the plans and the compute: zeroth-order units lose their backward ops
/// and add 2P forward passes with their ops and loss means per step, and at a sync their
/// records replace their parameters; a soup adds its passes and its distance sum. Its ops
/// count as the step's (bytes and calls); its overlappable ones hide behind the evaluations'
/// compute, the rest is exposed; its compute (local_price) is added to the step's, so
/// step = compute + straggler_wait + exposed_comm() still holds. local_memory_of states the
/// memory it adds per rank.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "fedshard/codec/cast.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/error.hpp"
#include "fedshard/federation/federation_policy.hpp"
#include "fedshard/federation/sync.hpp"
#include "fedshard/federation/with_codec.hpp"
#include "fedshard/mesh/axis.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/plan/traffic.hpp"
#include "fedshard/schedule/sync_schedule.hpp"
#include "fedshard/shard/flat_layout.hpp"
#include "fedshard/shard/ownership.hpp"
#include "fedshard/shard/shard_policy.hpp"
#include "fedshard/shard/sparse.hpp"
#include "fedshard/sim/collective_cost.hpp"
#include "fedshard/sim/compute.hpp"
#include "fedshard/sim/local_rule.hpp"
#include "fedshard/sim/model_layout.hpp"
#include "fedshard/sim/straggler.hpp"
#include "fedshard/sim/timeline.hpp"
#include "fedshard/sim/topology.hpp"
#include "fedshard/trainer/algorithm.hpp"

namespace fedshard::sim {

/// The longest window cadence_of scans (steps): a schedule whose pattern is longer (K in the
/// hundreds of millions) is refused rather than scanned for seconds.
inline constexpr std::int64_t max_cadence_window = std::int64_t{1} << 26;

/// The steps cadence_of scans for a schedule whose config has no `period` (every_step,
/// post_local, custom schedules), unless told otherwise.
inline constexpr std::int64_t default_cadence_window = 1000;

/// How one fragment syncs over a cadence window.
struct fragment_cadence {
  std::int64_t starts = 0;   ///< syncs started in the window
  std::int64_t applies = 0;  ///< syncs applied in the window
  /// For each start, the steps until its apply (0 for start_and_apply; τ for streaming).
  std::vector<std::int64_t> in_flight;
};

/// How often a schedule syncs each fragment: its action() over the first `window` steps of a
/// run of unknown length (so without the final-step sync), i.e. the steady state when the
/// window is a whole number of the schedule's periods.
struct sync_cadence {
  std::int64_t window = 1;                  ///< steps scanned
  std::vector<fragment_cadence> fragments;  ///< by fragment

  /// Syncs started per step, all fragments together.
  double starts_per_step() const noexcept {
    std::int64_t s = 0;
    for (const auto& f : fragments) s += f.starts;
    return static_cast<double>(s) / static_cast<double>(window);
  }
  /// Mean steps between two syncs of a fragment (periodic's K, streaming's H); infinity when
  /// nothing syncs in the window.
  double period() const noexcept {
    const double rate = starts_per_step();
    return rate > 0 ? static_cast<double>(fragments.size()) / rate
                    : std::numeric_limits<double>::infinity();
  }
  /// Mean steps a started sync stays in flight before it is applied (streaming's τ).
  double mean_in_flight() const noexcept {
    std::int64_t n = 0, sum = 0;
    for (const auto& f : fragments)
      for (std::int64_t t : f.in_flight) sum += t, ++n;
    return n > 0 ? static_cast<double>(sum) / static_cast<double>(n) : 0.0;
  }
};

/// The cadence of schedule s over steps [0, window): for every fragment, its starts and
/// applies, and each start's steps in flight (a start near the window's end is followed past
/// it to its apply). invalid_argument for a window outside [1, max_cadence_window], or when a
/// started sync is not applied within the window's length after it.
template <schedule::SyncSchedule S>
sync_cadence cadence_of(const S& s, std::int64_t window) {
  FEDSHARD_EXPECTS(window >= 1 && window <= max_cadence_window, "sim::cadence_of: the ", S::name,
                   " schedule's cadence is read over a window of ", window,
                   " steps, which must be in [1, ", max_cadence_window,
                   "] (a period that long cannot be scanned; price a shorter one)");
  sync_cadence c;
  c.window = window;
  c.fragments.resize(static_cast<std::size_t>(s.fragments()));
  for (int f = 0; f < s.fragments(); ++f) {
    auto& fc = c.fragments[static_cast<std::size_t>(f)];
    std::optional<std::int64_t> started;
    for (std::int64_t step = 0; step < window || started; ++step) {
      FEDSHARD_EXPECTS(step < 2 * window, "sim::cadence_of: the ", S::name,
                       " schedule started a sync of fragment ", f, " after step ", *started,
                       " and did not apply it within ", window,
                       " steps (the cadence window); give a longer window");
      const auto a = s.action(f, step, 0);
      if (schedule::applies(a) && started) {
        fc.in_flight.push_back(step - *started);
        started.reset();
      }
      if (step >= window) continue;
      if (schedule::applies(a)) ++fc.applies;
      if (schedule::starts(a)) {
        ++fc.starts;
        if (a == schedule::sync_action::start_and_apply)
          fc.in_flight.push_back(0);
        else
          started = step;
      }
    }
  }
  return c;
}

/// Syncs applied in the cadence's window, every fragment's (a local rule's after_sync runs
/// after each; fragments are taken to apply at distinct steps, as streaming's do).
inline std::int64_t applies_in(const sync_cadence& c) {
  std::int64_t n = 0;
  for (const auto& f : c.fragments) n += f.applies;
  return n;
}

/// K of the zeroth-order records an applied sync exchanges (sim/local_rule.hpp): the steps
/// since the previous applied sync, window / applies_in rounded, at least 1; 0 when nothing
/// is applied in the window.
inline std::int64_t records_steps(const sync_cadence& c) {
  const std::int64_t n = applies_in(c);
  if (n == 0) return 0;
  return std::max<std::int64_t>(
      1, std::llround(static_cast<double>(c.window) / static_cast<double>(n)));
}

/// Run-time settings of Algorithm A for the simulator: those of trainer_options<A> that shape
/// the plans and their cadence, and the inner optimizer's state count (the trainer reads it
/// from its optimizer).
template <Algorithm A>
struct algorithm_options {
  /// The federation policy's settings (sync mode, outer optimizer, ...).
  typename A::federation_policy::config federation{};
  /// The schedule's settings (K, H, fragments, delay, mixing), from the algorithm's defaults.
  typename A::sync_schedule::config schedule = A::default_schedule();
  /// The shard policy's settings where its step plan reads them (with_gather_codec's codec
  /// settings; shard::sparse's are priced by price_sparse's own).
  shard::settings_of_t<typename A::shard_policy> shard{};
  /// The inner optimizer's state buffers (2 for AdamW), for plans that average them.
  int inner_state_buffers = 2;
  /// Steps the cadence is read over; 0: the schedule config's `period` when it has one (the
  /// built-in schedules repeat with it), else default_cadence_window.
  std::int64_t cadence_window = 0;
  /// The local rule the groups train with (sim/local_rule.hpp); none by default.
  local_rule_desc local{};
  /// The dtype the federation's averages travel and combine in (shard::precision::sync, the
  /// trainer's setting): f32 (master weights), bf16 or f16 (half the bytes, summed in f32).
  /// A narrow dtype is refused where the federation policy averages nothing in it (codecs,
  /// robust means, gossip), as the trainer refuses it.
  dtype sync_dtype = dtype::f32;
};

namespace detail {

/// The message of a fedshard error without its "fedshard: " prefix.
inline std::string message_of(const std::exception& e) {
  std::string m = e.what();
  constexpr std::string_view prefix = "fedshard: ";
  if (m.compare(0, prefix.size(), prefix) == 0) m.erase(0, prefix.size());
  return m;
}

/// True for the sync ops that run when a sync starts (sync_prepare, sync_exchange); the others run
/// when it is applied (sync_finish, sync_after).
inline bool at_sync_start(const comm_op& op) {
  return op.trigger == trigger::sync_prepare || op.trigger == trigger::sync_exchange;
}

/// True for shard::sparse<Base> (SCAPE), whose steps run different plans by its settings.
template <class P>
inline constexpr bool is_sparse_policy_v = false;
template <class B>
inline constexpr bool is_sparse_policy_v<shard::sparse<B>> = true;

/// What algorithm_desc asks of the algorithm it describes.
class algorithm_model {
 public:
  virtual ~algorithm_model() = default;
  virtual std::string_view shard_policy() const noexcept = 0;
  virtual std::string_view federation_policy() const noexcept = 0;
  virtual std::string_view sync_schedule() const noexcept = 0;
  virtual bool syncs() const noexcept = 0;
  virtual int fragments() const noexcept = 0;
  virtual const sync_cadence& cadence() const noexcept = 0;
  virtual const local_rule_desc& local() const noexcept = 0;
  virtual flat_layout layout(const std::string& name, std::vector<unit_spec> units,
                             const mesh_shape& shape) const = 0;
  virtual plan step_plan(const flat_layout& layout, const mesh_shape& shape,
                         const shard::precision& prec) const = 0;
  virtual std::vector<plan> sync_plans(const flat_layout& layout, const mesh_shape& shape,
                                       const mesh_coords& coords, std::int64_t round) const = 0;
  virtual bool plan_per_round() const noexcept = 0;
  virtual bool steps_vary() const noexcept = 0;
  virtual schedule::sync_action action(int fragment, std::int64_t step,
                                       std::int64_t total_steps) const = 0;
};

/// algorithm_model of Algorithm A with its settings.
template <Algorithm A>
class algorithm_model_of final : public algorithm_model {
  using shard_type = typename A::shard_policy;
  using federation_type = typename A::federation_policy;
  using schedule_type = typename A::sync_schedule;

 public:
  explicit algorithm_model_of(const algorithm_options<A>& o)
      : schedule_(o.schedule),
        shard_(o.shard),
        policy_(o.federation, {}),
        owners_(federation::owners_of<federation_type>(o.federation)),
        inner_state_buffers_(o.inner_state_buffers),
        cadence_(cadence_of(schedule_, window(o))),
        local_(o.local),
        sync_dtype_(o.sync_dtype) {
    FEDSHARD_EXPECTS(
        sync_dtype_ == dtype::f32 || sync_dtype_ == dtype::bf16 || sync_dtype_ == dtype::f16,
        "the sync dtype must be f32, bf16 or f16, found ", to_string(sync_dtype_));
    FEDSHARD_EXPECTS(sync_dtype_ == dtype::f32 || federation_type::syncs, "a ",
                     to_string(sync_dtype_), " sync needs an algorithm that federates, but ",
                     federation_type::name, " never syncs");
  }

  std::string_view shard_policy() const noexcept override { return shard_type::name; }
  std::string_view federation_policy() const noexcept override { return federation_type::name; }
  std::string_view sync_schedule() const noexcept override { return schedule_type::name; }
  bool syncs() const noexcept override { return federation_type::syncs; }
  int fragments() const noexcept override { return schedule_.fragments(); }
  const sync_cadence& cadence() const noexcept override { return cadence_; }
  const local_rule_desc& local() const noexcept override { return local_; }

  flat_layout layout(const std::string& name, std::vector<unit_spec> units,
                     const mesh_shape& shape) const override {
    try {
      shard_type::check(shape);
    } catch (const invalid_argument& e) {
      throw invalid_argument(fedshard::detail::concat(
          "fedshard: sim: ", name, " cannot run on mesh ", to_string(shape), ": ", message_of(e)));
    }
    return flat_layout(std::move(units), shard_type::layout_shards(shape));
  }
  plan step_plan(const flat_layout& layout, const mesh_shape& shape,
                 const shard::precision& prec) const override {
    prec.check();
    return shard::step_plan_of<shard_type>(layout, shape, prec, shard_);
  }
  std::vector<plan> sync_plans(const flat_layout& layout, const mesh_shape& shape,
                               const mesh_coords& coords, std::int64_t round) const override {
    // Ownership (holder_average): each group's sync plans pack the units it holds only, and
    // a member op is priced on the span of its holders (detail::member_span). The step plan
    // is still priced for every unit: an upper bound for a group that holds fewer.
    owners_.check(layout, shape.groups);
    std::vector<bool> held = owners_.everyone() ? std::vector<bool>{}
                                                : owners_.held_by(coords.group, layout.num_units());
    const bool seeds = local_.zeroth_order_on() && local_.zeroth_order.seeds_on_wire;
    if (!seeds)
      return checked_narrow(plans_for(layout, shape, coords, held, round), layout, shape, coords);
    // Seeds on the wire: the zeroth-order units leave the parameter sync (planned as if the
    // group did not hold them) and every applied sync gathers the groups' records after it.
    const std::vector<bool> zo = zeroth_order_mask(layout, local_);
    check_units_left(layout, zo);
    if (held.empty()) held.assign(layout.num_units(), true);
    for (std::size_t u = 0; u < held.size(); ++u) held[u] = held[u] && !zo[u];
    std::vector<plan> out =
        checked_narrow(plans_for(layout, shape, coords, held, round), layout, shape, coords);
    const std::int64_t k = records_steps(cadence_);
    if (k > 0)
      for (plan& frag : out)
        for (const comm_op& op : zo_records_ops(shape, coords, k, local_.zeroth_order.probes).ops)
          frag.ops.push_back(op);
    return out;
  }
  std::vector<plan> plans_for(const flat_layout& layout, const mesh_shape& shape,
                              const mesh_coords& coords, const std::vector<bool>& held,
                              std::int64_t round) const {
    return federation::sync_plans_of(policy_, schedule_, layout, shape, coords,
                                     inner_state_buffers_, held, round, nullptr, {}, sync_dtype_);
  }
  /// `plans`, or invalid_argument when the sync dtype is narrow and the policy averages
  /// nothing in it: decided, as the trainer's synchronizer decides, from the plans of world
  /// rank 0's coordinates (a replica that only receives the average has no federation op);
  /// `plans` themselves when `coords` are rank 0's.
  std::vector<plan> checked_narrow(std::vector<plan> plans, const flat_layout& layout,
                                   const mesh_shape& shape, const mesh_coords& coords) const {
    if (sync_dtype_ == dtype::f32) return plans;
    const mesh_coords first{};
    const std::vector<bool> held =
        owners_.everyone() ? std::vector<bool>{} : owners_.held_by(0, layout.num_units());
    const std::vector<plan> theirs =
        coords == first ? std::vector<plan>{} : plans_for(layout, shape, first, held, 0);
    for (const plan& p : coords == first ? plans : theirs)
      for (const comm_op& op : p.ops)
        if (op.axis == axis::federation && op.dtype == sync_dtype_) return plans;
    throw invalid_argument(fedshard::detail::concat(
        "fedshard: sync dtype ", to_string(sync_dtype_), ", but federation policy ",
        federation_type::name,
        " averages nothing in it; expected f32 there (a narrow sync dtype applies to average, "
        "weighted_average, holder_average and the outer optimizers, without a codec)"));
  }
  /// invalid_argument when a fragment of the schedule holds zeroth-order units only (the
  /// synchronizer refuses a fragment with no unit left to sync).
  void check_units_left(const flat_layout& layout, const std::vector<bool>& zo) const {
    const int units = static_cast<int>(layout.num_units());
    for (int f = 0; f < schedule_.fragments(); ++f) {
      bool left = false;
      for (int u : schedule_.fragment_units(f, units))
        left = left || !zo[static_cast<std::size_t>(u)];
      FEDSHARD_EXPECTS(left, "sim: fragment ", f, " of the ", schedule_type::name,
                       " schedule holds zeroth-order units only: with seeds on the wire no "
                       "unit is left for the federation policy to sync (the synchronizer "
                       "refuses it); expected at least one unit that is not zeroth-order");
    }
  }
  bool plan_per_round() const noexcept override {
    return federation::plan_per_round_v<federation_type>;
  }
  bool steps_vary() const noexcept override { return is_sparse_policy_v<shard_type>; }
  schedule::sync_action action(int fragment, std::int64_t step,
                               std::int64_t total_steps) const override {
    return schedule_.action(fragment, step, total_steps);
  }

 private:
  static std::int64_t window(const algorithm_options<A>& o) {
    FEDSHARD_EXPECTS(o.cadence_window >= 0,
                     "sim: cadence_window must be >= 0 (0: automatic), found ", o.cadence_window);
    if (o.cadence_window > 0) return o.cadence_window;
    if constexpr (schedule::capabilities<schedule_type>::period)
      return static_cast<std::int64_t>(o.schedule.period);
    else
      return default_cadence_window;
  }

  schedule_type schedule_;
  shard::settings_of_t<shard_type> shard_;
  federation_type policy_;
  shard::ownership owners_;
  int inner_state_buffers_;
  sync_cadence cadence_;
  local_rule_desc local_;
  dtype sync_dtype_;
};

}  // namespace detail

/// True when Algorithm A's steps run different plans by its run-time settings (shard::sparse,
/// SCAPE): one step's price says nothing of a run, so the simulator prices a run of it
/// (sim::price_sparse; sim::price_named takes the path from the catalogue entry's type).
template <Algorithm A>
inline constexpr bool steps_vary_v = detail::is_sparse_policy_v<typename A::shard_policy>;

/// What the simulator prices: an algorithm with its run-time settings, type-erased, so that
/// algorithms chosen at run time and custom algorithm<...> types are priced alike. Built by
/// describe<A> or algorithm_by_name; cheap to copy (the settings are shared).
class algorithm_desc {
 public:
  /// An empty description (every query but name() throws); build one with describe<A>.
  algorithm_desc() = default;
  /// The algorithm `model` describes, reported as `name` (describe<A> builds the model).
  algorithm_desc(std::string name, std::shared_ptr<const detail::algorithm_model> model)
      : name_(std::move(name)), model_(std::move(model)) {}

  /// The name it is reported under.
  const std::string& name() const noexcept { return name_; }
  /// The ShardPolicy's name (shard::hybrid_shard::name, ...).
  std::string_view shard_policy() const { return model().shard_policy(); }
  /// The FederationPolicy's name.
  std::string_view federation_policy() const { return model().federation_policy(); }
  /// The SyncSchedule's name.
  std::string_view sync_schedule() const { return model().sync_schedule(); }
  /// True when the federation policy communicates (it runs its sync plans).
  bool syncs() const { return model().syncs(); }
  /// P, the schedule's fragments.
  int fragments() const { return model().fragments(); }
  /// The schedule's cadence (cadence_of over the settings' window).
  const sync_cadence& cadence() const { return model().cadence(); }

  /// The flat layout the trainer builds for these units on this mesh; invalid_argument naming
  /// the algorithm and the mesh when its shard policy refuses the mesh.
  flat_layout layout(std::vector<unit_spec> units, const mesh_shape& shape) const {
    return model().layout(name_, std::move(units), shape);
  }
  /// The local rule its groups train with (sim/local_rule.hpp).
  const local_rule_desc& local() const { return model().local(); }
  /// The comm_ops of one inner step (the same on every rank): the shard policy's, without
  /// the zeroth-order units' backward gathers and gradient reductions (local()).
  plan step_plan(const flat_layout& layout, const mesh_shape& shape,
                 const shard::precision& prec) const {
    plan p = model().step_plan(layout, shape, prec);
    if (!local().zeroth_order_on()) return p;
    return without_backward_of(std::move(p), zeroth_order_mask(layout, local()));
  }
  /// The shard policy's step plan as it is, every unit with its backward.
  plan plain_step_plan(const flat_layout& layout, const mesh_shape& shape,
                       const shard::precision& prec) const {
    return model().step_plan(layout, shape, prec);
  }
  /// The ops the local rule runs in a step beyond step_plan (local_step_ops), at local step
  /// `round_step` of its round when given (>= 0), else a full soup's.
  plan local_step_plan(const flat_layout& layout, const mesh_shape& shape,
                       const shard::precision& prec, std::int64_t round_step = -1) const {
    if (!local().active()) return {};
    return local_step_ops(step_plan(layout, shape, prec), shape, static_cast<int>(layout.shards()),
                          local(), round_step);
  }
  /// The ops world rank `rank` runs after an applied sync to exchange the groups' zeroth-order
  /// records of k steps (zo_records_ops; sync_plans appends them, with the cadence's k, to
  /// each fragment's plan); empty without seeds on the wire, a federation that syncs, or k.
  plan records_plan(const mesh_shape& shape, int rank, std::int64_t k) const {
    const local_rule_desc& r = local();
    if (!syncs() || !r.zeroth_order_on() || !r.zeroth_order.seeds_on_wire || k <= 0) return {};
    return zo_records_ops(shape, coords_of(shape, rank), k, r.zeroth_order.probes);
  }
  /// The sync plan of each fragment for world rank `rank` (federation::sync_plans_of: what
  /// the trainer's synchronizer runs) at the fragments' sync number `round` (gossip's peers
  /// change with it: plan_per_round); empty plans when the federation never communicates.
  std::vector<plan> sync_plans(const flat_layout& layout, const mesh_shape& shape, int rank,
                               std::int64_t round = 0) const {
    return model().sync_plans(layout, shape, coords_of(shape, rank), round);
  }
  /// True when the sync plans change from one sync to the next (federation::plan_per_round_v).
  bool plan_per_round() const { return model().plan_per_round(); }
  /// True when the steps run different plans by the settings (steps_vary_v): step_plan is then
  /// the base policy's dense step, and price_plans, price and run_traffic refuse it.
  bool steps_vary() const { return model().steps_vary(); }
  /// The schedule's action for a fragment after `step` of a run of `total_steps` steps.
  schedule::sync_action action(int fragment, std::int64_t step, std::int64_t total_steps) const {
    return model().action(fragment, step, total_steps);
  }

 private:
  const detail::algorithm_model& model() const {
    FEDSHARD_EXPECTS(model_ != nullptr, "sim: algorithm '", name_,
                     "' is an empty description (build it with sim::describe or "
                     "sim::algorithm_by_name)");
    return *model_;
  }

  std::string name_;
  std::shared_ptr<const detail::algorithm_model> model_;
};

/// The description of Algorithm A (any algorithm<Shard, Federation, Schedule[, Defaults]>)
/// named `name` with settings o. invalid_argument when the settings cannot work (the
/// schedule's own checks, e.g. K < 1 or τ >= floor(H/P)), or when the schedule's cadence
/// cannot be read (see cadence_of).
template <Algorithm A>
algorithm_desc describe(std::string name, const algorithm_options<A>& o = {}) {
  FEDSHARD_EXPECTS(o.inner_state_buffers >= 0, "sim::describe: ", name,
                   ": inner_state_buffers must be >= 0, found ", o.inner_state_buffers);
  try {
    o.local.check();
    return {name, std::make_shared<const detail::algorithm_model_of<A>>(o)};
  } catch (const invalid_argument& e) {
    throw invalid_argument(
        fedshard::detail::concat("fedshard: sim: ", name, ": ", detail::message_of(e)));
  }
}

/// Settings of an algorithm chosen by name at run time (fedshard-sim's --K, --fragments,
/// ...). Each one that is given replaces the schedule setting of the same name; unset ones
/// keep the algorithm's defaults (fl_fsdp's K = 8, diloco's H = 500, ...).
struct algorithm_settings {
  /// K (periodic) or H (streaming); ignored by a schedule without a period (every_step:
  /// a sync after every step, or nothing to sync).
  std::optional<int> period{};
  std::optional<int> fragments{};  ///< P (streaming); refused by a schedule without fragments
  std::optional<int> delay{};      ///< τ (streaming); refused by a schedule without a delay
  std::optional<float> alpha{};    ///< α (streaming); refused by a schedule without mixing
  federation::sync_mode sync = federation::sync_mode::hierarchical;  ///< how R > 1 syncs
  int inner_state_buffers = 2;  ///< the inner optimizer's state buffers (2 for AdamW)
  /// The dtype the cross-group average travels and combines in (algorithm_options::sync_dtype,
  /// the trainer's precision.sync): f32 master weights, or bf16/f16 all-reduced at half the
  /// bytes and summed in f32. Refused for an algorithm that does not federate, or whose
  /// federation averages nothing in it (a codec, a robust mean, gossip).
  dtype sync_dtype = dtype::f32;
  /// The local rule its groups train with (zeroth-order units, a soup); none: the alias's
  /// own (catalogue_local_rule: hofl's and lss's), if it has one.
  local_rule_desc local{};
};

/// The local rule the catalogue's alias `name` trains with by default, as the simulator
/// describes it (trainer/algorithm.hpp's Defaults::local_rule(), whose numbers these are):
/// hofl, the model's two lowest units zeroth-order with one probe, their records sent as
/// seeds (hofl_defaults: zeroth_order_lower_rule({.probes = 1}, 2), zo_sync::records); lss,
/// a soup of 3 members with both regularisers on, member 0 alone 4 local steps, the next
/// every 2 (lss_defaults: local_soup_rule({.pool_size = 3, .first_steps = 4, .add_every =
/// 2}), soup_config's coefficients 1e-3). None for the other aliases.
inline local_rule_desc catalogue_local_rule(std::string_view name) {
  if (name == "hofl") return {.zeroth_order = {.lower = 2, .probes = 1, .seeds_on_wire = true}};
  if (name == "lss")
    return {.soup = {.members = 3, .diversity = true, .first_steps = 4, .add_every = 2}};
  return {};
}

/// A's options with the settings s applied (see algorithm_settings); invalid_argument naming
/// the setting when A's schedule has no such setting, or when K < 1.
template <Algorithm A>
algorithm_options<A> options_for(std::string_view name, const algorithm_settings& s) {
  using schedule_type = typename A::sync_schedule;
  algorithm_options<A> o;
  o.federation.sync = s.sync;
  o.inner_state_buffers = s.inner_state_buffers;
  o.local = s.local.active() ? s.local : catalogue_local_rule(name);
  auto& c = o.schedule;
  if (s.period) {
    FEDSHARD_EXPECTS(*s.period >= 1, "sim: ", name,
                     ": K (period, the steps between syncs) must be >= 1, found ", *s.period);
    if constexpr (schedule::capabilities<schedule_type>::period) c.period = *s.period;
  }
  auto refuse = [&](std::string_view setting) {
    throw invalid_argument(fedshard::detail::concat(
        "fedshard: sim: ", name, ": its schedule '", schedule_type::name, "' has no '", setting,
        "' setting (fragments, delay and alpha are settings of schedule::streaming)"));
  };
  if (s.fragments) {
    if constexpr (schedule::capabilities<schedule_type>::fragments)
      c.fragments = *s.fragments;
    else
      refuse("fragments");
  }
  if (s.delay) {
    if constexpr (schedule::capabilities<schedule_type>::delay)
      c.delay = *s.delay;
    else
      refuse("delay");
  }
  if (s.alpha) {
    if constexpr (schedule::capabilities<schedule_type>::alpha)
      c.alpha = *s.alpha;
    else
      refuse("alpha");
  }
  return o;
}

/// The names algorithm_by_name accepts: fedshard::for_each_algorithm's aliases, in its order.
inline std::vector<std::string> algorithm_names() {
  std::vector<std::string> names;
  for_each_algorithm([&]<class A>(std::string_view n) { names.emplace_back(n); });
  return names;
}

/// A with its federation policy's cross-group average sent through Codec
/// (federation::with_codec), the same shard policy and schedule.
template <Algorithm A, codec::Codec Codec>
using with_sync_codec = algorithm<typename A::shard_policy,
                                  federation::with_codec<typename A::federation_policy, Codec>,
                                  typename A::sync_schedule>;

namespace detail {

/// describe<A> named n with settings s.
template <Algorithm A>
algorithm_desc describe_named(std::string_view n, const algorithm_settings& s) {
  algorithm_options<A> o = options_for<A>(n, s);
  o.sync_dtype = s.sync_dtype;
  return describe<A>(std::string(n), o);
}

}  // namespace detail

/// The alias called `name` (one of algorithm_names()) with settings s; invalid_argument
/// listing the known names for an unknown one, and naming the setting for bad settings.
inline algorithm_desc algorithm_by_name(std::string_view name, const algorithm_settings& s = {}) {
  std::optional<algorithm_desc> found;
  for_each_algorithm([&]<class A>(std::string_view n) {
    if (n == name) found = detail::describe_named<A>(n, s);
  });
  FEDSHARD_EXPECTS(found.has_value(), "sim: unknown algorithm '", name, "', expected one of ",
                   algorithm_list());
  return *found;
}

/// The flat layout the trainer builds for these units on this mesh under algorithm a.
inline flat_layout layout_of(const algorithm_desc& a, std::vector<unit_spec> units,
                             const mesh_shape& shape) {
  return a.layout(std::move(units), shape);
}

/// The comm_ops of one inner step (the same on every rank).
inline plan step_plan_of(const algorithm_desc& a, const flat_layout& layout,
                         const mesh_shape& shape, const shard::precision& prec) {
  return a.step_plan(layout, shape, prec);
}

/// The sync plan of each fragment for world rank `rank`, as the trainer's synchronizer holds
/// them (federation::sync_plans_of).
inline std::vector<plan> sync_plans_of(const algorithm_desc& a, const flat_layout& layout,
                                       const mesh_shape& shape, int rank) {
  return a.sync_plans(layout, shape, rank);
}

namespace detail {

/// invalid_argument when a's steps run different plans (algorithm_desc::steps_vary), which
/// `who` cannot price from one step plan.
inline void expect_one_step_plan(const algorithm_desc& a, std::string_view who) {
  FEDSHARD_EXPECTS(!a.steps_vary(), who, ": ", a.name(),
                   " runs different plans on different steps (shard::sparse around ",
                   a.shard_policy(),
                   "); price a run of it with sim::price_named (sim/run.hpp) or "
                   "sim::price_sparse");
}

}  // namespace detail

/// What world rank `rank` puts on the wire over `steps` steps of algorithm a, as the trainer
/// fires the plans in a run of `total_steps` planned steps (trainer_options::total_steps; 0 =
/// unknown, so no final-step sync): the step plan and the local rule's ops every step and, for each
/// fragment the schedule starts after a step (action(f, step, total_steps)), its sync_prepare and
/// sync_exchange ops, for each one it applies, its sync_finish and sync_after ops (nothing when
/// the federation never communicates). A local rule's ops follow its round (the steps since
/// the previous applied sync): a soup's distance sum by its members then, and after a step
/// that applies a sync the zeroth-order records of the steps since the previous one (once,
/// however many fragments it applies). Times are left at zero.
inline traffic_counters run_traffic(const algorithm_desc& a, std::vector<unit_spec> units,
                                    const mesh_shape& shape, int rank, std::int64_t steps,
                                    std::int64_t total_steps, const shard::precision& prec) {
  detail::expect_one_step_plan(a, "sim::run_traffic");
  FEDSHARD_EXPECTS(steps >= 0 && total_steps >= 0,
                   "sim::run_traffic: steps and total_steps must be >= 0, found ", steps, " and ",
                   total_steps);
  const flat_layout layout = a.layout(std::move(units), shape);
  const plan step = a.step_plan(layout, shape, prec);
  // The sync plans without the records ops they end with (recorded below by their round).
  const std::size_t steady = a.records_plan(shape, rank, records_steps(a.cadence())).ops.size();
  auto sync_plans = [&](std::int64_t round) {
    std::vector<plan> p =
        a.syncs() ? a.sync_plans(layout, shape, rank, round) : std::vector<plan>{};
    for (plan& f : p) f.ops.resize(f.ops.size() - steady);
    return p;
  };
  std::vector<plan> syncs = sync_plans(0);
  std::vector<std::int64_t> started(syncs.size(), 0);  // each fragment's syncs started so far
  traffic_counters out;
  std::int64_t applied_after = -1;        // the step after which a sync was last applied
  const bool soup = a.local().soup_on();  // its ops change with the round's members
  const plan local = a.local_step_plan(layout, shape, prec);
  for (std::int64_t s = 0; s < steps; ++s) {
    for (const auto& op : step.ops) out.record(op);
    const plan here = soup ? a.local_step_plan(layout, shape, prec, s - applied_after - 1) : plan{};
    for (const auto& op : (soup ? here : local).ops) out.record(op);
    bool applied = false;
    for (std::size_t f = 0; f < syncs.size(); ++f) {
      const auto act = a.action(static_cast<int>(f), s, total_steps);
      if (schedule::starts(act) && a.plan_per_round())  // this sync's plan (its round's peers)
        syncs[f] = sync_plans(started[f]).at(f);
      if (schedule::starts(act)) ++started[f];
      applied = applied || schedule::applies(act);
      for (const auto& op : syncs[f].ops)
        if (detail::at_sync_start(op) ? schedule::starts(act) : schedule::applies(act))
          out.record(op);
    }
    if (!applied) continue;
    for (const auto& op : a.records_plan(shape, rank, s - applied_after).ops) out.record(op);
    applied_after = s;
  }
  return out;
}

/// Settings of the pricing that are not the cluster's or the model's.
/// How the simulator overlaps a step's ops with its compute.
///  - channel: the overlappable ops run one after another behind the whole step's compute,
///    so max(C, O) plus the ops that block;
///  - timeline: the engine's order unit by unit (sim/timeline.hpp): an op starts when its
///    trigger fires and the channel is free, the compute waits where it needs a result; on
///    a level whose latency is propagation (link_level::pipelined_latency) ops in flight
///    overlap their latencies.
enum class step_overlap : std::uint8_t { channel, timeline };

/// "channel" or "timeline".
constexpr std::string_view to_string(step_overlap m) noexcept {
  return m == step_overlap::channel ? "channel" : "timeline";
}

struct price_options {
  collective_algorithm collectives = collective_algorithm::best;
  /// bf16 on the wire for parameters and gradient reductions (the paper's bf16 mixed
  /// precision). `sync` must stay f32 here: the federation's dtype is part of the algorithm's
  /// sync plans (algorithm_settings::sync_dtype, algorithm_options::sync_dtype).
  shard::precision precision{dtype::bf16, dtype::bf16};
  /// How a step's ops overlap its compute (see the file comment).
  step_overlap overlap = step_overlap::timeline;
  /// Per-rank compute variability (straggler.hpp); cv = 0 (the default) prices exactly as
  /// without it.
  straggler_model stragglers{};
  /// The backend's small all_reduce: one whose ranks x S is at most this many bytes gathers
  /// every input and reduces locally (wire_algorithm::gather_all, comm/communicator.hpp), as
  /// mpi (mpi::options::small_all_reduce_bytes, 64 KiB) and gloo (256 KiB) run it, and is
  /// priced so: as the all_gather of the ranks' whole inputs, (n-1) S sent per rank instead of
  /// a ring's 2 (n-1)/n S. 0 (the default): every all_reduce a ring, as NCCL runs it.
  std::int64_t gather_all_bytes = 0;
};

/// The price of one axis for one rank.
struct axis_price {
  level_kind level = level_kind::local;  ///< outermost level its communicator crosses
  int ranks = 1;                         ///< members of its communicator
  double step_bytes = 0;                 ///< wire bytes of one inner step
  double sync_bytes = 0;                 ///< wire bytes of one sync of every fragment
  double bytes_per_step = 0;             ///< step_bytes + the syncs' bytes per step (/ K)
  /// Bytes leaving this rank's node for the axis's ops in one inner step: each communicator
  /// that spans nodes sends its ring's bytes out of the node once, so this is the wire bytes
  /// times the communicators of the node that run the op (0 inside a node). Counted for ring
  /// algorithms; a hierarchical one sends slightly less.
  double step_node_bytes = 0;
  double sync_node_bytes = 0;      ///< the same for one sync of every fragment
  double node_bytes_per_step = 0;  ///< step_node_bytes + the syncs' node bytes per step
  std::int64_t step_calls = 0;
  std::int64_t sync_calls = 0;       ///< calls of one sync of every fragment
  double step_seconds = 0;           ///< time of its step ops, hidden or not
  double sync_seconds = 0;           ///< time of its ops in one sync of every fragment
  double sync_seconds_per_step = 0;  ///< time of its sync ops per step, hidden or not (/ K)
  double exposed = 0;                ///< exposed seconds per step (syncs amortised)
};

/// What one rank's step costs.
struct rank_price {
  double step = 0;                   ///< seconds
  std::array<axis_price, 5> axes{};  ///< by axis
};

/// What a local rule (sim/local_rule.hpp) adds to a step, in seconds (all 0 without one).
struct local_price {
  /// The step's own compute: the given compute less the zeroth-order units' backward.
  double main_compute = 0;
  double evaluations = 0;      ///< the zeroth-order loss evaluations' forward compute, 2P C / 3
  double passes = 0;           ///< the rule's elementwise passes of a step
  double replay = 0;           ///< the replay of one sync's zeroth-order records
  double replay_per_step = 0;  ///< replay x the syncs applied per step
  /// The critical rank's local ops not hidden: the evaluations' forward gathers beyond their
  /// compute, and the blocking ones (the loss means, the soup's distance sum).
  double exposed_ops = 0;

  /// The compute a step adds: evaluations + passes + replay_per_step.
  double compute() const noexcept { return evaluations + passes + replay_per_step; }
};

/// The price of one step of an algorithm on a cluster.
struct step_price {
  std::string algorithm;
  mesh_shape shape;
  double period = 1;         ///< steps between two syncs of a fragment: K, streaming's H (1
                             ///< when the algorithm does not federate)
  int fragments = 1;         ///< P, the fragments synced separately
  double in_flight = 0;      ///< mean steps a sync stays in flight (streaming's τ)
  bool syncs = false;        ///< the algorithm federates
  double compute = 0;        ///< seconds of compute per step
  double overlappable = 0;   ///< step comm marked overlappable, seconds
  double hidden = 0;         ///< of it, hidden behind compute
  double exposed_step = 0;   ///< step comm not hidden
  double sync = 0;           ///< seconds of one sync of every fragment
  double sync_per_step = 0;  ///< exposed sync seconds per step (sync / K when τ = 0)
  double sync_hidden = 0;    ///< sync seconds per step hidden behind compute (τ > 0)
  double step = 0;           ///< max(compute + straggler step wait, overlappable) + exposed ops +
                             ///< sync_per_step + straggler sync wait
  /// Seconds per step the stragglers add (0 without price_options::stragglers): the slowest
  /// of the step's n_step ranks, plus the syncs' wait for the slowest group, amortised
  /// (straggler_sync of it). step = compute + straggler_wait + exposed_comm().
  double straggler_wait = 0;
  double straggler_sync = 0;  ///< of straggler_wait, the syncs' part
  int step_component = 1;     ///< n_step: the ranks the step plan's ops join
  int sync_components = 1;    ///< G_sync: the step components the sync plans join
  double tokens_per_gpu = 0;  ///< tokens one GPU processes per step
  double tokens_per_s_per_gpu = 0;
  int critical_rank = 0;             ///< the slowest rank, whose split is reported
  std::array<axis_price, 5> axes{};  ///< the critical rank's, by axis
  std::vector<rank_price> ranks;     ///< every rank
  /// The local rule's part (sim/local_rule.hpp): its compute is in `compute`, its exposed ops
  /// in `exposed_step`, and its ops' bytes in the axes' step bytes.
  local_price local{};

  /// The critical rank's price of axis a.
  const axis_price& operator[](axis a) const { return axes[static_cast<std::size_t>(a)]; }
  /// Exposed communication seconds per step (step - compute - straggler_wait).
  double exposed_comm() const noexcept { return exposed_step + sync_per_step; }
};

namespace detail {

/// Identifies "the same op" across ranks: ranks whose plans hold an op with this key run it
/// at the same time.
using op_key = std::tuple<comm_kind, axis, std::int64_t, phase, trigger, int, int>;

inline op_key key_of(const comm_op& op) {
  return {op.kind, op.axis, op.bytes, op.phase, op.trigger, op.unit, op.fragment};
}

/// The ops of p as the modelled backend runs them: a plain all_reduce that gathers every
/// input (price_options::gather_all_bytes) becomes the all_gather of the ranks' whole inputs
/// (ranks x S, the same bytes: moved_total(op, gather_all)), so it is priced, and its bytes
/// counted, as that algorithm moves them, not as a ring.
inline plan as_run(plan p, const price_options& o) {
  for (comm_op& op : p.ops) {
    const bool gathers = op.kind == comm_kind::all_reduce && !encoded(op) && op.ranks > 1 &&
                         op.bytes * op.ranks <= o.gather_all_bytes;
    if (!gathers) continue;
    op.kind = comm_kind::all_gather;
    op.bytes *= op.ranks;
    op.reduce.reset();
  }
  return p;
}

/// Seconds one rank's codec kernels take for encoded op `op` on cluster c: encoding its
/// elements and decoding every rank's wire, each as passes over 4-byte elements at the GPU's
/// memory bandwidth (codec::spec's encode_passes and decode_passes); 0 for plain ops.
inline double codec_seconds(const comm_op& op, const cluster& c) {
  if (!encoded(op) || c.memory_bandwidth <= 0) return 0.0;
  const double f32_bytes = 4.0 * static_cast<double>(codec_elements(op));
  const double passes = op.codec.encode_passes + op.ranks * op.codec.decode_passes;
  return passes * f32_bytes / c.memory_bandwidth;
}

/// Per-rank spans of every axis, computed on first use.
class span_cache {
 public:
  explicit span_cache(const placement& p) : p_(&p), spans_(5) {}
  const comm_span& get(axis a, int rank) {
    auto& v = spans_[static_cast<std::size_t>(a)];
    if (v.empty()) {
      v.resize(static_cast<std::size_t>(p_->size()));
      std::map<int, comm_span> by_comm;  // every member of a communicator has the same span
      for (int r = 0; r < p_->size(); ++r) {
        const int id = p_->comm_id(a, r);
        auto it = by_comm.find(id);
        if (it == by_comm.end()) it = by_comm.emplace(id, p_->span(a, r)).first;
        v[static_cast<std::size_t>(r)] = it->second;
      }
    }
    return v[static_cast<std::size_t>(rank)];
  }

 private:
  const placement* p_;
  std::vector<std::vector<comm_span>> spans_;
};

/// The links op of `rank` crosses: its axis communicator's span `axis_span`, or for a
/// point-to-point op (send_recv, send, recv with axis rank op.peer) the pair's: 2 ranks, on
/// one node or two, in one site or two. So a gossip exchange is priced on the links between
/// the two groups, as one message each way (bus factor 1, one latency of the outermost level
/// crossed), and a heal's transfer as one message; the NIC and uplink sharing stays
/// sharing_of's, by axis communicator (each rank's exchange is one flow out of its node).
inline comm_span op_span(const placement& p, const comm_span& axis_span, const comm_op& op,
                         int rank) {
  if (!point_to_point(op.kind)) return axis_span;
  const std::vector<int> m = p.members(op.axis, rank);
  FEDSHARD_EXPECTS(op.peer >= 0 && static_cast<std::size_t>(op.peer) < m.size(),
                   "sim::price_plans: the plan's ", describe(op), " names axis rank ", op.peer,
                   " as its peer, but the communicator has ", m.size(), " ranks");
  const int peer = m[static_cast<std::size_t>(op.peer)];
  const bool one_node = p.node_of(rank) == p.node_of(peer);
  return {.ranks = 2,
          .nodes = one_node ? 1 : 2,
          .per_node = one_node ? 2 : 1,
          .sites = p.site_of(rank) == p.site_of(peer) ? 1 : 2};
}

/// The span of a federation op among member groups (comm_op::members) for `rank`: the
/// members of rank's federation communicator whose group is in the op's set.
inline comm_span member_span(const placement& p, const comm_op& op, int rank) {
  comm_span s{.ranks = 0, .nodes = 0, .per_node = 0, .sites = 0};
  std::map<int, int> nodes;
  std::set<int> sites;
  for (int r : p.members(axis::federation, rank)) {
    if (((op.members >> coords_of(p.shape(), r).group) & 1u) == 0) continue;
    ++s.ranks;
    ++nodes[p.node_of(r)];
    sites.insert(p.site_of(r));
  }
  s.nodes = static_cast<int>(nodes.size());
  for (const auto& [node, n] : nodes) s.per_node = std::max(s.per_node, n);
  s.sites = static_cast<int>(sites.size());
  return s;
}

/// For each rank, how many communicators of an op share its node's NICs and its site's
/// uplink, given which ranks run the op.
inline std::vector<link_sharing> sharing_of(const placement& p, span_cache& spans, axis a,
                                            const std::vector<bool>& active) {
  const int W = p.size();
  std::vector<std::set<int>> node_comms(static_cast<std::size_t>(p.nodes()));
  std::vector<std::set<int>> site_comms(static_cast<std::size_t>(p.sites()));
  for (int r = 0; r < W; ++r) {
    if (!active[static_cast<std::size_t>(r)]) continue;
    const comm_span& s = spans.get(a, r);
    if (s.nodes > 1) node_comms[static_cast<std::size_t>(p.node_of(r))].insert(p.comm_id(a, r));
    if (s.sites > 1) site_comms[static_cast<std::size_t>(p.site_of(r))].insert(p.comm_id(a, r));
  }
  std::vector<link_sharing> out(static_cast<std::size_t>(W));
  for (int r = 0; r < W; ++r) {
    auto& o = out[static_cast<std::size_t>(r)];
    o.per_node = std::max<int>(
        1, static_cast<int>(node_comms[static_cast<std::size_t>(p.node_of(r))].size()));
    o.per_site = std::max<int>(
        1, static_cast<int>(site_comms[static_cast<std::size_t>(p.site_of(r))].size()));
  }
  return out;
}

/// The links of level l of cluster c (a one-rank "local" op: default links).
inline const link_level& level_of(level_kind l, const cluster& c) noexcept {
  static const link_level none{};
  switch (l) {
    case level_kind::intra: return c.intra;
    case level_kind::inter: return c.inter;
    case level_kind::wan: return c.wan;
    case level_kind::local: break;
  }
  return none;
}

/// Remembers the price of an op for each (span, sharing) it was asked with.
class price_memo {
 public:
  template <class F>
  const collective_cost& get(const comm_op& op, const comm_span& s, const link_sharing& share,
                             F&& compute) {
    const key k{op.kind,    op.bytes, s.ranks,        s.nodes,
                s.per_node, s.sites,  share.per_node, share.per_site};
    auto it = costs_.find(k);
    if (it == costs_.end()) it = costs_.emplace(k, compute()).first;
    return it->second;
  }

 private:
  using key = std::tuple<comm_kind, std::int64_t, int, int, int, int, int, int>;
  std::map<key, collective_cost> costs_;
};

/// Which mesh dimensions (groups, replicas, shards) the communicators of axis a run along.
constexpr std::array<bool, 3> dims_of(axis a) noexcept {
  switch (a) {
    case axis::shard: return {false, false, true};
    case axis::replica: return {false, true, false};
    case axis::federation: return {true, false, false};
    case axis::group: return {false, true, true};
    case axis::world: return {true, true, true};
  }
  return {false, false, false};
}

/// Ranks of a component joined along the dimensions d of mesh s (1 when none).
inline int component_size(const mesh_shape& s, const std::array<bool, 3>& d) noexcept {
  return (d[0] ? s.groups : 1) * (d[1] ? s.replicas : 1) * (d[2] ? s.shards : 1);
}

/// What price_plans adds up for one rank besides its rank_price.
struct rank_totals {
  double overlappable = 0, exposed_ops = 0, sync = 0, sync_exposed = 0, sync_hidden = 0;
  double timeline_waiting = 0;  ///< step_overlap::timeline: seconds compute waited for ops
  double local_exposed = 0;     ///< the local rule's ops not hidden (local_price::exposed_ops)
  std::array<double, 5> overlappable_by_axis{};
};

/// The stragglers' part of a price (straggler.hpp).
struct straggler_terms {
  int n_step = 1;        ///< the ranks the step ops join every step
  int g_sync = 1;        ///< the step components a sync joins
  double step_wait = 0;  ///< straggler_step_wait
  double sync_wait = 0;  ///< straggler_sync_wait
};

/// An algorithm's plans placed on a cluster, with what pricing their ops shares between
/// ranks: each rank's sync plans, the spans of the axes' communicators, how many of them
/// share a NIC for each op, the unit sizes the timeline splits compute by, and the prices
/// computed so far.
struct plan_pricing {
  plan_pricing(const algorithm_desc& a, std::vector<unit_spec> units, const mesh_shape& shape,
               const cluster& c, const price_options& o)
      : c(c),
        o(o),
        shape(shape),
        place(shape, c),
        layout(a.layout(std::move(units), shape)),
        step_ops(as_run(a.step_plan(layout, shape, o.precision), o)),
        local_ops(as_run(a.local_step_plan(layout, shape, o.precision), o)),
        W(shape.size()),
        syncs(a.syncs()),
        cadence(a.cadence()),
        window(static_cast<double>(cadence.window)),
        sync_ops(static_cast<std::size_t>(W)),
        spans(place) {
    if (syncs)
      for (int r = 0; r < W; ++r)
        for (const plan& sp : a.sync_plans(layout, shape, r))
          sync_ops[static_cast<std::size_t>(r)].push_back(as_run(sp, o));
    share_links();
    for (std::size_t u = 0; u < layout.num_units(); ++u)
      unit_elements.push_back(static_cast<double>(layout.unit(u).numel));
  }
  plan_pricing(const plan_pricing&) = delete;
  plan_pricing& operator=(const plan_pricing&) = delete;

  /// The stragglers' terms for compute seconds C: the component the step ops join every
  /// step, and how many of them a sync joins.
  straggler_terms stragglers(double compute_seconds) const {
    std::array<bool, 3> step_dims{}, sync_dims{};
    for (const auto& op : step_ops.ops)
      if (op.ranks > 1)
        for (std::size_t d = 0; d < 3; ++d) step_dims[d] = step_dims[d] || dims_of(op.axis)[d];
    sync_dims = step_dims;
    for (const auto& [key, active] : sync_runs)
      for (std::size_t d = 0; d < 3; ++d)
        sync_dims[d] = sync_dims[d] || dims_of(std::get<1>(key))[d];
    straggler_terms st;
    st.n_step = component_size(shape, step_dims);
    st.g_sync = syncs ? component_size(shape, sync_dims) / st.n_step : 1;
    st.step_wait = straggler_step_wait(o.stragglers, compute_seconds, st.n_step);
    st.sync_wait = straggler_sync_wait(o.stragglers, compute_seconds, st.n_step, st.g_sync,
                                       syncs ? std::min(1.0, cadence.starts_per_step()) : 0.0);
    return st;
  }

  const cluster& c;
  const price_options& o;
  mesh_shape shape;
  placement place;
  flat_layout layout;
  plan step_ops;
  plan local_ops;  ///< the local rule's ops of a step (algorithm_desc::local_step_plan)
  int W;
  bool syncs;
  const sync_cadence& cadence;
  double window;                            ///< the cadence's steps
  std::vector<std::vector<plan>> sync_ops;  ///< [rank][fragment] (ranks differ in reference mode)
  span_cache spans;
  std::array<std::vector<link_sharing>, 5> step_sharing;     ///< [axis][rank]
  std::map<op_key, std::vector<bool>> sync_runs;             ///< the ranks that run each sync op
  std::map<op_key, std::vector<link_sharing>> sync_sharing;  ///< [rank] of each sync op
  price_memo memo;  ///< ranks mostly see the same (span, sharing): priced once
  std::vector<double> unit_elements;
  /// The local rule's compute seconds of a step (set by price_plans), of which `local_hide`
  /// (the evaluations') hides the local overlappable ops.
  double local_compute = 0, local_hide = 0;

 private:
  /// NIC sharing per rank: every rank runs every step op, so it depends on the axis alone;
  /// the sync ops differ between ranks (reference mode), so there it depends on who runs
  /// the op.
  void share_links() {
    const std::vector<bool> everyone(static_cast<std::size_t>(W), true);
    for (const plan* q : {&step_ops, &local_ops})
      for (const auto& op : q->ops) {
        auto& v = step_sharing[static_cast<std::size_t>(op.axis)];
        if (v.empty()) v = sharing_of(place, spans, op.axis, everyone);
      }
    for (int r = 0; r < W; ++r)
      for (const auto& frag : sync_ops[static_cast<std::size_t>(r)])
        for (const auto& op : frag.ops) {
          auto& v = sync_runs[key_of(op)];
          if (v.empty()) v.assign(static_cast<std::size_t>(W), false);
          v[static_cast<std::size_t>(r)] = true;
        }
    for (const auto& [key, active] : sync_runs)
      sync_sharing.emplace(key, sharing_of(place, spans, std::get<1>(key), active));
  }
};

/// Prices the step and sync ops of one rank r into its rank_price and totals (see the file
/// comment for the model); window_compute is the compute of a step's slowest member.
class rank_pricer {
 public:
  rank_pricer(plan_pricing& p, int r, double window_compute, rank_totals& t, rank_price& rp)
      : p_(p), r_(r), window_compute_(window_compute), t_(t), rp_(rp) {}

  /// Prices everything; rp.step is then the rank's step without the stragglers' sync wait.
  void run() {
    const std::vector<op_time> step_times = price_step_ops();
    // Compute a step leaves free of its own overlappable ops: what an in-flight sync uses.
    const double slack = std::max(0.0, window_compute_ - t_.overlappable);
    const auto& fragments = p_.sync_ops[static_cast<std::size_t>(r_)];
    for (std::size_t f = 0; f < fragments.size(); ++f)
      price_fragment(fragments[f], p_.cadence.fragments[f], slack);
    if (!p_.local_ops.ops.empty()) price_local_ops();
    close_axes();
    step_seconds(step_times);
    rp_.step += p_.local_compute + t_.local_exposed;
  }

 private:
  /// The span of op's communicator: its axis's, its member groups' (holder_average), or a
  /// point-to-point op's pair's (gossip, healing).
  comm_span span_of(const comm_op& op) const {
    return op.members != 0 ? member_span(p_.place, op, r_)
                           : op_span(p_.place, p_.spans.get(op.axis, r_), op, r_);
  }
  /// The collective price of op for the rank (without its codec passes).
  const collective_cost& collective(const comm_op& op, const link_sharing& share) {
    const comm_span s = span_of(op);
    // A point-to-point op's span is its pair's; the plan counts the ranks of its axis.
    const int ranks = point_to_point(op.kind) ? p_.spans.get(op.axis, r_).ranks : s.ranks;
    FEDSHARD_EXPECTS(ranks == op.ranks, "sim::price_plans: the plan's ", describe(op), " has ",
                     op.ranks, " ranks but the mesh's ", to_string(op.axis), " communicator has ",
                     ranks);
    const comm_op w = carried(op);  // an encoded op moves its wires
    return p_.memo.get(w, s, share, [&] {
      return price_collective(w.kind, static_cast<double>(w.bytes), s, share, p_.c,
                              p_.o.collectives);
    });
  }
  /// Prices op for the rank; adds the bytes it sends out of the rank's node to node_bytes.
  double cost(const comm_op& op, const link_sharing& share, double& node_bytes) {
    const comm_span s = span_of(op);
    if (s.nodes > 1) node_bytes += wire_bytes(op) * share.per_node;
    return codec_seconds(op, p_.c) + collective(op, share).seconds;
  }
  /// The timeline's view of step op op of `sec` seconds: the latency of a level whose
  /// latency is propagation does not hold the channel.
  op_time timeline_time(const comm_op& op, const link_sharing& share, double sec) {
    const cluster& c = p_.c;
    const level_kind level = p_.spans.get(op.axis, r_).level();
    if (level_of(level, c).on_compute) return {0, 0, sec};
    const double tail = level_of(level, c).pipelined_latency ? collective(op, share).latency : 0.0;
    // Thread ranks copy and reduce every collective themselves, whichever links carry its
    // bytes: an op across nodes or sites costs the compute what it costs inside one.
    double cpu = 0;
    if (c.intra.on_compute && op.ranks > 1) {
      const comm_op w = carried(op);
      cpu = price_collective(w.kind, static_cast<double>(w.bytes),
                             comm_span{op.ranks, 1, op.ranks, 1}, {}, c, p_.o.collectives)
                .seconds;
    }
    return {sec - tail, tail, cpu};
  }
  /// Prices the step ops; their times for the timeline (none under step_overlap::channel).
  std::vector<op_time> price_step_ops() {
    std::vector<op_time> step_times;
    for (const auto& op : p_.step_ops.ops) {
      auto& ax = rp_.axes[static_cast<std::size_t>(op.axis)];
      const link_sharing& share =
          p_.step_sharing[static_cast<std::size_t>(op.axis)][static_cast<std::size_t>(r_)];
      const double sec = cost(op, share, ax.step_node_bytes);
      if (p_.o.overlap == step_overlap::timeline)
        step_times.push_back(timeline_time(op, share, sec));
      ax.step_bytes += wire_bytes(op);
      ++ax.step_calls;
      ax.step_seconds += sec;
      if (op.overlappable) {
        t_.overlappable += sec;
        t_.overlappable_by_axis[static_cast<std::size_t>(op.axis)] += sec;
      } else {
        t_.exposed_ops += sec;
        if (p_.o.overlap == step_overlap::channel) ax.exposed += sec;
      }
    }
    return step_times;
  }
  /// Prices the local rule's ops, counted as the step's: the overlappable ones (the
  /// zeroth-order evaluations' forward gathers) run behind the evaluations' compute
  /// (p_.local_hide) and only what exceeds it is exposed; the others are exposed.
  void price_local_ops() {
    double over = 0;
    std::array<double, 5> over_by_axis{};
    for (const auto& op : p_.local_ops.ops) {
      const auto ai = static_cast<std::size_t>(op.axis);
      auto& ax = rp_.axes[ai];
      const double sec =
          cost(op, p_.step_sharing[ai][static_cast<std::size_t>(r_)], ax.step_node_bytes);
      ax.step_bytes += wire_bytes(op);
      ++ax.step_calls;
      ax.step_seconds += sec;
      if (op.overlappable) {
        over += sec;
        over_by_axis[ai] += sec;
      } else {
        t_.local_exposed += sec;
        ax.exposed += sec;
      }
    }
    const double spill = std::max(0.0, over - p_.local_hide);
    t_.local_exposed += spill;
    if (over > 0)
      for (axis ax_id : all_axes) {
        const auto ai = static_cast<std::size_t>(ax_id);
        rp_.axes[ai].exposed += spill * over_by_axis[ai] / over;
      }
  }
  /// Prices one sync of a fragment (its plan `frag`, its cadence fc): the seconds of its
  /// blocking ops per start and per apply, and of its sync_exchange ops (which may stay in
  /// flight, hidden by up to `slack` per step in flight), in all and by axis.
  void price_fragment(const plan& frag, const fragment_cadence& fc, double slack) {
    const double window = p_.window;
    double at_start = 0, at_apply = 0, in_flight = 0;
    std::array<double, 5> in_flight_by_axis{};
    for (const auto& op : frag.ops) {
      const auto ai = static_cast<std::size_t>(op.axis);
      auto& ax = rp_.axes[ai];
      double node_bytes = 0;
      const double sec =
          cost(op, p_.sync_sharing.at(key_of(op))[static_cast<std::size_t>(r_)], node_bytes);
      const double runs = static_cast<double>(at_sync_start(op) ? fc.starts : fc.applies);
      ax.sync_bytes += wire_bytes(op);
      ax.sync_node_bytes += node_bytes;
      ++ax.sync_calls;
      ax.sync_seconds += sec;
      ax.bytes_per_step += runs * wire_bytes(op) / window;
      ax.node_bytes_per_step += runs * node_bytes / window;
      ax.sync_seconds_per_step += runs * sec / window;
      t_.sync += sec;
      if (op.trigger == trigger::sync_exchange) {
        in_flight += sec;
        in_flight_by_axis[ai] += sec;
      } else {
        (at_sync_start(op) ? at_start : at_apply) += sec;
        ax.exposed += runs * sec / window;
      }
    }
    double exposed =
        static_cast<double>(fc.starts) * at_start + static_cast<double>(fc.applies) * at_apply;
    double hidden = 0;
    for (std::int64_t tau : fc.in_flight) {
      const double h = std::min(in_flight, static_cast<double>(tau) * slack);
      const double share = in_flight > 0 ? (in_flight - h) / in_flight : 0.0;
      for (axis ax_id : all_axes) {
        const auto ai = static_cast<std::size_t>(ax_id);
        rp_.axes[ai].exposed += share * in_flight_by_axis[ai] / window;
      }
      exposed += in_flight - h;
      hidden += h;
    }
    t_.sync_exposed += exposed / window;
    t_.sync_hidden += hidden / window;
  }
  /// Each axis's level, ranks and per-step totals; under step_overlap::channel, the
  /// overlappable seconds beyond the compute, shared among the axes as their seconds are.
  void close_axes() {
    const double spill = std::max(0.0, t_.overlappable - window_compute_);
    for (axis ax_id : all_axes) {
      auto& ax = rp_.axes[static_cast<std::size_t>(ax_id)];
      const comm_span& s = p_.spans.get(ax_id, r_);
      ax.level = s.level();
      ax.ranks = s.ranks;
      ax.bytes_per_step += ax.step_bytes;
      ax.node_bytes_per_step += ax.step_node_bytes;
      if (t_.overlappable > 0 && p_.o.overlap == step_overlap::channel)
        ax.exposed +=
            spill * t_.overlappable_by_axis[static_cast<std::size_t>(ax_id)] / t_.overlappable;
    }
  }
  /// rp.step: under step_overlap::timeline the step ops' exposure from the engine's timeline
  /// (shared among the axes as their seconds are), else max(C, O) + the exposed ops; plus
  /// the exposed sync seconds per step.
  void step_seconds(const std::vector<op_time>& step_times) {
    if (p_.o.overlap != step_overlap::timeline) {
      rp_.step = std::max(window_compute_, t_.overlappable) + t_.exposed_ops + t_.sync_exposed;
      return;
    }
    const std::vector<comm_op>& ops = p_.step_ops.ops;
    const step_timeline tl =
        time_step(ops, step_times, p_.unit_elements, window_compute_, p_.c.host_driven);
    double all = 0;
    std::array<double, 5> by_axis{};
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const double sec = step_times[i].occupancy + step_times[i].tail;
      all += sec;
      by_axis[static_cast<std::size_t>(ops[i].axis)] += sec;
    }
    if (all > 0)
      for (axis ax_id : all_axes)
        rp_.axes[static_cast<std::size_t>(ax_id)].exposed +=
            tl.waiting * by_axis[static_cast<std::size_t>(ax_id)] / all;
    t_.timeline_waiting = tl.waiting;
    rp_.step = tl.step + t_.sync_exposed;
  }

  plan_pricing& p_;
  int r_;
  double window_compute_;
  rank_totals& t_;
  rank_price& rp_;
};

/// The job's figures in out from its critical rank's totals t and price rp.
inline void report_critical(step_price& out, const rank_totals& t, const rank_price& rp,
                            double window_compute, const straggler_terms& st,
                            const price_options& o) {
  out.axes = rp.axes;
  out.overlappable = t.overlappable;
  if (o.overlap == step_overlap::timeline) {
    out.exposed_step = t.timeline_waiting;
    out.hidden = std::max(0.0, t.overlappable + t.exposed_ops - t.timeline_waiting);
  } else {
    out.hidden = std::min(t.overlappable, window_compute);
    out.exposed_step = (t.overlappable - out.hidden) + t.exposed_ops;
  }
  out.sync = t.sync;
  out.sync_per_step = t.sync_exposed;
  out.sync_hidden = t.sync_hidden;
  out.straggler_wait = (window_compute - out.compute) + st.sync_wait;
  out.straggler_sync = st.sync_wait;
  out.step_component = st.n_step;
  out.sync_components = st.g_sync;
  out.step = rp.step;
  out.tokens_per_s_per_gpu =
      out.step > 0 ? out.tokens_per_gpu / out.step : std::numeric_limits<double>::infinity();
}

/// The local rule's compute of a step of compute seconds C (sim/local_rule.hpp); exposed_ops
/// is left to the ranks' pricing.
inline local_price local_costs(const local_rule_desc& r, const plan_pricing& p, double C) {
  local_price out;
  out.main_compute = C;
  if (!r.active()) return out;
  const double bw = p.c.memory_bandwidth;
  auto pass_seconds = [bw](double passes, double elements) {
    return bw > 0 ? passes * 4.0 * elements / bw : 0.0;
  };
  if (r.zeroth_order_on()) {
    const int probes = r.zeroth_order.probes;
    const double z = zeroth_order_shard_elements(p.layout, r);
    out.main_compute = C * (1.0 - 2.0 / 3.0 * zeroth_order_share(p.layout, r));
    out.evaluations = 2.0 * probes * C / 3.0;
    out.passes = pass_seconds(zo_step_passes(probes), z);
    const std::int64_t k = records_steps(p.cadence);
    if (p.syncs && r.zeroth_order.seeds_on_wire && k > 0) {
      out.replay = pass_seconds(zo_sync_passes(p.shape.groups, k, probes), z);
      out.replay_per_step = out.replay * static_cast<double>(applies_in(p.cadence)) / p.window;
    }
  }
  if (r.soup_on())  // averaged over a round: the steps between two applied syncs
    out.passes += pass_seconds(soup_mean_passes(r.soup, p.syncs ? records_steps(p.cadence) : 0),
                               static_cast<double>(p.layout.total_shard_numel()));
  return out;
}

}  // namespace detail

/// What algorithm a's local rule (algorithm_desc::local) adds to the memory of a rank of
/// the units laid out for `shape`, by the plain step plan at precision prec: local_memory_of.
inline local_memory local_memory_of(const algorithm_desc& a, std::vector<unit_spec> units,
                                    const mesh_shape& shape, const shard::precision& prec = {}) {
  const flat_layout layout = a.layout(std::move(units), shape);
  return local_memory_of(layout, a.plain_step_plan(layout, shape, prec), a.local());
}

/// Seconds world rank `rank` of a mesh placed as p spends in the ops of q run one after
/// another (a chain: an on-demand plan, such as a heal's, federation/heal.hpp), each priced by
/// price_collective with `algo` on the links it crosses (its axis communicator's, its member
/// groups', or a point-to-point op's pair's: detail::op_span), alone on them, plus its codec
/// passes. A recv takes as long as its message, so a heal of S bytes between two sites costs
/// both sides c.op_latency + c.wan.alpha + S / c.wan.bandwidth (the WAN the slowest link).
inline double price_chain(const plan& q, const placement& p, int rank, const cluster& c,
                          collective_algorithm algo = collective_algorithm::best) {
  FEDSHARD_EXPECTS(rank >= 0 && rank < p.size(), "sim::price_chain: rank must be in [0, ", p.size(),
                   "), found ", rank);
  double seconds = 0;
  for (const comm_op& op : q.ops) {
    fedshard::check(op);
    const comm_span axis_span = p.span(op.axis, rank);
    const comm_span s = op.members != 0 ? detail::member_span(p, op, rank)
                                        : detail::op_span(p, axis_span, op, rank);
    const int ranks = op.members != 0 ? s.ranks : axis_span.ranks;
    FEDSHARD_EXPECTS(ranks == op.ranks, "sim::price_chain: ", describe(op), " has ", op.ranks,
                     " ranks but rank ", rank, "'s communicator has ", ranks);
    const comm_op w = carried(op);
    seconds += detail::codec_seconds(op, c) +
               price_collective(w.kind, static_cast<double>(w.bytes), s, {}, c, algo).seconds;
  }
  return seconds;
}

/// Prices algorithm a on units laid out for `shape` on cluster c, given the compute seconds
/// and tokens of one GPU's step. See the file comment for the model.
inline step_price price_plans(const algorithm_desc& a, std::vector<unit_spec> units,
                              const mesh_shape& shape, const cluster& c, double compute_seconds,
                              double tokens_per_gpu, const price_options& o = {}) {
  detail::expect_one_step_plan(a, "sim::price_plans");
  FEDSHARD_EXPECTS(compute_seconds >= 0 && tokens_per_gpu >= 0,
                   "sim::price_plans: compute seconds and tokens must be >= 0, found ",
                   compute_seconds, " and ", tokens_per_gpu);
  FEDSHARD_EXPECTS(o.stragglers.cv >= 0 && std::isfinite(o.stragglers.cv),
                   "sim::price_plans: the stragglers' coefficient of variation must be a finite "
                   "number >= 0, found ",
                   o.stragglers.cv);
  FEDSHARD_EXPECTS(o.precision.sync == dtype::f32,
                   "sim::price_plans: price_options::precision.sync must be f32, found ",
                   to_string(o.precision.sync),
                   "; the federation's sync dtype is the algorithm's (algorithm_settings::"
                   "sync_dtype or algorithm_options::sync_dtype)");
  detail::plan_pricing pricing(a, std::move(units), shape, c, o);
  const local_price local = detail::local_costs(a.local(), pricing, compute_seconds);
  if (a.local().active()) {
    compute_seconds = local.main_compute;
    pricing.local_compute = local.compute();
    pricing.local_hide = local.evaluations;
  }
  const detail::straggler_terms st = pricing.stragglers(compute_seconds);
  // The compute window of a step: the slowest member's compute.
  const double window_compute =
      o.stragglers.active() ? compute_seconds + st.step_wait : compute_seconds;

  step_price out;
  out.algorithm = a.name();
  out.shape = shape;
  out.syncs = pricing.syncs;
  out.period = pricing.syncs ? pricing.cadence.period() : 1;
  out.fragments = a.fragments();
  out.in_flight = pricing.syncs ? pricing.cadence.mean_in_flight() : 0;
  out.compute = compute_seconds;
  out.tokens_per_gpu = tokens_per_gpu;
  out.ranks.resize(static_cast<std::size_t>(pricing.W));
  std::vector<detail::rank_totals> per_rank(static_cast<std::size_t>(pricing.W));
  double worst = -1;
  for (int r = 0; r < pricing.W; ++r) {
    auto& rp = out.ranks[static_cast<std::size_t>(r)];
    detail::rank_pricer(pricing, r, window_compute, per_rank[static_cast<std::size_t>(r)], rp)
        .run();
    if (o.stragglers.active()) rp.step += st.sync_wait;
    if (rp.step > worst) {
      worst = rp.step;
      out.critical_rank = r;
    }
  }
  const auto critical = static_cast<std::size_t>(out.critical_rank);
  detail::report_critical(out, per_rank[critical], out.ranks[critical], window_compute, st, o);
  out.local = local;
  out.local.exposed_ops = per_rank[critical].local_exposed;
  out.compute += local.compute();
  out.exposed_step += out.local.exposed_ops;
  return out;
}

/// What each GPU trains on in a step.
struct workload {
  transformer_dims model = llama31_8b();
  int micro_batch = 1;  ///< sequences per GPU per step
  int seq = 2048;       ///< tokens per sequence
  double mfu = 0;       ///< 0: the cluster's default_mfu
  bool recompute = false;
  /// Measured compute seconds per token on one GPU; > 0 replaces the FLOP model (FLOPs /
  /// (peak x MFU)), so mfu and recompute no longer matter for the time.
  double seconds_per_token = 0;

  /// micro_batch x seq.
  double tokens_per_gpu() const noexcept { return double(micro_batch) * seq; }

  /// Throws invalid_argument naming the first setting out of range: the model's dimensions
  /// (transformer_dims::check), micro_batch and seq >= 1, mfu in [0, 1] (0: the cluster's),
  /// seconds_per_token finite and >= 0 (0: the FLOP model).
  void check() const {
    model.check();
    FEDSHARD_EXPECTS(micro_batch >= 1 && seq >= 1,
                     "sim::workload: micro_batch and seq must be >= 1, found ", micro_batch,
                     " and ", seq);
    FEDSHARD_EXPECTS(mfu >= 0 && mfu <= 1,
                     "sim::workload: mfu must be in [0, 1] (0: the cluster's default), found ",
                     mfu);
    FEDSHARD_EXPECTS(seconds_per_token >= 0 && std::isfinite(seconds_per_token),
                     "sim::workload: seconds_per_token must be a finite number >= 0 (0: the FLOP "
                     "model), found ",
                     seconds_per_token);
  }
};

/// One GPU's compute seconds for a step of w on cluster c: w.seconds_per_token when it is set,
/// else sim::compute_model's FLOPs / (peak x MFU).
inline double compute_seconds_of(const workload& w, const cluster& c) {
  const double tokens = w.tokens_per_gpu();
  if (w.seconds_per_token > 0) return w.seconds_per_token * tokens;
  const compute_model cm{c.peak_flops, w.mfu > 0 ? w.mfu : c.default_mfu, w.recompute};
  return cm.seconds(w.model, tokens, w.seq);
}

/// Prices algorithm a training workload w on a G x R x S mesh of cluster c: the model's
/// units (sim::transformer_units, bf16) planned by a's policies, compute from
/// w.seconds_per_token when it is set, else from sim::compute_model. invalid_argument for a
/// workload or cluster that is not physical (workload::check, cluster::check).
inline step_price price(const algorithm_desc& a, const workload& w, const mesh_shape& shape,
                        const cluster& c, const price_options& o = {}) {
  w.check();
  return price_plans(a, transformer_units(w.model, dtype::bf16), shape, c, compute_seconds_of(w, c),
                     w.tokens_per_gpu(), o);
}

}  // namespace fedshard::sim
