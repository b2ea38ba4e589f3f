// holder_average (FoMoE, holder-count aggregation): each unit is averaged over the groups that
// hold it; units held by one group stay as they are; a group allocates nothing for a unit it
// does not hold; every group holding everything is `average`, bit for bit; the wire moves what
// the plan says, and less than average.
#include "fedshard/federation/holder_average.hpp"

#include <doctest/doctest.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/federation/average.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/files.hpp"
#include "support/op_lists.hpp"
#include "support/plan_checks.hpp"
#include "support/policy_checks.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;
using federation::holder_average;
using shard::groups_of;

namespace {

constexpr int units_n = 5;  // "dense", "e0" .. "e2", "head"
constexpr int unit_len[units_n] = {40, 24, 24, 24, 8};

/// A model of a dense unit, three experts and a head; unit u's initial values depend on the
/// group (so the groups differ before the first sync); it acquires the units its group holds
/// (ctx.holds) and writes zero gradients, and reads unit `touch` too (held or not).
struct experts_model {
  int group = 0;
  int touch = -1;
  std::int64_t weight = 1;  ///< tokens per batch

  std::int64_t tokens(int) const { return weight; }

  std::vector<unit_spec> units() const {
    std::vector<unit_spec> u;
    const char* names[units_n] = {"dense", "e0", "e1", "e2", "head"};
    for (int k = 0; k < units_n; ++k) u.push_back({names[k], {{"w", {unit_len[k]}}}});
    return u;
  }
  std::vector<float> initial_values(const flat_layout& l, std::size_t u) const {
    std::vector<float> v(l.unit(u).numel);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = initial(group, u, i);
    return v;
  }
  static float initial(int g, std::size_t u, std::size_t i) {
    return 0.37f * static_cast<float>(g + 1) + 0.011f * static_cast<float>(i) -
           0.5f * static_cast<float>(u) + 0.001f * static_cast<float>(g * g);
  }
  float forward_backward(step_context& ctx, int) {
    for (std::size_t u = 0; u < units_n; ++u)  // the units this group holds, through the hooks
      if (ctx.holds(u)) {
        ctx.acquire(u);
        ctx.release(u);
      }
    for (std::size_t u = units_n; u-- > 0;)
      if (ctx.holds(u)) {
        ctx.acquire(u, phase::backward);
        ctx.release(u);
        ctx.grads_ready(u);
      }
    if (touch >= 0) {
      ctx.acquire(static_cast<std::size_t>(touch));
      ctx.release(static_cast<std::size_t>(touch));
    }
    return 0.0f;
  }
};

/// Trains for one step with lr 0 (parameters unchanged) and a sync at its end.
template <class A>
using experts_trainer = trainer<experts_model, A, optim::sgd, inproc::communicator>;

template <class A>
trainer_options<A> one_sync(typename A::federation_policy::config fed = {}) {
  trainer_options<A> o;
  o.total_steps = 1;
  o.schedule.period = 1;
  o.federation = fed;
  return o;
}

/// Dense and head everywhere; e0 on groups {0, 1}, e1 on {1, 2, 3}, e2 on group 2 alone.
shard::ownership experts_on_4() {
  return {.groups = 4,
          .holders = {shard::all_groups(4), groups_of({0, 1}), groups_of({1, 2, 3}), groups_of({2}),
                      shard::all_groups(4)}};
}

/// The mean over the holders of h, in group order, as the rank-order reduction computes it.
float holders_mean(shard::group_set h, std::size_t u, std::size_t i) {
  float s = 0;
  for (int g = 0; g < 64; ++g)
    if ((h >> g) & 1u) s += experts_model::initial(g, u, i);
  return s / static_cast<float>(std::popcount(h));
}

/// Runs body(mesh, group) on every rank of shape, its mesh over an inproc world.
template <class F>
void on_groups(const mesh_shape& shape, F body) {
  test::spawn_ranks(shape.size(), [&](inproc::communicator& world) {
    mesh m(world, shape);
    body(m, m.coords().group);
  });
}

using fomoe_sgd = algorithm<shard::hybrid_shard, federation::holder_average, schedule::periodic>;
using average_sgd = algorithm<shard::hybrid_shard, federation::average, schedule::periodic>;
using weighted_sgd =
    algorithm<shard::hybrid_shard, federation::weighted_average, schedule::periodic>;

}  // namespace

TEST_CASE("holder_average models FederationPolicy; fomoe is HSDP + holder_average every K") {
  test::check_federation_policy<holder_average>("holder_average", true);
  CHECK(std::is_same_v<fomoe::federation_policy, holder_average>);
  CHECK(fomoe::default_schedule().period == 8);
}

TEST_CASE("with every group holding everything the plan is average's") {
  // G = 3 groups of R = 2 replicas x S = 2 shards; this rank is replica 1 of group 1; a
  // fragment of 64 f32 = 256 B, whole on every group, so no members and no ranges:
  //  - hierarchical: its half (128 B) all-reduced over the 3 groups at sync_exchange, the 256 B
  //    all-gathered over the 2 replicas at sync_finish;
  //  - reference: replica 1 only receives replica 0's broadcast of the 256 B.
  const operand whole{.role = role::fragment};
  const operand half{.role = role::fragment, .piece = axis::replica};
  const comm_op gather = test::sync_op(comm_kind::all_gather, axis::replica, dtype::f32, 256, 2, {},
                                       trigger::sync_finish, 0, half, whole);
  const std::vector<comm_op> hierarchical{
      test::sync_op(comm_kind::all_reduce, axis::federation, dtype::f32, 128, 3, reduce_op::avg,
                    trigger::sync_exchange, 0, half, half),
      gather};
  comm_op bcast = gather;
  bcast.kind = comm_kind::broadcast;
  bcast.in = {};
  for (auto mode : {federation::sync_mode::hierarchical, federation::sync_mode::reference}) {
    CAPTURE(to_string(mode));
    const federation::sync_context ctx{
        .shape = {3, 2, 2}, .coords = {1, 1, 0}, .numel = 64, .units = {{0, 32}, {1, 16}}};
    const std::vector<comm_op> want =
        mode == federation::sync_mode::hierarchical ? hierarchical : std::vector<comm_op>{bcast};
    CHECK(test::compare_ops(holder_average({mode, {}}, {}).sync_plan(ctx).ops, want) == "");
    const shard::ownership all{.groups = 3, .holders = {shard::all_groups(3), 0b111}};
    CHECK(test::compare_ops(holder_average({mode, all}, {}).sync_plan(ctx).ops, want) == "");
    CHECK(test::compare_ops(federation::average({mode}, {}).sync_plan(ctx).ops, want) == "");
  }
}

TEST_CASE("the plan has one average per run of units with 2+ holders, among those holders") {
  const holder_average h({.owners = experts_on_4()}, {});
  CHECK(h.member_sets({4, 1, 1}) == std::vector<std::uint64_t>{0b0011, 0b1110});
  // group 1 holds dense, e0, e1, head: runs dense | e0 | e1 | head
  const federation::sync_context ctx{.shape = {4, 1, 1},
                                     .coords = {1, 0, 0},
                                     .numel = 128,
                                     .units = {{0, 48}, {1, 32}, {2, 32}, {4, 16}}};
  const plan p = h.sync_plan(ctx);
  REQUIRE(p.ops.size() == 4);
  const std::int64_t offsets[] = {0, 48, 80, 112}, counts[] = {48, 32, 32, 16};
  const std::uint64_t members[] = {0, 0b0011, 0b1110, 0};
  const int ranks[] = {4, 2, 3, 4};
  for (std::size_t k = 0; k < 4; ++k) {
    CHECK(p.ops[k].out.offset == offsets[k]);
    CHECK(p.ops[k].out.count == counts[k]);
    CHECK(p.ops[k].members == members[k]);
    CHECK(p.ops[k].ranks == ranks[k]);
    CHECK(p.ops[k].bytes == counts[k] * 4);
  }
  // group 2 holds e2 alone: nothing moves for it
  const plan p2 = h.sync_plan({.shape = {4, 1, 1},
                               .coords = {2, 0, 0},
                               .numel = 128,
                               .units = {{0, 48}, {2, 32}, {3, 32}, {4, 16}}});
  REQUIRE(p2.ops.size() == 3);
  CHECK(p2.ops[2].out.offset == 112);
  // R = 3, hierarchical: the dense run of 48 splits over the replicas (a piece each, then
  // all_gather); e0's 32 do not (replica 0 averages them, then broadcasts)
  for (int r : {0, 1}) {
    const plan p4 = h.sync_plan(
        {.shape = {4, 3, 1}, .coords = {1, r, 0}, .numel = 96, .units = {{0, 48}, {1, 32}}});
    std::vector<comm_kind> kinds;
    for (const comm_op& op : p4.ops) kinds.push_back(op.kind);
    if (r == 0)
      CHECK(kinds == std::vector<comm_kind>{comm_kind::all_reduce, comm_kind::all_gather,
                                            comm_kind::all_reduce, comm_kind::broadcast});
    else
      CHECK(kinds == std::vector<comm_kind>{comm_kind::all_reduce, comm_kind::all_gather,
                                            comm_kind::broadcast});
    CHECK(p4.ops[0].bytes == 48 * 4 / 3);
    CHECK(p4.ops[0].out.piece == axis::replica);
  }
  // adjacent units with the same holders are one run
  const holder_average same({.owners = {.groups = 2, .holders = {0b11, 0b11, 0b01}}}, {});
  const plan p3 = same.sync_plan(
      {.shape = {2, 1, 1}, .coords = {0, 0, 0}, .numel = 64, .units = {{0, 16}, {1, 16}, {2, 16}}});
  // every unit of the fragment held by both... except unit 2: one run of 32, then nothing
  REQUIRE(p3.ops.size() == 1);
  CHECK(p3.ops[0].out.count == 32);
  CHECK(p3.ops[0].members == 0);
}

TEST_CASE("every group holding everything equals average bit for bit, on several meshes") {
  for (const mesh_shape shape :
       {mesh_shape{2, 1, 1}, mesh_shape{3, 2, 1}, mesh_shape{2, 2, 2}, mesh_shape{4, 1, 2}}) {
    CAPTURE(shape.groups);
    CAPTURE(shape.replicas);
    CAPTURE(shape.shards);
    for (auto mode : {federation::sync_mode::hierarchical, federation::sync_mode::reference}) {
      const shard::ownership all{
          .groups = shape.groups,
          .holders = std::vector<shard::group_set>(units_n, shard::all_groups(shape.groups))};
      on_groups(shape, [&](auto& m, int g) {
        experts_trainer<fomoe_sgd> h(m, {g}, {.lr = 0.0f}, one_sync<fomoe_sgd>({mode, all}));
        experts_trainer<average_sgd> a(m, {g}, {.lr = 0.0f}, one_sync<average_sgd>({mode}));
        h.step(0);
        a.step(0);
        const auto ph = h.parameters(), pa = a.parameters();
        REQUIRE(ph.size() == pa.size());
        CHECK(std::memcmp(ph.data(), pa.data(), ph.size() * sizeof(float)) == 0);
        CHECK(h.sync_plan().ops == a.sync_plan().ops);
        CHECK(h.traffic().same_traffic(a.traffic()));
      });
    }
  }
}

TEST_CASE("with a mask each element is the mean over its holders; one holder: untouched") {
  // R = 3: runs of 32 and 16 elements do not split over 3 replicas (reference fallback), the
  // dense run of 48 does (hierarchical)
  for (const mesh_shape shape :
       {mesh_shape{4, 1, 1}, mesh_shape{4, 2, 1}, mesh_shape{4, 1, 2}, mesh_shape{4, 3, 1}}) {
    for (auto mode : {federation::sync_mode::hierarchical, federation::sync_mode::reference}) {
      CAPTURE(shape.replicas);
      CAPTURE(shape.shards);
      on_groups(shape, [&](auto& m, int g) {
        const auto owners = experts_on_4();
        experts_trainer<fomoe_sgd> t(m, {g}, {.lr = 0.0f},
                                     one_sync<fomoe_sgd>({.sync = mode, .owners = owners}));
        t.step(0);
        CHECK(t.syncs_applied() == 1);
        for (std::size_t u = 0; u < units_n; ++u) {
          if (!owners.holds(g, u)) continue;
          const auto v = t.unit_parameters(u);
          REQUIRE(v.size() == static_cast<std::size_t>(unit_len[u]));
          for (std::size_t i = 0; i < v.size(); ++i) {
            const shard::group_set h = owners.holders[u];
            const float want =
                std::popcount(h) == 1 ? experts_model::initial(g, u, i) : holders_mean(h, u, i);
            CHECK(v[i] == want);
          }
        }
      });
    }
  }
}

TEST_CASE("a group allocates nothing for units it does not hold; hooks refuse them") {
  on_groups(mesh_shape{4, 1, 2}, [&](auto& m, int g) {
    const auto owners = experts_on_4();
    trainer<experts_model, fomoe, optim::adamw, inproc::communicator> t(
        m, {g}, {.lr = 0.0f}, one_sync<fomoe>({.owners = owners}));
    const flat_layout& l = t.engine().layout();
    std::size_t held = 0, all = 0;
    for (std::size_t u = 0; u < units_n; ++u) {
      all += l.unit(u).shard_numel;
      if (owners.holds(g, u)) held += l.unit(u).shard_numel;
      CHECK(t.engine().holds(u) == owners.holds(g, u));
    }
    CHECK(all == l.total_shard_numel());
    CHECK(held < all);
    CHECK(t.engine().master().size() == held);
    CHECK(t.engine().grad().size() == held);
    for (const auto& s : t.optimizer().state()) CHECK(s.data.size() == held);
    // the step plan gathers and reduces held units only
    for (const comm_op& op : t.step_plan().ops)
      CHECK(owners.holds(g, static_cast<std::size_t>(op.unit)));
    // e2 (unit 3) lives on group 2 only
    if (g != 2) {
      CHECK_THROWS_WITH_AS(t.unit_parameters(3), doctest::Contains("is not held by group"),
                           invalid_argument);
      t.model().touch = 3;
      CHECK_THROWS_WITH_AS(t.step(0), doctest::Contains("unit 3 ('e2') is not held by group"),
                           invalid_argument);
    }
  });
}

TEST_CASE("the wire moves what the plan says, and less than average") {
  on_groups(mesh_shape{4, 2, 1}, [&](auto& m, int g) {
    experts_trainer<fomoe_sgd> h(m, {g}, {.lr = 0.0f},
                                 one_sync<fomoe_sgd>({.owners = experts_on_4()}));
    experts_trainer<average_sgd> a(m, {g}, {.lr = 0.0f}, one_sync<average_sgd>());
    h.wire().keep_calls(true);
    h.step(0);
    a.step(0);
    const auto got = h.wire().take_calls();
    CHECK(test::compare_calls(got, test::expected_step_calls(h, 0, 1)) == "");
    plan all = h.setup_plan();
    all.append(h.step_plan()).append(h.sync_plan());
    CHECK(h.traffic().same_traffic(traffic_counters::of(all)));
    CHECK(h.traffic()[axis::federation].wire_bytes < a.traffic()[axis::federation].wire_bytes);
  });
}

TEST_CASE("bad masks are invalid_argument on every rank") {
  struct bad {
    shard::ownership owners;
    const char* says;
  };
  const bad cases[] = {
      {{.groups = 2, .holders = {0b11, 0b00, 0b01, 0b10, 0b11}}, "is held by no group"},
      {{.groups = 3, .holders = {0b11, 0b11, 0b01, 0b10, 0b11}}, "written for 3 groups"},
      {{.groups = 2, .holders = {0b11, 0b01}}, "holders of 2 units, but the model declares 5"},
      {{.groups = 2, .holders = {0b11, 0b111, 0b01, 0b10, 0b11}}, "groups 0 to 1 only"},
  };
  for (const bad& b : cases) {
    CAPTURE(b.says);
    std::vector<std::string> errors(4);
    test::spawn_ranks(4, [&](inproc::communicator& world) {
      mesh m(world, {2, 1, 2});
      try {
        experts_trainer<fomoe_sgd> t(m, {m.coords().group}, {.lr = 0.0f},
                                     one_sync<fomoe_sgd>({.owners = b.owners}));
      } catch (const invalid_argument& e) {
        errors[static_cast<std::size_t>(world.rank())] = e.what();
      }
    });
    for (const auto& e : errors) CHECK(e.find(b.says) != std::string::npos);
  }
}

TEST_CASE("token-weighted: every group holding everything is weighted_average, bit for bit") {
  on_groups(mesh_shape{4, 2, 1}, [&](auto& m, int g) {
    experts_trainer<fomoe_sgd> h(m, {g, -1, g + 1}, {.lr = 0.0f},
                                 one_sync<fomoe_sgd>({.weighted = true}));
    experts_trainer<weighted_sgd> w(m, {g, -1, g + 1}, {.lr = 0.0f}, one_sync<weighted_sgd>());
    h.step(0);
    w.step(0);
    CHECK(h.sync_plan().ops == w.sync_plan().ops);
    const auto ph = h.parameters(), pw = w.parameters();
    CHECK(std::memcmp(ph.data(), pw.data(), ph.size() * sizeof(float)) == 0);
  });
}

TEST_CASE("token-weighted with a mask: each element is the weighted mean over its holders") {
  for (const mesh_shape shape : {mesh_shape{4, 1, 1}, mesh_shape{4, 2, 1}, mesh_shape{4, 1, 2}}) {
    CAPTURE(shape.replicas);
    CAPTURE(shape.shards);
    on_groups(shape, [&](auto& m, int g) {
      const auto owners = experts_on_4();
      experts_trainer<fomoe_sgd> t(m, {g, -1, g + 1}, {.lr = 0.0f},
                                   one_sync<fomoe_sgd>({.owners = owners, .weighted = true}));
      t.step(0);
      // w_g: (g + 1) tokens on each of the group's R x S ranks
      auto w = [&](int k) { return static_cast<double>((k + 1) * shape.replicas * shape.shards); };
      for (std::size_t u = 0; u < units_n; ++u) {
        if (!owners.holds(g, u)) continue;
        const shard::group_set h = owners.holders[u];
        double total = 0;
        for (int k = 0; k < 4; ++k)
          if ((h >> k) & 1u) total += w(k);
        const auto v = t.unit_parameters(u);
        for (std::size_t i = 0; i < v.size(); ++i) {
          float want = experts_model::initial(g, u, i);
          if (std::popcount(h) >= 2) {  // as the plan computes it: scaled, then averaged
            float sum = 0;
            for (int k = 0; k < 4; ++k)
              if ((h >> k) & 1u) {
                const double scale = std::popcount(h) * w(k) / total;
                const float x = experts_model::initial(k, u, i);
                sum += scale == 1.0 ? x : x * static_cast<float>(scale);
              }
            want = sum / static_cast<float>(std::popcount(h));
          }
          CHECK(v[i] == want);
        }
      }
    });
  }
}

TEST_CASE("token-weighted: holders without tokens are refused on every rank") {
  std::vector<std::string> errors(4);
  on_groups(mesh_shape{4, 1, 1}, [&](auto& m, int g) {
    // e0's holders {0, 1} process no tokens
    experts_trainer<fomoe_sgd> t(m, {g, -1, g <= 1 ? 0 : 1}, {.lr = 0.0f},
                                 one_sync<fomoe_sgd>({.owners = experts_on_4(), .weighted = true}));
    try {
      t.step(0);
    } catch (const invalid_argument& e) {
      errors[static_cast<std::size_t>(g)] = e.what();
    }
  });
  for (const auto& e : errors)
    CHECK(e.find("the holders {0, 1} of a unit have no tokens") != std::string::npos);
}

TEST_CASE("a checkpoint with ownership masks restores into the same masks only") {
  test::temp_dir dir("fedshard-holders");
  on_groups(mesh_shape{4, 1, 2}, [&](auto& m, int g) {
    const auto owners = experts_on_4();
    auto opts = one_sync<fomoe_sgd>({.owners = owners});
    opts.total_steps = 2;
    experts_trainer<fomoe_sgd> a(m, {g}, {.lr = 0.0f}, opts);
    a.step(0);
    a.save(dir.path);
    experts_trainer<fomoe_sgd> b(m, {g + 1}, {.lr = 0.0f}, opts);  // other initial values
    b.load(dir.path);
    for (std::size_t u = 0; u < units_n; ++u)
      if (owners.holds(g, u)) CHECK(b.unit_parameters(u) == a.unit_parameters(u));
    experts_trainer<fomoe_sgd> c(m, {g}, {.lr = 0.0f}, one_sync<fomoe_sgd>());
    CHECK_THROWS_WITH_AS(c.load(dir.path),
                         doctest::Contains("loading across ownership masks is not supported"),
                         invalid_argument);
  });
}
