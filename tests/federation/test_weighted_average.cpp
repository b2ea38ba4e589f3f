// weighted_average: each group scales its parameters by G w_g / W before the plain mean, so
// the mean is Σ w_g θ_g / W; a scale of exactly 1 leaves the buffer untouched, bit for bit.
#include "fedshard/federation/weighted_average.hpp"

#include <doctest/doctest.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

using namespace fedshard;
using federation::sync_info;
using federation::weighted_average;

TEST_CASE("weighted_average models FederationPolicy and asks for weights") {
  CHECK(federation::FederationPolicy<weighted_average>);
  CHECK(weighted_average::name == "weighted_average");
  CHECK(weighted_average::syncs);
  CHECK(weighted_average::uses_weights);
  weighted_average w({}, {8});
  CHECK_FALSE(w.averages_inner_moments());
  CHECK(w.state().empty());
}

TEST_CASE("begin scales the buffer by weight_scale; end and reset change nothing") {
  weighted_average w({}, {4});
  std::vector<float> buf{1.0f, -2.0f, 0.75f, 3.0f};
  w.begin(0, buf, {0, 2, 0.5});
  CHECK(buf == std::vector<float>{0.5f, -1.0f, 0.375f, 1.5f});
  w.begin(0, buf, {0, 2, 4.0});
  CHECK(buf == std::vector<float>{2.0f, -4.0f, 1.5f, 6.0f});
  w.begin(0, buf, {0, 2, 0.0});  // a group that processed nothing contributes nothing
  CHECK(buf == std::vector<float>{0.0f, -0.0f, 0.0f, 0.0f});

  std::vector<float> v{3.0f, 6.0f};
  w.begin(0, v, {0, 3, 1.0 / 3.0});
  CHECK(v[0] == doctest::Approx(1.0).epsilon(1e-7));
  CHECK(v[1] == doctest::Approx(2.0).epsilon(1e-7));

  const std::vector<float> before = v;
  w.end(0, v, {0, 3, 1.0 / 3.0});
  w.reset(0, v);
  CHECK(v == before);
}

TEST_CASE("a scale of exactly 1 leaves the buffer untouched, bit for bit") {
  weighted_average w({}, {5});
  // a signalling NaN would come back quiet from any multiplication, even by 1
  const std::vector<std::uint32_t> bits{0x7f800001u, 0x80000000u, 0x00000001u, 0x3f800001u,
                                        0xffc00123u};
  std::vector<float> buf;
  for (std::uint32_t b : bits) buf.push_back(std::bit_cast<float>(b));
  volatile double one = 1.0;  // a runtime value: no constant folding of x * 1
  w.begin(0, buf, {0, 2, one});
  for (std::size_t i = 0; i < bits.size(); ++i) {
    CAPTURE(i);
    CHECK(std::bit_cast<std::uint32_t>(buf[i]) == bits[i]);
  }
}

TEST_CASE("scaled, then averaged: the token-weighted mean of the groups") {
  // 2 groups with 1 and 3 tokens: scales 2*1/4 = 0.5 and 2*3/4 = 1.5
  weighted_average w({}, {3});
  std::vector<float> g0{4.0f, 8.0f, -2.0f}, g1{8.0f, 0.0f, 2.0f};
  w.begin(0, g0, {0, 2, 0.5});
  w.begin(0, g1, {0, 2, 1.5});
  for (std::size_t i = 0; i < 3; ++i) {
    const float mean = (g0[i] + g1[i]) / 2.0f;  // what the AVG all_reduce computes
    const float theta0[] = {4.0f, 8.0f, -2.0f}, theta1[] = {8.0f, 0.0f, 2.0f};
    CHECK(mean == (1.0f * theta0[i] + 3.0f * theta1[i]) / 4.0f);
  }
}
