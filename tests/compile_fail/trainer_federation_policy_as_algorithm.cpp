// A federation policy where trainer's algorithm belongs: the message says what to write, and the
// note lists the catalogue's aliases, generated from for_each_algorithm (checked here from
// its first five and last two aliases, in the catalogue's order).
// expect: choose_one_of<.*"ddp, zero2, fsdp, hsdp, fl_fsdp, .*, hofl, lss, fcp, feast, collate"
#include "fedshard/comm/inproc.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;
#ifdef FEDSHARD_COMPILE_OK
using checked = trainer<test::mlp_model, fl_fsdp, optim::sgd, inproc::communicator>;
#else
using checked =
    trainer<test::mlp_model, federation::weighted_average, optim::sgd, inproc::communicator>;
#endif
[[maybe_unused]] constexpr auto size = sizeof(checked);
