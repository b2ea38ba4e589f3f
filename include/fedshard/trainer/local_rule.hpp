#pragma once
/// local_rule: how a group trains between syncs beyond the plain inner step, the trainer's one
/// extension point for local-training methods (Local Superior Soups: trainer/local_soup.hpp;
/// zeroth-order units: trainer/local_zeroth_order.hpp). A rule is given to the trainer
/// through trainer_options::local_rule (a factory the trainer calls once, before it builds its
/// shard engine), and the trainer calls its hooks:
///
///   gradient_free_units   (at construction) units the rule trains without gradients: the
///                    engine plans no backward for them and keeps no gradient buffer
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

/// A local-training rule (see the file comment). Every hook but name() has a default that
/// leaves the step as it is.
class local_rule {
 public:
  virtual ~local_rule() = default;
  /// The rule's name, for logs and errors.
  virtual std::string_view name() const = 0;
  /// Names of the units the rule trains without gradients (none by default).
  virtual std::vector<std::string> gradient_free_units() const { return {}; }
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
  /// A federation sync wrote master.
  virtual void parameters_changed() {}
  /// Adds the rule's state to the run's registry.
  virtual void register_state(state_registry& r) { (void)r; }
};

/// Makes the rule of one trainer (each trainer calls it once).
using local_rule_factory = std::function<std::unique_ptr<local_rule>()>;

}  // namespace fedshard
