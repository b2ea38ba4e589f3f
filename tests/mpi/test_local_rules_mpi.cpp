/// The local rules over MPI (mpirun -np 4): zeroth-order units (tiny_mlp's "layer0") and
/// Local Superior Soups (a pool of three, both regularisers) on fl_fsdp, 2x1x2 of
/// mpi::communicator, end with the parameters and losses of the same run on 4 inproc ranks,
/// bit for bit (the rules' group collectives, the loss means and the soup's distance sums,
/// reduce in rank order on both backends); a checkpoint saved over MPI mid-round resumes
/// there bit-exactly. HO-FL's aggregation on 4 groups of one rank (weighted_average, 2 of 4
/// groups sampled per round) sees the same sample and the same weights on every rank (worked
/// in the test) and ends as on inproc.

#include <doctest/doctest.h>
#include <mpi.h>

#include <unistd.h>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/comm/mpi.hpp"
#include "fedshard/federation/average.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/optim/zeroth_order.hpp"
#include "fedshard/trainer/local_soup.hpp"
#include "fedshard/trainer/local_zeroth_order.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "mpi/mpi_support.hpp"
#include "support/collective_checks.hpp"
#include "support/local_rule_settings.hpp"
#include "support/recording_policy.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;
using test::mlp_model;
namespace fs = std::filesystem;

namespace {

constexpr std::uint64_t kData = 13;
const optim::zeroth_order_settings kZo = test::zo_two_probes;
const optim::soup_config kSoup = test::soup_of_three;

/// A leg of a run: its mesh, settings, steps [first, last), and where it loads and saves.
template <class Alg>
struct leg_spec {
  mesh_shape shape;
  trainer_options<Alg> opts;
  int first = 0, last = 0;
  fs::path from{}, to{};
};

struct leg_result {
  std::uint64_t params = 0, losses = 0;  // digests
  std::vector<test::recorded_sync> syncs;
};

std::uint64_t digest(const std::vector<float>& v) {
  return test::detail::fnv1a(v.data(), v.size() * sizeof(float));
}

/// Trains this rank of world through spec (group g's ranks take g + 1 samples a step).
template <class Alg, class C>
leg_result train_on(C& world, const leg_spec<Alg>& spec) {
  mesh m(world, spec.shape);
  trainer<mlp_model, Alg, optim::adamw, C> t(m, mlp_model{}, {.lr = 2e-2f}, spec.opts);
  if (!spec.from.empty()) t.load(spec.from);
  const auto c = t.topology().coords();
  std::vector<float> losses;
  for (int s = spec.first; s < spec.last; ++s)
    losses.push_back(t.step(t.model().batch(kData, s, c.group, spec.shape.groups, c.shard,
                                            spec.shape.shards, c.group + 1)));
  if (!spec.to.empty()) t.save(spec.to);
  leg_result r{digest(t.parameters()), digest(losses), {}};
  if constexpr (requires { t.federation().records(); }) r.syncs = t.federation().records();
  return r;
}

/// spec on the MPI world: every rank's digests (params, losses), in rank order.
template <class Alg>
std::vector<std::uint64_t> on_mpi(const leg_spec<Alg>& spec, leg_result* mine = nullptr) {
  leg_result r;
  {
    mpi::communicator world = mpi::communicator::world(test::mpi_options(true));
    REQUIRE(world.size() == spec.shape.size());
    r = train_on(world, spec);
  }
  if (mine != nullptr) *mine = r;
  return test::gather_world({r.params, r.losses});
}

/// spec on 4 inproc ranks (run by world rank 0 only): every rank's digests, in rank order.
template <class Alg>
std::vector<std::uint64_t> on_inproc(const leg_spec<Alg>& spec) {
  std::vector<std::uint64_t> out(2 * static_cast<std::size_t>(spec.shape.size()));
  inproc::run(spec.shape.size(), [&](inproc::communicator& world) {
    const auto r = train_on(world, spec);
    out[2 * static_cast<std::size_t>(world.rank())] = r.params;
    out[2 * static_cast<std::size_t>(world.rank()) + 1] = r.losses;
  });
  return out;
}

trainer_options<fl_fsdp> rule_options(local_rule_factory rule) {
  trainer_options<fl_fsdp> o;
  o.total_steps = 30;
  o.schedule.period = 3;
  o.log = [](const std::string&) {};
  o.local_rule = std::move(rule);
  return o;
}

/// A directory every rank sees: made by world rank 0, its name broadcast.
fs::path shared_temp_dir() {
  std::string name(256, '\0');
  if (test::world_rank() == 0) {
    std::string pattern = (fs::temp_directory_path() / "fedshard-rules-mpi-XXXXXX").string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    name.replace(0, pattern.size(), pattern);
  }
  MPI_Bcast(name.data(), static_cast<int>(name.size()), MPI_CHAR, 0, MPI_COMM_WORLD);
  return fs::path(name.c_str());
}

}  // namespace

TEST_CASE("mpi local rules: zeroth order and the soup end bit-identical to inproc, and resume") {
  for (int rule = 0; rule < 2; ++rule) {
    CAPTURE(rule);
    const auto opts =
        rule_options(rule == 0 ? zeroth_order_rule(kZo, {"layer0"}) : local_soup_rule(kSoup));
    // 9 steps: syncs after steps 2, 5 and 8, so every rank ends with the same model.
    const leg_spec<fl_fsdp> straight{{2, 1, 2}, opts, 0, 9};
    const auto mpi_digests = on_mpi(straight);
    CHECK(mpi_digests[0] == mpi_digests[6]);  // ranks 0 and 3 (groups 0 and 1) agree
    // Saved after step 4 (mid-round), resumed for steps 5..8 in a fresh MPI trainer.
    const fs::path dir = shared_temp_dir();
    (void)on_mpi(leg_spec<fl_fsdp>{{2, 1, 2}, opts, 0, 5, {}, dir});
    const auto resumed = on_mpi(leg_spec<fl_fsdp>{{2, 1, 2}, opts, 5, 9, dir});
    for (std::size_t r = 0; r < 4; ++r) CHECK(resumed[2 * r] == mpi_digests[2 * r]);
    MPI_Barrier(MPI_COMM_WORLD);
    if (test::world_rank() == 0) fs::remove_all(dir);
    if (test::world_rank() != 0) continue;
    const auto ref = on_inproc(straight);
    CHECK(mpi_digests == ref);
  }
}

TEST_CASE("mpi hofl: 2 of 4 groups sampled per round, the same sample and weights on every rank") {
  // 4 groups of one rank; group g takes g + 1 samples a step, 3 (g + 1) tokens a round of 3
  // steps. Participation {0.5, seed 42} samples rounds 0 and 1 as groups {0, 2} and {0, 3}
  // (tests/federation/test_participation.cpp); the weights' gather leaves the others as zeros.
  using recorded_hofl =
      algorithm<shard::full_shard, test::recording_weighted_average, schedule::periodic>;
  trainer_options<recorded_hofl> o;
  o.total_steps = 6;
  o.schedule.period = 3;
  o.participation = {.fraction = 0.5, .min_groups = 1, .seed = 42};
  o.log = [](const std::string&) {};
  o.local_rule = zeroth_order_rule(kZo, {"layer0"});
  const leg_spec<recorded_hofl> spec{{4, 1, 1}, o, 0, 6};
  leg_result mine;
  const auto mpi_digests = on_mpi(spec, &mine);
  REQUIRE(mine.syncs.size() == 2);
  CHECK(mine.syncs[0].included == std::vector<std::uint8_t>{1, 0, 1, 0});
  CHECK(mine.syncs[0].group_tokens == std::vector<double>{3, 0, 9, 0});
  CHECK(mine.syncs[1].included == std::vector<std::uint8_t>{1, 0, 0, 1});
  CHECK(mine.syncs[1].group_tokens == std::vector<double>{3, 0, 0, 12});
  for (std::size_t r = 1; r < 4; ++r) CHECK(mpi_digests[2 * r] == mpi_digests[0]);  // one model
  if (test::world_rank() != 0) return;
  CHECK(mpi_digests == on_inproc(spec));
}

TEST_CASE("mpi aliases: hofl and lss as the catalogue gives them end bit-identical to inproc") {
  // Their default rules (hofl: layer0 and layer1 zeroth-order, records at the sync; lss: a
  // soup of 3) on 2 groups of 2 replicas, K = 8: a sync after step 7, then 2 local steps.
  const auto check_alias = []<class A>() {
    trainer_options<A> o;
    o.total_steps = 10;
    o.log = [](const std::string&) {};
    const leg_spec<A> spec{{2, 2, 1}, o, 0, 10};
    const auto mpi_digests = on_mpi(spec);
    CHECK(mpi_digests[0] == mpi_digests[2]);  // the replicas of group 0 hold one model
    CHECK(mpi_digests[4] == mpi_digests[6]);  // and those of group 1
    if (test::world_rank() == 0) CHECK(mpi_digests == on_inproc(spec));
  };
  check_alias.operator()<hofl>();
  check_alias.operator()<lss>();
}
