#pragma once
/// Test support: the memory spaces the engine, trainer, federation and checkpoint suites run
/// on, as TEST_CASE_TEMPLATE arguments. Each names a communicator over an inproc world, the
/// memory space of the buffers, and how to make the communicator from the inproc world:
///  - on_host: inproc and host_space, the library's default;
///  - on_checked: inproc with its buffers in a checked_space in hold mode (work queued on a
///    stream runs only once something waits for it), so a missing wait before the host or a
///    collective reads a buffer sees the old values on every run;
///  - on_queued: queued<inproc> (support/queued_comm.hpp), a stream-ordered communicator on
///    checked_space in hold mode: the interpreter takes its NCCL path (chains queued with
///    events, no host waits), so a missing event wait between the compute, gather, reduce,
///    sync and communicator streams fails.

#include <chrono>
#include <string_view>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/space/checked_space.hpp"
#include "fedshard/space/host_space.hpp"
#include "support/queued_comm.hpp"

namespace fedshard::test {

/// checked_options of the test spaces: hold mode, and a timeout that ends a test that would
/// hang (a wait that never completes) within the ctest timeout.
inline space::checked_options held_options() {
  space::checked_options o;
  o.hold = true;
  o.timeout = std::chrono::seconds(60);
  return o;
}

/// A checked_space in hold mode, default-constructible (what a trainer over a host
/// communicator makes for itself).
class held_space : public space::checked_space {
 public:
  held_space() : space::checked_space(held_options()) {}
};

struct on_host {
  static constexpr std::string_view name = "host_space";
  using comm = inproc::communicator;
  using space = fedshard::space::host_space;
  static comm wrap(inproc::communicator& world) { return world.split(0, world.rank()); }
};

struct on_checked {
  static constexpr std::string_view name = "checked_space (hold)";
  using comm = inproc::communicator;
  using space = held_space;
  static comm wrap(inproc::communicator& world) { return world.split(0, world.rank()); }
};

struct on_queued {
  static constexpr std::string_view name = "checked_space (hold), stream-ordered communicator";
  using comm = queued<inproc::communicator>;
  using space = fedshard::space::checked_space;
  static comm wrap(inproc::communicator& world) {
    return comm(world.split(0, world.rank()), held_options());
  }
};

}  // namespace fedshard::test

#define FEDSHARD_TEST_SPACES \
  fedshard::test::on_host, fedshard::test::on_checked, fedshard::test::on_queued
