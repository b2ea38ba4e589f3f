#pragma once
/// Test support: federation::weighted_average with a record of what each sync handed it
/// (the participation stage's mask, every group's tokens, the round), and a local rule that
/// wraps another and keeps this rank's master as the step's optimizer step left it (the
/// parameters a sync started right after it packs). Host memory only.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fedshard/federation/weighted_average.hpp"
#include "fedshard/trainer/local_rule.hpp"

namespace fedshard::test {

/// What one sync told the policy (federation::sync_info).
struct recorded_sync {
  std::int64_t round = -1;
  std::vector<std::uint8_t> included;
  std::vector<double> group_tokens;
};

/// weighted_average, recording every begin()'s sync_info.
class recording_weighted_average {
 public:
  using config = federation::weighted_average_config;
  static constexpr std::string_view name = "weighted_average (recorded)";
  static constexpr bool syncs = true;

  recording_weighted_average() = default;
  recording_weighted_average(config c, std::vector<std::size_t> sizes)
      : inner_(c, std::move(sizes)) {}

  plan sync_plan(const federation::sync_context& ctx) const { return inner_.sync_plan(ctx); }
  template <class Stream>
  void begin(int f, std::span<float> buf, const federation::sync_info& info, Stream& st) {
    records_.push_back({info.round,
                        std::vector<std::uint8_t>(info.included.begin(), info.included.end()),
                        std::vector<double>(info.group_tokens.begin(), info.group_tokens.end())});
    inner_.begin(f, buf, info, st);
  }
  template <class Stream>
  void end(int f, std::span<float> buf, const federation::sync_info& info, Stream& st) {
    inner_.end(f, buf, info, st);
  }
  template <class Stream>
  void reset(int f, std::span<const float> params, Stream& st) {
    inner_.reset(f, params, st);
  }
  std::vector<optim::state_tensor> state() { return inner_.state(); }

  /// One record per sync begun, in order.
  const std::vector<recorded_sync>& records() const noexcept { return records_; }

 private:
  federation::weighted_average inner_;
  std::vector<recorded_sync> records_;
};

/// A local rule that runs `inner` and keeps a copy of master after each optimizer step.
class master_recording_rule final : public local_rule {
 public:
  explicit master_recording_rule(std::unique_ptr<local_rule> inner) : inner_(std::move(inner)) {}

  std::string_view name() const override { return inner_->name(); }
  void model_units(const std::vector<std::string>& names) override { inner_->model_units(names); }
  std::vector<std::string> gradient_free_units() const override {
    return inner_->gradient_free_units();
  }
  std::vector<std::string> synced_units() const override { return inner_->synced_units(); }
  void after_sync(local_access& a, const local_sync& s) override { inner_->after_sync(a, s); }
  void bind(const local_setup& s) override { inner_->bind(s); }
  bool before_forward(local_access& a) override { return inner_->before_forward(a); }
  void after_backward(local_access& a) override { inner_->after_backward(a); }
  void optimizer_step(local_access& a, float lr) override {
    inner_->optimizer_step(a, lr);
    last_.assign(a.master.begin(), a.master.end());
  }
  void parameters_changed() override { inner_->parameters_changed(); }
  void register_state(state_registry& r) override { inner_->register_state(r); }

  /// This rank's master after the latest optimizer step (before any sync of that step).
  const std::vector<float>& last_master() const noexcept { return last_; }
  local_rule& inner() noexcept { return *inner_; }

 private:
  std::unique_ptr<local_rule> inner_;
  std::vector<float> last_;
};

/// trainer_options::local_rule: make's rule wrapped in a master_recording_rule.
inline local_rule_factory recording(local_rule_factory make) {
  return [make = std::move(make)] { return std::make_unique<master_recording_rule>(make()); };
}

}  // namespace fedshard::test
