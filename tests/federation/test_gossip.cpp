// gossip (GASLoC): the matchings (symmetric, the degree's peer count, one idle group for an odd
// G at degree 1, the same on every rank, another one each round), the complete graph with
// α = 1/G equal to DiLoCo's outer step bit for bit, the wire equal to each round's plan and
// O(degree) bytes per round, and bad settings refused with what was expected and found.
#include "fedshard/federation/gossip.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/federation/outer_optimizer.hpp"
#include "fedshard/federation/outer_rules.hpp"
#include "fedshard/federation/sync.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/interpreter.hpp"
#include "fedshard/schedule/periodic.hpp"
#include "fedshard/trainer/algorithm.hpp"
#include "fedshard/trainer/checkpoint.hpp"
#include "fedshard/trainer/state_io.hpp"
#include "support/federated_run.hpp"
#include "support/plan_checks.hpp"
#include "support/spaces.hpp"
#include "support/spawn_ranks.hpp"

using namespace fedshard;
using namespace fedshard::federation;

namespace {

std::vector<unit_spec> two_units() {
  return {{"a", {{"w", {24}}}}, {"b", {{"w", {9}}}}};
}

/// Group g's parameters before round k's sync: small integers and halves (exact sums).
float theta(int g, int k, std::size_t i) {
  return static_cast<float>((g * 7 + k * 3 + static_cast<int>(i)) % 11) * 0.5f - 2.0f;
}

/// The matchings of `round` as a set of pairs, checked for symmetry on the way.
std::set<std::pair<int, int>> edges(const gossip_config& c, int G, std::int64_t round) {
  std::set<std::pair<int, int>> out;
  for (const auto& m : gossip_matchings(c, G, round)) {
    REQUIRE(m.size() == static_cast<std::size_t>(G));
    for (int g = 0; g < G; ++g) {
      const int p = m[static_cast<std::size_t>(g)];
      if (p < 0) continue;
      CHECK(p != g);
      CHECK(m[static_cast<std::size_t>(p)] == g);
      out.emplace(std::min(g, p), std::max(g, p));
    }
  }
  return out;
}

/// Runs body(mesh, interpreter, layout) on every rank of shape: the rank's mesh over an inproc
/// world, an interpreter over it and the two units laid out over the shape's shards; then
/// waits for every plan the body left in flight.
template <class F>
void on_gossip_ranks(const mesh_shape& shape, F body) {
  test::spawn_ranks(shape.size(), [&](inproc::communicator& world) {
    mesh m(world, shape);
    interpreter<inproc::communicator> in(m);
    const flat_layout l(two_units(), shape.shards);
    body(m, in, l);
    in.wait_all();
  });
}

}  // namespace

TEST_CASE("each group's peer count is the degree; with G odd at degree 1 one group is idle") {
  for (int G = 1; G <= 9; ++G)
    for (std::int64_t round = 0; round < 6; ++round) {
      CAPTURE(G);
      CAPTURE(round);
      for (int degree : {1, 2, gossip_config::complete}) {
        CAPTURE(degree);
        const gossip_config c{.degree = degree, .alpha = 0.5f / static_cast<float>(G), .seed = 7};
        const auto e = edges(c, G, round);
        int idle = 0;
        for (int g = 0; g < G; ++g) {
          const auto peers = gossip_peers(c, G, round, g);
          const std::set<int> distinct(peers.begin(), peers.end());
          CHECK(distinct.size() == peers.size());  // never the same peer twice in a round
          if (peers.empty()) ++idle;
          if (degree == 1) CHECK(peers.size() <= 1);
          if (degree == 2) CHECK(peers.size() == static_cast<std::size_t>(std::min(2, G - 1)));
          if (degree == gossip_config::complete)
            CHECK(peers.size() == static_cast<std::size_t>(G - 1));
        }
        if (degree == 1) CHECK(idle == (G % 2 == 1 ? 1 : 0));
        if (degree == gossip_config::complete)
          CHECK(e.size() == static_cast<std::size_t>(G * (G - 1) / 2));
      }
    }
}

TEST_CASE("matchings differ between rounds and seeds; the complete graph is every round's") {
  const gossip_config one{.degree = 1, .seed = 3}, two{.degree = 2, .alpha = 0.5f, .seed = 3};
  for (const auto& c : {one, two}) {
    std::set<std::set<std::pair<int, int>>> seen;
    for (std::int64_t r = 0; r < 10; ++r) {
      CHECK(edges(c, 8, r) != edges(c, 8, r + 1));
      seen.insert(edges(c, 8, r));
    }
    CHECK(seen.size() >= 8);
    gossip_config other = c;
    other.seed = 4;
    CHECK(edges(c, 8, 0) != edges(other, 8, 0));
  }
  const gossip_config all{.degree = gossip_config::complete, .alpha = 0.125f};
  CHECK(edges(all, 8, 0) == edges(all, 8, 5));
}

TEST_CASE("every rank runs the same matching: each receives its peers' stepped models") {
  // 6 groups x 2 replicas, degree 2, 4 rounds, outer SGD with lr 1 (y_g = anchor − Δ_g =
  // θ_g, exact: every value is a small multiple of 1/4): each rank's plan names its peers,
  // the peers name it back (the exchanges complete), and what arrives, whole on every
  // replica, is that peer's θ (the fragment's padding: 0).
  const mesh_shape shape{6, 2, 1};
  const gossip_config cfg{
      .degree = 2, .alpha = 0.25f, .lr = 1.0f, .momentum = 0.0f, .nesterov = false, .seed = 11};
  auto value = [](int g, int k) { return 1.0f + static_cast<float>(g) + 10.0f * k; };
  std::mutex mu;
  std::vector<std::vector<std::vector<int>>> peers_seen(4, std::vector<std::vector<int>>(12));
  on_gossip_ranks(shape, [&](auto& m, auto& in, const flat_layout& l) {
    synchronizer<gossip, schedule::periodic> s(cfg, {.period = 1}, l, shape, m.coords(), 0);
    const int g = m.coords().group;
    std::vector<float> master(l.total_shard_numel(), 0.0f);
    s.reset(master);
    for (int k = 0; k < 4; ++k) {
      std::fill(master.begin(), master.end(), value(g, k));
      s.after_step(in, k, 0, master, {});
      const auto expected = gossip_peers(cfg, 6, k, g);
      std::vector<int> planned;
      for (const comm_op& op : s.sync_plan(0).ops)
        if (op.kind == comm_kind::send_recv) planned.push_back(op.peer);
      CHECK(planned == expected);
      for (std::size_t j = 0; j < expected.size(); ++j) {
        const auto got = s.policy().gathered(0, static_cast<int>(j));
        std::size_t theirs = 0, zeros = 0;
        for (float x : got) {
          theirs += x == value(expected[j], k);
          zeros += x == 0.0f;
        }
        CHECK(theirs == master.size());  // the units with their padding
        CHECK(theirs + zeros == got.size());
      }
      std::lock_guard lock(mu);
      peers_seen[static_cast<std::size_t>(k)][static_cast<std::size_t>(m.rank())] = expected;
    }
  });
  for (int k = 0; k < 4; ++k) {
    const auto& seen = peers_seen[static_cast<std::size_t>(k)];
    for (int r = 0; r < 12; ++r) {
      const int g = r / 2;
      CHECK(seen[static_cast<std::size_t>(r)].size() == 2);
      CHECK(seen[static_cast<std::size_t>(r)] == seen[static_cast<std::size_t>(g * 2)]);
      for (int p : seen[static_cast<std::size_t>(r)]) {  // the peer has g among its peers
        const auto& back = seen[static_cast<std::size_t>(p * 2)];
        CHECK(std::find(back.begin(), back.end(), g) != back.end());
      }
    }
  }
  CHECK(peers_seen[0] != peers_seen[1]);
}

TEST_CASE(
    "degree 1, α = 1/2, outer SGD with lr 1: each pair averages, the idle group keeps its own") {
  // Anchors 0 and heavy-ball with γ = 0 and lr 1 give y_g = θ_g; the mixing gives
  // θ_g − (θ_g − θ_p) / 2: the pair's mean. With 5 groups one group is idle: it keeps θ_g.
  const mesh_shape shape{5, 1, 2};
  const gossip_config cfg{
      .degree = 1, .alpha = 0.5f, .lr = 1.0f, .momentum = 0.0f, .nesterov = false, .seed = 5};
  on_gossip_ranks(shape, [&](auto& m, auto& in, const flat_layout& l) {
    synchronizer<gossip, schedule::periodic> s(cfg, {.period = 1}, l, shape, m.coords(), 0);
    const int g = m.coords().group;
    std::vector<float> master(l.total_shard_numel(), 0.0f);
    s.reset(master);
    std::fill(master.begin(), master.end(), static_cast<float>(3 * g + 1));
    s.after_step(in, 0, 0, master, {});
    const auto peers = gossip_peers(cfg, 5, 0, g);
    const float expected =
        peers.empty() ? static_cast<float>(3 * g + 1)
                      : (static_cast<float>(3 * g + 1) + static_cast<float>(3 * peers[0] + 1)) / 2;
    for (float x : master) CHECK(x == expected);
  });
}

TEST_CASE("the complete graph with α = 1/G is DiLoCo's outer step (bit for bit when exact)") {
  // 4 groups x 2 replicas x 1 shard, both sync modes, 3 rounds; lr 0.5 and momentum 0.5 keep
  // every value a short dyadic number, so the sums are exact and the comparison is bitwise.
  // With DiLoCo's 0.7 and 0.9 the values round: equal up to the order of the sums (the mean
  // of the stepped models against the step on the mean), checked to 1e-6 relative.
  for (sync_mode mode : {sync_mode::hierarchical, sync_mode::reference}) {
    CAPTURE(to_string(mode));
    const mesh_shape shape{4, 2, 1};
    on_gossip_ranks(shape, [&](auto& m, auto& in, const flat_layout& l) {
      const int g = m.coords().group;
      for (const auto& [lr, mu, rounds] : {std::tuple{0.5f, 0.5f, 3}, std::tuple{0.7f, 0.9f, 3}}) {
        synchronizer<gossip, schedule::periodic> gs({.sync = mode,
                                                     .degree = gossip_config::complete,
                                                     .alpha = 0.25f,
                                                     .lr = lr,
                                                     .momentum = mu},
                                                    {.period = 1}, l, shape, m.coords(), 0);
        synchronizer<outer_optimizer<nesterov>, schedule::periodic> ds(
            {.sync = mode, .rule = {.lr = lr, .momentum = mu}}, {.period = 1}, l, shape, m.coords(),
            0);
        std::vector<float> a(l.total_shard_numel()), b(a.size());
        for (std::size_t i = 0; i < a.size(); ++i) a[i] = theta(0, 0, i);  // same start
        gs.reset(a);
        ds.reset(a);
        for (int k = 0; k < rounds; ++k) {
          for (std::size_t i = 0; i < a.size(); ++i) a[i] = b[i] = theta(g, k + 1, i);
          gs.after_step(in, k, 0, a, {});
          ds.after_step(in, k, 0, b, {});
          for (std::size_t i = 0; i < a.size(); ++i) {
            if (lr == 0.5f)
              CHECK(std::bit_cast<std::uint32_t>(a[i]) == std::bit_cast<std::uint32_t>(b[i]));
            else
              CHECK(a[i] == doctest::Approx(b[i]).epsilon(1e-6));
          }
        }
        CHECK(gs.policy().outer_steps(0) == rounds);
      }
    });
  }
}

TEST_CASE("the wire carries each round's plan: O(degree) bytes, whatever G") {
  for (sync_mode mode : {sync_mode::hierarchical, sync_mode::reference})
    for (int degree : {1, 2}) {
      CAPTURE(to_string(mode));
      CAPTURE(degree);
      const mesh_shape shape{5, 2, 1};  // odd G: at degree 1 one group idles each round
      const gossip_config cfg{.sync = mode, .degree = degree, .alpha = 0.25f, .seed = 2};
      on_gossip_ranks(shape, [&](auto& m, auto& in, const flat_layout& l) {
        synchronizer<gossip, schedule::periodic> s(cfg, {.period = 1}, l, shape, m.coords(), 0);
        const int g = m.coords().group;
        std::vector<float> master(l.total_shard_numel(), 1.0f);
        s.reset(master);
        traffic_counters planned;
        const auto numel = fragments_of(s.schedule(), l, shape.replicas)[0].padded;
        for (int k = 0; k < 4; ++k) {
          std::fill(master.begin(), master.end(), static_cast<float>(g + k));
          s.after_step(in, k, 0, master, {});
          for (const comm_op& op : s.sync_plan(0).ops) planned.record(op);
          CHECK(in.traffic().same_traffic(planned));
          // Federation bytes this round: one exchange per peer, of the rank's share.
          const auto peers = gossip_peers(cfg, 5, k, g).size();
          const double share = mode == sync_mode::hierarchical ? 0.5
                               : m.coords().replica == 0       ? 1.0
                                                               : 0.0;
          CHECK(s.sync_plan(0).wire_bytes_on(axis::federation) ==
                static_cast<double>(peers) * share * static_cast<double>(numel * 4));
        }
      });
    }
}

TEST_CASE("bad settings are refused, saying what was expected and what was found") {
  auto fails = [](gossip_config c, const char* what) {
    CAPTURE(what);
    CHECK_THROWS_WITH_AS(gossip(c, {16}), doctest::Contains(what), invalid_argument);
  };
  fails({.degree = 3}, "config.degree must be 1, 2 or gossip_config::complete (-1), found 3");
  fails({.degree = 0}, "found 0");
  fails({.alpha = 0.0f}, "config.alpha must be a finite number > 0, found 0");
  fails({.alpha = std::numeric_limits<float>::quiet_NaN()}, "config.alpha must be a finite");
  fails({.degree = 2, .alpha = 0.75f},
        "config.alpha must be in (0, 1/degree] = (0, 0.5] for "
        "degree 2 (each group keeps a weight >= 0), found 0.75");
  fails({.lr = -1.0f}, "gossip: config.lr must be a finite number >= 0, found -1");
  fails({.momentum = 1.0f}, "gossip: config.momentum must be in [0, 1), found 1");
  // The complete graph's α is checked against G where the plan is made.
  const gossip_config all{.degree = gossip_config::complete, .alpha = 0.5f};
  const gossip policy(all, {});
  CHECK_THROWS_WITH_AS(
      policy.sync_plan({.shape = {4, 1, 1}, .coords = {0, 0, 0}, .fragment = 0, .numel = 16}),
      doctest::Contains("config.alpha must be in (0, 1/3] = (0, 0.333333] with 3 peers per "
                        "group (4 groups, degree complete), found 0.5"),
      invalid_argument);
  CHECK_NOTHROW(
      policy.sync_plan({.shape = {3, 1, 1}, .coords = {0, 0, 0}, .fragment = 0, .numel = 16}));
  CHECK_THROWS_WITH_AS(gossip_peers({}, 4, 0, 4),
                       doctest::Contains("group must be in [0, 4), found 4"), invalid_argument);
}

TEST_CASE("gasloc trains in the trainer: one exchange per sync on the wire; complete ≈ diloco") {
  // 4 groups x 2 replicas, 6 steps, a sync every 2: three gossip rounds of degree 1.
  const mesh_shape shape{4, 2, 1};
  std::vector<test::run_outcome> gl(8), complete(8), dl(8);
  test::spawn_ranks(shape.size(), [&](inproc::communicator& world) {
    gl[static_cast<std::size_t>(world.rank())] = test::train_mlp<gasloc>(world, shape, 6, 2);
  });
  for (const auto& r : gl) {
    CHECK(r.syncs == 3);
    CHECK(r.traffic[axis::federation].calls == 3);  // degree 1, G even: one peer per round
    for (float loss : r.losses) CHECK(std::isfinite(loss));
  }
  CHECK(gl[0].traffic[axis::federation].wire_bytes > 0);
  // The complete graph with α = 1/4 is DiLoCo's step up to the summation order.
  test::spawn_ranks(shape.size(), [&](inproc::communicator& world) {
    const auto r = static_cast<std::size_t>(world.rank());
    complete[r] = test::train_mlp_with<gasloc>(world, shape, 6, 2,
                                               {.degree = gossip_config::complete, .alpha = 0.25f});
    dl[r] = test::train_mlp<diloco>(world, shape, 6, 2);
  });
  for (std::size_t r = 0; r < 8; ++r) {
    REQUIRE(complete[r].params.size() == dl[r].params.size());
    for (std::size_t i = 0; i < dl[r].params.size(); ++i)
      CHECK(complete[r].params[i] == doctest::Approx(dl[r].params[i]).epsilon(1e-5));
    CHECK(complete[r].traffic[axis::federation].calls == 3 * 3);  // 3 peers, 3 rounds
  }
}

TEST_CASE("a checkpoint between rounds keeps the anchors, the momentum and the round") {
  // Two synchronizers run rounds 0 and 1; the second is saved and restored into a third,
  // which then runs rounds 2 and 3 with the matchings and the state the first one has.
  const mesh_shape shape{4, 1, 1};
  const gossip_config cfg{.degree = 1, .alpha = 0.5f, .seed = 21};
  on_gossip_ranks(shape, [&](auto& m, auto& in, const flat_layout& l) {
    using S = synchronizer<gossip, schedule::periodic>;
    const int g = m.coords().group;
    S a(cfg, {.period = 1}, l, shape, m.coords(), 0);
    std::vector<float> ma(l.total_shard_numel()), mb(ma.size());
    for (std::size_t i = 0; i < ma.size(); ++i) ma[i] = theta(0, 0, i);
    a.reset(ma);
    for (int k = 0; k < 2; ++k) {
      for (std::size_t i = 0; i < ma.size(); ++i) ma[i] = theta(g, k, i);
      a.after_step(in, k, 0, ma, {});
    }
    state_registry ra, rb;
    a.register_state(ra, in);
    checkpoint::file_writer w;
    checkpoint::write_registry(ra, w);
    const checkpoint::file_reader r(w.bytes(), "memory");
    S b(cfg, {.period = 1}, l, shape, m.coords(), 0);
    b.register_state(rb, in);
    const checkpoint::state_geometry geo{.layout = &l, .fragments = {{0, 1}}, .shape = shape};
    checkpoint::apply(rb, checkpoint::stage_same(rb, r, geo));
    for (int k = 2; k < 4; ++k) {
      for (std::size_t i = 0; i < ma.size(); ++i) ma[i] = mb[i] = theta(g, k, i);
      a.after_step(in, k, 0, ma, {});
      b.after_step(in, k, 0, mb, {});
      CHECK(ma == mb);
      CHECK(a.sync_plan(0).ops == b.sync_plan(0).ops);
    }
    CHECK(b.policy().outer_steps(0) == 4);
  });
}

namespace {

/// gasloc with H = 2 (degree 2, 6 steps) trained in space Sp: every rank's parameters; the wire
/// checked against the plans step by step.
template <class Sp>
std::vector<std::vector<float>> gasloc_run(const mesh_shape& shape) {
  std::mutex mu;
  std::vector<std::string> mismatches;
  trainer_options<gasloc> o;
  o.schedule.period = 2;
  o.total_steps = 6;
  o.federation = {.degree = 2, .alpha = 0.25f, .seed = 17};
  auto out = test::collect_ranks(shape.size(), [&](inproc::communicator& world) {
    auto comm = Sp::wrap(world);
    mesh m(comm, shape);
    trainer<test::mlp_model, gasloc, optim::adamw, typename Sp::comm, typename Sp::space> t(
        m, test::mlp_model{}, {.lr = 0.02f}, o);
    const int g = m.coords().group;
    const int gs = shape.replicas * shape.shards;
    const int local = m.coords().replica * shape.shards + m.coords().shard;
    t.wire().keep_calls(true);
    for (int s = 0; s < 6; ++s) {
      t.step(t.model().batch(3, s, g, shape.groups, local, gs, 2));
      const std::string diff =
          test::compare_calls(t.wire().take_calls(), test::expected_step_calls(t, s, 6));
      if (!diff.empty()) {
        std::lock_guard lock(mu);
        mismatches.push_back(diff);
      }
    }
    return t.parameters();
  });
  for (const auto& d : mismatches) FAIL_CHECK(d);
  return out;
}

}  // namespace

TEST_CASE_TEMPLATE("gasloc gives the same bits in every test space, the wire equal to the plans",
                   Sp, FEDSHARD_TEST_SPACES) {
  const mesh_shape shape{4, 2, 1};
  const auto got = gasloc_run<Sp>(shape);
  const auto want = gasloc_run<test::on_host>(shape);
  REQUIRE(got.size() == want.size());
  for (std::size_t r = 0; r < got.size(); ++r) {
    CAPTURE(r);
    REQUIRE(got[r].size() == want[r].size());
    CHECK(std::memcmp(got[r].data(), want[r].data(), got[r].size() * sizeof(float)) == 0);
  }
}

TEST_CASE("streaming gossip: each fragment has its own rounds; the wire is each sync's plan") {
  // H = 4, 2 fragments, τ = 1, α = 0.5 on 4 groups at degree 2: each fragment syncs twice in
  // 8 steps, its exchanges in flight for a step while the other fragment's may start.
  const mesh_shape shape{4, 1, 2};
  const gossip_config cfg{.degree = 2, .alpha = 0.25f, .seed = 8};
  on_gossip_ranks(shape, [&](auto& m, auto& in, const flat_layout& l) {
    synchronizer<gossip, schedule::streaming> s(
        cfg, {.period = 4, .fragments = 2, .delay = 1, .alpha = 0.5f}, l, shape, m.coords(), 0);
    const int g = m.coords().group;
    std::vector<float> master(l.total_shard_numel(), static_cast<float>(g));
    s.reset(master);
    traffic_counters planned;
    std::vector<std::int64_t> applied(2, 0);
    for (std::int64_t step = 0; step < 8; ++step) {
      s.after_step(in, step, 0, master, {});
      for (int f = 0; f < 2; ++f)
        if (static_cast<std::int64_t>(s.sync_steps(f).size()) > applied[std::size_t(f)]) {
          applied[std::size_t(f)] = static_cast<std::int64_t>(s.sync_steps(f).size());
          for (const comm_op& op : s.sync_plan(f).ops) planned.record(op);
          std::vector<int> peers;
          for (const comm_op& op : s.sync_plan(f).ops) peers.push_back(op.peer);
          CHECK(peers == gossip_peers(cfg, 4, applied[std::size_t(f)] - 1, g));
        }
    }
    CHECK(applied == std::vector<std::int64_t>{2, 2});
    CHECK(in.traffic().same_traffic(planned));
    for (float x : master) CHECK(std::isfinite(x));
  });
}
