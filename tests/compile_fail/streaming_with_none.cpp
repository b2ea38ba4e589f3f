// Streaming fragments with federation::none would never sync: algorithm<> refuses it.
// expect: federation::none never syncs, so this schedule would have nothing to schedule
#include "fedshard/trainer/algorithm.hpp"

using namespace fedshard;
#ifdef FEDSHARD_COMPILE_OK
using checked = algorithm<shard::hybrid_shard, federation::none, schedule::every_step>;
#else
using checked = algorithm<shard::hybrid_shard, federation::none, schedule::streaming>;
#endif
[[maybe_unused]] constexpr auto size = sizeof(checked);
