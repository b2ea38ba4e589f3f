#pragma once
/// The wire codecs of fedshard/codec/ on the device: gpu::device_codec<C> encodes a device
/// array of f32 into a device wire and adds a device wire into a device array of f32, for
/// C = codec::cast<T> (float, bf16, f16, fp8_e4m3), codec::int8_block and codec::topk (with
/// its error-feedback residual in device memory), with the codec's run-time settings.
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
template <>
struct codec_traits<codec::int8_block> {
  static constexpr codec_kind kind = codec_kind::int8_block;
};
template <>
struct codec_traits<codec::topk> {
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

/// One block per scale block of `block` elements (grid-stride): absmax of its elements (NaN
/// ignored, as the host's `a > absmax` does), scale = absmax / 127, codes.
__global__ void __launch_bounds__(block_threads)
    int8_encode_kernel(const float* in, std::uint64_t n, std::uint64_t block, std::uint64_t blocks,
                       float* scales, std::int8_t* codes) {
  __shared__ std::uint32_t absmax_bits;
  for (std::uint64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const std::uint64_t begin = b * block;
    const std::uint64_t end = begin + block < n ? begin + block : n;
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

/// out[i] += code[i] * scale of i's block (of `block` elements).
__global__ void __launch_bounds__(block_threads)
    int8_decode_add_kernel(const float* scales, const std::int8_t* codes, float* out,
                           std::uint64_t n, std::uint64_t block) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{block_threads} + threadIdx.x; i < n;
       i += std::uint64_t{gridDim.x} * block_threads)
    out[i] = __fadd_rn(out[i], __fmul_rn(static_cast<float>(codes[i]), scales[i / block]));
}

// ---------------------------------------------------------------- topk

/// codec::detail::topk_quantiser with round-to-nearest intrinsics (bits in 1..8).
struct topk_device_quantiser {
  std::uint32_t levels;
  std::uint32_t sign_bit;

  __device__ explicit topk_device_quantiser(unsigned bits)
      : levels(1u << (bits - 1)), sign_bit(1u << (bits - 1)) {}

  /// The code of v (|v| <= s): sign bit and level - 1.
  __device__ std::uint32_t encode(float v, float s) const {
    const float lv = static_cast<float>(levels);
    const float t =
        s > 0.0f ? floorf(__fadd_rn(__fmul_rn(__fdiv_rn(fabsf(v), s), lv), 0.5f)) : 1.0f;
    const float l = t >= 1.0f ? (t <= lv ? t : lv) : 1.0f;  // a NaN gives level 1
    const bool negative = (::fedshard::detail::bit_cast<std::uint32_t>(v) >> 31) != 0;
    return (negative ? sign_bit : 0u) | (static_cast<std::uint32_t>(l) - 1u);
  }
  /// The value of a code: sign * s * (level / L).
  __device__ float decode(std::uint32_t code, float s) const {
    const float magnitude = __fmul_rn(
        s,
        __fdiv_rn(static_cast<float>((code & (sign_bit - 1u)) + 1u), static_cast<float>(levels)));
    return (code & sign_bit) ? -magnitude : magnitude;
  }
};

/// What the kernels need of a topk wire and its settings (the host codec's functions are
/// host-only): byte offsets of its sections (those of topk's file comment), bytes of codes
/// of a full chunk, selections, and the settings.
struct topk_sections {
  std::uint64_t indices = 0;      ///< after the scales (quantised) or the f32 values
  std::uint64_t codes = 0;        ///< quantised: after the indices
  std::uint64_t code_stride = 0;  ///< quantised: code bytes of a chunk that sends K
  std::uint64_t selections = 0;   ///< elements sent
  std::uint64_t chunk = 0;        ///< Chunk
  std::uint64_t k = 0;            ///< K
  unsigned bits = 0;              ///< Bits (codec::topk_unquantised: f32 values)
  bool quantised = false;
};

inline topk_sections topk_layout(const codec::topk::config& c, std::size_t n) noexcept {
  using C = codec::topk;
  const std::size_t floats = C::quantised(c) ? C::chunks(c, n) : C::selected(c, n);
  const std::size_t indices = floats * sizeof(float);
  return {.indices = indices,
          .codes = indices + C::selected(c, n) * C::index_bytes(c),
          .code_stride = C::code_bytes(c, c.k),
          .selections = C::selected(c, n),
          .chunk = c.chunk,
          .k = c.k,
          .bits = c.bits,
          .quantised = C::quantised(c)};
}

/// 32-bit words of shared memory holding one chunk's codes while they are packed.
inline std::size_t topk_code_words(const codec::topk::config& c) noexcept {
  return codec::topk::quantised(c) ? (c.k * c.bits + 31) / 32 : 1;
}

/// The most bytes of shared memory one chunk's codes may take (K * Bits <= 131072 bits).
inline constexpr std::size_t topk_max_code_bytes = 16384;

/// The static shared memory of a block of topk_encode_kernel; the chunk's code words are
/// its dynamic shared memory (topk_code_words x 4 bytes).
struct topk_shared {
  typename cub::BlockScan<std::uint32_t, block_threads>::TempStorage scan;
  std::uint32_t histogram[256];
  std::uint32_t prefix, remaining, scale_bits;
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
__device__ __forceinline__ void topk_radix_pass(const float* ec, std::uint32_t m, int shift,
                                                std::uint32_t& prefix, std::uint32_t mask,
                                                std::uint32_t& remaining, topk_shared& sh) {
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
__device__ __forceinline__ topk_cut topk_threshold(const float* ec, std::uint32_t m,
                                                   std::uint32_t k, topk_shared& sh) {
  std::uint32_t prefix = 0, mask = 0, remaining = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    topk_radix_pass(ec, m, shift, prefix, mask, remaining, sh);
    mask |= 0xffu << shift;
  }
  return {.threshold = prefix, .need = remaining};
}

/// Step 3: the selection in index order: above the threshold, or equal to it and among the
/// first `need` such (every element when take_all); position j = selected elements before
/// it. Writes the indices (idx, of the wire's Index type), and f32 values (values) with their
/// residual updates; when quantised, takes the largest selected |e| bits (NaN ignored, as the
/// host's max) into sh.scale_bits.
template <class Index>
__device__ __forceinline__ void topk_select(float* ec, std::uint32_t m, bool take_all, topk_cut cut,
                                            bool quantised, Index* idx, float* values,
                                            topk_shared& sh) {
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
      idx[j] = static_cast<Index>(i);
      if (quantised) {
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

/// Step 4 (quantised): the scale (into *scale), each of the k selected elements' code
/// (packed in the shared words code_words, `words` of them, then written to codes), and the
/// residual minus the value sent.
template <class Index>
__device__ __forceinline__ void topk_quantise(float* ec, std::uint32_t k, unsigned bits,
                                              const Index* idx, float* scale, std::uint8_t* codes,
                                              std::uint32_t* code_words, std::uint32_t words,
                                              topk_shared& sh) {
  const topk_device_quantiser quantiser(bits);
  const unsigned t = threadIdx.x;
  for (unsigned w = t; w < words; w += block_threads) code_words[w] = 0;
  __syncthreads();  // also makes the indices written by topk_select visible to the block
  const float s = ::fedshard::detail::bit_cast<float>(sh.scale_bits);
  if (t == 0) *scale = s;
  for (std::uint32_t j = t; j < k; j += block_threads) {
    const std::uint32_t i = idx[j];
    const float v = ec[i];
    const std::uint32_t code = quantiser.encode(v, s);
    const std::uint32_t bit = j * bits;
    const std::uint32_t word = bit / 32, off = bit % 32;
    atomicOr(&code_words[word], code << off);
    if (off + bits > 32) atomicOr(&code_words[word + 1], code >> (32 - off));
    ec[i] = __fsub_rn(v, quantiser.decode(code, s));
  }
  __syncthreads();
  const std::uint32_t bytes = (k * bits + 7) / 8;  // topk::code_bytes(k)
  for (std::uint32_t b = t; b < bytes; b += block_threads)
    codes[b] = static_cast<std::uint8_t>((code_words[b / 4] >> (8 * (b % 4))) & 0xffu);
}

/// One block per chunk (grid-stride): e <- beta e + delta, radix select of the k-th largest
/// |e| bits, selection in index order (block scans), indices written, then the scale, codes
/// and residual updates (quantised) or values and residual updates (f32). The steps are the
/// __forceinline__ helpers above. Index: the wire's index type; the dynamic shared memory
/// holds a chunk's code words.
template <class Index>
__global__ void __launch_bounds__(block_threads)
    topk_encode_kernel(const float* delta, float* e, std::uint64_t n, float beta, std::byte* wire,
                       topk_sections at, std::uint32_t code_words) {
  using index_t = Index;
  const std::uint64_t chunk = at.chunk;
  const std::uint64_t K = at.k;
  __shared__ topk_shared sh;
  extern __shared__ std::uint32_t dynamic_words[];

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
    if (!take_all) cut = topk_threshold(ec, m, k, sh);
    if (threadIdx.x == 0) sh.scale_bits = 0;
    __syncthreads();
    topk_select(ec, m, take_all, cut, at.quantised, idx, scales_or_values + c * K, sh);
    if (at.quantised)
      topk_quantise(ec, k, at.bits, idx, scales_or_values + c, all_codes + c * at.code_stride,
                    dynamic_words, code_words, sh);
    __syncthreads();  // shared state is reset for the next chunk
  }
}

/// One thread per selection g of the wire: out[chunk base + index] += value.
template <class Index>
__global__ void __launch_bounds__(block_threads)
    topk_decode_add_kernel(const std::byte* wire, float* out, std::uint64_t n, topk_sections at) {
  using index_t = Index;
  const std::uint64_t chunk = at.chunk;
  const std::uint64_t K = at.k;
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
    if (at.quantised) {
      const topk_device_quantiser quantiser(at.bits);
      const std::uint8_t* const codes = all_codes + c * at.code_stride;
      value = quantiser.decode(codec::detail::get_code(codes, j * at.bits, at.bits),
                               scales_or_values[c]);
    } else {
      value = scales_or_values[g];
    }
    out[base + i] = __fadd_rn(out[base + i], value);
  }
}

}  // namespace detail

/// A codec of fedshard/codec/ (cast<T>, int8_block, topk, with their settings) on the
/// device, for one rank's buffer of n elements; its wires are byte-identical to C's (see
/// the file comment). Stateful codecs (topk) own their residual in device memory.
template <class C>
class device_codec {
  static constexpr detail::codec_kind kind = detail::codec_traits<C>::kind;
  static_assert(kind != detail::codec_kind::none,
                "fedshard::gpu::device_codec: C must be codec::cast<T>, codec::int8_block or "
                "codec::topk");
  static_assert(codec::Codec<C>);

 public:
  /// The host codec whose wires this one writes and reads.
  using host_codec = C;
  /// C's run-time settings.
  using config = typename C::config;
  static constexpr bool stateful = C::stateful;

  /// A codec for device buffers of n elements (a zero residual when stateful; allocated
  /// and zeroed synchronously on the current device); invalid_argument for settings the host
  /// codec refuses, and for a topk whose K * Bits exceeds 131072 bits (one chunk's codes
  /// are packed in shared memory).
  device_codec(config cfg, std::size_t n) : cfg_(cfg), n_(n) {
    (void)C(cfg, 0);  // the host codec's checks of the settings
    if constexpr (kind == detail::codec_kind::topk) {
      FEDSHARD_EXPECTS(detail::topk_code_words(cfg) * 4 <= detail::topk_max_code_bytes,
                       "gpu::device_codec<topk>: k * bits must be at most 131072 bits (one "
                       "chunk's codes are packed in shared memory), found ",
                       cfg.k, " * ", cfg.bits);
      residual_ = device_buffer<float>(n);
    }
  }

  /// Elements of the buffer.
  std::size_t size() const noexcept { return n_; }
  /// The exact wire size for n elements, C's with these settings.
  std::size_t encoded_bytes(std::size_t n) const noexcept { return C::encoded_bytes(cfg_, n); }
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
      const std::uint64_t blocks = C::blocks(cfg_, n_);
      detail::int8_encode_kernel<<<detail::codec_grid_per_item(blocks), block_threads, 0, stream>>>(
          in, n, cfg_.block, blocks, reinterpret_cast<float*>(wire),
          reinterpret_cast<std::int8_t*>(wire + blocks * sizeof(float)));
      detail::check_launch("fedshard::gpu::device_codec<int8_block>::encode");
    } else {
      const auto words = static_cast<std::uint32_t>(detail::topk_code_words(cfg_));
      const unsigned grid = detail::codec_grid_per_item(C::chunks(cfg_, n_));
      const std::size_t shared = std::size_t{words} * 4;
      const detail::topk_sections at = detail::topk_layout(cfg_, n_);
      if (C::index_bytes(cfg_) == 2)
        detail::topk_encode_kernel<std::uint16_t><<<grid, block_threads, shared, stream>>>(
            in, residual_.data(), n, cfg_.beta, wire, at, words);
      else
        detail::topk_encode_kernel<std::uint32_t><<<grid, block_threads, shared, stream>>>(
            in, residual_.data(), n, cfg_.beta, wire, at, words);
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
      const std::uint64_t blocks = C::blocks(cfg_, n_);
      detail::int8_decode_add_kernel<<<detail::codec_grid(n), block_threads, 0, stream>>>(
          reinterpret_cast<const float*>(wire),
          reinterpret_cast<const std::int8_t*>(wire + blocks * sizeof(float)), out, n, cfg_.block);
      detail::check_launch("fedshard::gpu::device_codec<int8_block>::decode_add");
    } else {
      const std::uint64_t selections = C::selected(cfg_, n_);
      if (selections == 0) return;
      const unsigned grid = detail::codec_grid(selections);
      const detail::topk_sections at = detail::topk_layout(cfg_, n_);
      if (C::index_bytes(cfg_) == 2)
        detail::topk_decode_add_kernel<std::uint16_t>
            <<<grid, block_threads, 0, stream>>>(wire, out, n, at);
      else
        detail::topk_decode_add_kernel<std::uint32_t>
            <<<grid, block_threads, 0, stream>>>(wire, out, n, at);
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
    const std::size_t bytes = encoded_bytes(n_);
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
