#pragma once
/// A run's state registry (core/state_registry.hpp) in the checkpoint format: each entry is
/// the section of its name in a rank's file. Writing iterates the registry; reading stages
/// every entry's bytes (read and checked, nothing changed yet) and applies them only once
/// every rank staged all it needs: from a checkpoint of the same setup rank by rank
/// (stage_same), from any other one of the same model by element runs (trainer/reshard.hpp).
/// Healing a joining group sends what write_registry writes and stages it the same way.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "fedshard/core/state_registry.hpp"
#include "fedshard/error.hpp"
#include "fedshard/federation/sync_plan.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/shard/flat_layout.hpp"
#include "fedshard/trainer/checkpoint.hpp"
#include "fedshard/trainer/reshard.hpp"

namespace fedshard::checkpoint {

/// Which entries of a registry serialize() writes: all of them, or the two parts of a heal
/// from several donors (federation/heal.hpp): what may differ between groups, and what every
/// group holds alike (state_entry::same_in_every_group).
enum class entries : std::uint8_t { all, own, shared };

/// True when e is one of `which`.
inline bool is_of(const state_entry& e, entries which) {
  return which == entries::all || e.same_in_every_group == (which == entries::shared);
}

/// True when some entry of `reg` is held alike in every group.
inline bool has_shared(const state_registry& reg) {
  return std::any_of(reg.begin(), reg.end(),
                     [](const state_entry& e) { return e.same_in_every_group; });
}

/// Adds every entry of `reg` present now (of `which`) to `w`, copied from where it lives.
inline void write_registry(const state_registry& reg, file_writer& w,
                           entries which = entries::all) {
  for (const auto& e : reg) {
    if ((e.present && !e.present()) || !is_of(e, which)) continue;
    const std::span<char> out = w.add_buffer(e.name, e.bytes());
    e.save(std::as_writable_bytes(out));
  }
}

/// Room serialize() leaves behind the file: what a heal appends to it (padding to words, a
/// seal's tag, a shared piece's trailer) then moves nothing.
inline constexpr std::size_t heal_spare_bytes = 64;

/// The entries of `reg` (of `which`) as the bytes of one checkpoint file (what a donor sends
/// a joiner).
inline std::string serialize(const state_registry& reg, entries which = entries::all) {
  file_writer w;
  write_registry(reg, w, which);
  return w.bytes(heal_spare_bytes);
}

/// Where a rank's element entries lie: the model's layout, the units of each sync fragment,
/// the mesh, and the rank's layout shard (0 when the layout is not sharded) and replica.
struct state_geometry {
  const flat_layout* layout = nullptr;
  std::vector<std::vector<int>> fragments;
  mesh_shape shape;
  int shard = 0;
  int replica = 0;
};

/// Elements of fragment f's packed buffer before padding, on a rank of `g`.
inline std::size_t fragment_numel(const state_geometry& g, int f) {
  std::size_t n = 0;
  for (int u : g.fragments.at(static_cast<std::size_t>(f)))
    n += g.layout->unit(static_cast<std::size_t>(u)).shard_numel;
  return n;
}

/// The element runs of entry `e`'s buffer of `len` elements on a rank of `g` (layout shard
/// `shard`, replica `replica`: the rank's own, or a saver's).
inline std::vector<element_run> runs_of(const state_entry& e, const state_geometry& g, int shard,
                                        int replica, std::size_t len) {
  if (e.extent == state_extent::master) return master_runs(*g.layout, shard);
  FEDSHARD_EXPECTS(e.fragment >= 0 && static_cast<std::size_t>(e.fragment) < g.fragments.size(),
                   "state '", e.name, "': fragment ", e.fragment, " of a run with ",
                   g.fragments.size(), " fragment(s)");
  const auto runs =
      fragment_runs(*g.layout, g.fragments[static_cast<std::size_t>(e.fragment)], shard);
  if (!e.replica_piece) return runs;
  return window_runs(runs, static_cast<std::size_t>(replica) * len, len);
}

/// Copies the elements that `dst_runs` (of dst) and `src_runs` (of src) both cover.
inline void copy_runs(std::span<float> dst, const std::vector<element_run>& dst_runs,
                      std::span<const float> src, const std::vector<element_run>& src_runs) {
  for (const element_run& d : dst_runs)
    for (const element_run& s : src_runs) {
      if (s.unit != d.unit) continue;
      const std::size_t lo = std::max(s.begin, d.begin);
      const std::size_t hi = std::min(s.begin + s.count, d.begin + d.count);
      if (lo >= hi) continue;
      std::copy_n(src.begin() + static_cast<std::ptrdiff_t>(s.at + (lo - s.begin)), hi - lo,
                  dst.begin() + static_cast<std::ptrdiff_t>(d.at + (lo - d.begin)));
    }
}

/// A registry's values read from a checkpoint and checked, not applied yet: each entry's
/// bytes, or nothing (the entry starts as its `missing` says).
struct staged_registry {
  std::vector<std::optional<std::string>> values;  ///< by entry, in registry order
};

/// f32 view of staged bytes.
inline std::span<float> as_floats(std::string& bytes) {
  return {reinterpret_cast<float*>(bytes.data()), bytes.size() / sizeof(float)};
}

/// Checks a section's size against its entry: exactly bytes(), or a multiple of the element
/// size for a variable-size record; `what` names the file.
inline void check_size(const state_entry& e, std::size_t size, const file_reader& from) {
  if (e.variable_size ? size % e.element_size != 0 : size != e.bytes())
    from.fail("section '", e.name, "' holds ", size, " bytes, this run expects ",
              e.variable_size ? fedshard::detail::concat("a multiple of ", e.element_size)
                              : std::to_string(e.bytes()));
}

/// Completes a staging: entries without values start as their `missing` says. Element
/// entries starting from the parameters copy them (staged, else live) run by run; a group
/// with an element entry starting fresh starts its records fresh too; a refused one throws.
inline void finish_staging(const state_registry& reg, staged_registry& st, const state_geometry& g,
                           std::string_view dir,
                           const std::map<std::string, std::string>& saved_fields) {
  const auto& es = reg.entries();
  std::string params;
  std::vector<element_run> params_runs;
  for (std::size_t i = 0; i < es.size(); ++i)
    if (es[i].parameters) {
      if (st.values[i]) {
        params = *st.values[i];
      } else {
        params.assign(es[i].bytes(), '\0');
        es[i].save(std::as_writable_bytes(std::span<char>(params)));
      }
      params_runs = runs_of(es[i], g, g.shard, g.replica, params.size() / sizeof(float));
    }
  std::vector<std::string> fresh_groups;
  for (std::size_t i = 0; i < es.size(); ++i) {
    const state_entry& e = es[i];
    if (st.values[i]) continue;
    if (e.missing == state_start::refuse)
      throw invalid_argument(fedshard::detail::concat(
          "fedshard: checkpoint '", dir, "' has no section '", e.name,
          "': ", e.refuse_note ? e.refuse_note(saved_fields) : std::string("this run needs it")));
    if (e.over_elements() && !e.group.empty()) fresh_groups.push_back(e.group);
    if (e.missing != state_start::parameters) continue;
    std::string v(e.bytes(), '\0');
    const auto len = v.size() / sizeof(float);
    copy_runs(as_floats(v), runs_of(e, g, g.shard, g.replica, len),
              {reinterpret_cast<const float*>(params.data()), params.size() / sizeof(float)},
              params_runs);
    st.values[i] = std::move(v);
  }
  for (std::size_t i = 0; i < es.size(); ++i)
    if (!es[i].over_elements() &&
        std::find(fresh_groups.begin(), fresh_groups.end(), es[i].group) != fresh_groups.end() &&
        !es[i].group.empty())
      st.values[i].reset();
}

/// Applies a staging: every entry takes its staged bytes, or zeros (an empty list for a
/// variable-size record).
inline void apply(const state_registry& reg, const staged_registry& st) {
  const auto& es = reg.entries();
  for (std::size_t i = 0; i < es.size(); ++i) {
    if (st.values[i]) {
      es[i].load(std::as_bytes(std::span<const char>(*st.values[i])));
    } else {
      const std::string zeros(es[i].variable_size ? 0 : es[i].bytes(), '\0');
      es[i].load(std::as_bytes(std::span<const char>(zeros)));
    }
  }
}

/// Stages every entry from a rank file of the same setup (the same entries, sizes and
/// layout): a missing section is an error naming it, except for an entry saved only when
/// present (it starts as `missing` says).
/// With several files (the two parts of a heal), each entry comes from the first file that
/// has it, and a missing section is named with the first file.
inline staged_registry stage_same(const state_registry& reg,
                                  const std::vector<const file_reader*>& files,
                                  const state_geometry& g) {
  staged_registry st;
  for (const auto& e : reg) {
    const auto it = std::find_if(files.begin(), files.end(),
                                 [&](const file_reader* f) { return f->has(e.name); });
    if (it == files.end()) {
      if (!e.present) files.front()->fail("has no section '", e.name, "', which this setup saves");
      st.values.emplace_back();
      continue;
    }
    const file_reader& f = **it;
    std::string bytes = f.section(e.name);
    check_size(e, bytes.size(), f);
    if (e.check) e.check(std::as_bytes(std::span<const char>(bytes)));
    st.values.emplace_back(std::move(bytes));
  }
  finish_staging(reg, st, g, files.front()->what(), {});
  return st;
}
inline staged_registry stage_same(const state_registry& reg, const file_reader& f,
                                  const state_geometry& g) {
  return stage_same(reg, std::vector<const file_reader*>{&f}, g);
}

/// The saver of a checkpoint being resharded, as a loading rank reads it: its layout and
/// geometry, the group and replica this rank reads (its own modulo the saver's), and the
/// saved ranks holding each of the saver's layout shards there.
struct saved_run {
  const saved_checkpoint* saved = nullptr;
  saved_layout sv;
  flat_layout layout;
  state_geometry geometry;
  mesh_coords reads;                         ///< group and replica read; shard: this rank's
  std::vector<std::pair<int, int>> holders;  ///< (saver's layout shard, saved world rank)
  const file_reader* first = nullptr;        ///< the first holder's file (records)
  std::vector<std::string> read;             ///< sections a staging read

  saved_run(const saved_checkpoint& s, const flat_layout& mine, const mesh_coords& c)
      : saved(&s), sv(saved_layout::read(s.manifest_file())), layout(sv.layout()) {
    if (const std::string d = sv.model_differences(mine); !d.empty())
      throw invalid_argument(
          fedshard::detail::concat("fedshard: checkpoint '", s.dir().string(),
                                   "' holds another model than this run's: ", d));
    if (layout.shards() > 1 && layout.shards() != sv.shape.shards)
      s.manifest_file().fail("is corrupt: its layout has ", layout.shards(),
                             " shards on a mesh of ", sv.shape.shards);
    geometry = {.layout = &layout, .fragments = sv.fragments, .shape = sv.shape};
    reads = {c.group % sv.shape.groups, c.replica % sv.shape.replicas, c.shard};
    for (int sh = 0; sh < layout.shards(); ++sh)
      holders.emplace_back(sh, rank_at(reads.replica, sh));
    first = &s.rank_file(holders.front().second);
  }
  /// The saved world rank of replica r holding the saver's layout shard `sh` (the rank's own
  /// shard modulo the saver's when the saver's layout was not sharded).
  int rank_at(int r, int sh) const {
    return rank_of(sv.shape,
                   {reads.group, r, layout.shards() > 1 ? sh : reads.shard % sv.shape.shards});
  }
  /// The saver's fragment holding unit u, or -1.
  int fragment_of(int u) const {
    for (std::size_t f = 0; f < sv.fragments.size(); ++f)
      if (std::find(sv.fragments[f].begin(), sv.fragments[f].end(), u) != sv.fragments[f].end())
        return static_cast<int>(f);
    return -1;
  }
};

/// The saved sections holding element entry e, and which of the saver's fragments each is
/// of (-1: a master-shaped entry).
inline std::vector<std::pair<std::string, int>> saved_sections(const state_entry& e,
                                                               const saved_run& from) {
  std::vector<std::pair<std::string, int>> out;
  if (e.extent == state_extent::master || e.family.empty()) {
    if (from.first->has(e.name)) out.emplace_back(e.name, e.fragment);
    return out;
  }
  for (std::size_t fo = 0; fo < from.sv.fragments.size(); ++fo) {
    std::string name = e.name_in_fragment(static_cast<int>(fo));
    if (from.first->has(name)) out.emplace_back(std::move(name), static_cast<int>(fo));
  }
  return out;
}

/// Stages element entry e (`len` elements here) from the saver's buffers overlapping this
/// rank's runs; nothing when the checkpoint has none of them or cuts pieces of another size.
inline std::optional<std::string> stage_elements(const state_entry& e, std::size_t len,
                                                 saved_run& from, const state_geometry& mine) {
  const int pieces_old = e.replica_piece ? from.sv.shape.replicas : 1;
  if (e.replica_piece &&
      len * static_cast<std::size_t>(mine.shape.replicas) !=
          federation::padded_fragment_numel(fragment_numel(mine, e.fragment), mine.shape.replicas))
    return std::nullopt;
  std::vector<saved_buffer> sources;
  for (const auto& [section, fo] : saved_sections(e, from)) {
    from.read.push_back(section);
    state_entry old = e;
    old.fragment = fo;
    const std::size_t len_old =
        e.replica_piece
            ? federation::padded_fragment_numel(fragment_numel(from.geometry, fo), pieces_old) /
                  static_cast<std::size_t>(pieces_old)
            : 0;
    for (int r = 0; r < pieces_old; ++r)
      for (const auto& [sh, rank] : from.holders)
        sources.push_back({e.replica_piece ? from.rank_at(r, sh) : rank, section,
                           runs_of(old, from.geometry, sh, r, len_old)});
  }
  if (sources.empty()) return std::nullopt;
  std::string v(len * sizeof(float), '\0');
  fill_elements(*from.saved, as_floats(v), runs_of(e, mine, mine.shard, mine.replica, len), sources,
                from.saved->dir().string() + "'s " + e.name);
  return v;
}

/// Stages record e from the saver's first holder: a fragment's record from the saver's
/// fragment holding the first unit of this run's; nothing for a record that does not
/// reshard or is not in the checkpoint.
inline std::optional<std::string> stage_record(const state_entry& e, saved_run& from,
                                               const state_geometry& mine) {
  if (!e.reshards) return std::nullopt;
  std::string section = e.name;
  if (!e.family.empty()) {
    const auto& units = mine.fragments.at(static_cast<std::size_t>(e.fragment));
    const int fo = units.empty() ? -1 : from.fragment_of(units.front());
    if (fo < 0) return std::nullopt;
    section = e.name_in_fragment(fo);
  }
  if (!from.first->has(section)) return std::nullopt;
  from.read.push_back(section);
  std::string bytes = from.first->section(section);
  check_size(e, bytes.size(), *from.first);
  if (e.check) e.check(std::as_bytes(std::span<const char>(bytes)));
  return bytes;
}

/// "a, b, c".
inline std::string join_list(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

/// The log lines of a resharding load: what was dropped (saved sections of a known kind it
/// did not read, by kind) and what started fresh (entries without staged values: element
/// entries and records that do not reshard).
inline std::vector<std::string> reshard_notes(const state_registry& reg, const staged_registry& st,
                                              const saved_run& from) {
  std::vector<std::string> dropped, fresh, lines;
  for (const auto& k : reg.kinds())
    for (const auto& n : from.first->names())
      if (reg.kind_of(n) == &k &&
          std::find(from.read.begin(), from.read.end(), n) == from.read.end())
        dropped.push_back(reg.describe(n));
  const auto& es = reg.entries();
  for (std::size_t i = 0; i < es.size(); ++i)
    if (!st.values[i] && reg.kind_of(es[i].name) && (es[i].over_elements() || !es[i].reshards))
      fresh.push_back(reg.describe(es[i].name));
  if (!dropped.empty())
    lines.push_back("fedshard: checkpoint: dropped what this run has no use for: " +
                    join_list(dropped));
  if (!fresh.empty())
    lines.push_back("fedshard: checkpoint: started as at a fresh start (not in the checkpoint): " +
                    join_list(fresh));
  return lines;
}

/// Stages every entry of `reg` from a checkpoint of another mesh, layout or policy of the
/// same model: element entries read exactly the saved element ranges overlapping this
/// rank's runs, records come from the saver's first holder; an entry that does not survive
/// a change of policy starts fresh when `same_policy` is false. Returns the staging and
/// what it dropped and started fresh, as log lines.
inline std::pair<staged_registry, std::vector<std::string>> stage_resharded(
    const state_registry& reg, const saved_checkpoint& saved, const state_geometry& mine,
    const mesh_coords& c, bool same_policy) {
  saved_run from(saved, *mine.layout, c);
  staged_registry st;
  for (const auto& e : reg) {
    if (!e.survives_policy_change && !same_policy) {
      st.values.emplace_back();
    } else if (e.over_elements()) {
      st.values.push_back(stage_elements(e, e.bytes() / sizeof(float), from, mine));
    } else {
      st.values.push_back(stage_record(e, from, mine));
    }
  }
  auto notes = reshard_notes(reg, st, from);
  finish_staging(reg, st, mine, saved.dir().string(), saved.fields().fields);
  return {std::move(st), std::move(notes)};
}

/// Restores `reg` from what serialize() wrote on a rank of the same setup (`what` names its
/// source in errors): checked whole (chunk checksums, sections, sizes) before any entry
/// changes.
inline void deserialize(const state_registry& reg, std::string bytes, std::string what,
                        const state_geometry& g) {
  const file_reader r(std::move(bytes), std::move(what));
  apply(reg, stage_same(reg, r, g));
}

/// deserialize() of the two parts serialize() wrote (entries::own and entries::shared, from
/// ranks of the same setup; `what` names the source of each), checked whole before any entry
/// changes.
inline void deserialize(const state_registry& reg, std::string own, std::string own_what,
                        std::string shared, std::string shared_what, const state_geometry& g) {
  const file_reader a(std::move(own), std::move(own_what));
  const file_reader b(std::move(shared), std::move(shared_what));
  apply(reg, stage_same(reg, {&a, &b}, g));
}

}  // namespace fedshard::checkpoint
