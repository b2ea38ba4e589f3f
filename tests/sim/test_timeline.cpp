/// Tests of the step timeline (sim/timeline.hpp): the engine's order unit by unit on one
/// channel, worked by hand on small plans, and its refusals.
#include <doctest/doctest.h>

#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/sim/timeline.hpp"

using namespace fedshard;
using namespace fedshard::sim;

namespace {

comm_op op_at(comm_kind k, trigger t, phase ph, int unit, bool overlappable = true) {
  comm_op op;
  op.kind = k;
  op.axis = axis::shard;
  op.bytes = 1024;
  op.ranks = 4;
  op.trigger = t;
  op.phase = ph;
  op.unit = unit;
  op.overlappable = overlappable;
  return op;
}

/// FSDP's step plan over two units, in the order the engine fires it.
std::vector<comm_op> fsdp_two_units() {
  return {op_at(comm_kind::all_gather, trigger::acquire, phase::forward, 0),
          op_at(comm_kind::all_gather, trigger::acquire, phase::forward, 1),
          op_at(comm_kind::all_gather, trigger::acquire, phase::backward, 1),
          op_at(comm_kind::reduce_scatter, trigger::grads_ready, phase::backward, 1),
          op_at(comm_kind::all_gather, trigger::acquire, phase::backward, 0),
          op_at(comm_kind::reduce_scatter, trigger::grads_ready, phase::backward, 0)};
}

}  // namespace

TEST_CASE("fsdp on one channel: the first gather of each phase and the last reduce_scatter wait") {
  // Two equal units, C = 6: forward 1 + 1, backward 2 + 2; every op holds the channel 0.5.
  const auto ops = fsdp_two_units();
  const std::vector<op_time> times(ops.size(), op_time{0.5, 0, 0});
  const step_timeline tl = time_step(ops, times, {1, 1}, 6.0);
  // t = 0: gather 0 (done 0.5) and the prefetch of gather 1 (0.5-1.0); compute waits 0.5,
  // runs forward to 2.5; backward's gather 1 (2.5-3.0) waits 0.5, gather 0 is prefetched
  // (3.0-3.5); backward 3.0-5.0, reduce_scatter 1 (5.0-5.5); backward 5.0-7.0; the last
  // reduce_scatter 7.0-7.5.
  CHECK(tl.step == doctest::Approx(7.5));
  CHECK(tl.waiting == doctest::Approx(1.5));
  CHECK(tl.busy == doctest::Approx(3.0));
  CHECK(tl.cpu == 0);
}

TEST_CASE("with no op time the step is exactly the compute") {
  const auto ops = fsdp_two_units();
  const std::vector<op_time> times(ops.size());
  const step_timeline tl = time_step(ops, times, {3, 5}, 0.1);
  CHECK(tl.step == 0.1);  // exact: the segments end at fractions of C, the last at 1
  CHECK(tl.waiting == 0);
}

TEST_CASE("propagation latency: ops in flight overlap their tails, transfers queue") {
  // No compute: two forward gathers issued together (acquire 0 prefetches 1).
  const std::vector<comm_op> ops{op_at(comm_kind::all_gather, trigger::acquire, phase::forward, 0),
                                 op_at(comm_kind::all_gather, trigger::acquire, phase::forward, 1)};
  // Latency held on the channel (NCCL's stream): 1.0 each, one after the other.
  CHECK(time_step(ops, {{1.0, 0, 0}, {1.0, 0, 0}}, {1, 1}, 0).step == doctest::Approx(2.0));
  // Latency as a tail: transfers 0.1 queue, the 0.9 tails overlap: 0.1 + 0.1 + 0.9.
  CHECK(time_step(ops, {{0.1, 0.9, 0}, {0.1, 0.9, 0}}, {1, 1}, 0).step == doctest::Approx(1.1));
}

TEST_CASE("on-compute ops delay the compute; blocking reductions are waited for") {
  const auto ops = fsdp_two_units();
  // Every op runs on the compute stream for 0.25: C + 6 x 0.25.
  const step_timeline cpu =
      time_step(ops, std::vector<op_time>(ops.size(), {0, 0, 0.25}), {1, 1}, 6);
  CHECK(cpu.step == doctest::Approx(7.5));
  CHECK(cpu.cpu == doctest::Approx(1.5));
  CHECK(cpu.busy == 0);
  // DDP's all_reduce per unit, marked not overlappable: the backward waits for each.
  const std::vector<comm_op> ddp{
      op_at(comm_kind::all_reduce, trigger::grads_ready, phase::backward, 1, false),
      op_at(comm_kind::all_reduce, trigger::grads_ready, phase::backward, 0, false)};
  CHECK(time_step(ddp, {{0.5, 0, 0}, {0.5, 0, 0}}, {1, 1}, 6).step == doctest::Approx(7.0));
  // Overlappable: the first hides behind unit 0's backward, only the last is exposed.
  auto overlapped = ddp;
  for (auto& op : overlapped) op.overlappable = true;
  CHECK(time_step(overlapped, {{0.5, 0, 0}, {0.5, 0, 0}}, {1, 1}, 6).step == doctest::Approx(6.5));
}

TEST_CASE("ops of one trigger run one after another") {
  // HSDP: the replica all_reduce of a unit's shard reads the reduce_scatter's result.
  std::vector<comm_op> ops{
      op_at(comm_kind::reduce_scatter, trigger::grads_ready, phase::backward, 0),
      op_at(comm_kind::all_reduce, trigger::grads_ready, phase::backward, 0)};
  ops[1].axis = axis::replica;
  // The all_reduce's tail may not start before the reduce_scatter is done: 1 + 0.2 + 2.
  CHECK(time_step(ops, {{1.0, 0, 0}, {0.2, 2.0, 0}}, {1}, 0).step == doctest::Approx(3.2));
}

TEST_CASE("host-driven chains: a follow-up starts when the rank next enters the interpreter") {
  // HSDP's backward over two equal units, C = 6 (forward 1 + 1, backward 2 + 2): each unit's
  // grads_ready fires a reduce_scatter on the compute stream (cpu 0.25), then the replica
  // all_reduce of its shard (holds the channel 1.0).
  std::vector<comm_op> ops{
      op_at(comm_kind::reduce_scatter, trigger::grads_ready, phase::backward, 1),
      op_at(comm_kind::all_reduce, trigger::grads_ready, phase::backward, 1),
      op_at(comm_kind::reduce_scatter, trigger::grads_ready, phase::backward, 0),
      op_at(comm_kind::all_reduce, trigger::grads_ready, phase::backward, 0)};
  ops[1].axis = ops[3].axis = axis::replica;
  const std::vector<op_time> times{{0, 0, 0.25}, {1.0, 0, 0}, {0, 0, 0.25}, {1.0, 0, 0}};
  // Stream-ordered: unit 1's backward ends at 4, its reduce_scatter at 4.25, its all_reduce
  // runs 4.25-5.25 behind unit 0's backward (4.25-6.25); unit 0's reduce_scatter ends at
  // 6.5 and its all_reduce runs 6.5-7.5.
  CHECK(time_step(ops, times, {1, 1}, 6).step == doctest::Approx(7.5));
  // Host-driven: unit 1's all_reduce waits for the next firing after unit 0's backward,
  // 6.25-7.25; unit 0's reduce_scatter runs 6.25-6.5, and its all_reduce, left for the end
  // of the step, queues behind unit 1's: 7.25-8.25.
  const step_timeline host = time_step(ops, times, {1, 1}, 6, true);
  CHECK(host.step == doctest::Approx(8.25));
  CHECK(host.busy == doctest::Approx(2.0));
  CHECK(host.cpu == doctest::Approx(0.5));
  // A chain of one op is issued whole at its firing either way: DDP's all_reduces.
  const std::vector<comm_op> ddp{ops[1], ops[3]};
  CHECK(time_step(ddp, {{0.5, 0, 0}, {0.5, 0, 0}}, {1, 1}, 6, true).step == doctest::Approx(6.5));
}

TEST_CASE("bad timelines are refused with a clear message") {
  const auto ops = fsdp_two_units();
  CHECK_THROWS_WITH_AS(time_step(ops, {}, {1, 1}, 1), doctest::Contains("6 ops but 0 op times"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(time_step(ops, std::vector<op_time>(ops.size()), {1}, 1),
                       doctest::Contains("names unit 1 of a model of 1 units"), invalid_argument);
  CHECK_THROWS_WITH_AS(time_step(ops, std::vector<op_time>(ops.size()), {1, 1}, -1),
                       doctest::Contains("compute seconds must be >= 0"), invalid_argument);
  std::vector<comm_op> sync{op_at(comm_kind::all_reduce, trigger::sync_exchange, phase::sync, -1)};
  CHECK_THROWS_WITH_AS(time_step(sync, {{1, 0, 0}}, {1}, 1),
                       doctest::Contains("has a trigger no inner step fires"), invalid_argument);
}
