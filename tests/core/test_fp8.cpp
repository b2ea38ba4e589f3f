#include "fedshard/core/fp8.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "support/bits.hpp"

namespace {

using fedshard::fp8_e4m3;
using fedshard::test::bits_of;
using fedshard::test::float_of;

/// The exact value of an E4M3 pattern from the format's definition (NaN for 0x7F/0xFF).
double value_ref(std::uint32_t b) {
  const std::uint32_t e = (b >> 3) & 0xfu;
  const std::uint32_t m = b & 7u;
  double v;
  if ((b & 0x7fu) == 0x7fu)
    v = std::numeric_limits<double>::quiet_NaN();
  else if (e == 0)
    v = std::ldexp(static_cast<double>(m), -9);
  else
    v = std::ldexp(static_cast<double>(8 + m), static_cast<int>(e) - 7 - 3);
  return (b & 0x80u) ? -v : v;
}

/// x rounded to the nearest E4M3 value by search over every code, ties to the even code,
/// saturating to +-448; NaN to 0x7F with x's sign.
std::uint8_t round_ref(double x) {
  const std::uint32_t sign = std::signbit(x) ? 0x80u : 0u;
  if (std::isnan(x)) return static_cast<std::uint8_t>(sign | 0x7fu);
  const double a = std::fabs(x);
  if (a >= 448.0) return static_cast<std::uint8_t>(sign | 0x7eu);
  std::uint32_t best = 0;
  for (std::uint32_t c = 1; c <= 0x7eu; ++c) {
    const double d = std::fabs(value_ref(c) - a), db = std::fabs(value_ref(best) - a);
    if (d < db || (d == db && (c & 1u) == 0)) best = c;
  }
  return static_cast<std::uint8_t>(sign | best);
}

}  // namespace

TEST_CASE("fp8_e4m3: every code decodes to its exact value and encodes back to itself") {
  for (std::uint32_t c = 0; c < 256; ++c) {
    CAPTURE(c);
    const auto b = static_cast<std::uint8_t>(c);
    const float v = fp8_e4m3::from_bits(b).to_float();
    CHECK(bits_of(static_cast<float>(fp8_e4m3::from_bits(b))) == bits_of(v));
    if ((c & 0x7fu) == 0x7fu) {
      CHECK(std::isnan(v));
      CHECK(std::signbit(v) == ((c & 0x80u) != 0));
      CHECK((bits_of(v) & 0x00400000u) != 0);  // quiet
      CHECK(fp8_e4m3(v).bits == b);            // NaN stays NaN, with its sign
    } else {
      CHECK(static_cast<double>(v) == value_ref(c));
      CHECK(std::signbit(v) == ((c & 0x80u) != 0));  // -0 is 0x80
      CHECK(fp8_e4m3(v).bits == b);
    }
  }
  CHECK(fp8_e4m3::from_bits(0x7e).to_float() == 448.0f);
  CHECK(fp8_e4m3::from_bits(0x01).to_float() == std::ldexp(1.0f, -9));
  CHECK(fp8_e4m3::from_bits(0x08).to_float() == std::ldexp(1.0f, -6));
}

TEST_CASE("fp8_e4m3: rounding from float equals the reference: ties, subnormals, overflow") {
  std::vector<float> xs;
  // Every code's value, the midpoints between neighbours (ties) and their float neighbours.
  for (std::uint32_t c = 0; c < 0x7e; ++c) {
    const auto lo = static_cast<float>(value_ref(c)), hi = static_cast<float>(value_ref(c + 1));
    const float mid = static_cast<float>((value_ref(c) + value_ref(c + 1)) / 2);  // exact
    for (float v : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f), hi}) {
      xs.push_back(v);
      xs.push_back(-v);
    }
  }
  // Overflow and saturation, infinities, NaN, the smallest floats.
  const float inf = std::numeric_limits<float>::infinity();
  for (float v : {448.0f, std::nextafter(448.0f, 1e9f), 464.0f, 480.0f, 1e6f, 3.4e38f, inf,
                  std::nextafter(448.0f, 0.0f), std::ldexp(1.0f, -10), std::ldexp(1.0f, -11),
                  std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min(),
                  std::numeric_limits<float>::quiet_NaN(), 0.0f}) {
    xs.push_back(v);
    xs.push_back(-v);
  }
  // Random floats over 2^-14 .. 2^10 (uniform exponent, every mantissa bit random).
  std::mt19937 gen(12);
  std::uniform_int_distribution<std::uint32_t> exp(127 - 14, 127 + 10), man(0, (1u << 23) - 1);
  for (int i = 0; i < 200000; ++i)
    xs.push_back(float_of(((gen() & 1u) << 31) | (exp(gen) << 23) | man(gen)));

  std::size_t failures = 0;
  for (float x : xs) {
    const std::uint8_t got = fp8_e4m3(x).bits, want = round_ref(x);
    if (got != want && ++failures <= 8) {
      CAPTURE(x);
      CHECK(static_cast<int>(got) == static_cast<int>(want));
    }
  }
  CHECK(failures == 0);
  CHECK(fp8_e4m3(inf).bits == 0x7e);
  CHECK(fp8_e4m3(-inf).bits == 0xfe);
  CHECK(fp8_e4m3(464.0f).bits == 0x7e);                 // tie 448/480: even, and saturated
  CHECK(fp8_e4m3(std::ldexp(1.0f, -10)).bits == 0x00);  // tie 0 / 2^-9: to even (0)
  CHECK(fp8_e4m3(std::ldexp(3.0f, -10)).bits == 0x02);  // tie 1 / 2 (x 2^-9): to even
  CHECK(fp8_e4m3(-0.0f).bits == 0x80);
}

TEST_CASE("fp8_e4m3: conversions are constexpr") {
  static_assert(fp8_e4m3(1.0f).bits == 0x38);
  static_assert(fp8_e4m3::from_bits(0x38).to_float() == 1.0f);
  static_assert(fp8_e4m3(-448.0f).bits == 0xfe);
}
