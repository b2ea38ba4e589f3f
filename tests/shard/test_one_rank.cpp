// A group of one rank does no work for nothing (plan/comm_op.hpp one_rank_identity, the
// shard engine's step plan): DDP's one-rank gradient average, and ZeRO-2's and FSDP's
// one-rank gathers and reduce-scatters of f32, are not in the step plan, nothing crosses the
// wire, FSDP on one rank allocates what DDP allocates (no gathered copy, no full gradient
// buffer), and the three train to the same bits. An op that rounds (a bf16 reduce dtype)
// stays. Work per step on 1 rank of tiny_mlp (3 units): 0 ops and 0 calls, against 3
// reduce-scatters and 6 gathers for FSDP before the elision.

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/shard/engine.hpp"
#include "fedshard/shard/full_shard.hpp"
#include "fedshard/shard/replicate.hpp"
#include "fedshard/shard/shard_grad_op.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

namespace {

using namespace fedshard;
using fedshard::test::tiny_mlp;

/// One rank's run of policy P: its step plan's size, calls at the wire, system allocations
/// after setup and after 3 steps, and the master after 3 SGD steps.
struct one_rank_run {
  std::size_t plan_ops = 0;
  std::int64_t calls = 0;
  std::int64_t allocations_setup = 0, allocations_after = 0;
  std::vector<float> master;
};

template <class P>
one_rank_run run(shard::precision prec = {}) {
  tiny_mlp model;
  one_rank_run out;
  test::spawn_ranks(1, [&](inproc::communicator& world) {
    mesh m(world, {1, 1, 1});
    shard::engine<P, inproc::communicator> e(m, model.units(), prec);
    for (std::size_t u = 0; u < 3; ++u) e.set_unit(u, model.init_unit(e.layout(), u, 3));
    out.plan_ops = e.step_plan().ops.size();
    out.allocations_setup = e.space().system_allocations();
    const auto before = e.traffic().total().calls;
    for (int step = 0; step < 3; ++step) {
      const std::vector<test::sample> batch{model.make_sample(1, static_cast<std::uint64_t>(step)),
                                            model.make_sample(2, static_cast<std::uint64_t>(step))};
      e.begin_step();
      model.forward_backward(e, batch);
      e.finish_backward();
      auto p = e.master();
      for (std::size_t i = 0; i < p.size(); ++i) p[i] -= 0.05f * e.grad()[i];
      e.parameters_changed();
    }
    out.calls = e.traffic().total().calls - before;
    out.allocations_after = e.space().system_allocations();
    out.master.assign(e.master().begin(), e.master().end());
  });
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return !a.empty() && a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("one rank: DDP, ZeRO-2 and FSDP run no op, allocate alike and train to the same bits") {
  const auto ddp = run<shard::replicate>();
  const auto zero2 = run<shard::shard_grad_op>();
  const auto fsdp = run<shard::full_shard>();
  for (const auto* r : {&ddp, &zero2, &fsdp}) {
    CHECK(r->plan_ops == 0);
    CHECK(r->calls == 0);
    CHECK(r->allocations_after == r->allocations_setup);  // no per-step buffer either
  }
  // FSDP keeps no gathered copy and no full gradient: the system allocations of DDP.
  CHECK(fsdp.allocations_after == ddp.allocations_after);
  CHECK(zero2.allocations_after == ddp.allocations_after);
  CHECK(same_bits(zero2.master, ddp.master));
  CHECK(same_bits(fsdp.master, ddp.master));
}

TEST_CASE("one rank: an op that rounds through a narrow dtype stays") {
  // bf16 gradient reductions round the gradient: DDP keeps its 3 averages (one per unit),
  // FSDP its 3 reduce-scatters (its f32 gathers still go: 6 of them).
  const shard::precision bf16_reduce{dtype::f32, dtype::bf16};
  CHECK(run<shard::replicate>(bf16_reduce).plan_ops == 3);
  CHECK(run<shard::full_shard>(bf16_reduce).plan_ops == 3);
  const auto rounded = run<shard::replicate>(bf16_reduce);
  CHECK(rounded.calls == 9);  // 3 units x 3 steps
  CHECK_FALSE(same_bits(rounded.master, run<shard::replicate>().master));
}

TEST_CASE("one_rank_identity: what may be elided, worked op by op") {
  comm_op avg{.kind = comm_kind::all_reduce,
              .dtype = dtype::f32,
              .bytes = 64,
              .ranks = 1,
              .reduce = reduce_op::avg};
  CHECK(one_rank_identity(avg));
  auto two = avg;
  two.ranks = 2;
  CHECK_FALSE(one_rank_identity(two));  // a real average
  auto narrow = avg;
  narrow.dtype = dtype::bf16;
  CHECK_FALSE(one_rank_identity(narrow));  // rounds
  auto part = avg;
  part.in.count = 4;
  CHECK_FALSE(one_rank_identity(part));  // a range of a buffer: another buffer's layout
  auto send = avg;
  send.kind = comm_kind::send;
  CHECK_FALSE(one_rank_identity(send));  // point to point is never a collective identity
}
