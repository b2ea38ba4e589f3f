#pragma once
/// Prices a run of shard::sparse<Base> (SCAPE, shard/sparse.hpp) from the plans its trainer
/// runs: each step is one of a few kinds, priced by price_plans with that kind's step plan,
/// and the run's price is their mix over its steps.
///
/// Step t (from 0) of a run is of the kind shard::sparse_kind_in_run says (the definition the
/// run-time object uses too), the master counted as written after step t - 1 when a
/// federation sync applied after it; it runs the policy's plan of that kind (kind_plan). The
/// mask exchange (shard::mask_exchange) issued after step t - 1's optimizer step runs on the
/// rank's channel ahead of step t's first gather: it is priced as an overlappable op of step
/// t's first forward acquire, before that gather.
/// Bytes are the plans' wire bytes, so a run's bytes per rank are what the trainer's wire tap
/// records (run_wire_bytes adds the exchange issued after the run's last step).
///
/// Not modelled: the mask's top-k (host nth_element over each shard, every refresh), the
/// plan's local ops (pack, unpack, zero: O(k_u) or O(shard) element copies on the firing's
/// stream, left out of the priced plan) and the packed optimizer (O(sum k_u) per step).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/shard/sparse.hpp"
#include "fedshard/sim/price.hpp"

namespace fedshard::sim {

using shard::sparse_step_kind;

/// The plan a step of kind k runs (the policy's, shard::sparse::kind_plan) with the mask
/// exchange `mask` first when the kind carries it, placed as the simulator prices it: an
/// overlappable op of the first forward acquire (see the file comment).
template <class P>
plan priced_step_plan(const flat_layout& l, const mesh_shape& s, const shard::precision& p,
                      const shard::sparse_settings& c, const comm_op& mask,
                      const sparse_step_kind& k) {
  plan out;
  if (k.mask_exchange) {
    comm_op m = mask;
    m.trigger = trigger::acquire;
    m.phase = phase::forward;
    m.unit = 0;
    m.overlappable = true;
    out.ops.push_back(m);
  }
  for (comm_op& op : P::kind_plan(l, s, p, c, k).ops)
    if (!local(op.kind)) out.ops.push_back(std::move(op));  // not calls (file comment)
  return out;
}

namespace detail {

/// Algorithm A's model (its settings, layout and syncs) with a given step plan.
template <Algorithm A>
class fixed_step_model final : public algorithm_model {
 public:
  fixed_step_model(const algorithm_options<A>& o, plan step) : inner_(o), step_(std::move(step)) {}
  std::string_view shard_policy() const noexcept override { return inner_.shard_policy(); }
  std::string_view federation_policy() const noexcept override {
    return inner_.federation_policy();
  }
  std::string_view sync_schedule() const noexcept override { return inner_.sync_schedule(); }
  bool syncs() const noexcept override { return inner_.syncs(); }
  int fragments() const noexcept override { return inner_.fragments(); }
  const sync_cadence& cadence() const noexcept override { return inner_.cadence(); }
  const local_rule_desc& local() const noexcept override { return inner_.local(); }
  flat_layout layout(const std::string& name, std::vector<unit_spec> units,
                     const mesh_shape& shape) const override {
    return inner_.layout(name, std::move(units), shape);
  }
  plan step_plan(const flat_layout&, const mesh_shape&, const shard::precision&) const override {
    return step_;
  }
  std::vector<plan> sync_plans(const flat_layout& layout, const mesh_shape& shape,
                               const mesh_coords& coords, std::int64_t round) const override {
    return inner_.sync_plans(layout, shape, coords, round);
  }
  bool plan_per_round() const noexcept override { return inner_.plan_per_round(); }
  bool steps_vary() const noexcept override { return false; }
  schedule::sync_action action(int fragment, std::int64_t step,
                               std::int64_t total_steps) const override {
    return inner_.action(fragment, step, total_steps);
  }

 private:
  algorithm_model_of<A> inner_;
  plan step_;
};

}  // namespace detail

/// The price of a run of shard::sparse<Base>: each kind of step, priced, and how often.
struct sparse_run_price {
  struct kind_price {
    sparse_step_kind kind;
    std::int64_t count = 0;  ///< steps of this kind in the run
    step_price price;        ///< one such step (its syncs amortised as price_plans does)
  };
  std::string algorithm;
  shard::sparse_settings settings;
  std::int64_t steps = 0;
  std::vector<kind_price> kinds;    ///< in order of first appearance
  std::int64_t mask_exchanges = 0;  ///< refreshes in the run (the trainer's refreshes())
  double mask_wire_bytes = 0;       ///< one exchange, bytes this rank sends
  std::vector<std::size_t> masked;  ///< k_u by unit (shard::masked_counts)
  std::size_t shard_numel = 0;      ///< elements of a rank's master

  /// Mean seconds per step over the run.
  double step() const {
    double s = 0;
    for (const auto& k : kinds) s += static_cast<double>(k.count) * k.price.step;
    return steps > 0 ? s / static_cast<double>(steps) : 0.0;
  }
  /// Mean wire bytes per step this rank sends on axis a (step ops; syncs amortised).
  double bytes_per_step(axis a) const {
    double b = 0;
    for (const auto& k : kinds) b += static_cast<double>(k.count) * k.price[a].bytes_per_step;
    return steps > 0 ? b / static_cast<double>(steps) : 0.0;
  }
  /// Wire bytes this rank's step ops send on axis a over the run, the mask exchange issued
  /// after the last step included: what the trainer's wire tap records (syncs excluded).
  double run_step_wire_bytes(axis a) const {
    double b = 0;
    for (const auto& k : kinds) b += static_cast<double>(k.count) * k.price[a].step_bytes;
    if (a == axis::shard && shard::sparse_refreshes_after(settings, steps - 1))
      b += mask_wire_bytes;
    return b;
  }
  /// Tokens per second per GPU over the run.
  double tokens_per_s_per_gpu() const {
    const double s = step();
    return s > 0 && !kinds.empty() ? kinds.front().price.tokens_per_gpu / s : 0.0;
  }
};

/// Prices `steps` steps of Algorithm A (shard policy shard::sparse<Base>) with options o and
/// shard settings c on units laid out for `shape` on cluster c, given one GPU's compute
/// seconds and tokens per step (see the file comment).
template <Algorithm A>
sparse_run_price price_sparse(const std::string& name, const algorithm_options<A>& o,
                              const shard::sparse_settings& settings, std::vector<unit_spec> units,
                              const mesh_shape& shape, const cluster& c, double compute_seconds,
                              double tokens_per_gpu, std::int64_t steps,
                              const price_options& po = {}) {
  using P = typename A::shard_policy;
  static_assert(detail::is_sparse_policy_v<P>, "sim::price_sparse prices shard::sparse<Base>");
  settings.check();
  FEDSHARD_EXPECTS(steps >= 1, "sim::price_sparse: steps must be >= 1, found ", steps);
  const algorithm_desc a = describe<A>(name, o);
  const flat_layout layout = a.layout(units, shape);
  const comm_op mask = shard::mask_exchange(layout.total_shard_numel(), shape);
  const bool packable = shard::sparse_gathers_packable(P::step_plan(layout, shape, po.precision));

  sparse_run_price out;
  out.algorithm = name;
  out.settings = settings;
  out.steps = steps;
  out.masked = shard::masked_counts(layout, settings);
  out.shard_numel = layout.total_shard_numel();
  out.mask_wire_bytes = wire_bytes(mask);
  std::map<sparse_step_kind, std::size_t> at;
  for (std::int64_t t = 0; t < steps; ++t) {
    bool synced = false;  // a sync applied after step t - 1 wrote the master
    if (t > 0 && a.syncs())
      for (int f = 0; f < a.fragments(); ++f)
        synced = synced || schedule::applies(a.action(f, t - 1, steps));
    const sparse_step_kind k = shard::sparse_kind_in_run(settings, t, synced, packable);
    if (shard::sparse_refreshes_after(settings, t)) ++out.mask_exchanges;
    auto [it, fresh] = at.emplace(k, out.kinds.size());
    if (fresh) {
      const algorithm_desc ak(
          name, std::make_shared<const detail::fixed_step_model<A>>(
                    o, priced_step_plan<P>(layout, shape, po.precision, settings, mask, k)));
      out.kinds.push_back(
          {k, 0, price_plans(ak, units, shape, c, compute_seconds, tokens_per_gpu, po)});
    }
    ++out.kinds[it->second].count;
  }
  return out;
}

/// price_sparse for a training workload w (sim::transformer_units, compute as sim::price).
template <Algorithm A>
sparse_run_price price_sparse(const std::string& name, const algorithm_options<A>& o,
                              const shard::sparse_settings& settings, const workload& w,
                              const mesh_shape& shape, const cluster& c, std::int64_t steps,
                              const price_options& po = {}) {
  w.check();
  return price_sparse<A>(name, o, settings, transformer_units(w.model, dtype::bf16), shape, c,
                         compute_seconds_of(w, c), w.tokens_per_gpu(), steps, po);
}

}  // namespace fedshard::sim
