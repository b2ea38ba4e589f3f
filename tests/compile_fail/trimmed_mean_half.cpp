// A trimmed mean that would trim half or more from each end is refused, naming median.
// expect: it needs Den > 0 and 0 <= Num / Den < 1/2
#include "fedshard/federation/robust_mean.hpp"

using namespace fedshard;
#ifdef FEDSHARD_COMPILE_OK
using checked = federation::trimmed_mean<1, 3>;
#else
using checked = federation::trimmed_mean<1, 2>;
#endif
[[maybe_unused]] constexpr auto name = checked::name;
