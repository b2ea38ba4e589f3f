// A first parameter that is not a ShardPolicy is named as such.
// expect: the first parameter must model ShardPolicy
#include "fedshard/trainer/algorithm.hpp"

using namespace fedshard;
#ifdef FEDSHARD_COMPILE_OK
using checked = algorithm<shard::replicate, federation::average, schedule::every_step>;
#else
using checked = algorithm<federation::average, federation::average, schedule::every_step>;
#endif
[[maybe_unused]] constexpr auto size = sizeof(checked);
