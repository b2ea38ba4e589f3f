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

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fedshard/error.hpp"

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

namespace detail {
/// splitmix64's finaliser.
inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
}  // namespace detail

/// The participation sample of round `round` among `candidates` (ascending): a seeded
/// shuffle, the first k, ascending.
inline std::vector<int> sample_of(std::vector<int> candidates, const participation& p,
                                  std::int64_t round) {
  check(p);
  const int n = static_cast<int>(candidates.size());
  if (p.fraction >= 1.0 || n == 0) return candidates;
  int k = static_cast<int>(std::ceil(p.fraction * n - 1e-9));
  k = std::clamp(std::max(k, p.min_groups), std::min(1, n), n);
  std::uint64_t s = detail::mix(p.seed ^ detail::mix(static_cast<std::uint64_t>(round)));
  for (int i = n - 1; i > 0; --i) {
    s = detail::mix(s);
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

}  // namespace fedshard::federation
