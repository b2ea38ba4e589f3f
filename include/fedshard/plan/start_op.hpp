#pragma once
/// start_op: issues one comm_op on the communicator of its axis.

#include <cstdint>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/comm/request.hpp"
#include "fedshard/error.hpp"
#include "fedshard/plan/comm_op.hpp"

namespace fedshard {

/// Starts op on c, the communicator of op's axis, with buffers already in op.dtype: `in`
/// holds what the op reads (its input block for all_gather), `out` what it writes (a
/// broadcast uses `out` only, from axis rank op.root). The request completes it.
template <Communicator C>
request start_op(C& c, const comm_op& op, const void* in, void* out) {
  const auto n = op.bytes / static_cast<std::int64_t>(size_of(op.dtype));
  switch (op.kind) {
    case comm_kind::all_gather: return c.all_gather_async(in, out, n / op.ranks, op.dtype);
    case comm_kind::reduce_scatter:
      return c.reduce_scatter_async(in, out, n / op.ranks, op.dtype, op.reduce.value());
    case comm_kind::all_reduce: return c.all_reduce_async(in, out, n, op.dtype, op.reduce.value());
    case comm_kind::broadcast: return c.broadcast_async(out, n, op.dtype, op.root);
    case comm_kind::send_recv: break;
  }
  throw invalid_argument(detail::concat("fedshard: start_op: ", describe(op),
                                        ": send_recv ops are not executable yet"));
}

}  // namespace fedshard
