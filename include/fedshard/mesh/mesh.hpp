#pragma once
/// The G x R x S mesh: G federation groups of R replicas of S shards over any Communicator
/// world, and the communicator of each axis.
///
/// Ranks form contiguous blocks: group g holds world ranks [g*R*S, (g+1)*R*S); inside a group
/// ranks are replica-major, local index l = r*S + s. So world rank = g*R*S + r*S + s.
/// Every axis communicator orders its ranks by the coordinate on that axis: the shard
/// communicator's rank is s, the replica's r, the federation's g and the group's l.

#include <cstdint>
#include <string>
#include <utility>

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

/// One rank's view of a G x R x S mesh over a world communicator: its coordinates and the
/// communicator of each axis. The world is borrowed (the caller keeps it alive for the
/// mesh's lifetime); the axis communicators are split from it and owned by the mesh.
template <Communicator C>
class mesh {
 public:
  /// Collective over world (4 splits: group, shard, replica, federation). A world size other
  /// than G*R*S, or a dimension < 1, throws invalid_argument on every rank before any split.
  mesh(C& world, mesh_shape shape)
      : world_(&world),
        shape_(detail::checked_mesh_shape(shape, world.size())),
        coords_(coords_of(shape_, world.rank())),
        group_(split(world, axis::group, coords_.group, local_index())),
        shard_(split(world, axis::shard, coords_.group * shape_.replicas + coords_.replica,
                     coords_.shard)),
        replica_(split(world, axis::replica, coords_.group * shape_.shards + coords_.shard,
                       coords_.replica)),
        federation_(split(world, axis::federation, coords_.replica * shape_.shards + coords_.shard,
                          coords_.group)) {
    for (axis a : all_axes) check_split(a);
  }

  /// The mesh's dimensions.
  const mesh_shape& shape() const noexcept { return shape_; }
  /// This rank's coordinates.
  const mesh_coords& coords() const noexcept { return coords_; }
  /// This rank's index in the world communicator.
  int rank() const noexcept { return world_->rank(); }
  /// Number of ranks in the world, G * R * S.
  int size() const noexcept { return shape_.size(); }

  /// The world communicator the mesh was built on.
  C& world() noexcept { return *world_; }
  /// The R * S ranks of this rank's group, ordered by local index r*S + s.
  C& group() noexcept { return group_; }
  /// The S ranks with this rank's group and replica, ordered by shard.
  C& shard() noexcept { return shard_; }
  /// The R ranks with this rank's group and shard, ordered by replica.
  C& replica() noexcept { return replica_; }
  /// The G ranks with this rank's replica and shard (mesh[:, r, s]), ordered by group.
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

  /// Number of ranks on an axis: S, R, G, R*S or G*R*S.
  int axis_size(axis a) const {
    switch (a) {
      case axis::shard: return shape_.shards;
      case axis::replica: return shape_.replicas;
      case axis::federation: return shape_.groups;
      case axis::group: return shape_.replicas * shape_.shards;
      case axis::world: return shape_.size();
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
      case axis::federation: return coords_.group;
      case axis::group: return local_index();
      case axis::world: return world_->rank();
    }
    throw invalid_argument(
        detail::concat("fedshard: mesh::axis_rank: unknown axis value ", static_cast<int>(a)));
  }

 private:
  int local_index() const noexcept { return coords_.replica * shape_.shards + coords_.shard; }

  /// The communicator of axis a: world.split(color, key), or world.mesh_split(a, color, key)
  /// for a world that makes its axes itself (a hybrid world: its groups' axes are splits of
  /// the group's communicator, its federation axis is its link, nothing crosses the groups).
  static C split(C& world, axis a, int color, int key) {
    if constexpr (requires { world.mesh_split(a, color, key); })
      return world.mesh_split(a, color, key);
    else
      return world.split(color, key);
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
  mesh_shape shape_;
  mesh_coords coords_;
  C group_;
  C shard_;
  C replica_;
  C federation_;
};

template <class C>
mesh(C&, mesh_shape) -> mesh<C>;

}  // namespace fedshard
