// Healing is a plan (federation/heal.hpp): the heal plan's ops written out for small rounds,
// and heals run through an interpreter on inproc ranks: the donor's state reaches every
// joiner bit for bit, the donor's wire tap records exactly the size op and the padded state
// on the federation axis and nothing else, and a joiner refuses an announced size outside
// its bound before receiving anything.
#include "fedshard/federation/heal.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/traffic.hpp"
#include "fedshard/plan/wire_tap.hpp"
#include "support/spawn_ranks.hpp"

using namespace fedshard;
using fedshard::federation::heal_round;
using fedshard::inproc::communicator;

namespace {

/// A state of n bytes that holds every byte value, different for each seed.
std::string state_of(std::size_t n, int seed) {
  std::string s(n, '\0');
  for (std::size_t i = 0; i < n; ++i)
    s[i] = static_cast<char>((i * 7 + static_cast<std::size_t>(seed) * 31) % 256);
  return s;
}

}  // namespace

TEST_CASE("the heal plan of donor 0 and joiner 2 of 3 groups, for a state of 1000 bytes") {
  // Donor: send the size (one f64: 8 B) to axis rank 2, then the state (1000 B = 125 f64
  // words) to it; the joiner: the two matching recvs from axis rank 0; group 1: nothing.
  const comm_op send_size{.kind = comm_kind::send,
                          .axis = axis::federation,
                          .dtype = dtype::f64,
                          .bytes = 8,
                          .ranks = 3,
                          .peer = 2,
                          .trigger = trigger::on_demand,
                          .phase = phase::sync,
                          .in = {.role = role::state_size},
                          .overlappable = false};
  comm_op send_state = send_size;
  send_state.bytes = 1000;
  send_state.in = {.role = role::state};
  comm_op recv_size = send_size;
  recv_size.kind = comm_kind::recv;
  recv_size.peer = 0;
  recv_size.in = {};
  recv_size.out = {.role = role::state_size};
  comm_op recv_state = recv_size;
  recv_state.bytes = 1000;
  recv_state.out = {.role = role::state};

  const heal_round donor{.ranks = 3, .donor = 0, .joiners = {2}, .me = 0};
  const plan d = federation::heal_plan(donor, 1000);
  REQUIRE(d.ops.size() == 2);
  CHECK(d.ops[0] == send_size);
  CHECK(d.ops[1] == send_state);
  CHECK(describe(d.ops[0]) ==
        "send on federation (3 ranks), 8 B of f64, to axis rank 2, "
        "on_demand in sync, state_size");
  CHECK(describe(d.ops[1]) ==
        "send on federation (3 ranks), 1000 B of f64, to axis rank 2, on_demand in sync, state");
  d.check();

  heal_round joiner = donor;
  joiner.me = 2;
  const plan j = federation::heal_plan(joiner, 1000);
  REQUIRE(j.ops.size() == 2);
  CHECK(j.ops[0] == recv_size);
  CHECK(j.ops[1] == recv_state);
  CHECK(
      describe(j.ops[1]) ==
      "recv on federation (3 ranks), 1000 B of f64, from axis rank 0, on_demand in sync -> state");
  // What the joiner runs, op by op: the size first (it cannot know the state's), then the state.
  CHECK(federation::heal_size_op(joiner, 2) == recv_size);
  CHECK(federation::heal_state_op(joiner, 2, 1000) == recv_state);

  heal_round bystander = donor;
  bystander.me = 1;
  CHECK(federation::heal_plan(bystander, 1000).ops.empty());

  // Counted as the tap counts it: the donor sends 8 + 1000 B in 2 calls, the joiner makes no
  // call and receives those 1008 B.
  const auto sent = traffic_counters::of(d)[axis::federation];
  CHECK(sent.calls == 2);
  CHECK(sent.payload_bytes == 1008);
  CHECK(sent.wire_bytes == 1008.0);
  CHECK(sent.sent == 1008.0);
  CHECK(sent.received == 0.0);
  CHECK(traffic_counters::of(j).total() == axis_traffic{.received = 1008});
}

TEST_CASE("a state that is not whole words travels padded; two joiners, in the round's order") {
  // 1001 bytes travel as 126 f64 words: 1008 bytes. Donor 1, joiners {0, 2}: size and state to
  // 0, then size and state to 2.
  const heal_round donor{.ranks = 3, .donor = 1, .joiners = {0, 2}, .me = 1};
  const plan d = federation::heal_plan(donor, 1001);
  REQUIRE(d.ops.size() == 4);
  const std::int64_t bytes[] = {8, 1008, 8, 1008};
  const int peers[] = {0, 0, 2, 2};
  const role roles[] = {role::state_size, role::state, role::state_size, role::state};
  for (std::size_t k = 0; k < 4; ++k) {
    CAPTURE(k);
    CHECK(d.ops[k].kind == comm_kind::send);
    CHECK(d.ops[k].bytes == bytes[k]);
    CHECK(d.ops[k].peer == peers[k]);
    CHECK(d.ops[k].in.role == roles[k]);
  }
  CHECK(traffic_counters::of(d)[axis::federation].payload_bytes == 2032);
  CHECK(federation::padded_state_bytes(1) == 8);
  CHECK(federation::padded_state_bytes(8) == 8);
  CHECK(federation::padded_state_bytes(9) == 16);
  CHECK(federation::heal_bound(1000) == 2000 + 1048576);
}

TEST_CASE("a heal round that names the wrong ranks is refused with what was expected") {
  auto fails = [](const heal_round& r, const char* what) {
    CHECK_THROWS_WITH_AS(federation::heal_plan(r, 16), doctest::Contains(what), invalid_argument);
  };
  fails({.ranks = 1, .donor = 0, .joiners = {}, .me = 0},
        "a federation axis of 2 or more ranks, found 1");
  fails({.ranks = 3, .donor = 3, .joiners = {1}, .me = 0},
        "must be ranks of the federation axis, in [0, 3), found donor 3 and rank 0");
  fails({.ranks = 3, .donor = 0, .joiners = {0}, .me = 0},
        "joiner 0 must be a rank of the federation axis in [0, 3) other than the donor 0");
  fails({.ranks = 3, .donor = 0, .joiners = {2, 2}, .me = 0}, "joiner 2 is named more than once");
  CHECK_THROWS_WITH_AS(
      federation::heal_state_op({.ranks = 3, .donor = 0, .joiners = {2}, .me = 0}, 2, 0),
      doctest::Contains("a state of 0 bytes, expected at least 1"), invalid_argument);
  CHECK_THROWS_WITH_AS(
      federation::heal_size_op({.ranks = 3, .donor = 0, .joiners = {2}, .me = 1}, 2),
      doctest::Contains("rank 1 takes no part in the transfer from donor 0 to joiner 2"),
      invalid_argument);
}

TEST_CASE(
    "a heal through the interpreter moves the donor's state to the joiners bit for bit, "
    "counted on the donor's federation axis only") {
  // 3 groups of 2 shards; each federation axis (one per shard) heals from group 0 into group
  // 2. Shard s's state is 1000 + 3 s bytes: shard 0 sends 8 + 1000 B, shard 1 (1003 B, padded
  // to 126 words) 8 + 1008 B.
  test::spawn_ranks(6, [](communicator& world) {
    mesh m(world, {3, 1, 2});
    interpreter<communicator> in(m);
    in.wire().keep_calls(true);
    const int g = m.coords().group, s = m.coords().shard;
    const heal_round r{.ranks = 3, .donor = 0, .joiners = {2}, .me = m.axis_rank(axis::federation)};
    const std::size_t n = 1000 + 3 * static_cast<std::size_t>(s);
    std::string took;
    const auto h = federation::heal(
        in, r, [&] { return state_of(n, 100 * g + s); },
        [&](std::string b) {
          took = std::move(b);
          std::this_thread::sleep_for(std::chrono::milliseconds(20));  // inside the heal's time
        });
    // The heal's wall time: a joiner's includes take(); a rank outside the heal has none.
    CHECK(h.seconds >= (g == 2 ? 0.02 : 0.0));
    CHECK((g == 1) == (h.seconds == 0.0));
    if (g == 0) {
      CHECK(h.state_bytes == static_cast<std::int64_t>(n));
      CHECK(h.sent == 1);
      CHECK_FALSE(h.received);
      const std::int64_t padded = s == 0 ? 1000 : 1008;
      CHECK(
          in.wire().calls() ==
          std::vector<wire_call>{{comm_kind::send_recv, axis::federation, dtype::f64, 8, 2},
                                 {comm_kind::send_recv, axis::federation, dtype::f64, padded, 2}});
      const axis_traffic fed = in.traffic()[axis::federation];
      CHECK(fed.calls == 2);
      CHECK(fed.payload_bytes == 8 + padded);
      CHECK(fed.wire_bytes == static_cast<double>(8 + padded));
      CHECK(in.traffic().total().payload_bytes == 8 + padded);  // nothing on any other axis
      // Below the backend: the donor's link moved the two messages, and received nothing.
      CHECK(fed.sent == static_cast<double>(8 + padded));
      CHECK(fed.received == 0.0);
    } else {
      // A joiner makes no call; its link received the 8 + padded bytes. Group 1: nothing.
      const std::int64_t padded = s == 0 ? 1000 : 1008;
      CHECK(in.wire().calls().empty());
      CHECK(in.traffic().total() ==
            axis_traffic{.received = g == 2 ? static_cast<double>(8 + padded) : 0.0});
    }
    if (g == 2) {
      CHECK(h.received);
      CHECK(h.state_bytes == static_cast<std::int64_t>(n));
      CHECK(took == state_of(n, s));  // the donor's (group 0's) state of this shard, bit for bit
    } else {
      CHECK_FALSE(h.received);
      CHECK(took.empty());
    }
  });
}

TEST_CASE("one donor heals two joiners in turn; a collective on the axis runs after it") {
  test::spawn_ranks(3, [](communicator& world) {
    mesh m(world, {3, 1, 1});
    interpreter<communicator> in(m);
    const int g = m.coords().group;
    const heal_round r{.ranks = 3, .donor = 1, .joiners = {0, 2}, .me = g};
    std::string took;
    federation::heal(
        in, r, [&] { return state_of(77, g); }, [&](std::string b) { took = std::move(b); });
    if (g != 1) CHECK(took == state_of(77, 1));
    // donor: 2 x (8 + 80) B; joiners: nothing
    CHECK(in.traffic()[axis::federation].payload_bytes == (g == 1 ? 176 : 0));
    double x = g;
    in.run(comm_op{.kind = comm_kind::all_reduce,
                   .axis = axis::federation,
                   .dtype = dtype::f64,
                   .bytes = 8,
                   .ranks = 3,
                   .reduce = reduce_op::sum,
                   .in = {.role = role::value},
                   .out = {.role = role::value}},
           [&](const comm_op&, const operand&) {
             return buffer_view{&x, 1, dtype::f64};
           });
    CHECK(x == 3.0);
  });
}

TEST_CASE("a joiner's buffer: its memory takes the state when it holds it, its bytes never leak") {
  // The donor's 77 bytes travel as 80 (10 words). The joiner passes a buffer of 200 'z's
  // (capacity enough: the state lands in its memory) or of 3 (too small: it grows); either
  // way it gets exactly the donor's 77 bytes, none of the z's.
  for (const std::size_t held : {std::size_t{200}, std::size_t{3}}) {
    CAPTURE(held);
    test::spawn_ranks(2, [&](communicator& world) {
      mesh m(world, {2, 1, 1});
      interpreter<communicator> in(m);
      const heal_round r{.ranks = 2, .donor = 0, .joiners = {1}, .me = m.coords().group};
      if (r.me == 0) {
        federation::send_heal(in, r, state_of(77, 0));
        return;
      }
      std::string buffer(held, 'z');
      const char* memory = buffer.data();
      const std::string got = federation::receive_heal(in, r, 4096, std::move(buffer));
      CHECK(got == state_of(77, 0));
      if (held >= 80) CHECK(got.data() == memory);
    });
  }
}

TEST_CASE("a joiner refuses an announced size outside its bound before receiving a state") {
  // The donor announces a size with the heal's own size op, then stops; the joiner, bounded
  // at 4096 bytes, refuses 5000, 10.5 and -8, and has sent nothing.
  const std::pair<double, const char*> cases[] = {{5000.0, "5000"}, {10.5, "10.5"}, {-8.0, "-8"}};
  for (const auto& [announced, text] : cases) {
    CAPTURE(text);
    std::string error;
    test::spawn_ranks(2, [&](communicator& world) {
      mesh m(world, {2, 1, 1});
      interpreter<communicator> in(m);
      const heal_round r{.ranks = 2, .donor = 0, .joiners = {1}, .me = m.coords().group};
      if (r.me == 0) {
        double size = announced;
        in.run(federation::heal_size_op(r, 1), [&](const comm_op&, const operand&) {
          return buffer_view{&size, 1, dtype::f64};
        });
        return;
      }
      try {
        federation::receive_heal(in, r, 4096);
      } catch (const invalid_argument& e) {
        error = e.what();
      }
      CHECK(in.traffic().total() == axis_traffic{.received = 8});  // the size, nothing else
    });
    CHECK(error.find(std::string("donor 0 announced a state of ") + text +
                     " bytes, expected a whole number of bytes in [1, 4096]") != std::string::npos);
  }
}

TEST_CASE(
    "a heal from three donors: the first sends its own state, the others the shared one in "
    "two pieces with a trailer, and the joiner takes both bit for bit") {
  // 4 groups, donors {0, 1, 2}, joiner 3. Own states of 500 B (each group's its own), a shared
  // state of 1001 B (the same in every group). By hand:
  //  - donor 0 sends 8 B (size) + 504 B (500 padded to words);
  //  - donor 1 sends piece 0 of 2, bytes [0, 500), and a 16 B trailer: 516, padded 520; + 8;
  //  - donor 2 sends piece 1 of 2, bytes [500, 1001): 501 + 16 = 517, padded 520; + 8;
  //  - the joiner receives 3 x 8 + 504 + 520 + 520 = 1568 B and sends nothing.
  test::spawn_ranks(4, [](communicator& world) {
    mesh m(world, {4, 1, 1});
    interpreter<communicator> in(m);
    const int g = m.coords().group;
    const heal_round r{.ranks = 4, .donor = 0, .donors = {0, 1, 2}, .joiners = {3}, .me = g};
    federation::heal_parts took;
    const auto h = federation::heal_from_donors(
        in, r, [&] { return state_of(500, 100 + g); }, [&] { return state_of(1001, 7); },
        [&](federation::heal_parts p) { took = std::move(p); });
    const axis_traffic fed = in.traffic()[axis::federation];
    const std::int64_t sent[4] = {8 + 504, 8 + 520, 8 + 520, 0};
    CHECK(fed.payload_bytes == sent[g]);
    CHECK(fed.sent == static_cast<double>(sent[g]));
    CHECK(fed.received == (g == 3 ? 1568.0 : 0.0));
    if (g == 3) {
      CHECK(h.received);
      CHECK(h.donors == 3);
      CHECK(h.state_bytes == 1501);
      CHECK(took.own == state_of(500, 100));  // group 0's own state
      CHECK(took.shared == state_of(1001, 7));
    } else {
      CHECK_FALSE(h.received);
      CHECK(h.sent == 1);
      CHECK(h.state_bytes == (g == 0 ? 500 : g == 1 ? 516 : 517));
    }
  });
}

TEST_CASE("a heal from donors that hold different shared states is refused, never mixed") {
  // Donor 2's shared state differs: its trailer's digest differs from donor 1's. Then donor
  // 2's trailer is right but a byte of its piece is not: the pieces do not make the state.
  for (const bool trailer_differs : {true, false}) {
    CAPTURE(trailer_differs);
    test::spawn_ranks(4, [&](communicator& world) {
      mesh m(world, {4, 1, 1});
      interpreter<communicator> in(m);
      const int g = m.coords().group;
      heal_round r{.ranks = 4, .donor = 0, .donors = {0, 1, 2}, .joiners = {3}, .me = g};
      if (g == 2 && !trailer_differs)
        r.seal = [](std::string b) {
          b.front() = static_cast<char>(b.front() ^ 1);
          return b;
        };
      const int seed = g == 2 && trailer_differs ? 8 : 7;
      bool took = false;
      auto run = [&] {
        federation::heal_from_donors(
            in, r, [&] { return state_of(500, g); }, [&] { return state_of(1001, seed); },
            [&](federation::heal_parts) { took = true; });
      };
      if (g != 3) {
        CHECK_NOTHROW(run());
        return;
      }
      CHECK_THROWS_WITH_AS(run(),
                           trailer_differs ? doctest::Contains("donors 1 and 2 hold different "
                                                               "shared states")
                                           : doctest::Contains("from donors 1 to 2 do not make "
                                                               "the state their trailers name"),
                           invalid_argument);
      CHECK_FALSE(took);
    });
  }
}

TEST_CASE("a heal round whose donors are not right is refused with what was expected") {
  heal_round r{.ranks = 4, .donor = 0, .donors = {1, 0}, .joiners = {3}, .me = 0};
  CHECK_THROWS_WITH_AS(federation::check(r),
                       doctest::Contains("heal: the donors must start with the donor 0, found 1"),
                       invalid_argument);
  r.donors = {0, 2, 2};
  CHECK_THROWS_WITH_AS(federation::check(r),
                       doctest::Contains("heal: donor 2 is named more than once"),
                       invalid_argument);
  r.donors = {0, 3};
  CHECK_THROWS_WITH_AS(federation::check(r),
                       doctest::Contains("heal: joiner 3 must be a rank of the federation axis in "
                                         "[0, 4) other than the donors 0, 3"),
                       invalid_argument);
  r.donors = {0, 5};
  CHECK_THROWS_WITH_AS(
      federation::check(r),
      doctest::Contains("heal: donor 5 must be a rank of the federation axis in [0, 4)"),
      invalid_argument);
}

TEST_CASE("a heal from two donors sends the shared state whole, named by the round's digest") {
  // 3 groups, donors {0, 1}, joiner 2; a digest of the round's own (the shared state's first
  // 8 bytes, as a checkpoint file names itself by its trailer): donor 1 computes it once, the
  // joiner once. Donor 1 sends 8 B + the 1001 B state and its 16 B trailer, 1017 B padded to
  // 1024; the joiner receives 8 + 504 (donor 0's 500 B) + 8 + 1024 = 1544 B.
  test::spawn_ranks(3, [](communicator& world) {
    mesh m(world, {3, 1, 1});
    interpreter<communicator> in(m);
    const int g = m.coords().group;
    int digests = 0;
    heal_round r{.ranks = 3, .donor = 0, .donors = {0, 1}, .joiners = {2}, .me = g};
    r.digest = [&](const std::string& s) {
      ++digests;
      std::uint64_t d = 0;
      std::memcpy(&d, s.data(), sizeof d);
      return d;
    };
    federation::heal_parts took;
    federation::heal_from_donors(
        in, r, [&] { return state_of(500, g); }, [&] { return state_of(1001, 7); },
        [&](federation::heal_parts p) { took = std::move(p); });
    const std::int64_t sent[3] = {8 + 504, 8 + 1024, 0};
    CHECK(in.traffic()[axis::federation].sent == static_cast<double>(sent[g]));
    CHECK(in.traffic()[axis::federation].received == (g == 2 ? 1544.0 : 0.0));
    CHECK(digests == (g == 0 ? 0 : 1));
    if (g == 2) {
      CHECK(took.own == state_of(500, 0));
      CHECK(took.shared == state_of(1001, 7));
    }
  });
}
