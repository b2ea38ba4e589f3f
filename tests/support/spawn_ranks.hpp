#pragma once
/// Test support: runs a body on N thread-ranks of an inproc world and rethrows the first
/// failure, so one test body can be written for any Communicator.

#include <chrono>
#include <cstddef>
#include <type_traits>
#include <utility>
#include <vector>

#include "fedshard/comm/inproc.hpp"

namespace fedshard::test {

/// Runs body(world) on n inproc ranks; rethrows the exception of the rank that failed first.
template <class F>
void spawn_ranks(int n, F&& body, inproc::options opt = {}) {
  inproc::run(n, std::forward<F>(body), opt);
}

/// Runs body(world) on n inproc ranks and returns what each rank's body returned, in rank
/// order; rethrows the exception of the rank that failed first.
template <class F>
auto collect_ranks(int n, F&& body, inproc::options opt = {}) {
  std::vector<std::invoke_result_t<F&, inproc::communicator&>> results(static_cast<std::size_t>(n));
  inproc::run(
      n,
      [&](inproc::communicator& c) {
        const auto r = static_cast<std::size_t>(c.rank());
        results[r] = body(c);
      },
      opt);
  return results;
}

/// Options with a short timeout, for tests that provoke hangs on purpose.
inline inproc::options short_timeout(double seconds) {
  inproc::options o;
  o.timeout = std::chrono::duration<double>(seconds);
  return o;
}

}  // namespace fedshard::test
