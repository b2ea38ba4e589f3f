#include "fedshard/codec/topk.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "fedshard/kernels/dispatch.hpp"

namespace codec = fedshard::codec;

namespace {

using C = codec::topk;
constexpr unsigned f32 = codec::topk_unquantised;

/// A 4-byte-aligned wire of encoded_bytes(n) bytes.
struct wire_buffer {
  std::vector<float> storage;
  std::size_t bytes;
  explicit wire_buffer(std::size_t b) : storage((b + 3) / 4 + 1, -1.0f), bytes(b) {}
  std::span<std::byte> span() { return std::as_writable_bytes(std::span(storage)).first(bytes); }
  std::span<const std::byte> cspan() const {
    return std::as_bytes(std::span(storage)).first(bytes);
  }
};

std::vector<float> random_vector(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(gen);
  return v;
}

}  // namespace

TEST_CASE("topk: encoded_bytes is the closed form") {
  constexpr C::config D{};  // 4096, 64, 2 bits: 4 + 64 * 2 + 16 bytes per chunk
  static_assert(D.chunk == 4096 && D.k == 64 && D.bits == 2 && D.beta == 0.95f);
  static_assert(C::encoded_bytes(D, 4096) == 4 + 128 + 16);
  static_assert(C::encoded_bytes(D, 3 * 4096) == 3 * 148);
  static_assert(C::encoded_bytes(D, 4096 + 10) == 148 + 4 + 10 * 2 + 3);  // partial: k = 10
  static_assert(C::encoded_bytes(D, 0) == 0);
  constexpr C::config Q3{.chunk = 100, .k = 7, .bits = 3};  // 21 bits per full chunk: 3 bytes
  static_assert(C::encoded_bytes(Q3, 250) == 3 * 4 + (7 + 7 + 7) * 2 + 3 + 3 + 3);
  constexpr C::config F{.chunk = 100, .k = 7, .bits = f32};
  static_assert(C::encoded_bytes(F, 250) == 21 * (4 + 2));
  constexpr C::config Big{.chunk = 70000, .k = 3, .bits = 2};  // uint32 indices beyond 65536
  static_assert(C::index_bytes(Big) == 4 && C::encoded_bytes(Big, 70000) == 4 + 12 + 1);
  static_assert(C::index_bytes(D) == 2 && C::index_bytes({.chunk = 65536}) == 2);
  CHECK(C(Q3, 250).encoded_bytes(250) == C::encoded_bytes(Q3, 250));
}

TEST_CASE("topk: settings it cannot run with are refused, saying what was expected") {
  using doctest::Contains;
  CHECK_THROWS_WITH_AS(C({.chunk = 0}, 10), Contains("topk: chunk must be in [1, 2^32], found 0"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(C({.chunk = 16, .k = 17}, 10),
                       Contains("topk: k must be in [1, chunk = 16], found 17"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(C({.k = 0}, 10), Contains("topk: k must be in [1, chunk = 4096], found 0"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(
      C({.bits = 9}, 10),
      Contains("topk: bits must be 1..8, or topk_unquantised (32: f32 values), found 9"),
      fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(C({.bits = 0}, 10), Contains("found 0"), fedshard::invalid_argument);
  CHECK_NOTHROW(C({.chunk = 16, .k = 16, .bits = 8}, 10));
}

TEST_CASE("topk: chunk 10, k 3, 4 bits end to end: wire bytes and values by hand") {
  // 23 elements: chunks of 10, 10 and 3 (k = min(3, 3) = 3 in each). Wire: 3 scales (12 B)
  // + 9 u16 indices (18 B) + per chunk ceil(3 * 4 / 8) = 2 bytes of codes (6 B) = 36 B.
  // 4 bits: L = 8 levels of s / 8. Chunk 0 {.., 8 at 2, -4 at 5, 1 at 9}: s = 8; 8 -> level
  // 8, -4 -> level 4 (-4), 1 -> level 1 (1). Chunk 1: 6 at 0, 3 at 4, -2 at 7 (s = 6):
  // 3 -> 3 / 6 * 8 + 1/2 = 4.5 -> level 4 (3), -2 -> 2.67 + 1/2 -> level 3 (-2.25).
  // Chunk 2 {0.5, 0.5, 0.5}: all sent as s = 0.5.
  std::vector<float> in(23, 0.0f);
  in[2] = 8.0f, in[5] = -4.0f, in[9] = 1.0f, in[1] = 0.5f;
  in[10] = 6.0f, in[14] = 3.0f, in[17] = -2.0f, in[11] = 0.25f;
  in[20] = in[21] = in[22] = 0.5f;
  C c({.beta = 1.0f, .chunk = 10, .k = 3, .bits = 4}, in.size());
  REQUIRE(c.encoded_bytes(in.size()) == 36);
  wire_buffer w(36);
  c.encode(in, w.span());
  std::vector<float> out(in.size(), 0.0f);
  c.decode_add(w.cspan(), out);
  std::vector<float> want(23, 0.0f);
  want[2] = 8.0f, want[5] = -4.0f, want[9] = 1.0f;
  want[10] = 6.0f, want[14] = 3.0f, want[17] = -2.25f;
  want[20] = want[21] = want[22] = 0.5f;
  CHECK(out == want);
  for (std::size_t i = 0; i < in.size(); ++i) CHECK(c.residual()[i] == in[i] - want[i]);
  const auto* scales = reinterpret_cast<const float*>(w.cspan().data());
  CHECK(std::vector<float>(scales, scales + 3) == std::vector<float>{8.0f, 6.0f, 0.5f});
  const auto* idx = reinterpret_cast<const std::uint16_t*>(w.cspan().data() + 12);
  CHECK(std::vector<int>(idx, idx + 9) == std::vector<int>{2, 5, 9, 0, 4, 7, 0, 1, 2});
}

TEST_CASE("topk: K = Chunk without quantisation sends everything exactly, residual 0") {
  const std::size_t n = 64 * 3 + 17;  // partial last chunk
  const std::vector<float> in = random_vector(n, 1);
  C c({.beta = 0.95f, .chunk = 64, .k = 64, .bits = f32}, n);
  wire_buffer w(c.encoded_bytes(n));
  c.encode(in, w.span());
  std::vector<float> out(n, 0.0f);
  c.decode_add(w.cspan(), out);
  for (std::size_t i = 0; i < n; ++i) {
    CAPTURE(i);
    CHECK(out[i] == in[i]);
    CHECK(c.residual()[i] == 0.0f);
  }
}

TEST_CASE("topk: the K largest |e| of each chunk are sent, ties to the lower index") {
  // Chunk 0: largest magnitudes 9 (i 5), -7 (i 1), then a tie of 4s at 2, 6 and -4 at 7.
  // Chunk 1 (partial, 5 elements): all equal: indices 0, 1, 2.
  const std::vector<float> in = {1, -7, 4, 0, 2, 9, 4, -4, 3, 3, 3, 3, 3};
  C c({.beta = 1.0f, .chunk = 8, .k = 3, .bits = f32}, in.size());
  wire_buffer w(c.encoded_bytes(in.size()));
  c.encode(in, w.span());
  std::vector<float> out(in.size(), 0.0f);
  c.decode_add(w.cspan(), out);
  const std::vector<float> want = {0, -7, 4, 0, 0, 9, 0, 0, 3, 3, 3, 0, 0};
  for (std::size_t i = 0; i < in.size(); ++i) {
    CAPTURE(i);
    CHECK(out[i] == want[i]);
    CHECK(c.residual()[i] == in[i] - want[i]);
  }
  // Indices on the wire: increasing within each chunk.
  const auto* idx = reinterpret_cast<const std::uint16_t*>(w.cspan().data() + 6 * 4);
  CHECK(std::vector<int>(idx, idx + 6) == std::vector<int>{1, 2, 5, 0, 1, 2});
}

TEST_CASE("topk: 2-bit values are +-s/2 or +-s of the chunk's largest |e|") {
  const std::vector<float> in = {0.1f, 8.0f, -0.2f, 3.0f, -6.0f, 0.0f, 0.3f, -1.0f,
                                 0.0f, 0.0f, 0.0f,  0.0f, 0.0f,  0.0f, 0.0f, 0.0f,  // all zero
                                 2.0f};                                             // partial
  C c({.beta = 1.0f, .chunk = 16, .k = 4, .bits = 2}, in.size());
  wire_buffer w(c.encoded_bytes(in.size()));
  c.encode(in, w.span());
  std::vector<float> out(in.size(), 0.0f);
  c.decode_add(w.cspan(), out);
  // Chunk 0 sends 8 (s), -6 (-> -8: 6/8*2 = 1.5 rounds up to level 2), 3 (-> 4), -1 (-> -4).
  const std::vector<float> want = {0, 8, 0, 4, -8, 0, 0, -4, 0, 0, 0, 0, 0, 0, 0, 0, 2};
  for (std::size_t i = 0; i < in.size(); ++i) {
    CAPTURE(i);
    CHECK(out[i] == want[i]);
    CHECK(c.residual()[i] == in[i] - want[i]);
  }
}

TEST_CASE("topk: error feedback conserves the input over steps") {
  // Per step e_t = beta e_{t-1} + delta_t - sent_t, so sum_t beta^(T-t) (delta_t - sent_t)
  // = e_T; with beta = 1: sum of inputs = sum of what was sent + the residual. Each step
  // rounds (beta e, + delta, - sent) a few times; the bound allows 4 roundings of the
  // largest magnitude met, per step.
  const std::size_t n = 64 * 5 + 30, steps = 40;
  const C::config settings[] = {{.chunk = 64, .k = 4, .bits = 2},
                                {.chunk = 100, .k = 9, .bits = 3},
                                {.chunk = 64, .k = 8, .bits = f32}};
  for (const auto& [cfg, beta] : std::vector<std::pair<C::config, float>>{{settings[0], 1.0f},
                                                                          {settings[0], 0.95f},
                                                                          {settings[0], 0.5f},
                                                                          {settings[1], 1.0f},
                                                                          {settings[1], 0.95f},
                                                                          {settings[1], 0.5f},
                                                                          {settings[2], 1.0f},
                                                                          {settings[2], 0.95f},
                                                                          {settings[2], 0.5f}}) {
    CAPTURE(beta);
    CAPTURE(cfg.k);
    C::config with_beta = cfg;
    with_beta.beta = beta;
    C c(with_beta, n);
    wire_buffer w(c.encoded_bytes(n));
    std::vector<double> inputs(n, 0.0), sent(n, 0.0);
    std::vector<float> out(n);
    double largest = 0.0;
    for (std::size_t t = 0; t < steps; ++t) {
      const std::vector<float> delta = random_vector(n, 100 + static_cast<unsigned>(t));
      c.encode(delta, w.span());
      std::fill(out.begin(), out.end(), 0.0f);
      c.decode_add(w.cspan(), out);
      for (std::size_t i = 0; i < n; ++i) {
        inputs[i] = beta * inputs[i] + delta[i];
        sent[i] = beta * sent[i] + out[i];
        largest = std::max({largest, std::fabs(inputs[i]), std::fabs(sent[i]),
                            std::fabs(static_cast<double>(c.residual()[i]))});
      }
    }
    const double tol = 4.0 * steps * largest * std::ldexp(1.0, -24);
    std::size_t failures = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const double err = std::fabs(sent[i] + c.residual()[i] - inputs[i]);
      if (err > tol && ++failures <= 4) {
        CAPTURE(i);
        CHECK(err <= tol);
      }
    }
    CHECK(failures == 0);
  }
}

TEST_CASE("topk: two runs give bit-identical wires and residuals; reset zeroes the residual") {
  const std::size_t n = 4096 * 2 + 1000;
  C a({}, n), b({}, n);
  wire_buffer wa(a.encoded_bytes(n)), wb(b.encoded_bytes(n));
  for (unsigned t = 0; t < 5; ++t) {
    const std::vector<float> delta = random_vector(n, 50 + t);
    a.encode(delta, wa.span());
    b.encode(delta, wb.span());
    CHECK(std::memcmp(wa.cspan().data(), wb.cspan().data(), wa.bytes) == 0);
  }
  CHECK(std::memcmp(a.residual().data(), b.residual().data(), n * sizeof(float)) == 0);
  a.reset();
  CHECK(std::all_of(a.residual().begin(), a.residual().end(), [](float x) { return x == 0; }));
}

TEST_CASE(
    "topk: beta is set at run time and checked; inputs and wires of the wrong size are "
    "refused") {
  C c({.beta = 0.5f, .chunk = 8, .k = 2, .bits = 2}, 10);
  CHECK(c.beta() == 0.5f);
  c.set_beta(0.9f);
  CHECK(c.beta() == 0.9f);
  CHECK_THROWS_AS(c.set_beta(1.5f), fedshard::invalid_argument);
  CHECK_THROWS_AS((C({.beta = -0.1f}, 10)), fedshard::invalid_argument);
  std::vector<float> in(9, 1.0f);
  wire_buffer w(c.encoded_bytes(10));
  CHECK_THROWS_AS(c.encode(in, w.span()), fedshard::invalid_argument);
  // A corrupt index is refused rather than written out of bounds.
  in.assign(10, 1.0f);
  c.encode(in, w.span());
  auto* idx = reinterpret_cast<std::uint16_t*>(w.span().data() + 2 * 4);
  idx[2] = 7;  // chunk 1 has 2 elements
  std::vector<float> out(10, 0.0f);
  CHECK_THROWS_AS(c.decode_add(w.cspan(), out), fedshard::invalid_argument);
}

namespace {

/// topk's encode as first written (a key per element, nth_element, then a sort of the
/// indices): the reference the faster selection must equal, wire and residual, bit for bit.
/// Index: the wire's index type for cfg.
template <class Index>
void reference_encode(const C::config& cfg, std::vector<float>& e, const std::vector<float>& delta,
                      std::span<std::byte> wire) {
  const std::size_t n = e.size(), K = cfg.k;
  const float beta = cfg.beta;
  for (std::size_t i = 0; i < n; ++i)
    e[i] = beta == 1.0f ? e[i] + delta[i] : beta * e[i] + delta[i];
  const bool quantised = cfg.bits != f32;
  const std::size_t floats = quantised ? C::chunks(cfg, n) : C::selected(cfg, n);
  const std::size_t at_indices = floats * sizeof(float);
  const std::size_t at_codes = at_indices + C::selected(cfg, n) * sizeof(Index);
  auto* scales_or_values = reinterpret_cast<float*>(wire.data());
  auto* indices = reinterpret_cast<Index*>(wire.data() + at_indices);
  auto* all_codes = reinterpret_cast<std::uint8_t*>(wire.data() + at_codes);
  if (quantised) std::memset(all_codes, 0, wire.size() - at_codes);
  for (std::size_t c = 0, base = 0; base < n; ++c, base += cfg.chunk) {
    const std::size_t m = std::min(cfg.chunk, n - base);
    const std::size_t k = std::min(K, m);
    float* ec = e.data() + base;
    std::vector<std::uint64_t> keys(m);
    for (std::size_t i = 0; i < m; ++i)
      keys[i] = (static_cast<std::uint64_t>(codec::detail::magnitude_bits(ec[i])) << 32) |
                (0xffffffffu - static_cast<std::uint32_t>(i));
    std::sort(keys.begin(), keys.end(), std::greater<>{});
    std::vector<Index> order(k);
    for (std::size_t j = 0; j < k; ++j)
      order[j] = static_cast<Index>(0xffffffffu - static_cast<std::uint32_t>(keys[j]));
    std::sort(order.begin(), order.end());
    std::memcpy(indices + c * K, order.data(), k * sizeof(Index));
    if (quantised) {
      float s = 0.0f;
      for (std::size_t j = 0; j < k; ++j) s = std::max(s, std::fabs(ec[order[j]]));
      scales_or_values[c] = s;
      std::uint8_t* codes = all_codes + c * C::code_bytes(cfg, K);
      const codec::detail::topk_quantiser q(cfg.bits);
      for (std::size_t j = 0; j < k; ++j) {
        float& v = ec[order[j]];
        const std::uint32_t code = q.encode(v, s);
        codec::detail::put_code(codes, j * cfg.bits, code, cfg.bits);
        v -= q.decode(code, s);
      }
    } else {
      for (std::size_t j = 0; j < k; ++j) {
        float& v = ec[order[j]];
        scales_or_values[c * K + j] = v;
        v -= v;
      }
    }
  }
}

/// Inputs for the comparison: step t mixes normal values, many exact ties (multiples of
/// 1/4), subnormals, zeros of both signs, and now and then an infinity or a NaN.
std::vector<float> mixed_input(std::size_t n, unsigned t) {
  std::mt19937 gen(1000 + t);
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t r = gen();
    switch ((i / 97 + t) % 5) {
      case 0: v[i] = static_cast<float>(static_cast<int>(r % 9) - 4) * 0.25f; break;
      case 1: v[i] = std::ldexp(static_cast<float>(static_cast<int>(r % 200) - 100), -140); break;
      case 2: v[i] = (r % 2) ? 0.0f : -0.0f; break;
      default: v[i] = std::ldexp(static_cast<float>(static_cast<int>(r % 2001) - 1000), -10); break;
    }
  }
  if (t == 3 && n > 50) {
    v[7] = std::numeric_limits<float>::infinity();
    v[n / 2] = -std::numeric_limits<float>::infinity();
  }
  if (t == 5 && n > 50) v[n - 3] = std::numeric_limits<float>::quiet_NaN();
  return v;
}

/// Encodes 7 steps of mixed_input with settings base (beta 1 and 0.9) on every instruction
/// set and requires reference_encode's wire and residual.
void check_selection_on_every_isa(const C::config& base) {
  namespace kernels = fedshard::kernels;
  const std::size_t n = 3 * base.chunk + base.chunk / 3 + 1;  // a partial last chunk
  for (const float beta : {1.0f, 0.9f}) {
    for (kernels::isa which : kernels::supported_isas()) {
      CAPTURE(std::string(kernels::to_string(which)));
      CAPTURE(beta);
      kernels::isa_limit_guard g(which);
      C::config cfg = base;
      cfg.beta = beta;
      C c(cfg, n);
      std::vector<float> e(n, 0.0f);
      wire_buffer got(c.encoded_bytes(n)), want(c.encoded_bytes(n));
      for (unsigned t = 0; t < 7; ++t) {
        CAPTURE(t);
        const std::vector<float> delta = mixed_input(n, t);
        c.encode(delta, got.span());
        if (C::index_bytes(cfg) == 2)
          reference_encode<std::uint16_t>(cfg, e, delta, want.span());
        else
          reference_encode<std::uint32_t>(cfg, e, delta, want.span());
        REQUIRE(std::memcmp(got.cspan().data(), want.cspan().data(), got.bytes) == 0);
        REQUIRE(std::memcmp(c.residual().data(), e.data(), n * sizeof(float)) == 0);
      }
    }
  }
}

}  // namespace

TEST_CASE("topk: the selection equals the sort of (|e|, index) on every instruction set") {
  for (const C::config base :
       {C::config{}, C::config{.chunk = 256, .k = 16, .bits = 4},
        C::config{.chunk = 100, .k = 7, .bits = 3}, C::config{.chunk = 64, .k = 8, .bits = f32},
        C::config{.chunk = 50, .k = 40, .bits = 8}, C::config{.chunk = 8, .k = 3, .bits = 1}}) {
    CAPTURE(base.chunk);
    CAPTURE(base.k);
    CAPTURE(base.bits);
    check_selection_on_every_isa(base);
  }
}
