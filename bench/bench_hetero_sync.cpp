// The sub-communicators of a heterogeneous mesh's sync (federation/overlap.hpp): making the
// holder sets' communicators (interpreter::split_members, once per run, at the first sync)
// against finding them again (a later sync: every set is cached, nothing is split), and one
// sync's exchange for scale. Inproc ranks on groups 2x4 and 1x2 (10 ranks, 6 federation
// ranks), tiny_mlp-sized units scaled up; manual time: rank 0's seconds in the call alone.
#include <benchmark/benchmark.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/federation/overlap.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/interpreter.hpp"
#include "fedshard/shard/flat_layout.hpp"

namespace {

using namespace fedshard;

const std::vector<group_shape> groups{{2, 4}, {1, 2}};

std::vector<unit_spec> units(int n, std::int64_t width) {
  std::vector<unit_spec> u;
  for (int i = 0; i < n; ++i)
    u.push_back({.name = "u" + std::to_string(i),
                 .tensors = {{.name = "w", .shape = {width, width + 3}, .type = dtype::f32}}});
  return u;
}

enum class what { create, cached, exchange };

void run(benchmark::State& state, what w) {
  const int n_units = static_cast<int>(state.range(0));
  const auto spec = units(n_units, 64);
  std::int64_t sets = 0, bytes = 0;
  for (auto _ : state) {
    std::atomic<double> seconds{0};
    inproc::run(10, [&](inproc::communicator& world) {
      mesh m(world, groups);
      interpreter<inproc::communicator> interp(m);
      const mesh_coords c = m.coords();
      const flat_layout mine(spec, m.shape().shards);
      auto map = federation::make_overlap_map(mine, groups, c,
                                              [](const mesh_shape& v) { return v.shards; });
      std::vector<int> all;
      for (int u = 0; u < n_units; ++u) all.push_back(u);
      const auto member_sets = federation::overlap_member_sets(*map, {all});
      const bool leader = c.replica == 0;
      std::vector<float> buf(mine.total_shard_numel(), 1.0f);
      const plan p =
          federation::overlap_average_ops(*map, all, 0, buf.size(), {.role = role::fragment},
                                          trigger::sync_exchange, trigger::sync_finish);
      world.barrier();
      if (w != what::create && leader) interp.split_members(axis::federation, member_sets);
      world.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      if (leader) {
        if (w == what::exchange)
          interp.wait(interp.fire(
              p, {.trigger = trigger::sync_exchange, .phase = phase::sync, .fragment = 0},
              [&](const comm_op&, const operand&) { return view(std::span<float>(buf)); }));
        else
          interp.split_members(axis::federation, member_sets);
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      world.barrier();
      if (world.rank() == 0) {
        seconds = s;
        sets = static_cast<std::int64_t>(member_sets.size());
        bytes = static_cast<std::int64_t>(p.wire_bytes_on(axis::federation));
      }
    });
    state.SetIterationTime(seconds.load());
  }
  state.counters["holder_sets"] = static_cast<double>(sets);
  state.SetItemsProcessed(state.iterations() * sets);
  if (w == what::exchange) state.SetBytesProcessed(state.iterations() * bytes);
}

void BM_holder_sets_create(benchmark::State& s) {
  run(s, what::create);
}
void BM_holder_sets_cached(benchmark::State& s) {
  run(s, what::cached);
}
void BM_hetero_exchange(benchmark::State& s) {
  run(s, what::exchange);
}

BENCHMARK(BM_holder_sets_create)
    ->Arg(4)
    ->Arg(32)
    ->UseManualTime()
    ->Iterations(200)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_holder_sets_cached)
    ->Arg(4)
    ->Arg(32)
    ->UseManualTime()
    ->Iterations(200)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_hetero_exchange)
    ->Arg(4)
    ->Arg(32)
    ->UseManualTime()
    ->Iterations(200)
    ->Unit(benchmark::kMicrosecond);

}  // namespace
