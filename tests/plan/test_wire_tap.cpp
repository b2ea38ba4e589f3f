// The wire tap: a Communicator decorator that records what each call moved (kind, axis,
// dtype, array bytes, ranks) and the time spent, independently of any plan; results are the
// wrapped communicator's.
#include "fedshard/plan/wire_tap.hpp"

#include <doctest/doctest.h>

#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "support/extra_copy_comm.hpp"
#include "support/spawn_ranks.hpp"

using namespace fedshard;
using fedshard::inproc::communicator;

static_assert(Communicator<wire_tap<communicator>>);

TEST_CASE("every call is recorded as the wire saw it; results are unchanged") {
  test::spawn_ranks(4, [](communicator& world) {
    wire_log log;
    log.keep_calls(true);
    wire_tap<communicator> tap(world, axis::group, log);
    CHECK(tap.rank() == world.rank());
    CHECK(tap.size() == 4);
    CHECK(tap.on() == axis::group);
    CHECK(&tap.inner() == &world);
    std::vector<float> x(6, float(world.rank())), y(24);
    tap.all_gather(x.data(), y.data(), 6, dtype::f32);
    for (int r = 0; r < 4; ++r) CHECK(y[static_cast<std::size_t>(6 * r)] == float(r));
    tap.all_reduce(x.data(), x.data(), 6, dtype::f32, reduce_op::sum);
    CHECK(x[0] == 6.0f);
    std::vector<double> z(3, 1.0);
    tap.reduce_scatter_async(y.data(), x.data(), 6, dtype::f32, reduce_op::avg).wait();
    tap.broadcast_async(z.data(), 3, dtype::f64, 2).wait();
    tap.barrier();  // moves no data: not recorded
    const int peer = world.rank() ^ 1;
    std::vector<float> msg(5, 1.0f), got(5);
    auto rq = tap.recv_async(got.data(), 5, dtype::f32, peer);
    tap.send(msg.data(), 5, dtype::f32, peer);
    rq.wait();
    const std::vector<wire_call> want{{comm_kind::all_gather, axis::group, dtype::f32, 96, 4},
                                      {comm_kind::all_reduce, axis::group, dtype::f32, 24, 4},
                                      {comm_kind::reduce_scatter, axis::group, dtype::f32, 96, 4},
                                      {comm_kind::broadcast, axis::group, dtype::f64, 24, 4},
                                      {comm_kind::send_recv, axis::group, dtype::f32, 20, 2}};
    CHECK(log.calls() == want);
    // What inproc reports each call moved on this rank (a copy from one rank's buffer into
    // another's is sent by the first, received by the second):
    const auto& seen = log.calls();
    const int me = world.rank();
    // all_gather, 6 f32 (24 B) per rank: this rank's block into 3 outputs, 3 blocks into its
    CHECK(seen[0].moved == moved_bytes{72, 72});
    // all_reduce of 6 f32: chunks are 16 f32 (a 64-byte line), so rank 0 reduces all 24 B:
    // it reads 3 x 24 B and writes 3 x 24 B; ranks 1-3 give their 24 B and get 24 B back
    CHECK(seen[1].moved == (me == 0 ? moved_bytes{72, 72} : moved_bytes{24, 24}));
    // reduce_scatter, blocks of 6 f32: block r of 3 peers' inputs read by r, and back
    CHECK(seen[2].moved == moved_bytes{72, 72});
    // broadcast of 3 f64 (24 B) from rank 2: its buffer into 3 others
    CHECK(seen[3].moved == (me == 2 ? moved_bytes{72, 0} : moved_bytes{0, 24}));
    // send of 5 f32 (20 B); the receive adds its 20 B to the axis, not as a call
    CHECK(seen[4].moved == moved_bytes{20, 0});
    CHECK(log.traffic()[axis::group].sent ==
          72.0 + seen[1].moved.sent + 72.0 + (me == 2 ? 72.0 : 0.0) + 20.0);
    CHECK(log.traffic()[axis::group].received ==
          72.0 + seen[1].moved.received + 72.0 + (me == 2 ? 0.0 : 24.0) + 20.0);
    CHECK(log.traffic()[axis::group].calls == 5);
    CHECK(log.traffic()[axis::group].payload_bytes == 96 + 24 + 96 + 24 + 20);
    CHECK(log.traffic()[axis::group].wire_bytes == 72.0 + 36.0 + 72.0 + 24.0 + 20.0);
    CHECK(log.traffic()[axis::group].seconds > 0.0);
    CHECK(log.traffic()[axis::shard].calls == 0);
    CHECK(log.take_calls() == want);
    CHECK(log.calls().empty());
    log.keep_calls(false);
    tap.all_reduce(x.data(), x.data(), 1, dtype::f32, reduce_op::max);
    CHECK(log.calls().empty());  // not kept, still counted
    CHECK(log.traffic()[axis::group].calls == 6);
  });
}

TEST_CASE("a split tap records on its parent's axis and log") {
  test::spawn_ranks(4, [](communicator& world) {
    wire_log log;
    wire_tap<communicator> tap(world, axis::world, log);
    wire_tap<communicator> half = tap.split(world.rank() / 2, world.rank());
    CHECK(half.size() == 2);
    CHECK(half.on() == axis::world);
    float v = 1.0f;
    half.all_reduce(&v, &v, 1, dtype::f32, reduce_op::sum);
    CHECK(v == 2.0f);
    CHECK(log.traffic()[axis::world].calls == 1);
    CHECK(log.traffic()[axis::world].wire_bytes == 4.0);  // 2 (n-1)/n x 4 B with n = 2
  });
}

TEST_CASE("wire_call::of describes the call a plan's op makes") {
  const comm_op op{.kind = comm_kind::reduce_scatter,
                   .axis = axis::shard,
                   .dtype = dtype::bf16,
                   .bytes = 128,
                   .ranks = 4,
                   .reduce = reduce_op::avg};
  CHECK(wire_call::of(op) ==
        wire_call{comm_kind::reduce_scatter, axis::shard, dtype::bf16, 128, 4});
}

TEST_CASE("wire_call::of a send_recv op is its send: the op's bytes between 2 ranks") {
  const comm_op op{.kind = comm_kind::send_recv,
                   .axis = axis::federation,
                   .dtype = dtype::f32,
                   .bytes = 64,
                   .ranks = 8,
                   .peer = 3};
  CHECK(wire_call::of(op) == wire_call{comm_kind::send_recv, axis::federation, dtype::f32, 64, 2});
  // The plan's counters and the tap's agree: one call, 64 payload bytes, 64 sent.
  traffic_counters tap;
  const wire_call w = wire_call::of(op);
  tap.record(w.axis, w.kind, w.bytes, w.ranks);
  CHECK(tap.same_traffic(traffic_counters::of(plan{{op}})));
}

namespace {

/// The 1000-f32 sum all_reduce over 4 ranks of the tests below, on the replica axis.
const comm_op k1000{.kind = comm_kind::all_reduce,
                    .axis = axis::replica,
                    .dtype = dtype::f32,
                    .bytes = 4000,
                    .ranks = 4,
                    .reduce = reduce_op::sum};

/// Runs k1000 on 4 ranks through a tap on Comm made from each rank's world; every rank's
/// counters and calls.
template <class Make>
std::vector<wire_log> run_1000(Make make) {
  std::vector<wire_log> logs(4);
  test::spawn_ranks(4, [&](communicator& world) {
    auto c = make(world);
    wire_log& log = logs[static_cast<std::size_t>(world.rank())];
    log.keep_calls(true);
    wire_tap<decltype(c)> tap(c, axis::replica, log);
    std::vector<float> x(1000, 1.0f);
    tap.all_reduce(x.data(), x.data(), 1000, dtype::f32, reduce_op::sum);
    CHECK(x[999] == 4.0f);
  });
  return logs;
}

traffic_counters sum_of(const std::vector<wire_log>& logs) {
  traffic_counters s;
  for (const auto& l : logs) s += l.traffic();
  return s;
}

}  // namespace

TEST_CASE("inproc reports the bytes it copies: 4 ranks, a 1000-f32 all_reduce") {
  const std::vector<wire_log> logs =
      run_1000([](communicator& world) { return world.split(0, world.rank()); });
  // The plan's ring: each rank sends 2 (4-1)/4 x 4000 = 6000 B, and receives as much.
  // inproc cuts the 1000 elements into chunks of ceil(1000/4) = 250 rounded up to whole
  // 16-f32 lines: 256, 256, 256 and 232 elements (1024, 1024, 1024, 928 B). Rank r reads
  // chunk r of 3 peers and writes its reduced chunk into 3 peers' outputs; its other chunks
  // go the other way: sent = received = (4000 - c_r) + 3 c_r = 4000 + 2 c_r, i.e. 6048 for
  // ranks 0-2 and 5856 for rank 3; together 3 x 6048 + 5856 = 24000 = 4 x 6000.
  for (int r = 0; r < 4; ++r) {
    const std::int64_t b = r < 3 ? 6048 : 5856;
    CHECK(logs[static_cast<std::size_t>(r)].calls().at(0).moved == moved_bytes{b, b});
  }
  const traffic_counters sum = sum_of(logs);
  CHECK(sum[axis::replica].sent == 24000.0);
  CHECK(sum[axis::replica].received == 24000.0);
  const std::vector<traffic_counters> planned(4, traffic_counters::of(plan{{k1000}}));
  CHECK(planned[0][axis::replica].sent == 6000.0);
  CHECK(moved_mismatch(sum, traffic_counters::sum(planned)).empty());
}

TEST_CASE("a backend that moves one extra copy fails the wire-equals-plan check") {
  const std::vector<wire_log> logs = run_1000([](communicator& world) {
    return test::extra_copy<communicator>(world.split(0, world.rank()));
  });
  // Each rank also sends its 4000-B input to the next rank and receives the previous one's:
  // 24000 + 4 x 4000 = 40000 B sent and received in all.
  const traffic_counters sum = sum_of(logs);
  CHECK(sum[axis::replica].sent == 40000.0);
  CHECK(sum[axis::replica].received == 40000.0);
  const std::vector<traffic_counters> planned(4, traffic_counters::of(plan{{k1000}}));
  const traffic_counters want = traffic_counters::sum(planned);
  // The calls as issued are the plan's: the old check cannot see the copy...
  CHECK(sum.same_traffic(want));
  for (const auto& l : logs) CHECK(l.calls() == std::vector<wire_call>{wire_call::of(k1000)});
  // ...the bytes can.
  CHECK(moved_mismatch(sum, want) ==
        "replica: the backends moved 40000 B sent / 40000 B received, the plan 24000 B / "
        "24000 B");
}
