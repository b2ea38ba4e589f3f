// The simulator prices holder_average (fomoe) from its plans: each group's sync plan packs the
// units it holds, each run of units is priced on the communicator of its holders, and the
// federation bytes are those of the holder sets, fewer than average's.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fedshard/sim/price.hpp"
#include "fedshard/trainer/algorithm.hpp"

using namespace fedshard;
using namespace fedshard::sim;

namespace {

/// A dense unit of n, four experts of n and a head of n / 4 f32 elements.
std::vector<unit_spec> experts_units(std::int64_t n = 4096) {
  std::vector<unit_spec> u{{"dense", {{"w", {n}}}}};
  for (int e = 0; e < 4; ++e) u.push_back({"e" + std::to_string(e), {{"w", {n}}}});
  u.push_back({"head", {{"w", {n / 4}}}});
  return u;
}

/// Dense and head on every one of 4 groups; expert e on the groups of placement(e).
template <class F>
shard::ownership experts_placed(F placement) {
  shard::ownership o{.groups = 4, .holders = {shard::all_groups(4)}};
  for (int e = 0; e < 4; ++e) o.holders.push_back(placement(e));
  o.holders.push_back(shard::all_groups(4));
  return o;
}

step_price priced(const algorithm_desc& a, const mesh_shape& shape, std::int64_t n = 4096) {
  return price_plans(a, experts_units(n), shape, a100_4gpu_node(), 1.0, 1.0);
}

}  // namespace

TEST_CASE("fomoe's priced federation bytes are the holder sets' and fewer than average's") {
  const mesh_shape shape{4, 1, 2};  // shard elements: dense 2048, each expert 2048, head 512
  const step_price avg = priced(describe<fl_hsdp>("fl_hsdp", {}), shape);
  // average: one all_reduce of the whole packed fragment over 4 groups (1.5 x its bytes)
  CHECK(avg[axis::federation].sync_bytes == doctest::Approx(1.5 * (2048 + 4 * 2048 + 512) * 4));

  SUBCASE("one expert per group: only dense and head move") {
    algorithm_options<fomoe> o;
    o.federation.owners = experts_placed([](int e) { return shard::groups_of({e}); });
    const step_price p = priced(describe<fomoe>("fomoe", o), shape);
    for (const rank_price& r : p.ranks) {
      CHECK(r.axes[static_cast<std::size_t>(axis::federation)].sync_bytes ==
            doctest::Approx(1.5 * (2048 + 512) * 4));
      CHECK(r.axes[static_cast<std::size_t>(axis::federation)].sync_calls == 2);
    }
    CHECK(p[axis::federation].sync_bytes < avg[axis::federation].sync_bytes);
    CHECK(p[axis::federation].bytes_per_step < avg[axis::federation].bytes_per_step);
  }
  SUBCASE("each expert on two groups: its bytes go over a communicator of 2") {
    algorithm_options<fomoe> o;
    o.federation.owners = experts_placed([](int e) { return shard::groups_of({e, (e + 1) % 4}); });
    const step_price p = priced(describe<fomoe>("fomoe", o), shape);
    for (const rank_price& r : p.ranks) {
      // dense, head over 4 (1.5 x bytes); two experts over 2 (1 x bytes each)
      CHECK(r.axes[static_cast<std::size_t>(axis::federation)].sync_bytes ==
            doctest::Approx((1.5 * (2048 + 512) + 2.0 * 2048) * 4));
      CHECK(r.axes[static_cast<std::size_t>(axis::federation)].sync_calls == 4);
    }
    CHECK(p[axis::federation].sync_bytes < avg[axis::federation].sync_bytes);
    // At 16 KB per unit the 4 calls' latency outweighs the bytes saved (one call for
    // average); at 16 MB per unit the bytes decide.
    CHECK(p.sync > avg.sync);
    const std::int64_t big = std::int64_t{1} << 22;
    const step_price big_avg = priced(describe<fl_hsdp>("fl_hsdp", {}), shape, big);
    const step_price big_p = priced(describe<fomoe>("fomoe", o), shape, big);
    CHECK(big_p.sync < big_avg.sync);
  }
  SUBCASE("every group holding everything prices as average") {
    const step_price p = priced(describe<fomoe>("fomoe", {}), shape);
    CHECK(p[axis::federation].sync_bytes == avg[axis::federation].sync_bytes);
    CHECK(p.sync == doctest::Approx(avg.sync));
  }
}
