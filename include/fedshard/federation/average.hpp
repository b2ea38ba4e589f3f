#pragma once
/// average: FL+FSDP / FL+HSDP as in the paper: at each sync point the parameter shards are
/// averaged (AVG all_reduce) over the federation axis; inner optimizer moments untouched.

#include <cstddef>
#include <string_view>
#include <vector>

#include "fedshard/federation/federation_policy.hpp"
#include "fedshard/federation/sync_plan.hpp"

namespace fedshard::federation {

/// Plain averaging of the groups' parameters.
struct average : detail::stateless {
  using config = sync_config;
  static constexpr std::string_view name = "average";
  static constexpr bool syncs = true;
  /// Syncs groups of different shapes too (federation/overlap.hpp).
  static constexpr bool heterogeneous_groups = true;

  average() = default;
  average(config c, std::vector<std::size_t>) : config_(c) {}
  /// The parameters' average (parameter_average_ops).
  plan sync_plan(const sync_context& ctx) const { return parameter_average_ops(ctx, config_.sync); }

 private:
  config config_{};
};

}  // namespace fedshard::federation
