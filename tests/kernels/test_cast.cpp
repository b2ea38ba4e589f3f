#include "fedshard/kernels/cast.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "support/bits.hpp"

namespace {

using namespace fedshard;
using fedshard::test::bits_of;
using fedshard::test::float_of;

// ---- A reference for rounding to bf16/f16 that knows nothing of the kernels ----

template <class T>
struct format;
template <>
struct format<bf16> {
  static constexpr int mant = 7;
  static constexpr int exp = 8;
};
template <>
struct format<f16> {
  static constexpr int mant = 10;
  static constexpr int exp = 5;
};

template <class T>
constexpr std::uint32_t inf_bits = ((1u << format<T>::exp) - 1u) << format<T>::mant;

/// The exact value of a 16-bit pattern, from the IEEE formula.
template <class T>
double decode(std::uint32_t b) {
  constexpr int mant = format<T>::mant;
  constexpr int bias = (1 << (format<T>::exp - 1)) - 1;
  const std::uint32_t e = (b >> mant) & ((1u << format<T>::exp) - 1u);
  const std::uint32_t m = b & ((1u << mant) - 1u);
  double v;
  if ((b & 0x7fffu) == inf_bits<T>)
    v = std::numeric_limits<double>::infinity();
  else if ((b & 0x7fffu) > inf_bits<T>)
    v = std::numeric_limits<double>::quiet_NaN();
  else if (e == 0)
    v = std::ldexp(static_cast<double>(m), 1 - bias - mant);
  else
    v = std::ldexp(static_cast<double>(m | (1u << mant)), static_cast<int>(e) - bias - mant);
  return (b & 0x8000u) ? -v : v;
}

/// d rounded to nearest, ties to even, onto the patterns of T (d not NaN).
template <class T>
std::uint16_t round_ref(double d) {
  const std::uint32_t sign = std::signbit(d) ? 0x8000u : 0u;
  const double a = std::fabs(d);
  std::uint32_t lo = 0, hi = inf_bits<T>;  // invariant: decode(lo) <= a < "decode(hi)"
  if (std::isinf(a)) return static_cast<std::uint16_t>(sign | hi);
  while (hi - lo > 1) {
    const std::uint32_t mid = lo + (hi - lo) / 2;
    (decode<T>(mid) <= a ? lo : hi) = mid;
  }
  const double below = decode<T>(lo);
  if (below == a) return static_cast<std::uint16_t>(sign | lo);
  const double above = hi == inf_bits<T> ? below + (below - decode<T>(lo - 1)) : decode<T>(hi);
  const double midpoint = (below + above) / 2;  // exact: 12 significant bits at most
  const std::uint32_t r = a < midpoint ? lo : a > midpoint ? hi : ((lo & 1u) ? hi : lo);
  return static_cast<std::uint16_t>(sign | r);
}

template <class T>
double value_of(T v) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>)
    return decode<T>(v.bits);
  else
    return static_cast<double>(v);
}

template <class T>
bool is_nan(T v) {
  return std::isnan(value_of(v));
}

template <class T>
bool sign_of(T v) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>)
    return (v.bits & 0x8000u) != 0;
  else
    return std::signbit(v);
}

/// The correctly rounded conversion of the exact value x of a From element, to To.
template <class To>
To expected_from_value(double x) {
  if constexpr (std::is_same_v<To, double>)
    return x;
  else if constexpr (std::is_same_v<To, float>)
    return static_cast<float>(x);  // one IEEE rounding, to nearest even
  else
    return To::from_bits(round_ref<To>(x));
}

/// Checks out == cast(in) element by element: bit-exact where the value is a number, NaN
/// with the input's sign where it is NaN.
template <class From, class To>
void check_conversions(const std::vector<From>& in, const std::vector<To>& out) {
  REQUIRE(in.size() == out.size());
  std::size_t failures = 0;
  for (std::size_t i = 0; i < in.size() && failures < 8; ++i) {
    const double x = value_of(in[i]);
    bool ok;
    if (std::isnan(x))
      ok = is_nan(out[i]) && sign_of(out[i]) == sign_of(in[i]);
    else
      ok = bits_of(out[i]) == bits_of(expected_from_value<To>(x));
    if (!ok) {
      ++failures;
      FAIL_CHECK("element ", i, ": input ", x, " converted to ", value_of(out[i]), ", expected ",
                 value_of(expected_from_value<To>(x)));
    }
  }
}

/// Inputs that stress rounding: every pattern for 16-bit types, a sweep of float patterns
/// for f32, and random values, exact 16-bit midpoints and their neighbours for f64.
template <class T>
std::vector<T> stress_inputs() {
  std::vector<T> v;
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>) {
    for (std::uint32_t b = 0; b < 65536; ++b)
      v.push_back(T::from_bits(static_cast<std::uint16_t>(b)));
  } else if constexpr (std::is_same_v<T, float>) {
    for (std::uint64_t b = 0; b < (1ull << 32); b += 4093)
      v.push_back(float_of(static_cast<std::uint32_t>(b)));
    // Around every f16 and bf16 midpoint of positive finite values, and the specials.
    for (std::uint32_t p = 0; p < inf_bits<f16>; ++p) {
      const auto mid = static_cast<float>((decode<f16>(p) + decode<f16>(p + 1)) / 2);
      for (std::uint32_t d : {0u, 1u}) {
        v.push_back(float_of(bits_of(mid) + d));
        v.push_back(-float_of(bits_of(mid) - d));
      }
    }
    for (std::uint32_t hi = 0; hi < inf_bits<bf16>; hi += 3) {
      const std::uint32_t mid = (hi << 16) | 0x8000u;
      for (std::uint32_t u : {mid - 1, mid, mid + 1}) v.push_back(float_of(u));
    }
    for (float f : {0.0f, -0.0f, std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::max(),
                    std::numeric_limits<float>::denorm_min(), 65504.0f, 65519.99f, 65520.0f})
      v.push_back(f);
    v.push_back(float_of(0x7f800001u));  // signalling NaN
    v.push_back(float_of(0xffc12345u));  // negative quiet NaN with payload
  } else {
    std::mt19937_64 rng(42);
    std::uniform_int_distribution<int> exponent(-160, 140);
    for (int i = 0; i < 200000; ++i) {
      const double m = std::ldexp(static_cast<double>(rng() >> 11), -53) + 0.5;  // [0.5, 1)
      v.push_back(std::ldexp((rng() & 1) ? -m : m, exponent(rng)));
    }
    // Exact midpoints of bf16 and f16 values and values a hair off them: a conversion that
    // rounds to float first and then to 16 bits gets the hair-off ones wrong.
    auto around = [&](double below, double above) {
      const double mid = (below + above) / 2;
      const double hair = std::ldexp(above - below, -40);
      for (double d :
           {mid, mid + hair, mid - hair, std::nextafter(mid, 0.0), std::nextafter(mid, 1e300)}) {
        v.push_back(d);
        v.push_back(-d);
      }
    };
    for (std::uint32_t p = 0; p + 1 < inf_bits<f16>; p += 7)
      around(decode<f16>(p), decode<f16>(p + 1));
    for (std::uint32_t p = 0; p + 1 < inf_bits<bf16>; p += 5)
      around(decode<bf16>(p), decode<bf16>(p + 1));
    for (double d : {0.0, -0.0, std::numeric_limits<double>::infinity(),
                     -std::numeric_limits<double>::infinity(), std::numeric_limits<double>::max(),
                     std::numeric_limits<double>::denorm_min(), 3.4028235677973366e38, 3.4028236e38,
                     1e39, 1.0 + std::ldexp(1.0, -24), 1.0 + 3 * std::ldexp(1.0, -24)})
      v.push_back(d);
    v.push_back(-std::numeric_limits<double>::quiet_NaN());
    v.push_back(std::numeric_limits<double>::signaling_NaN());
  }
  return v;
}

template <class From, class To>
struct pair_of {
  using from = From;
  using to = To;
};

#define FEDSHARD_ALL_CAST_PAIRS                                                               \
  pair_of<float, float>, pair_of<float, double>, pair_of<float, bf16>, pair_of<float, f16>,   \
      pair_of<double, float>, pair_of<double, double>, pair_of<double, bf16>,                 \
      pair_of<double, f16>, pair_of<bf16, float>, pair_of<bf16, double>, pair_of<bf16, bf16>, \
      pair_of<bf16, f16>, pair_of<f16, float>, pair_of<f16, double>, pair_of<f16, bf16>,      \
      pair_of<f16, f16>

TEST_CASE_TEMPLATE("cast rounds every dtype pair once, to nearest even", P,
                   FEDSHARD_ALL_CAST_PAIRS) {
  using From = typename P::from;
  using To = typename P::to;
  const std::vector<From> in = stress_inputs<From>();
  std::vector<To> out(in.size());
  kernels::cast(std::span<const From>(in), std::span<To>(out));  // the host loop
  check_conversions(in, out);
  for (std::size_t i = 0; i < in.size(); i += 97)  // the functor alone agrees with the loop
    REQUIRE(bits_of(kernels::cast_fn<From, To>{}(in[i])) == bits_of(out[i]));
}

TEST_CASE_TEMPLATE("type-erased cast equals the typed one for every dtype pair", P,
                   FEDSHARD_ALL_CAST_PAIRS) {
  using From = typename P::from;
  using To = typename P::to;
  const std::vector<From> all = stress_inputs<From>();
  std::vector<From> in;
  for (std::size_t i = 0; i < all.size(); i += all.size() / 5000 + 1) in.push_back(all[i]);
  std::vector<To> typed(in.size()), erased(in.size());
  kernels::cast(std::span<const From>(in), std::span<To>(typed));
  kernels::cast(fedshard::cview(std::span<const From>(in)), fedshard::view(std::span<To>(erased)));
  for (std::size_t i = 0; i < in.size(); ++i) REQUIRE(bits_of(typed[i]) == bits_of(erased[i]));
}

TEST_CASE_TEMPLATE("every instruction set gives the portable loop's bits for every dtype pair", P,
                   FEDSHARD_ALL_CAST_PAIRS) {
  // The stress inputs (ties, subnormals, NaN, infinities, signed zeros, overflow), then
  // random bit patterns; odd counts so that the vector loops' tails run too.
  using From = typename P::from;
  using To = typename P::to;
  std::vector<From> in = stress_inputs<From>();
  std::mt19937_64 gen(11);
  for (int i = 0; i < 20011; ++i) {
    From v;
    const std::uint64_t r = gen();
    std::memcpy(static_cast<void*>(&v), &r, sizeof(From));
    in.push_back(v);
  }
  std::vector<To> want(in.size());
  kernels::cast_on(kernels::isa::portable, std::span<const From>(in), std::span<To>(want));
  for (kernels::isa which : kernels::supported_isas()) {
    CAPTURE(std::string(kernels::to_string(which)));
    for (std::size_t n : {in.size(), std::size_t{1}, std::size_t{15}, std::size_t{67}}) {
      std::vector<To> got(n);
      kernels::cast_on(which, std::span<const From>(in.data(), n), std::span<To>(got));
      REQUIRE(std::memcmp(got.data(), want.data(), n * sizeof(To)) == 0);
    }
  }
}

TEST_CASE("16-bit conversions are those of core/dtype.hpp, bit for bit") {
  // cast_fn rewrites the bf16/f16 conversions without branches; they must not differ.
  const std::vector<float> in = stress_inputs<float>();
  std::vector<bf16> b(in.size());
  std::vector<f16> h(in.size());
  kernels::cast(std::span<const float>(in), std::span<bf16>(b));
  kernels::cast(std::span<const float>(in), std::span<f16>(h));
  for (std::size_t i = 0; i < in.size(); ++i) {
    REQUIRE(b[i].bits == bf16(in[i]).bits);
    REQUIRE(h[i].bits == f16(in[i]).bits);
  }
  std::vector<f16> all(65536);
  std::vector<bf16> all_b(65536);
  for (std::uint32_t p = 0; p < 65536; ++p) {
    all[p] = f16::from_bits(static_cast<std::uint16_t>(p));
    all_b[p] = bf16::from_bits(static_cast<std::uint16_t>(p));
  }
  std::vector<float> wide(all.size()), wide_b(all.size());
  kernels::cast(std::span<const f16>(all), std::span<float>(wide));
  kernels::cast(std::span<const bf16>(all_b), std::span<float>(wide_b));
  for (std::uint32_t p = 0; p < 65536; ++p) {  // NaN payloads included
    REQUIRE(bits_of(wide[p]) == bits_of(static_cast<float>(all[p])));
    REQUIRE(bits_of(wide_b[p]) == bits_of(static_cast<float>(all_b[p])));
  }
}

TEST_CASE_TEMPLATE("every 16-bit NaN widens to a quiet NaN with its sign and payload", T, bf16,
                   f16) {
  constexpr int mant = format<T>::mant;
  std::vector<T> in;
  for (std::uint32_t p = 0; p < 65536; ++p)
    if ((p & 0x7fffu) > inf_bits<T>) in.push_back(T::from_bits(static_cast<std::uint16_t>(p)));
  std::vector<float> wide(in.size());
  std::vector<double> wider(in.size());
  kernels::cast(std::span<const T>(in), std::span<float>(wide));
  kernels::cast(std::span<const T>(in), std::span<double>(wider));
  for (std::size_t i = 0; i < in.size(); ++i) {
    const std::uint32_t b = in[i].bits;
    CAPTURE(b);
    const std::uint32_t payload = b & ((1u << mant) - 1u);
    const std::uint32_t want = ((b & 0x8000u) << 16) | 0x7fc00000u | (payload << (23 - mant));
    REQUIRE(bits_of(wide[i]) == want);
    REQUIRE(bits_of(kernels::cast_fn<T, float>{}(in[i])) == want);
    // To double: the same NaN, widened again (payload at the top of double's 52 bits).
    const std::uint64_t want64 = (std::uint64_t{b & 0x8000u} << 48) | 0x7ff8000000000000ull |
                                 (std::uint64_t{payload} << (52 - mant));
    REQUIRE(bits_of(wider[i]) == want64);
  }
}

TEST_CASE_TEMPLATE("operand_fn is cast_fn but for a NaN's quiet bit, for every 16-bit pattern", T,
                   bf16, f16) {
  constexpr std::uint32_t quiet16 = 1u << (format<T>::mant - 1);
  for (std::uint32_t p = 0; p < 65536; ++p) {
    const T x = T::from_bits(static_cast<std::uint16_t>(p));
    const float op = kernels::operand_fn<T, float>{}(x);
    const float cast = kernels::cast_fn<T, float>{}(x);
    if ((p & 0x7fffu) > inf_bits<T>) {  // NaN: the pattern's own quiet bit, else the same
      CAPTURE(p);
      REQUIRE(std::isnan(op));
      REQUIRE((bits_of(op) | 0x00400000u) == bits_of(cast));
      REQUIRE(((bits_of(op) & 0x00400000u) != 0) == ((p & quiet16) != 0));
    } else {
      REQUIRE(bits_of(op) == bits_of(cast));
      REQUIRE(bits_of(kernels::operand_fn<T, double>{}(x)) ==
              bits_of(kernels::cast_fn<T, double>{}(x)));
    }
  }
  CHECK(kernels::operand_fn<float, double>{}(0.1f) == static_cast<double>(0.1f));
  CHECK(kernels::operand_fn<double, double>{}(0.1) == 0.1);
  CHECK(kernels::operand_fn<float, float>{}(-0.0f) == 0.0f);
  CHECK(std::signbit(kernels::operand_fn<float, float>{}(-0.0f)));
}

TEST_CASE("special values: NaN, infinities, signed zeros, subnormals") {
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(kernels::cast_fn<float, f16>{}(inf).bits == 0x7c00u);
  CHECK(kernels::cast_fn<float, f16>{}(-inf).bits == 0xfc00u);
  CHECK(kernels::cast_fn<float, f16>{}(65520.0f).bits == 0x7c00u);  // the overflow tie
  CHECK(kernels::cast_fn<float, f16>{}(65519.0f).bits == 0x7bffu);
  CHECK(kernels::cast_fn<float, bf16>{}(-0.0f).bits == 0x8000u);
  CHECK(kernels::cast_fn<float, f16>{}(-0.0f).bits == 0x8000u);
  CHECK(kernels::cast_fn<float, f16>{}(std::ldexp(1.0f, -24)).bits == 0x0001u);  // f16 min
  CHECK(kernels::cast_fn<float, f16>{}(std::ldexp(1.0f, -25)).bits == 0x0000u);  // tie: even
  CHECK(kernels::cast_fn<float, f16>{}(std::ldexp(3.0f, -25)).bits == 0x0002u);  // tie: even
  CHECK(kernels::cast_fn<float, f16>{}(-std::ldexp(1023.0f, -24)).bits == 0x83ffu);
  CHECK(kernels::cast_fn<float, bf16>{}(std::ldexp(1.0f, -133)).bits == 0x0001u);  // bf16 min
  CHECK(kernels::cast_fn<float, bf16>{}(std::numeric_limits<float>::denorm_min()).bits == 0u);
  CHECK(kernels::cast_fn<f16, float>{}(f16::from_bits(0x0001u)) == std::ldexp(1.0f, -24));
  CHECK(kernels::cast_fn<f16, float>{}(f16::from_bits(0x83ffu)) == -std::ldexp(1023.0f, -24));
  CHECK(std::signbit(kernels::cast_fn<f16, float>{}(f16::from_bits(0x8000u))));
  CHECK(kernels::cast_fn<f16, bf16>{}(f16::from_bits(0x7c00u)).bits == 0x7f80u);   // +inf
  CHECK(kernels::cast_fn<bf16, f16>{}(bf16::from_bits(0x4780u)).bits == 0x7c00u);  // 65536
  const bf16 nan_b = kernels::cast_fn<f16, bf16>{}(f16::from_bits(0xfd01u));       // -sNaN
  CHECK(((nan_b.bits & 0x7fffu) > 0x7f80u && (nan_b.bits & 0x8000u)));
  const f16 nan_h = kernels::cast_fn<double, f16>{}(std::numeric_limits<double>::quiet_NaN());
  CHECK((nan_h.bits & 0x7fffu) > 0x7c00u);
  CHECK(std::isnan(kernels::cast_fn<bf16, double>{}(bf16::from_bits(0x7fc1u))));
}

TEST_CASE("f64 to bf16/f16 rounds once, not through a rounded float") {
  // 1 + 2^-8 is the bf16 midpoint between 1 and 1 + 2^-7; a hair above it must round up,
  // but float(1 + 2^-8 + 2^-40) is the midpoint itself, which then ties down to 1.
  const double d = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40);
  CHECK(bf16(static_cast<float>(d)).bits == 0x3f80u);  // the double rounding, for contrast
  CHECK(kernels::cast_fn<double, bf16>{}(d).bits == 0x3f81u);
  CHECK(kernels::cast_fn<double, bf16>{}(-d).bits == 0xbf81u);
  const double h = 1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40);  // f16 midpoint + hair
  CHECK(kernels::cast_fn<double, f16>{}(h).bits == 0x3c01u);
  CHECK(kernels::cast_fn<double, f16>{}(1.0 + std::ldexp(1.0, -11)).bits == 0x3c00u);
  CHECK(kernels::cast_fn<double, float>{}(1.0 + std::ldexp(1.0, -24)) == 1.0f);
  CHECK(kernels::cast_fn<double, float>{}(1.0 + 3 * std::ldexp(1.0, -24)) ==
        1.0f + std::ldexp(1.0f, -22));
  CHECK(kernels::cast_fn<double, f16>{}(1e300).bits == 0x7c00u);
  CHECK(kernels::cast_fn<double, bf16>{}(-1e300).bits == 0xff80u);
  CHECK(kernels::cast_fn<double, bf16>{}(std::ldexp(1.0, -200)).bits == 0u);
}

TEST_CASE("cast functors are usable in constant expressions") {
  static_assert(kernels::cast_fn<float, bf16>{}(1.0f).bits == 0x3f80u);
  static_assert(kernels::cast_fn<float, f16>{}(-2.0f).bits == 0xc000u);
  static_assert(kernels::cast_fn<f16, float>{}(f16::from_bits(0x3c00u)) == 1.0f);
  static_assert(kernels::cast_fn<double, f16>{}(0.5).bits == 0x3800u);
}

TEST_CASE("cast host loops check their arguments") {
  std::vector<float> in(5);
  std::vector<bf16> out(4);
  try {
    kernels::cast(std::span<const float>(in), std::span<bf16>(out));
    FAIL("expected invalid_argument");
  } catch (const fedshard::invalid_argument& e) {
    const std::string what = e.what();
    CHECK(what.find("5 elements") != std::string::npos);
    CHECK(what.find("4") != std::string::npos);
  }
  try {
    kernels::cast(fedshard::const_buffer_view(in.data(), 5, dtype::f32),
                  fedshard::buffer_view{out.data(), 4, dtype::bf16});
    FAIL("expected invalid_argument");
  } catch (const fedshard::invalid_argument& e) {
    const std::string what = e.what();
    CHECK(what.find("5 elements of f32") != std::string::npos);
    CHECK(what.find("4 elements of bf16") != std::string::npos);
  }
  CHECK_THROWS_AS(kernels::cast(fedshard::const_buffer_view(in.data(), 4, static_cast<dtype>(9)),
                                fedshard::buffer_view{out.data(), 4, dtype::bf16}),
                  fedshard::invalid_argument);
  CHECK_THROWS_AS(kernels::cast(fedshard::const_buffer_view(nullptr, 4, dtype::f32),
                                fedshard::buffer_view{out.data(), 4, dtype::bf16}),
                  fedshard::invalid_argument);
  // Empty buffers need no data.
  kernels::cast(fedshard::const_buffer_view(nullptr, 0, dtype::f32),
                fedshard::buffer_view{nullptr, 0, dtype::f16});
}

TEST_CASE("same-dtype cast copies, also in place") {
  std::vector<bf16> a = {bf16(1.0f), bf16(-2.5f), bf16::from_bits(0x7fc3u)};
  std::vector<bf16> b(3);
  kernels::cast(fedshard::cview(std::span<const bf16>(a)), fedshard::view(std::span<bf16>(b)));
  for (std::size_t i = 0; i < 3; ++i) CHECK(a[i].bits == b[i].bits);  // NaN payload kept
  kernels::cast(std::span<const bf16>(a), std::span<bf16>(a));
  CHECK(a[1].bits == bf16(-2.5f).bits);
}

}  // namespace
