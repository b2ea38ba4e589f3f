#pragma once
/// The executor: runs comm_ops of a plan on a mesh's communicators and counts what it ran.

#include <chrono>
#include <cstdint>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/comm/request.hpp"
#include "fedshard/error.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/plan/traffic.hpp"

namespace fedshard {

/// An op started by executor::start, finished by executor::wait.
struct pending_op {
  request req;
  axis on = axis::world;
};

/// Runs comm_ops on the communicators of a mesh; every op it runs is recorded in traffic().
/// Buffers: all_gather reads bytes / ranks from `in` and writes bytes to `out`;
/// reduce_scatter reads bytes from `in` and writes bytes / ranks to `out`; all_reduce and
/// broadcast move bytes (in may equal out; broadcast uses `out` only, from axis rank 0).
template <Communicator C>
class executor {
 public:
  explicit executor(mesh<C>& m) : mesh_(&m) {}

  /// Runs op to completion.
  void run(const comm_op& op, const void* in, void* out) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::int64_t n = count_of(op);
    C& c = mesh_->comm(op.on);
    switch (op.kind) {
      case comm_kind::all_gather: c.all_gather(in, out, n / op.ranks, op.type); break;
      case comm_kind::reduce_scatter:
        c.reduce_scatter(in, out, n / op.ranks, op.type, op.op);
        break;
      case comm_kind::all_reduce: c.all_reduce(in, out, n, op.type, op.op); break;
      case comm_kind::broadcast: c.broadcast(out, n, op.type, 0); break;
      case comm_kind::send_recv: unsupported(op);
    }
    traffic_.record(op, seconds_since(t0));
  }

  /// Starts op; finish it with wait(). Counted when started; the time is counted by wait().
  pending_op start(const comm_op& op, const void* in, void* out) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::int64_t n = count_of(op);
    C& c = mesh_->comm(op.on);
    pending_op p;
    p.on = op.on;
    switch (op.kind) {
      case comm_kind::all_gather: p.req = c.all_gather_async(in, out, n / op.ranks, op.type); break;
      case comm_kind::reduce_scatter:
        p.req = c.reduce_scatter_async(in, out, n / op.ranks, op.type, op.op);
        break;
      case comm_kind::all_reduce: p.req = c.all_reduce_async(in, out, n, op.type, op.op); break;
      case comm_kind::broadcast: p.req = c.broadcast_async(out, n, op.type, 0); break;
      case comm_kind::send_recv: unsupported(op);
    }
    traffic_.record(op, seconds_since(t0));
    return p;
  }

  /// Waits for a started op; the time blocked is added to its axis.
  void wait(pending_op& p) {
    if (!p.req.pending()) return;
    const auto t0 = std::chrono::steady_clock::now();
    p.req.wait();
    traffic_.add_time(p.on, seconds_since(t0));
  }

  traffic_counters& traffic() noexcept { return traffic_; }
  const traffic_counters& traffic() const noexcept { return traffic_; }
  mesh<C>& topology() noexcept { return *mesh_; }

 private:
  static double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  [[noreturn]] static void unsupported(const comm_op& op) {
    throw invalid_argument(
        detail::concat("fedshard: executor: ", describe(op), " is not supported by the executor"));
  }
  std::int64_t count_of(const comm_op& op) const {
    const int ranks = mesh_->axis_size(op.on);
    FEDSHARD_EXPECTS(op.ranks == ranks, "executor: ", describe(op), " was planned for ", op.ranks,
                     " ranks but the mesh's ", to_string(op.on), " axis has ", ranks);
    const auto esz = static_cast<std::int64_t>(size_of(op.type));
    FEDSHARD_EXPECTS(op.bytes >= 0 && op.bytes % esz == 0, "executor: ", describe(op),
                     ": bytes must be a multiple of the element size ", esz);
    const std::int64_t n = op.bytes / esz;
    if (op.kind == comm_kind::all_gather || op.kind == comm_kind::reduce_scatter)
      FEDSHARD_EXPECTS(n % op.ranks == 0, "executor: ", describe(op), ": ", n,
                       " elements do not split evenly over ", op.ranks, " ranks");
    return n;
  }

  mesh<C>* mesh_;
  traffic_counters traffic_;
};

}  // namespace fedshard
