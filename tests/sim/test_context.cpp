// The simulator's price of a context-parallel attention step (sim/context.hpp): FCP's block
// placement and ring context parallelism priced by one code path, worked by hand on a small
// cluster; P = 1 moves nothing; bad clusters and settings are refused with a message; and the
// README's table, the bench's skewed batch at P = 8 and 64 on DGX H100 nodes.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <tuple>
#include <utility>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/plan/context_blocks.hpp"
#include "fedshard/sim/context.hpp"
#include "fedshard/sim/topology.hpp"
#include "support/skewed_batch.hpp"

using namespace fedshard;
using namespace fedshard::sim;
using doctest::Contains;

namespace {

using lengths_t = std::vector<std::int64_t>;

/// Two GPUs per node. NVLink: α 1 s, 32 B/s. Network: α 2 s, one NIC of 16 B/s per node, so
/// 8 B/s per GPU. op_latency 1 s. 8 FLOP/s x MFU 0.5 = 4 FLOP/s, and with heads = head_dim =
/// 1 a (query, key) pair is 4 FLOPs: a rank's compute in seconds is its work.
cluster tiny_cluster() {
  cluster c;
  c.name = "tiny";
  c.gpus_per_node = 2;
  c.nics_per_node = 1;
  c.nic_bandwidth = 16;
  c.intra = {1.0, 32.0};
  c.inter = {2.0, 0.0};
  c.op_latency = 1;
  c.peak_flops = 8;
  c.default_mfu = 0.5;
  return c;
}

context_price_settings unit_pairs() {
  return {.heads = 1, .head_dim = 1};
}

/// B tokens per block, P ranks, kv_dim 4, 2-byte elements: a token's keys and values are 16 B.
context_settings blocks(std::int64_t b, int ranks) {
  return {.block_tokens = b, .ranks = ranks, .kv_dim = 4, .element_bytes = 2};
}

void check_rank(const context_rank_price& r, double compute, double receive, double send,
                double launch) {
  CHECK(r.compute == doctest::Approx(compute));
  CHECK(r.receive == doctest::Approx(receive));
  CHECK(r.send == doctest::Approx(send));
  CHECK(r.launch == doctest::Approx(launch));
}

using test::skewed_batch;

}  // namespace

TEST_CASE("flops_per_pair is 4 x head_dim x heads: QK^T and PV of one layer's forward") {
  CHECK(context_price_settings{}.flops_per_pair() == 4.0 * 128 * 32);
  CHECK(unit_pairs().flops_per_pair() == 4.0);
}

TEST_CASE("fcp's placement of {8, 2, 2, 4}, B = 2, P = 3, priced by hand") {
  // The placement (tests/plan/test_context_blocks.cpp): work {18, 18, 16}; bytes r0 -> r1
  // 32 (block 0 of sequence 0), r1 -> r0 64 (blocks 1 and 2). Ranks 0 and 1 share node 0,
  // rank 2 is alone on node 1; both messages stay on NVLink: 1 + 32/32 = 2 s and 1 + 64/32 =
  // 3 s. One launch (1 s) for each rank with traffic.
  // r0: compute 18, receive 3, send 2, comm 1 + 3 = 4: serial 22, overlapped 18.
  // r1: compute 18, receive 2, send 3, comm 4: 22, 18. r2: compute 16, no traffic: 16, 16.
  const lengths_t l{8, 2, 2, 4};
  const context_placement p = fcp_placement(l, blocks(2, 3));
  REQUIRE(p.work == std::vector<std::int64_t>{18, 18, 16});
  const context_price price = price_context(p, tiny_cluster(), unit_pairs());
  REQUIRE(price.ranks.size() == 3);
  check_rank(price.ranks[0], 18, 3, 2, 1);
  check_rank(price.ranks[1], 18, 2, 3, 1);
  check_rank(price.ranks[2], 16, 0, 0, 0);
  CHECK(price.ranks[0].communication() == doctest::Approx(4));
  CHECK(price.ranks[2].communication() == 0);
  CHECK(price.serial == doctest::Approx(22));
  CHECK(price.overlapped == doctest::Approx(18));
  CHECK(price.max_compute == doctest::Approx(18));
  CHECK(price.max_communication == doctest::Approx(4));

  // MFU 0.25 halves the FLOP rate: compute 36, 36, 32; serial 40, overlapped 36.
  context_price_settings slow = unit_pairs();
  slow.mfu = 0.25;
  const context_price half = price_context(p, tiny_cluster(), slow);
  CHECK(half.ranks[0].compute == doctest::Approx(36));
  CHECK(half.serial == doctest::Approx(40));
  CHECK(half.overlapped == doctest::Approx(36));
}

TEST_CASE("the ring's placement of {8, 2, 2, 4}, P = 3, priced by hand in P - 1 = 2 steps") {
  // The placement (tests/plan/test_context_blocks.cpp): work {4, 16, 32}; bytes r0 -> r1
  // 160, r1 -> r2 144, r2 -> r0 208. Each pair is 2 messages and each rank 2 launches (2 s).
  // r0 -> r1, NVLink: 2 x 1 + 160/32 = 7 s. r1 -> r2 and r2 -> r0 cross nodes at 8 B/s:
  // 2 x 2 + 144/8 = 22 s and 2 x 2 + 208/8 = 30 s.
  // r0: compute 4, receive 30, send 7, comm 2 + 30 = 32: serial 36, overlapped 32.
  // r1: compute 16, receive 7, send 22, comm 24: 40, 24.
  // r2: compute 32, receive 22, send 30, comm 32: 64, 32.
  const lengths_t l{8, 2, 2, 4};
  const context_placement p = ring_placement(l, blocks(2, 3));
  REQUIRE(p.work == std::vector<std::int64_t>{4, 16, 32});
  const context_price price =
      price_context(p, tiny_cluster(), unit_pairs(), context_exchange::ring);
  check_rank(price.ranks[0], 4, 30, 7, 2);
  check_rank(price.ranks[1], 16, 7, 22, 2);
  check_rank(price.ranks[2], 32, 22, 30, 2);
  CHECK(price.serial == doctest::Approx(64));
  CHECK(price.overlapped == doctest::Approx(32));
  CHECK(price.max_compute == doctest::Approx(32));
  CHECK(price.max_communication == doctest::Approx(32));

  // The network oversubscribed 2x: 4 B/s per GPU. r1 -> r2: 4 + 36 = 40; r2 -> r0: 4 + 52 =
  // 56. r2: comm 2 + max(40, 56) = 58, serial 90.
  cluster busy = tiny_cluster();
  busy.inter.oversubscription = 2;
  const context_price slow = price_context(p, busy, unit_pairs(), context_exchange::ring);
  check_rank(slow.ranks[2], 32, 40, 56, 2);
  CHECK(slow.serial == doctest::Approx(90));

  // The same bytes as one point-to-point exchange: one message per pair, one launch.
  // r2: receive 2 + 18 = 20, send 2 + 26 = 28, comm 1 + 28 = 29: serial 61.
  const context_price once = price_context(p, tiny_cluster(), unit_pairs());
  check_rank(once.ranks[2], 32, 20, 28, 1);
  CHECK(once.serial == doctest::Approx(61));
}

TEST_CASE("P = 1: no communication, the step is the compute") {
  // {8, 2, 2, 4}: W = 36 + 3 + 3 + 10 = 52 pairs on the one rank: 52 s.
  const lengths_t l{8, 2, 2, 4};
  for (const auto& [p, e] :
       {std::pair{fcp_placement(l, blocks(2, 1)), context_exchange::point_to_point},
        std::pair{ring_placement(l, blocks(2, 1)), context_exchange::ring}}) {
    const context_price price = price_context(p, tiny_cluster(), unit_pairs(), e);
    REQUIRE(price.ranks.size() == 1);
    check_rank(price.ranks[0], 52, 0, 0, 0);
    CHECK(price.serial == doctest::Approx(52));
    CHECK(price.overlapped == doctest::Approx(52));
    CHECK(price.max_communication == 0);
  }
}

TEST_CASE("bad clusters, settings and placements are refused with a message") {
  const context_placement p = fcp_placement(lengths_t{8, 2, 2, 4}, blocks(2, 3));
  context_price_settings s = unit_pairs();
  s.nodes = 1;  // 2 GPUs for 3 ranks
  CHECK_THROWS_WITH_AS(price_context(p, tiny_cluster(), s),
                       Contains("has 1 nodes x 2 GPUs = 2, expected at least the group's 3 ranks"),
                       invalid_argument);
  s.nodes = 2;
  CHECK_NOTHROW(price_context(p, tiny_cluster(), s));
  s.nodes = -1;
  CHECK_THROWS_WITH_AS(price_context(p, tiny_cluster(), s), Contains("expected nodes >= 0"),
                       invalid_argument);

  context_price_settings bad = unit_pairs();
  bad.heads = -32;
  CHECK_THROWS_WITH_AS(price_context(p, tiny_cluster(), bad),
                       Contains("expected heads and head_dim >= 1, found -32 and 1"),
                       invalid_argument);
  bad = unit_pairs();
  bad.head_dim = 0;
  CHECK_THROWS_WITH_AS(price_context(p, tiny_cluster(), bad),
                       Contains("expected heads and head_dim >= 1, found 1 and 0"),
                       invalid_argument);
  bad = unit_pairs();
  bad.mfu = -0.5;
  CHECK_THROWS_WITH_AS(price_context(p, tiny_cluster(), bad),
                       Contains("expected mfu in [0, 1] (0: the cluster's default), found -0.5"),
                       invalid_argument);
  bad.mfu = 1.5;
  CHECK_THROWS_AS(price_context(p, tiny_cluster(), bad), invalid_argument);

  cluster c = tiny_cluster();
  c.peak_flops = 0;
  CHECK_THROWS_WITH_AS(price_context(p, c, unit_pairs()),
                       Contains("expected peak_flops > 0 FLOP/s to price the attention, found 0"),
                       invalid_argument);
  c = tiny_cluster();
  c.sites = 2;
  c.wan = {1.0, 16.0};
  CHECK_THROWS_WITH_AS(price_context(p, c, unit_pairs()), Contains("expected one site"),
                       invalid_argument);
  c = tiny_cluster();
  c.intra.bandwidth = -1;  // cluster::check
  CHECK_THROWS_WITH_AS(price_context(p, c, unit_pairs()),
                       Contains("intra.bandwidth: expected a bandwidth > 0"), invalid_argument);

  context_placement broken = p;
  broken.kv_bytes.pop_back();
  CHECK_THROWS_WITH_AS(price_context(broken, tiny_cluster(), unit_pairs()),
                       Contains("found P = 3, 3 works and 8 bytes"), invalid_argument);
}

TEST_CASE("the skewed batch on DGX H100 nodes at P = 8 and 64: the README's table") {
  // The bench's batch and settings (bench/bench_context.cpp): B = 512, keys and values of 8
  // heads x 128 in bf16 (kv_dim 1024); the queries of llama3.1-8b, 32 heads x 128 (the
  // default settings). Its bytes (bench/README.md): fcp 749 MB and 8380 MB, ring 5493 MB
  // and 49438 MB at P = 8 and 64. The last column prices the receives alone (sends free).
  const lengths_t l = skewed_batch();
  const cluster h100 = h100_8gpu_node();
  std::printf(
      "| P | placement | max/mean work | K/V bytes, all ranks | most one rank receives "
      "| most one rank sends | compute, busiest rank | communication, busiest rank | "
      "step, serial | step, overlapped | step, serial, receives only |\n"
      "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (int ranks : {8, 64}) {
    const context_settings s{.block_tokens = 512, .ranks = ranks, .kv_dim = 1024};
    const context_placement fcp = fcp_placement(l, s);
    const context_placement ring = ring_placement(l, s);
    const context_price fcp_price = price_context(fcp, h100, {});
    const context_price ring_price = price_context(ring, h100, {}, context_exchange::ring);
    for (const auto& [name, p, price] :
         {std::tuple{"fcp", &fcp, &fcp_price}, std::tuple{"ring", &ring, &ring_price}}) {
      std::int64_t most_sent = 0;
      double receives_only = 0;
      for (int r = 0; r < ranks; ++r) {
        std::int64_t sent = 0;
        for (int d = 0; d < ranks; ++d) sent += p->bytes(r, d);
        most_sent = std::max(most_sent, sent);
        const context_rank_price& x = price->ranks[static_cast<std::size_t>(r)];
        receives_only = std::max(receives_only, x.launch + x.receive + x.compute);
      }
      std::printf(
          "| %d | %s | %.4f | %.0f MB | %.0f MB | %.0f MB | %.2f ms | %.2f ms | %.2f ms "
          "| %.2f ms | %.2f ms |\n",
          ranks, name, p->imbalance(), static_cast<double>(p->total_bytes()) / 1e6,
          static_cast<double>(p->max_received_bytes()) / 1e6, static_cast<double>(most_sent) / 1e6,
          price->max_compute * 1e3, price->max_communication * 1e3, price->serial * 1e3,
          price->overlapped * 1e3, receives_only * 1e3);
    }

    CHECK(static_cast<double>(fcp.total_bytes()) / 1e6 ==
          doctest::Approx(ranks == 8 ? 749 : 8380).epsilon(1e-3));
    CHECK(static_cast<double>(ring.total_bytes()) / 1e6 ==
          doctest::Approx(ranks == 8 ? 5493 : 49438).epsilon(1e-3));
    // A rank's compute: its pairs x 4 x 128 x 32 FLOPs at 989 TFLOP/s x MFU 0.4.
    const double per_pair = 4.0 * 128 * 32 / (989e12 * 0.4);
    CHECK(fcp_price.max_compute == doctest::Approx(static_cast<double>(fcp.max_work()) * per_pair));
    CHECK(ring_price.max_compute ==
          doctest::Approx(static_cast<double>(ring.max_work()) * per_pair));
    CHECK(fcp_price.max_compute < ring_price.max_compute);
    // The ring's last rank sends to rank 0 in P - 1 steps of 8.4 us (launch) + α. At P = 8
    // all on one node: NVLink, 3.4 us and 450 GB/s; at P = 64 rank 0 is on another node: the
    // network, 9.6 us and its share of the node's NICs, 8 x 400 Gb/s / 8 GPUs = 50 GB/s (its
    // receive from P - 2 stays on NVLink, the shorter).
    const bool one_node = ranks == 8;
    const double last_send =
        (ranks - 1) * (8.4e-6 + (one_node ? 3.4e-6 : 9.6e-6)) +
        static_cast<double>(ring.bytes(ranks - 1, 0)) / (one_node ? 450e9 : 50e9);
    CHECK(ring_price.ranks.back().communication() == doctest::Approx(last_send));
  }
}

TEST_CASE("on 64 H100s the fcp exchange is bound by the rank that sends a long head chunk") {
  // At P = 64 FCP's busiest receiver gets 235 MB and the ring's 773 MB, but the rank holding
  // the first chunk of a long sequence sends it to every later chunk's rank, across nodes:
  // its sends, not any rank's receives, set FCP's communication.
  const lengths_t l = skewed_batch();
  const context_settings s{.block_tokens = 512, .ranks = 64, .kv_dim = 1024};
  const context_price fcp = price_context(fcp_placement(l, s), h100_8gpu_node(), {});
  const context_price ring =
      price_context(ring_placement(l, s), h100_8gpu_node(), {}, context_exchange::ring);
  double fcp_receive = 0, fcp_send = 0, ring_receive = 0;
  for (const context_rank_price& r : fcp.ranks) {
    fcp_receive = std::max(fcp_receive, r.receive);
    fcp_send = std::max(fcp_send, r.send);
  }
  for (const context_rank_price& r : ring.ranks) ring_receive = std::max(ring_receive, r.receive);
  CHECK(fcp_receive < ring_receive);
  CHECK(fcp_send > 2 * fcp_receive);
  CHECK(fcp.max_communication == doctest::Approx(8.4e-6 + fcp_send));
}
