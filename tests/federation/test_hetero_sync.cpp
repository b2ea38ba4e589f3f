// The federation sync of a mesh of groups of different shapes (federation/overlap.hpp): the
// trainer's average equals, bit for bit, a reference that averages the groups' full models;
// the federation bytes each rank puts on the wire are the overlap ranges it holds; policies
// and shapes that cannot run are refused on every rank.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/federation/gossip.hpp"
#include "fedshard/federation/holder_average.hpp"
#include "fedshard/federation/overlap.hpp"
#include "fedshard/federation/robust_mean.hpp"
#include "fedshard/federation/weighted_average.hpp"
#include "fedshard/federation/with_codec.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/trainer/algorithm.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/plan_checks.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

namespace {

using namespace fedshard;
using fedshard::inproc::communicator;
using fedshard::test::mlp_model;

using weighted = algorithm<shard::hybrid_shard, federation::weighted_average, schedule::periodic>;

/// What a rank ended a run with.
struct outcome {
  mesh_coords coords;
  std::vector<float> params;            // the group's full model (gathered over the shards)
  std::int64_t federation_payload = 0;  // the federation calls' array bytes
  double federation_bytes = 0;          // what the rank sent on the federation axis
  std::int64_t syncs = 0;
};

/// Samples per rank of group g: unequal groups, unequal tokens.
int per_rank(int g) {
  return 2 + g;
}

/// `steps` steps of A on this rank of a mesh of `groups`, syncing every `period` steps.
template <class A>
outcome train(communicator& world, const std::vector<group_shape>& groups, int steps, int period,
              typename A::federation_policy::config fed = {}) {
  mesh m(world, groups);
  trainer_options<A> o;
  o.total_steps = steps;
  if constexpr (requires { o.schedule.period; }) o.schedule.period = period;
  o.federation = fed;
  trainer<mlp_model, A, optim::adamw, communicator> t(m, mlp_model{}, {.lr = 0.02f}, o);
  const mesh_coords c = m.coords();
  const int gs = m.shape().replicas * m.shape().shards;
  const int local = c.replica * m.shape().shards + c.shard;
  for (int s = 0; s < steps; ++s)
    t.step(t.model().batch(11, s, c.group, m.shape().groups, local, gs, per_rank(c.group)));
  return {.coords = c,
          .params = t.parameters(),
          .federation_payload = t.traffic()[axis::federation].payload_bytes,
          .federation_bytes = t.traffic()[axis::federation].wire_bytes,
          .syncs = t.syncs_applied()};
}

/// Each group's full model after `steps` steps without any sync (the models a sync after
/// step `steps` - 1 averages), by group.
std::vector<std::vector<float>> group_models(const std::vector<group_shape>& groups, int steps) {
  int world = 0;
  for (const auto& g : groups) world += g.size();
  const auto out = test::collect_ranks(
      world, [&](communicator& w) { return train<hsdp>(w, groups, steps, steps); });
  std::vector<std::vector<float>> models(groups.size());
  for (const auto& r : out)
    if (r.coords.replica == 0 && r.coords.shard == 0)
      models[static_cast<std::size_t>(r.coords.group)] = r.params;
  return models;
}

/// The reference: each group's model scaled by `scale[g]` (1: untouched), then averaged in
/// group order in f32 as the rank-order reduction does (sum from group 0, divided by G).
std::vector<float> reference_mean(const std::vector<std::vector<float>>& models,
                                  const std::vector<float>& scale) {
  const std::size_t G = models.size();
  std::vector<float> acc(models[0].size());
  for (std::size_t i = 0; i < acc.size(); ++i) {
    auto value = [&](std::size_t g) {
      return scale[g] == 1.0f ? models[g][i] : models[g][i] * scale[g];
    };
    float a = value(0);
    for (std::size_t g = 1; g < G; ++g) a += value(g);
    acc[i] = a / static_cast<float>(G);
  }
  return acc;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// The real elements of shard s of every unit cut into S shards (the overlap ranges a
/// replica-0 rank exchanges), from the layout rules alone.
std::size_t shard_elements(int S, int s) {
  const flat_layout l(mlp_model{}.units(), S);
  std::size_t n = 0;
  for (const auto& u : l.units()) {
    const std::size_t lo = std::min(u.numel, static_cast<std::size_t>(s) * u.shard_numel);
    const std::size_t hi = std::min(u.numel, static_cast<std::size_t>(s + 1) * u.shard_numel);
    n += hi - lo;
  }
  return n;
}

/// The federation payload a rank records per sync: the overlap ranges of its shard (4 bytes
/// per real element) on replica 0, nothing elsewhere; `weights`: plus the leaders'
/// all-gather of G token counts (8 bytes each).
std::int64_t expected_payload(const std::vector<group_shape>& groups, mesh_coords c, bool weights) {
  if (c.replica != 0) return 0;
  const auto G = static_cast<std::int64_t>(groups.size());
  const int S = groups[static_cast<std::size_t>(c.group)].shards;
  std::int64_t b = 4 * static_cast<std::int64_t>(shard_elements(S, c.shard));
  if (weights && c.shard == 0) b += 8 * G;
  return b;
}

/// What the rank sends for it: ring all-reduce 2 (G-1)/G x the ranges, all-gather (G-1)/G.
double expected_federation_bytes(const std::vector<group_shape>& groups, mesh_coords c,
                                 bool weights) {
  if (c.replica != 0) return 0;
  const double G = static_cast<double>(groups.size());
  const int S = groups[static_cast<std::size_t>(c.group)].shards;
  double b = 2 * (G - 1) / G * 4.0 * static_cast<double>(shard_elements(S, c.shard));
  if (weights && c.shard == 0) b += (G - 1) / G * 8.0 * G;
  return b;
}

void check_average(const std::vector<group_shape>& groups) {
  CAPTURE(to_string(groups));
  const int steps = 3;
  const auto models = group_models(groups, steps);
  const auto want = reference_mean(models, std::vector<float>(groups.size(), 1.0f));
  for (const auto& m : models) CHECK_FALSE(same_bits(m, want));  // the groups did differ
  int world = 0;
  for (const auto& g : groups) world += g.size();
  const auto out = test::collect_ranks(
      world, [&](communicator& w) { return train<fl_hsdp>(w, groups, steps, steps); });
  for (const auto& r : out) {
    CAPTURE(to_string(r.coords));
    CHECK(r.syncs == 1);
    CHECK(same_bits(r.params, want));
    CHECK(r.federation_payload == expected_payload(groups, r.coords, false));
    CHECK(r.federation_bytes ==
          doctest::Approx(expected_federation_bytes(groups, r.coords, false)).epsilon(1e-12));
  }
}

}  // namespace

TEST_CASE("groups 4x1 and 2x1: the average is the mean of the groups' full models") {
  check_average({{4, 1}, {2, 1}});
}

TEST_CASE("groups 2x2 and 1x2: the average is the mean of the groups' full models") {
  check_average({{2, 2}, {1, 2}});
}

TEST_CASE("groups of 3 and 4 shards (non-dividing): the average is bit-exact") {
  check_average({{1, 3}, {1, 4}});
  check_average({{1, 4}, {2, 3}, {1, 1}});
}

TEST_CASE("token-weighted average with different tokens per group is bit-exact") {
  const std::vector<group_shape> groups{{2, 2}, {1, 3}};
  const int steps = 2;
  const auto models = group_models(groups, steps);
  // Group g's tokens: steps x its ranks x per_rank(g); scale G w_g / W as the policy's.
  std::vector<double> w;
  double total = 0;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    w.push_back(steps * groups[g].size() * per_rank(static_cast<int>(g)));
    total += w.back();
  }
  std::vector<float> scale;
  for (double x : w) scale.push_back(static_cast<float>(static_cast<double>(w.size()) * x / total));
  CHECK(scale[0] != 1.0f);
  const auto want = reference_mean(models, scale);
  const auto out = test::collect_ranks(
      7, [&](communicator& c) { return train<weighted>(c, groups, steps, steps); });
  for (const auto& r : out) {
    CAPTURE(to_string(r.coords));
    CHECK(same_bits(r.params, want));
    CHECK(r.federation_payload == expected_payload(groups, r.coords, true));
    CHECK(r.federation_bytes ==
          doctest::Approx(expected_federation_bytes(groups, r.coords, true)).epsilon(1e-12));
  }
}

TEST_CASE("DiLoCo's outer step runs on a heterogeneous mesh: every group ends on one model") {
  const std::vector<group_shape> groups{{2, 2}, {1, 3}};
  const auto out =
      test::collect_ranks(7, [&](communicator& c) { return train<diloco>(c, groups, 4, 2); });
  for (const auto& r : out) {
    CHECK(r.syncs == 2);
    CHECK(same_bits(r.params, out[0].params));
  }
}

TEST_CASE("the holder sets of a heterogeneous mesh: one op per segment, merged where contiguous") {
  const flat_layout mine(mlp_model{}.units(), 2);
  const std::vector<group_shape> same{{1, 2}, {2, 2}};
  auto m = federation::make_overlap_map(mine, same, {0, 0, 1},
                                        [](const mesh_shape& v) { return v.shards; });
  // Groups cut alike: shard 0 of every unit is one run; shard 1 ends at each unit's last
  // real element (the padding is not exchanged), so it is one op per unit.
  const auto segs = federation::overlap_segments(*m, {0, 1, 2});
  REQUIRE(segs.size() == 4);
  CHECK(segs[0].members == 0b0101);
  CHECK(segs[0].count == 80 + 144 + 48);  // layer0 144 -> 80, layer1 272 -> 144, head 68 -> 48
  CHECK(segs[0].offset == std::vector<std::int64_t>{0, 0});
  CHECK(segs[1].members == 0b1010);
  CHECK(segs[1].offset == std::vector<std::int64_t>{0, 0});  // each holder's own buffer
  CHECK(segs[1].count == 144 - 80);
  // 3 shards next to 4:
  auto m34 = federation::make_overlap_map(mine, {{1, 3}, {1, 4}}, {0, 0, 0},
                                          [](const mesh_shape& v) { return v.shards; });
  const auto s34 = federation::overlap_segments(*m34, {1});  // layer1: 272 over 96 and 80
  std::vector<std::int64_t> counts;
  for (const auto& s : s34) counts.push_back(s.count);
  CHECK(counts == std::vector<std::int64_t>{80, 16, 64, 32, 48, 32});  // cuts 80 96 160 192 240
  CHECK(federation::overlap_member_sets(*m, {{0, 1, 2}}) ==
        std::vector<std::uint64_t>{0b0101, 0b1010});
}

TEST_CASE("policies that cannot sync groups of different shapes are refused on every rank") {
  const std::vector<group_shape> groups{{2, 2}, {1, 2}};
  auto refused = [&]<class A>(std::string policy) {
    CAPTURE(policy);
    std::vector<std::string> msg(6);
    test::spawn_ranks(6, [&](communicator& w) {
      try {
        (void)train<A>(w, groups, 1, 1);
      } catch (const invalid_argument& e) {
        msg[static_cast<std::size_t>(w.rank())] = e.what();
      }
    });
    for (const auto& s : msg) {
      CAPTURE(s);
      CHECK(s.find("federation policy " + policy + " cannot sync groups of different shapes") !=
            std::string::npos);
      CHECK(s.find("expected groups of one shape, found group shapes 2x2,1x2") !=
            std::string::npos);
    }
  };
  refused.template operator()<gasloc>("gossip");
  refused.template operator()<fomoe>("holder_average");
  refused.template
  operator()<algorithm<shard::hybrid_shard, federation::median, schedule::periodic>>("median");
  refused.template operator()<sparseloco>("outer_sgd");
}

TEST_CASE("a shard policy that cannot run on a group's shape fails every rank, naming it") {
  std::vector<std::string> msg(6);
  test::spawn_ranks(6, [&](communicator& w) {
    try {
      (void)train<fl_fsdp>(w, {{1, 2}, {2, 2}}, 1, 1);
    } catch (const invalid_argument& e) {
      msg[static_cast<std::size_t>(w.rank())] = e.what();
    }
  });
  for (const auto& s : msg) {
    CAPTURE(s);
    CHECK(s.find("group 1 (2x2, replicas x shards)") != std::string::npos);
    CHECK(s.find("needs replicas == 1, found 2") != std::string::npos);
  }
  // A policy that replicates units over S_g > 1 shards cannot be mapped shard to shard.
  std::vector<std::string> msg2(3);
  test::spawn_ranks(3, [&](communicator& w) {
    try {
      (void)train<algorithm<shard::replicate, federation::average, schedule::periodic>>(
          w, {{1, 2}, {1, 1}}, 1, 1);
    } catch (const invalid_argument& e) {
      msg2[static_cast<std::size_t>(w.rank())] = e.what();
    }
  });
  for (const auto& s : msg2) {
    CAPTURE(s);
    CHECK(s.find("group 0 (1x2) expected 2 layout shards, found 1") != std::string::npos);
  }
}

TEST_CASE("streaming DiLoCo with a sync in flight runs on a heterogeneous mesh") {
  const std::vector<group_shape> groups{{2, 2}, {1, 3}};
  const auto out = test::collect_ranks(
      7,
      [&](communicator& w) {
        mesh m(w, groups);
        trainer_options<streaming_diloco> o;
        o.total_steps = 8;
        o.schedule.period = 4;
        o.schedule.fragments = 2;
        o.schedule.delay = 1;
        trainer<mlp_model, streaming_diloco, optim::adamw, communicator> t(m, mlp_model{}, {}, o);
        const mesh_coords c = m.coords();
        for (int s = 0; s < 8; ++s)
          t.step(t.model().batch(5, s, c.group, 2, c.replica * m.shape().shards + c.shard,
                                 m.shape().replicas * m.shape().shards, 2));
        return t.syncs_applied();
      },
      test::short_timeout(60));
  for (auto syncs : out) CHECK(syncs >= 2);
}

TEST_CASE("checkpoints of a heterogeneous mesh are refused on every rank") {
  std::vector<std::string> msg(6);
  test::spawn_ranks(6, [&](communicator& w) {
    mesh m(w, std::vector<group_shape>{{2, 2}, {1, 2}});
    trainer<mlp_model, fl_hsdp, optim::adamw, communicator> t(m, mlp_model{});
    try {
      t.save("unused-hetero-checkpoint");
    } catch (const invalid_argument& e) {
      msg[static_cast<std::size_t>(w.rank())] = e.what();
    }
  });
  for (const auto& s : msg)
    CHECK(s.find("checkpoints expect groups of one shape (a G x R x S mesh), found group shapes "
                 "2x2,1x2") != std::string::npos);
}

TEST_CASE("on a heterogeneous mesh the wire carries the sync plan, call by call") {
  const std::vector<group_shape> groups{{2, 2}, {1, 3}};
  test::spawn_ranks(7, [&](communicator& w) {
    mesh m(w, groups);
    trainer_options<weighted> o;
    o.total_steps = 4;
    o.schedule.period = 2;
    trainer<mlp_model, weighted, optim::adamw, communicator> t(m, mlp_model{}, {}, o);
    t.wire().keep_calls(true);
    const mesh_coords c = m.coords();
    for (int s = 0; s < 4; ++s) {
      (void)t.wire().take_calls();
      t.step(t.model().batch(5, s, c.group, 2, c.replica * m.shape().shards + c.shard,
                             m.shape().replicas * m.shape().shards, 1 + c.group));
      const std::string diff =
          test::compare_calls(t.wire().take_calls(), test::expected_step_calls(t, s, 4));
      CAPTURE(to_string(c));
      CAPTURE(s);
      CHECK_MESSAGE(diff.empty(), diff);
    }
    // Replica 0 holds one op per range it shares; the other replicas receive the broadcast.
    std::int64_t member_ops = 0;
    for (const auto& op : t.sync_plan().ops) member_ops += op.members != 0;
    CHECK((c.replica == 0 ? member_ops > 0 : member_ops == 0));
  });
}

TEST_CASE("token_budget on groups of different shapes: each group syncs on its own tokens") {
  using budget =
      algorithm<shard::hybrid_shard, federation::weighted_average, schedule::token_budget>;
  const std::vector<group_shape> groups{{2, 2}, {1, 3}};
  struct end {
    int group;
    std::vector<std::int64_t> sync_steps;
    std::vector<float> params;
  };
  const auto out = test::collect_ranks(
      7,
      [&](communicator& w) {
        mesh m(w, groups);
        trainer_options<budget> o;
        o.schedule = {.tokens = 20, .syncs = 2};
        trainer<mlp_model, budget, optim::adamw, communicator> t(m, mlp_model{}, {}, o);
        const mesh_coords c = m.coords();
        // Group 0: 4 ranks x 2 samples = 8 tokens a step; group 1: 3 x 5 = 15.
        const int per = c.group == 0 ? 2 : 5;
        for (int s = 0; !t.done() && s < 50; ++s)
          t.step(t.model().batch(5, s, c.group, 2, c.replica * m.shape().shards + c.shard,
                                 m.shape().replicas * m.shape().shards, per));
        return end{c.group, t.sync_steps(), t.parameters()};
      },
      test::short_timeout(60));
  for (const auto& r : out) {
    CAPTURE(r.group);
    // 8 tokens a step reach 20 after 3 steps, 15 after 2.
    CHECK(r.sync_steps ==
          (r.group == 0 ? std::vector<std::int64_t>{2, 5} : std::vector<std::int64_t>{1, 3}));
    CHECK(same_bits(r.params, out[0].params));  // one model after the last sync
  }
}
