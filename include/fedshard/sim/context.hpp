#pragma once
/// The simulator's price of one context-parallel attention step (plan/context_blocks.hpp): any
/// placement's per-rank work and key/value bytes, FCP's block placement and the ring baseline
/// alike, priced on a cluster by one code path.
///
/// Compute. A rank's attention work is its causal (query, key) pairs; one pair costs
///     flops_per_pair = 4 x head_dim x heads
/// FLOPs of one layer's forward attention: 2 head_dim for its entry of Q K^T and 2 head_dim
/// for its share of P V, per query head (the backward pass is twice that, and returns the
/// same bytes the other way). A rank computes at compute.hpp's rate, peak_flops x MFU
/// (compute_model: the cluster's peak_flops, and its default_mfu unless settings give one).
///
/// Placement on the cluster. Rank r of the group is GPU r: node r / gpus_per_node, one site.
/// A pair of ranks on one node talks over NVLink (cluster::intra: α = intra.alpha, β =
/// intra.bandwidth); a pair on two nodes over the network (α = inter.alpha, β = the rank's
/// share of its node's NICs, node_bandwidth() / gpus_per_node: every GPU of a node exchanges
/// at once). Each level's oversubscription divides its β; a transfer takes bytes / β
/// (collective_cost.hpp's transfer_time).
///
/// Communication. Every (src, dst) pair with bytes(src, dst) > 0 is `messages` messages (1
/// for a point-to-point exchange, P - 1 for a ring, below), each paying its level's α, and
/// its bytes cross at its level's β. A rank's link carries one message at a time in each
/// direction (full duplex): what it receives from different sources goes in sequence, and so
/// does what it sends, so
///     receive(d) = sum_{s: bytes(s,d) > 0} (messages x α(s,d) + bytes(s,d) / β(s,d)),
///     send(s)    = the same sum over the destinations d of s,
///     comm(r)    = launches x op_latency + max(receive(r), send(r))   (0 with no traffic),
/// a lower bound for any schedule of the messages (it ignores which pairs wait for which).
/// Sends count as well as receives because a rank's link sends at β too: under FCP the rank
/// holding the head chunk of a long sequence sends it to every rank holding a later chunk
/// (on the bench's batch at P = 64 on DGX H100 nodes: 1156 MB to 46 ranks, 21 ms on its
/// share of the network, against 4.5 ms for the busiest receiver); receives alone would
/// hide that.
/// Exchanges:
///  - point_to_point (FCP): one message per pair, all launched together (one NCCL group:
///    launches = 1);
///  - ring: the bytes of a pair pass in P - 1 steps, each step a launch of its own with one
///    message per ring neighbour (messages = launches = P - 1). The ring's bytes matrix only
///    holds neighbours (r - 1 to r), so this is the ring's schedule, priced as above.
///
/// Step time, one layer's forward attention:
///  - serial: max over ranks of comm(r) + compute(r), nothing overlapped;
///  - overlapped: max over ranks of max(comm(r), compute(r)), the transfers hidden behind
///    the compute as far as it goes.
/// A schedule's step lies between the two (a block's keys must arrive before it runs).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/plan/context_blocks.hpp"
#include "fedshard/sim/collective_cost.hpp"
#include "fedshard/sim/compute.hpp"
#include "fedshard/sim/topology.hpp"

namespace fedshard::sim {

/// How the key/value bytes of a placement are exchanged (the header's two exchanges).
enum class context_exchange : std::uint8_t {
  point_to_point,  ///< one message per (src, dst) pair, launched together (FCP)
  ring,            ///< P - 1 steps, one launch and one message per pair each (ring attention)
};

/// "point_to_point" or "ring".
constexpr std::string_view to_string(context_exchange e) noexcept {
  return e == context_exchange::ring ? "ring" : "point_to_point";
}

/// The model whose attention is priced, and the cluster's size.
struct context_price_settings {
  int heads = 32;      ///< query heads (llama3.1-8b: 32)
  int head_dim = 128;  ///< elements of one head's query, key and value (llama3.1-8b: 128)
  double mfu = 0;      ///< achieved fraction of peak_flops; 0: the cluster's default_mfu
  int nodes = 0;       ///< nodes of the cluster; 0: as many as the P ranks fill

  /// FLOPs of one (query, key) pair of one layer's forward attention: 4 x head_dim x heads.
  double flops_per_pair() const noexcept { return 4.0 * head_dim * static_cast<double>(heads); }
};

/// What one rank's step costs.
struct context_rank_price {
  double compute = 0;  ///< seconds of attention compute
  double receive = 0;  ///< seconds its receives take in sequence (α and β terms)
  double send = 0;     ///< seconds its sends take in sequence
  double launch = 0;   ///< seconds of op_latency (0 for a rank with no traffic)
  /// launch + max(receive, send).
  double communication() const noexcept { return launch + std::max(receive, send); }
};

/// The price of one attention step of a placement on a cluster.
struct context_price {
  std::vector<context_rank_price> ranks;  ///< per rank of the group
  double serial = 0;                      ///< max over ranks of communication + compute
  double overlapped = 0;                  ///< max over ranks of max(communication, compute)
  double max_compute = 0;                 ///< the busiest rank's compute
  double max_communication = 0;           ///< the busiest rank's communication
};

namespace detail {

/// Throws invalid_argument unless the settings and cluster can price a group of `ranks`.
inline void check_context_price(int ranks, const cluster& c, const context_price_settings& s) {
  c.check();
  FEDSHARD_EXPECTS(s.heads >= 1 && s.head_dim >= 1,
                   "sim::price_context: expected heads and head_dim >= 1, found ", s.heads, " and ",
                   s.head_dim);
  FEDSHARD_EXPECTS(s.mfu >= 0 && s.mfu <= 1,
                   "sim::price_context: expected mfu in [0, 1] (0: the cluster's default), found ",
                   s.mfu);
  FEDSHARD_EXPECTS(s.nodes >= 0, "sim::price_context: expected nodes >= 0 (0: as many as ",
                   "the ranks fill), found ", s.nodes);
  FEDSHARD_EXPECTS(c.peak_flops > 0, "sim::price_context: cluster '", c.name,
                   "': expected peak_flops > 0 FLOP/s to price the attention, found ",
                   c.peak_flops);
  FEDSHARD_EXPECTS(c.sites == 1, "sim::price_context: cluster '", c.name,
                   "': expected one site (the WAN level is not modelled here), found ", c.sites);
  const std::int64_t gpus = std::int64_t{s.nodes} * c.gpus_per_node;
  FEDSHARD_EXPECTS(s.nodes == 0 || gpus >= ranks, "sim::price_context: cluster '", c.name, "' has ",
                   s.nodes, " nodes x ", c.gpus_per_node, " GPUs = ", gpus,
                   ", expected at least the group's ", ranks, " ranks");
}

/// Seconds the pair (src, dst) holds a link for `bytes` in `messages` messages.
inline double context_pair_time(int src, int dst, double bytes, double messages, const cluster& c) {
  const bool same_node = src / c.gpus_per_node == dst / c.gpus_per_node;
  const link_level& l = same_node ? c.intra : c.inter;
  const double bw =
      same_node ? c.intra.bandwidth : c.node_bandwidth() / static_cast<double>(c.gpus_per_node);
  return messages * l.alpha + transfer_time(bytes, bw / l.oversubscription);
}

/// Fills every rank's receive, send and launch seconds from the placement's bytes matrix.
inline void price_context_exchange(const context_placement& p, const cluster& c, context_exchange e,
                                   std::vector<context_rank_price>& out) {
  const bool ring = e == context_exchange::ring;
  const double messages = ring ? p.ranks - 1.0 : 1.0;
  const double launches = ring ? p.ranks - 1.0 : 1.0;
  for (int s = 0; s < p.ranks; ++s)
    for (int d = 0; d < p.ranks; ++d) {
      const std::int64_t b = p.bytes(s, d);
      if (b <= 0) continue;
      const double t = context_pair_time(s, d, static_cast<double>(b), messages, c);
      auto& src = out[static_cast<std::size_t>(s)];
      auto& dst = out[static_cast<std::size_t>(d)];
      src.send += t;
      dst.receive += t;
      src.launch = dst.launch = launches * c.op_latency;
    }
}

}  // namespace detail

/// The price of one layer's forward attention over placement p on cluster c (the header's
/// model), its bytes exchanged as e says. Throws invalid_argument for a cluster that fails
/// cluster::check, has no peak_flops, spans sites or holds fewer GPUs than p.ranks (settings
/// nodes), or settings out of range (heads, head_dim < 1, mfu outside [0, 1], nodes < 0).
inline context_price price_context(const context_placement& p, const cluster& c,
                                   const context_price_settings& s,
                                   context_exchange e = context_exchange::point_to_point) {
  FEDSHARD_EXPECTS(p.ranks >= 1 && p.work.size() == static_cast<std::size_t>(p.ranks) &&
                       p.kv_bytes.size() == p.work.size() * p.work.size(),
                   "sim::price_context: expected a placement of P >= 1 ranks with P works and ",
                   "P x P bytes, found P = ", p.ranks, ", ", p.work.size(), " works and ",
                   p.kv_bytes.size(), " bytes");
  detail::check_context_price(p.ranks, c, s);
  const compute_model cm{c.peak_flops, s.mfu > 0 ? s.mfu : c.default_mfu};
  const double flop_rate = cm.peak_flops * cm.mfu;

  context_price out;
  out.ranks.resize(static_cast<std::size_t>(p.ranks));
  for (std::size_t r = 0; r < out.ranks.size(); ++r)
    out.ranks[r].compute = static_cast<double>(p.work[r]) * s.flops_per_pair() / flop_rate;
  detail::price_context_exchange(p, c, e, out.ranks);
  for (const context_rank_price& r : out.ranks) {
    const double comm = r.communication();
    out.serial = std::max(out.serial, comm + r.compute);
    out.overlapped = std::max(out.overlapped, std::max(comm, r.compute));
    out.max_compute = std::max(out.max_compute, r.compute);
    out.max_communication = std::max(out.max_communication, comm);
  }
  return out;
}

}  // namespace fedshard::sim
