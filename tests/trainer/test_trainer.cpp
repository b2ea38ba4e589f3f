// The policy triple composed into a trainer: equivalences between algorithms, traffic against
// the plans, schedules, every alias training, and bad input.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "fedshard/codec/cast.hpp"
#include "fedshard/codec/topk.hpp"
#include "fedshard/comm/inproc.hpp"
#include "fedshard/core/fp8.hpp"
#include "fedshard/federation/outer_rules.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/plan_checks.hpp"
#include "support/spaces.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;
using test::mlp_model;

namespace {

constexpr std::uint64_t kData = 11;

/// What a training run produced, seen from every rank.
struct outcome {
  std::vector<std::vector<float>> params;      // per world rank: all units' full parameters
  std::vector<std::vector<float>> losses;      // per world rank
  std::vector<float> eval_before, eval_after;  // per world rank, on a fixed batch of 32
  std::vector<traffic_counters> traffic;       // per world rank
  std::vector<plan> step_plans, sync_plans;
  std::vector<std::vector<std::vector<std::int64_t>>> sync_steps;  // per rank, per fragment
  std::vector<std::string> wire_mismatches;  // per step and rank where the wire differs
};

/// The trainer of the tests, on the communicator and memory space of Sp
/// (support/spaces.hpp).
template <class Algorithm, class Opt, class Sp = test::on_host>
using mlp_trainer = trainer<mlp_model, Algorithm, Opt, typename Sp::comm, typename Sp::space>;

/// Options of an algorithm with a periodic schedule, syncing every k steps.
template <class Algorithm>
trainer_options<Algorithm> every(int k) {
  trainer_options<Algorithm> o;
  o.schedule = {.period = k};
  return o;
}

template <class Algorithm, class Opt = optim::sgd, class Sp = test::on_host>
outcome train(
    mesh_shape shape, int steps, typename Opt::config oc,
    std::type_identity_t<trainer_options<Algorithm>> opts = {}, int per_rank = 2,
    std::function<int(int group)> batch_size = {},
    std::type_identity_t<std::function<void(mlp_trainer<Algorithm, Opt, Sp>&, int)>> setup = {}) {
  outcome out;
  const int W = shape.size();
  out.params.resize(W);
  out.losses.resize(W);
  out.traffic.resize(W);
  out.step_plans.resize(W);
  out.sync_plans.resize(W);
  out.sync_steps.resize(W);
  out.eval_before.resize(W);
  out.eval_after.resize(W);
  if (opts.total_steps == 0) opts.total_steps = steps;
  std::mutex mu;
  test::spawn_ranks(W, [&](inproc::communicator& world) {
    auto comm = Sp::wrap(world);
    mesh m(comm, shape);
    mlp_trainer<Algorithm, Opt, Sp> t(m, mlp_model{}, oc, opts);
    const int g = m.coords().group;
    if (setup) setup(t, g);
    const int gs = shape.replicas * shape.shards;
    const int local = m.coords().replica * shape.shards + m.coords().shard;
    const int n = batch_size ? batch_size(g) : per_rank;
    const auto r = static_cast<std::size_t>(world.rank());
    const auto held_out = t.model().batch(kData + 1, 0, 0, 1, 0, 1, 32);
    out.eval_before[r] = t.evaluate(held_out);
    t.traffic().reset();  // count training only
    t.wire().keep_calls(true);
    t.wire().take_calls();
    std::vector<float> losses;
    for (int s = 0; s < steps; ++s) {
      losses.push_back(t.step(t.model().batch(kData, s, g, shape.groups, local, gs, n)));
      const std::string diff = test::compare_calls(
          t.wire().take_calls(), test::expected_step_calls(t, s, opts.total_steps));
      if (!diff.empty()) {
        std::lock_guard lock(mu);
        out.wire_mismatches.push_back(
            fedshard::detail::concat("rank ", world.rank(), ", step ", s, ": ", diff));
      }
    }
    t.wire().keep_calls(false);
    out.traffic[r] = t.traffic();
    out.eval_after[r] = t.evaluate(held_out);
    out.params[r] = t.parameters();
    out.losses[r] = losses;
    out.step_plans[r] = t.step_plan();
    out.sync_plans[r] = t.sync_plan();
    for (int f = 0; f < t.schedule().fragments(); ++f) out.sync_steps[r].push_back(t.sync_steps(f));
  });
  return out;
}

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

double max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::abs(double(a[i]) - b[i]) / std::max(1e-2, std::abs(double(b[i]))));
  return worst;
}

double mean(const std::vector<float>& v, std::size_t from, std::size_t to) {
  double s = 0;
  for (std::size_t i = from; i < to; ++i) s += v[i];
  return s / double(to - from);
}

}  // namespace

// fl_fsdp with K = 1 and plain SGD takes, every step, the average over groups of
// (θ - lr g_g), which is θ - lr * (mean of all ranks' gradients): FSDP over all ranks. The
// two differ only in float rounding (two-stage average vs one-stage), so within 1e-6.
TEST_CASE("fl_fsdp with K=1, average and plain SGD equals fsdp on the same data") {
  const optim::sgd::config sgd{.lr = 0.2f};
  const outcome fl = train<fl_fsdp>({2, 1, 2}, 6, sgd, every<fl_fsdp>(1));
  // The same 4 ranks' data as one FSDP group: group g, local l of fl is local 2g + l here.
  const outcome fs = train<fsdp>({1, 1, 4}, 6, sgd);
  for (int r = 0; r < 4; ++r) CHECK(max_rel(fl.params[r], fs.params[0]) <= 1e-6);
  CHECK(bit_equal(fl.params[0], fl.params[3]));  // groups agree after every sync
}

TEST_CASE("outer_sgd with lr 1 equals average") {
  using avg = algorithm<shard::full_shard, federation::average, schedule::periodic,
                        defaults<schedule::periodic::config{.period = 3}>>;
  using outer = algorithm<shard::full_shard, federation::outer_optimizer<federation::outer_sgd>,
                          schedule::periodic, defaults<schedule::periodic::config{.period = 3}>>;
  const optim::adamw::config adam{.lr = 1e-2f};
  const auto a = train<avg, optim::adamw>({2, 1, 2}, 9, adam);
  const auto o = train<outer, optim::adamw>({2, 1, 2}, 9, adam);
  // anchor - mean(anchor - θ_g) equals mean θ_g up to float rounding.
  CHECK(max_rel(a.params[0], o.params[0]) <= 1e-5);
  CHECK_FALSE(bit_equal(a.params[0], train<avg, optim::adamw>({2, 1, 2}, 8, adam).params[0]));
}

namespace {
/// The hooks tiny_mlp needs, over plain full buffers: one rank, no sharding.
struct plain_model {
  flat_layout l;
  std::vector<std::vector<float>> p, g;
  explicit plain_model(const test::tiny_mlp& net) : l(net.units(), 1) {
    for (std::size_t u = 0; u < l.num_units(); ++u) {
      auto v = net.init_unit(l, u, 7);
      v.resize(l.unit(u).padded_numel, 0.0f);
      p.push_back(v);
      g.emplace_back(v.size());
    }
  }
  const flat_layout& layout() const { return l; }
  std::span<const float> acquire(std::size_t u, phase = phase::forward) { return p[u]; }
  void release(std::size_t) {}
  std::span<float> grad_buffer(std::size_t u) { return g[u]; }
  void grads_ready(std::size_t) {}
  bool takes_gradients(std::size_t) const { return true; }
};
}  // namespace

// DiLoCo written out: G workers, each H inner SGD steps from the anchor on its own data;
// Δ = mean over workers of (anchor - θ_i); Nesterov: m = μ m + Δ; anchor -= η (μ m + Δ);
// every worker restarts from the anchor. One rank per worker, so each inner gradient is
// computed exactly as the trainer does; the mean over 2 workers is (Δ0 + Δ1) / 2 as inproc's
// avg; SGD and Nesterov round as kernels/sgd.hpp and kernels/outer.hpp document (torch's
// fused multiply-adds). So the trainer must match the reference bit for bit.
TEST_CASE_TEMPLATE("diloco matches a plain reference implementation over 3 outer steps", Sp,
                   FEDSHARD_TEST_SPACES) {
  constexpr int H = 4, G = 2, outer_steps = 3, per_rank = 2;
  const optim::sgd::config sgd{.lr = 0.1f};
  const outcome d =
      train<diloco, optim::sgd, Sp>({G, 1, 1}, H * outer_steps, sgd, every<diloco>(H), per_rank);

  test::tiny_mlp net;
  test::mlp_model data;
  std::vector<plain_model> workers(G, plain_model(net));
  const std::size_t U = workers[0].l.num_units();
  std::vector<std::vector<float>> anchor, momentum;
  for (std::size_t u = 0; u < U; ++u) {
    anchor.push_back(workers[0].p[u]);
    momentum.emplace_back(workers[0].p[u].size(), 0.0f);
  }
  const float lr = 0.7f, mu = 0.9f;
  for (int o = 0; o < outer_steps; ++o) {
    for (int w = 0; w < G; ++w)
      for (int s = o * H; s < (o + 1) * H; ++s) {
        auto& wk = workers[static_cast<std::size_t>(w)];
        for (auto& gu : wk.g) std::fill(gu.begin(), gu.end(), 0.0f);
        const auto batch = data.batch(kData, s, w, G, 0, 1, per_rank);
        net.forward_backward(wk, std::span<const test::sample>(batch));
        for (std::size_t u = 0; u < U; ++u)
          for (std::size_t i = 0; i < wk.p[u].size(); ++i)
            wk.p[u][i] = std::fma(wk.g[u][i], -sgd.lr, wk.p[u][i]);  // torch: p.add_(g, -lr)
      }
    for (std::size_t u = 0; u < U; ++u)
      for (std::size_t i = 0; i < anchor[u].size(); ++i) {
        const float d0 = anchor[u][i] - workers[0].p[u][i];
        const float d1 = anchor[u][i] - workers[1].p[u][i];
        const float delta = (d0 + d1) / 2.0f;
        const float m_scaled = momentum[u][i] * mu;
        momentum[u][i] = m_scaled + delta;
        const float step = std::fma(momentum[u][i], mu, delta);
        anchor[u][i] = std::fma(step, -lr, anchor[u][i]);
        workers[0].p[u][i] = workers[1].p[u][i] = anchor[u][i];
      }
  }
  std::vector<float> expected;
  for (std::size_t u = 0; u < U; ++u)
    expected.insert(expected.end(), anchor[u].begin(),
                    anchor[u].begin() + static_cast<std::ptrdiff_t>(workers[0].l.unit(u).numel));
  CHECK(bit_equal(d.params[0], expected));
  CHECK(bit_equal(d.params[1], expected));
  CHECK(d.sync_steps[0][0] == std::vector<std::int64_t>{3, 7, 11});
}

TEST_CASE("weighted_average: equal weights equal average, unequal weights the hand-computed mean") {
  using every2 = defaults<schedule::periodic::config{.period = 2}>;
  using wavg =
      algorithm<shard::full_shard, federation::weighted_average, schedule::periodic, every2>;
  using avg = algorithm<shard::full_shard, federation::average, schedule::periodic, every2>;
  const optim::sgd::config sgd{.lr = 0.1f};
  SUBCASE("equal weights: bit-identical to average") {
    const auto w = train<wavg>({2, 1, 2}, 6, sgd);
    const auto a = train<avg>({2, 1, 2}, 6, sgd);
    for (int r = 0; r < 4; ++r) CHECK(bit_equal(w.params[r], a.params[r]));
  }
  SUBCASE("unequal weights: tokens 1 vs 3 per rank") {
    // lr = 0 keeps each group's parameters where setup put them; the sync after step 1 must
    // give (w0 θ0 + w1 θ1) / (w0 + w1) with w_g = tokens of group g over both steps.
    const optim::sgd::config frozen{.lr = 0.0f};
    std::vector<std::vector<float>> start(2);
    auto setup = [&](mlp_trainer<wavg, optim::sgd>& t, int g) {
      std::vector<float> b0(16);
      for (std::size_t i = 0; i < b0.size(); ++i) b0[i] = float(g + 1) * 0.25f + 0.01f * float(i);
      t.set_tensor("b0", b0);
    };
    const auto w = train<wavg>(
        {2, 1, 2}, 2, frozen, {}, 0, [](int g) { return g == 0 ? 1 : 3; }, setup);
    // b0 sits at elements [128, 144) of the concatenated parameters.
    for (int r = 0; r < 4; ++r)
      for (std::size_t i = 0; i < 16; ++i) {
        const double t0 = 0.25 + 0.01 * double(i), t1 = 0.5 + 0.01 * double(i);
        const double expected = (1.0 * t0 + 3.0 * t1) / 4.0;
        CHECK(std::abs(w.params[r][128 + i] - expected) <= 1e-6 * std::abs(expected));
      }
  }
}

TEST_CASE("fl_hsdp moves hsdp's intra-group bytes plus federation bytes once every K steps") {
  constexpr int K = 3, steps = 8;  // syncs after steps 2, 5 and the final step 7
  const optim::adamw::config adam{.lr = 1e-2f};
  const auto fl = train<fl_hsdp, optim::adamw>({2, 2, 2}, steps, adam, every<fl_hsdp>(K));
  const auto h = train<hsdp, optim::adamw>({1, 2, 2}, steps, adam);
  for (int r = 0; r < 8; ++r) {
    const auto& t = fl.traffic[r];
    for (axis a : {axis::shard, axis::replica, axis::group}) {
      const auto planned = traffic_counters::of(fl.step_plans[r], steps)[a];
      // intra-group: the hsdp step plan, every step (replica also carries the sync's gather)
      if (a != axis::replica) CHECK(t[a].wire_bytes == planned.wire_bytes);
      CHECK(planned.wire_bytes == traffic_counters::of(h.step_plans[r % 4], steps)[a].wire_bytes);
    }
    const auto syncs = traffic_counters::of(fl.sync_plans[r], 3);
    CHECK(t[axis::federation].wire_bytes == syncs[axis::federation].wire_bytes);
    CHECK(t[axis::federation].calls == 3);
    CHECK(t[axis::replica].wire_bytes ==
          traffic_counters::of(fl.step_plans[r], steps)[axis::replica].wire_bytes +
              syncs[axis::replica].wire_bytes);
    CHECK(fl.sync_steps[r][0] == std::vector<std::int64_t>{2, 5, 7});
    // By hand, per rank: mlp_model's units of 144, 272 and 68 f32 over S = 2 shards are padded
    // to 160, 288 and 96 (shards of 80, 144 and 48: multiples of 16), 544 f32 = 2176 B.
    //  - shard, per step: 2 all_gathers and a reduce_scatter of every unit over 2 ranks,
    //    (2 - 1) / 2 x 3 x 2176 = 3264 B in 9 calls;
    //  - replica, per step: the 3 gradient shards (272 f32 = 1088 B) all-reduced over 2,
    //    2 (2 - 1) / 2 x 1088 = 1088 B; per sync: the fragment (272 f32, padded to 288 =
    //    1152 B) all-gathered over 2 replicas, (2 - 1) / 2 x 1152 = 576 B;
    //  - federation, per sync: the rank's half (576 B) all-reduced over 2 groups, 576 B.
    // 8 steps and 3 syncs.
    CHECK(t[axis::shard].calls == 8 * 9);
    CHECK(t[axis::shard].wire_bytes == 8 * 3264.0);
    CHECK(t[axis::replica].calls == 8 * 3 + 3);
    CHECK(t[axis::replica].wire_bytes == 8 * 1088.0 + 3 * 576.0);
    CHECK(t[axis::federation].wire_bytes == 3 * 576.0);
    CHECK(t[axis::group].calls == 0);
    CHECK(t[axis::world].calls == 0);
  }
}

TEST_CASE(
    "hierarchical federation sync: same result as the reference, R times fewer inter-group bytes") {
  constexpr int R = 2;
  const optim::sgd::config sgd{.lr = 0.1f};
  auto hier = every<fl_hsdp>(2), ref = every<fl_hsdp>(2);
  hier.federation.sync = federation::sync_mode::hierarchical;
  ref.federation.sync = federation::sync_mode::reference;
  const auto h = train<fl_hsdp>({2, R, 2}, 4, sgd, hier);
  const auto f = train<fl_hsdp>({2, R, 2}, 4, sgd, ref);
  for (int r = 0; r < 8; ++r) CHECK(bit_equal(h.params[r], f.params[r]));
  // Rank 0 is replica 0 (it all-reduces the whole shard in reference mode); rank 2 is replica 1.
  const double hier_bytes = h.traffic[0][axis::federation].wire_bytes;
  const double ref_bytes = f.traffic[0][axis::federation].wire_bytes;
  CHECK(hier_bytes > 0);
  CHECK(ref_bytes == R * hier_bytes);
  CHECK(h.traffic[2][axis::federation].wire_bytes == hier_bytes);
  CHECK(f.traffic[2][axis::federation].wire_bytes == 0);
  // Executed traffic == the step plan every step + the sync plan at each of the 2 syncs.
  for (const auto* o : {&h, &f})
    for (int r = 0; r < 8; ++r) {
      auto expected = traffic_counters::of(o->step_plans[r], 4);
      for (int i = 0; i < 2; ++i)
        for (const auto& op : o->sync_plans[r].ops) expected.record(op);
      CHECK(o->traffic[r].same_traffic(expected));
    }
}

TEST_CASE("streaming syncs each fragment once per period at its offset") {
  // H = 6, P = 3 fragments of one unit each: offsets floor(6 (p+1) / 3) % 6 = 2, 4, 0, so
  // fragment p applies after steps with (step + 1) % 6 == offset_p.
  for (int tau : {0, 1}) {
    trainer_options<streaming_diloco> o;
    o.schedule = {.period = 6, .fragments = 3, .delay = tau, .alpha = 0.5f};
    const auto s = train<streaming_diloco, optim::adamw>({2, 1, 2}, 18, {.lr = 1e-2f}, o);
    for (int r = 0; r < 4; ++r) {
      // ... and every fragment syncs at the final step (17), so the run ends synchronised.
      CHECK(s.sync_steps[r][0] == std::vector<std::int64_t>{1, 7, 13, 17});
      CHECK(s.sync_steps[r][1] == std::vector<std::int64_t>{3, 9, 15, 17});
      CHECK(s.sync_steps[r][2] == std::vector<std::int64_t>{5, 11, 17});
    }
    CHECK(mean(s.losses[0], 15, 18) < mean(s.losses[0], 0, 3));
  }
}

namespace {
/// Algorithms of one's own: ZeRO-2 groups averaged by tokens on a post-local schedule, and
/// FSDP groups under FedAdam that also average the inner moments (Photon).
using zero2_weighted =
    algorithm<shard::shard_grad_op, federation::weighted_average, schedule::post_local>;
using fsdp_photon = algorithm<shard::full_shard, federation::outer_optimizer<federation::fedadam>,
                              schedule::periodic>;
/// FL+FSDP whose cross-group average travels as fp8 (decoded and summed in f32).
using fp8_average =
    algorithm<shard::full_shard, federation::with_codec<federation::average, codec::cast<fp8_e4m3>>,
              schedule::periodic>;
}  // namespace

TEST_CASE_TEMPLATE(
    "every alias and custom algorithms train, and the wire carries their plans op by op", A, ddp,
    zero2, fsdp, hsdp, fl_fsdp, fl_hsdp, fl_hsdp_int8, diloco, streaming_diloco, sparseloco,
    zero2_weighted, fsdp_photon, fp8_average) {
  trainer_options<A> o;
  mesh_shape shape{2, 1, 2};
  if constexpr (std::is_same_v<A, streaming_diloco>) {
    o.schedule = {.period = 6, .fragments = 3, .delay = 1, .alpha = 0.5f};
    shape = {2, 2, 1};
  } else if constexpr (std::is_same_v<typename A::sync_schedule, schedule::periodic>) {
    o.schedule = {.period = 3};
  }
  if constexpr (std::is_same_v<A, zero2_weighted>) {
    o.schedule = {.switch_step = 4, .k = 5};
    o.federation.sync = federation::sync_mode::reference;
    shape = {2, 2, 2};
  }
  if constexpr (std::is_same_v<A, fsdp_photon>) {
    o.federation.average_inner_moments = true;
    o.federation.rule = {.lr = 0.01f};
  }
  // ddp/zero2/fsdp/hsdp run one group of 4 ranks; the federated ones 2 groups.
  if constexpr (std::is_same_v<A, ddp> || std::is_same_v<A, hsdp>) shape = {1, 2, 2};
  if constexpr (std::is_same_v<A, zero2> || std::is_same_v<A, fsdp>) shape = {1, 1, 4};
  if constexpr (std::is_same_v<A, fl_hsdp> || std::is_same_v<A, sparseloco>) shape = {2, 2, 1};
  const auto out = train<A, optim::adamw>(shape, 24, {.lr = 1e-2f}, o, 4);
  for (int r = 0; r < shape.size(); ++r) CHECK(out.eval_after[r] < 0.7f * out.eval_before[r]);
  // Every step put on the wire exactly the ops of the plans (see support/plan_checks.hpp).
  for (const auto& m : out.wire_mismatches) FAIL_CHECK(m);
  CHECK(out.wire_mismatches.empty());
  // The same run with the buffers in the stream-checking space, once with the host
  // communicator and once with the stream-ordered one (support/spaces.hpp): any missing wait
  // between streams would read stale or NaN values; the results are those of host_space,
  // bit for bit, and so is the wire.
  const auto checked = train<A, optim::adamw, test::on_checked>(shape, 24, {.lr = 1e-2f}, o, 4);
  const auto queued = train<A, optim::adamw, test::on_queued>(shape, 24, {.lr = 1e-2f}, o, 4);
  for (const auto* other : {&checked, &queued}) {
    CAPTURE(other == &checked ? test::on_checked::name : test::on_queued::name);
    for (const auto& m : other->wire_mismatches) FAIL_CHECK(m);
    for (int r = 0; r < shape.size(); ++r) {
      CHECK(bit_equal(other->params[r], out.params[r]));
      CHECK(bit_equal(other->losses[r], out.losses[r]));
      CHECK(other->traffic[r].same_traffic(out.traffic[r]));
    }
  }
  // ... and the totals agree with the plans' too.
  for (int r = 0; r < shape.size(); ++r)
    CHECK(out.traffic[r][axis::shard].wire_bytes ==
          traffic_counters::of(out.step_plans[r], 24)[axis::shard].wire_bytes);
}

TEST_CASE("Photon option: inner optimizer moments are averaged across groups at each sync") {
  using photon = algorithm<shard::full_shard, federation::outer_optimizer<federation::fedadam>,
                           schedule::periodic, defaults<schedule::periodic::config{.period = 2}>>;
  for (bool avg_moments : {false, true}) {
    trainer_options<photon> o;
    o.federation.average_inner_moments = avg_moments;
    o.federation.rule = {.lr = 0.5f};
    std::vector<std::vector<float>> exp_avg(4);
    std::mutex mu;
    test::spawn_ranks(4, [&](inproc::communicator& world) {
      mesh m(world, {2, 1, 2});
      mlp_trainer<photon, optim::adamw> t(m, mlp_model{}, {.lr = 1e-2f}, o);
      for (int s = 0; s < 4; ++s)
        t.step(t.model().batch(kData, s, m.coords().group, 2, m.coords().shard, 2, 2));
      std::lock_guard lock(mu);
      auto st = t.optimizer().state();
      exp_avg[static_cast<std::size_t>(world.rank())].assign(st[0].data.begin(), st[0].data.end());
    });
    // ranks 0 and 2 hold shard 0 in groups 0 and 1
    CHECK(bit_equal(exp_avg[0], exp_avg[2]) == avg_moments);
    CHECK(bit_equal(exp_avg[1], exp_avg[3]) == avg_moments);
  }
}

TEST_CASE("bad input is refused with clear errors on every rank") {
  auto errors_of = [](int ranks, auto&& body) {
    std::vector<std::string> errors(static_cast<std::size_t>(ranks));
    test::spawn_ranks(ranks, [&](inproc::communicator& world) {
      try {
        body(world);
      } catch (const fedshard::error& e) {
        errors[static_cast<std::size_t>(world.rank())] = e.what();
      }
    });
    return errors;
  };
  SUBCASE("post_local with K < 1") {
    using pl = algorithm<shard::full_shard, federation::average, schedule::post_local>;
    trainer_options<pl> o;
    o.schedule = {.switch_step = 2, .k = 0};
    for (const auto& e : errors_of(2, [&](inproc::communicator& w) {
           mesh m(w, {2, 1, 1});
           mlp_trainer<pl, optim::sgd> t(m, mlp_model{}, {}, o);
         }))
      CHECK(e.find("0") != std::string::npos);
  }
  SUBCASE("more fragments than units") {
    trainer_options<streaming_diloco> o;
    o.schedule = {.period = 8, .fragments = 4, .delay = 0, .alpha = 1.0f};
    for (const auto& e : errors_of(2, [&](inproc::communicator& w) {
           mesh m(w, {2, 1, 1});
           mlp_trainer<streaming_diloco, optim::sgd> t(m, mlp_model{}, {}, o);
         }))
      CHECK(e.find("4 fragments but the model has only 3 units") != std::string::npos);
  }
  SUBCASE("negative or all-zero weights") {
    using wavg = algorithm<shard::replicate, federation::weighted_average, schedule::periodic,
                           defaults<schedule::periodic::config{.period = 1}>>;
    struct counted : mlp_model {
      std::int64_t per_batch = 0;
      std::int64_t tokens(const std::vector<test::sample>&) const { return per_batch; }
    };
    for (std::int64_t group1_tokens : {0, -5}) {
      const auto errors = errors_of(4, [&](inproc::communicator& w) {
        mesh m(w, {2, 2, 1});
        counted model;
        model.per_batch = m.coords().group == 0 ? (group1_tokens == 0 ? 0 : 3) : group1_tokens;
        trainer<counted, wavg, optim::sgd, inproc::communicator> t(m, model, {});
        t.step(t.model().batch(kData, 0, m.coords().group, 2, m.coords().replica, 2, 1));
      });
      for (const auto& e : errors) {
        CAPTURE(e);
        CHECK(e.find("weights (tokens since the last sync) must be >= 0 and not all zero") !=
              std::string::npos);
        CHECK(e.find(group1_tokens == 0 ? "group 1: 0" : "group 1: -10") != std::string::npos);
      }
    }
  }
  SUBCASE("negative total_steps") {
    trainer_options<fsdp> o;
    o.total_steps = -1;
    for (const auto& e : errors_of(2, [&](inproc::communicator& w) {
           mesh m(w, {1, 1, 2});
           mlp_trainer<fsdp, optim::sgd> t(m, mlp_model{}, {}, o);
         }))
      CHECK(e.find("total_steps must be >= 0, found -1") != std::string::npos);
  }
}

// Every buffer the trainer, its engine, optimizer, interpreter and synchronizer use is made
// at construction or in the first step and kept: after the first step, steps (with syncs,
// a delayed sync in flight, mixed precision casts), evaluation and reading parameters ask the
// space's allocator for nothing that it has to get from the system.
TEST_CASE_TEMPLATE("after the first step no allocation reaches the space's system allocator", Sp,
                   FEDSHARD_TEST_SPACES) {
  auto run = [](auto tag, mesh_shape shape, auto opts, shard::precision prec) {
    using A = typename decltype(tag)::type;
    opts.precision = prec;
    opts.total_steps = 12;
    test::spawn_ranks(shape.size(), [&](inproc::communicator& world) {
      auto comm = Sp::wrap(world);
      mesh m(comm, shape);
      mlp_trainer<A, optim::adamw, Sp> t(m, mlp_model{}, {.lr = 1e-2f}, opts);
      const int g = m.coords().group;
      const int local = m.coords().replica * shape.shards + m.coords().shard;
      const int gs = shape.replicas * shape.shards;
      t.step(t.model().batch(kData, 0, g, shape.groups, local, gs, 2));
      const std::int64_t after_first = t.space().system_allocations();
      CHECK(after_first > 0);
      for (int s = 1; s < 12; ++s) {
        t.step(t.model().batch(kData, s, g, shape.groups, local, gs, 2));
        if (s % 4 == 0) t.evaluate(t.model().batch(kData + 1, 0, 0, 1, 0, 1, 8));
      }
      CHECK(t.syncs_applied() > 0);
      CHECK(t.space().system_allocations() == after_first);
    });
  };
  trainer_options<fl_hsdp> fl;
  fl.schedule = {.period = 1};
  run(std::type_identity<fl_hsdp>{}, {2, 2, 2}, fl, {});
  run(std::type_identity<fl_hsdp>{}, {2, 2, 2}, fl, {dtype::bf16, dtype::bf16});
  trainer_options<diloco> d;
  d.schedule = {.period = 1};
  run(std::type_identity<diloco>{}, {2, 1, 2}, d, {});
  trainer_options<streaming_diloco> st;
  st.schedule = {.period = 6, .fragments = 3, .delay = 1, .alpha = 0.5f};
  run(std::type_identity<streaming_diloco>{}, {2, 1, 2}, st, {});
}

namespace {
/// SparseLoCo's outer step with a topk (settings in the run's options), and DiLoCo's outer
/// SGD step with lr 1 and no momentum.
using sparse_sgd = algorithm<
    shard::hybrid_shard,
    federation::with_codec<federation::outer_optimizer<federation::outer_sgd>, codec::topk>,
    schedule::periodic>;
/// Its options: a sync every 3 steps, topk with settings c.
trainer_options<sparse_sgd> sparse_every_3(codec::topk::config c) {
  trainer_options<sparse_sgd> o = every<sparse_sgd>(3);
  o.federation.codec = c;
  return o;
}
using plain_sgd = algorithm<shard::hybrid_shard, federation::outer_optimizer<federation::outer_sgd>,
                            schedule::periodic>;
}  // namespace

TEST_CASE(
    "topk with K = Chunk, unquantised: sparseloco's outer step is DiLoCo's (lr 1, no "
    "momentum)") {
  const auto sparse = train<sparse_sgd, optim::adamw>(
      {2, 2, 1}, 9, {.lr = 1e-2f},
      sparse_every_3({.chunk = 32, .k = 32, .bits = codec::topk_unquantised}));
  const auto plain =
      train<plain_sgd, optim::adamw>({2, 2, 1}, 9, {.lr = 1e-2f}, every<plain_sgd>(3));
  for (int r = 0; r < 4; ++r) {
    REQUIRE(sparse.params[r].size() == plain.params[r].size());
    for (std::size_t i = 0; i < plain.params[r].size(); ++i)
      CHECK(sparse.params[r][i] == doctest::Approx(plain.params[r][i]).epsilon(1e-6));
  }
  // A real top-k (4 of every 32, 2-bit values) differs, but still trains and syncs the groups.
  const auto lossy = train<sparse_sgd, optim::adamw>(
      {2, 2, 1}, 9, {.lr = 1e-2f}, sparse_every_3({.chunk = 32, .k = 4, .bits = 2}));
  CHECK_FALSE(bit_equal(lossy.params[0], plain.params[0]));
  CHECK(bit_equal(lossy.params[0], lossy.params[3]));  // the run ends with a sync
  for (const auto& m : lossy.wire_mismatches) FAIL_CHECK(m);
}

TEST_CASE("fl_hsdp_int8 with blocks of 32 (trainer_options::shard.codec) runs its own plan") {
  auto o = every<fl_hsdp_int8>(3);
  o.shard.codec.block = 32;
  const auto out = train<fl_hsdp_int8, optim::adamw>({2, 1, 2}, 6, {.lr = 1e-2f}, o);
  for (const auto& m : out.wire_mismatches) FAIL_CHECK(m);
  int gathers = 0;
  for (const auto& op : out.step_plans[0].ops)
    if (encoded(op)) {
      ++gathers;
      CHECK(op.codec == codec::spec_of<codec::int8_block>({.block = 32}));
      // one f32 scale per 32 values of the rank's piece, then a byte per value
      const auto n = static_cast<std::size_t>(codec_elements(op));
      CHECK(op.codec.encoded_bytes(n) == (n + 31) / 32 * 4 + n);
    }
  CHECK(gathers > 0);
}

TEST_CASE("fl_hsdp_int8: the gathers move about 4x fewer bytes and training still converges") {
  const auto f32 = train<fl_hsdp, optim::adamw>({2, 1, 2}, 24, {.lr = 1e-2f}, every<fl_hsdp>(3), 4);
  const auto int8 =
      train<fl_hsdp_int8, optim::adamw>({2, 1, 2}, 24, {.lr = 1e-2f}, every<fl_hsdp_int8>(3), 4);
  for (const auto& m : int8.wire_mismatches) FAIL_CHECK(m);
  double gather_f32 = 0, gather_int8 = 0;
  for (const auto& op : f32.step_plans[0].ops)
    if (op.kind == comm_kind::all_gather) gather_f32 += wire_bytes(op);
  for (const auto& op : int8.step_plans[0].ops)
    if (op.kind == comm_kind::all_gather) gather_int8 += wire_bytes(op);
  // int8 + one f32 scale per 256 values (a short block per small unit shard here).
  CHECK(gather_f32 / gather_int8 > 3.5);
  CHECK(gather_f32 / gather_int8 < 4.0);
  for (int r = 0; r < 4; ++r) {
    CHECK(int8.eval_after[r] < 0.7f * int8.eval_before[r]);
    CHECK(int8.eval_after[r] == doctest::Approx(f32.eval_after[r]).epsilon(0.05));
  }
}
