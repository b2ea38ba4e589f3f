// average (FL+FSDP / FL+HSDP): the trainer's all_reduce does the averaging; the policy itself
// keeps no state and leaves the buffer unchanged before and after.
#include "fedshard/federation/average.hpp"

#include <doctest/doctest.h>

#include <cstring>
#include <limits>
#include <vector>

using namespace fedshard;
using fedshard::federation::average;

TEST_CASE("average models FederationPolicy, syncs, without weights or moments") {
  CHECK(federation::FederationPolicy<average>);
  CHECK(average::name == "average");
  CHECK(average::syncs);
  CHECK_FALSE(average::uses_weights);
  average a({}, {16});
  CHECK_FALSE(a.averages_inner_moments());  // the paper averages parameters only
  CHECK(a.state().empty());                 // nothing to checkpoint
}

TEST_CASE("average sends the parameters themselves and keeps the mean as it arrives") {
  average a({federation::sync_mode::hierarchical}, {5, 3});
  const std::vector<float> original{0.25f, -1.0f, std::numeric_limits<float>::infinity(), -0.0f,
                                    std::numeric_limits<float>::denorm_min()};
  std::vector<float> buf = original;
  // weights are not average's business: a scale other than 1 changes nothing
  const federation::sync_info info{1, 8, 0.5};
  a.reset(0, buf);
  a.begin(0, buf, info);
  CHECK(std::memcmp(buf.data(), original.data(), buf.size() * sizeof(float)) == 0);
  a.end(0, buf, info);
  CHECK(std::memcmp(buf.data(), original.data(), buf.size() * sizeof(float)) == 0);
}
