// median and trimmed_mean: one all_gather of the whole fragment per replica; end() writes the
// coordinate-wise median / trimmed mean over the included groups, bit for bit as computed by
// hand; poisoned groups (1e30, NaN) cannot move a median; G = 2 gives average's bits.
#include "fedshard/federation/robust_mean.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/federation/average.hpp"
#include "fedshard/federation/sync.hpp"
#include "fedshard/federation/sync_plan.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/plan/interpreter.hpp"
#include "fedshard/schedule/periodic.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/plan_checks.hpp"
#include "support/spaces.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;
using federation::median;
using federation::sync_info;
using federation::trimmed_mean;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

bool same_bits(float a, float b) {
  return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b);
}
bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

/// By hand: the middle value of n finite values, or the float mean of the two middle ones.
float hand_median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  const std::size_t h = v.size() / 2;
  return v.size() % 2 == 1 ? v[h] : (v[h - 1] + v[h]) / 2.0f;
}
/// By hand: finite values sorted, k = floor(n Num / Den) dropped at each end, the rest summed
/// from the smallest up in float, divided by their count.
template <int Num, int Den>
float hand_trimmed(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  const std::size_t k = v.size() * Num / Den;
  float s = 0.0f;
  for (std::size_t i = k; i < v.size() - k; ++i) s += v[i];
  return s / float(v.size() - 2 * k);
}

/// end() of a policy for one fragment of `copies[g]` per group, called directly.
template <class F>
std::vector<float> combine(const std::vector<std::vector<float>>& copies,
                           std::span<const std::uint8_t> included = {},
                           typename F::config cfg = {}) {
  const std::size_t n = copies.at(0).size();
  F p(cfg, {n});
  const sync_info info{
      .fragment = 0, .groups = int(copies.size()), .group = 0, .included = included};
  std::vector<float> buf = copies[0];
  p.begin(0, buf, info);
  REQUIRE(p.gathered(0).size() == copies.size() * n);
  for (std::size_t g = 0; g < copies.size(); ++g)
    std::copy(copies[g].begin(), copies[g].end(), p.gathered(0).begin() + std::ptrdiff_t(g * n));
  p.end(0, buf, info);
  return buf;
}

std::vector<unit_spec> four_units() {
  return {{"a", {{"w", {10}}}}, {"b", {{"w", {20}}}}, {"c", {{"w", {30}}}}, {"d", {{"w", {5}}}}};
}

/// Group g's value of element j of shard s's master (distinct across groups, with ties
/// between groups 0 and 1 at every 7th element).
float value_of(int g, int s, std::size_t j) {
  if (g == 1 && j % 7 == 0) g = 0;
  return test::hash_uniform(std::uint64_t(131 * g + s), j) * 4.0f;
}

struct synced {
  mesh_coords coords;
  std::vector<float> master;
};

/// One sync (periodic, K = 1, α = 1) of F on a mesh of `shape` over inproc ranks whose
/// master holds value(g, s, j); checks that the wire carried the plan. Per world rank.
template <class F>
std::vector<synced> sync_once(const mesh_shape& shape,
                              const std::function<float(int, int, std::size_t)>& value,
                              typename F::config cfg = {}) {
  return test::collect_ranks(shape.size(), [&](inproc::communicator& world) {
    mesh m(world, shape);
    interpreter<inproc::communicator> in(m);
    const flat_layout l(four_units(), shape.shards);
    federation::synchronizer<F, schedule::periodic> sync(cfg, {.period = 1}, l, shape, m.coords(),
                                                         0);
    std::vector<float> master(l.total_shard_numel());
    for (std::size_t j = 0; j < master.size(); ++j)
      master[j] = value(m.coords().group, m.coords().shard, j);
    sync.reset(master);
    sync.after_step(in, 0, 0, master, {});
    CHECK(sync.syncs_applied() == 1);
    CHECK(in.traffic().same_traffic(traffic_counters::of(sync.sync_plan(0))));
    return synced{m.coords(), master};
  });
}

/// Checks every rank's master against rule(the G groups' values of the element), bit for bit.
void check_synced(const std::vector<synced>& out, int groups,
                  const std::function<float(int, int, std::size_t)>& value,
                  const std::function<float(std::vector<float>)>& rule) {
  for (const auto& r : out) {
    CAPTURE(r.coords.group);
    CAPTURE(r.coords.replica);
    CAPTURE(r.coords.shard);
    bool all = true;
    for (std::size_t j = 0; j < r.master.size(); ++j) {
      std::vector<float> v;
      for (int g = 0; g < groups; ++g) v.push_back(value(g, r.coords.shard, j));
      const float want = rule(v);
      if (!same_bits(r.master[j], want)) {
        CAPTURE(j);
        CHECK(r.master[j] == want);
        all = false;
        break;
      }
    }
    CHECK(all);
  }
}

}  // namespace

TEST_CASE("median and trimmed_mean model FederationPolicy and keep no checkpoint state") {
  CHECK(federation::FederationPolicy<median>);
  CHECK(federation::FederationPolicy<trimmed_mean>);
  CHECK(median::name == "median");
  CHECK(trimmed_mean::name == "trimmed_mean");
  CHECK(median::syncs);
  CHECK(trimmed_mean::syncs);
  CHECK(trimmed_mean::config{}.trim == federation::trim_fraction{1, 4});
  median m({}, {32, 16});
  CHECK(m.state().empty());
  CHECK(m.gathered(0).empty());  // sized at the first begin(), when G is known
  CHECK(std::is_same_v<
        federation::in_space_t<median, test::held_space>,
        federation::basic_robust_mean<federation::detail::median_rule, test::held_space>>);
}

TEST_CASE("the plan is one all_gather of the whole fragment per replica, in either sync mode") {
  for (auto mode : {federation::sync_mode::hierarchical, federation::sync_mode::reference}) {
    for (int replica = 0; replica < 2; ++replica) {
      const federation::sync_context ctx{
          .shape = {3, 2, 2}, .coords = {1, replica, 1}, .fragment = 2, .numel = 64};
      const comm_op expected{.kind = comm_kind::all_gather,
                             .axis = axis::federation,
                             .dtype = dtype::f32,
                             .bytes = 3 * 64 * 4,
                             .ranks = 3,
                             .trigger = trigger::sync_exchange,
                             .phase = phase::sync,
                             .fragment = 2,
                             .in = {.role = role::fragment},
                             .out = {.role = role::gathered},
                             .overlappable = false};
      const median m({mode}, {});
      const trimmed_mean t({.sync = mode}, {});
      CHECK(m.sync_plan(ctx).ops == std::vector<comm_op>{expected});
      CHECK(t.sync_plan(ctx).ops == std::vector<comm_op>{expected});
      CHECK(federation::fragment_gather_ops(ctx).ops == std::vector<comm_op>{expected});
      // every replica sends (G - 1) x the fragment: R G / 2 times a hierarchical average's
      const plan avg = federation::parameter_average_ops(ctx, federation::sync_mode::hierarchical);
      CHECK(m.sync_plan(ctx).wire_bytes_on(axis::federation) == 2.0 * 64 * 4);
      CHECK(m.sync_plan(ctx).wire_bytes_on(axis::federation) ==
            doctest::Approx(avg.wire_bytes_on(axis::federation) * 2 * 3 / 2));
      CHECK(m.sync_plan(ctx).calls_on(axis::replica) == 0);
    }
  }
}

TEST_CASE("median: the middle value, the float mean of the two middle ones, NaN last") {
  CHECK(combine<median>({{3.0f}, {-1.0f}, {2.0f}}) == std::vector<float>{2.0f});
  CHECK(combine<median>({{3.0f}, {-1.0f}, {2.0f}, {10.0f}}) == std::vector<float>{2.5f});
  CHECK(combine<median>({{1.0f, 5.0f}, {4.0f, 5.0f}}) ==
        std::vector<float>{(1.0f + 4.0f) / 2.0f, 5.0f});
  // -0 sorts before +0: the middle of {+0, -0, -0} is -0, of {+0, +0, -0} is +0
  CHECK(same_bits(combine<median>({{0.0f}, {-0.0f}, {-0.0f}})[0], -0.0f));
  CHECK(same_bits(combine<median>({{0.0f}, {0.0f}, {-0.0f}})[0], 0.0f));
  // NaN sorts after +inf: ignored unless a middle value is NaN
  CHECK(combine<median>({{kNaN}, {1.0f}, {kInf}}) == std::vector<float>{kInf});
  CHECK(combine<median>({{kNaN}, {1.0f}, {2.0f}}) == std::vector<float>{2.0f});
  CHECK(combine<median>({{kNaN}, {1.0f}, {2.0f}, {4.0f}}) == std::vector<float>{3.0f});
  CHECK(std::isnan(combine<median>({{kNaN}, {1.0f}, {kNaN}})[0]));
  CHECK(std::isnan(combine<median>({{kNaN}, {1.0f}, {2.0f}, {kNaN}})[0]));
  CHECK(std::isnan(combine<median>({{-kInf}, {kInf}})[0]));                // (-inf + inf) / 2
  CHECK(combine<median>({{3e38f}, {3e38f}}) == std::vector<float>{kInf});  // (a + b) overflows
}

TEST_CASE("trimmed_mean: a fraction of 1/2 or more, or a bad denominator, is refused at run time") {
  using doctest::Contains;
  const auto refused = [](int num, int den) { return trimmed_mean({.trim = {num, den}}, {4}); };
  CHECK_THROWS_WITH_AS(refused(1, 2),
                       Contains("trimmed_mean: the fraction trimmed from each end, trim = num / "
                                "den, must be in [0, 1/2) with den > 0, found 1 / 2 (use "
                                "federation::median for the middle)"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(refused(3, 5), Contains("found 3 / 5"), invalid_argument);
  CHECK_THROWS_WITH_AS(refused(1, 0), Contains("found 1 / 0"), invalid_argument);
  CHECK_THROWS_WITH_AS(refused(-1, 4), Contains("found -1 / 4"), invalid_argument);
  CHECK_NOTHROW(refused(0, 1));
  CHECK_NOTHROW(refused(49, 100));
  // The synchronizer and a trainer build the policy from their settings: refused there too.
  CHECK_THROWS_WITH_AS((combine<trimmed_mean>({{1.0f}, {2.0f}}, {}, {.trim = {1, 2}})),
                       Contains("found 1 / 2"), invalid_argument);
}

TEST_CASE("trimmed_mean: the fraction set at run time, 1/3 of 7 groups, worked by hand") {
  // 7 values sorted: -100, 1, 2, 3, 4, 8, 1e6. trim 1/3: k = floor(7 / 3) = 2 from each end,
  // (2 + 3 + 4) / 3 = 3. trim 1/7: k = 1, (1 + 2 + 3 + 4 + 8) / 5 = 3.6f. trim 0/1: the
  // mean of all 7, summed from the smallest up in float.
  const std::vector<std::vector<float>> copies = {{8.0f}, {1e6f}, {3.0f}, {-100.0f},
                                                  {2.0f}, {4.0f}, {1.0f}};
  CHECK(combine<trimmed_mean>(copies, {}, {.trim = {1, 3}}) == std::vector<float>{3.0f});
  CHECK(combine<trimmed_mean>(copies, {}, {.trim = {1, 7}}) == std::vector<float>{18.0f / 5.0f});
  float all = -100.0f;
  for (float v : {1.0f, 2.0f, 3.0f, 4.0f, 8.0f, 1e6f}) all += v;
  CHECK(combine<trimmed_mean>(copies, {}, {.trim = {0, 1}}) == std::vector<float>{all / 7.0f});
  // The default, 1/4: k = floor(7 / 4) = 1, as 1/7.
  CHECK(combine<trimmed_mean>(copies) == std::vector<float>{18.0f / 5.0f});
}

TEST_CASE("trimmed_mean: floor(n Num / Den) dropped at each end, the rest summed ascending") {
  // n = 4, 1/4: k = 1
  CHECK(combine<trimmed_mean>({{100.0f}, {1.0f}, {2.0f}, {-50.0f}}) == std::vector<float>{1.5f});
  // n = 3, 1/4: k = 0, the plain mean
  CHECK(combine<trimmed_mean>({{1.0f}, {2.0f}, {6.0f}}) ==
        std::vector<float>{((0.0f + 1.0f) + 2.0f + 6.0f) / 3.0f});
  // n = 3, 1/3: k = 1, the median
  CHECK(combine<trimmed_mean>({{7.0f}, {-3.0f}, {0.5f}}, {}, {.trim = {1, 3}}) ==
        std::vector<float>{0.5f});
  // n = 5, 2/5: k = 2
  CHECK(combine<trimmed_mean>({{9.0f}, {8.0f}, {1.0f}, {2.0f}, {3.0f}}, {}, {.trim = {2, 5}}) ==
        std::vector<float>{3.0f});
  // ascending: -1e8 + 1 + 1 + 1e8 = 0 in float, where rank order (1e8 + 1 - 1e8 + 1) gives 1
  CHECK(combine<trimmed_mean>({{1e8f}, {1.0f}, {-1e8f}, {1.0f}}, {}, {.trim = {0, 1}}) ==
        std::vector<float>{0.0f});
  // NaN sorts last: trimmed when k covers it, else the mean is NaN
  CHECK(combine<trimmed_mean>({{kNaN}, {1.0f}, {2.0f}, {-9.0f}}) == std::vector<float>{1.5f});
  CHECK(std::isnan(combine<trimmed_mean>({{kNaN}, {1.0f}, {kNaN}, {-9.0f}})[0]));
}

TEST_CASE("the included mask: groups left out are ignored, whatever they hold") {
  const std::vector<std::vector<float>> copies{
      {1.0f, 10.0f}, {kNaN, 1e30f}, {3.0f, 20.0f}, {7.0f, -5.0f}};
  const std::uint8_t all_but_1[] = {1, 0, 1, 1};
  CHECK(combine<median>(copies, all_but_1) == std::vector<float>{3.0f, 10.0f});
  const std::uint8_t two[] = {0, 0, 1, 1};
  CHECK(combine<median>(copies, two) == std::vector<float>{5.0f, 7.5f});
  CHECK(combine<trimmed_mean>(copies, two) == std::vector<float>{5.0f, 7.5f});  // k = 0
  const std::uint8_t one[] = {0, 1, 0, 0};
  CHECK(combine<median>(copies, one)[1] == 1e30f);
  const std::uint8_t none[] = {0, 0, 0, 0};
  CHECK_THROWS_WITH_AS(combine<median>(copies, none),
                       doctest::Contains("median: sync_info::included leaves out all 4 groups"),
                       invalid_argument);
  const std::uint8_t short_mask[] = {1, 1};
  CHECK_THROWS_WITH_AS((combine<trimmed_mean>(copies, short_mask)),
                       doctest::Contains("trimmed_mean: sync_info::included names 2 groups, "
                                         "expected 4"),
                       invalid_argument);
}

TEST_CASE("end() without the begin() of its sync is refused (nothing was gathered)") {
  median m({}, {4});
  std::vector<float> buf(4, 1.0f);
  const sync_info info{.fragment = 0, .groups = 2};
  CHECK_THROWS_WITH_AS(m.end(0, buf, info),
                       doctest::Contains("end() of fragment 0 without a begin()"),
                       invalid_argument);
  m.begin(0, buf, info);
  m.end(0, buf, info);  // zeros gathered: the median is 0
  CHECK(buf == std::vector<float>(4, 0.0f));
  CHECK_THROWS_WITH_AS(m.end(0, buf, info), doctest::Contains("without a begin()"),
                       invalid_argument);
  std::vector<float> wrong(3);
  CHECK_THROWS_WITH_AS(m.begin(0, wrong, info),
                       doctest::Contains("fragment 0 has 4 elements, found a buffer of 3"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(m.begin(1, buf, info), doctest::Contains("fragment must be in [0, 1)"),
                       invalid_argument);
}

TEST_CASE("after a sync on 3x1x2 and 4x2x1 meshes every rank holds the groups' rule, bit for bit") {
  for (const mesh_shape shape : {mesh_shape{3, 1, 2}, mesh_shape{4, 2, 1}}) {
    CAPTURE(shape.groups);
    check_synced(sync_once<median>(shape, value_of), shape.groups, value_of, hand_median);
    check_synced(sync_once<trimmed_mean>(shape, value_of), shape.groups, value_of,
                 hand_trimmed<1, 4>);
    check_synced(sync_once<trimmed_mean>(shape, value_of, {.trim = {1, 3}}), shape.groups, value_of,
                 hand_trimmed<1, 3>);
  }
  // spot checks written out: G = 3 takes the middle group's value, G = 4 the mean of two
  const auto three = sync_once<median>({3, 1, 2}, [](int g, int, std::size_t j) {
    return j == 5 ? float(10 - 4 * g) : 0.0f;  // 10, 6, 2
  });
  for (const auto& r : three) CHECK(r.master[5] == 6.0f);
  const auto four = sync_once<median>({4, 2, 1}, [](int g, int, std::size_t j) {
    return j == 5 ? float(g * g) : 0.0f;  // 0, 1, 4, 9
  });
  for (const auto& r : four) CHECK(r.master[5] == 2.5f);
}

TEST_CASE("a poisoned group (1e30 or NaN) cannot move the median off the honest groups") {
  for (const float poison : {1e30f, kNaN, -1e30f}) {
    CAPTURE(poison);
    for (const mesh_shape shape : {mesh_shape{3, 1, 2}, mesh_shape{4, 2, 1}}) {
      CAPTURE(shape.groups);
      const int bad = 1;
      auto value = [&](int g, int s, std::size_t j) {
        return g == bad ? poison : value_of(g, s, j);
      };
      // The poison sorts at one end (NaN and 1e30 last, -1e30 first): for G = 3 the median is
      // the honest value on the other side, for G = 4 the mean of the two honest ones nearer it.
      auto expected = [&](std::vector<float> v) {
        std::vector<float> honest;
        for (int g = 0; g < int(v.size()); ++g)
          if (g != bad) honest.push_back(v[std::size_t(g)]);
        std::sort(honest.begin(), honest.end());
        const bool low = poison < 0;
        if (honest.size() == 2) return low ? honest[0] : honest[1];
        return low ? (honest[0] + honest[1]) / 2.0f : (honest[1] + honest[2]) / 2.0f;
      };
      const auto out = sync_once<median>(shape, value);
      check_synced(out, shape.groups, value, expected);
      for (const auto& r : out)
        for (std::size_t j = 0; j < r.master.size(); ++j) {
          REQUIRE(std::isfinite(r.master[j]));
          float lo = kInf, hi = -kInf;
          for (int g = 0; g < shape.groups; ++g)
            if (g != bad) {
              lo = std::min(lo, value_of(g, r.coords.shard, j));
              hi = std::max(hi, value_of(g, r.coords.shard, j));
            }
          REQUIRE(r.master[j] >= lo);
          REQUIRE(r.master[j] <= hi);
        }
      if (shape.groups == 4) {  // k = 1 trims the poison and one honest value
        const auto t = sync_once<trimmed_mean>(shape, value);
        check_synced(t, shape.groups, value, expected);
      }
    }
  }
}

TEST_CASE("with G = 2 the median is average's (a + b) / 2, bit for bit") {
  for (const mesh_shape shape : {mesh_shape{2, 1, 2}, mesh_shape{2, 2, 1}}) {
    const auto m = sync_once<median>(shape, value_of);
    const auto a = sync_once<federation::average>(shape, value_of);
    REQUIRE(m.size() == a.size());
    for (std::size_t r = 0; r < m.size(); ++r) CHECK(bit_equal(m[r].master, a[r].master));
    check_synced(m, 2, value_of, [](std::vector<float> v) { return (v[0] + v[1]) / 2.0f; });
  }
}

namespace {

using fl_median = algorithm<shard::hybrid_shard, median, schedule::periodic>;
using fl_trimmed = algorithm<shard::full_shard, trimmed_mean, schedule::periodic>;

std::size_t numel(const tensor_spec& t) {
  std::size_t n = 1;
  for (auto d : t.shape) n *= std::size_t(d);
  return n;
}

/// Group g's start value of element i of tensor t.
float start_value(int g, std::size_t t, std::size_t i) {
  return test::hash_uniform(std::uint64_t(17 * g + 3), 1000 * t + i);
}

/// The trainer over Sp (support/spaces.hpp), with sgd at lr = 0 so each group's parameters
/// stay where they were set: after `steps` steps with K = 1, every tensor of every rank
/// (concatenated in layout order); wire mismatches against the plans fail the test.
template <class A, class Sp>
std::vector<std::vector<float>> frozen_run(const mesh_shape& shape, int steps) {
  std::mutex mu;
  std::vector<std::string> mismatches;
  trainer_options<A> o;
  o.schedule = {.period = 1};
  o.total_steps = steps;
  auto out = test::collect_ranks(shape.size(), [&](inproc::communicator& world) {
    auto comm = Sp::wrap(world);
    mesh m(comm, shape);
    trainer<test::mlp_model, A, optim::sgd, typename Sp::comm, typename Sp::space> t(
        m, test::mlp_model{}, {.lr = 0.0f}, o);
    const int g = m.coords().group;
    std::size_t ti = 0;
    for (const auto& u : t.model().units())
      for (const auto& ts : u.tensors) {
        std::vector<float> v(numel(ts));
        for (std::size_t i = 0; i < v.size(); ++i) v[i] = start_value(g, ti, i);
        t.set_tensor(ts.name, v);
        ++ti;
      }
    t.wire().keep_calls(true);
    t.wire().take_calls();
    const int gs = shape.replicas * shape.shards;
    const int local = m.coords().replica * shape.shards + m.coords().shard;
    for (int s = 0; s < steps; ++s) {
      t.step(t.model().batch(5, s, g, shape.groups, local, gs, 2));
      const std::string diff =
          test::compare_calls(t.wire().take_calls(), test::expected_step_calls(t, s, steps));
      if (!diff.empty()) {
        std::lock_guard lock(mu);
        mismatches.push_back(diff);
      }
    }
    std::vector<float> all;
    for (const auto& u : t.model().units())
      for (const auto& ts : u.tensors) {
        const auto v = t.tensor(ts.name);
        all.insert(all.end(), v.begin(), v.end());
      }
    return all;
  });
  for (const auto& d : mismatches) FAIL_CHECK(d);
  return out;
}

}  // namespace

TEST_CASE_TEMPLATE("a trainer syncs with median / trimmed_mean in every space, as by hand", Sp,
                   FEDSHARD_TEST_SPACES) {
  const auto check = [](const std::vector<std::vector<float>>& out, int groups,
                        const std::function<float(std::vector<float>)>& rule) {
    for (const auto& all : out) {
      std::size_t at = 0, ti = 0;
      bool same = true;
      for (const auto& u : test::mlp_model{}.units())
        for (const auto& ts : u.tensors) {
          const std::size_t n = numel(ts);
          for (std::size_t i = 0; i < n; ++i) {
            std::vector<float> v;
            for (int g = 0; g < groups; ++g) v.push_back(start_value(g, ti, i));
            same = same && same_bits(all.at(at + i), rule(v));
          }
          at += n;
          ++ti;
        }
      CHECK(same);
    }
  };
  // 2 steps: the second sync combines copies that already agree, and must keep them.
  check(frozen_run<fl_median, Sp>({3, 1, 2}, 2), 3, hand_median);
  check(frozen_run<fl_trimmed, Sp>({4, 1, 2}, 1), 4, hand_trimmed<1, 4>);
}
