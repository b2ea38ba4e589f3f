#pragma once
/// The ShardOptimizer concept: an optimizer that updates one rank's f32 master shard and owns
/// the optimizer state of exactly that shard.
///
/// A ShardOptimizer O provides:
///  1. `O::config`, a default-constructible aggregate of hyper-parameters whose float `lr`
///     is the base (peak) learning rate that the trainer feeds to its LR schedule.
///  2. `O(config, n)`: validates the config (fedshard::invalid_argument naming the bad value)
///     and owns zero-initialised state for a shard of n elements.
///  3. `step(param, grad, lr)`: one update, in place, of the n elements of param
///     (std::span<float>) from grad (std::span<const float>) with learning rate lr (float,
///     from the schedule); throws invalid_argument, before changing anything, unless both
///     spans hold n elements and lr >= 0. param and grad do not overlap.
///  4. Element-wise updates: element i's update reads only param[i], grad[i], element i of
///     each state buffer, step_count() and the hyper-parameters. So a shard split among any
///     number of optimizer objects (ranks) evolves bit for bit as the whole would: this is
///     what lets the state be sharded with the parameters.
///  5. `state()`: a std::vector<state_tensor>, one per state buffer, each of n writable
///     floats, in a fixed order, named as in torch's state_dict (for checkpoints, and for
///     averaging moments across groups as Photon does).
///  6. `step_count()` (std::int64_t): the updates taken so far, torch's state["step"];
///     `set_step_count(s)` (s >= 0) restores it with the state buffers from a checkpoint.
///  7. `size()` (std::size_t): n.
///  8. Movable.
///  9. Memory spaces: `O::in_space<S>` is the same optimizer for shards in the memory space S
///     (space/memory_space.hpp), with `S::config == O::config`: built from (config, n, S&),
///     its state buffers in S, `step(param, grad, lr, stream)` queued on a stream of S; O
///     itself keeps its state in host memory (host_space). A class template over one space
///     declares it by deriving from space::same_in_every_space. An optimizer without
///     in_space runs on host memory only (in_space_t refuses it for other spaces).

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "fedshard/core/state_registry.hpp"
#include "fedshard/space/host_space.hpp"

namespace fedshard::optim {

/// One state buffer of a shard optimizer (its torch state_dict name and the shard's
/// elements) or of a federation policy (its name in fragment `fragment`, the fragment's
/// elements, and how it starts when a checkpoint lacks it).
struct state_tensor {
  std::string name;
  std::span<float> data;
  int fragment = -1;
  state_start missing = state_start::zero;
  /// A federation policy's buffer that every group holds alike at the start of a round
  /// (state_entry::same_in_every_group).
  bool same_in_every_group = false;
};

/// Registers optimizer `o`'s state (core/state_registry.hpp): each buffer as
/// "optimizer.<name>", laid out like the master, and its step count, one group (a buffer
/// missing from a checkpoint restarts the count). to_host(live, host) and
/// from_host(host, live) copy between the space's memory and the host.
template <class O, class ToHost, class FromHost>
void register_state(state_registry& reg, O& o, ToHost to_host, FromHost from_host) {
  reg.add_kind({.prefix = "optimizer.", .noun = "optimizer state"});
  for (const state_tensor& t : o.state())
    reg.add_elements(
        {.name = "optimizer." + t.name, .extent = state_extent::master, .group = "optimizer"},
        t.data.size(), [to_host, d = t.data](std::span<float> h) { to_host(d, h); },
        [from_host, d = t.data](std::span<const float> h) { from_host(h, d); });
  reg.add({.name = "optimizer.step_count",
           .element_size = sizeof(std::int64_t),
           .group = "optimizer",
           .bytes = [] { return sizeof(std::int64_t); },
           .save =
               [&o](std::span<std::byte> out) {
                 const std::int64_t n = o.step_count();
                 std::memcpy(out.data(), &n, sizeof n);
               },
           .load =
               [&o](std::span<const std::byte> in) {
                 std::int64_t n = 0;
                 std::memcpy(&n, in.data(), sizeof n);
                 o.set_step_count(n);
               }});
}

/// An optimizer of one rank's f32 shard with its own sharded state; see the list above.
template <class O>
concept ShardOptimizer = std::movable<O> && std::default_initializable<typename O::config> &&
    std::constructible_from<O, typename O::config, std::size_t> &&
    requires(O& o, const O& co, const typename O::config& c, std::span<float> param,
             std::span<const float> grad, float lr, std::int64_t steps) {
  { c.lr } -> std::convertible_to<float>;
  o.step(param, grad, lr);
  { o.state() } -> std::same_as<std::vector<state_tensor>>;
  { co.step_count() } -> std::same_as<std::int64_t>;
  o.set_step_count(steps);
  { co.size() } -> std::same_as<std::size_t>;
};

namespace detail {
/// An optimizer without in_space<S>: itself, on host memory only.
template <class O, class S>
struct host_only {
  static_assert(std::is_same_v<S, space::host_space>,
                "fedshard::optim::in_space_t: this optimizer has no in_space<S> for this memory "
                "space; it runs on host memory only (give it `template <class S> using in_space`)");
  using type = O;
};
}  // namespace detail

/// Optimizer O for shards in memory space S (requirement 9).
template <class O, class S>
using in_space_t = typename space::in_space_or<O, S, detail::host_only<O, S>>::type;

}  // namespace fedshard::optim
