#pragma once
/// Local Superior Soups (LSS) as a local rule (trainer/local_rule.hpp) over optim::soup_pool
/// (optim/soup.hpp, where the method and the authors' code are stated):
///
///   before_forward   at the round's first step the pool starts from master (anchor and
///                    member 0); members join on the schedule; master = the interpolation
///                    sum_i w_i v_i with this step's weights (the engine gathers it)
///   after_backward   grad = w_t grad + the affinity and diversity gradients (the distances
///                    summed over the group's shards)
///   optimizer_step   the inner optimizer steps the trained member v_t (copied through
///                    master), then master = the pool's average: between steps, and so at a
///                    sync and in evaluate(), the model is the soup
///   parameters_changed   a sync wrote master: the next step starts a new round from it
///
/// With pool_size 1 and both coefficients 0 every hook leaves the bits of the plain step.
/// Memory: the pool holds (pool_size + 1) x the master shard (soup_pool::held_bytes).
/// Not reproduced: the authors build a fresh Adam when a member joins; here the inner
/// optimizer's state carries over to the new member.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fedshard/core/state_registry.hpp"
#include "fedshard/optim/soup.hpp"
#include "fedshard/trainer/local_rule.hpp"

namespace fedshard {

/// The LSS local rule of one rank (see the file comment).
class local_soup final : public local_rule {
 public:
  explicit local_soup(const optim::soup_config& cfg) : cfg_(optim::validated(cfg)) {}

  std::string_view name() const override { return "local_soup"; }

  void bind(const local_setup& s) override { pool_.emplace(cfg_, s.master_size); }

  bool before_forward(local_access& a) override {
    if (!started_) {
      pool_->start_round(round_, a.master);
      local_step_ = 0;
      started_ = true;
    }
    pool_->maybe_add_member(local_step_);
    weights_ = pool_->weights(local_step_);
    pool_->interpolate(weights_, a.master);
    return true;
  }

  void after_backward(local_access& a) override {
    std::vector<double> d;
    if (pool_->needs_distances()) {
      d.resize(pool_->distance_count());
      pool_->shard_distances(d);
      a.sum_over_shards(d);
    }
    pool_->add_regularizer_gradients(weights_, pool_->regularizer(d), a.grad);
  }

  void optimizer_step(local_access& a, float lr) override {
    const auto trained = pool_->trained_member();
    std::copy(trained.begin(), trained.end(), a.master.begin());
    a.optimizer_step(lr);
    std::copy(a.master.begin(), a.master.end(), trained.begin());
    pool_->average(a.master);
    ++local_step_;
  }

  void parameters_changed() override {
    started_ = false;
    ++round_;
  }

  /// Members and anchor laid out like master ("soup.member<i>", "soup.anchor"), then the
  /// round's counters, whose load restores the pool's member count. One group: a load
  /// without them starts a new round from the loaded parameters.
  void register_state(state_registry& r) override {
    r.add_kind({.prefix = "soup.", .noun = "soup state"});
    const auto element_entry = [](std::string name) {
      state_entry e{.name = std::move(name), .extent = state_extent::master};
      e.missing = state_start::parameters;
      e.group = "soup";
      return e;
    };
    for (std::size_t i = 0; i < pool_->capacity(); ++i)
      r.add_host_span(element_entry("soup.member" + std::to_string(i)), pool_->member(i));
    r.add_host_span(element_entry("soup.anchor"), pool_->anchor());
    r.add_value({.name = "soup.local_step", .group = "soup"}, &local_step_);
    r.add_value({.name = "soup.started", .group = "soup"}, &started_);
    state_entry counters{.name = "soup.round", .group = "soup"};
    counters.element_size = sizeof(counters_);
    counters.bytes = [] { return sizeof(round_counters); };
    counters.save = [this](std::span<std::byte> out) {
      counters_ = {round_, static_cast<std::int64_t>(pool_->members())};
      std::memcpy(out.data(), &counters_, sizeof(counters_));
    };
    counters.load = [this](std::span<const std::byte> in) {
      std::memcpy(&counters_, in.data(), sizeof(counters_));
      round_ = counters_.round;
      if (started_) pool_->resume(round_, static_cast<std::size_t>(counters_.members));
    };
    r.add(std::move(counters));
  }

  /// The pool (its members, weights and memory), once bound.
  const optim::soup_pool& pool() const { return pool_.value(); }

 private:
  struct round_counters {
    std::int64_t round = 0;
    std::int64_t members = 0;
  };
  optim::soup_config cfg_;
  std::optional<optim::soup_pool> pool_;  // made by bind (its size is the master's)
  std::vector<float> weights_;
  std::int64_t round_ = 0;
  std::int64_t local_step_ = 0;
  bool started_ = false;  // false: the next step starts a round from master
  round_counters counters_{};
};

/// trainer_options::local_rule for LSS with these settings.
inline local_rule_factory local_soup_rule(const optim::soup_config& cfg) {
  const auto checked = optim::validated(cfg);
  return [checked] { return std::make_unique<local_soup>(checked); };
}

}  // namespace fedshard
