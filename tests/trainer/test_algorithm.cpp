// The policy triple and the named algorithms: each alias is the triple the papers describe,
// its numbers are run-time defaults, and the registry lists every alias once.
#include "fedshard/trainer/algorithm.hpp"

#include <doctest/doctest.h>

#include <string>
#include <type_traits>
#include <vector>

using namespace fedshard;

namespace {

/// True when A's three policies are S, F and Y.
template <class A, class S, class F, class Y>
constexpr bool is_triple = std::is_same_v<typename A::shard_policy, S>&&
    std::is_same_v<typename A::federation_policy, F>&& std::is_same_v<typename A::sync_schedule, Y>;

}  // namespace

TEST_CASE("algorithm exposes its three policies and models Algorithm") {
  using custom =
      algorithm<shard::shard_grad_op, federation::weighted_average, schedule::post_local>;
  CHECK(
      is_triple<custom, shard::shard_grad_op, federation::weighted_average, schedule::post_local>);
  CHECK_FALSE(
      is_triple<custom, shard::full_shard, federation::weighted_average, schedule::post_local>);
  CHECK(Algorithm<custom>);
  CHECK(Algorithm<fl_hsdp>);
  CHECK_FALSE(Algorithm<int>);
  CHECK_FALSE(Algorithm<shard::full_shard>);
  // without defaults, the schedule starts from its config's own
  CHECK(custom::default_schedule().k == schedule::post_local::config{}.k);
}

TEST_CASE("intra-group algorithms: no federation, every step") {
  CHECK(is_triple<ddp, shard::replicate, federation::none, schedule::every_step>);
  CHECK(is_triple<zero2, shard::shard_grad_op, federation::none, schedule::every_step>);
  CHECK(is_triple<fsdp, shard::full_shard, federation::none, schedule::every_step>);
  CHECK(is_triple<hsdp, shard::hybrid_shard, federation::none, schedule::every_step>);
  CHECK_FALSE(ddp::federation_policy::syncs);
}

TEST_CASE("FL+FSDP and FL+HSDP: parameter averaging every K steps, K = 8 unless told otherwise") {
  CHECK(is_triple<fl_fsdp, shard::full_shard, federation::average, schedule::periodic>);
  CHECK(is_triple<fl_hsdp, shard::hybrid_shard, federation::average, schedule::periodic>);
  CHECK(fl_fsdp::default_schedule().period == 8);
  CHECK(fl_hsdp::default_schedule().period == 8);
  // K is a run-time setting of the one type
  const schedule::periodic k3({.period = 3});
  CHECK(k3.period() == 3);
  CHECK(k3.action(0, 2, 0) == schedule::sync_action::start_and_apply);
  CHECK(k3.action(0, 3, 0) == schedule::sync_action::none);
}

TEST_CASE("DiLoCo and streaming DiLoCo: outer Nesterov on hybrid_shard, H = 500 by default") {
  using outer = federation::outer_optimizer<federation::nesterov>;
  CHECK(is_triple<diloco, shard::hybrid_shard, outer, schedule::periodic>);
  CHECK(diloco::default_schedule().period == 500);
  CHECK(is_triple<streaming_diloco, shard::hybrid_shard, outer, schedule::streaming>);
  CHECK(diloco::federation_policy::name == "nesterov");
  const auto s = streaming_diloco::default_schedule();
  CHECK(s.period == 100);
  CHECK(s.fragments == 2);
}

TEST_CASE("defaults<> sets an algorithm's starting schedule") {
  using every3 = algorithm<shard::full_shard, federation::average, schedule::periodic,
                           defaults<schedule::periodic::config{.period = 3}>>;
  CHECK(every3::default_schedule().period == 3);
  using slow_stream = algorithm<shard::hybrid_shard, federation::average, schedule::streaming,
                                defaults<schedule::streaming::config{
                                    .period = 12, .fragments = 3, .delay = 1, .alpha = 0.5f}>>;
  CHECK(slow_stream::default_schedule().delay == 1);
  CHECK(slow_stream::default_schedule().alpha == 0.5f);
}

TEST_CASE("for_each_algorithm lists every alias once, in order") {
  std::vector<std::string> names;
  bool all_algorithms = true;
  for_each_algorithm([&]<class A>(std::string_view name) {
    names.emplace_back(name);
    all_algorithms = all_algorithms && Algorithm<A>;
  });
  CHECK(names == std::vector<std::string>{
                     "ddp", "zero2", "fsdp", "hsdp", "fl_fsdp", "fl_hsdp", "fl_hsdp_int8", "diloco",
                     "streaming_diloco", "sparseloco", "gasloc", "fomoe", "scape_fsdp",
                     "fl_scape_fsdp", "hofl", "lss", "fcp", "feast", "collate"});
  CHECK(algorithm_list(",") ==
        "ddp,zero2,fsdp,hsdp,fl_fsdp,fl_hsdp,fl_hsdp_int8,diloco,streaming_diloco,sparseloco,"
        "gasloc,fomoe,scape_fsdp,fl_scape_fsdp,hofl,lss,fcp,feast,collate");
  CHECK(is_algorithm_name("gasloc"));
  CHECK_FALSE(is_algorithm_name("GASLOC"));
  CHECK(all_algorithms);
}
