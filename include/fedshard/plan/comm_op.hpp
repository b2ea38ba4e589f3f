#pragma once
/// The schedule as data: comm_op (one collective of a step) and plan (a step's list of them).
///
/// Policies describe what must move as a plan; the executor runs it on real communicators and
/// counts what it ran; the simulator prices the same plan. `bytes` is the size of the whole
/// array in the nccl-tests sense (the gathered unit for all_gather, the input for
/// reduce_scatter, the buffer for all_reduce and broadcast); the bytes each rank sends follow
/// from the bus factor of the op and the number of ranks on its axis.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/error.hpp"
#include "fedshard/mesh/axis.hpp"

namespace fedshard {

/// What a comm_op does.
enum class comm_kind : std::uint8_t {
  all_gather,
  reduce_scatter,
  all_reduce,
  broadcast,
  send_recv
};

/// When in a step a comm_op runs.
enum class phase : std::uint8_t { forward, backward, optimizer, sync };

constexpr std::string_view to_string(comm_kind k) noexcept {
  switch (k) {
    case comm_kind::all_gather: return "all_gather";
    case comm_kind::reduce_scatter: return "reduce_scatter";
    case comm_kind::all_reduce: return "all_reduce";
    case comm_kind::broadcast: return "broadcast";
    case comm_kind::send_recv: return "send_recv";
  }
  return "unknown-kind";
}

constexpr std::string_view to_string(phase p) noexcept {
  switch (p) {
    case phase::forward: return "forward";
    case phase::backward: return "backward";
    case phase::optimizer: return "optimizer";
    case phase::sync: return "sync";
  }
  return "unknown-phase";
}

/// One collective of a step's schedule.
struct comm_op {
  comm_kind kind = comm_kind::all_reduce;
  axis on = axis::world;
  std::int64_t bytes = 0;  ///< size of the whole array (nccl-tests S), in `type`
  dtype type = dtype::f32;
  int unit = -1;  ///< the unit it moves, -1 for all units at once
  phase when = phase::forward;
  int ranks = 1;  ///< ranks on the axis
  reduce_op op = reduce_op::avg;
  bool overlappable = true;  ///< may run behind compute (the simulator's overlap model)

  friend bool operator==(const comm_op&, const comm_op&) = default;
};

/// nccl-tests bus factor: bytes each rank sends = factor x bytes (ring algorithms).
constexpr double bus_factor(comm_kind k, int ranks) noexcept {
  if (ranks <= 1) return 0.0;
  const double n = ranks;
  switch (k) {
    case comm_kind::all_reduce: return 2.0 * (n - 1) / n;
    case comm_kind::all_gather:
    case comm_kind::reduce_scatter: return (n - 1) / n;
    case comm_kind::broadcast:
    case comm_kind::send_recv: return 1.0;
  }
  return 0.0;
}

/// Bytes one rank sends to run op (bus factor x array bytes).
constexpr double wire_bytes(const comm_op& op) noexcept {
  return bus_factor(op.kind, op.ranks) * static_cast<double>(op.bytes);
}

/// A human-readable line for op.
inline std::string describe(const comm_op& op) {
  return detail::concat(to_string(op.kind), " on ", to_string(op.on), " (", op.ranks, " ranks), ",
                        op.bytes, " B of ", to_string(op.type), ", unit ", op.unit, ", ",
                        to_string(op.when));
}

/// A step's schedule: comm_ops in the order they are issued.
struct plan {
  std::vector<comm_op> ops;

  /// Bytes one rank sends on axis a over the whole plan.
  double wire_bytes_on(axis a) const {
    double b = 0;
    for (const auto& op : ops)
      if (op.on == a) b += wire_bytes(op);
    return b;
  }
  /// Number of ops on axis a.
  std::int64_t calls_on(axis a) const {
    std::int64_t c = 0;
    for (const auto& op : ops) c += (op.on == a) ? 1 : 0;
    return c;
  }
  /// Appends the ops of another plan.
  plan& append(const plan& other) {
    const std::size_t n = other.ops.size();  // other may be *this
    ops.reserve(ops.size() + n);
    for (std::size_t i = 0; i < n; ++i) ops.push_back(other.ops[i]);
    return *this;
  }
};

}  // namespace fedshard
