#include "fedshard/kernels/dispatch.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fedshard/kernels/for_each.hpp"

namespace kernels = fedshard::kernels;
using kernels::isa;

TEST_CASE("parse_isa reads the three names and names them back in its error") {
  CHECK(kernels::parse_isa("portable") == isa::portable);
  CHECK(kernels::parse_isa("avx2") == isa::avx2);
  CHECK(kernels::parse_isa("avx512") == isa::avx512);
  CHECK_THROWS_WITH_AS(
      kernels::parse_isa("sse9"),
      "fedshard: unknown instruction set 'sse9', expected portable, avx2 or avx512",
      fedshard::invalid_argument);
}

TEST_CASE("supported_isas starts with portable and ends with the detected one") {
  const auto all = kernels::supported_isas();
  REQUIRE(!all.empty());
  CHECK(all.front() == isa::portable);
  CHECK(all.back() == kernels::detected_isa());
  MESSAGE("this machine: " << std::string(kernels::to_string(kernels::detected_isa())));
}

TEST_CASE("isa_limit_guard lowers the active instruction set and restores it") {
  const isa before = kernels::active_isa();
  {
    kernels::isa_limit_guard g(isa::portable);
    CHECK(kernels::active_isa() == isa::portable);
  }
  CHECK(kernels::active_isa() == before);
}

TEST_CASE("a loop with a * b + c gives the portable bits on every instruction set") {
  // Without fp-contract off the AVX2 loop would fuse x * a + y into one rounding.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  std::vector<float> x0(4099), y(4099);
  for (auto& v : x0) v = u(rng);
  for (auto& v : y) v = u(rng);
  auto f = [](float& x, float yi) { x = x * 1.37f + yi * yi; };
  std::vector<float> want = x0;
  kernels::for_each_element_on(isa::portable, f, want.size(), want.data(),
                               static_cast<const float*>(y.data()));
  for (isa i : kernels::supported_isas()) {
    CAPTURE(std::string(kernels::to_string(i)));
    std::vector<float> got = x0;
    kernels::for_each_element_on(i, f, got.size(), got.data(), static_cast<const float*>(y.data()));
    CHECK(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0);
  }
}
