// The trainer on GPUs: with gpu_inproc (4 and 8 ranks sharing one GPU) it trains exactly as
// the host inproc run does, for ddp, fsdp, hsdp, fl_hsdp (K = 4) and diloco; with
// nccl::communicator (one rank per GPU present) it trains as the host run does up to NCCL's
// reduction order. The model is a small MLP whose compute, on a device, is CUDA kernels on
// the step context's stream, and on the host the same functions in loops: every float
// operation is an explicitly rounded one (__fadd_rn, __fmul_rn, ...), in the same order, so
// the two compute the same bits.
#include "fedshard/cuda/gpu_inproc.cuh"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <thread>
#include <type_traits>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/cuda/cuda_space.cuh"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "gpu/device_mlp.cuh"

#if defined(FEDSHARD_HAS_NCCL)
#include "fedshard/cuda/nccl.cuh"
#endif

namespace {

namespace gpu = fedshard::gpu;
namespace gpu_inproc = fedshard::gpu_inproc;
using namespace fedshard;

/// The device MLP of examples/gpu at tiny_mlp's sizes (8 inputs, 2 hidden layers of 16, 4
/// outputs), 3 samples per rank.
struct tiny_device_mlp : fedshard_examples::device_mlp {
  tiny_device_mlp() { cfg = {.input = 8, .hidden = 16, .output = 4, .hidden_layers = 2}; }
};
constexpr int per_rank = 3;

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

double max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::abs(double(a[i]) - b[i]) / std::max(1e-2, std::abs(double(b[i]))));
  return worst;
}

template <class A>
void check_same(const char* name, mesh_shape shape, int period = 4) {
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

static_assert(std::is_same_v<
              trainer<tiny_device_mlp, ddp, optim::adamw, gpu_inproc::communicator>::space_type,
              gpu::cuda_space>);

TEST_CASE("the trainer on gpu_inproc (4 ranks on one GPU) equals the host inproc run") {
  check_same<ddp>("ddp", {1, 4, 1});
  check_same<fsdp>("fsdp", {1, 1, 4});
  check_same<hsdp>("hsdp", {1, 2, 2});
  check_same<fl_hsdp>("fl_hsdp, K = 4", {2, 1, 2}, 4);
  check_same<diloco>("diloco, H = 3", {2, 1, 2}, 3);
}

TEST_CASE("the trainer on gpu_inproc (8 ranks on one GPU) equals the host inproc run") {
  check_same<ddp>("ddp", {1, 8, 1});
  check_same<fsdp>("fsdp", {1, 1, 8});
  check_same<hsdp>("hsdp", {1, 2, 4});
  check_same<fl_hsdp>("fl_hsdp, K = 4", {2, 2, 2}, 4);
  check_same<diloco>("diloco, H = 3", {2, 2, 2}, 3);
}

#if defined(FEDSHARD_HAS_NCCL)
static_assert(
    std::is_same_v<trainer<tiny_device_mlp, fsdp, optim::adamw, nccl::communicator>::space_type,
                   gpu::cuda_space>);

/// Runs A on one NCCL rank per GPU (one thread each) and compares with the host run; NCCL
/// reduces in its own order, so within 1e-5.
template <class A>
void check_nccl(const char* name, mesh_shape shape) {
  const int steps = 4;
  const outcome want = on_host<A>(shape, steps, 4);
  std::vector<int> devices(static_cast<std::size_t>(shape.size()));
  for (int i = 0; i < shape.size(); ++i) devices[static_cast<std::size_t>(i)] = i;
  auto comms = nccl::communicator::init_all(devices);
  outcome got;
  got.params.resize(devices.size());
  got.losses.resize(devices.size());
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(devices.size());
  for (std::size_t r = 0; r < devices.size(); ++r)
    threads.emplace_back([&, r] {
      try {
        FEDSHARD_CUDA_TRY(cudaSetDevice(devices[r]));
        train_rank<A>(comms[r], shape, steps, options_of<A>(4, steps), got);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& th : threads) th.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  for (std::size_t r = 0; r < devices.size(); ++r) {
    INFO(name, " on ", devices.size(), " NCCL ranks, rank ", r);
    CHECK(max_rel(got.params[r], want.params[r]) <= 1e-5);
  }
}

TEST_CASE("the trainer on nccl::communicator (one rank per GPU) trains as the host run does") {
  const int n = gpu::device_count();
  if (n < 1) return;
  check_nccl<ddp>("ddp", {1, n, 1});
  check_nccl<fsdp>("fsdp", {1, 1, n});
}
#endif

}  // namespace
