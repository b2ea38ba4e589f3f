#pragma once
/// none: groups never combine their models (plain DDP/FSDP/HSDP when there is one group).

#include <cstddef>
#include <string_view>
#include <vector>

#include "fedshard/federation/federation_policy.hpp"

namespace fedshard::federation {

/// No federation: nothing moves on the federation axis.
struct none : detail::stateless {
  using config = sync_config;
  static constexpr std::string_view name = "none";
  static constexpr bool syncs = false;

  none() = default;
  none(config, std::vector<std::size_t>) {}
  /// No ops.
  plan sync_plan(const sync_context&) const { return {}; }
};

}  // namespace fedshard::federation
