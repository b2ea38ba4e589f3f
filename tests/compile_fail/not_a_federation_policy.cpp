// A second parameter that is not a FederationPolicy is named as such.
// expect: the second parameter must model FederationPolicy
#include "fedshard/trainer/algorithm.hpp"

using namespace fedshard;
#ifdef FEDSHARD_COMPILE_OK
using checked = algorithm<shard::replicate, federation::weighted_average, schedule::periodic>;
#else
using checked = algorithm<shard::replicate, schedule::periodic, schedule::periodic>;
#endif
[[maybe_unused]] constexpr auto size = sizeof(checked);
