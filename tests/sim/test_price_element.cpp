// The simulator prices element_average's two ways to move a sync from its plans: (b) the
// masked SUM moves 2 (G-1)/G of the fragment per rank in one call; (a) moves each run among its
// holders and broadcasts the runs that some groups do not hold, in more calls. The federation
// bytes equal the closed form worked by hand; at small units the calls' latency makes (b)
// cheaper, at large units with few holders (a) wins.
#include "fedshard/sim/element.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

using namespace fedshard;
using namespace fedshard::sim;

namespace {

/// One unit: w [rows, 256] f32.
std::vector<unit_spec> one_layer(std::int64_t rows) {
  return {{"layer", {{"w", {rows, 256}}}}};
}

}  // namespace

TEST_CASE("FEAST slices priced by (a) and by (b): bytes by hand, the cheaper by size") {
  // G = 4 groups of 1 rank; capabilities {1, .25, .25, .25}: the first quarter of the rows on
  // every group, the rest on group 0 alone. A fragment of n = rows x 256 f32:
  //  (b): one SUM all_reduce over 4: 2 x 3/4 x 4n = 6n bytes, 1 call;
  //  (a): the first quarter AVG over 4: 1.5 x n bytes; the rest broadcast from group 0:
  //       1 x 3n bytes: 4.5n bytes, 2 calls.
  const mesh_shape shape{4, 1, 1};
  for (const std::int64_t rows : {std::int64_t{4}, std::int64_t{65536}}) {
    CAPTURE(rows);
    const flat_layout l(one_layer(rows), 1);
    const std::vector<double> caps{1.0, 0.25, 0.25, 0.25};
    const auto p =
        price_element_average(one_layer(rows), shape, a100_4gpu_node(),
                              [&](std::int64_t) { return shard::feast_slices(l, caps); });
    const double n = static_cast<double>(rows * 256);
    for (const rank_price& r : p.masked.ranks) {
      CHECK(r.axes[static_cast<std::size_t>(axis::federation)].sync_bytes ==
            doctest::Approx(6 * n));
      CHECK(r.axes[static_cast<std::size_t>(axis::federation)].sync_calls == 1);
    }
    for (const rank_price& r : p.members.ranks) {
      CHECK(r.axes[static_cast<std::size_t>(axis::federation)].sync_bytes ==
            doctest::Approx(4.5 * n));
      CHECK(r.axes[static_cast<std::size_t>(axis::federation)].sync_calls == 2);
    }
    if (rows == 4)  // 4 KB: the second call's latency outweighs 1.5n = 6 KB saved
      CHECK(p.members.sync > p.masked.sync);
    else  // 64 MB: the bytes decide (at 4 MB the two calls still cost more)
      CHECK(p.members.sync < p.masked.sync);
  }
}

TEST_CASE("(a) is refused past 64 groups; (b) prices any number") {
  const flat_layout l(one_layer(8), 1);
  const std::vector<double> caps(70, 1.0);
  auto slices = [&](std::int64_t) { return shard::feast_slices(l, caps); };
  CHECK_THROWS_WITH_AS(price_element_average(one_layer(8), {70, 1, 1}, a100_4gpu_node(), slices),
                       doctest::Contains("at most 64 groups; found fixed = true and 70 groups"),
                       invalid_argument);
  algorithm_options<element_hsdp> o;
  o.federation = {.masks = [&](const flat_layout&, int, std::int64_t r) { return slices(r); }};
  const step_price p = price_plans(describe<element_hsdp>("element_hsdp", o), one_layer(8),
                                   {70, 1, 1}, a100_4gpu_node(), 1.0, 1.0);
  // 8 x 256 f32 = 8192 B over 70 groups: 2 x 69/70 x 8192
  CHECK(p.ranks.front().axes[static_cast<std::size_t>(axis::federation)].sync_bytes ==
        doctest::Approx(2.0 * 69 / 70 * 8192));
}
