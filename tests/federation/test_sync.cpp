// The federation sync state machine: fragments cut as the schedule says, sync plans without
// buffers, the stages of a delayed sync, mixing, inner moments, checkpoint state, and a
// schedule or plan that cannot work refused with a clear error.
#include "fedshard/federation/sync.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "fedshard/codec/cast.hpp"
#include "fedshard/comm/inproc.hpp"
#include "fedshard/core/fp8.hpp"
#include "fedshard/federation/average.hpp"
#include "fedshard/federation/outer_optimizer.hpp"
#include "fedshard/federation/outer_rules.hpp"
#include "fedshard/federation/with_codec.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/interpreter.hpp"
#include "fedshard/schedule/periodic.hpp"
#include "fedshard/schedule/streaming.hpp"
#include "fedshard/trainer/checkpoint.hpp"
#include "fedshard/trainer/state_io.hpp"
#include "support/op_lists.hpp"
#include "support/spawn_ranks.hpp"

using namespace fedshard;
using namespace fedshard::federation;

namespace {

std::vector<unit_spec> four_units() {
  return {{"a", {{"w", {10}}}}, {"b", {{"w", {20}}}}, {"c", {{"w", {30}}}}, {"d", {{"w", {5}}}}};
}

/// A schedule that starts every step and never applies: its second start is a bug.
struct starts_twice {
  struct config {};
  starts_twice() = default;
  explicit starts_twice(const config&) {}
  static constexpr std::string_view name = "starts_twice";
  int fragments() const { return 1; }
  schedule::sync_action action(int, std::int64_t, std::int64_t) const {
    return schedule::sync_action::start;
  }
  float mixing() const { return 1.0f; }
  std::vector<int> fragment_units(int f, int n) const {
    return schedule::detail::strided_units(name, f, 1, n);
  }
  void check(int n) const { schedule::detail::check_units(name, 1, n); }
};

/// average, but its plan averages an inner-optimizer state the optimizer may not have.
struct moment_hungry : average {
  using average::average;
  plan sync_plan(const sync_context& ctx) const {
    return average_ops(ctx, sync_mode::hierarchical, {.role = role::moment, .index = 3},
                       trigger::sync_after, trigger::sync_after);
  }
};

}  // namespace

TEST_CASE("fragments_of cuts strided fragments with padded buffers; sync_plans_of allocates none") {
  const flat_layout l(four_units(), 2);  // shards of 16, 16, 16, 16 elements
  const schedule::streaming s({.period = 8, .fragments = 2, .delay = 0, .alpha = 1.0f});
  const auto fr = fragments_of(s, l, 3);
  REQUIRE(fr.size() == 2);
  CHECK(fr[0].slices == std::vector<std::pair<std::size_t, std::size_t>>{{l.shard_offset(0), 16},
                                                                         {l.shard_offset(2), 16}});
  CHECK(fr[0].numel == 32);
  CHECK(fr[0].padded == 48);  // a multiple of 16 x 3 replicas
  CHECK(fr[1].slices.size() == 2);
  outer_optimizer<nesterov>::config c;
  c.average_inner_moments = true;
  const outer_optimizer<nesterov> policy(c, {});  // built for no fragments
  const auto plans = sync_plans_of(policy, s, l, {2, 3, 2}, {1, 2, 0}, 2);
  REQUIRE(plans.size() == 2);
  // G = 2 groups of R = 3 replicas; each fragment's buffer is padded to 48 f32 = 192 B. The
  // rank (replica 2) averages its third, 16 f32 = 64 B, over the 2 groups (sending
  // 2 (2 - 1) / 2 x 64 = 64 B), then the 3 replicas all-gather the 192 B (sending
  // (3 - 1) / 3 x 192 = 128 B): for the parameters at sync_exchange / sync_finish, then for each
  // of the 2 inner-optimizer buffers at sync_after.
  for (int f = 0; f < 2; ++f) {
    CAPTURE(f);
    auto average_of = [&](operand whole, trigger start, trigger finish) {
      operand third = whole;
      third.piece = axis::replica;
      return std::vector<comm_op>{{.kind = comm_kind::all_reduce,
                                   .axis = axis::federation,
                                   .dtype = dtype::f32,
                                   .bytes = 64,
                                   .ranks = 2,
                                   .reduce = reduce_op::avg,
                                   .trigger = start,
                                   .phase = phase::sync,
                                   .fragment = f,
                                   .in = third,
                                   .out = third,
                                   .overlappable = false},
                                  {.kind = comm_kind::all_gather,
                                   .axis = axis::replica,
                                   .dtype = dtype::f32,
                                   .bytes = 192,
                                   .ranks = 3,
                                   .trigger = finish,
                                   .phase = phase::sync,
                                   .fragment = f,
                                   .in = third,
                                   .out = whole,
                                   .overlappable = false}};
    };
    std::vector<comm_op> want =
        average_of({.role = role::fragment}, trigger::sync_exchange, trigger::sync_finish);
    for (int k : {0, 1})
      for (const comm_op& op :
           average_of({.role = role::moment, .index = k}, trigger::sync_after, trigger::sync_after))
        want.push_back(op);
    const plan& got = plans[std::size_t(f)];
    CHECK(test::compare_ops(got.ops, want) == "");
    CHECK(got.wire_bytes_on(axis::federation) == 3 * 64.0);
    CHECK(got.wire_bytes_on(axis::replica) == doctest::Approx(3 * 128.0));
  }
  CHECK_THROWS_WITH_AS(fragments_of(schedule::streaming({.period = 8, .fragments = 5}), l, 1),
                       doctest::Contains("5 fragments but the model has only 4 units"),
                       invalid_argument);
}

TEST_CASE("a delayed sync is in flight between its start and its apply, then mixed in") {
  // streaming, H = 4, P = 1, τ = 1, α = 0.5: starts after step 2, applies after step 3.
  const mesh_shape shape{2, 1, 2};
  test::spawn_ranks(4, [&](inproc::communicator& world) {
    mesh m(world, shape);
    interpreter<inproc::communicator> in(m);
    const flat_layout l(four_units(), 2);
    synchronizer<average, schedule::streaming> sync(
        {}, {.period = 4, .fragments = 1, .delay = 1, .alpha = 0.5f}, l, shape, m.coords(), 0);
    CHECK(sync.fragments() == 1);
    std::vector<float> master(l.total_shard_numel());
    const float mine = float(m.coords().group);  // group 0 holds 0, group 1 holds 1
    std::fill(master.begin(), master.end(), mine);
    sync.reset(master);
    for (std::int64_t step = 0; step < 3; ++step) sync.after_step(in, step, 0, master, {});
    CHECK(sync.stage(0) == sync_stage::in_flight);
    // the model moves on while the sync is in flight: the snapshot is what gets averaged
    std::fill(master.begin(), master.end(), mine + 10.0f);
    sync.after_step(in, 3, 0, master, {});
    CHECK(sync.stage(0) == sync_stage::idle);
    CHECK(sync.sync_steps(0) == std::vector<std::int64_t>{3});
    CHECK(sync.syncs_applied() == 1);
    // θ ← θ + α (mean of snapshots − θ): (mine + 10) + 0.5 (0.5 − (mine + 10))
    const float expected = (mine + 10.0f) + 0.5f * (0.5f - (mine + 10.0f));
    const auto cut = fragments_of(sync.schedule(), l, 1);
    for (const auto& [off, len] : cut[0].slices)
      for (std::size_t i = 0; i < len; ++i) CHECK(master[off + i] == expected);
    CHECK(in.traffic().same_traffic(traffic_counters::of(sync.sync_plan(0))));
  });
}

TEST_CASE("a checkpoint keeps a communicated sync and its stage; complete_in_flight finishes it") {
  const mesh_shape shape{2, 1, 1};
  test::spawn_ranks(2, [&](inproc::communicator& world) {
    mesh m(world, shape);
    interpreter<inproc::communicator> in(m);
    const flat_layout l(four_units(), 1);
    using S = synchronizer<outer_optimizer<nesterov>, schedule::streaming>;
    const schedule::streaming::config sc{.period = 4, .fragments = 1, .delay = 1, .alpha = 1.0f};
    S a({}, sc, l, shape, m.coords(), 0);
    std::vector<float> master(l.total_shard_numel(), float(world.rank()));
    a.reset(master);
    for (std::int64_t step = 0; step < 3; ++step) a.after_step(in, step, 0, master, {});
    REQUIRE(a.stage(0) == sync_stage::in_flight);
    a.complete_in_flight(in);
    CHECK(a.stage(0) == sync_stage::communicated);
    state_registry ra, rb;
    a.register_state(ra, in);
    checkpoint::file_writer w;
    checkpoint::write_registry(ra, w);
    const checkpoint::file_reader r(w.bytes(), "memory");
    CHECK(r.has("fragment0.buffer"));  // written while a sync is in flight
    S b({}, sc, l, shape, m.coords(), 0);
    b.register_state(rb, in);
    const checkpoint::state_geometry geo{.layout = &l, .fragments = {{0, 1, 2, 3}}, .shape = shape};
    const auto staged = checkpoint::stage_same(rb, r, geo);
    CHECK(b.stage(0) == sync_stage::idle);  // staged, not applied
    checkpoint::apply(rb, staged);
    CHECK(b.stage(0) == sync_stage::communicated);
    std::vector<float> ma = master, mb = master;
    a.after_step(in, 3, 0, ma, {});
    b.after_step(in, 3, 0, mb, {});
    CHECK(ma == mb);  // the restored one applies the same result at the same step
    CHECK(b.sync_steps(0) == std::vector<std::int64_t>{3});
  });
}

TEST_CASE("a schedule that starts twice, or a plan the optimizer cannot serve, is refused") {
  const mesh_shape shape{2, 1, 1};
  test::spawn_ranks(2, [&](inproc::communicator& world) {
    mesh m(world, shape);
    interpreter<inproc::communicator> in(m);
    const flat_layout l(four_units(), 1);
    synchronizer<average, starts_twice> s({}, {}, l, shape, m.coords(), 0);
    std::vector<float> master(l.total_shard_numel());
    s.after_step(in, 0, 0, master, {});
    CHECK_THROWS_WITH_AS(s.after_step(in, 1, 0, master, {}),
                         doctest::Contains("fragment 0 starts a sync while its previous one is "
                                           "still in flight (step 1)"),
                         invalid_argument);
    in.wait_all();
    using hungry = synchronizer<moment_hungry, schedule::periodic>;
    CHECK_THROWS_WITH_AS(hungry({}, {}, l, shape, m.coords(), 2),
                         doctest::Contains("averages inner-optimizer state 3 but the optimizer "
                                           "has 2 state buffers"),
                         invalid_argument);
  });
}

namespace {

/// average's transforms, but its plan gathers every group's fragment into role gathered.
struct gathers_fragments : average {
  using average::average;
  plan sync_plan(const sync_context& ctx) const {
    const auto G = ctx.shape.groups;
    plan p;
    p.ops.push_back({.kind = comm_kind::all_gather,
                     .axis = axis::federation,
                     .bytes = static_cast<std::int64_t>(ctx.numel * sizeof(float)) * G,
                     .ranks = G,
                     .trigger = trigger::sync_exchange,
                     .phase = phase::sync,
                     .fragment = ctx.fragment,
                     .in = {.role = role::fragment},
                     .out = {.role = role::gathered},
                     .overlappable = false});
    return p;
  }
};

/// gathers_fragments with a buffer for them: the synchronizer binds role gathered to it.
struct keeps_gathered : gathers_fragments {
  using gathers_fragments::gathers_fragments;
  std::vector<float> all;
  std::span<float> gathered(int) { return all; }
};

}  // namespace

TEST_CASE("role gathered is bound to the policy's gathered(f), and refused without one") {
  const mesh_shape shape{2, 1, 1};
  test::spawn_ranks(2, [&](inproc::communicator& world) {
    mesh m(world, shape);
    interpreter<inproc::communicator> in(m);
    const flat_layout l(four_units(), 1);
    const auto numel = fragments_of(schedule::periodic({.period = 1}), l, 1)[0].padded;
    std::vector<float> master(l.total_shard_numel(), float(world.rank() + 1));

    synchronizer<keeps_gathered, schedule::periodic> s({}, {.period = 1}, l, shape, m.coords(), 0);
    s.policy().all.assign(2 * numel, -1.0f);
    s.after_step(in, 0, 0, master, {});
    const auto cut = fragments_of(s.schedule(), l, 1);
    for (int g = 0; g < 2; ++g) {  // group g's packed fragment, padding zeroed
      std::vector<float> expected(numel, 0.0f);
      std::size_t at = 0;
      for (const auto& slice : cut[0].slices)
        for (std::size_t i = 0; i < slice.second; ++i) expected[at++] = float(g + 1);
      const auto first = s.policy().all.begin() + std::ptrdiff_t(std::size_t(g) * numel);
      CHECK(std::vector<float>(first, first + std::ptrdiff_t(numel)) == expected);
    }

    synchronizer<gathers_fragments, schedule::periodic> t({}, {.period = 1}, l, shape, m.coords(),
                                                          0);
    CHECK_THROWS_WITH_AS(t.after_step(in, 0, 0, master, {}),
                         doctest::Contains("holds no buffer of role gathered"), invalid_argument);
    in.wait_all();
  });
}

TEST_CASE("the round's participants reach the encoded average: the synchronizer sets the mask") {
  // Three groups of one rank; the included source (an elastic round's, here a fixed one) says
  // groups 0 and 2 take part. The bf16-encoded average then combines their values only:
  // groups hold 1, 100 and 3 (exact in bf16), so every rank's master becomes (1 + 3) / 2 = 2,
  // the left-out group's too (it takes the round's result, as a heal would give it).
  const mesh_shape shape{3, 1, 1};
  const std::vector<float> held{1.0f, 100.0f, 3.0f};
  test::spawn_ranks(3, [&](inproc::communicator& world) {
    mesh m(world, shape);
    interpreter<inproc::communicator> in(m);
    const flat_layout l(four_units(), 1);
    synchronizer<with_codec<average, codec::cast<bf16>>, schedule::periodic> sync(
        {}, {.period = 1}, l, shape, m.coords(), 0);
    sync.set_included_source([] { return std::vector<std::uint8_t>{1, 0, 1}; });
    std::vector<float> master(l.total_shard_numel(), held[std::size_t(m.coords().group)]);
    sync.reset(master);
    sync.after_step(in, 0, 0, master, {});
    CHECK(sync.syncs_applied() == 1);
    for (float v : master) REQUIRE(v == 2.0f);
  });
}
