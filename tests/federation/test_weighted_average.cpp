// weighted_average: each group scales its parameters by G w_g / W before the plain mean, so
// the mean is Σ w_g θ_g / W; a scale of exactly 1 leaves the buffer untouched, bit for bit.
#include "fedshard/federation/weighted_average.hpp"

#include <doctest/doctest.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "support/op_lists.hpp"
#include "support/policy_checks.hpp"

using namespace fedshard;
using federation::sync_info;
using federation::weighted_average;

namespace {
/// What a sync tells group `group` when the groups processed `tokens`.
sync_info info(const std::vector<double>& tokens, int group) {
  static thread_local std::vector<std::vector<double>> keep;  // the span must outlive the call
  keep.push_back(tokens);
  return {.fragment = 0,
          .groups = static_cast<int>(tokens.size()),
          .group = group,
          .group_tokens = keep.back()};
}
}  // namespace

TEST_CASE("weighted_average models FederationPolicy and exchanges the weights first") {
  test::check_federation_policy<weighted_average>("weighted_average", true);
  weighted_average w({}, {8});
  CHECK(w.state().empty());
  // G = 3 groups of R = 2 replicas x S = 2 shards; this rank is replica 1, shard 0 of group 1;
  // a fragment of 48 f32 = 192 B. At sync_prepare the 4 ranks of the group sum their token
  // counts (one f64: all_reduce of 8 B, each sends 2 (4 - 1) / 4 x 8 = 12 B), then the groups
  // gather their sums (3 x 8 = 24 B, each sends (3 - 1) / 3 x 24 = 16 B). Then the hierarchical
  // average: each replica all-reduces its half (24 f32 = 96 B) over the 3 groups, sending
  // 2 (3 - 1) / 3 x 96 = 128 B, and the 2 replicas all-gather the 192 B: (2 - 1) / 2 x 192 = 96.
  const federation::sync_context ctx{.shape = {3, 2, 2}, .coords = {1, 1, 0}, .numel = 48};
  const operand tokens{.role = role::tokens};
  const operand half{.role = role::fragment, .piece = axis::replica};
  const std::vector<comm_op> want{
      test::sync_op(comm_kind::all_reduce, axis::group, dtype::f64, 8, 4, reduce_op::sum,
                    trigger::sync_prepare, 0, tokens, tokens),
      test::sync_op(comm_kind::all_gather, axis::federation, dtype::f64, 24, 3, {},
                    trigger::sync_prepare, 0, tokens, {.role = role::group_tokens}),
      test::sync_op(comm_kind::all_reduce, axis::federation, dtype::f32, 96, 3, reduce_op::avg,
                    trigger::sync_exchange, 0, half, half),
      test::sync_op(comm_kind::all_gather, axis::replica, dtype::f32, 192, 2, {},
                    trigger::sync_finish, 0, half, {.role = role::fragment})};
  const plan p = w.sync_plan(ctx);
  CHECK(test::compare_ops(p.ops, want) == "");
  CHECK(p.wire_bytes_on(axis::group) == 12.0);
  CHECK(p.wire_bytes_on(axis::federation) == doctest::Approx(16.0 + 128.0));
  CHECK(p.wire_bytes_on(axis::replica) == 96.0);
}

TEST_CASE("begin scales the buffer by G w_g / W; end and reset change nothing") {
  weighted_average w({}, {4});
  std::vector<float> buf{1.0f, -2.0f, 0.75f, 3.0f};
  w.begin(0, buf, info({1, 3}, 0));  // 2 * 1 / 4
  CHECK(buf == std::vector<float>{0.5f, -1.0f, 0.375f, 1.5f});
  w.begin(0, buf, info({0, 4, 2}, 1));  // 3 * 4 / 6 = 2
  CHECK(buf == std::vector<float>{1.0f, -2.0f, 0.75f, 3.0f});
  w.begin(0, buf, info({0, 5}, 0));  // a group that processed nothing contributes nothing
  CHECK(buf == std::vector<float>{0.0f, -0.0f, 0.0f, 0.0f});

  std::vector<float> v{3.0f, 6.0f};
  w.begin(0, v, info({1, 1, 7}, 0));  // 3 * 1 / 9
  CHECK(v[0] == doctest::Approx(1.0).epsilon(1e-7));
  CHECK(v[1] == doctest::Approx(2.0).epsilon(1e-7));

  const std::vector<float> before = v;
  w.end(0, v, info({1, 1, 7}, 0));
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
  std::vector<double> equal{one * 5, one * 5};
  w.begin(0, buf, {.fragment = 0, .groups = 2, .group = 1, .group_tokens = equal});
  for (std::size_t i = 0; i < bits.size(); ++i) {
    CAPTURE(i);
    CHECK(std::bit_cast<std::uint32_t>(buf[i]) == bits[i]);
  }
}

TEST_CASE("scaled, then averaged: the token-weighted mean of the groups") {
  // 2 groups with 1 and 3 tokens: scales 2*1/4 = 0.5 and 2*3/4 = 1.5
  weighted_average w({}, {3});
  std::vector<float> g0{4.0f, 8.0f, -2.0f}, g1{8.0f, 0.0f, 2.0f};
  w.begin(0, g0, info({1, 3}, 0));
  w.begin(0, g1, info({1, 3}, 1));
  for (std::size_t i = 0; i < 3; ++i) {
    const float mean = (g0[i] + g1[i]) / 2.0f;  // what the AVG all_reduce computes
    const float theta0[] = {4.0f, 8.0f, -2.0f}, theta1[] = {8.0f, 0.0f, 2.0f};
    CHECK(mean == (1.0f * theta0[i] + 3.0f * theta1[i]) / 4.0f);
  }
}

TEST_CASE("weights that cannot be averaged are refused naming every group's") {
  weighted_average w({}, {2});
  std::vector<float> buf{1.0f, 2.0f};
  CHECK_THROWS_WITH_AS(
      w.begin(0, buf, info({0, 0}, 0)),
      doctest::Contains("must be >= 0 and not all zero, found group 0: 0, group 1: 0"),
      invalid_argument);
  CHECK_THROWS_WITH_AS(w.begin(0, buf, info({3, -1}, 1)), doctest::Contains("group 1: -1"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(w.begin(0, buf, {.fragment = 0, .groups = 2}),
                       doctest::Contains("expected the token counts of 2 groups, found 0"),
                       invalid_argument);
  CHECK(buf == std::vector<float>{1.0f, 2.0f});  // nothing changed
}

TEST_CASE("weighted_average: a sync that combines some groups renormalises over them") {
  // Groups 0 and 2 combine (group 1 is absent: its slot holds zero tokens); the average then
  // divides by 2, so the scales are 2 w_g / W over the two.
  const std::vector<double> tokens{10, 0, 30};
  const std::vector<std::uint8_t> included{1, 0, 1};
  sync_info info{
      .fragment = 0, .groups = 3, .group = 0, .group_tokens = tokens, .included = included};
  CHECK(info.included_count() == 2);
  CHECK(info.includes(2));
  CHECK_FALSE(info.includes(1));
  CHECK(federation::weighted_average::weight_scale(info) == doctest::Approx(0.5));
  info.group = 2;
  CHECK(federation::weighted_average::weight_scale(info) == doctest::Approx(1.5));
  // 0.5 * a + 1.5 * c, averaged over the 2, is the token-weighted mean (10 a + 30 c) / 40.
  info.included = {};
  CHECK(info.included_count() == 3);
  CHECK(federation::weighted_average::weight_scale(info) == doctest::Approx(3 * 30.0 / 40));
}
