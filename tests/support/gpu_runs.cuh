#pragma once
/// Test support for the trainer on GPUs (tests/cuda/): a small device MLP, one run of an
/// algorithm on inproc ranks (host memory) and on gpu_inproc ranks sharing GPU 0, and the
/// comparison of the two.

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/cuda/cuda_space.cuh"
#include "fedshard/cuda/gpu_inproc.cuh"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "gpu/device_mlp.cuh"

namespace fedshard::test::gpu_runs {

namespace gpu_inproc = fedshard::gpu_inproc;

/// The device MLP of examples/gpu at tiny_mlp's sizes (8 inputs, 2 hidden layers of 16, 4
/// outputs), 3 samples per rank.
struct tiny_device_mlp : fedshard_examples::device_mlp {
  tiny_device_mlp() { cfg = {.input = 8, .hidden = 16, .output = 4, .hidden_layers = 2}; }
};
inline constexpr int per_rank = 3;

// ---------------------------------------------------------------- runs

/// Every rank's final parameters and losses.
struct outcome {
  std::vector<std::vector<float>> params, losses;
};

/// Trains device_mlp for `steps` on one rank of a mesh over `world` (any communicator).
template <class A, class C>
void train_rank(C& world, mesh_shape shape, int steps, trainer_options<A> opts, outcome& out) {
  mesh m(world, shape);
  trainer<tiny_device_mlp, A, optim::adamw, C> t(m, tiny_device_mlp{}, {.lr = 0.01f}, opts);
  const int g = m.coords().group;
  const int gs = shape.replicas * shape.shards;
  const int local = m.coords().replica * shape.shards + m.coords().shard;
  std::vector<float> losses;
  for (int s = 0; s < steps; ++s)
    losses.push_back(
        t.step(tiny_device_mlp::batch(s, g * gs + local, shape.groups * gs, per_rank)));
  // the evaluation loss on the next batch (forward only) goes with the training losses
  losses.push_back(
      t.evaluate(tiny_device_mlp::batch(steps, g * gs + local, shape.groups * gs, per_rank)));
  const auto r = static_cast<std::size_t>(world.rank());
  out.params[r] = t.parameters();
  out.losses[r] = losses;
}

template <class A>
trainer_options<A> options_of(int period, int steps) {
  trainer_options<A> o;
  if constexpr (requires { o.schedule.period; }) o.schedule.period = period;
  o.total_steps = steps;
  return o;
}

template <class A>
outcome on_host(mesh_shape shape, int steps, int period) {
  outcome out;
  out.params.resize(static_cast<std::size_t>(shape.size()));
  out.losses.resize(out.params.size());
  inproc::run(shape.size(), [&](inproc::communicator& world) {
    train_rank<A>(world, shape, steps, options_of<A>(period, steps), out);
  });
  return out;
}

template <class A>
outcome on_gpu_inproc(mesh_shape shape, int steps, int period) {
  outcome out;
  out.params.resize(static_cast<std::size_t>(shape.size()));
  out.losses.resize(out.params.size());
  gpu_inproc::options o;
  o.devices = {0};
  o.timeout = std::chrono::seconds(120);
  gpu_inproc::run(
      shape.size(),
      [&](gpu_inproc::communicator& world) {
        train_rank<A>(world, shape, steps, options_of<A>(period, steps), out);
      },
      o);
  return out;
}

inline double max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::abs(double(a[i]) - b[i]) / std::max(1e-2, std::abs(double(b[i]))));
  return worst;
}

template <class A>
inline void check_same(const char* name, mesh_shape shape, int period = 4) {
  const int steps = 6;
  const outcome want = on_host<A>(shape, steps, period);
  const outcome got = on_gpu_inproc<A>(shape, steps, period);
  for (int r = 0; r < shape.size(); ++r) {
    const auto u = static_cast<std::size_t>(r);
    INFO(name, " on ", shape.size(), " ranks (", shape.groups, " x ", shape.replicas, " x ",
         shape.shards, "), rank ", r);
    REQUIRE(!got.params[u].empty());
    CHECK(max_rel(got.params[u], want.params[u]) <= 1e-6);
    CHECK(max_rel(got.losses[u], want.losses[u]) <= 1e-6);
  }
}

}  // namespace fedshard::test::gpu_runs
