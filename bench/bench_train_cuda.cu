/// Training on one GPU, side by side in one run: the device MLP of examples/gpu/device_mlp.cuh
/// trained by fedshard::trainer (AdamW) on gpu_inproc ranks that all share device 0, against
/// the same model trained by one rank alone.
///
/// The model: input 1024, 4 hidden layers of 1024 (softsign), output 64, 256 samples per rank
/// and step (environment FEDSHARD_TRAIN_INPUT, _HIDDEN, _LAYERS, _OUTPUT, _BATCH override
/// them; _STEPS the timed steps, 40). Its matrix products are a tiled kernel of explicitly
/// rounded float operations (about 3 G multiply-adds per rank and step at the default sizes)
/// and the batch is generated on the device, so a step is compute on the step context's
/// stream plus the algorithm's collectives, no host data.
///
/// Rows, train/<algorithm>/ranks:<R>:
///   unsharded/1: ddp on one rank (no peer, so no communication): the compute reference;
///   ddp, fsdp, hsdp, fl_hsdp (K = 4) and diloco (H = 4) on 4 and 8 ranks, meshes
///   (G x R x S) ddp 1 x R x 1, fsdp 1 x 1 x R, hsdp 1 x 2 x R/2, fl_hsdp and diloco
///   2 x 1 x 2 (4 ranks) and 2 x 2 x 2 (8 ranks).
/// Every rank trains on its own batch of the same size as the reference's.
///
/// Timing: one gpu_inproc::run per measurement; every rank builds its trainer, takes 3
/// untimed steps, synchronizes the device and enters a barrier; rank 0 reads steady_clock;
/// all ranks take `steps` steps (each returns the loss read on the host); every rank
/// synchronizes the device and enters a barrier; rank 0 reads the clock again. t_R = that
/// time / steps. Each row first measures t_1, the unsharded one-rank step, the same way, then
/// its own run: the two are taken back to back in the same process.
///
/// Counters: step_ms = t_R; ref_step_ms = t_1; tokens_per_s = R x batch / t_R (a token is one
/// sample); overlap_efficiency = R x t_1 / t_R. The R ranks share one GPU, so their compute
/// is R times the reference's; with communication fully hidden behind compute t_R = R x t_1
/// and the efficiency is 1, below 1 by the share of the step that communication (or
/// synchronization) adds, above 1 when ranks' kernels fill the GPU better together (on
/// unsharded/1 it is two one-rank runs against each other: the noise). comm_MB_per_step:
/// rank 0's bytes at the wire per step (array bytes, payload_bytes of the trainer's traffic
/// counters), also the row's bytes_per_second; loss: rank 0's last loss.
///
/// Without a CUDA device the program prints why and exits with 77.

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "fedshard/cuda/cuda_space.cuh"
#include "fedshard/cuda/error.cuh"
#include "fedshard/cuda/gpu_inproc.cuh"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "gpu/device_mlp.cuh"

namespace {

namespace gpu = fedshard::gpu;
namespace gpu_inproc = fedshard::gpu_inproc;
using fedshard_examples::device_mlp;
using fedshard_examples::mlp_config;

/// An environment variable as a positive int, or `fallback`.
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  const int n = std::atoi(v);
  return n > 0 ? n : fallback;
}

/// What every row trains.
struct setup {
  mlp_config model;
  int batch = 256;  ///< samples per rank and step
  int steps = 40;   ///< timed steps
  int warmup = 3;   ///< untimed steps before them
  int period = 4;   ///< K of fl_hsdp, H of diloco

  static setup from_env() {
    setup s;
    s.model = {.input = env_int("FEDSHARD_TRAIN_INPUT", 1024),
               .hidden = env_int("FEDSHARD_TRAIN_HIDDEN", 1024),
               .output = env_int("FEDSHARD_TRAIN_OUTPUT", 64),
               .hidden_layers = env_int("FEDSHARD_TRAIN_LAYERS", 4)};
    s.batch = env_int("FEDSHARD_TRAIN_BATCH", 256);
    s.steps = env_int("FEDSHARD_TRAIN_STEPS", 40);
    return s;
  }
};

/// One measurement: seconds per step, rank 0's wire bytes per step and last loss.
struct measured {
  double step_s = 0.0;
  double comm_bytes_per_step = 0.0;
  float loss = 0.0f;
};

/// Trains with A on shape.size() gpu_inproc ranks of device 0; see the file comment.
template <class A>
measured time_training(const setup& s, fedshard::mesh_shape shape) {
  const int ranks = shape.size();
  measured out;
  gpu_inproc::options o;
  o.devices = {0};
  o.timeout = std::chrono::seconds(300);
  gpu_inproc::run(
      ranks,
      [&](gpu_inproc::communicator& world) {
        fedshard::mesh m(world, shape);
        fedshard::trainer_options<A> opts;
        if constexpr (requires { opts.schedule.period; }) opts.schedule.period = s.period;
        opts.total_steps = s.warmup + s.steps;
        fedshard::trainer<device_mlp, A, fedshard::optim::adamw, gpu_inproc::communicator> t(
            m, device_mlp{s.model}, {.lr = 1e-3f}, opts);
        const int rank = world.rank();
        auto step = [&](int i) { return t.step(device_mlp::batch(i, rank, ranks, s.batch)); };
        for (int i = 0; i < s.warmup; ++i) step(i);
        FEDSHARD_CUDA_TRY(cudaDeviceSynchronize());
        world.barrier();
        const auto bytes0 = t.traffic().total().payload_bytes;
        const auto t0 = std::chrono::steady_clock::now();
        float loss = 0.0f;
        for (int i = s.warmup; i < s.warmup + s.steps; ++i) loss = step(i);
        FEDSHARD_CUDA_TRY(cudaDeviceSynchronize());
        world.barrier();
        const auto t1 = std::chrono::steady_clock::now();
        if (rank == 0) {
          out.step_s = std::chrono::duration<double>(t1 - t0).count() / s.steps;
          out.comm_bytes_per_step =
              static_cast<double>(t.traffic().total().payload_bytes - bytes0) / s.steps;
          out.loss = loss;
        }
      },
      o);
  return out;
}

/// A row: t_1 (unsharded, one rank), then A on `shape`; see the file comment.
template <class A>
void bm_train(benchmark::State& state, const setup& s, fedshard::mesh_shape shape) {
  const int ranks = shape.size();
  measured ref, run;
  try {
    ref = time_training<fedshard::ddp>(s, {1, 1, 1});
    run = time_training<A>(s, shape);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  for (auto _ : state) state.SetIterationTime(run.step_s);
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(run.comm_bytes_per_step));
  state.SetItemsProcessed(state.iterations() * ranks * s.batch);
  state.counters["step_ms"] = run.step_s * 1e3;
  state.counters["ref_step_ms"] = ref.step_s * 1e3;
  state.counters["tokens_per_s"] = ranks * s.batch / run.step_s;
  state.counters["overlap_efficiency"] = ranks * ref.step_s / run.step_s;
  state.counters["comm_MB_per_step"] = run.comm_bytes_per_step / 1e6;
  state.counters["loss"] = run.loss;
  state.counters["ranks"] = ranks;
  state.counters["batch_per_rank"] = s.batch;
}

template <class A>
void add_row(const setup& s, const char* algorithm, fedshard::mesh_shape shape) {
  const std::string name =
      std::string("train/") + algorithm + "/ranks:" + std::to_string(shape.size());
  benchmark::RegisterBenchmark(name.c_str(),
                               [s, shape](benchmark::State& st) { bm_train<A>(st, s, shape); })
      ->Iterations(s.steps)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  if (gpu::device_count() == 0) {
    std::fprintf(stderr, "bench_train_cuda: no CUDA device; nothing to measure\n");
    return 77;
  }
  const setup s = setup::from_env();
  std::printf(
      "bench_train_cuda: MLP input %d, %d hidden layers of %d, output %d; %d samples per rank, "
      "%d timed steps\n",
      s.model.input, s.model.hidden_layers, s.model.hidden, s.model.output, s.batch, s.steps);
  add_row<fedshard::ddp>(s, "unsharded", {1, 1, 1});
  for (const int r : {4, 8}) {
    add_row<fedshard::ddp>(s, "ddp", {1, r, 1});
    add_row<fedshard::fsdp>(s, "fsdp", {1, 1, r});
    add_row<fedshard::hsdp>(s, "hsdp", {1, 2, r / 2});
    add_row<fedshard::fl_hsdp>(s, "fl_hsdp", {2, r / 4, 2});
    add_row<fedshard::diloco>(s, "diloco", {2, r / 4, 2});
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
