#pragma once
/// Test support: runs a body on N thread-ranks of an inproc world and rethrows the first
/// failure, so one test body can be written for any Communicator.

#include <chrono>
#include <utility>

#include "fedshard/comm/inproc.hpp"

namespace fedshard::test {

/// Runs body(world) on n inproc ranks; rethrows the exception of the rank that failed first.
template <class F>
void spawn_ranks(int n, F&& body, inproc::options opt = {}) {
  inproc::run(n, std::forward<F>(body), opt);
}

/// Options with a short timeout, for tests that provoke hangs on purpose.
inline inproc::options short_timeout(double seconds) {
  inproc::options o;
  o.timeout = std::chrono::duration<double>(seconds);
  return o;
}

}  // namespace fedshard::test
