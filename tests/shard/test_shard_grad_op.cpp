// shard_grad_op (ZeRO-2): one gather per unit per step, gradient reduce_scatter over S, and
// the gradient shards averaged over R; 2 (S-1)/S |θ| + 2 (R-1)/R |θ| / S per step.
#include "fedshard/shard/shard_grad_op.hpp"

#include <doctest/doctest.h>

#include <vector>

#include "support/step_ops.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;
using shard::shard_grad_op;

namespace {

comm_op op(comm_kind k, axis a, std::int64_t bytes, dtype t, int unit, phase when, int ranks) {
  return test::step_op(k, a, bytes, t, unit, when, ranks);
}

double theta(const flat_layout& l, dtype t) {
  return static_cast<double>(l.total_padded_numel() * size_of(t));
}

}  // namespace

TEST_CASE("shard_grad_op: name, shards over S, any R") {
  CHECK(shard::ShardPolicy<shard_grad_op>);
  CHECK(shard_grad_op::name == "shard_grad_op");
  CHECK(shard_grad_op::layout_shards({1, 1, 4}) == 4);
  CHECK(shard_grad_op::layout_shards({2, 3, 5}) == 5);
  for (mesh_shape s : {mesh_shape{1, 1, 4}, mesh_shape{1, 4, 2}, mesh_shape{8, 2, 1}})
    CHECK_NOTHROW(shard_grad_op::check(s));
}

TEST_CASE("shard_grad_op step plan of the tiny MLP, op by op: no backward gathers") {
  const flat_layout l(test::tiny_mlp{}.units(), 4);  // padded 192, 320, 128
  using enum comm_kind;
  const auto f = phase::forward, b = phase::backward;
  const auto S = axis::shard, R = axis::replica;
  const auto p32 = dtype::f32, p16 = dtype::bf16;
  SUBCASE("one replica: gathers forward, reduce_scatters backward") {
    const plan p = shard_grad_op::step_plan(l, {1, 1, 4}, {p16, p32});
    const std::vector<comm_op> expected{
        op(all_gather, S, 384, p16, 0, f, 4),      op(all_gather, S, 640, p16, 1, f, 4),
        op(all_gather, S, 256, p16, 2, f, 4),      op(reduce_scatter, S, 512, p32, 2, b, 4),
        op(reduce_scatter, S, 1280, p32, 1, b, 4), op(reduce_scatter, S, 768, p32, 0, b, 4)};
    CHECK(p.ops == expected);
  }
  SUBCASE("two replicas: each reduce_scatter is followed by the shard's all_reduce over R") {
    const plan p = shard_grad_op::step_plan(l, {3, 2, 4}, {});
    const std::vector<comm_op> expected{
        op(all_gather, S, 768, p32, 0, f, 4), op(all_gather, S, 1280, p32, 1, f, 4),
        op(all_gather, S, 512, p32, 2, f, 4), op(reduce_scatter, S, 512, p32, 2, b, 4),
        op(all_reduce, R, 128, p32, 2, b, 2), op(reduce_scatter, S, 1280, p32, 1, b, 4),
        op(all_reduce, R, 320, p32, 1, b, 2), op(reduce_scatter, S, 768, p32, 0, b, 4),
        op(all_reduce, R, 192, p32, 0, b, 2)};
    CHECK(p.ops == expected);
  }
}

TEST_CASE("shard_grad_op moves 2 (S-1)/S |θ| over S plus 2 (R-1)/R |θ| / S over R per step") {
  const std::vector<unit_spec> units{{"emb", {{"w", {1000, 7}}}},
                                     {"mlp", {{"w1", {64, 40}}, {"b", {3}}}}};
  for (int R : {1, 2, 4})
    for (int S : {1, 2, 3, 8}) {
      CAPTURE(R);
      CAPTURE(S);
      const mesh_shape shape{1, R, S};
      const flat_layout l(units, shard_grad_op::layout_shards(shape));
      const plan p = shard_grad_op::step_plan(l, shape, {});
      const double th = theta(l, dtype::f32);
      CHECK(p.wire_bytes_on(axis::shard) == doctest::Approx(2.0 * (S - 1) / S * th));
      CHECK(p.wire_bytes_on(axis::replica) == doctest::Approx(2.0 * (R - 1) / R * th / S));
      CHECK(p.calls_on(axis::shard) == 4);
      CHECK(p.calls_on(axis::replica) == (R > 1 ? 2 : 0));
      CHECK(p.calls_on(axis::group) == 0);
      for (const comm_op& o : p.ops)
        if (o.kind == comm_kind::all_gather) CHECK(o.phase == phase::forward);
    }
}
