// traffic_counters: per-axis calls, payload and wire bytes, time; totals, plans, comparison.
#include "fedshard/plan/traffic.hpp"

#include <doctest/doctest.h>

using namespace fedshard;

namespace {

comm_op make(comm_kind k, axis a, std::int64_t bytes, int ranks) {
  comm_op op;
  op.kind = k;
  op.axis = a;
  op.bytes = bytes;
  op.ranks = ranks;
  return op;
}

}  // namespace

TEST_CASE("record counts an op on its own axis only") {
  traffic_counters c;
  for (axis a : all_axes) CHECK(c[a] == axis_traffic{});
  c.record(make(comm_kind::all_reduce, axis::replica, 1000, 4), 0.25);
  CHECK(c[axis::replica].calls == 1);
  CHECK(c[axis::replica].payload_bytes == 1000);
  CHECK(c[axis::replica].wire_bytes == 1500.0);
  CHECK(c[axis::replica].seconds == 0.25);
  for (axis a : all_axes)
    if (a != axis::replica) CHECK(c[a] == axis_traffic{});

  c.record(make(comm_kind::all_gather, axis::replica, 400, 4));  // no time given
  CHECK(c[axis::replica].calls == 2);
  CHECK(c[axis::replica].payload_bytes == 1400);
  CHECK(c[axis::replica].wire_bytes == 1500.0 + 300.0);
  CHECK(c[axis::replica].seconds == 0.25);

  // one rank: a call with payload, nothing on the wire
  c.record(make(comm_kind::all_reduce, axis::federation, 64, 1));
  CHECK(c[axis::federation].calls == 1);
  CHECK(c[axis::federation].payload_bytes == 64);
  CHECK(c[axis::federation].wire_bytes == 0.0);
}

TEST_CASE("add_time adds seconds without counting a call") {
  traffic_counters c;
  c.record(make(comm_kind::broadcast, axis::world, 10, 2), 1.0);
  c.add_time(axis::world, 0.5);
  c.add_time(axis::shard, 2.0);
  CHECK(c[axis::world].calls == 1);
  CHECK(c[axis::world].payload_bytes == 10);
  CHECK(c[axis::world].seconds == 1.5);
  CHECK(c[axis::shard].calls == 0);
  CHECK(c[axis::shard].payload_bytes == 0);
  CHECK(c[axis::shard].seconds == 2.0);
}

TEST_CASE("total sums every axis; reset clears them") {
  traffic_counters c;
  c.record(make(comm_kind::all_gather, axis::shard, 800, 2), 1.0);
  c.record(make(comm_kind::all_reduce, axis::replica, 100, 2), 2.0);
  c.record(make(comm_kind::all_reduce, axis::group, 100, 4), 0.5);
  c.record(make(comm_kind::broadcast, axis::world, 8, 8));
  c.add_time(axis::federation, 0.25);
  const axis_traffic t = c.total();
  CHECK(t.calls == 4);
  CHECK(t.payload_bytes == 1008);
  CHECK(t.wire_bytes == 400.0 + 100.0 + 150.0 + 8.0);
  CHECK(t.seconds == 3.75);

  c.reset();
  CHECK(c.total() == axis_traffic{});
  for (axis a : all_axes) CHECK(c[a] == axis_traffic{});
}

TEST_CASE("of(plan, times) is what running the plan `times` times records") {
  plan p;
  p.ops = {make(comm_kind::all_gather, axis::shard, 1024, 4),
           make(comm_kind::reduce_scatter, axis::shard, 1024, 4),
           make(comm_kind::all_reduce, axis::replica, 256, 2),
           make(comm_kind::all_reduce, axis::federation, 512, 3)};
  // One run, bytes each rank sends:
  //   shard: all_gather and reduce_scatter of 1024 B over 4: (4 - 1) / 4 x 1024 = 768 each;
  //   replica: all_reduce of 256 B over 2: 2 (2 - 1) / 2 x 256 = 256;
  //   federation: all_reduce of 512 B over 3: 2 (3 - 1) / 3 x 512 = 2048 / 3.
  // Three runs: 3x the calls, payloads and wire bytes.
  const traffic_counters c = traffic_counters::of(p, 3);
  CHECK(c[axis::shard] == axis_traffic{.calls = 6, .payload_bytes = 3 * 2048, .wire_bytes = 4608});
  CHECK(c[axis::replica] == axis_traffic{.calls = 3, .payload_bytes = 768, .wire_bytes = 768});
  CHECK(c[axis::federation].calls == 3);
  CHECK(c[axis::federation].payload_bytes == 1536);
  CHECK(c[axis::federation].wire_bytes == doctest::Approx(2048.0));
  CHECK(c[axis::group] == axis_traffic{});
  CHECK(c[axis::world] == axis_traffic{});
  CHECK(c.total().seconds == 0.0);  // plans carry no time
  CHECK(traffic_counters::of(p)[axis::shard] ==
        axis_traffic{.calls = 2, .payload_bytes = 2048, .wire_bytes = 1536});
  CHECK(traffic_counters::of(p, 0).total() == axis_traffic{});
  CHECK(traffic_counters::of(plan{}, 5).total() == axis_traffic{});
}

TEST_CASE("same_traffic compares calls, payload and wire bytes per axis, not time") {
  const comm_op ar = make(comm_kind::all_reduce, axis::replica, 1000, 4);
  traffic_counters a, b;
  a.record(ar, 1.0);
  b.record(ar, 7.0);
  b.add_time(axis::shard, 3.0);
  CHECK(a.same_traffic(b));
  CHECK(b.same_traffic(a));

  SUBCASE("one more call") {
    b.record(ar);
    CHECK_FALSE(a.same_traffic(b));
    CHECK_FALSE(b.same_traffic(a));
  }
  SUBCASE("same calls, different payload") {
    traffic_counters c;
    c.record(make(comm_kind::all_reduce, axis::replica, 1004, 4));
    CHECK_FALSE(a.same_traffic(c));
  }
  SUBCASE("same calls and payload, different wire bytes (other rank count)") {
    traffic_counters c;
    c.record(make(comm_kind::all_reduce, axis::replica, 1000, 2));
    CHECK(c[axis::replica].payload_bytes == a[axis::replica].payload_bytes);
    CHECK_FALSE(a.same_traffic(c));
  }
  SUBCASE("same totals on another axis") {
    traffic_counters c;
    c.record(make(comm_kind::all_reduce, axis::group, 1000, 4));
    CHECK(c.total().wire_bytes == a.total().wire_bytes);
    CHECK_FALSE(a.same_traffic(c));
  }
  SUBCASE("the traffic of a plan is the traffic of its ops in any order") {
    plan p, q;
    p.ops = {ar, make(comm_kind::all_gather, axis::shard, 64, 2)};
    q.ops = {p.ops[1], p.ops[0]};
    CHECK(traffic_counters::of(p).same_traffic(traffic_counters::of(q)));
  }
}
