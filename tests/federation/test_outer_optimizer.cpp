// outer_optimizer<Rule>: anchors per fragment, pseudo-gradients in begin, the rule's step in
// end, named state for checkpoints, and checks on fragment indices and sizes.
#include "fedshard/federation/outer_optimizer.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "fedshard/federation/outer_rules.hpp"
#include "support/op_lists.hpp"

using namespace fedshard;
using namespace fedshard::federation;

namespace {

std::vector<float> to_vec(std::span<const float> s) {
  return {s.begin(), s.end()};
}

}  // namespace

TEST_CASE("outer_optimizer: names, flags and default config") {
  CHECK(FederationPolicy<outer_optimizer<outer_sgd>>);
  CHECK(outer_optimizer<outer_sgd>::name == "outer_sgd");
  CHECK(outer_optimizer<nesterov>::name == "nesterov");
  CHECK(outer_optimizer<fedadam>::name == "fedadam");
  CHECK(outer_optimizer<nesterov>::syncs);
  const outer_optimizer<nesterov>::config c{};
  CHECK(c.sync == sync_mode::hierarchical);
  CHECK_FALSE(c.average_inner_moments);
  CHECK(c.rule.lr == 0.7f);  // the rule's own defaults (DiLoCo)
  CHECK(c.rule.momentum == 0.9f);
}

TEST_CASE("anchors start at zero; reset sets them; begin gives anchor - θ") {
  outer_optimizer<outer_sgd> o({}, {3, 2});
  CHECK(to_vec(o.anchor(0)) == std::vector<float>{0, 0, 0});
  CHECK(to_vec(o.anchor(1)) == std::vector<float>{0, 0});
  const std::vector<float> p0{1.0f, 2.0f, 3.0f}, p1{-1.0f, 0.5f};
  o.reset(0, p0);
  o.reset(1, p1);
  CHECK(to_vec(o.anchor(0)) == p0);
  CHECK(to_vec(o.anchor(1)) == p1);
  std::vector<float> buf{0.5f, 2.5f, 3.0f};
  o.begin(0, buf, {});
  CHECK(buf == std::vector<float>{0.5f, -0.5f, 0.0f});
  CHECK(to_vec(o.anchor(0)) == p0);  // begin does not move the anchor
  CHECK(to_vec(o.anchor(1)) == p1);  // nor another fragment's
}

TEST_CASE("outer_sgd: end moves the anchor by -lr * mean Δ and returns it") {
  SUBCASE("lr 1 is plain averaging") {
    outer_optimizer<outer_sgd> o({}, {2});
    o.reset(0, std::vector<float>{1.0f, 1.0f});
    // two groups trained to θ0 and θ1; Δ_g = anchor - θ_g; the all_reduce averages them
    std::vector<float> d0{3.0f, -1.0f}, d1{5.0f, 2.0f};
    o.begin(0, d0, {});
    o.begin(0, d1, {});
    std::vector<float> mean{(d0[0] + d1[0]) / 2, (d0[1] + d1[1]) / 2};
    o.end(0, mean, {});
    CHECK(mean == std::vector<float>{4.0f, 0.5f});  // (3 + 5) / 2, (-1 + 2) / 2
    CHECK(to_vec(o.anchor(0)) == mean);
    CHECK(o.outer_steps(0) == 1);
  }
  SUBCASE("lr 0.5") {
    outer_optimizer<outer_sgd>::config c;
    c.rule.lr = 0.5f;
    outer_optimizer<outer_sgd> o(c, {2});
    o.reset(0, std::vector<float>{1.0f, 2.0f});
    std::vector<float> d{2.0f, -4.0f};
    o.end(0, d, {});
    CHECK(d == std::vector<float>{0.0f, 4.0f});
    CHECK(to_vec(o.anchor(0)) == d);
  }
}

TEST_CASE("nesterov: end applies m = μ m + d; θ -= η (μ m + d) with state per fragment") {
  outer_optimizer<nesterov>::config c;
  c.rule = {.lr = 0.5f, .momentum = 0.5f};
  outer_optimizer<nesterov> o(c, {2, 1});
  o.reset(0, std::vector<float>{10.0f, 0.0f});
  o.reset(1, std::vector<float>{7.0f});
  std::vector<float> d{4.0f, -8.0f};
  o.end(0, d, {});
  // m = d = (4, -8); θ -= 0.5 (0.5 m + d) = 0.75 d
  CHECK(d == std::vector<float>{7.0f, 6.0f});
  auto s = o.state();
  REQUIRE(s.size() == 4);
  CHECK(to_vec(s[1].data) == std::vector<float>{4.0f, -8.0f});
  std::vector<float> d2{2.0f, 0.0f};
  o.end(0, d2, {});
  // m = 0.5 (4, -8) + (2, 0) = (4, -4); θ -= 0.5 (0.5 m + d2) = 0.5 (4, -2) = (2, -1)
  CHECK(d2 == std::vector<float>{5.0f, 7.0f});
  CHECK(to_vec(o.state()[1].data) == std::vector<float>{4.0f, -4.0f});
  CHECK(o.outer_steps(0) == 2);
  CHECK(o.outer_steps(1) == 0);
  CHECK(to_vec(o.anchor(1)) == std::vector<float>{7.0f});  // fragment 1 untouched
  CHECK(to_vec(o.state()[3].data) == std::vector<float>{0.0f});
}

TEST_CASE("state() names anchors and rule state with their fragment and aliases the live buffers") {
  outer_optimizer<nesterov> o({}, {3, 5});
  auto s = o.state();
  REQUIRE(s.size() == 4);
  CHECK((s[0].name == "anchor" && s[0].fragment == 0));
  CHECK((s[1].name == "momentum" && s[1].fragment == 0));
  CHECK((s[2].name == "anchor" && s[2].fragment == 1));
  CHECK((s[3].name == "momentum" && s[3].fragment == 1));
  // An anchor a checkpoint lacks starts from the parameters, the rule's state from zero.
  CHECK(s[0].missing == state_start::parameters);
  CHECK(s[1].missing == state_start::zero);
  CHECK(s[0].data.size() == 3);
  CHECK(s[1].data.size() == 3);
  CHECK(s[2].data.size() == 5);
  CHECK(s[3].data.size() == 5);
  s[2].data[4] = 42.0f;  // a checkpoint restore writes through state()
  CHECK(o.anchor(1)[4] == 42.0f);

  outer_optimizer<outer_sgd> sgd({}, {2, 2, 2});
  auto t = sgd.state();
  REQUIRE(t.size() == 3);  // anchors only
  CHECK((t[2].name == "anchor" && t[2].fragment == 2));

  outer_optimizer<fedadam> adam({}, {4});
  auto a = adam.state();
  REQUIRE(a.size() == 3);
  CHECK((a[0].name == "anchor" && a[0].fragment == 0));
  CHECK((a[1].name == "m" && a[1].fragment == 0));
  CHECK((a[2].name == "v" && a[2].fragment == 0));

  CHECK(outer_optimizer<nesterov>{}.state().empty());
}

TEST_CASE("the sync plan averages inner moments when the config says so; outer steps restore") {
  outer_optimizer<fedadam>::config c;
  const federation::sync_context ctx{.shape = {2, 2, 1},
                                     .coords = {1, 0, 0},
                                     .fragment = 1,
                                     .numel = 64,
                                     .inner_state_buffers = 2};
  // G = 2 groups of R = 2 replicas; fragment 1 of 64 f32 = 256 B, hierarchical: each buffer
  // (the mean pseudo-gradient, then with average_inner_moments AdamW's 2 moments) is averaged
  // as its replica's half (32 f32 = 128 B: each rank sends 2 (2 - 1) / 2 x 128 = 128 B over
  // the groups), then all-gathered over the replicas (256 B: (2 - 1) / 2 x 256 = 128 B each).
  auto average_of = [](operand whole, trigger start, trigger finish) {
    operand half = whole;
    half.piece = axis::replica;
    return std::vector<comm_op>{{.kind = comm_kind::all_reduce,
                                 .axis = axis::federation,
                                 .dtype = dtype::f32,
                                 .bytes = 128,
                                 .ranks = 2,
                                 .reduce = reduce_op::avg,
                                 .trigger = start,
                                 .phase = phase::sync,
                                 .fragment = 1,
                                 .in = half,
                                 .out = half,
                                 .overlappable = false},
                                {.kind = comm_kind::all_gather,
                                 .axis = axis::replica,
                                 .dtype = dtype::f32,
                                 .bytes = 256,
                                 .ranks = 2,
                                 .trigger = finish,
                                 .phase = phase::sync,
                                 .fragment = 1,
                                 .in = half,
                                 .out = whole,
                                 .overlappable = false}};
  };
  std::vector<comm_op> want =
      average_of({.role = role::fragment}, trigger::sync_exchange, trigger::sync_finish);
  const plan params_only = outer_optimizer<fedadam>(c, {}).sync_plan(ctx);
  CHECK(test::compare_ops(params_only.ops, want) == "");
  CHECK(params_only.wire_bytes_on(axis::federation) == 128.0);
  CHECK(params_only.wire_bytes_on(axis::replica) == 128.0);

  c.average_inner_moments = true;
  outer_optimizer<fedadam> o(c, {4});
  // the moments move after the parameters are applied: both halves of each at sync_after
  for (int k : {0, 1})
    for (const comm_op& op :
         average_of({.role = role::moment, .index = k}, trigger::sync_after, trigger::sync_after))
      want.push_back(op);
  REQUIRE(want.size() == 6);  // parameters + 2 moments, each all_reduce + all_gather
  const plan with_moments = o.sync_plan(ctx);
  CHECK(test::compare_ops(with_moments.ops, want) == "");
  CHECK(with_moments.wire_bytes_on(axis::federation) == 3 * 128.0);
  CHECK(with_moments.wire_bytes_on(axis::replica) == 3 * 128.0);
  o.set_outer_steps(0, 12);
  CHECK(o.outer_steps(0) == 12);
  CHECK_THROWS_AS(o.set_outer_steps(0, -1), invalid_argument);
}

TEST_CASE("a rule config the rule refuses is refused at construction") {
  outer_optimizer<nesterov>::config c;
  c.rule.lr = -1.0f;
  CHECK_THROWS_WITH_AS(outer_optimizer<nesterov>(c, {4}), doctest::Contains("lr"),
                       invalid_argument);
}

TEST_CASE("fragment indices out of range and size mismatches throw before anything changes") {
  outer_optimizer<nesterov> o({}, {4, 2});
  o.reset(0, std::vector<float>{1, 2, 3, 4});
  std::vector<float> four{1, 1, 1, 1}, three{1, 1, 1};
  for (int f : {2, -1, 100}) {
    CAPTURE(f);
    const std::string found = "found " + std::to_string(f);
    CHECK_THROWS_WITH_AS(o.begin(f, four, {}), doctest::Contains(found.c_str()), invalid_argument);
    CHECK_THROWS_WITH_AS(o.end(f, four, {}), doctest::Contains("fragment must be in [0, 2)"),
                         invalid_argument);
    CHECK_THROWS_AS(o.reset(f, four), invalid_argument);
    CHECK_THROWS_AS(o.anchor(f), invalid_argument);
  }
  CHECK_THROWS_WITH_AS(o.begin(0, three, {}),
                       doctest::Contains("fragment 0 has 4 elements, buffer has 3"),
                       invalid_argument);
  CHECK(three == std::vector<float>{1, 1, 1});
  CHECK_THROWS_WITH_AS(o.end(1, four, {}),
                       doctest::Contains("fragment 1 has 2 elements, buffer has 4"),
                       invalid_argument);
  CHECK(four == std::vector<float>{1, 1, 1, 1});
  CHECK(o.outer_steps(1) == 0);
  CHECK_THROWS_AS(o.reset(0, three), invalid_argument);
  CHECK(to_vec(o.anchor(0)) == std::vector<float>{1, 2, 3, 4});
}

TEST_CASE("outer_steps and set_outer_steps of a fragment out of range are invalid_argument") {
  // the library throws fedshard::error subclasses, not std::out_of_range
  outer_optimizer<nesterov> o({}, {4});
  CHECK_THROWS_WITH_AS(o.outer_steps(1), doctest::Contains("fragment must be in [0, 1), found 1"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(o.set_outer_steps(-1, 0),
                       doctest::Contains("fragment must be in [0, 1), found -1"), invalid_argument);
}
