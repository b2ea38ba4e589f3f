// Every alias of the catalogue (fedshard::for_each_algorithm) with its defaults on gpu_inproc:
// 2 groups x 1 replica x 2 shards, 4 ranks sharing GPU 0, the device MLP of
// support/gpu_runs.cuh, 6 steps, syncs every 2 steps where the schedule has a period. The
// aliases that run on device memory train as the host inproc run does (parameters and losses
// within 1e-6 relative: the model's kernels compute the host's bits, the collectives reduce in
// rank order); the others are refused, each where the library refuses it today:
//  - at compile time (a static_assert of the space, so they are not instantiated here):
//    SCAPE's runtime (scape_fsdp, fl_scape_fsdp: shard/sparse.hpp) and element_average
//    (feast, collate: federation/element_average.hpp);
//  - when first run, with a message on every rank: the codecs (fl_hsdp_int8's gathers,
//    sparseloco's average: plan/interpreter.hpp) and the local rules (hofl, lss:
//    trainer/trainer.hpp).
// Issue 31 moves aliases from the second list to the first; this test says which is which.
#include <doctest/doctest.h>

#include <string>
#include <string_view>
#include <type_traits>

#include "fedshard/cuda/cuda_space.cuh"
#include "fedshard/cuda/gpu_inproc.cuh"
#include "fedshard/trainer/algorithm.hpp"
#include "support/gpu_runs.cuh"

namespace {

using namespace fedshard;
using namespace fedshard::test::gpu_runs;

constexpr mesh_shape kShape{2, 1, 2};
constexpr int kSteps = 6;
constexpr int kPeriod = 2;

/// True when A cannot be instantiated on a device space (the static_asserts listed above).
template <class A>
constexpr bool host_only_at_compile_time =
    shard::runtime_of<typename A::shard_policy, space::host_space>::stateful ||
    std::is_same_v<typename A::federation_policy, federation::element_average>;

/// What refuses an alias when it first runs on device memory (empty: nothing does).
std::string refusal_of(std::string_view alias) {
  if (alias == "fl_hsdp_int8" || alias == "sparseloco") return "codecs run on host memory";
  if (alias == "hofl" || alias == "lss")
    return "a local rule (trainer_options::local_rule) runs on memory the host can read";
  return "";
}

}  // namespace

TEST_CASE("every alias on gpu_inproc trains as on the host, or is refused where it cannot run") {
  int ran = 0, refused_at_run = 0, refused_at_compile = 0;
  for_each_algorithm([&]<class A>(std::string_view alias) {
    CAPTURE(alias);
    if constexpr (host_only_at_compile_time<A>) {
      ++refused_at_compile;
    } else if (const std::string why = refusal_of(alias); !why.empty()) {
      ++refused_at_run;
      CHECK_THROWS_WITH_AS(on_gpu_inproc<A>(kShape, kSteps, kPeriod),
                           doctest::Contains(why.c_str()), fedshard::invalid_argument);
    } else {
      ++ran;
      check_same<A>(std::string(alias).c_str(), kShape, kPeriod);
    }
  });
  CHECK(ran == 11);
  CHECK(refused_at_run == 4);
  CHECK(refused_at_compile == 4);
}
