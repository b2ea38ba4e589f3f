// gossip's mixing functors: each operation rounded once, in the documented order, so the
// complete graph with α = 1/G gives the mean of the Δs exactly where the sums are exact.
#include "fedshard/kernels/gossip.hpp"

#include <doctest/doctest.h>

#include <cstring>
#include <vector>

namespace kernels = fedshard::kernels;

namespace {

/// The value rounded to a float and stored, so no later operation can fuse with it.
float rounded(float x) {
  const volatile float v = x;
  return v;
}

bool same_bits(float a, float b) {
  return std::memcmp(&a, &b, sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("laplacian_term_update adds fl(delta - peer) to the sum, rounded once each") {
  float acc = 0.1f;
  kernels::laplacian_term_update{}(acc, 1.0f / 3.0f, 1e-8f);
  CHECK(same_bits(acc, rounded(0.1f + rounded(1.0f / 3.0f - 1e-8f))));
}

TEST_CASE("laplacian_mix_update subtracts fl(alpha * sum), not a fused multiply-add") {
  float d = 1.0f / 3.0f;
  const float alpha = 0.3f, acc = 0.7f;
  kernels::laplacian_mix_update{alpha}(d, acc);
  CHECK(same_bits(d, rounded(1.0f / 3.0f - rounded(alpha * acc))));
}

TEST_CASE("over 4 groups with alpha 1/4, every group's d is the mean of the deltas") {
  const std::vector<float> delta{1.5f, -2.0f, 0.25f, 4.0f};
  const float mean = (1.5f - 2.0f + 0.25f + 4.0f) / 4.0f;
  for (std::size_t i = 0; i < delta.size(); ++i) {
    float acc = 0.0f;
    for (std::size_t j = 0; j < delta.size(); ++j)
      if (j != i) kernels::laplacian_term_update{}(acc, delta[i], delta[j]);
    float d = delta[i];
    kernels::laplacian_mix_update{0.25f}(d, acc);
    CHECK(d == mean);
  }
}
