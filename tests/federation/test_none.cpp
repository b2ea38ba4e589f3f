// none: the policy of algorithms without federation; it never communicates or changes a value.
#include "fedshard/federation/none.hpp"

#include <doctest/doctest.h>

#include <cstring>
#include <limits>
#include <vector>

#include "support/policy_checks.hpp"

using namespace fedshard;
using fedshard::federation::none;

TEST_CASE("none models FederationPolicy and never syncs") {
  test::check_federation_policy<none>("none", false);
  none n({}, {16, 32});
  CHECK(n.sync_plan({.shape = {4, 2, 1}, .numel = 32}).ops.empty());  // nothing moves
  CHECK(n.state().empty());
  CHECK(none{}.state().empty());
}

TEST_CASE("none leaves every buffer as it was, bit for bit") {
  none n({federation::sync_mode::reference}, {6});
  const std::vector<float> original{1.5f,
                                    -0.0f,
                                    std::numeric_limits<float>::quiet_NaN(),
                                    std::numeric_limits<float>::denorm_min(),
                                    3e38f,
                                    -7.25f};
  std::vector<float> buf = original;
  const federation::sync_info info{.fragment = 0, .groups = 4};
  n.reset(0, buf);
  n.begin(0, buf, info);
  n.end(0, buf, info);
  n.begin(3, buf, info);  // no per-fragment state to go out of range
  CHECK(std::memcmp(buf.data(), original.data(), buf.size() * sizeof(float)) == 0);
}
