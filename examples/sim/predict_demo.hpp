#pragma once
// fedshard-sim --predict-demo: the simulator predicts the demo (examples/demo) on this machine
// and measures it in the same invocation, side by side.
//
// The `local` cluster is calibrated here, before anything is predicted:
//  - compute: 8 threads (the demo's ranks) each train charlm on a 1 x 1 x 1 mesh of their
//    own, no communication, the demo's step loop and batch; a step is the world's, barrier
//    to barrier. The ranks share the machine's cores: when a rank's step is shorter than a
//    scheduler slice they run one after another, and the world's step is about 8 / cores
//    times a rank's own. Every collective waits for its slowest member, so that is the
//    compute each rank sees (the straggler model is not applied on top of it). The
//    optimizer's share is then moved to each mesh's shard size by timing AdamW alone on
//    both sizes (8 threads at once);
//  - inproc collectives: every (kind, ranks) that a demo plan runs inside a site, timed with
//    8 threads split into communicators of that size all running it at once (as a plan's op
//    runs on every communicator of its axis), issued as the interpreter issues them (async,
//    on the communicator's progress thread, then waited for), over sizes spanning the plans'
//    arrays, fitted by sim::fit_collectives (latency + bus bytes / bus bandwidth);
//  - the emulated cross-site link: latency and bandwidth from the demo's flags
//    (--latency-ms, --bandwidth-gbit), per collective as shaped::communicator charges them;
//  - codec passes: the memory bandwidth one of 8 threads copying at once gets;
//  - chains are host-driven (sim::cluster::host_driven): inproc and shaped requests move a
//    chain on only when the rank enters the interpreter.
// Nothing is taken from the runs being predicted. Each algorithm is then priced from its
// plans (sim::describe with the demo's own trainer options, the charlm units, the demo's
// mesh), and trained with fedshard-demo's code; the table shows both, the bytes the run moved
// against the plans' bytes, and the last line the worst ratio and whether the order agrees
// (pairs measured within the run-to-run noise count as agreeing either way: see report).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <typeinfo>
#include <utility>
#include <vector>

#include "demo/demo_run.hpp"
#include "fedshard/sim/calibrate.hpp"
#include "fedshard/sim/price.hpp"
#include "local_timing.hpp"

namespace predict_demo {

namespace sim = fedshard::sim;

/// What the local cluster is calibrated from.
struct local_calibration {
  /// Seconds of a world step of 8 independent 1x1x1 trainers (the policy's), barrier to barrier.
  double step_1x1x1 = 0;
  std::map<std::size_t, double> adamw;      ///< seconds of an AdamW step by elements per rank
  std::vector<sim::measured_point> points;  ///< inproc collectives
  double memory_bandwidth = 0;              ///< bytes/s one of 8 copying threads gets

  /// Compute seconds of a step when each rank's optimizer updates `elements`.
  double compute(std::size_t elements, std::size_t full) const {
    return step_1x1x1 - adamw.at(full) + adamw.at(elements);
  }
};

/// One algorithm of the demo, described for the simulator exactly as the demo trains it.
struct entry {
  std::string name;
  fedshard::mesh_shape shape;
  sim::algorithm_desc desc;
  fedshard::shard::precision precision;
  /// Seconds of a step of 8 ranks training alone on 1x1x1 meshes with the algorithm's shard
  /// policy, over n steps (time_local_steps).
  std::function<alone_timing(int n)> time_alone;
  /// The timed policy's type (compute_policy): rows of one type share their compute timings.
  std::string compute_key;
};

/// The shard policy whose compute a row's is timed as: a wrapper's base policy
/// (with_gather_codec: on a 1x1x1 mesh it would encode and decode the whole model, while
/// the simulator prices its codec passes from the plan).
template <class P>
struct compute_policy {
  using type = P;
};
template <class P>
requires requires {
  typename P::base_policy;
}
struct compute_policy<P> {
  using type = typename compute_policy<typename P::base_policy>::type;
};

/// Appends the row `name` of algorithm A, described with the demo's options for it.
template <class A>
void add(std::vector<entry>& out, const demo::settings& s, const charlm::corpus& data,
         const std::string& name) {
  const fedshard::trainer_options<A> o = demo::options_of<A>(s, name);
  sim::algorithm_options<A> ao;
  ao.federation = o.federation;
  ao.schedule = o.schedule;
  ao.inner_state_buffers = 2;  // AdamW
  using timed = typename compute_policy<typename A::shard_policy>::type;
  out.push_back({name, demo::mesh_of(name), sim::describe<A>(name, ao), o.precision,
                 [&s, &data](int n) { return time_local_steps<timed>(s, data, n); },
                 typeid(timed).name()});
}

inline std::vector<entry> entries(const demo::settings& s, const charlm::corpus& data) {
  std::vector<entry> out;
  for (const auto& name : s.algorithms) {
    bool known = false;
    fedshard::for_each_algorithm([&]<class A>(std::string_view alias) {
      if (alias != name) return;
      known = true;
      if constexpr (sim::steps_vary_v<A>) {
        cli::fail("--predict-demo --algorithms: " + name +
                  " runs different plans on different steps, and the prediction prices one step "
                  "plan per row (fedshard-sim --algo " +
                  name + " prices a run of it)");
      } else {
        add<A>(out, s, data, name);
      }
    });
    if (!known)
      cli::fail("--predict-demo --algorithms: expected names from " + fedshard::algorithm_list() +
                ", found '" + name + "'");
  }
  return out;
}

/// Every op of e's plans: the step plan's and each rank's sync plans'.
inline std::vector<fedshard::comm_op> plan_ops(const entry& e,
                                               const std::vector<fedshard::unit_spec>& units) {
  const fedshard::flat_layout layout = e.desc.layout(units, e.shape);
  std::vector<fedshard::comm_op> ops = e.desc.step_plan(layout, e.shape, e.precision).ops;
  if (e.desc.syncs())
    for (int r = 0; r < e.shape.size(); ++r)
      for (const auto& p : e.desc.sync_plans(layout, e.shape, r))
        ops.insert(ops.end(), p.ops.begin(), p.ops.end());
  return ops;
}

/// The (kind, ranks) of every op the entries' plans run: the rank threads copy and reduce
/// each of them (those across the sites, too, while the link carries their bytes).
inline std::set<std::pair<comm_kind, int>> collective_ops(
    const std::vector<entry>& es, const std::vector<fedshard::unit_spec>& units) {
  std::set<std::pair<comm_kind, int>> out;
  for (const auto& e : es) {
    for (const auto& op : plan_ops(e, units)) {
      if (op.ranks <= 1 || op.kind == comm_kind::send_recv) continue;
      out.insert({fedshard::carried(op).kind, op.ranks});
    }
  }
  return out;
}

/// The local cluster: 2 sites of one 4-rank "node" each, joined by the emulated link.
inline sim::cluster local_cluster(const demo::settings& s, const local_calibration& cal,
                                  std::shared_ptr<const sim::calibration> fitted) {
  sim::cluster c;
  c.name = "local";
  c.gpus_per_node = world_size / sites;
  c.nics_per_node = 1;
  c.sites = sites;
  c.wan = {s.latency_ms * 1e-3, s.bandwidth_gbit * 1e9 / 8};
  c.wan.pipelined_latency = true;  // shaped::communicator: collectives overlap their latencies
  c.intra.on_compute = true;       // inproc: the rank threads copy and reduce themselves
  c.host_driven = true;            // inproc and shaped: chains move on when the rank drives them
  // The fits of `fitted` price every op inside a node (calibrate covers each (kind, ranks) the
  // plans run); the model's own figure, should one be missing, is the rate a copying thread
  // gets.
  c.intra.bandwidth = cal.memory_bandwidth;
  c.nic_bandwidth = c.wan.bandwidth;
  c.memory_bandwidth = cal.memory_bandwidth;
  c.measured = std::move(fitted);
  return c;
}

/// One row of the table.
struct row {
  std::string name;
  fedshard::mesh_shape shape;
  sim::step_price price;
  double predicted = 0;  ///< tokens/s, all ranks
  double measured = 0;   ///< tokens/s, all ranks
  /// The measurement's standard error relative to it: the rounds' rates' standard deviation
  /// / sqrt(rounds) / their mean (0 with one round).
  double noise = 0;
  bool bytes_match = false;
};

/// sd(x) / sqrt(n) / mean(x), the sample standard deviation over n values (0 for n < 2).
inline double relative_standard_error(const std::vector<double>& x) {
  const auto n = static_cast<double>(x.size());
  if (x.size() < 2) return 0;
  double mean = 0;
  for (double v : x) mean += v / n;
  double var = 0;
  for (double v : x) var += (v - mean) * (v - mean) / (n - 1);
  return std::sqrt(var / n) / mean;
}

/// True when rows a and b measured within the run-to-run noise of each other: their
/// difference is at most two standard errors of the difference.
inline bool within_noise(const row& a, const row& b) {
  const double se_a = a.noise * a.measured, se_b = b.noise * b.measured;
  return std::abs(a.measured - b.measured) <= 2 * std::sqrt(se_a * se_a + se_b * se_b);
}

/// max(r, 1/r) of predicted / measured.
inline double off_by(const row& r) {
  const double x = r.predicted / r.measured;
  return std::max(x, 1.0 / x);
}

/// The names ordered by tokens/s, fastest first, by `rate`.
template <class F>
std::vector<std::string> order_by(std::vector<row> rows, F rate) {
  std::stable_sort(rows.begin(), rows.end(),
                   [&](const row& a, const row& b) { return rate(a) > rate(b); });
  std::vector<std::string> out;
  for (const auto& r : rows) out.push_back(r.name);
  return out;
}

inline std::string mesh_string(const fedshard::mesh_shape& s) {
  return std::to_string(s.groups) + "x" + std::to_string(s.replicas) + "x" +
         std::to_string(s.shards);
}

/// Calibrates, predicts and measures the demo with settings s; prints the table and the
/// summary line; returns the rows.
inline std::vector<row> predict_and_measure(const demo::settings& s, const charlm::corpus& data,
                                            int rounds) {
  const std::vector<entry> es = entries(s, data);
  const charlm::dims dims{data.vocab(), 8, 16, s.hidden};
  const std::vector<fedshard::unit_spec> units = charlm::model(dims, s.seed).units();
  const fedshard::flat_layout whole(units, 1);
  auto elements_of = [](const fedshard::flat_layout& l) {
    std::size_t n = 0;
    for (std::size_t u = 0; u < l.num_units(); ++u) n += l.unit(u).shard_numel;
    return n;
  };
  const std::size_t full = elements_of(whole);

  std::printf("calibrating the local cluster (nothing below is taken from the runs it predicts)\n");
  std::fflush(stdout);
  local_calibration cal;
  constexpr int compute_steps = 16;
  const alone_timing first = es.front().time_alone(compute_steps);
  cal.step_1x1x1 = first.step;
  std::map<std::string, std::size_t> shard_elements;
  cal.adamw[full] = time_adamw(full, 40);
  for (const auto& e : es) {
    const std::size_t n = elements_of(e.desc.layout(units, e.shape));
    shard_elements[e.name] = n;
    if (!cal.adamw.count(n)) cal.adamw[n] = time_adamw(n, 40);
  }
  cal.memory_bandwidth = time_memory_bandwidth();
  std::printf(
      "  compute: %.2f ms per step of 8 ranks training alone, barrier to barrier (a rank's own "
      "step %.2f ms; 1x1x1, %s, %d examples each; timed again around each run), AdamW %.2f ms "
      "over %zu elements; %u cores for 8 ranks\n",
      cal.step_1x1x1 * 1e3, first.rank * 1e3, std::string(es.front().desc.shard_policy()).c_str(),
      s.batch, cal.adamw[full] * 1e3, full, std::thread::hardware_concurrency());
  std::printf("  memory bandwidth per rank (8 copying at once): %.2f GB/s\n",
              cal.memory_bandwidth / 1e9);

  const sim::cluster probe = local_cluster(s, cal, nullptr);
  for (const auto& [kind, n] : collective_ops(es, units))
    for (std::int64_t bytes = std::int64_t{2} << 10; bytes <= std::int64_t{2} << 20; bytes *= 4) {
      const int iters =
          static_cast<int>(std::clamp<std::int64_t>((std::int64_t{8} << 20) / bytes, 5, 300));
      cal.points.push_back({kind, n, sim::level_kind::intra, static_cast<double>(bytes),
                            time_collective(kind, n, bytes, iters), "inproc"});
    }
  sim::calibration fitted = sim::fit_collectives(cal.points);
  // Every op a plan runs across the sites waits for the emulated link: its latency once and
  // the op's bus bytes at its bandwidth, as shaped::communicator charges them.
  std::set<std::pair<comm_kind, int>> crossing;
  for (const auto& e : es)
    for (const auto& op : plan_ops(e, units))
      if (op.ranks > 1 &&
          sim::placement(e.shape, probe).span(op.axis, 0).level() == sim::level_kind::wan)
        crossing.insert({fedshard::carried(op).kind, op.ranks});
  for (const auto& [kind, n] : crossing) {
    sim::fitted_collective f;
    f.kind = kind;
    f.ranks = n;
    f.level = sim::level_kind::wan;
    f.latency = probe.wan.alpha;
    f.bus_bandwidth = probe.wan.bandwidth;
    fitted.collectives.push_back(f);
  }
  std::printf(
      "\nfitted inproc collectives (8 ranks busy, split into communicators of n), and "
      "the emulated link (from the flags):\n");
  sim::print_calibration(std::cout, fitted);
  std::cout.flush();
  const sim::cluster c = local_cluster(s, cal, std::make_shared<const sim::calibration>(fitted));

  // The machine is shared and its speed drifts over seconds to minutes: every algorithm is
  // trained in `rounds` runs of steps / rounds steps, the rounds going through the list
  // forwards and backwards in turn, so that each samples the drift alike. The compute alone
  // is timed right before and right after each run (never from the run); an algorithm's C
  // is the mean of every timing of its shard policy, so algorithms on one policy are priced
  // on the same compute and differ only by what the simulator says of their communication.
  // The rounds' rates also measure the run-to-run noise (report).
  demo::settings per_round = s;
  per_round.steps = s.steps / rounds;
  per_round.eval_every = per_round.steps;
  std::printf(
      "\ntraining %zu algorithms in %d rounds of %d steps, the compute alone timed "
      "around each run\n",
      es.size(), rounds, per_round.steps);
  std::fflush(stdout);
  std::vector<row> rows;
  std::vector<double> tokens(es.size()), seconds(es.size());
  std::vector<std::vector<double>> rates(es.size());  // tokens/s of each round
  std::vector<bool> bytes_match(es.size(), true);
  struct policy_timing {
    double step = 0;  // sum
    int n = 0;
  };
  std::map<std::string, policy_timing> alone;  // by entry::compute_key
  for (int round = 0; round < rounds; ++round)
    for (std::size_t k = 0; k < es.size(); ++k) {
      const std::size_t i = round % 2 == 0 ? k : es.size() - 1 - k;
      const entry& e = es[i];
      const alone_timing before = e.time_alone(compute_steps);
      const demo::result run = *demo::train_named(e.name, per_round, data);
      const alone_timing after = e.time_alone(compute_steps);
      policy_timing& pt = alone[e.compute_key];
      pt.step += before.step + after.step;
      pt.n += 2;
      tokens[i] += run.tokens;
      seconds[i] += run.seconds;
      rates[i].push_back(run.tokens / run.seconds);
      // The calls and bytes rank 0 made on each axis in its training steps against what
      // the plans say it makes in a run of this many steps.
      const fedshard::traffic_counters planned = sim::run_traffic(
          e.desc, units, e.shape, 0, per_round.steps, per_round.steps, e.precision);
      for (fedshard::axis a : fedshard::all_axes)
        bytes_match[i] = bytes_match[i] && planned[a].calls == run.step_traffic.at(a).calls &&
                         planned[a].payload_bytes == run.step_traffic.at(a).payload_bytes;
      std::printf(
          "  round %d %-13s %7.0f tokens/s; %s alone %.2f ms per step (a rank's own %.2f) "
          "before, %.2f ms (%.2f) after\n",
          round + 1, e.name.c_str(), run.tokens / run.seconds,
          std::string(e.desc.shard_policy()).c_str(), before.step * 1e3, before.rank * 1e3,
          after.step * 1e3, after.rank * 1e3);
      std::fflush(stdout);
    }
  for (std::size_t i = 0; i < es.size(); ++i) {
    const entry& e = es[i];
    row r;
    r.name = e.name;
    r.shape = e.shape;
    const policy_timing& pt = alone.at(e.compute_key);
    cal.step_1x1x1 = pt.step / pt.n;
    sim::price_options po;
    po.precision = e.precision;
    po.overlap = sim::step_overlap::timeline;
    // No straggler model: the world's step measured alone already ends with its slowest rank
    // (the file comment).
    r.price = sim::price_plans(e.desc, units, e.shape, c,
                               cal.compute(shard_elements.at(e.name), full), s.batch, po);
    r.predicted = world_size * s.batch / r.price.step;
    r.measured = tokens[i] / seconds[i];
    r.noise = relative_standard_error(rates[i]);
    r.bytes_match = bytes_match[i];
    rows.push_back(std::move(r));
  }
  return rows;
}

/// What the table says: the worst ratio and whether the orders agree.
struct summary {
  double worst = 1;  ///< max over rows of max(r, 1/r), r = predicted / measured
  /// Every pair of rows in the same order, predicted and measured, or measured within the
  /// run-to-run noise of each other (within_noise).
  bool order_matches = false;
  bool bytes_match = true;
};

/// Prints the rows as a table and the summary line; returns the summary.
inline summary report(const std::vector<row>& rows) {
  summary out;
  std::printf(
      "\n| algorithm | mesh G x R x S | predicted tokens/s | measured tokens/s | noise | "
      "predicted / measured | predicted step ms = compute + stragglers + exposed comm | bytes "
      "= plans |\n");
  std::printf("|---|---|---:|---:|---:|---:|---|---|\n");
  for (const auto& r : rows) {
    std::printf("| %s | %s | %.0f | %.0f | %.1f%% | %.2f | %.2f = %.2f + %.2f + %.2f | %s |\n",
                r.name.c_str(), mesh_string(r.shape).c_str(), r.predicted, r.measured,
                100 * r.noise, r.predicted / r.measured, r.price.step * 1e3, r.price.compute * 1e3,
                r.price.straggler_wait * 1e3, r.price.exposed_comm() * 1e3,
                r.bytes_match ? "yes" : "NO");
    out.worst = std::max(out.worst, off_by(r));
    out.bytes_match = out.bytes_match && r.bytes_match;
  }
  const auto predicted = order_by(rows, [](const row& r) { return r.predicted; });
  const auto measured = order_by(rows, [](const row& r) { return r.measured; });
  auto joined = [](const std::vector<std::string>& v) {
    std::string j;
    for (const auto& n : v) j += (j.empty() ? "" : " > ") + n;
    return j;
  };
  std::printf("\npredicted order: %s\nmeasured order:  %s\n", joined(predicted).c_str(),
              joined(measured).c_str());
  // Which pairs the two orders disagree on, by how much the measurements differ there, and
  // whether that is within the noise.
  int pairs = 0, agree = 0, noisy = 0;
  std::string flipped;
  for (std::size_t i = 0; i < rows.size(); ++i)
    for (std::size_t j = i + 1; j < rows.size(); ++j) {
      ++pairs;
      const row& a = rows[i];
      const row& b = rows[j];
      if ((a.predicted > b.predicted) == (a.measured > b.measured)) {
        ++agree;
        continue;
      }
      const bool noise = within_noise(a, b);
      noisy += noise ? 1 : 0;
      char buf[160];
      std::snprintf(buf, sizeof buf, "%s%s/%s (measured %.1f%% apart, %s the noise)",
                    flipped.empty() ? "" : ", ", a.name.c_str(), b.name.c_str(),
                    100 * std::abs(a.measured - b.measured) / std::min(a.measured, b.measured),
                    noise ? "within" : "beyond");
      flipped += buf;
    }
  out.order_matches = agree + noisy == pairs;
  std::printf(
      "noise: the standard error of each measured rate over the rounds (column noise); a pair "
      "measured within two standard errors of their difference counts as in order either way\n");
  std::printf("pairs in the same order: %d of %d%s%s\n", agree, pairs,
              flipped.empty() ? "" : "; the others: ", flipped.c_str());
  std::printf("predict-demo: worst predicted/measured ratio %.2f, order matches: %s\n", out.worst,
              out.order_matches ? "yes" : "no");
  return out;
}

}  // namespace predict_demo
