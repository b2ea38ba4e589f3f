#pragma once
/// mix64: splitmix64's step and finaliser, a bijection of 64-bit words whose outputs look
/// independent for neighbouring inputs. Seeded shuffles (federation/participation.hpp) and
/// incarnation tokens (comm/elastic.hpp) draw from it; it is not a cryptographic hash.

#include <cstdint>

#include "fedshard/config.hpp"

namespace fedshard {

/// splitmix64 applied to x: the golden-ratio increment, then its finaliser.
/// Callable in device code (the zeroth-order directions, kernels/zeroth_order.hpp).
FEDSHARD_HOST_DEVICE constexpr std::uint64_t mix64(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace fedshard
