#pragma once
/// outer_optimizer<Rule>: FedOpt / DiLoCo. Each fragment keeps an anchor θ_anchor (the last
/// synchronised parameters, sharded like the parameters). At a sync point every group sends
/// its pseudo-gradient Δ_g = θ_anchor − θ_g; the mean Δ over groups drives an outer
/// optimizer step on the anchor (Rule: outer_sgd, nesterov, fedmom, fedadam, fedyogi, or
/// as_outer<O> for any shard optimizer O), and every group restarts from the new anchor. With
/// `average_inner_moments` the inner optimizer's state is averaged across groups too (Photon).

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fedshard/core/buffer.hpp"
#include "fedshard/error.hpp"
#include "fedshard/federation/federation_policy.hpp"
#include "fedshard/federation/outer_rules.hpp"
#include "fedshard/federation/sync_plan.hpp"
#include "fedshard/kernels/sync.hpp"
#include "fedshard/space/host_space.hpp"
#include "fedshard/space/memory_space.hpp"

namespace fedshard::federation {

/// The settings of outer_optimizer<Rule>.
template <class Rule>
struct outer_optimizer_config {
  sync_mode sync = sync_mode::hierarchical;
  typename Rule::config rule{};
  /// Also average the inner optimizer's moments across groups (Photon).
  bool average_inner_moments = false;
};

/// Outer optimizer on pseudo-gradients; Rule is one of federation/outer_rules.hpp. Anchors
/// and the rule's state live in memory space S.
template <class Rule, space::MemorySpace S = space::host_space>
class outer_optimizer {
 public:
  using config = outer_optimizer_config<Rule>;
  template <space::MemorySpace T>
  using in_space = outer_optimizer<Rule, T>;
  static constexpr std::string_view name = Rule::name;
  static constexpr bool syncs = true;
  /// Syncs groups of different shapes too (federation/overlap.hpp).
  static constexpr bool heterogeneous_groups = true;

  outer_optimizer() : space_(space::space_ref<S>::make()), stream_(space_->make_stream()) {}
  outer_optimizer(config c, std::vector<std::size_t> fragment_sizes)
      : outer_optimizer(c, fragment_sizes, space::space_ref<S>::make()) {}
  outer_optimizer(config c, std::vector<std::size_t> fragment_sizes, S& s)
      : outer_optimizer(c, fragment_sizes, space::space_ref<S>(s)) {}

  /// The mean pseudo-gradient's average (parameter_average_ops) and, with
  /// average_inner_moments, every inner-optimizer state buffer's (moment_average_ops).
  plan sync_plan(const sync_context& ctx) const {
    plan p = parameter_average_ops(ctx, config_.sync);
    if (config_.average_inner_moments) p.append(moment_average_ops(ctx, config_.sync));
    return p;
  }

  /// buf: θ_g  ->  Δ_g = θ_anchor − θ_g, queued on st.
  void begin(int f, std::span<float> buf, const sync_info&, typename S::stream& st) {
    check(f, buf.size());
    space_->for_each(st, kernels::pseudo_gradient_update{}, buf, std::span<const float>(anchor(f)));
  }
  /// buf: mean Δ  ->  the new anchor after the outer step, queued on st.
  void end(int f, std::span<float> buf, const sync_info&, typename S::stream& st) {
    check(f, buf.size());
    auto a = anchor(f);
    rules_[index(f)].step(a, std::span<const float>(buf), st);
    space_->copy(st, cview(std::span<const float>(a)), view(buf));
  }
  /// The anchor of fragment f = params, queued on st.
  void reset(int f, std::span<const float> params, typename S::stream& st) {
    check(f, params.size());
    space_->copy(st, cview(params), view(anchor(f)));
  }
  /// begin(), end() and reset() on a stream of the optimizer's own, done when they return
  /// in host_space.
  void begin(int f, std::span<float> buf, const sync_info& info) {
    on_own([&](auto& st) { begin(f, buf, info, st); });
  }
  void end(int f, std::span<float> buf, const sync_info& info) {
    on_own([&](auto& st) { end(f, buf, info, st); });
  }
  void reset(int f, std::span<const float> params) {
    on_own([&](auto& st) { reset(f, params, st); });
  }

  /// Each fragment's anchor ("anchor": the parameters it started the round from, so a
  /// checkpoint without it starts it from the parameters) and its rule's state (from zero),
  /// in the space's memory.
  std::vector<optim::state_tensor> state() {
    std::vector<optim::state_tensor> s;
    for (std::size_t f = 0; f < anchors_.size(); ++f) {
      const int fi = static_cast<int>(f);
      // Every group restarts from the new anchor and steps the rule on the same mean: both
      // are alike in every group (a heal may take them from several donors).
      s.push_back({"anchor", anchors_[f].span(), fi, state_start::parameters, true});
      for (auto& t : rules_[f].state()) s.push_back({t.name, t.data, fi, state_start::zero, true});
    }
    return s;
  }
  /// Outer steps taken by fragment f's rule.
  std::int64_t outer_steps(int f) const { return rules_[index(f)].step_count(); }
  void set_outer_steps(int f, std::int64_t s) { rules_[index(f)].set_step_count(s); }
  /// Fragment f's anchor (in the space's memory).
  std::span<float> anchor(int f) { return anchors_[index(f)].span(); }

 private:
  using rule_type = typename Rule::template in_space<S>;

  outer_optimizer(config c, const std::vector<std::size_t>& fragment_sizes, space::space_ref<S> sr)
      : config_(c), space_(std::move(sr)), stream_(space_->make_stream()) {
    for (std::size_t n : fragment_sizes) {
      anchors_.push_back(space_->template allocate<float>(n));
      rules_.emplace_back(c.rule, n, *space_);
    }
  }

  template <class F>
  void on_own(F&& f) {
    f(stream_);
    space_->synchronize(stream_);
  }
  std::size_t index(int f) const {
    FEDSHARD_EXPECTS(f >= 0 && static_cast<std::size_t>(f) < anchors_.size(),
                     "outer_optimizer: fragment must be in [0, ", anchors_.size(), "), found ", f);
    return static_cast<std::size_t>(f);
  }
  void check(int f, std::size_t n) const {
    FEDSHARD_EXPECTS(n == anchors_[index(f)].size(), "outer_optimizer: fragment ", f, " has ",
                     anchors_[index(f)].size(), " elements, buffer has ", n);
  }
  config config_{};
  space::space_ref<S> space_;  // before the buffers: they go back to it
  typename S::stream stream_;
  std::vector<typename S::template buffer<float>> anchors_;
  std::vector<rule_type> rules_;
};

}  // namespace fedshard::federation
