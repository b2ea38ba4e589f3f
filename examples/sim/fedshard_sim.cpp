// fedshard-sim: prices a training schedule before it runs. The step plan of the algorithm's
// shard policy and the per-fragment sync plans of its federation (the plans the trainer
// executes), at the cadence its schedule gives, are placed on a modelled cluster; the tool
// prints tokens/s per GPU, the step time split into compute and exposed communication per
// axis, and the bytes per axis. Every alias of fedshard::for_each_algorithm is priced from
// its name with run-time settings (K, fragments, delay, alpha). --sweep writes a CSV over K,
// groups and inter-group bandwidth (plot it with plot_sweep.py); --paper reproduces the
// 512-GPU setting of the FL+FSDP paper. An alias whose steps run different plans by its
// settings (shard::sparse: scape_fsdp, fl_scape_fsdp) is priced over a run of its step kinds
// (sim::price_named takes that path from the catalogue entry's type), beside its dense alias.
//
// Options are parsed strictly (common/cli.hpp) and the cluster they make is checked
// (sim::cluster::check): a bad value exits 2 with one line on stderr before anything is
// priced; a failure while running exits 1.
#include <fedshard/sim/calibrate.hpp>
#include <fedshard/sim/failures.hpp>
#include <fedshard/sim/hetero.hpp>
#include <fedshard/sim/price.hpp>
#include <fedshard/sim/run.hpp>
#include <fedshard/sim/sparse.hpp>

#include "common/cli.hpp"
#include "multi_job_check.hpp"
#include "predict_demo.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace {

using namespace fedshard;
using namespace fedshard::sim;

constexpr double paper_speedup = 8.04;  // PAPERS.md section 1: "up to 8.04x faster data processing"

/// items joined by ", ", wrapped at 92 columns, continuation lines indented by 24.
std::string wrapped(const std::vector<std::string>& items, std::size_t first_column) {
  std::string out;
  std::size_t column = first_column;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const std::string item = items[i] + (i + 1 < items.size() ? "," : "");
    if (i > 0 && column + 1 + item.size() > 92) {
      out += "\n" + std::string(24, ' ');
      column = 24;
    } else if (i > 0) {
      out += ' ';
      ++column;
    }
    out += item;
    column += item.size();
  }
  return out;
}

/// The --help text, with the algorithms of fedshard::for_each_algorithm and their defaults.
std::string usage() {
  std::vector<std::string> names, hybrid, periods, varying;
  for (const auto& n : algorithm_names()) {
    const algorithm_desc a = algorithm_by_name(n);
    names.push_back(n);
    if (a.shard_policy() == shard::hybrid_shard::name) hybrid.push_back(n);
    if (a.steps_vary())
      varying.push_back(
          n + (dense_counterpart(n).empty() ? "" : " (beside " + dense_counterpart(n) + ")"));
    if (a.syncs()) {
      char k[64];
      std::snprintf(k, sizeof k, "%s %g", n.c_str(), a.cadence().period());
      periods.push_back(k);
    }
  }
  return R"(usage: fedshard-sim [options]

What to train
  --model NAME          llama3.1-8b (default), llama3-70b, gpt2-124m, or custom:
  --layers L --d-model D --heads H --kv-heads KV --ffn F --vocab V [--plain-mlp] [--tied]
  --micro-batch B       sequences per GPU per step (default 2)
  --seq T               tokens per sequence (default 2048)
  --mfu X               achieved fraction of peak FLOP/s (default: the cluster's, cited)
  --seconds-per-token X measured compute seconds per token per GPU; replaces the FLOP model
                        (FLOPs / (peak x MFU))
  --recompute           activation recomputation (8N instead of 6N FLOPs per token)

Where
  --cluster NAME        a100-4gpu-node (default; Leonardo Booster), h100-8gpu-node
  --gpus W              world size (default 512)
  --node-gbps X         override the network bandwidth of a node, Gb/s (all NICs together)
  --nvlink-gbs X        override the NVLink bus bandwidth per GPU, GB/s
  --sites N             split the world (so the federation groups) into N contiguous sites
                        joined by a WAN
  --wan-gbps X          WAN uplink of a site, Gb/s (default 100, illustrative)
  --wan-latency-ms X    WAN latency per ring step, ms (default 10, illustrative)
  --oversubscription LEVEL=F
                        fabric contention: divide the bandwidth of LEVEL (nvlink, network or
                        wan) by F (default 1); repeatable
  --straggler-cv X      per-rank step compute varies with this coefficient of variation
                        (e.g. 0.05): each collective waits for its slowest member, each sync
                        for the slowest group (default 0: off)

How
  --algo NAME           the algorithm (default fsdp), one of
                        )" +
         wrapped(names, 24) + R"(
                        SCAPE (shard::sparse) runs dense, masked and mask-exchange steps: its
                        aliases are priced over --scape-steps steps, beside their dense alias:
                        )" +
         wrapped(varying, 24) + R"(
  --scape-density D     SCAPE: fraction of each shard in the mask, in (0, 1] (default 0.1)
  --scape-refresh N     SCAPE: steps between two mask refreshes (default 1)
  --scape-dense-steps N SCAPE: dense steps before the first mask (default 1)
  --scape-dense-every N SCAPE: every N-th step is dense (default 0: none)
  --scape-steps N       SCAPE: steps of the priced run (default 1000)
  --groups G            federation groups, for algorithms that federate (default 1)
  --hsdp S              shards per replica (default: GPUs per node), for algorithms whose
                        shard policy is hybrid_shard: )" +
         wrapped(hybrid, 54) + R"(
  --mesh GxRxS          the mesh itself (overrides --groups and --hsdp)
  --group-shapes RxS,RxS,...
                        groups of different shapes (replicas x shards each, e.g. 2x4,1x2;
                        each group a site): prices one sync of --algo (an averaging one:
                        fl_fsdp, fl_hsdp, fl_hsdp_int8, diloco, streaming_diloco) from the
                        overlapping ranges each rank exchanges, rank by rank
  --K K                 inner steps between syncs: K of a periodic schedule, H of a streaming
                        one; ignored by algorithms that do not federate (default: the
                        algorithm's own: )" +
         wrapped(periods, 42) + R"()
  --fragments P         streaming: fragments synced separately, each once per H steps
                        (default 2)
  --delay T             streaming: steps a fragment's sync stays in flight, overlapping
                        compute; T < floor(H / P) (default 0)
  --alpha A             streaming: mixing factor in (0, 1] (default 1; no effect on the price)
  --sync MODE           hierarchical (default) or reference (replica 0 syncs, then broadcasts)
  --param-dtype T       bf16 (default), f16 or f32 on the wire for parameters
  --reduce-dtype T      bf16 (default) or f32 for gradient reductions
  --collectives A       best (default), ring, tree or hierarchical
  --overlap M           how a step's ops overlap its compute: timeline (default: the engine's
                        order unit by unit, each op when its trigger fires, on one channel per
                        rank) or channel (every overlappable op behind the whole compute:
                        max(compute, comm))
  --sync-dtype T        f32, bf16 or f16: what the federation's averages travel and combine
                        in (the trainer's precision.sync; summed in f32, half of f32's
                        bytes). Default f32, bf16 under --paper. Refused for a federation
                        that averages nothing in it (codecs, robust means, gossip); ignored
                        by algorithms that do not federate
  --zo-units LIST       units trained zeroth-order (HO-FL), e.g. embed,layer0 (the model's
                        units: embed, layer0..layer<L-1>, head): no backward for them, 2P
                        forward passes and loss means per step, their records (a count and
                        K P x 24 B per group) sent at a sync instead of their parameters
  --zo-lower N          the model's N lowest units zeroth-order too (hofl's default: 2)
  --zo-probes P         probes per zeroth-order step (default 1)
  --zo-as-params        sync the zeroth-order units as parameters, not as records
  --soup-pool M         a local soup of M members per group (LSS, 1..16): (M + 1) master shards
                        held, its passes and distance sum each step
  --soup-no-diversity   the soup's diversity coefficient is 0 (no distance sum)

Modes
  --predict-demo [demo options] [--rounds R] [--fail-above X]
                        calibrate a `local` cluster on this machine, then predict and measure
                        fedshard-demo's algorithms side by side (the options after it are
                        fedshard-demo's: --steps, --algorithms, --bandwidth-gbit, ...), each
                        trained in R runs of steps / R (default 4) in alternating order; exit
                        1 when the worst predicted/measured ratio exceeds X or the bytes a run
                        moved differ from its plans
  --paper               the paper's 512-GPU reproduction table (Llama-3.1-8B, 128 x 4 A100)
  --failures            effective training time under failures: checkpoint-restart (fsdp),
                        fedshard's elastic groups (fl_fsdp) and a per-step quorum like
                        torchft's fault-tolerant HSDP (hsdp), for the paper's 512 A100 and
                        for 64 H200 (Llama-3.1-8B), and the failure rates where the winner
                        changes. --mtbf-hours H (default 50700, Llama 3's) per --mtbf-per
                        gpu|node; --detect-s (10), --restart-s (300, the whole job),
                        --group-restart-s (120), --storage-gbs (2 GB/s per node),
                        --checkpoint-every-s (default: Young's optimum), --quorum-s (0.02)
  --check-multi-job EXE [--check-tolerance X]
                        with --failures: run the multi-job example EXE (fedshard-multi-job)
                        with a group killed and restarted, and print the model's stall and
                        heal on this machine against the measured ones; exit 1 when either
                        ratio is more than X (default 0.25) from 1
  --sweep               CSV over --sweep-k, --sweep-groups and --sweep-gbps, for --algo
                        (default: fl_fsdp and fl_hsdp); --csv FILE (default: stdout)
  --sweep-k LIST        e.g. 1,2,4,8,16,32,64 (default)
  --sweep-groups LIST   e.g. 1,2,4,...,128 (default: powers of two that fit)
  --sweep-gbps LIST     inter-group bandwidth in Gb/s: the WAN uplink with --sites > 1, else
                        the node network (default 25,50,100,200,400,800,1600)

Measured constants
  --calibrate FILE      fit latency and busbw per collective, ranks and level from FILE
                        (repeatable): Google Benchmark JSON of bench_collectives (*.json),
                        bench_collectives_mpi's CSV, or nccl-tests' output (kind from its
                        header or file name, ranks and level from its rank lines); prints the
                        fit with residuals, then prices with the measured constants where
                        they cover a collective's kind and level
  --calibrate-level L   intra, inter or wan: the level of the --calibrate files that follow
  --calibrate-ranks N   the ranks of the nccl-tests --calibrate files that follow
  --calibrate-kind K    all_reduce, all_gather, reduce_scatter or broadcast: the collective
                        of the nccl-tests --calibrate files that follow
  --calibrate-points    print the residual of every point (default: fits of <= 16 points)
)";
}

struct options {
  workload work{llama31_8b(), 2, 2048, 0, false};
  cluster where = a100_4gpu_node();
  int gpus = 512;
  std::string algo = "fsdp";
  bool algo_given = false;
  int groups = 1;
  int hsdp = 0;
  std::optional<mesh_shape> mesh;
  std::vector<group_shape> group_shapes;  ///< --group-shapes: a heterogeneous mesh's sync
  std::optional<int> k;                   ///< unset: each algorithm's own
  std::optional<int> fragments, delay;
  std::optional<float> alpha;
  federation::sync_mode sync = federation::sync_mode::hierarchical;
  /// --sync-dtype: of the federation's average (algorithm_settings); unset: f32, and bf16
  /// under --paper (the paper's mixed precision)
  std::optional<dtype> sync_dtype;
  local_rule_desc local{};  ///< --zo-*, --soup-*: the groups' local rule
  price_options pricing{};
  bool paper = false;
  bool failures = false;          ///< --failures
  failure_settings failure{};     ///< --mtbf-hours, --detect-s, ...
  std::string check_multi_job;    ///< --check-multi-job: the example's path
  double check_tolerance = 0.25;  ///< --check-tolerance
  bool sweep = false;
  std::string csv;
  std::vector<int> sweep_k{1, 2, 4, 8, 16, 32, 64};
  std::vector<int> sweep_groups;
  std::vector<double> sweep_gbps{25, 50, 100, 200, 400, 800, 1600};
  std::vector<std::pair<std::string, measurement_overrides>> calibrate;  ///< --calibrate files
  bool calibrate_points = false;
  shard::sparse_settings scape{};  ///< --scape-*: shard::sparse's settings
  int scape_steps = 1000;
};

[[noreturn]] void fail(const std::string& msg) {
  cli::fail(msg + " (see --help)");
}

/// Upper limits of the settings (larger values are refused): a world of 2^20 GPUs, 2^16 of
/// them on a heterogeneous mesh (priced rank by rank), sync periods the cadence scan covers.
constexpr int max_gpus = 1 << 20;
constexpr int max_hetero_ranks = 1 << 16;
constexpr int max_period = static_cast<int>(max_cadence_window);
/// Bandwidths in Gb/s or GB/s: (0, 1e9].
constexpr cli::bounds bandwidth_bounds = cli::above(0, 1e9);

/// "bf16", "f16" or "f32".
dtype to_dtype(const std::string& flag, const std::string& v) {
  if (v == "bf16") return dtype::bf16;
  if (v == "f16") return dtype::f16;
  if (v == "f32") return dtype::f32;
  fail(flag + " expects bf16, f16 or f32, found '" + v + "'");
}

/// GxRxS, each in [1, max_gpus].
mesh_shape to_mesh(const std::string& flag, const std::string& v) {
  std::vector<int> d;
  std::size_t at = 0;
  for (int i = 0; i < 3; ++i) {
    const std::size_t x = i < 2 ? v.find('x', at) : v.size();
    if (x == std::string::npos) fail(flag + " expects GxRxS, e.g. 16x8x4, found '" + v + "'");
    d.push_back(cli::parse_integer<int>(flag + " (GxRxS)", v.substr(at, x - at), 1, max_gpus));
    at = x + 1;
  }
  if (std::int64_t{d[0]} * d[1] * d[2] > max_gpus)
    fail(flag + " expects at most " + std::to_string(max_gpus) + " GPUs in all, found '" + v + "'");
  return {d[0], d[1], d[2]};
}

/// The comma-separated whole numbers of v, each in [lo, hi].
std::vector<int> to_ints(const std::string& flag, const std::string& v, int lo, int hi) {
  std::vector<int> out;
  for (const auto& item : cli::parse_items(flag, v))
    out.push_back(cli::parse_integer<int>(flag, item, lo, hi));
  return out;
}

/// What to train: --model and its dimensions, the workload.
void declare_workload(cli::parser& p, options& o, bool& custom) {
  auto& m = o.work.model;
  auto dim = [&](const std::string& name, int& target, int hi) {
    p.custom(name, [&target, &custom, hi](const std::string& f, const std::string& v) {
      target = cli::parse_integer<int>(f, v, 1, hi);
      custom = true;
    });
  };
  p.custom("--model", [&m](const std::string&, const std::string& v) { m = model_preset(v); });
  dim("--layers", m.layers, 10000);
  dim("--d-model", m.d_model, 1 << 20);
  dim("--heads", m.heads, 1 << 16);
  dim("--kv-heads", m.kv_heads, 1 << 16);
  dim("--ffn", m.ffn, 1 << 24);
  dim("--vocab", m.vocab, 1 << 24);
  p.flag("--plain-mlp", [&] { custom = true, m.gated_mlp = false; })
      .flag("--tied", [&] { custom = true, m.tied_embeddings = true; })
      .integer("--micro-batch", o.work.micro_batch, 1, 1 << 20)
      .integer("--seq", o.work.seq, 1, 1 << 24)
      .real("--mfu", o.work.mfu, cli::above(0, 1))
      .flag("--recompute", o.work.recompute)
      .real("--seconds-per-token", o.work.seconds_per_token, cli::above(0, 1e6));
}

/// Settings of the cluster given on the command line, applied after --cluster.
struct cluster_overrides {
  std::optional<double> node_gbps, nvlink_gbs, wan_gbps, wan_ms;
  std::map<std::string, double> oversubscription;  ///< by level name
};

/// Where: the cluster, its links, the stragglers.
void declare_cluster(cli::parser& p, options& o, cluster_overrides& x) {
  p.custom("--cluster",
           [&o](const std::string&, const std::string& v) { o.where = cluster_preset(v); })
      .integer("--gpus", o.gpus, 1, max_gpus)
      .real("--node-gbps", x.node_gbps, bandwidth_bounds)
      .real("--nvlink-gbs", x.nvlink_gbs, bandwidth_bounds)
      .integer("--sites", o.where.sites, 1, max_gpus)
      .real("--wan-gbps", x.wan_gbps, bandwidth_bounds)
      .real("--wan-latency-ms", x.wan_ms, cli::closed(0, 1e7))
      .custom("--oversubscription",
              [&x](const std::string& f, const std::string& v) {
                const auto eq = v.find('=');
                const std::string level = v.substr(0, eq);
                if (eq == std::string::npos ||
                    (level != "nvlink" && level != "network" && level != "wan"))
                  fail(f + " expects LEVEL=F with LEVEL nvlink, network or wan, found '" + v + "'");
                x.oversubscription[level] =
                    cli::parse_real(f + " " + level + "=F", v.substr(eq + 1), cli::closed(1, 1e6));
              })
      .real("--straggler-cv", o.pricing.stragglers.cv, cli::closed(0, 1));
}

/// One of `names` (value of `flag`), as its index.
std::size_t choice(const std::string& flag, const std::string& v,
                   const std::vector<std::string>& names) {
  for (std::size_t i = 0; i < names.size(); ++i)
    if (v == names[i]) return i;
  std::string known;
  for (const auto& n : names) known += (known.empty() ? "" : " or ") + n;
  fail(flag + " expects " + known + ", found '" + v + "'");
}

/// How: the algorithm, its mesh and cadence, wire dtypes, collectives, SCAPE.
void declare_how(cli::parser& p, options& o) {
  p.custom("--algo",
           [&o](const std::string&, const std::string& v) { o.algo = v, o.algo_given = true; })
      .integer("--groups", o.groups, 1, max_gpus)
      .integer("--hsdp", o.hsdp, 1, max_gpus)
      .custom("--mesh",
              [&o](const std::string& f, const std::string& v) { o.mesh = to_mesh(f, v); })
      .custom("--group-shapes",
              [&o](const std::string&, const std::string& v) {
                o.group_shapes = parse_group_shapes(v);
              })
      .integer("--K", o.k, 1, max_period)
      .alias("-K", "--K")
      .alias("--k", "--K")
      .integer("--fragments", o.fragments, 1, 1 << 16)
      .integer("--delay", o.delay, 0, max_period)
      .real("--alpha", o.alpha, cli::above(0, 1))
      .custom("--sync",
              [&o](const std::string& f, const std::string& v) {
                o.sync = choice(f, v, {"hierarchical", "reference"}) == 0
                             ? federation::sync_mode::hierarchical
                             : federation::sync_mode::reference;
              })
      .custom("--param-dtype", [&o](const std::string& f, const std::string& v) {
        o.pricing.precision.param = to_dtype(f, v);
      });
  p.custom("--reduce-dtype",
           [&o](const std::string& f, const std::string& v) {
             o.pricing.precision.reduce = to_dtype(f, v);
           })
      .custom("--collectives",
              [&o](const std::string&, const std::string& v) {
                o.pricing.collectives = parse_collective_algorithm(v);
              })
      .custom("--overlap",
              [&o](const std::string& f, const std::string& v) {
                o.pricing.overlap = choice(f, v, {"channel", "timeline"}) == 0
                                        ? step_overlap::channel
                                        : step_overlap::timeline;
              })
      .custom("--sync-dtype",
              [&o](const std::string& f, const std::string& v) {
                constexpr dtype dtypes[] = {dtype::f32, dtype::bf16, dtype::f16};
                o.sync_dtype = dtypes[choice(f, v, {"f32", "bf16", "f16"})];
              })
      .real("--scape-density", o.scape.density, cli::above(0, 1))
      .integer("--scape-refresh", o.scape.refresh_period, 1, max_period)
      .integer("--scape-dense-steps", o.scape.dense_steps, 1, max_period)
      .integer("--scape-dense-every", o.scape.dense_every, 0, max_period)
      .integer("--scape-steps", o.scape_steps, 1, 10'000'000);
  p.custom("--zo-units",
           [&o](const std::string& f, const std::string& v) {
             o.local.zeroth_order.units.clear();
             std::stringstream in(v);
             for (std::string name; std::getline(in, name, ',');) {
               if (name.empty()) fail(f + " '" + v + "': expected unit names separated by commas");
               o.local.zeroth_order.units.push_back(name);
             }
             if (o.local.zeroth_order.units.empty()) fail(f + ": expected at least one unit name");
           })
      .integer("--zo-lower", o.local.zeroth_order.lower, 1, 1 << 20)
      .integer("--zo-probes", o.local.zeroth_order.probes, 1, 1 << 16)
      .flag("--zo-as-params", [&o] { o.local.zeroth_order.seeds_on_wire = false; })
      .integer("--soup-pool", o.local.soup.members, 1, max_soup_members)
      .flag("--soup-no-diversity", [&o] { o.local.soup.diversity = false; });
}

/// Modes (--paper, --sweep) and measured constants (--calibrate).
void declare_modes(cli::parser& p, options& o, measurement_overrides& measured_as) {
  p.flag("--paper", o.paper)
      .flag("--failures", o.failures)
      .real("--mtbf-hours", o.failure.mtbf_hours, cli::closed(1e-3, 1e12))
      .custom("--mtbf-per",
              [&o](const std::string& f, const std::string& v) {
                o.failure.per_node = choice(f, v, {"gpu", "node"}) == 1;
              })
      .real("--detect-s", o.failure.detect_s, cli::closed(0, 1e7))
      .real("--restart-s", o.failure.restart_s, cli::closed(0, 1e7))
      .real("--group-restart-s", o.failure.group_restart_s, cli::closed(0, 1e7))
      .custom("--storage-gbs",
              [&o](const std::string& f, const std::string& v) {
                o.failure.storage_bytes_per_s =
                    gbyte_per_s(cli::parse_real(f, v, cli::above(0, 1e6)));
              })
      .custom("--checkpoint-every-s",
              [&o](const std::string& f, const std::string& v) {
                o.failure.checkpoint_every_s = cli::parse_real(f, v, cli::above(0, 1e9));
              })
      .real("--quorum-s", o.failure.quorum_s, cli::closed(0, 1e4))
      .text("--check-multi-job", o.check_multi_job)
      .real("--check-tolerance", o.check_tolerance, cli::closed(0, 100))
      .flag("--sweep", o.sweep)
      .text("--csv", o.csv)
      .custom("--sweep-k", [&o](const std::string& f,
                                const std::string& v) { o.sweep_k = to_ints(f, v, 1, max_period); })
      .custom("--sweep-groups",
              [&o](const std::string& f, const std::string& v) {
                o.sweep_groups = to_ints(f, v, 1, max_gpus);
              })
      .custom("--sweep-gbps",
              [&o](const std::string& f, const std::string& v) {
                o.sweep_gbps.clear();
                for (const auto& item : cli::parse_items(f, v))
                  o.sweep_gbps.push_back(cli::parse_real(f, item, bandwidth_bounds));
              })
      .custom("--calibrate",
              [&o, &measured_as](const std::string&, const std::string& v) {
                o.calibrate.emplace_back(v, measured_as);
              })
      .custom("--calibrate-level",
              [&measured_as](const std::string&, const std::string& v) {
                measured_as.level = parse_level_kind(v);
              })
      .integer("--calibrate-ranks", measured_as.ranks, 2, max_gpus)
      .custom("--calibrate-kind",
              [&measured_as](const std::string&, const std::string& v) {
                measured_as.kind = parse_measured_kind(v);
              })
      .flag("--calibrate-points", o.calibrate_points);
}

/// The cluster overrides applied to o.where, then the checks between settings.
void finish(options& o, const cluster_overrides& x, bool custom) {
  if (custom) o.work.model.name = "custom";
  if (x.node_gbps) o.where.nic_bandwidth = gbit_per_s(*x.node_gbps) / o.where.nics_per_node;
  if (x.nvlink_gbs) o.where.intra.bandwidth = gbyte_per_s(*x.nvlink_gbs);
  if (x.wan_gbps) o.where.wan.bandwidth = gbit_per_s(*x.wan_gbps);
  if (x.wan_ms) o.where.wan.alpha = *x.wan_ms * 1e-3;
  for (const auto& [level, f] : x.oversubscription)
    (level == "nvlink"    ? o.where.intra
     : level == "network" ? o.where.inter
                          : o.where.wan)
        .oversubscription = f;
  o.work.check();   // invalid_argument naming the model's bad dimensions
  o.where.check();  // and the cluster's
  if (o.hsdp == 0) o.hsdp = o.where.gpus_per_node;
  std::int64_t hetero = 0;
  for (const auto& g : o.group_shapes) hetero += std::int64_t{g.replicas} * g.shards;
  if (hetero > max_hetero_ranks)
    fail("--group-shapes expects at most " + std::to_string(max_hetero_ranks) +
         " ranks in all, found " + std::to_string(hetero));
}

options parse(int argc, char** argv) {
  options o;
  cluster_overrides x;
  measurement_overrides measured_as;  // --calibrate-level / -ranks for the files that follow
  bool custom = false;
  cli::parser p;
  p.flag("--help", [] {
     std::fputs(usage().c_str(), stdout);
     std::exit(0);
   }).alias("-h", "--help");
  declare_workload(p, o, custom);
  declare_cluster(p, o, x);
  declare_how(p, o);
  declare_modes(p, o, measured_as);
  p.parse(argc, argv);
  finish(o, x, custom);
  if (!o.check_multi_job.empty() && !o.failures)
    fail("--check-multi-job checks --failures' model: expected --failures with it, found none");
  if (o.check_multi_job.find('\'') != std::string::npos)
    fail("--check-multi-job expects a path without a single quote, found '" + o.check_multi_job +
         "'");
  return o;
}

/// The mesh algorithm a runs on, from --groups and --hsdp: G groups when it federates (else
/// one), each of R x S ranks: replicated shards of --hsdp ranks under hybrid_shard, else one
/// replica of all the group's ranks.
mesh_shape mesh_for(const algorithm_desc& a, int gpus, int groups, int hsdp) {
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) fail(a.name() + " on " + std::to_string(gpus) + " GPUs: " + what);
  };
  const bool hybrid = a.shard_policy() == shard::hybrid_shard::name;
  const int g = a.syncs() ? groups : 1;
  need(g >= 1 && gpus % g == 0, "--groups " + std::to_string(g) + " must divide it");
  const int per_group = gpus / g;
  if (!hybrid) return {g, 1, per_group};
  need(hsdp >= 1 && per_group % hsdp == 0,
       "--hsdp " + std::to_string(hsdp) + " must divide " +
           (g == 1 ? std::string("it") : "the " + std::to_string(per_group) + " GPUs of a group"));
  return {g, per_group / hsdp, hsdp};
}

/// The settings of the command line with K = k (unset: the algorithm's own).
algorithm_settings settings_of(const options& o, std::optional<int> k) {
  return {.period = k,
          .fragments = o.fragments,
          .delay = o.delay,
          .alpha = o.alpha,
          .sync = o.sync,
          .local = o.local};
}

/// Settings with only K and the sync mode (the fixed configurations of --paper, and the fsdp
/// baseline).
algorithm_settings plain_settings(const options& o, std::optional<int> k) {
  return {.period = k, .sync = o.sync};
}

/// --sync-dtype, f32 when it is not given.
dtype sync_dtype_of(const options& o) {
  return o.sync_dtype.value_or(dtype::f32);
}

/// "f32 (master weights)", "bf16 (all-reduced, summed in f32)".
std::string sync_dtype_label(dtype d) {
  return d == dtype::f32 ? "f32 (master weights)"
                         : std::string(to_string(d)) + " (all-reduced, summed in f32)";
}

/// The alias `name` with settings s, its federation's average sent in --sync-dtype when it
/// federates.
algorithm_desc described(const options& o, const std::string& name, algorithm_settings s) {
  algorithm_desc a = algorithm_by_name(name, s);
  if (sync_dtype_of(o) == dtype::f32 || !a.syncs()) return a;
  s.sync_dtype = sync_dtype_of(o);
  return algorithm_by_name(name, s);
}

step_price run(const options& o, const algorithm_desc& a, const mesh_shape& shape,
               const cluster& c) {
  return price(a, o.work, shape, c, o.pricing);
}

std::string mesh_string(const mesh_shape& s) {
  return std::to_string(s.groups) + "x" + std::to_string(s.replicas) + "x" +
         std::to_string(s.shards);
}

/// "8", "2.5", "inf".
std::string number(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

void print_setting(const options& o, const cluster& c) {
  const auto& m = o.work.model;
  const double mfu = o.work.mfu > 0 ? o.work.mfu : c.default_mfu;
  std::printf("model    %s: %.3f B parameters, %.1f GFLOP per token at seq %d%s\n", m.name.c_str(),
              total_params(m) / 1e9, train_flops_per_token(m, o.work.seq, o.work.recompute) / 1e9,
              o.work.seq, o.work.recompute ? " (recompute)" : "");
  std::printf(
      "cluster  %s: %d GPUs = %d nodes x %d, %.0f TFLOP/s x MFU %.2f; NVLink %.0f GB/s "
      "per GPU; network %d x %.0f Gb/s = %.0f Gb/s per node",
      c.name.c_str(), o.gpus, (o.gpus + c.gpus_per_node - 1) / c.gpus_per_node, c.gpus_per_node,
      c.peak_flops / 1e12, mfu, c.intra.bandwidth / 1e9, c.nics_per_node, c.nic_bandwidth * 8 / 1e9,
      c.node_bandwidth() * 8 / 1e9);
  if (c.sites > 1)
    std::printf("; %d sites, WAN %.1f Gb/s, %.1f ms", c.sites, c.wan.bandwidth * 8 / 1e9,
                c.wan.alpha * 1e3);
  if (c.measured)
    std::printf("\nmeasured collective constants (--calibrate) replace the model for: %s",
                c.measured->summary().c_str());
  std::printf(
      "\nworkload micro-batch %d x seq %d = %.0f tokens per GPU per step; wire dtypes %s "
      "params, %s reductions, %s syncs; collectives: %s; step overlap: %s\n",
      o.work.micro_batch, o.work.seq, o.work.tokens_per_gpu(),
      std::string(to_string(o.pricing.precision.param)).c_str(),
      std::string(to_string(o.pricing.precision.reduce)).c_str(),
      sync_dtype_label(sync_dtype_of(o)).c_str(),
      std::string(to_string(o.pricing.collectives)).c_str(),
      std::string(to_string(o.pricing.overlap)).c_str());
  // Settings that are off print nothing.
  std::vector<std::string> effects;
  if (o.work.seconds_per_token > 0)
    effects.push_back("compute: measured " + number(o.work.seconds_per_token) +
                      " s per token per GPU (replaces FLOPs / (peak x MFU))");
  if (o.pricing.stragglers.active())
    effects.push_back("stragglers: cv " + number(100 * o.pricing.stragglers.cv) + "%");
  for (const auto& [name, level] : {std::pair<const char*, const link_level*>{"nvlink", &c.intra},
                                    {"network", &c.inter},
                                    {"wan", &c.wan}})
    if (level->oversubscription != 1)
      effects.push_back(std::string("oversubscription: ") + name + " " +
                        number(level->oversubscription) + "x");
  for (const auto& e : effects) std::printf("effects  %s\n", e.c_str());
}

/// True when the algorithm syncs the whole model at once and blocking (a plain K).
bool plain_k(const step_price& p) {
  return p.fragments == 1 && p.in_flight == 0;
}

void print_price(const step_price& p, const step_price* fsdp) {
  std::string cadence;
  if (p.syncs && plain_k(p))
    cadence = ", K = " + number(p.period);
  else if (p.syncs)
    cadence = ", " + std::to_string(p.fragments) + " fragments, each synced every " +
              number(p.period) + " steps, in flight " + number(p.in_flight) + " steps";
  std::printf("\n%s on mesh %s (groups x replicas x shards)%s\n", p.algorithm.c_str(),
              mesh_string(p.shape).c_str(), cadence.c_str());
  std::printf("  tokens/s per GPU     %10.1f", p.tokens_per_s_per_gpu);
  if (fsdp) std::printf("   (%.2fx fsdp)", fsdp->step / p.step);
  if (p.straggler_wait > 0)
    std::printf(
        "\n  step                 %10.4f s = compute %.4f s + stragglers %.4f s + exposed "
        "communication %.4f s\n",
        p.step, p.compute, p.straggler_wait, p.exposed_comm());
  else
    std::printf(
        "\n  step                 %10.4f s = compute %.4f s + exposed communication %.4f s\n",
        p.step, p.compute, p.exposed_comm());
  if (p.straggler_wait > 0) {
    std::printf(
        "  stragglers           %10.4f s per step: the slowest of the %d ranks each step joins "
        "(%.4f s)",
        p.straggler_wait, p.step_component, p.straggler_wait - p.straggler_sync);
    if (p.syncs && p.sync_components > 1)
      std::printf(", each sync waits for the slowest of %d groups (%.4f s per step)",
                  p.sync_components, p.straggler_sync);
    std::printf("\n");
  }
  std::printf("  overlappable comm    %10.4f s (%.4f s hidden behind compute)\n", p.overlappable,
              p.hidden);
  if (p.local.compute() > 0 || p.local.exposed_ops > 0)
    std::printf(
        "  local rule           %10.4f s of compute per step: %.4f s evaluations, %.4f s passes, "
        "%.4f s replay (%.4f s per sync); %.4f s of its ops exposed\n",
        p.local.compute(), p.local.evaluations, p.local.passes, p.local.replay_per_step,
        p.local.replay, p.local.exposed_ops);
  if (p.syncs && plain_k(p))
    std::printf("  one sync             %10.4f s, every %s steps: %.4f s per step\n", p.sync,
                number(p.period).c_str(), p.sync_per_step);
  else if (p.syncs)
    std::printf(
        "  one sync round       %10.4f s (every fragment once, every %s steps): %.4f s per "
        "step exposed, %.4f s per step hidden behind compute\n",
        p.sync, number(p.period).c_str(), p.sync_per_step, p.sync_hidden);
  std::printf("  %-11s %-8s %6s %10s %10s %12s %12s %12s %10s\n", "axis", "level", "ranks",
              "GB/step", "GB/sync", "GB/step(K)", "node GB/step", "comm s/step", "exposed s");
  for (axis a : all_axes) {
    const auto& x = p[a];
    if (x.step_calls + x.sync_calls == 0) continue;
    std::printf("  %-11s %-8s %6d %10.3f %10.3f %12.3f %12.3f %12.4f %10.4f\n",
                std::string(to_string(a)).c_str(), std::string(to_string(x.level)).c_str(), x.ranks,
                x.step_bytes / 1e9, x.sync_bytes / 1e9, x.bytes_per_step / 1e9,
                x.node_bytes_per_step / 1e9, x.step_seconds + x.sync_seconds_per_step, x.exposed);
  }
  std::printf(
      "  GB: bytes this GPU sends (the traffic counters' wire bytes); GB/step(K): syncs "
      "amortised over K;\n  node GB/step: bytes leaving its node, amortised\n");
}

/// The paper's four configurations on cluster c.
struct paper_row {
  std::string label;
  std::string algo;
  mesh_shape shape;
};

std::vector<paper_row> paper_rows() {
  return {{"fsdp", "fsdp", {1, 1, 512}},
          {"hsdp(4)", "hsdp", {1, 128, 4}},
          {"fl_fsdp (128 groups, K=8)", "fl_fsdp", {128, 1, 4}},
          {"fl_hsdp (hsdp 4, 16 groups, K=8)", "fl_hsdp", {16, 8, 4}}};
}

std::vector<step_price> paper_prices(const options& o, const cluster& c) {
  std::vector<step_price> out;
  for (const auto& r : paper_rows())
    out.push_back(run(o, described(o, r.algo, plain_settings(o, 8)), r.shape, c));
  return out;
}

double best_fl_speedup(const std::vector<step_price>& p) {
  return std::max(p[0].step / p[2].step, p[0].step / p[3].step);
}

cluster with_node_gbps(cluster c, double gbps) {
  c.nic_bandwidth = gbit_per_s(gbps) / c.nics_per_node;
  return c;
}

void what_it_would_take(const options& base, const cluster& c);
void paper_bandwidth_table(const options& o, const cluster& c);

void paper(options o) {
  o.work = workload{llama31_8b(), 2, 2048, o.work.mfu, o.work.recompute, o.work.seconds_per_token};
  o.gpus = 512;
  if (!o.sync_dtype) o.sync_dtype = dtype::bf16;  // the paper's bf16 mixed precision
  const cluster& c = o.where;
  std::printf("Reproduction of the FL+FSDP paper's setting (PAPERS.md section 1)\n");
  print_setting(o, c);
  const auto p = paper_prices(o, c);
  std::printf("\n%-34s %-9s %11s %9s %9s %9s %9s %9s %8s\n", "configuration", "mesh", "tok/s/GPU",
              "step s", "compute", "exp.shard", "exp.repl", "exp.fed", "vs fsdp");
  for (std::size_t i = 0; i < p.size(); ++i) {
    const auto& x = p[i];
    std::printf("%-34s %-9s %11.1f %9.4f %9.4f %9.4f %9.4f %9.4f %7.2fx\n",
                paper_rows()[i].label.c_str(), mesh_string(x.shape).c_str(), x.tokens_per_s_per_gpu,
                x.step, x.compute, x[axis::shard].exposed, x[axis::replica].exposed,
                x[axis::federation].exposed, p[0].step / x.step);
  }
  std::printf(
      "\nbytes each GPU sends per step by axis, and bytes leaving a node per step "
      "(GB; syncs amortised over K)\n");
  std::printf("%-34s %10s %10s %10s %12s\n", "configuration", "shard", "replica", "federation",
              "node egress");
  for (std::size_t i = 0; i < p.size(); ++i) {
    const auto& x = p[i];
    double egress = 0;
    for (axis a : all_axes) egress += x[a].node_bytes_per_step;
    std::printf("%-34s %10.3f %10.3f %10.3f %12.3f\n", paper_rows()[i].label.c_str(),
                x[axis::shard].bytes_per_step / 1e9, x[axis::replica].bytes_per_step / 1e9,
                x[axis::federation].bytes_per_step / 1e9, egress / 1e9);
  }

  const double best = best_fl_speedup(p);
  std::printf(
      "\npredicted data-processing speed-up of fl_* over fsdp: fl_fsdp %.2fx, fl_hsdp "
      "%.2fx; the paper reports up to %.2fx (gap: %.1fx)\n",
      p[0].step / p[2].step, p[0].step / p[3].step, paper_speedup, paper_speedup / best);

  std::printf(
      "fsdp's gathers and reduce-scatters take %.4f s per step (%.4f s of it latency-free "
      "transfer at best); its compute is %.4f s, so %s\n",
      p[0].overlappable,
      p[0][axis::shard].step_node_bytes * c.inter.oversubscription / c.node_bandwidth(),
      p[0].compute,
      p[0].overlappable <= p[0].compute
          ? "they hide behind it: fsdp is compute-bound here and federation cannot speed "
            "it up"
          : "part of them is exposed");

  std::printf("\nsensitivity (same model, nothing tuned):\n");
  for (double mfu : {0.3, 0.7}) {
    options m = o;
    m.work.mfu = mfu;
    const auto q = paper_prices(m, c);
    std::printf("  MFU %.1f: fl_fsdp %.2fx, fl_hsdp %.2fx\n", mfu, q[0].step / q[2].step,
                q[0].step / q[3].step);
  }
  paper_bandwidth_table(o, c);
  what_it_would_take(o, c);
}

/// The node network bandwidths at which fl_* reach the paper's speed-up over fsdp. The
/// speed-up need not fall as bandwidth grows (with a high latency per ring step, fsdp's
/// 512-rank rings pay it at any bandwidth), so a log grid of bandwidths is scanned and the
/// ends of the range that reaches it are bisected.
struct bandwidth_needed {
  bool reachable = false;
  double from_gbps = 0;    ///< nominal node bandwidth (Gb/s, all NICs): the range's low end,
  double gbps = 0;         ///< and its high end, when reachable
  bool from_zero = false;  ///< reached as the bandwidth goes to 0
  bool always = false;     ///< reached even at the grid's highest bandwidth
  double cap = 0;          ///< the highest speed-up over the grid
  double at_now = 0;       ///< speed-up at the cluster's own bandwidth
};

bandwidth_needed bandwidth_for(const options& o, const cluster& c, std::size_t row) {
  const paper_row r = paper_rows()[row];
  const algorithm_desc fsdp = algorithm_by_name("fsdp", plain_settings(o, 8));
  const algorithm_desc fl = described(o, r.algo, plain_settings(o, 8));
  auto speedup = [&](double gbps) {
    const cluster x = with_node_gbps(c, gbps);
    return run(o, fsdp, paper_rows()[0].shape, x).step / run(o, fl, r.shape, x).step;
  };
  auto reached = [&](double gbps) { return speedup(gbps) >= paper_speedup; };
  auto edge = [&](double in, double out) {  // reached(in) != reached(out): bisect to `in`'s side
    for (int it = 0; it < 14; ++it) {       // the grid's step to 1.0001x
      const double mid = std::sqrt(in * out);
      (reached(mid) ? in : out) = mid;
    }
    return in;
  };
  std::vector<double> grid;  // 1e-3 to 1e5 Gb/s, 3 points a decade
  for (int i = 0; i <= 24; ++i) grid.push_back(std::pow(10.0, -3 + i / 3.0));
  bandwidth_needed n;
  n.at_now = speedup(c.node_bandwidth() * 8 / 1e9);
  std::optional<std::size_t> first, last;
  for (std::size_t i = 0; i < grid.size(); ++i) {
    const double x = speedup(grid[i]);
    n.cap = std::max(n.cap, x);
    if (x < paper_speedup) continue;
    if (!first) first = i;
    last = i;
  }
  if (!first) return n;
  n.reachable = true;
  n.from_zero = *first == 0;
  n.always = *last + 1 == grid.size();
  n.from_gbps = n.from_zero ? 0 : edge(grid[*first], grid[*first - 1]);
  n.gbps = n.always ? grid.back() : edge(grid[*last], grid[*last + 1]);
  return n;
}

cluster with_latency(cluster c, double seconds) {
  c.inter.alpha = seconds;
  return c;
}

/// Where fl_* reach the paper's speed-up, in effective Gb/s per node: "<= 12.7 Gb/s",
/// ">= 96.0 Gb/s", "3.1 to 240.5 Gb/s", "any", "none (cap 6.00x)".
std::string needed_cell(const bandwidth_needed& n, const cluster& c) {
  const double lo = n.from_gbps / c.inter.oversubscription;
  const double hi = n.gbps / c.inter.oversubscription;
  char buf[64];
  if (!n.reachable)
    std::snprintf(buf, sizeof buf, "none (cap %.2fx)", n.cap);
  else if (n.from_zero && n.always)
    std::snprintf(buf, sizeof buf, "any");
  else if (n.from_zero)
    std::snprintf(buf, sizeof buf, "<= %.1f Gb/s", hi);
  else if (n.always)
    std::snprintf(buf, sizeof buf, ">= %.1f Gb/s", lo);
  else
    std::snprintf(buf, sizeof buf, "%.1f to %.1f Gb/s", lo, hi);
  return buf;
}

/// --paper's bandwidth table: the speed-up of fl_fsdp and fl_hsdp over fsdp against the node
/// network's bandwidth (25 to 800 Gb/s) and its latency per ring step, the bandwidth at which
/// each reaches the paper's speed-up, and the summary line `paper: fl_fsdp reaches ...`.
void paper_bandwidth_table(const options& o, const cluster& c) {
  const double nccl = c.inter.alpha;
  const double latencies[] = {nccl, 10 * nccl, 100 * nccl};
  std::printf(
      "\nspeed-up over fsdp by node network bandwidth and latency (%s syncs, %s reductions; "
      "latency: seconds per ring step between nodes, %.1f us is NCCL's)\n",
      std::string(to_string(sync_dtype_of(o))).c_str(),
      std::string(to_string(o.pricing.precision.reduce)).c_str(), nccl * 1e6);
  std::printf("%-19s", "latency");
  for (double l : latencies) std::printf(" | %11.1f us per step", l * 1e6);
  std::printf("\n%-19s", "node Gb/s");
  for (std::size_t i = 0; i < std::size(latencies); ++i)
    std::printf(" | %12s %12s", "fl_fsdp", "fl_hsdp");
  std::printf("\n");
  for (double gbps : {25.0, 50.0, 100.0, 200.0, 400.0, 800.0}) {
    std::printf("%-19.0f", gbps);
    for (double l : latencies) {
      const auto q = paper_prices(o, with_latency(with_node_gbps(c, gbps), l));
      std::printf(" | %11.2fx %11.2fx", q[0].step / q[2].step, q[0].step / q[3].step);
    }
    std::printf("\n");
  }
  bandwidth_needed n;  // fl_fsdp's at NCCL's latency
  for (std::size_t row : {std::size_t{2}, std::size_t{3}}) {
    std::printf("%-19s", row == 2 ? "fl_fsdp 8.04x needs" : "fl_hsdp 8.04x needs");
    for (double l : latencies) {
      const cluster x = with_latency(c, l);
      const bandwidth_needed needs = bandwidth_for(o, x, row);
      if (row == 2 && l == nccl) n = needs;
      std::printf(" | %25s", needed_cell(needs, x).c_str());
    }
    std::printf("\n");
  }
  if (n.reachable)
    std::printf("paper: fl_fsdp reaches %.2fx at %s per node (%.1f us per ring step)\n",
                paper_speedup, needed_cell(n, c).c_str(), nccl * 1e6);
  else
    std::printf(
        "paper: fl_fsdp cap %.2fx: its highest from 0.001 to 100000 Gb/s per node; as the "
        "network goes to 0, the bytes leaving a node (fsdp's gathers and reduce-scatters against "
        "fl_fsdp's %s syncs) bound it\n",
        n.cap, std::string(to_string(sync_dtype_of(o))).c_str());
}

/// --paper's "what it would take" table: for sync dtype f32 and bf16, stragglers off and on
/// (cv 5%, or --straggler-cv), the effective node network bandwidth at which fl_fsdp and
/// fl_hsdp reach the paper's speed-up over fsdp.
void what_it_would_take(const options& base, const cluster& c) {
  const double cv = base.pricing.stragglers.active() ? base.pricing.stragglers.cv : 0.05;
  std::printf(
      "\nwhat it would take: the effective node network bandwidth (all NICs, after any "
      "oversubscription) at which fl_* reach %.2fx over fsdp; speed-up at %.0f Gb/s "
      "in brackets\n",
      paper_speedup, c.node_bandwidth() * 8 / 1e9 / c.inter.oversubscription);
  std::printf("%-10s | %-10s | %-36s | %-36s\n", "sync dtype", "stragglers", "fl_fsdp needs",
              "fl_hsdp needs");
  for (dtype d : {dtype::f32, dtype::bf16})
    for (double v : {0.0, cv}) {
      options o = base;
      o.sync_dtype = d;
      o.pricing.stragglers.cv = v;
      std::string cells[2];
      for (std::size_t i = 0; i < 2; ++i) {
        const bandwidth_needed n = bandwidth_for(o, c, 2 + i);
        char at_now[32];
        std::snprintf(at_now, sizeof at_now, " [%.2fx]", n.at_now);
        cells[i] = needed_cell(n, c) + at_now;
      }
      std::printf("%-10s | %-10s | %-36s | %-36s\n", std::string(to_string(d)).c_str(),
                  v > 0 ? ("cv " + number(100 * v) + "%").c_str() : "off", cells[0].c_str(),
                  cells[1].c_str());
    }
  std::printf(
      "  cap: the highest speed-up from 0.001 to 100000 Gb/s; at NCCL's latency it is the one "
      "as the network goes to 0, the ratio of the bytes leaving a node\n  (fsdp's gathers and "
      "reduce-scatters against fl_*'s syncs and, for fl_hsdp, "
      "its replica all-reduce);\n  stragglers only add compute-proportional time, so they do not "
      "move "
      "it.\n  bf16 syncs price the trainer's precision.sync = bf16: the federation's all-reduce "
      "moves bf16 (half of f32's bytes) and sums in f32.\n");
}

void sweep(const options& o) {
  std::vector<std::string> algos;
  if (o.algo_given)
    algos.push_back(o.algo);
  else
    algos = {"fl_fsdp", "fl_hsdp"};
  // Unknown names and settings an algorithm has no use for are refused before anything runs;
  // a K its schedule refuses (streaming: fewer steps than fragments) only skips that K.
  std::vector<algorithm_desc> descs;
  for (const auto& algo : algos) {
    descs.push_back(described(o, algo, settings_of(o, {})));
    if (descs.back().steps_vary())
      fail("--sweep prices one step per row, but " + algo +
           " runs different plans on different steps (price it without --sweep)");
  }
  const algorithm_desc fsdp = algorithm_by_name("fsdp", plain_settings(o, {}));
  std::vector<int> groups = o.sweep_groups;
  if (groups.empty())
    for (int g = 1; g <= o.gpus; g *= 2) groups.push_back(g);
  std::ofstream file;
  if (!o.csv.empty()) {
    file.open(o.csv);
    if (!file) fail("--csv expects a file it can write, found '" + o.csv + "'");
  }
  std::ostream& out = o.csv.empty() ? std::cout : file;
  out << "model,cluster,gpus,algo,groups,replicas,shards,K,inter_group_gbps,node_gbps,sites,"
         "compute_s,exposed_s,exposed_shard_s,exposed_replica_s,exposed_federation_s,"
         "exposed_group_s,exposed_world_s,sync_s,step_s,tokens_per_s_per_gpu,fsdp_step_s,"
         "speedup_vs_fsdp,bytes_shard,bytes_replica,bytes_federation,bytes_group,bytes_world,"
         "straggler_s\n";
  int rows = 0, skipped = 0, refused = 0;
  for (double gbps : o.sweep_gbps) {
    cluster c = o.where;
    if (c.sites > 1)
      c.wan.bandwidth = gbit_per_s(gbps);
    else
      c = with_node_gbps(c, gbps);
    const step_price base = run(o, fsdp, {1, 1, o.gpus}, c);
    for (const auto& desc : descs)
      for (int g : groups)
        for (int k : o.sweep_k) {
          const std::string& algo = desc.name();
          mesh_shape shape;
          try {
            shape = mesh_for(desc, o.gpus, g, o.hsdp);
          } catch (const invalid_argument&) {
            ++skipped;
            continue;
          }
          algorithm_desc a;
          try {
            a = described(o, algo, settings_of(o, k));
          } catch (const invalid_argument&) {
            ++refused;
            continue;
          }
          const step_price p = run(o, a, shape, c);
          out << o.work.model.name << ',' << c.name << ',' << o.gpus << ',' << algo << ','
              << shape.groups << ',' << shape.replicas << ',' << shape.shards << ',' << p.period
              << ',' << gbps << ',' << c.node_bandwidth() * 8 / 1e9 << ',' << c.sites << ','
              << p.compute << ',' << p.exposed_comm();
          for (axis a : all_axes) out << ',' << p[a].exposed;
          out << ',' << p.sync << ',' << p.step << ',' << p.tokens_per_s_per_gpu << ',' << base.step
              << ',' << base.step / p.step;
          for (axis a : all_axes) out << ',' << p[a].bytes_per_step;
          out << ',' << p.straggler_wait << '\n';
          ++rows;
        }
  }
  std::fprintf(stderr, "fedshard-sim: %d rows%s%s (%d combinations skipped: mesh does not fit",
               rows, o.csv.empty() ? "" : " written to ", o.csv.c_str(), skipped);
  if (refused > 0) std::fprintf(stderr, "; %d: K refused by the schedule", refused);
  std::fprintf(stderr, ")\n");
}

/// Reads and fits the --calibrate files, prints the fit and installs it in o.where.
void install_calibration(options& o) {
  std::vector<measured_point> points;
  for (const auto& [path, as] : o.calibrate) {
    auto p = read_measurements(path, as);
    points.insert(points.end(), p.begin(), p.end());
  }
  auto cal = std::make_shared<const calibration>(fit_collectives(points));
  print_calibration(std::cout, *cal, o.calibrate_points);
  std::cout << '\n' << std::flush;
  o.where.measured = std::move(cal);
}

/// fedshard-sim --predict-demo [demo options] [--rounds R] [--fail-above X]: see predict_demo.hpp.
int predict_demo_main(int argc, char** argv, int first) {
  std::vector<char*> args{argv[0]};
  std::optional<double> fail_above;
  int rounds = 4;
  for (int i = first; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--fail-above" || a == "--rounds") {
      if (i + 1 >= argc) fail(a + " expects a value, found nothing");
      if (a == "--fail-above")
        fail_above = cli::parse_real(a, argv[++i], cli::closed(1, 1e6));
      else
        rounds = cli::parse_integer<int>(a, argv[++i], 1, 1 << 20);
    } else {
      args.push_back(argv[i]);
    }
  }
  demo::settings s =
      demo::parse(static_cast<int>(args.size()), args.data(), 1, "fedshard-sim --predict-demo");
  s.quiet = true;
  if (s.ranks != 8 || s.groups != 2 || s.slow_site >= 0 || s.experts > 0 || !s.group_shapes.empty())
    fail(
        "--predict-demo models the default demo only (8 ranks on 2 sites, no slow site, no "
        "experts, groups of one shape)");
  const charlm::corpus data = charlm::corpus::load(s.corpus);
  std::printf(
      "fedshard-sim --predict-demo: fedshard-demo's runs (8 inproc ranks on 2 sites, emulated "
      "link %.3g Gbit/s, %.3g ms; %d steps x %d examples per rank) predicted on a `local` "
      "cluster calibrated on this machine, then measured\n",
      s.bandwidth_gbit, s.latency_ms, s.steps, s.batch);
  if (s.steps < rounds)
    fail("--predict-demo: --steps " + std::to_string(s.steps) + " cannot be split into " +
         std::to_string(rounds) + " rounds");
  const auto rows = predict_demo::predict_and_measure(s, data, rounds);
  const predict_demo::summary sum = predict_demo::report(rows);
  if (!sum.bytes_match) {
    std::fprintf(stderr, "fedshard-sim: a run moved other bytes than its plans say\n");
    return 1;
  }
  if (fail_above && sum.worst > *fail_above) {
    std::fprintf(stderr, "fedshard-sim: worst predicted/measured ratio %.2f exceeds %.2f\n",
                 sum.worst, *fail_above);
    return 1;
  }
  return 0;
}

}  // namespace

/// --group-shapes: one sync of the algorithm on a heterogeneous mesh, priced from its
/// overlap exchanges (sim/hetero.hpp), each group a site.
void price_group_shapes(const options& o) {
  if (sync_dtype_of(o) != dtype::f32)
    fail(
        "--group-shapes: groups of different shapes average in f32 (their overlap exchanges), "
        "found --sync-dtype " +
        std::string(to_string(sync_dtype_of(o))) + "; expected f32");
  const algorithm_desc a = described(o, o.algo, settings_of(o, o.k));
  const std::string_view policy = a.federation_policy();
  if (!a.syncs() || !(policy == "average" || policy == "weighted_average" || policy == "nesterov"))
    fail("--group-shapes: " + o.algo + " (federation policy " + std::string(policy) +
         ") cannot sync groups of different shapes: expected an averaging policy without a "
         "codec (average, weighted_average, an outer Nesterov step)");
  cluster c = o.where;
  c.sites = static_cast<int>(o.group_shapes.size());
  const auto units = transformer_units(o.work.model, dtype::bf16);
  const hetero_sync_price p =
      price_hetero_sync(units, o.group_shapes, c, policy == "weighted_average");
  std::printf("model    %s; cluster %s, each group a site: WAN %.1f Gb/s, %.1f ms\n",
              o.work.model.name.c_str(), c.name.c_str(), c.wan.bandwidth * 8 / 1e9,
              c.wan.alpha * 1e3);
  std::printf(
      "mesh     groups %s (replicas x shards), %zu ranks; %s syncs f32 shards: replica 0 of "
      "each group all-reduces each range its shard shares with the other groups' shards, then "
      "broadcasts to its replicas\n",
      to_string(o.group_shapes).c_str(), p.seconds.size(), o.algo.c_str());
  std::printf("one sync %.3f s (slowest rank); %d holder sets (sub-communicators, split once)\n\n",
              p.sync_seconds, p.member_sets);
  std::printf(
      "| group | R x S | federation MB per replica-0 rank | ops per rank | replica MB | "
      "sync s |\n|---:|---|---:|---:|---:|---:|\n");
  const auto at = fedshard::detail::group_starts(o.group_shapes);
  for (std::size_t g = 0; g < o.group_shapes.size(); ++g) {
    const auto first = static_cast<std::size_t>(at[g]);
    double secs = 0;
    int ops = 0;
    for (auto r = first; r < static_cast<std::size_t>(at[g + 1]); ++r) {
      secs = std::max(secs, p.seconds[r]);
      ops = std::max(ops, p.ops[r]);
    }
    std::printf("| %zu | %dx%d | %.1f | %d | %.1f | %.3f |\n", g, o.group_shapes[g].replicas,
                o.group_shapes[g].shards, p.group_federation_bytes(static_cast<int>(g)) / 1e6, ops,
                p.replica_bytes[first] / 1e6, secs);
  }
}

/// The step kinds of a priced run of `name` (shard::sparse) on `shape`, one line each.
void print_kinds(const options& o, const std::string& name, const mesh_shape& shape,
                 const sparse_run_price& p) {
  std::size_t k = 0;
  for (std::size_t x : p.masked) k += x;
  std::printf(
      "\n%s on mesh %s: density %g (k = %zu of a rank's %zu elements), mask refreshed every %d "
      "steps, %d dense steps first%s; a run of %lld steps\n",
      name.c_str(), mesh_string(shape).c_str(), o.scape.density, k, p.shard_numel,
      o.scape.refresh_period, o.scape.dense_steps,
      o.scape.dense_every > 0
          ? (", every " + std::to_string(o.scape.dense_every) + "th step dense").c_str()
          : "",
      static_cast<long long>(p.steps));
  std::printf("  %-44s %7s %10s %12s %12s\n", "step kind", "steps", "step s", "shard GB",
              "exposed s");
  for (const auto& kp : p.kinds) {
    const std::string kind = std::string(kp.kind.packed_gathers ? "packed" : "dense") +
                             " gathers, " + (kp.kind.packed_reductions ? "packed" : "dense") +
                             " reductions" + (kp.kind.mask_exchange ? " + mask" : "");
    std::printf("  %-44s %7lld %10.4f %12.4f %12.4f\n", kind.c_str(),
                static_cast<long long>(kp.count), kp.price.step,
                kp.price[axis::shard].step_bytes / 1e9, kp.price.exposed_comm());
  }
  std::printf("  mask exchange        %10.4f GB per refresh (%lld in the run)\n",
              p.mask_wire_bytes / 1e9, static_cast<long long>(p.mask_exchanges));
}

/// A run of alias a, whose steps vary (shard::sparse), priced over its step kinds
/// (sim::price_named) beside its dense alias (sim::dense_counterpart) on the same mesh.
void print_run(options o, const algorithm_desc& a) {
  const std::string& name = a.name();
  const std::string base = dense_counterpart(name);
  const mesh_shape shape = o.mesh ? *o.mesh : mesh_for(a, o.gpus, o.groups, o.hsdp);
  if (shape.size() != o.gpus) o.gpus = shape.size();
  o.scape.check();  // invalid_argument naming the bad setting
  (void)placement(shape, o.where);
  run_settings rs{.algorithm = settings_of(o, o.k), .sparse = o.scape, .steps = o.scape_steps};
  rs.algorithm.sync_dtype = sync_dtype_of(o);
  const run_price r = price_named(name, rs, o.work, shape, o.where, o.pricing);
  FEDSHARD_EXPECTS(r.over_run.has_value(), "fedshard-sim: ", name, " was priced as one step");
  print_setting(o, o.where);
  print_kinds(o, name, shape, *r.over_run);
  std::printf("\n  %-16s %12s %14s %16s %10s\n", "", "step s", "tokens/s/GPU", "shard GB/step",
              "speed-up");
  std::optional<step_price> d;
  if (!base.empty()) {
    d = run(o, algorithm_by_name(base, plain_settings(o, o.k)), shape, o.where);
    std::printf("  %-16s %12.4f %14.1f %16.4f %10s\n", base.c_str(), d->step,
                d->tokens_per_s_per_gpu, (*d)[axis::shard].bytes_per_step / 1e9, "1.00x");
  }
  char speed[32] = "";
  if (d) std::snprintf(speed, sizeof speed, "%.2fx", d->step / r.step);
  std::printf("  %-16s %12.4f %14.1f %16.4f %10s\n", name.c_str(), r.step, r.tokens_per_s_per_gpu,
              r.bytes(axis::shard) / 1e9, speed);
  std::printf(
      "  mean over the run; bytes this GPU sends (syncs amortised). Not modelled: the mask's "
      "top-k,\n  the pack/unpack ops and the masked optimizer step (host memory only)\n");
}

/// fedshard-sim's modes, after their settings are checked.
/// One recovery scheme on one configuration: the algorithm it runs, priced, and the scheme.
struct failure_row {
  std::string algo;
  mesh_shape shape;
  scheme_price (*scheme)(const failing_job&, const failure_settings&);
};

/// The failing_job of algorithm `algo` on `shape` of cluster c, priced without failures:
/// 12 bytes of state per parameter (f32 weights and AdamW's two moments) over the shard
/// degree; the groups (or replicas) drop out alone; heals arrive at a node's network rate.
failing_job job_of(const options& o, const cluster& c, const failure_row& r, double* tokens) {
  const algorithm_desc a = described(o, r.algo, plain_settings(o, 8));
  const step_price p = run(o, a, r.shape, c);
  *tokens = p.tokens_per_s_per_gpu;
  return {.gpus = r.shape.size(),
          .gpus_per_node = c.gpus_per_node,
          .step_s = p.step,
          .state_bytes_per_gpu = 12.0 * total_params(o.work.model) / r.shape.shards,
          .groups = r.shape.groups > 1 ? r.shape.groups : r.shape.replicas,
          .steps_per_sync = static_cast<int>(std::lround(p.period)),
          .heal_bytes_per_s = c.node_bandwidth() / c.inter.oversubscription,
          .heal_latency_s = c.inter.alpha};
}

/// The effective tokens/s per GPU of each row at MTBF `mtbf_hours`.
std::vector<double> effective_rates(const options& o, const cluster& c,
                                    const std::vector<failure_row>& rows, double mtbf_hours) {
  failure_settings f = o.failure;
  f.mtbf_hours = mtbf_hours;
  std::vector<double> out;
  for (const auto& r : rows) {
    double tokens = 0;
    const failing_job j = job_of(o, c, r, &tokens);
    out.push_back(tokens * r.scheme(j, f).effective);
  }
  return out;
}

/// The row with the highest effective rate; `none` when no row trains at all.
constexpr std::size_t none = static_cast<std::size_t>(-1);
std::size_t best_of(const std::vector<double>& x) {
  const auto it = std::max_element(x.begin(), x.end());
  return *it > 0 ? static_cast<std::size_t>(it - x.begin()) : none;
}

/// --failures on one cluster: the three schemes at --mtbf-hours, then their effective
/// tokens/s over MTBFs from 10 to 10^7 hours and where the winner changes.
void failures_on(const options& o, const cluster& c, const std::vector<failure_row>& rows) {
  const failure_settings& f = o.failure;
  std::printf("\n%s, %d GPUs, %s; MTBF %g h per %s\n", c.name.c_str(), rows[0].shape.size(),
              o.work.model.name.c_str(), f.mtbf_hours, f.per_node ? "node" : "GPU");
  std::printf("%-19s %-18s %8s %10s %8s %11s %9s %10s %12s  %s\n", "scheme", "runs", "step s",
              "tok/s/GPU", "fails/h", "lost/fail s", "overhead", "effective", "eff tok/s/GPU",
              "recovery");
  for (const auto& r : rows) {
    double tokens = 0;
    const failing_job j = job_of(o, c, r, &tokens);
    const scheme_price p = r.scheme(j, f);
    char recovery[96];
    if (p.checkpoint_every_s > 0)
      std::snprintf(recovery, sizeof recovery, "save %.1f s every %.0f s", p.checkpoint_s,
                    p.checkpoint_every_s);
    else
      std::snprintf(recovery, sizeof recovery, "heal %.2f s, %d groups", p.heal_s, j.groups);
    std::printf("%-19s %-18s %8.4f %10.1f %8.3f %11.1f %8.3f%% %9.3f%% %12.1f  %s\n",
                p.scheme.c_str(), (r.algo + " " + mesh_string(r.shape)).c_str(), j.step_s, tokens,
                p.failures_per_hour, p.lost_per_failure_s, 100 * p.overhead, 100 * p.effective,
                tokens * p.effective, recovery);
  }
  std::printf("effective tok/s/GPU by MTBF per %s (hours):\n%-10s", f.per_node ? "node" : "GPU",
              "MTBF h");
  for (const auto& r : rows) std::printf(" %18s", r.algo.c_str());
  std::printf("  best\n");
  for (double h : {10.0, 100.0, 1e3, 1e4, 5.07e4, 1e5, 1e6, 1e7}) {
    const auto x = effective_rates(o, c, rows, h);
    std::printf("%-10g", h);
    for (double v : x) std::printf(" %18.1f", v);
    std::printf("  %s\n", best_of(x) == none ? "none" : rows[best_of(x)].algo.c_str());
  }
  // Where the winner changes: a log grid, 8 points a decade, each change bisected.
  auto name = [&](std::size_t w) { return w == none ? std::string("none") : rows[w].algo; };
  double lo = 1.0;
  std::size_t winner = best_of(effective_rates(o, c, rows, lo));
  int changes = 0;
  for (int i = 1; i <= 56; ++i) {
    const double hi = std::pow(10.0, i / 8.0);
    const std::size_t w = best_of(effective_rates(o, c, rows, hi));
    if (w != winner) {
      double a = lo, b = hi;
      for (int it = 0; it < 30; ++it) {
        const double mid = std::sqrt(a * b);
        (best_of(effective_rates(o, c, rows, mid)) == winner ? a : b) = mid;
      }
      if (winner == none)
        std::printf(
            "below MTBF %.4g h per %s no scheme trains (first order: a recovery outlasts "
            "the time between failures); above it %s leads\n",
            b, f.per_node ? "node" : "GPU", name(w).c_str());
      else
        std::printf("crossover: at MTBF %.4g h per %s, %s overtakes %s\n", b,
                    f.per_node ? "node" : "GPU", name(w).c_str(), name(winner).c_str());
      winner = w;
      changes += winner != none;
    }
    lo = hi;
  }
  if (changes == 0)
    std::printf("crossover: none from 1 to 10^7 h; %s leads throughout\n", name(winner).c_str());
}

void failures(options o) {
  o.work = workload{llama31_8b(), 2, 2048, o.work.mfu, o.work.recompute, o.work.seconds_per_token};
  if (!o.sync_dtype) o.sync_dtype = dtype::bf16;  // the paper's bf16 mixed precision
  o.failure.check();
  std::printf(
      "Failures priced (sim/failures.hpp): detect %g s, whole-job restart %g s, group restart "
      "%g s, storage %g GB/s per node, quorum %g s per step; state 12 B per parameter\n",
      o.failure.detect_s, o.failure.restart_s, o.failure.group_restart_s,
      o.failure.storage_bytes_per_s / 1e9, o.failure.quorum_s);
  const cluster a100 = o.where.name == "a100-4gpu-node" ? o.where : a100_4gpu_node();
  failures_on(o, a100,
              {{"fsdp", {1, 1, 512}, &checkpoint_restart},
               {"fl_fsdp", {128, 1, 4}, &elastic_groups},
               {"hsdp", {1, 128, 4}, &per_step_quorum}});
  failures_on(o, h200_8gpu_node(),
              {{"fsdp", {1, 1, 64}, &checkpoint_restart},
               {"fl_fsdp", {8, 1, 8}, &elastic_groups},
               {"hsdp", {1, 8, 8}, &per_step_quorum}});
}

int run_sim(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::string_view(argv[i]) == "--predict-demo") return predict_demo_main(argc, argv, i + 1);
  options o = parse(argc, argv);
  if (!o.calibrate.empty()) install_calibration(o);
  if (o.paper) {
    paper(o);
    return 0;
  }
  if (o.failures) {
    failures(o);
    if (o.check_multi_job.empty()) return 0;
    std::printf("\n");
    const double off = multi_job_check::check(o.check_multi_job);
    if (off <= o.check_tolerance) return 0;
    std::printf("a predicted/measured ratio is %.2f from 1, more than --check-tolerance %g\n", off,
                o.check_tolerance);
    return 1;
  }
  if (o.sweep) {
    sweep(o);
    return 0;
  }
  if (!o.group_shapes.empty()) {
    price_group_shapes(o);
    return 0;
  }
  const algorithm_desc a = described(o, o.algo, settings_of(o, o.k));
  if (a.steps_vary()) {
    print_run(o, a);
    return 0;
  }
  const mesh_shape shape = o.mesh ? *o.mesh : mesh_for(a, o.gpus, o.groups, o.hsdp);
  if (shape.size() != o.gpus) o.gpus = shape.size();
  (void)placement(shape, o.where);  // the mesh on the cluster (sites), before any output
  print_setting(o, o.where);
  const step_price p = run(o, a, shape, o.where);
  std::optional<step_price> base;
  if (o.algo != "fsdp")
    base = run(o, algorithm_by_name("fsdp", plain_settings(o, {})), {1, 1, shape.size()}, o.where);
  print_price(p, base ? &*base : nullptr);
  if (o.local.active()) {
    const local_memory m = local_memory_of(a, transformer_units(o.work.model, dtype::bf16), shape,
                                           o.pricing.precision);
    std::printf(
        "  local rule memory    %+10.4f GB per GPU: %.4f GB zeroth-order copy, %.4f GB soup "
        "pool, %.4f GB of gradient buffers saved\n",
        m.added() / 1e9, m.zeroth_order_copy / 1e9, m.soup_pool / 1e9, m.gradient_saved / 1e9);
  }
  return 0;
}

int main(int argc, char** argv) {
  return cli::run_main("fedshard-sim", [&] { return run_sim(argc, argv); });
}
