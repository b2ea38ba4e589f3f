// start_op: one comm_op issued on its axis's communicator. The element count comes from the
// op's array bytes and dtype (per rank for all_gather / reduce_scatter), the reduction and
// root from the op; the wire tap sees exactly the op's kind, dtype, bytes and ranks.
#include "fedshard/plan/start_op.hpp"

#include <doctest/doctest.h>

#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/plan/wire_tap.hpp"
#include "support/spawn_ranks.hpp"

using namespace fedshard;
using fedshard::inproc::communicator;

namespace {

comm_op make_op(comm_kind k, dtype t, std::int64_t elements, int ranks) {
  comm_op op;
  op.kind = k;
  op.axis = axis::shard;
  op.dtype = t;
  op.bytes = elements * static_cast<std::int64_t>(size_of(t));
  op.ranks = ranks;
  if (k == comm_kind::all_reduce || k == comm_kind::reduce_scatter) op.reduce = reduce_op::sum;
  return op;
}

}  // namespace

TEST_CASE("start_op runs each executable kind with the op's counts, and the wire sees the op") {
  constexpr int kRanks = 4;
  constexpr std::int64_t kArray = 12;  // the whole array, in elements
  test::spawn_ranks(kRanks, [&](communicator& world) {
    wire_log log;
    log.keep_calls(true);
    wire_tap<communicator> tap(world, axis::shard, log);
    const auto r = static_cast<float>(world.rank());

    // all_gather: each rank contributes kArray / ranks elements
    const auto ag = make_op(comm_kind::all_gather, dtype::f32, kArray, kRanks);
    std::vector<float> block(kArray / kRanks, r), full(kArray, -1.0f);
    start_op(tap, ag, block.data(), full.data()).wait();
    for (std::int64_t i = 0; i < kArray; ++i)
      CHECK(full[static_cast<std::size_t>(i)] == static_cast<float>(i / (kArray / kRanks)));

    // reduce_scatter: the whole array in, each rank's kArray / ranks sums out
    const auto rs = make_op(comm_kind::reduce_scatter, dtype::f32, kArray, kRanks);
    std::vector<float> in(kArray);
    for (std::int64_t i = 0; i < kArray; ++i) in[static_cast<std::size_t>(i)] = float(i) + r;
    std::vector<float> mine(kArray / kRanks, -1.0f);
    start_op(tap, rs, in.data(), mine.data()).wait();
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const auto g = static_cast<float>(static_cast<std::size_t>(world.rank()) * mine.size() + i);
      CHECK(mine[i] == kRanks * g + 0 + 1 + 2 + 3);
    }

    // all_reduce in place, in f64: the count is bytes / 8
    const auto ar = make_op(comm_kind::all_reduce, dtype::f64, 5, kRanks);
    std::vector<double> v(5, 1.0 + world.rank());
    start_op(tap, ar, v.data(), v.data()).wait();
    for (double x : v) CHECK(x == 1.0 + 2.0 + 3.0 + 4.0);

    // broadcast from the op's root writes `out` on every rank
    auto bc = make_op(comm_kind::broadcast, dtype::f32, 3, kRanks);
    bc.root = 2;
    std::vector<float> b(3, r);
    start_op(tap, bc, nullptr, b.data()).wait();
    for (float x : b) CHECK(x == 2.0f);

    const auto calls = log.calls();
    REQUIRE(calls.size() == 4);
    const comm_op* ops[] = {&ag, &rs, &ar, &bc};
    for (std::size_t i = 0; i < calls.size(); ++i) {
      CHECK(calls[i].kind == ops[i]->kind);
      CHECK(calls[i].dtype == ops[i]->dtype);
      CHECK(calls[i].bytes == ops[i]->bytes);
      CHECK(calls[i].ranks == ops[i]->ranks);
    }
  });
}

TEST_CASE("start_op exchanges a send_recv op's buffers with its peer, in both directions") {
  constexpr int kRanks = 4;
  test::spawn_ranks(kRanks, [](communicator& world) {
    wire_log log;
    log.keep_calls(true);
    wire_tap<communicator> tap(world, axis::shard, log);
    const int me = world.rank();
    // Two rounds of pairs, each rank with a lower and a higher peer once: (0 1)(2 3), (0 3)(1 2).
    for (int peer : {me ^ 1, kRanks - 1 - me}) {
      auto op = make_op(comm_kind::send_recv, dtype::f64, 5, kRanks);
      op.peer = peer;
      std::vector<double> mine(5), theirs(5, -1.0);
      for (std::size_t i = 0; i < mine.size(); ++i) mine[i] = 10.0 * me + static_cast<double>(i);
      start_op(tap, op, mine.data(), theirs.data()).wait();
      for (std::size_t i = 0; i < theirs.size(); ++i)
        CHECK(theirs[i] == 10.0 * peer + static_cast<double>(i));
    }
    const auto calls = log.calls();  // the sends, one per op
    REQUIRE(calls.size() == 2);
    for (const auto& c : calls)
      CHECK(c == wire_call{comm_kind::send_recv, axis::shard, dtype::f64, 40, 2});
  });
}

TEST_CASE("start_op refuses a send_recv op whose peer is the rank itself, naming the op") {
  test::spawn_ranks(2, [](communicator& world) {
    auto op = make_op(comm_kind::send_recv, dtype::f32, 4, 2);
    op.peer = world.rank();
    std::vector<float> x(4), y(4);
    CHECK_THROWS_WITH_AS(start_op(world, op, x.data(), y.data()),
                         doctest::Contains("cannot exchange with itself"), invalid_argument);
  });
}

TEST_CASE(
    "start_op moves a send op's input one way into its peer's recv op; only the sender "
    "records it") {
  // Rank 0 sends 3 f64 (24 bytes) to rank 2; rank 2 receives them; rank 1 stays out.
  test::spawn_ranks(3, [](communicator& world) {
    wire_log log;
    log.keep_calls(true);
    wire_tap<communicator> tap(world, axis::federation, log);
    const int me = world.rank();
    std::vector<double> buf(3, -1.0);
    if (me == 0) {
      buf = {1.5, -2.25, 1e300};
      auto op = make_op(comm_kind::send, dtype::f64, 3, 3);
      op.peer = 2;
      start_op(tap, op, buf.data(), nullptr).wait();
      CHECK(log.calls() ==
            std::vector<wire_call>{{comm_kind::send_recv, axis::federation, dtype::f64, 24, 2}});
    } else if (me == 2) {
      auto op = make_op(comm_kind::recv, dtype::f64, 3, 3);
      op.peer = 0;
      start_op(tap, op, nullptr, buf.data()).wait();
      CHECK(buf == std::vector<double>{1.5, -2.25, 1e300});
      CHECK(log.calls().empty());
    }
  });
}

TEST_CASE("start_op refuses a send or recv op whose peer is the rank itself, naming the op") {
  test::spawn_ranks(2, [](communicator& world) {
    std::vector<float> x(4);
    auto op = make_op(comm_kind::send, dtype::f32, 4, 2);
    op.peer = world.rank();
    CHECK_THROWS_WITH_AS(start_op(world, op, x.data(), nullptr),
                         doctest::Contains("a rank cannot send to itself"), invalid_argument);
    op.kind = comm_kind::recv;
    CHECK_THROWS_WITH_AS(start_op(world, op, nullptr, x.data()),
                         doctest::Contains("a rank cannot receive from itself"), invalid_argument);
  });
}
