#pragma once
/// Failures priced (fedshard-sim --failures): the effective training time of a job whose
/// GPUs fail at a given rate, under three recovery schemes.
///
///  - checkpoint_restart: the whole job saves its state every τ seconds (blocking, C seconds:
///    each node writes its GPUs' state to storage at failure_settings::storage_bytes_per_s);
///    a failure costs detection, a restart of the whole job, a reload (C again) and the work
///    since the last save, (τ + C) / 2 on average. τ is Young's optimum sqrt(2 C / λ) unless
///    set.
///  - elastic_groups (fedshard's groups as jobs): a failure takes its group out; the others
///    stall once, for the detection time (the round they were connecting waits its join
///    timeout), and train on; the group restarts, heals from a donor group (its state over
///    the node network) and rejoins. Per failure the job loses the stall, plus 1/G of the
///    group's absence and of its work since the last sync (K / 2 steps on average).
///  - per_step_quorum (torchft's fault-tolerant HSDP): the same drop-out and heal per replica
///    group, but every step pays a quorum and loses at most the step in flight (half a step
///    on average).
///
/// First order in the failure rate λ (failures per second of the whole job): each failure
/// costs its own seconds, and a failure during a recovery is not modelled, so the fractions
/// hold while λ x (seconds lost per failure) is well below 1 (clamped at 0 beyond).
#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

#include "fedshard/error.hpp"

namespace fedshard::sim {

/// How often hardware fails and what recovery costs (every time in seconds).
struct failure_settings {
  /// Mean time between failures of one GPU (or of one node, per_node), in hours. Default:
  /// Llama 3's pre-training (Dubey et al. 2024, section 3.3.4) saw 419 unexpected
  /// interruptions in a 54-day snapshot on 16,384 H100: 16384 x 54 x 24 / 419 = 50,700
  /// GPU-hours between failures.
  double mtbf_hours = 50'700;
  bool per_node = false;
  double detect_s = 10;              ///< a failure noticed: heartbeat or join timeout
  double restart_s = 300;            ///< checkpoint-restart: the whole job rescheduled, started
  double group_restart_s = 120;      ///< a replacement group's (replica's) processes started
  double storage_bytes_per_s = 2e9;  ///< per node, checkpoint save and load
  std::optional<double> checkpoint_every_s{};  ///< unset: Young's optimum sqrt(2 C / λ)
  double quorum_s = 0.02;                      ///< per_step_quorum: each step's quorum (assumed)

  /// invalid_argument naming the first setting that is not a finite number in its range.
  void check() const {
    auto positive = [](double x) { return x > 0 && std::isfinite(x); };
    auto non_negative = [](double x) { return x >= 0 && std::isfinite(x); };
    FEDSHARD_EXPECTS(positive(mtbf_hours),
                     "sim::failure_settings: mtbf_hours: expected a finite "
                     "number > 0, found ",
                     mtbf_hours);
    FEDSHARD_EXPECTS(non_negative(detect_s) && non_negative(restart_s) &&
                         non_negative(group_restart_s) && non_negative(quorum_s),
                     "sim::failure_settings: detect_s, restart_s, group_restart_s and quorum_s: "
                     "expected finite seconds >= 0, found ",
                     detect_s, ", ", restart_s, ", ", group_restart_s, " and ", quorum_s);
    FEDSHARD_EXPECTS(positive(storage_bytes_per_s),
                     "sim::failure_settings: "
                     "storage_bytes_per_s: expected a finite rate > 0, found ",
                     storage_bytes_per_s);
    FEDSHARD_EXPECTS(!checkpoint_every_s || positive(*checkpoint_every_s),
                     "sim::failure_settings: checkpoint_every_s: expected finite seconds > 0, "
                     "found ",
                     checkpoint_every_s.value_or(0));
  }
};

/// What the failure model needs of a priced configuration.
struct failing_job {
  int gpus = 1;
  int gpus_per_node = 1;
  double step_s = 0;               ///< one step without failures (sim::price's step)
  double state_bytes_per_gpu = 0;  ///< what one GPU saves, or receives when healed
  /// Units that drop out alone: the groups (elastic_groups) or replica groups
  /// (per_step_quorum); 1 for checkpoint_restart.
  int groups = 1;
  int steps_per_sync = 1;       ///< K: a dead group loses K / 2 steps on average
  double heal_bytes_per_s = 0;  ///< what a healed node receives at (its network)
  double heal_latency_s = 0;
  /// What a heal's host passes run at, per byte of the node's state: the donor serializes
  /// (copies and checksums) it, the joiner verifies and applies it (trainer/state_io.hpp);
  /// 0: not priced (they hide behind a network that is slower than memory).
  double heal_host_bytes_per_s = 0;
};

/// One scheme's price.
struct scheme_price {
  std::string scheme;
  double failures_per_hour = 0;   ///< of the whole job
  double lost_per_failure_s = 0;  ///< whole-job seconds one failure costs
  double overhead = 0;            ///< fraction of time lost without failures (saves, quorum)
  double effective = 0;           ///< fraction of wall-clock time that trains
  double checkpoint_every_s = 0;  ///< checkpoint_restart's τ
  double checkpoint_s = 0;        ///< checkpoint_restart's C (one save, or one reload)
  double heal_s = 0;              ///< elastic_groups' and per_step_quorum's heal of one group
};

namespace detail {

inline void check_job(const failing_job& j) {
  FEDSHARD_EXPECTS(j.gpus >= 1 && j.gpus_per_node >= 1 && j.groups >= 1 && j.steps_per_sync >= 1,
                   "sim::failing_job: expected gpus, gpus_per_node, groups and steps_per_sync "
                   ">= 1, found ",
                   j.gpus, ", ", j.gpus_per_node, ", ", j.groups, " and ", j.steps_per_sync);
  FEDSHARD_EXPECTS(j.step_s > 0 && std::isfinite(j.step_s) && j.state_bytes_per_gpu >= 0 &&
                       j.heal_bytes_per_s > 0 && j.heal_latency_s >= 0 &&
                       j.heal_host_bytes_per_s >= 0 && std::isfinite(j.heal_host_bytes_per_s),
                   "sim::failing_job: expected step_s > 0, state_bytes_per_gpu >= 0, "
                   "heal_bytes_per_s > 0, heal_latency_s >= 0 and heal_host_bytes_per_s >= 0, "
                   "found ",
                   j.step_s, ", ", j.state_bytes_per_gpu, ", ", j.heal_bytes_per_s, ", ",
                   j.heal_latency_s, " and ", j.heal_host_bytes_per_s);
}

/// λ: failures per second of the whole job.
inline double failure_rate(const failing_job& j, const failure_settings& f) {
  const int nodes = (j.gpus + j.gpus_per_node - 1) / j.gpus_per_node;
  return (f.per_node ? nodes : j.gpus) / (f.mtbf_hours * 3600);
}

/// Bytes one node holds: its GPUs' state.
inline double node_bytes(const failing_job& j) {
  return j.state_bytes_per_gpu * std::min(j.gpus_per_node, j.gpus);
}

/// One group's heal: the node's state over its network, after the latency, plus the host
/// passes at heal_host_bytes_per_s when priced.
inline double heal_seconds(const failing_job& j) {
  const double b = node_bytes(j);
  return j.heal_latency_s + b / j.heal_bytes_per_s +
         (j.heal_host_bytes_per_s > 0 ? b / j.heal_host_bytes_per_s : 0.0);
}

/// A drop-out scheme: per failure, the stall plus 1/G of the group's absence (restart and
/// heal) and of its lost work (`lost_steps` steps); `overhead` of every step.
inline scheme_price drop_out(std::string name, const failing_job& j, const failure_settings& f,
                             double lost_steps, double overhead) {
  check_job(j);
  f.check();
  scheme_price p{.scheme = std::move(name)};
  const double lambda = failure_rate(j, f);
  p.failures_per_hour = lambda * 3600;
  p.heal_s = heal_seconds(j);
  p.lost_per_failure_s =
      f.detect_s + (f.group_restart_s + p.heal_s + lost_steps * j.step_s) / j.groups;
  p.overhead = overhead;
  p.effective = (1 - overhead) * std::max(0.0, 1 - lambda * p.lost_per_failure_s);
  return p;
}

}  // namespace detail

/// The whole job saves every τ and restarts from the last save after a failure.
inline scheme_price checkpoint_restart(const failing_job& j, const failure_settings& f) {
  detail::check_job(j);
  f.check();
  scheme_price p{.scheme = "checkpoint-restart"};
  const double lambda = detail::failure_rate(j, f);
  p.failures_per_hour = lambda * 3600;
  p.checkpoint_s = detail::node_bytes(j) / f.storage_bytes_per_s;
  p.checkpoint_every_s =
      f.checkpoint_every_s ? *f.checkpoint_every_s : std::sqrt(2 * p.checkpoint_s / lambda);
  const double tau = p.checkpoint_every_s;
  p.lost_per_failure_s = f.detect_s + f.restart_s + p.checkpoint_s + (tau + p.checkpoint_s) / 2;
  p.overhead = p.checkpoint_s / (tau + p.checkpoint_s);
  p.effective = (1 - p.overhead) * std::max(0.0, 1 - lambda * p.lost_per_failure_s);
  return p;
}

/// fedshard's groups as jobs: a dead group drops out, restarts and heals from a donor.
inline scheme_price elastic_groups(const failing_job& j, const failure_settings& f) {
  return detail::drop_out("elastic groups", j, f, j.steps_per_sync / 2.0, 0.0);
}

/// A quorum every step (torchft's fault-tolerant HSDP): a dead replica group drops out and
/// heals; every step pays failure_settings::quorum_s.
inline scheme_price per_step_quorum(const failing_job& j, const failure_settings& f) {
  return detail::drop_out("per-step quorum", j, f, 0.5, f.quorum_s / (j.step_s + f.quorum_s));
}

}  // namespace fedshard::sim
