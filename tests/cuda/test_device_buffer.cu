#include "fedshard/cuda/device_buffer.cuh"

#include <doctest/doctest.h>

#include <cstddef>
#include <limits>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

#include "fedshard/core/dtype.hpp"
#include "fedshard/cuda/stream.cuh"
#include "fedshard/error.hpp"

namespace {

namespace gpu = fedshard::gpu;

TEST_SUITE("no_device") {
  TEST_CASE("empty buffers need no device; sizes are checked before any CUDA call") {
    gpu::device_buffer<float> empty;
    CHECK(empty.empty());
    CHECK(empty.data() == nullptr);
    gpu::device_buffer<float> zero(0);
    CHECK(zero.size() == 0);
    CHECK(zero.to_host().empty());
    const std::vector<float> three(3, 1.0f);
    CHECK_THROWS_WITH_AS(zero.copy_from_host(three), doctest::Contains("holds 0 elements"),
                         fedshard::invalid_argument);
    CHECK_THROWS_WITH_AS(gpu::device_buffer<double>(std::numeric_limits<std::size_t>::max() / 4),
                         doctest::Contains("overflow"), fedshard::invalid_argument);
  }
}

TEST_CASE("a new buffer is zero; host copies round-trip") {
  gpu::device_buffer<float> b(1000);
  CHECK(b.size() == 1000);
  CHECK(b.size_bytes() == 4000);
  for (float x : b.to_host()) REQUIRE(x == 0.0f);
  std::vector<float> host(1000);
  std::iota(host.begin(), host.end(), 1.0f);
  b.copy_from_host(host);
  CHECK(b.to_host() == host);
  const auto c = gpu::device_buffer<float>::from_host(host);
  CHECK(c.to_host() == host);
  CHECK(c.data() != b.data());
}

TEST_CASE("moves transfer ownership; the source is left empty") {
  auto a = gpu::device_buffer<int>::from_host(std::vector<int>{1, 2, 3});
  const int* p = a.data();
  gpu::device_buffer<int> b(std::move(a));
  CHECK(a.empty());
  CHECK(a.data() == nullptr);
  CHECK(b.data() == p);
  gpu::device_buffer<int> c(5);
  c = std::move(b);
  CHECK(b.empty());
  CHECK(c.data() == p);
  CHECK(c.to_host() == std::vector<int>{1, 2, 3});
  c.reset();
  CHECK(c.empty());
}

TEST_CASE("stream-ordered buffers are zero once the stream got there") {
  gpu::stream s;
  gpu::device_buffer<double> b(4097, s);
  s.synchronize();
  for (double x : b.to_host()) REQUIRE(x == 0.0);
}

TEST_CASE("views carry the device pointer, count and dtype") {
  gpu::device_buffer<fedshard::bf16> b(7);
  const fedshard::buffer_view v = b.view();
  CHECK(v.data == b.data());
  CHECK(v.count == 7);
  CHECK(v.type == fedshard::dtype::bf16);
  CHECK(b.cview().type == fedshard::dtype::bf16);
  CHECK(b.span().size() == 7);
}

}  // namespace
