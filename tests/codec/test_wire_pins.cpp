/// Pins the bytes the host codecs and casts produce today: a hash of each wire (and of
/// what decode_add and the residual hold after it) on fixed inputs, so that a rewrite of a
/// loop (vectorisation, a different selection algorithm) cannot change a wire unnoticed.
/// The inputs come from a generator spelled out here (no std:: distribution, whose output
/// the standard leaves to the library), and every instruction set the machine supports
/// must give the pinned hash.

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "fedshard/codec/cast.hpp"
#include "fedshard/codec/int8_block.hpp"
#include "fedshard/codec/topk.hpp"
#include "fedshard/core/fp8.hpp"
#include "fedshard/kernels/cast.hpp"
#include "fedshard/kernels/dispatch.hpp"

namespace codec = fedshard::codec;
namespace kernels = fedshard::kernels;
using fedshard::bf16;
using fedshard::f16;
using fedshard::fp8_e4m3;

namespace {

/// FNV-1a, 64 bits, of a byte range.
std::uint64_t fnv1a(const void* data, std::size_t bytes, std::uint64_t h = 0xcbf29ce484222325ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

template <class T>
std::uint64_t fnv1a(const std::vector<T>& v, std::uint64_t h = 0xcbf29ce484222325ull) {
  return fnv1a(v.data(), v.size() * sizeof(T), h);
}

/// splitmix64: a fixed sequence of 64-bit values.
struct splitmix {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  /// Uniform in [-1, 1), a multiple of 2^-23.
  float unit() {
    return static_cast<float>(static_cast<std::int32_t>(next() >> 40) - (1 << 23)) * 0x1p-23f;
  }
};

/// n values over many magnitudes (a sum of uniforms scaled by 2^e, e in [lo, hi]); with
/// specials, every 37th element is one of NaN, infinities, signed zeros, subnormals, ties of
/// bf16/f16/fp8 and saturation edges.
std::vector<float> pin_inputs(std::size_t n, std::uint64_t seed, int lo, int hi, bool specials) {
  const float inf = std::numeric_limits<float>::infinity();
  const float table[] = {0.0f,
                         -0.0f,
                         inf,
                         -inf,
                         std::numeric_limits<float>::quiet_NaN(),
                         -std::numeric_limits<float>::quiet_NaN(),
                         std::numeric_limits<float>::denorm_min(),
                         -0x1.8p-130f,
                         1.0f + 0x1p-8f,   // bf16 tie to even (down)
                         1.0f + 0x3p-8f,   // bf16 tie to even (up)
                         1.0f + 0x1p-11f,  // f16 tie
                         0x1.8p-9f,        // fp8 subnormal tie
                         0x1p-10f,         // fp8: half the smallest subnormal
                         0x1.1p3f,         // fp8 normal tie
                         448.0f,
                         464.0f,
                         65504.0f,
                         65520.0f,
                         0x1.ffcp-15f,  // f16 subnormal boundary
                         0x1p-25f,      // f16: half the smallest subnormal
                         3.0e38f};
  splitmix g{seed};
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (specials && i % 37 == 5) {
      v[i] = table[g.next() % (sizeof(table) / sizeof(table[0]))];
      continue;
    }
    const float x = (g.unit() + g.unit() + g.unit() + g.unit()) * 0.5f;
    const int e = lo + static_cast<int>(g.next() % static_cast<std::uint64_t>(hi - lo + 1));
    v[i] = std::ldexp(x, e);
  }
  return v;
}

/// Values with many equal magnitudes (multiples of 1/4 in [-2, 2]), for topk's ties.
std::vector<float> tie_inputs(std::size_t n, std::uint64_t seed) {
  splitmix g{seed};
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<float>(static_cast<int>(g.next() % 17) - 8) * 0.25f;
  return v;
}

/// The wire of a stateless codec C on in, and after it what decode_add adds to `base`.
template <class C>
std::uint64_t stateless_hash(const std::vector<float>& in, typename C::config cfg = {}) {
  std::vector<std::byte> wire(C::encoded_bytes(cfg, in.size()));
  C c(cfg, in.size());
  c.encode(in, wire);
  std::vector<float> out(in.size());
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(i % 7) - 3.0f;
  c.decode_add(wire, out);
  return fnv1a(out, fnv1a(wire));
}

/// Steps of a topk codec on fixed inputs: the hash of every wire, the decoded sums and the
/// final residual.
std::uint64_t topk_hash(codec::topk::config cfg, std::size_t n, bool ties) {
  codec::topk c(cfg, n);
  std::vector<std::byte> wire(c.encoded_bytes(n));
  std::vector<float> out(n, 0.0f);
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::uint64_t t = 0; t < 4; ++t) {
    std::vector<float> delta =
        ties ? tie_inputs(n, 100 + t) : pin_inputs(n, 200 + t, -8, 4, /*specials=*/false);
    if (t == 2 && n > 10) {
      delta[3] = std::numeric_limits<float>::infinity();  // stays in the residual
      delta[n - 2] = -0.0f;
    }
    c.encode(delta, wire);
    h = fnv1a(wire, h);
    c.decode_add(wire, out);
  }
  h = fnv1a(out, h);
  return fnv1a(c.residual().data(), n * sizeof(float), h);
}

template <class From, class To>
std::uint64_t kernel_cast_hash(const std::vector<float>& values) {
  std::vector<From> in(values.size());
  if constexpr (std::is_same_v<From, float>)
    in = values;
  else
    kernels::cast(std::span<const float>(values), std::span<From>(in));
  std::vector<To> out(values.size());
  kernels::cast(std::span<const From>(in), std::span<To>(out));
  return fnv1a(out);
}

/// Runs check on every instruction set the machine supports.
template <class F>
void on_every_isa(F check) {
  for (kernels::isa i : kernels::supported_isas()) {
    CAPTURE(std::string(kernels::to_string(i)));
    kernels::isa_limit_guard g(i);
    check();
  }
}

}  // namespace

TEST_CASE("pinned: kernels::cast between f32 and bf16/f16") {
  const std::vector<float> in = pin_inputs(10007, 1, -30, 20, true);
  on_every_isa([&] {
    CHECK(kernel_cast_hash<float, bf16>(in) == 0x78f53386a544ba12ull);
    CHECK(kernel_cast_hash<float, f16>(in) == 0x15118fc54f242e3eull);
    CHECK(kernel_cast_hash<bf16, float>(in) == 0xb9ada72a229de85aull);
    CHECK(kernel_cast_hash<f16, float>(in) == 0xe0934ba2d81d2f4cull);
  });
}

TEST_CASE("pinned: codec::cast wires and decode_add") {
  const std::vector<float> in = pin_inputs(10007, 2, -14, 10, true);
  on_every_isa([&] {
    CHECK(stateless_hash<codec::cast<float>>(in) == 0x386c41e4df9aee37ull);
    CHECK(stateless_hash<codec::cast<bf16>>(in) == 0x930511185cc797f8ull);
    CHECK(stateless_hash<codec::cast<f16>>(in) == 0x55c24f43601ebbb8ull);
    CHECK(stateless_hash<codec::cast<fp8_e4m3>>(in) == 0x140e5d628a2ab28full);
  });
}

TEST_CASE("pinned: int8_block wires and decode_add") {
  std::vector<float> in = pin_inputs(10007, 3, -20, 10, false);
  for (std::size_t i = 600; i < 900; ++i) in[i] = 0.0f;  // a block of zeros
  on_every_isa([&] {
    CHECK(stateless_hash<codec::int8_block>(in, {.block = 256}) == 0x71d77d8990f102d8ull);
    CHECK(stateless_hash<codec::int8_block>(in, {.block = 100}) == 0x8297cbf8a773ba50ull);
    CHECK(stateless_hash<codec::int8_block>(in, {.block = 7}) == 0xca5c1d56100e2407ull);
  });
}

TEST_CASE("pinned: topk wires, decoded sums and residuals over steps") {
  on_every_isa([&] {
    CHECK(topk_hash({.beta = 0.95f}, 4096 * 3 + 1000, false) == 0x70978ea0689f4e48ull);
    CHECK(topk_hash({.beta = 1.0f}, 4096 * 2 + 77, true) == 0xf151af42346888daull);
    CHECK(topk_hash({.beta = 0.9f, .chunk = 1024, .k = 32, .bits = 4}, 1024 * 5 + 3, true) ==
          0xb1c4b4a05f712e84ull);
    CHECK(topk_hash({.beta = 0.5f, .chunk = 100, .k = 7, .bits = 3}, 1234, false) ==
          0x7625254a97fffb70ull);
    CHECK(topk_hash({.beta = 1.0f, .chunk = 64, .k = 8, .bits = codec::topk_unquantised},
                    64 * 9 + 30, true) == 0xd7b2c75507d45765ull);
    CHECK(topk_hash({.beta = 0.95f, .chunk = 4096, .k = 64, .bits = 8}, 4096 * 2, false) ==
          0x4b03973c9e94edc0ull);
    CHECK(topk_hash({.beta = 0.95f, .chunk = 4096, .k = 4096, .bits = 2}, 4096 + 5, false) ==
          0x75686c7234ee3db3ull);
    CHECK(topk_hash({.beta = 0.95f, .chunk = 70000, .k = 3, .bits = 2}, 70001, true) ==
          0x72dbca221b7be2c2ull);
  });
}
