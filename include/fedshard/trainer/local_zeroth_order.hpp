#pragma once
/// Zeroth-order units (HO-FL's lower layers, MeZO's update) as a local rule
/// (trainer/local_rule.hpp) over optim/zeroth_order.hpp:
///
///   gradient_free_units   the named units: the engine plans no backward gather and no
///                    gradient reduction for them and keeps no full gradient buffer; the
///                    model skips their backward (step_context::takes_gradients)
///   after_backward   for each probe p, the SPSA estimate on the rank's shards of those units:
///                    master += eps z, L+ = the group's mean loss (the model's evaluate),
///                    master -= 2 eps z, L-, master += eps z; g_p = (L+ - L-) / (2 eps),
///                    z regenerated from (the group's seed, step, p, element); then the
///                    units' values are put back exactly (the round trips' additions round)
///   optimizer_step   the inner optimizer steps the other units (the zeroth-order units'
///                    values are put back after it: their zero gradient would still decay
///                    them under weight decay), then theta -= fl(fl(lr g_p) / P) z_p for each
///                    probe: the step's records (records()) alone reproduce this update,
///                    bit for bit, from the values before the step
///
/// Memory: one copy of the rank's shards of the zeroth-order units (the values put back),
/// where backprop would need their gradient buffers.
///
/// Every rank of the group computes the same records (the losses are the group's means), and
/// each updates its own shard. The first-order units train by backprop in the same step.
/// Costs per step: 2 P forward passes of the whole model and 2 P group all_reduces of one
/// f64. Not here yet: sending the records across the federation link instead of the
/// parameters (the units are synced as parameters by the federation policy).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/optim/zeroth_order.hpp"
#include "fedshard/trainer/local_rule.hpp"

namespace fedshard {

/// The zeroth-order local rule of one rank (see the file comment).
class local_zeroth_order final : public local_rule {
 public:
  local_zeroth_order(optim::zeroth_order_settings s, std::vector<std::string> units)
      : s_(s), units_(std::move(units)) {
    optim::check(s_);
    FEDSHARD_EXPECTS(!units_.empty(), "local_zeroth_order: name at least one unit");
  }

  std::string_view name() const override { return "zeroth_order"; }
  std::vector<std::string> gradient_free_units() const override { return units_; }

  void bind(const local_setup& setup) override {
    seed_ = optim::zo_group_seed(s_.seed, setup.group);
    for (const auto& u : setup.units)
      if (std::find(units_.begin(), units_.end(), u.name) != units_.end()) ranges_.push_back(u);
  }

  void after_backward(local_access& a) override {
    save(a.master);
    const auto slices = slices_of(a.master);
    records_.clear();
    for (int p = 0; p < s_.probes; ++p)
      records_.push_back(optim::spsa_probe(slices, s_, seed_, a.step, static_cast<std::int32_t>(p),
                                           [&a] { return a.loss(); }));
    restore(a.master);  // exactly: the round trips' additions may round
  }

  void optimizer_step(local_access& a, float lr) override {
    a.optimizer_step(lr);
    restore(a.master);
    optim::zo_apply(
        slices_of(a.master), records_, [lr](std::int64_t) { return lr; }, s_.probes);
  }

  /// The latest step's records, one per probe (what its update needs, 24 bytes each).
  const std::vector<optim::zo_record>& records() const noexcept { return records_; }
  /// The group's seed of directions.
  std::uint64_t seed() const noexcept { return seed_; }

 private:
  void save(std::span<const float> master) {
    saved_.clear();
    for (const auto& r : ranges_) {
      const auto part = master.subspan(r.offset, r.count);
      saved_.insert(saved_.end(), part.begin(), part.end());
    }
  }
  void restore(std::span<float> master) const {
    std::size_t at = 0;
    for (const auto& r : ranges_) {
      std::copy_n(saved_.begin() + static_cast<std::ptrdiff_t>(at), r.count,
                  master.begin() + static_cast<std::ptrdiff_t>(r.offset));
      at += r.count;
    }
  }
  std::vector<optim::zo_slice> slices_of(std::span<float> master) const {
    std::vector<optim::zo_slice> out;
    for (const auto& r : ranges_) out.push_back({master.subspan(r.offset, r.count), r.element});
    return out;
  }

  optim::zeroth_order_settings s_;
  std::vector<std::string> units_;
  std::vector<local_unit> ranges_;  // this rank's parts of the units
  std::uint64_t seed_ = 0;
  std::vector<optim::zo_record> records_;
  std::vector<float> saved_;
};

/// trainer_options::local_rule for zeroth-order units `units` with settings s.
inline local_rule_factory zeroth_order_rule(const optim::zeroth_order_settings& s,
                                            std::vector<std::string> units) {
  optim::check(s);
  FEDSHARD_EXPECTS(!units.empty(), "zeroth_order_rule: name at least one unit");
  return [s, units] { return std::make_unique<local_zeroth_order>(s, units); };
}

}  // namespace fedshard
