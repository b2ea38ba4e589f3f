#pragma once
/// Test support: what a trainer's step should put on the wire according to its plans, and a
/// step-by-step comparison with what the wire taps recorded.
///
/// A step runs every op of the step plan once, plus, for each fragment whose schedule action
/// starts a sync, the sync plan's sync_prepare and sync_exchange ops, and for each one that
/// applies, its sync_finish and sync_after ops. The comparison is op by op: the recorded
/// calls and the expected ones, each (kind, axis, dtype, array bytes, ranks), are equal as
/// sorted lists (prefetching may change the order in which a step issues its ops, never
/// which ops it issues).

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "fedshard/plan/comm_op.hpp"
#include "fedshard/plan/wire_tap.hpp"
#include "fedshard/schedule/sync_schedule.hpp"

namespace fedshard::test {

/// The calls of p's ops for which keep(op) holds.
template <class Pred>
std::vector<wire_call> calls_of(const plan& p, Pred keep) {
  std::vector<wire_call> out;
  for (const auto& op : p.ops)
    if (keep(op)) out.push_back(wire_call::of(op));
  return out;
}

/// The calls of every op of p.
inline std::vector<wire_call> calls_of(const plan& p) {
  return calls_of(p, [](const comm_op&) { return true; });
}

/// What trainer t's step `step` of a run of `total` steps should move: the step plan and the
/// sync ops its schedule starts or applies.
template <class Trainer>
std::vector<wire_call> expected_step_calls(Trainer& t, std::int64_t step, std::int64_t total) {
  std::vector<wire_call> out = calls_of(t.step_plan());
  for (int f = 0; f < t.schedule().fragments(); ++f) {
    const auto a = t.schedule().action(f, step, total);
    const bool starts = schedule::starts(a), applies = schedule::applies(a);
    const auto sync = calls_of(t.sync_plan(f), [&](const comm_op& op) {
      const bool at_start =
          op.trigger == trigger::sync_prepare || op.trigger == trigger::sync_exchange;
      const bool at_apply = op.trigger == trigger::sync_finish || op.trigger == trigger::sync_after;
      return (starts && at_start) || (applies && at_apply);
    });
    out.insert(out.end(), sync.begin(), sync.end());
  }
  return out;
}

/// A readable list of calls, for failure messages.
inline std::string describe(const std::vector<wire_call>& calls) {
  std::ostringstream s;
  for (const auto& c : calls)
    s << "\n  " << to_string(c.kind) << " on " << to_string(c.axis) << " (" << c.ranks << "), "
      << c.bytes << " B of " << to_string(c.dtype);
  return s.str();
}

/// Empty when `got` and `want` hold the same calls (in any order); else both, sorted.
inline std::string compare_calls(std::vector<wire_call> got, std::vector<wire_call> want) {
  std::sort(got.begin(), got.end());
  std::sort(want.begin(), want.end());
  if (got == want) return {};
  return "recorded at the wire:" + describe(got) + "\nplanned:" + describe(want);
}

}  // namespace fedshard::test
