#pragma once
// The demo's training runs, shared by fedshard-demo (which prints them) and fedshard-sim
// --predict-demo (which predicts them and measures them side by side): the settings and
// their flags, the mesh and schedule of each algorithm (the rows table), and train<A>, which
// trains charlm on 8 in-process ranks over 2 emulated sites (by default; --ranks, --groups,
// --slow-site, --slow-factor change the world, its sites and their links; --experts adds a
// mixture-of-experts layer to the model) and reports tokens/s, perplexity and bytes.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "charlm/charlm.hpp"
#include "common/cli.hpp"
#include "demo/models.hpp"
#include "fedshard/comm/inproc.hpp"
#include "fedshard/comm/shaped.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/trainer/trainer.hpp"

namespace demo {

using comm = fedshard::shaped::communicator<fedshard::inproc::communicator>;

struct settings {
  std::string corpus = "/usr/share/common-licenses";
  int steps = 480;  // --steps; under --time-budget, a cap (unbounded unless given)
  bool steps_given = false;
  // --time-budget S: every row trains until S seconds of training (rank 0's clock; 0: none)
  double time_budget = 0;
  // --token-budget N: every row trains the steps that reach N tokens (0: --steps decides)
  std::int64_t token_budget = 0;
  int batch = 16;           // examples per rank per step
  int hidden = 256;         // width of the two hidden layers
  int experts = 0;          // mixture-of-experts layer: number of experts (0: none)
  int expert_hidden = 0;    // width of each expert's hidden layer (0: hidden)
  int expert_copies = 0;    // fomoe: groups holding each expert (0: G - 1, at least 1)
  int ranks = 8;            // in-process ranks
  int groups = 2;           // groups of the federated rows = sites (one site per group)
  int slow_site = -1;       // the site behind a slower link (-1: every site's link is the same)
  double slow_factor = 10;  // how much slower: bandwidth / factor, latency x factor
  int eval_every = 40;
  int eval_examples = 1024;
  double bandwidth_gbit = 1.0;
  double latency_ms = 5.0;
  float lr = 3e-3f;
  std::uint64_t seed = 1;
  int k = 8;                              // fl_fsdp, fl_hsdp: steps between syncs
  int h = 16;                             // diloco, streaming_diloco: inner steps per outer step
  int fragments = 2;                      // streaming_diloco
  int delay = 1;                          // streaming_diloco: steps a fragment's sync overlaps
  double scape_density = 0.05;            // scape: fraction of each shard's elements in the mask
  int scape_refresh = 1;                  // scape: steps between mask computations
  int scape_dense_steps = 1;              // scape: dense steps before the first mask
  int scape_dense_every = 0;              // scape: every N-th step dense (0: none)
  bool scape_per_tensor = true;           // scape: a top-k per tensor slice of each shard
  std::int64_t scape_dense_below = 2048;  // scape: tensors smaller than this always masked
  std::string out = "demo-out";
  std::vector<std::string> algorithms{"ddp",     "fsdp",   "hsdp",       "fl_fsdp",
                                      "fl_hsdp", "diloco", "sparseloco", "fl_hsdp_int8"};
  bool quiet = false;  // no progress lines (fedshard-sim --predict-demo)
  // --model: "mlp" (charlm::model) or "attention" (charlm::attention_model: --batch counts
  // sequences, and the fcp row needs it); demo/models.hpp
  std::string model = "mlp";
  // --sync-dtype: the federation's averages travel and combine in it (precision.sync)
  std::string sync_dtype = "f32";
  // --group-shapes: the federated rows' groups, R_g x S_g each (sites of different sizes;
  // empty: G groups of one shape). Sets ranks = sum R_g S_g and groups = their count.
  std::vector<fedshard::group_shape> group_shapes;
};

struct curve_point {
  int step;
  double tokens, seconds, ppl;
};

struct result {
  std::string name;
  fedshard::mesh_shape shape;
  int steps = 0;             // training steps taken
  std::string group_shapes;  // the federated rows' "RxS,RxS" on a heterogeneous mesh, else ""
  double tokens = 0, seconds = 0, ppl = 0, comm_seconds = 0, link_delay = 0;
  double cross_site = 0;  // bytes rank 0 sent over the inter-site links (any communicator)
  double gather = 0;      // bytes rank 0 sent in parameter gathers (part of the shard axis)
  std::map<fedshard::axis, double> bytes;  // per rank (rank 0), evaluation included
  // per rank (rank 0), in training steps only: calls, array bytes, wire bytes
  std::map<fedshard::axis, fedshard::axis_traffic> step_traffic;
  std::vector<curve_point> curve;
};

/// Groups holding each expert in the fomoe row: --expert-copies, by default G - 1 (at least
/// 1). On the 4-site demo, one copy per expert (each expert trained by one group only, never
/// averaged) costs 17% in eval perplexity against fl_hsdp, 2 copies 8%, 3 copies 2% (README).
inline int expert_copies(const settings& s) {
  return s.expert_copies > 0 ? s.expert_copies : std::max(1, s.groups - 1);
}

/// The emulated network of settings s: s.ranks ranks on s.groups sites (contiguous blocks,
/// so that group g of a federated mesh sits on site g), optionally one site slower.
inline fedshard::shaped::topology topology_of(const settings& s) {
  const fedshard::shaped::link wan{s.bandwidth_gbit * 1e9 / 8, s.latency_ms * 1e-3};
  if (!s.group_shapes.empty()) {  // group g's block of R_g S_g ranks is site g
    fedshard::shaped::topology t;
    t.wan = wan;
    for (std::size_t g = 0; g < s.group_shapes.size(); ++g)
      t.site_of_rank.insert(t.site_of_rank.end(),
                            static_cast<std::size_t>(s.group_shapes[g].size()),
                            static_cast<int>(g));
    if (s.slow_site >= 0) {
      t.site_links.assign(s.group_shapes.size(), wan);
      t.site_links[static_cast<std::size_t>(s.slow_site)] = {
          .bandwidth_bytes_per_s = wan.bandwidth_bytes_per_s / s.slow_factor,
          .latency_s = wan.latency_s * s.slow_factor};
    }
    return t;
  }
  if (s.slow_site < 0) return fedshard::shaped::topology::blocks(s.ranks, s.groups, wan);
  return fedshard::shaped::topology::blocks_with_slow_site(s.ranks, s.groups, wan, s.slow_site,
                                                           s.slow_factor);
}

/// The model's sizes under settings s.
inline charlm::dims dims_of(const settings& s, const charlm::corpus& data) {
  return {.vocab = data.vocab(),
          .context = 8,
          .embed = 16,
          .hidden = s.hidden,
          .experts = s.experts,
          .expert_hidden = s.expert_hidden};
}

/// The steps a row trains: --token-budget's (the first step count whose tokens reach it,
/// the same on every rank: the tokens of a step are a function of the step and the mesh),
/// else --steps.
template <class Kit, class Mesh>
inline int steps_of(const Kit& kit, const Mesh& m, const settings& s) {
  if (s.token_budget <= 0) return s.steps;
  double tokens = 0;
  int steps = 0;
  while (tokens < static_cast<double>(s.token_budget)) {
    FEDSHARD_EXPECTS(steps < s.steps, "demo: --token-budget ", s.token_budget,
                     " is not reached within the ", s.steps, " steps --steps allows");
    tokens += kit.world_tokens(m, steps++);
  }
  return steps;
}

template <class Algorithm, class Kit>
inline result train(const std::string& name, fedshard::mesh_shape shape, const settings& s,
                    const Kit& kit, fedshard::trainer_options<Algorithm> opts = {}) {
  const int world_size = s.ranks;
  result r;
  r.name = name;
  r.shape = shape;
  auto net = fedshard::shaped::network::create(topology_of(s));
  std::mutex mu;
  // --time-budget: rank 0's clock decides, after a step, that the row stops; the others
  // read it after the next barrier, so every rank takes the same steps.
  std::atomic<bool> out_of_time{false};
  // 8 ranks computing on few cores: waiting ranks sleep at once instead of polling, so the
  // ranks they wait for get the cores (fedshard::inproc::options::spin_polls).
  fedshard::inproc::options run_options;
  run_options.spin_polls = 0;
  fedshard::inproc::run(
      world_size,
      [&](fedshard::inproc::communicator& w) {
        const int rank = w.rank();
        comm world(std::move(w), net);
        // --group-shapes: the federated rows (G groups) run on the groups of different sizes.
        const bool hetero = !s.group_shapes.empty() && shape.groups > 1;
        fedshard::mesh m =
            hetero ? fedshard::mesh(world, s.group_shapes) : fedshard::mesh(world, shape);
        const int steps = steps_of(kit, m, s);
        fedshard::trainer_options<Algorithm> o = opts;
        o.total_steps = s.time_budget > 0 ? 0 : steps;  // under a time budget: not known
        fedshard::trainer<typename Kit::model_type, Algorithm, fedshard::optim::adamw, comm> t(
            m, kit.make(), {.lr = s.lr, .weight_decay = 0.0f}, o);
        const auto eval = kit.eval_batch(m);
        double train_seconds = 0, tokens = 0;
        // A shard policy with run-time state (scape) gathers packed or dense from step to
        // step: its gathers are counted at the wire (the shard axis's all_gathers, less the
        // mask exchanges), not from the step plan.
        constexpr bool varies = decltype(t)::engine_type::has_runtime;
        double gathered = 0;
        t.wire().keep_calls(varies);
        std::map<fedshard::axis, fedshard::axis_traffic> step_traffic;
        std::vector<curve_point> curve;
        auto evaluate = [&](int step) {
          const double loss = kit.eval_loss(t, eval);
          curve.push_back({step, tokens, train_seconds, std::exp(loss)});
          if (rank == 0 && !s.quiet) {
            std::printf("  [%-8s] step %4d%s  tokens %7.0f  eval ppl %7.3f  (%.1f s training)\n",
                        name.c_str(), step,
                        s.time_budget > 0 ? "" : ("/" + std::to_string(steps)).c_str(), tokens,
                        std::exp(loss), train_seconds);
            std::fflush(stdout);
          }
        };
        evaluate(0);
        int taken = 0;
        for (int step = 0; step < steps; ++step) {
          if (s.time_budget > 0) {
            world.inner().barrier();  // rank 0's decision after the last step is visible
            if (out_of_time.load()) break;
          }
          const auto b = kit.train_batch(m, step);
          tokens += kit.world_tokens(m, step);
          // All ranks start the step together and the time covers the slowest. The barriers
          // are the wrapped communicator's: they measure, they are not training traffic, so
          // they do not wait for the emulated link's latency.
          world.inner().barrier();
          const auto t0 = std::chrono::steady_clock::now();
          std::map<fedshard::axis, fedshard::axis_traffic> before;
          for (fedshard::axis a : fedshard::all_axes) before[a] = t.traffic()[a];
          t.wire().take_calls();
          t.step(b);
          for (const auto& c : t.wire().take_calls())
            if (c.kind == fedshard::comm_kind::all_gather && c.axis == fedshard::axis::shard)
              gathered += fedshard::bus_factor(c.kind, c.ranks) * static_cast<double>(c.bytes);
          world.inner().barrier();
          train_seconds +=
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          taken = step + 1;
          if (rank == 0 && s.time_budget > 0 && train_seconds >= s.time_budget)
            out_of_time.store(true);
          for (fedshard::axis a : fedshard::all_axes) {
            auto& x = step_traffic[a];
            x.calls += t.traffic()[a].calls - before[a].calls;
            x.payload_bytes += t.traffic()[a].payload_bytes - before[a].payload_bytes;
            x.wire_bytes += t.traffic()[a].wire_bytes - before[a].wire_bytes;
          }
          if ((step + 1) % s.eval_every == 0 || step + 1 == steps) evaluate(step + 1);
        }
        if (curve.back().step != taken) evaluate(taken);  // stopped by the time budget
        if (rank != 0) return;
        std::lock_guard lock(mu);
        if (hetero) r.group_shapes = fedshard::to_string(s.group_shapes);
        r.curve = curve;
        r.steps = taken;
        r.seconds = train_seconds;
        r.tokens = tokens;
        r.ppl = curve.back().ppl;
        if constexpr (varies) {
          const auto& rt = t.engine().runtime();
          r.gather = gathered - static_cast<double>(rt.refreshes()) *
                                    fedshard::wire_bytes(rt.mask_plan().ops.at(0));
        } else {
          for (const auto& op : t.step_plan().ops)  // the wire carries the plan (tested)
            if (op.out.role == fedshard::role::params) r.gather += fedshard::wire_bytes(op) * taken;
        }
        for (fedshard::axis a : fedshard::all_axes) {
          r.bytes[a] = t.traffic()[a].wire_bytes;
          r.step_traffic[a] = step_traffic[a];
          r.comm_seconds += t.traffic()[a].seconds;
        }
        // Every communicator of the rank (the axes and the sub-communicators of holder sets
        // the interpreter splits off) counts into its world's family.
        r.cross_site = world.family_stats().crossing_bytes;
      },
      run_options);
  return r;
}

/// The shape of a row's mesh over N ranks and G groups.
enum class mesh_kind {
  replicas,          ///< 1 x N x 1
  shards,            ///< 1 x 1 x N
  hybrid,            ///< 1 x 2 x N/2
  federated_shards,  ///< G x 1 x N/G
  federated_hybrid,  ///< G x 2 x N/(2G) (N/G even; 4 groups of 8 ranks: 4 x 2 x 1), else G x N/G x
                     ///< 1
};
/// How often a federated row syncs: the rule of options_of (K for averaging, H for outer
/// optimizers), or K or H whatever its policies.
enum class cadence { by_policy, k, h };

/// How an alias of fedshard::for_each_algorithm runs in the demo: the mesh, when it syncs,
/// whether it places the model's experts (--experts: a holder_average row gets its holder
/// sets from charlm::model::ownership), and settings that differ from the alias's defaults.
struct row_spec {
  std::string_view name;
  mesh_kind mesh = mesh_kind::federated_hybrid;
  cadence every = cadence::by_policy;
  bool needs_experts = false;
  /// The outer step's momentum γ, for a row whose federation settings have one (0: the
  /// policy's default).
  float outer_momentum = 0.0f;
  /// Trains only the attention model (--model attention): its groups' ranks share each batch
  /// of sequences (context parallelism).
  bool needs_attention = false;
};

/// The demo's rows, keyed by alias: every alias of fedshard::for_each_algorithm is a row the
/// demo can run; one not listed here runs as {name, federated_hybrid, by_policy}. A row that
/// needs a mesh or settings of its own says so here, not in the code that trains it.
inline const std::vector<row_spec>& rows() {
  static const std::vector<row_spec> r{
      {.name = "ddp", .mesh = mesh_kind::replicas},
      {.name = "zero2", .mesh = mesh_kind::shards},
      {.name = "fsdp", .mesh = mesh_kind::shards},
      {.name = "hsdp", .mesh = mesh_kind::hybrid},
      {.name = "fl_fsdp", .mesh = mesh_kind::federated_shards},
      {.name = "fl_hsdp"},
      {.name = "fl_hsdp_int8"},
      {.name = "diloco"},
      {.name = "streaming_diloco"},
      {.name = "sparseloco"},
      // Gossip: one random peer per round (degree 1, α = 1/2: each pair averages its stepped
      // models) and outer momentum γ = 0.5, not DiLoCo's 0.9: each group's momentum is its
      // own, and on the 4-site demo γ = 0.9 left the groups' models apart (eval ppl 12.2
      // against 10.8 with γ = 0.5 and DiLoCo's 10.4; README's demo section).
      {.name = "gasloc", .every = cadence::h, .outer_momentum = 0.5f},
      // Expert e on groups e, e + 1, ... mod G (expert_copies; dense units everywhere).
      {.name = "fomoe", .every = cadence::k, .needs_experts = true},
      {.name = "scape_fsdp", .mesh = mesh_kind::shards},
      // SCAPE inside each group of fl_fsdp: its mesh and K (sparse_options).
      {.name = "fl_scape_fsdp", .mesh = mesh_kind::federated_shards, .every = cadence::k},
      // The local rules on fl_hsdp's mesh and cadence: HO-FL (embed and hidden1 zeroth-order,
      // sent as seeds) and LSS (a soup of 3 per round), both token-weighted.
      {.name = "hofl", .every = cadence::k},
      {.name = "lss", .every = cadence::k},
      // FCP: fl_hsdp's mesh and K, each group's batch spread over its 4 ranks.
      {.name = "fcp", .every = cadence::k, .needs_attention = true},
      // Sub-models at element granularity on fl_hsdp's mesh and K: FEAST (group g trains the
      // first (G - g) / G of every tensor's rows) and Collate (a random half of the blocks
      // per group per round), both token-weighted.
      {.name = "feast", .every = cadence::k},
      {.name = "collate", .every = cadence::k},
  };
  return r;
}
/// The row of `name` (a default row for an alias not listed).
inline row_spec row_of(std::string_view name) {
  for (const auto& r : rows())
    if (r.name == name) return r;
  return {.name = name};
}

/// The mesh an algorithm runs on under settings s (N = s.ranks, G = s.groups): see mesh_kind.
inline fedshard::mesh_shape mesh_of(const std::string& algorithm, const settings& s) {
  const int n = s.ranks, g = s.groups, per = n / g;
  switch (row_of(algorithm).mesh) {
    case mesh_kind::replicas: return {1, n, 1};
    case mesh_kind::shards: return {1, 1, n};
    case mesh_kind::hybrid:
      return n % 2 == 0 ? fedshard::mesh_shape{1, 2, n / 2} : fedshard::mesh_shape{1, n, 1};
    case mesh_kind::federated_shards: return {g, 1, per};
    case mesh_kind::federated_hybrid:
      return per % 2 == 0 ? fedshard::mesh_shape{g, 2, per / 2} : fedshard::mesh_shape{g, per, 1};
  }
  return {g, 1, per};
}
/// The mesh each algorithm runs on with the default settings: 8 ranks, the federated ones as
/// 2 groups (one per site).
inline fedshard::mesh_shape mesh_of(const std::string& algorithm) {
  return mesh_of(algorithm, settings{});
}

/// Whether the row `name` of algorithm A syncs every K or every H (cadence::k or cadence::h):
/// its row's cadence, else K for periodic averaging and H for the outer optimizers, except
/// sparseloco, which syncs every K like the averaging it compresses (so its bytes compare
/// with fl_hsdp's at the same cadence); by_policy for a schedule without a period.
template <class A>
cadence cadence_of(std::string_view name) {
  using schedule = typename A::sync_schedule;
  using federation = typename A::federation_policy;
  if constexpr (std::is_same_v<schedule, fedshard::schedule::streaming>) {
    return cadence::h;
  } else if constexpr (std::is_same_v<schedule, fedshard::schedule::periodic>) {
    constexpr bool outer =
        !std::is_same_v<federation, fedshard::federation::average> &&
        std::is_same_v<fedshard::federation::sync_codec_t<federation>, fedshard::codec::identity>;
    const cadence every = row_of(name).every;
    return every != cadence::by_policy ? every : outer ? cadence::h : cadence::k;
  } else {
    return cadence::by_policy;
  }
}

/// SCAPE's settings from the --scape-* flags (shard::sparse: --scape-density,
/// --scape-refresh, --scape-dense-steps, --scape-dense-every, --scape-per-tensor,
/// --scape-dense-below). By default each tensor's part of a shard gets its own top 5% and the
/// tensors of fewer than 2048 elements (the embedding table, 86 x 16 on the default corpus,
/// and the biases) are always masked: one top-k over a whole shard starved them (ppl 14.3
/// against 11.8, fl_fsdp 9.8).
inline fedshard::shard::sparse_settings sparse_options(const settings& s) {
  return {.density = s.scape_density,
          .refresh_period = s.scape_refresh,
          .dense_steps = s.scape_dense_steps,
          .dense_every = s.scape_dense_every,
          .per_tensor = s.scape_per_tensor,
          .dense_below = s.scape_dense_below};
}

/// The demo's settings for the row `name` of algorithm A: K or H (and the streaming settings)
/// by cadence_of, SCAPE's settings for a shard::sparse policy (sparse_options), and the
/// row's own settings (row_spec).
template <class A>
fedshard::trainer_options<A> options_of(const settings& s, std::string_view name = {}) {
  using schedule = typename A::sync_schedule;
  fedshard::trainer_options<A> o;
  o.precision.sync = s.sync_dtype == "bf16"  ? fedshard::dtype::bf16
                     : s.sync_dtype == "f16" ? fedshard::dtype::f16
                                             : fedshard::dtype::f32;
  if constexpr (std::is_same_v<schedule, fedshard::schedule::periodic>)
    o.schedule = {.period = cadence_of<A>(name) == cadence::h ? s.h : s.k};
  if constexpr (std::is_same_v<schedule, fedshard::schedule::streaming>)
    o.schedule = {.period = s.h, .fragments = s.fragments, .delay = s.delay, .alpha = 1.0f};
  if constexpr (std::is_same_v<decltype(o.shard), fedshard::shard::sparse_settings>)
    o.shard = sparse_options(s);
  const row_spec row = row_of(name);
  if (row.outer_momentum > 0.0f) {
    if constexpr (requires { o.federation.momentum; })
      o.federation.momentum = row.outer_momentum;
    else
      throw fedshard::invalid_argument(fedshard::detail::concat(
          "fedshard: demo: the row ", name, " sets an outer momentum, but its federation policy ",
          A::federation_policy::name, " has none"));
  }
  return o;
}

/// options_of, and for a row that places the model's experts (row_spec::needs_experts) under
/// holder_average, the groups that hold each unit (charlm::model::ownership: dense units
/// everywhere, expert e on expert_copies groups e, e + 1, ... mod G).
template <class A>
fedshard::trainer_options<A> row_options(const settings& s, std::string_view name,
                                         const charlm::corpus& data) {
  auto o = options_of<A>(s, name);
  if constexpr (std::is_same_v<typename A::federation_policy, fedshard::federation::holder_average>)
    if (row_of(name).needs_experts)
      o.federation.owners =
          charlm::model(dims_of(s, data), s.seed).ownership(s.groups, expert_copies(s));
  return o;
}

/// items (", "-separated) wrapped at 90 columns, the first line starting at `column`,
/// continuation lines indented by 2.
inline std::string listed(const std::string& items, std::size_t column) {
  std::string out;
  std::size_t at = 0;
  while (at < items.size()) {
    std::size_t next = items.find(", ", at);
    next = next == std::string::npos ? items.size() : next + 2;
    std::string word = items.substr(at, next - at);
    if (column + word.size() > 90 + (next < items.size() ? 1 : 0) && !out.empty()) {
      while (!out.empty() && out.back() == ' ') out.pop_back();
      out += "\n  ";
      column = 2;
    }
    out += word;
    column += word.size();
    at = next;
  }
  return out;
}

/// The catalogue's aliases whose row satisfies `pred`, ", "-separated.
template <class Pred>
std::string row_names(Pred pred) {
  std::string out;
  fedshard::for_each_algorithm([&]<class A>(std::string_view alias) {
    if (pred(row_of(alias))) out += (out.empty() ? "" : ", ") + std::string(alias);
  });
  return out;
}

/// The catalogue's aliases the demo syncs every K (cadence::k) or every H (cadence::h).
inline std::string synced_every(cadence every) {
  std::string out;
  fedshard::for_each_algorithm([&]<class A>(std::string_view alias) {
    if (A::federation_policy::syncs && cadence_of<A>(alias) == every)
      out += (out.empty() ? "" : ", ") + std::string(alias);
  });
  return out;
}

/// The catalogue's aliases whose shard policy runs SCAPE (its settings are shard::sparse's).
inline std::string sparse_rows() {
  std::string out;
  fedshard::for_each_algorithm([&]<class A>(std::string_view alias) {
    if (std::is_same_v<fedshard::shard::settings_of_t<typename A::shard_policy>,
                       fedshard::shard::sparse_settings>)
      out += (out.empty() ? "" : ", ") + std::string(alias);
  });
  return out;
}

/// The rows the demo runs unless --algorithms says otherwise, comma-separated.
inline std::string default_algorithms() {
  std::string out;
  for (const auto& a : settings{}.algorithms) out += (out.empty() ? "" : ",") + a;
  return out;
}

/// The --help text of the demo's options (fedshard-demo, fedshard-sim --predict-demo).
inline std::string usage_text(std::string_view program = "fedshard-demo") {
  return std::string("usage: ") + std::string(program) +
         " [--corpus PATH] [--steps N | --token-budget N] [--time-budget S]\n"
         "       [--batch N] [--hidden N]\n"
         "       [--model mlp|attention] [--experts X] [--expert-hidden F] [--expert-copies C]\n"
         "       [--ranks N] [--groups G] [--group-shapes RxS,RxS,...]\n"
         "       [--slow-site S] [--slow-factor F]\n"
         "       [--eval-every N] [--eval-examples N]\n"
         "       [--bandwidth-gbit G] [--latency-ms MS] [--lr LR] [--seed S] [--out DIR]\n"
         "       [--k K] [--h H] [--fragments P] [--delay T] [--sync-dtype f32|bf16|f16]\n"
         "       [--scape-density D] [--scape-refresh P] [--scape-dense-steps N]\n"
         "       [--scape-dense-every N] [--scape-per-tensor 0|1] [--scape-dense-below N]\n"
         "       [--algorithms " +
         default_algorithms() +
         "]\n"
         "  algorithms (fedshard::for_each_algorithm): " +
         listed(fedshard::algorithm_list(", "), 46) +
         "\n"
         "  rows that need --experts (expert e on the --expert-copies groups e, e + 1, ...\n"
         "  mod G, averaged over them only; default copies G - 1, at least 1): " +
         listed(row_names([](const row_spec& r) { return r.needs_experts; }), 70) +
         "\n"
         "  --model: mlp (charlm's k-gram MLP, default) or attention (causal attention over\n"
         "  sequences of up to 256 characters, skewed lengths; --batch counts sequences);\n"
         "  rows that need --model attention (each group's batch spread over its ranks): " +
         listed(row_names([](const row_spec& r) { return r.needs_attention; }), 79) +
         "\n"
         "  --steps N (default 480) or --token-budget N: every row trains the same tokens;\n"
         "  --time-budget S: every row trains S seconds (rank 0's training time, evaluation\n"
         "  not counted; the last step may run past S), at most --steps steps if given;\n"
         "  the table reports the steps and tokens each row reached\n"
         "  --k: steps between syncs of " +
         listed(synced_every(cadence::k), 30) +
         " (default 8)\n"
         "  --h: inner steps of " +
         listed(synced_every(cadence::h), 22) +
         " (default 16)\n"
         "  --fragments, --delay: streaming's fragments (default 2) and overlap in steps\n"
         "  (default 1)\n"
         "  --sync-dtype: the dtype the federated rows' averages travel and combine in (summed\n"
         "  in f32, rounded once; default f32); rows whose policy cannot are skipped\n"
         "  SCAPE (shard::sparse) in the rows " +
         listed(sparse_rows(), 36) +
         ":\n"
         "  --scape-density (default 0.05), --scape-refresh (steps between masks, default 1),\n"
         "  --scape-dense-steps (dense steps before the first mask, default 1),\n"
         "  --scape-dense-every (every N-th step dense, default 0: none), --scape-per-tensor\n"
         "  (1: each tensor's part of a shard gets its own top fraction, default 1),\n"
         "  --scape-dense-below (tensors of fewer elements always in the mask, default 2048:\n"
         "  the embedding table and the biases; 0: none)\n"
         "  --experts X: a mixture-of-experts layer of X experts, top-1 routing (default 0:\n"
         "  none); --expert-hidden F: each expert's width (default: --hidden)\n"
         "  --ranks N: in-process ranks (default 8); --groups G: groups of the federated\n"
         "  algorithms, one emulated site each (default 2); every row runs on these G sites\n"
         "  --group-shapes 2x2,1x2: the federated rows' groups of different sizes (replicas x\n"
         "  shards each, one site each; sets --ranks and --groups); rows whose policy cannot\n"
         "  sync such groups are skipped\n"
         "  --slow-site S: site S's link is --slow-factor times slower (default 10; bandwidth\n"
         "  / F, latency x F); a pair of sites talks at the slower of its two links\n"
         "  --hidden and --expert-hidden at most 4096, --ranks at most 256, --batch at most\n"
         "  4096, --eval-examples at most 65536. A bad value (out of its range, not a number,\n"
         "  an unknown option or algorithm) is refused with a message and exit status 2\n"
         "  before anything runs.\n";
}

/// Upper limits of the demo's settings (larger values are refused): a charlm of width 4096
/// has 17.7 M parameters, about 3 GB of training state over 8 ranks; more ranks than 256
/// threads, or wider batches, would not run in any reasonable time on one machine.
inline constexpr int max_hidden = 4096;
inline constexpr int max_ranks = 256;
inline constexpr int max_batch = 4096;
inline constexpr int max_eval_examples = 65536;
inline constexpr int max_experts = 64;
inline constexpr int max_steps = 10'000'000;

/// True when `name` is a row the demo can train: an alias of fedshard::for_each_algorithm.
inline bool known_algorithm(std::string_view name) {
  return fedshard::is_algorithm_name(name);
}

/// Every row name known_algorithm accepts, comma-separated (the catalogue's order).
inline std::string known_algorithms() {
  return fedshard::algorithm_list(",");
}

/// Declares the demo's options on p, writing into s.
inline void declare_options(cli::parser& p, settings& s) {
  const cli::bounds positive_time = cli::closed(0, 1e6);
  p.text("--corpus", s.corpus)
      .custom("--sync-dtype",
              [&s](const std::string& o, const std::string& v) {
                if (v != "f32" && v != "bf16" && v != "f16")
                  cli::fail(o + " expects f32, bf16 or f16, found '" + v + "'");
                s.sync_dtype = v;
              })
      .custom("--model",
              [&s](const std::string& o, const std::string& v) {
                if (v != "mlp" && v != "attention")
                  cli::fail(o + " expects mlp or attention, found '" + v + "'");
                s.model = v;
              })
      .custom("--steps",
              [&s](const std::string& o, const std::string& v) {
                s.steps = cli::parse_integer<int>(o, v, 1, max_steps);
                s.steps_given = true;
              })
      .real("--time-budget", s.time_budget, cli::above(0, 1e6))
      .integer("--token-budget", s.token_budget, 1, std::int64_t{1} << 50)
      .integer("--batch", s.batch, 1, max_batch)
      .integer("--hidden", s.hidden, 1, max_hidden)
      .integer("--experts", s.experts, 0, max_experts)
      .integer("--expert-hidden", s.expert_hidden, 1, max_hidden)
      .integer("--expert-copies", s.expert_copies, 1, max_ranks)
      .integer("--ranks", s.ranks, 1, max_ranks)
      .integer("--groups", s.groups, 1, max_ranks)
      .custom("--group-shapes",
              [&s](const std::string&, const std::string& v) {
                s.group_shapes = fedshard::parse_group_shapes(v);
              })
      .integer("--slow-site", s.slow_site, 0, max_ranks - 1)
      .real("--slow-factor", s.slow_factor, cli::closed(1, 1e6))
      .integer("--eval-every", s.eval_every, 1, max_steps)
      .integer("--eval-examples", s.eval_examples, 8, max_eval_examples)
      .real("--bandwidth-gbit", s.bandwidth_gbit, cli::closed(1e-6, 1e6))
      .real("--latency-ms", s.latency_ms, positive_time)
      .real("--lr", s.lr, cli::closed(0, 10))
      .integer("--seed", s.seed, 0, std::numeric_limits<std::uint64_t>::max())
      .text("--out", s.out)
      .integer("--k", s.k, 1, max_steps)
      .integer("--h", s.h, 1, max_steps)
      .integer("--fragments", s.fragments, 1, 1024)
      .integer("--delay", s.delay, 0, max_steps)
      .real("--scape-density", s.scape_density, cli::above(0, 1))
      .integer("--scape-refresh", s.scape_refresh, 1, max_steps)
      .integer("--scape-dense-steps", s.scape_dense_steps, 1, max_steps)
      .integer("--scape-dense-every", s.scape_dense_every, 0, max_steps)
      .custom("--scape-per-tensor",
              [&s](const std::string& o, const std::string& v) {
                s.scape_per_tensor = cli::parse_integer<int>(o, v, 0, 1) == 1;
              })
      .integer("--scape-dense-below", s.scape_dense_below, 0, std::int64_t{1} << 40)
      .custom("--algorithms", [&s](const std::string& o, const std::string& v) {
        s.algorithms = cli::parse_items(o, v);
        for (const auto& a : s.algorithms)
          if (!known_algorithm(a))
            cli::fail(o + " expects names from " + known_algorithms() + ", found '" + a + "'");
      });
}

/// The checks between settings, after every option is read.
inline void check_settings(settings& s) {
  using fedshard::detail::concat;
  if (s.token_budget > 0 && s.steps_given)
    cli::fail(concat("--token-budget ", s.token_budget, " and --steps ", s.steps,
                     " both set the tokens every row trains: expected one of them"));
  if ((s.time_budget > 0 || s.token_budget > 0) && !s.steps_given)
    s.steps = max_steps;  // a budget decides; --steps, when given, caps it
  if (!s.group_shapes.empty()) {
    s.groups = static_cast<int>(s.group_shapes.size());
    std::int64_t ranks = 0;
    for (const auto& g : s.group_shapes) ranks += std::int64_t{g.replicas} * g.shards;
    if (ranks > max_ranks)
      cli::fail(concat("--group-shapes expects at most ", max_ranks, " ranks in all, found ", ranks,
                       " in '", fedshard::to_string(s.group_shapes), "'"));
    s.ranks = static_cast<int>(ranks);
  }
  if (s.group_shapes.empty() && s.ranks % s.groups != 0)
    cli::fail(concat("--ranks ", s.ranks, " do not split into --groups ", s.groups));
  if (s.expert_copies > s.groups)
    cli::fail(
        concat("--expert-copies ", s.expert_copies, " is more than the ", s.groups, " groups"));
  if (s.slow_site >= s.groups)
    cli::fail(concat("--slow-site ", s.slow_site, " is not one of the ", s.groups,
                     " sites (0 .. groups - 1)"));
  if (s.eval_examples < s.ranks)
    cli::fail(concat("--eval-examples expects at least one example per rank (>= ", s.ranks,
                     "), found ", s.eval_examples));
  if (s.model == "attention" && (s.experts > 0 || !s.group_shapes.empty()))
    cli::fail(
        "--model attention has no experts and runs groups of one shape: expected no "
        "--experts and no --group-shapes");
  for (const auto& a : s.algorithms)
    if (row_of(a).needs_attention && s.model != "attention")
      cli::fail("--algorithms " + a +
                " spreads each group's batch of sequences over its ranks: expected --model "
                "attention, found --model " +
                s.model);
  for (const auto& a : s.algorithms)
    if (row_of(a).needs_experts && s.experts == 0)
      cli::fail("--algorithms " + a +
                " needs the model's experts: expected --experts >= 1, "
                "found 0");
}

/// The demo settings of args[first, argc); fedshard::invalid_argument naming the option for
/// a bad one (cli.hpp's rules); --help prints usage_text(program) and exits 0.
inline settings parse(int argc, char** argv, int first = 1,
                      std::string_view program = "fedshard-demo") {
  settings s;
  cli::parser p;
  declare_options(p, s);
  p.flag("--help", [program] {
     std::fputs(usage_text(program).c_str(), stdout);
     std::exit(0);
   }).alias("-h", "--help");
  p.parse(argc, argv, first);
  check_settings(s);
  return s;
}

/// Trains the alias `name` of fedshard::for_each_algorithm on its demo mesh with its demo
/// settings (row_options); nullopt for a name that is not an alias.
inline std::optional<result> train_named(const std::string& name, const settings& s,
                                         const charlm::corpus& data) {
  if (row_of(name).needs_experts && s.experts == 0)
    cli::fail("the row " + name + " needs the model's experts (--experts X)");
  if (row_of(name).needs_attention && s.model != "attention")
    cli::fail("the row " + name + " needs --model attention");
  std::optional<result> r;
  fedshard::for_each_algorithm([&]<class A>(std::string_view alias) {
    if (alias != name) return;
    const auto o = row_options<A>(s, name, data);
    if (s.model == "attention")
      r = train<A>(name, mesh_of(name, s), s,
                   attention_kit{.data = &data,
                                 .batch = s.batch,
                                 .eval_examples = s.eval_examples,
                                 .seed = s.seed,
                                 .context = o.context_axis},
                   o);
    else
      r = train<A>(name, mesh_of(name, s), s,
                   mlp_kit{.data = &data,
                           .dims = dims_of(s, data),
                           .batch = s.batch,
                           .eval_examples = s.eval_examples,
                           .seed = s.seed},
                   o);
  });
  return r;
}

}  // namespace demo
