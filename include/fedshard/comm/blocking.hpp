#pragma once
/// Blocking calls for a communicator that implements the async ones.

#include <cstdint>

#include "fedshard/comm/request.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"

namespace fedshard {

/// Base of a communicator D (CRTP) that implements the *_async calls: gives D each blocking
/// call of the Communicator concept as its async variant followed by wait() (barrier as
/// barrier_async().wait()). A call D defines itself hides the base's; a base call whose async
/// variant D lacks is never instantiated unless called.
template <class D>
class blocking_calls {
 public:
  /// out = op over ranks of in (count elements); in == out is in place.
  void all_reduce(const void* in, void* out, std::int64_t count, dtype t, reduce_op op) {
    self().all_reduce_async(in, out, count, t, op).wait();
  }
  /// out (count * size() elements) = every rank's in (count elements) in rank order.
  void all_gather(const void* in, void* out, std::int64_t count, dtype t) {
    self().all_gather_async(in, out, count, t).wait();
  }
  /// out (count elements) = op over ranks of block rank() of in (count * size() elements).
  void reduce_scatter(const void* in, void* out, std::int64_t count, dtype t, reduce_op op) {
    self().reduce_scatter_async(in, out, count, t, op).wait();
  }
  /// buf = root's buf on every rank.
  void broadcast(void* buf, std::int64_t count, dtype t, int root) {
    self().broadcast_async(buf, count, t, root).wait();
  }
  /// Returns once every rank has entered the barrier.
  void barrier() { self().barrier_async().wait(); }
  /// Sends count elements to peer; returns when send_async's request completes.
  void send(const void* buf, std::int64_t count, dtype t, int peer, int tag = 0) {
    self().send_async(buf, count, t, peer, tag).wait();
  }
  /// Receives count elements from peer (matched in order per sender and tag).
  void recv(void* buf, std::int64_t count, dtype t, int peer, int tag = 0) {
    self().recv_async(buf, count, t, peer, tag).wait();
  }

 protected:
  blocking_calls() = default;

 private:
  D& self() { return static_cast<D&>(*this); }
};

}  // namespace fedshard
