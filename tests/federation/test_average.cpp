// average (FL+FSDP / FL+HSDP): the trainer's all_reduce does the averaging; the policy itself
// keeps no state and leaves the buffer unchanged before and after.
#include "fedshard/federation/average.hpp"

#include <doctest/doctest.h>

#include <cstring>
#include <limits>
#include <vector>

#include "support/op_lists.hpp"
#include "support/policy_checks.hpp"

using namespace fedshard;
using fedshard::federation::average;

TEST_CASE("average models FederationPolicy, syncs the parameters only, without weights") {
  test::check_federation_policy<average>("average", true);
  CHECK(average({}, {16}).state().empty());  // nothing to checkpoint
}

TEST_CASE("average's sync plan, written out: the parameters only, no weights, no moments") {
  // G = 2 groups of R = 2 replicas, S = 1; a fragment of 32 f32 = 128 B; the inner optimizer
  // has 2 state buffers, which the paper's average leaves alone.
  const operand fragment{.role = role::fragment};
  const operand half{.role = role::fragment, .piece = axis::replica};
  auto ctx_at = [](int replica) {
    return federation::sync_context{.shape = {2, 2, 1},
                                    .coords = {1, replica, 0},
                                    .fragment = 3,
                                    .numel = 32,
                                    .inner_state_buffers = 2};
  };
  SUBCASE("hierarchical: each replica averages its half, then the replicas gather") {
    // all_reduce of 16 f32 = 64 B over the 2 groups: each rank sends 2 (2 - 1) / 2 x 64 = 64 B;
    // all_gather of the 128 B fragment over the 2 replicas: (2 - 1) / 2 x 128 = 64 B.
    const std::vector<comm_op> want{
        test::sync_op(comm_kind::all_reduce, axis::federation, dtype::f32, 64, 2, reduce_op::avg,
                      trigger::sync_exchange, 3, half, half),
        test::sync_op(comm_kind::all_gather, axis::replica, dtype::f32, 128, 2, {},
                      trigger::sync_finish, 3, half, fragment)};
    for (int replica : {0, 1}) {
      CAPTURE(replica);
      const plan p =
          average({federation::sync_mode::hierarchical}, {32}).sync_plan(ctx_at(replica));
      CHECK(test::compare_ops(p.ops, want) == "");
      CHECK(p.wire_bytes_on(axis::federation) == 64.0);
      CHECK(p.wire_bytes_on(axis::replica) == 64.0);
    }
  }
  SUBCASE("reference: replica 0 averages the whole fragment, then broadcasts it") {
    // all_reduce of 128 B over the 2 groups: 2 (2 - 1) / 2 x 128 = 128 B sent by replica 0;
    // the broadcast from replica 0: 128 B (bus factor 1); replica 1 only receives it.
    const comm_op bcast = test::sync_op(comm_kind::broadcast, axis::replica, dtype::f32, 128, 2, {},
                                        trigger::sync_finish, 3, {}, fragment);
    const std::vector<comm_op> want0{
        test::sync_op(comm_kind::all_reduce, axis::federation, dtype::f32, 128, 2, reduce_op::avg,
                      trigger::sync_exchange, 3, fragment, fragment),
        bcast};
    const average a({federation::sync_mode::reference}, {32});
    const plan p0 = a.sync_plan(ctx_at(0));
    CHECK(test::compare_ops(p0.ops, want0) == "");
    CHECK(p0.wire_bytes_on(axis::federation) == 128.0);
    CHECK(p0.wire_bytes_on(axis::replica) == 128.0);
    CHECK(test::compare_ops(a.sync_plan(ctx_at(1)).ops, {bcast}) == "");
  }
}

TEST_CASE("average sends the parameters themselves and keeps the mean as it arrives") {
  average a({federation::sync_mode::hierarchical}, {5, 3});
  const std::vector<float> original{0.25f, -1.0f, std::numeric_limits<float>::infinity(), -0.0f,
                                    std::numeric_limits<float>::denorm_min()};
  std::vector<float> buf = original;
  const federation::sync_info info{.fragment = 1, .groups = 8};
  a.reset(0, buf);
  a.begin(0, buf, info);
  CHECK(std::memcmp(buf.data(), original.data(), buf.size() * sizeof(float)) == 0);
  a.end(0, buf, info);
  CHECK(std::memcmp(buf.data(), original.data(), buf.size() * sizeof(float)) == 0);
}
