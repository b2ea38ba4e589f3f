#pragma once
/// The wire tap: a Communicator decorator that records what each call actually moved.
///
/// A wire_tap<C> forwards every call to the communicator it wraps and records, into a
/// wire_log, the call as issued: kind, axis, dtype, array bytes (element count x dtype size,
/// nccl-tests S: count x size() for all_gather and reduce_scatter) and the ranks; what the
/// backend reports the call moved (the difference of C's moved() around the call: bytes this
/// rank sent and received, for the algorithm C really runs); and the time spent in the call or
/// waiting for it. It knows nothing of plans: tests compare what it recorded with the plan the
/// policies emitted (plan/traffic.hpp, moved_mismatch). Point-to-point messages are counted as
/// calls by the sender (the receiver's bytes are added to its received bytes); barriers and
/// splits move no data and are not counted.

#include <chrono>
#include <cstdint>
#include <memory>
#include <tuple>
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

/// One call as issued, and what the backend reported it moved.
struct wire_call {
  comm_kind kind = comm_kind::all_reduce;
  fedshard::axis axis = fedshard::axis::world;
  fedshard::dtype dtype = fedshard::dtype::f32;
  std::int64_t bytes = 0;  ///< array bytes (nccl-tests S)
  int ranks = 1;
  /// What this rank sent and received in the call, as the backend reported it. Not part of
  /// the comparisons below, which say whether the call is the one a plan's op makes
  /// (wire_call::of); the bytes are checked against the plan's closed forms on their own.
  moved_bytes moved{};

  /// The call a plan's op makes (for an encoded op, the all_gather of its wires: carried; for
  /// a send_recv or a send, the message it sends: a send_recv call of 2 ranks). A recv op's
  /// message is recorded by its sender.
  static wire_call of(const comm_op& op) {
    const comm_op c = carried(op);
    const bool message = c.kind == comm_kind::send_recv || c.kind == comm_kind::send;
    return {message ? comm_kind::send_recv : c.kind, c.axis, c.dtype, c.bytes,
            message ? 2 : c.ranks};
  }
  /// The call as issued, as one value (what the comparisons compare).
  std::tuple<comm_kind, fedshard::axis, fedshard::dtype, std::int64_t, int> issued() const {
    return {kind, axis, dtype, bytes, ranks};
  }
  friend bool operator==(const wire_call& a, const wire_call& b) {
    return a.issued() == b.issued();
  }
  friend auto operator<=>(const wire_call& a, const wire_call& b) {
    return a.issued() <=> b.issued();
  }
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

  /// Records one call, what it moved and the time spent in it.
  void record(const wire_call& c, double seconds) {
    traffic_.record(c.axis, c.kind, c.bytes, c.ranks, seconds, c.moved);
    if (keep_) calls_.push_back(c);
  }
  /// Adds bytes a call moved without counting a call (a receive: its send is the call).
  void add_moved(fedshard::axis a, moved_bytes m) { traffic_.record_moved(a, m); }
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
  /// The wrapped communicator's bytes moved (so a tap of a tap counts once per log).
  moved_bytes moved() const { return c_->moved(); }
  /// The wrapped communicator's algorithm.
  wire_algorithm algorithm_of(collective k, std::int64_t n, dtype t) const {
    return c_->algorithm_of(k, n, t);
  }
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
    const moved_bytes before = c_->moved();
    c_->recv(buf, n, t, peer, tag);
    log_->add_moved(axis_, c_->moved() - before);
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
    const moved_bytes before = c_->moved();
    request r = c_->recv_async(buf, n, t, peer, tag);
    log_->add_moved(axis_, c_->moved() - before);
    return r;
  }

  /// A tap on the communicator split from the wrapped one (same axis and log).
  wire_tap split(int color, int key) {
    wire_tap t(std::make_unique<C>(c_->split(color, key)), axis_, *log_);
    return t;
  }

 private:
  wire_tap(std::unique_ptr<C> owned, axis a, wire_log& log)
      : owned_(std::move(owned)), c_(owned_.get()), axis_(a), log_(&log) {}

  wire_call call(comm_kind k, dtype t, std::int64_t elems, moved_bytes moved) const {
    const std::int64_t bytes = is_valid(t) ? elems * static_cast<std::int64_t>(size_of(t)) : 0;
    return {k, axis_, t, bytes, k == comm_kind::send_recv ? 2 : size(), moved};
  }
  template <class F>
  void timed(comm_kind k, dtype t, std::int64_t elems, F&& f) {
    const auto t0 = detail::tap_clock::now();
    const moved_bytes before = c_->moved();
    f();
    log_->record(call(k, t, elems, c_->moved() - before), detail::seconds_since(t0));
  }
  template <class F>
  request started(comm_kind k, dtype t, std::int64_t elems, F&& f) {
    const auto t0 = detail::tap_clock::now();
    const moved_bytes before = c_->moved();
    request r = f();
    log_->record(call(k, t, elems, c_->moved() - before), detail::seconds_since(t0));
    return request(std::make_unique<detail::timed_request>(std::move(r), log_, axis_));
  }

  std::unique_ptr<C> owned_;
  C* c_;
  fedshard::axis axis_;
  wire_log* log_;
};

}  // namespace fedshard
