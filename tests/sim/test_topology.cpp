// Cluster presets and where the ranks of a mesh sit: nodes, sites and the span of every axis.
#include <doctest/doctest.h>

#include <string>
#include <string_view>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/sim/topology.hpp"

using namespace fedshard;
using namespace fedshard::sim;

TEST_CASE("presets carry the datasheet figures they cite") {
  const cluster a = a100_4gpu_node();
  CHECK(a.gpus_per_node == 4);
  CHECK(a.node_bandwidth() == doctest::Approx(gbit_per_s(400)));  // 2 x dual-port HDR100
  CHECK(a.peak_flops == 312e12);
  const cluster h = h100_8gpu_node();
  CHECK(h.gpus_per_node == 8);
  CHECK(h.node_bandwidth() == doctest::Approx(gbit_per_s(8 * 400)));
  CHECK(h.peak_flops == 989e12);
  for (const auto& name : cluster_preset_names()) CHECK(cluster_preset(name).name == name);
  CHECK_THROWS_AS(cluster_preset("tpu-pod"), invalid_argument);
}

TEST_CASE("every field of the presets: the cited figures, NCCL's latencies, the default WAN") {
  const auto check = [](const cluster& c, std::string_view name, int nics, double nic_gbps,
                        double nvlink_gbs, double mfu) {
    CAPTURE(name);
    CHECK(c.name == name);
    CHECK(c.nics_per_node == nics);
    CHECK(c.nic_bandwidth == gbit_per_s(nic_gbps));
    CHECK(c.intra.bandwidth == gbyte_per_s(nvlink_gbs));
    CHECK(c.default_mfu == mfu);
    // NCCL 2.8 Ring/Simple latencies: NVLink step, network step, per collective.
    CHECK(c.intra.alpha == microseconds(3.4));
    CHECK(c.inter.alpha == microseconds(9.6));
    CHECK(c.inter.bandwidth == 0);
    CHECK(c.op_latency == microseconds(8.4));
    CHECK(c.wan.alpha == 10e-3);
    CHECK(c.wan.bandwidth == gbit_per_s(100));
    CHECK(c.sites == 1);
  };
  check(a100_4gpu_node(), "a100-4gpu-node", 4, 100, 235, 0.5);
  check(h100_8gpu_node(), "h100-8gpu-node", 8, 400, 450, 0.4);
  check(h200_8gpu_node(), "h200-8gpu-node", 8, 400, 450, 0.4);
  CHECK(h200_8gpu_node().memory_bandwidth == doctest::Approx(4.8e12));
  CHECK(cluster_preset_names() ==
        std::vector<std::string>{"a100-4gpu-node", "h100-8gpu-node", "h200-8gpu-node"});
  CHECK(cluster_preset("h100-8gpu-node").peak_flops == h100_8gpu_node().peak_flops);
  CHECK_THROWS_WITH_AS(cluster_preset("tpu-pod"),
                       doctest::Contains("expected one of a100-4gpu-node, h100-8gpu-node"),
                       invalid_argument);
}

TEST_CASE("ranks sit on nodes in order, and each axis spans the nodes its members are on") {
  // The paper's FL+HSDP mesh: 16 groups x 8 replicas x 4 shards on 4-GPU nodes.
  const placement p({16, 8, 4}, a100_4gpu_node());
  CHECK(p.nodes() == 128);
  CHECK(p.node_of(0) == 0);
  CHECK(p.node_of(7) == 1);
  const int r = rank_of(p.shape(), {3, 5, 2});
  CHECK(p.span(axis::shard, r) == comm_span{4, 1, 4, 1});         // one node, NVLink
  CHECK(p.span(axis::replica, r) == comm_span{8, 8, 1, 1});       // one GPU on each of 8 nodes
  CHECK(p.span(axis::federation, r) == comm_span{16, 16, 1, 1});  // one GPU in each group
  CHECK(p.span(axis::group, r) == comm_span{32, 8, 4, 1});
  CHECK(p.span(axis::world, r) == comm_span{512, 128, 4, 1});
  CHECK(p.span(axis::shard, r).level() == level_kind::intra);
  CHECK(p.span(axis::replica, r).level() == level_kind::inter);
  CHECK(placement({1, 1, 1}, a100_4gpu_node()).span(axis::world, 0).level() == level_kind::local);
}

TEST_CASE("members follow the mesh's communicators: same ids, ordered by axis coordinate") {
  const mesh_shape shape{3, 2, 2};
  const placement p(shape, a100_4gpu_node());
  for (int r = 0; r < shape.size(); ++r) {
    const mesh_coords c = coords_of(shape, r);
    const std::vector<int> fed = p.members(axis::federation, r);
    REQUIRE(fed.size() == 3u);
    for (int g = 0; g < 3; ++g) {
      CHECK(fed[g] == rank_of(shape, {g, c.replica, c.shard}));
      CHECK(p.comm_id(axis::federation, fed[g]) == p.comm_id(axis::federation, r));
    }
    const std::vector<int> rep = p.members(axis::replica, r);
    for (int x = 0; x < 2; ++x) CHECK(rep[x] == rank_of(shape, {c.group, x, c.shard}));
  }
  CHECK(p.comm_id(axis::shard, 0) != p.comm_id(axis::shard, 2));
}

TEST_CASE("sites: contiguous blocks of whole nodes, the federation axis crosses the WAN") {
  cluster c = a100_4gpu_node();
  c.sites = 2;
  const placement p({4, 1, 4}, c);  // one node per group, groups 0-1 on site 0, 2-3 on site 1
  CHECK(p.site_of(0) == 0);
  CHECK(p.site_of(7) == 0);
  CHECK(p.site_of(8) == 1);
  CHECK(p.span(axis::federation, 0) == comm_span{4, 4, 1, 2});
  CHECK(p.span(axis::federation, 0).level() == level_kind::wan);
  CHECK(p.span(axis::shard, 0).level() == level_kind::intra);

  // One group over both sites (FSDP across sites): its shard axis crosses the WAN.
  CHECK(placement({1, 1, 16}, c).span(axis::shard, 0) == comm_span{16, 4, 4, 2});
  c.sites = 3;
  CHECK_THROWS_AS(placement({4, 1, 4}, c), invalid_argument);  // 3 does not divide 16 ranks
  c.sites = 2;
  CHECK_THROWS_AS(placement({2, 1, 2}, c), invalid_argument);  // a node would span both sites
  CHECK_THROWS_AS(placement({0, 1, 2}, c), invalid_argument);
}
