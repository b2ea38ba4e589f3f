#pragma once
/// local_rule: how a group trains between syncs beyond the plain inner step, the trainer's one
/// extension point for local-training methods (Local Superior Soups: trainer/local_soup.hpp;
/// zeroth-order units: trainer/local_zeroth_order.hpp). A rule is given to the trainer
/// through trainer_options::local_rule (a factory the trainer calls once, before it builds its
/// shard engine), and the trainer calls its hooks:
///
///   model_units      (at construction, first) the model's unit names
///   gradient_free_units   (at construction) units the rule trains without gradients: the
///                    engine plans no backward for them and keeps no gradient buffer
///   synced_units     (at construction) units the rule syncs itself (after_sync): the
///                    federation policy's fragments leave them out
///   owns_optimizer   (at construction) true when the rule's optimizer_step steps an
///                    optimizer of its own and never the inner one: the trainer then gives
///                    the inner optimizer no elements (no state allocated, saved or synced)
///   bind             (at construction) where this rank's master holds each unit
///
/// then at fixed points of every step:
///
///   before_forward   the rank's master holds the parameters between steps; a rule may write
///                    the parameters the model is to compute with there (the engine gathers
///                    them); it returns true when it wrote
///   (forward and backward: grad() holds the step's reduced gradients)
///   after_backward   a rule may change the gradients (a regulariser's gradient)
///   optimizer_step   the inner optimizer's step (default: on master with grad())
///   after_sync       a federation sync was applied: a rule syncs its synced_units (left
///                    out of the federation policy's fragments) with the same groups and
///                    weights, over the federation axis (local_sync::all_gather)
///   parameters_changed   a federation sync wrote master
///   register_state   the rule's state, saved, loaded, resharded and healed with the run's
///
/// local_access is what a hook sees of the trainer: host views of this rank's master and
/// gradient shard, the step, the inner optimizer's step, a sum over the group's shards and the
/// group's mean loss of the step's batch at the current master (both collectives of every
/// rank of the group, run through the interpreter). Rules run on memory the host can read
/// (host and checked spaces).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fedshard/core/state_registry.hpp"
#include "fedshard/shard/flat_layout.hpp"

namespace fedshard {

/// Where this rank's master holds a unit: master[offset, offset + count) are the unit's
/// elements [element, element + count) of the model's flat element space (the units' numel
/// back to back, in declaration order; padding excluded).
struct local_unit {
  std::string name;
  std::size_t offset = 0;
  std::size_t count = 0;
  std::uint64_t element = 0;
};

/// What a rule learns of its trainer at construction (local_rule::bind).
struct local_setup {
  /// Floats in this rank's master.
  std::size_t master_size = 0;
  /// This rank's group.
  int group = 0;
  /// The units this rank's master holds.
  std::vector<local_unit> units;
  /// The model's layout (valid while bind runs: a rule that needs it later copies it); null
  /// where the caller has none.
  const flat_layout* layout = nullptr;
  /// The number of groups of the mesh.
  int groups = 1;
};

/// What a local rule's hook sees of the trainer (see the file comment).
struct local_access {
  /// This rank's master shard (f32, laid out as the engine's master), readable and writable.
  std::span<float> master;
  /// This rank's reduced gradients, laid out like master (after backward).
  std::span<float> grad;
  /// The trainer's 0-based step count.
  std::int64_t step = 0;
  /// Runs the inner optimizer's step on master with grad at this learning rate.
  std::function<void(float)> optimizer_step;
  /// Collective over the group: replaces values with their sum over the group's distinct
  /// shards (each shard counted once, whatever the replicas).
  std::function<void(std::span<double>)> sum_over_shards;
  /// Collective over the group: the group's mean loss of this step's batch at the current
  /// master (the model's evaluate: forward only). Call it on every rank of the group alike.
  std::function<double()> loss;
};

/// What a rule that syncs units of its own (local_rule::synced_units) sees of a federation
/// sync the trainer just applied: whom it combined and by what weights, and the federation
/// axis to exchange its own data on.
struct local_sync {
  /// G, the groups of the federation axis, and this rank's group.
  int groups = 1;
  int group = 0;
  /// Which groups the sync combined (1) or left out (0), by group; empty: every group.
  std::span<const std::uint8_t> included;
  /// Every group's tokens since its previous sync when the federation policy weighs groups by
  /// them (weighted_average), else empty: the groups weigh alike.
  std::span<const double> group_tokens;
  /// Collective over the world (every rank of every group, alike): all gathers each group's
  /// `mine` (the same count on every rank; the same values on every rank of a group) into
  /// `all`, G x mine.size() values in group order. The group's rank 0 gathers over its
  /// federation link and broadcasts the result inside its group, so the slow link carries
  /// each group's values once; both run through the interpreter (counted on their axes,
  /// seen by the wire tap). Groups the sync left out arrive as zeros.
  std::function<void(std::span<const double> mine, std::span<double> all)> all_gather;

  /// True when group g was combined.
  bool includes(int g) const {
    return included.empty() || included[static_cast<std::size_t>(g)] != 0;
  }
};

/// A local-training rule (see the file comment). Every hook but name() has a default that
/// leaves the step as it is.
class local_rule {
 public:
  virtual ~local_rule() = default;
  /// The rule's name, for logs and errors.
  virtual std::string_view name() const = 0;
  /// The model's units, by name in declaration order; called once, first (a rule that names
  /// units by position resolves them here).
  virtual void model_units(const std::vector<std::string>& names) { (void)names; }
  /// Names of the units the rule trains without gradients (none by default).
  virtual std::vector<std::string> gradient_free_units() const { return {}; }
  /// Names of the units the rule syncs across groups itself, in after_sync (none by
  /// default): the federation policy leaves them out of its fragments.
  virtual std::vector<std::string> synced_units() const { return {}; }
  /// True when optimizer_step never runs the inner optimizer (local_access::optimizer_step)
  /// but one of the rule's own, whose state the rule registers: the inner optimizer then
  /// holds no state (false by default).
  virtual bool owns_optimizer() const { return false; }
  /// Where this rank's master holds the units; called once, before the first hook.
  virtual void bind(const local_setup& s) { (void)s; }
  /// Before the model's forward; true when the rule wrote a.master.
  virtual bool before_forward(local_access& a) {
    (void)a;
    return false;
  }
  /// After backward, before the optimizer step.
  virtual void after_backward(local_access& a) { (void)a; }
  /// The optimizer step; the default runs the inner optimizer on master.
  virtual void optimizer_step(local_access& a, float lr) { a.optimizer_step(lr); }
  /// A federation sync was applied (it wrote master); before parameters_changed. A rule
  /// with synced_units syncs them here, with the same groups and weights.
  virtual void after_sync(local_access& a, const local_sync& s) {
    (void)a;
    (void)s;
  }
  /// A federation sync wrote master.
  virtual void parameters_changed() {}
  /// Adds the rule's state to the run's registry.
  virtual void register_state(state_registry& r) { (void)r; }
};

/// Makes the rule of one trainer (each trainer calls it once).
using local_rule_factory = std::function<std::unique_ptr<local_rule>()>;

}  // namespace fedshard
