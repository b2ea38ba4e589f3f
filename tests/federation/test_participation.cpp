/// Tests of the federation's participation stage (federation/participation.hpp): the sample's
/// size, its values for fixed seeds (worked out apart from the library: a Fisher-Yates
/// shuffle driven by splitmix64, seeded with seed ^ mix(round), first k kept, ascending),
/// masks drawn among eligible groups, the settings it refuses; the interpreter combining only
/// the included ranks of plain ops on inproc (no elastic link), and a synchronizer whose
/// sample decides what its average combines.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/error.hpp"
#include "fedshard/federation/average.hpp"
#include "fedshard/federation/participation.hpp"
#include "fedshard/federation/sync.hpp"
#include "fedshard/federation/weighted_average.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/interpreter.hpp"
#include "fedshard/schedule/periodic.hpp"
#include "support/spawn_ranks.hpp"

namespace {
using namespace fedshard;
using namespace fedshard::federation;
using federation::participation;
using federation::sample_of;
using federation::sampled_mask;
using mask = std::vector<std::uint8_t>;
}  // namespace

TEST_CASE("participation: samples of fixed seeds, round by round") {
  // 4 groups, fraction 0.5, seed 42: k = ceil(0.5 x 4) = 2.
  const participation half{.fraction = 0.5, .min_groups = 1, .seed = 42};
  CHECK(sample_of({0, 1, 2, 3}, half, 0) == std::vector<int>{0, 2});
  CHECK(sample_of({0, 1, 2, 3}, half, 1) == std::vector<int>{0, 3});
  CHECK(sample_of({0, 1, 2, 3}, half, 2) == std::vector<int>{1, 2});
  CHECK(sample_of({0, 1, 2, 3}, half, 3) == std::vector<int>{2, 3});
  // 10 groups, fraction 0.3, seed 7: k = 3.
  const participation third{.fraction = 0.3, .min_groups = 1, .seed = 7};
  const std::vector<int> ten{0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  CHECK(sample_of(ten, third, 0) == std::vector<int>{0, 1, 4});
  CHECK(sample_of(ten, third, 1) == std::vector<int>{2, 4, 6});
}

TEST_CASE("participation: how many groups a sample holds") {
  const std::vector<int> ten{0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  CHECK(sample_of(ten, {.fraction = 1.0}, 5) == ten);                           // everyone
  CHECK(sample_of(ten, {.fraction = 0.1, .min_groups = 5}, 5).size() == 5);     // min_groups
  CHECK(sample_of({3, 8}, {.fraction = 0.1, .min_groups = 9}, 5).size() == 2);  // at most all
  CHECK(sample_of({}, {.fraction = 0.5}, 5).empty());
  CHECK(sample_of({6}, {.fraction = 0.01}, 5) == std::vector<int>{6});  // at least one
}

TEST_CASE("participation: a mask drawn among the eligible groups") {
  // Eligible {1, 2, 4, 5} of 6 (e.g. an elastic round whose groups 0 and 3 are joiners):
  // the sample of round 0 with seed 42 picks positions {0, 2} of that list, i.e. groups 1, 4.
  const participation half{.fraction = 0.5, .min_groups = 1, .seed = 42};
  CHECK(sampled_mask(6, mask{0, 1, 1, 0, 1, 1}, half, 0) == mask{0, 1, 0, 0, 1, 0});
  CHECK(sampled_mask(4, {}, half, 1) == mask{1, 0, 0, 1});  // all eligible: {0, 3}
  CHECK(sampled_mask(3, {}, {}, 9) == mask{1, 1, 1});
  CHECK_THROWS_WITH_AS((void)sampled_mask(3, mask{1, 1}, half, 0),
                       doctest::Contains("a mask of 3 groups or none, found 2"), invalid_argument);
}

TEST_CASE("participation: settings it cannot use are refused with what was expected") {
  CHECK_THROWS_WITH_AS(federation::check(participation{.fraction = 0}),
                       doctest::Contains("fraction must be in (0, 1], found 0"), invalid_argument);
  CHECK_THROWS_WITH_AS(federation::check(participation{.fraction = 1.5}),
                       doctest::Contains("fraction must be in (0, 1], found 1.5"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(federation::check(participation{.fraction = 0.5, .min_groups = 0}),
                       doctest::Contains("min_groups must be >= 1, found 0"), invalid_argument);
  CHECK_NOTHROW(federation::check(participation{}));
}

// ------------------------------------------------- the stage run through the interpreter

namespace {

using fedshard::inproc::communicator;

comm_op federation_op(comm_kind k, std::int64_t elems, std::optional<reduce_op> r) {
  return {.kind = k,
          .axis = axis::federation,
          .dtype = dtype::f32,
          .bytes = elems * 4,
          .ranks = 3,
          .reduce = r,
          .in = {.role = role::value, .index = 0},
          .out = {.role = role::value, .index = 1}};
}

auto bind(std::vector<float>& in, std::vector<float>& out) {
  return [&](const comm_op&, const operand& o) {
    auto& v = o.index == 0 ? in : out;
    return buffer_view{v.data(), v.size(), dtype::f32};
  };
}

std::vector<unit_spec> two_units() {
  return {{"a", {{"w", {6}}}}, {"b", {{"w", {2}}}}};
}

}  // namespace

TEST_CASE("the interpreter combines only the included ranks of plain ops, on inproc") {
  // Three groups of one rank; the mask includes groups 0 and 2. Values exact in f32:
  // group 0 {1, -2}, group 1 {100, 100}, group 2 {3, 6}.
  //   avg all_reduce: ({1, -2} + {3, 6}) / 2 = {2, 2} on every rank, group 1's too;
  //   sum all_reduce: {4, 4};
  //   all_gather of {10g + 1}: {1, 0, 21} (group 1's slot zeroed);
  //   reduce_scatter (sum) of {g+1, 10(g+1), 100(g+1)}: {1+3, 10+30, 100+300}, rank r keeps
  //   element r: 4, 40, 400;
  //   nobody included: each rank keeps its own input.
  const std::vector<std::vector<float>> values{{1.0f, -2.0f}, {100.0f, 100.0f}, {3.0f, 6.0f}};
  test::spawn_ranks(3, [&](communicator& world) {
    mesh m(world, {.groups = 3, .replicas = 1, .shards = 1});
    interpreter<communicator> in(m);
    in.wire().keep_calls(true);
    const int g = world.rank();
    const auto mine = values[static_cast<std::size_t>(g)];
    in.set_included(axis::federation, {1, 0, 1});

    std::vector<float> x = mine, y(2);
    in.run(federation_op(comm_kind::all_reduce, 2, reduce_op::avg), bind(x, y));
    CHECK(y == std::vector<float>{2.0f, 2.0f});
    in.run(federation_op(comm_kind::all_reduce, 2, reduce_op::sum), bind(x, x));  // in place
    CHECK(x == std::vector<float>{4.0f, 4.0f});

    std::vector<float> one{10.0f * static_cast<float>(g) + 1.0f}, all(3, -1.0f);
    in.run(federation_op(comm_kind::all_gather, 3, std::nullopt), bind(one, all));
    CHECK(all == std::vector<float>{1.0f, 0.0f, 21.0f});

    const auto k = static_cast<float>(g + 1);
    std::vector<float> three{k, 10 * k, 100 * k}, part(1);
    in.run(federation_op(comm_kind::reduce_scatter, 3, reduce_op::sum), bind(three, part));
    CHECK(part[0] == std::vector<float>{4.0f, 40.0f, 400.0f}[static_cast<std::size_t>(g)]);

    in.set_included(axis::federation, {0, 0, 0});
    x = mine;
    in.run(federation_op(comm_kind::all_reduce, 2, reduce_op::avg), bind(x, y));
    CHECK(y == mine);

    // Each ran as the all_gather of every rank's input: 2, 2, 1, 3, 2 elements per rank.
    std::vector<std::int64_t> gathered;
    for (const wire_call& w : in.wire().calls()) {
      CHECK(w.kind == comm_kind::all_gather);
      gathered.push_back(w.bytes);
    }
    CHECK(gathered == std::vector<std::int64_t>{24, 24, 12, 36, 24});
  });
}

TEST_CASE("every rank included: the same bits as the backend's own all_reduce") {
  test::spawn_ranks(3, [&](communicator& world) {
    mesh m(world, {.groups = 3, .replicas = 1, .shards = 1});
    interpreter<communicator> in(m);
    std::vector<float> x(37), plain(37), masked(37);
    for (std::size_t i = 0; i < x.size(); ++i)
      x[i] = std::sin(0.37f * static_cast<float>(i) + 1.3f * static_cast<float>(world.rank()));
    in.run(federation_op(comm_kind::all_reduce, 37, reduce_op::avg), bind(x, plain));
    in.set_included(axis::federation, {1, 1, 1});
    in.run(federation_op(comm_kind::all_reduce, 37, reduce_op::avg), bind(x, masked));
    CHECK(std::memcmp(plain.data(), masked.data(), plain.size() * sizeof(float)) == 0);
  });
}

TEST_CASE("a synchronizer's participation stage samples the groups its average combines") {
  // Four groups of one rank, fraction 0.5, seed 42: sync 0 combines groups {0, 2}, sync 1
  // groups {0, 3} (the samples of rounds 0 and 1 above). Groups hold 1, 100, 3, 1000 before
  // sync 0: every master becomes (1 + 3) / 2 = 2; they hold 11, 110, 13, 1010 before sync 1:
  // (11 + 1010) / 2 = 510.5 everywhere, the groups left out included.
  const std::vector<float> held{1.0f, 100.0f, 3.0f, 1000.0f};
  const mesh_shape shape{4, 1, 1};
  test::spawn_ranks(4, [&](communicator& world) {
    mesh m(world, shape);
    interpreter<communicator> in(m);
    const flat_layout l(two_units(), 1);
    synchronizer<average, schedule::periodic> sync({}, {.period = 1}, l, shape, m.coords(), 0);
    sync.set_participation({.fraction = 0.5, .min_groups = 1, .seed = 42});
    const float mine = held[static_cast<std::size_t>(world.rank())];
    std::vector<float> master(l.total_shard_numel(), mine);
    sync.reset(master);
    sync.after_step(in, 0, 0, master, {});
    for (float v : master) REQUIRE(v == 2.0f);
    std::fill(master.begin(), master.end(), mine + 10.0f);
    sync.after_step(in, 1, 0, master, {});
    CHECK(sync.syncs_applied() == 2);
    for (float v : master) REQUIRE(v == 510.5f);
    CHECK_THROWS_WITH_AS(sync.set_participation({.fraction = 2}),
                         doctest::Contains("fraction must be in (0, 1], found 2"),
                         invalid_argument);
  });
}

TEST_CASE("a synchronizer's screening leaves out NaN and outlier groups, on inproc") {
  // Four groups of one rank, screening on (reject_nonfinite, clip_ratio 3), every group a
  // candidate. Sync 0: groups hold 1, NaN, 3, 2: group 1 is rejected, every master becomes
  // (1 + 3 + 2) / 3 = 2. Sync 1: they hold 11, 12, 13, 1e6: per element the median (the
  // third smallest of 4) is 13, distances 2, 1, 0 and 1e6 - 13 (x sqrt(N) over the N
  // elements); the median distance is 2 sqrt(N), so group 3 (far above 3 x that) is rejected:
  // (11 + 12 + 13) / 3 = 12.
  const mesh_shape shape{4, 1, 1};
  const std::vector<float> first{1.0f, std::nanf(""), 3.0f, 2.0f};
  const std::vector<float> second{11.0f, 12.0f, 13.0f, 1e6f};
  test::spawn_ranks(4, [&](communicator& world) {
    mesh m(world, shape);
    interpreter<communicator> in(m);
    const flat_layout l(two_units(), 1);
    synchronizer<average, schedule::periodic> sync({}, {.period = 1}, l, shape, m.coords(), 0);
    sync.set_screening({});
    const auto g = static_cast<std::size_t>(world.rank());
    std::vector<float> master(l.total_shard_numel(), first[g]);
    sync.reset(master);
    sync.after_step(in, 0, 0, master, {});
    for (float v : master) REQUIRE(v == 2.0f);
    std::fill(master.begin(), master.end(), second[g]);
    sync.after_step(in, 1, 0, master, {});
    for (float v : master) REQUIRE(v == 12.0f);
    CHECK_THROWS_WITH_AS(sync.set_screening({.clip_ratio = -1}),
                         doctest::Contains("clip_ratio must be finite and >= 0, found -1"),
                         invalid_argument);
  });
}

TEST_CASE("screening without an agreement needs groups of one rank") {
  // Two groups of two replicas: each replica would judge its own shard's statistics.
  const mesh_shape shape{2, 2, 1};
  test::spawn_ranks(4, [&](communicator& world) {
    mesh m(world, shape);
    interpreter<communicator> in(m);
    const flat_layout l(two_units(), 2);
    synchronizer<average, schedule::periodic> sync({}, {.period = 1}, l, shape, m.coords(), 0);
    sync.set_screening({});
    std::vector<float> master(l.total_shard_numel(), 1.0f);
    sync.reset(master);
    CHECK_THROWS_WITH_AS(sync.after_step(in, 0, 0, master, {}),
                         doctest::Contains("without one it needs groups of one rank, found 2 x 1"),
                         invalid_argument);
    in.wait_all();
  });
}

TEST_CASE("weighted_average under a sample: the weights' gather sees this sync's groups") {
  // Four groups of one rank, fraction 0.5, seed 42: sync 0 combines {0, 2}, sync 1 {0, 3}.
  // Sync 0: every group counted 1 token, groups hold 1, 100, 3, 1000: (1 + 3) / 2 = 2.
  // Sync 1: groups 0 and 3 counted 1 and 3 tokens and hold 2 and 6 (the others 50 and 7):
  // scales 2 x 1 / 4 = 0.5 and 2 x 3 / 4 = 1.5, (0.5 x 2 + 1.5 x 6) / 2 = 5. Had the weights
  // been gathered under sync 0's mask, group 3's weight would read 0.
  const mesh_shape shape{4, 1, 1};
  const std::vector<float> first{1.0f, 100.0f, 3.0f, 1000.0f}, second{2.0f, 50.0f, 7.0f, 6.0f};
  test::spawn_ranks(4, [&](communicator& world) {
    mesh m(world, shape);
    interpreter<communicator> in(m);
    const flat_layout l(two_units(), 1);
    synchronizer<weighted_average, schedule::periodic> sync({}, {.period = 1}, l, shape, m.coords(),
                                                            0);
    sync.set_participation({.fraction = 0.5, .min_groups = 1, .seed = 42});
    const auto g = static_cast<std::size_t>(world.rank());
    std::vector<float> master(l.total_shard_numel(), first[g]);
    sync.reset(master);
    sync.add_tokens(1);
    sync.after_step(in, 0, 0, master, {});
    for (float v : master) REQUIRE(v == 2.0f);
    std::fill(master.begin(), master.end(), second[g]);
    sync.add_tokens(g == 3 ? 3 : 1);
    sync.after_step(in, 1, 0, master, {});
    for (float v : master) REQUIRE(v == 5.0f);
  });
}
