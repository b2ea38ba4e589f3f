// Checkpoints written by an earlier version of fedshard still load: the fixtures under
// tests/data/checkpoints/ were written by main at 29caae3 (before the state registry), with
// the file format of version 2. Each holds one run saved mid-way and what that run did next
// (expected.bin: every rank's parameters at the save and at the end of the run).
//
// The checks do not rebuild their expectation with the code under test: the parameters at the
// save and the run's end come from the old code; loading and saving again at once must write
// every state section the old code wrote, byte for byte; and the state each section holds is
// what the old code's run went on from, so resuming ends bit-identically.
//
// To write the fixtures again (only with the code of the commit named above):
//   FEDSHARD_WRITE_FIXTURES=<dir> test_trainer_checkpoint_compat --no-skip
//     --test-case='write the fixtures'
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fedshard/codec/topk.hpp"
#include "fedshard/comm/inproc.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/trainer/checkpoint.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/files.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;
using test::mlp_model;
namespace fs = std::filesystem;
namespace ck = fedshard::checkpoint;

namespace {

constexpr std::uint64_t kData = 23;

template <int K>
using every = defaults<schedule::periodic::config{.period = K}>;

/// SparseLoCo-like: top-k with error feedback on the outer SGD's pseudo-gradients (chunk 16,
/// k 2, 2 bits: sparse even on the test model's small shards; sloco_scenario sets them).
using sloco = algorithm<
    shard::hybrid_shard,
    federation::with_codec<federation::outer_optimizer<federation::outer_sgd>, codec::topk>,
    schedule::periodic, every<2>>;

/// A run: its mesh, settings, the step it saves after and the step it ends at.
template <class Alg, class Opt>
struct scenario {
  mesh_shape shape;
  typename Opt::config oc{};
  trainer_options<Alg> opts{};
  int save_at = 0;
  int end = 0;
};

/// The fixtures: a streaming DiLoCo run saved with fragment 1's sync in flight (H = 6, P = 3,
/// tau = 1: fragment 1 starts after step 2 and applies after step 3), DiLoCo with SGD momentum
/// on a hybrid mesh saved after one outer step, and SparseLoCo's error-feedback residuals.
scenario<streaming_diloco, optim::adamw> streaming_scenario() {
  scenario<streaming_diloco, optim::adamw> s{{2, 1, 2}, {.lr = 1e-2f}};
  s.opts.schedule = {.period = 6, .fragments = 3, .delay = 1, .alpha = 0.5f};
  s.opts.total_steps = 12;
  s.save_at = 3;
  s.end = 12;
  return s;
}
scenario<diloco, optim::sgd> diloco_scenario() {
  scenario<diloco, optim::sgd> s{{2, 2, 1}, {.lr = 0.05f, .momentum = 0.9f}};
  s.opts.schedule = {.period = 4};
  s.opts.total_steps = 11;
  s.save_at = 6;
  s.end = 11;
  return s;
}
scenario<sloco, optim::adamw> sloco_scenario() {
  scenario<sloco, optim::adamw> s{{2, 2, 1}, {.lr = 1e-2f}};
  s.opts.federation.codec = {.chunk = 16, .k = 2, .bits = 2};
  s.opts.total_steps = 9;
  s.save_at = 5;
  s.end = 9;
  return s;
}

template <class T>
std::vector<test::sample> batch_at(T& t, const mesh_shape& shape, int step) {
  auto& m = t.topology();
  const int local = m.coords().replica * shape.shards + m.coords().shard;
  return t.model().batch(kData, step, m.coords().group, shape.groups, local,
                         shape.replicas * shape.shards, 2);
}

/// Every rank's parameters at the save and at the end.
struct outcome {
  std::vector<std::vector<float>> at_save, at_end;
  std::vector<std::int64_t> loaded_step;
};

/// Runs the scenario on fresh trainers: from step 0 saving into save_dir at save_at, or from
/// the checkpoint in load_dir; both go on to the end.
template <class Alg, class Opt>
outcome run(const scenario<Alg, Opt>& s, const fs::path& save_dir, const fs::path& load_dir) {
  const auto n = static_cast<std::size_t>(s.shape.size());
  outcome out{std::vector<std::vector<float>>(n), std::vector<std::vector<float>>(n),
              std::vector<std::int64_t>(n, -1)};
  test::spawn_ranks(s.shape.size(), [&](inproc::communicator& world) {
    mesh m(world, s.shape);
    trainer<mlp_model, Alg, Opt, inproc::communicator> t(m, mlp_model{}, s.oc, s.opts);
    const auto r = static_cast<std::size_t>(world.rank());
    int step = 0;
    if (!load_dir.empty()) {
      t.load(load_dir);
      step = static_cast<int>(t.step_count());
      out.loaded_step[r] = step;
      out.at_save[r] = t.parameters();
    }
    for (; step < s.end; ++step) {
      if (step == s.save_at && !save_dir.empty()) {
        t.save(save_dir);
        out.at_save[r] = t.parameters();
      }
      t.step(batch_at(t, s.shape, step));
    }
    out.at_end[r] = t.parameters();
  });
  return out;
}

void write_outcome(const fs::path& p, const outcome& o) {
  ck::file_writer w;
  for (std::size_t r = 0; r < o.at_save.size(); ++r) {
    w.add_span("at_save" + std::to_string(r), std::span<const float>(o.at_save[r]));
    w.add_span("at_end" + std::to_string(r), std::span<const float>(o.at_end[r]));
  }
  w.write(p);
}

outcome read_outcome(const fs::path& p, std::size_t ranks) {
  const auto f = ck::file_reader::open(p);
  outcome o;
  for (std::size_t r = 0; r < ranks; ++r) {
    auto read = [&](const std::string& name) {
      std::vector<float> v(f.section(name).size() / sizeof(float));
      f.read_span(name, std::span<float>(v));
      return v;
    };
    o.at_save.push_back(read("at_save" + std::to_string(r)));
    o.at_end.push_back(read("at_end" + std::to_string(r)));
  }
  return o;
}

fs::path fixture(std::string_view name) {
  return fs::path(FEDSHARD_TEST_DATA_DIR) / "checkpoints" / name;
}

template <class Alg, class Opt>
void write_fixture(const fs::path& root, std::string_view name, const scenario<Alg, Opt>& s) {
  const fs::path dir = root / name;
  fs::create_directories(dir / "checkpoint");
  write_outcome(dir / "expected.bin", run(s, dir / "checkpoint", {}));
}

/// Loads the fixture, resumes to the end: the parameters right after the load are the ones
/// the old code had at its save, and the end is the old code's end, bit for bit.
template <class Alg, class Opt>
void check_resumes(std::string_view name, const scenario<Alg, Opt>& s) {
  const auto ranks = static_cast<std::size_t>(s.shape.size());
  const outcome want = read_outcome(fixture(name) / "expected.bin", ranks);
  const outcome got = run(s, {}, fixture(name) / "checkpoint");
  for (std::size_t r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(got.loaded_step[r] == s.save_at);
    CHECK(test::bit_equal(got.at_save[r], want.at_save[r]));
    CHECK(test::bit_equal(got.at_end[r], want.at_end[r]));
  }
}

/// Loads the fixture and saves again at once: every section of every rank file is written
/// again, byte for byte (the manifest's save id differs, the sections do not).
template <class Alg, class Opt>
void check_saves_the_same(std::string_view name, const scenario<Alg, Opt>& s) {
  test::temp_dir again("fedshard-compat");
  test::spawn_ranks(s.shape.size(), [&](inproc::communicator& world) {
    mesh m(world, s.shape);
    trainer<mlp_model, Alg, Opt, inproc::communicator> t(m, mlp_model{}, s.oc, s.opts);
    t.load(fixture(name) / "checkpoint");
    t.save(again.path);
  });
  const auto old_ck = ck::saved_checkpoint::open(fixture(name) / "checkpoint");
  const auto new_ck = ck::saved_checkpoint::open(again.path);
  for (int r = 0; r < s.shape.size(); ++r) {
    CAPTURE(r);
    const auto& a = old_ck.rank_file(r);
    const auto& b = new_ck.rank_file(r);
    const auto names_a = a.names(), names_b = b.names();
    CHECK(std::set<std::string>(names_a.begin(), names_a.end()) ==
          std::set<std::string>(names_b.begin(), names_b.end()));
    for (const auto& n : names_a) {
      if (n == "save_id") continue;  // each save has its own
      CAPTURE(n);
      CHECK(a.section(n) == b.section(n));
    }
  }
}

}  // namespace

TEST_CASE("write the fixtures" * doctest::skip()) {
  const char* root = std::getenv("FEDSHARD_WRITE_FIXTURES");
  REQUIRE_MESSAGE(root != nullptr, "set FEDSHARD_WRITE_FIXTURES to the directory to write");
  write_fixture(root, "streaming", streaming_scenario());
  write_fixture(root, "diloco", diloco_scenario());
  write_fixture(root, "sparseloco", sloco_scenario());
}

TEST_CASE("a checkpoint written before the state registry resumes bit-identically") {
  SUBCASE("streaming DiLoCo, a fragment's sync in flight") {
    check_resumes("streaming", streaming_scenario());
  }
  SUBCASE("DiLoCo, SGD momentum, hybrid mesh") {
    check_resumes("diloco", diloco_scenario());
  }
  SUBCASE("SparseLoCo's error-feedback residuals") {
    check_resumes("sparseloco", sloco_scenario());
  }
}

TEST_CASE("a checkpoint written before the state registry is written again section by section") {
  SUBCASE("streaming") {
    check_saves_the_same("streaming", streaming_scenario());
  }
  SUBCASE("diloco") {
    check_saves_the_same("diloco", diloco_scenario());
  }
  SUBCASE("sparseloco") {
    check_saves_the_same("sparseloco", sloco_scenario());
  }
}

TEST_CASE("a checkpoint written before the state registry reshards onto another mesh") {
  // Saved on 2x1x2, loaded on 2x2x1 (group g reads the saver's group g): every rank of group
  // g holds group g's parameters at the save, as the old code had them.
  auto s = streaming_scenario();
  const outcome want = read_outcome(fixture("streaming") / "expected.bin", 4);
  auto other = s;
  other.shape = {2, 2, 1};
  other.end = s.save_at;  // load only
  const outcome got = run(other, {}, fixture("streaming") / "checkpoint");
  for (std::size_t r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(got.loaded_step[r] == s.save_at);
    const std::size_t saver_rank = r / 2 * 2;  // group r / 2's first rank in 2x1x2
    CHECK(test::bit_equal(got.at_save[r], want.at_save[saver_rank]));
  }
}
