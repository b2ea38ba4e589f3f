#include "fedshard/kernels/weighted_sum.hpp"

#include <doctest/doctest.h>

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

template <class T>
double value_of(T v) {
  return static_cast<double>(fedshard::to_accum(v));
}

std::string message_of(std::span<const const_buffer_view> ins, std::span<const double> weights,
                       fedshard::buffer_view out) {
  try {
    kernels::weighted_sum(ins, weights, out);
  } catch (const fedshard::invalid_argument& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST_CASE("weighted sum against a hand-computed reference") {
  // Small integers and power-of-two weights: every partial sum is exact in float, so the
  // result must equal the double reference exactly.
  const std::vector<float> a = {1, 2, 3, -4, 0};
  const std::vector<float> b = {8, -6, 4, 2, 0};
  const std::vector<float> c = {0, 10, -12, 16, 0};
  const std::vector<double> w = {0.5, 0.25, 0.125};
  const std::vector<double> expected = {
      0.5 * 1 + 0.25 * 8 + 0.125 * 0, 0.5 * 2 + 0.25 * -6 + 0.125 * 10,
      0.5 * 3 + 0.25 * 4 + 0.125 * -12, 0.5 * -4 + 0.25 * 2 + 0.125 * 16, 0.0};
  const const_buffer_view ins[] = {fedshard::cview(std::span<const float>(a)),
                                   fedshard::cview(std::span<const float>(b)),
                                   fedshard::cview(std::span<const float>(c))};
  std::vector<float> out(5, -1.0f);
  kernels::weighted_sum(ins, w, fedshard::view(std::span<float>(out)));
  for (std::size_t i = 0; i < out.size(); ++i) CHECK(out[i] == expected[i]);
  std::vector<double> out64(5);  // f32 in, f64 out: accumulates in double
  kernels::weighted_sum(ins, w, fedshard::view(std::span<double>(out64)));
  CHECK(out64 == expected);
  std::vector<bf16> out16(5);
  kernels::weighted_sum(ins, w, fedshard::view(std::span<bf16>(out16)));
  for (std::size_t i = 0; i < out.size(); ++i) CHECK(value_of(out16[i]) == expected[i]);
}

TEST_CASE("random f32 weighted sums: k-order float accumulation, close to double") {
  std::mt19937 rng(31);
  std::uniform_real_distribution<float> value(-10.0f, 10.0f);
  std::uniform_real_distribution<double> weight(0.0, 1.0);
  for (std::size_t k = 1; k <= 9; ++k) {
    const std::size_t n = 777;
    std::vector<std::vector<float>> in(k, std::vector<float>(n));
    std::vector<const_buffer_view> views;
    std::vector<double> w(k);
    for (std::size_t j = 0; j < k; ++j) {
      for (float& x : in[j]) x = value(rng);
      views.push_back(fedshard::cview(std::span<const float>(in[j])));
      w[j] = weight(rng);
    }
    std::vector<float> out(n);
    kernels::weighted_sum(views, w, fedshard::view(std::span<float>(out)));
    for (std::size_t i = 0; i < n; ++i) {
      float acc = static_cast<float>(w[0]) * in[0][i];
      double exact = 0, magnitude = 0;
      for (std::size_t j = 0; j < k; ++j) {
        if (j > 0) acc += static_cast<float>(w[j]) * in[j][i];
        exact += w[j] * static_cast<double>(in[j][i]);
        magnitude += std::fabs(w[j] * static_cast<double>(in[j][i]));
      }
      REQUIRE(bits_of(out[i]) == bits_of(acc));  // deterministic: exactly this order
      REQUIRE(std::fabs(out[i] - exact) <= 1e-6 * magnitude + 1e-30);
    }
  }
}

TEST_CASE_TEMPLATE("every input/output dtype pair accumulates in accum_t and rounds once", P,
                   FEDSHARD_TEST_ELEMENT_PAIRS) {
  using In = typename P::first;
  using Out = typename P::second;
  using A = test::accum_of_t<In, Out>;
  std::mt19937 rng(37);
  std::uniform_real_distribution<double> value(-50.0, 50.0);
  const std::size_t k = 4, n = 300;
  const std::vector<double> w = {0.4, 0.0, 0.35, 0.25};
  std::vector<std::vector<In>> in(k, std::vector<In>(n));
  std::vector<const_buffer_view> views;
  for (std::size_t j = 0; j < k; ++j) {
    for (In& x : in[j]) x = fedshard::from_accum<In>(value(rng));
    views.push_back(fedshard::cview(std::span<const In>(in[j])));
  }
  std::vector<Out> out(n);
  kernels::weighted_sum(views, w, fedshard::view(std::span<Out>(out)));
  for (std::size_t i = 0; i < n; ++i) {
    A acc = static_cast<A>(w[0]) * static_cast<A>(fedshard::to_accum(in[0][i]));
    for (std::size_t j = 2; j < k; ++j)  // the zero weight w[1] is skipped
      acc += static_cast<A>(w[j]) * static_cast<A>(fedshard::to_accum(in[j][i]));
    REQUIRE(bits_of(out[i]) == bits_of(fedshard::from_accum<Out>(acc)));
  }
}

TEST_CASE("a zero weight leaves its input out, even NaN or infinity") {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> a = {1, 2, 3};
  const std::vector<float> bad = {std::numeric_limits<float>::quiet_NaN(), inf, -inf};
  const const_buffer_view ins[] = {fedshard::cview(std::span<const float>(a)),
                                   fedshard::cview(std::span<const float>(bad))};
  std::vector<float> out(3);
  const double w[] = {2.0, 0.0};
  kernels::weighted_sum(ins, w, fedshard::view(std::span<float>(out)));
  CHECK(out == std::vector<float>{2, 4, 6});
  const double none[] = {0.0, 0.0};
  kernels::weighted_sum(ins, none, fedshard::view(std::span<float>(out)));
  for (float x : out) CHECK(bits_of(x) == bits_of(0.0f));  // +0 when nothing takes part
  const double both[] = {1.0, 1.0};  // a non-zero weight lets NaN and infinity through
  kernels::weighted_sum(ins, both, fedshard::view(std::span<float>(out)));
  CHECK(std::isnan(out[0]));
  CHECK(out[1] == inf);
  CHECK(out[2] == -inf);
}

TEST_CASE("a signalling 16-bit NaN input gives a quiet NaN, payload kept") {
  const std::vector<f16> a = {f16::from_bits(0x7d01), f16(1.0f)};
  const std::vector<f16> b = {f16(1.0f), f16(2.0f)};
  const const_buffer_view ins[] = {fedshard::cview(std::span<const f16>(a)),
                                   fedshard::cview(std::span<const f16>(b))};
  const double weights[] = {0.5, 0.5};
  std::vector<float> out(2);
  kernels::weighted_sum(ins, weights, fedshard::view(std::span<float>(out)));
  std::uint32_t bits = 0;
  std::memcpy(&bits, &out[0], 4);
  CHECK(bits == 0x7fe02000u);  // f16 payload 0x101 at the top of the float's mantissa, quiet
  CHECK(out[1] == 1.5f);
}

TEST_CASE("K = 1: a scaled copy, signed zeros kept") {
  const std::vector<f16> a = {f16(1.5f), f16(-0.0f), f16(-3.0f)};
  const const_buffer_view ins[] = {fedshard::cview(std::span<const f16>(a))};
  std::vector<f16> out(3);
  const double one[] = {1.0};
  kernels::weighted_sum(ins, one, fedshard::view(std::span<f16>(out)));
  for (std::size_t i = 0; i < 3; ++i) CHECK(out[i].bits == a[i].bits);
  const double half[] = {0.5};
  std::vector<float> out32(3);
  kernels::weighted_sum(ins, half, fedshard::view(std::span<float>(out32)));
  CHECK(out32 == std::vector<float>{0.75f, -0.0f, -1.5f});
}

TEST_CASE("the output may be one of the inputs") {
  std::vector<float> a = {1, 2, 3, 4};
  const std::vector<float> b = {10, 20, 30, 40};
  const const_buffer_view ins[] = {fedshard::cview(std::span<const float>(a)),
                                   fedshard::cview(std::span<const float>(b))};
  const double w[] = {0.5, 0.5};
  kernels::weighted_sum(ins, w, fedshard::view(std::span<float>(a)));
  CHECK(a == std::vector<float>{5.5f, 11.0f, 16.5f, 22.0f});
}

TEST_CASE("the functor alone, as a device kernel would call it") {
  const float a[] = {1, 2}, b[] = {3, 4};
  const float* ptrs[] = {a, b};
  const float w[] = {0.5f, 2.0f};
  const kernels::weighted_sum_fn<float, bf16> f{ptrs, w, 2};
  CHECK(f(0).bits == bf16(6.5f).bits);
  CHECK(f(1).bits == bf16(9.0f).bits);
}

TEST_CASE("weighted_sum checks its arguments and says what it found") {
  const std::vector<float> a(4), b(3);
  const std::vector<bf16> c(4);
  std::vector<float> out(4);
  const auto out_view = fedshard::view(std::span<float>(out));
  const double w2[] = {1.0, 1.0};
  const double w3[] = {1.0, 1.0, 1.0};
  const const_buffer_view va = fedshard::cview(std::span<const float>(a));
  SUBCASE("no inputs") {
    CHECK(contains(message_of({}, {}, out_view), "at least one input, got 0"));
  }
  SUBCASE("weights") {
    const const_buffer_view ins[] = {va, va};
    CHECK(contains(message_of(ins, w3, out_view), "(2 inputs), got 3 weights"));
  }
  SUBCASE("counts") {
    const const_buffer_view ins[] = {va, fedshard::cview(std::span<const float>(b))};
    CHECK(contains(message_of(ins, w2, out_view),
                   "input 1 has 3 elements of f32, input 0 has 4 elements of f32"));
  }
  SUBCASE("dtypes") {
    const const_buffer_view ins[] = {va, fedshard::cview(std::span<const bf16>(c))};
    CHECK(contains(message_of(ins, w2, out_view),
                   "input 1 has 4 elements of bf16, input 0 has 4 elements of f32"));
  }
  SUBCASE("output count") {
    const const_buffer_view ins[] = {va, va};
    std::vector<float> small(2);
    CHECK(contains(message_of(ins, w2, fedshard::view(std::span<float>(small))),
                   "output has 2 elements, the inputs have 4"));
  }
  SUBCASE("null pointers") {
    const const_buffer_view ins[] = {va, const_buffer_view(nullptr, 4, dtype::f32)};
    CHECK(contains(message_of(ins, w2, out_view), "input 1 has a null data pointer for 4"));
    const const_buffer_view ok[] = {va, va};
    CHECK(contains(message_of(ok, w2, fedshard::buffer_view{nullptr, 4, dtype::f32}),
                   "null output data pointer for 4"));
  }
  SUBCASE("invalid dtype") {
    const const_buffer_view ins[] = {const_buffer_view(a.data(), 4, static_cast<dtype>(5))};
    const double w1[] = {1.0};
    CHECK(contains(message_of(ins, w1, out_view), "invalid dtype"));
  }
  SUBCASE("empty buffers are fine") {
    const const_buffer_view ins[] = {const_buffer_view(nullptr, 0, dtype::f16)};
    const double w1[] = {1.0};
    CHECK(message_of(ins, w1, fedshard::buffer_view{nullptr, 0, dtype::bf16}).empty());
  }
}

}  // namespace
