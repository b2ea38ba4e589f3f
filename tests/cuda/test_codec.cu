#include "fedshard/cuda/codec.cuh"

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "fedshard/codec/cast.hpp"
#include "fedshard/codec/int8_block.hpp"
#include "fedshard/codec/topk.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/fp8.hpp"
#include "fedshard/cuda/device_buffer.cuh"
#include "fedshard/cuda/error.cuh"
#include "fedshard/error.hpp"

// Helpers live in a named namespace and the test cases at global scope (nvcc's host stubs
// fail on kernels instantiated inside nested anonymous namespaces).
namespace test_codec_cu {

namespace gpu = fedshard::gpu;
namespace codec = fedshard::codec;

/// Sizes with a short last block or chunk, one element, and exact multiples.
constexpr std::size_t sizes[] = {1, 7, 64, 255, 256, 257, 1000, 4096, 4096 + 10, 3 * 4096 + 100};

/// n values in regions of 64 elements: (0) edge values: zeros of both signs, subnormals,
/// ties of every magnitude (+-1, +-0.5), halfway points of bf16, large magnitudes (beyond
/// fp8's 448 and f16's 65504, up to 1e30); (1) normal values; (2) int8 ties: half-integers
/// in [-127, 127] after a 127 (a scale of exactly 1); (3) zeros.
std::vector<float> edge_input(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 13);
  std::uniform_int_distribution<int> half(-127, 126);
  const float denorm = std::numeric_limits<float>::denorm_min();
  std::vector<float> x(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float sign = (rng() & 1) != 0 ? -1.0f : 1.0f;
    switch ((i / 64) % 4) {
      case 0:
        switch (pick(rng)) {
          case 0: x[i] = 0.0f; break;
          case 1: x[i] = -0.0f; break;
          case 2: x[i] = sign * denorm * static_cast<float>(1 + rng() % 1000); break;
          case 3: x[i] = 1e-39f * normal(rng); break;
          case 4: x[i] = sign * 1.0f; break;
          case 5: x[i] = sign * 0.5f; break;
          case 6: x[i] = sign * (1.0f + 0x1p-8f); break;  // halfway between two bf16
          case 7: x[i] = 1e6f * normal(rng); break;
          case 8: x[i] = 1e30f * normal(rng); break;
          case 9: x[i] = sign * 500.0f; break;
          case 10: x[i] = sign * 70000.0f; break;
          case 11: x[i] = sign * 448.0f; break;
          default: x[i] = normal(rng); break;
        }
        break;
      case 1: x[i] = normal(rng); break;
      case 2: x[i] = i % 64 == 0 ? 127.0f : static_cast<float>(half(rng)) + 0.5f; break;
      default: x[i] = 0.0f; break;
    }
  }
  return x;
}

/// Finite values to add into (decode_add rounds on every add).
std::vector<float> start_values(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng);
  return x;
}

std::uint32_t bits_of(float x) {
  std::uint32_t u = 0;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

/// The same bits, element by element; names the first difference.
void require_same_bits(const std::vector<float>& got, const std::vector<float>& want,
                       const char* what) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    if (bits_of(got[i]) != bits_of(want[i]))
      FAIL(what << ": element " << i << " of " << got.size() << " is " << got[i] << " (0x"
                << std::hex << bits_of(got[i]) << "), the host codec gives " << want[i] << " (0x"
                << bits_of(want[i]) << ")");
}

/// The same bytes; names the first difference.
void require_same_bytes(const std::vector<std::byte>& got, const std::vector<std::byte>& want,
                        const char* what) {
  REQUIRE(got.size() == want.size());
  if (got.empty() || std::memcmp(got.data(), want.data(), got.size()) == 0) return;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i])
      FAIL(what << ": byte " << i << " of " << got.size() << " is 0x" << std::hex
                << static_cast<int>(got[i]) << ", the host codec's is 0x"
                << static_cast<int>(want[i]));
}

/// A device wire of `bytes` bytes filled with 0xab (every byte must be written by encode).
gpu::device_buffer<std::byte> poisoned_wire(std::size_t bytes) {
  auto w = gpu::device_buffer<std::byte>::uninitialized(bytes);
  if (bytes != 0) {
    FEDSHARD_CUDA_TRY(cudaMemset(w.data(), 0xab, bytes));
    FEDSHARD_CUDA_TRY(cudaDeviceSynchronize());  // before kernels on non-blocking streams
  }
  return w;
}

/// Encodes `rounds` inputs with C on the host and on the device: equal wires and (stateful)
/// residuals after each; then each side decode_adds the other's last wire into the same
/// start values: equal results.
template <class C>
void check_codec(std::size_t n, typename C::config cfg = {}, int rounds = 1) {
  CAPTURE(n);
  C host(cfg, n);
  gpu::device_codec<C> device(cfg, n);
  const std::size_t bytes = C::encoded_bytes(cfg, n);
  REQUIRE(device.encoded_bytes(n) == bytes);
  std::vector<std::byte> host_wire(bytes);
  auto device_wire = poisoned_wire(bytes);
  for (int round = 0; round < rounds; ++round) {
    CAPTURE(round);
    const std::vector<float> in = edge_input(n, 1000 * n + static_cast<std::uint64_t>(round));
    host.encode(in, host_wire);
    const auto device_in = gpu::device_buffer<float>::from_host(in);
    device.encode(nullptr, device_in.data(), device_wire.data());
    FEDSHARD_CUDA_TRY(cudaDeviceSynchronize());
    require_same_bytes(device_wire.to_host(), host_wire, "wire");
    if constexpr (C::stateful) {
      std::vector<float> device_residual(n);
      FEDSHARD_CUDA_TRY(cudaMemcpy(device_residual.data(), device.residual().data(),
                                   n * sizeof(float), cudaMemcpyDeviceToHost));
      const auto r = host.residual();
      require_same_bits(device_residual, std::vector<float>(r.begin(), r.end()), "residual");
    }
  }
  // decode_add: the host's wire on the device, against the host.
  const std::vector<float> start = start_values(n, n + 7);
  std::vector<float> host_out = start;
  host.decode_add(host_wire, host_out);
  auto device_out = gpu::device_buffer<float>::from_host(start);
  const auto host_wire_on_device = gpu::device_buffer<std::byte>::from_host(host_wire);
  device.decode_add(nullptr, host_wire_on_device.data(), device_out.data());
  FEDSHARD_CUDA_TRY(cudaDeviceSynchronize());
  require_same_bits(device_out.to_host(), host_out, "decode_add");
}

template <class C>
void check_all_sizes(typename C::config cfg = {}, int rounds = 1) {
  for (std::size_t n : sizes) check_codec<C>(n, cfg, rounds);
}

}  // namespace test_codec_cu

using namespace test_codec_cu;

TEST_SUITE("no_device") {
  TEST_CASE("gpu::device_codec: argument checks before any device work") {
    using fedshard::invalid_argument;
    gpu::device_codec<codec::cast<fedshard::bf16>> c({}, 10);
    auto* misaligned = reinterpret_cast<std::byte*>(std::uintptr_t{0x1002});
    auto* in = reinterpret_cast<const float*>(std::uintptr_t{0x2000});
    CHECK_THROWS_AS(c.encode(nullptr, in, misaligned), invalid_argument);
    CHECK_THROWS_AS(
        c.encode(nullptr, nullptr, reinterpret_cast<std::byte*>(std::uintptr_t{0x4000})),
        invalid_argument);
    gpu::device_codec<codec::int8_block> q({}, 10);
    CHECK_THROWS_AS(q.decode_add(nullptr, misaligned, reinterpret_cast<float*>(0x2000)),
                    invalid_argument);
    using topk = codec::topk;
    CHECK_THROWS_AS(gpu::device_codec<topk>(topk::config{.beta = 1.5f}, 10), invalid_argument);
    CHECK_THROWS_WITH_AS(gpu::device_codec<topk>(topk::config{.chunk = 8, .k = 9}, 10),
                         doctest::Contains("topk: k must be in [1, chunk = 8], found 9"),
                         invalid_argument);
    CHECK_THROWS_WITH_AS(gpu::device_codec<codec::int8_block>({.block = 0}, 10),
                         doctest::Contains("block (elements per scale) must be > 0"),
                         invalid_argument);
    // 65536 x 3 bits of codes per chunk: 24 KiB, over the 16 KiB of shared memory allowed.
    CHECK_THROWS_WITH_AS(
        gpu::device_codec<topk>(topk::config{.chunk = 65536, .k = 65536, .bits = 3}, 10),
        doctest::Contains("k * bits must be at most 131072 bits"), invalid_argument);
    CHECK(gpu::device_codec<topk>({}, 0).encoded_bytes(5000) == topk::encoded_bytes({}, 5000));
    static_assert(gpu::device_codec<topk>::stateful &&
                  !gpu::device_codec<codec::cast<float>>::stateful);
  }
}

TEST_CASE("gpu::device_codec<cast<T>>: the host's wire bytes and decoded values") {
  SUBCASE("f32") {
    check_all_sizes<codec::cast<float>>();
  }
  SUBCASE("bf16") {
    check_all_sizes<codec::cast<fedshard::bf16>>();
  }
  SUBCASE("f16") {
    check_all_sizes<codec::cast<fedshard::f16>>();
  }
  SUBCASE("fp8_e4m3") {
    check_all_sizes<codec::cast<fedshard::fp8_e4m3>>();
  }
}

TEST_CASE("gpu::device_codec<int8_block>: the host's scales, codes and decoded values") {
  SUBCASE("Block 256") {
    check_all_sizes<codec::int8_block>({.block = 256});
  }
  SUBCASE("Block 64 (scale 1: ties to even)") {
    check_all_sizes<codec::int8_block>({.block = 64});
  }
  SUBCASE("Block 100") {
    check_all_sizes<codec::int8_block>({.block = 100});
  }
}

TEST_CASE("gpu::device_codec<topk>: the host's wires and residuals over 3 encodes") {
  SUBCASE("4096, 64, 2 bits, beta 0.95") {
    check_all_sizes<codec::topk>({.beta = 0.95f, .chunk = 4096, .k = 64, .bits = 2}, 3);
  }
  SUBCASE("4096, 64, 2 bits, beta 1") {
    check_all_sizes<codec::topk>({.beta = 1.0f, .chunk = 4096, .k = 64, .bits = 2}, 3);
  }
  SUBCASE("128, 17, 3 bits (codes across bytes and words)") {
    check_all_sizes<codec::topk>({.beta = 0.9f, .chunk = 128, .k = 17, .bits = 3}, 3);
  }
  SUBCASE("1000, 300, 8 bits") {
    check_all_sizes<codec::topk>({.beta = 0.5f, .chunk = 1000, .k = 300, .bits = 8}, 3);
  }
  SUBCASE("256, 256, 1 bit (K = Chunk)") {
    check_all_sizes<codec::topk>({.beta = 0.95f, .chunk = 256, .k = 256, .bits = 1}, 3);
  }
  SUBCASE("4096, 64, f32 values") {
    check_all_sizes<codec::topk>(
        {.beta = 0.95f, .chunk = 4096, .k = 64, .bits = codec::topk_unquantised}, 3);
  }
  SUBCASE("ties: every |e| equal, the lower indices win") {
    using topk = codec::topk;
    constexpr topk::config cfg{.beta = 1.0f, .chunk = 512, .k = 40, .bits = 2};
    const std::size_t n = 1300;
    std::vector<float> in(n);
    for (std::size_t i = 0; i < n; ++i) in[i] = (i * 7) % 3 == 0 ? -2.0f : 2.0f;
    topk host(cfg, n);
    gpu::device_codec<topk> device(cfg, n);
    std::vector<std::byte> host_wire(topk::encoded_bytes(cfg, n));
    auto device_wire = poisoned_wire(host_wire.size());
    const auto device_in = gpu::device_buffer<float>::from_host(in);
    for (int round = 0; round < 3; ++round) {
      host.encode(in, host_wire);
      device.encode(nullptr, device_in.data(), device_wire.data());
      FEDSHARD_CUDA_TRY(cudaDeviceSynchronize());
      require_same_bytes(device_wire.to_host(), host_wire, "wire");
    }
    device.reset(nullptr);
    host.reset();
    host.encode(in, host_wire);
    device.encode(nullptr, device_in.data(), device_wire.data());
    FEDSHARD_CUDA_TRY(cudaDeviceSynchronize());
    require_same_bytes(device_wire.to_host(), host_wire, "wire after reset");
  }
}
