/// A chaos soak of the elastic federation (comm/elastic.hpp): 3 group processes (each an inproc
/// job of 2 thread ranks, fl_hsdp over hybrid<inproc::communicator, elastic::link>, syncing every
/// 3 steps through a file store) are SIGKILLed at every phase of a round and restarted:
///  - between syncs (in the training loop), after arrival ("arrived"), after the decision
///    ("decided"), while connecting ("ready": the others are connecting), right after
///    connecting ("connected"), inside a sync's collectives ("op"), and during a heal: the
///    donor while it sends ("send"), a restarted joiner while it receives ("recv");
///  - the victim kills itself from its link's on_phase hook (or its training loop) when the
///    controller (this test process) has armed it, on the local rank the plan names; the
///    controller restarts it after the plan's delay (0 ms for some: a restart that quick once
///    took the dead process's place in the round) as a new process, a new incarnation. One
///    group at most is dead at a time; a kill is armed only once every group is alive and
///    every restarted one healed, except the heal kills, which ride on the previous kill's
///    restart (the donor is armed before the joiner comes back, the joiner at its start).
/// Checks: for every round, every file written after that round's sync holds the same
/// parameters (rank l against every rank l); no process that was not killed exits non-zero or
/// hangs; every restarted incarnation that applied a sync took a donor's state (at once, or
/// in a later round after its link said its heal failed); the live groups end equal. The worst
/// stall of the survivors per phase (their longest sync step in the kill's round and the next)
/// is printed with MESSAGE.
///
/// Short form: one kill per phase (8), in CI, on fl_hsdp and on diloco (whose joiners heal from
/// two donors: the donor's own state, the other participant's anchor and outer momentum).
/// FEDSHARD_CHAOS_ALGORITHM=diloco runs the long form on diloco; a joiner whose heal failed
/// is left out of the per-round check in that round (with an outer optimizer it applied the
/// round to its old anchor; it heals in its next round). Long form: FEDSHARD_CHAOS_KILLS=<n> random
/// kills (phases, victims, ranks, delays from FEDSHARD_CHAOS_SEED); tests/federation/chaos_soak.sh.
/// FEDSHARD_CHAOS_DIR=<dir> keeps a run's files there (parameters per round, step times, link
/// and trainer logs, the store) for a post-mortem.

#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fedshard/comm/elastic.hpp"
#include "fedshard/comm/gloo.hpp"
#include "fedshard/comm/hybrid.hpp"
#include "fedshard/comm/inproc.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/gloo_support.hpp"
#include "support/processes.hpp"
#include "support/tiny_mlp.hpp"

namespace {

using namespace fedshard;
namespace el = fedshard::elastic;
namespace gl = fedshard::gloo;
namespace ft = fedshard::test;
namespace fs = std::filesystem;
using detail::concat;
using clock_type = std::chrono::steady_clock;

constexpr int G = 3, L = 2, period = 3;
const mesh_shape shape{G, 1, L};
using elastic_world = hybrid<inproc::communicator, el::link>;

/// Where a kill happens: in the training loop between syncs ("step"), or at a phase of a
/// round as the link's on_phase names it.
const std::array<std::string, 8> kill_phases = {"step",      "arrived", "decided", "ready",
                                                "connected", "op",      "send",    "recv"};
/// The heal kills: they need a restarted group, so they ride on the previous kill's restart.
bool rides(const std::string& phase) {
  return phase == "send" || phase == "recv";
}

/// One planned kill: its phase, the victim group (for "send": the round's donor, for "recv":
/// the previous victim, both chosen when armed), the local rank that kills, and how long the
/// controller waits before restarting the victim.
struct kill_plan {
  std::string phase;
  int victim = 0;
  int rank = 0;
  int delay_ms = 0;
};

// ------------------------------------------------------------------ files
void write_atomic(const fs::path& p, const std::string& text) {
  {
    std::ofstream out(p.string() + ".tmp", std::ios::binary);
    out << text;
  }
  fs::rename(p.string() + ".tmp", p);
}
std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {(std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()};
}
void append_line(const fs::path& p, const std::string& line) {
  std::ofstream(p, std::ios::app) << line << '\n';
}
void write_floats(const fs::path& p, const std::vector<float>& v) {
  write_atomic(p, std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4));
}
std::vector<float> read_floats(const fs::path& p) {
  const std::string b = read_text(p);
  std::vector<float> v(b.size() / 4);
  std::memcpy(v.data(), b.data(), v.size() * 4);
  return v;
}
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return !a.empty() && a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}
/// The files of group g's incarnation n start with this.
std::string prefix_of(int g, int n) {
  return concat("g", g, "n", n, "_");
}

// ------------------------------------------------------------------ the group process
/// What the controller armed a group with (file arm_<g>): kill number `index` at `phase` on
/// local rank `rank`, in a round >= min_round.
struct arm {
  int index = -1;
  std::string phase;
  int rank = -1;
  std::int64_t min_round = 0;
};
std::optional<arm> read_arm(const fs::path& dir, int g) {
  std::istringstream is(read_text(dir / concat("arm_", g)));
  arm a;
  if (!(is >> a.index >> a.phase >> a.rank >> a.min_round)) return std::nullopt;
  return a;
}

/// Kills this process when it is armed for (phase, round) on local rank l; first records the
/// kill (kill_<index>: group, incarnation, rank, phase, round) for the controller.
void maybe_die(const fs::path& dir, int g, int n, int l, std::string_view phase,
               std::int64_t round) {
  const auto a = read_arm(dir, g);
  if (!a || a->phase != phase || a->rank != l || round < a->min_round) return;
  write_atomic(dir / concat("kill_", a->index), concat(g, ' ', n, ' ', l, ' ', phase, ' ', round));
  // Inside an op or a transfer, let the others get into it first.
  if (phase == "op" || phase == "send" || phase == "recv")
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  ::kill(::getpid(), SIGKILL);
  std::this_thread::sleep_for(std::chrono::seconds(600));
}

el::options chaos_link_options(const fs::path& dir, int g, int n, int l) {
  el::options o;
  o.job = "run";
  o.join_timeout = std::chrono::duration<double>(3);
  o.connect_timeout = std::chrono::duration<double>(2);
  o.transport = ft::gloo_timeout(20);
  static std::mutex mu;  // one per process: both ranks append to the incarnation's link log
  const auto file = dir / (prefix_of(g, n) + "link");
  o.log = [file](const std::string& s) {
    std::lock_guard lock(mu);
    append_line(file, s);
  };
  o.on_phase = [dir, g, n, l](std::string_view phase, std::int64_t round) {
    maybe_die(dir, g, n, l, phase, round);
  };
  return o;
}

/// The round after which every group stops (file finish), or -1.
std::int64_t finish_round(const fs::path& dir) {
  std::istringstream is(read_text(dir / "finish"));
  std::int64_t e = -1;
  return is >> e ? e : -1;
}

/// Incarnation n of group g: trains until the round named by the finish file; after every
/// sync it applied writes its parameters to <prefix>p_r<round>_l<l> and the step's wall time
/// to <prefix>steps_l<l> ("<round> <ms>"); its trainer log goes to <prefix>trainer_l<l>, its
/// link's to <prefix>link; at the end its parameters to <prefix>final_l<l>. Local rank 0
/// writes the latest round it applied to progress_<g>.
template <class Alg>
void chaos_group(const fs::path& dir, int g, int n) {
  const std::string pre = prefix_of(g, n);
  inproc::run(L, [&](inproc::communicator& c) {
    const int l = c.rank();
    auto st = std::make_shared<gl::file_store>(dir / "store");
    el::link lk(st, G, g, L, l, chaos_link_options(dir, g, n, l));
    elastic_world w(c.split(0, l), std::move(lk));
    mesh m(w, shape);
    trainer_options<Alg> o;
    o.total_steps = 1'000'000;  // the controller ends the run (finish)
    o.schedule.period = period;
    const auto log_file = dir / concat(pre, "trainer_l", l);
    o.log = [log_file](const std::string& s) { append_line(log_file, s); };
    trainer<ft::mlp_model, Alg, optim::adamw, elastic_world> t(m, ft::mlp_model{}, {.lr = 0.02f},
                                                               o);
    const auto& link = t.topology().federation().federation_side();
    for (;;) {
      const auto s = t.step_count();
      if (s % period == 1) maybe_die(dir, g, n, l, "step", link.round().round + 1);
      const auto syncs = t.syncs_applied();
      const auto t0 = clock_type::now();
      t.step(t.model().batch(11, static_cast<int>(s), g, G, l, L, 2));
      if (t.syncs_applied() == syncs) continue;
      const double ms = std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
      const auto e = link.round().round;
      write_floats(dir / concat(pre, "p_r", e, "_l", l), t.parameters());
      append_line(dir / concat(pre, "steps_l", l), concat(e, ' ', ms));
      if (l == 0) write_atomic(dir / concat("progress_", g), std::to_string(e));
      // Both ranks stop after the same sync (the finish file may appear between their reads).
      const std::int64_t end = finish_round(dir);
      float stop = e >= 0 && end >= 0 && e >= end ? 1.0f : 0.0f;
      c.all_reduce(&stop, &stop, 1, dtype::f32, reduce_op::max);
      if (stop != 0) break;
    }
    write_floats(dir / concat(pre, "final_l", l), t.parameters());
  });
}

// ------------------------------------------------------------------ the controller
struct incarnation {
  int g = 0;
  int n = 0;  ///< 0: the first process of the group
  pid_t pid = -1;
  bool running = true;
  int status = 0;
  bool killed = false;  ///< died by a planned kill (its kill file names it)
};

/// A kill as it happened: its plan, the victim incarnation, the round (from the kill file).
struct kill_record {
  kill_plan plan;
  int victim = -1;
  int incarnation = -1;
  std::int64_t round = -1;
};

class controller {
 public:
  explicit controller(const fs::path& dir) : dir_(dir) {
    for (int g = 0; g < G; ++g) start(g);
  }
  controller(const controller&) = delete;
  controller& operator=(const controller&) = delete;
  /// Kills whatever still runs (a failed run).
  ~controller() {
    for (auto& i : all_)
      if (i.running) {
        ::kill(i.pid, SIGKILL);
        ::waitpid(i.pid, nullptr, 0);
      }
  }

  /// Runs the plan, then ends the run; false (with failures()) when something went wrong.
  bool run(const std::vector<kill_plan>& plan) {
    for (std::size_t k = 0; k < plan.size(); ++k) {
      if (!rides(plan[k].phase) && !settle()) return false;
      if (!rides(plan[k].phase))
        arm_kill(static_cast<int>(k), plan[k], plan[k].victim, next_round());
      // A ride was armed when the previous victim was restarted.
      if (!await_kill(static_cast<int>(k), plan[k])) return false;
      const kill_record& r = kills_.back();
      const kill_plan* next = k + 1 < plan.size() ? &plan[k + 1] : nullptr;
      fs::remove(dir_ / concat("arm_", r.victim));
      if (next != nullptr && next->phase == "send") {
        int donor = 0;
        while (donor == r.victim) ++donor;  // the lowest group that is no joiner
        arm_kill(static_cast<int>(k + 1), *next, donor, 0);
      } else if (next != nullptr && next->phase == "recv") {
        arm_kill(static_cast<int>(k + 1), *next, r.victim, 0);
      }
      if (!pause(plan[k].delay_ms)) return false;
      start(r.victim);
    }
    return settle() && finish();
  }

  const std::vector<std::string>& failures() const noexcept { return failures_; }
  const std::vector<incarnation>& incarnations() const noexcept { return all_; }
  const std::vector<kill_record>& kills() const noexcept { return kills_; }
  /// The latest incarnation of group g.
  const incarnation& current(int g) const { return all_[current_[static_cast<std::size_t>(g)]]; }

 private:
  void start(int g) {
    const int n = lives_[static_cast<std::size_t>(g)]++;
    incarnation i{.g = g, .n = n};
    i.pid = ft::spawn(
        [this, g, n] {
          // FEDSHARD_CHAOS_ALGORITHM=diloco: its heals come from two donors (anchors and
          // outer momentum from the other participant), so the donor kills hit either.
          const char* a = std::getenv("FEDSHARD_CHAOS_ALGORITHM");
          if (a != nullptr && std::string_view(a) == "diloco")
            chaos_group<diloco>(dir_, g, n);
          else
            chaos_group<fl_hsdp>(dir_, g, n);
        },
        "chaos: group process");
    current_[static_cast<std::size_t>(g)] = all_.size();
    all_.push_back(i);
  }
  void arm_kill(int index, const kill_plan& p, int victim, std::int64_t min_round) {
    write_atomic(dir_ / concat("arm_", victim),
                 concat(index, ' ', p.phase, ' ', p.rank, ' ', min_round));
  }
  /// Reaps the processes that ended; one that was not killed by plan and did not exit 0 is a
  /// failure. False when there is one.
  bool reap() {
    for (auto& i : all_) {
      if (!i.running || ::waitpid(i.pid, &i.status, WNOHANG) != i.pid) continue;
      i.running = false;
      const bool planned = WIFSIGNALED(i.status) && WTERMSIG(i.status) == SIGKILL && named(i);
      if (planned) {
        i.killed = true;
      } else if (!(WIFEXITED(i.status) && WEXITSTATUS(i.status) == 0)) {
        failures_.push_back(
            concat("group ", i.g, " incarnation ", i.n, " ended with status ", i.status,
                   " (signal ", WIFSIGNALED(i.status) ? WTERMSIG(i.status) : 0, ", exit ",
                   WIFEXITED(i.status) ? WEXITSTATUS(i.status) : -1, ") without being killed"));
      } else if (!finishing_) {
        failures_.push_back(concat("group ", i.g, " incarnation ", i.n, " exited before the end"));
      }
    }
    return failures_.empty();
  }
  /// True when a kill file names incarnation i.
  bool named(const incarnation& i) const {
    for (int k = 0; fs::exists(dir_ / concat("kill_", k)) || k <= last_armed_; ++k) {
      std::istringstream is(read_text(dir_ / concat("kill_", k)));
      int g = -1, n = -1;
      if (is >> g >> n && g == i.g && n == i.n) return true;
    }
    return false;
  }
  /// Polls until done() or `seconds` passed (a failure then, saying `what`); false on failure.
  template <class Done>
  bool poll(double seconds, const std::string& what, Done&& done) {
    const auto deadline = clock_type::now() + std::chrono::duration<double>(seconds);
    for (;;) {
      if (!reap()) return false;
      if (done()) return true;
      if (clock_type::now() > deadline) {
        failures_.push_back(concat("timed out after ", seconds, " s ", what));
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  bool pause(int ms) {
    return poll(ms / 1000.0 + 1, "", [t = clock_type::now() + std::chrono::milliseconds(ms)] {
      return clock_type::now() >= t;
    });
  }
  /// The first round a kill armed now may hit: after the latest any group applied.
  std::int64_t next_round() const {
    std::int64_t e = -1;
    for (int g = 0; g < G; ++g) {
      std::istringstream is(read_text(dir_ / concat("progress_", g)));
      std::int64_t x = -1;
      if (is >> x) e = std::max(e, x);
    }
    return e + 1;
  }
  /// True when incarnation i took a donor's state on every rank.
  bool healed(const incarnation& i) const {
    for (int l = 0; l < L; ++l)
      if (read_text(dir_ / concat(prefix_of(i.g, i.n), "trainer_l", l))
              .find("took the state of group") == std::string::npos)
        return false;
    return true;
  }
  /// Waits until every group's latest incarnation runs, applied a sync and, when restarted,
  /// healed.
  bool settle() {
    return poll(60, "waiting for every restarted group to heal", [&] {
      for (int g = 0; g < G; ++g) {
        const auto& i = current(g);
        if (!i.running || !fs::exists(dir_ / concat(prefix_of(g, i.n), "steps_l0")) ||
            (i.n > 0 && !healed(i)))
          return false;
      }
      return true;
    });
  }
  bool await_kill(int k, const kill_plan& p) {
    last_armed_ = k;
    const auto file = dir_ / concat("kill_", k);
    if (!poll(60, concat("waiting for kill ", k, " (", p.phase, ")"), [&] {
          if (!fs::exists(file)) return false;
          std::istringstream is(read_text(file));
          int g = -1, n = -1;
          return is >> g >> n && g >= 0 && g < G && !current(g).running;
        }))
      return false;
    std::istringstream is(read_text(file));
    kill_record r{.plan = p};
    int l = -1;
    std::string phase;
    is >> r.victim >> r.incarnation >> l >> phase >> r.round;
    kills_.push_back(r);
    return true;
  }
  /// Ends the run a few rounds ahead and waits for every group to exit.
  bool finish() {
    finishing_ = true;
    write_atomic(dir_ / "finish", std::to_string(next_round() + 2));
    return poll(60, "waiting for the groups to finish", [&] {
      for (int g = 0; g < G; ++g)
        if (current(g).running) return false;
      return true;
    });
  }

  fs::path dir_;
  std::vector<incarnation> all_;
  std::array<std::size_t, G> current_{};
  std::array<int, G> lives_{};
  std::vector<kill_record> kills_;
  std::vector<std::string> failures_;
  int last_armed_ = -1;
  bool finishing_ = false;
};

// ------------------------------------------------------------------ checks and the report
/// The rounds in which a joiner's heal failed, per incarnation's prefix (from its link log:
/// "the heal of round <e> failed ...; this group heals in its next round").
std::set<std::pair<std::string, std::int64_t>> failed_heals(const fs::path& dir) {
  std::set<std::pair<std::string, std::int64_t>> out;
  const std::string said = "the heal of round ";
  for (const auto& f : fs::directory_iterator(dir)) {
    const std::string name = f.path().filename().string();
    if (name.size() < 5 || name.substr(name.size() - 5) != "_link") continue;
    std::istringstream in(read_text(f.path()));
    for (std::string line; std::getline(in, line);) {
      const auto at = line.find(said);
      if (at != std::string::npos && line.find("heals in its next round") != std::string::npos)
        out.emplace(name.substr(0, name.size() - 4), std::stoll(line.substr(at + said.size())));
    }
  }
  return out;
}

/// The files of `dir` named like <prefix>p_r<round>_l<l>, per round, then per l; left out:
/// a joiner's in the round its heal failed (it applied the round to the state it had: with
/// an outer optimizer, not the others' anchor; it heals in its next round).
std::map<std::int64_t, std::map<int, std::vector<fs::path>>> parameter_files(const fs::path& dir) {
  std::map<std::int64_t, std::map<int, std::vector<fs::path>>> out;
  const auto failed = failed_heals(dir);
  for (const auto& f : fs::directory_iterator(dir)) {
    const std::string name = f.path().filename().string();
    int g = 0, n = 0, l = 0;
    long long e = 0;
    char tail = 0;
    if (std::sscanf(name.c_str(), "g%dn%d_p_r%lld_l%d%c", &g, &n, &e, &l, &tail) == 4 &&
        failed.count({prefix_of(g, n), e}) == 0)
      out[e][l].push_back(f.path());
  }
  return out;
}

/// Every round's sync step times of incarnation (g, n): round -> the slowest of its ranks, ms.
std::map<std::int64_t, double> step_times(const fs::path& dir, int g, int n) {
  std::map<std::int64_t, double> out;
  for (int l = 0; l < L; ++l) {
    std::istringstream is(read_text(dir / concat(prefix_of(g, n), "steps_l", l)));
    std::int64_t e = 0;
    double ms = 0;
    while (is >> e >> ms) out[e] = std::max(out[e], ms);
  }
  return out;
}

/// For each kill, the survivors' longest sync step in its round and the next (ms), not
/// counting a later kill's rounds: the incarnations of other groups that applied a round
/// before it.
std::vector<double> stalls(const fs::path& dir, const controller& c) {
  std::vector<double> out;
  const auto& kills = c.kills();
  for (std::size_t j = 0; j < kills.size(); ++j) {
    const auto& k = kills[j];
    std::int64_t last = k.round + 1;
    if (j + 1 < kills.size() && kills[j + 1].round > k.round)
      last = std::min(last, kills[j + 1].round - 1);
    double worst = 0;
    for (const auto& i : c.incarnations()) {
      if (i.g == k.victim) continue;
      const auto times = step_times(dir, i.g, i.n);
      if (times.empty() || times.begin()->first >= k.round) continue;
      for (std::int64_t e = k.round; e <= last; ++e)
        if (auto it = times.find(e); it != times.end()) worst = std::max(worst, it->second);
    }
    out.push_back(worst);
  }
  return out;
}

/// Runs `plan`, checks everything the file comment lists, and reports the stalls.
/// With FEDSHARD_CHAOS_DIR set, the run's files are kept there (for a post-mortem).
void soak(const std::vector<kill_plan>& plan) {
  ft::temp_dir tmp("fedshard-chaos");
  struct kept {
    fs::path p;
    const fs::path& path() const { return p; }
  } dir{tmp.path()};
  if (const char* keep = std::getenv("FEDSHARD_CHAOS_DIR"); keep != nullptr && *keep != '\0') {
    dir.p = fs::path(keep) / concat("run-", ::getpid(), "-", plan.size());
    fs::remove_all(dir.p);
    fs::create_directories(dir.p);
    MESSAGE(concat("chaos: files kept in ", dir.p.string()));
  }
  const auto t0 = clock_type::now();
  controller c(dir.path());
  const bool ran = c.run(plan);
  const double took = std::chrono::duration<double>(clock_type::now() - t0).count();
  std::string failures;
  for (const auto& f : c.failures()) failures += f + "\n";
  CAPTURE(failures);
  CHECK(ran);
  CHECK(c.kills().size() == plan.size());
  // Every round: every file holds the same parameters as the others of its rank.
  const auto files = parameter_files(dir.path());
  for (const auto& [e, by_rank] : files)
    for (const auto& [l, paths] : by_rank) {
      const auto first = read_floats(paths.front());
      for (const auto& p : paths) {
        CAPTURE(e);
        CAPTURE(p.filename().string());
        CAPTURE(paths.front().filename().string());
        CHECK(same_bits(read_floats(p), first));
      }
    }
  // Every restarted incarnation that applied a sync healed, at once or after a failed heal.
  for (const auto& i : c.incarnations()) {
    if (i.n == 0 || step_times(dir.path(), i.g, i.n).empty()) continue;
    const auto pre = prefix_of(i.g, i.n);
    for (int l = 0; l < L; ++l) {
      const std::string log = read_text(dir.path() / concat(pre, "trainer_l", l));
      const std::string first_round =
          concat(" in round ", step_times(dir.path(), i.g, i.n).begin()->first);
      CAPTURE(pre);
      CAPTURE(log);
      CHECK(log.find("took the state of group") != std::string::npos);
      if (log.find("took the state of group") == std::string::npos ||
          log.find(first_round) == std::string::npos)
        CHECK(read_text(dir.path() / (pre + "link")).find("heals in its next round") !=
              std::string::npos);
    }
  }
  // The live groups end equal.
  if (ran)
    for (int g = 0; g < G; ++g)
      for (int l = 0; l < L; ++l) {
        CAPTURE(g);
        CHECK(same_bits(
            read_floats(dir.path() / concat(prefix_of(g, c.current(g).n), "final_l", l)),
            read_floats(dir.path() / concat(prefix_of(0, c.current(0).n), "final_l", l))));
      }
  // The report: the worst stall per phase, and an ordinary sync step for comparison.
  const auto s = stalls(dir.path(), c);
  std::map<std::string, std::pair<int, double>> worst;
  std::string each;
  for (std::size_t k = 0; k < s.size(); ++k) {
    const auto& r = c.kills()[k];
    auto& w = worst[r.plan.phase];
    ++w.first;
    w.second = std::max(w.second, s[k]);
    each += concat(" ", r.plan.phase, "@g", r.victim, "/r", r.round, "+", r.plan.delay_ms, ":",
                   static_cast<int>(s[k]));
  }
  std::vector<double> all;
  for (const auto& i : c.incarnations())
    for (const auto& [e, ms] : step_times(dir.path(), i.g, i.n)) all.push_back(ms);
  std::sort(all.begin(), all.end());
  std::string table;
  for (const auto& [phase, w] : worst)
    table += concat("  ", phase, ": ", w.first, " kill(s), worst stall ",
                    static_cast<int>(w.second), " ms\n");
  MESSAGE(concat("chaos: ", c.kills().size(), " kills in ", static_cast<int>(took), " s, ",
                 files.size(), " rounds; median sync step ",
                 all.empty() ? 0 : static_cast<int>(all[all.size() / 2]), " ms\n", table,
                 "  per kill (phase@victim/round+restart delay:stall, ms):", each));
}

/// The short form's plan: each phase once, victims and ranks spread, some restarts at once.
std::vector<kill_plan> short_plan() {
  return {{"step", 2, 0, 1000},  {"arrived", 1, 1, 0},     {"decided", 0, 0, 0},
          {"ready", 2, 1, 1000}, {"connected", 1, 0, 200}, {"op", 0, 1, 500},
          {"send", -1, 0, 0},    {"recv", -1, 1, 100}};
}

/// n random kills from `seed`: phase, victim, rank and restart delay; a heal kill only right
/// after a kill that is not one (it rides on that kill's restart).
std::vector<kill_plan> random_plan(int n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int delays[] = {0, 0, 50, 200, 500, 1000};
  std::vector<kill_plan> plan;
  for (int k = 0; k < n; ++k) {
    kill_plan p;
    p.phase = kill_phases[rng() % kill_phases.size()];
    if (rides(p.phase) && (k == 0 || rides(plan.back().phase)))
      p.phase = kill_phases[rng() % (kill_phases.size() - 2)];
    p.victim = static_cast<int>(rng() % G);
    p.rank = static_cast<int>(rng() % L);
    p.delay_ms = delays[rng() % std::size(delays)];
    plan.push_back(p);
  }
  return plan;
}

}  // namespace

TEST_CASE("chaos: 3 groups killed at every phase of a round and restarted stay equal (short)") {
  soak(short_plan());
}

TEST_CASE(
    "chaos: the same kills on diloco, whose joiners heal from two donors, stay equal (short)") {
  // The group processes read FEDSHARD_CHAOS_ALGORITHM when they start (chaos_group's spawn).
  const char* before = std::getenv("FEDSHARD_CHAOS_ALGORITHM");
  const std::string saved = before != nullptr ? before : "";
  ::setenv("FEDSHARD_CHAOS_ALGORITHM", "diloco", 1);
  soak(short_plan());
  if (before != nullptr)
    ::setenv("FEDSHARD_CHAOS_ALGORITHM", saved.c_str(), 1);
  else
    ::unsetenv("FEDSHARD_CHAOS_ALGORITHM");
}

TEST_CASE("chaos: the long soak (FEDSHARD_CHAOS_KILLS random kills, FEDSHARD_CHAOS_SEED)") {
  const char* kills = std::getenv("FEDSHARD_CHAOS_KILLS");
  if (kills == nullptr || *kills == '\0') {
    MESSAGE("skipped: set FEDSHARD_CHAOS_KILLS=<n> (and FEDSHARD_CHAOS_SEED) for the long soak");
    return;
  }
  const char* seed = std::getenv("FEDSHARD_CHAOS_SEED");
  const int n = std::atoi(kills);
  REQUIRE(n > 0);
  const std::uint64_t s = seed != nullptr && *seed != '\0' ? std::strtoull(seed, nullptr, 10) : 1;
  MESSAGE(concat("chaos: ", n, " kills, seed ", s));
  soak(random_plan(n, s));
}
