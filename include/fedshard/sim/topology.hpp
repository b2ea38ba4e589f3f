#pragma once
/// The cluster model of the simulator: levels of links with latency α and bandwidth β, cluster
/// presets with cited constants, and where the ranks of a mesh sit (node, site).
///
/// Levels:
///  - intra: GPU to GPU inside a node (NVLink). β is the bus bandwidth one GPU sustains in a
///    ring (nccl-tests busbw), per direction.
///  - inter: node to node (InfiniBand). β of a node is nics_per_node x nic_bandwidth, shared
///    by every ring that leaves the node at the same time.
///  - wan: site to site, optional. The world is split into `sites` contiguous blocks of whole
///    nodes; since groups are contiguous rank blocks too, sites dividing G put whole groups
///    on each site. β is one site's uplink, shared by every ring that leaves the site at the
///    same time.
/// α is the latency of one ring step that crosses the level; op_latency is the fixed cost of
/// launching one collective. A level's oversubscription F >= 1 models fabric contention: the
/// bandwidth of the level (NVLink busbw, a node's NICs, a site's uplink) is divided by F.
///
/// Placement: world ranks are contiguous, node = rank / gpus_per_node, site = rank / (W / sites).
/// All bandwidths are bytes per second, all latencies seconds.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/mesh/axis.hpp"
#include "fedshard/mesh/mesh.hpp"

namespace fedshard::sim {

struct calibration;  // calibrate.hpp

/// One level of links.
struct link_level {
  double alpha = 0;      ///< seconds per ring step that crosses this level
  double bandwidth = 0;  ///< bytes/s, per direction (see the file comment for whose)
  /// Contention on this level: its bandwidth (for inter, the node's NICs) is divided by it;
  /// 1 = none, 2 = every link delivers half of its rate.
  double oversubscription = 1;
  /// The latency is propagation: collectives in flight at once overlap their latencies (a
  /// long-haul link; the demo's emulated one), so with step_overlap::timeline an op holds
  /// the channel only for its transfer. False: the whole op holds it (NCCL's one stream).
  bool pipelined_latency = false;
  /// The level's collectives run on the ranks' own processors (thread ranks copying and
  /// reducing in shared memory): with step_overlap::timeline they delay the compute instead
  /// of overlapping it. Set on `intra`, it also charges the compute of an op that crosses
  /// nodes or sites what the op would cost inside one node (the threads still copy and
  /// reduce; the outer links carry the bytes meanwhile).
  bool on_compute = false;

  /// Throws invalid_argument unless the level is physical: alpha finite and >= 0, bandwidth
  /// > 0 (+infinity: free transfers), oversubscription finite and >= 1. `what` names the
  /// level in the message ("sim::cluster 'x': wan").
  void check(std::string_view what) const {
    FEDSHARD_EXPECTS(alpha >= 0 && std::isfinite(alpha), what,
                     ".alpha: expected a finite latency >= 0 s per ring step, found ", alpha);
    FEDSHARD_EXPECTS(bandwidth > 0, what,
                     ".bandwidth: expected a bandwidth > 0 bytes/s (inf: free), found ", bandwidth);
    FEDSHARD_EXPECTS(oversubscription >= 1 && std::isfinite(oversubscription), what,
                     ".oversubscription: expected a finite factor >= 1 (1: none), found ",
                     oversubscription);
  }
};

/// A cluster of identical nodes.
struct cluster {
  std::string name;
  int gpus_per_node = 1;
  int nics_per_node = 1;
  double nic_bandwidth = 0;  ///< bytes/s of one NIC, per direction
  link_level intra;          ///< NVLink: α per step, β = busbw per GPU
  link_level inter;  ///< network: α per step; β is node_bandwidth(), `inter.bandwidth` unused
  link_level wan;    ///< between sites: α per step, β per site uplink
  double op_latency = 0;  ///< fixed seconds per collective
  /// The ranks' communicators are not stream-ordered (host memory: inproc, MPI, Gloo): the
  /// interpreter issues an op that follows another in its chain only when the rank next
  /// enters it (sim/timeline.hpp prices that under step_overlap::timeline). False: NCCL's
  /// streams, the whole chain queued at once.
  bool host_driven = false;
  double peak_flops = 0;     ///< dense bf16 FLOP/s of one GPU
  double default_mfu = 0.5;  ///< achieved fraction of peak_flops for transformer training
  int sites = 1;             ///< the world is split over this many sites
  /// Bytes/s of one GPU's memory: the codec kernels' price (passes over the buffer at this
  /// rate); 0 prices them at nothing.
  double memory_bandwidth = 0;
  /// Measured collective constants (calibrate.hpp); where they cover a collective's kind and
  /// level, price_collective uses them instead of the α-β model.
  std::shared_ptr<const calibration> measured{};

  /// Bytes/s a node can send to the network: nics_per_node x nic_bandwidth.
  double node_bandwidth() const noexcept { return nics_per_node * nic_bandwidth; }

  /// Throws invalid_argument naming the first setting that is not physical: counts >= 1;
  /// nic_bandwidth > 0; every level that exists checked by link_level::check (intra when
  /// nodes hold more than one GPU, wan when there is more than one site; inter's latency
  /// and oversubscription, its bandwidth being unused); op_latency finite and >= 0;
  /// peak_flops and memory_bandwidth >= 0 (0: unknown, priced at nothing), peak_flops
  /// finite; default_mfu in (0, 1]. Pricing runs it where a cluster enters (sim::placement,
  /// price_hetero_sync).
  void check() const {
    const std::string me = "sim::cluster '" + name + "': ";
    FEDSHARD_EXPECTS(gpus_per_node >= 1 && nics_per_node >= 1 && sites >= 1, me,
                     "expected gpus_per_node, nics_per_node and sites >= 1, found ", gpus_per_node,
                     ", ", nics_per_node, " and ", sites);
    FEDSHARD_EXPECTS(nic_bandwidth > 0, me,
                     "nic_bandwidth: expected a bandwidth > 0 bytes/s (inf: free), found ",
                     nic_bandwidth);
    if (gpus_per_node > 1) intra.check(me + "intra");
    link_level network = inter;
    network.bandwidth = nic_bandwidth;  // inter's own bandwidth is unused
    network.check(me + "inter");
    if (sites > 1) wan.check(me + "wan");
    FEDSHARD_EXPECTS(op_latency >= 0 && std::isfinite(op_latency), me,
                     "op_latency: expected a finite latency >= 0 s, found ", op_latency);
    FEDSHARD_EXPECTS(peak_flops >= 0 && std::isfinite(peak_flops), me,
                     "peak_flops: expected a finite FLOP rate >= 0 (0: unknown), found ",
                     peak_flops);
    FEDSHARD_EXPECTS(default_mfu > 0 && default_mfu <= 1, me,
                     "default_mfu: expected a fraction in (0, 1], found ", default_mfu);
    FEDSHARD_EXPECTS(memory_bandwidth >= 0, me,
                     "memory_bandwidth: expected a bandwidth >= 0 bytes/s (0: free), found ",
                     memory_bandwidth);
  }
};

/// Gb/s (network units) to bytes/s.
constexpr double gbit_per_s(double gbps) noexcept {
  return gbps * 1e9 / 8.0;
}
/// GB/s to bytes/s.
constexpr double gbyte_per_s(double gbs) noexcept {
  return gbs * 1e9;
}
/// Microseconds to seconds.
constexpr double microseconds(double us) noexcept {
  return us * 1e-6;
}

namespace detail {

// Latencies from NCCL's own tuning model (NVIDIA/nccl, src/graph/tuning.cc, NCCL 2.8: the
// `baseLat` and `hwLat` tables, Ring algorithm, Simple protocol, the one used for large
// messages): 8.4 us per collective, 3.4 us per NVLink ring step, 9.6 us per network step.
inline constexpr double nccl_ring_simple_base_us = 8.4;
inline constexpr double nccl_ring_simple_nvlink_step_us = 3.4;
inline constexpr double nccl_ring_simple_net_step_us = 9.6;

/// The WAN level a preset starts with: unused while sites == 1. The values are illustrative,
/// not a measurement: a 100 Gb/s uplink and 10 ms per step (a few hundred km of fibre plus
/// routers); set them to the link being priced.
inline link_level default_wan() {
  return {10e-3, gbit_per_s(100)};
}

/// The figures of a cluster preset: nodes of GPUs on NVLink, NICs to an InfiniBand fabric.
/// Every preset takes NCCL's latencies (above) and the default WAN.
struct preset_figures {
  std::string_view name;
  int gpus_per_node = 1;
  int nics_per_node = 1;
  double nic_gbit_per_s = 0;            ///< one NIC, per direction
  double nvlink_busbw_gbyte_per_s = 0;  ///< nccl-tests busbw of one GPU in a ring
  double peak_flops = 0;                ///< dense bf16 FLOP/s of one GPU
  double default_mfu = 0.5;             ///< achieved fraction of peak_flops
  double memory_gbyte_per_s = 0;        ///< one GPU's memory bandwidth
};

/// A Leonardo Booster node (the paper's system).
inline constexpr preset_figures a100_4gpu_figures{
    .name = "a100-4gpu-node",
    // CINECA, Leonardo hardware overview (leonardo-supercomputer.cineca.eu/hpc-system): a
    // Booster node is 4 x A100 SXM4 64 GB and "2x dual-port HDR network interface (400 Gbps
    // aggregated)", i.e. 4 ports of HDR100 (100 Gb/s) on an HDR Dragonfly+ fabric.
    .gpus_per_node = 4,
    .nics_per_node = 4,
    .nic_gbit_per_s = 100,
    // NVLink 3: 12 links x 25 GB/s per direction = 300 GB/s per GPU (A100 datasheet: "NVLink
    // 600 GB/s", both directions). NCCL's tuning model caps the bus bandwidth of compute
    // capability 8.0 at 235 GB/s (tuning.cc: `if (compCap80) busBw = std::min(busBw,
    // 235.0f)`), in line with published nccl-tests busbw of 230-250 GB/s on 8 x A100 SXM4.
    // We use 235.
    .nvlink_busbw_gbyte_per_s = 235,
    // A100 datasheet: BF16 Tensor Core 312 TFLOP/s dense (624 with sparsity).
    .peak_flops = 312e12,
    // Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
    // Megatron-LM" (SC'21): 163 TFLOP/s per A100 = 52% of peak on GPT models; PaLM (Chowdhery
    // et al. 2022, Table 3) reports 46.2% MFU. We take 0.5 for the compute alone.
    .default_mfu = 0.5,
    // A100 datasheet: HBM2e 1,555 GB/s (40 GB) to 2,039 GB/s (80 GB); Leonardo's 64 GB part
    // sits between. We take 1,600 GB/s.
    .memory_gbyte_per_s = 1600};

/// A DGX H100.
inline constexpr preset_figures h100_8gpu_figures{
    .name = "h100-8gpu-node",
    // NVIDIA DGX H100 datasheet: 8 x H100 SXM5, 8 x single-port ConnectX-7 400 Gb/s
    // InfiniBand.
    .gpus_per_node = 8,
    .nics_per_node = 8,
    .nic_gbit_per_s = 400,
    // H100 SXM datasheet: NVLink 900 GB/s (both directions) = 450 GB/s per direction;
    // published nccl-tests busbw on 8 x H100 SXM5 is 450-480 GB/s. We use 450.
    .nvlink_busbw_gbyte_per_s = 450,
    // H100 SXM datasheet: BF16 Tensor Core 989 TFLOP/s dense (1979 with sparsity).
    .peak_flops = 989e12,
    // Llama 3 (Dubey et al. 2024, Table 4): 38-43% BF16 MFU on H100 at 8K-16K GPUs. We take
    // 0.4.
    .default_mfu = 0.4,
    // H100 SXM datasheet: HBM3 3.35 TB/s.
    .memory_gbyte_per_s = 3350};

/// A DGX H200.
inline constexpr preset_figures h200_8gpu_figures{
    .name = "h200-8gpu-node",
    // NVIDIA DGX H200 datasheet: 8 x H200 SXM, 8 x single-port ConnectX-7 VPI, up to
    // 400 Gb/s InfiniBand.
    .gpus_per_node = 8,
    .nics_per_node = 8,
    .nic_gbit_per_s = 400,
    // H200 SXM datasheet: NVLink 900 GB/s (both directions), the H100's; we use the same
    // 450 GB/s busbw.
    .nvlink_busbw_gbyte_per_s = 450,
    // H200 SXM datasheet: BF16 Tensor Core 1,979 TFLOP/s with sparsity, 989 dense (the
    // H100's compute); MFU as the H100's.
    .peak_flops = 989e12,
    .default_mfu = 0.4,
    // H200 SXM datasheet: 141 GB HBM3e at 4.8 TB/s.
    .memory_gbyte_per_s = 4800};

/// Every preset, in the order cluster_preset_names() lists them.
inline constexpr const preset_figures* presets[] = {&a100_4gpu_figures, &h100_8gpu_figures,
                                                    &h200_8gpu_figures};

/// The cluster of a preset's figures, with NCCL's latencies and the default WAN.
inline cluster cluster_of(const preset_figures& f) {
  return {.name = std::string(f.name),
          .gpus_per_node = f.gpus_per_node,
          .nics_per_node = f.nics_per_node,
          .nic_bandwidth = gbit_per_s(f.nic_gbit_per_s),
          .intra = {microseconds(nccl_ring_simple_nvlink_step_us),
                    gbyte_per_s(f.nvlink_busbw_gbyte_per_s)},
          .inter = {microseconds(nccl_ring_simple_net_step_us), 0},
          .wan = default_wan(),
          .op_latency = microseconds(nccl_ring_simple_base_us),
          .peak_flops = f.peak_flops,
          .default_mfu = f.default_mfu,
          .memory_bandwidth = gbyte_per_s(f.memory_gbyte_per_s)};
}

}  // namespace detail

/// 4 x A100 per node, 4 x HDR100 InfiniBand: a Leonardo Booster node (the paper's system).
inline cluster a100_4gpu_node() {
  return detail::cluster_of(detail::a100_4gpu_figures);
}

/// 8 x H100 SXM per node, 8 x 400 Gb/s NDR InfiniBand: a DGX H100.
inline cluster h100_8gpu_node() {
  return detail::cluster_of(detail::h100_8gpu_figures);
}

/// 8 x H200 SXM per node, 8 x 400 Gb/s NDR InfiniBand: a DGX H200.
inline cluster h200_8gpu_node() {
  return detail::cluster_of(detail::h200_8gpu_figures);
}

/// Names of the cluster presets.
inline std::vector<std::string> cluster_preset_names() {
  std::vector<std::string> names;
  for (const detail::preset_figures* p : detail::presets) names.emplace_back(p->name);
  return names;
}

/// The cluster preset called name; invalid_argument naming the presets otherwise.
inline cluster cluster_preset(std::string_view name) {
  for (const detail::preset_figures* p : detail::presets)
    if (p->name == name) return detail::cluster_of(*p);
  std::string known;
  for (const auto& n : cluster_preset_names()) known += (known.empty() ? "" : ", ") + n;
  FEDSHARD_EXPECTS(false, "sim: unknown cluster preset '", name, "', expected one of ", known);
  return {};
}

/// The outermost level a communicator crosses.
enum class level_kind : std::uint8_t { local, intra, inter, wan };

/// "local" (one rank), "nvlink", "network" or "wan".
constexpr std::string_view to_string(level_kind k) noexcept {
  switch (k) {
    case level_kind::local: return "local";
    case level_kind::intra: return "nvlink";
    case level_kind::inter: return "network";
    case level_kind::wan: return "wan";
  }
  return "unknown-level";
}

/// How one communicator is spread over the cluster.
struct comm_span {
  int ranks = 1;     ///< members
  int nodes = 1;     ///< distinct nodes
  int per_node = 1;  ///< most members on one node
  int sites = 1;     ///< distinct sites

  /// The outermost level the communicator crosses.
  level_kind level() const noexcept {
    if (ranks <= 1) return level_kind::local;
    if (sites > 1) return level_kind::wan;
    if (nodes > 1) return level_kind::inter;
    return level_kind::intra;
  }
  friend bool operator==(const comm_span&, const comm_span&) = default;
};

/// Where the ranks of a G x R x S mesh sit on a cluster (see the file comment).
class placement {
 public:
  /// Throws invalid_argument for an invalid shape or cluster (cluster::check), or when sites
  /// do not split the world into whole nodes.
  placement(mesh_shape shape, const cluster& c)
      : shape_(shape), gpus_per_node_(c.gpus_per_node), sites_(c.sites) {
    FEDSHARD_EXPECTS(shape.groups >= 1 && shape.replicas >= 1 && shape.shards >= 1,
                     "sim::placement: every mesh dimension must be >= 1, found ", to_string(shape));
    c.check();
    FEDSHARD_EXPECTS(c.sites >= 1 && shape.size() % c.sites == 0,
                     "sim::placement: sites must be >= 1 and divide the ", shape.size(),
                     " ranks, found ", c.sites);
    const int per_site = shape.size() / c.sites;
    FEDSHARD_EXPECTS(c.sites == 1 || per_site % c.gpus_per_node == 0, "sim::placement: ", c.sites,
                     " sites hold ", per_site, " ranks each, not a whole number of ",
                     c.gpus_per_node, "-GPU nodes");
  }

  const mesh_shape& shape() const noexcept { return shape_; }
  /// Ranks in the world.
  int size() const noexcept { return shape_.size(); }
  /// Nodes used (the last one may be partly filled).
  int nodes() const noexcept { return (size() + gpus_per_node_ - 1) / gpus_per_node_; }
  int gpus_per_node() const noexcept { return gpus_per_node_; }
  int sites() const noexcept { return sites_; }
  /// rank / gpus_per_node.
  int node_of(int rank) const noexcept { return rank / gpus_per_node_; }
  /// rank / (W / sites).
  int site_of(int rank) const noexcept { return rank / (size() / sites_); }

  /// An id shared by exactly the ranks of one communicator of axis a.
  int comm_id(axis a, int rank) const {
    const mesh_coords c = coords_of(shape_, rank);
    switch (a) {
      case axis::shard: return c.group * shape_.replicas + c.replica;
      case axis::replica: return c.group * shape_.shards + c.shard;
      case axis::federation: return c.replica * shape_.shards + c.shard;
      case axis::group: return c.group;
      case axis::world: return 0;
    }
    return -1;
  }

  /// The world ranks of rank's communicator on axis a, ordered by their axis coordinate.
  std::vector<int> members(axis a, int rank) const {
    const mesh_coords c = coords_of(shape_, rank);
    std::vector<int> out;
    switch (a) {
      case axis::shard:
        for (int s = 0; s < shape_.shards; ++s)
          out.push_back(rank_of(shape_, {c.group, c.replica, s}));
        break;
      case axis::replica:
        for (int r = 0; r < shape_.replicas; ++r)
          out.push_back(rank_of(shape_, {c.group, r, c.shard}));
        break;
      case axis::federation:
        for (int g = 0; g < shape_.groups; ++g)
          out.push_back(rank_of(shape_, {g, c.replica, c.shard}));
        break;
      case axis::group: {
        const int f = shape_.replicas * shape_.shards;
        for (int l = 0; l < f; ++l) out.push_back(c.group * f + l);
        break;
      }
      case axis::world:
        for (int r = 0; r < size(); ++r) out.push_back(r);
        break;
    }
    return out;
  }

  /// How rank's communicator on axis a is spread over nodes and sites.
  comm_span span(axis a, int rank) const {
    const std::vector<int> m = members(a, rank);
    comm_span s;
    s.ranks = static_cast<int>(m.size());
    std::vector<int> nodes, sites;
    for (int r : m) {
      nodes.push_back(node_of(r));
      sites.push_back(site_of(r));
    }
    std::sort(nodes.begin(), nodes.end());
    std::sort(sites.begin(), sites.end());
    s.nodes = 0;
    s.per_node = 0;
    for (std::size_t i = 0; i < nodes.size();) {
      std::size_t j = i;
      while (j < nodes.size() && nodes[j] == nodes[i]) ++j;
      ++s.nodes;
      s.per_node = std::max(s.per_node, static_cast<int>(j - i));
      i = j;
    }
    s.sites = static_cast<int>(std::unique(sites.begin(), sites.end()) - sites.begin());
    return s;
  }

 private:
  mesh_shape shape_;
  int gpus_per_node_;
  int sites_;
};

}  // namespace fedshard::sim
