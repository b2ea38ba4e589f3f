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
///   after_sync       (zo_sync::records, the default) seeds on the wire: the units are left
///                    out of the federation policy's fragments (synced_units); at each
///                    applied sync every rank all gathers over the federation axis each
///                    group's records since the previous one, then every group replays them
///                    onto the units' values at that previous sync (the anchor), group by
///                    group in group order, each scaled by the group's weight in the sync
///                    (1/n over the n groups it combined, or their token shares under a
///                    token-weighted policy): theta = anchor - sum_g sum_r
///                    fl(fl(s_r w_g) / P) z_r, every group alike, bit for bit
///
/// On the wire a record carries fl(lr g) in place of g (the step's learning rate folded in:
/// fl(1 x s) = s, so the replay's step sizes are the group's own): 24 bytes per probe per
/// step. An exchange is two all_gathers over the federation axis: each group's record count
/// (8 bytes), then n records of each group, n the largest count (24 n bytes; shorter lists
/// padded): G x (8 + 24 n) bytes gathered by every rank, whatever the units' size. A group
/// whose only combined group is itself (one group, or a sample of one) ends with exactly the
/// parameters the federation would have sent; with several, the result is the weighted mean
/// of the groups' units up to the rounding of its terms. The federation policy's own rule
/// (an outer optimizer's step, a codec, mixing) applies to the other units only.
///
/// Memory: one copy of the rank's shards of the zeroth-order units (the values put back),
/// where backprop would need their gradient buffers, and one more for the anchor under
/// zo_sync::records. Every rank of the group computes the same records (the losses are the
/// group's means), and each updates its own shard. The first-order units train by backprop in
/// the same step. Costs per step: 2 P forward passes of the whole model and 2 P group
/// all_reduces of one f64. Not supported with records: an elastic federation axis (refused).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fedshard/core/state_registry.hpp"
#include "fedshard/error.hpp"
#include "fedshard/optim/zeroth_order.hpp"
#include "fedshard/trainer/local_rule.hpp"

namespace fedshard {

/// How the zeroth-order units cross the federation link.
enum class zo_sync : std::uint8_t {
  records,     ///< as the round's records, replayed by every group (seeds on the wire)
  parameters,  ///< as parameters, through the federation policy like every other unit
};

/// The zeroth-order local rule of one rank (see the file comment).
class local_zeroth_order final : public local_rule {
 public:
  local_zeroth_order(optim::zeroth_order_settings s, std::vector<std::string> units,
                     zo_sync sync = zo_sync::records)
      : s_(s), units_(std::move(units)), sync_(sync) {
    optim::check(s_);
    FEDSHARD_EXPECTS(!units_.empty(), "local_zeroth_order: name at least one unit");
  }
  /// The model's `lower` first units (HO-FL's lower layers), named once the trainer tells
  /// the rule the model's units (model_units).
  local_zeroth_order(optim::zeroth_order_settings s, std::size_t lower,
                     zo_sync sync = zo_sync::records)
      : s_(s), lower_(lower), sync_(sync) {
    optim::check(s_);
    FEDSHARD_EXPECTS(lower_ >= 1,
                     "local_zeroth_order: train at least one lower unit "
                     "zeroth-order, found 0");
  }

  std::string_view name() const override { return "zeroth_order"; }
  void model_units(const std::vector<std::string>& names) override {
    if (lower_ == 0) return;
    FEDSHARD_EXPECTS(lower_ < names.size(), "local_zeroth_order: ", lower_,
                     " lower units zeroth-order leave none to train by backprop: expected fewer "
                     "than the model's ",
                     names.size(), " units");
    units_.assign(names.begin(), names.begin() + static_cast<std::ptrdiff_t>(lower_));
  }
  std::vector<std::string> gradient_free_units() const override { return units_; }
  std::vector<std::string> synced_units() const override {
    return sync_ == zo_sync::records ? units_ : std::vector<std::string>{};
  }

  void bind(const local_setup& setup) override {
    seed_ = optim::zo_group_seed(s_.seed, setup.group);
    master_size_ = setup.master_size;
    for (const auto& u : setup.units)
      if (std::find(units_.begin(), units_.end(), u.name) != units_.end()) ranges_.push_back(u);
    for (const auto& r : ranges_) held_ += r.count;
    anchor_.assign(held_, 0.0f);
  }

  bool before_forward(local_access& a) override {
    if (!started_ && sync_ == zo_sync::records) copy_out(a.master, anchor_);
    started_ = true;
    return false;
  }

  void after_backward(local_access& a) override {
    copy_out(a.master, saved_);
    const auto slices = slices_of(a.master);
    records_.clear();
    for (int p = 0; p < s_.probes; ++p)
      records_.push_back(optim::spsa_probe(slices, s_, seed_, a.step, static_cast<std::int32_t>(p),
                                           [&a] { return a.loss(); }));
    copy_in(saved_, a.master);  // exactly: the round trips' additions may round
  }

  void optimizer_step(local_access& a, float lr) override {
    a.optimizer_step(lr);
    copy_in(saved_, a.master);
    optim::zo_apply(
        slices_of(a.master), records_, [lr](std::int64_t) { return lr; }, s_.probes);
    if (sync_ != zo_sync::records) return;
    for (auto r : records_) {
      r.scalar = kernels::detail::mul_rn(lr, r.scalar);  // fl(lr g): the wire's scalar
      round_.push_back(r);
    }
  }

  void after_sync(local_access& a, const local_sync& s) override {
    if (sync_ != zo_sync::records) return;
    const auto of_group = exchange(s);
    const auto weights = weights_of(s);
    copy_in(anchor_, a.master);
    const auto slices = slices_of(a.master);
    for (int g = 0; g < s.groups; ++g)
      if (s.includes(g))
        optim::zo_apply(
            slices, of_group[static_cast<std::size_t>(g)], [](std::int64_t) { return 1.0f; },
            s_.probes, weights[static_cast<std::size_t>(g)]);
    copy_out(a.master, anchor_);
    round_.clear();
  }

  void register_state(state_registry& r) override;

  /// The latest step's records, one per probe (what its update needs, 24 bytes each).
  const std::vector<optim::zo_record>& records() const noexcept { return records_; }
  /// The records the group has taken since the previous sync, as they cross the wire (the
  /// step's learning rate folded into each scalar); empty under zo_sync::parameters.
  const std::vector<optim::zo_record>& round_records() const noexcept { return round_; }
  /// The group's seed of directions.
  std::uint64_t seed() const noexcept { return seed_; }
  /// How the units cross the federation link.
  zo_sync sync() const noexcept { return sync_; }

 private:
  /// Every group's records of the round, by group: two all_gathers (counts, then records).
  std::vector<std::vector<optim::zo_record>> exchange(const local_sync& s) const {
    constexpr std::size_t words = sizeof(optim::zo_record) / sizeof(double);
    const auto groups = static_cast<std::size_t>(s.groups);
    const double mine = static_cast<double>(round_.size());
    std::vector<double> counts(groups);
    s.all_gather(std::span<const double>(&mine, 1), counts);
    std::size_t n = 0;
    for (double c : counts) n = std::max(n, static_cast<std::size_t>(c));
    std::vector<double> out(n * words, 0.0);
    copy_bytes(out.data(), round_.data(), round_.size() * sizeof(optim::zo_record));
    std::vector<double> all(groups * n * words);
    if (n > 0) s.all_gather(out, all);
    std::vector<std::vector<optim::zo_record>> by_group(groups);
    for (std::size_t g = 0; g < groups; ++g) {
      by_group[g].resize(static_cast<std::size_t>(counts[g]));
      copy_bytes(by_group[g].data(), all.data() + g * n * words,
                 by_group[g].size() * sizeof(optim::zo_record));
    }
    return by_group;
  }

  /// memcpy of n bytes, nothing for n = 0 (where an empty vector's data() may be null).
  static void copy_bytes(void* to, const void* from, std::size_t n) noexcept {
    if (n > 0) std::memcpy(to, from, n);
  }

  /// Each group's weight in the sync: its token share under a token-weighted policy, else
  /// 1/n over the n combined groups (0 for the others).
  static std::vector<float> weights_of(const local_sync& s) {
    std::vector<float> w(static_cast<std::size_t>(s.groups), 0.0f);
    double total = 0.0;
    int n = 0;
    for (int g = 0; g < s.groups; ++g)
      if (s.includes(g)) {
        ++n;
        if (!s.group_tokens.empty()) total += s.group_tokens[static_cast<std::size_t>(g)];
      }
    for (int g = 0; g < s.groups; ++g) {
      if (!s.includes(g)) continue;
      const auto gg = static_cast<std::size_t>(g);
      w[gg] = !s.group_tokens.empty() && total > 0.0
                  ? static_cast<float>(s.group_tokens[gg] / total)
                  : static_cast<float>(1.0 / static_cast<double>(n));
    }
    return w;
  }

  /// The units' values in master, back to back, into out.
  void copy_out(std::span<const float> master, std::vector<float>& out) const {
    out.clear();
    for (const auto& r : ranges_) {
      const auto part = master.subspan(r.offset, r.count);
      out.insert(out.end(), part.begin(), part.end());
    }
  }
  /// The units' values in master from `in` (as copy_out lays them out).
  void copy_in(std::span<const float> in, std::span<float> master) const {
    std::size_t at = 0;
    for (const auto& r : ranges_) {
      std::copy_n(in.begin() + static_cast<std::ptrdiff_t>(at), r.count,
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
  std::size_t lower_ = 0;  // units by position: the first lower_ (model_units)
  zo_sync sync_;
  std::vector<local_unit> ranges_;  // this rank's parts of the units
  std::size_t held_ = 0;            // their elements
  std::size_t master_size_ = 0;
  std::uint64_t seed_ = 0;
  std::vector<optim::zo_record> records_;  // the latest step's
  std::vector<optim::zo_record> round_;    // since the previous sync, as on the wire
  std::vector<float> saved_;               // the units' values before the probes
  std::vector<float> anchor_;              // the units' values at the previous sync
  bool started_ = false;
};

/// The rule's state: the anchor ("zo.anchor", laid out like the master: the units' elements,
/// zeros elsewhere; a fresh start takes the parameters), the round's records ("zo.round",
/// 24 bytes each, as many as taken) and whether the anchor was taken ("zo.started").
inline void local_zeroth_order::register_state(state_registry& r) {
  if (sync_ != zo_sync::records) return;
  r.add_kind({.prefix = "zo.", .noun = "zeroth-order state"});
  state_entry anchor{.name = "zo.anchor", .extent = state_extent::master};
  anchor.missing = state_start::parameters;
  anchor.group = "zo";
  anchor.element_size = sizeof(float);
  anchor.bytes = [this] { return master_size_ * sizeof(float); };
  anchor.save = [this](std::span<std::byte> out) {
    std::vector<float> m(master_size_, 0.0f);
    copy_in(anchor_, m);
    copy_bytes(out.data(), m.data(), out.size());
  };
  anchor.load = [this](std::span<const std::byte> in) {
    std::vector<float> m(master_size_);
    copy_bytes(m.data(), in.data(), in.size());
    copy_out(m, anchor_);
  };
  r.add(std::move(anchor));
  state_entry round{.name = "zo.round", .group = "zo"};
  round.variable_size = true;
  round.element_size = sizeof(optim::zo_record);
  round.bytes = [this] { return round_.size() * sizeof(optim::zo_record); };
  round.save = [this](std::span<std::byte> out) {
    copy_bytes(out.data(), round_.data(), out.size());
  };
  round.load = [this](std::span<const std::byte> in) {
    round_.resize(in.size() / sizeof(optim::zo_record));
    copy_bytes(round_.data(), in.data(), in.size());
  };
  r.add(std::move(round));
  r.add_value({.name = "zo.started", .group = "zo"}, &started_);
}

/// trainer_options::local_rule for zeroth-order units `units` with settings s, synced across
/// groups as `sync` says.
inline local_rule_factory zeroth_order_rule(const optim::zeroth_order_settings& s,
                                            std::vector<std::string> units,
                                            zo_sync sync = zo_sync::records) {
  optim::check(s);
  FEDSHARD_EXPECTS(!units.empty(), "zeroth_order_rule: name at least one unit");
  return [s, units, sync] { return std::make_unique<local_zeroth_order>(s, units, sync); };
}
/// trainer_options::local_rule for the model's `lower` first units zeroth-order (HO-FL's
/// split: the lower layers forward-only, the upper ones by backprop).
inline local_rule_factory zeroth_order_lower_rule(const optim::zeroth_order_settings& s,
                                                  std::size_t lower,
                                                  zo_sync sync = zo_sync::records) {
  optim::check(s);
  FEDSHARD_EXPECTS(lower >= 1,
                   "zeroth_order_lower_rule: train at least one lower unit "
                   "zeroth-order, found 0");
  return [s, lower, sync] { return std::make_unique<local_zeroth_order>(s, lower, sync); };
}

}  // namespace fedshard
