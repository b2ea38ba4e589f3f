// Ops on element ranges of a buffer and federation ops among member groups (comm_op::members):
// the interpreter binds only the range, runs a member op on the cached sub-communicator of its
// groups (split_members), taps it on the federation axis, and refuses what does not fit.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/interpreter.hpp"
#include "support/spawn_ranks.hpp"

using namespace fedshard;
using fedshard::inproc::communicator;

namespace {

/// An avg all_reduce of value 0's elements [offset, offset + count) among the groups of mask.
comm_op ranged(std::int64_t offset, std::int64_t count, std::uint64_t mask, int ranks) {
  return {.kind = comm_kind::all_reduce,
          .axis = axis::federation,
          .dtype = dtype::f32,
          .bytes = count * 4,
          .ranks = ranks,
          .reduce = reduce_op::avg,
          .in = {.role = role::value, .offset = offset, .count = count},
          .out = {.role = role::value, .offset = offset, .count = count},
          .members = mask};
}

}  // namespace

TEST_CASE("check: members only on the federation axis, as many as ranks, without a codec") {
  comm_op op = ranged(0, 4, 0b101, 2);
  CHECK_NOTHROW(check(op));
  CHECK(describe(op).find("among groups {0, 2}") != std::string::npos);
  CHECK(describe(op).find("value [0, 4)") != std::string::npos);
  op.ranks = 3;
  CHECK_THROWS_WITH_AS(check(op), doctest::Contains("2 member groups but ranks = 3"),
                       invalid_argument);
  op = ranged(0, 4, 0b11, 2);
  op.axis = axis::replica;
  CHECK_THROWS_WITH_AS(check(op), doctest::Contains("only federation ops"), invalid_argument);
  op = ranged(0, 4, 0, 2);
  op.in.offset = -1;
  CHECK_THROWS_AS(check(op), invalid_argument);
}

TEST_CASE("member ops average a range among their groups only, tapped on the federation axis") {
  // 4 groups x 2 shards: the federation axis of each shard has 4 ranks.
  test::spawn_ranks(8, [](communicator& world) {
    mesh<communicator> m(world, {4, 1, 2});
    interpreter<communicator> in(m);
    const int g = m.coords().group;
    in.split_members(axis::federation, {0b0011, 0b1110, 0b0011});  // the repeat is skipped
    std::vector<float> buf(12);
    for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(10 * g + i);
    const std::vector<float> before = buf;
    auto bind = [&](const comm_op&, const operand&) {
      return buffer_view{buf.data(), buf.size(), dtype::f32};
    };
    plan p;
    // elements [0, 4) among groups {0, 1}; [4, 8) among {1, 2, 3}; [8, 12) untouched
    if (g <= 1) p.ops.push_back(ranged(0, 4, 0b0011, 2));
    if (g >= 1) p.ops.push_back(ranged(4, 4, 0b1110, 3));
    in.wire().keep_calls(true);
    in.wait(in.fire(p, {}, bind));
    for (std::size_t i = 0; i < 12; ++i) {
      float want = before[i];
      if (i < 4 && g <= 1) want = (static_cast<float>(i) + static_cast<float>(10 + i)) / 2;
      if (i >= 4 && i < 8 && g >= 1)
        want =
            (static_cast<float>(10 + i) + static_cast<float>(20 + i) + static_cast<float>(30 + i)) /
            3;
      CHECK(buf[i] == want);
    }
    const auto calls = in.wire().take_calls();
    REQUIRE(calls.size() == p.ops.size());
    for (std::size_t k = 0; k < calls.size(); ++k) CHECK(calls[k] == wire_call::of(p.ops[k]));
    CHECK(in.traffic()[axis::federation].calls == static_cast<std::int64_t>(p.ops.size()));
  });
}

TEST_CASE("a member op without its sub-communicator, or on a non-member, is refused") {
  test::spawn_ranks(2, [](communicator& world) {
    mesh<communicator> m(world, {2, 1, 1});
    interpreter<communicator> in(m);
    std::vector<float> buf(4);
    auto bind = [&](const comm_op&, const operand&) {
      return buffer_view{buf.data(), buf.size(), dtype::f32};
    };
    CHECK_THROWS_WITH_AS(in.run(ranged(0, 4, 0b11, 2), bind),
                         doctest::Contains("split_members() makes it"), invalid_argument);
    CHECK_THROWS_WITH_AS(in.run(ranged(2, 4, 0, 2), bind),
                         doctest::Contains("ends past its 4 elements"), invalid_argument);
    in.split_members(axis::federation, {0b01});
    if (m.coords().group == 1)
      CHECK_THROWS_WITH_AS(in.run(ranged(0, 4, 0b01, 1), bind),
                           doctest::Contains("is not one of its members"), invalid_argument);
    else
      CHECK_NOTHROW(in.run(ranged(0, 4, 0b01, 1), bind));
  });
}
