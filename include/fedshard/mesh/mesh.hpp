#pragma once
/// The G x R x S mesh: G federation groups of R replicas of S shards over any Communicator
/// world, and the communicator of each axis.
///
/// Ranks form contiguous blocks: group g holds world ranks [g*R*S, (g+1)*R*S); inside a group
/// ranks are replica-major, local index l = r*S + s. So world rank = g*R*S + r*S + s.
/// Every axis communicator orders its ranks by the coordinate on that axis: the shard
/// communicator's rank is s, the replica's r, the federation's g and the group's l.
///
/// Groups of different shapes (a heterogeneous mesh, built from one group_shape per group):
/// group g has R_g replicas of S_g shards, world = sum of R_g * S_g, and the groups are still
/// contiguous blocks of world ranks in group order (group g starts at sum_{h<g} R_h * S_h).
/// Inside a group nothing changes: shape() is this rank's group view {G, R_g, S_g}, and the
/// shard, replica and group axes are the group's. The federation axis cannot pair equal
/// shards across groups that cut the model differently; on a heterogeneous mesh it holds the
/// ranks of replica r of every group that has one, ordered by (group, shard): axis rank
/// sum_{h<g, R_h > r} S_h + s. The federation sync (federation/overlap.hpp) runs among the
/// replica-0 ranks whose shards overlap, on sub-communicators of that axis.

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/error.hpp"
#include "fedshard/mesh/axis.hpp"

namespace fedshard {

/// The dimensions of a mesh: groups x replicas x shards.
struct mesh_shape {
  int groups = 1;
  int replicas = 1;
  int shards = 1;

  /// Number of ranks, G * R * S (for a valid shape).
  constexpr int size() const noexcept { return groups * replicas * shards; }
  friend constexpr bool operator==(const mesh_shape&, const mesh_shape&) = default;
};

/// Where a rank sits in the mesh.
struct mesh_coords {
  int group = 0;
  int replica = 0;
  int shard = 0;

  friend constexpr bool operator==(const mesh_coords&, const mesh_coords&) = default;
};

/// One group of a mesh: replicas x shards (R_g x S_g).
struct group_shape {
  int replicas = 1;
  int shards = 1;

  /// Ranks of the group, R_g * S_g.
  constexpr int size() const noexcept { return replicas * shards; }
  friend constexpr bool operator==(const group_shape&, const group_shape&) = default;
};

/// "2x2,1x2": each group's replicas x shards, as the demo's --group-shapes takes it.
inline std::string to_string(const std::vector<group_shape>& groups) {
  std::string s;
  for (std::size_t g = 0; g < groups.size(); ++g)
    s += detail::concat(g ? "," : "", groups[g].replicas, 'x', groups[g].shards);
  return s;
}

/// The group shapes of "RxS,RxS,..." (e.g. "2x2,1x2"); invalid_argument naming the text
/// unless every item is two positive integers joined by 'x'.
inline std::vector<group_shape> parse_group_shapes(const std::string& text) {
  std::vector<group_shape> out;
  std::size_t at = 0;
  while (at <= text.size()) {
    const std::size_t end = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, end - at);
    const std::size_t x = item.find('x');
    int r = 0, s = 0;
    bool ok = x != std::string::npos && x > 0 && x + 1 < item.size();
    for (std::size_t i = 0; ok && i < item.size(); ++i)
      ok = i == x || (item[i] >= '0' && item[i] <= '9');
    if (ok && x <= 6 && item.size() - x - 1 <= 6) {
      r = std::stoi(item.substr(0, x));
      s = std::stoi(item.substr(x + 1));
    }
    FEDSHARD_EXPECTS(r >= 1 && s >= 1, "group shapes: expected RxS with R, S >= 1 per group, ",
                     "comma-separated (e.g. 2x2,1x2), found '", item, "' in '", text, "'");
    out.push_back({r, s});
    at = end + 1;
  }
  return out;
}

/// "GxRxS (groups x replicas x shards)".
inline std::string to_string(const mesh_shape& shape) {
  return detail::concat(shape.groups, 'x', shape.replicas, 'x', shape.shards,
                        " (groups x replicas x shards)");
}

/// "(group g, replica r, shard s)".
inline std::string to_string(const mesh_coords& c) {
  return detail::concat("(group ", c.group, ", replica ", c.replica, ", shard ", c.shard, ')');
}

namespace detail {
/// The shape itself if every dimension is >= 1 and G * R * S equals world_size; otherwise
/// invalid_argument naming the numbers.
inline mesh_shape checked_mesh_shape(const mesh_shape& s, int world_size) {
  FEDSHARD_EXPECTS(s.groups >= 1 && s.replicas >= 1 && s.shards >= 1,
                   "mesh: every dimension must be >= 1, found groups x replicas x shards = ",
                   s.groups, " x ", s.replicas, " x ", s.shards);
  const std::int64_t product = std::int64_t{s.groups} * s.replicas * s.shards;
  FEDSHARD_EXPECTS(product == world_size, "mesh: world size ", world_size,
                   " does not equal groups x replicas x shards = ", s.groups, " x ", s.replicas,
                   " x ", s.shards, " = ", product);
  return s;
}
}  // namespace detail

namespace detail {
/// The shapes themselves if there is at least one group, every dimension is >= 1 and the
/// groups' sizes sum to world_size; otherwise invalid_argument naming the numbers.
inline std::vector<group_shape> checked_group_shapes(std::vector<group_shape> groups,
                                                     int world_size) {
  FEDSHARD_EXPECTS(!groups.empty(), "mesh: expected at least one group shape, found none");
  std::int64_t total = 0;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    FEDSHARD_EXPECTS(
        groups[g].replicas >= 1 && groups[g].shards >= 1, "mesh: group ", g,
        " must have replicas and shards >= 1, found replicas x shards = ", groups[g].replicas,
        " x ", groups[g].shards, " (group shapes ", to_string(groups), ")");
    total += std::int64_t{groups[g].replicas} * groups[g].shards;
  }
  FEDSHARD_EXPECTS(total == world_size, "mesh: world size ", world_size,
                   " does not equal the sum of the groups' replicas x shards (", to_string(groups),
                   ") = ", total);
  return groups;
}

/// The first world rank of each group, and the world size last.
inline std::vector<int> group_starts(const std::vector<group_shape>& groups) {
  std::vector<int> at{0};
  for (const auto& g : groups) at.push_back(at.back() + g.size());
  return at;
}
}  // namespace detail

/// The coordinates of a world rank of a mesh of these groups (see the file comment).
inline mesh_coords coords_of(const std::vector<group_shape>& groups, int world_rank) {
  const auto at = detail::group_starts(groups);
  FEDSHARD_EXPECTS(world_rank >= 0 && world_rank < at.back(), "coords_of: rank must be in [0, ",
                   at.back(), ") for a mesh of groups ", to_string(groups), ", found ", world_rank);
  int g = 0;
  while (at[static_cast<std::size_t>(g) + 1] <= world_rank) ++g;
  const int l = world_rank - at[static_cast<std::size_t>(g)];
  const int S = groups[static_cast<std::size_t>(g)].shards;
  return {g, l / S, l % S};
}

/// The world rank at the given coordinates of a mesh of these groups.
inline int rank_of(const std::vector<group_shape>& groups, mesh_coords c) {
  FEDSHARD_EXPECTS(c.group >= 0 && c.group < static_cast<int>(groups.size()), "rank_of: group ",
                   c.group, " is outside a mesh of ", groups.size(), " groups");
  const group_shape& gs = groups[static_cast<std::size_t>(c.group)];
  FEDSHARD_EXPECTS(c.replica >= 0 && c.replica < gs.replicas && c.shard >= 0 && c.shard < gs.shards,
                   "rank_of: coordinates (", c.group, ", ", c.replica, ", ", c.shard,
                   ") are outside group ", c.group, " of shape ", gs.replicas, 'x', gs.shards);
  return detail::group_starts(groups)[static_cast<std::size_t>(c.group)] + c.replica * gs.shards +
         c.shard;
}

/// The coordinates of a world rank: g = rank / (R*S), r = (rank % (R*S)) / S, s = rank % S.
constexpr mesh_coords coords_of(const mesh_shape& shape, int world_rank) {
  FEDSHARD_EXPECTS(shape.groups >= 1 && shape.replicas >= 1 && shape.shards >= 1,
                   "coords_of: every dimension must be >= 1, found groups x replicas x shards = ",
                   shape.groups, " x ", shape.replicas, " x ", shape.shards);
  FEDSHARD_EXPECTS(world_rank >= 0 && world_rank < shape.size(), "coords_of: rank must be in [0, ",
                   shape.size(), ") for a ", shape.groups, 'x', shape.replicas, 'x', shape.shards,
                   " mesh, found ", world_rank);
  const int per_group = shape.replicas * shape.shards;
  return {world_rank / per_group, (world_rank % per_group) / shape.shards,
          world_rank % shape.shards};
}

/// The world rank at the given coordinates: g*R*S + r*S + s.
constexpr int rank_of(const mesh_shape& shape, mesh_coords c) {
  FEDSHARD_EXPECTS(c.group >= 0 && c.group < shape.groups && c.replica >= 0 &&
                       c.replica < shape.replicas && c.shard >= 0 && c.shard < shape.shards,
                   "rank_of: coordinates (", c.group, ", ", c.replica, ", ", c.shard,
                   ") are outside a ", shape.groups, 'x', shape.replicas, 'x', shape.shards,
                   " mesh");
  return (c.group * shape.replicas + c.replica) * shape.shards + c.shard;
}

/// A world that makes its axes itself (a hybrid world, comm/hybrid.hpp): splits of its
/// group's communicator by color and key, and its federation link.
template <class C>
concept makes_axes = requires(C& c, int color, int key) {
  { c.group_split(color, key) } -> std::same_as<C>;
  { c.federation_link() } -> std::same_as<C>;
};

/// One rank's view of a G x R x S mesh over a world communicator: its coordinates and the
/// communicator of each axis. The world is borrowed (the caller keeps it alive for the
/// mesh's lifetime); the axis communicators are split from it and owned by the mesh.
template <Communicator C>
class mesh {
 public:
  /// Collective over world (4 splits: group, shard, replica, federation). A world size other
  /// than G*R*S, or a dimension < 1, throws invalid_argument on every rank before any split.
  mesh(C& world, mesh_shape shape)
      : mesh(world, mesh_shape{}, uniform_groups(detail::checked_mesh_shape(shape, world.size()))) {
  }

  /// A mesh of groups of different shapes (see the file comment); all groups of one shape
  /// make the same mesh as mesh(world, {G, R, S}). Collective over world; a group with a
  /// dimension < 1, or sizes that do not sum to the world size, throw invalid_argument on
  /// every rank before any split.
  mesh(C& world, std::vector<group_shape> groups)
      : mesh(world, mesh_shape{}, checked_for(world, std::move(groups))) {}

  /// This rank's group view of the mesh: {G, R_g, S_g} (the whole mesh when uniform).
  const mesh_shape& shape() const noexcept { return shape_; }
  /// Every group's replicas x shards, in group order.
  const std::vector<group_shape>& group_shapes() const noexcept { return groups_; }
  /// Group g's view {G, R_g, S_g}.
  mesh_shape group_view(int g) const {
    FEDSHARD_EXPECTS(g >= 0 && g < shape_.groups, "mesh::group_view: group must be in [0, ",
                     shape_.groups, "), found ", g);
    const group_shape& gs = groups_[static_cast<std::size_t>(g)];
    return {shape_.groups, gs.replicas, gs.shards};
  }
  /// True when every group has the same shape (a G x R x S mesh).
  bool uniform() const noexcept { return uniform_; }
  /// This rank's coordinates.
  const mesh_coords& coords() const noexcept { return coords_; }
  /// This rank's index in the world communicator.
  int rank() const noexcept { return world_->rank(); }
  /// Number of ranks in the world, G * R * S (the sum of R_g * S_g).
  int size() const noexcept { return world_size_; }

  /// The world communicator the mesh was built on.
  C& world() noexcept { return *world_; }
  /// The R * S ranks of this rank's group, ordered by local index r*S + s.
  C& group() noexcept { return group_; }
  /// The S ranks with this rank's group and replica, ordered by shard.
  C& shard() noexcept { return shard_; }
  /// The R ranks with this rank's group and shard, ordered by replica.
  C& replica() noexcept { return replica_; }
  /// The G ranks with this rank's replica and shard (mesh[:, r, s]), ordered by group; on a
  /// heterogeneous mesh, replica r of every group that has one (see the file comment).
  C& federation() noexcept { return federation_; }

  /// The communicator of an axis.
  C& comm(axis a) {
    switch (a) {
      case axis::shard: return shard_;
      case axis::replica: return replica_;
      case axis::federation: return federation_;
      case axis::group: return group_;
      case axis::world: return *world_;
    }
    throw invalid_argument(
        detail::concat("fedshard: mesh::comm: unknown axis value ", static_cast<int>(a)));
  }

  /// Number of ranks on an axis: S, R, G, R*S or G*R*S (heterogeneous: S_g, R_g, the
  /// federation ranks of this replica, R_g*S_g or the world).
  int axis_size(axis a) const {
    switch (a) {
      case axis::shard: return shape_.shards;
      case axis::replica: return shape_.replicas;
      case axis::federation: return fed_size_;
      case axis::group: return shape_.replicas * shape_.shards;
      case axis::world: return world_size_;
    }
    throw invalid_argument(
        detail::concat("fedshard: mesh::axis_size: unknown axis value ", static_cast<int>(a)));
  }

  /// This rank's coordinate on an axis, which is its rank in that axis's communicator:
  /// s, r, g, r*S + s or the world rank.
  int axis_rank(axis a) const {
    switch (a) {
      case axis::shard: return coords_.shard;
      case axis::replica: return coords_.replica;
      case axis::federation: return fed_rank_;
      case axis::group: return local_index();
      case axis::world: return world_->rank();
    }
    throw invalid_argument(
        detail::concat("fedshard: mesh::axis_rank: unknown axis value ", static_cast<int>(a)));
  }

  /// Heterogeneous meshes: the federation axis rank of (group g, shard s) among replica r's
  /// ranks (sum_{h<g, R_h > r} S_h + s); on a uniform mesh, g.
  int federation_rank_of(int g, int r, int s) const {
    if (uniform_) return g;
    int k = 0;
    for (int h = 0; h < g; ++h)
      if (groups_[static_cast<std::size_t>(h)].replicas > r)
        k += groups_[static_cast<std::size_t>(h)].shards;
    return k + s;
  }

 private:
  mesh(C& world, mesh_shape, std::vector<group_shape> groups)
      : world_(&world),
        groups_(std::move(groups)),
        uniform_(std::all_of(groups_.begin(), groups_.end(),
                             [&](const group_shape& g) { return g == groups_.front(); })),
        world_size_(detail::group_starts(groups_).back()),
        coords_(coords_of(groups_, world.rank())),
        shape_(view_of(groups_, coords_.group)),
        fed_rank_(federation_rank_of(coords_.group, coords_.replica, coords_.shard)),
        fed_size_(federation_size()),
        group_(split(world, axis::group, coords_.group, local_index())),
        shard_(split(world, axis::shard, first_of_block(coords_.replica, 0), coords_.shard)),
        replica_(split(world, axis::replica, first_of_block(0, coords_.shard), coords_.replica)),
        federation_(split(world, axis::federation, federation_color(), federation_key())) {
    for (axis a : all_axes) check_split(a);
  }

  static std::vector<group_shape> uniform_groups(const mesh_shape& s) {
    return std::vector<group_shape>(static_cast<std::size_t>(s.groups),
                                    group_shape{s.replicas, s.shards});
  }
  /// checked_group_shapes; a world that makes its axes itself takes one shape only.
  static std::vector<group_shape> checked_for(C& world, std::vector<group_shape> groups) {
    groups = detail::checked_group_shapes(std::move(groups), world.size());
    if constexpr (makes_axes<C>)
      FEDSHARD_EXPECTS(std::all_of(groups.begin(), groups.end(),
                                   [&](const group_shape& g) { return g == groups.front(); }),
                       "mesh: a world that makes its axes itself (a hybrid world) takes groups of "
                       "one shape, found group shapes ",
                       to_string(groups));
    return groups;
  }

  static mesh_shape view_of(const std::vector<group_shape>& groups, int g) {
    const group_shape& gs = groups[static_cast<std::size_t>(g)];
    return {static_cast<int>(groups.size()), gs.replicas, gs.shards};
  }
  /// The world rank of (this group, replica r, shard s): a color unique to the block.
  int first_of_block(int r, int s) const {
    return detail::group_starts(groups_)[static_cast<std::size_t>(coords_.group)] +
           r * shape_.shards + s;
  }
  int federation_color() const {
    return uniform_ ? coords_.replica * shape_.shards + coords_.shard : coords_.replica;
  }
  int federation_key() const { return uniform_ ? coords_.group : fed_rank_; }
  int federation_size() const {
    if (uniform_) return shape_.groups;
    int n = 0;
    for (const auto& g : groups_)
      if (g.replicas > coords_.replica) n += g.shards;
    return n;
  }

  int local_index() const noexcept { return coords_.replica * shape_.shards + coords_.shard; }

  /// The communicator of axis a: world.split(color, key), or for a world that makes its axes
  /// itself (a hybrid world: its groups' axes are splits of the group's communicator, its
  /// federation axis is its link, nothing crosses the groups) world.federation_link() for the
  /// federation axis and world.group_split(color, key) for the others.
  static C split(C& world, axis a, int color, int key) {
    if constexpr (makes_axes<C>) {
      if (a == axis::federation) return world.federation_link();
      FEDSHARD_EXPECTS(a != axis::world, "mesh: the world of a hybrid is not split");
      return world.group_split(color, key);
    } else {
      return world.split(color, key);
    }
  }

  /// A backend whose split does not order by key would break every plan: fail loudly.
  void check_split(axis a) {
    C& c = comm(a);
    if (c.size() != axis_size(a) || c.rank() != axis_rank(a))
      throw backend_error(detail::concat(
          "fedshard: mesh: the ", to_string(a), " communicator of world rank ", world_->rank(),
          " in a ", to_string(shape_), " mesh should be rank ", axis_rank(a), " of ", axis_size(a),
          ", the backend's split gave rank ", c.rank(), " of ", c.size()));
  }

  C* world_;
  std::vector<group_shape> groups_;
  bool uniform_ = true;
  int world_size_ = 0;
  mesh_coords coords_;
  mesh_shape shape_;
  int fed_rank_ = 0;
  int fed_size_ = 0;
  C group_;
  C shard_;
  C replica_;
  C federation_;
};

template <class C>
mesh(C&, mesh_shape) -> mesh<C>;
template <class C>
mesh(C&, std::vector<group_shape>) -> mesh<C>;

}  // namespace fedshard
