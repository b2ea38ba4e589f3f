#pragma once
/// Alpha-beta prices of one collective on a modelled cluster: ring, tree and hierarchical
/// (intra-node, then inter-node, then intra-node) algorithms.
///
/// S is the whole array (comm_op::bytes, nccl-tests' S); n the communicator's ranks, N the
/// nodes it spans, m its most members on one node.
///  - ring: the bytes each rank sends are the nccl-tests bus factor x S (2(n-1)/n for
///    all_reduce, (n-1)/n for all_gather and reduce_scatter, 1 for broadcast), and they flow
///    through every edge of the ring, so t = latency + bus_factor x S / β, where β is the
///    slowest level the ring crosses (ring_bandwidth). Latency as NCCL's tuning model:
///    op_latency + (steps - inter_steps) α_intra + inter_steps α_inter, steps = 2(n-1) for
///    all_reduce and n-1 otherwise, inter_steps the same count over N (and over sites for α_wan).
///  - tree (all_reduce and broadcast only): a reduce up and a broadcast down a tree whose
///    depth is m-1 intra hops plus ceil(log2 N) network hops; every rank sends S per phase, so
///    t = op_latency + phases x depth x α + phases x S / β.
///  - hierarchical (a communicator with m > 1 members on each of N > 1 nodes): all_reduce =
///    reduce_scatter inside the node + all_reduce of S/m across nodes by the m node-local
///    ranks in parallel + all_gather inside the node; all_gather / reduce_scatter = the
///    inter-node part on S/m and the intra-node part on S; broadcast = across nodes, then
///    inside them.
///
/// NIC sharing, explicitly: a ring (or tree) that leaves a node uses the node's NICs once per
/// communicator, whatever its members on that node. Every communicator of the same op that
/// leaves the node at the same time (link_sharing::per_node, counting this one) gets an
/// equal share of the node bandwidth, and a communicator with m members on a node reaches at
/// most m x nics_per_node / gpus_per_node of its NICs (at least one). The same holds for a
/// site's WAN uplink (link_sharing::per_site). Each level's oversubscription (fabric
/// contention) divides its bandwidth.
///
/// Measured constants (cluster::measured, calibrate.hpp): when they hold a fit of the kind at
/// the span's level, t = latency + bus_factor x S / (busbw / sharing), sharing =
/// link_sharing::per_site for a span across sites, per_node for one across nodes, 1 inside a
/// node (busbw was measured for one communicator alone), whatever the algorithm asked for
/// (the measured library chose its own). A fit of another rank count of the same kind and
/// level gives busbw as measured and latency x ring_steps(n) / ring_steps(n measured), from
/// the nearest rank count measured. Otherwise the α-β model above.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>

#include "fedshard/error.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/sim/calibrate.hpp"
#include "fedshard/sim/topology.hpp"

namespace fedshard::sim {

/// How a collective is run.
enum class collective_algorithm : std::uint8_t { ring, tree, hierarchical, best };

/// "ring", "tree", "hierarchical" or "best".
constexpr std::string_view to_string(collective_algorithm a) noexcept {
  switch (a) {
    case collective_algorithm::ring: return "ring";
    case collective_algorithm::tree: return "tree";
    case collective_algorithm::hierarchical: return "hierarchical";
    case collective_algorithm::best: return "best";
  }
  return "unknown-algorithm";
}

/// The algorithm called name; invalid_argument otherwise.
inline collective_algorithm parse_collective_algorithm(std::string_view name) {
  for (auto a : {collective_algorithm::ring, collective_algorithm::tree,
                 collective_algorithm::hierarchical, collective_algorithm::best})
    if (name == to_string(a)) return a;
  FEDSHARD_EXPECTS(false, "sim: unknown collective algorithm '", name,
                   "', expected ring, tree, hierarchical or best");
  return collective_algorithm::ring;
}

/// How many communicators running the same op at the same time share one node's NICs and one
/// site's uplink, counting this one.
struct link_sharing {
  int per_node = 1;
  int per_site = 1;
};

/// The price of one collective.
struct collective_cost {
  double seconds = 0;                                           ///< latency + transfer
  double latency = 0;                                           ///< α terms
  double transfer = 0;                                          ///< β terms
  collective_algorithm algorithm = collective_algorithm::ring;  ///< the one priced
  bool measured = false;  ///< priced with cluster::measured, not the α-β model
};

namespace detail {

/// Ring steps of a collective over n participants (0 when n <= 1).
constexpr double ring_steps(comm_kind k, int n) noexcept {
  if (n <= 1) return 0;
  switch (k) {
    case comm_kind::all_reduce: return 2.0 * (n - 1);
    case comm_kind::all_gather:
    case comm_kind::reduce_scatter:
    case comm_kind::broadcast: return n - 1.0;
    case comm_kind::send_recv:
    case comm_kind::send:
    case comm_kind::recv: return 1;
    case comm_kind::pack:
    case comm_kind::unpack:
    case comm_kind::zero: return 0;  // local: no ring
  }
  return 0;
}

/// The bytes whose transfer an op's time waits for, per array byte: the bus factor, but 1 for a
/// recv (it sends nothing and waits for the whole message).
constexpr double time_factor(comm_kind k, int n) noexcept {
  return k == comm_kind::recv && n > 1 ? 1.0 : bus_factor(k, n);
}

/// ceil(log2(n)) for n >= 1.
inline double tree_depth(int n) noexcept {
  return n <= 1 ? 0.0 : std::ceil(std::log2(static_cast<double>(n)));
}

/// Bytes/s one communicator's traffic gets through the slowest level it crosses, each
/// level's bandwidth divided by its oversubscription.
inline double ring_bandwidth(const comm_span& s, const link_sharing& share, const cluster& c) {
  for (const link_level* l : {&c.intra, &c.inter, &c.wan})
    FEDSHARD_EXPECTS(l->oversubscription > 0,
                     "sim: a link level's oversubscription must be > 0 (1: none), found ",
                     l->oversubscription);
  double bw = std::numeric_limits<double>::infinity();
  if (s.per_node > 1) bw = std::min(bw, c.intra.bandwidth / c.intra.oversubscription);
  if (s.nodes > 1) {
    const double reachable =
        std::clamp(static_cast<double>(s.per_node) * c.nics_per_node / c.gpus_per_node, 1.0,
                   static_cast<double>(c.nics_per_node));
    bw = std::min({bw, c.node_bandwidth() / std::max(1, share.per_node) / c.inter.oversubscription,
                   reachable * c.nic_bandwidth / c.inter.oversubscription});
  }
  if (s.sites > 1)
    bw = std::min(bw, c.wan.bandwidth / std::max(1, share.per_site) / c.wan.oversubscription);
  return bw;
}

/// bytes / bw, 0 when nothing moves (also for an infinite bandwidth).
inline double transfer_time(double bytes, double bw) noexcept {
  return bytes <= 0 ? 0.0 : bytes / bw;
}

inline collective_cost ring_cost(comm_kind k, double bytes, const comm_span& s,
                                 const link_sharing& share, const cluster& c) {
  collective_cost r;
  r.algorithm = collective_algorithm::ring;
  if (s.ranks <= 1) return r;
  const double steps = ring_steps(k, s.ranks);
  const double inter = std::min(steps, ring_steps(k, s.nodes));
  const double wan = std::min(inter, ring_steps(k, s.sites));
  r.latency = c.op_latency + (steps - inter) * c.intra.alpha + (inter - wan) * c.inter.alpha +
              wan * c.wan.alpha;
  r.transfer = transfer_time(time_factor(k, s.ranks) * bytes, ring_bandwidth(s, share, c));
  r.seconds = r.latency + r.transfer;
  return r;
}

inline bool tree_applies(comm_kind k) noexcept {
  return k == comm_kind::all_reduce || k == comm_kind::broadcast;
}

inline collective_cost tree_cost(comm_kind k, double bytes, const comm_span& s,
                                 const link_sharing& share, const cluster& c) {
  collective_cost r;
  r.algorithm = collective_algorithm::tree;
  if (s.ranks <= 1) return r;
  const double phases = k == comm_kind::all_reduce ? 2.0 : 1.0;
  const int nodes_per_site = (s.nodes + s.sites - 1) / s.sites;
  const double depth = (s.per_node - 1) * c.intra.alpha +
                       tree_depth(nodes_per_site) * c.inter.alpha +
                       tree_depth(s.sites) * c.wan.alpha;
  r.latency = c.op_latency + phases * depth;
  r.transfer = transfer_time(phases * bytes, ring_bandwidth(s, share, c));
  r.seconds = r.latency + r.transfer;
  return r;
}

inline bool hierarchical_applies(comm_kind k, const comm_span& s) noexcept {
  return !point_to_point(k) && s.per_node > 1 && s.nodes > 1;
}

inline collective_cost add(collective_cost a, const collective_cost& b) {
  a.seconds += b.seconds;
  a.latency += b.latency;
  a.transfer += b.transfer;
  return a;
}

inline collective_cost faster(const collective_cost& a, const collective_cost& b) {
  return b.seconds < a.seconds ? b : a;
}

inline collective_cost hierarchical_cost(comm_kind k, double bytes, const comm_span& s,
                                         const link_sharing& share, const cluster& c) {
  const int m = s.per_node;
  const comm_span local{m, 1, m, 1};
  const comm_span across{s.nodes, s.nodes, 1, s.sites};
  // m node-local ranks each run their own inter-node collective; broadcast has one.
  const int parallel = k == comm_kind::broadcast ? 1 : m;
  const link_sharing wide{share.per_node * parallel, share.per_site * parallel};
  const double piece = bytes / m;
  collective_cost r;
  switch (k) {
    case comm_kind::all_reduce: {
      r = ring_cost(comm_kind::reduce_scatter, bytes, local, {}, c);
      const collective_cost mid = faster(ring_cost(comm_kind::all_reduce, piece, across, wide, c),
                                         tree_cost(comm_kind::all_reduce, piece, across, wide, c));
      r = add(add(r, mid), ring_cost(comm_kind::all_gather, bytes, local, {}, c));
      break;
    }
    case comm_kind::all_gather:
      r = add(ring_cost(comm_kind::all_gather, piece, across, wide, c),
              ring_cost(comm_kind::all_gather, bytes, local, {}, c));
      break;
    case comm_kind::reduce_scatter:
      r = add(ring_cost(comm_kind::reduce_scatter, bytes, local, {}, c),
              ring_cost(comm_kind::reduce_scatter, piece, across, wide, c));
      break;
    case comm_kind::broadcast:
      r = add(faster(ring_cost(k, bytes, across, wide, c), tree_cost(k, bytes, across, wide, c)),
              ring_cost(k, bytes, local, {}, c));
      break;
    case comm_kind::send_recv:
    case comm_kind::send:
    case comm_kind::recv:
    case comm_kind::pack:
    case comm_kind::unpack:
    case comm_kind::zero: break;
  }
  r.algorithm = collective_algorithm::hierarchical;
  return r;
}

/// The price from c.measured (see the file comment), or nothing when it has no fit of k at
/// s's level.
inline std::optional<collective_cost> measured_cost(comm_kind k, double bytes, const comm_span& s,
                                                    const link_sharing& share, const cluster& c,
                                                    collective_algorithm algo) {
  if (!c.measured || s.ranks <= 1) return std::nullopt;
  const level_kind level = s.level();
  const fitted_collective* f = c.measured->find(k, level, s.ranks);
  double latency = 0;
  if (f) {
    latency = f->latency;
  } else {
    f = c.measured->nearest(k, level, s.ranks);
    if (!f) return std::nullopt;
    latency = f->latency * (ring_steps(k, s.ranks) / ring_steps(k, f->ranks));
  }
  const int sharing = level == level_kind::wan     ? std::max(1, share.per_site)
                      : level == level_kind::inter ? std::max(1, share.per_node)
                                                   : 1;
  collective_cost r;
  r.algorithm = algo;
  r.measured = true;
  r.latency = latency;
  r.transfer = transfer_time(time_factor(k, s.ranks) * bytes, f->bus_bandwidth / sharing);
  r.seconds = r.latency + r.transfer;
  return r;
}

}  // namespace detail

/// The time of one collective of kind k on an array of `bytes` (nccl-tests S) over a
/// communicator spread as s, with `share` communicators leaving each node (site) at once.
/// An algorithm that does not apply (tree for all_gather / reduce_scatter, hierarchical for a
/// communicator inside one node or with one member per node) falls back to ring; `best`
/// prices every one that applies and returns the fastest.
inline collective_cost price_collective(comm_kind k, double bytes, const comm_span& s,
                                        const link_sharing& share, const cluster& c,
                                        collective_algorithm algo = collective_algorithm::best) {
  FEDSHARD_EXPECTS(bytes >= 0, "sim::price_collective: bytes must be >= 0, found ", bytes);
  FEDSHARD_EXPECTS(s.ranks >= 1 && s.nodes >= 1 && s.per_node >= 1 && s.sites >= 1,
                   "sim::price_collective: a communicator span needs ranks, nodes, per_node and "
                   "sites >= 1, found ",
                   s.ranks, ", ", s.nodes, ", ", s.per_node, ", ", s.sites);
  if (auto m = detail::measured_cost(k, bytes, s, share, c, algo)) return *m;
  const collective_cost ring = detail::ring_cost(k, bytes, s, share, c);
  if (s.ranks <= 1) return ring;
  const bool tree_ok = detail::tree_applies(k);
  const bool hier_ok = detail::hierarchical_applies(k, s);
  switch (algo) {
    case collective_algorithm::ring: return ring;
    case collective_algorithm::tree:
      return tree_ok ? detail::tree_cost(k, bytes, s, share, c) : ring;
    case collective_algorithm::hierarchical:
      return hier_ok ? detail::hierarchical_cost(k, bytes, s, share, c) : ring;
    case collective_algorithm::best: {
      collective_cost r = ring;
      if (tree_ok) r = detail::faster(r, detail::tree_cost(k, bytes, s, share, c));
      if (hier_ok) r = detail::faster(r, detail::hierarchical_cost(k, bytes, s, share, c));
      return r;
    }
  }
  return ring;
}

}  // namespace fedshard::sim
