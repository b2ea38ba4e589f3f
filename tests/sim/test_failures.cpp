// Failures priced (sim/failures.hpp): the three recovery schemes on a small job whose
// numbers are worked by hand, how they move with the failure rate, and bad settings refused.
#include <doctest/doctest.h>

#include <cmath>
#include <string>

#include "fedshard/error.hpp"
#include "fedshard/sim/failures.hpp"
#include "support/sim.hpp"

using namespace fedshard;
using namespace fedshard::sim;
using fedshard::test::error_of;

namespace {

/// 8 GPUs on 2 nodes of 4, 1 s steps, 1 GB of state per GPU (4 GB a node), 2 groups syncing
/// every 8 steps, heals at 4 GB/s. With an MTBF of 8 h per GPU the job fails once an hour:
/// λ = 8 / (8 x 3600) = 1 / 3600 per second.
failing_job small_job() {
  return {.gpus = 8,
          .gpus_per_node = 4,
          .step_s = 1.0,
          .state_bytes_per_gpu = 1e9,
          .groups = 2,
          .steps_per_sync = 8,
          .heal_bytes_per_s = 4e9,
          .heal_latency_s = 0.0};
}

failure_settings hourly() {
  failure_settings f;
  f.mtbf_hours = 8;
  f.detect_s = 10;
  f.restart_s = 300;
  f.group_restart_s = 120;
  f.storage_bytes_per_s = 2e9;
  f.quorum_s = 0.02;
  return f;
}

}  // namespace

TEST_CASE("checkpoint-restart: Young's interval, a save's overhead, and each failure's loss") {
  // C = 4 GB / 2 GB/s = 2 s; τ = sqrt(2 C / λ) = sqrt(2 x 2 x 3600) = 120 s.
  // Per failure: detect 10 + restart 300 + reload 2 + rework (120 + 2) / 2 = 61 -> 373 s.
  // Effective: (1 - 2 / 122) x (1 - 373 / 3600) = 0.9836066 x 0.8963889 = 0.8816940.
  const scheme_price p = checkpoint_restart(small_job(), hourly());
  CHECK(p.scheme == "checkpoint-restart");
  CHECK(p.failures_per_hour == doctest::Approx(1.0));
  CHECK(p.checkpoint_s == doctest::Approx(2.0));
  CHECK(p.checkpoint_every_s == doctest::Approx(120.0));
  CHECK(p.lost_per_failure_s == doctest::Approx(373.0));
  CHECK(p.overhead == doctest::Approx(2.0 / 122.0));
  CHECK(p.effective == doctest::Approx(0.8816940).epsilon(1e-6));
  // A fixed interval instead: τ = 600 s -> loss 10 + 300 + 2 + 301 = 613 s,
  // effective (600 / 602) x (1 - 613 / 3600).
  failure_settings f = hourly();
  f.checkpoint_every_s = 600;
  const scheme_price q = checkpoint_restart(small_job(), f);
  CHECK(q.lost_per_failure_s == doctest::Approx(613.0));
  CHECK(q.effective == doctest::Approx(600.0 / 602.0 * (1 - 613.0 / 3600.0)));
  CHECK(q.effective < p.effective);  // Young's interval is the better one here
}

TEST_CASE("elastic groups: one stall for everyone, the rest of the absence on 1/G") {
  // Heal: 4 GB at 4 GB/s = 1 s. Per failure: detect 10 + (restart 120 + heal 1 + K/2 = 4
  // steps of 1 s) / 2 groups = 10 + 62.5 = 72.5 s; no overhead.
  const scheme_price p = elastic_groups(small_job(), hourly());
  CHECK(p.heal_s == doctest::Approx(1.0));
  CHECK(p.lost_per_failure_s == doctest::Approx(72.5));
  CHECK(p.overhead == 0.0);
  CHECK(p.effective == doctest::Approx(1 - 72.5 / 3600));
  // More groups share the absence more thinly: G = 8 -> 10 + 125 / 8 = 25.625 s.
  failing_job eight = small_job();
  eight.groups = 8;
  CHECK(elastic_groups(eight, hourly()).lost_per_failure_s == doctest::Approx(25.625));
}

TEST_CASE("a heal's host passes, when priced, add the node's state at their rate") {
  // 4 GB: 1 s over the network, + 0.25 s latency, + 4 GB at 2 GB/s of host passes = 3.25 s;
  // per failure 10 + (120 + 3.25 + 4) / 2 = 73.625 s.
  failing_job j = small_job();
  j.heal_latency_s = 0.25;
  j.heal_host_bytes_per_s = 2e9;
  const scheme_price p = elastic_groups(j, hourly());
  CHECK(p.heal_s == doctest::Approx(3.25));
  CHECK(p.lost_per_failure_s == doctest::Approx(73.625));
  CHECK(per_step_quorum(j, hourly()).heal_s == doctest::Approx(3.25));
  j.heal_host_bytes_per_s = -1;
  CHECK(error_of([&] { (void)elastic_groups(j, hourly()); }).find("heal_host_bytes_per_s >= 0") !=
        std::string::npos);
}

TEST_CASE("per-step quorum: half a step lost, a quorum paid every step") {
  // Per failure: 10 + (120 + 1 + 0.5) / 2 = 70.75 s; overhead 0.02 / 1.02 of every step.
  const scheme_price p = per_step_quorum(small_job(), hourly());
  CHECK(p.lost_per_failure_s == doctest::Approx(70.75));
  CHECK(p.overhead == doctest::Approx(0.02 / 1.02));
  CHECK(p.effective == doctest::Approx((1 / 1.02) * (1 - 70.75 / 3600)));
}

TEST_CASE("the failure rate: per GPU or per node; rarer failures favour checkpoints") {
  failure_settings f = hourly();
  f.per_node = true;  // 2 nodes at 8 h each: λ = 1 / 14400 per second
  CHECK(elastic_groups(small_job(), f).failures_per_hour == doctest::Approx(0.25));
  // As failures grow rare every scheme tends to its overhead alone: checkpoint-restart's
  // Young interval grows as 1 / sqrt(λ), so it overtakes the quorum's fixed 2% per step.
  f = hourly();
  f.mtbf_hours = 8e6;
  const double cr = checkpoint_restart(small_job(), f).effective;
  const double quorum = per_step_quorum(small_job(), f).effective;
  const double elastic = elastic_groups(small_job(), f).effective;
  CHECK(cr > quorum);
  CHECK(elastic > cr);  // no overhead at all
  // Frequent failures: checkpoint-restart loses everything (clamped at 0, not negative).
  f.mtbf_hours = 0.5;  // 16 failures an hour
  CHECK(checkpoint_restart(small_job(), f).effective == 0.0);
  CHECK(elastic_groups(small_job(), f).effective > 0.6);
}

TEST_CASE("bad settings are refused with the setting's name") {
  failure_settings f = hourly();
  f.mtbf_hours = 0;
  CHECK(error_of([&] {
          (void)elastic_groups(small_job(), f);
        }).find("mtbf_hours: expected a finite number > 0, found 0") != std::string::npos);
  f = hourly();
  f.storage_bytes_per_s = -1;
  CHECK(error_of([&] { (void)checkpoint_restart(small_job(), f); }).find("storage_bytes_per_s") !=
        std::string::npos);
  f = hourly();
  f.checkpoint_every_s = 0.0;
  CHECK(error_of([&] {
          (void)checkpoint_restart(small_job(), f);
        }).find("checkpoint_every_s: expected finite seconds > 0") != std::string::npos);
  failing_job j = small_job();
  j.groups = 0;
  CHECK(error_of([&] {
          (void)per_step_quorum(j, hourly());
        }).find("expected gpus, gpus_per_node, groups and steps_per_sync >= 1") !=
        std::string::npos);
  j = small_job();
  j.heal_bytes_per_s = 0;
  CHECK(error_of([&] { (void)elastic_groups(j, hourly()); }).find("heal_bytes_per_s > 0") !=
        std::string::npos);
}
