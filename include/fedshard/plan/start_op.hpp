#pragma once
/// start_op: issues one comm_op on the communicator of its axis.

#include <cstdint>
#include <exception>
#include <memory>
#include <utility>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/comm/request.hpp"
#include "fedshard/error.hpp"
#include "fedshard/plan/comm_op.hpp"

namespace fedshard {

/// The tag of the messages of send_recv ops (a communicator matches messages per sender,
/// receiver and tag, so the plan's exchanges never take another protocol's messages).
inline constexpr int exchange_tag = 0x5e0d;
/// The tag of the messages of send and recv ops (one-way transfers), matched in order per
/// sender and receiver.
inline constexpr int transfer_tag = 0x5e0e;

namespace detail {
/// The two halves of an exchange: complete when both are; wait() waits for both, then
/// rethrows the first error.
class exchange_request final : public request_state {
 public:
  exchange_request(request first, request second)
      : first_(std::move(first)), second_(std::move(second)) {}
  void wait() override {
    std::exception_ptr e;
    for (request* r : {&first_, &second_}) {
      try {
        r->wait();
      } catch (...) {
        if (!e) e = std::current_exception();
      }
    }
    if (e) std::rethrow_exception(e);
  }
  bool test() override { return first_.test() && second_.test(); }

 private:
  request first_, second_;
};

/// The peer of point-to-point op `op` on c, which must be another rank than c's own.
template <Communicator C>
int peer_of(const C& c, const comm_op& op) {
  FEDSHARD_EXPECTS(op.peer != c.rank(), "fedshard: start_op: ", describe(op), ": a rank cannot ",
                   op.kind == comm_kind::send_recv ? "exchange with"
                   : op.kind == comm_kind::send    ? "send to"
                                                   : "receive from",
                   " itself (axis rank ", c.rank(), ")");
  return op.peer;
}
}  // namespace detail

/// Starts the send_recv op `op` on c: sends n elements of `in` to axis rank op.peer and
/// receives n into `out`. Deadlock-free on every communicator, blocking ones too: the lower
/// rank of the pair posts its send first, the higher its receive first, so each posted call
/// finds its match posted or about to be.
template <Communicator C>
request start_exchange(C& c, const comm_op& op, const void* in, void* out, std::int64_t n) {
  const int me = c.rank(), peer = detail::peer_of(c, op);
  request first, second;
  if (me < peer) {
    first = c.send_async(in, n, op.dtype, peer, exchange_tag);
    second = c.recv_async(out, n, op.dtype, peer, exchange_tag);
  } else {
    first = c.recv_async(out, n, op.dtype, peer, exchange_tag);
    second = c.send_async(in, n, op.dtype, peer, exchange_tag);
  }
  return request(std::make_unique<detail::exchange_request>(std::move(first), std::move(second)));
}

/// Starts op on c, the communicator of op's axis, with buffers already in op.dtype: `in`
/// holds what the op reads (its input block for all_gather), `out` what it writes (a
/// broadcast uses `out` only, from axis rank op.root; a send_recv sends `in` to axis rank
/// op.peer and receives into `out`: start_exchange; a send sends `in` to op.peer, a recv
/// receives into `out` from op.peer, on transfer_tag). The request completes it.
template <Communicator C>
request start_op(C& c, const comm_op& op, const void* in, void* out) {
  const auto n = op.bytes / static_cast<std::int64_t>(size_of(op.dtype));
  switch (op.kind) {
    case comm_kind::all_gather: return c.all_gather_async(in, out, n / op.ranks, op.dtype);
    case comm_kind::reduce_scatter:
      return c.reduce_scatter_async(in, out, n / op.ranks, op.dtype, op.reduce.value());
    case comm_kind::all_reduce: return c.all_reduce_async(in, out, n, op.dtype, op.reduce.value());
    case comm_kind::broadcast: return c.broadcast_async(out, n, op.dtype, op.root);
    case comm_kind::send_recv: return start_exchange(c, op, in, out, n);
    case comm_kind::send:
      return c.send_async(in, n, op.dtype, detail::peer_of(c, op), transfer_tag);
    case comm_kind::recv:
      return c.recv_async(out, n, op.dtype, detail::peer_of(c, op), transfer_tag);
    case comm_kind::pack:
    case comm_kind::unpack:
    case comm_kind::zero: break;  // local: the interpreter runs them
  }
  throw invalid_argument(detail::concat("fedshard: start_op: ", describe(op), ": unknown kind"));
}

}  // namespace fedshard
