#pragma once
/// The state registry: what a run *is*, declared by the components that hold it.
///
/// Every stateful component (the engine's master, the inner optimizer, the synchronizer's
/// anchors, outer-optimizer state and fragment counters, codec residuals, schedule progress,
/// the trainer's step) adds one `state_entry` per buffer where it is created: its name (the
/// section of a checkpoint), what its elements are (`state_extent`: runs
/// over the model's elements, laid out like the master or like a sync fragment, or a small
/// record), how it starts when a checkpoint lacks it (`state_start`), whether it survives a
/// change of federation policy, and two callables that copy it to and from host bytes (the
/// component knows its memory space; the host waits for the copy).
///
/// Save, load, resharding, healing a joining group and exports iterate the registry
/// (trainer/state_io.hpp, trainer/reshard.hpp); none of them names a component. Entries keep
/// the order they were added in: a load restores them in that order.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "fedshard/error.hpp"

namespace fedshard {

/// What the elements of a state entry are.
enum class state_extent : std::uint8_t {
  record,    ///< a small record (counts, progress, flags): copied whole, never resharded by element
  master,    ///< runs over the model: each unit's shard back to back, as the engine's master
  fragment,  ///< runs over the model: the shards of sync fragment `fragment`'s units back to back
};

/// How an entry starts when the checkpoint being loaded lacks it (or, for an entry that does
/// not survive a change of policy, holds it from another policy).
enum class state_start : std::uint8_t {
  zero,        ///< zero bytes (a record's default; a fresh optimizer's moments)
  parameters,  ///< the model's parameters at the entry's elements (an anchor)
  refuse,      ///< the load is refused, naming the entry
};

/// One registered buffer; see the file comment.
struct state_entry {
  /// Its section in a checkpoint (unique in the registry), e.g. "optimizer.exp_avg".
  std::string name;
  /// The same state in a run cut into other sync fragments: the name with "{f}" where the
  /// fragment number goes (e.g. "federation.fragment{f}.anchor"); empty for entries that
  /// belong to no fragment.
  std::string family{};
  state_extent extent = state_extent::record;
  /// extent::fragment, and records of one fragment (with a family): which fragment.
  int fragment = -1;
  /// Element entries: the buffer holds only this rank's replica's 1/R piece of its runs
  /// (padded to a multiple of R): an op's operand sharded over the replica axis.
  bool replica_piece = false;
  state_start missing = state_start::zero;
  /// False: a load from a checkpoint of another federation policy starts it as `missing`
  /// says (codec residuals are the state of one plan's ops).
  bool survives_policy_change = true;
  /// False: a resharding load (another mesh, layout or policy) starts it as `missing` says
  /// (a sync in flight, the counters of a stage).
  bool reshards = true;
  /// Records only: the saved size may differ from the live one (a list that grows); the
  /// load callable takes any multiple of element_size bytes.
  bool variable_size = false;
  /// Bytes per element: 4 for element entries (f32), a record's value size otherwise.
  std::size_t element_size = 1;
  /// Entries of one group (e.g. an optimizer's buffers and its step count) start together:
  /// when a load starts any element entry of the group as `missing` says, its records too.
  std::string group{};
  /// This entry is the model's parameters: the values state_start::parameters copies.
  bool parameters = false;
  /// Element entries: every group of the federation holds the same bytes at the start of a
  /// round (an anchor, an outer optimizer's state: what each group takes from the round's
  /// average), so a joining group may take it from several donors (federation/heal.hpp).
  bool same_in_every_group = false;
  /// state_start::refuse: why a checkpoint without the entry cannot do, given the saved
  /// manifest's fields (empty: "this run needs it").
  std::function<std::string(const std::map<std::string, std::string>& saved)> refuse_note{};
  /// Saved only when this returns true (empty: always); a load without the section starts
  /// the entry as `missing` says.
  std::function<bool()> present{};
  /// Its size in bytes now.
  std::function<std::size_t()> bytes{};
  /// Copies the live values into `out` (bytes() of them); the host waits for the copy.
  std::function<void(std::span<std::byte> out)> save{};
  /// Checks saved bytes before any entry changes (throws invalid_argument naming what is
  /// wrong); empty: any bytes of the right size are fine.
  std::function<void(std::span<const std::byte> in)> check{};
  /// Replaces the live values with `in` (bytes() of them, or any size when variable_size).
  std::function<void(std::span<const std::byte> in)> load{};

  /// True for entries laid out over the model's elements (f32).
  bool over_elements() const noexcept { return extent != state_extent::record; }
  /// The entry's name for fragment f of its family ("" without a family).
  std::string name_in_fragment(int f) const {
    const auto at = family.find("{f}");
    if (at == std::string::npos) return {};
    return family.substr(0, at) + std::to_string(f) + family.substr(at + 3);
  }
};

/// How log lines name the sections that start with `prefix` ("optimizer." -> "optimizer
/// state 'exp_avg'"); `strip`: the name without the prefix.
struct state_kind {
  std::string prefix;
  std::string noun;
  bool strip = true;
};

/// The entries of one run, in the order they were added.
class state_registry {
 public:
  /// Names the sections starting with k.prefix in log lines (what a load dropped or started
  /// fresh); kinds are listed in the order they were added.
  /// A prefix named before keeps its first noun (components that share a kind each add it).
  void add_kind(state_kind k) {
    for (const auto& have : kinds_)
      if (have.prefix == k.prefix) return;
    kinds_.push_back(std::move(k));
  }
  const std::vector<state_kind>& kinds() const noexcept { return kinds_; }
  /// The kind of section `name`, or null when no kind names it.
  const state_kind* kind_of(std::string_view name) const {
    for (const auto& k : kinds_)
      if (name.substr(0, k.prefix.size()) == k.prefix) return &k;
    return nullptr;
  }
  /// "optimizer state 'exp_avg'": section `name` as a log line says it.
  std::string describe(std::string_view name) const {
    const state_kind* k = kind_of(name);
    if (k == nullptr) return "'" + std::string(name) + "'";
    return k->noun + " '" + std::string(k->strip ? name.substr(k->prefix.size()) : name) + "'";
  }

  /// Adds an entry; invalid_argument when its name is taken or it lacks a callable.
  void add(state_entry e) {
    FEDSHARD_EXPECTS(!e.name.empty(), "state_registry: an entry needs a name");
    FEDSHARD_EXPECTS(e.bytes && e.save && e.load, "state_registry: entry '", e.name,
                     "' needs bytes, save and load callables");
    FEDSHARD_EXPECTS(find(e.name) == nullptr, "state_registry: two entries are named '", e.name,
                     "'");
    FEDSHARD_EXPECTS(e.extent != state_extent::fragment || e.fragment >= 0,
                     "state_registry: fragment entry '", e.name, "' needs a fragment, found ",
                     e.fragment);
    FEDSHARD_EXPECTS(!e.variable_size || e.extent == state_extent::record,
                     "state_registry: element entry '", e.name, "' cannot change size");
    entries_.push_back(std::move(e));
  }

  /// Adds an f32 buffer laid out over the model's elements, read and written through the
  /// host (to_host / from_host: copies between the buffer and host memory, done when they
  /// return).
  template <class ToHost, class FromHost>
  void add_elements(state_entry e, std::size_t n, ToHost to_host, FromHost from_host) {
    e.element_size = sizeof(float);
    e.bytes = [n] { return n * sizeof(float); };
    e.save = [n, to_host](std::span<std::byte> out) {
      to_host(std::span<float>(reinterpret_cast<float*>(out.data()), n));
    };
    e.load = [n, from_host](std::span<const std::byte> in) {
      from_host(std::span<const float>(reinterpret_cast<const float*>(in.data()), n));
    };
    add(std::move(e));
  }

  /// Adds an f32 buffer in host memory (its address and size fixed from now on).
  void add_host_span(state_entry e, std::span<float> data) {
    add_elements(
        std::move(e), data.size(),
        [data](std::span<float> out) { std::copy(data.begin(), data.end(), out.begin()); },
        [data](std::span<const float> in) { std::copy(in.begin(), in.end(), data.begin()); });
  }

  /// Adds a record of one trivially copyable value, held in host memory at `v`.
  template <class T>
  void add_value(state_entry e, T* v) {
    static_assert(std::is_trivially_copyable_v<T>);
    e.extent = state_extent::record;
    e.element_size = sizeof(T);
    e.bytes = [] { return sizeof(T); };
    e.save = [v](std::span<std::byte> out) { std::memcpy(out.data(), v, sizeof(T)); };
    e.load = [v](std::span<const std::byte> in) { std::memcpy(v, in.data(), sizeof(T)); };
    add(std::move(e));
  }

  /// The entry named `name`, or null.
  const state_entry* find(std::string_view name) const {
    for (const auto& e : entries_)
      if (e.name == name) return &e;
    return nullptr;
  }
  /// The entry holding the model's parameters (state_entry::parameters); invalid_argument
  /// when none does.
  const state_entry& parameters() const {
    for (const auto& e : entries_)
      if (e.parameters) return e;
    throw invalid_argument("state_registry: no entry holds the model's parameters");
  }
  const std::vector<state_entry>& entries() const noexcept { return entries_; }
  auto begin() const noexcept { return entries_.begin(); }
  auto end() const noexcept { return entries_.end(); }
  std::size_t size() const noexcept { return entries_.size(); }

 private:
  std::vector<state_entry> entries_;
  std::vector<state_kind> kinds_;
};

}  // namespace fedshard
