#pragma once
/// Test support: bit patterns of the element types (float, double, bf16, f16), for checks
/// that compare results bit for bit, and every pair of them as TEST_CASE_TEMPLATE arguments.

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

/// Two element types, one TEST_CASE_TEMPLATE argument (FEDSHARD_TEST_ELEMENT_PAIRS).
template <class A, class B>
struct type_pair {
  using first = A;
  using second = B;
};

/// The type two element types accumulate in: double if either is double, else float.
template <class A, class B>
using accum_of_t =
    std::conditional_t<std::is_same_v<A, double> || std::is_same_v<B, double>, double, float>;

}  // namespace fedshard::test

/// The 16 ordered pairs of float, double, bf16 and f16.
#define FEDSHARD_TEST_ELEMENT_PAIRS                                                              \
  fedshard::test::type_pair<float, float>, fedshard::test::type_pair<float, double>,             \
      fedshard::test::type_pair<float, fedshard::bf16>,                                          \
      fedshard::test::type_pair<float, fedshard::f16>, fedshard::test::type_pair<double, float>, \
      fedshard::test::type_pair<double, double>,                                                 \
      fedshard::test::type_pair<double, fedshard::bf16>,                                         \
      fedshard::test::type_pair<double, fedshard::f16>,                                          \
      fedshard::test::type_pair<fedshard::bf16, float>,                                          \
      fedshard::test::type_pair<fedshard::bf16, double>,                                         \
      fedshard::test::type_pair<fedshard::bf16, fedshard::bf16>,                                 \
      fedshard::test::type_pair<fedshard::bf16, fedshard::f16>,                                  \
      fedshard::test::type_pair<fedshard::f16, float>,                                           \
      fedshard::test::type_pair<fedshard::f16, double>,                                          \
      fedshard::test::type_pair<fedshard::f16, fedshard::bf16>,                                  \
      fedshard::test::type_pair<fedshard::f16, fedshard::f16>
