// mix64 is splitmix64: the published first outputs of a splitmix64 generator seeded with 0
// (state advancing by the golden-ratio constant, each output the finaliser of the state) are
// mix64(0), mix64(0x9e3779b97f4a7c15), ...
#include "fedshard/core/mix.hpp"

#include <doctest/doctest.h>

#include <cstdint>

TEST_CASE("mix64 gives splitmix64's outputs for seed 0") {
  CHECK(fedshard::mix64(0) == 0xe220a8397b1dcdafull);
  CHECK(fedshard::mix64(0x9e3779b97f4a7c15ull) == 0x6e789e6aa1b965f4ull);
  CHECK(fedshard::mix64(2 * 0x9e3779b97f4a7c15ull) == 0x06c45d188009454full);
  static_assert(fedshard::mix64(0) == 0xe220a8397b1dcdafull);  // usable at compile time
}
