#pragma once
/// The memory space of a communicator's buffers, and the communicators whose calls are
/// queued on a stream of their space.
///
/// A communicator names the space of the buffers it accepts with `using memory_space = S;`;
/// without it, its buffers are host memory (host_space: inproc, shaped, mpi). A communicator
/// is stream-ordered in S when its calls run in call order on a stream of S (NCCL,
/// gpu_inproc): `c.after(ev)` makes its later calls wait for event ev of S without the host
/// waiting, and `c.record()` returns an event of S that completes with the calls made so
/// far. The interpreter chains such calls with events; with any other communicator it waits
/// on the host for the work its calls read. Optionally `c.make_space()` returns a
/// std::unique_ptr to a space of its own (a device space bound to c's device, NCCL); without
/// it the trainer default-constructs space_of_t<C> (make_space below: the one place that
/// detects it).

#include <concepts>
#include <memory>
#include <type_traits>

#include "fedshard/core/member_names.hpp"
#include "fedshard/space/host_space.hpp"
#include "fedshard/space/memory_space.hpp"

namespace fedshard::space {

/// The memory space of C's buffers: C::memory_space, else host_space.
FEDSHARD_MEMBER_TYPE_OR(space_of, memory_space, host_space)

/// C's calls are queued on a stream of S, in call order (see the file comment).
template <class C, class S>
concept StreamOrdered = MemorySpace<S> && requires(C& c, const typename S::event& e) {
  c.after(e);
  { c.record() } -> std::same_as<typename S::event>;
};

/// A space for the buffers of communicator c: c.make_space() when it has one (a device
/// space bound to c's device), else a default-constructed space_of_t<C>.
template <class C>
std::unique_ptr<space_of_t<C>> make_space(C& c) {
  if constexpr (requires { c.make_space(); })
    return c.make_space();
  else
    return std::make_unique<space_of_t<C>>();
}

}  // namespace fedshard::space
