#include "fedshard/codec/int8_block.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace codec = fedshard::codec;

namespace {

/// Encodes in, decodes into zeros; returns the decoded values and the wire.
template <class C>
std::vector<float> round_trip(const std::vector<float>& in, std::vector<float>& wire_storage) {
  wire_storage.assign((C::encoded_bytes(in.size()) + 3) / 4, 0.0f);
  auto wire = std::as_writable_bytes(std::span(wire_storage)).first(C::encoded_bytes(in.size()));
  C c(typename C::config{}, in.size());
  c.encode(in, wire);
  std::vector<float> out(in.size(), 0.0f);
  c.decode_add(wire, out);
  return out;
}

/// The scale of each block, as written at the start of the wire.
float scale_of(const std::vector<float>& wire_storage, std::size_t block) {
  return wire_storage[block];
}

}  // namespace

TEST_CASE("int8_block: wire size is n bytes + one f32 scale per block, partial last included") {
  using C = codec::int8_block<64>;
  static_assert(C::encoded_bytes(0) == 0);
  static_assert(C::encoded_bytes(1) == 1 + 4);
  static_assert(C::encoded_bytes(64) == 64 + 4);
  static_assert(C::encoded_bytes(65) == 65 + 8);
  static_assert(C::encoded_bytes(1000) == 1000 + 16 * 4);
  static_assert(codec::int8_block<>::block == 256);
}

TEST_CASE("int8_block: every element within scale/2 (+ float slack) of its input") {
  // |x - q s| <= s/2 in exact arithmetic. In floats: x / s has relative error <= 2^-24 on
  // |x / s| <= 127 (1 + 2^-23), which can move q across a tie (at most 127.01 * 2^-24 * s
  // more), and q * s rounds once (<= 127 s 2^-24): in all under 255 * 2^-24 s < 2^-15 s.
  using C = codec::int8_block<100>;
  std::mt19937 gen(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> e(-20, 20);
  std::vector<float> in(1234);  // 12 full blocks and a partial one of 34
  for (std::size_t i = 0; i < in.size(); ++i)
    in[i] = std::ldexp(u(gen), (i / 100) % 2 ? e(gen) : 0);  // some blocks of mixed magnitude
  std::vector<float> wire;
  const std::vector<float> out = round_trip<C>(in, wire);
  REQUIRE(C::blocks(in.size()) == 13);
  for (std::size_t b = 0; b < 13; ++b) {
    const std::size_t begin = b * 100, end = std::min(in.size(), begin + 100);
    float absmax = 0.0f;
    for (std::size_t i = begin; i < end; ++i) absmax = std::max(absmax, std::fabs(in[i]));
    const float s = scale_of(wire, b);
    CHECK(s == absmax / 127.0f);
    const double bound = static_cast<double>(s) * (0.5 + std::ldexp(1.0, -15));
    for (std::size_t i = begin; i < end; ++i) {
      CAPTURE(i);
      CHECK(std::fabs(static_cast<double>(in[i]) - out[i]) <= bound);
    }
    // The element of largest magnitude is sent as +-127 and comes back within one rounding.
    for (std::size_t i = begin; i < end; ++i)
      if (std::fabs(in[i]) == absmax) CHECK(std::fabs(out[i] - in[i]) <= absmax * 1e-6f);
  }
}

TEST_CASE("int8_block: zeros, all-equal blocks, a single element, sign symmetry") {
  using C = codec::int8_block<8>;
  std::vector<float> wire;
  SUBCASE("zeros give scale 0 and exact zeros") {
    const std::vector<float> in(19, 0.0f);
    const std::vector<float> out = round_trip<C>(in, wire);
    for (float v : out) CHECK(v == 0.0f);
    for (std::size_t b = 0; b < C::blocks(19); ++b) CHECK(scale_of(wire, b) == 0.0f);
  }
  SUBCASE("all-equal blocks come back within one rounding (code +-127)") {
    std::vector<float> in(20);
    for (std::size_t i = 0; i < in.size(); ++i) in[i] = i < 8 ? 0.3f : (i < 16 ? -5.5f : 1e-3f);
    const std::vector<float> out = round_trip<C>(in, wire);
    for (std::size_t i = 0; i < in.size(); ++i) {
      CAPTURE(i);
      CHECK(std::fabs(out[i] - in[i]) <= std::fabs(in[i]) * 1.2e-7f);
    }
    const auto* codes = reinterpret_cast<const std::int8_t*>(wire.data() + C::blocks(20));
    for (std::size_t i = 0; i < in.size(); ++i) CHECK(codes[i] == (in[i] > 0 ? 127 : -127));
  }
  SUBCASE("a zero in a block of non-zeros is sent exactly") {
    const std::vector<float> in = {0.0f, 2.0f, -1.0f};
    const std::vector<float> out = round_trip<C>(in, wire);
    CHECK(out[0] == 0.0f);
  }
  SUBCASE("negating the input negates the codes") {
    std::vector<float> in = {0.1f, -0.7f, 0.35f, 2.5f, -2.5f, 1.25f, 0.0f, 0.9f, 0.01f};
    std::vector<float> neg(in.size());
    for (std::size_t i = 0; i < in.size(); ++i) neg[i] = -in[i];
    std::vector<float> wire_neg;
    const std::vector<float> a = round_trip<C>(in, wire), b = round_trip<C>(neg, wire_neg);
    for (std::size_t i = 0; i < in.size(); ++i) CHECK(a[i] == -b[i]);
  }
}

TEST_CASE("int8_block: decode_add accumulates; encoding is deterministic") {
  using C = codec::int8_block<16>;
  std::vector<float> in(50);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = std::sin(static_cast<float>(i));
  std::vector<float> w1, w2;
  const std::vector<float> once = round_trip<C>(in, w1);
  round_trip<C>(in, w2);
  CHECK(std::memcmp(w1.data(), w2.data(), C::encoded_bytes(in.size())) == 0);
  std::vector<float> acc(in.size(), 1.0f);
  C::decode_add(std::as_bytes(std::span(w1)).first(C::encoded_bytes(in.size())), acc);
  for (std::size_t i = 0; i < in.size(); ++i) CHECK(acc[i] == 1.0f + once[i]);
}
