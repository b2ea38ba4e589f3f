#pragma once
/// Test support: bit patterns of the element types (float, double, bf16, f16), for checks
/// that compare results bit for bit.

#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "fedshard/core/dtype.hpp"

namespace fedshard::test {

/// The bit pattern of v: 16 bits for bf16 and f16, 32 for float, 64 for double.
template <class T>
auto bits_of(T v) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>)
    return v.bits;
  else if constexpr (sizeof(T) == 4)
    return std::bit_cast<std::uint32_t>(v);
  else
    return std::bit_cast<std::uint64_t>(v);
}

/// The float with bit pattern u.
inline float float_of(std::uint32_t u) {
  return std::bit_cast<float>(u);
}

/// True when v is a NaN.
template <class T>
bool is_nan(T v) {
  const auto a = to_accum(v);
  return a != a;
}

/// True when a and b have the same bit pattern.
template <class T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

/// True when a and b are both NaN or have the same bits (a NaN's payload is not specified).
template <class T>
bool same_value(T a, T b) {
  if (is_nan(a) || is_nan(b)) return is_nan(a) && is_nan(b);
  return same_bits(a, b);
}

}  // namespace fedshard::test
