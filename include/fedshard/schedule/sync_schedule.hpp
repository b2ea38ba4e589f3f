#pragma once
/// The SyncSchedule concept: when the federation groups synchronise, and which part of the
/// model (fragment) each sync covers.
///
/// The trainer asks a schedule, after the inner optimizer step of the 0-based step `step`
/// of a run of `total_steps` planned steps (the final step is total_steps - 1; total_steps
/// <= 0 means unknown, so there is no final-step sync), what to do with each fragment.
///
/// A SyncSchedule S provides:
///  1. `S::config`, a default-constructible aggregate of settings; `S(config)` and `S()`
///     (same as `S(config{})`); constructors throw invalid_argument for settings that can
///     never work, naming the value found. S is copyable.
///  2. `int fragments() const`: P >= 1, the number of fragments (1 unless streaming).
///  3. Either (a step schedule)
///     `sync_action action(int fragment, std::int64_t step, std::int64_t total_steps) const`:
///     start = snapshot the fragment and start its all_reduce; apply = wait for it and mix
///     the result in; start_and_apply = both at once (a blocking sync). Guarantees:
///     - a non-streaming schedule only ever returns none or start_and_apply;
///     - over steps 0, 1, 2, ... a fragment's starts and applies alternate, beginning with a
///       start (start_and_apply counts as both), so at most one all_reduce per fragment is
///       in flight;
///     - when total_steps > 0 the final step syncs every fragment (apply when its all_reduce
///       is in flight, else start_and_apply): nothing is left in flight and the run ends on
///       a synchronised model;
///     - the answer depends on the arguments alone (every rank computes it alone, and a
///       restored run continues the same way);
///     - invalid_argument for a fragment outside [0, P) or step < 0.
///     or (a progress schedule: ProgressSchedule below; token_budget, wall_clock)
///     `sync_action action(int fragment, const sync_progress& p) const` and
///     `std::int64_t run_syncs() const`: the decision depends on the group's progress (its
///     tokens since its last sync, its seconds since the start), which the synchronizer
///     agrees on across the group's ranks after every step (federation/sync.hpp,
///     progress_op). Guarantees: P = 1; only none or start_and_apply; the answer depends on
///     `p` alone; groups take different numbers of steps between syncs, and the k-th sync of
///     every group meets the k-th of the others; a run ends after run_syncs() >= 1 syncs
///     (trainer::done()), not after total_steps, so every group does the same number.
///     Optionally `static constexpr bool uses_clock = true` (wall_clock): the decision reads
///     p.seconds, so every rank waits for its step's work before the group reads the clock.
///  4. `float mixing() const`: α in (0, 1]; θ ← (1 - α)·θ_local + α·θ_synced (1 = replace).
///  5. `std::vector<int> fragment_units(int fragment, int num_units) const`: the units of the
///     fragment, ascending, strided (unit u belongs to fragment u % P); the fragments
///     partition the units. invalid_argument when P > num_units or num_units < 1.
///  6. `void check(int num_units) const`: invalid_argument when the schedule cannot run on a
///     model with num_units units.
///  7. `S::name`, a std::string_view.
///
/// Optional capabilities (declared here, detected once in schedule::capabilities<S>, each with
/// its default when absent; a near-miss name or another type is a compile error naming what was
/// meant):
///  8. `static constexpr bool uses_clock` (see 3; wall_clock). Default false.
///  9. The config settings tools set by name (the simulator's --period, --fragments, --delay,
///     --alpha): `int period` (K or H, steps between syncs), `int fragments` (P), `int delay`
///     (τ), `float alpha` (α). Default: the schedule has no such setting (the simulator
///     refuses fragments, delay and alpha for it, and prices it without a period).

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>
#include <vector>

#include "fedshard/core/member_names.hpp"
#include "fedshard/error.hpp"

namespace fedshard::schedule {

/// What happens to one fragment after a step.
enum class sync_action : std::uint8_t { none, start, apply, start_and_apply };

/// The name of an action ("none", "start", "apply", "start_and_apply").
constexpr std::string_view to_string(sync_action a) noexcept {
  switch (a) {
    case sync_action::none: return "none";
    case sync_action::start: return "start";
    case sync_action::apply: return "apply";
    case sync_action::start_and_apply: return "start_and_apply";
  }
  return "unknown-sync_action";
}

/// True for start and start_and_apply: the fragment is snapshotted and its all_reduce starts.
constexpr bool starts(sync_action a) noexcept {
  return a == sync_action::start || a == sync_action::start_and_apply;
}

/// True for apply and start_and_apply: the fragment's all_reduce is waited for and mixed in.
constexpr bool applies(sync_action a) noexcept {
  return a == sync_action::apply || a == sync_action::start_and_apply;
}

/// Where a group stands after a step, as every rank of the group agreed on it: what a
/// progress schedule decides from.
struct sync_progress {
  std::int64_t step = 0;  ///< the 0-based step just taken
  /// The group's tokens since its last sync (summed over its ranks), this step's included.
  std::int64_t tokens = 0;
  double seconds = 0;      ///< the group's seconds since the run started (its rank 0's clock)
  std::int64_t syncs = 0;  ///< the syncs the group applied so far
};

namespace detail {

/// Requirements 1, 2 and 4 to 7.
template <class S>
concept schedule_common = std::default_initializable<S> && std::copy_constructible<S> &&
    std::default_initializable<typename S::config> && std::is_aggregate_v<typename S::config> &&
    std::constructible_from<S, const typename S::config&> &&
    requires(const S& s, int fragment, int num_units) {
  { s.fragments() } -> std::same_as<int>;
  { s.mixing() } -> std::same_as<float>;
  { s.fragment_units(fragment, num_units) } -> std::same_as<std::vector<int>>;
  s.check(num_units);
  { S::name } -> std::convertible_to<std::string_view>;
};

}  // namespace detail

/// Requirement 3, first form: the action is a function of the step.
template <class S>
concept StepSchedule = detail::schedule_common<S> &&
    requires(const S& s, int fragment, std::int64_t step) {
  { s.action(fragment, step, step) } -> std::same_as<sync_action>;
};

/// Requirement 3, second form: the action is a function of the group's progress, and a run
/// ends after run_syncs() syncs.
template <class S>
concept ProgressSchedule = detail::schedule_common<S> &&
    requires(const S& s, int fragment, const sync_progress& p) {
  { s.action(fragment, p) } -> std::same_as<sync_action>;
  { s.run_syncs() } -> std::same_as<std::int64_t>;
};

/// See the numbered requirements above.
template <class S>
concept SyncSchedule = StepSchedule<S> || ProgressSchedule<S>;

namespace detail {
// The member names capabilities<S> looks for: its own and near misses of them.
FEDSHARD_MEMBER_NAME(uses_clock)
FEDSHARD_MEMBER_NAME(use_clock)
FEDSHARD_MEMBER_NAME(period)
FEDSHARD_MEMBER_NAME(periods)
FEDSHARD_MEMBER_NAME(K)
FEDSHARD_MEMBER_NAME(H)
FEDSHARD_MEMBER_NAME(fragments)
FEDSHARD_MEMBER_NAME(fragment)
FEDSHARD_MEMBER_NAME(delay)
FEDSHARD_MEMBER_NAME(tau)
FEDSHARD_MEMBER_NAME(alpha)
FEDSHARD_MEMBER_NAME(mixing)
}  // namespace detail

/// The optional capabilities 8 and 9 of SyncSchedule S, detected here and nowhere else (the
/// synchronizer and the simulator read them through this).
template <class S>
struct capabilities {
  using config = typename S::config;
  /// 8.
  static constexpr bool uses_clock = requires { requires S::uses_clock; };
  /// 9, each setting.
  static constexpr bool period = requires(config & c) {
    { c.period } -> std::same_as<int&>;
  };
  static constexpr bool fragments = requires(config & c) {
    { c.fragments } -> std::same_as<int&>;
  };
  static constexpr bool delay = requires(config & c) {
    { c.delay } -> std::same_as<int&>;
  };
  static constexpr bool alpha = requires(config & c) {
    { c.alpha } -> std::same_as<float&>;
  };

  static_assert(!detail::names_use_clock<S>,
                "SyncSchedule: the schedule has a member `use_clock`; did you mean `static "
                "constexpr bool uses_clock` (capability 8, sync_schedule.hpp)?");
  static_assert(
      !detail::names_uses_clock<S> || requires { bool{S::uses_clock}; },
      "SyncSchedule: the schedule's `uses_clock` is not a constant bool (capability 8)");
  static_assert(!detail::names_periods<config> && !detail::names_K<config> &&
                    !detail::names_H<config>,
                "SyncSchedule: the schedule's config has a member `periods`, `K` or `H`; did you "
                "mean `int period` (capability 9, sync_schedule.hpp)?");
  static_assert(!detail::names_fragment<config> && !detail::names_tau<config> &&
                    !detail::names_mixing<config>,
                "SyncSchedule: the schedule's config has a member `fragment`, `tau` or `mixing`; "
                "did you mean `int fragments`, `int delay` or `float alpha` (capability 9)?");
  static_assert((!detail::names_period<config> || period) &&
                    (!detail::names_fragments<config> || fragments) &&
                    (!detail::names_delay<config> || delay) &&
                    (!detail::names_alpha<config> || alpha),
                "SyncSchedule: a config setting of capability 9 has another type than the one "
                "declared (int period, int fragments, int delay, float alpha): tools would not "
                "set it");

  /// True once the checks above compiled.
  static constexpr bool checked = true;
};

namespace detail {

/// The action that starts when `start` and applies when `apply`.
constexpr sync_action make_action(bool start, bool apply) noexcept {
  if (start && apply) return sync_action::start_and_apply;
  if (start) return sync_action::start;
  if (apply) return sync_action::apply;
  return sync_action::none;
}

/// Throws invalid_argument unless 0 <= fragment < fragments and step >= 0.
inline void check_action_args(std::string_view name, int fragment, int fragments,
                              std::int64_t step) {
  FEDSHARD_EXPECTS(fragment >= 0 && fragment < fragments, name, ": fragment must be in [0, ",
                   fragments, "), found ", fragment);
  FEDSHARD_EXPECTS(step >= 0, name, ": step must be >= 0, found ", step);
}

/// Throws invalid_argument unless a model of num_units units can be cut into `fragments`
/// non-empty fragments.
inline void check_units(std::string_view name, int fragments, int num_units) {
  FEDSHARD_EXPECTS(num_units >= 1, name, ": the model must have at least one unit, found ",
                   num_units);
  FEDSHARD_EXPECTS(fragments <= num_units, name, ": ", fragments,
                   " fragments but the model has only ", num_units, " units");
}

/// The units u of [0, num_units) with u % fragments == fragment, ascending.
inline std::vector<int> strided_units(std::string_view name, int fragment, int fragments,
                                      int num_units) {
  check_units(name, fragments, num_units);
  FEDSHARD_EXPECTS(fragment >= 0 && fragment < fragments, name, ": fragment must be in [0, ",
                   fragments, "), found ", fragment);
  std::vector<int> units;
  units.reserve(static_cast<std::size_t>((num_units - fragment + fragments - 1) / fragments));
  for (int u = fragment; u < num_units; u += fragments) units.push_back(u);
  return units;
}

/// True when step is the final step of a run of total_steps (> 0) steps.
constexpr bool is_final_step(std::int64_t step, std::int64_t total_steps) noexcept {
  return total_steps > 0 && step == total_steps - 1;
}

}  // namespace detail

/// What the schedules that sync the whole model as one fragment (every_step, periodic,
/// post_local, token_budget, wall_clock) share: requirements 2, 4, 5 and 6; Derived provides the
/// name and action().
template <class Derived>
struct whole_model {
  /// 1.
  int fragments() const noexcept { return 1; }
  /// 1: the synchronised parameters replace the local ones.
  float mixing() const noexcept { return 1.0f; }
  /// All units, ascending.
  std::vector<int> fragment_units(int fragment, int num_units) const {
    return detail::strided_units(Derived::name, fragment, 1, num_units);
  }
  /// Throws invalid_argument when num_units < 1.
  void check(int num_units) const { detail::check_units(Derived::name, 1, num_units); }
};
}  // namespace fedshard::schedule
