// median in a memory space the host cannot read (a device space) is refused at compile time.
// expect: their memory space must be host-accessible
#include "fedshard/federation/federation_policy.hpp"
#include "fedshard/federation/robust_mean.hpp"
#include "fedshard/space/host_space.hpp"

using namespace fedshard;
/// host_space's buffers and streams, declared unreadable from the host.
struct device_like : space::host_space {
  static constexpr bool host_accessible = false;
};
#ifdef FEDSHARD_COMPILE_OK
using checked = federation::in_space_t<federation::median, space::host_space>;
#else
using checked = federation::in_space_t<federation::median, device_like>;
#endif
[[maybe_unused]] constexpr auto size = sizeof(checked);
