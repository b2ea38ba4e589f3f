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
  /// Written as selects so that host loops vectorise. Subnormal results come from one float
  /// addition that rounds |f| onto the 2^-9 grid (nearest even); it runs for every element
  /// (on 0 where unused) because a compiler may not speculate a float operation that it
  /// would otherwise move into a branch. Assumes the default rounding mode (to nearest).
  FEDSHARD_HOST_DEVICE static constexpr std::uint8_t from_float(float f) noexcept {
    const std::uint32_t u = bit_cast<std::uint32_t>(f);
    const std::uint32_t sign = (u >> 24) & 0x80u;
    const std::uint32_t x = u & 0x7fffffffu;
    const bool is_nan = x > 0x7f800000u;
    const bool saturates = x >= 0x43e00000u;    // >= 448, and infinity: 448
    const bool is_subnormal = x < 0x3c800000u;  // < 2^-6
    // Normal range: rebias, round 23 -> 3 mantissa bits. The carry of rounding may step the
    // exponent; below 448 it never reaches 0x7f (NaN): the largest float below 448 rounds to
    // 448 itself.
    const std::uint32_t normal = ((x + 0x7ffffu + ((x >> 20) & 1u)) >> 20) - (120u << 3);
    // Subnormal range: |f| + 2^14 has its last mantissa bit worth 2^-9, so the sum rounds |f|
    // to a multiple of 2^-9: 0..8 units (8 is 2^-6, the smallest normal, whose pattern 0x08
    // follows on from the subnormals').
    const float tiny = bit_cast<float>(x & (0u - std::uint32_t{is_subnormal}));
    const std::uint32_t subnormal = bit_cast<std::uint32_t>(tiny + 0x1p14f) - 0x46800000u;
    const std::uint32_t sub_mask = 0u - std::uint32_t{is_subnormal};
    const std::uint32_t sat_mask = 0u - std::uint32_t{saturates};
    const std::uint32_t nan_mask = 0u - std::uint32_t{is_nan};
    const std::uint32_t finite =
        (subnormal & sub_mask) | (((0x7eu & sat_mask) | (normal & ~sat_mask)) & ~sub_mask);
    return static_cast<std::uint8_t>(sign | (finite & ~nan_mask) | (0x7fu & nan_mask));
  }

  /// The exact float value of a pattern; NaN quiet, with its sign. Written without
  /// branches so that host loops vectorise; the float subtraction that makes subnormals
  /// runs for every element (subtracting 0 where unused), for the reason given above.
  FEDSHARD_HOST_DEVICE static constexpr float to_float(std::uint8_t bits) noexcept {
    const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x80u) << 24;
    const std::uint32_t em = bits & 0x7fu;
    const std::uint32_t sub_mask = 0u - std::uint32_t{(em & 0x78u) == 0};
    // Normal: rebias the exponent (+120). Subnormal m: (1 + m/8) 2^-6 - 2^-6 = m 2^-9, exact.
    const std::uint32_t biased = (em << 20) + (120u << 23) + ((1u << 23) & sub_mask);
    const float value = bit_cast<float>(biased) - bit_cast<float>((121u << 23) & sub_mask);
    const std::uint32_t nan_mask = 0u - std::uint32_t{em == 0x7fu};
    return bit_cast<float>(sign | (bit_cast<std::uint32_t>(value) & ~nan_mask) |
                           (0x7fc00000u & nan_mask));
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
