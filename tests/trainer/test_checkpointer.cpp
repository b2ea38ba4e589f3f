// checkpoint::checkpointer on its own, without a trainer: a registry of two records (a step
// count and a small vector of doubles) on one rank, whose agreement is the identity.
//  - save() then load() restores the values the save saw;
//  - save_async() snapshots the registry when it is called: values changed right after it
//    are not what a later load restores; wait_for_save() ends the save, and a second
//    save_async() waits for the first;
//  - a save_async() into a directory that cannot be made throws at the call, naming it, and
//    leaves nothing in flight;
//  - a checkpoint saved by one rank is refused, with both sizes named, by a run of two.

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include "fedshard/core/state_registry.hpp"
#include "fedshard/trainer/checkpointer.hpp"
#include "support/files.hpp"

namespace {

using namespace fedshard;
namespace fs = std::filesystem;

/// The state of the toy run: what its registry saves and loads.
struct toy_state {
  std::int64_t step = 0;
  std::vector<double> values = {1.5, -2.0, 0.25};
  state_registry reg;

  toy_state() {
    reg.add_value({.name = "toy.step"}, &step);
    state_entry v{.name = "toy.values"};
    v.element_size = sizeof(double);
    v.bytes = [this] { return values.size() * sizeof(double); };
    v.save = [this](std::span<std::byte> out) {
      std::memcpy(out.data(), values.data(), out.size());
    };
    v.load = [this](std::span<const std::byte> in) {
      std::memcpy(values.data(), in.data(), in.size());
    };
    reg.add(std::move(v));
  }
};

/// One rank of `size`, its agreement the identity (a single process plays every rank's part
/// only where the test says so).
checkpoint::checkpoint_run run_of(int size, std::vector<std::string>* log = nullptr) {
  checkpoint::checkpoint_run r;
  r.rank = 0;
  r.size = size;
  r.agree = [](double x, reduce_op) { return x; };
  r.fields.fields["format"] = "2";
  r.fields.fields["toy"] = "two records";
  r.describe = [](checkpoint::file_writer&) {};
  r.log = [log](const std::string& line) {
    if (log != nullptr) log->push_back(line);
  };
  return r;
}

}  // namespace

TEST_CASE("checkpointer: save then load restores the values the save saw") {
  test::temp_dir dir("fedshard-checkpointer");
  toy_state s;
  checkpoint::checkpointer c(s.reg);
  s.step = 41;
  c.save(dir.path, run_of(1));
  s.step = 7;
  s.values = {9.0, 9.0, 9.0};
  c.load(dir.path, run_of(1));
  CHECK(s.step == 41);
  CHECK(s.values == std::vector<double>{1.5, -2.0, 0.25});
}

TEST_CASE("checkpointer: save_async snapshots the registry when it is called") {
  test::temp_dir dir("fedshard-checkpointer-async");
  const fs::path first = dir.path / "first", second = dir.path / "second";
  toy_state s;
  checkpoint::checkpointer c(s.reg);
  s.step = 100;
  c.save_async(first, run_of(1));
  s.step = 200;  // after the snapshot: not in `first`
  s.values[0] = 3.0;
  c.save_async(second, run_of(1));  // waits for the first
  c.wait_for_save(run_of(1));
  CHECK_FALSE(c.save_in_flight());
  c.load(first, run_of(1));
  CHECK(s.step == 100);
  CHECK(s.values[0] == 1.5);
  c.load(second, run_of(1));
  CHECK(s.step == 200);
  CHECK(s.values[0] == 3.0);
}

TEST_CASE("checkpointer: a save_async whose directory cannot be made throws at the call") {
  test::temp_dir dir("fedshard-checkpointer-fail");
  const fs::path file = dir.path / "a-file";
  std::ofstream(file) << "not a directory";
  const fs::path bad = file / "checkpoint";  // under a regular file: cannot be made
  toy_state s;
  checkpoint::checkpointer c(s.reg);
  // Every rank hears it (rank 0 makes the directory; the agreement spreads its outcome).
  CHECK_THROWS_WITH_AS(c.save_async(bad, run_of(1)), doctest::Contains("cannot create directories"),
                       std::exception);
  CHECK_THROWS_WITH_AS(c.save_async(bad, run_of(1)), doctest::Contains(bad.string().c_str()),
                       std::exception);
  CHECK_FALSE(c.save_in_flight());  // nothing was started: a later save works
  c.save(dir.path / "good", run_of(1));
}

TEST_CASE("checkpointer: a checkpoint of one rank is refused by a run of two, naming both") {
  test::temp_dir dir("fedshard-checkpointer-size");
  toy_state s;
  checkpoint::checkpointer c(s.reg);
  c.save(dir.path, run_of(1));
  s.step = 5;
  CHECK_THROWS_WITH_AS(c.load(dir.path, run_of(2)),
                       doctest::Contains("was saved by 1 ranks, its manifest names this run's "
                                         "mesh of 2"),
                       invalid_argument);
  CHECK(s.step == 5);  // nothing changed
}
