#pragma once
// Timings of this machine that fedshard-sim --predict-demo calibrates its `local` cluster
// with (see predict_demo.hpp): the demo's compute with no communication, AdamW alone, inproc
// collectives as the demo's plans run them, and the memory bandwidth of a rank.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "demo/demo_run.hpp"
#include "fedshard/core/buffer.hpp"
#include "fedshard/plan/comm_op.hpp"

namespace predict_demo {

using fedshard::comm_kind;

constexpr int world_size = 8;  // the demo's ranks
constexpr int sites = 2;       // the demo's sites

inline fedshard::inproc::options run_options() {
  fedshard::inproc::options o;
  o.spin_polls = 0;  // as the demo: waiting ranks sleep, so the ranks they wait for compute
  return o;
}

using clock = std::chrono::steady_clock;
inline double since(clock::time_point t0) {
  return std::chrono::duration<double>(clock::now() - t0).count();
}

/// What time_local_steps measured.
struct alone_timing {
  double step = 0;  ///< mean seconds of a step of the world: the slowest rank's, barrier to barrier
  double rank = 0;  ///< mean seconds of one rank's step (its own start to its own end)
};

/// 8 ranks each training charlm alone on a 1x1x1 mesh with shard policy Shard (its engine's
/// own work per step, no communication), with the demo's step loop: a barrier before and
/// after each step.
template <fedshard::shard::ShardPolicy Shard>
alone_timing time_local_steps(const demo::settings& s, const charlm::corpus& data, int steps) {
  using alone =
      fedshard::algorithm<Shard, fedshard::federation::none, fedshard::schedule::every_step>;
  const charlm::dims dims{data.vocab(), 8, 16, s.hidden};
  double world_seconds = 0;
  std::vector<double> own(static_cast<std::size_t>(world_size * steps));
  fedshard::inproc::run(
      world_size,
      [&](fedshard::inproc::communicator& world) {
        const int rank = world.rank();
        fedshard::inproc::communicator self = world.split(rank, 0);
        fedshard::mesh m(self, {1, 1, 1});
        fedshard::trainer<charlm::model, alone, fedshard::optim::adamw,
                          fedshard::inproc::communicator>
            t(m, charlm::model(dims, s.seed), {.lr = s.lr, .weight_decay = 0.0f});
        double total = 0;
        constexpr int warmup = 2;
        for (int step = 0; step < warmup + steps; ++step) {
          const auto b =
              charlm::model::training_batch(data, dims.context, s.seed, step, rank, s.batch);
          world.barrier();
          const auto t0 = clock::now();
          t.step(b);
          const double mine = since(t0);
          world.barrier();
          if (step < warmup) continue;
          total += since(t0);
          own[static_cast<std::size_t>(rank * steps + step - warmup)] = mine;
        }
        if (rank == 0) world_seconds = total / steps;
      },
      run_options());
  alone_timing out;
  out.step = world_seconds;
  for (double x : own) out.rank += x;
  out.rank /= static_cast<double>(own.size());
  return out;
}

/// Seconds of one AdamW step over `elements` per rank, 8 ranks at once.
inline double time_adamw(std::size_t elements, int steps) {
  double seconds = 0;
  fedshard::inproc::run(
      world_size,
      [&](fedshard::inproc::communicator& world) {
        fedshard::optim::adamw opt({.lr = 1e-3f, .weight_decay = 0.0f}, elements);
        fedshard::aligned_buffer<float> p(elements), g(elements);
        for (std::size_t i = 0; i < elements; ++i) g[i] = 1e-3f * static_cast<float>(i % 97);
        fedshard::space::host_space::stream st;
        opt.step(std::span<float>(p.data(), elements), std::span<const float>(g.data(), elements),
                 1e-3f, st);  // warm-up
        world.barrier();
        const auto t0 = clock::now();
        for (int i = 0; i < steps; ++i)
          opt.step(std::span<float>(p.data(), elements), std::span<const float>(g.data(), elements),
                   1e-3f, st);
        world.barrier();
        if (world.rank() == 0) seconds = since(t0) / steps;
      },
      run_options());
  return seconds;
}

/// Seconds of one collective of kind k over S = bytes, on communicators of n ranks: the 8
/// ranks split into 8 / n of them, all running it at once, each call issued as the
/// interpreter issues it (async, run on the communicator's progress thread, then waited for:
/// the hand-offs between the threads are part of its cost on cores the ranks share).
inline double time_collective(comm_kind k, int n, std::int64_t bytes, int iters) {
  double seconds = 0;
  fedshard::inproc::run(
      world_size,
      [&](fedshard::inproc::communicator& world) {
        fedshard::inproc::communicator c = world.split(world.rank() / n, world.rank());
        const auto whole = static_cast<std::int64_t>(bytes / 4);
        const std::int64_t block = whole / n;
        fedshard::aligned_buffer<float> in(static_cast<std::size_t>(whole));
        fedshard::aligned_buffer<float> out(static_cast<std::size_t>(whole));
        for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i % 13);
        auto call = [&] {
          switch (k) {
            case comm_kind::all_reduce:
              c.all_reduce_async(in.data(), out.data(), whole, fedshard::dtype::f32,
                                 fedshard::reduce_op::sum)
                  .wait();
              break;
            case comm_kind::all_gather:
              c.all_gather_async(in.data(), out.data(), block, fedshard::dtype::f32).wait();
              break;
            case comm_kind::reduce_scatter:
              c.reduce_scatter_async(in.data(), out.data(), block, fedshard::dtype::f32,
                                     fedshard::reduce_op::sum)
                  .wait();
              break;
            case comm_kind::broadcast:
              c.broadcast_async(out.data(), whole, fedshard::dtype::f32, 0).wait();
              break;
            case comm_kind::send_recv:
            case comm_kind::send:
            case comm_kind::recv:
            case comm_kind::pack:
            case comm_kind::unpack:
            case comm_kind::zero: break;
          }
        };
        for (int i = 0; i < 2; ++i) call();
        world.barrier();
        const auto t0 = clock::now();
        for (int i = 0; i < iters; ++i) call();
        world.barrier();
        if (world.rank() == 0) seconds = since(t0) / iters;
      },
      run_options());
  return seconds;
}

/// Bytes/s one of 8 threads gets copying 4 MiB at once.
inline double time_memory_bandwidth() {
  constexpr std::size_t bytes = std::size_t{4} << 20;
  constexpr int iters = 20;
  double seconds = 0;
  fedshard::inproc::run(
      world_size,
      [&](fedshard::inproc::communicator& world) {
        fedshard::aligned_buffer<float> a(bytes / 4), b(bytes / 4);
        for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i);
        world.barrier();
        const auto t0 = clock::now();
        for (int i = 0; i < iters; ++i) {
          std::copy(a.begin(), a.end(), b.begin());
          std::swap(a, b);
        }
        world.barrier();
        if (world.rank() == 0) seconds = since(t0) / iters;
      },
      run_options());
  return static_cast<double>(bytes) / seconds;
}

}  // namespace predict_demo
