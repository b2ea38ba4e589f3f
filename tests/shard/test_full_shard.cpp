// full_shard (FSDP): its step plan op by op, 3 (S-1)/S |θ| per step, and R = 1 only.
#include "fedshard/shard/full_shard.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "support/step_ops.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;
using shard::full_shard;
using shard::precision;

namespace {

/// |θ| in bytes of type t: the padded units of a layout.
double theta(const flat_layout& l, dtype t) {
  return static_cast<double>(l.total_padded_numel() * size_of(t));
}

}  // namespace

TEST_CASE("full_shard: name, one shard per rank of a replica, gathered again for backward") {
  CHECK(shard::ShardPolicy<full_shard>);
  CHECK(full_shard::name == "full_shard");
  const flat_layout l(test::tiny_mlp{}.units(), 4);
  const plan p = full_shard::step_plan(l, {1, 1, 4}, {});
  for (int u = 0; u < 3; ++u) {
    CHECK(p.at({.trigger = trigger::acquire, .phase = phase::forward, .unit = u}).ops.size() == 1);
    CHECK(p.at({.trigger = trigger::acquire, .phase = phase::backward, .unit = u}).ops.size() == 1);
    CHECK(p.at({.trigger = trigger::grads_ready, .phase = phase::backward, .unit = u}).ops.size() ==
          1);
  }
  CHECK(full_shard::layout_shards({1, 1, 4}) == 4);
  CHECK(full_shard::layout_shards({8, 1, 2}) == 2);
  CHECK(full_shard::layout_shards({3, 1, 1}) == 1);
}

TEST_CASE("full_shard::check refuses R > 1, naming the count") {
  CHECK_NOTHROW(full_shard::check({1, 1, 4}));
  CHECK_NOTHROW(full_shard::check({16, 1, 8}));
  CHECK_THROWS_WITH_AS(full_shard::check({1, 2, 2}),
                       doctest::Contains("needs replicas == 1, found 2"), invalid_argument);
  CHECK_THROWS_WITH_AS(full_shard::check({2, 4, 1}), doctest::Contains("found 4"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(full_shard::check({2, 4, 1}), doctest::Contains("hybrid_shard"),
                       invalid_argument);
}

TEST_CASE("full_shard step plan of the tiny MLP over S = 4, op by op") {
  // units of 144, 272 and 68 elements, padded over 4 shards of multiples of 16: 192, 320, 128
  const flat_layout l(test::tiny_mlp{}.units(), 4);
  REQUIRE(l.unit(0).padded_numel == 192);
  REQUIRE(l.unit(1).padded_numel == 320);
  REQUIRE(l.unit(2).padded_numel == 128);
  using enum comm_kind;
  const auto f = phase::forward, b = phase::backward;
  // kind, axis, unit, phase; bytes, dtype, ranks in f32; the same with bf16 parameters
  const test::step_op_pair ops[] = {
      {all_gather, axis::shard, 0, f, 768, dtype::f32, 4, 384, dtype::bf16, 4},
      {all_gather, axis::shard, 1, f, 1280, dtype::f32, 4, 640, dtype::bf16, 4},
      {all_gather, axis::shard, 2, f, 512, dtype::f32, 4, 256, dtype::bf16, 4},
      {all_gather, axis::shard, 2, b, 512, dtype::f32, 4, 256, dtype::bf16, 4},
      {reduce_scatter, axis::shard, 2, b, 512, dtype::f32, 4, 512, dtype::f32, 4},
      {all_gather, axis::shard, 1, b, 1280, dtype::f32, 4, 640, dtype::bf16, 4},
      {reduce_scatter, axis::shard, 1, b, 1280, dtype::f32, 4, 1280, dtype::f32, 4},
      {all_gather, axis::shard, 0, b, 768, dtype::f32, 4, 384, dtype::bf16, 4},
      {reduce_scatter, axis::shard, 0, b, 768, dtype::f32, 4, 768, dtype::f32, 4}};
  SUBCASE("f32") {
    CHECK(full_shard::step_plan(l, {1, 1, 4}, {}).ops == test::step_ops_of(ops, 0));
  }
  SUBCASE("bf16 parameters, f32 gradients") {
    CHECK(full_shard::step_plan(l, {1, 1, 4}, {dtype::bf16, dtype::f32}).ops ==
          test::step_ops_of(ops, 1));
  }
}

TEST_CASE("full_shard moves 3 (S-1)/S |θ| per rank per step, all on the shard axis") {
  const std::vector<unit_spec> big{{"emb", {{"w", {1000, 7}}}},
                                   {"mlp", {{"w1", {64, 40}}, {"w2", {40, 64}}, {"b", {3}}}}};
  for (int S : {1, 2, 3, 4, 5, 8}) {
    CAPTURE(S);
    for (int G : {1, 3}) {
      const mesh_shape shape{G, 1, S};
      const flat_layout l(big, full_shard::layout_shards(shape));
      const plan p = full_shard::step_plan(l, shape, {});
      const double expected = 3.0 * (S - 1) / S * theta(l, dtype::f32);
      CHECK(p.wire_bytes_on(axis::shard) == doctest::Approx(expected).epsilon(1e-12));
      if ((S & (S - 1)) == 0) CHECK(p.wire_bytes_on(axis::shard) == expected);  // exact
      CHECK(p.calls_on(axis::shard) == 6);
      for (axis a : {axis::replica, axis::federation, axis::group, axis::world})
        CHECK(p.calls_on(a) == 0);
      // every reduction averages; the federation groups do not change the step
      for (const comm_op& o : p.ops) CHECK(o.reduce.value_or(reduce_op::avg) == reduce_op::avg);
      CHECK(p.ops == full_shard::step_plan(l, {1, 1, S}, {}).ops);
    }
  }
  SUBCASE("mixed precision: two gathers in the param dtype, one reduce_scatter in f32") {
    const flat_layout l(big, 4);
    const plan p = full_shard::step_plan(l, {1, 1, 4}, {dtype::f16, dtype::f32});
    CHECK(p.wire_bytes_on(axis::shard) == 0.75 * (2 * theta(l, dtype::f16) + theta(l, dtype::f32)));
  }
}
