// The state registry: every stateful part of a run registers its buffers, and save, load,
// resharding and healing iterate the registry. A federation policy written here, in this
// file, with a buffer of its own over the model's elements, is saved, loaded bit-exactly and
// resharded onto another mesh with no edit anywhere else.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/core/state_registry.hpp"
#include "fedshard/federation/average.hpp"
#include "fedshard/federation/federation_policy.hpp"
#include "fedshard/federation/sync_plan.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/plan/traffic.hpp"
#include "fedshard/trainer/state_io.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/files.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;
using test::mlp_model;
namespace fs = std::filesystem;

namespace {

/// A new stateful federation policy: plain averaging that also keeps, per fragment, a
/// running mean of the synced parameters (half the last running mean, half the new
/// average), a buffer laid out like the fragment. It says nothing to the trainer, the
/// checkpoint code or the registry beyond its state().
struct running_average : federation::detail::stateless {
  struct config {
    federation::sync_mode sync = federation::sync_mode::hierarchical;
  };
  static constexpr std::string_view name = "running_average";
  static constexpr bool syncs = true;

  running_average() = default;
  running_average(config c, const std::vector<std::size_t>& sizes) : config_(c) {
    for (std::size_t n : sizes) running_.emplace_back(n, 0.0f);
  }
  plan sync_plan(const federation::sync_context& ctx) const {
    return federation::parameter_average_ops(ctx, config_.sync);
  }
  template <class Stream>
  void end(int f, std::span<float> buf, const federation::sync_info&, Stream&) {
    auto& r = running_[static_cast<std::size_t>(f)];
    for (std::size_t i = 0; i < r.size(); ++i) r[i] = 0.5f * r[i] + 0.5f * buf[i];
  }
  void end(int f, std::span<float> buf, const federation::sync_info& info) {
    space::host_space::stream st;
    end(f, buf, info, st);
  }
  std::vector<optim::state_tensor> state() {
    std::vector<optim::state_tensor> s;
    for (std::size_t f = 0; f < running_.size(); ++f)
      s.push_back({"running", running_[f], static_cast<int>(f), state_start::zero});
    return s;
  }

 private:
  config config_{};
  std::vector<std::vector<float>> running_;
};
static_assert(federation::FederationPolicy<running_average>);

using running_alg = algorithm<shard::hybrid_shard, running_average, schedule::periodic,
                              defaults<schedule::periodic::config{.period = 2}>>;
using trainer_t = trainer<mlp_model, running_alg, optim::adamw, inproc::communicator>;

constexpr std::uint64_t kData = 5;

std::vector<test::sample> batch_at(trainer_t& t, const mesh_shape& shape, int step) {
  const auto c = t.topology().coords();
  return t.model().batch(kData, step, c.group, shape.groups, c.replica * shape.shards + c.shard,
                         shape.replicas * shape.shards, 2);
}

/// Every rank's parameters and running buffers after a leg.
struct leg_result {
  std::vector<std::vector<float>> params, running;
};

/// Fresh trainers on `shape`: load(from) when given, train steps [first, last), save(to)
/// when given.
leg_result leg(const mesh_shape& shape, int first, int last, const fs::path& from = {},
               const fs::path& to = {}) {
  const auto n = static_cast<std::size_t>(shape.size());
  leg_result out{std::vector<std::vector<float>>(n), std::vector<std::vector<float>>(n)};
  test::spawn_ranks(shape.size(), [&](inproc::communicator& world) {
    mesh m(world, shape);
    trainer_options<running_alg> o;
    o.total_steps = 12;
    o.log = [](const std::string&) {};
    trainer_t t(m, mlp_model{}, {.lr = 1e-2f}, o);
    if (!from.empty()) t.load(from);
    for (int s = first; s < last; ++s) t.step(batch_at(t, shape, s));
    if (!to.empty()) t.save(to);
    const auto r = static_cast<std::size_t>(world.rank());
    out.params[r] = t.parameters();
    const auto st = t.federation().state();
    out.running[r].assign(st.at(0).data.begin(), st.at(0).data.end());
  });
  return out;
}

/// The nonzero values of some ranks' buffers, sorted: what a group holds, however its
/// ranks cut it (padding is zero).
std::vector<float> values_of(const leg_result& r, std::initializer_list<std::size_t> ranks) {
  std::vector<float> v;
  for (std::size_t k : ranks)
    for (float x : r.running[k])
      if (x != 0.0f) v.push_back(x);
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

TEST_CASE("a federation policy's own buffer is registered, saved and loaded bit-exactly") {
  test::temp_dir dir("fedshard-registry");
  const mesh_shape shape{2, 1, 2};
  const leg_result straight = leg(shape, 0, 9);
  const leg_result first = leg(shape, 0, 5, {}, dir.path);  // syncs after steps 1 and 3
  for (const auto& r : first.running)
    CHECK(std::any_of(r.begin(), r.end(), [](float x) { return x != 0.0f; }));
  const leg_result resumed = leg(shape, 5, 9, dir.path);
  for (std::size_t r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(test::bit_equal(resumed.params[r], straight.params[r]));
    CHECK(test::bit_equal(resumed.running[r], straight.running[r]));
  }
  // Its section is named by the synchronizer after the policy's own name for it.
  const auto saved = checkpoint::saved_checkpoint::open(dir.path);
  CHECK(saved.rank_file(0).has("federation.fragment0.running"));
}

TEST_CASE("a federation policy's own buffer reshards onto another mesh and back") {
  test::temp_dir a("fedshard-registry"), b("fedshard-registry"), c("fedshard-registry");
  const mesh_shape sharded{2, 1, 2}, replicated{2, 2, 1};
  const leg_result saved = leg(sharded, 0, 5, {}, a.path);
  // 2x1x2 -> 2x2x1: every rank of group g holds group g's whole buffer (its two shards').
  const leg_result wide = leg(replicated, 5, 5, a.path, b.path);
  CHECK(values_of(wide, {0}) == values_of(saved, {0, 1}));
  CHECK(values_of(wide, {1}) == values_of(saved, {0, 1}));
  CHECK(values_of(wide, {2}) == values_of(saved, {2, 3}));
  CHECK_FALSE(values_of(saved, {2, 3}).empty());
  // ... and back: each shard holds exactly what it held before, padding included.
  const leg_result back = leg(sharded, 5, 5, b.path, c.path);
  for (std::size_t r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(test::bit_equal(back.running[r], saved.running[r]));
    CHECK(test::bit_equal(back.params[r], saved.params[r]));
  }
}

TEST_CASE("a joining group takes the donor's whole state, the policy's own buffer included") {
  // Two groups of 2 ranks train 3 steps (a sync after step 1, so the running buffers hold
  // values; step 2 is local, so the groups' parameters differ). Group 1 then heals from
  // group 0 through the heal plan: afterwards each of its ranks holds exactly what its
  // counterpart in group 0 holds, and the donor's tap saw the plan's two sends.
  const mesh_shape shape{2, 1, 2};
  struct rank_view {
    std::vector<float> params_before, params, running;
    std::int64_t step = -1, state_bytes = -1, fed_calls = -1, fed_bytes = -1;
  };
  std::vector<rank_view> out(4);
  test::spawn_ranks(shape.size(), [&](inproc::communicator& world) {
    mesh m(world, shape);
    trainer_options<running_alg> o;
    o.total_steps = 12;
    trainer_t t(m, mlp_model{}, {.lr = 1e-2f}, o);
    for (int s = 0; s < 3; ++s) t.step(batch_at(t, shape, s));
    auto& v = out[static_cast<std::size_t>(world.rank())];
    v.params_before = t.parameters();
    const axis_traffic before = t.traffic()[axis::federation];
    const auto h = t.heal({.ranks = 2, .donor = 0, .joiners = {1}, .me = m.coords().group});
    const axis_traffic after = t.traffic()[axis::federation];
    v.params = t.parameters();
    v.running.assign(t.federation().state().at(0).data.begin(),
                     t.federation().state().at(0).data.end());
    v.step = t.step_count();
    v.state_bytes = h.state_bytes;
    v.fed_calls = after.calls - before.calls;
    v.fed_bytes = after.payload_bytes - before.payload_bytes;
  });
  for (std::size_t r : {2, 3}) {
    CAPTURE(r);
    const rank_view& donor = out[r - 2];
    CHECK_FALSE(test::bit_equal(out[r].params_before, donor.params_before));
    CHECK(test::bit_equal(out[r].params, donor.params));
    CHECK(test::bit_equal(out[r].running, donor.running));
    CHECK(std::any_of(out[r].running.begin(), out[r].running.end(),
                      [](float x) { return x != 0.0f; }));
    CHECK(out[r].step == 3);
    CHECK(out[r].state_bytes == donor.state_bytes);  // the joiner took what the donor sent
    CHECK(out[r].fed_calls == 0);                    // a joiner sends nothing
  }
  for (std::size_t r : {0, 1}) {
    CAPTURE(r);
    // The donor's plan: the size (one f64, 8 bytes), then the state in whole 8-byte words.
    const std::int64_t words = (out[r].state_bytes + 7) / 8 * 8;
    CHECK(out[r].state_bytes > 0);
    CHECK(out[r].fed_calls == 2);
    CHECK(out[r].fed_bytes == 8 + words);
    CHECK(test::bit_equal(out[r].params, out[r].params_before));  // the donor is unchanged
  }
}

TEST_CASE("a trainer's registry lists every piece of its state, in the order registered") {
  // DiLoCo-like outer Nesterov on 2x1x2 with AdamW and one fragment: written out by hand.
  const std::vector<std::string> want = {"master",
                                         "optimizer.exp_avg",
                                         "optimizer.exp_avg_sq",
                                         "optimizer.step_count",
                                         "federation.fragment0.anchor",
                                         "federation.fragment0.momentum",
                                         "fragment0.stage",
                                         "fragment0.outer_steps",
                                         "fragment0.tokens",
                                         "fragment0.group_tokens",
                                         "fragment0.applied_at",
                                         "fragment0.buffer",
                                         "federation.syncs_applied",
                                         "trainer.step",
                                         "trainer.started"};
  const mesh_shape shape{2, 1, 2};
  test::spawn_ranks(shape.size(), [&](inproc::communicator& world) {
    mesh m(world, shape);
    trainer<mlp_model, diloco, optim::adamw, inproc::communicator> t(m, mlp_model{});
    std::vector<std::string> names;
    for (const auto& e : t.state()) names.push_back(e.name);
    CHECK(names == want);
    const state_entry* anchor = t.state().find("federation.fragment0.anchor");
    REQUIRE(anchor != nullptr);
    CHECK(anchor->extent == state_extent::fragment);
    CHECK(anchor->missing == state_start::parameters);
    CHECK(anchor->name_in_fragment(3) == "federation.fragment3.anchor");
    CHECK(t.state().describe("optimizer.exp_avg") == "optimizer state 'exp_avg'");
  });
}

TEST_CASE("state_registry refuses a second entry of one name, or one without callables") {
  state_registry reg;
  std::int64_t x = 0;
  reg.add_value({.name = "x"}, &x);
  CHECK_THROWS_WITH_AS(reg.add_value({.name = "x"}, &x),
                       doctest::Contains("two entries are named 'x'"), invalid_argument);
  CHECK_THROWS_WITH_AS(reg.add({.name = "y"}),
                       doctest::Contains("entry 'y' needs bytes, save and load callables"),
                       invalid_argument);
  std::vector<float> v(4);
  CHECK_THROWS_WITH_AS(reg.add_host_span({.name = "z", .extent = state_extent::fragment}, v),
                       doctest::Contains("fragment entry 'z' needs a fragment, found -1"),
                       invalid_argument);
}

TEST_CASE("a staging refuses a missing section, a wrong size and a refused start, naming them") {
  state_registry reg;
  std::int64_t step = 7;
  std::vector<std::int64_t> list = {1, 2, 3};
  reg.add_value({.name = "step"}, &step);
  reg.add({.name = "list",
           .variable_size = true,
           .element_size = 8,
           .bytes = [&] { return list.size() * 8; },
           .save = [&](std::span<std::byte> o) { std::memcpy(o.data(), list.data(), o.size()); },
           .load =
               [&](std::span<const std::byte> in) {
                 list.resize(in.size() / 8);
                 std::memcpy(list.data(), in.data(), in.size());
               }});
  checkpoint::file_writer w;
  checkpoint::write_registry(reg, w);
  const checkpoint::file_reader r(w.bytes(), "memory");
  CHECK(r.section_size("step") == 8);
  CHECK(r.section_size("list") == 24);

  // Round trip: a list of another length loads (it is variable), the value comes back.
  step = 0;
  list.assign(5, 0);
  const flat_layout l({{"u", {{"w", {4}}}}}, 1);
  const checkpoint::state_geometry geo{.layout = &l, .fragments = {{0}}, .shape = {1, 1, 1}};
  checkpoint::apply(reg, checkpoint::stage_same(reg, r, geo));
  CHECK(step == 7);
  CHECK(list == std::vector<std::int64_t>{1, 2, 3});

  std::int64_t extra = 0;
  reg.add_value({.name = "extra"}, &extra);
  CHECK_THROWS_WITH_AS(checkpoint::stage_same(reg, r, geo),
                       doctest::Contains("has no section 'extra', which this setup saves"),
                       invalid_argument);

  state_registry small;
  std::int32_t four = 0;
  small.add_value({.name = "step"}, &four);
  CHECK_THROWS_WITH_AS(checkpoint::stage_same(small, r, geo),
                       doctest::Contains("section 'step' holds 8 bytes, this run expects 4"),
                       invalid_argument);

  state_registry refusing;
  double seconds = 0;
  refusing.add_value(
      {.name = "seconds",
       .missing = state_start::refuse,
       .refuse_note = [](const std::map<std::string, std::string>&) { return "it has no clock"; },
       .present = [] { return true; }},
      &seconds);
  CHECK_THROWS_WITH_AS(checkpoint::stage_same(refusing, r, geo),
                       doctest::Contains("has no section 'seconds': it has no clock"),
                       invalid_argument);
}
