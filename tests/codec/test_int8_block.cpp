#include "fedshard/codec/int8_block.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fedshard/kernels/dispatch.hpp"
#include "support/codec_isa.hpp"

namespace codec = fedshard::codec;

namespace {

using C = codec::int8_block;

/// Encodes in with blocks of `block`, decodes into zeros; returns the decoded values and the
/// wire.
std::vector<float> round_trip(std::size_t block, const std::vector<float>& in,
                              std::vector<float>& wire_storage) {
  const C c({.block = block}, in.size());
  wire_storage.assign((c.encoded_bytes(in.size()) + 3) / 4, 0.0f);
  auto wire = std::as_writable_bytes(std::span(wire_storage)).first(c.encoded_bytes(in.size()));
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
  constexpr C::config b64{.block = 64};
  static_assert(C::encoded_bytes(b64, 0) == 0);
  static_assert(C::encoded_bytes(b64, 1) == 1 + 4);
  static_assert(C::encoded_bytes(b64, 64) == 64 + 4);
  static_assert(C::encoded_bytes(b64, 65) == 65 + 8);
  static_assert(C::encoded_bytes(b64, 1000) == 1000 + 16 * 4);
  static_assert(C::config{}.block == 256);
  CHECK(C{}.block() == 256);
  CHECK(C{}.encoded_bytes(1000) == 1000 + 4 * 4);  // ceil(1000 / 256) = 4 scales
}

TEST_CASE("int8_block: a block of 0 is refused, saying what was expected and found") {
  CHECK_THROWS_WITH_AS(
      C({.block = 0}, 10),
      doctest::Contains("int8_block: block (elements per scale) must be > 0, found 0"),
      fedshard::invalid_argument);
}

TEST_CASE("int8_block: a block of 3 end to end: wire bytes and values by hand") {
  // 7 elements in blocks of 3: ceil(7 / 3) = 3 scales (12 B) + 7 codes = 19 B. Block 0
  // {127, -63.5, 0}: scale 127 / 127 = 1, codes 127, round(-63.5) = -64 (ties to even), 0.
  // Block 1 {254, 254, -254}: scale 2, codes 127, 127, -127. Block 2 {0}: scale 0, code 0.
  const std::vector<float> in = {127.0f, -63.5f, 0.0f, 254.0f, 254.0f, -254.0f, 0.0f};
  const C c({.block = 3}, in.size());
  REQUIRE(c.encoded_bytes(in.size()) == 19);
  std::vector<float> wire;
  const std::vector<float> out = round_trip(3, in, wire);
  CHECK(scale_of(wire, 0) == 1.0f);
  CHECK(scale_of(wire, 1) == 2.0f);
  CHECK(scale_of(wire, 2) == 0.0f);
  const auto* codes = reinterpret_cast<const std::int8_t*>(wire.data() + 3);
  const std::int8_t want[7] = {127, -64, 0, 127, 127, -127, 0};
  for (std::size_t i = 0; i < 7; ++i) CHECK(codes[i] == want[i]);
  CHECK(out == std::vector<float>{127.0f, -64.0f, 0.0f, 254.0f, 254.0f, -254.0f, 0.0f});
}

TEST_CASE("int8_block: every element within scale/2 (+ float slack) of its input") {
  // |x - q s| <= s/2 in exact arithmetic. In floats: x / s has relative error <= 2^-24 on
  // |x / s| <= 127 (1 + 2^-23), which can move q across a tie (at most 127.01 * 2^-24 * s
  // more), and q * s rounds once (<= 127 s 2^-24): in all under 255 * 2^-24 s < 2^-15 s.
  std::mt19937 gen(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> e(-20, 20);
  std::vector<float> in(1234);  // 12 full blocks and a partial one of 34
  for (std::size_t i = 0; i < in.size(); ++i)
    in[i] = std::ldexp(u(gen), (i / 100) % 2 ? e(gen) : 0);  // some blocks of mixed magnitude
  std::vector<float> wire;
  const std::vector<float> out = round_trip(100, in, wire);
  REQUIRE(C({.block = 100}).blocks(in.size()) == 13);
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
  const C c8({.block = 8});
  std::vector<float> wire;
  SUBCASE("zeros give scale 0 and exact zeros") {
    const std::vector<float> in(19, 0.0f);
    const std::vector<float> out = round_trip(8, in, wire);
    for (float v : out) CHECK(v == 0.0f);
    for (std::size_t b = 0; b < c8.blocks(19); ++b) CHECK(scale_of(wire, b) == 0.0f);
  }
  SUBCASE("all-equal blocks come back within one rounding (code +-127)") {
    std::vector<float> in(20);
    for (std::size_t i = 0; i < in.size(); ++i) in[i] = i < 8 ? 0.3f : (i < 16 ? -5.5f : 1e-3f);
    const std::vector<float> out = round_trip(8, in, wire);
    for (std::size_t i = 0; i < in.size(); ++i) {
      CAPTURE(i);
      CHECK(std::fabs(out[i] - in[i]) <= std::fabs(in[i]) * 1.2e-7f);
    }
    const auto* codes = reinterpret_cast<const std::int8_t*>(wire.data() + c8.blocks(20));
    for (std::size_t i = 0; i < in.size(); ++i) CHECK(codes[i] == (in[i] > 0 ? 127 : -127));
  }
  SUBCASE("a zero in a block of non-zeros is sent exactly") {
    const std::vector<float> in = {0.0f, 2.0f, -1.0f};
    const std::vector<float> out = round_trip(8, in, wire);
    CHECK(out[0] == 0.0f);
  }
  SUBCASE("negating the input negates the codes") {
    std::vector<float> in = {0.1f, -0.7f, 0.35f, 2.5f, -2.5f, 1.25f, 0.0f, 0.9f, 0.01f};
    std::vector<float> neg(in.size());
    for (std::size_t i = 0; i < in.size(); ++i) neg[i] = -in[i];
    std::vector<float> wire_neg;
    const std::vector<float> a = round_trip(8, in, wire), b = round_trip(8, neg, wire_neg);
    for (std::size_t i = 0; i < in.size(); ++i) CHECK(a[i] == -b[i]);
  }
}

TEST_CASE("int8_block: decode_add accumulates; encoding is deterministic") {
  const C c16({.block = 16});
  std::vector<float> in(50);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = std::sin(static_cast<float>(i));
  std::vector<float> w1, w2;
  const std::vector<float> once = round_trip(16, in, w1);
  round_trip(16, in, w2);
  CHECK(std::memcmp(w1.data(), w2.data(), c16.encoded_bytes(in.size())) == 0);
  std::vector<float> acc(in.size(), 1.0f);
  c16.decode_add(std::as_bytes(std::span(w1)).first(c16.encoded_bytes(in.size())), acc);
  for (std::size_t i = 0; i < in.size(); ++i) CHECK(acc[i] == 1.0f + once[i]);
}

TEST_CASE("int8_block: every instruction set gives the portable wire and sums") {
  // Random bit patterns (NaN, infinities, subnormals), blocks of one magnitude with ties
  // (k + 1/2 times the scale), blocks of zeros and of subnormals; a partial last block.
  std::mt19937 gen(9);
  std::vector<float> in(7 * 256 + 77);
  for (std::size_t i = 0; i < in.size(); ++i) {
    const std::uint32_t r = gen();
    switch ((i / 256) % 4) {
      case 0: std::memcpy(&in[i], &r, 4); break;  // any pattern
      case 1: in[i] = static_cast<float>(static_cast<int>(r % 255) - 127) * 0.5f; break;  // ties
      case 2: in[i] = (r % 5 == 0) ? 0.0f : std::ldexp(static_cast<float>(r % 1000), -140); break;
      default: in[i] = (r % 3 == 0) ? -0.0f : 0.0f; break;
    }
  }
  std::vector<float> base(in.size());
  for (std::size_t i = 0; i < base.size(); ++i) base[i] = static_cast<float>(i % 11) - 5.0f;
  for (std::size_t block : {256, 100, 7}) {  // 256: the compiled-in default's loops
    CAPTURE(block);
    fedshard::test::check_codec_on_every_isa<C>(
        in, base, {in.size(), std::size_t{1}, std::size_t{300}, std::size_t{1000}},
        {.block = block});
  }
}

TEST_CASE("int8_block: the branch-free code equals rounding the quotient with nearbyint") {
  // int8_code rounds on the bits; the definition is nearbyint(v) clamped to [-127, 127],
  // NaN -> -127. Checked here on a sweep of quotients around every half-integer, and
  // on random bit patterns (an exhaustive run over all 2^32 floats agreed when written).
  const auto reference = [](float v) {
    const float q = std::nearbyint(v);
    return static_cast<std::int8_t>(q >= -127.0f ? (q <= 127.0f ? q : 127.0f) : -127.0f);
  };
  std::vector<float> v;
  for (int k = -300; k <= 300; ++k) {
    const float h = static_cast<float>(k) * 0.5f;
    v.insert(v.end(), {h, std::nextafter(h, -1e9f), std::nextafter(h, 1e9f)});
  }
  std::mt19937 gen(4);
  for (int i = 0; i < 200000; ++i) {
    const std::uint32_t r = gen();
    float f;
    std::memcpy(&f, &r, 4);
    v.push_back(f);
  }
  for (float x : v) {
    CAPTURE(x);
    REQUIRE(codec::detail::int8_code(x) == reference(x));
  }
}
