// A shard policy where trainer's algorithm belongs is named as such, with what to write instead.
// expect: A is a shard policy.*Write fedshard::algorithm<A, federation::none, schedule::every_step>
#include "fedshard/comm/inproc.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;
#ifdef FEDSHARD_COMPILE_OK
using checked = trainer<test::mlp_model, fsdp, optim::sgd, inproc::communicator>;
#else
using checked = trainer<test::mlp_model, shard::full_shard, optim::sgd, inproc::communicator>;
#endif
[[maybe_unused]] constexpr auto size = sizeof(checked);
