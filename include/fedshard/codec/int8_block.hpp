#pragma once
/// codec::int8_block: blockwise absmax int8 quantisation (as ZeRO++'s qwZ/qgZ); the block
/// size is a run-time setting (config::block, 256 by default).
///
/// Per block of `block` elements (the last block may be shorter): scale = absmax / 127 in f32,
/// q[i] = round-to-nearest-even(x[i] / scale) as int8 in [-127, 127] (q = 0 for a block of
/// zeros, scale 0); the receiver adds q[i] * scale. With a normal scale the error is at
/// most scale / 2 plus float rounding: |x - q * scale| <= scale * (1/2 + 2^-15).
/// Wire: ceil(n / block) f32 scales, then n int8 values.
///
/// The host loops are compiled once per instruction set (kernels/dispatch.hpp) and run the
/// widest the CPU supports; every version gives the same bits.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>

#include "fedshard/codec/codec.hpp"
#include "fedshard/config.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/error.hpp"
#include "fedshard/kernels/dispatch.hpp"

namespace fedshard::codec {

namespace detail {

/// The scale of a block whose largest magnitude is absmax.
FEDSHARD_HOST_DEVICE inline float int8_scale(float absmax) noexcept {
  return absmax / 127.0f;
}

/// The int8 code of a quotient v = x / scale: v rounded to nearest even, clamped to
/// [-127, 127]; -127 for a NaN. Written on the bits of v, without branches or library
/// calls, so that host loops vectorise: |v| is clamped to 128 (an infinity or a NaN too),
/// rounded by the float addition |v| + 1.5 * 2^23 (whose last mantissa bit is worth 1; exact
/// rounding to nearest even in the default rounding mode), 128 becomes 127, and the sign is
/// applied (rounding to nearest even is symmetric).
FEDSHARD_HOST_DEVICE inline std::int8_t int8_code(float v) noexcept {
  using ::fedshard::detail::bit_cast;
  const std::uint32_t u = bit_cast<std::uint32_t>(v);
  const std::uint32_t a = u & 0x7fffffffu;
  const std::uint32_t clamped = a < 0x43000000u ? a : 0x43000000u;  // min(|v|, 128)
  const std::uint32_t r =
      bit_cast<std::uint32_t>(bit_cast<float>(clamped) + 0x1.8p23f) - 0x4b400000u;
  const std::uint32_t m = r - (r >> 7);  // 0..128 -> 0..127
  const std::uint32_t neg = 0u - (u >> 31);
  const std::uint32_t nan = 0u - std::uint32_t{a > 0x7f800000u};
  const std::uint32_t q = (((m ^ neg) - neg) & ~nan) | (0x81u & nan);  // 0x81: -127
  return static_cast<std::int8_t>(static_cast<std::uint8_t>(q));
}

/// The int8 code of x in a block of the given scale: x / scale rounded to nearest even,
/// clamped to [-127, 127]; 0 when scale is 0 (a NaN, from a non-finite input, gives -127).
FEDSHARD_HOST_DEVICE inline std::int8_t int8_quantise(float x, float scale) noexcept {
  return scale > 0.0f ? int8_code(x / scale) : std::int8_t{0};
}

/// The value of an int8 code in a block of the given scale.
FEDSHARD_HOST_DEVICE inline float int8_dequantise(std::int8_t q, float scale) noexcept {
  return static_cast<float>(q) * scale;
}

#if FEDSHARD_DISPATCH
#define FEDSHARD_DETAIL_INT8_BODY __attribute__((always_inline)) inline
#else
#define FEDSHARD_DETAIL_INT8_BODY inline
#endif

/// The scales and codes of n elements in blocks of `block` (see int8_block::encode); Fixed,
/// when not 0, is the block size known at compile time (the default's fast path). The
/// largest magnitude is taken over the bits of |x| (ordered as |x| for numbers), skipping
/// NaN as the float comparison does, so that the loop is an integer max the compiler
/// vectorises.
template <std::size_t Fixed>
FEDSHARD_DETAIL_INT8_BODY void int8_encode_body(const float* __restrict in, std::size_t n,
                                                std::size_t block, float* __restrict scales,
                                                std::int8_t* __restrict codes) noexcept {
  const std::size_t Block = Fixed != 0 ? Fixed : block;
  for (std::size_t b = 0, begin = 0; begin < n; ++b, begin += Block) {
    const std::size_t m = begin + Block < n ? Block : n - begin;
    const float* x = in + begin;
    std::uint32_t largest = 0;
    for (std::size_t i = 0; i < m; ++i) {
      const std::uint32_t a = ::fedshard::detail::bit_cast<std::uint32_t>(x[i]) & 0x7fffffffu;
      const std::uint32_t number = a & (0u - std::uint32_t{a <= 0x7f800000u});
      largest = number > largest ? number : largest;
    }
    const float scale = int8_scale(::fedshard::detail::bit_cast<float>(largest));
    scales[b] = scale;
    std::int8_t* q = codes + begin;
    if (scale > 0.0f) {
      for (std::size_t i = 0; i < m; ++i) q[i] = int8_code(x[i] / scale);
    } else {
      for (std::size_t i = 0; i < m; ++i) q[i] = 0;
    }
  }
}

/// out[i] += code[i] * the scale of i's block, for n elements in blocks of `block` (Fixed:
/// as int8_encode_body).
template <std::size_t Fixed>
FEDSHARD_DETAIL_INT8_BODY void int8_decode_add_body(const float* __restrict scales,
                                                    const std::int8_t* __restrict codes,
                                                    std::size_t n, std::size_t block,
                                                    float* __restrict out) noexcept {
  const std::size_t Block = Fixed != 0 ? Fixed : block;
  for (std::size_t b = 0, begin = 0; begin < n; ++b, begin += Block) {
    const std::size_t m = begin + Block < n ? Block : n - begin;
    const float scale = scales[b];
    const std::int8_t* q = codes + begin;
    float* o = out + begin;
    for (std::size_t i = 0; i < m; ++i) o[i] += int8_dequantise(q[i], scale);
  }
}

template <std::size_t Fixed>
FEDSHARD_TARGET_PORTABLE inline void int8_encode_portable(const float* in, std::size_t n,
                                                          std::size_t block, float* scales,
                                                          std::int8_t* codes) noexcept {
  int8_encode_body<Fixed>(in, n, block, scales, codes);
}
template <std::size_t Fixed>
FEDSHARD_TARGET_PORTABLE inline void int8_decode_add_portable(const float* scales,
                                                              const std::int8_t* codes,
                                                              std::size_t n, std::size_t block,
                                                              float* out) noexcept {
  int8_decode_add_body<Fixed>(scales, codes, n, block, out);
}
#if FEDSHARD_DISPATCH
template <std::size_t Fixed>
FEDSHARD_TARGET_AVX2 inline void int8_encode_avx2(const float* in, std::size_t n, std::size_t block,
                                                  float* scales, std::int8_t* codes) noexcept {
  int8_encode_body<Fixed>(in, n, block, scales, codes);
}
template <std::size_t Fixed>
FEDSHARD_TARGET_AVX2 inline void int8_decode_add_avx2(const float* scales, const std::int8_t* codes,
                                                      std::size_t n, std::size_t block,
                                                      float* out) noexcept {
  int8_decode_add_body<Fixed>(scales, codes, n, block, out);
}
template <std::size_t Fixed>
FEDSHARD_TARGET_AVX512 inline void int8_encode_avx512(const float* in, std::size_t n,
                                                      std::size_t block, float* scales,
                                                      std::int8_t* codes) noexcept {
  int8_encode_body<Fixed>(in, n, block, scales, codes);
}
template <std::size_t Fixed>
FEDSHARD_TARGET_AVX512 inline void int8_decode_add_avx512(const float* scales,
                                                          const std::int8_t* codes, std::size_t n,
                                                          std::size_t block, float* out) noexcept {
  int8_decode_add_body<Fixed>(scales, codes, n, block, out);
}
#endif
#undef FEDSHARD_DETAIL_INT8_BODY

/// int8_encode_body with the instruction set `which` (Fixed: as int8_encode_body).
template <std::size_t Fixed>
void int8_encode_isa(kernels::isa which, const float* in, std::size_t n, std::size_t block,
                     float* scales, std::int8_t* codes) noexcept {
#if FEDSHARD_DISPATCH
  if (which == kernels::isa::avx512 && kernels::detected_isa() >= kernels::isa::avx512)
    return int8_encode_avx512<Fixed>(in, n, block, scales, codes);
  if (which >= kernels::isa::avx2 && kernels::detected_isa() >= kernels::isa::avx2)
    return int8_encode_avx2<Fixed>(in, n, block, scales, codes);
#else
  (void)which;
#endif
  int8_encode_portable<Fixed>(in, n, block, scales, codes);
}

/// int8_decode_add_body with the instruction set `which` (Fixed: as int8_encode_body).
template <std::size_t Fixed>
void int8_decode_add_isa(kernels::isa which, const float* scales, const std::int8_t* codes,
                         std::size_t n, std::size_t block, float* out) noexcept {
#if FEDSHARD_DISPATCH
  if (which == kernels::isa::avx512 && kernels::detected_isa() >= kernels::isa::avx512)
    return int8_decode_add_avx512<Fixed>(scales, codes, n, block, out);
  if (which >= kernels::isa::avx2 && kernels::detected_isa() >= kernels::isa::avx2)
    return int8_decode_add_avx2<Fixed>(scales, codes, n, block, out);
#else
  (void)which;
#endif
  int8_decode_add_portable<Fixed>(scales, codes, n, block, out);
}

/// The block size whose loops are compiled for it (int8_block's default).
inline constexpr std::size_t int8_fixed_block = 256;

/// The scales and codes of n elements in blocks of `block`, with the instruction set `which`.
inline void int8_encode_on(kernels::isa which, const float* in, std::size_t n, std::size_t block,
                           float* scales, std::int8_t* codes) noexcept {
  if (block == int8_fixed_block)
    return int8_encode_isa<int8_fixed_block>(which, in, n, block, scales, codes);
  int8_encode_isa<0>(which, in, n, block, scales, codes);
}

/// out[i] += code[i] * the scale of i's block, with the instruction set `which`.
inline void int8_decode_add_on(kernels::isa which, const float* scales, const std::int8_t* codes,
                               std::size_t n, std::size_t block, float* out) noexcept {
  if (block == int8_fixed_block)
    return int8_decode_add_isa<int8_fixed_block>(which, scales, codes, n, block, out);
  int8_decode_add_isa<0>(which, scales, codes, n, block, out);
}

}  // namespace detail

/// Blockwise absmax int8 quantisation, one f32 scale per `block` elements (a run-time
/// setting); stateless.
class int8_block {
 public:
  /// Run-time settings.
  struct config {
    /// Elements per scale; > 0.
    std::size_t block = 256;

    friend bool operator==(const config&, const config&) = default;
  };

  static constexpr std::string_view name = "int8_block";
  static constexpr bool stateful = false;

  /// The default settings (block 256).
  int8_block() = default;
  /// A codec for buffers of n elements (int8_block works on any n); invalid_argument unless
  /// cfg.block > 0.
  explicit int8_block(config cfg, std::size_t = 0) : cfg_(cfg) {
    FEDSHARD_EXPECTS(cfg.block > 0, "int8_block: block (elements per scale) must be > 0, found ",
                     cfg.block);
  }

  /// The settings.
  const config& settings() const noexcept { return cfg_; }
  /// Elements per scale.
  std::size_t block() const noexcept { return cfg_.block; }

  /// Number of blocks (and scales) for n elements with settings c.
  static constexpr std::size_t blocks(const config& c, std::size_t n) noexcept {
    return detail::ceil_div(n, c.block);
  }
  /// n int8 values + ceil(n / block) f32 scales.
  static constexpr std::size_t encoded_bytes(const config& c, std::size_t n) noexcept {
    return blocks(c, n) * sizeof(float) + n;
  }
  /// blocks and encoded_bytes with this codec's settings.
  std::size_t blocks(std::size_t n) const noexcept { return blocks(cfg_, n); }
  std::size_t encoded_bytes(std::size_t n) const noexcept { return encoded_bytes(cfg_, n); }

  /// wire = the scales of the blocks of in, then the codes.
  void encode(std::span<const float> in, std::span<std::byte> wire) const {
    const std::size_t n = in.size();
    detail::check_wire(name, "encode", wire.data(), wire.size(), encoded_bytes(n), n);
    float* scales = reinterpret_cast<float*>(wire.data());
    std::int8_t* codes = reinterpret_cast<std::int8_t*>(wire.data() + blocks(n) * sizeof(float));
    detail::int8_encode_on(kernels::active_isa(), in.data(), n, cfg_.block, scales, codes);
  }

  /// out[i] += code[i] * scale of i's block.
  void decode_add(std::span<const std::byte> wire, std::span<float> out) const {
    const std::size_t n = out.size();
    detail::check_wire(name, "decode_add", wire.data(), wire.size(), encoded_bytes(n), n);
    const float* scales = reinterpret_cast<const float*>(wire.data());
    const std::int8_t* codes =
        reinterpret_cast<const std::int8_t*>(wire.data() + blocks(n) * sizeof(float));
    detail::int8_decode_add_on(kernels::active_isa(), scales, codes, n, cfg_.block, out.data());
  }

 private:
  config cfg_{};
};

}  // namespace fedshard::codec
