#include "fedshard/core/dtype.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__FLT16_MAX__)
#define FEDSHARD_TEST_HAS_FLOAT16 1
#else
#define FEDSHARD_TEST_HAS_FLOAT16 0
#endif

namespace {

using fedshard::bf16;
using fedshard::dtype;
using fedshard::f16;

// ---- An independent description of the two formats (nothing below calls the header) ----

template <class T>
struct layout;
template <>
struct layout<bf16> {
  static constexpr int mant = 7;
  static constexpr int exp = 8;
};
template <>
struct layout<f16> {
  static constexpr int mant = 10;
  static constexpr int exp = 5;
};

template <class T>
constexpr int bias = (1 << (layout<T>::exp - 1)) - 1;
/// The +infinity pattern, which is also the largest finite pattern + 1.
template <class T>
constexpr std::uint32_t inf_bits = ((1u << layout<T>::exp) - 1u) << layout<T>::mant;
template <class T>
constexpr std::uint32_t quiet_bit = 1u << (layout<T>::mant - 1);

template <class T>
bool is_nan_bits(std::uint32_t b) {
  return (b & 0x7fffu) > inf_bits<T>;
}

/// The exact value of a pattern, from the IEEE formula.
template <class T>
double decode(std::uint32_t b) {
  constexpr int mant = layout<T>::mant;
  const int e = static_cast<int>(b >> mant) & ((1 << layout<T>::exp) - 1);
  const int m = static_cast<int>(b) & ((1 << mant) - 1);
  double mag = 0;
  if (e == (1 << layout<T>::exp) - 1)
    mag =
        m == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  else if (e == 0)
    mag = std::ldexp(m, 1 - bias<T> - mant);
  else
    mag = std::ldexp(m + (1 << mant), e - bias<T> - mant);
  return (b & 0x8000u) ? -mag : mag;
}

/// v[i] = value of the positive pattern i for every finite i; v[inf_bits] = 2^(emax + 1),
/// the value a rounding that overflows to infinity would pick.
template <class T>
const std::vector<double>& magnitudes() {
  static const std::vector<double> table = [] {
    std::vector<double> v(inf_bits<T> + 1);
    for (std::uint32_t i = 0; i < inf_bits<T>; ++i) v[i] = decode<T>(i);
    v[inf_bits<T>] = std::ldexp(1.0, bias<T> + 1);
    return v;
  }();
  return table;
}

/// Reference rounding of a non-NaN double: find the two neighbouring representable values
/// and take the nearer; on a tie take the even pattern (even mantissa).
template <class T>
std::uint16_t reference_round(double x) {
  const std::uint32_t sign = std::signbit(x) ? 0x8000u : 0u;
  const double a = std::fabs(x);
  const auto& v = magnitudes<T>();
  if (a >= v.back()) return static_cast<std::uint16_t>(sign | inf_bits<T>);
  const auto lo =
      static_cast<std::uint32_t>(std::upper_bound(v.begin(), v.end(), a) - v.begin() - 1);
  const double mid = (v[lo] + v[lo + 1]) / 2;  // exact: both have at most 11 significant bits
  const std::uint32_t r = a < mid ? lo : a > mid ? lo + 1 : (lo % 2 == 0 ? lo : lo + 1);
  return static_cast<std::uint16_t>(sign | r);
}

#if FEDSHARD_TEST_HAS_FLOAT16
std::uint16_t float16_bits(float f) {
  return std::bit_cast<std::uint16_t>(static_cast<_Float16>(f));
}
std::uint16_t float16_bits(double d) {
  return std::bit_cast<std::uint16_t>(static_cast<_Float16>(d));
}
#endif

/// Counts mismatches of a bulk check and keeps the first few for the failure message.
struct failures {
  std::size_t count = 0;
  std::string examples;
  void add(const char* what, double input, unsigned got, unsigned want) {
    if (++count > 8) return;
    char line[160];
    std::snprintf(line, sizeof line, "%s: input %a gave 0x%04x, expected 0x%04x\n", what, input,
                  got, want);
    examples += line;
  }
};

template <class T>
std::uint16_t bits_of(float f) {
  return T(f).bits;
}

template <class T>
bool is_quiet_nan_with_sign(std::uint32_t b, bool negative) {
  return is_nan_bits<T>(b) && (b & quiet_bit<T>) != 0 && ((b & 0x8000u) != 0) == negative;
}

float float_from_bits(std::uint32_t u) {
  return std::bit_cast<float>(u);
}

}  // namespace

// ---- compile-time use ----

static_assert(bf16(1.0f).bits == 0x3f80);
static_assert(bf16(-2.0f).bits == 0xc000);
static_assert(f16(1.0f).bits == 0x3c00);
static_assert(f16(65520.0f).bits == 0x7c00);
static_assert(static_cast<float>(f16::from_bits(0x0001)) == 0x1p-24f);
static_assert(static_cast<float>(bf16::from_bits(0x4049)) == 3.140625f);
static_assert(fedshard::from_accum<bf16>(1.0 + 0x1p-8 + 0x1p-40).bits == 0x3f81);

// ---- (a) to float and back ----

TEST_CASE_TEMPLATE("every 16-bit pattern converts to its exact float value and back", T, bf16,
                   f16) {
  failures value_bad, roundtrip_bad, nan_bad, float16_bad;
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    const float f = static_cast<float>(T::from_bits(static_cast<std::uint16_t>(b)));
    const std::uint16_t back = T(f).bits;
    if (is_nan_bits<T>(b)) {
      if (!std::isnan(f) || std::signbit(f) != ((b & 0x8000u) != 0))
        nan_bad.add("NaN to float", f, b, b);
      // NaN comes back quiet, with its sign and payload.
      if (!is_quiet_nan_with_sign<T>(back, (b & 0x8000u) != 0) ||
          (back | quiet_bit<T>) != (b | quiet_bit<T>))
        nan_bad.add("NaN round trip", f, back, b | quiet_bit<T>);
      continue;
    }
    const double want = decode<T>(b);
    if (static_cast<double>(f) != want || std::signbit(f) != std::signbit(want))
      value_bad.add("to float", f, b, b);
    if (back != b) roundtrip_bad.add("round trip", f, back, b);
#if FEDSHARD_TEST_HAS_FLOAT16
    if constexpr (std::is_same_v<T, f16>) {
      const float g = static_cast<float>(std::bit_cast<_Float16>(static_cast<std::uint16_t>(b)));
      if (std::bit_cast<std::uint32_t>(g) != std::bit_cast<std::uint32_t>(f))
        float16_bad.add("to float vs _Float16", f, b, b);
    }
#endif
  }
  CHECK_MESSAGE(value_bad.count == 0, value_bad.examples);
  CHECK_MESSAGE(roundtrip_bad.count == 0, roundtrip_bad.examples);
  CHECK_MESSAGE(nan_bad.count == 0, nan_bad.examples);
  CHECK_MESSAGE(float16_bad.count == 0, float16_bad.examples);
}

TEST_CASE_TEMPLATE("every 16-bit NaN widens to a quiet float NaN; every other pattern exactly", T,
                   bf16, f16) {
  // A NaN keeps its sign and its whole payload (mant bits shifted to the top of float's 23)
  // and gets float's quiet bit, as IEEE 754 asks of a conversion; a signalling NaN thus
  // comes out quiet. Any other pattern becomes the float of its exact value.
  constexpr int shift = 23 - layout<T>::mant;
  failures nan_bad, value_bad, float16_bad;
  std::size_t nans = 0, signalling = 0;
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    const auto pattern = static_cast<std::uint16_t>(b);
    const auto got = std::bit_cast<std::uint32_t>(static_cast<float>(T::from_bits(pattern)));
    CHECK(std::bit_cast<std::uint32_t>(T::from_bits(pattern).to_float()) == got);
    std::uint32_t want = 0;
    if (is_nan_bits<T>(b)) {
      ++nans;
      signalling += (b & quiet_bit<T>) == 0;
      const std::uint32_t payload = b & ((1u << layout<T>::mant) - 1u);
      want = ((b & 0x8000u) << 16) | 0x7f800000u | 0x00400000u | (payload << shift);
      if (got != want) nan_bad.add("NaN to float", 0.0, got >> 16, want >> 16);
      if (!std::isnan(std::bit_cast<float>(got))) nan_bad.add("not NaN", 0.0, got >> 16, b);
    } else {
      want = std::bit_cast<std::uint32_t>(static_cast<float>(decode<T>(b)));
      if (got != want) value_bad.add("to float", decode<T>(b), got >> 16, want >> 16);
    }
#if FEDSHARD_TEST_HAS_FLOAT16
    if constexpr (std::is_same_v<T, f16>) {  // the compiler's own conversion, NaNs included
      const float g = static_cast<float>(std::bit_cast<_Float16>(pattern));
      if (std::bit_cast<std::uint32_t>(g) != got)
        float16_bad.add("to float vs _Float16", g, got >> 16, b);
    }
#endif
  }
  // 2 signs x (2^mant - 1) payloads, half of them (those without the quiet bit) signalling.
  CHECK(nans == 2 * ((std::size_t{1} << layout<T>::mant) - 1));
  CHECK(signalling == 2 * ((std::size_t{1} << (layout<T>::mant - 1)) - 1));
  CHECK_MESSAGE(nan_bad.count == 0, nan_bad.examples);
  CHECK_MESSAGE(value_bad.count == 0, value_bad.examples);
  CHECK_MESSAGE(float16_bad.count == 0, float16_bad.examples);
}

TEST_CASE("signalling NaNs widen to quiet NaNs: examples") {
  CHECK(std::bit_cast<std::uint32_t>(static_cast<float>(f16::from_bits(0x7c01))) == 0x7fc02000u);
  CHECK(std::bit_cast<std::uint32_t>(static_cast<float>(f16::from_bits(0xfd00))) == 0xffe00000u);
  CHECK(std::bit_cast<std::uint32_t>(static_cast<float>(f16::from_bits(0x7e00))) == 0x7fc00000u);
  CHECK(std::bit_cast<std::uint32_t>(static_cast<float>(bf16::from_bits(0x7f81))) == 0x7fc10000u);
  CHECK(std::bit_cast<std::uint32_t>(static_cast<float>(bf16::from_bits(0xffa0))) == 0xffe00000u);
  CHECK(std::bit_cast<std::uint32_t>(static_cast<float>(bf16::from_bits(0x7fc0))) == 0x7fc00000u);
  static_assert(std::bit_cast<std::uint32_t>(static_cast<float>(f16::from_bits(0x7c01))) ==
                0x7fc02000u);
  static_assert(std::bit_cast<std::uint32_t>(static_cast<float>(bf16::from_bits(0x7f81))) ==
                0x7fc10000u);
}

// ---- (b) round to nearest even, around every pattern ----

TEST_CASE_TEMPLATE("float to 16-bit rounds to nearest even around every pattern", T, bf16, f16) {
  failures structural, reference, float16, setup;
  std::size_t checked = 0;
  auto check = [&](const char* what, float input, std::uint16_t want) {
    ++checked;
    const std::uint16_t got = bits_of<T>(input);
    if (got != want) structural.add(what, input, got, want);
    const std::uint16_t ref = reference_round<T>(input);
    if (got != ref) reference.add(what, input, got, ref);
#if FEDSHARD_TEST_HAS_FLOAT16
    if constexpr (std::is_same_v<T, f16>) {
      const std::uint16_t h = float16_bits(input);
      if (got != h) float16.add(what, input, got, h);
    }
#endif
  };
  const auto& mags = magnitudes<T>();
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    const std::uint32_t mag = b & 0x7fffu;
    if (mag >= inf_bits<T>) continue;  // infinities and NaNs: see the special-value tests
    const std::uint32_t sign = b & 0x8000u;
    const double s = sign ? -1.0 : 1.0;
    const auto here = static_cast<std::uint16_t>(b);
    const auto next = static_cast<std::uint16_t>(sign | (mag + 1));  // infinity after the largest
    const auto even = (mag % 2 == 0) ? here : next;

    check("value", static_cast<float>(s * mags[mag]), here);
    const double mid = s * (mags[mag] + mags[mag + 1]) / 2;
    const auto midf = static_cast<float>(mid);
    if (static_cast<double>(midf) != mid) {
      setup.add("midpoint not a float", mid, b, b);
      continue;
    }
    check("midpoint", midf, even);
    check("above midpoint", std::nextafter(midf, static_cast<float>(s * INFINITY)), next);
    check("below midpoint", std::nextafter(midf, 0.0f), here);
  }
  CHECK(checked == 4u * 2u * inf_bits<T>);
  CHECK_MESSAGE(setup.count == 0, setup.examples);
  CHECK_MESSAGE(structural.count == 0, structural.examples);
  CHECK_MESSAGE(reference.count == 0, reference.examples);
  CHECK_MESSAGE(float16.count == 0, float16.examples);
}

TEST_CASE_TEMPLATE("float to 16-bit matches the references across the float range", T, bf16, f16) {
  failures reference, float16, nan_bad;
  // An odd stride visits every exponent, both signs, NaNs and all low-bit residues.
  for (std::uint64_t u = 0; u <= 0xffffffffu; u += 4099) {
    const float f = float_from_bits(static_cast<std::uint32_t>(u));
    const std::uint16_t got = bits_of<T>(f);
    if (std::isnan(f)) {
      if (!is_quiet_nan_with_sign<T>(got, std::signbit(f))) nan_bad.add("NaN", f, got, 0);
      continue;
    }
    const std::uint16_t ref = reference_round<T>(f);
    if (got != ref) reference.add("reference", f, got, ref);
#if FEDSHARD_TEST_HAS_FLOAT16
    if constexpr (std::is_same_v<T, f16>) {
      const std::uint16_t h = float16_bits(f);
      if (got != h) float16.add("_Float16", f, got, h);
    }
#endif
  }
  CHECK_MESSAGE(nan_bad.count == 0, nan_bad.examples);
  CHECK_MESSAGE(reference.count == 0, reference.examples);
  CHECK_MESSAGE(float16.count == 0, float16.examples);
}

// ---- (c) special values ----

TEST_CASE("bf16 special values") {
  using L = std::numeric_limits<float>;
  CHECK(bf16(0.0f).bits == 0x0000);
  CHECK(bf16(-0.0f).bits == 0x8000);
  CHECK(std::signbit(static_cast<float>(bf16::from_bits(0x8000))));
  CHECK(bf16(L::infinity()).bits == 0x7f80);
  CHECK(bf16(-L::infinity()).bits == 0xff80);
  CHECK(static_cast<float>(bf16::from_bits(0x7f80)) == L::infinity());
  CHECK(static_cast<float>(bf16::from_bits(0xff80)) == -L::infinity());

  // Largest finite 0x7f7f = (2 - 2^-7) * 2^127 and the overflow threshold halfway to 2^128.
  const float largest = static_cast<float>(bf16::from_bits(0x7f7f));
  CHECK(largest == 0x1.fep127f);
  CHECK(bf16(largest).bits == 0x7f7f);
  CHECK(bf16(float_from_bits(0x7f7f7fffu)).bits == 0x7f7f);
  CHECK(bf16(float_from_bits(0x7f7f8000u)).bits == 0x7f80);
  CHECK(bf16(L::max()).bits == 0x7f80);
  CHECK(bf16(-L::max()).bits == 0xff80);

  // Smallest subnormal 2^-133, and float subnormals rounded onto the bf16 subnormal grid.
  CHECK(static_cast<float>(bf16::from_bits(0x0001)) == 0x1p-133f);
  CHECK(bf16(0x1p-133f).bits == 0x0001);
  CHECK(bf16(L::denorm_min()).bits == 0x0000);
  CHECK(bf16(-L::denorm_min()).bits == 0x8000);
  CHECK(bf16(float_from_bits(0x00008000u)).bits == 0x0000);  // tie between 0 and 1: even
  CHECK(bf16(float_from_bits(0x00008001u)).bits == 0x0001);
  CHECK(bf16(float_from_bits(0x00018000u)).bits == 0x0002);  // tie between 1 and 2: even
  CHECK(bf16(float_from_bits(0x00028000u)).bits == 0x0002);  // tie between 2 and 3: even
  CHECK(bf16(float_from_bits(0x00123400u)).bits == 0x0012);  // exact subnormal kept
  CHECK(bf16(float_from_bits(0x007fffffu)).bits == 0x0080);  // largest subnormal rounds up
  CHECK(bf16(L::min()).bits == 0x0080);

  // Ties in the normal range.
  CHECK(bf16(1.0f + 0x1p-8f).bits == 0x3f80);
  CHECK(bf16(1.0f + 0x3p-8f).bits == 0x3f82);
  CHECK(bf16(1.0f + 0x1p-8f + 0x1p-20f).bits == 0x3f81);

  // NaN: stays NaN (never infinity), quiet, sign kept.
  CHECK(bf16(L::quiet_NaN()).bits == 0x7fc0);
  CHECK(is_quiet_nan_with_sign<bf16>(bf16(-L::quiet_NaN()).bits, true));
  CHECK(is_quiet_nan_with_sign<bf16>(bf16(L::signaling_NaN()).bits, false));
  CHECK(is_quiet_nan_with_sign<bf16>(bf16(float_from_bits(0x7f800001u)).bits, false));
  CHECK(is_quiet_nan_with_sign<bf16>(bf16(float_from_bits(0xff800001u)).bits, true));
  CHECK(std::isnan(static_cast<float>(bf16::from_bits(0x7f81))));
}

TEST_CASE("f16 special values") {
  using L = std::numeric_limits<float>;
  CHECK(f16(0.0f).bits == 0x0000);
  CHECK(f16(-0.0f).bits == 0x8000);
  CHECK(std::signbit(static_cast<float>(f16::from_bits(0x8000))));
  CHECK(f16(L::infinity()).bits == 0x7c00);
  CHECK(f16(-L::infinity()).bits == 0xfc00);
  CHECK(static_cast<float>(f16::from_bits(0x7c00)) == L::infinity());
  CHECK(static_cast<float>(f16::from_bits(0xfc00)) == -L::infinity());

  // Largest finite and the overflow threshold.
  CHECK(static_cast<float>(f16::from_bits(0x7bff)) == 65504.0f);
  CHECK(f16(65504.0f).bits == 0x7bff);
  CHECK(f16(65519.99f).bits == 0x7bff);
  CHECK(f16(std::nextafter(65520.0f, 0.0f)).bits == 0x7bff);
  CHECK(f16(65520.0f).bits == 0x7c00);
  CHECK(f16(-65520.0f).bits == 0xfc00);
  CHECK(f16(-65519.99f).bits == 0xfbff);
  CHECK(f16(1e10f).bits == 0x7c00);
  CHECK(f16(L::max()).bits == 0x7c00);

  // Subnormals (denormals): smallest 2^-24, largest 1023 * 2^-24, smallest normal 2^-14.
  CHECK(static_cast<float>(f16::from_bits(0x0001)) == 0x1p-24f);
  CHECK(static_cast<float>(f16::from_bits(0x8001)) == -0x1p-24f);
  CHECK(static_cast<float>(f16::from_bits(0x03ff)) == 1023 * 0x1p-24f);
  CHECK(static_cast<float>(f16::from_bits(0x0400)) == 0x1p-14f);
  CHECK(f16(0x1p-24f).bits == 0x0001);
  CHECK(f16(0x1p-25f).bits == 0x0000);  // tie between 0 and 1: even
  CHECK(f16(-0x1p-25f).bits == 0x8000);
  CHECK(f16(std::nextafter(0x1p-25f, 1.0f)).bits == 0x0001);
  CHECK(f16(std::nextafter(0x1p-25f, 0.0f)).bits == 0x0000);
  CHECK(f16(3 * 0x1p-25f).bits == 0x0002);  // tie between 1 and 2: even
  CHECK(f16(5 * 0x1p-25f).bits == 0x0002);  // tie between 2 and 3: even
  CHECK(f16(1023 * 0x1p-24f).bits == 0x03ff);
  CHECK(f16(1023.5f * 0x1p-24f).bits == 0x0400);  // tie rounds up into the normal range
  CHECK(f16(0x1p-14f).bits == 0x0400);
  CHECK(f16(L::denorm_min()).bits == 0x0000);
  CHECK(f16(-L::denorm_min()).bits == 0x8000);
  CHECK(f16(L::min()).bits == 0x0000);

  // Ties in the normal range: spacing is 2 between 2048 and 4096.
  CHECK(f16(2049.0f).bits == 0x6800);
  CHECK(f16(2051.0f).bits == 0x6802);
  CHECK(f16(1.0f + 0x1p-11f).bits == 0x3c00);
  CHECK(f16(1.0f + 0x3p-11f).bits == 0x3c02);

  // NaN: stays NaN, quiet, sign and top payload kept.
  CHECK(f16(L::quiet_NaN()).bits == 0x7e00);
  CHECK(is_quiet_nan_with_sign<f16>(f16(-L::quiet_NaN()).bits, true));
  CHECK(is_quiet_nan_with_sign<f16>(f16(L::signaling_NaN()).bits, false));
  CHECK(is_quiet_nan_with_sign<f16>(f16(float_from_bits(0x7f800001u)).bits, false));
  CHECK(f16(float_from_bits(0x7fa00000u)).bits == 0x7f00);
  CHECK(std::isnan(static_cast<float>(f16::from_bits(0x7c01))));
  CHECK(std::isnan(static_cast<float>(f16::from_bits(0xfe00))));
}

// ---- the dtype vocabulary ----

TEST_CASE("size_of, to_string and is_valid of every dtype") {
  CHECK(fedshard::size_of(dtype::f32) == 4);
  CHECK(fedshard::size_of(dtype::f64) == 8);
  CHECK(fedshard::size_of(dtype::bf16) == 2);
  CHECK(fedshard::size_of(dtype::f16) == 2);
  CHECK(fedshard::to_string(dtype::f32) == "f32");
  CHECK(fedshard::to_string(dtype::f64) == "f64");
  CHECK(fedshard::to_string(dtype::bf16) == "bf16");
  CHECK(fedshard::to_string(dtype::f16) == "f16");

  std::vector<std::string_view> names;
  for (dtype t : fedshard::all_dtypes) {
    CHECK(fedshard::is_valid(t));
    names.push_back(fedshard::to_string(t));
  }
  std::sort(names.begin(), names.end());
  CHECK(names.size() == 4);
  CHECK(std::adjacent_find(names.begin(), names.end()) == names.end());

  const auto bad = static_cast<dtype>(4);
  CHECK_FALSE(fedshard::is_valid(bad));
  CHECK_FALSE(fedshard::is_valid(static_cast<dtype>(255)));
  CHECK(fedshard::to_string(bad) == "unknown-dtype");
}

TEST_CASE("dtype_of and type_of are inverse") {
  static_assert(fedshard::dtype_of<float> == dtype::f32);
  static_assert(fedshard::dtype_of<double> == dtype::f64);
  static_assert(fedshard::dtype_of<bf16> == dtype::bf16);
  static_assert(fedshard::dtype_of<f16> == dtype::f16);
  static_assert(fedshard::dtype_of<const float> == dtype::f32);
  static_assert(fedshard::dtype_of<const volatile bf16> == dtype::bf16);
  static_assert(std::is_same_v<fedshard::type_of<dtype::f32>, float>);
  static_assert(std::is_same_v<fedshard::type_of<dtype::f64>, double>);
  static_assert(std::is_same_v<fedshard::type_of<dtype::bf16>, bf16>);
  static_assert(std::is_same_v<fedshard::type_of<dtype::f16>, f16>);
  static_assert(fedshard::dtype_of<fedshard::type_of<dtype::bf16>> == dtype::bf16);
  static_assert(fedshard::dtype_of<fedshard::type_of<dtype::f16>> == dtype::f16);
  for (dtype t : fedshard::all_dtypes)
    CHECK(fedshard::size_of(t) ==
          fedshard::visit(t, [](auto tag) { return sizeof(typename decltype(tag)::type); }));
}

TEST_CASE("visit calls the visitor with the element type of the dtype") {
  for (dtype t : fedshard::all_dtypes) {
    const dtype seen = fedshard::visit(
        t, [](auto tag) { return fedshard::dtype_of<typename decltype(tag)::type>; });
    CHECK(seen == t);
  }
  constexpr auto bytes =
      fedshard::visit(dtype::f64, [](auto tag) { return sizeof(typename decltype(tag)::type); });
  static_assert(bytes == 8);

  int calls = 0;
  fedshard::visit(dtype::bf16, [&](auto tag) {
    ++calls;
    CHECK(std::is_same_v<typename decltype(tag)::type, bf16>);
  });
  CHECK(calls == 1);
}

TEST_CASE("visit of two dtypes calls the visitor once with both element types") {
  for (dtype a : fedshard::all_dtypes) {
    for (dtype b : fedshard::all_dtypes) {
      int calls = 0;
      const auto seen = fedshard::visit(a, b, [&](auto ta, auto tb) {
        ++calls;
        return std::pair{fedshard::dtype_of<typename decltype(ta)::type>,
                         fedshard::dtype_of<typename decltype(tb)::type>};
      });
      CHECK(calls == 1);
      CHECK(seen.first == a);
      CHECK(seen.second == b);
    }
  }
  constexpr auto bytes = fedshard::visit(dtype::f16, dtype::f64, [](auto ta, auto tb) {
    return 10 * sizeof(typename decltype(ta)::type) + sizeof(typename decltype(tb)::type);
  });
  static_assert(bytes == 28);
}

// ---- to_accum / from_accum ----

TEST_CASE("to_accum widens 16-bit types to float and keeps float and double") {
  static_assert(std::is_same_v<decltype(fedshard::to_accum(bf16{})), float>);
  static_assert(std::is_same_v<decltype(fedshard::to_accum(f16{})), float>);
  static_assert(std::is_same_v<decltype(fedshard::to_accum(1.0f)), float>);
  static_assert(std::is_same_v<decltype(fedshard::to_accum(1.0)), double>);
  CHECK(fedshard::to_accum(bf16::from_bits(0x3fc0)) == 1.5f);
  CHECK(fedshard::to_accum(f16::from_bits(0xc100)) == -2.5f);
  CHECK(fedshard::to_accum(0.1) == 0.1);
  CHECK(fedshard::to_accum(0.1f) == 0.1f);
}

TEST_CASE("from_accum rounds float and double to the element type") {
  CHECK(fedshard::from_accum<double>(0.1f) == static_cast<double>(0.1f));
  CHECK(fedshard::from_accum<float>(0.1) == 0.1f);
  CHECK(fedshard::from_accum<float>(1.0 + 0x1p-24) == 1.0f);  // tie: even
  for (float f : {0.0f, -1.5f, 3.14159f, 1.0f + 0x1p-8f, 65519.99f, 1e-7f}) {
    CHECK(fedshard::from_accum<bf16>(f).bits == bf16(f).bits);
    CHECK(fedshard::from_accum<f16>(f).bits == f16(f).bits);
  }
}

TEST_CASE_TEMPLATE("from_accum rounds a double to 16 bits once, around every pattern", T, bf16,
                   f16) {
  failures bad;
  const auto& mags = magnitudes<T>();
  auto check = [&](const char* what, double input, std::uint16_t want) {
    const std::uint16_t got = fedshard::from_accum<T>(input).bits;
    if (got != want) bad.add(what, input, got, want);
    if (got != reference_round<T>(input))
      bad.add("reference", input, got, reference_round<T>(input));
#if FEDSHARD_TEST_HAS_FLOAT16
    if constexpr (std::is_same_v<T, f16>) {
      if (got != float16_bits(input)) bad.add("_Float16", input, got, float16_bits(input));
    }
#endif
  };
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    const std::uint32_t mag = b & 0x7fffu;
    if (mag >= inf_bits<T>) continue;
    const std::uint32_t sign = b & 0x8000u;
    const double s = sign ? -1.0 : 1.0;
    const auto here = static_cast<std::uint16_t>(b);
    const auto next = static_cast<std::uint16_t>(sign | (mag + 1));
    const double mid = s * (mags[mag] + mags[mag + 1]) / 2;
    // Closer to the midpoint than a float can resolve: rounding via float would tie.
    check("just above midpoint", mid * (1 + 0x1p-40), next);
    check("just below midpoint", mid * (1 - 0x1p-40), here);
    check("midpoint", mid, (mag % 2 == 0) ? here : next);
    check("value", s * mags[mag], here);
  }
  CHECK_MESSAGE(bad.count == 0, bad.examples);

  using D = std::numeric_limits<double>;
  CHECK(fedshard::from_accum<T>(D::infinity()).bits == inf_bits<T>);
  CHECK(fedshard::from_accum<T>(-D::infinity()).bits == (0x8000u | inf_bits<T>));
  CHECK(fedshard::from_accum<T>(D::max()).bits == inf_bits<T>);
  CHECK(fedshard::from_accum<T>(-1e300).bits == (0x8000u | inf_bits<T>));
  CHECK(fedshard::from_accum<T>(1e-300).bits == 0x0000);
  CHECK(fedshard::from_accum<T>(-D::denorm_min()).bits == 0x8000);
  CHECK(fedshard::from_accum<T>(-0.0).bits == 0x8000);
  CHECK(is_quiet_nan_with_sign<T>(fedshard::from_accum<T>(D::quiet_NaN()).bits, false));
  CHECK(is_quiet_nan_with_sign<T>(fedshard::from_accum<T>(-D::quiet_NaN()).bits, true));
  CHECK(is_quiet_nan_with_sign<T>(fedshard::from_accum<T>(D::signaling_NaN()).bits, false));
  CHECK(is_quiet_nan_with_sign<T>(
      fedshard::from_accum<T>(std::bit_cast<double>(0x7ff0000000000001ull)).bits, false));
}
