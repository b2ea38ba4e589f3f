/// Host kernels against memcpy of the same bytes, side by side in one run: pack and unpack
/// of a unit's tensors into a shard, and the f32 <-> bf16/f16 casts.
///
/// The size argument is the bytes each kernel call writes (the shard for pack, the tensor
/// parts for unpack, the output for casts). Every iteration times the kernel and then a
/// memcpy of that many bytes between two other buffers, each repeated to move at least
/// 4 MiB. Times are the thread's CPU time (CLOCK_THREAD_CPUTIME_ID), so that time the
/// thread spends preempted on a shared machine is not counted; on an idle machine they
/// equal wall time. The reported time and bytes_per_second are the kernel's (manual time);
/// the counter ratio_vs_memcpy = memcpy time / kernel time for the same bytes (1 = as fast
/// as memcpy), and memcpy_GBps is the baseline's bandwidth in 1e9 bytes/s.
///
/// The rows named after a kernel (cast_f32_bf16, fp8_encode, int8_block_encode, topk_encode,
/// ...) compare instead with a memcpy of the kernel's f32 side (the input of an encode or
/// narrowing cast, the output of a decode or widening cast): their size argument is those
/// f32 bytes, and bytes_per_second counts them.
///
/// The pack case: a unit of 8 tensors of mixed sizes (1:3:8:2:16:1:4:5), each starting on a
/// 64-byte boundary (the gaps are padding), sharded over 4 ranks; rank 1's shard is packed
/// and unpacked, so shard edges cut tensors.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <ctime>
#include <span>
#include <string>
#include <vector>

#include "fedshard/codec/cast.hpp"
#include "fedshard/codec/int8_block.hpp"
#include "fedshard/codec/topk.hpp"
#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/fp8.hpp"
#include "fedshard/kernels/adamw.hpp"
#include "fedshard/kernels/cast.hpp"
#include "fedshard/kernels/dispatch.hpp"
#include "fedshard/kernels/pack.hpp"

namespace {

namespace kernels = fedshard::kernels;
using fedshard::aligned_buffer;
using fedshard::bf16;
using fedshard::f16;

constexpr std::size_t shard_count = 4;
constexpr std::size_t shard_rank = 1;
constexpr std::size_t tensor_parts[] = {1, 3, 8, 2, 16, 1, 4, 5};

/// CPU seconds used by the calling thread so far.
double thread_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

/// Times `kernel` (which writes `bytes` bytes) and a memcpy of `bytes` alternately; see
/// the file comment for what is reported.
template <class Kernel>
void side_by_side(benchmark::State& state, std::size_t bytes, Kernel&& kernel) {
  aligned_buffer<std::byte> src(bytes), dst(bytes);
  const auto copy = [&] {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::ClobberMemory();
  };
  const std::size_t reps = std::max<std::size_t>(1, (std::size_t{4} << 20) / bytes);
  kernel();  // warm-up: first touches, caches
  copy();
  double kernel_s = 0.0, memcpy_s = 0.0;
  for (auto _ : state) {
    const double t0 = thread_seconds();
    for (std::size_t r = 0; r < reps; ++r) {
      kernel();
      benchmark::ClobberMemory();
    }
    const double t1 = thread_seconds();
    for (std::size_t r = 0; r < reps; ++r) copy();
    const double t2 = thread_seconds();
    const double k = t1 - t0;
    kernel_s += k;
    memcpy_s += t2 - t1;
    state.SetIterationTime(k / static_cast<double>(reps));
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes));
  state.counters["ratio_vs_memcpy"] = memcpy_s / kernel_s;
  state.counters["memcpy_GBps"] =
      static_cast<double>(state.iterations()) * static_cast<double>(reps * bytes) / memcpy_s / 1e9;
}

/// The benchmark unit: tensors with their storage, laid out in a flat buffer of
/// shard_count * shard_elems elements.
template <class T>
struct bench_unit {
  std::vector<aligned_buffer<T>> storage;
  std::vector<kernels::tensor_ref<const T>> in;
  std::vector<kernels::tensor_ref<T>> out;

  explicit bench_unit(std::size_t shard_elems) {
    const std::size_t flat = shard_count * shard_elems;
    const std::size_t align = fedshard::cache_line_bytes / sizeof(T);
    std::size_t parts = 0;
    for (std::size_t p : tensor_parts) parts += p;
    std::size_t offset = 0;
    for (std::size_t p : tensor_parts) {
      const std::size_t count = flat / parts * p - align;  // leaves room to align the next
      storage.emplace_back(count);
      for (std::size_t i = 0; i < count; ++i)
        storage.back()[i] = fedshard::from_accum<T>(static_cast<double>(i % 1000) * 0.25);
      in.push_back({storage.back().data(), count, offset});
      out.push_back({storage.back().data(), count, offset});
      offset = (offset + count + align - 1) / align * align;
    }
  }
};

template <class Src, class Dst>
void bm_pack(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  const std::size_t shard_elems = bytes / sizeof(Dst);
  const bench_unit<Src> unit(shard_elems);
  aligned_buffer<Dst> shard(shard_elems);
  const std::span<const kernels::tensor_ref<const Src>> tensors(unit.in);
  side_by_side(state, bytes, [&] {
    kernels::pack(tensors, shard_rank * shard_elems, std::span<Dst>(shard.span()));
  });
}

template <class T>
void bm_unpack(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  const std::size_t shard_elems = bytes / sizeof(T);
  bench_unit<T> unit(shard_elems);
  aligned_buffer<T> shard(shard_elems);
  const std::span<const kernels::tensor_ref<T>> tensors(unit.out);
  std::size_t written = 0;  // the tensor elements inside the shard: what unpack writes
  kernels::for_each_segment(tensors, shard_rank * shard_elems, shard_elems,
                            [&](const kernels::pack_segment& s) {
                              if (s.tensor != kernels::pack_segment::padding) written += s.count;
                            });
  side_by_side(state, written * sizeof(T), [&] {
    kernels::unpack(std::span<const T>(shard.span()), shard_rank * shard_elems, tensors);
  });
}

template <class From, class To>
void bm_cast(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  const std::size_t n = bytes / sizeof(To);
  aligned_buffer<From> in(n);
  for (std::size_t i = 0; i < n; ++i)
    in[i] = fedshard::from_accum<From>(static_cast<double>(i % 4096) * 0.37 - 700.0);
  aligned_buffer<To> out(n);
  side_by_side(state, bytes,
               [&] { kernels::cast(std::span<const From>(in.span()), std::span<To>(out.span())); });
}

/// f32 values of a fixed pseudo-random sequence, roughly normal with the given spread.
aligned_buffer<float> f32_inputs(std::size_t n, float spread, std::uint32_t seed) {
  aligned_buffer<float> v(n);
  std::uint32_t x = seed * 2654435761u + 1u;
  const auto unit = [&] {  // xorshift32, uniform in [-1, 1)
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    return static_cast<float>(static_cast<std::int32_t>(x >> 8) - (1 << 23)) * 0x1p-23f;
  };
  for (std::size_t i = 0; i < n; ++i) v[i] = (unit() + unit() + unit()) * spread;
  return v;
}

/// kernels::cast between f32 and To (or back), against memcpy of the f32 side.
template <class From, class To>
void bm_cast_f32(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  const std::size_t n = bytes / sizeof(float);
  const aligned_buffer<float> values = f32_inputs(n, 300.0f, 1);
  aligned_buffer<From> in(n);
  kernels::cast(std::span<const float>(values.data(), n), std::span<From>(in.span()));
  aligned_buffer<To> out(n);
  side_by_side(state, bytes,
               [&] { kernels::cast(std::span<const From>(in.span()), std::span<To>(out.span())); });
}

/// Encode with a stateless codec C, against memcpy of its f32 input.
template <class C>
void bm_codec_encode(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  const std::size_t n = bytes / sizeof(float);
  const aligned_buffer<float> in = f32_inputs(n, 100.0f, 2);
  const C c({}, n);
  aligned_buffer<std::byte> wire(c.encoded_bytes(n));
  side_by_side(state, bytes, [&] {
    c.encode(std::span<const float>(in.data(), n), std::span<std::byte>(wire.span()));
  });
}

/// decode_add with a stateless codec C, against memcpy of its f32 output.
template <class C>
void bm_codec_decode_add(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  const std::size_t n = bytes / sizeof(float);
  const aligned_buffer<float> in = f32_inputs(n, 100.0f, 3);
  const C c({}, n);
  aligned_buffer<std::byte> wire(c.encoded_bytes(n));
  c.encode(std::span<const float>(in.data(), n), std::span<std::byte>(wire.span()));
  aligned_buffer<float> out(n);
  side_by_side(state, bytes, [&] {
    c.decode_add(std::span<const std::byte>(wire.span()), std::span<float>(out.span()));
  });
}

/// topk at its defaults (4096, 64, 2 bits; beta 0.95) encode: error feedback, selection,
/// quantisation.
void bm_topk_encode(benchmark::State& state) {
  using C = fedshard::codec::topk;
  const auto bytes = static_cast<std::size_t>(state.range(0));
  const std::size_t n = bytes / sizeof(float);
  const aligned_buffer<float> in = f32_inputs(n, 1.0f, 4);
  C c({.beta = 0.95f}, n);
  aligned_buffer<std::byte> wire(c.encoded_bytes(n));
  side_by_side(state, bytes, [&] {
    c.encode(std::span<const float>(in.data(), n), std::span<std::byte>(wire.span()));
  });
}

/// topk (defaults) decode_add, against memcpy of its f32 output.
void bm_topk_decode_add(benchmark::State& state) {
  using C = fedshard::codec::topk;
  const auto bytes = static_cast<std::size_t>(state.range(0));
  const std::size_t n = bytes / sizeof(float);
  const aligned_buffer<float> in = f32_inputs(n, 1.0f, 5);
  C c({.beta = 0.95f}, n);
  aligned_buffer<std::byte> wire(c.encoded_bytes(n));
  c.encode(std::span<const float>(in.data(), n), std::span<std::byte>(wire.span()));
  aligned_buffer<float> out(n);
  side_by_side(state, bytes, [&] {
    c.decode_add(std::span<const std::byte>(wire.span()), std::span<float>(out.span()));
  });
}

/// One AdamW step (kernels::adamw_step) against memcpy of the state it writes: the size
/// argument is the bytes of param, exp_avg and exp_avg_sq together (3 x 4 bytes per element;
/// the gradient is read besides). `loop` 0: adamw_step as the library runs it (the widest
/// instruction set, hand-vectorised blocks); 1: the functor's loop compiled for AVX2 without
/// the blocks (what adamw_step ran before them, scalar under -fmath-errno); 2: the portable
/// loop.
void bm_adamw(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  const std::size_t n = bytes / (3 * sizeof(float));
  aligned_buffer<float> p = f32_inputs(n, 1.0f, 1), m = f32_inputs(n, 0.1f, 2);
  const aligned_buffer<float> g = f32_inputs(n, 0.01f, 3);
  aligned_buffer<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v.data()[i] = g.data()[i] * g.data()[i];
  const auto s = kernels::make_adamw_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 10);
  const auto loop = state.range(1);
  side_by_side(state, 3 * n * sizeof(float), [&] {
    if (loop == 0) {
      kernels::adamw_step(p.span(), std::span<const float>(g.span()), m.span(), v.span(), s);
#if FEDSHARD_DISPATCH
    } else if (loop == 1 && kernels::detected_isa() >= kernels::isa::avx2) {
      kernels::detail::for_each_avx2(kernels::adamw_update{s}, n, p.data(), g.data(), m.data(),
                                     v.data());
#endif
    } else {
      kernels::for_each_element_on(kernels::isa::portable, kernels::adamw_update{s}, n, p.data(),
                                   g.data(), m.data(), v.data());
    }
  });
  state.SetLabel(loop == 0   ? std::string(kernels::to_string(kernels::active_isa())) + " blocks"
                 : loop == 1 ? "avx2 functor loop"
                             : "portable loop");
}

void sizes(benchmark::internal::Benchmark* b) {
  b->RangeMultiplier(4)->Range(64 << 10, 64 << 20)->UseManualTime()->Unit(benchmark::kMicrosecond);
}

BENCHMARK(bm_pack<float, float>)->Name("pack/f32")->Apply(sizes);
BENCHMARK(bm_unpack<float>)->Name("unpack/f32")->Apply(sizes);
BENCHMARK(bm_pack<float, bf16>)->Name("pack/f32_to_bf16")->Apply(sizes);
BENCHMARK(bm_cast<float, bf16>)->Name("cast/f32_to_bf16")->Apply(sizes);
BENCHMARK(bm_cast<bf16, float>)->Name("cast/bf16_to_f32")->Apply(sizes);
BENCHMARK(bm_cast<float, f16>)->Name("cast/f32_to_f16")->Apply(sizes);
BENCHMARK(bm_cast<f16, float>)->Name("cast/f16_to_f32")->Apply(sizes);

/// The f32 sizes of the rows named after a kernel: in cache, in L2/L3, in memory.
void f32_sizes(benchmark::internal::Benchmark* b) {
  b->Arg(256 << 10)->Arg(4 << 20)->Arg(64 << 20)->UseManualTime()->Unit(benchmark::kMicrosecond);
}

using fedshard::fp8_e4m3;
namespace codec = fedshard::codec;
BENCHMARK(bm_cast_f32<float, bf16>)->Name("cast_f32_bf16")->Apply(f32_sizes);
BENCHMARK(bm_cast_f32<bf16, float>)->Name("cast_bf16_f32")->Apply(f32_sizes);
BENCHMARK(bm_cast_f32<float, f16>)->Name("cast_f32_f16")->Apply(f32_sizes);
BENCHMARK(bm_cast_f32<f16, float>)->Name("cast_f16_f32")->Apply(f32_sizes);
BENCHMARK(bm_codec_encode<codec::cast<bf16>>)->Name("cast_bf16_encode")->Apply(f32_sizes);
BENCHMARK(bm_codec_decode_add<codec::cast<bf16>>)->Name("cast_bf16_decode_add")->Apply(f32_sizes);
BENCHMARK(bm_codec_encode<codec::cast<f16>>)->Name("cast_f16_encode")->Apply(f32_sizes);
BENCHMARK(bm_codec_decode_add<codec::cast<f16>>)->Name("cast_f16_decode_add")->Apply(f32_sizes);
BENCHMARK(bm_codec_encode<codec::cast<fp8_e4m3>>)->Name("fp8_encode")->Apply(f32_sizes);
BENCHMARK(bm_codec_decode_add<codec::cast<fp8_e4m3>>)->Name("fp8_decode_add")->Apply(f32_sizes);
BENCHMARK(bm_codec_encode<codec::int8_block>)->Name("int8_block_encode")->Apply(f32_sizes);
BENCHMARK(bm_codec_decode_add<codec::int8_block>)->Name("int8_block_decode_add")->Apply(f32_sizes);
BENCHMARK(bm_topk_encode)->Name("topk_encode")->Apply(f32_sizes);
BENCHMARK(bm_adamw)
    ->Name("adamw")
    ->ArgsProduct({{256 << 10, 4 << 20, 64 << 20}, {0, 1, 2}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_topk_decode_add)->Name("topk_decode_add")->Apply(f32_sizes);

}  // namespace
