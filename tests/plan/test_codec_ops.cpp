// Encoded ops: an op carrying a codec moves carried(op) (the all_gather of every rank's wire)
// and the interpreter decodes every rank's wire in rank order into f32; the tap and the
// traffic counters see exactly what the plan says; stateful codecs keep their residual
// between firings; ops a codec cannot carry are refused with the reason.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fedshard/codec/cast.hpp"
#include "fedshard/codec/int8_block.hpp"
#include "fedshard/codec/topk.hpp"
#include "fedshard/comm/inproc.hpp"
#include "fedshard/core/fp8.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/interpreter.hpp"
#include "support/spawn_ranks.hpp"

using namespace fedshard;
using fedshard::inproc::communicator;

namespace {

/// Rank r's element i: values with many bits, different per rank.
float value(int r, std::size_t i) {
  return std::sin(0.37f * static_cast<float>(i) + 1.3f * static_cast<float>(r)) *
         (1.0f + 0.25f * static_cast<float>(r));
}

comm_op op_of(comm_kind k, std::int64_t elems, int ranks, codec::spec c) {
  comm_op op{.kind = k,
             .axis = axis::world,
             .dtype = dtype::f32,
             .bytes = elems * 4,
             .ranks = ranks,
             .in = {.role = role::value, .index = 0},
             .out = {.role = role::value, .index = 1},
             .codec = c};
  if (k == comm_kind::all_reduce) op.reduce = reduce_op::avg;
  return op;
}

auto bind(std::vector<float>& in, std::vector<float>& out) {
  return [&](const comm_op&, const operand& o) {
    auto& v = o.index == 0 ? in : out;
    return buffer_view{v.data(), v.size(), dtype::f32};
  };
}

}  // namespace

TEST_CASE("carried(op) is the all_gather of every rank's wire, in whole 4-byte words") {
  const comm_op plain = op_of(comm_kind::all_reduce, 1000, 4, {});
  CHECK(carried(plain) == plain);
  CHECK(wire_bytes(plain) == doctest::Approx(2.0 * 3 / 4 * 4000));

  const comm_op bf = op_of(comm_kind::all_reduce, 1001, 4, codec::spec_of<codec::cast<bf16>>());
  CHECK(encoded(bf));
  CHECK(codec_elements(bf) == 1001);
  CHECK(codec_slot_bytes(bf) == 2004);  // 2002 bytes, rounded up to words
  const comm_op c = carried(bf);
  CHECK(c.kind == comm_kind::all_gather);
  CHECK(c.dtype == dtype::f32);
  CHECK(c.bytes == 4 * 2004);
  CHECK_FALSE(c.reduce.has_value());
  CHECK(wire_bytes(bf) == doctest::Approx(3.0 * 2004));

  // An all_gather encodes each rank's block: 256 elements per rank, int8 + one scale.
  const comm_op g = op_of(comm_kind::all_gather, 4 * 256, 4, codec::spec_of<codec::int8_block>());
  CHECK(codec_elements(g) == 256);
  CHECK(codec_slot_bytes(g) == 256 + 4);
  CHECK(carried(g).bytes == 4 * 260);
  CHECK(describe(g).find("codec int8_block (260 B per rank)") != std::string::npos);

  // topk's closed form at the defaults: one scale, 64 u16 indices, 64 2-bit codes per chunk.
  const comm_op t = op_of(comm_kind::all_reduce, 2 * 4096, 2, codec::spec_of<codec::topk>());
  CHECK(codec_slot_bytes(t) == 2 * (4 + 64 * 2 + 16));

  // Other settings travel with the spec: int8_block of 100 per scale on 256 elements per
  // rank is 3 scales + 256 codes = 268 B; topk of chunk 512, k 5, 8 bits on 1300 elements
  // is 3 scales (12 B) + 15 u16 indices (30 B) + 3 x 5 B of codes = 57 B, slotted as 60 B.
  const comm_op g100 =
      op_of(comm_kind::all_gather, 4 * 256, 4, codec::spec_of<codec::int8_block>({.block = 100}));
  CHECK(codec_slot_bytes(g100) == 268);
  CHECK(describe(g100).find("codec int8_block (268 B per rank)") != std::string::npos);
  const comm_op t8 = op_of(comm_kind::all_reduce, 1300, 2,
                           codec::spec_of<codec::topk>({.chunk = 512, .k = 5, .bits = 8}));
  CHECK(t8.codec.encoded_bytes(1300) == 57);
  CHECK(codec_slot_bytes(t8) == 60);
  CHECK_THROWS_WITH_AS(codec::spec_of<codec::int8_block>({.block = 0}),
                       doctest::Contains("int8_block: block (elements per scale) must be > 0"),
                       invalid_argument);
}

TEST_CASE("check() refuses codecs on ops they cannot carry, saying why") {
  comm_op rs = op_of(comm_kind::reduce_scatter, 64, 4, codec::spec_of<codec::cast<bf16>>());
  rs.reduce = reduce_op::avg;
  CHECK_THROWS_WITH_AS(check(rs), doctest::Contains("a codec encodes all_gather and all_reduce"),
                       invalid_argument);
  comm_op mx = op_of(comm_kind::all_reduce, 64, 4, codec::spec_of<codec::cast<bf16>>());
  mx.reduce = reduce_op::max;
  CHECK_THROWS_WITH_AS(check(mx), doctest::Contains("(sum or avg)"), invalid_argument);
  comm_op half = op_of(comm_kind::all_reduce, 64, 4, codec::spec_of<codec::cast<bf16>>());
  half.dtype = dtype::bf16;
  half.bytes = 128;
  CHECK_THROWS_WITH_AS(check(half), doctest::Contains("a codec encodes f32 values, found bf16"),
                       invalid_argument);
}

TEST_CASE("an encoded all_reduce decodes every rank's wire in rank order, in f32") {
  constexpr int n = 4;
  constexpr std::size_t len = 1001;
  const auto spec = codec::spec_of<codec::cast<bf16>>();
  test::spawn_ranks(n, [&](communicator& world) {
    mesh m(world, {.groups = 1, .replicas = 1, .shards = n});
    interpreter<communicator> interp(m);
    interp.wire().keep_calls(true);
    std::vector<float> x(len);
    for (std::size_t i = 0; i < len; ++i) x[i] = value(world.rank(), i);
    const comm_op op = op_of(comm_kind::all_reduce, len, n, spec);
    interp.run(op, bind(x, x));  // in place
    for (std::size_t i = 0; i < len; ++i) {
      float want = 0.0f;
      for (int r = 0; r < n; ++r) want += static_cast<float>(bf16(value(r, i)));
      want = want / static_cast<float>(n);
      REQUIRE(x[i] == want);
    }
    const auto calls = interp.wire().take_calls();
    REQUIRE(calls.size() == 1);
    CHECK(calls[0] == wire_call::of(op));
    CHECK(interp.traffic().same_traffic(traffic_counters::of(plan{{op}})));
    CHECK(interp.traffic()[axis::world].wire_bytes == doctest::Approx(wire_bytes(op)));
  });
}

TEST_CASE("an encoded all_gather gives every rank every decoded block, its own too") {
  constexpr int n = 3;
  constexpr std::size_t per = 700;  // not a multiple of the block: a short last block
  using C = codec::int8_block;
  const C::config cfg{.block = 100};  // not the default: the spec carries it to each rank
  test::spawn_ranks(n, [&](communicator& world) {
    mesh m(world, {.groups = 1, .replicas = 1, .shards = n});
    interpreter<communicator> interp(m);
    std::vector<float> x(per), y(per * n, -7.0f);
    for (std::size_t i = 0; i < per; ++i) x[i] = value(world.rank(), i);
    const comm_op op = op_of(comm_kind::all_gather, per * n, n, codec::spec_of<C>(cfg));
    CHECK(codec_slot_bytes(op) == 700 + 7 * 4);  // 7 scales of 100
    interp.run(op, bind(x, y));
    for (int r = 0; r < n; ++r) {
      std::vector<float> block(per), want(per, 0.0f);
      for (std::size_t i = 0; i < per; ++i) block[i] = value(r, i);
      std::vector<std::byte> wire(C::encoded_bytes(cfg, per));
      C c(cfg, per);
      c.encode(block, wire);
      c.decode_add(wire, want);
      CHECK(std::memcmp(y.data() + per * static_cast<std::size_t>(r), want.data(),
                        per * sizeof(float)) == 0);
    }
    CHECK(interp.traffic()[axis::world].payload_bytes == carried(op).bytes);
  });
}

TEST_CASE("a stateful codec keeps its residual between firings of the same op") {
  constexpr int n = 2;
  constexpr std::size_t len = 512;
  using C = codec::topk;
  const C::config cfg{.chunk = 128, .k = 4, .bits = 2};
  test::spawn_ranks(n, [&](communicator& world) {
    mesh m(world, {.groups = 1, .replicas = 1, .shards = n});
    interpreter<communicator> interp(m);
    const comm_op op = op_of(comm_kind::all_reduce, len, n, codec::spec_of<C>(cfg));
    // A reference codec per rank, fed the same inputs.
    std::vector<C> ref;
    for (int r = 0; r < n; ++r) ref.emplace_back(cfg, len);
    for (int round = 0; round < 3; ++round) {
      std::vector<float> x(len), y(len);
      for (std::size_t i = 0; i < len; ++i) x[i] = value(world.rank() + round, i);
      interp.run(op, bind(x, y));
      std::vector<float> want(len, 0.0f);
      for (int r = 0; r < n; ++r) {
        std::vector<float> in(len);
        for (std::size_t i = 0; i < len; ++i) in[i] = value(r + round, i);
        std::vector<std::byte> wire(C::encoded_bytes(cfg, len));
        ref[static_cast<std::size_t>(r)].encode(in, wire);
        ref[static_cast<std::size_t>(r)].decode_add(wire, want);
      }
      for (auto& v : want) v = v / static_cast<float>(n);
      CHECK(std::memcmp(y.data(), want.data(), len * sizeof(float)) == 0);
    }
    const auto state = interp.codec_state(op);
    const auto mine = ref[static_cast<std::size_t>(world.rank())].residual();
    REQUIRE(state.size() == len);
    CHECK(std::memcmp(state.data(), mine.data(), len * sizeof(float)) == 0);
  });
}

TEST_CASE("set_included: an encoded average combines only the ranks of the mask it was given") {
  // Three groups on the federation axis; the round includes groups 0 and 2 (group 1 left out,
  // as an elastic round decides). Values exact in bf16: group 0 {1, -2}, group 1 {100, 100},
  // group 2 {3, 6}. With the mask: ({1, -2} + {3, 6}) / 2 = {2, 2} on every rank, group 1's
  // too; with the mask cleared: ({1, -2} + {100, 100} + {3, 6}) / 3 = {104/3, 104/3}.
  const auto spec = codec::spec_of<codec::cast<bf16>>();
  const std::vector<std::vector<float>> values{{1.0f, -2.0f}, {100.0f, 100.0f}, {3.0f, 6.0f}};
  test::spawn_ranks(3, [&](communicator& world) {
    mesh m(world, {.groups = 3, .replicas = 1, .shards = 1});
    interpreter<communicator> interp(m);
    comm_op op = op_of(comm_kind::all_reduce, 2, 3, spec);
    op.axis = axis::federation;
    const auto mine = values[static_cast<std::size_t>(world.rank())];

    interp.set_included(axis::federation, {1, 0, 1});
    std::vector<float> x = mine;
    interp.run(op, bind(x, x));
    CHECK(x == std::vector<float>{2.0f, 2.0f});

    interp.set_included(axis::federation, {});
    x = mine;
    interp.run(op, bind(x, x));
    CHECK(x == std::vector<float>{104.0f / 3.0f, 104.0f / 3.0f});

    CHECK_THROWS_WITH_AS(interp.set_included(axis::federation, {1, 1}),
                         doctest::Contains("a mask of 3 ranks (the federation axis) or none, "
                                           "found 2"),
                         invalid_argument);
  });
}
