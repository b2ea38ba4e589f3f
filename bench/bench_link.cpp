/// The Gloo link between two processes on this machine (comm/gloo.hpp): how fast an all_reduce
/// of S bytes goes, against S and the link's settings.
///
/// Every benchmark forks a second process (rank 1); the benchmark process is rank 0. They meet
/// through a file store in a fresh temporary directory, connect one gloo::communicator with the
/// settings under test, and run a fixed number of all_reduce(sum) calls of S bytes of f32
/// (warm-up calls first, not timed). Before every timed call the two ranks pass a barrier; rank
/// 0 times the call alone (manual time). Rank 1 runs the same calls and exits.
///
/// Arguments: S in MiB, checked (1: every call's arguments exchanged first, options::checked;
/// 0: not), pipelined (1: options::pipeline_bytes at its default; 0: one exchange for the
/// whole message) and stripes (options::stripes: TCP connections between the two ranks, each
/// with its own Gloo context and threads).
///
/// Counters:
///  - Gbit/s: S x 8 / time (what the caller sees: the algorithm's bandwidth);
///  - wire_Gbit/s: the bytes this rank handed to Gloo (moved().sent) x 8 / time.

#include <benchmark/benchmark.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "fedshard/comm/gloo.hpp"

namespace {

namespace gl = fedshard::gloo;
using fedshard::dtype;
using fedshard::reduce_op;

constexpr int warmup = 2;
constexpr int iterations = 8;

struct setting {
  std::int64_t bytes;
  bool checked;
  bool pipelined;
  int stripes;
};

gl::options options_of(const setting& s) {
  gl::options o;
  o.timeout = std::chrono::seconds(120);
  o.checked = s.checked;
  if (!s.pipelined) o.pipeline_bytes = 0;
  o.stripes = s.stripes;
  return o;
}

/// Runs `calls` all_reduces of s.bytes on rank `rank`; rank 0 reports each timed call's
/// seconds to `time` and returns the bytes it sent.
template <class Time>
std::int64_t run_rank(const std::filesystem::path& dir, int rank, const setting& s, Time&& time) {
  auto st = std::make_shared<gl::file_store>(dir);
  gl::communicator c(st, "link", rank, 2, options_of(s));
  const auto n = s.bytes / static_cast<std::int64_t>(sizeof(float));
  std::vector<float> in(static_cast<std::size_t>(n), 1.0f + static_cast<float>(rank));
  std::vector<float> out(in.size());
  for (int i = 0; i < warmup; ++i)
    c.all_reduce(in.data(), out.data(), n, dtype::f32, reduce_op::sum);
  const auto before = c.moved();
  for (int i = 0; i < iterations; ++i) {
    c.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    c.all_reduce(in.data(), out.data(), n, dtype::f32, reduce_op::sum);
    time(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  if (out[0] != 3.0f) throw std::runtime_error("bench_link: wrong all_reduce result");
  return (c.moved() - before).sent;
}

void bm_all_reduce(benchmark::State& state) {
  const setting s{state.range(0) << 20, state.range(1) != 0, state.range(2) != 0,
                  static_cast<int>(state.range(3))};
  const auto dir = std::filesystem::temp_directory_path() /
                   ("fedshard_bench_link_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const pid_t child = ::fork();
  if (child == 0) {
    try {
      (void)run_rank(dir, 1, s, [](double) {});
      ::_exit(0);
    } catch (...) {
      ::_exit(3);
    }
  }
  std::vector<double> seconds;
  std::int64_t sent = 0;
  try {
    sent = run_rank(dir, 0, s, [&](double t) { seconds.push_back(t); });
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  std::filesystem::remove_all(dir);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) state.SkipWithError("rank 1 failed");
  double total = 0;
  std::size_t i = 0;
  for (auto _ : state) {
    const double t = i < seconds.size() ? seconds[i++] : 0.0;
    state.SetIterationTime(t);
    total += t;
  }
  if (total > 0) {
    state.counters["Gbit/s"] = static_cast<double>(s.bytes) * 8 * iterations / total / 1e9;
    state.counters["wire_Gbit/s"] = static_cast<double>(sent) * 8 / total / 1e9;
  }
}

}  // namespace

BENCHMARK(bm_all_reduce)
    ->ArgNames({"MiB", "checked", "pipelined", "stripes"})
    ->ArgsProduct({{1, 16, 64}, {1, 0}, {1, 0}, {1}})
    ->Iterations(iterations)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
// Stripes against one connection, unchecked and pipelined.
BENCHMARK(bm_all_reduce)
    ->ArgNames({"MiB", "checked", "pipelined", "stripes"})
    ->ArgsProduct({{16, 64}, {0}, {1}, {2, 4, 8}})
    ->Iterations(iterations)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
