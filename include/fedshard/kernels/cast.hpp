#pragma once
/// Element-type conversions: a per-element functor shared by host loops and CUDA kernels,
/// and host loops over typed spans and type-erased buffers.
///
/// Every conversion rounds to nearest, ties to even, exactly once: f64 -> bf16/f16 goes
/// through a round-to-odd float so that the two steps do not round twice. NaN stays NaN
/// (quiet, sign kept), infinities and signed zeros are kept, subnormals are produced and
/// read like core/dtype.hpp does.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>

#include "fedshard/config.hpp"
#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/error.hpp"

namespace fedshard::kernels {

/// The arithmetic type of kernels over the given element types: double if any is double,
/// else float (bf16 and f16 compute in float).
template <class... Ts>
using accum_t =
    std::conditional_t<(std::is_same_v<std::remove_cv_t<Ts>, double> || ...), double, float>;

namespace detail {

/// d rounded to a float with round-to-odd: exact values stay, inexact ones become the
/// neighbour (of the two around d) whose last mantissa bit is 1. Rounding that float to a
/// format at least two bits narrower then equals rounding d directly.
FEDSHARD_HOST_DEVICE constexpr float round_to_odd_float(double d) noexcept {
  const float f = static_cast<float>(d);
  const double back = f;
  if (back == d || d != d) return f;
  std::uint32_t u = ::fedshard::detail::bit_cast<std::uint32_t>(f);
  if (d > 0 ? back > d : back < d) --u;  // step the magnitude back towards zero: truncation
  return ::fedshard::detail::bit_cast<float>(u | 1u);
}

}  // namespace detail

namespace detail {

/// bf16(f).bits, written as selects so that host loops vectorise.
FEDSHARD_HOST_DEVICE constexpr std::uint16_t float_to_bf16_bits(float f) noexcept {
  const std::uint32_t u = ::fedshard::detail::bit_cast<std::uint32_t>(f);
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const std::uint32_t quiet_nan = (u >> 16) | 0x0040u;
  return static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

/// f16(f).bits, written as selects so that host loops vectorise. Subnormal results come
/// from one float addition that rounds |f| onto the 2^-24 grid (round to nearest even).
FEDSHARD_HOST_DEVICE constexpr std::uint16_t float_to_f16_bits(float f) noexcept {
  const std::uint32_t u = ::fedshard::detail::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t x = u & 0x7fffffffu;
  const std::uint32_t normal = ((x + 0xfffu + ((x >> 13) & 1u)) >> 13) - (112u << 10);
  const std::uint32_t subnormal =
      ::fedshard::detail::bit_cast<std::uint32_t>(::fedshard::detail::bit_cast<float>(x) + 0.5f) -
      0x3f000000u;
  std::uint32_t h = x >= 0x38800000u ? normal : subnormal;
  h = x >= 0x477ff000u ? 0x7c00u : h;  // >= 65520 rounds to infinity
  h = x > 0x7f800000u ? (0x7e00u | ((x >> 13) & 0x3ffu)) : h;
  return static_cast<std::uint16_t>(sign | h);
}

/// float(f16::from_bits(bits)), written as selects so that host loops vectorise.
FEDSHARD_HOST_DEVICE constexpr float f16_bits_to_float(std::uint16_t bits) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t em = bits & 0x7fffu;
  const std::uint32_t exp = em & 0x7c00u;
  const std::uint32_t normal = (em << 13) + (112u << 23);
  const std::uint32_t inf_nan = normal + (112u << 23);
  const std::uint32_t subnormal = ::fedshard::detail::bit_cast<std::uint32_t>(
      ::fedshard::detail::bit_cast<float>(normal + (1u << 23)) -
      ::fedshard::detail::bit_cast<float>(113u << 23));  // (1 + m/1024) 2^-14 - 2^-14
  const std::uint32_t r = exp == 0x7c00u ? inf_nan : (exp == 0 ? subnormal : normal);
  return ::fedshard::detail::bit_cast<float>(sign | r);
}

/// Any element type to float: exact except f64, which rounds to odd (see above).
template <class From>
FEDSHARD_HOST_DEVICE constexpr float to_float_for_16(From v) noexcept {
  if constexpr (std::is_same_v<From, double>)
    return round_to_odd_float(v);
  else if constexpr (std::is_same_v<From, f16>)
    return f16_bits_to_float(v.bits);
  else
    return static_cast<float>(v);
}

}  // namespace detail

/// Converts one element of type From to type To, rounding to nearest even. The results
/// are those of the bf16/f16 constructors and float conversions of core/dtype.hpp (f64 ->
/// bf16/f16 rounds once, directly).
template <class From, class To>
struct cast_fn {
  FEDSHARD_HOST_DEVICE constexpr To operator()(From v) const noexcept {
    if constexpr (std::is_same_v<From, To>) {
      return v;
    } else if constexpr (std::is_same_v<From, f16>) {
      return cast_fn<float, To>{}(detail::f16_bits_to_float(v.bits));
    } else if constexpr (std::is_same_v<To, double> || std::is_same_v<To, float>) {
      return static_cast<To>(to_accum(v));  // exact, except f64 -> f32 which rounds once
    } else if constexpr (std::is_same_v<To, bf16>) {
      return bf16::from_bits(detail::float_to_bf16_bits(detail::to_float_for_16(v)));
    } else {
      return f16::from_bits(detail::float_to_f16_bits(detail::to_float_for_16(v)));
    }
  }
};

namespace detail {

/// out[i] = cast(in[i]) for i < n, without checks; in and out must not overlap.
template <class From, class To>
void cast_n(const From* in, To* out, std::size_t n) noexcept {
  if constexpr (std::is_same_v<From, To>) {
    if (n != 0 && in != out) std::memcpy(out, in, n * sizeof(To));
  } else {
    const cast_fn<From, To> f;
    for (std::size_t i = 0; i < n; ++i) out[i] = f(in[i]);
  }
}

}  // namespace detail

/// Converts in into out element by element; sizes must match and the spans must not
/// overlap (unless they are the same span of the same type).
template <class From, class To>
void cast(std::span<From> in, std::span<To> out) {
  static_assert(!std::is_const_v<To>, "fedshard::kernels::cast: the output must be writable");
  FEDSHARD_EXPECTS(in.size() == out.size(), "cast: input has ", in.size(),
                   " elements, output has ", out.size(), " (sizes must match)");
  detail::cast_n<std::remove_const_t<From>, To>(in.data(), out.data(), in.size());
}

/// Converts a type-erased buffer into another of any dtype; same dtype is a plain copy.
inline void cast(const_buffer_view in, buffer_view out) {
  FEDSHARD_EXPECTS(is_valid(in.type) && is_valid(out.type), "cast: invalid dtype (input ",
                   static_cast<int>(in.type), ", output ", static_cast<int>(out.type), ")");
  FEDSHARD_EXPECTS(in.count == out.count, "cast: input has ", in.count, " elements of ",
                   to_string(in.type), ", output has ", out.count, " elements of ",
                   to_string(out.type), " (counts must match)");
  FEDSHARD_EXPECTS(in.count == 0 || (in.data != nullptr && out.data != nullptr),
                   "cast: null data pointer for ", in.count, " elements");
  visit(in.type, [&](auto from) {
    using From = typename decltype(from)::type;
    visit(out.type, [&](auto to) {
      using To = typename decltype(to)::type;
      detail::cast_n(static_cast<const From*>(in.data), static_cast<To*>(out.data), in.count);
    });
  });
}

}  // namespace fedshard::kernels
