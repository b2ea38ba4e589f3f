// trainer's Algorithm parameter is constrained by the Algorithm concept.
// expect: required for the satisfaction of .*Algorithm<A>
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
