// The ShardPolicy concept, mixed precision settings, and the step plan every sharding policy
// derives from its traits (order of ops, axes, dtypes, bytes).
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
using shard::shard_traits;

namespace {

std::vector<unit_spec> three_units() {
  return {{"embed", {{"w", {50, 20}}}},
          {"block", {{"w", {30, 30}}, {"b", {30}}}},
          {"head", {{"w", {7}}}}};
}

// Types that each miss one requirement of the concept.
struct no_step_plan {
  static constexpr std::string_view name = "no_step_plan";
  static constexpr shard_traits traits{};
  static int layout_shards(const mesh_shape& s) { return s.shards; }
  static void check(const mesh_shape&) {}
};
struct step_plan_returns_ops {
  static constexpr std::string_view name = "bad";
  static constexpr shard_traits traits{};
  static int layout_shards(const mesh_shape& s) { return s.shards; }
  static void check(const mesh_shape&) {}
  static std::vector<comm_op> step_plan(const flat_layout&, const mesh_shape&, const precision&) {
    return {};
  }
};
struct no_check {
  static constexpr std::string_view name = "no_check";
  static constexpr shard_traits traits{};
  static int layout_shards(const mesh_shape& s) { return s.shards; }
  static plan step_plan(const flat_layout&, const mesh_shape&, const precision&) { return {}; }
};
struct no_name {
  static constexpr shard_traits traits{};
  static int layout_shards(const mesh_shape& s) { return s.shards; }
  static void check(const mesh_shape&) {}
  static plan step_plan(const flat_layout&, const mesh_shape&, const precision&) { return {}; }
};
struct no_traits {
  static constexpr std::string_view name = "no_traits";
  static int layout_shards(const mesh_shape& s) { return s.shards; }
  static void check(const mesh_shape&) {}
  static plan step_plan(const flat_layout&, const mesh_shape&, const precision&) { return {}; }
};
struct no_layout_shards {
  static constexpr std::string_view name = "no_layout_shards";
  static constexpr shard_traits traits{};
  static void check(const mesh_shape&) {}
  static plan step_plan(const flat_layout&, const mesh_shape&, const precision&) { return {}; }
};
/// A policy of one's own built on the shared plan: ZeRO-2 that never averages over replicas.
struct my_zero2 {
  static constexpr std::string_view name = "my_zero2";
  static constexpr shard_traits traits{
      .shards_params = true, .regather_for_backward = false, .reduce_over_replicas = false};
  static int layout_shards(const mesh_shape& s) { return s.shards; }
  static void check(const mesh_shape&) {}
  static plan step_plan(const flat_layout& l, const mesh_shape& s, const precision& p) {
    return shard::detail::sharded_step_plan(traits, l, s, p);
  }
};

}  // namespace

TEST_CASE("ShardPolicy holds for the four policies and a custom one, not for incomplete types") {
  CHECK(shard::ShardPolicy<shard::replicate>);
  CHECK(shard::ShardPolicy<shard::shard_grad_op>);
  CHECK(shard::ShardPolicy<shard::full_shard>);
  CHECK(shard::ShardPolicy<shard::hybrid_shard>);
  CHECK(shard::ShardPolicy<my_zero2>);
  CHECK_FALSE(shard::ShardPolicy<no_step_plan>);
  CHECK_FALSE(shard::ShardPolicy<step_plan_returns_ops>);
  CHECK_FALSE(shard::ShardPolicy<no_check>);
  CHECK_FALSE(shard::ShardPolicy<no_name>);
  CHECK_FALSE(shard::ShardPolicy<no_traits>);
  CHECK_FALSE(shard::ShardPolicy<no_layout_shards>);
  CHECK_FALSE(shard::ShardPolicy<int>);
}

TEST_CASE("the four policies have distinct names and traits") {
  CHECK(shard::replicate::name == "replicate");
  CHECK(shard::shard_grad_op::name == "shard_grad_op");
  CHECK(shard::full_shard::name == "full_shard");
  CHECK(shard::hybrid_shard::name == "hybrid_shard");
  const shard_traits d{};
  CHECK(d.shards_params);
  CHECK(d.regather_for_backward);
  CHECK_FALSE(d.reduce_over_replicas);
}

TEST_CASE("precision: f32 by default; param f32/bf16/f16, reduce f32/bf16") {
  const precision d{};
  CHECK(d.param == dtype::f32);
  CHECK(d.reduce == dtype::f32);
  CHECK(d == precision{dtype::f32, dtype::f32});
  CHECK_FALSE(d == precision{dtype::bf16, dtype::f32});
  CHECK_FALSE(d == precision{dtype::f32, dtype::bf16});
  for (dtype p : {dtype::f32, dtype::bf16, dtype::f16})
    for (dtype r : {dtype::f32, dtype::bf16}) {
      CAPTURE(to_string(p));
      CAPTURE(to_string(r));
      CHECK_NOTHROW(precision{p, r}.check());
    }
  CHECK_THROWS_WITH_AS(precision({dtype::f64, dtype::f32}).check(),
                       doctest::Contains("param dtype must be f32, bf16 or f16, found f64"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(precision({dtype::f32, dtype::f16}).check(),
                       doctest::Contains("reduce dtype must be f32 or bf16, found f16"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(precision({dtype::bf16, dtype::f64}).check(),
                       doctest::Contains("reduce dtype must be f32 or bf16, found f64"),
                       invalid_argument);
}

TEST_CASE("sharded_step_plan: forward gathers by ascending unit, backward ops by descending unit") {
  const precision prec{dtype::bf16, dtype::f32};
  for (bool regather : {false, true})
    for (bool over_replicas : {false, true})
      for (mesh_shape shape : {mesh_shape{1, 1, 4}, mesh_shape{2, 3, 2}, mesh_shape{1, 2, 1}}) {
        const shard_traits t{true, regather, over_replicas};
        CAPTURE(regather);
        CAPTURE(over_replicas);
        CAPTURE(to_string(shape));
        const flat_layout l(three_units(), shape.shards);
        const plan p = shard::detail::sharded_step_plan(t, l, shape, prec);
        const int U = 3;
        const bool ar = over_replicas && shape.replicas > 1;
        REQUIRE(p.ops.size() == static_cast<std::size_t>(U + U * (1 + int(regather) + int(ar))));
        std::size_t i = 0;
        for (int u = 0; u < U; ++u, ++i) {
          const comm_op& op = p.ops[i];
          CHECK(op.kind == comm_kind::all_gather);
          CHECK(op.when == phase::forward);
          CHECK(op.unit == u);
          CHECK(op.on == axis::shard);
          CHECK(op.type == dtype::bf16);
          CHECK(op.ranks == shape.shards);
          CHECK(op.bytes == std::int64_t(l.unit(std::size_t(u)).padded_numel) * 2);
        }
        for (int u = U - 1; u >= 0; --u) {
          const auto padded = std::int64_t(l.unit(std::size_t(u)).padded_numel);
          if (regather) {
            const comm_op& g = p.ops[i++];
            CHECK(g.kind == comm_kind::all_gather);
            CHECK(g.when == phase::backward);
            CHECK(g.unit == u);
            CHECK(g.type == dtype::bf16);
            CHECK(g.bytes == padded * 2);
          }
          const comm_op& rs = p.ops[i++];
          CHECK(rs.kind == comm_kind::reduce_scatter);
          CHECK(rs.on == axis::shard);
          CHECK(rs.when == phase::backward);
          CHECK(rs.unit == u);
          CHECK(rs.type == dtype::f32);
          CHECK(rs.ranks == shape.shards);
          CHECK(rs.op == reduce_op::avg);
          CHECK(rs.bytes == padded * 4);
          if (ar) {
            const comm_op& a = p.ops[i++];
            CHECK(a.kind == comm_kind::all_reduce);
            CHECK(a.on == axis::replica);
            CHECK(a.when == phase::backward);
            CHECK(a.unit == u);
            CHECK(a.type == dtype::f32);
            CHECK(a.ranks == shape.replicas);
            CHECK(a.op == reduce_op::avg);
            CHECK(a.bytes == padded / shape.shards * 4);  // one shard of the unit
          }
        }
        for (const comm_op& op : p.ops) CHECK(op.overlappable);
      }
}

TEST_CASE("sharded_step_plan for replicated parameters: one gradient all_reduce per unit") {
  const shard_traits t{false, false, false};
  const flat_layout l(three_units(), 1);
  const plan p = shard::detail::sharded_step_plan(t, l, {2, 3, 2}, {dtype::f16, dtype::bf16});
  REQUIRE(p.ops.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    const comm_op& op = p.ops[i];
    CHECK(op.kind == comm_kind::all_reduce);
    CHECK(op.on == axis::group);
    CHECK(op.unit == int(2 - i));
    CHECK(op.type == dtype::bf16);
    CHECK(op.ranks == 6);
    CHECK(op.bytes == std::int64_t(l.unit(2 - i).padded_numel) * 2);
    CHECK(op.when == phase::backward);
    CHECK(op.op == reduce_op::avg);
  }
}

TEST_CASE("a custom policy built on the shared plan runs its own traits") {
  const flat_layout l(three_units(), 2);
  const plan p = my_zero2::step_plan(l, {1, 2, 2}, {});
  CHECK(p.calls_on(axis::shard) == 6);  // 3 gathers + 3 reduce_scatters
  CHECK(p.calls_on(axis::replica) == 0);
}
