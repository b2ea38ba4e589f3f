#pragma once
/// local_rule: how a group trains between syncs beyond the plain inner step, the trainer's one
/// extension point for local-training methods (Local Superior Soups: trainer/local_soup.hpp;
/// zeroth-order units next). A rule is given to the trainer through
/// trainer_options::local_rule (a factory the trainer calls once with the master's size), and
/// the trainer calls its hooks at fixed points of every step:
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
/// gradient shard, the step, the inner optimizer's step, and a sum over the group's shards (a
/// collective of every rank of the group, run through the interpreter). Rules run on memory
/// the host can read (host and checked spaces).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>

#include "fedshard/core/state_registry.hpp"

namespace fedshard {

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
};

/// A local-training rule (see the file comment). Every hook but name() has a default that
/// leaves the step as it is.
class local_rule {
 public:
  virtual ~local_rule() = default;
  /// The rule's name, for logs and errors.
  virtual std::string_view name() const = 0;
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

/// Makes the rule of one trainer from the size of its master shard (floats).
using local_rule_factory = std::function<std::unique_ptr<local_rule>(std::size_t)>;

}  // namespace fedshard
