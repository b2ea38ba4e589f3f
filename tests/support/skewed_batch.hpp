#pragma once
// The skewed batch of the context-parallel tests (bench/bench_context.cpp draws the same):
// 60 short sequences in [128, 2048] tokens and 4 long ones in [16384, 65536] (at positions
// 7, 23, 41, 58), from a splitmix64 stream seeded with 2602.

#include <cstdint>
#include <vector>

#include "fedshard/core/mix.hpp"

namespace fedshard::test {

inline std::vector<std::int64_t> skewed_batch() {
  std::uint64_t state = 2602;
  auto next = [&] {
    const std::uint64_t z = mix64(state);
    state += 0x9e3779b97f4a7c15ULL;
    return z;
  };
  std::vector<std::int64_t> l;
  for (int i = 0; i < 64; ++i) {
    const bool long_one = i == 7 || i == 23 || i == 41 || i == 58;
    l.push_back(long_one ? 16384 + static_cast<std::int64_t>(next() % 49153)
                         : 128 + static_cast<std::int64_t>(next() % 1921));
  }
  return l;
}

}  // namespace fedshard::test
