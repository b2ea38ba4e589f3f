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
/// Chains driven by the host (time_step's host_driven: communicators that are not
/// stream-ordered, plan/interpreter.hpp): firing an event issues only the first op of its
/// chain; the interpreter issues a follow-up op when the rank next enters it (a firing, or a
/// wait) after its predecessor completed. The rank returns from a firing at once and
/// computes, so a follow-up cannot start before the firing after the next compute segment:
/// a reduce_scatter's replica all_reduce (HSDP) leaves one unit's backward later than it
/// would on a stream. While the rank blocks on a chain with a follow-up pending, the
/// interpreter first drives the earlier chains with follow-ups pending (their ops then start
/// as soon as their predecessors complete), and at the end of the step it drives them all.
///
/// The compute seconds C of a step are split over units in proportion to their elements,
/// one third forward and two thirds backward (backward computes two products per forward
/// one). The step ends when the compute is done and every op has completed.

#include <algorithm>
#include <cstddef>
#include <deque>
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

namespace detail {

/// The event of an inner step that issues ops: a trigger, its phase (acquire's; setup for
/// the others) and its unit (-1 for end_of_backward).
using step_event = std::tuple<trigger, phase, int>;

/// The state of time_step as it walks the engine's order: the compute stream's clock, the
/// channel, and which events were issued when.
class step_clock {
 public:
  step_clock(const std::vector<comm_op>& ops, const std::vector<op_time>& times,
             const std::vector<double>& unit_elements, double compute, bool host_driven)
      : ops_(ops),
        times_(times),
        unit_elements_(unit_elements),
        units_(static_cast<int>(unit_elements.size())),
        host_driven_(host_driven) {
    out_.compute = compute;
    for (double e : unit_elements) total_ += e;
    // The ops of each event, in plan order.
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const comm_op& op = ops[i];
      FEDSHARD_EXPECTS(op.unit < units_, "sim::time_step: ", describe(op), " names unit ", op.unit,
                       " of a model of ", units_, " units");
      const phase ph = op.trigger == trigger::acquire ? op.phase : phase::setup;
      by_event_[{op.trigger, ph, op.trigger == trigger::end_of_backward ? -1 : op.unit}].push_back(
          i);
    }
  }

  /// Forward, backward and end_of_backward in the engine's order; the step's timeline.
  step_timeline run() {
    for (int u = 0; u < units_; ++u) {
      const step_event a{trigger::acquire, phase::forward, u};
      issue(a, t_);
      if (u + 1 < units_) issue({trigger::acquire, phase::forward, u + 1}, t_);
      wait_for(a);
      compute_segment(share(u) / 3, false);
    }
    for (int u = units_ - 1; u >= 0; --u) {
      const step_event a{trigger::acquire, phase::backward, u};
      issue(a, t_);
      if (u > 0) issue({trigger::acquire, phase::backward, u - 1}, t_);
      wait_for(a);
      compute_segment(share(u) * 2 / 3, u == 0);
      const step_event g{trigger::grads_ready, phase::setup, u};
      issue(g, t_);
      if (blocking(g)) wait_for(g);
    }
    if (units_ == 0) compute_segment(1, true);
    issue({trigger::end_of_backward, phase::setup, -1}, t_);
    for (const auto& [k, idx] : by_event_)
      FEDSHARD_EXPECTS(issued_.count(k) == 1, "sim::time_step: ", describe(ops_[idx.front()]),
                       " has a trigger no inner step fires (a step plan runs at acquire, "
                       "grads_ready and end_of_backward)");
    drain();
    out_.step = std::max(t_, last_done_);
    out_.waiting = out_.step - out_.compute;
    return out_;
  }

 private:
  /// A host-driven chain whose follow-ups are not all issued: its ops, the next one, when
  /// the one before it completes, and the compute segment in which that one was issued.
  struct pending_chain {
    step_event event;
    std::vector<std::size_t> ops;
    std::size_t next = 1;
    double done = 0;
    int segment = 0;
    bool finished() const { return next == ops.size(); }
  };

  /// Unit u's share of the compute.
  double share(int u) const {
    return total_ > 0 ? unit_elements_[static_cast<std::size_t>(u)] / total_
                      : 1.0 / std::max(1, units_);
  }
  /// The compute stream waits until `ready`.
  void wait_until(double ready) {
    if (ready > t_) stalled_ += ready - t_, t_ = ready;
  }
  /// Op i started at `at` (its predecessor completed by then); returns when it completes. An
  /// on-compute op first runs on the compute stream.
  double run_op(std::size_t i, double at) {
    const op_time& ot = times_[i];
    double done = at;
    if (ot.cpu > 0) {
      wait_until(done);
      stalled_ += ot.cpu, t_ += ot.cpu;
      out_.cpu += ot.cpu;
      done = t_;
    }
    if (ot.occupancy > 0 || ot.tail > 0) {
      const double start = std::max({at, done, channel_free_});
      channel_free_ = start + ot.occupancy;
      out_.busy += ot.occupancy;
      done = channel_free_ + ot.tail;
    }
    last_done_ = std::max(last_done_, done);
    return done;
  }
  /// Issues the ops of event k at time `at` (once): all of them, one after another, or, when
  /// host-driven, the first (the others wait in pending_).
  void issue(const step_event& k, double at) {
    if (issued_.count(k) != 0) return;
    if (host_driven_) enter();
    double done = at;
    if (auto it = by_event_.find(k); it != by_event_.end()) {
      const std::vector<std::size_t>& idx = it->second;
      const std::size_t now = host_driven_ ? 1 : idx.size();
      for (std::size_t j = 0; j < now; ++j) done = run_op(idx[j], done);
      if (now < idx.size()) pending_.push_back({k, idx, now, done, segment_});
    }
    issued_.emplace(k, done);
  }
  /// The host enters the interpreter at t_: follow-ups whose predecessor completed (and was
  /// issued before the last compute segment) start now, in firing order; a chain left with a
  /// follow-up pending holds back those of later chains.
  void enter() {
    for (pending_chain& c : pending_) {
      while (!c.finished() && c.segment < segment_ && c.done <= t_) {
        c.done = run_op(c.ops[c.next++], t_);
        c.segment = segment_;
      }
      if (!c.finished()) return;
    }
  }
  /// The host blocks on chain c: each of its follow-ups starts when its predecessor completes.
  void finish(pending_chain& c) {
    while (!c.finished()) {
      wait_until(c.done);
      c.done = run_op(c.ops[c.next++], t_);
    }
    issued_[c.event] = c.done;
  }
  /// The compute stream waits for event k's chain. A host-driven chain with follow-ups
  /// pending is driven to its end, after the earlier chains with follow-ups pending.
  void wait_for(const step_event& k) {
    if (host_driven_) {
      enter();
      const auto mine = std::find_if(pending_.begin(), pending_.end(), [&](const pending_chain& c) {
        return c.event == k && !c.finished();
      });
      if (mine != pending_.end())
        for (auto c = pending_.begin(); c != std::next(mine); ++c) finish(*c);
    }
    wait_until(issued_.at(k));
  }
  /// The end of the step: the host waits for every chain, driving their follow-ups.
  void drain() {
    for (pending_chain& c : pending_) finish(c);
  }
  /// True when some op of k may not run behind compute (the compute waits for it).
  bool blocking(const step_event& k) const {
    if (auto it = by_event_.find(k); it != by_event_.end())
      for (std::size_t i : it->second)
        if (!ops_[i].overlappable) return true;
    return false;
  }
  /// Ends a compute segment `fraction` of C later (the last one at exactly C, so that a step
  /// that never waits ends at exactly C).
  void compute_segment(double fraction, bool last) {
    ++segment_;
    done_fraction_ = last ? 1.0 : done_fraction_ + fraction;
    t_ = out_.compute * done_fraction_ + stalled_;
  }

  const std::vector<comm_op>& ops_;
  const std::vector<op_time>& times_;
  const std::vector<double>& unit_elements_;
  int units_;
  double total_ = 0;  // the units' elements
  std::map<step_event, std::vector<std::size_t>> by_event_;
  step_timeline out_;
  double t_ = 0;        // the compute stream: compute done so far + stalled_
  double stalled_ = 0;  // waits and on-compute ops
  double channel_free_ = 0;
  double last_done_ = 0;
  std::map<step_event, double> issued_;  // event -> completion of its last op issued so far
  double done_fraction_ = 0;             // of C, by the compute segments so far
  bool host_driven_ = false;
  int segment_ = 0;  // compute segments so far
  std::deque<pending_chain> pending_;
};

}  // namespace detail

/// The timeline of plan `step` (ops in plan order, times[i] for ops[i]) with compute seconds
/// C split over units by `unit_elements`. invalid_argument when the sizes disagree, or an op
/// names a unit outside [0, units) or has a trigger no inner step fires.
inline step_timeline time_step(const std::vector<comm_op>& ops, const std::vector<op_time>& times,
                               const std::vector<double>& unit_elements, double compute,
                               bool host_driven = false) {
  FEDSHARD_EXPECTS(ops.size() == times.size(), "sim::time_step: ", ops.size(), " ops but ",
                   times.size(), " op times");
  FEDSHARD_EXPECTS(compute >= 0, "sim::time_step: compute seconds must be >= 0, found ", compute);
  return detail::step_clock(ops, times, unit_elements, compute, host_driven).run();
}

}  // namespace fedshard::sim
