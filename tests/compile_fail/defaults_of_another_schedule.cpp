// Default settings of another schedule than the algorithm's are refused.
// expect: the fourth parameter must be no_defaults or defaults
#include "fedshard/trainer/algorithm.hpp"

using namespace fedshard;
#ifdef FEDSHARD_COMPILE_OK
using checked = algorithm<shard::full_shard, federation::average, schedule::periodic,
                          defaults<schedule::periodic::config{.period = 4}>>;
#else
using checked = algorithm<shard::full_shard, federation::average, schedule::periodic,
                          defaults<schedule::post_local::config{.switch_step = 2, .k = 4}>>;
#endif
[[maybe_unused]] constexpr auto size = sizeof(checked);
