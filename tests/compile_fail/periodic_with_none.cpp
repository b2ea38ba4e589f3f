// A periodic schedule with federation::none can never sync: algorithm<> refuses it.
// expect: federation::none never syncs, so this schedule would have nothing to schedule
#include "fedshard/trainer/algorithm.hpp"

using namespace fedshard;
#ifdef FEDSHARD_COMPILE_OK
using checked = algorithm<shard::full_shard, federation::average, schedule::periodic>;
#else
using checked = algorithm<shard::full_shard, federation::none, schedule::periodic>;
#endif
[[maybe_unused]] constexpr auto size = sizeof(checked);
