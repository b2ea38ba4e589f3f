#pragma once
/// Prices a training step before it runs: the step plan of the algorithm's ShardPolicy and the
/// sync plan of its federation (the very plans the trainer executes), placed on a modelled
/// cluster, give the step time, split into compute and exposed communication per axis, the
/// tokens per second per GPU and the bytes per axis.
///
/// The model, for each rank:
///  - compute C: the tokens of one step x training FLOPs per token / (peak x MFU);
///  - every comm_op is priced by price_collective on the communicator of its axis, with the
///    communicators of every rank that runs the same op at the same time sharing NICs;
///  - overlap: the step ops the plan marks overlappable (FSDP's forward and backward
///    all_gathers and reduce_scatters, HSDP's replica all_reduce) run behind compute and only
///    what exceeds C is exposed; the others (none in today's step plans) are exposed;
///  - federation: the sync ops (overlappable = false) are exposed; a sync every K steps adds
///    sync time / K to each step;
///  - step = max(C, overlappable) + exposed step ops + sync / K; the job's step is the
///    slowest rank's (collectives wait for every member).
/// Bytes per axis are the plan's per-rank wire bytes (bus factor x array bytes), so they
/// equal what the executor's traffic_counters record for the same plan.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "fedshard/core/dtype.hpp"
#include "fedshard/error.hpp"
#include "fedshard/federation/federation_policy.hpp"
#include "fedshard/federation/sync_plan.hpp"
#include "fedshard/mesh/axis.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/schedule/every_step.hpp"
#include "fedshard/shard/flat_layout.hpp"
#include "fedshard/shard/shard_policy.hpp"
#include "fedshard/sim/collective_cost.hpp"
#include "fedshard/sim/compute.hpp"
#include "fedshard/sim/model_layout.hpp"
#include "fedshard/sim/topology.hpp"
#include "fedshard/trainer/algorithm.hpp"

namespace fedshard::sim {

/// What the simulator needs of an algorithm: its ShardPolicy's functions (whose step plan it
/// prices) and how and how often its federation syncs.
struct algorithm_desc {
  std::string name;
  std::string_view shard_policy;
  shard::shard_traits traits{};
  int (*layout_shards)(const mesh_shape&) = nullptr;
  void (*check)(const mesh_shape&) = nullptr;
  plan (*step_plan)(const flat_layout&, const mesh_shape&, const shard::precision&) = nullptr;
  bool syncs = false;  ///< the federation communicates
  federation::sync_mode sync = federation::sync_mode::hierarchical;
  bool weights = false;    ///< the groups' token weights are exchanged at each sync
  int moment_buffers = 0;  ///< inner-optimizer buffers averaged at each sync too
  int period = 1;          ///< K: inner steps per sync
};

/// The desc of Algorithm (an algorithm<Shard, Federation, Schedule> with an every_step or
/// periodic<K> schedule), named `name`, with the federation settings `fed`;
/// `inner_state_buffers` is the inner optimizer's state count (2 for AdamW), used when the
/// federation averages inner moments.
template <class Algorithm>
algorithm_desc describe(std::string name, typename Algorithm::federation_policy::config fed = {},
                        int inner_state_buffers = 2) {
  using S = typename Algorithm::shard_policy;
  using F = typename Algorithm::federation_policy;
  using Sched = typename Algorithm::sync_schedule;
  static_assert(
      std::is_same_v<Sched, schedule::every_step> || requires { Sched::period; },
      "fedshard::sim::describe: only every_step and periodic<K> schedules are priced");
  algorithm_desc d;
  d.name = std::move(name);
  d.shard_policy = S::name;
  d.traits = S::traits;
  d.layout_shards = &S::layout_shards;
  d.check = &S::check;
  d.step_plan = &S::step_plan;
  d.syncs = F::syncs;
  d.sync = fed.sync;
  d.weights = F::uses_weights;
  d.moment_buffers = F(fed, {}).averages_inner_moments() ? inner_state_buffers : 0;
  if constexpr (requires { Sched::period; })
    d.period = Sched::period;
  else
    d.period = 1;
  return d;
}

/// Names accepted by algorithm_by_name.
inline std::vector<std::string> algorithm_names() {
  return {"ddp", "zero2", "fsdp", "hsdp", "fl_fsdp", "fl_hsdp", "diloco"};
}

/// The algorithm called name (one of algorithm_names()) with K inner steps per sync (ignored
/// by those that do not federate) and the given sync mode.
inline algorithm_desc algorithm_by_name(
    std::string_view name, int k = 1,
    federation::sync_mode mode = federation::sync_mode::hierarchical) {
  FEDSHARD_EXPECTS(k >= 1, "sim::algorithm_by_name: K must be >= 1, found ", k);
  algorithm_desc d;
  const std::string n(name);
  if (name == "ddp")
    d = describe<ddp>(n);
  else if (name == "zero2")
    d = describe<zero2>(n);
  else if (name == "fsdp")
    d = describe<fsdp>(n);
  else if (name == "hsdp")
    d = describe<hsdp>(n);
  else if (name == "fl_fsdp")
    d = describe<fl_fsdp<1>>(n, {mode});
  else if (name == "fl_hsdp")
    d = describe<fl_hsdp<1>>(n, {mode});
  else if (name == "diloco")
    d = describe<diloco<1>>(n, {mode});
  else {
    std::string known;
    for (const auto& a : algorithm_names()) known += (known.empty() ? "" : ", ") + a;
    FEDSHARD_EXPECTS(false, "sim: unknown algorithm '", name, "', expected one of ", known);
  }
  if (d.syncs) d.period = k;
  return d;
}

/// The flat layout the trainer builds for these units on this mesh under algorithm a.
inline flat_layout layout_of(const algorithm_desc& a, std::vector<unit_spec> units,
                             const mesh_shape& shape) {
  FEDSHARD_EXPECTS(a.layout_shards && a.check && a.step_plan, "sim: algorithm '", a.name,
                   "' has no shard policy functions (build it with sim::describe)");
  a.check(shape);
  return flat_layout(std::move(units), a.layout_shards(shape));
}

/// The comm_ops of one inner step (the same on every rank).
inline plan step_plan_of(const algorithm_desc& a, const flat_layout& layout,
                         const mesh_shape& shape, const shard::precision& prec) {
  prec.check();
  return a.step_plan(layout, shape, prec);
}

/// The comm_ops one sync moves for world rank `rank`: federation::sync_plan on the padded
/// size of the rank's f32 master parameters, as the trainer calls it; empty when the
/// algorithm does not federate.
inline plan sync_plan_of(const algorithm_desc& a, const flat_layout& layout,
                         const mesh_shape& shape, int rank) {
  if (!a.syncs) return {};
  const std::size_t numel =
      federation::padded_fragment_numel(layout.total_shard_numel(), shape.replicas);
  return federation::sync_plan(shape, coords_of(shape, rank), a.sync, numel, a.weights,
                               a.moment_buffers);
}

/// Settings of the pricing that are not the cluster's or the model's.
struct price_options {
  collective_algorithm collectives = collective_algorithm::best;
  /// bf16 on the wire for parameters and gradient reductions (the paper's bf16 mixed
  /// precision); master weights, and so federation syncs, are f32 in any case.
  shard::precision precision{dtype::bf16, dtype::bf16};
};

/// The price of one axis for one rank.
struct axis_price {
  level_kind level = level_kind::local;  ///< outermost level its communicator crosses
  int ranks = 1;                         ///< members of its communicator
  double step_bytes = 0;                 ///< wire bytes of one inner step
  double sync_bytes = 0;                 ///< wire bytes of one sync
  double bytes_per_step = 0;             ///< step_bytes + sync_bytes / K
  /// Bytes leaving this rank's node for the axis's ops in one inner step: each communicator
  /// that spans nodes sends its ring's bytes out of the node once, so this is the wire bytes
  /// times the communicators of the node that run the op (0 inside a node). Counted for ring
  /// algorithms; a hierarchical one sends slightly less.
  double step_node_bytes = 0;
  double sync_node_bytes = 0;      ///< the same for one sync
  double node_bytes_per_step = 0;  ///< step_node_bytes + sync_node_bytes / K
  std::int64_t step_calls = 0;
  std::int64_t sync_calls = 0;
  double step_seconds = 0;  ///< time of its step ops, hidden or not
  double sync_seconds = 0;  ///< time of its ops in one sync
  double exposed = 0;       ///< exposed seconds per step (sync amortised over K)
};

/// What one rank's step costs.
struct rank_price {
  double step = 0;                   ///< seconds
  std::array<axis_price, 5> axes{};  ///< by axis
};

/// The price of one step of an algorithm on a cluster.
struct step_price {
  std::string algorithm;
  mesh_shape shape;
  int period = 1;             ///< K (1 when the algorithm does not federate)
  bool syncs = false;         ///< the algorithm federates
  double compute = 0;         ///< seconds of compute per step
  double overlappable = 0;    ///< step comm marked overlappable, seconds
  double hidden = 0;          ///< of it, hidden behind compute
  double exposed_step = 0;    ///< step comm not hidden
  double sync = 0;            ///< seconds of one sync
  double sync_per_step = 0;   ///< sync / K
  double step = 0;            ///< compute + exposed_step + sync_per_step
  double tokens_per_gpu = 0;  ///< tokens one GPU processes per step
  double tokens_per_s_per_gpu = 0;
  int critical_rank = 0;             ///< the slowest rank, whose split is reported
  std::array<axis_price, 5> axes{};  ///< the critical rank's, by axis
  std::vector<rank_price> ranks;     ///< every rank

  /// The critical rank's price of axis a.
  const axis_price& operator[](axis a) const { return axes[static_cast<std::size_t>(a)]; }
  /// Exposed communication seconds per step (step - compute).
  double exposed_comm() const noexcept { return exposed_step + sync_per_step; }
};

namespace detail {

/// Identifies "the same op" across ranks: ranks whose plans hold an op with this key run it
/// at the same time.
using op_key = std::tuple<comm_kind, axis, std::int64_t, phase, int>;

inline op_key key_of(const comm_op& op) {
  return {op.kind, op.on, op.bytes, op.when, op.unit};
}

/// Per-rank spans of every axis, computed on first use.
class span_cache {
 public:
  explicit span_cache(const placement& p) : p_(&p), spans_(5) {}
  const comm_span& get(axis a, int rank) {
    auto& v = spans_[static_cast<std::size_t>(a)];
    if (v.empty()) {
      v.resize(static_cast<std::size_t>(p_->size()));
      std::map<int, comm_span> by_comm;  // every member of a communicator has the same span
      for (int r = 0; r < p_->size(); ++r) {
        const int id = p_->comm_id(a, r);
        auto it = by_comm.find(id);
        if (it == by_comm.end()) it = by_comm.emplace(id, p_->span(a, r)).first;
        v[static_cast<std::size_t>(r)] = it->second;
      }
    }
    return v[static_cast<std::size_t>(rank)];
  }

 private:
  const placement* p_;
  std::vector<std::vector<comm_span>> spans_;
};

/// For each rank, how many communicators of an op share its node's NICs and its site's
/// uplink, given which ranks run the op.
inline std::vector<link_sharing> sharing_of(const placement& p, span_cache& spans, axis a,
                                            const std::vector<bool>& active) {
  const int W = p.size();
  std::vector<std::set<int>> node_comms(static_cast<std::size_t>(p.nodes()));
  std::vector<std::set<int>> site_comms(static_cast<std::size_t>(p.sites()));
  for (int r = 0; r < W; ++r) {
    if (!active[static_cast<std::size_t>(r)]) continue;
    const comm_span& s = spans.get(a, r);
    if (s.nodes > 1) node_comms[static_cast<std::size_t>(p.node_of(r))].insert(p.comm_id(a, r));
    if (s.sites > 1) site_comms[static_cast<std::size_t>(p.site_of(r))].insert(p.comm_id(a, r));
  }
  std::vector<link_sharing> out(static_cast<std::size_t>(W));
  for (int r = 0; r < W; ++r) {
    auto& o = out[static_cast<std::size_t>(r)];
    o.per_node = std::max<int>(
        1, static_cast<int>(node_comms[static_cast<std::size_t>(p.node_of(r))].size()));
    o.per_site = std::max<int>(
        1, static_cast<int>(site_comms[static_cast<std::size_t>(p.site_of(r))].size()));
  }
  return out;
}

/// Remembers the price of an op for each (span, sharing) it was asked with.
class price_memo {
 public:
  template <class F>
  double get(const comm_op& op, const comm_span& s, const link_sharing& share, F&& compute) {
    const key k{op.kind,    op.bytes, s.ranks,        s.nodes,
                s.per_node, s.sites,  share.per_node, share.per_site};
    auto it = seconds_.find(k);
    if (it == seconds_.end()) it = seconds_.emplace(k, compute()).first;
    return it->second;
  }

 private:
  using key = std::tuple<comm_kind, std::int64_t, int, int, int, int, int, int>;
  std::map<key, double> seconds_;
};

}  // namespace detail

/// Prices algorithm a on units laid out for `shape` on cluster c, given the compute seconds
/// and tokens of one GPU's step. See the file comment for the model.
inline step_price price_plans(const algorithm_desc& a, std::vector<unit_spec> units,
                              const mesh_shape& shape, const cluster& c, double compute_seconds,
                              double tokens_per_gpu, const price_options& o = {}) {
  FEDSHARD_EXPECTS(compute_seconds >= 0 && tokens_per_gpu >= 0,
                   "sim::price_plans: compute seconds and tokens must be >= 0, found ",
                   compute_seconds, " and ", tokens_per_gpu);
  FEDSHARD_EXPECTS(a.period >= 1, "sim::price_plans: K (period) must be >= 1, found ", a.period);
  const placement place(shape, c);
  const flat_layout layout = layout_of(a, std::move(units), shape);
  const plan step_ops = step_plan_of(a, layout, shape, o.precision);
  const int W = shape.size();
  std::vector<plan> sync_ops(static_cast<std::size_t>(W));
  for (int r = 0; r < W; ++r)
    sync_ops[static_cast<std::size_t>(r)] = sync_plan_of(a, layout, shape, r);

  detail::span_cache spans(place);
  // NIC sharing per rank: every rank runs every step op, so it depends on the axis alone; the
  // sync ops differ between ranks (reference mode), so there it depends on who runs the op.
  std::array<std::vector<link_sharing>, 5> step_sharing;
  const std::vector<bool> everyone(static_cast<std::size_t>(W), true);
  for (const auto& op : step_ops.ops) {
    auto& v = step_sharing[static_cast<std::size_t>(op.on)];
    if (v.empty()) v = detail::sharing_of(place, spans, op.on, everyone);
  }
  std::map<detail::op_key, std::vector<bool>> sync_runs;
  for (int r = 0; r < W; ++r)
    for (const auto& op : sync_ops[static_cast<std::size_t>(r)].ops) {
      auto& v = sync_runs[detail::key_of(op)];
      if (v.empty()) v.assign(static_cast<std::size_t>(W), false);
      v[static_cast<std::size_t>(r)] = true;
    }
  std::map<detail::op_key, std::vector<link_sharing>> sync_sharing;
  for (const auto& [key, active] : sync_runs)
    sync_sharing.emplace(key, detail::sharing_of(place, spans, std::get<1>(key), active));
  // Ranks mostly see the same (span, sharing) for an op: price each combination once.
  detail::price_memo memo;

  const double K = a.syncs ? a.period : 1.0;
  step_price out;
  out.algorithm = a.name;
  out.shape = shape;
  out.period = a.syncs ? a.period : 1;
  out.syncs = a.syncs;
  out.compute = compute_seconds;
  out.tokens_per_gpu = tokens_per_gpu;
  out.ranks.resize(static_cast<std::size_t>(W));

  struct totals {
    double overlappable = 0, exposed_ops = 0, sync = 0;
    std::array<double, 5> overlappable_by_axis{};
  };
  std::vector<totals> per_rank(static_cast<std::size_t>(W));
  double worst = -1;
  for (int r = 0; r < W; ++r) {
    auto& t = per_rank[static_cast<std::size_t>(r)];
    auto& rp = out.ranks[static_cast<std::size_t>(r)];
    // Prices op for rank r; adds the bytes it sends out of r's node to node_bytes.
    auto cost = [&](const comm_op& op, const link_sharing& share, double& node_bytes) {
      const comm_span& s = spans.get(op.on, r);
      FEDSHARD_EXPECTS(s.ranks == op.ranks, "sim::price_plans: the plan's ", describe(op), " has ",
                       op.ranks, " ranks but the mesh's ", to_string(op.on), " communicator has ",
                       s.ranks);
      if (s.nodes > 1) node_bytes += wire_bytes(op) * share.per_node;
      return memo.get(op, s, share, [&] {
        return price_collective(op.kind, static_cast<double>(op.bytes), s, share, c, o.collectives)
            .seconds;
      });
    };
    for (const auto& op : step_ops.ops) {
      auto& ax = rp.axes[static_cast<std::size_t>(op.on)];
      const double sec =
          cost(op, step_sharing[static_cast<std::size_t>(op.on)][static_cast<std::size_t>(r)],
               ax.step_node_bytes);
      ax.step_bytes += wire_bytes(op);
      ++ax.step_calls;
      ax.step_seconds += sec;
      if (op.overlappable) {
        t.overlappable += sec;
        t.overlappable_by_axis[static_cast<std::size_t>(op.on)] += sec;
      } else {
        t.exposed_ops += sec;
        ax.exposed += sec;
      }
    }
    for (const auto& op : sync_ops[static_cast<std::size_t>(r)].ops) {
      auto& ax = rp.axes[static_cast<std::size_t>(op.on)];
      const double sec = cost(op, sync_sharing.at(detail::key_of(op))[static_cast<std::size_t>(r)],
                              ax.sync_node_bytes);
      ax.sync_bytes += wire_bytes(op);
      ++ax.sync_calls;
      ax.sync_seconds += sec;
      ax.exposed += sec / K;
      t.sync += sec;
    }
    const double spill = std::max(0.0, t.overlappable - compute_seconds);
    for (axis ax_id : all_axes) {
      auto& ax = rp.axes[static_cast<std::size_t>(ax_id)];
      const comm_span& s = spans.get(ax_id, r);
      ax.level = s.level();
      ax.ranks = s.ranks;
      ax.bytes_per_step = ax.step_bytes + ax.sync_bytes / K;
      ax.node_bytes_per_step = ax.step_node_bytes + ax.sync_node_bytes / K;
      if (t.overlappable > 0)
        ax.exposed +=
            spill * t.overlappable_by_axis[static_cast<std::size_t>(ax_id)] / t.overlappable;
    }
    rp.step = std::max(compute_seconds, t.overlappable) + t.exposed_ops + t.sync / K;
    if (rp.step > worst) {
      worst = rp.step;
      out.critical_rank = r;
    }
  }
  const auto& t = per_rank[static_cast<std::size_t>(out.critical_rank)];
  const auto& rp = out.ranks[static_cast<std::size_t>(out.critical_rank)];
  out.axes = rp.axes;
  out.overlappable = t.overlappable;
  out.hidden = std::min(t.overlappable, compute_seconds);
  out.exposed_step = (t.overlappable - out.hidden) + t.exposed_ops;
  out.sync = t.sync;
  out.sync_per_step = t.sync / K;
  out.step = rp.step;
  out.tokens_per_s_per_gpu =
      out.step > 0 ? tokens_per_gpu / out.step : std::numeric_limits<double>::infinity();
  return out;
}

/// What each GPU trains on in a step.
struct workload {
  transformer_dims model = llama31_8b();
  int micro_batch = 1;  ///< sequences per GPU per step
  int seq = 2048;       ///< tokens per sequence
  double mfu = 0;       ///< 0: the cluster's default_mfu
  bool recompute = false;

  /// micro_batch x seq.
  double tokens_per_gpu() const noexcept { return double(micro_batch) * seq; }
};

/// Prices algorithm a training workload w on a G x R x S mesh of cluster c: the model's
/// units (sim::transformer_units, bf16) planned by a's policies, compute from
/// sim::compute_model.
inline step_price price(const algorithm_desc& a, const workload& w, const mesh_shape& shape,
                        const cluster& c, const price_options& o = {}) {
  FEDSHARD_EXPECTS(w.micro_batch >= 1 && w.seq >= 1,
                   "sim::price: micro_batch and seq must be >= 1, found ", w.micro_batch, " and ",
                   w.seq);
  const compute_model cm{c.peak_flops, w.mfu > 0 ? w.mfu : c.default_mfu, w.recompute};
  const double tokens = w.tokens_per_gpu();
  return price_plans(a, transformer_units(w.model, dtype::bf16), shape, c,
                     cm.seconds(w.model, tokens, w.seq), tokens, o);
}

}  // namespace fedshard::sim
