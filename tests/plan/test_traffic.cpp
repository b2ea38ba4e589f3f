// traffic_counters: per-axis calls, payload and wire bytes, time; totals, plans, comparison.
#include "fedshard/plan/traffic.hpp"

#include <doctest/doctest.h>

#include <vector>

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

/// An axis's counters: calls, payload bytes and seconds.
void check_counts(const axis_traffic& t, std::int64_t calls, std::int64_t payload, double seconds) {
  CHECK(t.calls == calls);
  CHECK(t.payload_bytes == payload);
  CHECK(t.seconds == seconds);
}

}  // namespace

TEST_CASE("record counts an op on its own axis only") {
  traffic_counters c;
  for (axis a : all_axes) CHECK(c[a] == axis_traffic{});
  c.record(make(comm_kind::all_reduce, axis::replica, 1000, 4), 0.25);
  check_counts(c[axis::replica], 1, 1000, 0.25);
  CHECK(c[axis::replica].wire_bytes == 1500.0);
  for (axis a : all_axes)
    if (a != axis::replica) CHECK(c[a] == axis_traffic{});

  c.record(make(comm_kind::all_gather, axis::replica, 400, 4));  // no time given
  check_counts(c[axis::replica], 2, 1400, 0.25);
  CHECK(c[axis::replica].wire_bytes == 1500.0 + 300.0);

  // one rank: a call with payload, nothing on the wire
  c.record(make(comm_kind::all_reduce, axis::federation, 64, 1));
  check_counts(c[axis::federation], 1, 64, 0.0);
  CHECK(c[axis::federation].wire_bytes == 0.0);
}

TEST_CASE("add_time adds seconds without counting a call") {
  traffic_counters c;
  c.record(make(comm_kind::broadcast, axis::world, 10, 2), 1.0);
  c.add_time(axis::world, 0.5);
  c.add_time(axis::shard, 2.0);
  check_counts(c[axis::world], 1, 10, 1.5);
  check_counts(c[axis::shard], 0, 0, 2.0);
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
  // The bytes each rank sends and receives (moved_share: ring, (n - 1) / n of the array for a
  // gather or scatter, 2 (n - 1) / n for an all_reduce) are the same figures.
  // Three runs: 3x the calls, payloads and wire bytes.
  const traffic_counters c = traffic_counters::of(p, 3);
  CHECK(c[axis::shard] == axis_traffic{.calls = 6,
                                       .payload_bytes = 3 * 2048,
                                       .wire_bytes = 4608,
                                       .sent = 4608,
                                       .received = 4608});
  CHECK(c[axis::replica] ==
        axis_traffic{
            .calls = 3, .payload_bytes = 768, .wire_bytes = 768, .sent = 768, .received = 768});
  CHECK(c[axis::federation].calls == 3);
  CHECK(c[axis::federation].payload_bytes == 1536);
  CHECK(c[axis::federation].wire_bytes == doctest::Approx(2048.0));
  CHECK(c[axis::group] == axis_traffic{});
  CHECK(c[axis::world] == axis_traffic{});
  CHECK(c.total().seconds == 0.0);  // plans carry no time
  CHECK(traffic_counters::of(p)[axis::shard] ==
        axis_traffic{
            .calls = 2, .payload_bytes = 2048, .wire_bytes = 1536, .sent = 1536, .received = 1536});
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

TEST_CASE("moved_total: the bytes all ranks of an op send together, by algorithm") {
  // S = 4000 B over n = 4 ranks
  const comm_op ar = make(comm_kind::all_reduce, axis::replica, 4000, 4);
  CHECK(moved_total(ar) == 24000);                                // 2 (4-1) x 4000
  CHECK(moved_total(ar, wire_algorithm::gather_all) == 48000);    // 4 x 3 x 4000
  CHECK(moved_share(ar) == 6000.0);                               // 2 (4-1)/4 x 4000
  CHECK(moved_share(ar, wire_algorithm::gather_all) == 12000.0);  // (4-1) x 4000
  const comm_op ag = make(comm_kind::all_gather, axis::shard, 4000, 4);
  CHECK(moved_total(ag) == 12000);                              // (4-1) x 4000
  CHECK(moved_total(ag, wire_algorithm::gather_all) == 12000);  // gathering is gathering
  const comm_op rs = make(comm_kind::reduce_scatter, axis::shard, 4000, 4);
  CHECK(moved_total(rs) == 12000);
  CHECK(moved_total(rs, wire_algorithm::gather_all) == 48000);  // every whole input to 3
  const comm_op bc = make(comm_kind::broadcast, axis::world, 4000, 4);
  CHECK(moved_total(bc) == 12000);  // 3 ranks receive 4000 B each
  CHECK(moved_share(bc) == 3000.0);
  comm_op ex = make(comm_kind::send_recv, axis::federation, 64, 8);
  ex.root = 3;
  CHECK(moved_total(ex) == 128);  // 64 B each way between the pair
  CHECK(moved_share(ex) == 64.0);
  CHECK(moved_total(make(comm_kind::all_reduce, axis::group, 4000, 1)) == 0);
}

TEST_CASE("of(plan) counts each op's share; sum adds ranks; moved_mismatch compares bytes") {
  const comm_op ar = make(comm_kind::all_reduce, axis::replica, 4000, 4);
  const algorithm_for gather = [](const comm_op&) { return wire_algorithm::gather_all; };
  CHECK(traffic_counters::of(plan{{ar}}, 2)[axis::replica].sent == 12000.0);
  CHECK(traffic_counters::of(plan{{ar}}, 2, gather)[axis::replica].received == 24000.0);
  // the algorithm changes the bytes moved, not the call as issued
  CHECK(traffic_counters::of(plan{{ar}}, 1, gather).same_traffic(traffic_counters::of(plan{{ar}})));

  traffic_counters reported;
  reported.record(axis::replica, comm_kind::all_reduce, 4000, 4, 0, moved_bytes{6048, 6048});
  reported.record_moved(axis::shard, moved_bytes{0, 20});
  CHECK(reported[axis::replica].calls == 1);
  CHECK(reported[axis::shard].calls == 0);
  CHECK(reported[axis::shard].received == 20.0);
  const std::vector<traffic_counters> four(4, reported);
  const traffic_counters all = traffic_counters::sum(four);
  CHECK(all[axis::replica].calls == 4);
  CHECK(all[axis::replica].sent == 4 * 6048.0);

  traffic_counters plan_sum;
  for (int r = 0; r < 4; ++r) plan_sum += traffic_counters::of(plan{{ar}});
  CHECK(plan_sum[axis::replica].sent == 24000.0);
  CHECK(moved_mismatch(all, plan_sum) ==
        "shard: the backends moved 0 B sent / 80 B received, the plan 0 B / 0 B\n"
        "replica: the backends moved 24192 B sent / 24192 B received, the plan 24000 B / "
        "24000 B");
  CHECK(moved_mismatch(plan_sum, plan_sum).empty());
}
