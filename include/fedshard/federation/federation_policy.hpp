#pragma once
/// The FederationPolicy concept: how the groups' models are combined at a sync point.
///
/// At a sync point of fragment f (a set of units, all units unless the schedule streams) the
/// sync state machine (federation/sync.hpp) packs the rank's master parameters of the
/// fragment into one buffer (role `fragment`), runs the policy's sync plan around the
/// policy's transforms, and mixes the result into the local parameters:
///   sync_prepare ops (e.g. the groups' token counts) -> begin() -> sync_exchange ops (the
///   averaging; may stay in flight across steps) ... sync_finish ops (finish it inside the
///   group) -> end() -> mix in -> sync_after ops (e.g. inner-optimizer moments).
///
/// A FederationPolicy F provides:
///  1. `F::config`, a default-constructible aggregate with a `sync_mode sync` member;
///  2. `F::name`, a std::string_view;
///  3. `F::syncs` (bool): false for a policy that never communicates (none);
///  4. `F(config, fragment_sizes)`: per-fragment state for buffers of those sizes;
///  5. `sync_plan(ctx)` (const): the executable ops of one sync of fragment ctx.fragment for
///     this rank (triggers sync_prepare, sync_exchange, sync_finish, sync_after; roles fragment,
///     moment, tokens, group_tokens); it depends on the config and ctx alone (a policy built
///     for no fragments gives the same plan); sync_plan.hpp has the builders. A policy whose
///     plan changes from one sync to the next (gossip's matchings) reads ctx.round and says
///     so with `static constexpr bool plan_per_round = true` (plan_per_round_v): the sync
///     state machine then asks for the plan at every sync, otherwise once;
///  6. `begin(f, buf, info, stream)`: buf holds the fragment's parameters; turn it into what
///     is averaged (work queued on the stream);
///  7. `end(f, buf, info, stream)`: buf holds the average; turn it into the synchronised
///     parameters;
///  8. `reset(f, params, stream)`: (re)start from these parameters (sets anchors);
///  9. `state()`: anchors and outer-optimizer state (checkpoints, resharding, healing), each
///     buffer an optim::state_tensor laid out like its fragment's buffer: its name within the
///     fragment, the fragment, and how it starts when a checkpoint lacks it (the
///     synchronizer registers each as "federation.fragment<f>.<name>").
/// 10. Memory spaces: F works on host memory (host_space: its buffers and streams);
///     `F::in_space<S>` is the same policy in memory space S, with F's config, built from
///     (config, fragment_sizes, S&) (a class template over one space declares it by deriving
///     from space::same_in_every_space). A policy with no buffers of its own and begin/end/reset
///     templates over the stream type works in any space as it is (in_space_t<F, S> is F).
///
/// Optional capabilities (declared here, detected once in federation::capabilities<F>, each with
/// its default when absent; a member under a near-miss name, or under the right name with
/// another signature, is a compile error naming what was meant, never a silent no-op):
/// 11. `member_sets(const mesh_shape&) const -> std::vector<std::uint64_t>`: the sets of groups
///     (bitmasks) whose sub-communicators the plan's member ops use, split once at the first
///     sync (holder_average). Default: no member ops.
/// 12. `gathered(int f) -> std::span<float>` (robust_mean) or `gathered(int f, int k) ->
///     std::span<float>` (gossip: one buffer per peer k): what role `gathered` (index k) of
///     fragment f's plan names. Default: the plan names no such role.
/// 13. `outer_steps(int f) const -> std::int64_t` with `set_outer_steps(int f, std::int64_t)`:
///     a per-fragment step count saved with the state (outer optimizers' bias corrections).
///     Default: nothing saved.
/// 14. `static constexpr bool plan_per_round` (see 5). Default false.
/// 15. `static constexpr bool heterogeneous_groups`: true when F syncs groups of different
///     shapes (its plan is built from average_ops and weights_ops, begin/end element-wise).
///     Default false.
/// 16. `config::owners` (a shard::ownership): which groups hold which units (holder_average).
///     Default: every group holds every unit.
/// 17. `using sync_codec = C` (a codec::Codec): the cross-group average travels encoded by C
///     (with_codec); sync_codec_t<F> names it. Default: codec::identity (f32 on the wire).

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "fedshard/codec/identity.hpp"
#include "fedshard/core/member_names.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/optimizer.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/shard/flat_layout.hpp"
#include "fedshard/shard/ownership.hpp"
#include "fedshard/space/host_space.hpp"

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

/// A unit packed into a fragment buffer: which one, and how many of its elements (this rank's
/// shard of it); the units lie back to back from element 0, in the order listed.
struct packed_unit {
  int unit = 0;
  std::size_t numel = 0;
};

struct overlap_map;  // federation/overlap.hpp

/// What a policy's sync_plan is planned for: one rank's sync of one fragment.
struct sync_context {
  mesh_shape shape{};
  mesh_coords coords{};
  int fragment = 0;
  std::size_t numel = 0;        ///< f32 elements of the packed (padded) fragment buffer
  int inner_state_buffers = 0;  ///< the inner optimizer's state buffers (role moment 0..n-1)
  /// The units packed in the buffer, in order (the ones this rank's group holds); empty when
  /// the caller does not say.
  std::vector<packed_unit> units{};
  /// The syncs of this fragment started before this one (0 for the first), the same on
  /// every rank; only a policy with plan_per_round reads it.
  std::int64_t round = 0;
  /// On a heterogeneous mesh (groups of different shapes), how every group cuts the model
  /// (federation/overlap.hpp): the averages then exchange overlapping ranges; null on a
  /// uniform mesh.
  std::shared_ptr<const overlap_map> overlap{};
  /// The model's layout, from the synchronizer; null where the caller has none.
  const flat_layout* layout = nullptr;
  /// The dtype average_ops combine in (shard::precision::sync): f32, bf16 or f16.
  dtype reduce = dtype::f32;
};

/// What a policy is told at a sync point.
struct sync_info {
  int fragment = 0;
  int groups = 1;
  int group = 0;  ///< this rank's group
  /// Every group's tokens since the fragment's last sync, when the plan exchanged them
  /// (role group_tokens), else empty.
  std::span<const double> group_tokens{};
  /// Which of the G groups this sync combines (1) and which it leaves out (0), by group;
  /// empty = every group. A federation axis of groups that come and go (elastic::link)
  /// leaves out the groups that are absent, not sampled or rejected: their slots of
  /// group_tokens and of gathered buffers hold zeros, and averages divide by the included
  /// count.
  std::span<const std::uint8_t> included{};
  /// The units packed in the fragment buffer, in order (as sync_context::units).
  std::span<const packed_unit> units{};
  /// The syncs of this fragment started before this one (sync_context::round of its plan).
  std::int64_t round = 0;
  /// This rank's shard of its group (mesh_coords::shard): the buffer holds shard `shard` of
  /// each packed unit (element_average maps it to the units' elements).
  int shard = 0;
  /// The model's layout, from the synchronizer; null where the caller has none.
  const flat_layout* layout = nullptr;

  /// The number of groups combined: the ones in `included`, or all G.
  int included_count() const {
    if (included.empty()) return groups;
    int n = 0;
    for (auto b : included) n += b != 0;
    return n;
  }
  /// True when group g is combined.
  bool includes(int g) const {
    return included.empty() || included[static_cast<std::size_t>(g)] != 0;
  }
};

/// See the numbered requirements above.
template <class F>
concept FederationPolicy = std::default_initializable<typename F::config> &&
    std::constructible_from<F, typename F::config, std::vector<std::size_t>> &&
    requires(F& f, const F& cf, int frag, std::span<float> buf, std::span<const float> cbuf,
             const sync_info& info, const sync_context& ctx, typename F::config c,
             space::host_space::stream& st) {
  { c.sync } -> std::convertible_to<sync_mode>;
  { F::name } -> std::convertible_to<std::string_view>;
  { F::syncs } -> std::convertible_to<bool>;
  { cf.sync_plan(ctx) } -> std::same_as<plan>;
  f.begin(frag, buf, info, st);
  f.end(frag, buf, info, st);
  f.reset(frag, cbuf, st);
  { f.state() } -> std::same_as<std::vector<optim::state_tensor>>;
};

namespace detail {
// The member names capabilities<F> looks for: its own and near misses of them.
FEDSHARD_MEMBER_NAME(member_sets)
FEDSHARD_MEMBER_NAME(member_set)
FEDSHARD_MEMBER_NAME(gathered)
FEDSHARD_MEMBER_NAME(gather)
FEDSHARD_MEMBER_NAME(outer_steps)
FEDSHARD_MEMBER_NAME(outer_step)
FEDSHARD_MEMBER_NAME(set_outer_steps)
FEDSHARD_MEMBER_NAME(set_outer_step)
FEDSHARD_MEMBER_NAME(plan_per_round)
FEDSHARD_MEMBER_NAME(plan_per_rounds)
FEDSHARD_MEMBER_NAME(heterogeneous_groups)
FEDSHARD_MEMBER_NAME(heterogenous_groups)
FEDSHARD_MEMBER_NAME(heterogeneous_group)
FEDSHARD_MEMBER_NAME(owners)
FEDSHARD_MEMBER_NAME(owner)
}  // namespace detail

/// The optional capabilities 11-16 of FederationPolicy F, detected here and nowhere else.
/// Instantiating it (the synchronizer and algorithm<> do) checks F for near-miss names and
/// wrong signatures.
template <class F>
struct capabilities {
  /// 11.
  static constexpr bool member_sets = requires(const F& f, const mesh_shape& s) {
    { f.member_sets(s) } -> std::convertible_to<std::vector<std::uint64_t>>;
  };
  /// 12, the one-buffer form.
  static constexpr bool gathered = requires(F & f, int frag) {
    { f.gathered(frag) } -> std::convertible_to<std::span<float>>;
  };
  /// 12, the per-peer form.
  static constexpr bool gathered_per_peer = requires(F & f, int frag, int k) {
    { f.gathered(frag, k) } -> std::convertible_to<std::span<float>>;
  };
  /// 13.
  static constexpr bool outer_steps = requires(F & f, const F& cf, int frag, std::int64_t n) {
    { cf.outer_steps(frag) } -> std::convertible_to<std::int64_t>;
    f.set_outer_steps(frag, n);
  };
  /// 14.
  static constexpr bool plan_per_round = requires { requires F::plan_per_round; };
  /// 15.
  static constexpr bool heterogeneous_groups = requires { requires F::heterogeneous_groups; };
  /// 16.
  static constexpr bool owners = requires(const typename F::config& c) {
    { c.owners } -> std::convertible_to<shard::ownership>;
  };

  static_assert(!detail::names_member_set<F>,
                "FederationPolicy: the policy has a member `member_set`; did you mean "
                "`member_sets(const mesh_shape&) const -> std::vector<std::uint64_t>` "
                "(capability 11, federation_policy.hpp)?");
  static_assert(!detail::names_member_sets<F> || member_sets,
                "FederationPolicy: the policy's `member_sets` is not callable as "
                "`member_sets(const mesh_shape&) const -> std::vector<std::uint64_t>` "
                "(capability 11): the synchronizer would not call it");
  static_assert(!detail::names_gather<F>,
                "FederationPolicy: the policy has a member `gather`; did you mean `gathered(int "
                "f) -> std::span<float>` or `gathered(int f, int k) -> std::span<float>` "
                "(capability 12, federation_policy.hpp)?");
  static_assert(!detail::names_gathered<F> || gathered || gathered_per_peer,
                "FederationPolicy: the policy's `gathered` is callable neither as `gathered(int "
                "f) -> std::span<float>` nor as `gathered(int f, int k) -> std::span<float>` "
                "(capability 12): role gathered would name no buffer");
  static_assert(!detail::names_outer_step<F> && !detail::names_set_outer_step<F>,
                "FederationPolicy: the policy has a member `outer_step` or `set_outer_step`; did "
                "you mean `outer_steps(int f) const -> std::int64_t` and `set_outer_steps(int f, "
                "std::int64_t)` (capability 13, federation_policy.hpp)?");
  static_assert((!detail::names_outer_steps<F> && !detail::names_set_outer_steps<F>) || outer_steps,
                "FederationPolicy: the policy's `outer_steps` / `set_outer_steps` are not the "
                "pair `outer_steps(int f) const -> std::int64_t` and `set_outer_steps(int f, "
                "std::int64_t)` (capability 13): the step counts would not be saved");
  static_assert(!detail::names_plan_per_rounds<F>,
                "FederationPolicy: the policy has a member `plan_per_rounds`; did you mean "
                "`static constexpr bool plan_per_round` (capability 14)?");
  static_assert(!detail::names_heterogenous_groups<F> && !detail::names_heterogeneous_group<F>,
                "FederationPolicy: the policy has a member `heterogenous_groups` or "
                "`heterogeneous_group`; did you mean `static constexpr bool heterogeneous_groups` "
                "(capability 15)?");
  static_assert(!detail::names_owner<typename F::config>,
                "FederationPolicy: the policy's config has a member `owner`; did you mean "
                "`shard::ownership owners` (capability 16)?");
  static_assert(!detail::names_owners<typename F::config> || owners,
                "FederationPolicy: the policy's config member `owners` is not a "
                "shard::ownership (capability 16): the engine would not place units by it");

  /// True once the checks above compiled: `static_assert(capabilities<F>::checked)` runs them.
  static constexpr bool checked = true;
};

/// True when F can sync a heterogeneous mesh (capability 15).
template <class F>
inline constexpr bool heterogeneous_groups_v = capabilities<F>::heterogeneous_groups;

/// True when F's sync plan depends on sync_context::round (capability 14).
template <class F>
inline constexpr bool plan_per_round_v = capabilities<F>::plan_per_round;

/// Which groups hold which units under a policy of config `c` (capability 16).
template <class F>
shard::ownership owners_of(const typename F::config& c) {
  if constexpr (capabilities<F>::owners)
    return c.owners;
  else
    return {};
}

/// The config of a policy whose only setting is how it syncs (none, average).
struct sync_config {
  sync_mode sync = sync_mode::hierarchical;
};

/// The codec of F's cross-group average (capability 17).
FEDSHARD_MEMBER_TYPE_OR(sync_codec, sync_codec, codec::identity)

/// Policy F in memory space S (requirement 10): F itself when it declares no in_space.
template <class F, class S>
using in_space_t = typename space::in_space_or<F, S, std::type_identity<F>>::type;

namespace detail {
/// A policy without buffers of its own: begin, end and reset change nothing, in any space.
struct stateless {
  template <class Stream>
  void begin(int, std::span<float>, const sync_info&, Stream&) {}
  template <class Stream>
  void end(int, std::span<float>, const sync_info&, Stream&) {}
  template <class Stream>
  void reset(int, std::span<const float>, Stream&) {}
  /// Without a stream (host buffers).
  void begin(int, std::span<float>, const sync_info&) {}
  void end(int, std::span<float>, const sync_info&) {}
  void reset(int, std::span<const float>) {}
  std::vector<optim::state_tensor> state() { return {}; }
};

/// A policy whose begin scales its buffer on a stream of its memory space and whose end and
/// reset change nothing (weighted_average, holder_average): stateless's members, and begin()
/// without a stream (host buffers) on a stream of Self's space, done when it returns. Self
/// provides begin(f, buf, info, stream) and space(), and says `using begins_only::begin;`.
template <class Self>
struct begins_only : stateless {
  using stateless::end;
  using stateless::reset;
  void begin(int f, std::span<float> buf, const sync_info& info) {
    auto& self = static_cast<Self&>(*this);
    auto& s = self.space();
    auto st = s.make_stream();
    self.begin(f, buf, info, st);
    s.synchronize(st);
  }
};
}  // namespace detail

}  // namespace fedshard::federation
