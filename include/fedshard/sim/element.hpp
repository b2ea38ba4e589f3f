#pragma once
/// The simulator's price of element_average (FEAST / Collate sub-models at element
/// granularity, federation/element_average.hpp) by each of its two ways to move a sync:
/// (a) sub-communicators per holder set (an AVG among the holders, a broadcast to the rest)
/// and (b) the masked SUM of the whole fragment over every group. Both are priced from the
/// plans element_average makes, as every algorithm is (sim/price.hpp), so a member op is
/// priced on the span of its holders; element_average's own choice (aggregation automatic)
/// compares the closed form of bytes and calls (members_cost) instead.

#include <cstdint>
#include <functional>
#include <vector>

#include "fedshard/federation/element_average.hpp"
#include "fedshard/sim/price.hpp"
#include "fedshard/trainer/algorithm.hpp"

namespace fedshard::sim {

/// HSDP inside each group, element_average every K steps (8 unless told otherwise): the
/// algorithm the prices below describe.
using element_hsdp = algorithm<shard::hybrid_shard, federation::element_average, schedule::periodic,
                               defaults<schedule::periodic::config{.period = 8}>>;

/// A step's price under element_average with fixed masks, moved by (a) and by (b).
struct element_prices {
  step_price members;  ///< (a)
  step_price masked;   ///< (b)
};

/// The prices of one step of element_hsdp on `units` (one compute second per step, one token
/// per GPU) on mesh `shape` of cluster c, the masks fixed for the run (masks(0)), moved by
/// (a) and by (b); invalid_argument as describe() and price_plans() say, and when (a) cannot
/// run (more than 64 groups).
inline element_prices price_element_average(
    std::vector<unit_spec> units, const mesh_shape& shape, const cluster& c,
    const std::function<shard::element_ownership(std::int64_t)>& masks, bool weighted = false) {
  auto priced = [&](federation::element_aggregation how) {
    algorithm_options<element_hsdp> o;
    o.federation = {.masks = [masks](const flat_layout&, int, std::int64_t r) { return masks(r); },
                    .fixed = true,
                    .weighted = weighted,
                    .aggregation = how};
    return price_plans(describe<element_hsdp>("element_hsdp", o), units, shape, c, 1.0, 1.0);
  };
  return {priced(federation::element_aggregation::members),
          priced(federation::element_aggregation::masked)};
}

}  // namespace fedshard::sim
