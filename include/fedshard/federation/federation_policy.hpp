#pragma once
/// The FederationPolicy concept: how the groups' models are combined at a sync point.
///
/// At a sync point of fragment f (a set of units, all units unless the schedule streams) the
/// trainer copies the rank's master parameters of the fragment into one buffer, lets the
/// policy turn them into the values to average (begin), averages that buffer over the
/// federation axis (mesh[:, r, s]), lets the policy turn the average into the synchronised
/// parameters (end), and mixes those into the local parameters.
///
/// A FederationPolicy F provides:
///  1. `F::config`, a default-constructible aggregate with a `sync_mode sync` member;
///  2. `F::name`, a std::string_view;
///  3. `F::syncs` (bool): false for a policy that never communicates (none);
///  4. `F::uses_weights` (bool): true when begin() needs sync_info::weight_scale;
///  5. `F(config, fragment_sizes)`: per-fragment state for buffers of those sizes;
///  6. `begin(f, buf, info)`: buf holds the fragment's parameters; turn it into what is
///     averaged;
///  7. `end(f, buf, info)`: buf holds the average; turn it into the synchronised parameters;
///  8. `reset(f, params)`: (re)start from these parameters (sets anchors);
///  9. `state()`: anchors and outer-optimizer state as named buffers (checkpoints);
/// 10. `averages_inner_moments()`: true when the inner optimizer's state is averaged too.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "fedshard/optim/optimizer.hpp"

namespace fedshard::federation {

/// How a fragment is averaged when a group has R > 1 replicas.
enum class sync_mode : std::uint8_t {
  /// Each of the R replicas all-reduces 1/R of the buffer across groups, then the replicas
  /// all-gather: every replica's links carry a share; R times fewer inter-group bytes per rank.
  hierarchical,
  /// As the reference code: replica 0 all-reduces the whole buffer across groups and
  /// broadcasts it to the other replicas.
  reference,
};

constexpr std::string_view to_string(sync_mode m) noexcept {
  return m == sync_mode::hierarchical ? "hierarchical" : "reference";
}

/// What a policy is told at a sync point.
struct sync_info {
  int fragment = 0;
  int groups = 1;
  /// G * w_g / sum of w: this group's weight relative to the plain mean (1 when equal).
  double weight_scale = 1.0;
};

/// See the numbered requirements above.
template <class F>
concept FederationPolicy = std::default_initializable<typename F::config> &&
    std::constructible_from<F, typename F::config, std::vector<std::size_t>> &&
    requires(F& f, const F& cf, int frag, std::span<float> buf, std::span<const float> cbuf,
             const sync_info& info, typename F::config c) {
  { c.sync } -> std::convertible_to<sync_mode>;
  { F::name } -> std::convertible_to<std::string_view>;
  { F::syncs } -> std::convertible_to<bool>;
  { F::uses_weights } -> std::convertible_to<bool>;
  f.begin(frag, buf, info);
  f.end(frag, buf, info);
  f.reset(frag, cbuf);
  { f.state() } -> std::same_as<std::vector<optim::state_tensor>>;
  { cf.averages_inner_moments() } -> std::same_as<bool>;
};

}  // namespace fedshard::federation
