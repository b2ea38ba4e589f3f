#pragma once
/// The *_async calls of a communicator, as calls of its collective and p2p entry points.

#include <cstdint>

#include "fedshard/comm/detail/call.hpp"
#include "fedshard/comm/request.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"

namespace fedshard {

/// Base of a communicator D (CRTP) that runs every collective through one entry point and
/// every send and receive through another: gives D each *_async call of the Communicator
/// concept, made of detail::make_call and forwarded to D's
///   request collective(const detail::call_args&);
///   request p2p(bool is_send, const void* sbuf, void* rbuf, std::int64_t count, dtype t,
///               int peer, int tag);
/// (which may be private with async_calls<D> a friend). A call D defines itself hides the
/// base's.
template <class D>
class async_calls {
 public:
  /// out = op over ranks of in (count elements); in == out is in place.
  request all_reduce_async(const void* in, void* out, std::int64_t count, dtype t, reduce_op op) {
    return self().collective(detail::make_call(detail::op_kind::all_reduce, in, out, count, t, op));
  }
  /// out (count * size() elements) = every rank's in (count elements) in rank order.
  request all_gather_async(const void* in, void* out, std::int64_t count, dtype t) {
    return self().collective(detail::make_call(detail::op_kind::all_gather, in, out, count, t));
  }
  /// out (count elements) = op over ranks of block rank() of in (count * size() elements).
  request reduce_scatter_async(const void* in, void* out, std::int64_t count, dtype t,
                               reduce_op op) {
    return self().collective(
        detail::make_call(detail::op_kind::reduce_scatter, in, out, count, t, op));
  }
  /// buf = root's buf on every rank.
  request broadcast_async(void* buf, std::int64_t count, dtype t, int root) {
    return self().collective(
        detail::make_call(detail::op_kind::broadcast, buf, buf, count, t, reduce_op::sum, root));
  }
  /// Completes once every rank has entered the barrier.
  request barrier_async() {
    return self().collective(
        detail::make_call(detail::op_kind::barrier, nullptr, nullptr, 0, dtype::f32));
  }
  /// Posts a send of count elements to peer.
  request send_async(const void* buf, std::int64_t count, dtype t, int peer, int tag = 0) {
    return self().p2p(true, buf, nullptr, count, t, peer, tag);
  }
  /// Posts a receive of count elements from peer (matched in order per sender and tag).
  request recv_async(void* buf, std::int64_t count, dtype t, int peer, int tag = 0) {
    return self().p2p(false, nullptr, buf, count, t, peer, tag);
  }

 protected:
  async_calls() = default;

 private:
  D& self() { return static_cast<D&>(*this); }
};

}  // namespace fedshard
