// Saving without stopping: save_async snapshots the state and writes it behind training; the
// manifest is written last, so a save that stops at any point (a killed process included)
// leaves the previous checkpoint loadable.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/error.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
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

constexpr std::uint64_t kData = 5;
const mesh_shape kShape{2, 1, 2};
using alg = diloco;
using trainer_t = trainer<mlp_model, alg, optim::adamw, inproc::communicator>;

struct temp_dir : test::temp_dir {
  temp_dir() : test::temp_dir("fedshard-async") {}
};
using test::bit_equal;
using test::contains;

trainer_options<alg> options() {
  trainer_options<alg> o;
  o.total_steps = 10;
  o.schedule.period = 3;
  return o;
}

std::vector<test::sample> batch_at(trainer_t& t, int step) {
  const auto c = t.topology().coords();
  return t.model().batch(kData, step, c.group, kShape.groups, c.shard, kShape.shards, 2);
}

struct outcome {
  std::vector<float> params;
  std::int64_t step = -1;
  std::int64_t loaded_step = -1;
};

/// Fresh trainers on every rank: load(load_dir) first when given, then steps up to `to`;
/// `at(t, step)` runs before each step (and once more at `to`).
template <class At>
std::vector<outcome> run(int to, const fs::path& load_dir, At&& at) {
  return test::collect_ranks(kShape.size(), [&](inproc::communicator& world) {
    mesh m(world, kShape);
    trainer_t t(m, mlp_model{}, {.lr = 1e-2f}, options());
    outcome o;
    if (!load_dir.empty()) t.load(load_dir);
    o.loaded_step = t.step_count();
    for (auto step = static_cast<int>(t.step_count());; ++step) {
      at(t, step);
      if (step == to) break;
      t.step(batch_at(t, step));
    }
    t.wait_for_save();
    o.params = t.parameters();
    o.step = t.step_count();
    return o;
  });
}
std::vector<outcome> run(int to, const fs::path& load_dir = {}) {
  return run(to, load_dir, [](trainer_t&, int) {});
}

void check_same(const std::vector<outcome>& got, const std::vector<outcome>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t r = 0; r < got.size(); ++r) {
    CAPTURE(r);
    CHECK(got[r].step == want[r].step);
    CHECK(bit_equal(got[r].params, want[r].params));
  }
}

}  // namespace

TEST_CASE(
    "save_async: training goes on while it writes, the checkpoint is the state at the call, "
    "and resuming from it is bit-identical") {
  temp_dir dir;
  const auto straight = run(10);
  bool was_in_flight = false;
  const auto saver = run(10, {}, [&](trainer_t& t, int step) {
    if (step == 4) t.save_async(dir.path);
    if (step == 5 && t.topology().rank() == 0) was_in_flight = was_in_flight || t.save_in_flight();
  });
  check_same(saver, straight);  // the save does not perturb the run
  MESSAGE("a save was still in flight one step later: ", was_in_flight);
  const auto resumed = run(10, dir.path);
  for (const auto& r : resumed) CHECK(r.loaded_step == 4);
  check_same(resumed, straight);

  // A second save_async waits for the first; the last one is what loads; stale files go.
  const auto twice = run(10, {}, [&](trainer_t& t, int step) {
    if (step == 6 || step == 7) t.save_async(dir.path);
  });
  check_same(twice, straight);
  for (const auto& r : run(10, dir.path)) CHECK(r.loaded_step == 7);
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path)) names.insert(e.path().filename().string());
  CHECK(names.size() == 1 + static_cast<std::size_t>(kShape.size()));  // manifest + rank files
}

TEST_CASE(
    "a save that stopped after any number of rank files, or before its manifest was renamed, "
    "leaves the previous checkpoint loadable") {
  temp_dir previous, next;
  run(3, {}, [&](trainer_t& t, int step) {
    if (step == 3) t.save(previous.path);
  });
  run(6, {}, [&](trainer_t& t, int step) {
    if (step == 6) t.save(next.path);
  });
  const auto want = run(10, previous.path);
  const auto next_id = ck::saved_checkpoint::open(next.path).id();
  for (int written = 0; written <= kShape.size(); ++written) {
    CAPTURE(written);
    temp_dir dir;
    fs::copy(previous.path, dir.path, fs::copy_options::recursive);
    // What the interrupted save into dir had written: some of its rank files, a temporary.
    for (int r = 0; r < written; ++r)
      fs::copy_file(next.path / ck::rank_file_name(r, next_id),
                    dir.path / ck::rank_file_name(r, next_id));
    if (written < kShape.size())
      std::ofstream(dir.path / (ck::rank_file_name(written, next_id) + ".tmp")) << "partial";
    else
      fs::copy_file(next.path / ck::manifest_file_name,
                    dir.path / (std::string(ck::manifest_file_name) + ".tmp"));
    const auto got = run(10, dir.path);
    for (const auto& r : got) CHECK(r.loaded_step == 3);
    check_same(got, want);
  }
}

TEST_CASE("a process killed in the middle of save_async leaves the previous checkpoint loadable") {
  temp_dir dir;
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // The child: a complete save after step 3, then a save_async after step 6, killed as soon
    // as the first file of the new save appears (or after 2 s).
    std::set<std::string> before;
    run(7, {}, [&](trainer_t& t, int step) {
      if (step == 3) {
        t.save(dir.path);
        if (t.topology().rank() == 0)  // the rank that watches for the new save's files
          for (const auto& e : fs::directory_iterator(dir.path))
            before.insert(e.path().filename().string());
      }
      if (step != 6) return;
      t.save_async(dir.path);
      (void)t.mean_over_world(0.0);  // every rank has started its save
      if (t.topology().rank() != 0) return;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      for (bool fresh = false; !fresh && std::chrono::steady_clock::now() < deadline;) {
        std::error_code ec;
        for (const auto& e : fs::directory_iterator(dir.path, ec))
          fresh = fresh || !before.count(e.path().filename().string());
      }
      ::kill(::getpid(), SIGKILL);
    });
    ::_exit(3);  // not reached
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) REQUIRE(errno == EINTR);
  REQUIRE(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGKILL);
  // The checkpoint in dir is the one of step 3, or, had the new save finished before the
  // kill, the one of step 6: either way complete, and resuming from it is the straight run.
  const auto straight = run(10);
  const auto resumed = run(10, dir.path);
  const auto step = resumed.front().loaded_step;
  MESSAGE("the killed save_async left the checkpoint of step ", step);
  CHECK((step == 3 || step == 6));
  check_same(resumed, straight);
}

TEST_CASE("save_job: world rank 0 writes no manifest while a rank's file is missing or failed") {
  temp_dir dir;
  ck::save_job job;
  job.dir = dir.path;
  job.id = 42;
  job.rank = 0;
  job.size = 3;
  job.rank_file.add_text("x", "rank 0");
  job.manifest.add_text("manifest", "");
  job.wait_for_peers = std::chrono::milliseconds(50);
  std::ofstream(dir.path / ck::rank_file_name(1, 42)) << "rank 1";
  CHECK_THROWS_WITH_AS(job.run(true),
                       doctest::Contains("world rank 2's file rank-00002-000000000000002a.bin did "
                                         "not appear"),
                       timeout_error);
  CHECK_FALSE(fs::exists(dir.path / ck::manifest_file_name));
  std::ofstream(dir.path / ck::detail::failure_note_name(2, 42)) << "failed";
  job.wait_for_peers = std::chrono::minutes(1);
  CHECK_THROWS_WITH_AS(job.run(true), doctest::Contains("world rank 2 could not write its file"),
                       backend_error);
  CHECK_FALSE(fs::exists(dir.path / ck::manifest_file_name));
  std::ofstream(dir.path / ck::rank_file_name(2, 42)) << "rank 2";
  CHECK_NOTHROW(job.run(true));
  CHECK(fs::exists(dir.path / ck::manifest_file_name));
}

TEST_CASE("save_async into a path that cannot be a directory fails on every rank") {
  temp_dir dir;
  const fs::path file = dir.path / "plain-file";
  std::ofstream(file) << "not a directory";
  const auto errors = test::collect_ranks(kShape.size(), [&](inproc::communicator& world) {
    mesh m(world, kShape);
    trainer_t t(m, mlp_model{}, {.lr = 1e-2f}, options());
    t.step(batch_at(t, 0));
    std::string error;
    try {
      t.save_async(file / "ckpt");
    } catch (const std::exception& e) {
      error = e.what();
    }
    t.step(batch_at(t, 1));  // still trains
    return error;
  });
  for (std::size_t r = 0; r < errors.size(); ++r) {
    CAPTURE(errors[r]);
    CHECK(contains(errors[r], r == 0 ? "plain-file" : "failed on world rank 0"));
  }
}
