#pragma once
/// local_element_mask: a group trains only the elements it holds this round (FEAST's width
/// slices, Collate's per-round masks; shard/element_ownership.hpp), with optimizer state for
/// those elements only. Pair it with federation/element_average.hpp and the same masks.
///
/// The rule's optimizer step replaces the inner one: it gathers the held elements of this
/// rank's master and gradients (k of them), steps a packed optimizer O of k elements of its
/// own, and scatters the parameters back; every other element keeps its value bit for bit, so
/// an element the group does not hold stays at its global value (element_average's rule 2
/// relies on it). The trainer's inner optimizer is never stepped: the rule owns its optimizer
/// (local_rule::owns_optimizer), so the trainer allocates no inner state at all, and a group
/// holds optimizer state for the elements it holds only.
///
/// Rounds: the rule's round is the number of syncs applied so far (after_sync), which is
/// element_average's sync_info::round when the schedule syncs one fragment and each sync is
/// applied before the next starts (the periodic schedule). At the first step of a round the
/// rule takes masks(round): an element held in the previous round too keeps its optimizer
/// state; an element newly held starts from the current global value (the sync gave every
/// group every element's global value) and from zero state; the step count carries on.
///
/// State: the packed buffers, the held elements' positions, the round and the step count are
/// saved as one section "element_mask.state" (its size changes with the masks, so it is
/// saved as bytes of this rank, not laid out over the model's elements: a checkpoint restores
/// into the same mesh only).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fedshard/core/state_registry.hpp"
#include "fedshard/error.hpp"
#include "fedshard/optim/optimizer.hpp"
#include "fedshard/shard/element_ownership.hpp"
#include "fedshard/shard/flat_layout.hpp"
#include "fedshard/trainer/local_rule.hpp"

namespace fedshard {

/// The element-mask local rule of one rank with packed optimizer O (see the file comment).
template <optim::ShardOptimizer O>
class local_element_mask final : public local_rule {
 public:
  /// The masks of each round (element_average's config::masks: from the model's layout,
  /// the group count and the round) and the packed optimizer's settings.
  using mask_source =
      std::function<shard::element_ownership(const flat_layout&, int groups, std::int64_t round)>;
  local_element_mask(mask_source masks, typename O::config cfg)
      : masks_(std::move(masks)), cfg_(cfg), opt_(std::make_unique<O>(cfg_, 0)) {
    FEDSHARD_EXPECTS(masks_ != nullptr, "local_element_mask: expected a mask source, found none");
  }

  std::string_view name() const override { return "element_mask"; }
  /// Takes the model's layout (its units' names and element counts) and group count from s;
  /// invalid_argument when s has no layout.
  void bind(const local_setup& s) override {
    FEDSHARD_EXPECTS(s.layout != nullptr,
                     "local_element_mask: expected the model's layout in the local setup, found "
                     "none");
    setup_ = s;
    layout_.emplace(*s.layout);
    setup_.layout = &*layout_;
    std::sort(setup_.units.begin(), setup_.units.end(),
              [](const local_unit& a, const local_unit& b) { return a.offset < b.offset; });
    base_.assign(layout_->num_units(), 0);
    index_.clear();
    for (std::size_t u = 0; u < layout_->num_units(); ++u) {
      index_[layout_->unit(u).name] = u;
      if (u > 0) base_[u] = base_[u - 1] + layout_->unit(u - 1).numel;
    }
  }
  void optimizer_step(local_access& a, float lr) override {
    take_round();
    const std::size_t k = idx_.size();
    std::vector<float> p(k), g(k);
    for (std::size_t j = 0; j < k; ++j) {
      p[j] = a.master[idx_[j]];
      g[j] = a.grad[idx_[j]];
    }
    opt_->step(std::span<float>(p), std::span<const float>(g), lr);
    for (std::size_t j = 0; j < k; ++j) a.master[idx_[j]] = p[j];
  }
  void after_sync(local_access&, const local_sync&) override { ++round_; }
  bool owns_optimizer() const override { return true; }
  void register_state(state_registry& r) override;

  /// The master offsets of the elements held this round (after the round's first step).
  std::span<const std::size_t> held() const noexcept { return idx_; }
  /// The packed optimizer (its state: one value per held element, in held()'s order).
  O& optimizer() noexcept { return *opt_; }
  /// Syncs applied so far: the round of the next step.
  std::int64_t round() const noexcept { return round_; }

 private:
  /// The master offsets this rank's group holds in round r, ascending.
  std::vector<std::size_t> held_in(std::int64_t r) const;
  /// At the first step of a round: the round's held elements, the state remapped.
  void take_round();
  std::vector<std::byte> save() const;
  /// The held elements of saved bytes `in`; invalid_argument unless its size fits them.
  std::size_t check_saved(std::span<const std::byte> in) const;
  void load(std::span<const std::byte> in);

  mask_source masks_;
  std::optional<flat_layout> layout_;  // the model's, from bind
  std::vector<std::size_t> base_;      // each unit's first element in the model
  std::map<std::string, std::size_t, std::less<>> index_;
  typename O::config cfg_;
  std::unique_ptr<O> opt_;  // by pointer: a new one per round (see take_round)
  local_setup setup_;
  std::vector<std::size_t> idx_;
  std::int64_t round_ = 0, taken_ = -1;  // taken_: the round idx_ and opt_ are for
};

template <optim::ShardOptimizer O>
std::vector<std::size_t> local_element_mask<O>::held_in(std::int64_t r) const {
  const shard::element_ownership o = masks_(*layout_, setup_.groups, r);
  std::vector<std::size_t> out;
  for (const local_unit& lu : setup_.units) {
    if (o.everyone()) {
      for (std::size_t i = 0; i < lu.count; ++i) out.push_back(lu.offset + i);
      continue;
    }
    const auto it = index_.find(lu.name);
    FEDSHARD_EXPECTS(it != index_.end(), "local_element_mask: unit '", lu.name,
                     "' is not one of the model's");
    const std::size_t u = it->second, lo = static_cast<std::size_t>(lu.element) - base_[u];
    FEDSHARD_EXPECTS(o.groups() > setup_.group && o.held[std::size_t(setup_.group)].size() > u,
                     "local_element_mask: round ", r, "'s masks list ", o.groups(),
                     " groups; expected unit ", u, " of group ", setup_.group);
    for (const shard::element_range& rg : o.held[static_cast<std::size_t>(setup_.group)][u])
      for (std::size_t e = std::max(rg.begin, lo); e < std::min(rg.end, lo + lu.count); ++e)
        out.push_back(lu.offset + (e - lo));
  }
  return out;
}

template <optim::ShardOptimizer O>
void local_element_mask<O>::take_round() {
  if (taken_ == round_) return;
  std::vector<std::size_t> next = held_in(round_);
  auto fresh = std::make_unique<O>(cfg_, next.size());  // zero state
  fresh->set_step_count(opt_->step_count());
  const auto old_state = opt_->state(), new_state = fresh->state();
  for (std::size_t i = 0, j = 0; i < idx_.size() && j < next.size();) {  // both ascending
    if (idx_[i] < next[j]) {
      ++i;
    } else if (next[j] < idx_[i]) {
      ++j;
    } else {
      for (std::size_t t = 0; t < old_state.size(); ++t)
        new_state[t].data[j] = old_state[t].data[i];
      ++i;
      ++j;
    }
  }
  opt_ = std::move(fresh);
  idx_ = std::move(next);
  taken_ = round_;
}

template <optim::ShardOptimizer O>
void local_element_mask<O>::register_state(state_registry& r) {
  r.add_kind({.prefix = "element_mask.", .noun = "element-mask state"});
  r.add(
      {.name = "element_mask.state",
       .reshards = false,
       .variable_size = true,
       .element_size = 1,
       .group = "element_mask",
       .bytes = [this] { return save().size(); },
       .save =
           [this](std::span<std::byte> out) {
             const auto b = save();
             std::memcpy(out.data(), b.data(), b.size());
           },
       .check =
           [this](std::span<const std::byte> in) {
             if (!std::all_of(in.begin(), in.end(), [](std::byte b) { return b == std::byte{0}; }))
               (void)check_saved(in);
           },
       .load = [this](std::span<const std::byte> in) { load(in); }});
}

template <optim::ShardOptimizer O>
std::vector<std::byte> local_element_mask<O>::save() const {
  // round, taken, step count, k, then k offsets, then each state buffer's k floats
  const auto state = opt_->state();
  const std::int64_t head[] = {round_, taken_, opt_->step_count(),
                               static_cast<std::int64_t>(idx_.size())};
  std::vector<std::byte> out(sizeof head + idx_.size() * (8 + 4 * state.size()));
  std::byte* p = out.data();
  std::memcpy(p, head, sizeof head);
  p += sizeof head;
  for (const std::size_t i : idx_) {
    const auto v = static_cast<std::uint64_t>(i);
    std::memcpy(p, &v, 8);
    p += 8;
  }
  for (const optim::state_tensor& t : state) {
    std::memcpy(p, t.data.data(), t.data.size() * 4);
    p += t.data.size() * 4;
  }
  return out;
}

template <optim::ShardOptimizer O>
std::size_t local_element_mask<O>::check_saved(std::span<const std::byte> in) const {
  std::int64_t head[4];
  FEDSHARD_EXPECTS(in.size() >= sizeof head, "local_element_mask: a saved state of ", in.size(),
                   " bytes; expected at least ", sizeof head);
  std::memcpy(head, in.data(), sizeof head);
  const std::size_t per = 8 + 4 * opt_->state().size();  // an offset and each buffer's value
  FEDSHARD_EXPECTS(head[3] >= 0 && (in.size() - sizeof head) % per == 0 &&
                       static_cast<std::size_t>(head[3]) == (in.size() - sizeof head) / per,
                   "local_element_mask: a saved state of ", in.size(), " bytes; expected ",
                   sizeof head + static_cast<std::size_t>(std::max<std::int64_t>(head[3], 0)) * per,
                   " for ", head[3], " held elements");
  return static_cast<std::size_t>(head[3]);
}

template <optim::ShardOptimizer O>
void local_element_mask<O>::load(std::span<const std::byte> in) {
  if (std::all_of(in.begin(), in.end(), [](std::byte b) { return b == std::byte{0}; })) {
    opt_ = std::make_unique<O>(cfg_, 0);  // a checkpoint without the section: a fresh start
    idx_.clear();
    round_ = 0;
    taken_ = -1;
    return;
  }
  const std::size_t k = check_saved(in);
  std::int64_t head[4];
  std::memcpy(head, in.data(), sizeof head);
  auto fresh = std::make_unique<O>(cfg_, k);
  const auto state = fresh->state();
  const std::byte* p = in.data() + sizeof head;
  idx_.assign(k, 0);
  for (std::size_t& i : idx_) {
    std::uint64_t v = 0;
    std::memcpy(&v, p, 8);
    i = static_cast<std::size_t>(v);
    p += 8;
  }
  for (const optim::state_tensor& t : state) {
    std::memcpy(t.data.data(), p, t.data.size() * 4);
    p += t.data.size() * 4;
  }
  fresh->set_step_count(head[2]);
  opt_ = std::move(fresh);
  round_ = head[0];
  taken_ = head[1];
}

/// trainer_options::local_rule for local_element_mask with packed optimizer O, these masks
/// (as element_average's config::masks) and O's settings.
template <optim::ShardOptimizer O>
local_rule_factory element_mask_rule(typename local_element_mask<O>::mask_source masks,
                                     typename O::config cfg) {
  FEDSHARD_EXPECTS(masks != nullptr, "element_mask_rule: expected a mask source, found none");
  return [masks = std::move(masks), cfg] {
    return std::make_unique<local_element_mask<O>>(masks, cfg);
  };
}

}  // namespace fedshard
