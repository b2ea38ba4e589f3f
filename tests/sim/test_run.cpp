// The catalogue priced by name: every alias of fedshard::for_each_algorithm is accepted by
// sim::algorithm_by_name and priced by sim::price_named, through the path its entry's type
// takes (one step for the algorithms whose steps are all alike, a run of step kinds for
// shard::sparse), and the one-step path refuses the aliases whose steps vary.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/sim/price.hpp"
#include "fedshard/sim/run.hpp"
#include "fedshard/trainer/algorithm.hpp"

#include "support/sim.hpp"

using namespace fedshard;
using namespace fedshard::sim;
using fedshard::test::error_of;
using fedshard::test::small_gpt;

namespace {

/// Every alias, in the catalogue's order: adding or losing one fails the tests below.
const std::vector<std::string> catalogue{"ddp",          "zero2",         "fsdp",
                                         "hsdp",         "fl_fsdp",       "fl_hsdp",
                                         "fl_hsdp_int8", "diloco",        "streaming_diloco",
                                         "sparseloco",   "gasloc",        "fomoe",
                                         "scape_fsdp",   "fl_scape_fsdp", "hofl",
                                         "lss",          "fcp",           "feast",
                                         "collate"};

/// An 8-GPU mesh the alias's policies accept: 2 groups when it federates, else one; replicas
/// of 4 shards when its shard policy takes them, else one replica (or, for DDP's
/// replicate, 8 replicas of one shard).
mesh_shape mesh_for(const algorithm_desc& a) {
  const int g = a.syncs() ? 2 : 1;
  for (const mesh_shape s :
       {mesh_shape{g, 2, 4 / g}, mesh_shape{g, 1, 8 / g}, mesh_shape{g, 8 / g, 1}})
    if (error_of([&] {
          (void)a.layout(transformer_units(small_gpt().model, dtype::bf16), s);
        }).empty())
      return s;
  FAIL("no 8-GPU mesh fits ", a.name());
  return {};
}

}  // namespace

TEST_CASE("the catalogue lists every alias once, in order, and the simulator knows each name") {
  std::vector<std::string> visited;
  for_each_algorithm([&]<class A>(std::string_view n) { visited.emplace_back(n); });
  CHECK(visited == catalogue);
  CHECK(algorithm_names() == catalogue);
  CHECK(algorithm_list() ==
        "ddp, zero2, fsdp, hsdp, fl_fsdp, fl_hsdp, fl_hsdp_int8, diloco, streaming_diloco, "
        "sparseloco, gasloc, fomoe, scape_fsdp, fl_scape_fsdp, hofl, lss, fcp, feast, collate");
  for (const auto& n : catalogue) {
    CAPTURE(n);
    CHECK(is_algorithm_name(n));
    CHECK(algorithm_by_name(n).name() == n);
  }
  CHECK_FALSE(is_algorithm_name("scape"));
  // The numbers each alias carries by default: gasloc's H = 500 (as diloco), fomoe's K = 8,
  // fl_scape_fsdp's K = 8; scape_fsdp does not federate.
  CHECK(algorithm_by_name("gasloc").cadence().period() == 500);
  CHECK(algorithm_by_name("gasloc").federation_policy() == "gossip");
  CHECK(algorithm_by_name("fomoe").cadence().period() == 8);
  CHECK(algorithm_by_name("fomoe").federation_policy() == "holder_average");
  CHECK(algorithm_by_name("fl_scape_fsdp").cadence().period() == 8);
  CHECK_FALSE(algorithm_by_name("scape_fsdp").syncs());
  // The unknown-name message lists the catalogue.
  const std::string unknown = error_of([] { algorithm_by_name("scape"); });
  CHECK(unknown.find("unknown algorithm 'scape', expected one of ddp, zero2, fsdp, hsdp, "
                     "fl_fsdp, fl_hsdp, fl_hsdp_int8, diloco, streaming_diloco, sparseloco, "
                     "gasloc, fomoe, scape_fsdp, fl_scape_fsdp, hofl, lss, fcp, feast, collate") !=
        std::string::npos);
  CHECK(error_of([] {
          price_named("gossip", {}, small_gpt(), {1, 1, 8}, a100_4gpu_node());
        }).find("unknown algorithm 'gossip', expected one of ddp,") != std::string::npos);
}

TEST_CASE("every alias is priced by name: a finite, positive step on 8 GPUs") {
  const cluster c = a100_4gpu_node();
  const std::vector<std::string> varying{"scape_fsdp", "fl_scape_fsdp"};
  int priced = 0;
  for_each_algorithm([&]<class A>(std::string_view name) {
    CAPTURE(name);
    const algorithm_desc a = algorithm_by_name(name);
    const mesh_shape shape = mesh_for(a);
    CAPTURE(to_string(shape));
    const run_price p = price_named(name, {.steps = 20}, small_gpt(), shape, c);
    CHECK(p.algorithm == name);
    CHECK(std::isfinite(p.step));
    CHECK(p.step > 0);
    CHECK(p.tokens_per_s_per_gpu > 0);
    double inside = 0;  // every alias reduces its gradients inside a group each step
    for (axis x : {axis::shard, axis::replica, axis::group}) inside += p.bytes(x);
    CHECK(inside > 0);
    const bool varies = std::find(varying.begin(), varying.end(), name) != varying.end();
    CHECK(a.steps_vary() == varies);
    CHECK(steps_vary_v<A> == varies);
    CHECK(p.over_run.has_value() == varies);
    CHECK(p.each_step.has_value() == !varies);
    if (a.syncs()) CHECK(p.bytes(axis::federation) > 0);
    ++priced;
  });
  CHECK(priced == static_cast<int>(catalogue.size()));
}

TEST_CASE("SCAPE's aliases are priced over a run of step kinds, beside their dense alias") {
  const cluster c = a100_4gpu_node();
  // Defaults: density 0.1, a mask after every step, 1 dense step first. Over 20 steps:
  // step 0 dense; steps 1..19 packed reductions with the mask computed after the previous
  // step exchanged first. Their base is full_shard (FSDP's one unit at a time: no gathered
  // copy kept), so every gather is dense; fl_scape_fsdp's syncs after steps 7 and 15 (K = 8)
  // change no step's kind.
  SUBCASE("scape_fsdp") {
    const run_price p = price_named("scape_fsdp", {.steps = 20}, small_gpt(), {1, 1, 8}, c);
    REQUIRE(p.over_run.has_value());
    std::vector<std::int64_t> counts;
    for (const auto& k : p.over_run->kinds) counts.push_back(k.count);
    CHECK(counts == std::vector<std::int64_t>{1, 19});
    CHECK(p.over_run->mask_exchanges == 20);
    CHECK(dense_counterpart("scape_fsdp") == "fsdp");
  }
  SUBCASE("fl_scape_fsdp") {
    const run_price p = price_named("fl_scape_fsdp", {.steps = 20}, small_gpt(), {2, 1, 4}, c);
    REQUIRE(p.over_run.has_value());
    std::vector<std::int64_t> counts;
    for (const auto& k : p.over_run->kinds) counts.push_back(k.count);
    CHECK(counts == std::vector<std::int64_t>{1, 19});
    CHECK(dense_counterpart("fl_scape_fsdp") == "fl_fsdp");
  }
  SUBCASE("the aliases whose steps are alike have no dense counterpart") {
    for (const auto& n : catalogue)
      if (n != "scape_fsdp" && n != "fl_scape_fsdp") CHECK(dense_counterpart(n).empty());
    CHECK(error_of([] { (void)dense_counterpart("scape"); }).find("unknown algorithm 'scape'") !=
          std::string::npos);
  }
  SUBCASE("one step's price is refused, naming the run's") {
    const algorithm_desc a = algorithm_by_name("scape_fsdp");
    const std::string e = error_of([&] { (void)price(a, small_gpt(), {1, 1, 8}, c); });
    CHECK(e.find("sim::price_plans: scape_fsdp runs different plans on different steps") !=
          std::string::npos);
    CHECK(e.find("sim::price_named") != std::string::npos);
    CHECK(error_of([&] {
            (void)run_traffic(a, transformer_units(small_gpt().model, dtype::bf16), {1, 1, 8}, 0, 4,
                              4, {});
          }).find("sim::run_traffic: scape_fsdp runs different plans") != std::string::npos);
  }
  SUBCASE("a bf16 sync is refused for a run whose steps vary") {
    CHECK(error_of([&] {
            (void)price_named("fl_scape_fsdp", {.algorithm = {.sync_dtype = dtype::bf16}},
                              small_gpt(), {2, 1, 4}, c);
          })
              .find("fl_scape_fsdp: a run whose steps vary is priced with its federation's own "
                    "sync (f32), found sync dtype bf16") != std::string::npos);
  }
}
