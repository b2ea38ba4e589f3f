// A federation policy's optional member under a near-miss name is an error naming the member
// meant (capability 11), not a silent no-op.
// expect: has a member `member_set`; did you mean `member_sets\(const mesh_shape&\) const
#include <cstdint>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;
struct my_average : federation::average {
  using federation::average::average;
#ifdef FEDSHARD_COMPILE_OK
  std::vector<std::uint64_t> member_sets(const mesh_shape&) const {
    return {};
  }
#else
  std::vector<std::uint64_t> member_set(const mesh_shape&) const {
    return {};
  }
#endif
};
using my_algorithm = algorithm<shard::full_shard, my_average, schedule::periodic>;
using checked = trainer<test::mlp_model, my_algorithm, optim::sgd, inproc::communicator>;
[[maybe_unused]] constexpr auto size = sizeof(checked);
