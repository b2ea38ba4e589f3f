/// The trainer over MPI (mpirun -np 4): fl_fsdp with K = 2 on a {2, 1, 2} mesh of
/// mpi::communicator ends with the parameters of the same run on 4 inproc ranks, bit for bit:
/// every collective reduces in rank order in float on both backends, and the rest of a step is
/// the same code. And for every alias and a custom algorithm, what the wire carried in each
/// step is exactly what the plans say, op by op (gasloc's exchanges included: send_recv over
/// MPI point to point).

#include <doctest/doctest.h>
#include <mpi.h>

#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "fedshard/codec/topk.hpp"
#include "fedshard/comm/inproc.hpp"
#include "fedshard/comm/mpi.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "mpi/mpi_support.hpp"
#include "support/collective_checks.hpp"
#include "support/plan_checks.hpp"
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
  std::vector<std::string> wire_mismatches;  // steps whose wire calls differ from the plans
};

/// Trains on this rank of world for `steps` steps and returns what it ended with.
template <class Algorithm, class Opt, class C>
run_result train_on(C& world, mesh_shape shape, int steps, typename Opt::config oc,
                    trainer_options<Algorithm> opts = {}) {
  mesh m(world, shape);
  opts.total_steps = steps;
  trainer<mlp_model, Algorithm, Opt, C> t(m, mlp_model{}, oc, opts);
  const int g = m.coords().group;
  const int gs = shape.replicas * shape.shards;
  const int local = m.coords().replica * shape.shards + m.coords().shard;
  run_result r;
  t.traffic().reset();
  t.wire().keep_calls(true);
  for (int s = 0; s < steps; ++s) {
    r.losses.push_back(t.step(t.model().batch(kData, s, g, shape.groups, local, gs, 2)));
    const std::string diff =
        test::compare_calls(t.wire().take_calls(), test::expected_step_calls(t, s, steps));
    if (!diff.empty()) r.wire_mismatches.push_back(detail::concat("step ", s, ": ", diff));
  }
  r.traffic = t.traffic();
  t.wire().keep_calls(false);
  r.params = t.parameters();
  r.step_plan = t.step_plan();
  r.sync_plan = t.sync_plan();
  return r;
}

/// Options of A syncing every k steps.
template <class A>
trainer_options<A> every(int k) {
  trainer_options<A> o;
  o.schedule = {.period = k};
  return o;
}

std::uint64_t digest(const std::vector<float>& v) {
  return test::detail::fnv1a(v.data(), v.size() * sizeof(float));
}

/// Runs Algorithm with Opt on the MPI world and on 4 inproc ranks (inside MPI rank 0), and
/// checks that every rank ends with the same parameters on both.
template <class Algorithm, class Opt>
void check_mpi_equals_inproc(mesh_shape shape, int steps, typename Opt::config oc,
                             trainer_options<Algorithm> o = every<Algorithm>(2)) {
  run_result mine;
  {
    mpi::communicator world = mpi::communicator::world(test::mpi_options(true));
    REQUIRE(world.size() == shape.size());
    mine = train_on<Algorithm, Opt>(world, shape, steps, oc, o);
  }
  for (const auto& m : mine.wire_mismatches) FAIL_CHECK(m);
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
        train_on<Algorithm, Opt>(world, shape, steps, oc, o).params;
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

TEST_CASE("mpi trainer: fl_fsdp (K = 2) on a 2x1x2 mesh ends bit-identical to the inproc run") {
  check_mpi_equals_inproc<fl_fsdp, optim::sgd>({2, 1, 2}, 6, {.lr = 0.2f});
  check_mpi_equals_inproc<fl_fsdp, optim::adamw>({2, 1, 2}, 6, {.lr = 1e-2f});
}

TEST_CASE("mpi trainer: sparseloco and fl_hsdp_int8 (codecs) end bit-identical to the inproc run") {
  // Codecs decode every rank's wire in rank order on the host: no backend-dependent order.
  using small_sparseloco = algorithm<
      shard::hybrid_shard,
      federation::with_codec<federation::outer_optimizer<federation::outer_sgd>, codec::topk>,
      schedule::periodic>;
  auto o = every<small_sparseloco>(2);
  o.federation.codec = {.chunk = 32, .k = 4, .bits = 2};
  check_mpi_equals_inproc<small_sparseloco, optim::adamw>({2, 1, 2}, 12, {.lr = 1e-2f}, o);
  check_mpi_equals_inproc<fl_hsdp_int8, optim::adamw>({2, 1, 2}, 6, {.lr = 1e-2f});
}

namespace {
/// ZeRO-2 groups averaged by tokens, on a post-local schedule, synced the reference way.
using zero2_weighted =
    algorithm<shard::shard_grad_op, federation::weighted_average, schedule::post_local>;
}  // namespace

TEST_CASE_TEMPLATE("mpi trainer: every alias and a custom algorithm put their plans on the wire", A,
                   ddp, zero2, fsdp, hsdp, fl_fsdp, fl_hsdp, fl_hsdp_int8, diloco, streaming_diloco,
                   sparseloco, zero2_weighted, gasloc) {
  trainer_options<A> o;
  mesh_shape shape{2, 2, 1};
  if constexpr (std::is_same_v<A, ddp> || std::is_same_v<A, hsdp>) shape = {1, 2, 2};
  if constexpr (std::is_same_v<A, zero2> || std::is_same_v<A, fsdp>) shape = {1, 1, 4};
  if constexpr (std::is_same_v<A, fl_fsdp> || std::is_same_v<A, fl_hsdp_int8>) shape = {2, 1, 2};
  if constexpr (std::is_same_v<typename A::sync_schedule, schedule::periodic>)
    o.schedule = {.period = 3};
  if constexpr (std::is_same_v<A, streaming_diloco>)
    o.schedule = {.period = 4, .fragments = 2, .delay = 1, .alpha = 0.5f};
  if constexpr (std::is_same_v<A, gasloc>) {  // a ring of 4 groups: two exchanges a sync
    shape = {4, 1, 1};
    o.federation = {.degree = 2, .alpha = 0.25f, .seed = 9};
  }
  if constexpr (std::is_same_v<A, zero2_weighted>) {
    o.schedule = {.switch_step = 2, .k = 3};
    o.federation.sync = federation::sync_mode::reference;
  }
  mpi::communicator world = mpi::communicator::world(test::mpi_options(true));
  REQUIRE(world.size() == shape.size());
  const run_result r = train_on<A, optim::adamw>(world, shape, 8, {.lr = 1e-2f}, o);
  for (const auto& m : r.wire_mismatches) FAIL_CHECK(m);
  CHECK(r.wire_mismatches.empty());
  CHECK(r.traffic[axis::shard].wire_bytes ==
        traffic_counters::of(r.step_plan, 8)[axis::shard].wire_bytes);
}
