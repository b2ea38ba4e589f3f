// hybrid_shard (HSDP): FSDP's plan over S plus a gradient-shard all_reduce over R per unit;
// FSDP's bytes + 2 (R-1)/R |θ| / S per step.
#include "fedshard/shard/hybrid_shard.hpp"

#include <doctest/doctest.h>

#include <vector>

#include "fedshard/shard/full_shard.hpp"
#include "support/step_ops.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;
using shard::hybrid_shard;

namespace {

double theta(const flat_layout& l, dtype t) {
  return static_cast<double>(l.total_padded_numel() * size_of(t));
}

}  // namespace

TEST_CASE("hybrid_shard: name, shards over S, any R") {
  CHECK(shard::ShardPolicy<hybrid_shard>);
  CHECK(hybrid_shard::name == "hybrid_shard");
  CHECK(hybrid_shard::layout_shards({1, 2, 4}) == 4);
  CHECK(hybrid_shard::layout_shards({2, 8, 1}) == 1);
  for (mesh_shape s : {mesh_shape{1, 1, 4}, mesh_shape{1, 4, 2}, mesh_shape{16, 4, 8}})
    CHECK_NOTHROW(hybrid_shard::check(s));
}

TEST_CASE("hybrid_shard step plan of the tiny MLP on R = 2, S = 2, op by op") {
  // units of 144, 272 and 68 elements over 2 shards: padded 160, 288, 96
  const flat_layout l(test::tiny_mlp{}.units(), 2);
  REQUIRE(l.unit(0).padded_numel == 160);
  REQUIRE(l.unit(1).padded_numel == 288);
  REQUIRE(l.unit(2).padded_numel == 96);
  using enum comm_kind;
  const auto f = phase::forward, b = phase::backward;
  const auto S = axis::shard, R = axis::replica;
  const auto p32 = dtype::f32, p16 = dtype::bf16;
  // kind, axis, unit, phase; bytes, dtype, ranks on 1 x 2 x 2 in f32; on 4 x 3 x 2 in bf16
  const test::step_op_pair ops[] = {{all_gather, S, 0, f, 640, p32, 2, 320, p16, 2},
                                    {all_gather, S, 1, f, 1152, p32, 2, 576, p16, 2},
                                    {all_gather, S, 2, f, 384, p32, 2, 192, p16, 2},
                                    {all_gather, S, 2, b, 384, p32, 2, 192, p16, 2},
                                    {reduce_scatter, S, 2, b, 384, p32, 2, 192, p16, 2},
                                    {all_reduce, R, 2, b, 192, p32, 2, 96, p16, 3},
                                    {all_gather, S, 1, b, 1152, p32, 2, 576, p16, 2},
                                    {reduce_scatter, S, 1, b, 1152, p32, 2, 576, p16, 2},
                                    {all_reduce, R, 1, b, 576, p32, 2, 288, p16, 3},
                                    {all_gather, S, 0, b, 640, p32, 2, 320, p16, 2},
                                    {reduce_scatter, S, 0, b, 640, p32, 2, 320, p16, 2},
                                    {all_reduce, R, 0, b, 320, p32, 2, 160, p16, 3}};
  SUBCASE("f32") {
    CHECK(hybrid_shard::step_plan(l, {1, 2, 2}, {}).ops == test::step_ops_of(ops, 0));
  }
  SUBCASE("bf16 everywhere, 3 replicas in 4 groups") {
    CHECK(hybrid_shard::step_plan(l, {4, 3, 2}, {p16, p16}).ops == test::step_ops_of(ops, 1));
  }
}

TEST_CASE("hybrid_shard moves FSDP's 3 (S-1)/S |θ| plus 2 (R-1)/R |θ| / S per step") {
  const std::vector<unit_spec> units{{"emb", {{"w", {1000, 7}}}},
                                     {"mlp", {{"w1", {64, 40}}, {"w2", {40, 64}}, {"b", {3}}}},
                                     {"out", {{"w", {5}}}}};
  for (int R : {1, 2, 3, 4})
    for (int S : {1, 2, 4, 6}) {
      CAPTURE(R);
      CAPTURE(S);
      const mesh_shape shape{2, R, S};
      const flat_layout l(units, hybrid_shard::layout_shards(shape));
      const plan p = hybrid_shard::step_plan(l, shape, {});
      const double th = theta(l, dtype::f32);
      CHECK(p.wire_bytes_on(axis::shard) == doctest::Approx(3.0 * (S - 1) / S * th));
      CHECK(p.wire_bytes_on(axis::replica) == doctest::Approx(2.0 * (R - 1) / R * th / S));
      CHECK(p.calls_on(axis::replica) == (R > 1 ? 3 : 0));
      CHECK(p.calls_on(axis::group) == 0);
      CHECK(p.calls_on(axis::federation) == 0);
      // the shard-axis part is exactly full_shard's plan on a 1-replica mesh
      plan shard_part;
      for (const comm_op& o : p.ops)
        if (o.axis == axis::shard) shard_part.ops.push_back(o);
      CHECK(shard_part.ops == shard::full_shard::step_plan(l, {2, 1, S}, {}).ops);
      if (R == 1) CHECK(p.ops == shard::full_shard::step_plan(l, {2, 1, S}, {}).ops);
    }
  SUBCASE("the replica all_reduce travels in the reduce dtype") {
    const flat_layout l(units, 4);
    const plan p = hybrid_shard::step_plan(l, {1, 2, 4}, {dtype::f32, dtype::bf16});
    CHECK(p.wire_bytes_on(axis::replica) == 1.0 * theta(l, dtype::bf16) / 4);
    for (const comm_op& o : p.ops)
      if (o.axis == axis::replica) CHECK(o.dtype == dtype::bf16);
  }
}
