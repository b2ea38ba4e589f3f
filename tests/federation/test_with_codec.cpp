// with_codec<F, Codec>: only the fragment's cross-group averages carry the codec; the rest of
// F's plan is untouched; the bytes SparseLoCo's codec puts on the federation axis follow the
// closed form (>100x fewer than the f32 average at the paper's settings).
#include "fedshard/federation/with_codec.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <type_traits>

#include "fedshard/codec/cast.hpp"
#include "fedshard/codec/topk.hpp"
#include "fedshard/core/fp8.hpp"
#include "fedshard/federation/average.hpp"
#include "fedshard/federation/outer_optimizer.hpp"
#include "fedshard/federation/outer_rules.hpp"
#include "fedshard/federation/weighted_average.hpp"

using namespace fedshard;
using namespace fedshard::federation;

namespace {
sync_context ctx(mesh_shape shape, mesh_coords me, std::size_t numel, int inner = 0) {
  return {
      .shape = shape, .coords = me, .fragment = 1, .numel = numel, .inner_state_buffers = inner};
}
using sloco = with_codec<outer_optimizer<outer_sgd>, codec::topk>;
}  // namespace

static_assert(FederationPolicy<sloco>);
static_assert(FederationPolicy<with_codec<average, codec::cast<fp8_e4m3>>>);
static_assert(FederationPolicy<with_codec<weighted_average, codec::cast<bf16>>>);
static_assert(std::is_same_v<sync_codec_t<sloco>, codec::topk>);
static_assert(std::is_same_v<sync_codec_t<average>, codec::identity>);

TEST_CASE("with_codec encodes the fragment's cross-group averages and nothing else") {
  for (sync_mode mode : {sync_mode::hierarchical, sync_mode::reference}) {
    CAPTURE(to_string(mode));
    outer_optimizer<nesterov>::config c{.sync = mode, .average_inner_moments = true};
    const with_codec<outer_optimizer<nesterov>, codec::cast<bf16>> coded({c}, {});
    const outer_optimizer<nesterov> plain(c, {});
    const auto me = ctx({4, 2, 1}, {.group = 1, .replica = 0, .shard = 0}, 4096, 2);
    const plan p = coded.sync_plan(me), q = plain.sync_plan(me);
    REQUIRE(p.ops.size() == q.ops.size());
    int encoded_ops = 0;
    for (std::size_t i = 0; i < p.ops.size(); ++i) {
      comm_op o = p.ops[i];
      if (encoded(o)) {
        ++encoded_ops;
        CHECK(averages_fragment_across_groups(o));
        CHECK(o.codec.name == "cast_bf16");
        o.codec = {};
      }
      CHECK(o == q.ops[i]);  // otherwise the same op
    }
    CHECK(encoded_ops == 1);  // the parameters' average; the moments' stay f32
  }
}

TEST_CASE("SparseLoCo's federation bytes: the closed form, >100x below the f32 average") {
  constexpr std::size_t n = std::size_t{1} << 20;  // a fragment of 1 Mi parameters
  for (int groups : {2, 8}) {
    CAPTURE(groups);
    const auto me = ctx({groups, 1, 1}, {}, n);
    const plan f32 = average({}, {}).sync_plan(me);
    const plan sparse = sloco({}, {}).sync_plan(me);
    const double per_chunk = 4 + 64 * 2 + 64 * 2 / 8;  // scale, u16 indices, 2-bit codes
    CHECK(sparse.wire_bytes_on(axis::federation) ==
          doctest::Approx((groups - 1) * per_chunk * (n / 4096)));
    CHECK(f32.wire_bytes_on(axis::federation) / sparse.wire_bytes_on(axis::federation) >
          (groups == 2 ? 100.0 : 25.0));
  }
}

TEST_CASE("with_codec: the codec's settings come from the policy's config, checked when built") {
  // topk with chunk 1000, k 10, 4 bits on a fragment of 2500: chunks of 1000, 1000, 500,
  // 10 sent from each. Wire: 3 scales (12 B) + 30 u16 indices (60 B) + 3 x ceil(10 * 4 / 8)
  // = 15 B of codes: 87 B, slotted as 88 B (whole f32 words); G = 2: one peer's wire each.
  sloco::config c;
  c.codec = {.beta = 0.9f, .chunk = 1000, .k = 10, .bits = 4};
  const sloco p(c, {2500});
  const plan sp = p.sync_plan(ctx({2, 1, 1}, {}, 2500));
  int encoded_ops = 0;
  for (const comm_op& o : sp.ops)
    if (encoded(o)) {
      ++encoded_ops;
      CHECK(o.codec.encoded_bytes(2500) == 87);
      CHECK(codec_slot_bytes(o) == 88);
      CHECK(o.codec == codec::spec_of<codec::topk>(c.codec));
      CHECK(!(o.codec == codec::spec_of<codec::topk>()));  // other settings, other spec
    }
  CHECK(encoded_ops == 1);
  CHECK(sp.wire_bytes_on(axis::federation) == 88.0);
  sloco::config bad;
  bad.codec.k = 5000;  // above the chunk of 4096
  CHECK_THROWS_WITH_AS(sloco(bad, {2500}),
                       doctest::Contains("topk: k must be in [1, chunk = 4096], found 5000"),
                       fedshard::invalid_argument);
}
