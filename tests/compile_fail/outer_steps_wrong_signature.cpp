// A federation policy's step counter under the right name with another signature (no fragment)
// is an error saying the pair the library calls (capability 13), not state left unsaved.
// expect: `outer_steps` / `set_outer_steps` are not the pair `outer_steps\(int f\) const
#include <cstdint>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;
struct my_average : federation::average {
  using federation::average::average;
#ifdef FEDSHARD_COMPILE_OK
  std::int64_t outer_steps(int) const {
    return steps;
  }
  void set_outer_steps(int, std::int64_t s) {
    steps = s;
  }
#else
  std::int64_t outer_steps() const {
    return steps;
  }
  void set_outer_steps(std::int64_t s) {
    steps = s;
  }
#endif
  std::int64_t steps = 0;
};
using my_algorithm = algorithm<shard::full_shard, my_average, schedule::periodic>;
using checked = trainer<test::mlp_model, my_algorithm, optim::sgd, inproc::communicator>;
[[maybe_unused]] constexpr auto size = sizeof(checked);
