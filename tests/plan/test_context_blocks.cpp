// Block placement for context parallelism: fcp_placement against ring_placement, worked by
// hand on small batches; balance on a skewed batch; determinism; P = 1; bad input.
#include "fedshard/plan/context_blocks.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <vector>

#include "support/skewed_batch.hpp"

using namespace fedshard;

namespace {

using lengths_t = std::vector<std::int64_t>;

/// kv_dim 4, 2-byte elements: a token's key and value are 2 x 4 x 2 = 16 bytes.
context_settings settings(std::int64_t block, int ranks) {
  return {.block_tokens = block, .ranks = ranks, .kv_dim = 4, .element_bytes = 2};
}

/// The bytes rank src sends each other rank, row by row (P x P).
std::vector<std::int64_t> matrix(const context_placement& p) {
  std::vector<std::int64_t> m;
  for (int s = 0; s < p.ranks; ++s)
    for (int d = 0; d < p.ranks; ++d) m.push_back(p.bytes(s, d));
  return m;
}

using test::skewed_batch;

/// The sum over t in [a, b) of t + 1, by a loop (the cost model's definition).
std::int64_t pairs(std::int64_t a, std::int64_t b) {
  std::int64_t s = 0;
  for (std::int64_t t = a; t < b; ++t) s += t + 1;
  return s;
}

/// Each sequence's ranks.
std::vector<std::set<int>> ranks_of(const context_placement& p, std::size_t sequences) {
  std::vector<std::set<int>> r(sequences);
  for (const context_block& b : p.blocks) r[static_cast<std::size_t>(b.sequence)].insert(b.rank);
  return r;
}

}  // namespace

TEST_CASE("causal_work counts the (query, key) pairs t + 1 of each query token") {
  CHECK(causal_work(0, 2) == 3);   // 1 + 2
  CHECK(causal_work(2, 2) == 7);   // 3 + 4
  CHECK(causal_work(6, 2) == 15);  // 7 + 8
  CHECK(causal_work(1, 1) == 2);
  CHECK(causal_work(0, 8) == 36);  // 8 x 9 / 2: a sequence costs the same however it is cut
  // a full block j of B = 512: B^2 j + B (B + 1) / 2; j = 3: 786432 + 131328
  CHECK(causal_work(3 * 512, 512) == 917760);
  CHECK(causal_work(3 * 512, 512) == pairs(1536, 2048));
  CHECK(causal_work(5, 3) == pairs(5, 8));  // 6 + 7 + 8 = 21
}

TEST_CASE("fcp_placement of {8, 2, 2, 4}, B = 2, on 3 ranks, worked by hand") {
  // Blocks (sequence, index: tokens, work): (0,0: [0,2) 3) (0,1: [2,4) 7) (0,2: [4,6) 11)
  // (0,3: [6,8) 15) (1,0: 3) (2,0: 3) (3,0: 3) (3,1: 7). Sequence work 36, 3, 3, 10; W = 52;
  // T = ceil(52 / 3) = 18. Order by work: 0 (36), 3 (10), 1 (3), 2 (3). A 2-token block's
  // keys and values: 2 x 2 x 4 x 2 = 32 bytes.
  //
  // Rule least_loaded. Sequence 0: least loaded rank 0, 36 > 18: split, last block first.
  //   b3 (15) -> r0 = 15; b2 (11): 26 > 18, least loaded r1 -> 11; b1 (7): 18 <= 18 -> r1 =
  //   18; b0 (3): 21 > 18, least loaded r2 -> 3. Sequence 3 (10): least loaded r2 (3): 13 <=
  //   18, whole on r2 (13). Sequence 1 (3): r2 (13) -> 16. Sequence 2 (3): r0 (15) -> 18.
  //   Work {18, 18, 16}. Only sequence 0 is split; b3 on r0 needs b0 (r2) and b1, b2 (r1):
  //   r1 -> r0 64, r2 -> r0 32; b2 on r1 needs b0 (r2): r2 -> r1 32 (b1 on r1 needs b0 too,
  //   received once). Max received: r0, 96.
  // Rule best_fit. Sequence 0: b3 (15): every rank fits, all empty: r0 -> 15; b2 (11): 26 >
  //   18, the fullest rank with room for 11: r1 (r0 has 3 left) -> 11; b1 (7) -> r1 18; b0
  //   (3): 21 > 18, fullest with room for 3: r0 (15) -> 18. Sequences 3, 1, 2 whole on the
  //   least loaded r2: 10, 13, 16. Work {18, 18, 16}. Bytes: b3 on r0 needs b1, b2 from r1
  //   (64); b1, b2 on r1 need b0 from r0 (32). Max received: r0, 64.
  // Step 5: max work equal (18); best_fit's busiest receiver gets less (64 < 96): best_fit.
  const lengths_t l{8, 2, 2, 4};
  const context_placement least =
      detail::pack_blocks(l, settings(2, 3), detail::chunk_rule::least_loaded);
  CHECK(least.blocks == std::vector<context_block>{{0, 0, 0, 2, 3, 2},
                                                   {0, 1, 2, 2, 7, 1},
                                                   {0, 2, 4, 2, 11, 1},
                                                   {0, 3, 6, 2, 15, 0},
                                                   {1, 0, 0, 2, 3, 2},
                                                   {2, 0, 0, 2, 3, 0},
                                                   {3, 0, 0, 2, 3, 2},
                                                   {3, 1, 2, 2, 7, 2}});
  CHECK(least.work == std::vector<std::int64_t>{18, 18, 16});
  CHECK(matrix(least) == std::vector<std::int64_t>{0, 0, 0, 64, 0, 0, 32, 32, 0});
  CHECK(least.max_received_bytes() == 96);

  const context_placement p = fcp_placement(l, settings(2, 3));
  CHECK(p == detail::pack_blocks(l, settings(2, 3), detail::chunk_rule::best_fit));
  const std::vector<context_block> blocks{
      {0, 0, 0, 2, 3, 0}, {0, 1, 2, 2, 7, 1}, {0, 2, 4, 2, 11, 1}, {0, 3, 6, 2, 15, 0},
      {1, 0, 0, 2, 3, 2}, {2, 0, 0, 2, 3, 2}, {3, 0, 0, 2, 3, 2},  {3, 1, 2, 2, 7, 2}};
  CHECK(p.ranks == 3);
  CHECK(p.blocks == blocks);
  CHECK(p.work == std::vector<std::int64_t>{18, 18, 16});
  CHECK(matrix(p) == std::vector<std::int64_t>{0, 32, 0, 64, 0, 0, 0, 0, 0});
  CHECK(p.total_bytes() == 96);
  CHECK(p.max_received_bytes() == 64);
  CHECK(p.total_work() == 52);
  CHECK(p.max_work() == 18);
  CHECK(p.imbalance() == doctest::Approx(54.0 / 52.0));
}

TEST_CASE("ring_placement of {8, 2, 2, 4} on 3 ranks, worked by hand") {
  // Chunk c of a sequence of L tokens: [floor(cL/3), floor((c+1)L/3)).
  // L = 8: [0,2) 3 on r0, [2,5) 3+4+5 = 12 on r1, [5,8) 6+7+8 = 21 on r2.
  // L = 2: [0,0) empty on r0, [0,1) 1 on r1, [1,2) 2 on r2 (twice: sequences 1 and 2).
  // L = 4: [0,1) 1 on r0, [1,2) 2 on r1, [2,4) 3+4 = 7 on r2.
  // Work: r0 3+1 = 4, r1 12+1+1+2 = 16, r2 21+2+2+7 = 32; max/mean = 32 / (52/3).
  // Bytes (16 per token): rank r receives from r-1 every token but its own chunk's:
  // r0 from r2: 6+2+2+3 = 13 tokens, 208 bytes; r1 from r0: 5+1+1+3 = 10, 160;
  // r2 from r1: 5+1+1+2 = 9, 144. In all (P-1) x 16 tokens x 16 = 512.
  const lengths_t l{8, 2, 2, 4};
  const context_placement p = ring_placement(l, settings(2, 3));
  const std::vector<context_block> blocks{
      {0, 0, 0, 2, 3, 0}, {0, 1, 2, 3, 12, 1}, {0, 2, 5, 3, 21, 2}, {1, 1, 0, 1, 1, 1},
      {1, 2, 1, 1, 2, 2}, {2, 1, 0, 1, 1, 1},  {2, 2, 1, 1, 2, 2},  {3, 0, 0, 1, 1, 0},
      {3, 1, 1, 1, 2, 1}, {3, 2, 2, 2, 7, 2}};
  CHECK(p.blocks == blocks);
  CHECK(p.work == std::vector<std::int64_t>{4, 16, 32});
  CHECK(matrix(p) == std::vector<std::int64_t>{0, 160, 0, 0, 0, 144, 208, 0, 0});
  CHECK(p.total_bytes() == 512);
  CHECK(p.max_received_bytes() == 208);
  CHECK(p.imbalance() == doctest::Approx(96.0 / 52.0));
}

TEST_CASE("a single sequence: backwards filling balances where forwards would not") {
  // Both rules place it alike (best_fit's ranks are least_loaded's here); ties keep
  // least_loaded's.
  // {8}, B = 2, P = 2: blocks 3, 7, 11, 15; W = 36, T = 18. b3 (15) -> r0; b2 (11): 26 > 18,
  // least loaded r1 -> 11; b1 (7): 18 <= 18 -> r1 18; b0 (3): 21 > 18, least loaded r0 -> 18.
  // Work {18, 18} (forwards: b0, b1 -> r0 10, b2 -> r1 11, b3 -> r0 25: {25, 11}).
  // Bytes: b3 on r0 needs b1, b2 from r1 (64); b1, b2 on r1 need b0 from r0 (32).
  const lengths_t l{8};
  const context_placement p = fcp_placement(l, settings(2, 2));
  CHECK(p.work == std::vector<std::int64_t>{18, 18});
  CHECK(p.blocks[0].rank == 0);
  CHECK(p.blocks[1].rank == 1);
  CHECK(p.blocks[2].rank == 1);
  CHECK(p.blocks[3].rank == 0);
  CHECK(matrix(p) == std::vector<std::int64_t>{0, 32, 64, 0});
  CHECK(p == detail::pack_blocks(l, settings(2, 2), detail::chunk_rule::best_fit));
  CHECK(p == detail::pack_blocks(l, settings(2, 2), detail::chunk_rule::least_loaded));
}

TEST_CASE("more ranks than blocks, P = 5: the bound T + w_max holds with idle ranks") {
  // {4}, B = 2: blocks 3 and 7, W = 10, T = 2. b1 (7) exceeds T on the least loaded r0 (7);
  // b0 (3): 10 > 2, least loaded r1 -> 3. Work {7, 3, 0, 0, 0} <= T + w_max = 9.
  // Bytes: b1 on r0 needs b0 from r1: 2 tokens, 32 bytes.
  const lengths_t l{4};
  const context_placement p = fcp_placement(l, settings(2, 5));
  CHECK(p.work == std::vector<std::int64_t>{7, 3, 0, 0, 0});
  CHECK(p.total_bytes() == 32);
  CHECK(p.bytes(1, 0) == 32);
  // The ring on 5 ranks: chunks [0,0) [0,1) [1,2) [2,3) [3,4)... of L = 4: floor(4c/5) =
  // 0, 0, 1, 2, 3, 4: r1 [0,1) 1, r2 [1,2) 2, r3 [2,3) 3, r4 [3,4) 4. Rank r receives
  // L - |own chunk|: 4, 3, 3, 3, 3 tokens, 16 x 16 = 256 bytes = (P-1) L x 16.
  const context_placement r = ring_placement(l, settings(2, 5));
  CHECK(r.work == std::vector<std::int64_t>{0, 1, 2, 3, 4});
  CHECK(r.bytes(4, 0) == 64);
  CHECK(r.bytes(0, 1) == 48);
  CHECK(r.total_bytes() == 256);
}

TEST_CASE("one rank: everything on rank 0, nothing exchanged") {
  const lengths_t l{8, 2, 2, 4, 1000, 3};
  for (const context_placement& p :
       {fcp_placement(l, settings(2, 1)), ring_placement(l, settings(2, 1))}) {
    CHECK(p.work == std::vector<std::int64_t>{36 + 3 + 3 + 10 + 500500 + 6});
    CHECK(p.kv_bytes == std::vector<std::int64_t>{0});
    for (const context_block& b : p.blocks) CHECK(b.rank == 0);
  }
  CHECK(fcp_placement(l, settings(2, 1)).blocks.size() == 4 + 1 + 1 + 2 + 500 + 2);
}

TEST_CASE("the placement is a pure function of the lengths and settings") {
  const lengths_t l = skewed_batch();
  const std::array<std::int64_t, 4> same_ties{4, 4, 4, 4};  // ties: sequence and rank order
  for (int ranks : {3, 8, 64}) {
    const context_placement a = fcp_placement(l, settings(512, ranks));
    CHECK(a == fcp_placement(lengths_t(l), settings(512, ranks)));
    CHECK(ring_placement(l, settings(512, ranks)) == ring_placement(l, settings(512, ranks)));
  }
  // {4, 4, 4, 4}, B = 2, P = 2: each sequence 10 (blocks 3, 7), W = 40, T = 20; sequences in
  // index order (equal work), each whole on the least loaded, lowest rank: 0 -> r0, 1 -> r1,
  // 2 -> r0, 3 -> r1.
  const context_placement t = fcp_placement(same_ties, settings(2, 2));
  CHECK(t.work == std::vector<std::int64_t>{20, 20});
  const std::vector<int> expect{0, 0, 1, 1, 0, 0, 1, 1};
  for (std::size_t i = 0; i < t.blocks.size(); ++i) CHECK(t.blocks[i].rank == expect[i]);
  CHECK(t.total_bytes() == 0);
}

TEST_CASE("skewed batch: fcp within T + w_max, the ring near (2P - 1) / P; fewer bytes") {
  const lengths_t l = skewed_batch();
  std::int64_t total = 0, w_max = 0;
  for (std::int64_t len : l) {
    total += pairs(0, len);
    for (std::int64_t a = 0; a < len; a += 512)
      w_max = std::max(w_max, pairs(a, std::min(a + 512, len)));
  }
  for (int ranks : {3, 5, 7, 8, 64}) {
    CAPTURE(ranks);
    const context_placement f = fcp_placement(l, settings(512, ranks));
    const context_placement r = ring_placement(l, settings(512, ranks));
    CHECK(f.total_work() == total);
    CHECK(r.total_work() == total);
    const std::int64_t target = (total + ranks - 1) / ranks;
    CHECK(f.max_work() <= target + w_max);
    // Ring: chunk c of L tokens costs about L^2 (2c + 1) / (2 P^2); the last rank's share,
    // (2P - 1) / P of the mean, for L >> P.
    CHECK(r.imbalance() >= 0.99 * (2.0 * ranks - 1.0) / ranks);
    CHECK(f.imbalance() < r.imbalance());
    CHECK(f.total_bytes() < r.total_bytes());
    std::int64_t tokens = 0;
    for (std::int64_t len : l) tokens += len;
    CHECK(r.total_bytes() == (ranks - 1) * tokens * 16);
    // Every sequence whose work exceeds T cannot fit on a rank: it must be split.
    const auto where = ranks_of(f, l.size());
    for (std::size_t i = 0; i < l.size(); ++i)
      if (pairs(0, l[i]) > target) CHECK(where[i].size() > 1);
  }
  // At P = 8 the bound is within 6%: W / P is about 7e8 pairs, w_max about 3.3e7.
  const context_placement f8 = fcp_placement(l, settings(512, 8));
  CHECK(f8.imbalance() <=
        1.0 + (1.0 + static_cast<double>(w_max)) * 8.0 / static_cast<double>(total));
  CHECK(f8.imbalance() <= 1.06);
  // Not tight: measured 1.0000 at P = 3, 5, 7 and 8 (the short sequences fill the room the
  // long ones' chunks leave); kept as a regression guard with some slack.
  for (int ranks : {3, 5, 7, 8}) CHECK(fcp_placement(l, settings(512, ranks)).imbalance() < 1.001);
}

TEST_CASE("skewed batch: step 5 keeps best_fit where blocks are coarse, else least_loaded") {
  // Measured on this batch (the header's figures): at P = 8 both rules are within one first
  // block's work of each other in max work, and least_loaded's busiest receiver gets less
  // (197 MB against 333 MB at 4 KiB a token); at P = 64 best_fit's max/mean is 1.0043
  // against least_loaded's 1.1021.
  const lengths_t l = skewed_batch();
  using detail::chunk_rule;
  const auto least8 = detail::pack_blocks(l, settings(512, 8), chunk_rule::least_loaded);
  const auto fit8 = detail::pack_blocks(l, settings(512, 8), chunk_rule::best_fit);
  CHECK(std::abs(least8.max_work() - fit8.max_work()) < causal_work(0, 512));
  CHECK(least8.max_received_bytes() < fit8.max_received_bytes());
  CHECK(fcp_placement(l, settings(512, 8)) == least8);
  const auto least64 = detail::pack_blocks(l, settings(512, 64), chunk_rule::least_loaded);
  const auto fit64 = detail::pack_blocks(l, settings(512, 64), chunk_rule::best_fit);
  CHECK(fit64.imbalance() < 1.01);
  CHECK(least64.imbalance() > 1.1);
  CHECK(fcp_placement(l, settings(512, 64)) == fit64);
}

TEST_CASE("bad input throws invalid_argument saying what was expected and found") {
  using doctest::Contains;
  const lengths_t l{8, 2};
  CHECK_THROWS_WITH_AS(fcp_placement(l, settings(0, 2)),
                       Contains("expected block_tokens > 0, found 0"), invalid_argument);
  CHECK_THROWS_WITH_AS(fcp_placement(l, settings(2, 0)), Contains("expected ranks > 0, found 0"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(ring_placement(l, settings(2, -1)), Contains("expected ranks > 0, found -1"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(fcp_placement(lengths_t{}, settings(2, 2)),
                       Contains("expected at least one sequence, found an empty batch"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(ring_placement(lengths_t{}, settings(2, 2)),
                       Contains("found an empty batch"), invalid_argument);
  CHECK_THROWS_WITH_AS(fcp_placement(lengths_t{8, 0}, settings(2, 2)),
                       Contains("expected every length in [1, 2^31], found 0 at sequence 1"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(ring_placement(lengths_t{-3}, settings(2, 2)),
                       Contains("found -3 at sequence 0"), invalid_argument);
  CHECK_THROWS_WITH_AS(fcp_placement(lengths_t{(std::int64_t{1} << 31) + 1}, settings(2, 2)),
                       Contains("found 2147483649 at sequence 0"), invalid_argument);
  context_settings s = settings(2, 2);
  s.kv_dim = 0;
  CHECK_THROWS_WITH_AS(fcp_placement(l, s), Contains("expected kv_dim > 0, found 0"),
                       invalid_argument);
  s = settings(2, 2);
  s.element_bytes = 0;
  CHECK_THROWS_WITH_AS(ring_placement(l, s), Contains("expected element_bytes > 0, found 0"),
                       invalid_argument);
  s = settings(2, 2);
  s.kv_dim = std::int64_t{1} << 62;
  CHECK_THROWS_WITH_AS(fcp_placement(l, s), Contains("key/value bytes to fit in int64"),
                       invalid_argument);
  // ring_placement does not use block_tokens
  CHECK(ring_placement(l, settings(0, 2)).total_work() == 36 + 3);
  const context_placement p = fcp_placement(l, settings(2, 2));
  CHECK_THROWS_WITH_AS(static_cast<void>(p.bytes(2, 0)),
                       Contains("expected ranks in [0, 2), found src 2, dst 0"), invalid_argument);
}
