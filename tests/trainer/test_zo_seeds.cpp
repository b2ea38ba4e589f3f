// Seeds on the wire (trainer/local_zeroth_order.hpp, zo_sync::records): tiny_mlp's first
// layer ("layer0", 144 elements) trained zeroth-order, groups of 2 shards (inproc, fl_fsdp
// syncing every 3 steps). The layer crosses the federation axis as the round's records, not as
// parameters:
//  - with a sample of one group per sync, every group ends each sync with exactly the sampled
//    group's layer: the whole model is bit-identical to the run that sends the layer as
//    parameters (the mean of one group is that group's values);
//  - with two groups weighted alike, every group holds the same bits, within rounding of the
//    parameters' mean (the other units bit-identical to the parameter run's);
//  - at the wire, a sync is the policy's all_reduce without the layer (80 floats of each
//    rank's shard less: 320 B) and two all_gathers: the counts (G x 8 B) and the records
//    (G x 6 x 24 B: 3 steps x 2 probes);
//  - a save mid-round and a load resume bit-exactly; the records' state is in the checkpoint.

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/federation/average.hpp"
#include "fedshard/federation/weighted_average.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/optim/zeroth_order.hpp"
#include "fedshard/plan/wire_tap.hpp"
#include "fedshard/trainer/checkpoint.hpp"
#include "fedshard/trainer/local_zeroth_order.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/files.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

namespace {

using namespace fedshard;
using test::mlp_model;
namespace fs = std::filesystem;

using trainer_t = trainer<mlp_model, fl_fsdp, optim::adamw, inproc::communicator>;
constexpr float kLr = 2e-2f;
const optim::zeroth_order_settings kZo{.eps = 1e-3f, .probes = 2, .seed = 9};

struct leg_settings {
  mesh_shape shape{2, 1, 2};
  zo_sync sync = zo_sync::records;
  double fraction = 1.0;  // participation
  int first = 0, last = 6;
  fs::path from{}, to{};
  bool uneven = false;  // group g's batches hold 4 (g + 1) samples (else 4)
};

/// Every rank's parameters at the end, its layer0 before the leg's first sync, and its
/// federation calls in the step of that sync (step 2 or the first multiple of 3 after it).
struct leg_result {
  std::vector<std::vector<float>> params, layer0_before_sync;
  std::vector<std::vector<wire_call>> sync_calls;
  std::vector<std::vector<std::uint8_t>> included;
};

template <class Alg = fl_fsdp>
leg_result leg(const leg_settings& s) {
  const auto n = static_cast<std::size_t>(s.shape.size());
  leg_result out{std::vector<std::vector<float>>(n), std::vector<std::vector<float>>(n),
                 std::vector<std::vector<wire_call>>(n), std::vector<std::vector<std::uint8_t>>(n)};
  test::spawn_ranks(s.shape.size(), [&](inproc::communicator& world) {
    mesh m(world, s.shape);
    trainer_options<Alg> o;
    o.total_steps = 30;
    o.schedule.period = 3;
    o.participation = {.fraction = s.fraction, .seed = 5};
    o.log = [](const std::string&) {};
    o.local_rule = zeroth_order_rule(kZo, {"layer0"}, s.sync);
    trainer<mlp_model, Alg, optim::adamw, inproc::communicator> t(
        m, mlp_model{}, {.lr = kLr, .weight_decay = 0.1f}, o);
    if (!s.from.empty()) t.load(s.from);
    const auto c = t.topology().coords();
    const auto r = static_cast<std::size_t>(world.rank());
    auto& wire = t.engine().interp().wire();
    bool first_sync = true;
    for (int step = s.first; step < s.last; ++step) {
      const bool syncs = step % 3 == 2;
      if (syncs && first_sync) {
        out.layer0_before_sync[r] = t.unit_parameters(0);
        wire.keep_calls(true);
        (void)wire.take_calls();
      }
      const int per = s.uneven ? 4 * (c.group + 1) : 4;
      t.step(t.model().batch(3, step, c.group, s.shape.groups, c.shard, s.shape.shards, per));
      if (syncs && first_sync) {
        for (const auto& call : wire.take_calls())
          if (call.axis == axis::federation || call.kind == comm_kind::broadcast)
            out.sync_calls[r].push_back(call);
        wire.keep_calls(false);
        out.included[r] = t.last_sync().included;
        first_sync = false;
      }
    }
    if (!s.to.empty()) t.save(s.to);
    out.params[r] = t.parameters();
  });
  return out;
}

/// Unit 0's elements (layer0: the first 144 of the model's parameters).
std::vector<float> layer0_of(const std::vector<float>& params) {
  return {params.begin(), params.begin() + 144};
}
std::vector<float> rest_of(const std::vector<float>& params) {
  return {params.begin() + 144, params.end()};
}

}  // namespace

TEST_CASE("seeds on the wire: a sample of one group gives every group its layer exactly") {
  // 3 groups, a third sampled per sync (ceil(0.3 x 3) = 1): the mean of one group is that
  // group's values, so replaying its records gives the parameters it would have sent.
  leg_settings s{.shape = {3, 1, 2}, .fraction = 0.3, .last = 9};
  const auto seeds = leg(s);
  s.sync = zo_sync::parameters;
  const auto params = leg(s);
  REQUIRE(seeds.included[0].size() == 3);
  CHECK(seeds.included[0][0] + seeds.included[0][1] + seeds.included[0][2] == 1);
  for (std::size_t r = 0; r < seeds.params.size(); ++r) {
    CAPTURE(r);
    CHECK(seeds.included[r] == seeds.included[0]);
    CHECK(test::bit_equal(seeds.params[r], params.params[r]));
    CHECK(test::bit_equal(seeds.params[r], seeds.params[0]));
  }
  // Before the first sync the groups' layers differ (their own directions): the sync made
  // every group's layer the sampled group's, which the parameter run confirms bit for bit.
  CHECK_FALSE(test::bit_equal(seeds.layer0_before_sync[0], seeds.layer0_before_sync[2]));
}

TEST_CASE("seeds on the wire: two groups alike end with one layer, near the parameters' mean") {
  leg_settings s{.last = 3};  // one sync, after step 2
  const auto seeds = leg(s);
  s.sync = zo_sync::parameters;
  const auto params = leg(s);
  for (std::size_t r = 0; r < seeds.params.size(); ++r) {
    CAPTURE(r);
    CHECK(test::bit_equal(seeds.params[r], seeds.params[0]));
    CHECK(test::bit_equal(rest_of(seeds.params[r]), rest_of(params.params[r])));
    const auto a = layer0_of(seeds.params[r]);
    const auto b = layer0_of(params.params[r]);
    for (std::size_t i = 0; i < a.size(); ++i) CHECK(a[i] == doctest::Approx(b[i]).epsilon(1e-5));
  }
  // The groups' layers differed before the sync; their mean is what both now hold.
  CHECK_FALSE(test::bit_equal(seeds.layer0_before_sync[0], seeds.layer0_before_sync[2]));
}

TEST_CASE("seeds on the wire: a token-weighted policy weighs the records by the groups' tokens") {
  // weighted_average, group 1 training on twice group 0's samples: weights 1/3 and 2/3. The
  // layer lands within rounding of the parameters' weighted mean; weights of 1/2 would put
  // it about a sixth of the groups' difference away.
  using weighted = algorithm<shard::full_shard, federation::weighted_average, schedule::periodic>;
  leg_settings s{.last = 3, .uneven = true};
  const auto seeds = leg<weighted>(s);
  s.sync = zo_sync::parameters;
  const auto params = leg<weighted>(s);
  const auto& before = seeds.layer0_before_sync;
  int apart = 0;
  for (std::size_t r = 0; r < seeds.params.size(); ++r) {
    CAPTURE(r);
    CHECK(test::bit_equal(seeds.params[r], seeds.params[0]));
    const auto a = layer0_of(seeds.params[r]);
    const auto b = layer0_of(params.params[r]);
    for (std::size_t i = 0; i < a.size(); ++i) {
      CHECK(a[i] == doctest::Approx(b[i]).epsilon(1e-5));
      apart += std::abs(before[0][i] - before[2][i]) > 1e-3f;
    }
  }
  CHECK(apart > 0);  // the groups' layers were apart enough for the weights to show
}

TEST_CASE("seeds on the wire: a sync's federation calls, byte for byte") {
  // Per rank, FSDP over 2 shards: layer0 144 elements (72 a shard, rounded up to 80),
  // layer1 272 (136 -> 144), head 68 (34 -> 48): a fragment of 80 + 144 + 48 = 272 floats,
  // 1088 B, the average's all_reduce. Without layer0: 192 floats, 768 B. Then the records:
  // an all_gather of one f64 count per group (2 x 8 = 16 B), and one of 3 steps x 2 probes =
  // 6 records per group (2 x 6 x 24 = 288 B). 1088 - 768 = 320 B of parameters become
  // 304 B, on the group's rank 0 only: it broadcasts them to its group (the group axis), so
  // the federation link carries each group's records once. On a real model the layer's
  // bytes grow with its size, the records' do not.
  const auto seeds = leg({});
  const auto params = leg({.sync = zo_sync::parameters});
  for (std::size_t r = 0; r < seeds.sync_calls.size(); ++r) {
    CAPTURE(r);
    const auto& p = params.sync_calls[r];
    REQUIRE(p.size() == 1);
    CHECK(p[0].kind == comm_kind::all_reduce);
    CHECK(p[0].bytes == 1088);
    // The group's rank 0 gathers the counts and the records over its federation link and
    // broadcasts each to its group (the group axis); its other rank only receives them.
    struct call {
      comm_kind kind;
      axis on;
      std::int64_t bytes;
    };
    const std::vector<call> leader{{comm_kind::all_reduce, axis::federation, 768},
                                   {comm_kind::all_gather, axis::federation, 16},
                                   {comm_kind::broadcast, axis::group, 16},
                                   {comm_kind::all_gather, axis::federation, 288},
                                   {comm_kind::broadcast, axis::group, 288}};
    const std::vector<call> other{{comm_kind::all_reduce, axis::federation, 768},
                                  {comm_kind::broadcast, axis::group, 16},
                                  {comm_kind::broadcast, axis::group, 288}};
    const auto& want = r % 2 == 0 ? leader : other;
    const auto& z = seeds.sync_calls[r];
    REQUIRE(z.size() == want.size());
    for (std::size_t k = 0; k < z.size(); ++k) {
      CAPTURE(k);
      CHECK(z[k].kind == want[k].kind);
      CHECK(z[k].axis == want[k].on);
      CHECK(z[k].bytes == want[k].bytes);
    }
  }
}

TEST_CASE("seeds on the wire: saved and loaded mid-round, bit-exactly") {
  test::temp_dir dir("fedshard-zo-seeds");
  const auto straight = leg({.last = 8});
  (void)leg({.last = 5, .to = dir.path});  // stops after step 4: 2 steps into a round
  const auto resumed = leg({.first = 5, .last = 8, .from = dir.path});
  for (std::size_t r = 0; r < straight.params.size(); ++r) {
    CAPTURE(r);
    CHECK(test::bit_equal(resumed.params[r], straight.params[r]));
  }
  const auto saved = checkpoint::saved_checkpoint::open(dir.path);
  for (const char* name : {"zo.anchor", "zo.round", "zo.started"})
    CHECK(saved.rank_file(0).has(name));
}

TEST_CASE("seeds on the wire: a model without the unit is refused, naming it") {
  test::spawn_ranks(2, [&](inproc::communicator& world) {
    mesh m(world, {2, 1, 1});
    trainer_options<fl_fsdp> o;
    o.log = [](const std::string&) {};
    o.local_rule = [] {
      // A rule that syncs a unit it does not train: the trainer finds no such unit.
      struct rule final : local_rule {
        std::string_view name() const override { return "syncs_nothing_real"; }
        std::vector<std::string> synced_units() const override { return {"layer9"}; }
      };
      return std::make_unique<rule>();
    };
    CHECK_THROWS_WITH_AS(trainer_t(m, mlp_model{}, {.lr = kLr}, o),
                         doctest::Contains("the local rule 'syncs_nothing_real' syncs unit "
                                           "'layer9', which the model does not declare"),
                         invalid_argument);
  });
}

TEST_CASE("seeds on the wire: groups of different shapes are refused, naming the way out") {
  // Groups 1x2 and 1x1: 3 ranks; the records' exchange pairs the groups' rank 0s over a
  // federation axis that such a mesh does not have yet.
  test::spawn_ranks(3, [&](inproc::communicator& world) {
    mesh m(world, std::vector<group_shape>{{1, 2}, {1, 1}});
    trainer_options<fl_fsdp> o;
    o.log = [](const std::string&) {};
    o.local_rule = zeroth_order_rule(kZo, {"layer0"});
    CHECK_THROWS_WITH_AS(trainer_t(m, mlp_model{}, {.lr = kLr}, o),
                         doctest::Contains("groups of different shapes do not support yet; "
                                           "expected groups of one shape (zeroth-order units: "
                                           "zo_sync::parameters"),
                         invalid_argument);
  });
}
