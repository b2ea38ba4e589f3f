// The ops of a federation sync: hierarchical (every replica all-reduces 1/R) against the
// reference (replica 0 all-reduces everything, then broadcasts), the weights' exchange, the
// moment buffers; and the ops run by the interpreter give every replica the groups' mean.
#include "fedshard/federation/sync_plan.hpp"

#include <doctest/doctest.h>

#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/interpreter.hpp"
#include "support/spawn_ranks.hpp"

using namespace fedshard;
using namespace fedshard::federation;

namespace {

/// A sync op written out by hand: an average over the groups of role `what` of fragment 2.
comm_op sync_op(comm_kind k, axis a, std::int64_t bytes, int ranks, trigger t, operand in,
                operand out) {
  comm_op op{.kind = k, .axis = a, .dtype = dtype::f32, .bytes = bytes, .ranks = ranks};
  if (reduces(k)) op.reduce = reduce_op::avg;
  op.trigger = t;
  op.phase = phase::sync;
  op.fragment = 2;
  op.in = in;
  op.out = out;
  op.overlappable = false;
  return op;
}

sync_context ctx_of(mesh_shape shape, mesh_coords me, std::size_t numel, int inner = 0) {
  return {
      .shape = shape, .coords = me, .fragment = 2, .numel = numel, .inner_state_buffers = inner};
}

const operand whole{.role = role::fragment};
const operand piece{.role = role::fragment, .piece = axis::replica};

}  // namespace

TEST_CASE("padded_fragment_numel rounds up to a multiple of 16 R") {
  CHECK(padded_fragment_numel(0, 1) == 0);
  CHECK(padded_fragment_numel(1, 1) == 16);
  CHECK(padded_fragment_numel(16, 1) == 16);
  CHECK(padded_fragment_numel(17, 1) == 32);
  CHECK(padded_fragment_numel(17, 2) == 32);
  CHECK(padded_fragment_numel(33, 2) == 64);
  CHECK(padded_fragment_numel(100, 3) == 144);
  for (int R = 1; R <= 5; ++R)
    for (std::size_t n : {std::size_t{1}, std::size_t{15}, std::size_t{63}, std::size_t{64},
                          std::size_t{65}, std::size_t{1000}, std::size_t{12345}}) {
      CAPTURE(R);
      CAPTURE(n);
      const std::size_t p = padded_fragment_numel(n, R);
      const std::size_t q = 16 * static_cast<std::size_t>(R);
      CHECK(p % q == 0);
      CHECK(p >= n);
      CHECK(p - n < q);
      CHECK(p / static_cast<std::size_t>(R) * sizeof(float) % 64 == 0);  // aligned pieces
    }
}

TEST_CASE("hierarchical: every replica all-reduces its 1/R over the groups, then all-gathers") {
  const std::size_t numel = 96;  // padded for R = 2 and 3
  const std::int64_t bytes = 96 * 4;
  for (mesh_shape shape : {mesh_shape{4, 1, 2}, mesh_shape{4, 2, 2}, mesh_shape{2, 3, 1}}) {
    CAPTURE(to_string(shape));
    const int R = shape.replicas, G = shape.groups;
    for (int r = 0; r < R; ++r)
      for (int s = 0; s < shape.shards; ++s) {
        const plan p =
            parameter_average_ops(ctx_of(shape, {1, r, s}, numel), sync_mode::hierarchical);
        std::vector<comm_op> expected{sync_op(comm_kind::all_reduce, axis::federation, bytes / R, G,
                                              trigger::sync_exchange, piece, piece)};
        if (R > 1)
          expected.push_back(sync_op(comm_kind::all_gather, axis::replica, bytes, R,
                                     trigger::sync_finish, piece, whole));
        CHECK(p.ops == expected);
        CHECK_NOTHROW(p.check());
      }
  }
  CHECK_THROWS_WITH_AS(parameter_average_ops(ctx_of({2, 3, 1}, {}, 100), sync_mode::hierarchical),
                       doctest::Contains("100 elements do not divide evenly"), invalid_argument);
}

TEST_CASE("reference: replica 0 all-reduces the whole buffer and broadcasts it to the others") {
  const std::size_t numel = 48;
  const std::int64_t bytes = 48 * 4;
  const mesh_shape shape{3, 2, 2};
  for (int r = 0; r < 2; ++r) {
    const plan p = parameter_average_ops(ctx_of(shape, {0, r, 1}, numel), sync_mode::reference);
    std::vector<comm_op> expected;
    if (r == 0)
      expected.push_back(sync_op(comm_kind::all_reduce, axis::federation, bytes, 3,
                                 trigger::sync_exchange, whole, whole));
    expected.push_back(
        sync_op(comm_kind::broadcast, axis::replica, bytes, 2, trigger::sync_finish, {}, whole));
    CHECK(p.ops == expected);
  }
  // one replica: just the all_reduce
  CHECK(parameter_average_ops(ctx_of({3, 1, 2}, {}, numel), sync_mode::reference).ops.size() == 1);
}

TEST_CASE("per group, both modes put the same bytes on the federation links") {
  // 192 f32 = 768 B over G = 4 groups, all-reduced whole (reference, by replica 0) or as R
  // pieces of 768 / R B (hierarchical, one per replica): either way the group sends
  // 2 (4 - 1) / 4 x 768 = 1152 B.
  const std::size_t numel = 192;
  for (int R : {1, 2, 3, 4}) {
    const mesh_shape shape{4, R, 2};
    double hier = 0, ref = 0;
    for (int r = 0; r < R; ++r) {
      hier += parameter_average_ops(ctx_of(shape, {0, r, 0}, numel), sync_mode::hierarchical)
                  .wire_bytes_on(axis::federation);
      ref += parameter_average_ops(ctx_of(shape, {0, r, 0}, numel), sync_mode::reference)
                 .wire_bytes_on(axis::federation);
    }
    CAPTURE(R);
    CHECK(hier == doctest::Approx(1152.0));
    CHECK(ref == 1152.0);
  }
}

TEST_CASE("weights_ops: the group's token sum, then every group's over the federation axis") {
  const plan p = weights_ops(ctx_of({3, 2, 2}, {}, 64));
  REQUIRE(p.ops.size() == 2);
  CHECK(p.ops[0].kind == comm_kind::all_reduce);
  CHECK(p.ops[0].axis == axis::group);
  CHECK(p.ops[0].dtype == dtype::f64);
  CHECK(p.ops[0].bytes == 8);
  CHECK(p.ops[0].ranks == 4);
  CHECK(p.ops[0].reduce == reduce_op::sum);
  CHECK(p.ops[0].in.role == role::tokens);
  CHECK(p.ops[0].out.role == role::tokens);
  CHECK(p.ops[1].kind == comm_kind::all_gather);
  CHECK(p.ops[1].axis == axis::federation);
  CHECK(p.ops[1].bytes == 24);
  CHECK(p.ops[1].ranks == 3);
  CHECK(p.ops[1].in.role == role::tokens);
  CHECK(p.ops[1].out.role == role::group_tokens);
  for (const comm_op& op : p.ops) {
    CHECK(op.trigger == trigger::sync_prepare);
    CHECK(op.fragment == 2);
  }
}

TEST_CASE("moment_average_ops: every inner-optimizer buffer averaged after the apply") {
  const sync_context ctx = ctx_of({2, 2, 1}, {}, 32, 2);
  const plan p = moment_average_ops(ctx, sync_mode::hierarchical);
  REQUIRE(p.ops.size() == 4);
  for (std::size_t i = 0; i < p.ops.size(); ++i) {
    CHECK(p.ops[i].trigger == trigger::sync_after);
    CHECK(p.ops[i].out.role == role::moment);
    CHECK(p.ops[i].out.index == static_cast<int>(i / 2));
  }
  CHECK(moment_average_ops(ctx_of({2, 2, 1}, {}, 32, 0), sync_mode::reference).ops.empty());
}

TEST_CASE("both modes run on the interpreter and give every replica the mean over groups") {
  for (sync_mode mode : {sync_mode::hierarchical, sync_mode::reference}) {
    CAPTURE(to_string(mode));
    const mesh_shape shape{2, 2, 2};
    test::spawn_ranks(8, [&](inproc::communicator& world) {
      mesh m(world, shape);
      interpreter<inproc::communicator> in(m);
      const std::size_t numel = padded_fragment_numel(40, 2);
      std::vector<float> buf(numel);
      const auto& c = m.coords();
      for (std::size_t i = 0; i < numel; ++i) buf[i] = float(c.group * 8 + c.shard) + float(i);
      const plan p = parameter_average_ops(ctx_of(shape, c, numel), mode);
      auto bind = [&](const comm_op&, const operand&) {
        return buffer_view{buf.data(), buf.size(), dtype::f32};
      };
      in.wait(in.fire(p, {.trigger = trigger::sync_exchange, .phase = phase::sync, .fragment = 2},
                      bind));
      in.wait(
          in.fire(p, {.trigger = trigger::sync_finish, .phase = phase::sync, .fragment = 2}, bind));
      for (std::size_t i = 0; i < numel; ++i)
        CHECK(buf[i] == (float(c.shard) + float(i) + float(8 + c.shard) + float(i)) / 2.0f);
      CHECK(in.traffic().same_traffic(traffic_counters::of(p)));
      // 64 f32 = 256 B over G = 2 groups and R = 2 replicas, as the wire counted it:
      //  - hierarchical: the half (128 B) all-reduced, 2 (2 - 1) / 2 x 128 = 128 B sent, then
      //    the 256 B all-gathered, (2 - 1) / 2 x 256 = 128 B sent, on every rank;
      //  - reference: replica 0 all-reduces the 256 B (256 B sent), then broadcasts them
      //    (256 B, counted on both replicas).
      const bool hier = mode == sync_mode::hierarchical;
      const axis_traffic& fed = in.traffic()[axis::federation];
      const axis_traffic& rep = in.traffic()[axis::replica];
      CHECK(fed.calls == (hier || c.replica == 0 ? 1 : 0));
      CHECK(fed.wire_bytes == (hier ? 128.0 : c.replica == 0 ? 256.0 : 0.0));
      CHECK(rep.calls == 1);
      CHECK(rep.wire_bytes == (hier ? 128.0 : 256.0));
      CHECK(in.traffic()[axis::shard] == axis_traffic{});
    });
  }
}
