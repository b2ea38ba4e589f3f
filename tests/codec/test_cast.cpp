#include "fedshard/codec/cast.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "fedshard/kernels/dispatch.hpp"
#include "support/codec_isa.hpp"

namespace codec = fedshard::codec;
using fedshard::bf16;
using fedshard::f16;
using fedshard::fp8_e4m3;

namespace {

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

/// Inputs: random over many magnitudes plus the special values.
std::vector<float> inputs() {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          448.0f,
                          500.0f,
                          -1e6f,
                          65504.0f,
                          65520.0f,
                          std::ldexp(1.0f, -24),
                          std::ldexp(1.0f, -10),
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::denorm_min()};
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> mant(-2.0f, 2.0f);
  std::uniform_int_distribution<int> exp(-30, 20);
  for (int i = 0; i < 5000; ++i) v.push_back(std::ldexp(mant(gen), exp(gen)));
  return v;
}

/// The wire element i as stored, and its value by the element type's own conversion.
template <class T>
float wire_value(const std::vector<std::byte>& wire, std::size_t i) {
  T t;
  std::memcpy(&t, wire.data() + i * sizeof(T), sizeof(T));
  if constexpr (std::is_same_v<T, float>)
    return t;
  else
    return t.to_float();
}

/// The element the core conversion gives.
template <class T>
T converted(float x) {
  if constexpr (std::is_same_v<T, float>)
    return x;
  else
    return T(x);
}

}  // namespace

TEST_CASE_TEMPLATE("cast<T>: the wire holds T(x) bit for bit; decode_add adds its exact value", T,
                   float, bf16, f16, fp8_e4m3) {
  using C = codec::cast<T>;
  const std::vector<float> in = inputs();
  static_assert(C::encoded_bytes(10) == 10 * sizeof(T));
  std::vector<std::byte> wire(C::encoded_bytes(in.size()) + 8);
  // A vector of bytes is aligned for every fundamental type (operator new).
  C c(typename C::config{}, in.size());
  c.encode(in, std::span(wire).first(C::encoded_bytes(in.size())));
  std::vector<float> out(in.size(), 0.5f);
  c.decode_add(std::span<const std::byte>(wire).first(C::encoded_bytes(in.size())), out);
  std::size_t failures = 0;
  for (std::size_t i = 0; i < in.size(); ++i) {
    const T want = converted<T>(in[i]);
    T got;
    std::memcpy(&got, wire.data() + i * sizeof(T), sizeof(T));
    const bool same = std::memcmp(&got, &want, sizeof(T)) == 0;
    const float v = wire_value<T>(wire, i);
    const float sum = 0.5f + v;
    const bool added = std::isnan(sum) ? std::isnan(out[i]) : bits_of(out[i]) == bits_of(sum);
    if ((!same || !added) && ++failures <= 8) {
      CAPTURE(i);
      CAPTURE(in[i]);
      CHECK(same);
      CHECK(added);
    }
  }
  CHECK(failures == 0);
}

TEST_CASE_TEMPLATE("cast<T>: every instruction set gives the portable wire and sums", T, float,
                   bf16, f16, fp8_e4m3) {
  // inputs() and random bit patterns (NaN payloads, subnormals, infinities); decode_add
  // adds to finite values, so that a NaN sum has one NaN operand.
  using C = codec::cast<T>;
  std::vector<float> in = inputs();
  std::mt19937 gen(5);
  for (int i = 0; i < 20011; ++i) {
    const std::uint32_t r = gen();
    float f;
    std::memcpy(&f, &r, 4);
    in.push_back(f);
  }
  std::vector<float> base(in.size());
  for (std::size_t i = 0; i < base.size(); ++i) base[i] = static_cast<float>(i % 13) * 0.37f - 2.0f;
  fedshard::test::check_codec_on_every_isa<C>(
      in, base, {in.size(), std::size_t{1}, std::size_t{31}, std::size_t{100}});
}

TEST_CASE("cast: names") {
  CHECK(codec::cast<float>::name == "cast_f32");
  CHECK(codec::cast<bf16>::name == "cast_bf16");
  CHECK(codec::cast<f16>::name == "cast_f16");
  CHECK(codec::cast<fp8_e4m3>::name == "cast_fp8_e4m3");
}
