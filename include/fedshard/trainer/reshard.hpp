#pragma once
/// Resharding a checkpoint on load: where every saved element lives, and reading exactly the
/// element ranges a rank of another mesh, shard policy or algorithm now owns.
///
/// Every state buffer of a rank is a run list over the model's elements: "master-shaped"
/// buffers (the master, the inner optimizer's state) hold each unit's shard back to back
/// (shard::engine), "fragment-shaped" ones (anchors, outer-optimizer state) hold the shards of
/// a fragment's units back to back (federation::synchronizer). The manifest of a save records
/// what it takes to recompute the saver's run lists: the mesh, the units with their tensors,
/// the layout's shard count, the fragments and the state names. A loading rank computes its
/// own runs, finds the saved runs that overlap them, and reads those byte ranges (each read
/// checks the checksums of the chunks it touches).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fedshard/core/dtype.hpp"
#include "fedshard/error.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/shard/flat_layout.hpp"
#include "fedshard/trainer/checkpoint.hpp"

namespace fedshard::checkpoint {

/// `count` elements of unit `unit` from element `begin` of the unit, held at element `at` of
/// a rank's buffer.
struct element_run {
  std::size_t unit = 0;
  std::size_t begin = 0;
  std::size_t count = 0;
  std::size_t at = 0;
};

/// The runs of a master-shaped buffer of the rank holding shard `shard` of `layout` (each
/// unit's shard back to back; padding is in no run).
inline std::vector<element_run> master_runs(const flat_layout& layout, int shard) {
  std::vector<element_run> out;
  for (std::size_t u = 0; u < layout.num_units(); ++u) {
    const auto& ul = layout.unit(u);
    const shard_range r = layout.shard_of(u, layout.shards() > 1 ? shard : 0);
    const std::size_t end = std::min(r.end, ul.numel);
    if (r.begin < end) out.push_back({u, r.begin, end - r.begin, layout.shard_offset(u)});
  }
  return out;
}

/// The runs of a fragment-shaped buffer (the shards of `units` back to back) of the rank
/// holding shard `shard` of `layout`.
inline std::vector<element_run> fragment_runs(const flat_layout& layout, std::span<const int> units,
                                              int shard) {
  std::vector<element_run> out;
  std::size_t at = 0;
  for (int u : units) {
    const auto uu = static_cast<std::size_t>(u);
    const auto& ul = layout.unit(uu);
    const shard_range r = layout.shard_of(uu, layout.shards() > 1 ? shard : 0);
    const std::size_t end = std::min(r.end, ul.numel);
    if (r.begin < end) out.push_back({uu, r.begin, end - r.begin, at});
    at += ul.shard_numel;
  }
  return out;
}

/// The runs of `runs` inside the window [lo, lo + len) of their buffer, with `at` counted from
/// lo (a piece of a buffer: an op's operand that covers one replica's part of a fragment).
inline std::vector<element_run> window_runs(const std::vector<element_run>& runs, std::size_t lo,
                                            std::size_t len) {
  std::vector<element_run> out;
  for (const element_run& r : runs) {
    const std::size_t a = std::max(r.at, lo), b = std::min(r.at + r.count, lo + len);
    if (a < b) out.push_back({r.unit, r.begin + (a - r.at), b - a, a - lo});
  }
  return out;
}

namespace detail {
inline void put_string(std::string& out, std::string_view s) {
  put(out, static_cast<std::uint32_t>(s.size()));
  out += s;
}
}  // namespace detail

/// What a manifest records about the saver's layout (the sections "reshard.*").
struct saved_layout {
  mesh_shape shape;
  int layout_shards = 1;
  std::vector<unit_spec> units;
  std::vector<std::vector<int>> fragments;    ///< the units of each fragment
  std::vector<std::string> optimizer_state;   ///< the inner optimizer's state names
  std::vector<std::string> federation_state;  ///< the federation policy's state names

  /// Adds the sections that describe a layout to a manifest.
  static void describe(file_writer& w, const mesh_shape& shape, const flat_layout& layout,
                       const std::vector<std::vector<int>>& fragments,
                       const std::vector<std::string>& optimizer_state,
                       const std::vector<std::string>& federation_state) {
    const int dims[4] = {shape.groups, shape.replicas, shape.shards, layout.shards()};
    w.add_span("reshard.mesh", std::span<const int>(dims));
    std::string units;
    detail::put(units, static_cast<std::uint32_t>(layout.num_units()));
    for (const auto& ul : layout.units()) {
      detail::put_string(units, ul.name);
      detail::put_string(units, to_string(ul.type));
      detail::put(units, static_cast<std::uint32_t>(ul.tensors.size()));
      for (const auto& t : ul.tensors) {
        detail::put_string(units, t.name);
        detail::put(units, static_cast<std::uint32_t>(t.shape.size()));
        for (auto d : t.shape) detail::put(units, d);
      }
    }
    w.add_text("reshard.units", units);
    std::string fr;
    detail::put(fr, static_cast<std::uint32_t>(fragments.size()));
    for (const auto& f : fragments) {
      detail::put(fr, static_cast<std::uint32_t>(f.size()));
      for (int u : f) detail::put(fr, u);
    }
    w.add_text("reshard.fragments", fr);
    auto names = [](const std::vector<std::string>& v) {
      std::string s;
      detail::put(s, static_cast<std::uint32_t>(v.size()));
      for (const auto& n : v) detail::put_string(s, n);
      return s;
    };
    w.add_text("reshard.optimizer_state", names(optimizer_state));
    w.add_text("reshard.federation_state", names(federation_state));
  }

  /// Reads a manifest's description; a corrupt one is an error naming the file.
  static saved_layout read(const file_reader& m) {
    saved_layout s;
    int dims[4] = {};
    m.read_span("reshard.mesh", std::span<int>(dims));
    s.shape = {dims[0], dims[1], dims[2]};
    s.layout_shards = dims[3];
    if (dims[0] < 1 || dims[1] < 1 || dims[2] < 1 || dims[3] < 1)
      m.fail("is corrupt: section 'reshard.mesh' holds ", dims[0], "x", dims[1], "x", dims[2],
             " with ", dims[3], " layout shards");
    cursor c{m, "reshard.units"};
    const auto units = c.get<std::uint32_t>();
    for (std::uint32_t u = 0; u < units; ++u) {
      unit_spec us;
      us.name = c.str();
      const std::string type = c.str();
      dtype t = dtype::f32;
      bool known = false;
      for (dtype d : all_dtypes)
        if (to_string(d) == type) t = d, known = true;
      if (!known) m.fail("is corrupt: unit '", us.name, "' has an unknown dtype '", type, "'");
      const auto tensors = c.get<std::uint32_t>();
      for (std::uint32_t k = 0; k < tensors; ++k) {
        tensor_spec ts;
        ts.name = c.str();
        ts.type = t;
        const auto rank = c.get<std::uint32_t>();
        for (std::uint32_t d = 0; d < rank; ++d) ts.shape.push_back(c.get<std::int64_t>());
        us.tensors.push_back(std::move(ts));
      }
      s.units.push_back(std::move(us));
    }
    c.end();
    cursor f{m, "reshard.fragments"};
    const auto fragments = f.get<std::uint32_t>();
    for (std::uint32_t i = 0; i < fragments; ++i) {
      std::vector<int> us(f.get<std::uint32_t>());
      for (int& u : us) {
        u = f.get<int>();
        if (u < 0 || static_cast<std::size_t>(u) >= s.units.size())
          m.fail("is corrupt: fragment ", i, " names unit ", u, " of ", s.units.size());
      }
      s.fragments.push_back(std::move(us));
    }
    f.end();
    s.optimizer_state = names(m, "reshard.optimizer_state");
    s.federation_state = names(m, "reshard.federation_state");
    return s;
  }

  /// The saver's layout.
  flat_layout layout() const { return flat_layout(units, layout_shards); }

  /// "tensor 'u.t' ...; ..." for every difference between the saver's model and `mine` (the
  /// units, their tensors, shapes and dtypes); empty when they are the same model.
  std::string model_differences(const flat_layout& mine) const {
    std::string d;
    auto add = [&](auto&&... a) {
      d += fedshard::detail::concat(d.empty() ? "" : "; ", std::forward<decltype(a)>(a)...);
    };
    if (units.size() != mine.num_units())
      add("the checkpoint has ", units.size(), " units, this run's model ", mine.num_units());
    for (std::size_t u = 0; u < std::min(units.size(), mine.num_units()); ++u) {
      const auto& su = units[u];
      const auto& mu = mine.unit(u);
      if (su.name != mu.name) {
        add("unit ", u, " is '", su.name, "' in the checkpoint, '", mu.name, "' in this run");
        continue;
      }
      for (std::size_t t = 0; t < std::max(su.tensors.size(), mu.tensors.size()); ++t) {
        if (t >= su.tensors.size()) {
          add("tensor '", mu.name, ".", mu.tensors[t].name, "' is missing from the checkpoint");
          continue;
        }
        const auto& st = su.tensors[t];
        const std::string q = fedshard::detail::concat(su.name, ".", st.name);
        if (t >= mu.tensors.size()) {
          add("tensor '", q, "' of the checkpoint is not in this run's model");
        } else if (st.name != mu.tensors[t].name) {
          add("tensor ", t, " of unit '", su.name, "' is '", st.name, "' in the checkpoint, '",
              mu.tensors[t].name, "' in this run");
        } else if (st.shape != mu.tensors[t].shape) {
          add("tensor '", q, "' has shape ", fedshard::detail::shape_string(st.shape),
              " in the checkpoint, ", fedshard::detail::shape_string(mu.tensors[t].shape),
              " in this run");
        } else if (st.type != mu.type) {
          add("tensor '", q, "' has dtype ", to_string(st.type), " in the checkpoint, ",
              to_string(mu.type), " in this run");
        }
      }
    }
    return d;
  }

 private:
  struct cursor {
    const file_reader& m;
    std::string name;
    std::string data = m.section(name);
    std::size_t at = 0;
    template <class T>
    T get() {
      T v{};
      if (sizeof v > data.size() - at) m.fail("is corrupt: section '", name, "' is too short");
      std::memcpy(&v, data.data() + at, sizeof v);
      at += sizeof v;
      return v;
    }
    std::string str() {
      const auto n = get<std::uint32_t>();
      if (n > data.size() - at) m.fail("is corrupt: section '", name, "' is too short");
      std::string s = data.substr(at, n);
      at += n;
      return s;
    }
    void end() const {
      if (at != data.size()) m.fail("is corrupt: section '", name, "' has trailing bytes");
    }
  };
  static std::vector<std::string> names(const file_reader& m, const char* section) {
    cursor c{m, section};
    std::vector<std::string> out(c.get<std::uint32_t>());
    for (auto& n : out) n = c.str();
    c.end();
    return out;
  }
};

/// A saved buffer to read from: world rank `rank`'s section `section`, whose elements are
/// `runs`.
struct saved_buffer {
  int rank = 0;
  std::string section;
  std::vector<element_run> runs;
};

/// Fills the elements `want` of dst (f32) from the saved buffers that hold them, reading only
/// the overlapping byte ranges; throws invalid_argument when an element of `want` is in none
/// of them (naming the buffer `what`). dst's other elements (padding) are left as they are.
inline void fill_elements(const saved_checkpoint& saved, std::span<float> dst,
                          const std::vector<element_run>& want,
                          const std::vector<saved_buffer>& from, std::string_view what) {
  for (const element_run& w : want) {
    FEDSHARD_EXPECTS(w.at + w.count <= dst.size(), "reshard: run of ", w.count, " elements at ",
                     w.at, " outside a buffer of ", dst.size());
    std::size_t covered = 0;
    for (const saved_buffer& b : from) {
      for (const element_run& r : b.runs) {
        if (r.unit != w.unit) continue;
        const std::size_t lo = std::max(r.begin, w.begin);
        const std::size_t hi = std::min(r.begin + r.count, w.begin + w.count);
        if (lo >= hi) continue;
        saved.rank_file(b.rank).read_elements(b.section, r.at + (lo - r.begin),
                                              dst.subspan(w.at + (lo - w.begin), hi - lo));
        covered += hi - lo;
      }
    }
    if (covered != w.count)
      throw invalid_argument(fedshard::detail::concat(
          "fedshard: checkpoint '", saved.dir().string(), "' holds ", covered, " of the ", w.count,
          " elements [", w.begin, ", ", w.begin + w.count, ") of unit ", w.unit,
          " that this rank's ", what, " needs"));
  }
}

}  // namespace fedshard::checkpoint
