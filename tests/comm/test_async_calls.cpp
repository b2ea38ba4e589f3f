// async_calls<D>: each *_async entry point hands the class's collective() or p2p() exactly the
// arguments of the call it names (kind, buffers, count, dtype, reduction, root; direction,
// peer, tag).
#include "fedshard/comm/async_calls.hpp"

#include <doctest/doctest.h>

#include <vector>

using namespace fedshard;
using fedshard::detail::call_args;
using fedshard::detail::op_kind;

namespace {

struct p2p_args {
  bool send;
  const void* in;
  void* out;
  std::int64_t count;
  dtype type;
  int peer, tag;
};

/// Records what the mixin passes on.
class recorder : public async_calls<recorder> {
  friend class async_calls<recorder>;

 public:
  std::vector<call_args> calls;
  std::vector<p2p_args> p2ps;

 private:
  request collective(const call_args& a) {
    calls.push_back(a);
    return {};
  }
  request p2p(bool send, const void* in, void* out, std::int64_t n, dtype t, int peer, int tag) {
    p2ps.push_back({send, in, out, n, t, peer, tag});
    return {};
  }
};

}  // namespace

TEST_CASE("async_calls forwards every collective with its arguments") {
  recorder r;
  float a[4] = {}, b[8] = {};
  r.all_reduce_async(a, b, 4, dtype::bf16, reduce_op::max);
  r.all_gather_async(a, b, 2, dtype::f32);
  r.reduce_scatter_async(b, a, 2, dtype::f16, reduce_op::avg);
  r.broadcast_async(b, 8, dtype::f64, 3);
  r.barrier_async();
  REQUIRE(r.calls.size() == 5);
  const auto& ar = r.calls[0];
  CHECK(ar.kind == op_kind::all_reduce);
  CHECK(ar.in == a);
  CHECK(ar.out == b);
  CHECK(ar.count == 4);
  CHECK(ar.type == dtype::bf16);
  CHECK(ar.op == reduce_op::max);
  CHECK(r.calls[1].kind == op_kind::all_gather);
  CHECK(r.calls[1].count == 2);
  CHECK(r.calls[2].kind == op_kind::reduce_scatter);
  CHECK(r.calls[2].in == b);
  CHECK(r.calls[2].op == reduce_op::avg);
  CHECK(r.calls[2].type == dtype::f16);
  const auto& bc = r.calls[3];
  CHECK(bc.kind == op_kind::broadcast);
  CHECK(bc.in == b);  // in place
  CHECK(bc.out == b);
  CHECK(bc.root == 3);
  CHECK(bc.type == dtype::f64);
  CHECK(r.calls[4].kind == op_kind::barrier);
  CHECK(r.calls[4].count == 0);
}

TEST_CASE("async_calls forwards send and receive with direction, peer and tag") {
  recorder r;
  float a[3] = {};
  r.send_async(a, 3, dtype::f32, 2, 7);
  r.recv_async(a, 3, dtype::bf16, 1);
  REQUIRE(r.p2ps.size() == 2);
  CHECK(r.p2ps[0].send);
  CHECK(r.p2ps[0].in == a);
  CHECK(r.p2ps[0].out == nullptr);
  CHECK(r.p2ps[0].peer == 2);
  CHECK(r.p2ps[0].tag == 7);
  CHECK_FALSE(r.p2ps[1].send);
  CHECK(r.p2ps[1].out == a);
  CHECK(r.p2ps[1].type == dtype::bf16);
  CHECK(r.p2ps[1].peer == 1);
  CHECK(r.p2ps[1].tag == 0);  // the default tag
}
