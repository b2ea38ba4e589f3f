#pragma once
/// The wire tap: a Communicator decorator that records what each call actually moved.
///
/// A wire_tap<C> forwards every call to the communicator it wraps and records, into a
/// wire_log, the call as the wire saw it: kind, axis, dtype, array bytes (element count x
/// dtype size, nccl-tests S: count x size() for all_gather and reduce_scatter) and the ranks,
/// plus the time spent in the call or waiting for it. It knows nothing of plans: tests compare
/// what it recorded with the plan the policies emitted. Point-to-point messages are counted by
/// the sender; barriers and splits move no data and are not counted.

#include <chrono>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/comm/request.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/mesh/axis.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/plan/traffic.hpp"
#include "fedshard/space/space_of.hpp"

namespace fedshard {

/// One call as the wire saw it.
struct wire_call {
  comm_kind kind = comm_kind::all_reduce;
  fedshard::axis axis = fedshard::axis::world;
  fedshard::dtype dtype = fedshard::dtype::f32;
  std::int64_t bytes = 0;  ///< array bytes (nccl-tests S)
  int ranks = 1;

  /// The call a plan's op makes (for an encoded op, the all_gather of its wires: carried; for
  /// a send_recv or a send, the message it sends: a send_recv call of 2 ranks). A recv op's
  /// message is recorded by its sender.
  static wire_call of(const comm_op& op) {
    const comm_op c = carried(op);
    const bool message = c.kind == comm_kind::send_recv || c.kind == comm_kind::send;
    return {message ? comm_kind::send_recv : c.kind, c.axis, c.dtype, c.bytes,
            message ? 2 : c.ranks};
  }
  friend bool operator==(const wire_call&, const wire_call&) = default;
  friend auto operator<=>(const wire_call&, const wire_call&) = default;
};

/// What one rank's taps recorded: per-axis counters and, when asked for, every call.
class wire_log {
 public:
  /// Per-axis calls, bytes and time.
  traffic_counters& traffic() noexcept { return traffic_; }
  const traffic_counters& traffic() const noexcept { return traffic_; }
  /// Keep (or stop keeping) the list of calls; off by default, since it grows every step.
  void keep_calls(bool on) { keep_ = on; }
  /// The calls recorded since keep_calls(true) or the last take_calls().
  const std::vector<wire_call>& calls() const noexcept { return calls_; }
  /// Returns the recorded calls and starts a new list.
  std::vector<wire_call> take_calls() { return std::exchange(calls_, {}); }

  /// Records one call and the time spent in it.
  void record(const wire_call& c, double seconds) {
    traffic_.record(c.axis, c.kind, c.bytes, c.ranks, seconds);
    if (keep_) calls_.push_back(c);
  }
  /// Adds time spent waiting for a call already recorded.
  void add_time(fedshard::axis a, double seconds) { traffic_.add_time(a, seconds); }

 private:
  traffic_counters traffic_;
  std::vector<wire_call> calls_;
  bool keep_ = false;
};

namespace detail {

using tap_clock = std::chrono::steady_clock;

inline double seconds_since(tap_clock::time_point t0) {
  return std::chrono::duration<double>(tap_clock::now() - t0).count();
}

/// A request whose wait time is added to an axis of a wire_log.
class timed_request final : public request_state {
 public:
  timed_request(request inner, wire_log* log, axis a)
      : inner_(std::move(inner)), log_(log), axis_(a) {}
  void wait() override {
    const auto t0 = tap_clock::now();
    inner_.wait();
    log_->add_time(axis_, seconds_since(t0));
  }
  bool test() override { return inner_.test(); }

 private:
  request inner_;
  wire_log* log_;
  axis axis_;
};

}  // namespace detail

/// Communicator C seen through a tap on axis `a`: same results, every call recorded in a
/// wire_log. Non-owning: the wrapped communicator and the log outlive the tap (a tap made by
/// split() owns the communicator split from the wrapped one).
template <Communicator C>
class wire_tap {
 public:
  /// The space of the buffers the wrapped communicator accepts.
  using memory_space = space::space_of_t<C>;

  wire_tap(C& inner, axis a, wire_log& log) : c_(&inner), axis_(a), log_(&log) {}

  /// Stream-ordered communicators (space/space_of.hpp): later calls wait for e.
  template <class E>
  void after(const E& e) requires requires(C& c) {
    c.after(e);
  }
  { c_->after(e); }
  /// Stream-ordered communicators: an event completing with the calls made so far.
  auto record() requires requires(C& c) { c.record(); }
  { return c_->record(); }

  int rank() const { return c_->rank(); }
  int size() const { return c_->size(); }
  /// The axis the tap records on.
  fedshard::axis on() const noexcept { return axis_; }
  /// The wrapped communicator.
  C& inner() noexcept { return *c_; }

  void all_reduce(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    timed(comm_kind::all_reduce, t, n, [&] { c_->all_reduce(in, out, n, t, op); });
  }
  void all_gather(const void* in, void* out, std::int64_t n, dtype t) {
    timed(comm_kind::all_gather, t, n * size(), [&] { c_->all_gather(in, out, n, t); });
  }
  void reduce_scatter(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    timed(comm_kind::reduce_scatter, t, n * size(), [&] { c_->reduce_scatter(in, out, n, t, op); });
  }
  void broadcast(void* buf, std::int64_t n, dtype t, int root) {
    timed(comm_kind::broadcast, t, n, [&] { c_->broadcast(buf, n, t, root); });
  }
  void send(const void* buf, std::int64_t n, dtype t, int peer, int tag = 0) {
    timed(comm_kind::send_recv, t, n, [&] { c_->send(buf, n, t, peer, tag); });
  }
  void recv(void* buf, std::int64_t n, dtype t, int peer, int tag = 0) {
    c_->recv(buf, n, t, peer, tag);
  }
  void barrier() { c_->barrier(); }

  request all_reduce_async(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    return started(comm_kind::all_reduce, t, n,
                   [&] { return c_->all_reduce_async(in, out, n, t, op); });
  }
  request all_gather_async(const void* in, void* out, std::int64_t n, dtype t) {
    return started(comm_kind::all_gather, t, n * size(),
                   [&] { return c_->all_gather_async(in, out, n, t); });
  }
  request reduce_scatter_async(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    return started(comm_kind::reduce_scatter, t, n * size(),
                   [&] { return c_->reduce_scatter_async(in, out, n, t, op); });
  }
  request broadcast_async(void* buf, std::int64_t n, dtype t, int root) {
    return started(comm_kind::broadcast, t, n,
                   [&] { return c_->broadcast_async(buf, n, t, root); });
  }
  request send_async(const void* buf, std::int64_t n, dtype t, int peer, int tag = 0) {
    return started(comm_kind::send_recv, t, n,
                   [&] { return c_->send_async(buf, n, t, peer, tag); });
  }
  request recv_async(void* buf, std::int64_t n, dtype t, int peer, int tag = 0) {
    return c_->recv_async(buf, n, t, peer, tag);
  }

  /// A tap on the communicator split from the wrapped one (same axis and log).
  wire_tap split(int color, int key) {
    wire_tap t(std::make_unique<C>(c_->split(color, key)), axis_, *log_);
    return t;
  }

 private:
  wire_tap(std::unique_ptr<C> owned, axis a, wire_log& log)
      : owned_(std::move(owned)), c_(owned_.get()), axis_(a), log_(&log) {}

  wire_call call(comm_kind k, dtype t, std::int64_t elems) const {
    const std::int64_t bytes = is_valid(t) ? elems * static_cast<std::int64_t>(size_of(t)) : 0;
    return {k, axis_, t, bytes, k == comm_kind::send_recv ? 2 : size()};
  }
  template <class F>
  void timed(comm_kind k, dtype t, std::int64_t elems, F&& f) {
    const auto t0 = detail::tap_clock::now();
    f();
    log_->record(call(k, t, elems), detail::seconds_since(t0));
  }
  template <class F>
  request started(comm_kind k, dtype t, std::int64_t elems, F&& f) {
    const auto t0 = detail::tap_clock::now();
    request r = f();
    log_->record(call(k, t, elems), detail::seconds_since(t0));
    return request(std::make_unique<detail::timed_request>(std::move(r), log_, axis_));
  }

  std::unique_ptr<C> owned_;
  C* c_;
  fedshard::axis axis_;
  wire_log* log_;
};

}  // namespace fedshard
