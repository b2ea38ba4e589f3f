/// What a sub-communicator costs on the inproc backend: making one (a split), and finding one
/// the interpreter made before (its cache of member sets, plan/interpreter.hpp
/// split_members). Groups re-formed per batch (FCP's context-parallel groups, the holder sets
/// of federation::holder_average, the overlap ranges of groups with different shapes) pay the
/// first on the first use of a set and the second on every later one.
///
/// Rows (manual time, read by rank 0 between a barrier before and a barrier after the timed
/// calls, divided by the calls, as bench_collectives does):
/// - split/ranks:N: world.split(rank % 2, rank) on N threads, the new communicator destroyed
///   before the next call: the creation cost of one sub-communicator.
/// - split_members_new/groups:G: interpreter::split_members on the federation axis of a
///   G x 1 x 1 mesh, each call with a set of groups not seen before (the sets 1..2^G-1 in
///   turn, so a run makes at most 2^G - 1 of them): the cost of a cache miss, one split.
/// - split_members_cached/groups:G: the same call with one set made before: the cache hit
///   every later firing of an op among those groups pays (no communication).
/// - all_reduce_4k/fresh:F: a 4 KiB all_reduce among half the ranks on a communicator made
///   for it (fresh = 1: split, call, destroy) or made once (fresh = 0): what re-forming a
///   group for every batch adds to one small collective.

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/interpreter.hpp"

namespace {

using world_type = fedshard::inproc::communicator;

/// Runs setup(world) (untimed, returns the state) then call(state, world, i) for i in
/// [0, iters) on `ranks` threads; returns the seconds rank 0 read between a barrier before
/// and a barrier after the calls, divided by iters.
template <class Setup, class Call>
double per_call_seconds(int ranks, std::int64_t iters, Setup setup, Call call) {
  double seconds = 0.0;
  fedshard::inproc::run(ranks, [&](world_type& world) {
    auto st = setup(world, iters);
    world.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    for (std::int64_t i = 0; i < iters; ++i) call(*st, world, i);
    world.barrier();
    const auto t1 = std::chrono::steady_clock::now();
    if (world.rank() == 0) seconds = std::chrono::duration<double>(t1 - t0).count();
  });
  return seconds / static_cast<double>(iters);
}

template <class Setup, class Call>
void report(benchmark::State& state, int ranks, Setup setup, Call call) {
  double per_call = 0.0;
  try {
    per_call = per_call_seconds(ranks, state.max_iterations, setup, call);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  for (auto _ : state) state.SetIterationTime(per_call);
  state.counters["us_per_call"] = per_call * 1e6;
}

struct nothing {};

void bm_split(benchmark::State& state) {
  report(
      state, static_cast<int>(state.range(0)),
      [](world_type& world, std::int64_t) {
        world_type warm = world.split(world.rank() % 2, world.rank());  // first split's tables
        benchmark::DoNotOptimize(warm.size());
        return std::make_unique<nothing>();
      },
      [](nothing&, world_type& world, std::int64_t) {
        world_type sub = world.split(world.rank() % 2, world.rank());
        benchmark::DoNotOptimize(sub.size());
      });
}

/// A G x 1 x 1 mesh and its interpreters (made before the clock starts: construction is
/// local, no communication).
struct members_state {
  fedshard::mesh<world_type> mesh;
  std::vector<std::unique_ptr<fedshard::interpreter<world_type>>> interps;
  members_state(world_type& world, int groups, std::size_t count)
      : mesh(world, {.groups = groups, .replicas = 1, .shards = 1}) {
    for (std::size_t k = 0; k < count; ++k)
      interps.push_back(std::make_unique<fedshard::interpreter<world_type>>(mesh));
  }
};

void bm_split_members_new(benchmark::State& state) {
  const auto groups = static_cast<int>(state.range(0));
  const std::uint64_t sets = (std::uint64_t{1} << groups) - 1;
  report(
      state, groups,
      [&](world_type& world, std::int64_t iters) {
        // One interpreter per 2^G - 1 calls: every call below meets a set its interpreter
        // has not made (a cache miss).
        const auto count =
            static_cast<std::size_t>((static_cast<std::uint64_t>(iters) - 1) / sets + 1);
        return std::make_unique<members_state>(world, groups, count);
      },
      [&](members_state& st, world_type&, std::int64_t i) {
        const auto k = static_cast<std::uint64_t>(i);
        st.interps[static_cast<std::size_t>(k / sets)]->split_members(fedshard::axis::federation,
                                                                      {k % sets + 1});
      });
}

void bm_split_members_cached(benchmark::State& state) {
  const auto groups = static_cast<int>(state.range(0));
  const std::uint64_t set = (std::uint64_t{1} << groups) - 2;  // every group but group 0
  report(
      state, groups,
      [&](world_type& world, std::int64_t) {
        auto st = std::make_unique<members_state>(world, groups, 1);
        st->interps[0]->split_members(fedshard::axis::federation, {set});  // the miss
        return st;
      },
      [&](members_state& st, world_type&, std::int64_t) {
        st.interps[0]->split_members(fedshard::axis::federation, {set});
      });
}

/// 4 KiB all_reduce among half of 4 ranks.
struct reduce_state {
  static constexpr std::int64_t count = 1024;
  fedshard::aligned_buffer<float> in{count}, out{count};
  world_type made;
  explicit reduce_state(world_type& world) : made(world.split(world.rank() % 2, world.rank())) {
    for (float& x : in) x = static_cast<float>(world.rank());
  }
  void call(world_type& sub) {
    sub.all_reduce(in.data(), out.data(), count, fedshard::dtype::f32, fedshard::reduce_op::sum);
    benchmark::DoNotOptimize(out.data());
  }
};

void bm_all_reduce_4k(benchmark::State& state) {
  const bool fresh = state.range(0) != 0;
  report(
      state, 4,
      [](world_type& world, std::int64_t) { return std::make_unique<reduce_state>(world); },
      [&](reduce_state& st, world_type& world, std::int64_t) {
        if (!fresh) return st.call(st.made);
        world_type sub = world.split(world.rank() % 2, world.rank());
        st.call(sub);
      });
}

}  // namespace

BENCHMARK(bm_split)->ArgName("ranks")->Arg(2)->Arg(4)->Arg(8)->UseManualTime();
BENCHMARK(bm_split_members_new)
    ->ArgName("groups")
    ->Arg(2)
    ->Arg(4)
    ->Arg(8)
    ->Iterations(200)
    ->UseManualTime();
BENCHMARK(bm_split_members_cached)->ArgName("groups")->Arg(2)->Arg(4)->Arg(8)->UseManualTime();
BENCHMARK(bm_all_reduce_4k)->ArgName("fresh")->Arg(0)->Arg(1)->UseManualTime();
