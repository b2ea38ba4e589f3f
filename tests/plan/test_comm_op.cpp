// comm_op and plan: names, nccl-tests bus factors, wire bytes, describe(), validation of an
// op's fields, trigger points, per-axis sums and the plan's selections.
#include "fedshard/plan/comm_op.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

using namespace fedshard;

namespace {

constexpr comm_kind all_kinds[] = {
    comm_kind::all_gather, comm_kind::reduce_scatter, comm_kind::all_reduce, comm_kind::broadcast,
    comm_kind::send_recv,  comm_kind::send,           comm_kind::recv};

comm_op make(comm_kind k, axis a, std::int64_t bytes, int ranks, dtype t = dtype::f32, int unit = 0,
             phase when = phase::backward) {
  comm_op op;
  op.kind = k;
  op.axis = a;
  op.bytes = bytes;
  op.dtype = t;
  op.unit = unit;
  op.phase = when;
  op.ranks = ranks;
  op.trigger = trigger::grads_ready;
  op.in = {.role = role::grad};
  op.out = {.role = role::grad_shard};
  if (reduces(k)) op.reduce = reduce_op::avg;
  return op;
}

}  // namespace

TEST_CASE("kinds, phases, triggers and roles have distinct names") {
  CHECK(to_string(comm_kind::all_gather) == "all_gather");
  CHECK(to_string(comm_kind::reduce_scatter) == "reduce_scatter");
  CHECK(to_string(comm_kind::all_reduce) == "all_reduce");
  CHECK(to_string(comm_kind::broadcast) == "broadcast");
  CHECK(to_string(comm_kind::send_recv) == "send_recv");
  CHECK(to_string(comm_kind::send) == "send");
  CHECK(to_string(comm_kind::recv) == "recv");
  CHECK(to_string(phase::forward) == "forward");
  CHECK(to_string(phase::backward) == "backward");
  CHECK(to_string(phase::optimizer) == "optimizer");
  CHECK(to_string(phase::sync) == "sync");
  CHECK(to_string(phase::setup) == "setup");
  CHECK(to_string(trigger::acquire) == "acquire");
  CHECK(to_string(trigger::grads_ready) == "grads_ready");
  CHECK(to_string(trigger::end_of_backward) == "end_of_backward");
  CHECK(to_string(trigger::sync_prepare) == "sync_prepare");
  CHECK(to_string(trigger::sync_exchange) == "sync_exchange");
  CHECK(to_string(trigger::sync_finish) == "sync_finish");
  CHECK(to_string(trigger::sync_after) == "sync_after");
  CHECK(to_string(trigger::on_demand) == "on_demand");
  CHECK(to_string(role::param_shard) == "param_shard");
  CHECK(to_string(role::group_tokens) == "group_tokens");
  CHECK(to_string(role::gathered) == "gathered");
  CHECK(static_cast<int>(role::value) == 9);  // a role added later keeps the codes before it
  CHECK(static_cast<int>(role::gathered) == 10);
  CHECK(static_cast<int>(role::packed) == 11);
  CHECK(to_string(role::packed) == "packed");
  CHECK(to_string(role::state_size) == "state_size");
  CHECK(to_string(role::state) == "state");
  CHECK(to_string(static_cast<comm_kind>(99)) == "unknown-kind");
  CHECK(to_string(static_cast<phase>(99)) == "unknown-phase");
  CHECK(to_string(static_cast<trigger>(99)) == "unknown-trigger");
  CHECK(to_string(static_cast<role>(99)) == "unknown-role");
}

TEST_CASE("a default comm_op is an on-demand all_reduce of nothing on the world, with no roles") {
  const comm_op op;
  CHECK(op.kind == comm_kind::all_reduce);
  CHECK(op.axis == axis::world);
  CHECK(op.bytes == 0);
  CHECK(op.dtype == dtype::f32);
  CHECK(op.unit == -1);
  CHECK(op.fragment == -1);
  CHECK(op.ranks == 1);
  CHECK_FALSE(op.reduce.has_value());
  CHECK(op.trigger == trigger::on_demand);
  CHECK(op.in.role == role::none);
  CHECK(op.out.role == role::none);
  CHECK(op.overlappable);
  CHECK(wire_bytes(op) == 0.0);
}

TEST_CASE("comm_op equality compares every field") {
  const comm_op base = make(comm_kind::all_gather, axis::shard, 4096, 4, dtype::bf16, 2);
  CHECK(base == base);
  std::vector<comm_op> changed(16, base);
  changed[0].kind = comm_kind::reduce_scatter;
  changed[1].axis = axis::replica;
  changed[2].bytes = 4098;
  changed[3].dtype = dtype::f16;
  changed[4].unit = 3;
  changed[5].phase = phase::forward;
  changed[6].ranks = 8;
  changed[7].reduce = reduce_op::sum;
  changed[8].overlappable = false;
  changed[9].trigger = trigger::acquire;
  changed[10].fragment = 1;
  changed[11].root = 1;
  changed[12].in.piece = axis::replica;
  changed[13].out.index = 2;
  changed[14].in.role = role::params;
  changed[15].peer = 1;
  for (const comm_op& c : changed) CHECK_FALSE(c == base);
}

TEST_CASE("bus_factor follows nccl-tests: 2(n-1)/n, (n-1)/n, 1, and 0 for one rank") {
  // exact binary fractions
  CHECK(bus_factor(comm_kind::all_reduce, 2) == 1.0);
  CHECK(bus_factor(comm_kind::all_reduce, 4) == 1.5);
  CHECK(bus_factor(comm_kind::all_reduce, 8) == 1.75);
  CHECK(bus_factor(comm_kind::all_gather, 2) == 0.5);
  CHECK(bus_factor(comm_kind::all_gather, 4) == 0.75);
  CHECK(bus_factor(comm_kind::reduce_scatter, 8) == 0.875);
  CHECK(bus_factor(comm_kind::broadcast, 2) == 1.0);
  CHECK(bus_factor(comm_kind::broadcast, 64) == 1.0);
  CHECK(bus_factor(comm_kind::send_recv, 2) == 1.0);
  CHECK(bus_factor(comm_kind::send, 2) == 1.0);  // one message, sent by the sender
  CHECK(bus_factor(comm_kind::send, 64) == 1.0);
  CHECK(bus_factor(comm_kind::recv, 2) == 0.0);  // the receiver sends nothing
  CHECK(bus_factor(comm_kind::recv, 64) == 0.0);
  // other counts
  for (int n = 2; n <= 17; ++n) {
    CAPTURE(n);
    CHECK(bus_factor(comm_kind::all_reduce, n) == doctest::Approx(2.0 * (n - 1) / n));
    CHECK(bus_factor(comm_kind::all_gather, n) == doctest::Approx(double(n - 1) / n));
    CHECK(bus_factor(comm_kind::reduce_scatter, n) == doctest::Approx(double(n - 1) / n));
    CHECK(bus_factor(comm_kind::broadcast, n) == 1.0);
  }
  // a single rank (or a nonsensical count) moves nothing
  for (comm_kind k : all_kinds)
    for (int n : {1, 0, -3}) {
      CAPTURE(n);
      CHECK(bus_factor(k, n) == 0.0);
    }
  static_assert(bus_factor(comm_kind::all_reduce, 4) == 1.5, "usable in constant expressions");
}

TEST_CASE("wire_bytes is the bus factor times the array bytes") {
  CHECK(wire_bytes(make(comm_kind::all_reduce, axis::group, 1024, 4)) == 1536.0);
  CHECK(wire_bytes(make(comm_kind::all_gather, axis::shard, 1024, 4)) == 768.0);
  CHECK(wire_bytes(make(comm_kind::reduce_scatter, axis::shard, 1000, 8)) == 875.0);
  CHECK(wire_bytes(make(comm_kind::broadcast, axis::replica, 1000, 3)) == 1000.0);
  CHECK(wire_bytes(make(comm_kind::all_reduce, axis::federation, 1 << 20, 1)) == 0.0);
  CHECK(wire_bytes(make(comm_kind::all_reduce, axis::world, 3000, 3)) == doctest::Approx(4000.0));
  // 2^40 bytes: no overflow in the conversion
  const std::int64_t big = std::int64_t{1} << 40;
  CHECK(wire_bytes(make(comm_kind::all_reduce, axis::world, big, 2)) == double(big));
}

TEST_CASE(
    "describe names the kind, axis, ranks, bytes, dtype, reduction, unit, trigger, phase, roles") {
  const std::string s =
      describe(make(comm_kind::reduce_scatter, axis::replica, 4096, 3, dtype::bf16, 7));
  CHECK(s.find("reduce_scatter") != std::string::npos);
  CHECK(s.find("replica") != std::string::npos);
  CHECK(s.find("3 ranks") != std::string::npos);
  CHECK(s.find("4096 B") != std::string::npos);
  CHECK(s.find("bf16") != std::string::npos);
  CHECK(s.find("unit 7") != std::string::npos);
  CHECK(s.find("grads_ready in backward") != std::string::npos);
  CHECK(s.find("avg") != std::string::npos);
  CHECK(s.find("grad -> grad_shard") != std::string::npos);
  comm_op b = make(comm_kind::broadcast, axis::replica, 8, 2, dtype::f32, -1, phase::sync);
  b.reduce.reset();
  b.trigger = trigger::sync_finish;
  b.fragment = 3;
  b.out = {.role = role::fragment};
  CHECK(describe(b) ==
        "broadcast on replica (2 ranks), 8 B of f32, fragment 3, sync_finish in sync -> fragment");
  CHECK(describe(operand{.role = role::moment, .index = 1, .piece = axis::replica}) ==
        "moment 1 (piece on replica)");
  // A packed operand names whose masked elements it holds; an index naming none shows as is.
  CHECK(packed_operand(packed_of::grad) == operand{.role = role::packed, .index = 2});
  CHECK(describe(packed_operand(packed_of::param_shard)) == "packed param_shard");
  CHECK(describe(packed_operand(packed_of::params)) == "packed params");
  CHECK(describe(packed_operand(packed_of::grad)) == "packed grad");
  CHECK(describe(packed_operand(packed_of::grad_shard)) == "packed grad_shard");
  CHECK(describe(operand{.role = role::packed, .index = 7}) == "packed 7");
}

TEST_CASE("describe names a point-to-point op's peer and only the operands its kind has") {
  comm_op x{.kind = comm_kind::send_recv,
            .axis = axis::federation,
            .bytes = 64,
            .ranks = 4,
            .peer = 3,
            .trigger = trigger::sync_exchange,
            .phase = phase::sync,
            .fragment = 0,
            .in = {.role = role::fragment},
            .out = {.role = role::gathered}};
  CHECK(describe(x) ==
        "send_recv on federation (4 ranks), 64 B of f32, with axis rank 3, "
        "fragment 0, sync_exchange in sync, fragment -> gathered");
  const comm_op send{.kind = comm_kind::send,
                     .axis = axis::federation,
                     .dtype = dtype::f64,
                     .bytes = 1000,
                     .ranks = 3,
                     .peer = 2,
                     .phase = phase::sync,
                     .in = {.role = role::state}};
  CHECK(describe(send) ==
        "send on federation (3 ranks), 1000 B of f64, to axis rank 2, on_demand in sync, state");
  comm_op recv = send;
  recv.kind = comm_kind::recv;
  recv.peer = 0;
  recv.in = {};
  recv.out = {.role = role::state};
  CHECK(
      describe(recv) ==
      "recv on federation (3 ranks), 1000 B of f64, from axis rank 0, on_demand in sync -> state");
}

TEST_CASE("plan: wire bytes and calls per axis, append keeps order") {
  plan p;
  CHECK(p.wire_bytes_on(axis::shard) == 0.0);
  CHECK(p.calls_on(axis::shard) == 0);
  p.ops = {make(comm_kind::all_gather, axis::shard, 1024, 4),
           make(comm_kind::reduce_scatter, axis::shard, 2048, 4),
           make(comm_kind::all_reduce, axis::replica, 512, 2),
           make(comm_kind::all_reduce, axis::federation, 512, 1)};
  CHECK(p.wire_bytes_on(axis::shard) == 768.0 + 1536.0);
  CHECK(p.calls_on(axis::shard) == 2);
  CHECK(p.wire_bytes_on(axis::replica) == 512.0);
  CHECK(p.calls_on(axis::replica) == 1);
  // a one-rank op is a call that sends nothing
  CHECK(p.calls_on(axis::federation) == 1);
  CHECK(p.wire_bytes_on(axis::federation) == 0.0);
  CHECK(p.calls_on(axis::group) == 0);
  CHECK(p.calls_on(axis::world) == 0);

  plan q;
  q.ops = {make(comm_kind::broadcast, axis::world, 100, 8)};
  const plan before = p;
  plan& r = p.append(q).append(q);
  CHECK(&r == &p);
  REQUIRE(p.ops.size() == 6);
  for (std::size_t i = 0; i < 4; ++i) CHECK(p.ops[i] == before.ops[i]);
  CHECK(p.ops[4] == q.ops[0]);
  CHECK(p.ops[5] == q.ops[0]);
  CHECK(p.calls_on(axis::world) == 2);
  CHECK(p.wire_bytes_on(axis::world) == 200.0);
  CHECK(q.ops.size() == 1);  // the appended plan is untouched

  // appending a plan to itself doubles it
  plan self = q;
  self.append(self);
  CHECK(self.ops.size() == 2);
}

TEST_CASE("check accepts consistent ops and names what is wrong with the others") {
  const comm_op ok = make(comm_kind::reduce_scatter, axis::shard, 4096, 4, dtype::bf16, 2);
  CHECK_NOTHROW(check(ok));
  auto fails = [](comm_op op, const char* what) {
    CAPTURE(what);
    CHECK_THROWS_WITH_AS(check(op), doctest::Contains(what), invalid_argument);
  };
  comm_op c = ok;
  c.ranks = 0;
  fails(c, "ranks must be >= 1");
  c = ok;
  c.bytes = 4095;
  fails(c, "bytes must be a whole number of 2-byte elements");
  c = ok;
  c.bytes = 2 * 6;
  fails(c, "6 elements do not split evenly over 4 ranks");
  c = ok;
  c.reduce.reset();
  fails(c, "a reducing op needs a reduce op");
  c = make(comm_kind::all_gather, axis::shard, 64, 2);
  c.reduce = reduce_op::sum;
  fails(c, "only all_reduce and reduce_scatter carry a reduce op");
  c = ok;
  c.kind = comm_kind::send_recv;
  c.reduce.reset();
  fails(c, "the peer must be a rank of the axis, in [0, 4), found -1");
  c.peer = 0;
  CHECK_NOTHROW(check(c));  // an exchange with axis rank 0
  c.peer = 4;
  fails(c, "the peer must be a rank of the axis, in [0, 4), found 4");
  c.peer = 0;
  c.ranks = 1;
  fails(c, "a send_recv op needs a peer: ranks must be >= 2, found 1");
  c = ok;
  c.peer = 1;
  fails(c, "only send_recv, send and recv name a peer, expected -1, found 1");
  // a send reads its input only, a recv writes its output only
  const auto to_peer_1 = [&](comm_kind k) {
    comm_op o = ok;
    o.kind = k;
    o.reduce.reset();
    o.peer = 1;
    return o;
  };
  c = to_peer_1(comm_kind::send);
  fails(c, "a send op has no output, found one");
  c.out = {};
  CHECK_NOTHROW(check(c));
  c.ranks = 1;
  c.peer = 0;
  fails(c, "a send op needs a peer: ranks must be >= 2, found 1");
  c = to_peer_1(comm_kind::recv);
  fails(c, "a recv op has no input, found one");
  c.in = {};
  CHECK_NOTHROW(check(c));
  c.out = {};
  fails(c, "the output has no role");
  c = ok;
  c.out = {};
  fails(c, "the output has no role");
  c = ok;
  c.in = {};
  fails(c, "the input has no role");
  c = ok;
  c.unit = -1;
  fails(c, "a grads_ready op needs a unit");
  c = ok;
  c.trigger = trigger::acquire;
  c.phase = phase::sync;
  fails(c, "acquire ops run in forward or backward");
  c = ok;
  c.trigger = trigger::sync_exchange;
  fails(c, "a sync_exchange op needs a fragment");
  c = make(comm_kind::broadcast, axis::replica, 8, 2);
  c.reduce.reset();
  c.root = 2;
  fails(c, "root must be a rank of the axis, in [0, 2)");
}

TEST_CASE("trigger points select the ops of one event; writes and reads look at roles") {
  plan p;
  comm_op fwd = make(comm_kind::all_gather, axis::shard, 64, 2, dtype::f32, 1, phase::forward);
  fwd.reduce.reset();
  fwd.trigger = trigger::acquire;
  fwd.in = {.role = role::param_shard};
  fwd.out = {.role = role::params};
  comm_op bwd = fwd;
  bwd.phase = phase::backward;
  const comm_op rs = make(comm_kind::reduce_scatter, axis::shard, 64, 2, dtype::f32, 1);
  comm_op other = rs;
  other.unit = 0;
  p.ops = {fwd, bwd, rs, other};
  CHECK(p.at({.trigger = trigger::acquire, .phase = phase::forward, .unit = 1}).ops ==
        std::vector<comm_op>{fwd});
  CHECK(p.at({.trigger = trigger::acquire, .phase = phase::backward, .unit = 1}).ops ==
        std::vector<comm_op>{bwd});
  CHECK(p.at({.trigger = trigger::grads_ready, .phase = phase::backward, .unit = 1}).ops ==
        std::vector<comm_op>{rs});
  CHECK(p.at({.trigger = trigger::acquire, .phase = phase::forward, .unit = 0}).ops.empty());
  CHECK(p.at({.trigger = trigger::sync_exchange, .phase = phase::sync, .fragment = 0}).ops.empty());
  CHECK(p.writes(role::params, 1));
  CHECK_FALSE(p.writes(role::params, 0));
  CHECK(p.reads(role::grad, 0));
  CHECK_FALSE(p.reads(role::params, 1));
  CHECK(p.select([](const comm_op& op) { return op.unit == 0; }).ops.size() == 1);
  CHECK_NOTHROW(p.check());
  p.ops.back().ranks = 0;
  CHECK_THROWS_AS(p.check(), invalid_argument);
}
