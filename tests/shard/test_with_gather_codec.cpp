// with_gather_codec<P, Codec>: P's plan with exactly its compute gathers encoded (f32 ops,
// even when the parameters compute in bf16), everything else untouched; the bytes these
// gathers carry are the codec's closed form.
#include "fedshard/shard/with_gather_codec.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <type_traits>

#include "fedshard/codec/int8_block.hpp"
#include "fedshard/shard/full_shard.hpp"
#include "fedshard/shard/hybrid_shard.hpp"
#include "fedshard/shard/replicate.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;

namespace {
using int8 = codec::int8_block;
template <class P>
using qwz = shard::with_gather_codec<P, int8>;
}  // namespace

static_assert(shard::ShardPolicy<qwz<shard::hybrid_shard>>);

TEST_CASE("with_gather_codec encodes the compute gathers of its policy and nothing else") {
  const flat_layout l(test::tiny_mlp{}.units(), 2);
  CHECK(qwz<shard::full_shard>::name == shard::full_shard::name);
  CHECK(qwz<shard::full_shard>::layout_shards({1, 1, 2}) == 2);
  for (dtype param : {dtype::f32, dtype::bf16}) {
    CAPTURE(to_string(param));
    const shard::precision prec{param, dtype::f32};
    const plan coded = qwz<shard::hybrid_shard>::step_plan(l, {2, 2, 2}, prec);
    const plan plain = shard::hybrid_shard::step_plan(l, {2, 2, 2}, prec);
    REQUIRE(coded.ops.size() == plain.ops.size());
    int gathers = 0;
    for (std::size_t i = 0; i < coded.ops.size(); ++i) {
      const comm_op& c = coded.ops[i];
      const comm_op& p = plain.ops[i];
      if (p.kind != comm_kind::all_gather) {
        CHECK(c == p);
        continue;
      }
      ++gathers;
      CHECK(c.codec == codec::spec_of<int8>());
      CHECK(c.dtype == dtype::f32);  // the codec reads the f32 master
      CHECK(c.bytes / 4 == p.bytes / static_cast<std::int64_t>(size_of(param)));  // same count
      // Units padded to 160, 288 and 96 elements over 2 ranks: blocks of 80, 144 and 48 f32,
      // each encoded as one 256-block's f32 scale (4 B) and a byte per value: 84, 148 and 52
      // B, already whole words. The wire all-gathers 2 of them as f32 words.
      const std::int64_t slot[] = {84, 148, 52};
      CAPTURE(c.unit);
      CHECK(codec_slot_bytes(c) == slot[c.unit]);
      CHECK(carried(c).bytes == 2 * slot[c.unit]);
      CHECK_NOTHROW(check(c));
    }
    CHECK(gathers == 6);  // forward and backward, 3 units
  }
  // On-demand reads of the master (evaluation, checkpoints) are not the policy's plan: exact.
  for (const comm_op& op : shard::ops::read_units(l, {2, 2, 2}).ops) CHECK_FALSE(encoded(op));
  // A policy without gathers has nothing to encode.
  const plan ddp = qwz<shard::replicate>::step_plan(l, {1, 4, 1}, {});
  for (const comm_op& op : ddp.ops) CHECK_FALSE(encoded(op));
}

TEST_CASE("with_gather_codec takes its codec's settings at run time (settings.codec)") {
  const flat_layout l(test::tiny_mlp{}.units(), 2);
  using P = qwz<shard::hybrid_shard>;
  static_assert(std::is_same_v<shard::settings_of_t<P>, P::settings>);
  // Blocks of 64: the per-rank pieces of 80, 144 and 48 f32 take ceil(80 / 64) = 2,
  // ceil(144 / 64) = 3 and 1 scales: 80 + 8 = 88, 144 + 12 = 156 and 48 + 4 = 52 B.
  const P::settings s{.codec = {.block = 64}};
  const plan coded = shard::step_plan_of<P>(l, {2, 2, 2}, {}, s);
  const std::int64_t slot[] = {88, 156, 52};
  int gathers = 0;
  for (const comm_op& c : coded.ops) {
    if (!encoded(c)) continue;
    ++gathers;
    CAPTURE(c.unit);
    CHECK(c.codec == codec::spec_of<int8>({.block = 64}));
    CHECK(codec_slot_bytes(c) == slot[c.unit]);
  }
  CHECK(gathers == 6);
  // The default settings give the three-argument plan; a block of 0 is refused.
  CHECK(shard::step_plan_of<P>(l, {2, 2, 2}, {}, {}).ops == P::step_plan(l, {2, 2, 2}, {}).ops);
  CHECK_THROWS_WITH_AS(shard::step_plan_of<P>(l, {2, 2, 2}, {}, {.codec = {.block = 0}}),
                       doctest::Contains("int8_block: block (elements per scale) must be > 0, "
                                         "found 0"),
                       invalid_argument);
}
