#pragma once
/// Zeroth-order (SPSA / MeZO) updates of parameters that get no gradient, and their records:
/// what crosses the federation link instead of the parameters (HO-FL, FedKSeed).
///
/// One step of the zeroth-order part, for each probe p < P, on the parameters in place
/// (kernels/zeroth_order.hpp gives z(key, i) in {-1, +1}, key = zo_key(seed, step, p)):
///
///   theta += eps z;  L+ = loss();  theta -= 2 eps z;  L- = loss();  theta += eps z
///   g_p = (L+ - L-) / (2 eps)        (in double from the float losses, rounded to float)
///
/// then, once every probe is evaluated (P probes average),
///
///   theta -= s_p z_p  for p = 0..P-1 in order,   s_p = fl(fl(fl(lr * g_p) * w) / P)
///
/// with w = 1 on the group's own parameters. The in-place round trip +eps, -2 eps, +eps leaves
/// theta within an ulp or so of where it was (each addition rounds once); that drift is only
/// in the points the group evaluates its losses at.
///
/// Records. A step's update is fully described by (seed, step, probe, g_p) per probe: a
/// zo_record, 24 bytes. A group that holds the same starting parameters and receives the
/// records applies zo_apply and gets the same bits as the group that made them would by
/// applying the same records: the update has no other input (z is regenerated element by
/// element, the step size is rounded the same way everywhere). Over K local steps a group's
/// zeroth-order update is K x P records, whatever the size of the parameters.
///
/// Sharding. The parameters are given as slices of the flat layout (zo_slice: a rank's values
/// of a range of global element indices); z depends only on the global index, so each rank
/// perturbs and updates its own shard, and the group's ranks must agree on the losses (the
/// trainer averages them over the group before computing g).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <type_traits>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/kernels/zeroth_order.hpp"

namespace fedshard::optim {

/// Settings of the zeroth-order part.
struct zeroth_order_settings {
  /// The perturbation's size (> 0).
  float eps = 1e-3f;
  /// Probes per step (>= 1): their updates average.
  int probes = 1;
  /// The run's seed; a group draws its directions from seed_of(group) (zo_group_seed).
  std::uint64_t seed = 0;
};

/// Refuses settings no step can run with, saying what was expected.
inline void check(const zeroth_order_settings& s) {
  FEDSHARD_EXPECTS(std::isfinite(s.eps) && s.eps > 0.0f,
                   "zeroth_order_settings: eps must be finite and > 0, found ", s.eps);
  FEDSHARD_EXPECTS(s.probes >= 1, "zeroth_order_settings: probes must be >= 1, found ", s.probes);
}

/// The seed of group g's directions: distinct groups draw unrelated directions.
constexpr std::uint64_t zo_group_seed(std::uint64_t run_seed, int group) noexcept {
  return mix64(run_seed ^ mix64(static_cast<std::uint64_t>(group) + 1));
}

/// One probe of one step: the direction's key parts and its projected gradient.
struct zo_record {
  std::uint64_t seed = 0;  ///< the group's seed (zo_group_seed)
  std::int64_t step = 0;   ///< the step it was taken at
  std::int32_t probe = 0;  ///< the probe within the step
  float scalar = 0.0f;     ///< g = (L+ - L-) / (2 eps)

  /// The direction's key (kernels::zo_key).
  constexpr std::uint64_t key() const noexcept { return kernels::zo_key(seed, step, probe); }
  friend bool operator==(const zo_record&, const zo_record&) = default;
};
static_assert(sizeof(zo_record) == 24 && std::is_trivially_copyable_v<zo_record>,
              "zo_record crosses the wire as its 24 bytes");

/// A rank's values of the global element range [offset, offset + values.size()).
struct zo_slice {
  std::span<float> values;
  std::uint64_t offset = 0;
};

/// Adds z(key) * s to every slice (each element rounded once).
inline void zo_add(std::span<const zo_slice> slices, std::uint64_t key, float s) noexcept {
  for (const auto& sl : slices) kernels::zo_add(sl.values, sl.offset, key, s);
}

/// The projected gradient of losses at +eps z and -eps z: (L+ - L-) / (2 eps), computed in
/// double and rounded to float once.
inline float zo_scalar(double loss_plus, double loss_minus, float eps) noexcept {
  return static_cast<float>((loss_plus - loss_minus) / (2.0 * static_cast<double>(eps)));
}

/// One probe (the file comment): perturbs the slices by +eps z, calls loss(), by -2 eps z,
/// calls loss() again, restores them by +eps z, and returns the probe's record. loss() must
/// return the same value on every rank of the group (a mean over the group).
template <class Loss>
zo_record spsa_probe(std::span<const zo_slice> slices, const zeroth_order_settings& s,
                     std::uint64_t seed, std::int64_t step, std::int32_t probe, Loss&& loss) {
  zo_record r{.seed = seed, .step = step, .probe = probe};
  const auto key = r.key();
  zo_add(slices, key, s.eps);
  const double plus = static_cast<double>(loss());
  zo_add(slices, key, -2.0f * s.eps);
  const double minus = static_cast<double>(loss());
  zo_add(slices, key, s.eps);
  r.scalar = zo_scalar(plus, minus, s.eps);
  return r;
}

/// The step size of a record's update: fl(fl(fl(lr * g) * weight) / probes).
inline float zo_step_size(const zo_record& r, float lr, int probes, float weight = 1.0f) noexcept {
  return kernels::detail::div_rn(
      kernels::detail::mul_rn(kernels::detail::mul_rn(lr, r.scalar), weight),
      static_cast<float>(probes));
}

/// Applies records in their order: theta -= s z for each (s = zo_step_size with lr_of(step)).
/// The same records on the same starting values give the same bits on any rank and group.
inline void zo_apply(std::span<const zo_slice> slices, std::span<const zo_record> records,
                     const std::function<float(std::int64_t)>& lr_of, int probes,
                     float weight = 1.0f) {
  FEDSHARD_EXPECTS(probes >= 1, "zo_apply: probes must be >= 1, found ", probes);
  for (const auto& r : records)
    zo_add(slices, r.key(), -zo_step_size(r, lr_of(r.step), probes, weight));
}

/// One zeroth-order step of the slices: every probe evaluated (spsa_probe), then their
/// updates applied; returns the step's records (what the federation sends for it).
template <class Loss>
std::vector<zo_record> spsa_step(std::span<const zo_slice> slices, const zeroth_order_settings& s,
                                 std::uint64_t seed, std::int64_t step, float lr, Loss&& loss) {
  check(s);
  std::vector<zo_record> records;
  records.reserve(static_cast<std::size_t>(s.probes));
  for (int p = 0; p < s.probes; ++p)
    records.push_back(spsa_probe(slices, s, seed, step, static_cast<std::int32_t>(p), loss));
  zo_apply(
      slices, records, [lr](std::int64_t) { return lr; }, s.probes);
  return records;
}

/// The federation's combination of the groups' zeroth-order updates of one round, from
/// their records alone: starting from the round's common values (the anchor), each group's
/// records in group order, scaled by its weight (1/G for a plain average, its token share for
/// a weighted one). Every group that runs it on the same anchor gets the same bits.
inline void zo_combine(std::span<const zo_slice> anchor,
                       std::span<const std::vector<zo_record>> records_of_group,
                       std::span<const float> weight_of_group,
                       const std::function<float(std::int64_t)>& lr_of, int probes) {
  FEDSHARD_EXPECTS(records_of_group.size() == weight_of_group.size(),
                   "zo_combine: one weight per group expected, found ", weight_of_group.size(),
                   " weights for ", records_of_group.size(), " groups");
  for (std::size_t g = 0; g < records_of_group.size(); ++g)
    zo_apply(anchor, records_of_group[g], lr_of, probes, weight_of_group[g]);
}

}  // namespace fedshard::optim
