#pragma once
/// Test support: one rank's training run of the tiny MLP on any world (an inproc world, a
/// hybrid world of group-side and federation-side communicators, ...), with what the tests
/// compare: the parameters, the losses and the per-axis traffic.

#include <cstdint>
#include <vector>

#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/plan/traffic.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/tiny_mlp.hpp"

namespace fedshard::test {

/// What a rank ended a run with.
struct run_outcome {
  std::vector<float> params;
  std::vector<float> losses;
  traffic_counters traffic;
  std::int64_t syncs = 0;
};

/// train_mlp (below) with the federation policy's settings `fed`.
template <class A, class C>
run_outcome train_mlp_with(C& world, mesh_shape shape, int steps, int period,
                           typename A::federation_policy::config fed,
                           std::uint64_t data_seed = 11) {
  mesh m(world, shape);
  trainer_options<A> o;
  o.total_steps = steps;
  o.schedule.period = period;
  o.federation = fed;
  trainer<mlp_model, A, optim::adamw, C> t(m, mlp_model{}, {.lr = 0.02f}, o);
  const int g = m.coords().group;
  const int gs = shape.replicas * shape.shards;
  const int local = m.coords().replica * shape.shards + m.coords().shard;
  run_outcome r;
  for (int s = 0; s < steps; ++s)
    r.losses.push_back(t.step(t.model().batch(data_seed, s, g, shape.groups, local, gs, 2)));
  r.traffic = t.traffic();
  r.params = t.parameters();
  r.syncs = t.syncs_applied();
  return r;
}

/// Trains on this rank of `world` (a mesh of `shape`) for `steps` steps of A, syncing every
/// `period` steps, with AdamW; every rank's batch depends only on (step, group, local rank).
template <class A, class C>
run_outcome train_mlp(C& world, mesh_shape shape, int steps, int period,
                      std::uint64_t data_seed = 11) {
  return train_mlp_with<A>(world, shape, steps, period, {}, data_seed);
}

}  // namespace fedshard::test
