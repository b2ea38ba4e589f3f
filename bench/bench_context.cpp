/// Block placement for context parallelism (plan/context_blocks.hpp): what computing one costs,
/// and how FCP's placement balances attention work and moves keys and values against ring
/// context parallelism without load balancing, on a skewed batch.
///
/// The batch: 64 sequences, 60 short in [128, 2048] tokens and 4 long in [16384, 65536] (at
/// positions 7, 23, 41, 58), from a splitmix64 stream seeded with 2602 (the batch of
/// tests/plan/test_context_blocks.cpp). B = 512 tokens; keys and values of 8 heads x 128
/// (kv_dim 1024) in bf16: 4 KiB per token and layer.
///
/// Rows (time per placement, wall clock):
/// - fcp/ranks:P: fcp_placement of the batch on P ranks;
/// - ring/ranks:P: ring_placement of the batch on P ranks;
/// - fcp_plan/ranks:P: the placement and its plan (plan/context_plan.hpp: the transfers, and
///   rank 0's forward and backward ops), what a batch of new lengths costs each rank; counter
///   ops (rank 0's forward ops);
/// - fcp_plan_cached/ranks:P: context_plan_cache::get of lengths seen before (a lookup).
/// Counters: max_over_mean (the most attention work one rank has over the mean), kv_MB (key
/// and value bytes moved between all ranks, per layer, 1e6 bytes), kv_max_rank_MB (the most
/// one rank receives), blocks (blocks or chunks placed).

#include <benchmark/benchmark.h>

#include <cstdint>
#include <exception>
#include <vector>

#include "fedshard/core/mix.hpp"
#include "fedshard/plan/context_blocks.hpp"
#include "fedshard/plan/context_plan.hpp"

namespace {

std::vector<std::int64_t> skewed_batch() {
  std::uint64_t state = 2602;
  auto next = [&] {
    const std::uint64_t z = fedshard::mix64(state);
    state += 0x9e3779b97f4a7c15ULL;
    return z;
  };
  std::vector<std::int64_t> l;
  for (int i = 0; i < 64; ++i) {
    const bool long_one = i == 7 || i == 23 || i == 41 || i == 58;
    l.push_back(long_one ? 16384 + static_cast<std::int64_t>(next() % 49153)
                         : 128 + static_cast<std::int64_t>(next() % 1921));
  }
  return l;
}

template <class Place>
void run(benchmark::State& state, Place place) {
  const std::vector<std::int64_t> lengths = skewed_batch();
  const fedshard::context_settings s{.block_tokens = 512,
                                     .ranks = static_cast<int>(state.range(0)),
                                     .kv_dim = 1024,
                                     .element_bytes = 2};
  fedshard::context_placement p;
  try {
    for (auto _ : state) {
      p = place(lengths, s);
      benchmark::DoNotOptimize(p.work.data());
    }
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  state.counters["max_over_mean"] = p.imbalance();
  state.counters["kv_MB"] = static_cast<double>(p.total_bytes()) / 1e6;
  state.counters["kv_max_rank_MB"] = static_cast<double>(p.max_received_bytes()) / 1e6;
  state.counters["blocks"] = static_cast<double>(p.blocks.size());
}

void bm_fcp(benchmark::State& state) {
  run(state, [](const std::vector<std::int64_t>& l, const fedshard::context_settings& s) {
    return fedshard::fcp_placement(l, s);
  });
}

void bm_ring(benchmark::State& state) {
  run(state, [](const std::vector<std::int64_t>& l, const fedshard::context_settings& s) {
    return fedshard::ring_placement(l, s);
  });
}

fedshard::context_settings batch_settings(const benchmark::State& state) {
  return {.block_tokens = 512,
          .ranks = static_cast<int>(state.range(0)),
          .kv_dim = 1024,
          .element_bytes = 2};
}

void bm_fcp_plan(benchmark::State& state) {
  const std::vector<std::int64_t> lengths = skewed_batch();
  const fedshard::context_settings s = batch_settings(state);
  std::size_t ops = 0;
  for (auto _ : state) {
    const fedshard::context_plan plan(fedshard::fcp_placement(lengths, s), s,
                                      fedshard::axis::group);
    ops = plan.forward(0).ops.size();
    benchmark::DoNotOptimize(plan.backward(0).ops.data());
  }
  state.counters["ops"] = static_cast<double>(ops);
}

void bm_fcp_plan_cached(benchmark::State& state) {
  const std::vector<std::int64_t> lengths = skewed_batch();
  fedshard::context_plan_cache cache(batch_settings(state), fedshard::axis::group);
  (void)cache.get(lengths);
  for (auto _ : state) benchmark::DoNotOptimize(cache.get(lengths).get());
}

}  // namespace

BENCHMARK(bm_fcp_plan)
    ->Name("fcp_plan")
    ->ArgName("ranks")
    ->Arg(8)
    ->Arg(64)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_fcp_plan_cached)
    ->Name("fcp_plan_cached")
    ->ArgName("ranks")
    ->Arg(8)
    ->Arg(64)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_fcp)->Name("fcp")->ArgName("ranks")->Arg(8)->Arg(64)->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_ring)->Name("ring")->ArgName("ranks")->Arg(8)->Arg(64)->Unit(benchmark::kMicrosecond);
