#pragma once
/// A run's checkpoints: save, save_async and load of its state registry
/// (core/state_registry.hpp) in the checkpoint format (trainer/checkpoint.hpp), with
/// resharding (trainer/state_io.hpp) when the checkpoint is of another setup. It knows the
/// run only through the registry and a `checkpoint_run`: what its manifest says, how its
/// element entries lie, and how its ranks agree.

#include <atomic>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fedshard/core/reduce_op.hpp"
#include "fedshard/core/state_registry.hpp"
#include "fedshard/error.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/trainer/checkpoint.hpp"
#include "fedshard/trainer/state_io.hpp"

namespace fedshard::checkpoint {

/// What a checkpoint needs of the run it belongs to.
struct checkpoint_run {
  int rank = 0;  ///< world rank
  int size = 1;  ///< world size
  /// Collective over the world: min or max of a value (the interpreter's agreement op).
  std::function<double(double, reduce_op)> agree;
  /// What a checkpoint of this run must match to load rank by rank.
  checkpoint::manifest fields;
  /// Adds the sections describing the saver's layout to the manifest file (saved_layout).
  std::function<void(file_writer&)> describe;
  /// Where this rank's element entries lie, and its coordinates.
  state_geometry geometry;
  mesh_coords coords;
  /// The federation policy's name (codec residuals survive only within one policy).
  std::string federation_policy;
  /// "(full_shard, none)": the run as a resharding load's log line names it.
  std::string description;
  /// Where log lines go.
  std::function<void(const std::string&)> log;
  /// Refuses (throws) a checkpoint this run cannot load at all; empty: none.
  std::function<void(const saved_checkpoint&)> check{};
};

/// Saves and loads one run's registry; at most one save_async in flight.
class checkpointer {
 public:
  explicit checkpointer(const state_registry& reg) : reg_(&reg) {}
  checkpointer(const checkpointer&) = delete;
  checkpointer& operator=(const checkpointer&) = delete;

  /// Waits for a save_async still writing; its error, if any, goes to `log` (a destructor
  /// cannot agree with the other ranks).
  void abandon(const std::function<void(const std::string&)>& log) noexcept {
    if (!pending_) return;
    pending_->thread.join();
    if (pending_->error) {
      try {
        std::rethrow_exception(pending_->error);
      } catch (const std::exception& e) {
        log(fedshard::detail::concat("fedshard: checkpoint: a save_async into '",
                                     pending_->dir.string(),
                                     "' failed and its trainer was destroyed before "
                                     "wait_for_save(): ",
                                     e.what()));
      }
    }
    pending_.reset();
  }

  /// Collective: writes every rank's registry into dir (checkpoint::save).
  void save(const std::filesystem::path& dir, const checkpoint_run& run) {
    wait_for_save(run);
    checkpoint::save(
        dir, run.rank, run.size, run.fields, run.agree,
        [&](file_writer& w) { write_registry(*reg_, w); }, run.describe, &staging_);
  }

  /// Collective: save() without waiting for the files: the registry is copied into host
  /// memory and written by a thread of its own.
  void save_async(const std::filesystem::path& dir, const checkpoint_run& run) {
    wait_for_save(run);
    auto job = checkpoint::prepare_save(
        dir, run.rank, run.size, run.fields, run.agree,
        [&](file_writer& w) { write_registry(*reg_, w); }, run.describe, &staging_);
    pending_ = std::make_unique<pending_save>();
    pending_->dir = dir;
    pending_->thread = std::thread([job = std::move(job), p = pending_.get()]() mutable {
      try {
        job.run(true);
      } catch (...) {
        p->error = std::current_exception();
      }
      p->used.recycle(std::move(job.rank_file));  // for the next save's snapshot
      p->done.store(true, std::memory_order_release);
    });
  }

  /// Collective: waits for the save_async() in flight, if any; its failure on any rank
  /// throws on every rank.
  void wait_for_save(const checkpoint_run& run) {
    if (!pending_) return;
    pending_->thread.join();
    const std::exception_ptr error = pending_->error;
    staging_.recycle(std::move(pending_->used));
    pending_.reset();
    detail::all_ok(error, "writing a checkpoint in the background", run.rank, run.size, run.agree);
  }
  /// True while this rank's part of a save_async() is still being written.
  bool save_in_flight() const noexcept {
    return pending_ && !pending_->done.load(std::memory_order_acquire);
  }

  /// Collective: restores the registry from dir: rank by rank when the checkpoint is of this
  /// very setup, else resharded; nothing changes unless every rank staged all it needs.
  void load(const std::filesystem::path& dir, const checkpoint_run& run) {
    wait_for_save(run);
    checkpoint::load(dir, run.rank, run.size, run.agree,
                     [&](const saved_checkpoint& saved) { return prepare(saved, run); });
  }

 private:
  std::function<void()> prepare(const saved_checkpoint& saved, const checkpoint_run& run) {
    if (run.check) run.check(saved);
    if (!run.fields.differences(saved.fields()).empty()) return prepare_reshard(saved, run);
    FEDSHARD_EXPECTS(saved.world_size() == run.size, "checkpoint '", saved.dir().string(),
                     "' was saved by ", saved.world_size(),
                     " ranks, its manifest names this run's mesh of ", run.size);
    auto st = std::make_shared<staged_registry>(
        stage_same(*reg_, saved.rank_file_in_memory(run.rank), run.geometry));
    return [this, st] { apply(*reg_, *st); };
  }

  std::function<void()> prepare_reshard(const saved_checkpoint& saved, const checkpoint_run& run) {
    const auto policy = saved.fields().fields.find("federation_policy");
    const bool same_policy =
        policy != saved.fields().fields.end() && policy->second == run.federation_policy;
    auto [staged, notes] = stage_resharded(*reg_, saved, run.geometry, run.coords, same_policy);
    const auto sv = saved_layout::read(saved.manifest_file());
    auto dims = [](const mesh_shape& x) {
      return fedshard::detail::concat(x.groups, "x", x.replicas, "x", x.shards);
    };
    notes.insert(notes.begin(),
                 fedshard::detail::concat(
                     "fedshard: checkpoint '", saved.dir().string(), "' of ", dims(sv.shape),
                     " resharded onto ", dims(run.geometry.shape), " (", run.description,
                     "); group g reads the saved group g mod ", sv.shape.groups));
    auto st = std::make_shared<staged_registry>(std::move(staged));
    return [this, st, notes = std::move(notes), log = run.log] {
      apply(*reg_, *st);
      for (const auto& l : notes) log(l);
    };
  }

  /// A save_async() being written by a thread of its own.
  struct pending_save {
    std::filesystem::path dir;
    std::thread thread;
    std::exception_ptr error;
    file_writer used;  // its snapshot's buffers, once written
    std::atomic<bool> done{false};
  };

  const state_registry* reg_;
  std::unique_ptr<pending_save> pending_;
  /// The host buffers of the last save's snapshot, which the next one fills again (no
  /// allocation or page faults on the step that saves).
  file_writer staging_;
};

}  // namespace fedshard::checkpoint
