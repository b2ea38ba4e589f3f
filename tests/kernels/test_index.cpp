// kernels/index.hpp: gather and scatter by index on the host, worked by hand, and the
// indices checked against the array they name.
#include "fedshard/kernels/index.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <span>
#include <vector>

#include "fedshard/error.hpp"

using namespace fedshard;

TEST_CASE("kernels::gather_index takes in[idx[j] - base] in idx's order") {
  const std::vector<float> in{1.5f, -2.0f, 3.25f, 0.0f, 7.0f};
  const std::vector<std::uint32_t> idx{4, 0, 2};
  std::vector<float> out(3, 99.0f);
  kernels::gather_index<float>(in, idx, 0, out);
  CHECK(out == std::vector<float>{7.0f, 1.5f, 3.25f});
  // the same elements named from base 10 (element i of in is index 10 + i)
  const std::vector<std::uint32_t> shifted{14, 10, 12};
  std::vector<float> again(3);
  kernels::gather_index<float>(in, shifted, 10, again);
  CHECK(again == out);
}

TEST_CASE("kernels::scatter_index writes in[j] at idx[j] - base and nothing else") {
  const std::vector<float> in{7.0f, 1.5f, 3.25f};
  const std::vector<std::uint32_t> idx{6, 2, 4};  // base 2: elements 4, 0, 2
  std::vector<float> out(5, -1.0f);
  kernels::scatter_index<float>(in, idx, 2, out);
  CHECK(out == std::vector<float>{1.5f, -1.0f, 3.25f, -1.0f, 7.0f});
}

TEST_CASE("kernels::gather_index and scatter_index refuse indices outside the array") {
  const std::vector<float> in{1, 2, 3};
  std::vector<float> out(2);
  const std::vector<std::uint32_t> past{0, 3}, below{4, 5}, three{0, 1, 2};
  CHECK_THROWS_AS(kernels::gather_index<float>(in, past, 0, out), invalid_argument);
  CHECK_THROWS_AS(kernels::gather_index<float>(in, below, 5, out), invalid_argument);
  CHECK_THROWS_WITH_AS(
      kernels::gather_index<float>(in, three, 0, out),
      doctest::Contains("expected as many indices as packed elements (2), found 3"),
      invalid_argument);
  std::vector<float> dst(3);
  CHECK_THROWS_AS(kernels::scatter_index<float>(std::span<const float>(in).first(2), past, 0, dst),
                  invalid_argument);
}
