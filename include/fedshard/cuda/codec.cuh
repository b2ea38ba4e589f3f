#pragma once
/// The wire codecs of fedshard/codec/ on the device: gpu::device_codec<C> encodes a device
/// array of f32 into a device wire and adds a device wire into a device array of f32, for
/// C = codec::cast<T> (float, bf16, f16, fp8_e4m3), codec::int8_block<Block> and
/// codec::topk<Chunk, K, Bits> (with its error-feedback residual in device memory).
///
/// Wires are byte-identical to the host codec's: the same state and input give the same wire
/// bytes on the device as C::encode gives on the host, decode_add gives the same f32 bits, and
/// topk's residual evolves bit for bit as the host's. So host and device ranks exchange
/// wires freely, and a device rank's wire decodes on a host rank (and conversely).
///
/// How the bits are kept. The casts call the FEDSHARD_HOST_DEVICE functors of codec/cast.hpp
/// (kernels/cast.hpp, core/fp8.hpp), integer code. The float arithmetic of int8_block and
/// topk (scales, codes, the residual's beta * e + delta, the values subtracted) is written
/// with the round-to-nearest intrinsics (__fadd_rn, __fmul_rn, __fdiv_rn), which nvcc never
/// contracts into fused multiply-adds, in the order the host codecs compute; rintf rounds
/// half to even as std::nearbyint does. Largest magnitudes are found on the bits of |x| (the
/// host's float comparisons, NaN ignored by int8_block and by topk's scale). Subnormals must
/// not be flushed: do not build with -ftz=true (or --use_fast_math).
///
/// topk on the device: one block per chunk folds delta into the residual, finds the k-th
/// largest |e| by a radix select on its bits (four 8-bit passes), and then takes, in index
/// order, every element above it and the first elements equal to it (ties to the lower
/// index, as the host's (|e|, -index) keys order them); the indices come out increasing
/// without a sort. A corrupt wire's out-of-range index is skipped by decode_add (the host
/// codec throws).
///
/// Every function enqueues its work on the given stream and returns (argument checks throw
/// fedshard::invalid_argument before anything is enqueued). Pointers are device memory; a
/// wire pointer must be aligned to codec::wire_alignment and hold exactly
/// encoded_bytes(size()) bytes. An encode and a decode_add of one topk codec must not run
/// concurrently on two streams (encode writes the residual).

#include "fedshard/cuda/config.cuh"

#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

#include "fedshard/codec/cast.hpp"
#include "fedshard/codec/codec.hpp"
#include "fedshard/codec/int8_block.hpp"
#include "fedshard/codec/topk.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/fp8.hpp"
#include "fedshard/cuda/device_buffer.cuh"
#include "fedshard/cuda/error.cuh"
#include "fedshard/error.hpp"
#include "fedshard/kernels/cast.hpp"

namespace fedshard::gpu {

namespace detail {

// ---------------------------------------------------------------- which codecs

/// Which host codec a device_codec wraps.
enum class codec_kind { none, cast, int8_block, topk };

template <class C>
struct codec_traits {
  static constexpr codec_kind kind = codec_kind::none;
};
template <class T>
struct codec_traits<codec::cast<T>> {
  static constexpr codec_kind kind = codec_kind::cast;
  using element = T;
};
template <std::size_t Block>
struct codec_traits<codec::int8_block<Block>> {
  static constexpr codec_kind kind = codec_kind::int8_block;
};
template <std::size_t Chunk, std::size_t K, unsigned Bits>
struct codec_traits<codec::topk<Chunk, K, Bits>> {
  static constexpr codec_kind kind = codec_kind::topk;
};

/// Blocks of a grid-stride launch over `items` items (at least one).
inline unsigned codec_grid(std::uint64_t items) {
  const std::uint64_t blocks = (items + block_threads - 1) / block_threads;
  return static_cast<unsigned>(blocks < 1 ? 1
                                          : (blocks > max_grid_blocks ? max_grid_blocks : blocks));
}

/// Blocks of a launch of one block per item (chunks, scale blocks), grid-stride beyond.
inline unsigned codec_grid_per_item(std::uint64_t items) {
  return static_cast<unsigned>(items < 1 ? 1 : (items > max_grid_blocks ? max_grid_blocks : items));
}

/// The bits of |x| (ordered as |x|; a NaN's above infinity's).
__device__ __forceinline__ std::uint32_t abs_bits(float x) {
  return ::fedshard::detail::bit_cast<std::uint32_t>(x) & 0x7fffffffu;
}

/// The bits of +infinity: |x| bits above it are a NaN's.
inline constexpr std::uint32_t infinity_bits = 0x7f800000u;

// ---------------------------------------------------------------- cast

/// wire[i] = codec::detail::cast_encode_fn<T>(in[i]).
template <class T>
__global__ void __launch_bounds__(block_threads)
    cast_encode_kernel(const float* in, T* wire, std::uint64_t n) {
  const codec::detail::cast_encode_fn<T> f;
  for (std::uint64_t i = blockIdx.x * std::uint64_t{block_threads} + threadIdx.x; i < n;
       i += std::uint64_t{gridDim.x} * block_threads)
    wire[i] = f(in[i]);
}

/// The exact f32 value of a wire element, as codec::detail::cast_decode_add_fn reads it.
template <class T>
__device__ __forceinline__ float cast_value(T w) {
  if constexpr (std::is_same_v<T, fp8_e4m3>)
    return w.to_float();
  else
    return kernels::cast_fn<T, float>{}(w);
}

/// out[i] += value of wire[i].
template <class T>
__global__ void __launch_bounds__(block_threads)
    cast_decode_add_kernel(const T* wire, float* out, std::uint64_t n) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{block_threads} + threadIdx.x; i < n;
       i += std::uint64_t{gridDim.x} * block_threads)
    out[i] = __fadd_rn(out[i], cast_value(wire[i]));
}

// ---------------------------------------------------------------- int8_block

/// codec::detail::int8_quantise with round-to-nearest intrinsics.
__device__ __forceinline__ std::int8_t int8_code(float x, float scale) {
  if (!(scale > 0.0f)) return 0;
  const float q = rintf(__fdiv_rn(x, scale));
  return static_cast<std::int8_t>(q >= -127.0f ? (q <= 127.0f ? q : 127.0f) : -127.0f);
}

/// One block per scale block (grid-stride): absmax of its elements (NaN ignored, as the
/// host's `a > absmax` does), scale = absmax / 127, codes.
template <std::size_t Block>
__global__ void __launch_bounds__(block_threads)
    int8_encode_kernel(const float* in, std::uint64_t n, std::uint64_t blocks, float* scales,
                       std::int8_t* codes) {
  __shared__ std::uint32_t absmax_bits;
  for (std::uint64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const std::uint64_t begin = b * Block;
    const std::uint64_t end = begin + Block < n ? begin + Block : n;
    if (threadIdx.x == 0) absmax_bits = 0;
    __syncthreads();
    std::uint32_t local = 0;
    for (std::uint64_t i = begin + threadIdx.x; i < end; i += block_threads) {
      const std::uint32_t a = abs_bits(in[i]);
      if (a <= infinity_bits && a > local) local = a;
    }
    atomicMax(&absmax_bits, local);
    __syncthreads();
    const float scale = __fdiv_rn(::fedshard::detail::bit_cast<float>(absmax_bits), 127.0f);
    if (threadIdx.x == 0) scales[b] = scale;
    for (std::uint64_t i = begin + threadIdx.x; i < end; i += block_threads)
      codes[i] = int8_code(in[i], scale);
    __syncthreads();  // absmax_bits is reset for the next block
  }
}

/// out[i] += code[i] * scale of i's block.
template <std::size_t Block>
__global__ void __launch_bounds__(block_threads)
    int8_decode_add_kernel(const float* scales, const std::int8_t* codes, float* out,
                           std::uint64_t n) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{block_threads} + threadIdx.x; i < n;
       i += std::uint64_t{gridDim.x} * block_threads)
    out[i] = __fadd_rn(out[i], __fmul_rn(static_cast<float>(codes[i]), scales[i / Block]));
}

// ---------------------------------------------------------------- topk

/// codec::detail::topk_quantiser<Bits> with round-to-nearest intrinsics.
template <unsigned Bits>
struct topk_device_quantiser {
  using host = codec::detail::topk_quantiser<Bits>;
  static constexpr std::uint32_t levels = host::levels;
  static constexpr std::uint32_t sign_bit = host::sign_bit;

  /// The code of v (|v| <= s): sign bit and level - 1.
  __device__ static std::uint32_t encode(float v, float s) {
    const float lv = static_cast<float>(levels);
    const float t =
        s > 0.0f ? floorf(__fadd_rn(__fmul_rn(__fdiv_rn(fabsf(v), s), lv), 0.5f)) : 1.0f;
    const float l = t >= 1.0f ? (t <= lv ? t : lv) : 1.0f;  // a NaN gives level 1
    const bool negative = (::fedshard::detail::bit_cast<std::uint32_t>(v) >> 31) != 0;
    return (negative ? sign_bit : 0u) | (static_cast<std::uint32_t>(l) - 1u);
  }
  /// The value of a code: sign * s * (level / L).
  __device__ static float decode(std::uint32_t code, float s) {
    const float magnitude = __fmul_rn(
        s,
        __fdiv_rn(static_cast<float>((code & (sign_bit - 1u)) + 1u), static_cast<float>(levels)));
    return (code & sign_bit) ? -magnitude : magnitude;
  }
};

/// The sizes of a topk wire the kernels need (C's constexpr functions are host-only):
/// byte offsets of its sections (those of topk's file comment), bytes of codes of a full
/// chunk, selections.
struct topk_sections {
  std::uint64_t indices = 0;      ///< after the scales (quantised) or the f32 values
  std::uint64_t codes = 0;        ///< quantised: after the indices
  std::uint64_t code_stride = 0;  ///< quantised: code bytes of a chunk that sends K
  std::uint64_t selections = 0;   ///< elements sent
};

template <class C>
constexpr topk_sections topk_layout(std::size_t n) noexcept {
  using index_t = typename C::index_t;
  const std::size_t floats = C::quantised ? C::chunks(n) : C::selected(n);
  const std::size_t indices = floats * sizeof(float);
  return {.indices = indices,
          .codes = indices + C::selected(n) * sizeof(index_t),
          .code_stride = C::code_bytes(C::k),
          .selections = C::selected(n)};
}

/// 32-bit words of shared memory holding one chunk's codes while they are packed.
template <class C>
inline constexpr std::size_t topk_code_words = C::quantised ? (C::k* C::bits + 31) / 32 : 1;

/// The shared memory of a block of topk_encode_kernel.
template <class C>
struct topk_shared {
  typename cub::BlockScan<std::uint32_t, block_threads>::TempStorage scan;
  std::uint32_t histogram[256];
  std::uint32_t prefix, remaining, scale_bits;
  std::uint32_t code_words[topk_code_words<C>];
};

/// Where a chunk's selection stops: elements whose |e| bits are above `threshold` are taken,
/// and the first `need` (in index order) of those equal to it.
struct topk_cut {
  std::uint32_t threshold = 0;
  std::uint32_t need = 0;
};

/// Step 1 of a chunk of m elements: fold delta into the residual (as the host: e + delta
/// when beta is 1).
__device__ __forceinline__ void topk_fold(float* ec, const float* dc, std::uint32_t m, float beta) {
  for (std::uint32_t i = threadIdx.x; i < m; i += block_threads)
    ec[i] = beta == 1.0f ? __fadd_rn(ec[i], dc[i]) : __fadd_rn(__fmul_rn(beta, ec[i]), dc[i]);
  __syncthreads();
}

/// One radix pass of topk_threshold on the byte at `shift`: among the elements whose bits
/// under `mask` equal `prefix`, the digit of the remaining-th largest, appended to prefix;
/// remaining becomes its rank among the elements of that digit.
template <class C>
__device__ __forceinline__ void topk_radix_pass(const float* ec, std::uint32_t m, int shift,
                                                std::uint32_t& prefix, std::uint32_t mask,
                                                std::uint32_t& remaining, topk_shared<C>& sh) {
  const unsigned t = threadIdx.x;
  for (unsigned b = t; b < 256; b += block_threads) sh.histogram[b] = 0;
  __syncthreads();
  for (std::uint32_t i = t; i < m; i += block_threads) {
    const std::uint32_t key = abs_bits(ec[i]);
    if ((key & mask) == prefix) atomicAdd(&sh.histogram[(key >> shift) & 0xffu], 1u);
  }
  __syncthreads();
  if (t == 0) {
    // The digit of the remaining-th largest candidate: bins above it hold fewer.
    std::uint32_t above = 0;
    unsigned b = 255;
    for (; b > 0; --b) {
      if (above + sh.histogram[b] >= remaining) break;
      above += sh.histogram[b];
    }
    sh.prefix = prefix | (static_cast<std::uint32_t>(b) << shift);
    sh.remaining = remaining - above;
  }
  __syncthreads();
  prefix = sh.prefix;
  remaining = sh.remaining;
}

/// Step 2 (k < m): the k-th largest |e| bits (threshold) and how many elements equal to it
/// are taken (need), by four 8-bit radix passes from the top byte.
template <class C>
__device__ __forceinline__ topk_cut topk_threshold(const float* ec, std::uint32_t m,
                                                   std::uint32_t k, topk_shared<C>& sh) {
  std::uint32_t prefix = 0, mask = 0, remaining = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    topk_radix_pass<C>(ec, m, shift, prefix, mask, remaining, sh);
    mask |= 0xffu << shift;
  }
  return {.threshold = prefix, .need = remaining};
}

/// Step 3: the selection in index order: above the threshold, or equal to it and among the
/// first `need` such (every element when take_all); position j = selected elements before
/// it. Writes the indices (idx), and f32 values (values) with their residual updates; a
/// quantised C takes the largest selected |e| bits (NaN ignored, as the host's max) into
/// sh.scale_bits.
template <class C>
__device__ __forceinline__ void topk_select(float* ec, std::uint32_t m, bool take_all, topk_cut cut,
                                            typename C::index_t* idx, float* values,
                                            topk_shared<C>& sh) {
  using index_t = typename C::index_t;
  using scan = cub::BlockScan<std::uint32_t, block_threads>;
  const unsigned t = threadIdx.x;
  std::uint32_t equal_before_tile = 0, selected_before_tile = 0;
  for (std::uint32_t tile = 0; tile < m; tile += block_threads) {
    const std::uint32_t i = tile + t;
    const bool inside = i < m;
    const float v = inside ? ec[i] : 0.0f;
    const std::uint32_t key = abs_bits(v);
    const std::uint32_t equal = inside && !take_all && key == cut.threshold ? 1u : 0u;
    std::uint32_t equal_before = 0, equal_total = 0;
    scan(sh.scan).ExclusiveSum(equal, equal_before, equal_total);
    __syncthreads();
    const bool selected = inside && (take_all || key > cut.threshold ||
                                     (equal != 0 && equal_before_tile + equal_before < cut.need));
    std::uint32_t position = 0, selected_total = 0;
    scan(sh.scan).ExclusiveSum(selected ? 1u : 0u, position, selected_total);
    __syncthreads();
    if (selected) {
      const std::uint32_t j = selected_before_tile + position;
      idx[j] = static_cast<index_t>(i);
      if constexpr (C::quantised) {
        if (key <= infinity_bits) atomicMax(&sh.scale_bits, key);
      } else {
        values[j] = v;
        ec[i] = __fsub_rn(v, v);
      }
    }
    equal_before_tile += equal_total;
    selected_before_tile += selected_total;
  }
}

/// Step 4 (quantised C): the scale (into *scale), each of the k selected elements' code
/// (packed in shared memory, then written to codes), and the residual minus the value sent.
template <class C>
__device__ __forceinline__ void topk_quantise(float* ec, std::uint32_t k,
                                              const typename C::index_t* idx, float* scale,
                                              std::uint8_t* codes, topk_shared<C>& sh) {
  using quantiser = topk_device_quantiser<C::bits>;
  constexpr unsigned bits = C::bits;
  const unsigned t = threadIdx.x;
  for (unsigned w = t; w < topk_code_words<C>; w += block_threads) sh.code_words[w] = 0;
  __syncthreads();  // also makes the indices written by topk_select visible to the block
  const float s = ::fedshard::detail::bit_cast<float>(sh.scale_bits);
  if (t == 0) *scale = s;
  for (std::uint32_t j = t; j < k; j += block_threads) {
    const std::uint32_t i = idx[j];
    const float v = ec[i];
    const std::uint32_t code = quantiser::encode(v, s);
    const std::uint32_t bit = j * bits;
    const std::uint32_t word = bit / 32, off = bit % 32;
    atomicOr(&sh.code_words[word], code << off);
    if (off + bits > 32) atomicOr(&sh.code_words[word + 1], code >> (32 - off));
    ec[i] = __fsub_rn(v, quantiser::decode(code, s));
  }
  __syncthreads();
  const std::uint32_t bytes = (k * bits + 7) / 8;  // topk::code_bytes(k)
  for (std::uint32_t b = t; b < bytes; b += block_threads)
    codes[b] = static_cast<std::uint8_t>((sh.code_words[b / 4] >> (8 * (b % 4))) & 0xffu);
}

/// One block per chunk (grid-stride): e <- beta e + delta, radix select of the k-th largest
/// |e| bits, selection in index order (block scans), indices written, then the scale, codes
/// and residual updates (quantised) or values and residual updates (f32). The steps are the
/// __forceinline__ helpers above.
template <class C>
__global__ void __launch_bounds__(block_threads)
    topk_encode_kernel(const float* delta, float* e, std::uint64_t n, float beta, std::byte* wire,
                       topk_sections at) {
  using index_t = typename C::index_t;
  constexpr std::uint64_t chunk = C::chunk;
  constexpr std::uint64_t K = C::k;
  __shared__ topk_shared<C> sh;

  const std::uint64_t chunks = (n + chunk - 1) / chunk;
  float* const scales_or_values = reinterpret_cast<float*>(wire);
  index_t* const indices = reinterpret_cast<index_t*>(wire + at.indices);
  std::uint8_t* const all_codes = reinterpret_cast<std::uint8_t*>(wire + at.codes);

  for (std::uint64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const std::uint64_t base = c * chunk;
    const std::uint32_t m = static_cast<std::uint32_t>(n - base < chunk ? n - base : chunk);
    const std::uint32_t k = static_cast<std::uint32_t>(K < m ? K : m);
    float* const ec = e + base;
    index_t* const idx = indices + c * K;

    topk_fold(ec, delta + base, m, beta);
    const bool take_all = k == m;
    topk_cut cut{};
    if (!take_all) cut = topk_threshold<C>(ec, m, k, sh);
    if (threadIdx.x == 0) sh.scale_bits = 0;
    __syncthreads();
    topk_select<C>(ec, m, take_all, cut, idx, scales_or_values + c * K, sh);
    if constexpr (C::quantised)
      topk_quantise<C>(ec, k, idx, scales_or_values + c, all_codes + c * at.code_stride, sh);
    __syncthreads();  // shared state is reset for the next chunk
  }
}

/// One thread per selection g of the wire: out[chunk base + index] += value.
template <class C>
__global__ void __launch_bounds__(block_threads)
    topk_decode_add_kernel(const std::byte* wire, float* out, std::uint64_t n, topk_sections at) {
  using index_t = typename C::index_t;
  constexpr std::uint64_t chunk = C::chunk;
  constexpr std::uint64_t K = C::k;
  const float* const scales_or_values = reinterpret_cast<const float*>(wire);
  const index_t* const indices = reinterpret_cast<const index_t*>(wire + at.indices);
  const std::uint8_t* const all_codes = reinterpret_cast<const std::uint8_t*>(wire + at.codes);
  for (std::uint64_t g = blockIdx.x * std::uint64_t{block_threads} + threadIdx.x; g < at.selections;
       g += std::uint64_t{gridDim.x} * block_threads) {
    const std::uint64_t c = g / K, j = g % K;
    const std::uint64_t base = c * chunk;
    const std::uint64_t m = n - base < chunk ? n - base : chunk;
    const std::uint64_t i = indices[g];
    if (i >= m) continue;  // a corrupt wire (the host codec throws)
    float value;
    if constexpr (C::quantised) {
      using quantiser = topk_device_quantiser<C::bits>;
      const std::uint8_t* const codes = all_codes + c * at.code_stride;
      value = quantiser::decode(codec::detail::get_code<C::bits>(codes, j * C::bits),
                                scales_or_values[c]);
    } else {
      value = scales_or_values[g];
    }
    out[base + i] = __fadd_rn(out[base + i], value);
  }
}

}  // namespace detail

/// A codec of fedshard/codec/ (cast<T>, int8_block<Block>, topk<Chunk, K, Bits>) on the
/// device, for one rank's buffer of n elements; its wires are byte-identical to C's (see
/// the file comment). Stateful codecs (topk) own their residual in device memory.
template <class C>
class device_codec {
  static constexpr detail::codec_kind kind = detail::codec_traits<C>::kind;
  static_assert(kind != detail::codec_kind::none,
                "fedshard::gpu::device_codec: C must be codec::cast<T>, codec::int8_block<Block> "
                "or codec::topk<Chunk, K, Bits>");
  static_assert(codec::Codec<C>);

 public:
  /// The host codec whose wires this one writes and reads.
  using host_codec = C;
  /// C's run-time settings.
  using config = typename C::config;
  static constexpr bool stateful = C::stateful;

  /// A codec for device buffers of n elements (a zero residual when stateful; allocated
  /// and zeroed synchronously on the current device).
  device_codec(config cfg, std::size_t n) : cfg_(cfg), n_(n) {
    if constexpr (kind == detail::codec_kind::topk) {
      FEDSHARD_EXPECTS(cfg.beta >= 0.0f && cfg.beta <= 1.0f,
                       "gpu::device_codec<topk>: beta must be in [0, 1], found ", cfg.beta);
      static_assert(detail::topk_code_words<C> * 4 <= 16384,
                    "fedshard::gpu::device_codec<topk>: K * Bits must be at most 131072 bits "
                    "(one chunk's codes are packed in shared memory)");
      residual_ = device_buffer<float>(n);
    }
  }

  /// Elements of the buffer.
  std::size_t size() const noexcept { return n_; }
  /// The exact wire size for n elements, C's.
  static constexpr std::size_t encoded_bytes(std::size_t n) noexcept { return C::encoded_bytes(n); }
  /// The settings.
  const config& settings() const noexcept { return cfg_; }

  /// Fills the wire (device memory, encoded_bytes(size()) bytes, aligned) from in (size()
  /// f32 on the device), as C::encode does, updating the residual when stateful.
  void encode(cudaStream_t stream, const float* in, std::byte* wire) {
    check(in, wire, "encode");
    if (n_ == 0) return;
    const auto n = static_cast<std::uint64_t>(n_);
    if constexpr (kind == detail::codec_kind::cast) {
      using T = typename detail::codec_traits<C>::element;
      if constexpr (std::is_same_v<T, float>) {
        FEDSHARD_CUDA_TRY(
            cudaMemcpyAsync(wire, in, n_ * sizeof(float), cudaMemcpyDeviceToDevice, stream));
      } else {
        detail::cast_encode_kernel<T><<<detail::codec_grid(n), block_threads, 0, stream>>>(
            in, reinterpret_cast<T*>(wire), n);
        detail::check_launch("fedshard::gpu::device_codec<cast>::encode");
      }
    } else if constexpr (kind == detail::codec_kind::int8_block) {
      const std::uint64_t blocks = C::blocks(n_);
      detail::int8_encode_kernel<C::block>
          <<<detail::codec_grid_per_item(blocks), block_threads, 0, stream>>>(
              in, n, blocks, reinterpret_cast<float*>(wire),
              reinterpret_cast<std::int8_t*>(wire + blocks * sizeof(float)));
      detail::check_launch("fedshard::gpu::device_codec<int8_block>::encode");
    } else {
      detail::topk_encode_kernel<C>
          <<<detail::codec_grid_per_item(C::chunks(n_)), block_threads, 0, stream>>>(
              in, residual_.data(), n, cfg_.beta, wire, detail::topk_layout<C>(n_));
      detail::check_launch("fedshard::gpu::device_codec<topk>::encode");
    }
  }

  /// out[i] += the value wire (any rank's, same size()) sends for element i, as
  /// C::decode_add does; out is size() f32 on the device.
  void decode_add(cudaStream_t stream, const std::byte* wire, float* out) const {
    check(out, wire, "decode_add");
    if (n_ == 0) return;
    const auto n = static_cast<std::uint64_t>(n_);
    if constexpr (kind == detail::codec_kind::cast) {
      using T = typename detail::codec_traits<C>::element;
      detail::cast_decode_add_kernel<T><<<detail::codec_grid(n), block_threads, 0, stream>>>(
          reinterpret_cast<const T*>(wire), out, n);
      detail::check_launch("fedshard::gpu::device_codec<cast>::decode_add");
    } else if constexpr (kind == detail::codec_kind::int8_block) {
      const std::uint64_t blocks = C::blocks(n_);
      detail::int8_decode_add_kernel<C::block><<<detail::codec_grid(n), block_threads, 0, stream>>>(
          reinterpret_cast<const float*>(wire),
          reinterpret_cast<const std::int8_t*>(wire + blocks * sizeof(float)), out, n);
      detail::check_launch("fedshard::gpu::device_codec<int8_block>::decode_add");
    } else {
      const std::uint64_t selections = C::selected(n_);
      if (selections == 0) return;
      detail::topk_decode_add_kernel<C>
          <<<detail::codec_grid(selections), block_threads, 0, stream>>>(
              wire, out, n, detail::topk_layout<C>(n_));
      detail::check_launch("fedshard::gpu::device_codec<topk>::decode_add");
    }
  }

  /// The error-feedback residual, size() f32 in device memory (a checkpoint reads or
  /// restores it; host and device residuals of the same history are equal bit for bit).
  std::span<float> residual() noexcept requires stateful { return residual_.span(); }
  /// The residual, read-only.
  std::span<const float> residual() const noexcept requires stateful { return residual_.span(); }
  /// Zeroes the residual, in the order of stream.
  void reset(cudaStream_t stream) requires stateful {
    if (!residual_.empty())
      FEDSHARD_CUDA_TRY(cudaMemsetAsync(residual_.data(), 0, residual_.size_bytes(), stream));
  }
  /// The residual decay (topk's beta).
  float beta() const noexcept requires stateful { return cfg_.beta; }
  /// Sets the residual decay (in [0, 1]); it applies from the next encode.
  void set_beta(float beta) requires stateful {
    FEDSHARD_EXPECTS(beta >= 0.0f && beta <= 1.0f,
                     "gpu::device_codec<topk>: beta must be in "
                     "[0, 1], found ",
                     beta);
    cfg_.beta = beta;
  }

 private:
  /// The checks of C's host codec (wire alignment), and data where there are elements.
  void check(const void* data, const std::byte* wire, const char* what) const {
    const std::size_t bytes = C::encoded_bytes(n_);
    codec::detail::check_wire(C::name, what, wire, bytes, bytes, n_);
    FEDSHARD_EXPECTS(n_ == 0 || (data != nullptr && (bytes == 0 || wire != nullptr)),
                     "gpu::device_codec<", C::name, ">::", what, ": null device pointer for ", n_,
                     " elements");
    FEDSHARD_EXPECTS(reinterpret_cast<std::uintptr_t>(data) % alignof(float) == 0,
                     "gpu::device_codec<", C::name, ">::", what, ": f32 array at ", data,
                     " is not aligned to 4 bytes");
  }

  config cfg_;
  std::size_t n_ = 0;
  device_buffer<float> residual_;  // stateful codecs only
};

}  // namespace fedshard::gpu
