#pragma once
/// The timeline of one inner step as the engine runs it: compute unit by unit, each step op
/// issued at its trigger and run on the rank's one communication channel, so that what is
/// exposed follows from when each op can start and when the compute needs its result.
///
/// The engine's order (shard/engine.hpp): forward acquires units 0, 1, ..., U-1 and backward
/// U-1, ..., 0; acquiring a unit issues its gather (unless prefetched) and prefetches the next
/// unit of the same phase, then the compute waits for the unit's gather; a unit's gradients
/// issue the grads_ready ops after its backward; end_of_backward issues its ops and waits for
/// every op in flight. Ops of one trigger run one after another (each reads what the previous
/// one wrote: a reduce_scatter, then the replica all_reduce of its shard). An op the plan
/// marks not overlappable is waited for at once.
///
/// The channel: an op starts when it is issued, its predecessor of the same trigger is done
/// and the channel is free; it holds the channel for `occupancy` seconds and completes `tail`
/// seconds later. On NCCL's one stream the whole op holds the channel (tail 0); on a link
/// whose latency is propagation (a WAN, the demo's emulated link) ops in flight overlap
/// their latencies, so the latency is the tail (link_level::pipelined_latency).
///
/// An op whose level runs on the ranks' own processors (link_level::on_compute: thread ranks
/// copying and reducing in shared memory) is work of the compute stream: it runs there when
/// its trigger fires and delays the compute by its `cpu` seconds.
///
/// The compute seconds C of a step are split over units in proportion to their elements,
/// one third forward and two thirds backward (backward computes two products per forward
/// one). The step ends when the compute is done and every op has completed.

#include <algorithm>
#include <cstddef>
#include <map>
#include <tuple>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/plan/comm_op.hpp"

namespace fedshard::sim {

/// How long an op holds the channel, how much later it completes, and how long it runs on
/// the compute stream (an on-compute level's op).
struct op_time {
  double occupancy = 0;
  double tail = 0;
  double cpu = 0;
};

/// The timeline's result for one rank.
struct step_timeline {
  double step = 0;     ///< the last compute's or op's completion
  double compute = 0;  ///< C
  double waiting = 0;  ///< step - C: on-compute ops and waits for ops
  double busy = 0;     ///< seconds the channel was held
  double cpu = 0;      ///< seconds of on-compute ops
};

/// The timeline of plan `step` (ops in plan order, times[i] for ops[i]) with compute seconds
/// C split over units by `unit_elements`. invalid_argument when the sizes disagree, or an op
/// names a unit outside [0, units) or has a trigger no inner step fires.
inline step_timeline time_step(const std::vector<comm_op>& ops, const std::vector<op_time>& times,
                               const std::vector<double>& unit_elements, double compute) {
  FEDSHARD_EXPECTS(ops.size() == times.size(), "sim::time_step: ", ops.size(), " ops but ",
                   times.size(), " op times");
  FEDSHARD_EXPECTS(compute >= 0, "sim::time_step: compute seconds must be >= 0, found ", compute);
  const int units = static_cast<int>(unit_elements.size());
  double total = 0;
  for (double e : unit_elements) total += e;
  auto share = [&](int u) {
    return total > 0 ? unit_elements[static_cast<std::size_t>(u)] / total
                     : 1.0 / std::max(1, units);
  };

  // The ops of each (trigger, phase, unit), in plan order.
  using key = std::tuple<trigger, phase, int>;
  std::map<key, std::vector<std::size_t>> by_event;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const comm_op& op = ops[i];
    FEDSHARD_EXPECTS(op.unit < units, "sim::time_step: ", describe(op), " names unit ", op.unit,
                     " of a model of ", units, " units");
    const phase ph = op.trigger == trigger::acquire ? op.phase : phase::setup;
    by_event[{op.trigger, ph, op.trigger == trigger::end_of_backward ? -1 : op.unit}].push_back(i);
  }

  step_timeline out;
  out.compute = compute;
  // The compute stream: t = compute done so far + `stalled` (waits and on-compute ops), so
  // that a step that never waits ends at exactly C.
  double t = 0, stalled = 0;
  auto wait_until = [&](double ready) {
    if (ready > t) stalled += ready - t, t = ready;
  };
  double channel_free = 0;
  double last_done = 0;
  std::map<key, double> issued;  // event -> completion of its last op
  // Issues the ops of event k at time `at` (once); returns when the last one completes. An
  // on-compute op first runs on the compute stream.
  auto issue = [&](const key& k, double at) {
    if (auto it = issued.find(k); it != issued.end()) return it->second;
    double done = at;
    if (auto it = by_event.find(k); it != by_event.end())
      for (std::size_t i : it->second) {
        const op_time& ot = times[i];
        if (ot.cpu > 0) {
          wait_until(done);
          stalled += ot.cpu, t += ot.cpu;
          out.cpu += ot.cpu;
          done = t;
        }
        if (ot.occupancy > 0 || ot.tail > 0) {
          const double start = std::max({at, done, channel_free});
          channel_free = start + ot.occupancy;
          out.busy += ot.occupancy;
          done = channel_free + ot.tail;
        }
      }
    last_done = std::max(last_done, done);
    issued.emplace(k, done);
    return done;
  };
  // Waits for the ops of k the plan does not let run behind compute.
  auto blocking = [&](const key& k) {
    if (auto it = by_event.find(k); it != by_event.end())
      for (std::size_t i : it->second)
        if (!ops[i].overlappable) return true;
    return false;
  };
  // Compute segments end at these fractions of C (forward a third, backward two), the last
  // at exactly 1.
  double done_fraction = 0;
  auto compute_segment = [&](double fraction, bool last) {
    done_fraction = last ? 1.0 : done_fraction + fraction;
    t = compute * done_fraction + stalled;
  };

  for (int u = 0; u < units; ++u) {
    const double ready = issue({trigger::acquire, phase::forward, u}, t);
    if (u + 1 < units) issue({trigger::acquire, phase::forward, u + 1}, t);
    wait_until(ready);
    compute_segment(share(u) / 3, false);
  }
  for (int u = units - 1; u >= 0; --u) {
    const double ready = issue({trigger::acquire, phase::backward, u}, t);
    if (u > 0) issue({trigger::acquire, phase::backward, u - 1}, t);
    wait_until(ready);
    compute_segment(share(u) * 2 / 3, u == 0);
    const key g{trigger::grads_ready, phase::setup, u};
    const double reduced = issue(g, t);
    if (blocking(g)) wait_until(reduced);
  }
  if (units == 0) compute_segment(1, true);
  issue({trigger::end_of_backward, phase::setup, -1}, t);
  for (const auto& [k, idx] : by_event)
    FEDSHARD_EXPECTS(issued.count(k) == 1, "sim::time_step: ", describe(ops[idx.front()]),
                     " has a trigger no inner step fires (a step plan runs at acquire, "
                     "grads_ready and end_of_backward)");
  out.step = std::max(t, last_done);
  out.waiting = out.step - compute;
  return out;
}

}  // namespace fedshard::sim
