// A third parameter that is not a SyncSchedule is named as such.
// expect: the third parameter must model SyncSchedule
#include "fedshard/trainer/algorithm.hpp"

using namespace fedshard;
#ifdef FEDSHARD_COMPILE_OK
using checked = algorithm<shard::full_shard, federation::average, schedule::post_local>;
#else
using checked = algorithm<shard::full_shard, federation::average, shard::full_shard>;
#endif
[[maybe_unused]] constexpr auto size = sizeof(checked);
