/// The trainer over MPI (mpirun -np 4): fl_fsdp<2> on a {2, 1, 2} mesh of mpi::communicator
/// ends with the parameters of the same run on 4 inproc ranks, bit for bit: every collective
/// reduces in rank order in float on both backends, and the rest of a step is the same code.

#include <doctest/doctest.h>
#include <mpi.h>

#include <cstring>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/comm/mpi.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "mpi/mpi_support.hpp"
#include "support/collective_checks.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;
using test::mlp_model;

namespace {

constexpr std::uint64_t kData = 11;

struct run_result {
  std::vector<float> params;
  std::vector<float> losses;
  traffic_counters traffic;
  plan step_plan;
  plan sync_plan;
};

/// Trains on this rank of world for `steps` steps and returns what it ended with.
template <class Algorithm, class Opt, class C>
run_result train_on(C& world, mesh_shape shape, int steps, typename Opt::config oc) {
  mesh m(world, shape);
  trainer_options<Algorithm> opts;
  opts.total_steps = steps;
  trainer<mlp_model, Algorithm, Opt, C> t(m, mlp_model{}, oc, opts);
  const int g = m.coords().group;
  const int gs = shape.replicas * shape.shards;
  const int local = m.coords().replica * shape.shards + m.coords().shard;
  run_result r;
  for (int s = 0; s < steps; ++s)
    r.losses.push_back(t.step(t.model().batch(kData, s, g, shape.groups, local, gs, 2)));
  r.params = t.parameters();
  r.traffic = t.traffic();
  r.step_plan = t.step_plan();
  r.sync_plan = t.sync_plan();
  return r;
}

std::uint64_t digest(const std::vector<float>& v) {
  return test::detail::fnv1a(v.data(), v.size() * sizeof(float));
}

/// Runs Algorithm with Opt on the MPI world and on 4 inproc ranks (inside MPI rank 0), and
/// checks that every rank ends with the same parameters on both.
template <class Algorithm, class Opt>
void check_mpi_equals_inproc(mesh_shape shape, int steps, typename Opt::config oc) {
  run_result mine;
  {
    mpi::communicator world = mpi::communicator::world(test::mpi_options(true));
    REQUIRE(world.size() == shape.size());
    mine = train_on<Algorithm, Opt>(world, shape, steps, oc);
  }
  CHECK(mine.losses.back() < mine.losses.front());
  auto expected = traffic_counters::of(mine.step_plan, steps);  // + one sync every 2 steps
  for (int i = 0; i < steps / 2; ++i)
    for (const auto& op : mine.sync_plan.ops) expected.record(op);
  CHECK(mine.traffic.same_traffic(expected));
  const auto mpi_digests = test::gather_world({digest(mine.params)});
  if (test::world_rank() != 0) return;
  std::vector<std::vector<float>> ref(static_cast<std::size_t>(shape.size()));
  inproc::run(shape.size(), [&](inproc::communicator& world) {
    ref[static_cast<std::size_t>(world.rank())] =
        train_on<Algorithm, Opt>(world, shape, steps, oc).params;
  });
  for (int r = 0; r < shape.size(); ++r) {
    CAPTURE(r);
    CHECK(mpi_digests[static_cast<std::size_t>(r)] == digest(ref[static_cast<std::size_t>(r)]));
  }
  CHECK(std::memcmp(mine.params.data(), ref[0].data(), mine.params.size() * sizeof(float)) == 0);
  // The last step synced: both groups hold the same model.
  CHECK(mpi_digests[0] == mpi_digests[3]);
}

}  // namespace

TEST_CASE("mpi trainer: fl_fsdp<2> on a 2x1x2 mesh ends bit-identical to the inproc run") {
  check_mpi_equals_inproc<fl_fsdp<2>, optim::sgd>({2, 1, 2}, 6, {.lr = 0.2f});
  check_mpi_equals_inproc<fl_fsdp<2>, optim::adamw>({2, 1, 2}, 6, {.lr = 1e-2f});
}
