// outer_optimizer<Rule>: anchors per fragment, pseudo-gradients in begin, the rule's step in
// end, named state for checkpoints, and checks on fragment indices and sizes; any shard
// optimizer as the outer one (as_outer<O>), and DiLoCo's Nesterov step by hand.
#include "fedshard/federation/outer_optimizer.hpp"

#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/error.hpp"
#include "fedshard/federation/outer_rules.hpp"
#include "fedshard/federation/sync.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/optim/optimizer.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/plan/interpreter.hpp"
#include "fedshard/schedule/periodic.hpp"
#include "fedshard/shard/flat_layout.hpp"
#include "support/op_lists.hpp"
#include "support/spawn_ranks.hpp"

using namespace fedshard;
using namespace fedshard::federation;

namespace {

std::vector<float> to_vec(std::span<const float> s) {
  return {s.begin(), s.end()};
}

std::vector<std::uint32_t> bits(std::span<const float> s) {
  std::vector<std::uint32_t> out;
  for (const float x : s) out.push_back(std::bit_cast<std::uint32_t>(x));
  return out;
}

/// A shard optimizer written here, host only (no in_space, no stream): sign descent with
/// heavy-ball momentum, buf <- buf / 2 + g; θ <- θ - lr * sign(buf).
class sign_momentum {
 public:
  struct config {
    float lr = 0.25f;
  };
  sign_momentum(config c, std::size_t n) : buf_(n, 0.0f) {
    FEDSHARD_EXPECTS(c.lr >= 0.0f, "sign_momentum: config.lr must be >= 0, found ", c.lr);
  }
  void step(std::span<float> param, std::span<const float> grad, float lr) {
    FEDSHARD_EXPECTS(param.size() == buf_.size() && grad.size() == buf_.size(),
                     "sign_momentum::step: sizes");
    for (std::size_t i = 0; i < buf_.size(); ++i) {
      buf_[i] = buf_[i] * 0.5f + grad[i];
      param[i] -= buf_[i] > 0.0f ? lr : (buf_[i] < 0.0f ? -lr : 0.0f);
    }
    ++steps_;
  }
  std::vector<optim::state_tensor> state() { return {{"buf", std::span<float>(buf_)}}; }
  std::int64_t step_count() const { return steps_; }
  void set_step_count(std::int64_t s) { steps_ = s; }
  std::size_t size() const { return buf_.size(); }

 private:
  std::vector<float> buf_;
  std::int64_t steps_ = 0;
};
static_assert(optim::ShardOptimizer<sign_momentum>);
static_assert(OuterRule<as_outer<sign_momentum>>);
static_assert(OuterRule<as_outer<optim::adamw>>);

}  // namespace

TEST_CASE("outer_optimizer: names, flags and default config") {
  CHECK(FederationPolicy<outer_optimizer<outer_sgd>>);
  CHECK(outer_optimizer<outer_sgd>::name == "outer_sgd");
  CHECK(outer_optimizer<nesterov>::name == "nesterov");
  CHECK(outer_optimizer<fedadam>::name == "fedadam");
  CHECK(outer_optimizer<nesterov>::syncs);
  const outer_optimizer<nesterov>::config c{};
  CHECK(c.sync == sync_mode::hierarchical);
  CHECK_FALSE(c.average_inner_moments);
  CHECK(c.rule.lr == 0.7f);  // the rule's own defaults (DiLoCo)
  CHECK(c.rule.momentum == 0.9f);
}

TEST_CASE("anchors start at zero; reset sets them; begin gives anchor - θ") {
  outer_optimizer<outer_sgd> o({}, {3, 2});
  CHECK(to_vec(o.anchor(0)) == std::vector<float>{0, 0, 0});
  CHECK(to_vec(o.anchor(1)) == std::vector<float>{0, 0});
  const std::vector<float> p0{1.0f, 2.0f, 3.0f}, p1{-1.0f, 0.5f};
  o.reset(0, p0);
  o.reset(1, p1);
  CHECK(to_vec(o.anchor(0)) == p0);
  CHECK(to_vec(o.anchor(1)) == p1);
  std::vector<float> buf{0.5f, 2.5f, 3.0f};
  o.begin(0, buf, {});
  CHECK(buf == std::vector<float>{0.5f, -0.5f, 0.0f});
  CHECK(to_vec(o.anchor(0)) == p0);  // begin does not move the anchor
  CHECK(to_vec(o.anchor(1)) == p1);  // nor another fragment's
}

TEST_CASE("outer_sgd: end moves the anchor by -lr * mean Δ and returns it") {
  SUBCASE("lr 1 is plain averaging") {
    outer_optimizer<outer_sgd> o({}, {2});
    o.reset(0, std::vector<float>{1.0f, 1.0f});
    // two groups trained to θ0 and θ1; Δ_g = anchor - θ_g; the all_reduce averages them
    std::vector<float> d0{3.0f, -1.0f}, d1{5.0f, 2.0f};
    o.begin(0, d0, {});
    o.begin(0, d1, {});
    std::vector<float> mean{(d0[0] + d1[0]) / 2, (d0[1] + d1[1]) / 2};
    o.end(0, mean, {});
    CHECK(mean == std::vector<float>{4.0f, 0.5f});  // (3 + 5) / 2, (-1 + 2) / 2
    CHECK(to_vec(o.anchor(0)) == mean);
    CHECK(o.outer_steps(0) == 1);
  }
  SUBCASE("lr 0.5") {
    outer_optimizer<outer_sgd>::config c;
    c.rule.lr = 0.5f;
    outer_optimizer<outer_sgd> o(c, {2});
    o.reset(0, std::vector<float>{1.0f, 2.0f});
    std::vector<float> d{2.0f, -4.0f};
    o.end(0, d, {});
    CHECK(d == std::vector<float>{0.0f, 4.0f});
    CHECK(to_vec(o.anchor(0)) == d);
  }
}

TEST_CASE("nesterov: end applies m = μ m + d; θ -= η (μ m + d) with state per fragment") {
  outer_optimizer<nesterov>::config c;
  c.rule = {.lr = 0.5f, .momentum = 0.5f};
  outer_optimizer<nesterov> o(c, {2, 1});
  o.reset(0, std::vector<float>{10.0f, 0.0f});
  o.reset(1, std::vector<float>{7.0f});
  std::vector<float> d{4.0f, -8.0f};
  o.end(0, d, {});
  // m = d = (4, -8); θ -= 0.5 (0.5 m + d) = 0.75 d
  CHECK(d == std::vector<float>{7.0f, 6.0f});
  auto s = o.state();
  REQUIRE(s.size() == 4);
  CHECK(to_vec(s[1].data) == std::vector<float>{4.0f, -8.0f});
  std::vector<float> d2{2.0f, 0.0f};
  o.end(0, d2, {});
  // m = 0.5 (4, -8) + (2, 0) = (4, -4); θ -= 0.5 (0.5 m + d2) = 0.5 (4, -2) = (2, -1)
  CHECK(d2 == std::vector<float>{5.0f, 7.0f});
  CHECK(to_vec(o.state()[1].data) == std::vector<float>{4.0f, -4.0f});
  CHECK(o.outer_steps(0) == 2);
  CHECK(o.outer_steps(1) == 0);
  CHECK(to_vec(o.anchor(1)) == std::vector<float>{7.0f});  // fragment 1 untouched
  CHECK(to_vec(o.state()[3].data) == std::vector<float>{0.0f});
}

TEST_CASE("state() names anchors and rule state with their fragment and aliases the live buffers") {
  outer_optimizer<nesterov> o({}, {3, 5});
  auto s = o.state();
  REQUIRE(s.size() == 4);
  CHECK((s[0].name == "anchor" && s[0].fragment == 0));
  CHECK((s[1].name == "momentum" && s[1].fragment == 0));
  CHECK((s[2].name == "anchor" && s[2].fragment == 1));
  CHECK((s[3].name == "momentum" && s[3].fragment == 1));
  // An anchor a checkpoint lacks starts from the parameters, the rule's state from zero.
  CHECK(s[0].missing == state_start::parameters);
  CHECK(s[1].missing == state_start::zero);
  CHECK(s[0].data.size() == 3);
  CHECK(s[1].data.size() == 3);
  CHECK(s[2].data.size() == 5);
  CHECK(s[3].data.size() == 5);
  s[2].data[4] = 42.0f;  // a checkpoint restore writes through state()
  CHECK(o.anchor(1)[4] == 42.0f);

  outer_optimizer<outer_sgd> sgd({}, {2, 2, 2});
  auto t = sgd.state();
  REQUIRE(t.size() == 3);  // anchors only
  CHECK((t[2].name == "anchor" && t[2].fragment == 2));

  outer_optimizer<fedadam> adam({}, {4});
  auto a = adam.state();
  REQUIRE(a.size() == 3);
  CHECK((a[0].name == "anchor" && a[0].fragment == 0));
  CHECK((a[1].name == "m" && a[1].fragment == 0));
  CHECK((a[2].name == "v" && a[2].fragment == 0));

  CHECK(outer_optimizer<nesterov>{}.state().empty());
}

TEST_CASE("the sync plan averages inner moments when the config says so; outer steps restore") {
  outer_optimizer<fedadam>::config c;
  const federation::sync_context ctx{.shape = {2, 2, 1},
                                     .coords = {1, 0, 0},
                                     .fragment = 1,
                                     .numel = 64,
                                     .inner_state_buffers = 2};
  // G = 2 groups of R = 2 replicas; fragment 1 of 64 f32 = 256 B, hierarchical: each buffer
  // (the mean pseudo-gradient, then with average_inner_moments AdamW's 2 moments) is averaged
  // as its replica's half (32 f32 = 128 B: each rank sends 2 (2 - 1) / 2 x 128 = 128 B over
  // the groups), then all-gathered over the replicas (256 B: (2 - 1) / 2 x 256 = 128 B each).
  auto average_of = [](operand whole, trigger start, trigger finish) {
    operand half = whole;
    half.piece = axis::replica;
    return std::vector<comm_op>{{.kind = comm_kind::all_reduce,
                                 .axis = axis::federation,
                                 .dtype = dtype::f32,
                                 .bytes = 128,
                                 .ranks = 2,
                                 .reduce = reduce_op::avg,
                                 .trigger = start,
                                 .phase = phase::sync,
                                 .fragment = 1,
                                 .in = half,
                                 .out = half,
                                 .overlappable = false},
                                {.kind = comm_kind::all_gather,
                                 .axis = axis::replica,
                                 .dtype = dtype::f32,
                                 .bytes = 256,
                                 .ranks = 2,
                                 .trigger = finish,
                                 .phase = phase::sync,
                                 .fragment = 1,
                                 .in = half,
                                 .out = whole,
                                 .overlappable = false}};
  };
  std::vector<comm_op> want =
      average_of({.role = role::fragment}, trigger::sync_exchange, trigger::sync_finish);
  const plan params_only = outer_optimizer<fedadam>(c, {}).sync_plan(ctx);
  CHECK(test::compare_ops(params_only.ops, want) == "");
  CHECK(params_only.wire_bytes_on(axis::federation) == 128.0);
  CHECK(params_only.wire_bytes_on(axis::replica) == 128.0);

  c.average_inner_moments = true;
  outer_optimizer<fedadam> o(c, {4});
  // the moments move after the parameters are applied: both halves of each at sync_after
  for (int k : {0, 1})
    for (const comm_op& op :
         average_of({.role = role::moment, .index = k}, trigger::sync_after, trigger::sync_after))
      want.push_back(op);
  REQUIRE(want.size() == 6);  // parameters + 2 moments, each all_reduce + all_gather
  const plan with_moments = o.sync_plan(ctx);
  CHECK(test::compare_ops(with_moments.ops, want) == "");
  CHECK(with_moments.wire_bytes_on(axis::federation) == 3 * 128.0);
  CHECK(with_moments.wire_bytes_on(axis::replica) == 3 * 128.0);
  o.set_outer_steps(0, 12);
  CHECK(o.outer_steps(0) == 12);
  CHECK_THROWS_AS(o.set_outer_steps(0, -1), invalid_argument);
}

TEST_CASE("a rule config the rule refuses is refused at construction") {
  outer_optimizer<nesterov>::config c;
  c.rule.lr = -1.0f;
  CHECK_THROWS_WITH_AS(outer_optimizer<nesterov>(c, {4}), doctest::Contains("lr"),
                       invalid_argument);
}

TEST_CASE("fragment indices out of range and size mismatches throw before anything changes") {
  outer_optimizer<nesterov> o({}, {4, 2});
  o.reset(0, std::vector<float>{1, 2, 3, 4});
  std::vector<float> four{1, 1, 1, 1}, three{1, 1, 1};
  for (int f : {2, -1, 100}) {
    CAPTURE(f);
    const std::string found = "found " + std::to_string(f);
    CHECK_THROWS_WITH_AS(o.begin(f, four, {}), doctest::Contains(found.c_str()), invalid_argument);
    CHECK_THROWS_WITH_AS(o.end(f, four, {}), doctest::Contains("fragment must be in [0, 2)"),
                         invalid_argument);
    CHECK_THROWS_AS(o.reset(f, four), invalid_argument);
    CHECK_THROWS_AS(o.anchor(f), invalid_argument);
  }
  CHECK_THROWS_WITH_AS(o.begin(0, three, {}),
                       doctest::Contains("fragment 0 has 4 elements, buffer has 3"),
                       invalid_argument);
  CHECK(three == std::vector<float>{1, 1, 1});
  CHECK_THROWS_WITH_AS(o.end(1, four, {}),
                       doctest::Contains("fragment 1 has 2 elements, buffer has 4"),
                       invalid_argument);
  CHECK(four == std::vector<float>{1, 1, 1, 1});
  CHECK(o.outer_steps(1) == 0);
  CHECK_THROWS_AS(o.reset(0, three), invalid_argument);
  CHECK(to_vec(o.anchor(0)) == std::vector<float>{1, 2, 3, 4});
}

TEST_CASE("outer_steps and set_outer_steps of a fragment out of range are invalid_argument") {
  // the library throws fedshard::error subclasses, not std::out_of_range
  outer_optimizer<nesterov> o({}, {4});
  CHECK_THROWS_WITH_AS(o.outer_steps(1), doctest::Contains("fragment must be in [0, 1), found 1"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(o.set_outer_steps(-1, 0),
                       doctest::Contains("fragment must be in [0, 1), found -1"), invalid_argument);
}

TEST_CASE("as_outer: a shard optimizer written by the user is the outer one of 2 groups") {
  // 2 groups of 1 rank, one tensor of 2 elements, a sync after every step; sign_momentum
  // with lr 0.25 steps the anchor on the mean pseudo-gradient d. All values are dyadic, so
  // every sum is exact.
  //   start   anchor (1, -2)
  //   round 1 groups at (0, -1) and (0.5, -2.5): Δ = (1, -1) and (0.5, 0.5), d = (0.75, -0.25)
  //           buf = (0.75, -0.25); anchor = (1 - 0.25, -2 + 0.25) = (0.75, -1.75)
  //   round 2 groups at (1.25, -1.75) and (0.75, -1.25): Δ = (-0.5, 0) and (0, -0.5),
  //           d = (-0.25, -0.25); buf = (0.375 - 0.25, -0.125 - 0.25) = (0.125, -0.375):
  //           element 0 still moves down (the momentum outweighs d); anchor = (0.5, -1.5)
  const mesh_shape shape{2, 1, 1};
  test::spawn_ranks(shape.size(), [&](inproc::communicator& world) {
    mesh m(world, shape);
    interpreter<inproc::communicator> in(m);
    const std::vector<unit_spec> units{{"u", {{"w", {2}}}}};
    const flat_layout l(units, 1);
    // A rank's shard is padded to 16 floats; the padding stays 0 (d = 0, sign 0).
    REQUIRE(l.total_shard_numel() == 16);
    using policy = outer_optimizer<as_outer<sign_momentum>>;
    synchronizer<policy, schedule::periodic> s({.rule = {.lr = 0.25f}}, {.period = 1}, l, shape,
                                               m.coords(), 0);
    const int g = m.coords().group;
    auto model = [](float a, float b) {
      std::vector<float> v(16, 0.0f);
      v[0] = a;
      v[1] = b;
      return v;
    };
    std::vector<float> master = model(1.0f, -2.0f);
    s.reset(master);
    master = g == 0 ? model(0.0f, -1.0f) : model(0.5f, -2.5f);
    s.after_step(in, 0, 0, master, {});
    CHECK(master == model(0.75f, -1.75f));
    master = g == 0 ? model(1.25f, -1.75f) : model(0.75f, -1.25f);
    s.after_step(in, 1, 0, master, {});
    CHECK(master == model(0.5f, -1.5f));
    CHECK(s.policy().outer_steps(0) == 2);
    const auto state = s.policy().state();
    REQUIRE(state.size() == 2);  // the anchor, then the optimizer's own state
    CHECK((state[1].name == "buf" && state[1].fragment == 0));
    CHECK(to_vec(state[1].data) == model(0.125f, -0.375f));
    in.wait_all();
  });
}

TEST_CASE("as_outer: AdamW as the outer optimizer of 2 groups moves the anchor by lr sign(d)") {
  // AdamW lr 0.1, weight decay 0.01 (its default), β1 0.9, β2 0.999, on d: with the same d
  // every round the bias-corrected moments are m̂ = d and v̂ = d², so each step is
  // θ <- θ (1 - 0.1 · 0.01) - 0.1 d / (|d| + 1e-8), i.e. θ · 0.999 - 0.1 sign(d) to 1e-7.
  //   anchor (1, 2); groups at (0, 3) and (1, 2.5): Δ = (1, -1) and (0, -0.5), d = (0.5, -0.75)
  //   round 1: (0.999 - 0.1, 1.998 + 0.1) = (0.899, 2.098)
  //   round 2 (same Δ): (0.899 · 0.999 - 0.1, 2.098 · 0.999 + 0.1) = (0.798101, 2.195902)
  //   exp_avg after 2 rounds: (0.1 · 0.9 + 0.1) d = 0.19 d = (0.095, -0.1425)
  outer_optimizer<as_outer<optim::adamw>>::config c;
  c.rule.lr = 0.1f;
  outer_optimizer<as_outer<optim::adamw>> o(c, {2});
  CHECK(o.name == "as_outer");
  o.reset(0, std::vector<float>{1.0f, 2.0f});
  const std::vector<std::vector<float>> deltas{{1.0f, -1.0f}, {0.0f, -0.5f}};
  for (int round = 0; round < 2; ++round) {
    std::vector<float> g0(2), g1(2);  // the groups' models: anchor - Δ_g
    for (std::size_t i = 0; i < 2; ++i) {
      g0[i] = o.anchor(0)[i] - deltas[0][i];
      g1[i] = o.anchor(0)[i] - deltas[1][i];
    }
    o.begin(0, g0, {});
    o.begin(0, g1, {});
    std::vector<float> mean{(g0[0] + g1[0]) / 2, (g0[1] + g1[1]) / 2};
    o.end(0, mean, {});
  }
  CHECK(std::fabs(o.anchor(0)[0] - 0.798101f) <= 1e-6f);
  CHECK(std::fabs(o.anchor(0)[1] - 2.195902f) <= 1e-6f);
  CHECK(o.outer_steps(0) == 2);
  const auto s = o.state();
  REQUIRE(s.size() == 3);
  CHECK((s[1].name == "exp_avg" && s[2].name == "exp_avg_sq"));
  CHECK(std::fabs(s[1].data[0] - 0.095f) <= 1e-6f);
  CHECK(std::fabs(s[1].data[1] + 0.1425f) <= 1e-6f);
  CHECK_THROWS_WITH_AS(as_outer<optim::adamw>({.lr = INFINITY}, 2),
                       doctest::Contains("as_outer: config.lr must be a finite number >= 0"),
                       invalid_argument);
}

TEST_CASE("nesterov runs optim::sgd on d: DiLoCo's update for 2 elements, by hand") {
  // DiLoCo's lr 0.7 and momentum 0.9; m starts at 0: m <- 0.9 m + d; θ <- θ - 0.7 (0.9 m + d)
  //   anchor (1, -1)
  //   d1 = (0.5, 0):    m = (0.5, 0);   0.9 m + d = (0.95, 0);    θ = (1 - 0.665, -1)
  //                                                                 = (0.335, -1)
  //   d2 = (0.25, 0.5): m = (0.7, 0.5); 0.9 m + d = (0.88, 0.95); θ = (0.335 - 0.616,
  //                                                                    -1 - 0.665)
  //                                                                 = (-0.281, -1.665)
  // optim::sgd with the same lr, momentum and Nesterov, its buffer from zero, as the outer
  // optimizer gives the same bits.
  outer_optimizer<nesterov> diloco({}, {2});
  outer_optimizer<as_outer<optim::sgd>>::config c;
  c.rule = {.lr = 0.7f, .momentum = 0.9f, .nesterov = true, .start = optim::momentum_start::zero};
  outer_optimizer<as_outer<optim::sgd>> sgd(c, {2});
  diloco.reset(0, std::vector<float>{1.0f, -1.0f});
  sgd.reset(0, std::vector<float>{1.0f, -1.0f});
  const std::vector<std::vector<float>> ds{{0.5f, 0.0f}, {0.25f, 0.5f}};
  const std::vector<std::vector<double>> want{{0.335, -1.0}, {-0.281, -1.665}};
  for (std::size_t k = 0; k < 2; ++k) {
    CAPTURE(k);
    std::vector<float> a = ds[k], b = ds[k];
    diloco.end(0, a, {});
    sgd.end(0, b, {});
    for (std::size_t i = 0; i < 2; ++i)
      CHECK(std::fabs(static_cast<double>(a[i]) - want[k][i]) <= 1e-6);
    CHECK(bits(a) == bits(b));
  }
  CHECK(diloco.state()[1].name == "momentum");
  CHECK(sgd.state()[1].name == "momentum_buffer");
  CHECK(std::fabs(diloco.state()[1].data[0] - 0.7f) <= 1e-6f);
  CHECK(diloco.state()[1].data[1] == 0.5f);
  CHECK(bits(diloco.state()[1].data) == bits(sgd.state()[1].data));
  CHECK(diloco.outer_steps(0) == 2);
}
