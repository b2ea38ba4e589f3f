/// Elastic federation between group processes (comm/elastic.hpp): how long the surviving
/// groups take to go on after a group dies, and how long a restarted group takes to heal.
///
/// Every iteration runs one scenario from scratch, in a fresh temporary directory:
///  - the benchmark process forks 3 group processes (as tests/federation/test_cross_job_gloo.cpp
///    does); each is an inproc job of 2 thread ranks training a tiny model (one unit of 256
///    floats, a quadratic loss) with fl_hsdp, a sync every `period` = 4 steps, over an elastic
///    link whose groups meet through a file store in that directory. Before every step a
///    rank sleeps `compute_ms` = 20 ms, standing for the step's compute (the model itself
///    costs microseconds), so syncs are about 4 x 20 ms apart;
///  - group 2 SIGKILLs itself at step `kill_step` = 25 (0-based; the syncs follow steps
///    3, 7, ..., 23, 27, so it dies between two syncs, 2 steps before the next one);
///  - once both survivors have completed a sync without it, the benchmark process forks group 2
///    again (a fresh process: it heals at the next round it reaches, receiving a survivor's
///    state);
///  - once the restarted group completed a sync, the benchmark process SIGKILLs and reaps
///    every group process and removes the directory.
///
/// Timestamps are CLOCK_MONOTONIC in nanoseconds (one clock for all processes of the
/// machine): rank 0 of every group appends one line per step to <dir>/steps_<g>
/// (life, step, whether a round took place in it and its members, joiners and left-out counts,
/// the time t.step() returned, how long t.step() took), with one write() on an O_APPEND file;
/// group 2's rank 0 writes <dir>/killed (the time) right before kill(getpid(), SIGKILL), after
/// a barrier of its ranks; the benchmark process reads the clock right before it forks the
/// restarted group. A sync is complete when t.step() returns at a step where the link saw a
/// round: the round decided, joiners healed, the average applied.
///
/// Arguments: join_timeout in ms, and reuse (1: a round whose members are the previous
/// round's keeps its Gloo context, elastic::options::reuse_connections; 0: a new one every
/// round).
///
/// Counters (seconds; means over the iterations, and the worst for recovery and heal):
///  - recovery_s: from the SIGKILL to the first sync after it completed by both survivors
///    (the later of groups 0 and 1). It holds the 2 steps left before the sync (~40 ms), the
///    round's wait for the dead group (join_timeout) and the sync;
///  - heal_s: from the restart to the restarted group's first completed sync: process start,
///    its first `period` steps, the wait for the next round of the others, the donor's state,
///    the sync;
///  - sync_s: without failures (group 0's rounds before the kill), the median time t.step()
///    takes at a sync step (the round: arrive, decide, connect, average), compute excluded;
///  - period_s: without failures, the median time between two consecutive completed syncs of
///    group 0 (one sync period: `period` steps and a round);
///  - bound_s = 2 x join_timeout + period_s: the requirement is recovery and heal both under
///    2 x the federation timeout plus one sync (taken here as one sync period, which holds
///    the sync and the compute before it; 2 x join_timeout + sync_s is the stricter reading).
/// The manual time of an iteration is its recovery time.

#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <stdexcept>
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

namespace {

namespace el = fedshard::elastic;
namespace gl = fedshard::gloo;
using fedshard::detail::concat;

constexpr int groups = 3, locals = 2;
constexpr int period = 4, kill_step = 25, killed_group = 2;
constexpr int compute_ms = 20;
constexpr int max_steps = 100000;  // never reached: the benchmark ends the processes
constexpr double wait_limit = 60;  // seconds the benchmark waits for any one event

std::int64_t now_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

/// The tiny model: one unit "w" of n floats, loss 0.5 mean (w - target)^2.
struct toy_batch {
  std::vector<float> target;
};
struct toy_model {
  std::int64_t n = 256;
  std::vector<fedshard::unit_spec> units() const { return {{"linear", {{"w", {n}}}}}; }
  template <class Ctx>
  float forward_backward(Ctx& ctx, const toy_batch& b) {
    const fedshard::flat_layout& l = ctx.layout();
    const auto N = static_cast<std::size_t>(n);
    std::vector<float> diff(N);
    double loss = 0;
    {
      auto w = l.tensor_view(ctx.acquire(0), 0, 0);
      for (std::size_t i = 0; i < N; ++i) {
        diff[i] = w[i] - b.target[i];
        loss += 0.5 * double(diff[i]) * double(diff[i]);
      }
      ctx.release(0);
    }
    ctx.acquire(0, fedshard::phase::backward);
    auto g = l.tensor_view(ctx.grad_buffer(0), 0, 0);
    for (std::size_t i = 0; i < N; ++i) g[i] = diff[i] / static_cast<float>(N);
    ctx.release(0);
    ctx.grads_ready(0);
    return static_cast<float>(loss / double(N));
  }
  static toy_batch batch(std::int64_t step, int group, int local) {
    toy_batch b{std::vector<float>(256)};
    for (std::size_t i = 0; i < b.target.size(); ++i)
      b.target[i] = static_cast<float>(
                        ((step * 7 + group * 3 + local + static_cast<std::int64_t>(i)) % 17) - 8) /
                    8.0f;
    return b;
  }
};

using world_type = fedshard::hybrid<fedshard::inproc::communicator, el::link>;

/// Appends one line with a single write() (readers never see half a line).
void append_line(const std::filesystem::path& file, const std::string& line) {
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd < 0) return;
  const std::string s = line + "\n";
  [[maybe_unused]] const ssize_t w = ::write(fd, s.data(), s.size());
  ::close(fd);
}

/// elastic::options::reuse_connections of the links (the benchmark's second argument; the
/// group processes are forked after it is set).
bool reuse_connections = true;

/// Group g's process body (life 0: first start, 1: restarted); see the file comment.
void group_process(const std::filesystem::path& dir, double join_timeout, int g, int life) {
  fedshard::inproc::options run_options;
  run_options.spin_polls = 0;
  fedshard::inproc::run(
      locals,
      [&](fedshard::inproc::communicator& c) {
        el::options o;
        o.job = "bench";
        o.join_timeout = std::chrono::duration<double>(join_timeout);
        o.transport.timeout = std::chrono::duration<double>(30);
        o.log = [](const std::string&) {};
        o.reuse_connections = reuse_connections;
        el::link lk(std::make_shared<gl::file_store>(dir / "store"), groups, g, locals, c.rank(),
                    o);
        world_type w(c.split(0, c.rank()), std::move(lk));
        fedshard::mesh m(w, {groups, 1, locals});
        fedshard::trainer_options<fedshard::fl_hsdp> to;
        to.total_steps = max_steps;
        to.schedule.period = period;
        fedshard::trainer<toy_model, fedshard::fl_hsdp, fedshard::optim::adamw, world_type> t(
            m, toy_model{}, {.lr = 0.01f}, to);
        el::link& link = t.topology().federation().federation_side();
        const auto steps_file = dir / concat("steps_", g);
        while (t.step_count() < max_steps) {
          const std::int64_t s = t.step_count();
          if (life == 0 && g == killed_group && s == kill_step) {
            c.barrier();
            if (c.rank() == 0) {
              append_line(dir / "killed", std::to_string(now_ns()));
              ::kill(::getpid(), SIGKILL);
            }
            std::this_thread::sleep_for(std::chrono::seconds(60));
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(compute_ms));
          const auto rounds = link.rounds_seen();
          const std::int64_t t0 = now_ns();
          t.step(toy_model::batch(s, g, c.rank()));
          const std::int64_t t1 = now_ns();
          if (c.rank() != 0) continue;
          const bool synced = link.rounds_seen() != rounds;
          const auto& r = link.round();
          append_line(steps_file,
                      concat(life, ' ', s, ' ', synced ? 1 : 0, ' ', synced ? r.members.size() : 0,
                             ' ', synced ? r.joiners.size() : 0, ' ',
                             synced ? r.left_out.size() : 0, ' ', t1, ' ', t1 - t0));
        }
      },
      run_options);
}

/// Forks a process that runs body() and exits 0 (1 when it threw).
pid_t spawn(const std::function<void()>& body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    int rc = 0;
    try {
      body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_elastic: group process failed: %s\n", e.what());
      rc = 1;
    }
    std::fflush(nullptr);
    ::_exit(rc);
  }
  return pid;
}

struct step_line {
  int life = 0;
  std::int64_t step = 0;
  bool synced = false;
  std::size_t members = 0, joiners = 0, left_out = 0;
  std::int64_t end_ns = 0, took_ns = 0;
};

std::vector<step_line> read_steps(const std::filesystem::path& file) {
  std::vector<step_line> v;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    std::istringstream is(line);
    step_line s;
    int synced = 0;
    if (is >> s.life >> s.step >> synced >> s.members >> s.joiners >> s.left_out >> s.end_ns >>
        s.took_ns) {
      s.synced = synced != 0;
      v.push_back(s);
    }
  }
  return v;
}

/// Polls `ready` every 5 ms, at most wait_limit seconds; false on timeout.
template <class F>
bool wait_until(F&& ready) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_limit);
  while (!ready()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct scenario_result {
  double recovery = 0, heal = 0, sync = 0, period_time = 0;
};

/// One scenario (see the file comment); throws std::runtime_error saying what did not happen.
scenario_result run_scenario(double join_timeout) {
  std::string pattern =
      (std::filesystem::temp_directory_path() / "fedshard-bench-elastic-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr)
    throw std::runtime_error("cannot make a temporary directory");
  const std::filesystem::path dir = pattern;
  std::vector<pid_t> pids;
  auto cleanup = [&] {
    for (pid_t p : pids) {
      ::kill(p, SIGKILL);
      ::waitpid(p, nullptr, 0);
    }
    pids.clear();
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  };
  try {
    for (int g = 0; g < groups; ++g)
      pids.push_back(spawn([&, g] { group_process(dir, join_timeout, g, 0); }));
    auto fail = [&](const std::string& what) { throw std::runtime_error(what); };
    // The kill, and its time.
    std::int64_t killed = 0;
    if (!wait_until([&] {
          std::ifstream in(dir / "killed");
          return static_cast<bool>(in >> killed);
        }))
      fail("group 2 did not reach its kill step");
    // The survivors' first completed sync after it.
    std::int64_t recovered = 0;
    if (!wait_until([&] {
          std::int64_t latest = 0;
          for (int g = 0; g < 2; ++g) {
            std::int64_t first = 0;
            for (const auto& s : read_steps(dir / concat("steps_", g)))
              if (s.synced && s.end_ns > killed) {
                first = s.end_ns;
                break;
              }
            if (first == 0) return false;
            latest = std::max(latest, first);
          }
          recovered = latest;
          return true;
        }))
      fail("the survivors did not complete a sync after the kill");
    // The restart, and the restarted group's first completed sync.
    int status = 0;
    if (::waitpid(pids[killed_group], &status, 0) != pids[killed_group] || !WIFSIGNALED(status))
      fail("group 2's process did not die of its SIGKILL");
    pids.erase(pids.begin() + killed_group);
    const std::int64_t restarted = now_ns();
    pids.push_back(spawn([&] { group_process(dir, join_timeout, killed_group, 1); }));
    std::int64_t healed = 0;
    std::size_t joiners = 0;
    if (!wait_until([&] {
          for (const auto& s : read_steps(dir / concat("steps_", killed_group)))
            if (s.life == 1 && s.synced) {
              healed = s.end_ns;
              joiners = s.joiners;
              return true;
            }
          return false;
        }))
      fail("the restarted group did not complete a sync");
    if (joiners == 0) fail("the restarted group's first sync had no joiners");
    // Failure-free figures: group 0's steps before the kill.
    std::vector<double> sync_steps, intervals;
    std::int64_t previous = 0;
    for (const auto& s : read_steps(dir / "steps_0")) {
      if (!s.synced || s.end_ns > killed) continue;
      if (s.step > period) sync_steps.push_back(double(s.took_ns) * 1e-9);  // round 0 has start-up
      if (previous != 0) intervals.push_back(double(s.end_ns - previous) * 1e-9);
      previous = s.end_ns;
    }
    scenario_result r;
    r.recovery = double(recovered - killed) * 1e-9;
    r.heal = double(healed - restarted) * 1e-9;
    r.sync = median(sync_steps);
    r.period_time = median(intervals);
    cleanup();
    return r;
  } catch (...) {
    cleanup();
    throw;
  }
}

void bm_elastic_recovery(benchmark::State& state) {
  const double join_timeout = double(state.range(0)) / 1000.0;
  reuse_connections = state.range(1) != 0;
  std::vector<scenario_result> runs;
  for (auto _ : state) {
    try {
      runs.push_back(run_scenario(join_timeout));
    } catch (const std::exception& e) {
      state.SkipWithError(e.what());
      return;
    }
    state.SetIterationTime(runs.back().recovery);
  }
  auto mean = [&](double scenario_result::*f) {
    double s = 0;
    for (const auto& r : runs) s += r.*f;
    return s / double(runs.size());
  };
  auto worst = [&](double scenario_result::*f) {
    double m = 0;
    for (const auto& r : runs) m = std::max(m, r.*f);
    return m;
  };
  state.counters["join_timeout_s"] = join_timeout;
  state.counters["recovery_s"] = mean(&scenario_result::recovery);
  state.counters["recovery_max_s"] = worst(&scenario_result::recovery);
  state.counters["heal_s"] = mean(&scenario_result::heal);
  state.counters["heal_max_s"] = worst(&scenario_result::heal);
  state.counters["sync_s"] = mean(&scenario_result::sync);
  state.counters["period_s"] = mean(&scenario_result::period_time);
  state.counters["bound_s"] = 2 * join_timeout + mean(&scenario_result::period_time);
}

}  // namespace

BENCHMARK(bm_elastic_recovery)
    ->ArgNames({"join_timeout_ms", "reuse"})
    ->ArgsProduct({{500, 1000}, {1, 0}})
    ->Iterations(3)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
