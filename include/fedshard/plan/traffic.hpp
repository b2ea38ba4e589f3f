#pragma once
/// Traffic counters: calls, bytes and time per mesh axis. The wire tap (plan/wire_tap.hpp)
/// records into them each call as issued and the bytes the backend reports it moved;
/// traffic_counters::of(plan) gives what a plan would move, so tests compare the two.
///
/// Two measures of bytes:
///  - wire_bytes: nccl-tests' bus bytes of the call as issued (bus factor x S), the same
///    formula on both sides: it checks that the calls are the plan's, not what moved;
///  - sent and received: what the backend reported it moved (comm/communicator.hpp,
///    moved()), against the plan's closed forms (moved_total: the bytes all ranks of an op's
///    communicator send together, for the algorithm the communicator says it runs). A rank's
///    own figure depends on where chunk boundaries and roots fall; the sum over every rank of
///    the communicators does not, so moved_mismatch compares counters summed over ranks
///    (traffic_counters::sum). A backend that moves more than its plan fails it.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/mesh/axis.hpp"
#include "fedshard/plan/comm_op.hpp"

namespace fedshard {

/// The collective a comm_op's kind runs (point-to-point kinds are none: all_reduce, unused).
constexpr collective collective_of(comm_kind k) noexcept {
  if (k == comm_kind::all_gather) return collective::all_gather;
  if (k == comm_kind::reduce_scatter) return collective::reduce_scatter;
  if (k == comm_kind::broadcast) return collective::broadcast;
  return collective::all_reduce;
}

/// The bytes all ranks of op's communicator send together (and receive together) to run what
/// op carries (carried(op)) with algorithm a; S = its bytes, n = its ranks (see
/// wire_algorithm): ring 2 (n-1) S for all_reduce, (n-1) S for all_gather, reduce_scatter
/// and broadcast; gather_all n (n-1) S for all_reduce and reduce_scatter. A send_recv is one
/// message of S each way between a pair: 2 S.
inline std::int64_t moved_total(const comm_op& op, wire_algorithm a = wire_algorithm::ring) {
  const comm_op c = carried(op);
  const std::int64_t n = c.ranks, s = c.bytes;
  if (c.kind == comm_kind::send_recv) return 2 * s;
  if (c.kind == comm_kind::send) return s;  // one message, from this rank
  if (c.kind == comm_kind::recv) return 0;  // its sender's op counts it
  if (n <= 1) return 0;
  const bool gathers = a == wire_algorithm::gather_all && reduces(c.kind);
  if (gathers) return n * (n - 1) * s;
  return (c.kind == comm_kind::all_reduce ? 2 : 1) * (n - 1) * s;
}

/// The bytes one rank of op's communicator sends (and receives) on average: moved_total over
/// the ranks (over the pair for send_recv: S).
inline double moved_share(const comm_op& op, wire_algorithm a = wire_algorithm::ring) {
  const comm_op c = carried(op);
  const int n = c.kind == comm_kind::send_recv ? 2 : c.ranks;
  return static_cast<double>(moved_total(op, a)) / static_cast<double>(n);
}

/// Totals for one axis.
struct axis_traffic {
  std::int64_t calls = 0;
  std::int64_t payload_bytes = 0;  ///< sum of the calls' array bytes (nccl-tests S)
  double wire_bytes = 0;           ///< bus bytes of the calls as issued (bus factor x payload)
  double seconds = 0;              ///< time this rank spent in (or waiting for) the calls
  double sent = 0;      ///< bytes this rank sent: reported by the backend, or the plan's share
  double received = 0;  ///< bytes this rank received: likewise

  friend bool operator==(const axis_traffic&, const axis_traffic&) = default;
  /// Adds another set of counters, field by field.
  axis_traffic& operator+=(const axis_traffic& o) {
    calls += o.calls;
    payload_bytes += o.payload_bytes;
    wire_bytes += o.wire_bytes;
    seconds += o.seconds;
    sent += o.sent;
    received += o.received;
    return *this;
  }
};

/// The algorithm c, the communicator of op's axis, runs what op carries with (the call
/// start_op makes: c.algorithm_of with its count); a point-to-point message is ring.
template <Communicator C>
wire_algorithm algorithm_on(const C& c, const comm_op& op) {
  const comm_op w = carried(op);
  if (point_to_point(w.kind) || !is_valid(w.dtype)) return wire_algorithm::ring;
  std::int64_t n = w.bytes / static_cast<std::int64_t>(size_of(w.dtype));
  if (w.kind == comm_kind::all_gather || w.kind == comm_kind::reduce_scatter)
    n /= std::max(1, w.ranks);
  return c.algorithm_of(collective_of(w.kind), n, w.dtype);
}

/// The algorithm each op of a plan runs with; empty: every op a ring.
using algorithm_for = std::function<wire_algorithm(const comm_op&)>;

/// Per-axis counters of one rank.
class traffic_counters {
 public:
  /// Counts one call of `kind` moving an array of `bytes` over `ranks` ranks on axis a, which
  /// sent and received what `moved` says.
  void record(axis a, comm_kind kind, std::int64_t bytes, int ranks, double seconds = 0,
              moved_bytes moved = {}) {
    auto& t = per_axis_[index(a)];
    ++t.calls;
    t.payload_bytes += bytes;
    t.wire_bytes += bus_factor(kind, ranks) * static_cast<double>(bytes);
    t.seconds += seconds;
    t.sent += static_cast<double>(moved.sent);
    t.received += static_cast<double>(moved.received);
  }
  /// Counts one op as the plan describes it (a local op: nothing): what it carries on the
  /// wire (carried(op)), and
  /// moved_share(op, algo) sent and received. A one-way send is sent by this rank alone; a
  /// recv is not a call (its message is counted by its sender, as the wire tap counts it),
  /// only bytes received.
  void record(const comm_op& op, double seconds = 0, wire_algorithm algo = wire_algorithm::ring) {
    if (local(op.kind)) return;  // not a call, nothing moved
    if (op.kind == comm_kind::recv) {
      per_axis_[index(op.axis)].received += static_cast<double>(op.bytes);
      return;
    }
    const comm_op c = carried(op);
    record(c.axis, c.kind, c.bytes, c.ranks, seconds);
    auto& t = per_axis_[index(c.axis)];
    if (op.kind == comm_kind::send) {
      t.sent += static_cast<double>(op.bytes);
      return;
    }
    t.sent += moved_share(op, algo);
    t.received += moved_share(op, algo);
  }
  /// Adds bytes moved without counting a call (a receive, whose send is the call).
  void record_moved(axis a, moved_bytes m) {
    auto& t = per_axis_[index(a)];
    t.sent += static_cast<double>(m.sent);
    t.received += static_cast<double>(m.received);
  }
  /// Adds time spent waiting for a call already counted.
  void add_time(axis a, double seconds) { per_axis_[index(a)].seconds += seconds; }
  const axis_traffic& operator[](axis a) const { return per_axis_[index(a)]; }
  /// Sums over all axes.
  axis_traffic total() const {
    axis_traffic s;
    for (const auto& t : per_axis_) s += t;
    return s;
  }
  void reset() { per_axis_ = {}; }
  /// Adds another rank's (or run's) counters, axis by axis.
  traffic_counters& operator+=(const traffic_counters& o) {
    for (std::size_t i = 0; i < per_axis_.size(); ++i) per_axis_[i] += o.per_axis_[i];
    return *this;
  }
  /// The counters of several ranks added up.
  static traffic_counters sum(std::span<const traffic_counters> ranks) {
    traffic_counters c;
    for (const auto& r : ranks) c += r;
    return c;
  }
  /// The counters a plan would produce if run `times` times (time left at zero), each op
  /// moving what algo(op) moves (a ring when algo is empty).
  static traffic_counters of(const plan& p, int times = 1, const algorithm_for& algo = {}) {
    traffic_counters c;
    for (int i = 0; i < times; ++i)
      for (const auto& op : p.ops) c.record(op, 0, algo ? algo(op) : wire_algorithm::ring);
    return c;
  }
  /// Equal calls, payload and bus bytes on every axis (times and moved bytes are not
  /// compared: see moved_mismatch).
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

/// The wire-equals-plan check: "" when, on every axis, the bytes the backends reported sent
/// and received equal the plan's closed forms; else one line per axis that differs, with both
/// figures. Both counters must cover the same ranks: every rank of the communicators their
/// calls ran on (traffic_counters::sum of every rank's tap, and of every rank's plan), where
/// the plan's shares add up to whole bytes.
inline std::string moved_mismatch(const traffic_counters& reported,
                                  const traffic_counters& planned) {
  std::string out;
  for (axis a : all_axes) {
    const axis_traffic& r = reported[a];
    const axis_traffic& p = planned[a];
    const auto whole = [](double b) { return static_cast<std::int64_t>(std::llround(b)); };
    if (whole(r.sent) == whole(p.sent) && whole(r.received) == whole(p.received)) continue;
    out += detail::concat(out.empty() ? "" : "\n", to_string(a), ": the backends moved ",
                          whole(r.sent), " B sent / ", whole(r.received), " B received, the plan ",
                          whole(p.sent), " B / ", whole(p.received), " B");
  }
  return out;
}

}  // namespace fedshard
