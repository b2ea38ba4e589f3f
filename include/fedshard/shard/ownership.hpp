#pragma once
/// Ownership masks: which of the G federation groups hold each unit (experts placed on
/// groups, FoMoE; a sub-model per group, FEAST / Collate).
///
/// A group that does not hold a unit allocates nothing for it: the shard engine leaves it out
/// of the master, the gradients, the optimizer state and the step plan, and the model's hooks
/// refuse it (basic_step_context::holds tells the model which units are there). The federation
/// sync averages each unit over its holders only (federation/holder_average.hpp).
///
/// An empty ownership (no units listed) means every group holds every unit. Otherwise it lists
/// one group_set per unit and says for how many groups it was written; check() refuses a
/// unit held by nobody, a group outside [0, G) and a count of units or groups that differs
/// from the model's and the mesh's, with the same invalid_argument on every rank (it reads
/// nothing but its arguments). The assignment is fixed for a run.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/shard/flat_layout.hpp"

namespace fedshard::shard {

/// A set of groups: bit g for group g (so at most 64 groups).
using group_set = std::uint64_t;

/// The set of the listed groups.
inline group_set groups_of(std::initializer_list<int> gs) {
  group_set s = 0;
  for (int g : gs) {
    FEDSHARD_EXPECTS(g >= 0 && g < 64, "groups_of: a group must be in [0, 64), found ", g);
    s |= group_set{1} << g;
  }
  return s;
}

/// Every one of G groups.
constexpr group_set all_groups(int groups) noexcept {
  return groups >= 64 ? ~group_set{0} : (group_set{1} << groups) - 1;
}

/// Which groups hold each unit; see the file comment.
struct ownership {
  int groups = 0;                    ///< G the sets were written for (0 when holders is empty)
  std::vector<group_set> holders{};  ///< per unit, the groups that hold it; empty: all hold all

  /// True when every group holds every unit (no units listed).
  bool everyone() const noexcept { return holders.empty(); }
  /// The groups that hold unit u (all of G when no units are listed).
  group_set holders_of(std::size_t u, int G) const {
    return everyone() ? all_groups(G) : holders.at(u);
  }
  /// True when group g holds unit u.
  bool holds(int g, std::size_t u) const { return everyone() || ((holders.at(u) >> g) & 1u) != 0; }

  /// invalid_argument (the same on every rank) unless the ownership fits `units` units of
  /// `layout` on a mesh of G groups: see the file comment.
  void check(const flat_layout& layout, int G) const {
    if (everyone()) return;
    FEDSHARD_EXPECTS(G >= 1 && G <= 64, "ownership: at most 64 groups, the mesh has ", G);
    FEDSHARD_EXPECTS(groups == G, "ownership: the holders were written for ", groups,
                     " groups, but the mesh has ", G);
    FEDSHARD_EXPECTS(holders.size() == layout.num_units(), "ownership: it lists holders of ",
                     holders.size(), " units, but the model declares ", layout.num_units());
    for (std::size_t u = 0; u < holders.size(); ++u) {
      FEDSHARD_EXPECTS(holders[u] != 0, "ownership: unit ", u, " ('", layout.unit(u).name,
                       "') is held by no group; every unit needs at least one holder");
      FEDSHARD_EXPECTS((holders[u] & ~all_groups(G)) == 0, "ownership: unit ", u, " ('",
                       layout.unit(u).name, "') is held by groups ", group_list(holders[u]),
                       ", but the mesh has groups 0 to ", G - 1, " only");
    }
  }

  /// For each unit, whether group g holds it.
  std::vector<bool> held_by(int g, std::size_t units) const {
    std::vector<bool> h(units);
    for (std::size_t u = 0; u < units; ++u) h[u] = holds(g, u);
    return h;
  }
};

/// Marks a unit absent from a group's storage in held_offsets.
inline constexpr std::size_t not_held = std::numeric_limits<std::size_t>::max();

/// The offset of each unit's shard in a master that holds the shards of the held units back
/// to back in unit order (not_held for the others); held empty: every unit is held (then
/// the offsets are layout.shard_offset). The last entry is the master's size.
inline std::vector<std::size_t> held_offsets(const flat_layout& layout,
                                             const std::vector<bool>& held) {
  std::vector<std::size_t> out(layout.num_units() + 1, not_held);
  std::size_t at = 0;
  for (std::size_t u = 0; u < layout.num_units(); ++u) {
    if (!held.empty() && !held.at(u)) continue;
    out[u] = at;
    at += layout.unit(u).shard_numel;
  }
  out.back() = at;
  return out;
}

}  // namespace fedshard::shard
