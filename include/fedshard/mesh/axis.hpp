#pragma once
/// The axes of a mesh: the communicators a plan moves data over.

#include <cstdint>
#include <string_view>

namespace fedshard {

/// An axis of the G x R x S mesh (see mesh/mesh.hpp):
///  - shard: the S ranks of one replica of one group (same group and replica);
///  - replica: the R ranks holding the same shard in one group (same group and shard);
///  - federation: the G ranks holding the same shard of the same replica in every group
///    (mesh[:, r, s]);
///  - group: the R * S ranks of one federation group;
///  - world: all G * R * S ranks.
enum class axis : std::uint8_t { shard, replica, federation, group, world };

/// Every axis, innermost first.
inline constexpr axis all_axes[] = {axis::shard, axis::replica, axis::federation, axis::group,
                                    axis::world};

/// The name of an axis ("shard", "replica", "federation", "group", "world").
constexpr std::string_view to_string(axis a) noexcept {
  switch (a) {
    case axis::shard: return "shard";
    case axis::replica: return "replica";
    case axis::federation: return "federation";
    case axis::group: return "group";
    case axis::world: return "world";
  }
  return "unknown-axis";
}

}  // namespace fedshard
