// A sync schedule where trainer's algorithm belongs is named as such, with what to write instead.
// expect: A is a sync schedule.*Write fedshard::algorithm<ShardPolicy, FederationPolicy, A>
#include "fedshard/comm/inproc.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/tiny_mlp.hpp"

namespace fs = fedshard;
#ifdef FEDSHARD_COMPILE_OK
using wanted = fs::diloco;  // what the message points to: an algorithm with that schedule
#else
using wanted = fs::schedule::periodic;
#endif
static_assert(
    sizeof(fs::trainer<fs::test::mlp_model, wanted, fs::optim::adamw, fs::inproc::communicator>) >
    0);
