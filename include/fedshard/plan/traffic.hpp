#pragma once
/// Traffic counters: calls, bytes and time per mesh axis. The wire tap (plan/wire_tap.hpp)
/// records what each call actually moved into them; traffic_counters::of(plan) gives what a
/// plan would move, so tests compare the two.

#include <array>
#include <cstdint>

#include "fedshard/mesh/axis.hpp"
#include "fedshard/plan/comm_op.hpp"

namespace fedshard {

/// Totals for one axis.
struct axis_traffic {
  std::int64_t calls = 0;
  std::int64_t payload_bytes = 0;  ///< sum of the calls' array bytes (nccl-tests S)
  double wire_bytes = 0;           ///< bytes this rank sent (bus factor x payload)
  double seconds = 0;              ///< time this rank spent in (or waiting for) the calls

  friend bool operator==(const axis_traffic&, const axis_traffic&) = default;
};

/// Per-axis counters of one rank.
class traffic_counters {
 public:
  /// Counts one call of `kind` moving an array of `bytes` over `ranks` ranks on axis a.
  void record(axis a, comm_kind kind, std::int64_t bytes, int ranks, double seconds = 0) {
    auto& t = per_axis_[index(a)];
    ++t.calls;
    t.payload_bytes += bytes;
    t.wire_bytes += bus_factor(kind, ranks) * static_cast<double>(bytes);
    t.seconds += seconds;
  }
  /// Counts one op as the plan describes it (what it carries on the wire: carried(op)); a
  /// recv op is not counted (its message is, by its sender, as the wire tap counts it).
  void record(const comm_op& op, double seconds = 0) {
    if (op.kind == comm_kind::recv) return;
    const comm_op c = carried(op);
    record(c.axis, c.kind, c.bytes, c.ranks, seconds);
  }
  /// Adds time spent waiting for a call already counted.
  void add_time(axis a, double seconds) { per_axis_[index(a)].seconds += seconds; }
  const axis_traffic& operator[](axis a) const { return per_axis_[index(a)]; }
  /// Sums over all axes.
  axis_traffic total() const {
    axis_traffic s;
    for (const auto& t : per_axis_) {
      s.calls += t.calls;
      s.payload_bytes += t.payload_bytes;
      s.wire_bytes += t.wire_bytes;
      s.seconds += t.seconds;
    }
    return s;
  }
  void reset() { per_axis_ = {}; }
  /// The counters a plan would produce if run `times` times (time left at zero).
  static traffic_counters of(const plan& p, int times = 1) {
    traffic_counters c;
    for (int i = 0; i < times; ++i)
      for (const auto& op : p.ops) c.record(op);
    return c;
  }
  /// Equal calls and bytes on every axis (times are not compared).
  bool same_traffic(const traffic_counters& o) const {
    for (std::size_t i = 0; i < per_axis_.size(); ++i) {
      const auto& a = per_axis_[i];
      const auto& b = o.per_axis_[i];
      if (a.calls != b.calls || a.payload_bytes != b.payload_bytes || a.wire_bytes != b.wire_bytes)
        return false;
    }
    return true;
  }

 private:
  static std::size_t index(axis a) { return static_cast<std::size_t>(a); }
  std::array<axis_traffic, 5> per_axis_{};
};

}  // namespace fedshard
