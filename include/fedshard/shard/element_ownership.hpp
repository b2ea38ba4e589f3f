#pragma once
/// Element ownership: which elements of each unit each of G groups holds (FEAST width slices,
/// Collate's per-round random masks), with no limit on G. shard/ownership.hpp places whole
/// units on at most 64 groups, fixed for the run; this places element ranges, and a source of
/// it (federation/element_average.hpp's config) may give another one every round.
///
/// An element_ownership lists, per group and per unit, a sorted list of disjoint, non-empty
/// element ranges [begin, end) of the unit's flat buffer (elements 0 .. numel-1 of the unit,
/// its tensors back to back: shard/flat_layout.hpp). An empty one (no groups listed) means
/// every group holds every element. check() refuses, with the same invalid_argument on every
/// rank (it reads nothing but its arguments): a count of groups or units that differs from
/// the mesh's and the model's, a range that is empty, unsorted, overlapping, or that runs
/// past the unit's numel.
///
/// An element held by no group is allowed: the sync leaves it at its value on the lowest
/// group, which is its global value when no group changes elements it does not hold (the rule
/// of federation/element_average.hpp). A unit's padding (elements numel .. padded_numel-1) is
/// held by nobody.
///
/// Generators:
///  - feast_slices: group g of capability c_g in (0, 1] holds, of every tensor of every unit,
///    the first k = ceil(c_g x rows) rows, rows = shape[0] (a row is the trailing dimensions:
///    for a weight [out, in] the first k output neurons; for a bias [out] its first k; a
///    scalar is one row). Nested prefixes: few distinct holder sets (at most G + 1 per tensor).
///  - collate_masks: group g holds each block of `block` elements of unit u in round r with
///    probability `fraction`, drawn from core/mix.hpp's mix64 of (seed, r, g, u, block index):
///    a pure function of its arguments, so every rank computes the same masks without any
///    communication, and the masks differ from round to round.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "fedshard/core/mix.hpp"
#include "fedshard/error.hpp"
#include "fedshard/shard/flat_layout.hpp"

namespace fedshard::shard {

/// A half-open range [begin, end) of a unit's elements.
struct element_range {
  std::size_t begin = 0;
  std::size_t end = 0;

  std::size_t size() const noexcept { return end - begin; }
  friend bool operator==(const element_range&, const element_range&) = default;
};

/// The ranges one group holds of one unit: sorted, disjoint, non-empty.
using element_ranges = std::vector<element_range>;

/// Which elements of each unit each group holds; see the file comment.
struct element_ownership {
  /// held[g][u]: the ranges of unit u that group g holds; empty: every group holds all.
  std::vector<std::vector<element_ranges>> held{};

  /// True when every group holds every element (no groups listed).
  bool everyone() const noexcept { return held.empty(); }
  /// The number of groups it was written for (0 when everyone()).
  int groups() const noexcept { return static_cast<int>(held.size()); }

  /// True when group g holds element e of unit u.
  bool holds(int g, std::size_t u, std::size_t e) const {
    if (everyone()) return true;
    for (const element_range& r : held.at(static_cast<std::size_t>(g)).at(u))
      if (e >= r.begin && e < r.end) return true;
    return false;
  }

  /// The elements of unit u that group g holds (numel when everyone()).
  std::size_t held_count(int g, std::size_t u, std::size_t numel) const {
    if (everyone()) return numel;
    std::size_t n = 0;
    for (const element_range& r : held.at(static_cast<std::size_t>(g)).at(u)) n += r.size();
    return n;
  }

  /// invalid_argument (the same on every rank) unless it fits layout's units on G groups:
  /// see the file comment.
  void check(const flat_layout& layout, int G) const {
    if (everyone()) return;
    FEDSHARD_EXPECTS(groups() == G, "element_ownership: it lists the elements of ", groups(),
                     " groups, but the mesh has ", G);
    for (int g = 0; g < G; ++g) {
      const auto& per_unit = held[static_cast<std::size_t>(g)];
      FEDSHARD_EXPECTS(per_unit.size() == layout.num_units(), "element_ownership: group ", g,
                       " lists ranges of ", per_unit.size(), " units, but the model declares ",
                       layout.num_units());
      for (std::size_t u = 0; u < per_unit.size(); ++u)
        check_ranges(per_unit[u], g, layout.unit(u));
    }
  }

 private:
  static void check_ranges(const element_ranges& rs, int g, const unit_layout& unit) {
    std::size_t last_end = 0;
    for (std::size_t i = 0; i < rs.size(); ++i) {
      const element_range& r = rs[i];
      FEDSHARD_EXPECTS(r.begin < r.end, "element_ownership: group ", g, ", unit '", unit.name,
                       "': range ", i, " is [", r.begin, ", ", r.end,
                       "); expected a non-empty range (begin < end)");
      FEDSHARD_EXPECTS(i == 0 || r.begin >= last_end, "element_ownership: group ", g, ", unit '",
                       unit.name, "': range ", i, " [", r.begin, ", ", r.end,
                       ") starts before the end ", last_end,
                       " of the range before it; expected sorted, disjoint ranges");
      FEDSHARD_EXPECTS(r.end <= unit.numel, "element_ownership: group ", g, ", unit '", unit.name,
                       "': range ", i, " [", r.begin, ", ", r.end, ") runs past the unit's ",
                       unit.numel, " elements");
      last_end = r.end;
    }
  }
};

/// Appends [b, e) to rs, merging it with the last range when they touch.
inline void append_range(element_ranges& rs, std::size_t b, std::size_t e) {
  if (b >= e) return;
  if (!rs.empty() && rs.back().end == b)
    rs.back().end = e;
  else
    rs.push_back({b, e});
}

/// FEAST width slices: group g holds the first ceil(capability[g] x rows) rows of every tensor
/// (see the file comment); invalid_argument unless every capability is in (0, 1].
inline element_ownership feast_slices(const flat_layout& layout,
                                      std::span<const double> capability) {
  FEDSHARD_EXPECTS(!capability.empty(),
                   "feast_slices: expected a capability per group, found none");
  element_ownership o;
  for (std::size_t g = 0; g < capability.size(); ++g) {
    const double c = capability[g];
    FEDSHARD_EXPECTS(c > 0 && c <= 1, "feast_slices: group ", g,
                     "'s capability must be in (0, 1], found ", c);
    std::vector<element_ranges> per_unit(layout.num_units());
    for (std::size_t u = 0; u < layout.num_units(); ++u)
      for (const tensor_slot& t : layout.unit(u).tensors) {
        const auto rows =
            t.shape.empty() ? std::size_t{1} : static_cast<std::size_t>(t.shape.front());
        const std::size_t row_len = t.numel / rows;
        const auto k = std::min(rows, static_cast<std::size_t>(std::ceil(c * double(rows))));
        append_range(per_unit[u], t.offset, t.offset + k * row_len);
      }
    o.held.push_back(std::move(per_unit));
  }
  return o;
}

/// The settings of collate_masks.
struct collate_config {
  int groups = 1;          ///< G
  double fraction = 0.5;   ///< probability that a group holds a block, in (0, 1]
  std::uint64_t seed = 0;  ///< the run's seed
  std::size_t block = 1;   ///< elements per block (>= 1): a mask holds whole blocks
};

/// True when group g holds block b of unit u in round `round` (see the file comment).
inline bool collate_holds(const collate_config& c, std::int64_t round, int g, std::size_t u,
                          std::size_t b) noexcept {
  std::uint64_t h = mix64(c.seed);
  h = mix64(h ^ static_cast<std::uint64_t>(round));
  h = mix64(h ^ static_cast<std::uint64_t>(g));
  h = mix64(h ^ static_cast<std::uint64_t>(u));
  h = mix64(h ^ static_cast<std::uint64_t>(b));
  return static_cast<double>(h >> 11) * 0x1p-53 < c.fraction;
}

/// Collate's masks of round `round` (see the file comment); invalid_argument unless G >= 1,
/// fraction is in (0, 1] and block >= 1.
inline element_ownership collate_masks(const flat_layout& layout, const collate_config& c,
                                       std::int64_t round) {
  FEDSHARD_EXPECTS(c.groups >= 1, "collate_masks: expected at least 1 group, found ", c.groups);
  FEDSHARD_EXPECTS(c.fraction > 0 && c.fraction <= 1,
                   "collate_masks: the fraction of blocks a group holds must be in (0, 1], found ",
                   c.fraction);
  FEDSHARD_EXPECTS(c.block >= 1, "collate_masks: a block must hold at least 1 element, found ",
                   c.block);
  element_ownership o;
  o.held.resize(static_cast<std::size_t>(c.groups));
  for (int g = 0; g < c.groups; ++g) {
    auto& per_unit = o.held[static_cast<std::size_t>(g)];
    per_unit.resize(layout.num_units());
    for (std::size_t u = 0; u < layout.num_units(); ++u) {
      const std::size_t n = layout.unit(u).numel;
      for (std::size_t b = 0; b * c.block < n; ++b)
        if (collate_holds(c, round, g, u, b))
          append_range(per_unit[u], b * c.block, std::min(n, (b + 1) * c.block));
    }
  }
  return o;
}

}  // namespace fedshard::shard
