#pragma once
/// codec::int8_block<Block>: blockwise absmax int8 quantisation (as ZeRO++'s qwZ/qgZ).
///
/// Per block of Block elements (the last block may be shorter): scale = absmax / 127 in f32,
/// q[i] = round-to-nearest-even(x[i] / scale) as int8 in [-127, 127] (q = 0 for a block of
/// zeros, scale 0); the receiver adds q[i] * scale. With a normal scale the error is at
/// most scale / 2 plus float rounding: |x - q * scale| <= scale * (1/2 + 2^-15).
/// Wire: ceil(n / Block) f32 scales, then n int8 values.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>

#include "fedshard/codec/codec.hpp"
#include "fedshard/config.hpp"

namespace fedshard::codec {

namespace detail {

/// The scale of a block whose largest magnitude is absmax.
FEDSHARD_HOST_DEVICE inline float int8_scale(float absmax) noexcept {
  return absmax / 127.0f;
}

/// The int8 code of x in a block of the given scale: x / scale rounded to nearest even,
/// clamped to [-127, 127]; 0 when scale is 0 (a NaN, from a non-finite input, gives -127).
FEDSHARD_HOST_DEVICE inline std::int8_t int8_quantise(float x, float scale) noexcept {
  if (!(scale > 0.0f)) return 0;
  const float q = std::nearbyint(x / scale);
  return static_cast<std::int8_t>(q >= -127.0f ? (q <= 127.0f ? q : 127.0f) : -127.0f);
}

/// The value of an int8 code in a block of the given scale.
FEDSHARD_HOST_DEVICE inline float int8_dequantise(std::int8_t q, float scale) noexcept {
  return static_cast<float>(q) * scale;
}

}  // namespace detail

/// Blockwise absmax int8 quantisation, one f32 scale per Block elements; stateless.
template <std::size_t Block = 256>
class int8_block {
  static_assert(Block > 0, "fedshard::codec::int8_block: Block must be positive");

 public:
  /// No settings.
  struct config {};

  static constexpr std::string_view name = "int8_block";
  static constexpr bool stateful = false;
  /// Elements per scale.
  static constexpr std::size_t block = Block;

  int8_block() = default;
  /// A codec for buffers of n elements (int8_block works on any n).
  int8_block(config, std::size_t) noexcept {}

  /// Number of blocks (and scales) for n elements.
  static constexpr std::size_t blocks(std::size_t n) noexcept { return detail::ceil_div(n, Block); }
  /// n int8 values + ceil(n / Block) f32 scales.
  static constexpr std::size_t encoded_bytes(std::size_t n) noexcept {
    return blocks(n) * sizeof(float) + n;
  }

  /// wire = the scales of the blocks of in, then the codes.
  static void encode(std::span<const float> in, std::span<std::byte> wire) {
    const std::size_t n = in.size();
    detail::check_wire(name, "encode", wire.data(), wire.size(), encoded_bytes(n), n);
    float* scales = reinterpret_cast<float*>(wire.data());
    std::int8_t* codes = reinterpret_cast<std::int8_t*>(wire.data() + blocks(n) * sizeof(float));
    for (std::size_t b = 0, begin = 0; begin < n; ++b, begin += Block) {
      const std::size_t end = begin + Block < n ? begin + Block : n;
      float absmax = 0.0f;
      for (std::size_t i = begin; i < end; ++i) {
        const float a = std::fabs(in[i]);
        absmax = a > absmax ? a : absmax;
      }
      const float scale = detail::int8_scale(absmax);
      scales[b] = scale;
      for (std::size_t i = begin; i < end; ++i) codes[i] = detail::int8_quantise(in[i], scale);
    }
  }

  /// out[i] += code[i] * scale of i's block.
  static void decode_add(std::span<const std::byte> wire, std::span<float> out) {
    const std::size_t n = out.size();
    detail::check_wire(name, "decode_add", wire.data(), wire.size(), encoded_bytes(n), n);
    const float* scales = reinterpret_cast<const float*>(wire.data());
    const std::int8_t* codes =
        reinterpret_cast<const std::int8_t*>(wire.data() + blocks(n) * sizeof(float));
    for (std::size_t b = 0, begin = 0; begin < n; ++b, begin += Block) {
      const std::size_t end = begin + Block < n ? begin + Block : n;
      const float scale = scales[b];
      for (std::size_t i = begin; i < end; ++i) out[i] += detail::int8_dequantise(codes[i], scale);
    }
  }
};

}  // namespace fedshard::codec
