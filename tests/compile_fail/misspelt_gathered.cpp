// A federation policy's buffer for role gathered under a near-miss name is an error naming the
// member meant (capability 12), not a plan op that finds no buffer at run time.
// expect: has a member `gather`; did you mean `gathered\(int f\) -> std::span<float>`
#include <span>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;
struct my_average : federation::average {
  using federation::average::average;
#ifdef FEDSHARD_COMPILE_OK
  std::span<float> gathered(int) {
    return {};
  }
#else
  std::span<float> gather(int) {
    return {};
  }
#endif
};
using my_algorithm = algorithm<shard::full_shard, my_average, schedule::periodic>;
using checked = trainer<test::mlp_model, my_algorithm, optim::sgd, inproc::communicator>;
[[maybe_unused]] constexpr auto size = sizeof(checked);
