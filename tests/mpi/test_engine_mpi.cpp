/// The shard engine over MPI (mpirun -np 4): the equivalences of tests/shard/test_engine.cpp
/// on a mesh of mpi::communicator, the traffic counters against the plan, and every policy's
/// parameters bit-identical to the same run on 4 inproc ranks (MPI reduces like inproc: each
/// element in rank order, accumulated in float, avg = sum / n, rounded once).

#include <doctest/doctest.h>
#include <mpi.h>

#include <cmath>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/comm/mpi.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/shard/engine.hpp"
#include "fedshard/shard/full_shard.hpp"
#include "fedshard/shard/hybrid_shard.hpp"
#include "fedshard/shard/replicate.hpp"
#include "fedshard/shard/shard_grad_op.hpp"
#include "mpi/mpi_support.hpp"
#include "support/collective_checks.hpp"
#include "support/engine_runs.hpp"

using namespace fedshard;

namespace {

using namespace fedshard::test::engine_runs;
using run_result = rank_run;

/// Every rank's reported (or planned) bytes per axis, added up over MPI_COMM_WORLD.
traffic_counters world_sum(const traffic_counters& mine) {
  std::vector<double> v;
  for (axis a : all_axes) {
    v.push_back(mine[a].sent);
    v.push_back(mine[a].received);
  }
  MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_DOUBLE, MPI_SUM,
                MPI_COMM_WORLD);
  traffic_counters s;
  std::size_t i = 0;
  for (axis a : all_axes) {
    s.record_moved(a, {std::llround(v[i]), std::llround(v[i + 1])});
    i += 2;
  }
  return s;
}

/// The run of P (support/engine_runs.hpp) on this rank of world (of shape.size() ranks),
/// whose construction moved the bytes of its setup plan (the layout check).
template <class P, class C>
run_result train_on(C& world, mesh_shape shape, shard::precision prec = {}) {
  mesh m(world, shape);
  space::host_space space;
  run_result out = train_rank<P>(m, space, prec);
  CHECK(out.setup_traffic.same_traffic(traffic_counters::of(out.setup_plan)));
  return out;
}

/// The run of P on this MPI rank (checked mode, so any mismatch between ranks is reported).
template <class P>
run_result train_mpi(mesh_shape shape, shard::precision prec = {}) {
  mpi::communicator world = mpi::communicator::world(test::mpi_options(true));
  REQUIRE(world.size() == shape.size());
  return train_on<P>(world, shape, prec);
}

/// Rank 0's run of P on shape.size() inproc ranks.
template <class P>
run_result train_inproc(mesh_shape shape, shard::precision prec = {}) {
  run_result out;
  inproc::run(shape.size(), [&](inproc::communicator& world) {
    run_result r = train_on<P>(world, shape, prec);
    if (world.rank() == 0) out = std::move(r);
  });
  return out;
}

std::uint64_t digest(const run_result& r) {
  std::uint64_t h = 0;
  for (const auto& u : r.units)
    h = h * 31 + test::detail::fnv1a(u.data(), u.size() * sizeof(float));
  return h;
}

/// Every rank gathered the same full parameters.
void check_same_on_every_rank(const run_result& r) {
  const auto all = test::gather_world({digest(r)});
  for (std::uint64_t d : all) CHECK(d == all[0]);
}

}  // namespace

TEST_CASE("mpi engine: policies agree bit for bit where the summation order is the same") {
  const run_result ddp = train_mpi<shard::replicate>({1, 4, 1});
  const run_result ddp_2x2 = train_mpi<shard::replicate>({1, 2, 2});
  const run_result zero2 = train_mpi<shard::shard_grad_op>({1, 1, 4});
  const run_result fsdp = train_mpi<shard::full_shard>({1, 1, 4});
  const run_result hsdp = train_mpi<shard::hybrid_shard>({1, 2, 2});
  const run_result zero2_2x2 = train_mpi<shard::shard_grad_op>({1, 2, 2});
  CHECK(fsdp.losses.back() < fsdp.losses.front());
  CHECK(bit_equal(ddp, fsdp));
  CHECK(bit_equal(ddp, zero2));
  CHECK(bit_equal(ddp, ddp_2x2));
  CHECK(bit_equal(hsdp, zero2_2x2));
  for (const run_result* r : {&ddp, &fsdp, &zero2, &hsdp}) check_same_on_every_rank(*r);
  // The same runs on inproc ranks give the same bits.
  if (test::world_rank() == 0) {
    CHECK(bit_equal(fsdp, train_inproc<shard::full_shard>({1, 1, 4})));
    CHECK(bit_equal(ddp, train_inproc<shard::replicate>({1, 4, 1})));
    CHECK(bit_equal(hsdp, train_inproc<shard::hybrid_shard>({1, 2, 2})));
  }
}

TEST_CASE("mpi engine: bf16 on the wire, f32 master; policies and backends agree bit for bit") {
  const shard::precision bf16_all{dtype::bf16, dtype::bf16};
  const run_result ddp = train_mpi<shard::replicate>({1, 4, 1}, bf16_all);
  const run_result fsdp = train_mpi<shard::full_shard>({1, 1, 4}, bf16_all);
  const run_result zero2 = train_mpi<shard::shard_grad_op>({1, 1, 4}, bf16_all);
  CHECK(bit_equal(ddp, fsdp));
  CHECK(bit_equal(ddp, zero2));
  check_same_on_every_rank(fsdp);
  if (test::world_rank() == 0)
    CHECK(bit_equal(fsdp, train_inproc<shard::full_shard>({1, 1, 4}, bf16_all)));
}

TEST_CASE("mpi engine: bytes per step read from the traffic counters equal the plan") {
  for (auto prec : {shard::precision{}, shard::precision{dtype::bf16, dtype::bf16}}) {
    const int S = 4;
    const run_result r = train_mpi<shard::full_shard>({1, 1, S}, prec);
    CHECK(r.traffic.same_traffic(traffic_counters::of(r.step_plan, kSteps)));
    const double theta = static_cast<double>(r.padded_numel * size_of(prec.param));
    CHECK(r.traffic[axis::shard].wire_bytes == kSteps * 3.0 * (S - 1) / S * theta);
    CHECK(r.traffic[axis::shard].calls == kSteps * 3 * 3);
  }
  const run_result h = train_mpi<shard::hybrid_shard>({1, 2, 2});
  CHECK(h.traffic.same_traffic(traffic_counters::of(h.step_plan, kSteps)));
  const double theta = static_cast<double>(h.padded_numel * sizeof(float));
  CHECK(h.traffic[axis::replica].wire_bytes == kSteps * 2.0 * (2 - 1) / 2 * theta / 2);
}

TEST_CASE("mpi engine: the bytes MPI is handed equal the step plans' closed forms") {
  // ddp's gradient all_reduces of the tiny MLP's units are small (4 ranks x a unit <= 64 KiB):
  // MPI gathers every input, n (n-1) S in all instead of a ring's 2 (n-1) S, and the plan
  // says so through algorithm_of; fsdp's gathers and reduce-scatters are rings.
  const run_result ddp = train_mpi<shard::replicate>({1, 4, 1});
  CHECK(ddp.gathering_ops == static_cast<std::int64_t>(ddp.step_plan.ops.size()));
  const traffic_counters moved = world_sum(ddp.traffic);
  CHECK(moved_mismatch(moved, world_sum(ddp.planned)) == "");
  CHECK(moved_mismatch(moved, world_sum(traffic_counters::of(ddp.step_plan, kSteps))) != "");
  // 5 steps x 4 ranks x (4-1) x |theta| sent in all
  const double theta = static_cast<double>(ddp.padded_numel * sizeof(float));
  CHECK(moved[axis::group].sent == kSteps * 4 * 3 * theta);
  const run_result fsdp = train_mpi<shard::full_shard>({1, 1, 4});
  CHECK(fsdp.gathering_ops == 0);
  CHECK(moved_mismatch(world_sum(fsdp.traffic), world_sum(fsdp.planned)) == "");
}
