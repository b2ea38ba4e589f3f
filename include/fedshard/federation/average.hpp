#pragma once
/// average: FL+FSDP / FL+HSDP as in the paper: at each sync point the parameter shards are
/// averaged (AVG all_reduce) over the federation axis; inner optimizer moments untouched.

#include <cstddef>
#include <span>
#include <string_view>
#include <vector>

#include "fedshard/federation/federation_policy.hpp"

namespace fedshard::federation {

/// Plain averaging of the groups' parameters.
struct average {
  struct config {
    sync_mode sync = sync_mode::hierarchical;
  };
  static constexpr std::string_view name = "average";
  static constexpr bool syncs = true;
  static constexpr bool uses_weights = false;

  average() = default;
  average(config, std::vector<std::size_t>) {}
  void begin(int, std::span<float>, const sync_info&) {}
  void end(int, std::span<float>, const sync_info&) {}
  void reset(int, std::span<const float>) {}
  std::vector<optim::state_tensor> state() { return {}; }
  bool averages_inner_moments() const { return false; }
};

}  // namespace fedshard::federation
