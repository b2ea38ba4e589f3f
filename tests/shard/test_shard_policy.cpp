// The ShardPolicy concept, mixed precision settings, and the builders of the ops policies are
// made of (order of ops, axes, dtypes, bytes, roles and triggers).
#include "fedshard/shard/shard_policy.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "fedshard/shard/full_shard.hpp"
#include "fedshard/shard/hybrid_shard.hpp"
#include "fedshard/shard/replicate.hpp"
#include "fedshard/shard/shard_grad_op.hpp"

using namespace fedshard;
using shard::precision;

namespace {

std::vector<unit_spec> three_units() {
  return {{"embed", {{"w", {50, 20}}}},
          {"block", {{"w", {30, 30}}, {"b", {30}}}},
          {"head", {{"w", {7}}}}};
}

// Types that each miss one requirement of the concept.
struct no_step_plan {
  static constexpr std::string_view name = "no_step_plan";
  static int layout_shards(const mesh_shape& s) { return s.shards; }
  static void check(const mesh_shape&) {}
};
struct step_plan_returns_ops {
  static constexpr std::string_view name = "bad";
  static int layout_shards(const mesh_shape& s) { return s.shards; }
  static void check(const mesh_shape&) {}
  static std::vector<comm_op> step_plan(const flat_layout&, const mesh_shape&, const precision&) {
    return {};
  }
};
struct no_check {
  static constexpr std::string_view name = "no_check";
  static int layout_shards(const mesh_shape& s) { return s.shards; }
  static plan step_plan(const flat_layout&, const mesh_shape&, const precision&) { return {}; }
};
struct no_name {
  static int layout_shards(const mesh_shape& s) { return s.shards; }
  static void check(const mesh_shape&) {}
  static plan step_plan(const flat_layout&, const mesh_shape&, const precision&) { return {}; }
};
struct no_layout_shards {
  static constexpr std::string_view name = "no_layout_shards";
  static void check(const mesh_shape&) {}
  static plan step_plan(const flat_layout&, const mesh_shape&, const precision&) { return {}; }
};
/// A policy of one's own built from the builders: ZeRO-2 that never averages over replicas
/// and gathers again for backward (a ZeRO-3 without replica averaging).
struct my_zero3 {
  static constexpr std::string_view name = "my_zero3";
  static int layout_shards(const mesh_shape& s) { return s.shards; }
  static void check(const mesh_shape&) {}
  static plan step_plan(const flat_layout& l, const mesh_shape& s, const precision& p) {
    plan out = shard::ops::forward_gathers(l, s, p.param);
    for (int u : shard::ops::backward_order(l)) {
      out.ops.push_back(shard::ops::gather(l, s, p.param, u, phase::backward));
      out.ops.push_back(shard::ops::reduce_scatter(l, s, p.reduce, u));
    }
    return out;
  }
};

}  // namespace

TEST_CASE("ShardPolicy holds for the four policies and a custom one, not for incomplete types") {
  CHECK(shard::ShardPolicy<shard::replicate>);
  CHECK(shard::ShardPolicy<shard::shard_grad_op>);
  CHECK(shard::ShardPolicy<shard::full_shard>);
  CHECK(shard::ShardPolicy<shard::hybrid_shard>);
  CHECK(shard::ShardPolicy<my_zero3>);
  CHECK_FALSE(shard::ShardPolicy<no_step_plan>);
  CHECK_FALSE(shard::ShardPolicy<step_plan_returns_ops>);
  CHECK_FALSE(shard::ShardPolicy<no_check>);
  CHECK_FALSE(shard::ShardPolicy<no_name>);
  CHECK_FALSE(shard::ShardPolicy<no_layout_shards>);
  CHECK_FALSE(shard::ShardPolicy<int>);
}

TEST_CASE("the four policies have distinct names") {
  CHECK(shard::replicate::name == "replicate");
  CHECK(shard::shard_grad_op::name == "shard_grad_op");
  CHECK(shard::full_shard::name == "full_shard");
  CHECK(shard::hybrid_shard::name == "hybrid_shard");
}

TEST_CASE("precision: f32 by default; param f32/bf16/f16, reduce f32/bf16") {
  const precision d{};
  CHECK(d.param == dtype::f32);
  CHECK(d.reduce == dtype::f32);
  CHECK(d == precision{dtype::f32, dtype::f32});
  CHECK_FALSE(d == precision{dtype::bf16, dtype::f32});
  CHECK_FALSE(d == precision{dtype::f32, dtype::bf16});
  for (dtype p : {dtype::f32, dtype::bf16, dtype::f16})
    for (dtype r : {dtype::f32, dtype::bf16, dtype::f16}) {
      CAPTURE(to_string(p));
      CAPTURE(to_string(r));
      CHECK_NOTHROW(precision{p, r}.check());
    }
  CHECK_THROWS_WITH_AS(precision({dtype::f64, dtype::f32}).check(),
                       doctest::Contains("param dtype must be f32, bf16 or f16, found f64"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(precision({dtype::bf16, dtype::f64}).check(),
                       doctest::Contains("reduce dtype must be f32, bf16 or f16, found f64"),
                       invalid_argument);
}

TEST_CASE("ops builders: what each step op moves, reads, writes and waits for") {
  const precision prec{dtype::bf16, dtype::f32};
  for (mesh_shape shape : {mesh_shape{1, 1, 4}, mesh_shape{2, 3, 2}, mesh_shape{1, 2, 1}}) {
    CAPTURE(to_string(shape));
    const flat_layout l(three_units(), shape.shards);
    for (int u = 0; u < 3; ++u) {
      const auto padded = std::int64_t(l.unit(std::size_t(u)).padded_numel);
      for (phase ph : {phase::forward, phase::backward}) {
        const comm_op g = shard::ops::gather(l, shape, prec.param, u, ph);
        CHECK(g.kind == comm_kind::all_gather);
        CHECK(g.axis == axis::shard);
        CHECK(g.dtype == dtype::bf16);
        CHECK(g.bytes == padded * 2);
        CHECK(g.ranks == shape.shards);
        CHECK_FALSE(g.reduce.has_value());
        CHECK(g.trigger == trigger::acquire);
        CHECK(g.phase == ph);
        CHECK(g.unit == u);
        CHECK(g.in == operand{.role = role::param_shard});
        CHECK(g.out == operand{.role = role::params});
        CHECK(g.overlappable);
        CHECK_NOTHROW(check(g));
      }
      const comm_op rs = shard::ops::reduce_scatter(l, shape, prec.reduce, u);
      CHECK(rs.kind == comm_kind::reduce_scatter);
      CHECK(rs.axis == axis::shard);
      CHECK(rs.dtype == dtype::f32);
      CHECK(rs.bytes == padded * 4);
      CHECK(rs.reduce == reduce_op::avg);
      CHECK(rs.trigger == trigger::grads_ready);
      CHECK(rs.in.role == role::grad);
      CHECK(rs.out.role == role::grad_shard);
      const comm_op ar = shard::ops::replica_average(l, shape, prec.reduce, u);
      CHECK(ar.axis == axis::replica);
      CHECK(ar.ranks == shape.replicas);
      CHECK(ar.bytes == padded / shape.shards * 4);  // one shard of the unit
      CHECK(ar.in.role == role::grad_shard);
      CHECK(ar.out.role == role::grad_shard);
      const comm_op ga = shard::ops::group_average(l, shape, dtype::bf16, u);
      CHECK(ga.axis == axis::group);
      CHECK(ga.ranks == shape.replicas * shape.shards);
      CHECK(ga.bytes == padded * 2);
      CHECK(ga.in.role == role::grad);
      CHECK(ga.out.role == role::grad);
      for (const comm_op& op : {rs, ar, ga}) CHECK_NOTHROW(check(op));
    }
    CHECK(shard::ops::forward_order(l) == std::vector<int>{0, 1, 2});
    CHECK(shard::ops::backward_order(l) == std::vector<int>{2, 1, 0});
    const plan fwd = shard::ops::forward_gathers(l, shape, prec.param);
    REQUIRE(fwd.ops.size() == 3);
    for (int u = 0; u < 3; ++u) CHECK(fwd.ops[std::size_t(u)].unit == u);
  }
}

TEST_CASE("read_units: on-demand f32 gathers into a caller's buffer, none when not sharded") {
  const flat_layout sharded(three_units(), 2);
  const plan p = shard::ops::read_units(sharded, {1, 1, 2});
  REQUIRE(p.ops.size() == 3);
  for (int u = 0; u < 3; ++u) {
    const comm_op& op = p.ops[std::size_t(u)];
    CHECK(op.kind == comm_kind::all_gather);
    CHECK(op.dtype == dtype::f32);
    CHECK(op.trigger == trigger::on_demand);
    CHECK(op.unit == u);
    CHECK(op.out.role == role::value);
    CHECK(op.bytes == std::int64_t(sharded.unit(std::size_t(u)).padded_numel) * 4);
  }
  CHECK(shard::ops::read_units(flat_layout(three_units(), 1), {1, 4, 1}).ops.empty());
}

TEST_CASE("a custom policy built from the builders plans its own schedule") {
  const flat_layout l(three_units(), 2);
  const plan p = my_zero3::step_plan(l, {1, 2, 2}, {});
  CHECK(p.calls_on(axis::shard) == 9);  // 3 forward + 3 backward gathers + 3 reduce_scatters
  CHECK(p.calls_on(axis::replica) == 0);
  CHECK_NOTHROW(p.check());
}
