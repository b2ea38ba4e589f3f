// The wire tap: a Communicator decorator that records what each call moved (kind, axis,
// dtype, array bytes, ranks) and the time spent, independently of any plan; results are the
// wrapped communicator's.
#include "fedshard/plan/wire_tap.hpp"

#include <doctest/doctest.h>

#include <vector>

#include "fedshard/comm/inproc.hpp"
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
