// The comm_ops of a federation sync: hierarchical (every replica all-reduces 1/R) against the
// reference (replica 0 all-reduces everything, then broadcasts), weights, moment buffers.
#include "fedshard/federation/sync_plan.hpp"

#include <doctest/doctest.h>

#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/executor.hpp"
#include "support/spawn_ranks.hpp"

using namespace fedshard;
using namespace fedshard::federation;

namespace {

comm_op sync_op(comm_kind k, axis a, std::int64_t bytes, int ranks, dtype t = dtype::f32,
                reduce_op op = reduce_op::avg) {
  return {k, a, bytes, t, -1, phase::sync, ranks, op, false};
}

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
        const plan p = average_plan(shape, {1, r, s}, sync_mode::hierarchical, numel);
        std::vector<comm_op> expected{
            sync_op(comm_kind::all_reduce, axis::federation, bytes / R, G)};
        if (R > 1) expected.push_back(sync_op(comm_kind::all_gather, axis::replica, bytes, R));
        CHECK(p.ops == expected);
        CHECK(p.wire_bytes_on(axis::federation) ==
              doctest::Approx(2.0 * (G - 1) / G * double(bytes) / R));
      }
  }
}

TEST_CASE("reference: replica 0 all-reduces the whole buffer and broadcasts it to the others") {
  const std::size_t numel = 64;
  const std::int64_t bytes = 256;
  const mesh_shape shape{4, 2, 2};
  const plan p0 = average_plan(shape, {0, 0, 1}, sync_mode::reference, numel);
  CHECK(p0.ops == std::vector<comm_op>{sync_op(comm_kind::all_reduce, axis::federation, bytes, 4),
                                       sync_op(comm_kind::broadcast, axis::replica, bytes, 2)});
  const plan p1 = average_plan(shape, {3, 1, 0}, sync_mode::reference, numel);
  CHECK(p1.ops == std::vector<comm_op>{sync_op(comm_kind::broadcast, axis::replica, bytes, 2)});
  CHECK(p1.calls_on(axis::federation) == 0);
  // one replica: no broadcast, and the same all_reduce as hierarchical
  const plan single = average_plan({4, 1, 2}, {0, 0, 0}, sync_mode::reference, numel);
  CHECK(single.ops ==
        std::vector<comm_op>{sync_op(comm_kind::all_reduce, axis::federation, bytes, 4)});
  CHECK(single.ops == average_plan({4, 1, 2}, {0, 0, 0}, sync_mode::hierarchical, numel).ops);
}

TEST_CASE("per group, both modes put the same bytes on the federation links") {
  const std::size_t numel = 192;
  for (int R : {2, 3, 4}) {
    const mesh_shape shape{3, R, 1};
    double hier = 0, ref = 0;
    for (int r = 0; r < R; ++r) {
      const double h = average_plan(shape, {0, r, 0}, sync_mode::hierarchical, numel)
                           .wire_bytes_on(axis::federation);
      const double f = average_plan(shape, {0, r, 0}, sync_mode::reference, numel)
                           .wire_bytes_on(axis::federation);
      hier += h;
      ref += f;
      if (r > 0) CHECK(f == 0.0);
    }
    CAPTURE(R);
    CHECK(hier == doctest::Approx(ref));
    // replica 0 carries R times the hierarchical share in the reference mode
    CHECK(average_plan(shape, {0, 0, 0}, sync_mode::reference, numel)
              .wire_bytes_on(axis::federation) ==
          doctest::Approx(R * average_plan(shape, {0, 0, 0}, sync_mode::hierarchical, numel)
                                  .wire_bytes_on(axis::federation)));
  }
}

TEST_CASE("weights_plan: the group's token sum, then every group's over the federation axis") {
  const plan p = weights_plan({5, 2, 3});
  CHECK(p.ops ==
        std::vector<comm_op>{
            sync_op(comm_kind::all_reduce, axis::group, 8, 6, dtype::f64, reduce_op::sum),
            sync_op(comm_kind::all_gather, axis::federation, 40, 5, dtype::f64, reduce_op::sum)});
}

TEST_CASE("sync_plan: weights first, then the average of parameters and of each moment buffer") {
  const mesh_shape shape{2, 2, 2};
  const mesh_coords me{1, 1, 0};
  for (sync_mode mode : {sync_mode::hierarchical, sync_mode::reference}) {
    CAPTURE(to_string(mode));
    const plan avg = average_plan(shape, me, mode, 128);
    CHECK(sync_plan(shape, me, mode, 128, false, 0).ops == avg.ops);
    plan expected = weights_plan(shape);
    expected.append(avg);
    CHECK(sync_plan(shape, me, mode, 128, true, 0).ops == expected.ops);
    // Photon: AdamW's two moments are averaged like the parameters
    expected.append(avg).append(avg);
    CHECK(sync_plan(shape, me, mode, 128, true, 2).ops == expected.ops);
    plan no_weights = avg;
    no_weights.append(avg);
    CHECK(sync_plan(shape, me, mode, 128, false, 1).ops == no_weights.ops);
  }
}

TEST_CASE("both plans run on the executor and give every replica the mean over groups") {
  // 2 groups x 2 replicas; each rank's fragment is 32 floats (padded for R = 2)
  for (sync_mode mode : {sync_mode::hierarchical, sync_mode::reference}) {
    CAPTURE(to_string(mode));
    test::spawn_ranks(4, [&](inproc::communicator& world) {
      mesh m(world, {2, 2, 1});
      executor<inproc::communicator> ex(m);
      const std::size_t n = padded_fragment_numel(20, 2);
      REQUIRE(n == 32);
      std::vector<float> buf(n);
      const int g = m.coords().group, r = m.coords().replica;
      // replicas of a group hold the same values (they train in lock step)
      for (std::size_t i = 0; i < n; ++i) buf[i] = float(4 * g + i % 8);
      // replica 1 of the reference mode receives only: scribble on it to see the broadcast
      if (mode == sync_mode::reference && r == 1) std::fill(buf.begin(), buf.end(), -1.0f);
      const plan p = average_plan(m.shape(), m.coords(), mode, n);
      for (const comm_op& op : p.ops) {
        if (op.kind == comm_kind::all_reduce) {
          float* piece = buf.data() + (mode == sync_mode::hierarchical ? n / 2 * r : 0);
          ex.run(op, piece, piece);
        } else if (op.kind == comm_kind::all_gather) {
          ex.run(op, buf.data() + n / 2 * r, buf.data());
        } else {
          ex.run(op, nullptr, buf.data());
        }
      }
      for (std::size_t i = 0; i < n; ++i) CHECK(buf[i] == float(2 + i % 8));  // (0 + 4) / 2
      CHECK(ex.traffic().same_traffic(traffic_counters::of(p)));
    });
  }
}
