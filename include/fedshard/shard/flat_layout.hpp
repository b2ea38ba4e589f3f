#pragma once
/// The flat layout of a model's parameters: tensors grouped into units (one unit = one
/// all-gather, e.g. one layer), one flat buffer per unit, cut into S equal shards.
///
/// Rules:
///  1. The tensors of a unit share one dtype and are packed back to back in declaration
///     order, without gaps; the unit's padding is at its end only.
///  2. shard_numel = ceil(numel / S) rounded up to a multiple of 64 / size_of(dtype) elements;
///     padded_numel = S * shard_numel. So in a 64-byte aligned unit buffer every shard starts
///     on a 64-byte boundary, and padded_numel - numel < S * 64 / size_of(dtype).
///  3. Shard s of a unit is the element range [s * shard_numel, (s + 1) * shard_numel).
///  4. Padding is zero: it belongs to no tensor, so no tensor view ever reads or writes it.
/// All offsets and sizes are in elements. The alignment of rule 2 holds for any element type
/// at least as wide as the unit's dtype (e.g. an f32 master copy of a bf16 unit).
///
/// Names: unit names are unique; tensor names are unique inside their unit, and a tensor's
/// qualified name "unit.tensor" is unique in the layout.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/config.hpp"
#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/error.hpp"
#include "fedshard/mesh/axis.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/plan/start_op.hpp"

namespace fedshard {

/// A tensor to lay out: its name, shape (row-major; {} is a scalar) and element type.
struct tensor_spec {
  std::string name;
  std::vector<std::int64_t> shape;
  dtype type = dtype::f32;
};

/// A unit: the tensors gathered together by one all-gather.
struct unit_spec {
  std::string name;
  std::vector<tensor_spec> tensors;
};

/// Where a tensor lives inside its unit's flat buffer.
struct tensor_slot {
  std::string name;
  std::vector<std::int64_t> shape;
  std::size_t numel = 0;
  /// Elements from the start of the unit's flat buffer.
  std::size_t offset = 0;
};

/// The flat buffer of one unit.
struct unit_layout {
  std::string name;
  dtype type = dtype::f32;
  std::vector<tensor_slot> tensors;
  /// Sum of the tensors' element counts.
  std::size_t numel = 0;
  /// numel plus the zero padding at the end: shards() * shard_numel.
  std::size_t padded_numel = 0;
  /// Elements per shard.
  std::size_t shard_numel = 0;
};

/// A half-open element range [begin, end).
struct shard_range {
  std::size_t begin = 0;
  std::size_t end = 0;

  std::size_t size() const noexcept { return end - begin; }
  friend bool operator==(const shard_range&, const shard_range&) = default;
};

namespace detail {

/// Largest element count a layout accepts: every byte count then fits in std::int64_t,
/// the count type of communicators.
inline std::size_t max_numel(dtype t) {
  return static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max()) / size_of(t);
}

/// "[d0, d1, ...]".
inline std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += concat(i ? ", " : "", shape[i]);
  return s + "]";
}

/// "0x" and 16 hex digits.
inline std::string hex64(std::uint64_t v) {
  char buf[19];
  std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

/// 64-bit FNV-1a.
class fnv1a {
 public:
  void bytes(const void* p, std::size_t n) noexcept {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i) h_ = (h_ ^ b[i]) * 0x100000001b3ull;
  }
  void u64(std::uint64_t v) noexcept {
    for (int i = 0; i < 8; ++i) {
      const auto b = static_cast<unsigned char>(v >> (8 * i));
      bytes(&b, 1);
    }
  }
  /// Length-prefixed, so that ("ab", "c") and ("a", "bc") differ.
  void str(std::string_view s) noexcept {
    u64(s.size());
    bytes(s.data(), s.size());
  }
  std::uint64_t value() const noexcept { return h_; }

 private:
  std::uint64_t h_ = 0xcbf29ce484222325ull;
};

}  // namespace detail

/// The flat layout of a list of units over S shards; see the rules above.
class flat_layout {
 public:
  /// Lays out the units over `shards` shards. Throws invalid_argument (naming the unit,
  /// tensor and values) for: shards < 1, no units, a unit without tensors, an empty or
  /// duplicate name, a dimension <= 0, mixed dtypes in a unit, or an element count too big.
  flat_layout(std::vector<unit_spec> units, int shards) : shards_(shards) {
    FEDSHARD_EXPECTS(shards >= 1, "flat_layout: the number of shards must be >= 1, found ", shards);
    FEDSHARD_EXPECTS(!units.empty(), "flat_layout: expected at least one unit, found none");
    units_.reserve(units.size());
    for (std::size_t u = 0; u < units.size(); ++u) add_unit(u, std::move(units[u]));
    fingerprint_ = compute_fingerprint();
  }

  /// Number of shards S.
  int shards() const noexcept { return shards_; }
  /// Number of units.
  std::size_t num_units() const noexcept { return units_.size(); }
  /// The layout of unit u.
  const unit_layout& unit(std::size_t u) const {
    check_unit(u, "unit");
    return units_[u];
  }
  /// Every unit, in declaration order.
  std::span<const unit_layout> units() const noexcept { return units_; }

  /// Shard s of unit u: [s * shard_numel, (s + 1) * shard_numel) of its flat buffer.
  shard_range shard_of(std::size_t u, int s) const {
    check_unit(u, "shard_of");
    FEDSHARD_EXPECTS(s >= 0 && s < shards_, "flat_layout::shard_of: shard index must be in [0, ",
                     shards_, "), found ", s);
    const std::size_t n = units_[u].shard_numel;
    return {static_cast<std::size_t>(s) * n, static_cast<std::size_t>(s + 1) * n};
  }

  /// Sum of the units' numel.
  std::size_t total_numel() const noexcept { return total_numel_; }
  /// Sum of the units' padded_numel.
  std::size_t total_padded_numel() const noexcept { return total_padded_; }
  /// Sum of the units' shard_numel: the size of one rank's shards of all units.
  std::size_t total_shard_numel() const noexcept { return total_shard_; }
  /// Offset of unit u's shard in a rank's buffer holding its shards of all units back to back.
  std::size_t shard_offset(std::size_t u) const {
    check_unit(u, "shard_offset");
    return shard_offsets_[u];
  }
  /// Offset of unit u in a buffer holding all padded units back to back.
  std::size_t unit_offset(std::size_t u) const {
    check_unit(u, "unit_offset");
    return unit_offsets_[u];
  }

  /// The (unit, tensor index) of a tensor, by qualified name "unit.tensor" or, failing that,
  /// by a tensor name used in one unit only; nullopt if there is none. A bare name used in
  /// several units throws invalid_argument naming them.
  std::optional<std::pair<std::size_t, std::size_t>> find(std::string_view name) const {
    if (auto it = by_qualified_.find(name); it != by_qualified_.end()) return it->second;
    const auto [first, last] = by_name_.equal_range(name);
    if (first == last) return std::nullopt;
    if (std::next(first) != last) {
      std::string where;
      for (auto it = first; it != last; ++it)
        where += detail::concat(where.empty() ? "'" : ", '", units_[it->second.first].name, "'");
      FEDSHARD_EXPECTS(std::next(first) == last, "flat_layout::find: tensor name '", name,
                       "' is ambiguous, it is in units ", where,
                       "; ask for the qualified name 'unit.tensor'");
    }
    return first->second;
  }
  /// The (unit, tensor index) of tensor `tensor` of unit `unit`, or nullopt.
  std::optional<std::pair<std::size_t, std::size_t>> find(std::string_view unit,
                                                          std::string_view tensor) const {
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if (units_[u].name != unit) continue;
      for (std::size_t t = 0; t < units_[u].tensors.size(); ++t)
        if (units_[u].tensors[t].name == tensor) return std::pair{u, t};
    }
    return std::nullopt;
  }

  /// FNV-1a over S and every unit's name and dtype and every tensor's name and shape: equal
  /// layouts have equal fingerprints, and different ones differ (up to hash collisions).
  std::uint64_t fingerprint() const noexcept { return fingerprint_; }

  /// A one-line summary: S, unit count, element totals and fingerprint.
  std::string summary() const {
    return detail::concat("S = ", shards_, ", ", units_.size(), " units, ", total_numel_,
                          " elements (", total_padded_, " padded, ", total_shard_,
                          " per shard), fingerprint ", detail::hex64(fingerprint_));
  }

  /// A human-readable summary: the totals, then every unit and tensor with its offsets.
  std::string describe() const {
    std::string s = detail::concat("flat_layout: ", summary(), '\n');
    for (std::size_t u = 0; u < units_.size(); ++u) {
      const unit_layout& ul = units_[u];
      s += detail::concat("  unit ", u, " '", ul.name, "' ", to_string(ul.type), ": ",
                          ul.tensors.size(), " tensors, ", ul.numel, " elements, padded ",
                          ul.padded_numel, ", shard ", ul.shard_numel, '\n');
      for (const tensor_slot& t : ul.tensors)
        s += detail::concat("    ", t.name, ' ', detail::shape_string(t.shape), " at ", t.offset,
                            " (", t.numel, " elements)\n");
    }
    return s;
  }

  /// The elements of tensor t of unit u inside unit_buffer, the unit's flat buffer
  /// (unit_buffer.size() must be the unit's padded_numel).
  template <class T>
  std::span<T> tensor_view(std::span<T> unit_buffer, std::size_t u, std::size_t t) const {
    check_unit(u, "tensor_view");
    const unit_layout& ul = units_[u];
    FEDSHARD_EXPECTS(t < ul.tensors.size(), "flat_layout::tensor_view: unit '", ul.name, "' has ",
                     ul.tensors.size(), " tensors, asked for tensor ", t);
    FEDSHARD_EXPECTS(unit_buffer.size() == ul.padded_numel, "flat_layout::tensor_view: unit '",
                     ul.name, "' needs a buffer of padded_numel = ", ul.padded_numel,
                     " elements, found ", unit_buffer.size());
    return unit_buffer.subspan(ul.tensors[t].offset, ul.tensors[t].numel);
  }

  /// Same S and the same units, names, dtypes and shapes in the same order.
  friend bool operator==(const flat_layout& a, const flat_layout& b) {
    if (a.shards_ != b.shards_ || a.units_.size() != b.units_.size()) return false;
    for (std::size_t u = 0; u < a.units_.size(); ++u) {
      const unit_layout& x = a.units_[u];
      const unit_layout& y = b.units_[u];
      if (x.name != y.name || x.type != y.type || x.tensors.size() != y.tensors.size())
        return false;
      for (std::size_t t = 0; t < x.tensors.size(); ++t)
        if (x.tensors[t].name != y.tensors[t].name || x.tensors[t].shape != y.tensors[t].shape)
          return false;
    }
    return true;
  }

 private:
  void check_unit(std::size_t u, const char* what) const {
    FEDSHARD_EXPECTS(u < units_.size(), "flat_layout::", what, ": unit index must be in [0, ",
                     units_.size(), "), found ", u);
  }

  void add_unit(std::size_t u, unit_spec spec) {
    FEDSHARD_EXPECTS(!spec.name.empty(), "flat_layout: unit ", u, " has an empty name");
    for (const unit_layout& other : units_)
      FEDSHARD_EXPECTS(other.name != spec.name, "flat_layout: unit name '", spec.name,
                       "' is used twice (units ", &other - units_.data(), " and ", u, ")");
    FEDSHARD_EXPECTS(!spec.tensors.empty(), "flat_layout: unit '", spec.name,
                     "' has no tensors, expected at least one");

    unit_layout ul;
    ul.name = std::move(spec.name);
    ul.type = spec.tensors.front().type;
    FEDSHARD_EXPECTS(is_valid(ul.type), "flat_layout: tensor '", spec.tensors.front().name,
                     "' of unit '", ul.name, "' has an invalid dtype value ",
                     static_cast<int>(ul.type));
    const std::size_t limit = detail::max_numel(ul.type);
    ul.tensors.reserve(spec.tensors.size());
    for (tensor_spec& ts : spec.tensors) {
      FEDSHARD_EXPECTS(!ts.name.empty(), "flat_layout: tensor ", ul.tensors.size(), " of unit '",
                       ul.name, "' has an empty name");
      for (const tensor_slot& other : ul.tensors)
        FEDSHARD_EXPECTS(other.name != ts.name, "flat_layout: tensor name '", ts.name,
                         "' is used twice in unit '", ul.name, "'");
      FEDSHARD_EXPECTS(ts.type == ul.type, "flat_layout: the tensors of a unit must share one ",
                       "dtype; unit '", ul.name, "' has tensor '", ul.tensors.front().name, "' of ",
                       to_string(ul.type), " and tensor '", ts.name, "' of ",
                       is_valid(ts.type) ? to_string(ts.type) : "an invalid dtype");
      std::size_t numel = 1;
      for (std::int64_t d : ts.shape) {
        FEDSHARD_EXPECTS(d > 0, "flat_layout: every dimension must be >= 1; tensor '", ts.name,
                         "' of unit '", ul.name, "' has shape ", detail::shape_string(ts.shape));
        FEDSHARD_EXPECTS(static_cast<std::size_t>(d) <= limit / numel, "flat_layout: tensor '",
                         ts.name, "' of unit '", ul.name, "' with shape ",
                         detail::shape_string(ts.shape), " has more than ", limit, " elements of ",
                         to_string(ul.type));
        numel *= static_cast<std::size_t>(d);
      }
      FEDSHARD_EXPECTS(numel <= limit - ul.numel, "flat_layout: unit '", ul.name,
                       "' has more than ", limit, " elements of ", to_string(ul.type),
                       " (at tensor '", ts.name, "')");
      std::string qualified = ul.name + "." + ts.name;
      if (const auto clash = by_qualified_.find(qualified); clash != by_qualified_.end()) {
        const auto [cu, ct] = clash->second;
        FEDSHARD_EXPECTS(clash == by_qualified_.end(), "flat_layout: tensor '", ts.name,
                         "' of unit '", ul.name, "' and tensor '", units_[cu].tensors[ct].name,
                         "' of unit '", units_[cu].name, "' have the same qualified name '",
                         qualified, "'");
      }
      by_qualified_.emplace(std::move(qualified), std::pair{u, ul.tensors.size()});
      by_name_.emplace(ts.name, std::pair{u, ul.tensors.size()});
      ul.tensors.push_back({std::move(ts.name), std::move(ts.shape), numel, ul.numel});
      ul.numel += numel;
    }

    const std::size_t align = cache_line_bytes / size_of(ul.type);
    const auto s = static_cast<std::size_t>(shards_);
    const std::size_t per_shard = ul.numel / s + (ul.numel % s != 0);
    const std::size_t max_shard = (limit / s) / align * align;
    FEDSHARD_EXPECTS(per_shard <= max_shard, "flat_layout: unit '", ul.name, "' of ", ul.numel,
                     " elements of ", to_string(ul.type), " over ", shards_,
                     " shards needs more than ", limit, " padded elements");
    ul.shard_numel = (per_shard + align - 1) / align * align;
    ul.padded_numel = ul.shard_numel * s;

    const auto max_total = static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max());
    FEDSHARD_EXPECTS(ul.padded_numel <= max_total - total_padded_,
                     "flat_layout: the padded units up to '", ul.name, "' hold more than ",
                     max_total, " elements in all");
    unit_offsets_.push_back(total_padded_);
    shard_offsets_.push_back(total_shard_);
    total_numel_ += ul.numel;
    total_padded_ += ul.padded_numel;
    total_shard_ += ul.shard_numel;

    units_.push_back(std::move(ul));
  }

  std::uint64_t compute_fingerprint() const noexcept {
    detail::fnv1a h;
    h.u64(static_cast<std::uint64_t>(shards_));
    h.u64(units_.size());
    for (const unit_layout& ul : units_) {
      h.str(ul.name);
      h.u64(static_cast<std::uint64_t>(ul.type));
      h.u64(ul.tensors.size());
      for (const tensor_slot& t : ul.tensors) {
        h.str(t.name);
        h.u64(t.shape.size());
        for (std::int64_t d : t.shape) h.u64(static_cast<std::uint64_t>(d));
      }
    }
    return h.value();
  }

  int shards_;
  std::vector<unit_layout> units_;
  std::vector<std::size_t> unit_offsets_;
  std::vector<std::size_t> shard_offsets_;
  std::size_t total_numel_ = 0;
  std::size_t total_padded_ = 0;
  std::size_t total_shard_ = 0;
  std::uint64_t fingerprint_ = 0;
  std::map<std::string, std::pair<std::size_t, std::size_t>, std::less<>> by_qualified_;
  std::multimap<std::string, std::pair<std::size_t, std::size_t>, std::less<>> by_name_;
};

/// The unit declarations a layout was made from (every unit's name and tensors, their names,
/// shapes and dtype), to lay the same model out over another shard count.
inline std::vector<unit_spec> unit_specs(const flat_layout& layout) {
  std::vector<unit_spec> out;
  for (const unit_layout& ul : layout.units()) {
    unit_spec u{.name = ul.name, .tensors = {}};
    for (const tensor_slot& t : ul.tensors)
      u.tensors.push_back({.name = t.name, .shape = t.shape, .type = ul.type});
    out.push_back(std::move(u));
  }
  return out;
}

namespace detail {

/// What verify_same_layout compares, as f64 values that hold it exactly: the fingerprint and
/// the total element count as 32-bit halves, S and the unit count.
inline std::array<double, 6> layout_digest(const flat_layout& l) {
  const std::uint64_t f = l.fingerprint();
  const std::uint64_t n = l.total_numel();
  return {static_cast<double>(f >> 32),    static_cast<double>(f & 0xffffffffu),
          static_cast<double>(l.shards()), static_cast<double>(l.num_units()),
          static_cast<double>(n >> 32),    static_cast<double>(n & 0xffffffffu)};
}

/// "S = 4, 2 units, 2762 elements, fingerprint 0x...".
inline std::string digest_summary(const std::array<double, 6>& d) {
  const auto half = [](double v) { return static_cast<std::uint64_t>(v); };
  return concat("S = ", static_cast<long long>(d[2]), ", ", half(d[3]), " units, ",
                (half(d[4]) << 32) | half(d[5]), " elements, fingerprint ",
                hex64((half(d[0]) << 32) | half(d[1])));
}

}  // namespace detail

/// The ops of a layout check on an axis of n ranks: rank 0's digest (role value 0: 6 f64)
/// is broadcast, then every rank's "differs from rank 0" flag (value 1: n f64) is
/// max-reduced, so every rank learns which ranks differ.
inline plan layout_check_plan(axis a, int n) {
  plan p;
  p.ops.push_back({.kind = comm_kind::broadcast,
                   .axis = a,
                   .dtype = dtype::f64,
                   .bytes = 6 * 8,
                   .ranks = n,
                   .out = {.role = role::value, .index = 0},
                   .overlappable = false});
  p.ops.push_back({.kind = comm_kind::all_reduce,
                   .axis = a,
                   .dtype = dtype::f64,
                   .bytes = 8 * static_cast<std::int64_t>(n),
                   .ranks = n,
                   .reduce = reduce_op::max,
                   .in = {.role = role::value, .index = 1},
                   .out = {.role = role::value, .index = 1},
                   .overlappable = false});
  return p;
}

/// Checks that every one of the n ranks (this is rank `me`) built the same layout as rank 0,
/// running the ops of layout_check_plan with run(op, buffer) (buffer: the op's value, in and
/// out). If any rank differs, every rank throws invalid_argument naming the ranks that
/// differ, with rank 0's summary and its own.
template <class Run>
void verify_same_layout(const flat_layout& layout, int me, int n, const plan& check, Run&& run) {
  const std::array<double, 6> mine = detail::layout_digest(layout);
  std::array<double, 6> root = mine;
  run(check.ops.at(0), buffer_view{root.data(), root.size(), dtype::f64});
  std::vector<double> differs(static_cast<std::size_t>(n), 0.0);
  differs[static_cast<std::size_t>(me)] = root != mine ? 1.0 : 0.0;
  run(check.ops.at(1), buffer_view{differs.data(), differs.size(), dtype::f64});
  std::string ranks;
  for (int r = 0; r < n; ++r)
    if (differs[static_cast<std::size_t>(r)] != 0.0)
      ranks += detail::concat(ranks.empty() ? "" : ", ", r);
  FEDSHARD_EXPECTS(ranks.empty(), "verify_same_layout: the flat layout of rank(s) ", ranks, " of ",
                   n, " differs from rank 0's; rank 0 has ", detail::digest_summary(root),
                   "; this rank (", me, ") has ", detail::digest_summary(mine));
}

/// Collective over comm: verify_same_layout with the check's ops called on comm directly.
template <Communicator C>
void verify_same_layout(C& comm, const flat_layout& layout) {
  const plan check = layout_check_plan(axis::world, comm.size());
  verify_same_layout(
      layout, comm.rank(), comm.size(), check,
      [&](const comm_op& op, buffer_view b) { start_op(comm, op, b.data, b.data).wait(); });
}

}  // namespace fedshard
