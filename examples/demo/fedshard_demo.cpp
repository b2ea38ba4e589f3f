// fedshard-demo: FL+HSDP against HSDP (and DDP, FSDP, FL+FSDP, DiLoCo, SparseLoCo, FL+HSDP
// with int8 gathers) on a character-level language model, 8 in-process ranks on 2 emulated
// sites joined by a slow link.
//
// Every algorithm trains the same model on the same number of tokens (--steps,
// --token-budget), or for the same training time (--time-budget). Collectives whose
// members span both sites wait latency + cross-site bytes / bandwidth (shaped::communicator;
// the link is emulated, the training is real). The output is a table of steps, tokens, tokens/s,
// eval perplexity, bytes per rank on each mesh axis and time in communication, and CSV curves of
// eval perplexity against time and tokens (examples/plot_curves.py renders them).
//
// Bad input (an option out of its range or not a number, an unknown option or algorithm, an
// --out that cannot be written, a corpus that cannot be read) is refused before any training
// with one line on stderr and exit status 2 (common/cli.hpp); a failure while running exits 1.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "common/cli.hpp"
#include "demo/demo_run.hpp"

namespace {

using demo::result;

std::string human_bytes(double b) {
  char buf[32];
  if (b >= 1e9)
    std::snprintf(buf, sizeof buf, "%.2f GB", b / 1e9);
  else if (b >= 1e6)
    std::snprintf(buf, sizeof buf, "%.2f MB", b / 1e6);
  else if (b >= 1e3)
    std::snprintf(buf, sizeof buf, "%.1f kB", b / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.0f B", b);
  return buf;
}

/// "480 steps", "the steps that reach 1000000 tokens", "20 s of training each (at most 480
/// steps)".
std::string budget_text(const demo::settings& s) {
  std::ostringstream out;
  if (s.time_budget > 0) {
    out << s.time_budget << " s of training each";
    if (s.token_budget > 0) out << " (at most " << s.token_budget << " tokens)";
    if (s.steps_given) out << " (at most " << s.steps << " steps)";
  } else if (s.token_budget > 0) {
    out << "the steps that reach " << s.token_budget << " tokens";
  } else {
    out << s.steps << " steps";
  }
  return out.str();
}

/// The demo: every check of its input (options, --out, the corpus) before any training.
int run(int argc, char** argv) {
  const demo::settings s = demo::parse(argc, argv);
  cli::check_writable_dir("--out", s.out);
  charlm::corpus data;
  try {
    data = charlm::corpus::load(s.corpus);
  } catch (const fedshard::invalid_argument& e) {
    cli::fail(std::string("--corpus: ") + e.what());
  }
  std::printf("fedshard-demo: %zu characters of %s (alphabet %d), %d inproc ranks on %d sites\n",
              data.ids.size(), s.corpus.c_str(), data.vocab(), s.ranks, s.groups);
  std::printf(
      "The link between the sites is EMULATED: %.3g Gbit/s, %.3g ms latency per "
      "cross-site collective.\n",
      s.bandwidth_gbit, s.latency_ms);
  if (s.slow_site >= 0)
    std::printf(
        "Site %d sits behind a link %.3g x slower (%.3g Gbit/s, %.3g ms); a pair of sites talks "
        "at the slower of its two links.\n",
        s.slow_site, s.slow_factor, s.bandwidth_gbit / s.slow_factor, s.latency_ms * s.slow_factor);
  if (s.experts > 0) {
    const charlm::model m(demo::dims_of(s, data));
    std::printf(
        "Model with a mixture of %d experts (top-1, width %d); fomoe's placement over %d "
        "groups:",
        s.experts, m.sizes().expert_hidden, s.groups);
    const auto owners = m.ownership(s.groups, demo::expert_copies(s));
    for (int e = 0; e < s.experts; ++e) {
      std::printf(" expert%d -> group", e);
      for (int g = 0; g < s.groups; ++g)
        if (owners.holds(g, m.unit_of_expert(e))) std::printf(" %d", g);
    }
    std::printf(" (--expert-copies)\n");
  }
  if (s.model == "attention")
    std::printf(
        "Model: causal self-attention over sequences of up to %d characters (charlm::"
        "attention_model); fcp spreads each group's batch over its ranks by FCP's placement.\n",
        demo::attention_kit::max_length);
  std::printf(
      "%s x %d %s per rank per step; AdamW lr %g; fl_* and sparseloco sync every "
      "%d steps, diloco every %d%s%s.\n\n",
      budget_text(s).c_str(), s.batch, s.model == "attention" ? "sequences" : "examples",
      double(s.lr), s.k, s.h, s.sync_dtype == "f32" ? "" : "; averages in ",
      s.sync_dtype == "f32" ? "" : s.sync_dtype.c_str());

  std::vector<result> results;
  for (const auto& a : s.algorithms) {
    std::printf("%s\n", a.c_str());
    std::optional<result> r;
    try {
      r = demo::train_named(a, s, data);
    } catch (const fedshard::invalid_argument& e) {  // a policy refusing --group-shapes or
      if (s.group_shapes.empty() && s.sync_dtype == "f32") throw;  // --sync-dtype
      std::printf("  skipped: %s\n", e.what());
      continue;
    }
    if (!r) cli::fail("--algorithms: unknown algorithm '" + a + "'");
    results.push_back(std::move(*r));
  }

  double hsdp_rate = 0;
  for (const auto& r : results)
    if (r.name == "hsdp") hsdp_rate = r.tokens / r.seconds;
  std::printf(
      "\n| algorithm | mesh G x R x S | steps | tokens | tokens/s | eval ppl | shard B/rank "
      "(gathers) | replica B/rank | federation B/rank | group B/rank | cross-site B/rank | "
      "comm s | speed-up vs hsdp |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const auto& r : results) {
    const double rate = r.tokens / r.seconds;
    char mesh[64];
    std::snprintf(mesh, sizeof mesh, "%dx%dx%d", r.shape.groups, r.shape.replicas, r.shape.shards);
    const std::string mesh_text = r.group_shapes.empty() ? mesh : "groups " + r.group_shapes;
    char speed[32] = "n/a";
    if (hsdp_rate > 0) std::snprintf(speed, sizeof speed, "%.2fx", rate / hsdp_rate);
    std::printf("| %s | %s | %d | %.0f | %.0f | %.3f | %s (%s) | %s | %s | %s | %s | %.1f | %s |\n",
                r.name.c_str(), mesh_text.c_str(), r.steps, r.tokens, rate, r.ppl,
                human_bytes(r.bytes.at(fedshard::axis::shard)).c_str(),
                human_bytes(r.gather).c_str(),
                human_bytes(r.bytes.at(fedshard::axis::replica)).c_str(),
                human_bytes(r.bytes.at(fedshard::axis::federation)).c_str(),
                human_bytes(r.bytes.at(fedshard::axis::group)).c_str(),
                human_bytes(r.cross_site).c_str(), r.comm_seconds, speed);
  }

  const auto csv = std::filesystem::path(s.out) / "curves.csv";
  std::ofstream f(csv);
  f << "algorithm,step,tokens,seconds,eval_ppl\n";
  for (const auto& r : results)
    for (const auto& p : r.curve)
      f << r.name << "," << p.step << "," << p.tokens << "," << p.seconds << "," << p.ppl << "\n";
  if (!f.flush())  // writable when checked up front, so a failure while running: exit 1
    throw fedshard::backend_error("cannot write " + csv.string());
  std::printf("\nCurves written to %s (render: python3 examples/plot_curves.py %s)\n",
              csv.string().c_str(), csv.string().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return cli::run_main("fedshard-demo", [&] { return run(argc, argv); });
}
