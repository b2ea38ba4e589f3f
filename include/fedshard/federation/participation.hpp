#pragma once
/// Participation: which groups a federation sync combines (Flower's fraction_fit). A stage of
/// the federation sync, not of a communicator: the sample is drawn here, from the groups that
/// may contribute (every group; in an elastic round, the round's members that are not
/// joiners: federation/heal.hpp), and becomes the mask the sync hands to the policy
/// (sync_info::included) and to the interpreter (interpreter::set_included), which combine
/// only those groups; the others receive the result.
///
/// The sample is a pure function of the candidates, the settings and the round's number, so
/// every rank of every group draws the same one without exchanging anything.
///
/// Screening (robust aggregation) is the stage's second half: the interpreter gathers every
/// group's input of a combining op (interpreter::set_screen) and screen() judges the included
/// ones before they are reduced: a non-finite value (screening::reject_nonfinite), or a
/// distance from the coordinate-wise median of the included inputs above clip_ratio x the
/// median of their distances (with 3 or more of them), leaves a group out of the op and of
/// the rest of the round. One verdict per group on all its shards, the same in every group:
/// each shard's statistics (per group: non-finite count, squared distance) are summed over
/// the group's ranks by the federation axis's agreement (round_hooks::agree; elastic::link's
/// agreed_sum, through the store, since the groups' own axes may be busy with other
/// collectives when the op completes); without one, only groups of one rank screen.
///
/// Limits: without a federation axis with rounds, a group screened out inside a sync is still
/// listed in the sync_info::included that the policy's end() sees (the ops fired after the
/// screen leave it out), and with several fragments in flight the sync_after ops of one use
/// the mask of the fragment started last.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "fedshard/comm/detail/reduction.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/mix.hpp"
#include "fedshard/error.hpp"
#include "fedshard/kernels/cast.hpp"
#include "fedshard/plan/interpreter.hpp"

namespace fedshard::federation {

/// Each round a seeded sample of the candidate groups combines its models:
/// max(min_groups, ceil(fraction x candidates)) of them, at most all; the same sample on
/// every rank.
struct participation {
  double fraction = 1.0;   ///< in (0, 1]; 1: every candidate
  int min_groups = 1;      ///< at least this many (when there are as many candidates)
  std::uint64_t seed = 0;  ///< the run's seed of the samples
};

/// invalid_argument when p cannot be used: fraction outside (0, 1], min_groups < 1.
inline void check(const participation& p) {
  FEDSHARD_EXPECTS(p.fraction > 0 && p.fraction <= 1,
                   "federation::participation: fraction must be in (0, 1], found ", p.fraction);
  FEDSHARD_EXPECTS(p.min_groups >= 1, "federation::participation: min_groups must be >= 1, found ",
                   p.min_groups);
}

/// The participation sample of round `round` among `candidates` (ascending): a seeded
/// shuffle, the first k, ascending.
inline std::vector<int> sample_of(std::vector<int> candidates, const participation& p,
                                  std::int64_t round) {
  check(p);
  const int n = static_cast<int>(candidates.size());
  if (p.fraction >= 1.0 || n == 0) return candidates;
  int k = static_cast<int>(std::ceil(p.fraction * n - 1e-9));
  k = std::clamp(std::max(k, p.min_groups), std::min(1, n), n);
  std::uint64_t s = mix64(p.seed ^ mix64(static_cast<std::uint64_t>(round)));
  for (int i = n - 1; i > 0; --i) {
    s = mix64(s);
    std::swap(candidates[static_cast<std::size_t>(i)],
              candidates[static_cast<std::size_t>(s % static_cast<std::uint64_t>(i + 1))]);
  }
  candidates.resize(static_cast<std::size_t>(k));
  std::sort(candidates.begin(), candidates.end());
  return candidates;
}

/// The sample of round `round` as a mask over `groups` groups (1: combined), drawn among the
/// groups `eligible` marks (empty: all of them).
inline std::vector<std::uint8_t> sampled_mask(int groups, const std::vector<std::uint8_t>& eligible,
                                              const participation& p, std::int64_t round) {
  FEDSHARD_EXPECTS(eligible.empty() || static_cast<int>(eligible.size()) == groups,
                   "federation::sampled_mask: a mask of ", groups, " groups or none, found ",
                   eligible.size());
  std::vector<int> candidates;
  for (int g = 0; g < groups; ++g)
    if (eligible.empty() || eligible[static_cast<std::size_t>(g)] != 0) candidates.push_back(g);
  std::vector<std::uint8_t> m(static_cast<std::size_t>(groups), 0);
  for (int g : sample_of(std::move(candidates), p, round)) m[static_cast<std::size_t>(g)] = 1;
  return m;
}

/// Robust aggregation's settings (see the file comment).
struct screening {
  /// Reject a group whose input holds a NaN or an infinity (it heals in its next round).
  bool reject_nonfinite = true;
  /// Reject a group whose distance from the coordinate-wise median exceeds clip_ratio times
  /// the median distance (0 = off; needs 3 or more included groups). Honest groups trained
  /// on the same task sit at comparable distances (ratios near 1); 3 leaves room for groups
  /// whose data differ, and stops one group sending finite but wild values (x1e6).
  double clip_ratio = 3.0;
  /// Neither check.
  static screening off() { return {.reject_nonfinite = false, .clip_ratio = 0}; }
  bool on() const { return reject_nonfinite || clip_ratio > 0; }
};

/// invalid_argument when s cannot be used: clip_ratio negative or not finite.
inline void check(const screening& s) {
  FEDSHARD_EXPECTS(std::isfinite(s.clip_ratio) && s.clip_ratio >= 0,
                   "federation::screening: clip_ratio must be finite and >= 0, found ",
                   s.clip_ratio);
}

/// What a federation axis with rounds (elastic::link, wired in federation/heal.hpp) offers
/// the participation stage; each member may be empty.
struct round_hooks {
  /// The groups the round combines now, as a mask (its participants, less the groups
  /// dropped or rejected so far); asked at every sync's begin and end and before a screen.
  std::function<std::vector<std::uint8_t>()> included;
  /// The element-wise sum of a vector over the group's ranks, the same on every rank of
  /// every group (each rank of one shard passes the same values); nothing when this group
  /// cannot agree with the others (it is alone in the round).
  std::function<std::optional<std::vector<double>>(const std::vector<double>&)> agree;
  /// Records a verdict: group g leaves the round (why; unhealthy: it heals in its next).
  std::function<void(int, const std::string&, bool)> reject;
};

/// The statistics of the included blocks of `in` (live marks them): [0, G) the non-finite
/// values of each group's block, [G, 2G) with clip_ratio its squared distance from the
/// coordinate-wise median of the live blocks (non-finite values count as 0 in the median).
inline std::vector<double> screen_stats(const gathered_inputs& in,
                                        const std::vector<std::uint8_t>& live, const screening& s) {
  const auto G = static_cast<std::size_t>(in.ranks);
  std::vector<double> st(2 * G, 0.0);
  std::vector<std::size_t> idx;
  for (std::size_t r = 0; r < G; ++r)
    if (live[r] != 0) idx.push_back(r);
  std::vector<double> column(idx.size());
  visit(in.type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto at = [&](std::size_t i, std::int64_t j) {
      T v;
      std::memcpy(&v, in.blocks + i * in.stride + static_cast<std::size_t>(j) * sizeof(T),
                  sizeof(T));
      return static_cast<double>(kernels::operand_fn<T, fedshard::detail::accum_t<T>>{}(v));
    };
    for (std::int64_t j = 0; j < in.count; ++j) {
      std::size_t c = 0;
      for (std::size_t i : idx) {
        const double v = at(i, j);
        if (!std::isfinite(v)) st[i] += 1;
        column[c++] = std::isfinite(v) ? v : 0.0;
      }
      if (s.clip_ratio <= 0) continue;
      auto mid = column.begin() + static_cast<std::ptrdiff_t>(column.size() / 2);
      std::nth_element(column.begin(), mid, column.end());
      const double median = *mid;
      for (std::size_t i : idx) {
        const double v = at(i, j);
        if (std::isfinite(v)) st[G + i] += (v - median) * (v - median);
      }
    }
  });
  return st;
}

/// A group screening leaves out, and why.
struct rejection {
  int group = -1;
  std::string reason;
  bool unhealthy = false;  ///< rejected for non-finite values: it heals in its next round
};

/// The live groups whose group-wide statistics (screen_stats' layout, summed over the
/// group's ranks) fail the settings, in ascending order.
inline std::vector<rejection> judge(const std::vector<std::uint8_t>& live,
                                    const std::vector<double>& st, const screening& s) {
  const std::size_t G = live.size();
  std::vector<double> norms;
  std::size_t n_live = 0;
  for (std::size_t g = 0; g < G; ++g) {
    if (live[g] == 0) continue;
    ++n_live;
    if (st[g] == 0) norms.push_back(std::sqrt(st[G + g]));
  }
  double median_norm = 0;
  if (!norms.empty()) {
    std::sort(norms.begin(), norms.end());
    median_norm = norms[norms.size() / 2];
  }
  std::vector<rejection> out;
  for (std::size_t g = 0; g < G; ++g) {
    if (live[g] == 0) continue;
    const double norm = std::sqrt(st[G + g]);
    if (s.reject_nonfinite && st[g] > 0)
      out.push_back(
          {static_cast<int>(g),
           fedshard::detail::concat(st[g], " non-finite value(s); it heals in its next round"),
           true});
    else if (s.clip_ratio > 0 && n_live >= 3 && median_norm > 0 &&
             norm > s.clip_ratio * median_norm)
      out.push_back({static_cast<int>(g),
                     fedshard::detail::concat("update norm ", norm, " > clip_ratio ", s.clip_ratio,
                                              " x median ", median_norm),
                     false});
  }
  return out;
}

/// The screening stage of one gathered op (see the file comment): narrows `included` to the
/// round's current groups (hooks.included), then leaves out the groups judge() rejects,
/// reporting each to hooks.reject. A group that cannot agree (hooks.agree gives nothing)
/// screens nothing and takes the round's groups as they are now.
inline void screen(const gathered_inputs& in, std::vector<std::uint8_t>& included,
                   const screening& s, const round_hooks& hooks) {
  const auto narrow = [&] {
    if (!hooks.included) return;
    const auto now = hooks.included();
    for (std::size_t g = 0; g < included.size() && g < now.size(); ++g)
      included[g] = included[g] != 0 && now[g] != 0;
  };
  narrow();
  if (!s.on() || std::none_of(included.begin(), included.end(), [](auto b) { return b != 0; }))
    return;
  auto st = screen_stats(in, included, s);
  if (hooks.agree) {
    auto agreed = hooks.agree(st);
    if (!agreed || agreed->size() != st.size()) {
      narrow();
      return;
    }
    st = std::move(*agreed);
  }
  for (const rejection& r : judge(included, st, s)) {
    included[static_cast<std::size_t>(r.group)] = 0;
    if (hooks.reject) hooks.reject(r.group, r.reason, r.unhealthy);
  }
}

}  // namespace fedshard::federation
