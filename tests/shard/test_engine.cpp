// Equivalence and traffic of the four shard policies on the tiny MLP (tests/support/tiny_mlp.hpp).
//
// Which results are bit-identical, and why:
//  - replicate over n ranks, shard_grad_op and full_shard over S = n ranks give bit-identical
//    parameters: gathers are exact copies, the optimizer is element-wise, and every gradient
//    element is reduced the same way (sum of the n ranks' values in rank order, then / n).
//  - hybrid_shard (R x S) and shard_grad_op on R x S average in two stages ((sum over S) / S,
//    then (sum over R) / R): bit-identical to each other, within 1e-6 relative of the others.
//  - A single rank on the concatenated batch sums all per-sample gradients in one pass, so it
//    matches the others within 1e-6 relative (the summation order differs).
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/shard/engine.hpp"
#include "fedshard/shard/full_shard.hpp"
#include "fedshard/shard/hybrid_shard.hpp"
#include "fedshard/shard/replicate.hpp"
#include "fedshard/shard/shard_grad_op.hpp"
#include "support/engine_runs.hpp"
#include "support/extra_copy_comm.hpp"
#include "support/spaces.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;
using fedshard::test::tiny_mlp;

namespace {

using namespace fedshard::test::engine_runs;

/// Rank 0's run, with every rank's counters and step plan over the steps.
struct run_result : rank_run {
  std::vector<traffic_counters> rank_traffic;  // every rank's counters over the steps
  std::vector<plan> rank_step_plans;           // every rank's step plan
};

/// The run of P (support/engine_runs.hpp) on a world of shape.size() inproc ranks, with the
/// communicator and memory space of Sp (support/spaces.hpp).
template <class P, class Sp = test::on_host>
run_result train(mesh_shape shape, shard::precision prec = {}, int batch_per_rank = kBatchPerRank) {
  run_result out;
  out.rank_traffic.resize(static_cast<std::size_t>(shape.size()));
  out.rank_step_plans.resize(static_cast<std::size_t>(shape.size()));
  test::spawn_ranks(shape.size(), [&](inproc::communicator& world) {
    auto comm = Sp::wrap(world);
    mesh m(comm, shape);
    typename Sp::space space;
    rank_run r = train_rank<P>(m, space, prec, batch_per_rank);
    const auto rank = static_cast<std::size_t>(world.rank());
    out.rank_traffic[rank] = r.traffic;
    out.rank_step_plans[rank] = r.step_plan;
    if (rank == 0) static_cast<rank_run&>(out) = std::move(r);
  });
  return out;
}

double max_rel_diff(const run_result& a, const run_result& b) {
  double worst = 0;
  for (std::size_t u = 0; u < a.units.size(); ++u)
    for (std::size_t i = 0; i < a.units[u].size(); ++i) {
      const double x = a.units[u][i], y = b.units[u][i];
      worst = std::max(worst, std::abs(x - y) / std::max(1e-3, std::abs(y)));
    }
  return worst;
}

}  // namespace

// On every test space (support/spaces.hpp): with the stream-checking space a missing wait
// between the compute, gather and reduce streams reads stale values (hold mode), so the
// results would differ from host_space's.
TEST_CASE_TEMPLATE("policies train to the parameters of a single rank on the concatenated batch",
                   Sp, FEDSHARD_TEST_SPACES) {
  const run_result single = train<shard::replicate, Sp>({1, 1, 1}, {}, 4 * kBatchPerRank);
  const run_result ddp = train<shard::replicate, Sp>({1, 4, 1});
  const run_result ddp_2x2 = train<shard::replicate, Sp>({1, 2, 2});
  const run_result zero2 = train<shard::shard_grad_op, Sp>({1, 1, 4});
  const run_result fsdp = train<shard::full_shard, Sp>({1, 1, 4});
  const run_result hsdp = train<shard::hybrid_shard, Sp>({1, 2, 2});
  const run_result zero2_2x2 = train<shard::shard_grad_op, Sp>({1, 2, 2});

  // Training did something.
  CHECK(single.losses.back() < single.losses.front());
  CHECK_FALSE(bit_equal(single, train<shard::replicate, Sp>({1, 1, 1}, {}, 1)));
  // ... exactly what it does in host memory.
  if constexpr (!std::is_same_v<Sp, test::on_host>) {
    CHECK(bit_equal(fsdp, train<shard::full_shard>({1, 1, 4})));
    CHECK(bit_equal(hsdp, train<shard::hybrid_shard>({1, 2, 2})));
  }

  // Same summation order: bit-identical.
  CHECK(bit_equal(ddp, fsdp));
  CHECK(bit_equal(ddp, zero2));
  CHECK(bit_equal(ddp, ddp_2x2));
  CHECK(bit_equal(hsdp, zero2_2x2));

  // Different summation order: within 1e-6 relative.
  for (const run_result* r : {&ddp, &fsdp, &zero2, &hsdp}) CHECK(max_rel_diff(*r, single) <= 1e-6);
  CHECK(max_rel_diff(hsdp, fsdp) <= 1e-6);
}

TEST_CASE_TEMPLATE(
    "mixed precision: bf16 on the wire, f32 master; policies still agree bit for bit", Sp,
    FEDSHARD_TEST_SPACES) {
  const shard::precision bf16_all{dtype::bf16, dtype::bf16};
  const run_result ddp = train<shard::replicate, Sp>({1, 4, 1}, bf16_all);
  const run_result fsdp = train<shard::full_shard, Sp>({1, 1, 4}, bf16_all);
  const run_result zero2 = train<shard::shard_grad_op, Sp>({1, 1, 4}, bf16_all);
  CHECK(bit_equal(ddp, fsdp));
  CHECK(bit_equal(ddp, zero2));
  const run_result f32 = train<shard::full_shard>({1, 1, 4});
  CHECK_FALSE(bit_equal(f32, fsdp));      // bf16 rounding changed the result...
  CHECK(max_rel_diff(fsdp, f32) < 5e-2);  // ...but only slightly
  CHECK(fsdp.losses.back() < fsdp.losses.front());
}

TEST_CASE_TEMPLATE("f16 on the wire: the gradient reductions sum in f32 and round once", Sp,
                   FEDSHARD_TEST_SPACES) {
  const shard::precision f16_all{dtype::f16, dtype::f16};
  const run_result ddp = train<shard::replicate, Sp>({1, 4, 1}, f16_all);
  const run_result fsdp = train<shard::full_shard, Sp>({1, 1, 4}, f16_all);
  const run_result zero2 = train<shard::shard_grad_op, Sp>({1, 1, 4}, f16_all);
  CHECK(bit_equal(ddp, fsdp));
  CHECK(bit_equal(ddp, zero2));
  const run_result f32 = train<shard::full_shard>({1, 1, 4});
  const run_result bf16 = train<shard::full_shard>({1, 1, 4}, {dtype::bf16, dtype::bf16});
  CHECK_FALSE(bit_equal(f32, fsdp));
  // f16 keeps 11 significant bits to bf16's 8: its run stays closer to f32's.
  CHECK(max_rel_diff(fsdp, f32) < max_rel_diff(bf16, f32));
  CHECK(fsdp.losses.back() < fsdp.losses.front());
}

TEST_CASE("bytes per step read from the traffic counters equal the plan and the closed forms") {
  SUBCASE("construction checks the layout over the world; reading the units runs the read plan") {
    const run_result r = train<shard::full_shard>({1, 1, 4});
    CHECK(r.setup_traffic.same_traffic(traffic_counters::of(r.setup_plan)));
    CHECK(r.setup_traffic[axis::world].calls == 2);
    CHECK(r.read_traffic.same_traffic(traffic_counters::of(r.read_plan)));
    CHECK(r.read_traffic[axis::shard].calls == 3);
    const run_result d = train<shard::replicate>({1, 4, 1});
    CHECK(d.read_plan.ops.empty());  // every rank holds whole units: nothing moves
    CHECK(d.read_traffic.total().calls == 0);
  }
  SUBCASE("full_shard: 3 (S-1)/S |theta| per rank per step in the wire dtype") {
    for (auto prec : {shard::precision{}, shard::precision{dtype::bf16, dtype::bf16}}) {
      const int S = 4;
      const run_result r = train<shard::full_shard>({1, 1, S}, prec);
      CHECK(r.traffic.same_traffic(traffic_counters::of(r.step_plan, kSteps)));
      const double theta = static_cast<double>(r.padded_numel * size_of(prec.param));
      CHECK(r.traffic[axis::shard].wire_bytes == kSteps * 3.0 * (S - 1) / S * theta);
      CHECK(r.traffic[axis::shard].calls == kSteps * 3 * 3);  // 3 units x (2 gathers + 1 RS)
      CHECK(r.traffic[axis::replica].calls == 0);
    }
  }
  SUBCASE("replicate: 2 (n-1)/n |theta|") {
    const int n = 4;
    const run_result r = train<shard::replicate>({1, n, 1});
    CHECK(r.traffic.same_traffic(traffic_counters::of(r.step_plan, kSteps)));
    const double theta = static_cast<double>(r.padded_numel * sizeof(float));
    CHECK(r.traffic[axis::group].wire_bytes == kSteps * 2.0 * (n - 1) / n * theta);
    CHECK(r.traffic[axis::shard].calls == 0);
  }
  SUBCASE("hybrid_shard: FSDP's over S plus 2 (R-1)/R |theta| / S") {
    const int R = 2, S = 2;
    const run_result r = train<shard::hybrid_shard>({1, R, S});
    CHECK(r.traffic.same_traffic(traffic_counters::of(r.step_plan, kSteps)));
    const double theta = static_cast<double>(r.padded_numel * sizeof(float));
    CHECK(r.traffic[axis::shard].wire_bytes == kSteps * 3.0 * (S - 1) / S * theta);
    CHECK(r.traffic[axis::replica].wire_bytes == kSteps * 2.0 * (R - 1) / R * theta / S);
  }
  SUBCASE("shard_grad_op gathers once per step") {
    const int S = 4;
    const run_result r = train<shard::shard_grad_op>({1, 1, S});
    CHECK(r.traffic.same_traffic(traffic_counters::of(r.step_plan, kSteps)));
    const double theta = static_cast<double>(r.padded_numel * sizeof(float));
    CHECK(r.traffic[axis::shard].wire_bytes == kSteps * 2.0 * (S - 1) / S * theta);
  }
}

namespace {

/// An inproc world whose communicators each send one extra copy of every collective's input
/// (support/extra_copy_comm.hpp), on host memory.
struct on_extra_copy {
  using comm = test::extra_copy<inproc::communicator>;
  using space = fedshard::space::host_space;
  static comm wrap(inproc::communicator& world) { return comm(world.split(0, world.rank())); }
};

/// The wire-equals-plan check of a run: every rank's reported bytes against every rank's
/// step plan run kSteps times ("" when they agree).
std::string step_mismatch(const run_result& r) {
  std::vector<traffic_counters> planned;
  for (const plan& p : r.rank_step_plans) planned.push_back(traffic_counters::of(p, kSteps));
  return moved_mismatch(traffic_counters::sum(r.rank_traffic), traffic_counters::sum(planned));
}

}  // namespace

TEST_CASE("the bytes the backend reports moving equal the step plans' closed forms") {
  SUBCASE("ddp (replicate over 4) and fsdp (full_shard over 4), on host and queued") {
    CHECK(step_mismatch(train<shard::replicate>({1, 4, 1})) == "");
    CHECK(step_mismatch(train<shard::full_shard>({1, 1, 4})) == "");
    CHECK(step_mismatch(train<shard::hybrid_shard>({1, 2, 2})) == "");
    CHECK(step_mismatch(train<shard::full_shard, test::on_queued>({1, 1, 4})) == "");
    // ddp: 5 steps x 4 ranks x 2 (4-1)/4 |theta|, every byte of it reported
    const run_result d = train<shard::replicate>({1, 4, 1});
    const double theta = static_cast<double>(d.padded_numel * sizeof(float));
    CHECK(traffic_counters::sum(d.rank_traffic)[axis::group].sent == kSteps * 4 * 1.5 * theta);
  }
  SUBCASE("a communicator that moves one extra copy of every input fails it") {
    const run_result r = train<shard::full_shard, on_extra_copy>({1, 1, 4});
    CHECK(bit_equal(r, train<shard::full_shard>({1, 1, 4})));  // same results, same calls
    CHECK(r.traffic.same_traffic(traffic_counters::of(r.step_plan, kSteps)));
    const std::string why = step_mismatch(r);
    CHECK(why.find("shard: the backends moved ") == 0);
    // Each gather copies its shard (|theta|/4) and each reduce-scatter its whole gradient
    // (|theta|) once more per rank: 5 steps x 4 ranks x (2 x |theta|/4 + |theta|) = 30 |theta|
    // on top of the plan's 5 x 4 x 3 (4-1)/4 |theta| = 45 |theta|.
    const double theta = static_cast<double>(r.padded_numel * sizeof(float));
    CHECK(traffic_counters::sum(r.rank_traffic)[axis::shard].sent == (45 + 30) * theta);
  }
}

TEST_CASE("bad input: policy/mesh mismatch, wrong sizes, layouts that differ across ranks") {
  tiny_mlp model;
  SUBCASE("full_shard with R > 1 is refused on every rank") {
    std::vector<std::string> errors(4);
    test::spawn_ranks(4, [&](inproc::communicator& world) {
      mesh m(world, {1, 2, 2});
      try {
        shard::engine<shard::full_shard, inproc::communicator> e(m, model.units());
      } catch (const invalid_argument& ex) {
        errors[static_cast<std::size_t>(world.rank())] = ex.what();
      }
    });
    for (const auto& e : errors) CHECK(e.find("replicas == 1, found 2") != std::string::npos);
  }
  SUBCASE("a rank declaring different units fails on every rank") {
    std::vector<std::string> errors(4);
    test::spawn_ranks(4, [&](inproc::communicator& world) {
      mesh m(world, {1, 1, 4});
      tiny_mlp mine = model;
      if (world.rank() == 2) mine.h = 17;
      try {
        shard::engine<shard::full_shard, inproc::communicator> e(m, mine.units());
      } catch (const invalid_argument& ex) {
        errors[static_cast<std::size_t>(world.rank())] = ex.what();
      }
    });
    for (const auto& e : errors) CHECK(e.find("2") != std::string::npos);
    for (const auto& e : errors) CHECK_FALSE(e.empty());
  }
  SUBCASE("values that don't fit a unit or tensor") {
    test::spawn_ranks(2, [&](inproc::communicator& world) {
      mesh m(world, {1, 1, 2});
      shard::engine<shard::full_shard, inproc::communicator> e(m, model.units());
      std::vector<float> wrong(5);
      CHECK_THROWS_WITH_AS(e.set_unit(0, wrong), doctest::Contains("has 144 elements, got 5"),
                           invalid_argument);
      CHECK_THROWS_WITH_AS(e.set_tensor("w1", wrong), doctest::Contains("has 256 elements, got 5"),
                           invalid_argument);
      CHECK_THROWS_WITH_AS(e.set_tensor("nope", wrong), doctest::Contains("'nope'"),
                           invalid_argument);
      CHECK_THROWS_AS(e.acquire(3), invalid_argument);
    });
  }
  SUBCASE("unsupported precision") {
    test::spawn_ranks(1, [&](inproc::communicator& world) {
      mesh m(world, {1, 1, 1});
      using E = shard::engine<shard::replicate, inproc::communicator>;
      CHECK_THROWS_WITH_AS(E(m, model.units(), {dtype::f32, dtype::f64}),
                           doctest::Contains("reduce dtype must be f32, bf16 or f16, found f64"),
                           invalid_argument);
    });
  }
}

TEST_CASE("padding stays zero and never leaks into results") {
  tiny_mlp model;
  test::spawn_ranks(4, [&](inproc::communicator& world) {
    mesh m(world, {1, 1, 4});
    shard::engine<shard::full_shard, inproc::communicator> e(m, model.units());
    for (std::size_t u = 0; u < 3; ++u) e.set_unit(u, model.init_unit(e.layout(), u, kSeed));
    for (int step = 0; step < 2; ++step) {
      std::vector<test::sample> batch{
          model.make_sample(1, static_cast<std::uint64_t>(world.rank()))};
      e.begin_step();
      model.forward_backward(e, batch);
      e.finish_backward();
      auto p = e.master();
      for (std::size_t i = 0; i < p.size(); ++i) p[i] -= 0.1f * e.grad()[i];
    }
    for (std::size_t u = 0; u < 3; ++u) {
      const auto& ul = e.layout().unit(u);
      const auto range = e.layout().shard_of(u, m.coords().shard);
      auto mine = e.master_of(u);
      for (std::size_t i = 0; i < mine.size(); ++i)
        if (range.begin + i >= ul.numel) CHECK(mine[i] == 0.0f);
      CHECK(e.gather_unit(u).size() == ul.numel);
    }
  });
}

TEST_CASE(
    "prefetch: the next unit's gather is in flight while a unit computes, live units bounded") {
  tiny_mlp model;
  test::spawn_ranks(2, [&](inproc::communicator& world) {
    mesh m(world, {1, 1, 2});
    shard::engine<shard::full_shard, inproc::communicator> e(m, model.units());
    for (int limit : {2, 1}) {
      e.set_max_live_units(limit);
      e.begin_step();
      // forward: acquiring u starts u + 1's gather (when the limit allows)
      e.acquire(0);
      CHECK(e.in_flight(1) == (limit >= 2));
      e.release(0);
      e.acquire(1);
      CHECK(e.in_flight(2) == (limit >= 2));
      e.release(1);
      e.acquire(2);
      e.release(2);
      // backward: acquiring u starts u - 1's gather; reductions overlap
      e.acquire(2, phase::backward);
      CHECK(e.step_phase() == phase::backward);
      CHECK(e.in_flight(1) == (limit >= 2));
      e.grad_buffer(2);
      e.release(2);
      e.grads_ready(2);
      e.acquire(1, phase::backward);
      e.grad_buffer(1);
      e.release(1);
      e.grads_ready(1);
      e.acquire(0, phase::backward);
      e.release(0);
      e.grads_ready(0);
      e.finish_backward();
      CHECK(e.reductions_in_flight() == 0);
      CHECK(e.live_units() == 0);
      CHECK(e.peak_live_units() <= 2);
      // every gather and reduction of the plan ran exactly once per step
      CHECK(e.traffic()[axis::shard].calls == (limit == 2 ? 9 : 18));
    }
    CHECK_THROWS_WITH_AS(e.set_max_live_units(0), doctest::Contains("found 0"), invalid_argument);
  });
}

TEST_CASE("a model that calls no hook gets its units gathered on use and reduced after") {
  tiny_mlp model;
  test::spawn_ranks(2, [&](inproc::communicator& world) {
    mesh m(world, {1, 1, 2});
    shard::engine<shard::full_shard, inproc::communicator> e(m, model.units());
    for (std::size_t u = 0; u < 3; ++u) e.set_unit(u, model.init_unit(e.layout(), u, kSeed));
    e.begin_step();
    auto p1 = e.params(1);
    auto p1_again = e.params(1);
    CHECK(p1.data() == p1_again.data());  // kept, not gathered twice
    auto full = e.gather_unit(1);
    for (std::size_t i = 0; i < full.size(); ++i) CHECK(p1[i] == full[i]);
    e.grad_buffer(1)[0] = 1.0f;  // only unit 1 gets a gradient
    e.finish_backward();
    if (m.coords().shard == 0) CHECK(e.grad_of(1)[0] == 1.0f);  // (1 + 1) / 2
    // construction's layout check, one forward gather, the read of unit 1, three reductions
    CHECK(e.traffic().same_traffic(traffic_counters::of(plan{
        {e.setup_plan().ops[0], e.setup_plan().ops[1], e.step_plan().ops[1], e.read_plan().ops[1],
         e.step_plan().ops[4], e.step_plan().ops[6], e.step_plan().ops[8]}})));
  });
}

namespace {
/// A policy whose plan names a buffer the engine does not hold.
struct bad_role_policy {
  static constexpr std::string_view name = "bad_role_policy";
  static int layout_shards(const mesh_shape& s) { return s.shards; }
  static void check(const mesh_shape&) {}
  static plan step_plan(const flat_layout& l, const mesh_shape& s, const shard::precision& p) {
    plan out = shard::full_shard::step_plan(l, s, p);
    out.ops[0].out = {.role = role::fragment};
    return out;
  }
};
}  // namespace

TEST_CASE("what the engine keeps and frees follows the plan; buffers keep their address") {
  tiny_mlp model;
  // shard_grad_op: gathered once, kept through backward, freed when reduced
  test::spawn_ranks(2, [&](inproc::communicator& world) {
    mesh m(world, {1, 1, 2});
    shard::engine<shard::shard_grad_op, inproc::communicator> e(m, model.units());
    e.begin_step();
    const float* p0 = e.acquire(0).data();
    e.release(0);
    CHECK(e.is_live(0));  // no backward gather planned: kept
    CHECK(e.acquire(0, phase::backward).data() == p0);
    e.grads_ready(0);
    CHECK_FALSE(e.is_live(0));
    CHECK_THROWS_WITH_AS(e.acquire(0, phase::backward),
                         doctest::Contains("unit 0 ('layer0') is not gathered and the "
                                           "shard_grad_op plan gathers it only for forward, not "
                                           "for backward"),
                         invalid_argument);
    e.finish_backward();
  });
  // full_shard: freed on release, gathered again into the same memory
  test::spawn_ranks(2, [&](inproc::communicator& world) {
    mesh m(world, {1, 1, 2});
    shard::engine<shard::full_shard, inproc::communicator> e(m, model.units());
    e.set_max_live_units(1);
    const float* first = nullptr;
    for (int step = 0; step < 2; ++step) {
      e.begin_step();
      const float* p = e.acquire(1).data();
      if (first == nullptr) first = p;
      CHECK(p == first);
      e.release(1);
      CHECK_FALSE(e.is_live(1));
      CHECK(e.acquire(1, phase::backward).data() == first);
      CHECK(e.is_live(1));
      e.grads_ready(1);
      e.finish_backward();
      CHECK(e.live_units() == 0);
    }
    CHECK(e.peak_live_units() == 1);
    CHECK_THROWS_WITH_AS(e.acquire(0, phase::sync),
                         doctest::Contains("phase must be forward or backward, found sync"),
                         invalid_argument);
  });
  // a plan naming a buffer the engine does not hold is refused on every rank
  test::spawn_ranks(2, [&](inproc::communicator& world) {
    mesh m(world, {1, 1, 2});
    using E = shard::engine<bad_role_policy, inproc::communicator>;
    CHECK_THROWS_WITH_AS(E(m, model.units()),
                         doctest::Contains("uses role fragment, but the shard engine holds only "
                                           "param_shard, params, grad and grad_shard"),
                         invalid_argument);
  });
}

TEST_CASE("a step does not wait for other firings of the interpreter (a sync in flight)") {
  // Rank 0 starts an all_reduce over the federation axis that rank 1 joins only once rank 0
  // has run a whole step: if the step waited for it, rank 0 would never finish (timeout).
  tiny_mlp model;
  std::atomic<bool> stepped{false};
  test::spawn_ranks(
      2,
      [&](inproc::communicator& world) {
        mesh m(world, {2, 1, 1});
        shard::engine<shard::full_shard, inproc::communicator> e(m, model.units());
        for (std::size_t u = 0; u < 3; ++u) e.set_unit(u, model.init_unit(e.layout(), u, kSeed));
        std::vector<float> v(4, float(world.rank()));
        const comm_op ar{.kind = comm_kind::all_reduce,
                         .axis = axis::federation,
                         .dtype = dtype::f32,
                         .bytes = 16,
                         .ranks = 2,
                         .reduce = reduce_op::sum,
                         .in = {.role = role::value},
                         .out = {.role = role::value}};
        auto bind = [&](const comm_op&, const operand&) {
          return buffer_view{v.data(), v.size(), dtype::f32};
        };
        const std::vector<test::sample> batch{model.make_sample(kSeed, 3)};
        if (world.rank() == 0) {
          const ticket t = e.interp().fire(plan{{ar}}, {}, bind);
          e.begin_step();
          model.forward_backward(e, batch);
          e.finish_backward();
          e.begin_step();
          stepped = true;
          e.interp().wait(t);
        } else {
          while (!stepped) std::this_thread::sleep_for(std::chrono::milliseconds(1));
          e.interp().wait(e.interp().fire(plan{{ar}}, {}, bind));
          e.begin_step();
          model.forward_backward(e, batch);
          e.finish_backward();
        }
        for (float x : v) CHECK(x == 1.0f);
      },
      test::short_timeout(20));
}

// FSDP2's mixed precision seen from the model: parameters read in the compute dtype are
// exactly the gathered (param-dtype) values, and gradients written in bf16 reduce exactly
// as the same values written in f32.
TEST_CASE_TEMPLATE(
    "compute dtype: acquire_as reads the gathered values, grad_buffer_as reduces "
    "like f32 gradients",
    Sp, FEDSHARD_TEST_SPACES) {
  const shard::precision prec{dtype::bf16, dtype::bf16};
  tiny_mlp model;
  test::spawn_ranks(2, [&](inproc::communicator& world) {
    auto comm = Sp::wrap(world);
    mesh m(comm, {1, 1, 2});
    typename Sp::space space;
    shard::engine<shard::full_shard, typename Sp::comm, typename Sp::space> e(m, space,
                                                                              model.units(), prec);
    for (std::size_t u = 0; u < e.layout().num_units(); ++u)
      e.set_unit(u, model.init_unit(e.layout(), u, kSeed));
    const std::size_t U = e.layout().num_units();
    // A gradient value per element, exactly representable in bf16, different per rank.
    auto grad_value = [&](std::size_t u, std::size_t i) {
      return static_cast<float>(
          bf16(0.01f * static_cast<float>((i * 7 + u * 3) % 23) + 0.5f * float(world.rank())));
    };
    std::vector<std::vector<float>> reduced(2);
    for (int pass = 0; pass < 2; ++pass) {
      e.begin_step();
      for (std::size_t u = 0; u < U; ++u) {
        const std::span<const float> p = e.acquire(u, phase::forward);
        const std::vector<float> wide(p.begin(), p.end());
        const const_buffer_view b = e.acquire_as(u, phase::forward, dtype::bf16);
        REQUIRE(b.type == dtype::bf16);
        REQUIRE(b.count == wide.size());
        const auto* narrow = static_cast<const bf16*>(b.data);
        bool exact = true;
        for (std::size_t i = 0; i < wide.size(); ++i)
          exact = exact && static_cast<float>(narrow[i]) == wide[i];
        CHECK(exact);
        e.release(u);
      }
      for (std::size_t u = U; u-- > 0;) {
        e.acquire(u, phase::backward);
        if (pass == 0) {
          const std::span<float> g = e.grad_buffer(u);
          for (std::size_t i = 0; i < g.size(); ++i) g[i] = grad_value(u, i);
        } else {
          const buffer_view g = e.grad_buffer_as(u, dtype::bf16);
          auto* narrow = static_cast<bf16*>(g.data);
          for (std::size_t i = 0; i < g.count; ++i) narrow[i] = bf16(grad_value(u, i));
          CHECK_THROWS_WITH_AS(e.grad_buffer(u),
                               doctest::Contains("already has gradients in bf16 (grad_buffer_as)"),
                               invalid_argument);
        }
        e.release(u);
        e.grads_ready(u);
      }
      e.finish_backward();
      reduced[static_cast<std::size_t>(pass)] = e.download(e.grad());
    }
    CHECK(reduced[0] == reduced[1]);
    CHECK(std::any_of(reduced[0].begin(), reduced[0].end(), [](float x) { return x != 0.0f; }));
    CHECK_THROWS_WITH_AS(e.acquire_as(0, phase::forward, dtype::f64),
                         doctest::Contains("compute dtype must be f32, bf16 or f16, found f64"),
                         invalid_argument);
  });
}
