#pragma once
/// What a trainer's checkpoints say about the run they belong to (checkpointer.hpp's
/// checkpoint_run): the manifest a checkpoint must match to load rank by rank, the sections
/// describing the saver's layout, where the rank's element state lies, how the world agrees,
/// and what cannot load at all (other ownership masks). Built from the trainer's parts; the
/// state itself is the registry's.

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/error.hpp"
#include "fedshard/shard/ownership.hpp"
#include "fedshard/shard/shard_policy.hpp"
#include "fedshard/trainer/checkpoint.hpp"
#include "fedshard/trainer/checkpointer.hpp"
#include "fedshard/trainer/reshard.hpp"
#include "fedshard/trainer/state_io.hpp"

namespace fedshard::checkpoint {

/// Where the element state of a rank of `engine` lies (its layout, each of `sync`'s
/// fragments' units, its layout shard and replica).
template <class Engine, class Sync>
state_geometry geometry_of(const Engine& engine, const Sync& sync) {
  const auto& m = engine.topology();
  const auto& l = engine.layout();
  state_geometry g{.layout = &l,
                   .fragments = {},
                   .shape = m.shape(),
                   .shard = l.shards() > 1 ? m.coords().shard : 0,
                   .replica = m.coords().replica};
  for (int f = 0; f < sync.fragments(); ++f)
    g.fragments.push_back(sync.synced_units(f, static_cast<int>(l.num_units())));
  return g;
}

/// The manifest's "ownership" field: each unit's holders, or "" when every group holds
/// every unit (then the field is left out).
inline std::string ownership_field(const shard::ownership& o) {
  if (o.everyone()) return {};
  std::string s = fedshard::detail::concat(o.groups, " groups:");
  for (const shard::group_set h : o.holders) s += " " + group_list(h);
  return s;
}

/// Ownership masks change which units a rank stores: only the same masks load (rank by
/// rank); resharding across masks is not supported yet.
inline void check_owners(const saved_checkpoint& saved, const std::string& ours) {
  const auto it = saved.fields().fields.find("ownership");
  const std::string theirs = it == saved.fields().fields.end() ? "" : it->second;
  FEDSHARD_EXPECTS(theirs == ours, "checkpoint '", saved.dir().string(),
                   "' was saved with other ownership masks (",
                   theirs.empty() ? "every group holds every unit" : theirs, ") than this run's (",
                   ours.empty() ? "every group holds every unit" : ours,
                   "); loading across ownership masks is not supported yet");
}

/// What a checkpoint of a run of algorithm A with these parts must match (`inner`: the
/// inner optimizer's state names, none when a local rule owns its optimizer).
template <class A, class Engine, class Sync>
manifest manifest_of(Engine& engine, const std::vector<std::string>& inner, const Sync& sync,
                     const shard::precision& precision) {
  manifest m;
  char fp[24];
  std::snprintf(fp, sizeof fp, "%016llx",
                static_cast<unsigned long long>(engine.layout().fingerprint()));
  m.fields["format"] = "2";
  m.fields["mesh"] = to_string(engine.topology().shape());
  m.fields["layout"] = fp;
  m.fields["layout_summary"] = engine.layout().summary();
  m.fields["shard_policy"] = std::string(A::shard_policy::name);
  m.fields["federation_policy"] = std::string(A::federation_policy::name);
  m.fields["sync_schedule"] =
      fedshard::detail::concat(A::sync_schedule::name, " with ", sync.fragments(), " fragment(s)");
  m.fields["precision"] =
      fedshard::detail::concat(to_string(precision.param), "/", to_string(precision.reduce));
  std::string names;
  for (const auto& n : inner) names += n + " ";
  m.fields["optimizer_state"] = names;
  if (const std::string o = ownership_field(engine.owners()); !o.empty()) m.fields["ownership"] = o;
  return m;
}

/// Everything a save or load of a trainer's registry needs of the run: A's policies and
/// these parts (`inner` as manifest_of's); `log` takes the resharding notes.
template <class A, class Engine, class Sync>
checkpoint_run checkpoint_run_of(Engine& engine, std::vector<std::string> inner, Sync& sync,
                                 const shard::precision& precision,
                                 std::function<void(const std::string&)> log) {
  auto& m = engine.topology();
  // Checkpoints describe one G x R x S mesh: refused (on every rank alike) on groups of
  // different shapes.
  FEDSHARD_EXPECTS(m.uniform(), "trainer: checkpoints expect groups of one shape (a G x R x S ",
                   "mesh), found group shapes ", to_string(m.group_shapes()));
  return {.rank = m.rank(),
          .size = m.size(),
          .agree =
              [&engine](double x, reduce_op op) {
                engine.run(agreement_op(op, engine.topology().size()), {&x, 1, dtype::f64});
                return x;
              },
          .fields = manifest_of<A>(engine, inner, sync, precision),
          .describe =
              [&engine, inner, &sync](file_writer& w) {
                std::vector<std::vector<int>> fragments = geometry_of(engine, sync).fragments;
                saved_layout::describe(w, engine.topology().shape(), engine.layout(), fragments,
                                       inner, sync.state_names());
              },
          .geometry = geometry_of(engine, sync),
          .coords = m.coords(),
          .federation_policy = std::string(A::federation_policy::name),
          .description =
              fedshard::detail::concat(A::shard_policy::name, ", ", A::federation_policy::name),
          .log = std::move(log),
          .check = [o = ownership_field(engine.owners())](
                       const saved_checkpoint& saved) { check_owners(saved, o); }};
}

}  // namespace fedshard::checkpoint
