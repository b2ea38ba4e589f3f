// The policy triple and the named algorithms: each alias is the triple the papers describe.
#include "fedshard/trainer/algorithm.hpp"

#include <doctest/doctest.h>

#include <type_traits>

using namespace fedshard;

namespace {

/// True when A is algorithm<S, F, Y>.
template <class A, class S, class F, class Y>
constexpr bool is_triple =
    std::is_same_v<typename A::shard_policy, S>&& std::is_same_v<typename A::federation_policy, F>&&
        std::is_same_v<typename A::sync_schedule, Y>&& std::is_same_v<A, algorithm<S, F, Y>>;

}  // namespace

TEST_CASE("algorithm exposes its three policies") {
  using custom =
      algorithm<shard::shard_grad_op, federation::weighted_average, schedule::post_local>;
  CHECK(
      is_triple<custom, shard::shard_grad_op, federation::weighted_average, schedule::post_local>);
  CHECK_FALSE(
      is_triple<custom, shard::full_shard, federation::weighted_average, schedule::post_local>);
}

TEST_CASE("intra-group algorithms: no federation, every step") {
  CHECK(is_triple<ddp, shard::replicate, federation::none, schedule::every_step>);
  CHECK(is_triple<zero2, shard::shard_grad_op, federation::none, schedule::every_step>);
  CHECK(is_triple<fsdp, shard::full_shard, federation::none, schedule::every_step>);
  CHECK(is_triple<hsdp, shard::hybrid_shard, federation::none, schedule::every_step>);
  CHECK_FALSE(ddp::federation_policy::syncs);
}

TEST_CASE("FL+FSDP and FL+HSDP: parameter averaging every K steps") {
  CHECK(is_triple<fl_fsdp<8>, shard::full_shard, federation::average, schedule::periodic<8>>);
  CHECK(is_triple<fl_hsdp<8>, shard::hybrid_shard, federation::average, schedule::periodic<8>>);
  CHECK(is_triple<fl_hsdp<1>, shard::hybrid_shard, federation::average, schedule::periodic<1>>);
  CHECK(fl_fsdp<3>::sync_schedule::period == 3);
  CHECK_FALSE(std::is_same_v<fl_fsdp<2>, fl_fsdp<3>>);
}

TEST_CASE("DiLoCo and streaming DiLoCo: outer Nesterov on hybrid_shard") {
  using outer = federation::outer_optimizer<federation::nesterov>;
  CHECK(is_triple<diloco<500>, shard::hybrid_shard, outer, schedule::periodic<500>>);
  CHECK(diloco<500>::sync_schedule::period == 500);
  CHECK(is_triple<streaming_diloco, shard::hybrid_shard, outer, schedule::streaming>);
  CHECK(diloco<100>::federation_policy::name == "nesterov");
}
