// replicate (DDP): full parameters on every rank, one gradient all_reduce per unit over the
// group's R * S ranks, in backward order; 2 (n-1)/n |θ| per step.
#include "fedshard/shard/replicate.hpp"

#include <doctest/doctest.h>

#include <vector>

#include "support/step_ops.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;
using shard::replicate;

TEST_CASE("replicate: name, never shards, never gathers, runs on any mesh") {
  CHECK(shard::ShardPolicy<replicate>);
  CHECK(replicate::name == "replicate");
  const flat_layout l(test::tiny_mlp{}.units(), 1);
  for (const comm_op& op : replicate::step_plan(l, {1, 2, 2}, {}).ops)
    CHECK(op.kind == comm_kind::all_reduce);
  for (mesh_shape s :
       {mesh_shape{1, 1, 1}, mesh_shape{1, 4, 1}, mesh_shape{1, 2, 2}, mesh_shape{4, 2, 8}}) {
    CHECK(replicate::layout_shards(s) == 1);
    CHECK_NOTHROW(replicate::check(s));
  }
}

TEST_CASE("replicate step plan of the tiny MLP: all_reduce of each whole unit, last unit first") {
  // one shard: units of 144, 272, 68 elements padded to multiples of 16: 144, 272, 80
  const flat_layout l(test::tiny_mlp{}.units(), 1);
  REQUIRE(l.unit(2).padded_numel == 80);
  const auto b = phase::backward;
  // kind, axis, unit, phase; bytes, dtype, ranks on 1 x 2 x 2 in f32; on 3 x 1 x 2 with f16
  // parameters and bf16 gradients
  const test::step_op_pair ops[] = {
      {comm_kind::all_reduce, axis::group, 2, b, 320, dtype::f32, 4, 160, dtype::bf16, 2},
      {comm_kind::all_reduce, axis::group, 1, b, 1088, dtype::f32, 4, 544, dtype::bf16, 2},
      {comm_kind::all_reduce, axis::group, 0, b, 576, dtype::f32, 4, 288, dtype::bf16, 2}};
  SUBCASE("4 ranks in 2 replicas x 2 shards, f32") {
    CHECK(replicate::step_plan(l, {1, 2, 2}, {}).ops == test::step_ops_of(ops, 0));
  }
  SUBCASE("the param dtype does not travel; gradients go in the reduce dtype; G is not involved") {
    CHECK(replicate::step_plan(l, {3, 1, 2}, {dtype::f16, dtype::bf16}).ops ==
          test::step_ops_of(ops, 1));
  }
}

TEST_CASE("replicate moves 2 (n-1)/n |θ| per step over the group's n = R * S ranks") {
  const std::vector<unit_spec> units{{"emb", {{"w", {1000, 7}}}},
                                     {"mlp", {{"w1", {64, 40}}, {"b", {3}}}}};
  const flat_layout l(units, 1);
  const double theta = static_cast<double>(l.total_padded_numel() * sizeof(float));
  for (mesh_shape s : {mesh_shape{1, 1, 1}, mesh_shape{1, 2, 1}, mesh_shape{1, 1, 4},
                       mesh_shape{2, 2, 2}, mesh_shape{1, 3, 1}, mesh_shape{1, 2, 3}}) {
    CAPTURE(to_string(s));
    const int n = s.replicas * s.shards;
    const plan p = replicate::step_plan(l, s, {});
    CHECK(p.wire_bytes_on(axis::group) == doctest::Approx(2.0 * (n - 1) / n * theta));
    CHECK(p.calls_on(axis::group) == 2);
    for (axis a : {axis::shard, axis::replica, axis::federation, axis::world})
      CHECK(p.calls_on(a) == 0);
    for (const comm_op& o : p.ops) {
      CHECK(o.ranks == n);
      CHECK(o.reduce == reduce_op::avg);
    }
  }
  CHECK(replicate::step_plan(l, {1, 4, 1}, {}).wire_bytes_on(axis::group) == 1.5 * theta);
}
