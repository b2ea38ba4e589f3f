#include "fedshard/kernels/scale.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "support/bits.hpp"

namespace {

using namespace fedshard;
using fedshard::test::bits_of;

/// Values of T: every pattern for 16-bit types, random ones (and specials) otherwise.
template <class T>
std::vector<T> values_of() {
  std::vector<T> v;
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>) {
    for (std::uint32_t b = 0; b < 65536; ++b)
      v.push_back(T::from_bits(static_cast<std::uint16_t>(b)));
  } else {
    std::mt19937_64 rng(3);
    std::uniform_real_distribution<double> mantissa(-1.0, 1.0);
    std::uniform_int_distribution<int> exponent(-30, 30);
    for (int i = 0; i < 20000; ++i)
      v.push_back(static_cast<T>(std::ldexp(mantissa(rng), exponent(rng))));
    for (T s :
         {T(0), -T(0), std::numeric_limits<T>::infinity(), std::numeric_limits<T>::quiet_NaN(),
          std::numeric_limits<T>::denorm_min(), std::numeric_limits<T>::max()})
      v.push_back(s);
  }
  return v;
}

using element_types = std::tuple<float, double, bf16, f16>;

TEST_CASE_TEMPLATE_DEFINE("scale multiplies in the accumulation type and rounds once", T,
                          scale_test) {
  for (double alpha : {0.5, -3.0, 0.1, 1.0 / 3.0, 0.0, 1e10}) {
    CAPTURE(alpha);
    const std::vector<T> in = values_of<T>();
    std::vector<T> x = in;
    kernels::scale(std::span<T>(x), alpha);
    using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
    const A a = static_cast<A>(alpha);
    for (std::size_t i = 0; i < in.size(); ++i) {
      const T expected = fedshard::from_accum<T>(fedshard::to_accum(in[i]) * a);
      REQUIRE(fedshard::test::same_value(x[i], expected));
    }
    std::vector<T> erased = in;  // the type-erased loop agrees
    kernels::scale(fedshard::view(std::span<T>(erased)), alpha);
    for (std::size_t i = 0; i < in.size(); ++i) REQUIRE(bits_of(erased[i]) == bits_of(x[i]));
  }
}
TEST_CASE_TEMPLATE_APPLY(scale_test, element_types);

TEST_CASE("scale of exact values") {
  std::vector<float> x = {1.0f, -2.0f, 3.0f, 0.0f};
  kernels::scale(std::span<float>(x), 0.25);
  CHECK(x == std::vector<float>{0.25f, -0.5f, 0.75f, 0.0f});
  std::vector<bf16> h = {bf16(1.0f), bf16(3.0f)};
  kernels::scale(std::span<bf16>(h), 1.0 / 3.0);
  CHECK(h[0].bits == bf16(1.0f / 3.0f).bits);
  CHECK(h[1].bits == bf16(1.0f).bits);  // 3 * float(1/3) = 1 after rounding to bf16
}

TEST_CASE_TEMPLATE("axpy adds a * x to y for every dtype pair", P, FEDSHARD_TEST_ELEMENT_PAIRS) {
  using X = typename P::first;
  using Y = typename P::second;
  using A = test::accum_of_t<X, Y>;
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> value(-100.0, 100.0);
  const std::size_t n = 1000;
  std::vector<X> x(n);
  std::vector<Y> y(n);
  for (std::size_t i = 0; i < n; ++i) {
    x[i] = fedshard::from_accum<X>(value(rng));
    y[i] = fedshard::from_accum<Y>(value(rng));
  }
  const double a = -0.3;
  std::vector<Y> out = y;
  kernels::axpy(a, std::span<const X>(x), std::span<Y>(out));
  for (std::size_t i = 0; i < n; ++i) {
    const A sum = static_cast<A>(fedshard::to_accum(y[i])) +
                  static_cast<A>(a) * static_cast<A>(fedshard::to_accum(x[i]));
    REQUIRE(bits_of(out[i]) == bits_of(fedshard::from_accum<Y>(sum)));
  }
  std::vector<Y> erased = y;
  kernels::axpy(a, fedshard::cview(std::span<const X>(x)), fedshard::view(std::span<Y>(erased)));
  for (std::size_t i = 0; i < n; ++i) REQUIRE(bits_of(erased[i]) == bits_of(out[i]));
}

TEST_CASE("axpy in place: y += a * y") {
  std::vector<float> y = {1.0f, -2.0f, 4.0f};
  kernels::axpy(0.5, std::span<const float>(y), std::span<float>(y));
  CHECK(y == std::vector<float>{1.5f, -3.0f, 6.0f});
}

TEST_CASE("signalling 16-bit NaNs come out of scale and axpy quiet, sign and payload kept") {
  // 0x7d01 and 0x7f81 are signalling; the widening keeps them so, the arithmetic quiets them.
  std::vector<f16> h = {f16::from_bits(0x7d01), f16::from_bits(0xfd01)};
  kernels::scale(std::span<f16>(h), 2.0);
  CHECK(h[0].bits == 0x7f01);
  CHECK(h[1].bits == 0xff01);
  std::vector<float> y = {1.0f, 1.0f};
  const std::vector<bf16> x = {bf16::from_bits(0x7f81), bf16::from_bits(0xff81)};
  kernels::axpy(0.5, std::span<const bf16>(x), std::span<float>(y));
  std::uint32_t y0 = 0, y1 = 0;
  std::memcpy(&y0, &y[0], 4);
  std::memcpy(&y1, &y[1], 4);
  CHECK(y0 == 0x7fc10000u);
  CHECK(y1 == 0xffc10000u);
}

TEST_CASE("scale and axpy check their arguments") {
  std::vector<float> x(3);
  std::vector<bf16> y(2);
  try {
    kernels::axpy(1.0, std::span<const float>(x), std::span<bf16>(y));
    FAIL("expected invalid_argument");
  } catch (const fedshard::invalid_argument& e) {
    const std::string what = e.what();
    CHECK(what.find("x has 3 elements, y has 2") != std::string::npos);
  }
  try {
    kernels::axpy(1.0, fedshard::cview(std::span<const float>(x)),
                  fedshard::view(std::span<bf16>(y)));
    FAIL("expected invalid_argument");
  } catch (const fedshard::invalid_argument& e) {
    const std::string what = e.what();
    CHECK(what.find("x has 3 elements of f32, y has 2 elements of bf16") != std::string::npos);
  }
  CHECK_THROWS_AS(kernels::scale(fedshard::buffer_view{x.data(), 3, static_cast<dtype>(7)}, 2.0),
                  fedshard::invalid_argument);
  CHECK_THROWS_AS(kernels::scale(fedshard::buffer_view{nullptr, 3, dtype::f32}, 2.0),
                  fedshard::invalid_argument);
  CHECK_THROWS_AS(kernels::axpy(1.0, fedshard::const_buffer_view(nullptr, 2, dtype::f32),
                                fedshard::view(std::span<bf16>(y))),
                  fedshard::invalid_argument);
  kernels::scale(fedshard::buffer_view{nullptr, 0, dtype::f16}, 2.0);  // empty: no data needed
}

}  // namespace
