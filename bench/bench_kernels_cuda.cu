/// GPU kernels against cudaMemcpyDeviceToDevice, and the NCCL communicator against raw NCCL
/// calls, side by side in one run.
///
/// Kernels. The size argument S is the bytes of one f32 array of the operation (the shard
/// for pack and unpack, the output of casts and weighted sums, each array of an optimizer
/// step, the input of a reduction). A kernel's traffic is the bytes it must read plus the
/// bytes it must write (e.g. 5 S for a weighted sum of 4 f32 inputs, 7 S for AdamW). Every
/// iteration times, with CUDA events on one stream, the kernel and right after it a
/// cudaMemcpyDeviceToDevice of traffic / 2 bytes (which also reads and writes `traffic`
/// bytes). The reported time and bytes_per_second are the kernel's; GBps is traffic / kernel
/// time in 1e9 bytes/s, memcpy_GBps the same for the copy, and ratio_vs_memcpy = memcpy time /
/// kernel time, the fraction of the copy's bandwidth the kernel reaches (the target is >= 0.85
/// at S >= 64 MiB); vs_memcpy is the same ratio under the name every row shares.
///
/// memcpy/d2d: a cudaMemcpyDeviceToDevice of S bytes timed against itself, the reference row
/// (vs_memcpy = 1 up to noise). cuda_space/*: the same operations through the cuda_space API
/// (space/memory_space.hpp) on a stream of the space: cast f32 -> bf16, pack (one space copy
/// per tensor part and one fill per padding run, as a space-generic engine packs), the
/// 2-array weighted sum of streaming mixing (kernels::mix_update through for_each) and AdamW
/// (kernels::adamw_update through for_each). gpu_inproc/all_reduce_*: S bytes of f32 or bf16
/// summed over 4 ranks sharing device 0, out of place; every call's device traffic is 2 x 4 x
/// S (each input read once, each output written once); time per call from the host clock
/// between two barriers around max_iterations back-to-back async calls (host rendezvous
/// included); vs_memcpy = that traffic's bandwidth / a cudaMemcpyDeviceToDevice of 4 S bytes
/// measured in the same run; algbw and busbw as nccl-tests.
///
/// codec/*: encode and decode_add of S bytes of f32 through gpu::device_codec (cast to bf16,
/// f16, fp8_e4m3; int8_block and topk at their defaults: blocks of 256; 64 of 4096 in 2 bits), each
/// against a cudaMemcpyDeviceToDevice of the same S bytes: vs_memcpy = copy time / codec time,
/// input_GBps = S / codec time.
///
/// NCCL (built with fedshard::nccl). On a communicator of one rank (device 0), all_reduce of
/// S bytes of f32, out of place. nccl_blocking: each iteration times with steady_clock a raw
/// ncclAllReduce + cudaStreamSynchronize and then the communicator's blocking all_reduce (which
/// records an event and polls it); the time is the wrapper's, raw_us and wrapper_us the means,
/// overhead = wrapper / raw - 1 (the target is <= 0.02 at S >= 64 MiB). nccl_async: 8 raw calls
/// and 8 all_reduce_async calls (requests kept, waited at the end) timed with CUDA events on
/// the stream, overhead likewise.
///
/// Without a CUDA device the program prints why and exits with 77.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <span>
#include <vector>

#include "fedshard/codec/cast.hpp"
#include "fedshard/codec/int8_block.hpp"
#include "fedshard/codec/topk.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/fp8.hpp"
#include "fedshard/cuda/codec.cuh"
#include "fedshard/cuda/cuda_space.cuh"
#include "fedshard/cuda/device_buffer.cuh"
#include "fedshard/cuda/error.cuh"
#include "fedshard/cuda/gpu_inproc.cuh"
#include "fedshard/cuda/kernels.cuh"
#include "fedshard/cuda/reduce.cuh"
#include "fedshard/cuda/stream.cuh"
#include "fedshard/kernels/adamw.hpp"
#include "fedshard/kernels/outer.hpp"
#include "fedshard/kernels/pack.hpp"
#include "fedshard/kernels/sync.hpp"
#if FEDSHARD_HAS_NCCL
#include "fedshard/cuda/nccl.cuh"
#endif

namespace {

namespace gpu = fedshard::gpu;
namespace gpu_inproc = fedshard::gpu_inproc;
namespace kernels = fedshard::kernels;
using fedshard::bf16;

constexpr std::int64_t mib = 1 << 20;

/// Fills a device array with finite values (a pattern, converted on the device).
template <class T>
gpu::device_buffer<T> filled(std::size_t n, float scale = 1.0f) {
  std::vector<float> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = scale * (static_cast<float>(i % 1999) - 999.0f);
  auto f32 = gpu::device_buffer<float>::from_host(host);
  auto out = gpu::device_buffer<T>::uninitialized(n);
  gpu::cast(std::span<const float>(f32.span()), out.span(), nullptr);
  FEDSHARD_CUDA_TRY(cudaDeviceSynchronize());
  return out;
}

/// Times kernel(s), which moves `traffic` bytes on stream s, against a device-to-device copy
/// of traffic / 2 bytes on s; see the file comment for what is reported.
template <class Kernel>
void side_by_side_on(benchmark::State& state, std::size_t traffic, cudaStream_t s,
                     Kernel&& kernel) {
  const std::size_t copy_bytes = traffic / 2;
  auto src = gpu::device_buffer<std::byte>::uninitialized(copy_bytes);
  auto dst = gpu::device_buffer<std::byte>::uninitialized(copy_bytes);
  const auto copy = [&] {
    FEDSHARD_CUDA_TRY(
        cudaMemcpyAsync(dst.data(), src.data(), copy_bytes, cudaMemcpyDeviceToDevice, s));
  };
  gpu::event e0(cudaEventDefault), e1(cudaEventDefault), e2(cudaEventDefault);
  kernel(s);  // warm-up: first launch, opt-in attributes, caches
  copy();
  FEDSHARD_CUDA_TRY(cudaStreamSynchronize(s));
  double kernel_ms = 0.0, copy_ms = 0.0;
  for (auto _ : state) {
    e0.record(s);
    kernel(s);
    e1.record(s);
    copy();
    e2.record(s);
    e2.synchronize();
    const double k = gpu::event::elapsed_ms(e0, e1);
    kernel_ms += k;
    copy_ms += gpu::event::elapsed_ms(e1, e2);
    state.SetIterationTime(k / 1e3);
  }
  const auto iterations = static_cast<double>(state.iterations());
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(traffic));
  state.counters["GBps"] = iterations * static_cast<double>(traffic) / (kernel_ms * 1e6);
  state.counters["memcpy_GBps"] =
      iterations * 2.0 * static_cast<double>(copy_bytes) / (copy_ms * 1e6);
  state.counters["ratio_vs_memcpy"] = copy_ms / kernel_ms;
  state.counters["vs_memcpy"] = copy_ms / kernel_ms;  // bandwidth / memcpy bandwidth
}

/// side_by_side_on a stream of its own.
template <class Kernel>
void side_by_side(benchmark::State& state, std::size_t traffic, Kernel&& kernel) {
  gpu::stream s;
  side_by_side_on(state, traffic, s.get(), kernel);
}

template <class From, class To>
void bm_cast(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0)) / sizeof(float);
  auto in = filled<From>(n);
  auto out = gpu::device_buffer<To>::uninitialized(n);
  side_by_side(state, n * (sizeof(From) + sizeof(To)),
               [&](cudaStream_t s) { gpu::cast(std::span<const From>(in.span()), out.span(), s); });
}

/// A unit of 8 tensors of mixed sizes (1:3:8:2:16:1:4:5, each starting on a 64-byte
/// boundary) sharded over 4 ranks; rank 1's shard of S bytes of f32 is packed and unpacked,
/// so the shard's edges cut tensors (as in bench_kernels).
struct bench_unit {
  static constexpr std::size_t ranks = 4, rank = 1;
  std::size_t shard_elems;
  std::vector<gpu::device_buffer<float>> storage;
  std::vector<kernels::tensor_ref<const float>> in;
  std::vector<kernels::tensor_ref<float>> out;

  explicit bench_unit(std::size_t shard) : shard_elems(shard) {
    constexpr std::size_t parts[] = {1, 3, 8, 2, 16, 1, 4, 5};
    constexpr std::size_t total = 40, align = 16;
    const std::size_t flat = ranks * shard_elems;
    std::size_t offset = 0;
    for (std::size_t p : parts) {
      const std::size_t count = flat / total * p - align;
      storage.push_back(filled<float>(count));
      in.push_back({storage.back().data(), count, offset});
      out.push_back({storage.back().data(), count, offset});
      offset = (offset + count + align - 1) / align * align;
    }
  }
  std::size_t begin() const { return rank * shard_elems; }
  /// Elements of the shard that tensors cover (the rest is padding).
  std::size_t covered() const {
    std::size_t n = 0;
    kernels::for_each_segment(std::span<const kernels::tensor_ref<const float>>(in), begin(),
                              shard_elems, [&](const kernels::pack_segment& s) {
                                if (s.tensor != kernels::pack_segment::padding) n += s.count;
                              });
    return n;
  }
};

template <class Dst>
void bm_pack(benchmark::State& state) {
  const bench_unit unit(static_cast<std::size_t>(state.range(0)) / sizeof(float));
  auto shard = gpu::device_buffer<Dst>::uninitialized(unit.shard_elems);
  const gpu::pack_plan<const float, Dst> plan(unit.in, unit.begin(), shard.span());
  const std::size_t traffic = unit.covered() * sizeof(float) + unit.shard_elems * sizeof(Dst);
  side_by_side(state, traffic, [&](cudaStream_t s) { plan.run(s); });
}

void bm_unpack(benchmark::State& state) {
  const bench_unit unit(static_cast<std::size_t>(state.range(0)) / sizeof(float));
  auto shard = filled<float>(unit.shard_elems);
  const gpu::unpack_plan<const float, float> plan(std::span<const float>(shard.span()),
                                                  unit.begin(), unit.out);
  const std::size_t traffic = 2 * unit.covered() * sizeof(float);
  side_by_side(state, traffic, [&](cudaStream_t s) { plan.run(s); });
}

template <class In, std::size_t K>
void bm_weighted_sum(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0)) / sizeof(float);
  std::vector<gpu::device_buffer<In>> ins;
  std::vector<const In*> pointers;
  std::vector<double> weights;
  for (std::size_t k = 0; k < K; ++k) {
    ins.push_back(filled<In>(n, 0.01f * static_cast<float>(k + 1)));
    pointers.push_back(ins.back().data());
    weights.push_back(1.0 / static_cast<double>(K));
  }
  auto out = gpu::device_buffer<float>::uninitialized(n);
  side_by_side(state, n * (K * sizeof(In) + sizeof(float)), [&](cudaStream_t s) {
    gpu::weighted_sum<In, float>(pointers, weights, out.span(), s);
  });
}

void bm_outer_nesterov(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0)) / sizeof(float);
  auto theta = filled<float>(n), d = filled<float>(n, 1e-3f), m = filled<float>(n, 1e-4f);
  const auto sc = kernels::make_outer_momentum_scalars(0.7f, 0.9f);
  side_by_side(state, 5 * n * sizeof(float), [&](cudaStream_t s) {
    gpu::outer_nesterov_step(theta.span(), d.span(), m.span(), sc, s);
  });
}

void bm_outer_fedadam(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0)) / sizeof(float);
  auto theta = filled<float>(n), d = filled<float>(n, 1e-3f), m = filled<float>(n, 1e-4f),
       v = filled<float>(n, 1e-6f);
  const auto sc = kernels::make_outer_adaptive_scalars(0.01f, 0.9f, 0.99f, 1e-3f);
  side_by_side(state, 7 * n * sizeof(float), [&](cudaStream_t s) {
    gpu::outer_fedadam_step(theta.span(), d.span(), m.span(), v.span(), sc, s);
  });
}

void bm_adamw(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0)) / sizeof(float);
  auto p = filled<float>(n), g = filled<float>(n, 1e-3f), m = filled<float>(n, 1e-4f),
       v = filled<float>(n, 1e-6f);
  const auto sc = kernels::make_adamw_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 10);
  side_by_side(state, 7 * n * sizeof(float), [&](cudaStream_t s) {
    gpu::adamw_step(p.span(), g.span(), m.span(), v.span(), sc, s);
  });
}

void bm_sum_of_squares(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0)) / sizeof(float);
  auto x = filled<float>(n);
  gpu::device_buffer<double> result(1);
  gpu::reduce_workspace ws;
  side_by_side(state, n * sizeof(float), [&](cudaStream_t s) {
    gpu::sum_of_squares_async(std::span<const float>(x.span()), result.data(), ws, s);
  });
}

void bm_count_nonfinite(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0)) / sizeof(float);
  auto x = filled<float>(n);
  gpu::device_buffer<unsigned long long> result(1);
  gpu::reduce_workspace ws;
  side_by_side(state, n * sizeof(float), [&](cudaStream_t s) {
    gpu::count_nonfinite_async(std::span<const float>(x.span()), result.data(), ws, s);
  });
}

// ---------------------------------------------------------------- codecs

/// encode of S bytes of f32 through gpu::device_codec<C> (a topk residual updated on every
/// call), side by side with a cudaMemcpyDeviceToDevice of the same S bytes: traffic is given
/// as 2 S, so vs_memcpy = memcpy time of the f32 input / encode time, and input_GBps = S /
/// encode time (GBps counts 2 S); wire_bytes is the size of the wire written.
template <class C>
void bm_codec_encode(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0)) / sizeof(float);
  auto in = filled<float>(n, 1e-3f);
  gpu::device_codec<C> c({}, n);
  auto wire = gpu::device_buffer<std::byte>::uninitialized(c.encoded_bytes(n));
  side_by_side(state, 2 * n * sizeof(float),
               [&](cudaStream_t s) { c.encode(s, in.data(), wire.data()); });
  state.counters["input_GBps"] = state.counters["GBps"].value / 2.0;
  state.counters["wire_bytes"] = static_cast<double>(c.encoded_bytes(n));
}

/// decode_add of one wire of S bytes of f32 into an f32 array, side by side with a
/// cudaMemcpyDeviceToDevice of the same S bytes (as bm_codec_encode): input_GBps = S /
/// decode_add time.
template <class C>
void bm_codec_decode_add(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0)) / sizeof(float);
  auto in = filled<float>(n, 1e-3f);
  auto out = filled<float>(n);
  gpu::device_codec<C> c({}, n);
  auto wire = gpu::device_buffer<std::byte>::uninitialized(c.encoded_bytes(n));
  c.encode(nullptr, in.data(), wire.data());
  FEDSHARD_CUDA_TRY(cudaDeviceSynchronize());
  side_by_side(state, 2 * n * sizeof(float),
               [&](cudaStream_t s) { c.decode_add(s, wire.data(), out.data()); });
  state.counters["input_GBps"] = state.counters["GBps"].value / 2.0;
  state.counters["wire_bytes"] = static_cast<double>(c.encoded_bytes(n));
}

// ---------------------------------------------------------------- the reference copy

/// cudaMemcpyDeviceToDevice of S bytes: the reference of every vs_memcpy (here 1 by
/// construction: it is timed against itself, side by side).
void bm_memcpy_d2d(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  auto src = gpu::device_buffer<std::byte>::uninitialized(bytes);
  auto dst = gpu::device_buffer<std::byte>::uninitialized(bytes);
  side_by_side(state, 2 * bytes, [&](cudaStream_t s) {
    FEDSHARD_CUDA_TRY(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, s));
  });
}

// ---------------------------------------------------------------- gpu_inproc

/// Seconds of one cudaMemcpyDeviceToDevice of `bytes` (the best of a few), on device 0.
double memcpy_seconds(std::size_t bytes) {
  auto src = gpu::device_buffer<std::byte>::uninitialized(bytes);
  auto dst = gpu::device_buffer<std::byte>::uninitialized(bytes);
  gpu::stream s;
  gpu::event e0(cudaEventDefault), e1(cudaEventDefault);
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    e0.record(s);
    FEDSHARD_CUDA_TRY(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, s));
    e1.record(s);
    e1.synchronize();
    best = std::min(best, static_cast<double>(gpu::event::elapsed_ms(e0, e1)) / 1e3);
  }
  return best;
}

/// all_reduce (sum, out of place) of S bytes of T on `ranks` gpu_inproc ranks sharing device
/// 0. One gpu_inproc::run per benchmark run: every rank allocates its buffers and makes 3
/// untimed calls; rank 0 reads steady_clock after a barrier, all ranks make max_iterations
/// async calls back to back, and rank 0 reads the clock after a final barrier (which waits
/// for the device work). The device traffic of one call is 2 x ranks x S (every input read
/// once, every output written once); vs_memcpy = that traffic's bandwidth / the bandwidth of
/// a cudaMemcpyDeviceToDevice of ranks x S bytes measured in the same run.
template <class T>
void bm_gpu_inproc_all_reduce(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  const auto ranks = static_cast<int>(state.range(1));
  const auto count = static_cast<std::int64_t>(bytes / sizeof(T));
  const std::int64_t iterations = state.max_iterations;
  const std::size_t traffic = 2 * static_cast<std::size_t>(ranks) * bytes;
  double seconds = 0.0;
  try {
    gpu_inproc::options o;
    o.devices = {0};
    gpu_inproc::run(
        ranks,
        [&](gpu_inproc::communicator& c) {
          auto space = c.make_space();
          auto in = space->allocate<T>(static_cast<std::size_t>(count));
          auto out = space->allocate<T>(static_cast<std::size_t>(count));
          const auto call = [&] {
            return c.all_reduce_async(in.data(), out.data(), count, fedshard::dtype_of<T>,
                                      fedshard::reduce_op::sum);
          };
          for (int i = 0; i < 3; ++i) call().wait();
          std::vector<fedshard::request> requests;
          requests.reserve(static_cast<std::size_t>(iterations));
          c.barrier();
          const auto t0 = std::chrono::steady_clock::now();
          for (std::int64_t i = 0; i < iterations; ++i) requests.push_back(call());
          c.barrier();
          const auto t1 = std::chrono::steady_clock::now();
          fedshard::wait_all(requests);
          if (c.rank() == 0) seconds = std::chrono::duration<double>(t1 - t0).count();
        },
        o);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  const double per_iter = seconds / static_cast<double>(iterations);
  for (auto _ : state) state.SetIterationTime(per_iter);
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes));
  const double gbps = static_cast<double>(traffic) / per_iter / 1e9;
  const double memcpy_gbps = static_cast<double>(traffic) / memcpy_seconds(traffic / 2) / 1e9;
  state.counters["algbw"] = static_cast<double>(bytes) / per_iter / 1e9;
  state.counters["busbw"] = state.counters["algbw"] * 2.0 * (ranks - 1) / ranks;
  state.counters["GBps"] = gbps;
  state.counters["memcpy_GBps"] = memcpy_gbps;
  state.counters["vs_memcpy"] = gbps / memcpy_gbps;
}

// ---------------------------------------------------------------- cuda_space

/// One cuda_space (device 0) and a stream of it for the cuda_space rows; the buffers are
/// the space's (cached blocks).
struct space_bench {
  gpu::cuda_space space{0};
  gpu::cuda_space::stream st = space.make_stream();

  gpu::cuda_space::buffer<float> filled_f32(std::size_t n, float scale = 1.0f) {
    auto b = space.allocate<float>(n);
    std::vector<float> host(n);
    for (std::size_t i = 0; i < n; ++i) host[i] = scale * (static_cast<float>(i % 1999) - 999.0f);
    space.from_host(st, fedshard::cview(std::span<const float>(host)), b.view());
    space.synchronize(st);
    return b;
  }
};

void bm_space_cast(benchmark::State& state) {
  space_bench sb;
  const auto n = static_cast<std::size_t>(state.range(0)) / sizeof(float);
  auto in = sb.filled_f32(n);
  auto out = sb.space.allocate<bf16>(n);
  side_by_side_on(state, n * (sizeof(float) + sizeof(bf16)), sb.st.get(),
                  [&](cudaStream_t) { sb.space.cast(sb.st, in.view(), out.view()); });
}

/// pack as a space-generic engine does it: one cuda_space copy per tensor part of the shard
/// and one fill per padding run (bench_unit's shard of S bytes).
void bm_space_pack(benchmark::State& state) {
  space_bench sb;
  const bench_unit unit(static_cast<std::size_t>(state.range(0)) / sizeof(float));
  auto shard = sb.space.allocate<float>(unit.shard_elems);
  const std::size_t traffic = unit.covered() * sizeof(float) + unit.shard_elems * sizeof(float);
  side_by_side_on(state, traffic, sb.st.get(), [&](cudaStream_t) {
    kernels::for_each_segment(
        std::span<const kernels::tensor_ref<const float>>(unit.in), unit.begin(), unit.shard_elems,
        [&](const kernels::pack_segment& p) {
          const fedshard::buffer_view to{shard.data() + p.shard_pos, p.count, fedshard::dtype::f32};
          if (p.tensor == kernels::pack_segment::padding)
            sb.space.fill(sb.st, to, 0.0);
          else
            sb.space.copy(
                sb.st, {unit.in[p.tensor].data + p.tensor_pos, p.count, fedshard::dtype::f32}, to);
        });
  });
}

/// The weighted sum of two arrays the streaming sync does (kernels::mix_update through
/// cuda_space::for_each): reads 2 S, writes S.
void bm_space_mix(benchmark::State& state) {
  space_bench sb;
  const auto n = static_cast<std::size_t>(state.range(0)) / sizeof(float);
  auto local = sb.filled_f32(n), synced = sb.filled_f32(n, 0.5f);
  side_by_side_on(state, 3 * n * sizeof(float), sb.st.get(), [&](cudaStream_t) {
    sb.space.for_each(sb.st, kernels::mix_update{0.3f}, local.span(),
                      std::span<const float>(synced.span()));
  });
}

/// AdamW through cuda_space::for_each (kernels::adamw_update): reads 4 S, writes 3 S.
void bm_space_adamw(benchmark::State& state) {
  space_bench sb;
  const auto n = static_cast<std::size_t>(state.range(0)) / sizeof(float);
  auto p = sb.filled_f32(n), g = sb.filled_f32(n, 1e-3f), m = sb.filled_f32(n, 1e-4f),
       v = sb.filled_f32(n, 1e-6f);
  const auto sc = kernels::make_adamw_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 10);
  side_by_side_on(state, 7 * n * sizeof(float), sb.st.get(), [&](cudaStream_t) {
    sb.space.for_each(sb.st, kernels::adamw_update{sc}, p.span(), std::span<const float>(g.span()),
                      m.span(), v.span());
  });
}

#if FEDSHARD_HAS_NCCL

/// The one-rank communicator on device 0, made once and never destroyed (it would be torn
/// down after the CUDA runtime at exit).
fedshard::nccl::communicator& solo() {
  static auto* c = [] {
    const int devices[] = {0};
    auto all = fedshard::nccl::communicator::init_all(devices);
    return new fedshard::nccl::communicator(std::move(all.front()));
  }();
  return *c;
}

void bm_nccl_blocking(benchmark::State& state) {
  auto& c = solo();
  const auto n = static_cast<std::size_t>(state.range(0)) / sizeof(float);
  auto in = filled<float>(n);
  auto out = gpu::device_buffer<float>::uninitialized(n);
  const auto count = static_cast<std::int64_t>(n);
  const auto raw = [&] {
    if (ncclAllReduce(in.data(), out.data(), n, ncclFloat32, ncclSum, c.native_handle(),
                      c.stream()) != ncclSuccess)
      throw fedshard::backend_error("ncclAllReduce failed");
    FEDSHARD_CUDA_TRY(cudaStreamSynchronize(c.stream()));
  };
  const auto wrapped = [&] {
    c.all_reduce(in.data(), out.data(), count, fedshard::dtype::f32, fedshard::reduce_op::sum);
  };
  raw();
  wrapped();
  using clock = std::chrono::steady_clock;
  double raw_s = 0.0, wrapped_s = 0.0;
  for (auto _ : state) {
    const auto t0 = clock::now();
    raw();
    const auto t1 = clock::now();
    wrapped();
    const auto t2 = clock::now();
    const double w = std::chrono::duration<double>(t2 - t1).count();
    raw_s += std::chrono::duration<double>(t1 - t0).count();
    wrapped_s += w;
    state.SetIterationTime(w);
  }
  const auto iterations = static_cast<double>(state.iterations());
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(n * sizeof(float)));
  state.counters["raw_us"] = raw_s / iterations * 1e6;
  state.counters["wrapper_us"] = wrapped_s / iterations * 1e6;
  state.counters["overhead"] = wrapped_s / raw_s - 1.0;
}

void bm_nccl_async(benchmark::State& state) {
  constexpr int batch = 8;
  auto& c = solo();
  const auto n = static_cast<std::size_t>(state.range(0)) / sizeof(float);
  auto in = filled<float>(n);
  auto out = gpu::device_buffer<float>::uninitialized(n);
  const auto count = static_cast<std::int64_t>(n);
  gpu::event e0(cudaEventDefault), e1(cudaEventDefault), e2(cudaEventDefault);
  std::vector<fedshard::request> requests;
  double raw_ms = 0.0, wrapped_ms = 0.0;
  for (auto _ : state) {
    e0.record(c.stream());
    for (int i = 0; i < batch; ++i)
      if (ncclAllReduce(in.data(), out.data(), n, ncclFloat32, ncclSum, c.native_handle(),
                        c.stream()) != ncclSuccess)
        throw fedshard::backend_error("ncclAllReduce failed");
    e1.record(c.stream());
    for (int i = 0; i < batch; ++i)
      requests.push_back(c.all_reduce_async(in.data(), out.data(), count, fedshard::dtype::f32,
                                            fedshard::reduce_op::sum));
    e2.record(c.stream());
    fedshard::wait_all(requests);
    requests.clear();
    e2.synchronize();
    const double w = gpu::event::elapsed_ms(e1, e2);
    raw_ms += gpu::event::elapsed_ms(e0, e1);
    wrapped_ms += w;
    state.SetIterationTime(w / 1e3 / batch);
  }
  state.SetBytesProcessed(state.iterations() * batch *
                          static_cast<std::int64_t>(n * sizeof(float)));
  state.counters["overhead"] = wrapped_ms / raw_ms - 1.0;
}

#endif  // FEDSHARD_HAS_NCCL

void sizes(benchmark::internal::Benchmark* b) {
  b->Arg(64 * mib)->Arg(256 * mib)->UseManualTime()->Unit(benchmark::kMicrosecond)->MinTime(0.2);
}

void rank_sizes(benchmark::internal::Benchmark* b) {
  for (int ranks : {4}) b->Args({64 * mib, ranks})->Args({256 * mib, ranks});
  b->UseManualTime()->Unit(benchmark::kMicrosecond)->MinTime(0.2);
}

BENCHMARK(bm_memcpy_d2d)->Name("memcpy/d2d")->Apply(sizes);
BENCHMARK(bm_cast<float, bf16>)->Name("cast/f32_to_bf16")->Apply(sizes);
BENCHMARK(bm_cast<bf16, float>)->Name("cast/bf16_to_f32")->Apply(sizes);
BENCHMARK(bm_pack<float>)->Name("pack/f32")->Apply(sizes);
BENCHMARK(bm_pack<bf16>)->Name("pack/f32_to_bf16")->Apply(sizes);
BENCHMARK(bm_unpack)->Name("unpack/f32")->Apply(sizes);
BENCHMARK(bm_weighted_sum<float, 4>)->Name("weighted_sum/k4_f32")->Apply(sizes);
BENCHMARK(bm_weighted_sum<float, 8>)->Name("weighted_sum/k8_f32")->Apply(sizes);
BENCHMARK(bm_weighted_sum<bf16, 4>)->Name("weighted_sum/k4_bf16_to_f32")->Apply(sizes);
BENCHMARK(bm_outer_nesterov)->Name("outer_nesterov/f32")->Apply(sizes);
BENCHMARK(bm_outer_fedadam)->Name("outer_fedadam/f32")->Apply(sizes);
BENCHMARK(bm_adamw)->Name("adamw/f32")->Apply(sizes);
BENCHMARK(bm_sum_of_squares)->Name("sum_of_squares/f32")->Apply(sizes);
BENCHMARK(bm_count_nonfinite)->Name("count_nonfinite/f32")->Apply(sizes);
BENCHMARK(bm_gpu_inproc_all_reduce<float>)->Name("gpu_inproc/all_reduce_f32")->Apply(rank_sizes);
BENCHMARK(bm_gpu_inproc_all_reduce<bf16>)->Name("gpu_inproc/all_reduce_bf16")->Apply(rank_sizes);
BENCHMARK(bm_space_cast)->Name("cuda_space/cast_f32_to_bf16")->Apply(sizes);
BENCHMARK(bm_space_pack)->Name("cuda_space/pack_f32")->Apply(sizes);
BENCHMARK(bm_space_mix)->Name("cuda_space/weighted_sum_mix_f32")->Apply(sizes);
BENCHMARK(bm_space_adamw)->Name("cuda_space/adamw_f32")->Apply(sizes);
BENCHMARK(bm_codec_encode<fedshard::codec::cast<bf16>>)
    ->Name("codec/encode_cast_bf16")
    ->Apply(sizes);
BENCHMARK(bm_codec_decode_add<fedshard::codec::cast<bf16>>)
    ->Name("codec/decode_add_cast_bf16")
    ->Apply(sizes);
BENCHMARK(bm_codec_encode<fedshard::codec::cast<fedshard::f16>>)
    ->Name("codec/encode_cast_f16")
    ->Apply(sizes);
BENCHMARK(bm_codec_decode_add<fedshard::codec::cast<fedshard::f16>>)
    ->Name("codec/decode_add_cast_f16")
    ->Apply(sizes);
BENCHMARK(bm_codec_encode<fedshard::codec::cast<fedshard::fp8_e4m3>>)
    ->Name("codec/encode_cast_fp8_e4m3")
    ->Apply(sizes);
BENCHMARK(bm_codec_decode_add<fedshard::codec::cast<fedshard::fp8_e4m3>>)
    ->Name("codec/decode_add_cast_fp8_e4m3")
    ->Apply(sizes);
BENCHMARK(bm_codec_encode<fedshard::codec::int8_block>)
    ->Name("codec/encode_int8_block256")
    ->Apply(sizes);
BENCHMARK(bm_codec_decode_add<fedshard::codec::int8_block>)
    ->Name("codec/decode_add_int8_block256")
    ->Apply(sizes);
BENCHMARK(bm_codec_encode<fedshard::codec::topk>)
    ->Name("codec/encode_topk4096_k64_2bit")
    ->Apply(sizes);
BENCHMARK(bm_codec_decode_add<fedshard::codec::topk>)
    ->Name("codec/decode_add_topk4096_k64_2bit")
    ->Apply(sizes);
#if FEDSHARD_HAS_NCCL
BENCHMARK(bm_nccl_blocking)->Name("nccl_blocking/all_reduce_f32")->Apply(sizes);
BENCHMARK(bm_nccl_async)->Name("nccl_async/all_reduce_f32")->Apply(sizes);
#endif

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  if (gpu::device_count() == 0) {
    std::fprintf(stderr, "bench_kernels_cuda: no CUDA device; nothing to measure\n");
    return 77;
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
