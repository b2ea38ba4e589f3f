// Alpha-beta prices of one collective: ring, tree, hierarchical, NIC sharing and the limits.
#include <doctest/doctest.h>

#include <limits>

#include "fedshard/error.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/sim/collective_cost.hpp"

using namespace fedshard;
using namespace fedshard::sim;

namespace {
constexpr double inf = std::numeric_limits<double>::infinity();
constexpr double S = 1e9;  // the whole array, bytes
}  // namespace

TEST_CASE("ring inside one node: op latency + steps x alpha + bus factor x S / beta") {
  const cluster c = a100_4gpu_node();
  const comm_span node{4, 1, 4, 1};
  const auto ar =
      price_collective(comm_kind::all_reduce, S, node, {}, c, collective_algorithm::ring);
  CHECK(ar.latency == doctest::Approx(c.op_latency + 6 * c.intra.alpha));
  CHECK(ar.transfer == doctest::Approx(2.0 * 3 / 4 * S / c.intra.bandwidth));
  CHECK(ar.seconds == doctest::Approx(ar.latency + ar.transfer));
  const auto ag =
      price_collective(comm_kind::all_gather, S, node, {}, c, collective_algorithm::ring);
  CHECK(ag.latency == doctest::Approx(c.op_latency + 3 * c.intra.alpha));
  CHECK(ag.transfer ==
        doctest::Approx(bus_factor(comm_kind::all_gather, 4) * S / c.intra.bandwidth));
  // A communicator of one rank moves nothing.
  CHECK(price_collective(comm_kind::all_reduce, S, {1, 1, 1, 1}, {}, c).seconds == 0);
}

TEST_CASE("across nodes the network steps cost alpha_inter, and the node's NICs are shared") {
  const cluster c = a100_4gpu_node();  // 4 GPUs, 4 x 12.5 GB/s NICs
  // 128 nodes, all 4 GPUs of each node in the ring (FSDP over the world): one ring per node.
  const comm_span world{512, 128, 4, 1};
  const auto ag =
      price_collective(comm_kind::all_gather, S, world, {1, 1}, c, collective_algorithm::ring);
  CHECK(ag.latency ==
        doctest::Approx(c.op_latency + (511 - 127) * c.intra.alpha + 127 * c.inter.alpha));
  CHECK(ag.transfer == doctest::Approx(511.0 / 512 * S / c.node_bandwidth()));
  // One GPU per node (HSDP's replica axis), four such rings leave each node at once: each
  // gets a quarter of the node, i.e. one NIC.
  const comm_span replica{128, 128, 1, 1};
  const auto ar =
      price_collective(comm_kind::all_reduce, S, replica, {4, 1}, c, collective_algorithm::ring);
  CHECK(ar.transfer == doctest::Approx(2.0 * 127 / 128 * S / (c.node_bandwidth() / 4)));
  // Alone on the node, a one-GPU ring still reaches only its own NIC.
  const auto alone =
      price_collective(comm_kind::all_reduce, S, replica, {1, 1}, c, collective_algorithm::ring);
  CHECK(alone.transfer == doctest::Approx(ar.transfer));
  // Two GPUs per node reach two of the four NICs: a second such ring takes the other two,
  // four of them halve each one's share.
  const comm_span pair{64, 32, 2, 1};
  auto rs = [&](int sharing) {
    return price_collective(comm_kind::reduce_scatter, S, pair, {sharing, 1}, c,
                            collective_algorithm::ring)
        .transfer;
  };
  CHECK(rs(1) == doctest::Approx(63.0 / 64 * S / (2 * c.nic_bandwidth)));
  CHECK(rs(2) == doctest::Approx(rs(1)));
  CHECK(rs(4) == doctest::Approx(2 * rs(1)));
}

TEST_CASE("the WAN level: its steps cost alpha_wan and the site uplink is shared") {
  cluster c = a100_4gpu_node();
  c.wan = {5e-3, gbit_per_s(10)};
  const comm_span fed{4, 4, 1, 2};
  const auto ar =
      price_collective(comm_kind::all_reduce, S, fed, {4, 8}, c, collective_algorithm::ring);
  CHECK(ar.latency == doctest::Approx(c.op_latency + 4 * c.inter.alpha + 2 * c.wan.alpha));
  CHECK(ar.transfer == doctest::Approx(1.5 * S / (c.wan.bandwidth / 8)));
}

TEST_CASE("tree: log-depth latency, 2S per rank for all_reduce; ring only for all_gather") {
  const cluster c = a100_4gpu_node();
  const comm_span replica{128, 128, 1, 1};
  const auto tree =
      price_collective(comm_kind::all_reduce, S, replica, {1, 1}, c, collective_algorithm::tree);
  CHECK(tree.algorithm == collective_algorithm::tree);
  CHECK(tree.latency == doctest::Approx(c.op_latency + 2 * 7 * c.inter.alpha));
  CHECK(tree.transfer == doctest::Approx(2 * S / c.nic_bandwidth));
  // Small messages: the tree's latency wins; large ones: the ring's bandwidth term wins.
  const auto small_ring =
      price_collective(comm_kind::all_reduce, 1e3, replica, {1, 1}, c, collective_algorithm::ring);
  const auto small_tree =
      price_collective(comm_kind::all_reduce, 1e3, replica, {1, 1}, c, collective_algorithm::tree);
  CHECK(small_tree.seconds < small_ring.seconds);
  const auto best = price_collective(comm_kind::all_reduce, 1e3, replica, {1, 1}, c);
  CHECK(best.seconds == doctest::Approx(small_tree.seconds));
  const auto big_ring =
      price_collective(comm_kind::all_reduce, 1e10, replica, {1, 1}, c, collective_algorithm::ring);
  CHECK(price_collective(comm_kind::all_reduce, 1e10, replica, {1, 1}, c).seconds <=
        big_ring.seconds);
  CHECK(price_collective(comm_kind::all_gather, S, replica, {1, 1}, c, collective_algorithm::tree)
            .algorithm == collective_algorithm::ring);
}

TEST_CASE(
    "hierarchical all_reduce = intra reduce_scatter + inter all_reduce of S/m + intra "
    "all_gather") {
  const cluster c = a100_4gpu_node();
  const comm_span group{32, 8, 4, 1};
  const auto h = price_collective(comm_kind::all_reduce, S, group, {1, 1}, c,
                                  collective_algorithm::hierarchical);
  CHECK(h.algorithm == collective_algorithm::hierarchical);
  const comm_span local{4, 1, 4, 1}, across{8, 8, 1, 1};
  const double rs =
      price_collective(comm_kind::reduce_scatter, S, local, {}, c, collective_algorithm::ring)
          .seconds;
  const double ag =
      price_collective(comm_kind::all_gather, S, local, {}, c, collective_algorithm::ring).seconds;
  // The 4 node-local ranks each run an inter-node all_reduce: 4 rings share the node.
  const double mid = std::min(
      price_collective(comm_kind::all_reduce, S / 4, across, {4, 4}, c, collective_algorithm::ring)
          .seconds,
      price_collective(comm_kind::all_reduce, S / 4, across, {4, 4}, c, collective_algorithm::tree)
          .seconds);
  CHECK(h.seconds == doctest::Approx(rs + mid + ag));
  // Inside one node there is nothing to split: ring.
  CHECK(price_collective(comm_kind::all_reduce, S, local, {}, c, collective_algorithm::hierarchical)
            .algorithm == collective_algorithm::ring);
}

TEST_CASE("infinite bandwidth leaves the latency; zero latency too leaves nothing") {
  cluster c = a100_4gpu_node();
  c.intra.bandwidth = inf;
  c.nic_bandwidth = inf;
  for (auto algo : {collective_algorithm::ring, collective_algorithm::tree,
                    collective_algorithm::hierarchical, collective_algorithm::best}) {
    const auto p = price_collective(comm_kind::all_reduce, S, {512, 128, 4, 1}, {1, 1}, c, algo);
    CHECK(p.transfer == 0);
    CHECK(p.seconds == doctest::Approx(p.latency));
  }
  c.intra.alpha = c.inter.alpha = c.op_latency = 0;
  CHECK(price_collective(comm_kind::all_gather, S, {512, 128, 4, 1}, {1, 1}, c).seconds == 0);
}

TEST_CASE("names round-trip and bad input is refused") {
  for (auto a : {collective_algorithm::ring, collective_algorithm::tree,
                 collective_algorithm::hierarchical, collective_algorithm::best})
    CHECK(parse_collective_algorithm(to_string(a)) == a);
  CHECK_THROWS_AS(parse_collective_algorithm("butterfly"), invalid_argument);
  CHECK_THROWS_AS(price_collective(comm_kind::all_reduce, -1, {2, 1, 2, 1}, {}, a100_4gpu_node()),
                  invalid_argument);
  CHECK_THROWS_AS(price_collective(comm_kind::all_reduce, 1, {2, 0, 2, 1}, {}, a100_4gpu_node()),
                  invalid_argument);
}
