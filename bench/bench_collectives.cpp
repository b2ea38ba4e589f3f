/// inproc collectives (ranks are threads) on float buffers, with nccl-tests counters, and the
/// single-thread memcpy of the same bytes that bounds them.
///
/// S (the `bytes` argument) is the whole array, as in nccl-tests: the all_reduce and
/// broadcast buffer, the all_gather output, the reduce_scatter input. Counters: algbw = S / t
/// and busbw = algbw * 2(n-1)/n (all_reduce), * (n-1)/n (all_gather, reduce_scatter), * 1
/// (broadcast), both in GB/s = 1e9 bytes/s. all_reduce, all_gather and reduce_scatter are out
/// of place (the nccl-tests default), broadcast is in place from root 0.
///
/// Timing (see bench/README.md): Google Benchmark's thread only starts and joins the ranks.
/// Each benchmark run calls inproc::run(n, ...) once; every rank allocates and touches its
/// buffers, runs a few untimed warm-up calls, then rank 0 reads the clock between a barrier
/// before and a barrier after state.max_iterations back-to-back calls. That time divided by
/// the iterations is reported as manual time, so rank start-up, allocation and warm-up are
/// never timed and no per-iteration handshake with the benchmark thread perturbs the loop.

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"

namespace {

enum class op_kind { all_reduce, all_gather, reduce_scatter, broadcast };

constexpr int warmup_calls = 3;

double bus_factor(op_kind op, int n) {
  switch (op) {
    case op_kind::all_reduce: return 2.0 * (n - 1) / n;
    case op_kind::all_gather:
    case op_kind::reduce_scatter: return static_cast<double>(n - 1) / n;
    case op_kind::broadcast: break;
  }
  return 1.0;
}

/// Seconds that `iters` back-to-back calls of `op` on S = bytes take on `ranks` threads,
/// from a barrier before the first call to a barrier after the last, read by rank 0.
double time_inproc(op_kind op, std::int64_t bytes, int ranks, std::int64_t iters) {
  double seconds = 0.0;
  fedshard::inproc::run(ranks, [&](fedshard::inproc::communicator& world) {
    const auto whole = static_cast<std::size_t>(bytes) / sizeof(float);
    const auto block = whole / static_cast<std::size_t>(ranks);
    const bool whole_in = op == op_kind::all_reduce || op == op_kind::reduce_scatter;
    const bool whole_out = op != op_kind::reduce_scatter;
    // aligned_buffer zero-fills, so every page is touched here by the rank that owns it.
    fedshard::aligned_buffer<float> in(op == op_kind::broadcast ? 0 : whole_in ? whole : block);
    fedshard::aligned_buffer<float> out(whole_out ? whole : block);
    for (float& x : in) x = static_cast<float>(world.rank() + 1);
    const auto call = [&] {
      switch (op) {
        case op_kind::all_reduce:
          world.all_reduce(in.data(), out.data(), static_cast<std::int64_t>(whole),
                           fedshard::dtype::f32, fedshard::reduce_op::sum);
          break;
        case op_kind::all_gather:
          world.all_gather(in.data(), out.data(), static_cast<std::int64_t>(block),
                           fedshard::dtype::f32);
          break;
        case op_kind::reduce_scatter:
          world.reduce_scatter(in.data(), out.data(), static_cast<std::int64_t>(block),
                               fedshard::dtype::f32, fedshard::reduce_op::sum);
          break;
        case op_kind::broadcast:
          world.broadcast(out.data(), static_cast<std::int64_t>(whole), fedshard::dtype::f32, 0);
          break;
      }
    };
    for (int i = 0; i < warmup_calls; ++i) call();
    world.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    for (std::int64_t i = 0; i < iters; ++i) call();
    world.barrier();
    const auto t1 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(out.data());
    if (world.rank() == 0) seconds = std::chrono::duration<double>(t1 - t0).count();
  });
  return seconds;
}

void bm_inproc(benchmark::State& state, op_kind op) {
  const std::int64_t bytes = state.range(0);
  const auto ranks = static_cast<int>(state.range(1));
  double seconds = 0.0;
  try {
    seconds = time_inproc(op, bytes, ranks, state.max_iterations);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  const double per_iter = seconds / static_cast<double>(state.max_iterations);
  for (auto _ : state) state.SetIterationTime(per_iter);
  state.SetBytesProcessed(state.iterations() * bytes);
  const double algbw = static_cast<double>(bytes) / per_iter / 1e9;
  state.counters["algbw"] = algbw;
  state.counters["busbw"] = algbw * bus_factor(op, ranks);
}

/// One thread copying S bytes: p of these is the shared-memory bound of a p-rank all_reduce
/// (it must read p buffers of S and write p buffers of S).
void bm_memcpy(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  fedshard::aligned_buffer<float> src(bytes / sizeof(float));
  fedshard::aligned_buffer<float> dst(bytes / sizeof(float));
  for (float& x : src) x = 1.0f;
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
  const auto gigabytes = static_cast<double>(state.iterations()) * static_cast<double>(bytes) / 1e9;
  state.counters["algbw"] = benchmark::Counter(gigabytes, benchmark::Counter::kIsRate);
  state.counters["busbw"] = benchmark::Counter(gigabytes, benchmark::Counter::kIsRate);
}

constexpr std::int64_t min_bytes = std::int64_t{4} << 10;
constexpr std::int64_t max_bytes = std::int64_t{64} << 20;

void collective_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"bytes", "ranks"});
  for (const std::int64_t ranks : {2, 4})
    for (std::int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) b->Args({bytes, ranks});
}

/// Every power of two up to 4 x max_bytes, so that memcpy of p * S (the same working set as a
/// p-rank all_reduce of S) is measured too.
void memcpy_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"bytes"});
  for (std::int64_t bytes = min_bytes; bytes <= 4 * max_bytes; bytes *= 2) b->Args({bytes});
}

}  // namespace

BENCHMARK_CAPTURE(bm_inproc, all_reduce, op_kind::all_reduce)
    ->Apply(collective_args)
    ->UseManualTime();
BENCHMARK_CAPTURE(bm_inproc, all_gather, op_kind::all_gather)
    ->Apply(collective_args)
    ->UseManualTime();
BENCHMARK_CAPTURE(bm_inproc, reduce_scatter, op_kind::reduce_scatter)
    ->Apply(collective_args)
    ->UseManualTime();
BENCHMARK_CAPTURE(bm_inproc, broadcast, op_kind::broadcast)
    ->Apply(collective_args)
    ->UseManualTime();
BENCHMARK(bm_memcpy)->Apply(memcpy_args)->UseRealTime();
