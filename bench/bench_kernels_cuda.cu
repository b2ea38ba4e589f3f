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
/// at S >= 64 MiB).
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

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <vector>

#include "fedshard/core/dtype.hpp"
#include "fedshard/cuda/device_buffer.cuh"
#include "fedshard/cuda/error.cuh"
#include "fedshard/cuda/kernels.cuh"
#include "fedshard/cuda/reduce.cuh"
#include "fedshard/cuda/stream.cuh"
#include "fedshard/kernels/adamw.hpp"
#include "fedshard/kernels/outer.hpp"
#include "fedshard/kernels/pack.hpp"
#if FEDSHARD_HAS_NCCL
#include "fedshard/cuda/nccl.cuh"
#endif

namespace {

namespace gpu = fedshard::gpu;
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

/// Times kernel(stream), which moves `traffic` bytes, against a device-to-device copy of
/// traffic / 2 bytes; see the file comment for what is reported.
template <class Kernel>
void side_by_side(benchmark::State& state, std::size_t traffic, Kernel&& kernel) {
  gpu::stream s;
  const std::size_t copy_bytes = traffic / 2;
  auto src = gpu::device_buffer<std::byte>::uninitialized(copy_bytes);
  auto dst = gpu::device_buffer<std::byte>::uninitialized(copy_bytes);
  const auto copy = [&] {
    FEDSHARD_CUDA_TRY(
        cudaMemcpyAsync(dst.data(), src.data(), copy_bytes, cudaMemcpyDeviceToDevice, s));
  };
  gpu::event e0(cudaEventDefault), e1(cudaEventDefault), e2(cudaEventDefault);
  kernel(s.get());  // warm-up: first launch, opt-in attributes, caches
  copy();
  s.synchronize();
  double kernel_ms = 0.0, copy_ms = 0.0;
  for (auto _ : state) {
    e0.record(s);
    kernel(s.get());
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
