#pragma once
/// none: groups never combine their models (plain DDP/FSDP/HSDP when there is one group).

#include <cstddef>
#include <span>
#include <string_view>
#include <vector>

#include "fedshard/federation/federation_policy.hpp"

namespace fedshard::federation {

/// No federation: nothing moves on the federation axis.
struct none {
  struct config {
    sync_mode sync = sync_mode::hierarchical;
  };
  static constexpr std::string_view name = "none";
  static constexpr bool syncs = false;
  static constexpr bool uses_weights = false;

  none() = default;
  none(config, std::vector<std::size_t>) {}
  void begin(int, std::span<float>, const sync_info&) {}
  void end(int, std::span<float>, const sync_info&) {}
  void reset(int, std::span<const float>) {}
  std::vector<optim::state_tensor> state() { return {}; }
  bool averages_inner_moments() const { return false; }
};

}  // namespace fedshard::federation
