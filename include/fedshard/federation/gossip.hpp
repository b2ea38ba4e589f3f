#pragma once
/// gossip (GASLoC, arXiv 2606.11081): no global all-reduce. Every sync round each group is
/// matched with one or two random peers (the same matching on every rank, another one each
/// round), takes an outer momentum step on its own anchor, exchanges the stepped model with
/// its peers point to point and mixes.
///
/// With Δ_i = anchor_i − θ_i (group i's pseudo-gradient, as outer_optimizer's) and N(i) the
/// groups i is matched with this round:
///
///   y_i = the outer rule's step on anchor_i with Δ_i       (each group on its own)
///   anchor_i ← y_i − α Σ_{j ∈ N(i)} (y_i − y_j)          (one graph-Laplacian mixing step)
///
/// and the group restarts from its new anchor. This is GASLoC's θ ← (θ + ηg) − α Λ(θ + ηg)
/// with the momentum inside the outer rule: the models are mixed, not the pseudo-gradients,
/// so the groups' disagreement contracts every round (mixing only the Δ would leave the
/// anchors' differences in place for ever). The outer rule is outer_optimizer's own:
/// `nesterov` (DiLoCo's, momentum γ) or, with nesterov = false, `fedmom` (heavy-ball momentum
/// γ; γ = 0 is outer SGD). Each group keeps its own momentum. With the complete graph
/// (degree = gossip_config::complete) and α = 1/G, the new anchor is the mean of the y_i,
/// which is DiLoCo's step on the mean Δ (the rules are linear in Δ and the momentum, and the
/// anchors are equal after every such round): with values whose sums are exact in float
/// (small integers, halves, quarters) bit for bit; otherwise up to the summation order.
///
/// Matchings (gossip_matchings), from a splitmix64 stream seeded by (seed, round) and a
/// Fisher-Yates shuffle π of the G groups (specified here, so every platform draws the same):
///  - degree 1: pairs (π0 π1), (π2 π3), ...; with G odd, π_{G-1} is unmatched that round:
///    it exchanges nothing and keeps its own y;
///  - degree 2: the ring π0 π1 ... π_{G-1} π0, as two matchings (even and odd edges) for G
///    even, three for G odd (the closing edge alone), so every group has exactly 2 peers;
///    for G = 2 the ring is one edge (1 peer), G = 3 is the complete graph;
///  - complete: every pair, as the G − 1 (G even) or G (G odd, one group idle in each)
///    rounds of the circle method; the same every round.
/// A group's exchanges follow the matchings' order; each matching pairs disjoint groups, so
/// when every group runs its exchanges in that order, each one finds its peer at the same
/// matching: nothing waits in a cycle.
///
/// The sync plan (sync_plan, a new plan every round: plan_per_round), for group g:
///  - sync_exchange: one send_recv over the federation axis per peer of g this round (in
///    matching order), role fragment (y_g) -> role gathered, index k (the k-th peer's y);
///    hierarchical: every replica exchanges its 1/R piece, and the replicas all-gather each
///    gathered k at sync_finish; reference: replica 0 exchanges the whole fragment and
///    broadcasts each gathered k to the other replicas at sync_finish.
///  So a round moves degree x B bytes per group on the federation axis (B: the fragment) in
///  degree messages, whatever G; `average`'s ring all-reduce moves 2 (G − 1) / G x B per
///  group, in 2 (G − 1) steps that each wait for the slowest link of the ring.
///
/// State: anchors and momentum per fragment (state(), as outer_optimizer's); the gathered
/// peers' copies, (peers) x numel per fragment, and the Laplacian sum (numel), are sized by
/// begin() from sync_info::groups and are not checkpointed, so a sync restored in flight or
/// communicated cannot be completed (end() without begin() is an invalid_argument, as for
/// median). The round is the synchronizer's (sync_info::round: the fragment's syncs applied
/// so far, which checkpoints keep).
///
/// Memory spaces: the buffers (anchors, momentum, peers' copies, the Laplacian sum) live in
/// memory space S and the mixing runs as element functors (kernels/gossip.hpp) on the sync
/// stream, so nothing waits on the host; tested on host_space and checked_space (held, with
/// host and stream-ordered communicators), not yet on a GPU.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "fedshard/core/buffer.hpp"
#include "fedshard/error.hpp"
#include "fedshard/federation/federation_policy.hpp"
#include "fedshard/federation/outer_optimizer.hpp"
#include "fedshard/federation/outer_rules.hpp"
#include "fedshard/federation/sync_plan.hpp"
#include "fedshard/kernels/gossip.hpp"
#include "fedshard/optim/optimizer.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/space/host_space.hpp"
#include "fedshard/space/memory_space.hpp"

namespace fedshard::federation {

/// The settings of gossip.
struct gossip_config {
  /// The value of `degree` that matches every group with every other one.
  static constexpr int complete = -1;

  sync_mode sync = sync_mode::hierarchical;
  /// Peers per group and round: 1, 2, or complete.
  int degree = 1;
  /// The mixing weight α of each peer's difference, in (0, 1 / peers].
  float alpha = 0.5f;
  /// The outer learning rate η (DiLoCo's 0.7).
  float lr = 0.7f;
  /// The outer momentum γ, in [0, 1).
  float momentum = 0.9f;
  /// Nesterov momentum (DiLoCo's outer step); false: heavy-ball momentum (fedmom).
  bool nesterov = true;
  /// Seeds the matchings (with the round number).
  std::uint64_t seed = 0;
};

namespace detail {

/// splitmix64 (Steele, Lea, Flood 2014): a fixed, portable stream of 64-bit values.
struct splitmix64 {
  std::uint64_t state;
  std::uint64_t next() noexcept {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
};

/// The peers a group has at most in a round of `cfg` on G groups.
inline int max_peers(const gossip_config& cfg, int groups) {
  const int others = std::max(groups - 1, 0);
  return cfg.degree == gossip_config::complete ? others : std::min(cfg.degree, others);
}

/// Throws invalid_argument unless cfg's fields can work (degree, α for degree 1 or 2, the
/// outer rule's lr and momentum).
inline void check_gossip(const gossip_config& cfg) {
  FEDSHARD_EXPECTS(cfg.degree == 1 || cfg.degree == 2 || cfg.degree == gossip_config::complete,
                   "gossip: config.degree must be 1, 2 or gossip_config::complete (-1), found ",
                   cfg.degree);
  FEDSHARD_EXPECTS(std::isfinite(cfg.alpha) && cfg.alpha > 0.0f, "gossip: config.alpha must be a ",
                   "finite number > 0, found ", cfg.alpha);
  if (cfg.degree != gossip_config::complete)
    FEDSHARD_EXPECTS(static_cast<double>(cfg.alpha) * cfg.degree <= 1.0 + 1e-6,
                     "gossip: config.alpha must be in (0, 1/degree] = (0, ", 1.0 / cfg.degree,
                     "] for degree ", cfg.degree, " (each group keeps a weight >= 0), found ",
                     cfg.alpha);
  check_lr("gossip", cfg.lr);
  check_unit_interval("gossip", "momentum", cfg.momentum);
}

/// Throws invalid_argument unless α suits the peers of a round on G groups.
inline void check_gossip_alpha(const gossip_config& cfg, int groups) {
  const int peers = max_peers(cfg, groups);
  if (peers > 0)
    FEDSHARD_EXPECTS(static_cast<double>(cfg.alpha) * peers <= 1.0 + 1e-6,
                     "gossip: config.alpha must be in (0, 1/", peers, "] = (0, ", 1.0 / peers,
                     "] with ", peers, " peers per group (", groups, " groups, degree ",
                     cfg.degree == gossip_config::complete ? std::string("complete")
                                                           : std::to_string(cfg.degree),
                     "), found ", cfg.alpha);
}

}  // namespace detail

/// The matchings of round `round` of cfg on `groups` groups (see the file comment): each a
/// vector of G partners, partner[g] = the group g exchanges with in that matching, or -1.
inline std::vector<std::vector<int>> gossip_matchings(const gossip_config& cfg, int groups,
                                                      std::int64_t round) {
  detail::check_gossip(cfg);
  FEDSHARD_EXPECTS(groups >= 1, "gossip: expected at least one group, found ", groups);
  FEDSHARD_EXPECTS(round >= 0, "gossip: the round must be >= 0, found ", round);
  const auto G = static_cast<std::size_t>(groups);
  std::vector<std::vector<int>> out;
  if (groups < 2) return out;
  auto matching = [&] { return std::vector<int>(G, -1); };
  auto pair = [](std::vector<int>& m, int a, int b) {
    m[static_cast<std::size_t>(a)] = b;
    m[static_cast<std::size_t>(b)] = a;
  };
  if (cfg.degree == gossip_config::complete) {  // circle method, with a bye for G odd
    const int n = groups % 2 == 0 ? groups : groups + 1;
    for (int r = 0; r < n - 1; ++r) {
      auto m = matching();
      for (int k = 0; k < n / 2; ++k) {
        const int a = k == 0 ? n - 1 : (r + k) % (n - 1);
        const int b = (r + n - 1 - k) % (n - 1);
        if (a < groups && b < groups) pair(m, a, b);
      }
      out.push_back(std::move(m));
    }
    return out;
  }
  detail::splitmix64 rng{cfg.seed ^ detail::splitmix64{static_cast<std::uint64_t>(round)}.next()};
  std::vector<int> pi(G);
  for (std::size_t g = 0; g < G; ++g) pi[g] = static_cast<int>(g);
  for (std::size_t i = G - 1; i > 0; --i)
    std::swap(pi[i], pi[static_cast<std::size_t>(rng.next() % (i + 1))]);
  if (cfg.degree == 1 || groups == 2) {
    auto m = matching();
    for (std::size_t k = 0; k + 1 < G; k += 2) pair(m, pi[k], pi[k + 1]);
    out.push_back(std::move(m));
    return out;
  }
  // degree 2: the ring pi[0] .. pi[G-1] pi[0], edge k = (pi[k], pi[k+1 mod G]).
  auto even = matching(), odd = matching();
  for (std::size_t k = 0; k + 1 < G; ++k) pair(k % 2 == 0 ? even : odd, pi[k], pi[k + 1]);
  if (G % 2 == 0) {
    pair(odd, pi[G - 1], pi[0]);
    out.push_back(std::move(even));
    out.push_back(std::move(odd));
  } else {
    auto closing = matching();
    pair(closing, pi[G - 1], pi[0]);
    out.push_back(std::move(even));
    out.push_back(std::move(odd));
    out.push_back(std::move(closing));
  }
  return out;
}

/// Group g's peers in round `round`, in the order it exchanges with them (matching order):
/// index k of role gathered holds the k-th one's pseudo-gradient.
inline std::vector<int> gossip_peers(const gossip_config& cfg, int groups, std::int64_t round,
                                     int group) {
  FEDSHARD_EXPECTS(group >= 0 && group < groups, "gossip: group must be in [0, ", groups,
                   "), found ", group);
  std::vector<int> peers;
  for (const auto& m : gossip_matchings(cfg, groups, round))
    if (const int p = m[static_cast<std::size_t>(group)]; p >= 0) peers.push_back(p);
  return peers;
}

/// The ops of one gossip round for the rank at ctx (see the file comment).
inline plan gossip_ops(const gossip_config& cfg, const sync_context& ctx) {
  const int G = ctx.shape.groups, R = ctx.shape.replicas;
  detail::check_gossip_alpha(cfg, G);
  const bool hierarchical = cfg.sync == sync_mode::hierarchical;
  FEDSHARD_EXPECTS(!hierarchical || ctx.numel % static_cast<std::size_t>(R) == 0,
                   "gossip: a hierarchical sync splits the fragment over ", R,
                   " replicas, but its ", ctx.numel,
                   " elements do not divide evenly (pad it with padded_fragment_numel)");
  const auto peers = gossip_peers(cfg, G, ctx.round, ctx.coords.group);
  const auto bytes = static_cast<std::int64_t>(ctx.numel * sizeof(float));
  plan p;
  for (std::size_t k = 0; k < peers.size(); ++k) {
    comm_op x{.kind = comm_kind::send_recv,
              .axis = axis::federation,
              .dtype = dtype::f32,
              .bytes = hierarchical ? bytes / R : bytes,
              .ranks = G,
              .peer = peers[k],
              .trigger = trigger::sync_exchange,
              .phase = phase::sync,
              .fragment = ctx.fragment,
              .in = {.role = role::fragment},
              .out = {.role = role::gathered, .index = static_cast<int>(k)},
              .overlappable = false};
    if (hierarchical) x.in.piece = x.out.piece = axis::replica;
    if (hierarchical || ctx.coords.replica == 0) p.ops.push_back(x);
  }
  if (R > 1)
    for (std::size_t k = 0; k < peers.size(); ++k) {
      const operand whole{.role = role::gathered, .index = static_cast<int>(k)};
      comm_op share{.kind = hierarchical ? comm_kind::all_gather : comm_kind::broadcast,
                    .axis = axis::replica,
                    .dtype = dtype::f32,
                    .bytes = bytes,
                    .ranks = R,
                    .trigger = trigger::sync_finish,
                    .phase = phase::sync,
                    .fragment = ctx.fragment,
                    .in = {},
                    .out = whole,
                    .overlappable = false};
      if (hierarchical) {
        share.in = whole;
        share.in.piece = axis::replica;
      }
      p.ops.push_back(share);
    }
  return p;
}

/// GASLoC's gossip with the outer rule of outer_optimizer, in memory space S (see the file
/// comment).
template <space::MemorySpace S = space::host_space>
class basic_gossip : public space::same_in_every_space<basic_gossip> {
 public:
  using config = gossip_config;
  static constexpr std::string_view name = "gossip";
  static constexpr bool syncs = true;
  /// The peers change every round: the synchronizer asks for the plan at every sync.
  static constexpr bool plan_per_round = true;

  basic_gossip(config c, std::vector<std::size_t> sizes)
      : basic_gossip(c, std::move(sizes), space::space_ref<S>::make()) {}
  basic_gossip(config c, std::vector<std::size_t> sizes, S& s)
      : basic_gossip(c, std::move(sizes), space::space_ref<S>(s)) {}

  /// This round's exchanges with the group's peers (gossip_ops).
  plan sync_plan(const sync_context& ctx) const { return gossip_ops(config_, ctx); }

  /// Fragment f's copy of the stepped model of its k-th peer this round (role gathered,
  /// index k), in the space's memory; empty before begin() sized it.
  std::span<float> gathered(int f, int k) {
    const std::size_t i = checked(f, "gathered");
    const std::size_t n = sizes_[i];
    FEDSHARD_EXPECTS(k >= 0 && (static_cast<std::size_t>(k) + 1) * n <= gathered_[i].size(),
                     "gossip: fragment ", f, " holds ", n == 0 ? 0 : gathered_[i].size() / n,
                     " peers' copies, asked for copy ", k);
    return gathered_[i].span().subspan(static_cast<std::size_t>(k) * n, n);
  }

  /// buf: θ_g -> y_g, the group's own outer step: Δ_g = anchor − θ_g, then the outer rule's
  /// step on the anchor with Δ_g (outer_optimizer's begin and end); y_g is what the group
  /// sends its peers. Queued on st; sizes the peers' buffers for info.groups.
  void begin(int f, std::span<float> buf, const sync_info& info, typename S::stream& st) {
    const std::size_t i = checked(f, "begin");
    detail::check_gossip_alpha(config_, info.groups);
    const auto want = static_cast<std::size_t>(detail::max_peers(config_, info.groups)) * sizes_[i];
    if (gathered_[i].size() != want) gathered_[i] = space_->template allocate<float>(want);
    if (sum_[i].size() != sizes_[i]) sum_[i] = space_->template allocate<float>(sizes_[i]);
    std::visit(
        [&](auto& o) {
          o.begin(f, buf, info, st);
          o.end(f, buf, info, st);
        },
        outer_);
    pending_[i] = true;
  }
  /// buf: y_g -> y_g − α Σ_k (y_g − peer_k) (summed over the peers in exchange order): the
  /// mixed model, which becomes the group's anchor and its parameters; queued on st.
  void end(int f, std::span<float> buf, const sync_info& info, typename S::stream& st) {
    const std::size_t i = checked(f, "end");
    FEDSHARD_EXPECTS(pending_[i], "gossip: end() of fragment ", f,
                     " without a begin() since the last end(): the peers' models were not "
                     "exchanged by this object (a sync restored from a checkpoint in flight "
                     "cannot be completed)");
    FEDSHARD_EXPECTS(buf.size() == sizes_[i], "gossip: fragment ", f, " has ", sizes_[i],
                     " elements, found a buffer of ", buf.size());
    const auto peers =
        static_cast<int>(gossip_peers(config_, info.groups, info.round, info.group).size());
    if (peers > 0) {
      const std::span<float> sum = sum_[i].span();
      space_->fill(st, view(sum), 0.0);
      for (int k = 0; k < peers; ++k)
        space_->for_each(st, kernels::laplacian_term_update{}, sum, std::span<const float>(buf),
                         std::span<const float>(gathered(f, k)));
      space_->for_each(st, kernels::laplacian_mix_update{config_.alpha}, buf,
                       std::span<const float>(sum));
      space_->copy(st, cview(std::span<const float>(buf)), view(anchor(f)));
    }
    pending_[i] = false;
  }
  /// Fragment f's anchor = params (outer_optimizer's reset), queued on st.
  void reset(int f, std::span<const float> params, typename S::stream& st) {
    std::visit([&](auto& o) { o.reset(f, params, st); }, outer_);
  }
  /// begin(), end() and reset() on a stream of their own, done when they return.
  void begin(int f, std::span<float> buf, const sync_info& info) {
    auto st = space_->make_stream();
    begin(f, buf, info, st);
    space_->synchronize(st);
  }
  void end(int f, std::span<float> buf, const sync_info& info) {
    auto st = space_->make_stream();
    end(f, buf, info, st);
    space_->synchronize(st);
  }
  void reset(int f, std::span<const float> params) {
    auto st = space_->make_stream();
    reset(f, params, st);
    space_->synchronize(st);
  }

  /// The anchors and the momentum, named as outer_optimizer's.
  std::vector<optim::state_tensor> state() {
    return std::visit([](auto& o) { return o.state(); }, outer_);
  }
  /// Outer steps taken by fragment f.
  std::int64_t outer_steps(int f) const {
    return std::visit([&](const auto& o) { return o.outer_steps(f); }, outer_);
  }
  void set_outer_steps(int f, std::int64_t s) {
    std::visit([&](auto& o) { o.set_outer_steps(f, s); }, outer_);
  }
  /// Fragment f's anchor (in the space's memory).
  std::span<float> anchor(int f) {
    return std::visit([&](auto& o) { return o.anchor(f); }, outer_);
  }
  /// The settings.
  const config& settings() const noexcept { return config_; }

 private:
  using nesterov_outer = outer_optimizer<nesterov, S>;
  using heavy_ball_outer = outer_optimizer<fedmom, S>;

  basic_gossip(config c, std::vector<std::size_t> sizes, space::space_ref<S> sr)
      : config_(checked_config(c)),
        space_(std::move(sr)),
        sizes_(std::move(sizes)),
        gathered_(sizes_.size()),
        sum_(sizes_.size()),
        pending_(sizes_.size(), false),
        outer_(make_outer(c, sizes_, *space_)) {}

  static config checked_config(const config& c) {
    detail::check_gossip(c);
    return c;
  }
  static std::variant<nesterov_outer, heavy_ball_outer> make_outer(
      const config& c, const std::vector<std::size_t>& sizes, S& s) {
    if (c.nesterov)
      return std::variant<nesterov_outer, heavy_ball_outer>(
          std::in_place_type<nesterov_outer>,
          typename nesterov_outer::config{.sync = c.sync,
                                          .rule = {.lr = c.lr, .momentum = c.momentum}},
          sizes, s);
    return std::variant<nesterov_outer, heavy_ball_outer>(
        std::in_place_type<heavy_ball_outer>,
        typename heavy_ball_outer::config{.sync = c.sync,
                                          .rule = {.lr = c.lr, .momentum = c.momentum}},
        sizes, s);
  }
  std::size_t checked(int f, const char* what) const {
    FEDSHARD_EXPECTS(f >= 0 && static_cast<std::size_t>(f) < sizes_.size(), "gossip::", what,
                     ": fragment must be in [0, ", sizes_.size(), "), found ", f);
    return static_cast<std::size_t>(f);
  }

  config config_;
  space::space_ref<S> space_;  // before the buffers: they go back to it
  std::vector<std::size_t> sizes_;
  std::vector<typename S::template buffer<float>> gathered_;  // role gathered, per fragment
  std::vector<typename S::template buffer<float>> sum_;       // Σ_k (y − peer_k), per fragment
  std::vector<bool> pending_;  // begin() called, end() not yet, per fragment
  std::variant<nesterov_outer, heavy_ball_outer> outer_;
};

/// GASLoC's gossip (in host memory; gossip::in_space<S> in space S).
using gossip = basic_gossip<>;

}  // namespace fedshard::federation
