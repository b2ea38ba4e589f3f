#pragma once
/// checksum64: a fast 64-bit checksum of a byte range, the one of checkpoints' chunks
/// (trainer/checkpoint.hpp) and of a heal's shared state (federation/heal.hpp).

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace fedshard {

/// The checksum of a byte range (a checkpoint's chunk, its table of contents): four independent
/// lanes each take a 64-bit little-endian word in turn (x ^= w; x *= golden ratio; x ^= x >> 29, a
/// bijection of x for each w, so one changed word always changes its lane), the last n % 32 bytes
/// go to lane 0 one by one, and the lanes are mixed together with the length. About 8x the speed of
/// byte-wise FNV-1a, which made a checksum of 100 MB a step's worth of time.
inline std::uint64_t checksum64(const void* data, std::size_t n) noexcept {
  constexpr std::uint64_t golden = 0x9e3779b97f4a7c15ull;
  auto mix = [](std::uint64_t x) {
    x *= golden;
    return x ^ (x >> 29);
  };
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t lane[4] = {0x243f6a8885a308d3ull, 0x13198a2e03707344ull, 0xa4093822299f31d0ull,
                           0x082efa98ec4e6c89ull};
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (std::size_t k = 0; k < 4; ++k) {
      std::uint64_t w = 0;
      std::memcpy(&w, p + i + 8 * k, 8);
      lane[k] = mix(lane[k] ^ w);
    }
  }
  for (; i < n; ++i) lane[0] = mix(lane[0] ^ p[i]);
  std::uint64_t h = mix(static_cast<std::uint64_t>(n));
  for (std::uint64_t x : lane) h = mix(h ^ x);
  return h;
}

}  // namespace fedshard
