#pragma once
/// Test support: the options of the elastic links the Gloo suites make.

#include <chrono>

#include "fedshard/comm/elastic.hpp"
#include "support/gloo_support.hpp"
#include "support/log_sink.hpp"

namespace fedshard::test {

/// A link's options: a join timeout of `join` s (long where nobody should be missing), a
/// transport timeout of `op` s, and the log into sink.
inline elastic::options elastic_options(log_sink& sink, double join = 10.0, double op = 20.0) {
  elastic::options o;
  o.join_timeout = std::chrono::duration<double>(join);
  o.transport = gloo_timeout(op);
  o.log = sink.fn();
  return o;
}

}  // namespace fedshard::test
