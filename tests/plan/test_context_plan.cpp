// The per-batch plan of context parallelism (plan/context_plan.hpp): the transfers a
// placement implies, every rank's point-to-point ops in round-robin order (worked by hand
// below), the bytes at the wire against the placement's, and the cache of plans by lengths.
#include "fedshard/plan/context_plan.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/plan/wire_tap.hpp"
#include "support/error_of.hpp"
#include "support/spawn_ranks.hpp"

using namespace fedshard;
using fedshard::test::error_of;

namespace {

/// A placement written out by hand (3 ranks, f32, kv_dim 1: 2 elements, 8 bytes, a token):
///   sequence 0: blocks 0, 1 on rank 0, block 2 on rank 1, block 3 on rank 2 (2 tokens each);
///   sequence 1: block 4 on rank 2 (2 tokens), alone;
///   sequence 2: block 5 on rank 1 (2 tokens), block 6 on rank 0 (1 token).
context_placement hand_placement() {
  context_placement p;
  p.ranks = 3;
  p.blocks = {{0, 0, 0, 2, 3, 0}, {0, 1, 2, 2, 7, 0}, {0, 2, 4, 2, 11, 1}, {0, 3, 6, 2, 15, 2},
              {1, 0, 0, 2, 3, 2}, {2, 0, 0, 2, 3, 1}, {2, 1, 2, 1, 3, 0}};
  p.work = {13, 14, 18};
  p.kv_bytes.assign(9, 0);
  return p;
}

context_settings hand_settings() {
  return {.block_tokens = 2, .ranks = 3, .kv_dim = 1, .element_bytes = 4};
}

comm_op p2p(comm_kind k, int peer, std::int64_t bytes, operand in, operand out, phase ph) {
  return {.kind = k,
          .axis = axis::group,
          .dtype = dtype::f32,
          .bytes = bytes,
          .ranks = 3,
          .peer = peer,
          .phase = ph,
          .in = in,
          .out = out};
}
operand area(int index, std::int64_t offset, std::int64_t count) {
  return {.role = role::value, .index = index, .offset = offset, .count = count};
}

}  // namespace

TEST_CASE("the round-robin pairs every two ranks exactly once, for odd and even P") {
  // P = 3 (P' = 4, rounds 0..2): round 0 pairs 1-2 (0 sits out), round 1 0-2, round 2 0-1.
  CHECK(context_partner(0, 0, 3) == -1);
  CHECK(context_partner(1, 0, 3) == 2);
  CHECK(context_partner(0, 1, 3) == 2);
  CHECK(context_partner(1, 1, 3) == -1);
  CHECK(context_partner(0, 2, 3) == 1);
  CHECK(context_partner(2, 2, 3) == -1);
  for (int P : {2, 3, 4, 5, 8, 13}) {
    std::set<std::pair<int, int>> met;
    const int rounds = P + P % 2 - 1;
    for (int k = 0; k < rounds; ++k)
      for (int r = 0; r < P; ++r) {
        const int p = context_partner(r, k, P);
        if (p < 0) continue;
        CHECK(context_partner(p, k, P) == r);
        CHECK(p != r);
        if (r < p) CHECK(met.insert({r, p}).second);
      }
    CHECK(met.size() == static_cast<std::size_t>(P * (P - 1) / 2));
  }
  CHECK(error_of([] {
          (void)context_partner(0, 3, 3);
        }).find("expected a rank in [0, 3) and a round in [0, 3), found rank 0, round 3") !=
        std::string::npos);
}

TEST_CASE("transfers and ops of a placement written out by hand") {
  const context_plan p(hand_placement(), hand_settings(), axis::group);
  // Block 3 (rank 2) needs blocks 0, 1 (rank 0) and 2 (rank 1); block 2 (rank 1) needs 0, 1;
  // block 6 (rank 0) needs block 5 (rank 1); sequence 1 is whole on rank 2.
  CHECK(p.transfer(0, 1).blocks == std::vector<int>{0, 1});
  CHECK(p.transfer(0, 2).blocks == std::vector<int>{0, 1});
  CHECK(p.transfer(1, 2).blocks == std::vector<int>{2});
  CHECK(p.transfer(1, 0).blocks == std::vector<int>{5});
  CHECK(p.transfer(2, 0).tokens == 0);
  CHECK(p.transfer(2, 1).tokens == 0);
  CHECK(p.transfer(0, 1).tokens == 4);
  // Rounds (P = 3): 1-2, then 0-2, then 0-1. Rank 0 sends 4 tokens (8 elements, 32 B) to 2,
  // then to 1 its 8 elements at send-area offset 8 and receives rank 1's 2 tokens (16 B):
  // unequal, so a send then a recv (0 is the lower rank).
  const auto fwd = phase::forward, bwd = phase::backward;
  const operand none{};
  CHECK(p.forward(0).ops ==
        std::vector<comm_op>{p2p(comm_kind::send, 2, 32, area(0, 0, 8), none, fwd),
                             p2p(comm_kind::send, 1, 32, area(0, 8, 8), none, fwd),
                             p2p(comm_kind::recv, 1, 16, none, area(1, 0, 4), fwd)});
  // Rank 1: sends block 2 to rank 2; then, the higher rank of 0-1, receives first.
  CHECK(p.forward(1).ops ==
        std::vector<comm_op>{p2p(comm_kind::send, 2, 16, area(0, 0, 4), none, fwd),
                             p2p(comm_kind::recv, 0, 32, none, area(1, 0, 8), fwd),
                             p2p(comm_kind::send, 0, 16, area(0, 4, 4), none, fwd)});
  CHECK(p.forward(2).ops ==
        std::vector<comm_op>{p2p(comm_kind::recv, 1, 16, none, area(1, 0, 4), fwd),
                             p2p(comm_kind::recv, 0, 32, none, area(1, 4, 8), fwd)});
  // Backward: the same rounds, directions swapped; what was received goes back from area 1,
  // what was sent comes back into area 0.
  CHECK(p.backward(0).ops ==
        std::vector<comm_op>{p2p(comm_kind::recv, 2, 32, none, area(0, 0, 8), bwd),
                             p2p(comm_kind::send, 1, 16, area(1, 0, 4), none, bwd),
                             p2p(comm_kind::recv, 1, 32, none, area(0, 8, 8), bwd)});
  CHECK(p.backward(2).ops ==
        std::vector<comm_op>{p2p(comm_kind::send, 1, 16, area(1, 0, 4), none, bwd),
                             p2p(comm_kind::send, 0, 32, area(1, 4, 8), none, bwd)});
  CHECK(p.sent_by(0).size() == 2);
  CHECK(p.received_by(2).front() == &p.transfer(1, 2));
}

TEST_CASE("equal bytes both ways make one send_recv") {
  // Two sequences crossing: a's block 1 on rank 1 needs a's block 0 (rank 0); b's block 1 on
  // rank 0 needs b's block 0 (rank 1); 3 tokens each way, kv_dim 2: 12 elements, 24 B (bf16).
  context_placement pl;
  pl.ranks = 2;
  pl.blocks = {{0, 0, 0, 3, 6, 0}, {0, 1, 3, 3, 15, 1}, {1, 0, 0, 3, 6, 1}, {1, 1, 3, 3, 15, 0}};
  pl.work = {21, 21};
  pl.kv_bytes.assign(4, 0);
  const context_plan p(pl, {.block_tokens = 3, .ranks = 2, .kv_dim = 2, .element_bytes = 2},
                       axis::shard);
  const comm_op x{.kind = comm_kind::send_recv,
                  .axis = axis::shard,
                  .dtype = dtype::bf16,
                  .bytes = 24,
                  .ranks = 2,
                  .peer = 1,
                  .phase = phase::forward,
                  .in = area(0, 0, 12),
                  .out = area(1, 0, 12)};
  CHECK(p.forward(0).ops == std::vector<comm_op>{x});
  CHECK(error_of([&] {
          (void)context_plan(pl, {.block_tokens = 3, .ranks = 2, .element_bytes = 8}, axis::shard);
        }).find("f32 (4 bytes) or bf16 (2 bytes); found element_bytes 8") != std::string::npos);
}

TEST_CASE(
    "a skewed batch on 1 to 5 ranks: every block arrives where it is needed, bytes as placed") {
  // Skewed as FCP's batches are: two long sequences among short ones.
  const std::vector<std::int64_t> lengths{200, 13, 40, 7, 150, 31, 5, 64, 9};
  for (int P = 1; P <= 5; ++P) {
    const context_settings s{.block_tokens = 16, .ranks = P, .kv_dim = 3, .element_bytes = 4};
    const context_plan plan(fcp_placement(lengths, s), s, axis::group);
    const auto& blocks = plan.placement().blocks;
    // Each block's k/v, element e of token t: block * 1000 + t * 10 + e (exact in f32).
    auto value = [](std::size_t b, std::int64_t t, std::int64_t e) {
      return static_cast<float>(b * 1000 + static_cast<std::size_t>(t * 10 + e));
    };
    fedshard::test::spawn_ranks(P, [&](inproc::communicator& c) {
      const int me = c.rank();
      std::vector<float> send, recv;
      for (const context_transfer* t : plan.sent_by(me))
        for (int b : t->blocks)
          for (std::int64_t k = 0; k < blocks[static_cast<std::size_t>(b)].tokens * 6; ++k)
            send.push_back(value(static_cast<std::size_t>(b), k / 6, k % 6));
      std::int64_t expect_in = 0;
      for (const context_transfer* t : plan.received_by(me)) expect_in += t->tokens * 6;
      recv.assign(static_cast<std::size_t>(expect_in), -1.0f);
      wire_log log;
      log.keep_calls(true);
      wire_tap<inproc::communicator> tap(c, axis::group, log);
      run_context_ops(tap, plan.forward(me), std::as_writable_bytes(std::span(send)),
                      std::as_writable_bytes(std::span(recv)));
      std::size_t at = 0;
      for (const context_transfer* t : plan.received_by(me))
        for (int b : t->blocks)
          for (std::int64_t k = 0; k < blocks[static_cast<std::size_t>(b)].tokens * 6; ++k)
            CHECK(recv[at++] == value(static_cast<std::size_t>(b), k / 6, k % 6));
      // The bytes this rank sent to each peer are what the placement says.
      std::int64_t sent = 0, placed = 0;
      for (const wire_call& w : log.calls()) sent += w.bytes;
      for (int d = 0; d < P; ++d) placed += plan.placement().bytes(me, d);
      CHECK(sent == placed);
    });
  }
}

TEST_CASE("the cache makes a plan once per tuple of lengths and drops the least recently used") {
  context_plan_cache cache({.block_tokens = 4, .ranks = 3, .kv_dim = 1, .element_bytes = 4},
                           axis::group, 2);
  const std::vector<std::int64_t> a{9, 3}, b{5, 5, 5}, c{16};
  const auto pa = cache.get(a);
  CHECK(cache.get(a) == pa);
  CHECK(cache.hits() == 1);
  (void)cache.get(b);
  (void)cache.get(a);  // a used after b: b is the least recently used
  (void)cache.get(c);  // full: b goes
  CHECK(cache.size() == 2);
  CHECK(cache.get(a) == pa);
  CHECK(cache.hits() == 3);
  (void)cache.get(b);  // made again
  CHECK(cache.hits() == 3);
  CHECK(error_of([] {
          context_plan_cache bad({}, axis::group, 0);
        }).find("expected a capacity >= 1, found 0") != std::string::npos);
}

TEST_CASE("check_same_batch: one all_reduce of 32 bytes; other lengths on another rank refused") {
  const context_settings s{.block_tokens = 4, .ranks = 3, .kv_dim = 2, .element_bytes = 4};
  const context_plan a(fcp_placement(std::vector<std::int64_t>{9, 3, 5}, s), s, axis::group);
  const context_plan same(fcp_placement(std::vector<std::int64_t>{9, 3, 5}, s), s, axis::group);
  const context_plan other(fcp_placement(std::vector<std::int64_t>{9, 5, 3}, s), s, axis::group);
  CHECK(a.fingerprint() == same.fingerprint());
  CHECK(a.fingerprint() != other.fingerprint());
  // The op: a max all_reduce of 4 f64 on the plan's axis over its ranks.
  const comm_op op = batch_agreement_op(axis::group, 3);
  CHECK(op.kind == comm_kind::all_reduce);
  CHECK(op.reduce == reduce_op::max);
  CHECK(op.dtype == dtype::f64);
  CHECK(op.bytes == 32);
  CHECK(op.ranks == 3);
  // agree() stands for the all_reduce: the maximum of this rank's values and a peer's.
  const auto peer = [](const context_plan& p) {
    return [&p](std::span<double> v) {
      const std::uint64_t f = p.fingerprint();
      const double theirs[] = {double(f >> 32), double(f & 0xffffffffu), -double(f >> 32),
                               -double(f & 0xffffffffu)};
      REQUIRE(v.size() == 4);
      for (std::size_t i = 0; i < 4; ++i) v[i] = std::max(v[i], theirs[i]);
    };
  };
  check_same_batch(a, peer(same));
  CHECK(error_of([&] {
          check_same_batch(a, peer(other));
        }).find("the ranks of the group axis made their plans from different batches") !=
        std::string::npos);
  CHECK(error_of([&] {
          check_same_batch(other, peer(a));
        }).find("made their plans from different batches") != std::string::npos);
  // One rank: nothing runs.
  const context_settings one{.block_tokens = 4, .ranks = 1, .kv_dim = 2, .element_bytes = 4};
  int calls = 0;
  check_same_batch(context_plan(fcp_placement(std::vector<std::int64_t>{9}, one), one, axis::group),
                   [&](std::span<double>) { ++calls; });
  CHECK(calls == 0);
}
