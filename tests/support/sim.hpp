#pragma once
/// Fixtures shared by the simulator's tests.

#include <limits>
#include <string>

#include "fedshard/error.hpp"
#include "fedshard/sim/compute.hpp"
#include "fedshard/sim/price.hpp"
#include "fedshard/sim/topology.hpp"
#include "support/error_of.hpp"

namespace fedshard::test {

/// A cluster whose links cost nothing.
inline sim::cluster free_links(sim::cluster c) {
  constexpr double inf = std::numeric_limits<double>::infinity();
  c.intra = {0, inf};
  c.inter = {0, inf};
  c.wan = {0, inf};
  c.nic_bandwidth = inf;
  c.op_latency = 0;
  return c;
}

/// GPT-2 small, 2 sequences of 1024 tokens per GPU.
inline sim::workload small_gpt() {
  return {sim::gpt2_small(), 2, 1024, 0, false};
}

}  // namespace fedshard::test
