#pragma once
/// fp8_e4m3: the OCP 8-bit floating-point format E4M3 as a storage type (wire codecs).
///
/// 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; 0x7F and 0xFF are NaN; the
/// largest finite value is 448 (0x7E), the smallest subnormal 2^-9. Conversion from float
/// rounds to nearest, ties to even, with saturation (the OCP "saturating" mode): a finite
/// value beyond 448, and an infinity, become +-448; NaN becomes NaN with its sign. Conversion
/// to float is exact (NaN comes out quiet with its sign). Signed zeros are kept.
///
/// fp8_e4m3 is not a `dtype`: communicators do not reduce it; it travels inside a codec's
/// wire bytes (codec/cast.hpp).

#include <cstdint>
#include <type_traits>

#include "fedshard/config.hpp"
#include "fedshard/core/dtype.hpp"

namespace fedshard {

namespace detail {

/// The conversions of OCP FP8 E4M3 (saturating).
struct e4m3_format {
  /// Round-to-nearest-even conversion of a float, saturating to +-448; NaN -> 0x7F | sign.
  FEDSHARD_HOST_DEVICE static constexpr std::uint8_t from_float(float f) noexcept {
    const std::uint32_t u = bit_cast<std::uint32_t>(f);
    const auto sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
    const std::uint32_t x = u & 0x7fffffffu;
    if (x > 0x7f800000u) return static_cast<std::uint8_t>(sign | 0x7fu);   // NaN
    if (x >= 0x43e00000u) return static_cast<std::uint8_t>(sign | 0x7eu);  // >= 448, inf: 448
    if (x >= 0x3c800000u) {  // >= 2^-6, the normal range: rebias, round 23 -> 3 mantissa bits
      // The carry of rounding may step the exponent; below 448 it never reaches 0x7f (NaN):
      // the largest float below 448 rounds to 448 itself.
      const std::uint32_t r = x + 0x7ffffu + ((x >> 20) & 1u);
      return static_cast<std::uint8_t>(sign | ((r >> 20) - (120u << 3)));
    }
    // Subnormal range: |f| in units of 2^-9, rounded to an integer 0..8 (8 is 2^-6, the
    // smallest normal, whose pattern 0x08 follows on from the subnormals').
    const std::uint32_t exp = x >> 23;
    if (exp < 116) return sign;  // |f| < 2^-11: below half the smallest subnormal
    const std::uint32_t man = (x & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 141 - exp;  // 21..25: man * 2^(exp-150) in units of 2^-9
    const std::uint32_t q = man >> shift;
    const std::uint32_t rem = man & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1);
    const std::uint32_t up = (rem > half || (rem == half && (q & 1u))) ? 1u : 0u;
    return static_cast<std::uint8_t>(sign | (q + up));
  }

  /// The exact float value of a pattern; NaN quiet, with its sign.
  FEDSHARD_HOST_DEVICE static constexpr float to_float(std::uint8_t bits) noexcept {
    const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x80u) << 24;
    const std::uint32_t exp = (bits >> 3) & 0xfu;
    const std::uint32_t man = bits & 0x7u;
    if ((bits & 0x7fu) == 0x7fu) return bit_cast<float>(sign | 0x7fc00000u);
    if (exp == 0)  // m * 2^-9, exact in float
      return bit_cast<float>(sign | bit_cast<std::uint32_t>(static_cast<float>(man) * 0x1p-9f));
    return bit_cast<float>(sign | ((exp + 120u) << 23) | (man << 20));
  }
};

}  // namespace detail

/// OCP FP8 E4M3: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, NaN 0x7F/0xFF,
/// max finite 448. From float: round to nearest even, saturating to +-448.
struct fp8_e4m3 {
  std::uint8_t bits = 0;

  /// The largest finite value.
  static constexpr float max_finite = 448.0f;

  fp8_e4m3() = default;
  /// Rounds a float to the nearest value, ties to even, saturating to +-448.
  FEDSHARD_HOST_DEVICE constexpr explicit fp8_e4m3(float f) noexcept
      : bits(detail::e4m3_format::from_float(f)) {}
  /// The value with the given bit pattern.
  FEDSHARD_HOST_DEVICE static constexpr fp8_e4m3 from_bits(std::uint8_t b) noexcept {
    fp8_e4m3 r;
    r.bits = b;
    return r;
  }
  /// The exact float value (a NaN quiet, with its sign).
  FEDSHARD_HOST_DEVICE constexpr explicit operator float() const noexcept {
    return detail::e4m3_format::to_float(bits);
  }
  /// The exact float value, as the conversion operator gives it.
  FEDSHARD_HOST_DEVICE constexpr float to_float() const noexcept {
    return detail::e4m3_format::to_float(bits);
  }
};

static_assert(sizeof(fp8_e4m3) == 1 && std::is_trivially_copyable_v<fp8_e4m3>);

}  // namespace fedshard
