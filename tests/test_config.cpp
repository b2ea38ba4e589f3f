#include "fedshard/config.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <string_view>

#define FEDSHARD_TEST_STR2(...) #__VA_ARGS__
#define FEDSHARD_TEST_STR(...) FEDSHARD_TEST_STR2(__VA_ARGS__)

#if FEDSHARD_HAS_MPI != 0 && FEDSHARD_HAS_MPI != 1
#error "FEDSHARD_HAS_MPI must be 0 or 1"
#endif
#if FEDSHARD_HAS_CUDA != 0 && FEDSHARD_HAS_CUDA != 1
#error "FEDSHARD_HAS_CUDA must be 0 or 1"
#endif
#if FEDSHARD_HAS_NCCL != 0 && FEDSHARD_HAS_NCCL != 1
#error "FEDSHARD_HAS_NCCL must be 0 or 1"
#endif

namespace {
FEDSHARD_HOST_DEVICE constexpr int twice(int x) {
  return 2 * x;
}
}  // namespace

static_assert(twice(21) == 42);

TEST_CASE("cache_line_bytes is 64, a power of two") {
  static_assert(std::is_same_v<decltype(fedshard::cache_line_bytes), const std::size_t>);
  CHECK(fedshard::cache_line_bytes == 64);
  CHECK((fedshard::cache_line_bytes & (fedshard::cache_line_bytes - 1)) == 0);
}

TEST_CASE("FEDSHARD_HOST_DEVICE is empty in host compilation") {
  CHECK(std::string_view(FEDSHARD_TEST_STR(FEDSHARD_HOST_DEVICE)).empty());
}
