#pragma once
/// outer_optimizer<Rule>: FedOpt / DiLoCo. Each fragment keeps an anchor θ_anchor (the last
/// synchronised parameters, sharded like the parameters). At a sync point every group sends
/// its pseudo-gradient Δ_g = θ_anchor − θ_g; the mean Δ over groups drives an outer
/// optimizer step on the anchor (Rule: outer_sgd, nesterov, fedmom, fedadam, fedyogi), and
/// every group restarts from the new anchor. With `average_inner_moments` the inner
/// optimizer's state is averaged across groups too (Photon).

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

namespace fedshard::federation {

/// Outer optimizer on pseudo-gradients; Rule is one of federation/outer_rules.hpp.
template <class Rule>
struct outer_optimizer {
  struct config {
    sync_mode sync = sync_mode::hierarchical;
    typename Rule::config rule{};
    /// Also average the inner optimizer's moments across groups (Photon).
    bool average_inner_moments = false;
  };
  static constexpr std::string_view name = Rule::name;
  static constexpr bool syncs = true;

  outer_optimizer() = default;
  outer_optimizer(config c, std::vector<std::size_t> fragment_sizes) : config_(c) {
    for (std::size_t n : fragment_sizes) {
      anchors_.emplace_back(n);
      rules_.emplace_back(c.rule, n);
    }
  }

  /// The mean pseudo-gradient's average (parameter_average_ops) and, with
  /// average_inner_moments, every inner-optimizer state buffer's (moment_average_ops).
  plan sync_plan(const sync_context& ctx) const {
    plan p = parameter_average_ops(ctx, config_.sync);
    if (config_.average_inner_moments) p.append(moment_average_ops(ctx, config_.sync));
    return p;
  }

  /// buf: θ_g  ->  Δ_g = θ_anchor − θ_g.
  void begin(int f, std::span<float> buf, const sync_info&) {
    auto a = anchor(f);
    check(f, buf.size());
    for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = a[i] - buf[i];
  }
  /// buf: mean Δ  ->  the new anchor after the outer step.
  void end(int f, std::span<float> buf, const sync_info&) {
    auto a = anchor(f);
    check(f, buf.size());
    rules_[static_cast<std::size_t>(f)].step(a, std::span<const float>(buf));
    std::copy(a.begin(), a.end(), buf.begin());
  }
  void reset(int f, std::span<const float> params) {
    auto a = anchor(f);
    check(f, params.size());
    std::copy(params.begin(), params.end(), a.begin());
  }
  std::vector<optim::state_tensor> state() {
    std::vector<optim::state_tensor> s;
    for (std::size_t f = 0; f < anchors_.size(); ++f) {
      s.push_back({"fragment" + std::to_string(f) + ".anchor", anchors_[f].span()});
      for (auto& t : rules_[f].state())
        s.push_back({"fragment" + std::to_string(f) + "." + t.name, t.data});
    }
    return s;
  }
  /// Outer steps taken by fragment f's rule.
  std::int64_t outer_steps(int f) const { return rules_[index(f)].step_count(); }
  void set_outer_steps(int f, std::int64_t s) { rules_[index(f)].set_step_count(s); }
  /// Fragment f's anchor.
  std::span<float> anchor(int f) { return anchors_[index(f)].span(); }

 private:
  std::size_t index(int f) const {
    FEDSHARD_EXPECTS(f >= 0 && static_cast<std::size_t>(f) < anchors_.size(),
                     "outer_optimizer: fragment must be in [0, ", anchors_.size(), "), found ", f);
    return static_cast<std::size_t>(f);
  }
  void check(int f, std::size_t n) const {
    FEDSHARD_EXPECTS(n == anchors_[static_cast<std::size_t>(f)].size(),
                     "outer_optimizer: fragment ", f, " has ",
                     anchors_[static_cast<std::size_t>(f)].size(), " elements, buffer has ", n);
  }
  config config_{};
  std::vector<aligned_buffer<float>> anchors_;
  std::vector<Rule> rules_;
};

}  // namespace fedshard::federation
