#pragma once
/// Prices any alias of fedshard::for_each_algorithm by name, through the path its catalogue
/// entry's type takes:
///  - an algorithm whose every step runs the same plan: sim::price (one step, its syncs
///    amortised);
///  - one whose steps run different plans by its settings (steps_vary_v: shard::sparse,
///    SCAPE): sim::price_sparse over a run of run_settings::steps steps.
/// Either way the result gives the mean seconds per step, tokens per second per GPU and the
/// bytes per axis per step, and keeps the detailed price of the path taken.

#include <array>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "fedshard/core/dtype.hpp"
#include "fedshard/error.hpp"
#include "fedshard/mesh/axis.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/shard/sparse.hpp"
#include "fedshard/sim/price.hpp"
#include "fedshard/sim/sparse.hpp"
#include "fedshard/sim/topology.hpp"
#include "fedshard/trainer/algorithm.hpp"

namespace fedshard::sim {

/// Settings of a priced run of an alias chosen by name.
struct run_settings {
  /// K, fragments, delay, alpha, sync mode and dtype: algorithm_by_name's settings.
  algorithm_settings algorithm{};
  /// shard::sparse's density, refresh period and dense steps (aliases whose steps vary).
  shard::sparse_settings sparse{};
  /// Steps of the priced run (aliases whose steps vary; the others repeat one step).
  std::int64_t steps = 1000;
};

/// The price of a run of an alias: its mean step, and the detailed price of the path taken.
struct run_price {
  std::string algorithm;
  double step = 0;  ///< mean seconds per step
  double tokens_per_s_per_gpu = 0;
  /// Wire bytes this rank sends per step, by axis (syncs amortised).
  std::array<double, std::size(all_axes)> bytes_per_step{};
  std::optional<step_price> each_step;       ///< every step's price (the steps do not vary)
  std::optional<sparse_run_price> over_run;  ///< the run's kinds of step (steps_vary_v)

  /// Mean wire bytes per step this rank sends on axis a.
  double bytes(axis a) const { return bytes_per_step[static_cast<std::size_t>(a)]; }
};

namespace detail {

/// The base policy of shard::sparse<Base>; void for any other shard policy.
template <class P>
struct sparse_base {
  using type = void;
};
template <class B>
struct sparse_base<shard::sparse<B>> {
  using type = B;
};

/// A run of Algorithm A (named `name`) priced through its path (see the file comment).
template <Algorithm A>
run_price price_run_of(std::string_view name, const run_settings& s, const workload& w,
                       const mesh_shape& shape, const cluster& c, const price_options& po) {
  run_price out;
  out.algorithm = std::string(name);
  if constexpr (steps_vary_v<A>) {
    FEDSHARD_EXPECTS(s.algorithm.sync_dtype == dtype::f32, "sim: ", name,
                     ": a run whose steps vary is priced with its federation's own sync (f32), "
                     "found sync dtype ",
                     to_string(s.algorithm.sync_dtype));
    sparse_run_price p = price_sparse<A>(out.algorithm, options_for<A>(name, s.algorithm), s.sparse,
                                         w, shape, c, s.steps, po);
    out.step = p.step();
    out.tokens_per_s_per_gpu = p.tokens_per_s_per_gpu();
    for (axis a : all_axes) out.bytes_per_step[static_cast<std::size_t>(a)] = p.bytes_per_step(a);
    out.over_run = std::move(p);
  } else {
    step_price p = price(describe_named<A>(name, s.algorithm), w, shape, c, po);
    out.step = p.step;
    out.tokens_per_s_per_gpu = p.tokens_per_s_per_gpu;
    for (axis a : all_axes) out.bytes_per_step[static_cast<std::size_t>(a)] = p[a].bytes_per_step;
    out.each_step = std::move(p);
  }
  return out;
}

}  // namespace detail

/// Prices a run of the alias called `name` (one of algorithm_names()) with settings s,
/// training workload w on mesh `shape` of cluster c, through the path its catalogue entry's
/// type takes (see the file comment); invalid_argument listing the known names for an
/// unknown one, and naming the setting for bad settings.
inline run_price price_named(std::string_view name, const run_settings& s, const workload& w,
                             const mesh_shape& shape, const cluster& c,
                             const price_options& po = {}) {
  std::optional<run_price> out;
  for_each_algorithm([&]<class A>(std::string_view n) {
    if (n == name) out = detail::price_run_of<A>(n, s, w, shape, c, po);
  });
  FEDSHARD_EXPECTS(out.has_value(), "sim: unknown algorithm '", name, "', expected one of ",
                   algorithm_list());
  return *std::move(out);
}

/// The alias a run of `name` is measured against when its steps vary (shard::sparse<Base>):
/// the catalogue's alias with the same federation policy and schedule whose shard policy is
/// Base (scape_fsdp: fsdp; fl_scape_fsdp: fl_fsdp). Empty for an alias whose steps do not
/// vary, or when the catalogue has no such alias; invalid_argument for an unknown name.
inline std::string dense_counterpart(std::string_view name) {
  FEDSHARD_EXPECTS(is_algorithm_name(name), "sim: unknown algorithm '", name, "', expected one of ",
                   algorithm_list());
  std::string out;
  for_each_algorithm([&]<class A>(std::string_view n) {
    using base = typename detail::sparse_base<typename A::shard_policy>::type;
    if constexpr (!std::is_void_v<base>) {
      if (n != name) return;
      for_each_algorithm([&]<class D>(std::string_view m) {
        constexpr bool same =
            std::is_same_v<typename D::shard_policy, base> &&
            std::is_same_v<typename D::federation_policy, typename A::federation_policy> &&
            std::is_same_v<typename D::sync_schedule, typename A::sync_schedule>;
        if (same && out.empty()) out = std::string(m);
      });
    }
  });
  return out;
}

}  // namespace fedshard::sim
