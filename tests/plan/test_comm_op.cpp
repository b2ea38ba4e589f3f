// comm_op and plan: names, nccl-tests bus factors, wire bytes, describe(), per-axis sums.
#include "fedshard/plan/comm_op.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

using namespace fedshard;

namespace {

constexpr comm_kind all_kinds[] = {comm_kind::all_gather, comm_kind::reduce_scatter,
                                   comm_kind::all_reduce, comm_kind::broadcast,
                                   comm_kind::send_recv};

comm_op make(comm_kind k, axis a, std::int64_t bytes, int ranks, dtype t = dtype::f32, int unit = 0,
             phase when = phase::backward) {
  comm_op op;
  op.kind = k;
  op.on = a;
  op.bytes = bytes;
  op.type = t;
  op.unit = unit;
  op.when = when;
  op.ranks = ranks;
  return op;
}

}  // namespace

TEST_CASE("kinds and phases have distinct names") {
  CHECK(to_string(comm_kind::all_gather) == "all_gather");
  CHECK(to_string(comm_kind::reduce_scatter) == "reduce_scatter");
  CHECK(to_string(comm_kind::all_reduce) == "all_reduce");
  CHECK(to_string(comm_kind::broadcast) == "broadcast");
  CHECK(to_string(comm_kind::send_recv) == "send_recv");
  CHECK(to_string(phase::forward) == "forward");
  CHECK(to_string(phase::backward) == "backward");
  CHECK(to_string(phase::optimizer) == "optimizer");
  CHECK(to_string(phase::sync) == "sync");
  CHECK(to_string(static_cast<comm_kind>(99)) == "unknown-kind");
  CHECK(to_string(static_cast<phase>(99)) == "unknown-phase");
}

TEST_CASE("a default comm_op is an averaging all_reduce of nothing on the world") {
  const comm_op op;
  CHECK(op.kind == comm_kind::all_reduce);
  CHECK(op.on == axis::world);
  CHECK(op.bytes == 0);
  CHECK(op.type == dtype::f32);
  CHECK(op.unit == -1);
  CHECK(op.ranks == 1);
  CHECK(op.op == reduce_op::avg);
  CHECK(op.overlappable);
  CHECK(wire_bytes(op) == 0.0);
}

TEST_CASE("comm_op equality compares every field") {
  const comm_op base = make(comm_kind::all_gather, axis::shard, 4096, 4, dtype::bf16, 2);
  CHECK(base == base);
  std::vector<comm_op> changed(9, base);
  changed[0].kind = comm_kind::reduce_scatter;
  changed[1].on = axis::replica;
  changed[2].bytes = 4098;
  changed[3].type = dtype::f16;
  changed[4].unit = 3;
  changed[5].when = phase::forward;
  changed[6].ranks = 8;
  changed[7].op = reduce_op::sum;
  changed[8].overlappable = false;
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

TEST_CASE("describe names the kind, axis, ranks, bytes, dtype, unit and phase") {
  const std::string s =
      describe(make(comm_kind::reduce_scatter, axis::replica, 4096, 3, dtype::bf16, 7));
  CHECK(s.find("reduce_scatter") != std::string::npos);
  CHECK(s.find("replica") != std::string::npos);
  CHECK(s.find("3 ranks") != std::string::npos);
  CHECK(s.find("4096 B") != std::string::npos);
  CHECK(s.find("bf16") != std::string::npos);
  CHECK(s.find("unit 7") != std::string::npos);
  CHECK(s.find("backward") != std::string::npos);
  const std::string w =
      describe(make(comm_kind::broadcast, axis::federation, 8, 2, dtype::f64, -1, phase::sync));
  CHECK(w.find("broadcast on federation (2 ranks), 8 B of f64, unit -1, sync") !=
        std::string::npos);
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
