#pragma once
/// trainer_options: a trainer's settings beyond its optimizer's (precision, steps, the
/// policies' settings, logging), and world_mean_op, the op of trainer::mean_over_world.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/federation/participation.hpp"
#include "fedshard/mesh/axis.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/shard/shard_policy.hpp"
#include "fedshard/trainer/algorithm.hpp"
#include "fedshard/trainer/local_rule.hpp"

namespace fedshard {

/// The local rule an algorithm starts from (algorithm::default_local_rule; none for an
/// Algorithm without one).
template <Algorithm A>
local_rule_factory default_local_rule_of() {
  if constexpr (requires { A::default_local_rule(); })
    return A::default_local_rule();
  else
    return {};
}

/// The federation settings an algorithm starts from (algorithm::default_federation; the
/// config's default for an Algorithm without one).
template <Algorithm A>
typename A::federation_policy::config default_federation_of() {
  if constexpr (requires { A::default_federation(); })
    return A::default_federation();
  else
    return typename A::federation_policy::config{};
}

/// The context axis an algorithm starts from (algorithm::default_context_axis; none for an
/// Algorithm without one).
template <Algorithm A>
constexpr std::optional<axis> default_context_axis_of() {
  if constexpr (requires { A::default_context_axis(); })
    return A::default_context_axis();
  else
    return std::nullopt;
}

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
  /// The federation policy's settings (sync mode, outer optimizer, ...), from the
  /// algorithm's default (feast, collate: their masks; the others: the config's default).
  typename A::federation_policy::config federation = default_federation_of<A>();
  /// The schedule's settings (K, H, fragments, delay, mixing), from the algorithm's defaults.
  typename A::sync_schedule::config schedule = A::default_schedule();
  /// Which groups each sync combines: a seeded sample (federation/participation.hpp; in an
  /// elastic round, among its members that are not joiners). Default: every group.
  federation::participation participation{};
  /// Robust aggregation (federation/participation.hpp): a group whose update holds NaN/inf
  /// or lies too far from the others' median is left out of the sync. Unset: on
  /// (screening{}) over an elastic federation axis, off otherwise.
  std::optional<federation::screening> screening{};
  /// The shard policy's settings (shard::sparse's density, refresh period); none for most.
  shard::settings_of_t<typename A::shard_policy> shard{};
  /// How a group trains between syncs beyond the inner step (trainer/local_rule.hpp: LSS's
  /// local_soup_rule, ...), from the algorithm's default (hofl, lss; the others: empty, the
  /// plain step). Host-readable memory spaces only.
  local_rule_factory local_rule = default_local_rule_of<A>();
  /// Context parallelism: the axis whose ranks share each batch of sequences, which a model
  /// computing attention over blocks spreads over them (step_context::context_axis), from
  /// the algorithm's default (fcp: the group's; the others: none). The caller gives every
  /// rank of that axis the same batch.
  std::optional<axis> context_axis = default_context_axis_of<A>();
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

/// The op of a local rule's group mean loss (local_access::loss): an average all_reduce of
/// one f64 (role value) over the group of `ranks` ranks.
inline comm_op group_mean_op(int ranks) {
  return {.kind = comm_kind::all_reduce,
          .axis = axis::group,
          .dtype = dtype::f64,
          .bytes = 8,
          .ranks = ranks,
          .reduce = reduce_op::avg,
          .in = {.role = role::value},
          .out = {.role = role::value},
          .overlappable = false};
}

/// The op of a local rule's sum over the group's shards (local_access::sum_over_shards): a
/// sum all_reduce of n f64 (role value) over the shard axis of `shards` ranks.
inline comm_op shard_sum_op(int shards, std::int64_t n) {
  return {.kind = comm_kind::all_reduce,
          .axis = axis::shard,
          .dtype = dtype::f64,
          .bytes = 8 * n,
          .ranks = shards,
          .reduce = reduce_op::sum,
          .in = {.role = role::value},
          .out = {.role = role::value},
          .overlappable = false};
}

/// The op that hands a local rule's exchange to the rest of its group
/// (local_sync::all_gather): a broadcast of n f64 (role value) from the group's rank 0 over
/// the group of `ranks` ranks.
inline comm_op group_broadcast_op(int ranks, std::int64_t n) {
  return {.kind = comm_kind::broadcast,
          .axis = axis::group,
          .dtype = dtype::f64,
          .bytes = 8 * n,
          .ranks = ranks,
          .root = 0,
          .trigger = trigger::on_demand,
          .phase = phase::sync,
          .in = {.role = role::none},
          .out = {.role = role::value},
          .overlappable = false};
}

/// The op of a local rule's exchange over the federation axis (local_sync::all_gather): an
/// all_gather of n f64 per group (role value: index 0 the rank's, index 1 the G x n result)
/// over the `groups` groups.
inline comm_op federation_gather_op(int groups, std::int64_t n) {
  return {.kind = comm_kind::all_gather,
          .axis = axis::federation,
          .dtype = dtype::f64,
          .bytes = 8 * n * groups,
          .ranks = groups,
          .trigger = trigger::on_demand,
          .phase = phase::sync,
          .in = {.role = role::value, .index = 0},
          .out = {.role = role::value, .index = 1},
          .overlappable = false};
}

}  // namespace fedshard
