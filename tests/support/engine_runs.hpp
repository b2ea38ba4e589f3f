#pragma once
/// Test support: the shard engine's training run on one rank, the one body that
/// tests/shard/test_engine.cpp runs on inproc ranks of every test space and
/// tests/mpi/test_engine_mpi.cpp runs on MPI ranks.
///
/// A run trains the tiny MLP (support/tiny_mlp.hpp) for kSteps with plain SGD (p -= lr g,
/// queued on the engine's compute stream); the ranks of a group split each step's batch of
/// group_size * batch_per_rank samples by local rank.

#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/shard/engine.hpp"
#include "support/tiny_mlp.hpp"

namespace fedshard::test::engine_runs {

inline constexpr int kSteps = 5;
inline constexpr int kBatchPerRank = 3;
inline constexpr std::uint64_t kSeed = 7;
inline constexpr float kLr = 0.2f;

/// p -= lr * g, queued on the engine's compute stream like an optimizer step.
struct sgd_step {
  float lr;
  FEDSHARD_HOST_DEVICE void operator()(float& p, float g) const { p -= lr * g; }
};

/// What one rank saw of a run.
struct rank_run {
  std::vector<std::vector<float>> units;  // full parameters after training
  std::vector<float> losses;              // the loss per step
  traffic_counters traffic;               // counters over the steps
  traffic_counters setup_traffic;         // ... over construction
  traffic_counters read_traffic;          // ... reading the units at the end
  plan step_plan, setup_plan, read_plan;
  std::size_t padded_numel = 0;
  traffic_counters planned;        // the step plan x kSteps, with the algorithms the backend runs
  std::int64_t gathering_ops = 0;  // ops of the step plan that the backend runs as gather_all
};

/// Trains the MLP for kSteps with policy P on this rank of mesh m, buffers in space.
template <class P, class C, class S>
rank_run train_rank(mesh<C>& m, S& space, shard::precision prec,
                    int batch_per_rank = kBatchPerRank) {
  rank_run out;
  tiny_mlp model;
  shard::engine<P, C, S> e(m, space, model.units(), prec);
  out.setup_traffic = e.traffic();
  e.traffic().reset();
  for (std::size_t u = 0; u < e.layout().num_units(); ++u)
    e.set_unit(u, model.init_unit(e.layout(), u, kSeed));
  const mesh_shape shape = m.shape();
  const int group_size = shape.replicas * shape.shards;
  const int local = m.coords().replica * shape.shards + m.coords().shard;
  for (int step = 0; step < kSteps; ++step) {
    std::vector<sample> batch;
    for (int i = 0; i < batch_per_rank; ++i)
      batch.push_back(model.make_sample(
          kSeed, static_cast<std::uint64_t>((step * group_size + local) * batch_per_rank + i)));
    e.begin_step();
    out.losses.push_back(model.forward_backward(e, batch));
    e.finish_backward();
    e.space().for_each(e.compute_stream(), sgd_step{kLr}, e.master(),
                       std::span<const float>(e.grad()));
  }
  out.traffic = e.traffic();
  e.traffic().reset();
  for (std::size_t u = 0; u < e.layout().num_units(); ++u) out.units.push_back(e.gather_unit(u));
  out.read_traffic = e.traffic();
  out.step_plan = e.step_plan();
  out.setup_plan = e.setup_plan();
  out.read_plan = e.read_plan();
  const auto algo = [&](const comm_op& op) { return e.interp().algorithm_of(op); };
  out.planned = traffic_counters::of(out.step_plan, kSteps, algo);
  for (const comm_op& op : out.step_plan.ops)
    out.gathering_ops += algo(op) == wire_algorithm::gather_all ? 1 : 0;
  out.padded_numel = e.layout().total_padded_numel();
  return out;
}

/// The two runs ended with the same parameters, bit for bit.
inline bool bit_equal(const rank_run& a, const rank_run& b) {
  if (a.units.size() != b.units.size()) return false;
  for (std::size_t u = 0; u < a.units.size(); ++u) {
    if (a.units[u].size() != b.units[u].size()) return false;
    if (std::memcmp(a.units[u].data(), b.units[u].data(), a.units[u].size() * sizeof(float)) != 0)
      return false;
  }
  return true;
}

}  // namespace fedshard::test::engine_runs
