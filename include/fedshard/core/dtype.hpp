#pragma once
/// Element types fedshard moves and reduces: f32, f64 and its own 16-bit bf16 and f16.
///
/// bf16 and f16 are storage types: arithmetic converts to float. Conversion from float
/// rounds to nearest, ties to even; conversion to float is exact. Both ways NaN stays NaN,
/// quiet, with its sign and as much of its payload as fits (a signalling NaN comes out
/// quiet, as IEEE 754 conversions make it); infinities and signed zeros are preserved, and
/// subnormals are produced and read exactly.

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "fedshard/config.hpp"

namespace fedshard {

namespace detail {
template <class To, class From>
FEDSHARD_HOST_DEVICE constexpr To bit_cast(const From& from) noexcept {
  static_assert(sizeof(To) == sizeof(From));
  return __builtin_bit_cast(To, from);
}

/// A 16-bit floating-point storage type, Derived, whose bit-level conversions Format
/// supplies: `from_float(f)`, f rounded to the nearest pattern (ties to even), and
/// `to_float(bits)`, the exact float value of a pattern.
template <class Derived, class Format>
struct float16_storage {
  std::uint16_t bits = 0;

  float16_storage() = default;
  /// Rounds a float to the nearest value, ties to even.
  FEDSHARD_HOST_DEVICE constexpr explicit float16_storage(float f) noexcept
      : bits(Format::from_float(f)) {}
  /// The value with the given bit pattern.
  FEDSHARD_HOST_DEVICE static constexpr Derived from_bits(std::uint16_t b) noexcept {
    Derived r;
    r.bits = b;
    return r;
  }
  /// The exact float value (a NaN quiet, with its sign and payload).
  FEDSHARD_HOST_DEVICE constexpr explicit operator float() const noexcept {
    return Format::to_float(bits);
  }
  /// The exact float value, as the conversion operator gives it.
  FEDSHARD_HOST_DEVICE constexpr float to_float() const noexcept { return Format::to_float(bits); }

  /// Round-to-nearest-even conversion of a float's bit pattern.
  FEDSHARD_HOST_DEVICE static constexpr std::uint16_t from_float(float f) noexcept {
    return Format::from_float(f);
  }
};

/// The conversions of bfloat16, the upper half of an IEEE float.
struct bf16_format {
  /// Round-to-nearest-even conversion of a float's bit pattern.
  FEDSHARD_HOST_DEVICE static constexpr std::uint16_t from_float(float f) noexcept {
    const std::uint32_t u = bit_cast<std::uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)  // NaN: keep sign and top payload, force quiet
      return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
    const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
    return static_cast<std::uint16_t>((u + rounding) >> 16);
  }
  /// The exact float value of a pattern; a NaN quiet, with its sign and payload.
  FEDSHARD_HOST_DEVICE static constexpr float to_float(std::uint16_t bits) noexcept {
    // The quiet bit is set on the 16 bits, where host loops do 8 elements per 128-bit op.
    const auto quiet = static_cast<std::uint16_t>((bits & 0x7fffu) > 0x7f80u ? 0x0040u : 0u);
    return bit_cast<float>(static_cast<std::uint32_t>(bits | quiet) << 16);
  }
};

/// The conversions of IEEE 754 binary16.
struct f16_format {
  /// Round-to-nearest-even conversion of a float's bit pattern; overflow gives infinity.
  FEDSHARD_HOST_DEVICE static constexpr std::uint16_t from_float(float f) noexcept {
    const std::uint32_t u = bit_cast<std::uint32_t>(f);
    const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
    const std::uint32_t x = u & 0x7fffffffu;
    if (x > 0x7f800000u)  // NaN: keep top payload bits, force quiet
      return static_cast<std::uint16_t>(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
    if (x >= 0x477ff000u)  // >= 65520 rounds to infinity (and infinity itself)
      return static_cast<std::uint16_t>(sign | 0x7c00u);
    if (x >= 0x38800000u) {  // normal f16 range: rebias exponent, round mantissa
      const std::uint32_t r = x + 0xfffu + ((x >> 13) & 1u);
      return static_cast<std::uint16_t>(sign | ((r >> 13) - (112u << 10)));
    }
    const std::uint32_t exp = x >> 23;
    if (exp < 102) return sign;  // below half the smallest subnormal (2^-25): zero
    const std::uint32_t man = (x & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126 - exp;  // 14..24: man * 2^(exp-150) in units of 2^-24
    const std::uint32_t q = man >> shift;
    const std::uint32_t rem = man & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1);
    const std::uint32_t up = (rem > half || (rem == half && (q & 1u))) ? 1u : 0u;
    return static_cast<std::uint16_t>(sign | (q + up));
  }
  /// The exact float value of a pattern; a NaN quiet, with its sign and payload.
  FEDSHARD_HOST_DEVICE static constexpr float to_float(std::uint16_t bits) noexcept {
    const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
    std::uint32_t exp = (bits >> 10) & 0x1fu;
    std::uint32_t man = bits & 0x3ffu;
    if (exp == 0x1fu)  // infinity, or NaN: payload kept, quiet bit set
      return bit_cast<float>(sign | 0x7f800000u | (man != 0 ? 0x00400000u : 0u) | (man << 13));
    if (exp == 0) {
      if (man == 0) return bit_cast<float>(sign);
      exp = 113;  // subnormal: normalise man * 2^-24
      while ((man & 0x400u) == 0) {
        man <<= 1;
        --exp;
      }
      man &= 0x3ffu;
      return bit_cast<float>(sign | (exp << 23) | (man << 13));
    }
    return bit_cast<float>(sign | ((exp + 112u) << 23) | (man << 13));
  }
};

}  // namespace detail

/// bfloat16: 1 sign, 8 exponent, 7 mantissa bits (the upper half of an IEEE float).
struct bf16 : detail::float16_storage<bf16, detail::bf16_format> {
  using float16_storage::float16_storage;
};

/// IEEE 754 binary16: 1 sign, 5 exponent, 10 mantissa bits; overflow rounds to infinity.
struct f16 : detail::float16_storage<f16, detail::f16_format> {
  using float16_storage::float16_storage;
};

static_assert(sizeof(bf16) == 2 && std::is_trivially_copyable_v<bf16>);
static_assert(sizeof(f16) == 2 && std::is_trivially_copyable_v<f16>);

/// Runtime tag of an element type; buffers cross the communicator boundary as
/// (pointer, count, dtype).
enum class dtype : std::uint8_t { f32, f64, bf16, f16 };

/// Every dtype, for tests and dispatch tables.
inline constexpr dtype all_dtypes[] = {dtype::f32, dtype::f64, dtype::bf16, dtype::f16};

/// Bytes per element of a dtype.
FEDSHARD_HOST_DEVICE constexpr std::size_t size_of(dtype t) noexcept {
  return (t == dtype::f64) ? 8 : (t == dtype::f32) ? 4 : 2;
}

/// The name of a dtype ("f32", "f64", "bf16", "f16").
constexpr std::string_view to_string(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return "f32";
    case dtype::f64: return "f64";
    case dtype::bf16: return "bf16";
    case dtype::f16: return "f16";
  }
  return "unknown-dtype";
}

/// True for the four values of the enum (guards against casts from bad integers).
constexpr bool is_valid(dtype t) noexcept {
  return t == dtype::f32 || t == dtype::f64 || t == dtype::bf16 || t == dtype::f16;
}

/// The dtype tag of a C++ element type.
template <class T>
inline constexpr dtype dtype_of = [] {
  using U = std::remove_cv_t<T>;
  static_assert(std::is_same_v<U, float> || std::is_same_v<U, double> || std::is_same_v<U, bf16> ||
                    std::is_same_v<U, f16>,
                "fedshard: element type must be float, double, fedshard::bf16 or fedshard::f16");
  if constexpr (std::is_same_v<U, float>)
    return dtype::f32;
  else if constexpr (std::is_same_v<U, double>)
    return dtype::f64;
  else if constexpr (std::is_same_v<U, bf16>)
    return dtype::bf16;
  else
    return dtype::f16;
}();

/// The C++ element type of a dtype tag.
template <dtype D>
using type_of = std::conditional_t<
    D == dtype::f32, float,
    std::conditional_t<D == dtype::f64, double, std::conditional_t<D == dtype::bf16, bf16, f16>>>;

/// A value standing for a C++ type, passed to visitors.
template <class T>
struct type_tag {
  using type = T;
};

/// Calls f(type_tag<T>{}) with T the element type of t.
template <class F>
constexpr decltype(auto) visit(dtype t, F&& f) {
  switch (t) {
    case dtype::f64: return f(type_tag<double>{});
    case dtype::bf16: return f(type_tag<bf16>{});
    case dtype::f16: return f(type_tag<f16>{});
    case dtype::f32: break;
  }
  return f(type_tag<float>{});
}

/// Calls f(type_tag<A>{}, type_tag<B>{}) with A and B the element types of a and b (the
/// double dispatch of kernels between two type-erased buffers).
template <class F>
constexpr decltype(auto) visit(dtype a, dtype b, F&& f) {
  return visit(a, [&](auto ta) -> decltype(auto) {
    return visit(b, [&](auto tb) -> decltype(auto) { return f(ta, tb); });
  });
}

/// Converts any element type to float (the accumulation type of 16-bit types).
template <class T>
FEDSHARD_HOST_DEVICE constexpr auto to_accum(T v) noexcept {
  if constexpr (std::is_same_v<T, double>)
    return v;
  else
    return static_cast<float>(v);
}

namespace detail {
/// A double rounded to float toward the odd neighbour when inexact ("round to odd"): rounding
/// that float again to bf16 or f16 (at least 2 fewer bits) then equals one correct rounding
/// of the double. NaN keeps its sign and top payload (quiet); beyond the float range gives
/// the largest float (odd), so the second rounding overflows to infinity.
FEDSHARD_HOST_DEVICE constexpr float round_to_odd_float(double d) noexcept {
  const std::uint64_t u = bit_cast<std::uint64_t>(d);
  const auto sign = static_cast<std::uint32_t>(u >> 32) & 0x80000000u;
  const std::uint64_t x = u & 0x7fffffffffffffffull;
  if (x > 0x7ff0000000000000ull)
    return bit_cast<float>(sign | 0x7fc00000u | static_cast<std::uint32_t>((x >> 29) & 0x3fffffu));
  if (x == 0x7ff0000000000000ull) return bit_cast<float>(sign | 0x7f800000u);
  const double a = bit_cast<double>(x);
  if (a > static_cast<double>(bit_cast<float>(0x7f7fffffu)))
    return bit_cast<float>(sign | 0x7f7fffffu);
  std::uint32_t r = bit_cast<std::uint32_t>(static_cast<float>(a));
  const double nearest = static_cast<double>(bit_cast<float>(r));
  if (nearest != a) {
    if (nearest > a) --r;  // rounded up: step back to the float below
    r |= 1u;
  }
  return bit_cast<float>(sign | r);
}
}  // namespace detail

/// Converts an accumulated value back to the element type, rounding to nearest even (once:
/// a double is not first rounded to float and then again to a 16-bit type).
template <class T, class A>
FEDSHARD_HOST_DEVICE constexpr T from_accum(A v) noexcept {
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>)
    return static_cast<T>(v);
  else if constexpr (std::is_same_v<A, double>)
    return T(detail::round_to_odd_float(v));
  else
    return T(static_cast<float>(v));
}

}  // namespace fedshard
