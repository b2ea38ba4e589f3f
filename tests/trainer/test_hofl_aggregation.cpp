// HO-FL's aggregation (issue 29, item 3) on inproc: zeroth-order lower layer (tiny_mlp's
// "layer0", trainer/local_zeroth_order.hpp) with backprop above it, FSDP inside 4 groups of 2
// shards, weighted_average across them (weights: the tokens, here samples, each group took
// since the last sync) and the participation stage sampling 2 of the 4 groups per round.
//
// Worked by hand: rank (g, 0, s) trains g + 1 samples a step, so group g counts 2 (g + 1)
// tokens a step and 6 (g + 1) a round of 3 steps: 6, 12, 18, 24 (every group's count starts
// over at every sync, sampled or not). Participation {fraction 0.5, seed 42} samples rounds
// 0 and 1 as groups {0, 2} and {0, 3} (tests/federation/test_participation.cpp). The
// weights' gather leaves the groups out of a round as zeros, so
//   round 0 (after step 2): tokens {6, 0, 18, 0}, W = 24: the mean is (6 A + 18 C) / 24;
//   round 1 (after step 5): tokens {6, 0, 0, 24}, W = 30: the mean is (6 A + 24 D) / 30;
// with A, C, D the groups' parameters before the sync. weighted_average computes it as
// fl(s_a A) and fl(s_b B) summed in group order and divided by the 2 groups combined, with
// s_g = fl(2 w_g / W): 0.5 and 1.5 in round 0, 0.4f and 1.6f in round 1. Every rank, in the
// groups left out too, ends the sync holding that mean.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/federation/weighted_average.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/optim/zeroth_order.hpp"
#include "fedshard/trainer/local_zeroth_order.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/files.hpp"
#include "support/recording_policy.hpp"
#include "support/spaces.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

namespace {

using namespace fedshard;
using test::bit_equal;
using test::mlp_model;

constexpr std::uint64_t kData = 3;
const mesh_shape kShape{4, 1, 2};
const optim::zeroth_order_settings kZo{.eps = 1e-3f, .probes = 2, .seed = 9};
const federation::participation kSample{.fraction = 0.5, .min_groups = 1, .seed = 42};

using recorded_hofl =
    algorithm<shard::full_shard, test::recording_weighted_average, schedule::periodic>;
using plain_hofl = algorithm<shard::full_shard, federation::weighted_average, schedule::periodic>;

template <class Alg>
trainer_options<Alg> hofl_options() {
  trainer_options<Alg> o;
  o.total_steps = 6;
  o.schedule.period = 3;
  o.participation = kSample;
  o.log = [](const std::string&) {};
  // The layer as parameters, through weighted_average (its bits are the policy's; the
  // records' replay of the same sample is tests/trainer/test_zo_seeds.cpp's).
  o.local_rule = test::recording(zeroth_order_rule(kZo, {"layer0"}, zo_sync::parameters));
  return o;
}

/// One rank's view of the run: its master before and after each sync (steps 2 and 5), what
/// each sync told the policy, and its parameters at the end.
struct rank_view {
  mesh_coords coords;
  std::vector<std::vector<float>> pre, post;
  std::vector<test::recorded_sync> syncs;
  std::vector<float> params;
};

template <class Alg>
std::vector<rank_view> run_hofl() {
  return test::collect_ranks(kShape.size(), [&](inproc::communicator& world) {
    mesh m(world, kShape);
    trainer<mlp_model, Alg, optim::adamw, inproc::communicator> t(m, mlp_model{}, {.lr = 2e-2f},
                                                                  hofl_options<Alg>());
    auto* rule = dynamic_cast<test::master_recording_rule*>(t.local());
    REQUIRE(rule != nullptr);
    rank_view v;
    v.coords = t.topology().coords();
    const int g = v.coords.group;
    for (int s = 0; s < 6; ++s) {
      t.step(t.model().batch(kData, s, g, kShape.groups, v.coords.shard, kShape.shards, g + 1));
      if (s % 3 != 2) continue;
      t.synchronize();
      const auto master = t.engine().master();
      v.pre.push_back(rule->last_master());
      v.post.emplace_back(master.begin(), master.end());
    }
    if constexpr (requires { t.federation().records(); }) v.syncs = t.federation().records();
    v.params = t.parameters();
    return v;
  });
}

}  // namespace

TEST_CASE("hofl: each round's sample, identical on every rank, averaged by tokens") {
  const auto ranks = run_hofl<recorded_hofl>();
  using mask = std::vector<std::uint8_t>;
  const mask sampled[2] = {{1, 0, 1, 0}, {1, 0, 0, 1}};
  const std::vector<double> tokens[2] = {{6, 0, 18, 0}, {6, 0, 0, 24}};
  const int pair[2][2] = {{0, 2}, {0, 3}};
  const float scale[2][2] = {{0.5f, 1.5f}, {0.4f, 1.6f}};
  const double weight[2][2] = {{6, 18}, {6, 24}};
  for (const auto& v : ranks) {
    CAPTURE(v.coords.group);
    CAPTURE(v.coords.shard);
    REQUIRE(v.syncs.size() == 2);
    for (int k = 0; k < 2; ++k) {
      CAPTURE(k);
      CHECK(v.syncs[static_cast<std::size_t>(k)].round == k);
      CHECK(v.syncs[static_cast<std::size_t>(k)].included == sampled[k]);
      CHECK(v.syncs[static_cast<std::size_t>(k)].group_tokens == tokens[k]);
      const auto& a =
          ranks[static_cast<std::size_t>(rank_of(kShape, {pair[k][0], 0, v.coords.shard}))]
              .pre[static_cast<std::size_t>(k)];
      const auto& b =
          ranks[static_cast<std::size_t>(rank_of(kShape, {pair[k][1], 0, v.coords.shard}))]
              .pre[static_cast<std::size_t>(k)];
      // The zeroth-order layer's shard (the first 72 of the master: layer0's 144 elements
      // over 2 shards) trained apart in the two sampled groups.
      REQUIRE_FALSE(std::equal(a.begin(), a.begin() + 72, b.begin()));
      const auto& got = v.post[static_cast<std::size_t>(k)];
      REQUIRE(got.size() == a.size());
      std::vector<float> want(a.size());
      for (std::size_t i = 0; i < a.size(); ++i) {
        const float x = scale[k][0] * a[i];
        const float y = scale[k][1] * b[i];
        want[i] = (x + y) / 2.0f;
        const double mean =
            (weight[k][0] * a[i] + weight[k][1] * b[i]) / (weight[k][0] + weight[k][1]);
        REQUIRE(std::abs(got[i] - mean) <= 1e-6 * (1 + std::abs(mean)));
      }
      CHECK(bit_equal(got, want));
    }
  }
  // The recording changes nothing: plain weighted_average ends with the same bits.
  const auto plain = run_hofl<plain_hofl>();
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    CAPTURE(r);
    CHECK(bit_equal(plain[r].params, ranks[r].params));
    CHECK(bit_equal(ranks[r].params, ranks[r % 2].params));  // step 5 synced: one model
  }
}

namespace {

/// Plain HO-FL (hofl) on the communicator and space of Sp: load(from) when given, steps
/// [first, last), save(to) when given; every rank's parameters at the end.
template <class Sp>
std::vector<std::vector<float>> hofl_leg(int first, int last,
                                         const std::filesystem::path& from = {},
                                         const std::filesystem::path& to = {}) {
  return test::collect_ranks(kShape.size(), [&](inproc::communicator& world) {
    auto comm = Sp::wrap(world);
    mesh m(comm, kShape);
    trainer<mlp_model, plain_hofl, optim::adamw, typename Sp::comm, typename Sp::space> t(
        m, mlp_model{}, {.lr = 2e-2f}, hofl_options<plain_hofl>());
    if (!from.empty()) t.load(from);
    const auto c = t.topology().coords();
    for (int s = first; s < last; ++s)
      t.step(
          t.model().batch(kData, s, c.group, kShape.groups, c.shard, kShape.shards, c.group + 1));
    if (!to.empty()) t.save(to);
    return t.parameters();
  });
}

}  // namespace

// The round's number (which sample a sync draws) and the tokens each rank counted since the
// last sync are state: saved after step 4, a resumed run's sync after step 5 draws round 1's
// sample {0, 3} and weighs it 6 : 24 as the uninterrupted run does.
TEST_CASE_TEMPLATE(
    "hofl: the test spaces give the host's bits, and a run saved mid-round resumes "
    "bit-exactly",
    Sp, FEDSHARD_TEST_SPACES) {
  test::temp_dir dir("fedshard-hofl");
  const auto host = hofl_leg<test::on_host>(0, 6);
  const auto straight = hofl_leg<Sp>(0, 6);
  (void)hofl_leg<Sp>(0, 5, {}, dir.path);
  const auto resumed = hofl_leg<Sp>(5, 6, dir.path);
  const auto recorded = run_hofl<recorded_hofl>();
  for (std::size_t r = 0; r < host.size(); ++r) {
    CAPTURE(r);
    CHECK(bit_equal(straight[r], host[r]));
    CHECK(bit_equal(resumed[r], straight[r]));
    CHECK(bit_equal(host[r], recorded[r].params));
  }
}
