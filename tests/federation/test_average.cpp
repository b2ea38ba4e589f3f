// average (FL+FSDP / FL+HSDP): the trainer's all_reduce does the averaging; the policy itself
// keeps no state and leaves the buffer unchanged before and after.
#include "fedshard/federation/average.hpp"

#include <doctest/doctest.h>

#include <cstring>
#include <limits>
#include <vector>

#include "fedshard/federation/sync_plan.hpp"

using namespace fedshard;
using fedshard::federation::average;

TEST_CASE("average models FederationPolicy, syncs the parameters only, without weights") {
  CHECK(federation::FederationPolicy<average>);
  CHECK(average::name == "average");
  CHECK(average::syncs);
  for (auto mode : {federation::sync_mode::hierarchical, federation::sync_mode::reference}) {
    average a({mode}, {16});
    CHECK(a.state().empty());  // nothing to checkpoint
    const federation::sync_context ctx{
        .shape = {2, 2, 1}, .coords = {0, 0, 0}, .numel = 32, .inner_state_buffers = 2};
    // the paper averages parameters only: no weights, no moments
    CHECK(a.sync_plan(ctx).ops == federation::parameter_average_ops(ctx, mode).ops);
  }
}

TEST_CASE("average sends the parameters themselves and keeps the mean as it arrives") {
  average a({federation::sync_mode::hierarchical}, {5, 3});
  const std::vector<float> original{0.25f, -1.0f, std::numeric_limits<float>::infinity(), -0.0f,
                                    std::numeric_limits<float>::denorm_min()};
  std::vector<float> buf = original;
  const federation::sync_info info{.fragment = 1, .groups = 8};
  a.reset(0, buf);
  a.begin(0, buf, info);
  CHECK(std::memcmp(buf.data(), original.data(), buf.size() * sizeof(float)) == 0);
  a.end(0, buf, info);
  CHECK(std::memcmp(buf.data(), original.data(), buf.size() * sizeof(float)) == 0);
}
