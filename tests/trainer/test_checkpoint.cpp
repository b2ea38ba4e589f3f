// Checkpoints: the file format, bit-identical resume (in the same process and in a fresh one),
// refusal of another setup and of torn files on every rank, and never half-loading.
#include <doctest/doctest.h>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <random>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <vector>

#include "fedshard/codec/topk.hpp"
#include "fedshard/comm/inproc.hpp"
#include "fedshard/error.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/trainer/checkpoint.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/files.hpp"
#include "support/spaces.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

extern char** environ;

using namespace fedshard;
using test::mlp_model;
namespace fs = std::filesystem;
namespace ck = fedshard::checkpoint;

namespace {

constexpr std::uint64_t kData = 11;

/// World rank r's file of the checkpoint in dir (its name carries the save's id).
fs::path rank_file(const fs::path& dir, int r) {
  return dir / ck::rank_file_name(r, ck::saved_checkpoint::open(dir).id());
}

struct temp_dir : test::temp_dir {
  temp_dir() : test::temp_dir("fedshard-ckpt") {}
};
using test::bit_equal;
using test::contains;
using test::read_all;
using test::write_all;

/// Everything that defines a run except the steps it covers.
template <class Alg, class Opt>
struct setup {
  mesh_shape shape;
  typename Opt::config oc{};
  trainer_options<Alg> opts{};
  mlp_model model{};
  std::function<int(int group, int step)> batch_size{};  // samples per rank; empty = 2
};

/// The trainer of the tests, on the communicator and memory space of Sp
/// (support/spaces.hpp).
template <class Alg, class Opt, class Sp = test::on_host>
using trainer_t = trainer<mlp_model, Alg, Opt, typename Sp::comm, typename Sp::space>;

/// Default schedule settings of a periodic algorithm that syncs every K steps.
template <int K>
using every = defaults<schedule::periodic::config{.period = K}>;

/// The batch of this rank at a (global) step: the same whichever process trains it.
template <class Alg, class Opt, class T>
std::vector<test::sample> batch_at(T& t, const setup<Alg, Opt>& s, int step) {
  auto& m = t.topology();
  const int g = m.coords().group;
  const int local = m.coords().replica * s.shape.shards + m.coords().shard;
  const int n = s.batch_size ? s.batch_size(g, step) : 2;
  return t.model().batch(kData, step, g, s.shape.groups, local, s.shape.replicas * s.shape.shards,
                         n);
}

/// What one world rank ended a leg with.
struct rank_result {
  std::vector<float> params;
  std::int64_t step = -1;
  std::int64_t syncs = -1;                            // syncs_applied()
  std::vector<std::vector<std::int64_t>> sync_steps;  // per fragment
  std::vector<std::int64_t> outer_steps;              // per fragment, outer optimizers only
  std::int64_t loaded_step = -1;                      // step_count() right after load()
  std::vector<float> params_at_save;                  // parameters() right after save()
  std::int64_t fed_calls_at_save = -1;  // federation collectives started before save()
  std::int64_t syncs_at_save = -1;      // syncs applied before save()
};
using result = std::vector<rank_result>;

/// Fresh trainers on every rank (on the communicator and space of Sp); load(load_dir) first
/// when given; then steps [from, to), with save(save_dir) when the step count reaches save_at.
template <class Sp = test::on_host, class Alg, class Opt>
result leg(const setup<Alg, Opt>& s, int from, int to, const fs::path& load_dir = {},
           int save_at = -1, const fs::path& save_dir = {}) {
  result out(static_cast<std::size_t>(s.shape.size()));
  test::spawn_ranks(s.shape.size(), [&](inproc::communicator& world) {
    auto comm = Sp::wrap(world);
    mesh m(comm, s.shape);
    trainer_t<Alg, Opt, Sp> t(m, s.model, s.oc, s.opts);
    auto& r = out[static_cast<std::size_t>(world.rank())];
    if (!load_dir.empty()) t.load(load_dir);
    r.loaded_step = t.step_count();
    for (int step = from;; ++step) {
      if (step == save_at) {
        r.fed_calls_at_save = t.traffic()[axis::federation].calls;
        r.syncs_at_save = t.syncs_applied();
        t.save(save_dir);
        r.params_at_save = t.parameters();
      }
      if (step == to) break;
      t.step(batch_at(t, s, step));
    }
    r.params = t.parameters();
    r.step = t.step_count();
    r.syncs = t.syncs_applied();
    for (int f = 0; f < t.schedule().fragments(); ++f) {
      r.sync_steps.push_back(t.sync_steps(f));
      if constexpr (requires { t.federation().outer_steps(f); })
        r.outer_steps.push_back(t.federation().outer_steps(f));
    }
  });
  return out;
}

/// Every rank's parameters equal, bit for bit, and the step and sync counts too.
void check_same(const result& got, const result& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t r = 0; r < got.size(); ++r) {
    CAPTURE(r);
    CHECK(got[r].step == want[r].step);
    CHECK(got[r].syncs == want[r].syncs);
    CHECK(got[r].sync_steps == want[r].sync_steps);
    CHECK(got[r].outer_steps == want[r].outer_steps);
    CHECK(bit_equal(got[r].params, want[r].params));
  }
}

// ---- scenarios shared by the parent and the child process -------------------------------

/// Calls f(setup, N, M) for the named scenario: save after N steps, resume for M more.
template <class F>
bool with_scenario(std::string_view name, F&& f) {
  if (name == "fl_hsdp") {
    // K = 3 syncs after steps 2, 5 and the final 7: N = 4 is mid-period.
    setup<fl_hsdp, optim::adamw> s{{2, 2, 2}, {.lr = 1e-2f}};
    s.opts.schedule = {.period = 3};
    s.opts.total_steps = 8;
    f(s, 4, 4);
    return true;
  }
  if (name == "streaming") {
    // H = 6, P = 3, τ = 1: fragment 1 starts after step 2 and applies after step 3, so after
    // N = 3 steps its sync is in flight.
    setup<streaming_diloco, optim::adamw> s{{2, 1, 2}, {.lr = 1e-2f}};
    s.opts.schedule = {.period = 6, .fragments = 3, .delay = 1, .alpha = 0.5f};
    s.opts.total_steps = 12;
    f(s, 3, 9);
    return true;
  }
  if (name == "diloco") {
    // H = 4: outer steps after 3, 7 and the final 10; N = 6 has one outer step and momentum.
    setup<diloco, optim::sgd> s{{2, 2, 1}, {.lr = 0.05f, .momentum = 0.9f}};
    s.opts.schedule = {.period = 4};
    s.opts.total_steps = 11;
    f(s, 6, 5);
    return true;
  }
  return false;
}

constexpr const char* child_dir_env = "FEDSHARD_CKPT_CHILD";
constexpr const char* child_scenario_env = "FEDSHARD_CKPT_SCENARIO";
constexpr const char* child_output = "child-result.bin";

/// Runs this test binary's "checkpoint child process" case in a new process with the two
/// environment variables set; returns its exit status (-1 when it did not exit normally).
int run_child(const fs::path& dir, std::string_view scenario) {
  std::vector<std::string> env_text;
  for (char** e = environ; *e; ++e)
    if (!contains(*e, child_dir_env) && !contains(*e, child_scenario_env))
      env_text.emplace_back(*e);
  env_text.push_back(fedshard::detail::concat(child_dir_env, "=", dir.string()));
  env_text.push_back(fedshard::detail::concat(child_scenario_env, "=", scenario));
  std::vector<char*> envp;
  for (auto& e : env_text) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe", filter = "--test-case=checkpoint child process",
              no_skip = "--no-skip", minimal = "--minimal";
  char* argv[] = {exe.data(), filter.data(), no_skip.data(), minimal.data(), nullptr};
  pid_t pid = 0;
  const int err = ::posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv, envp.data());
  REQUIRE_MESSAGE(err == 0, "posix_spawn failed: ", std::strerror(err));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) REQUIRE(errno == EINTR);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

void write_result(const fs::path& p, const result& res) {
  ck::file_writer w;
  for (std::size_t r = 0; r < res.size(); ++r) {
    w.add_span("params" + std::to_string(r), std::span<const float>(res[r].params));
    w.add_value("step" + std::to_string(r), res[r].step);
    w.add_value("syncs" + std::to_string(r), res[r].syncs);
    for (std::size_t f = 0; f < res[r].sync_steps.size(); ++f)
      w.add_span(fedshard::detail::concat("sync_steps", r, ".", f),
                 std::span<const std::int64_t>(res[r].sync_steps[f]));
    w.add_span("outer_steps" + std::to_string(r),
               std::span<const std::int64_t>(res[r].outer_steps));
    w.add_value("loaded_step" + std::to_string(r), res[r].loaded_step);
  }
  w.write(p);
}

/// The child's result; `like` (the parent's straight run) gives the sizes to expect.
result read_result(const fs::path& p, const result& like) {
  const std::size_t ranks = like.size();
  const auto f = ck::file_reader::open(p);
  result res(ranks);
  for (std::size_t r = 0; r < ranks; ++r) {
    res[r].params.resize(like[r].params.size());
    f.read_span("params" + std::to_string(r), std::span<float>(res[r].params));
    res[r].step = f.read_value<std::int64_t>("step" + std::to_string(r));
    res[r].syncs = f.read_value<std::int64_t>("syncs" + std::to_string(r));
    for (std::size_t i = 0; i < like[r].sync_steps.size(); ++i) {
      const auto name = fedshard::detail::concat("sync_steps", r, ".", i);
      res[r].sync_steps.emplace_back(f.section(name).size() / sizeof(std::int64_t));
      f.read_span(name, std::span<std::int64_t>(res[r].sync_steps.back()));
    }
    res[r].outer_steps.resize(like[r].outer_steps.size());
    f.read_span("outer_steps" + std::to_string(r), std::span<std::int64_t>(res[r].outer_steps));
    res[r].loaded_step = f.read_value<std::int64_t>("loaded_step" + std::to_string(r));
  }
  return res;
}

}  // namespace

// The restoring half of the fresh-process test: does nothing unless the parent named the
// checkpoint directory and the scenario (it is skipped by default and run with --no-skip).
TEST_CASE("checkpoint child process" * doctest::skip()) {
  const char* dir = std::getenv(child_dir_env);
  const char* scenario = std::getenv(child_scenario_env);
  if (dir == nullptr || scenario == nullptr) return;
  const bool known = with_scenario(scenario, [&](const auto& s, int n, int m) {
    write_result(fs::path(dir) / child_output, leg(s, n, n + m, dir));
  });
  REQUIRE_MESSAGE(known, "unknown scenario ", scenario);
}

// ---- resume -------------------------------------------------------------------------------

TEST_CASE(
    "training N steps, saving, and resuming in a fresh process for M more is "
    "bit-identical to N + M steps straight") {
  for (const std::string name : {"fl_hsdp", "streaming", "diloco"}) {
    CAPTURE(name);
    with_scenario(name, [&](const auto& s, int n, int m) {
      temp_dir dir;
      const result straight = leg(s, 0, n + m);
      const result first = leg(s, 0, n, {}, n, dir.path);
      for (std::size_t r = 0; r < first.size(); ++r) {
        CHECK(first[r].step == n);
        // the checkpoint is not the end state: the resumed run has real work to do
        CHECK_FALSE(bit_equal(first[r].params, straight[r].params));
      }
      if (name == "streaming")
        for (const auto& r : first) CHECK(r.fed_calls_at_save == r.syncs_at_save + 1);
      REQUIRE(run_child(dir.path, name) == 0);
      const result child = read_result(dir.path / child_output, straight);
      for (const auto& r : child) CHECK(r.loaded_step == n);
      check_same(child, straight);
    });
  }
}

// On every test space (support/spaces.hpp): a save reads state that streams are still
// writing, a load writes state that streams read next; a missing wait shows as a difference.
// A checkpoint holds host values, so one saved in one space resumes in another.
TEST_CASE_TEMPLATE(
    "resuming in the same process is bit-identical, and saving does not perturb the run", Sp,
    FEDSHARD_TEST_SPACES) {
  auto check = [](const auto& s, int n, int m) {
    temp_dir dir;
    const result straight = leg<Sp>(s, 0, n + m);
    const result saver = leg<Sp>(s, 0, n + m, {}, n, dir.path);  // saves at n and keeps going
    check_same(saver, straight);
    const result resumed = leg<Sp>(s, n, n + m, dir.path);
    for (const auto& r : resumed) CHECK(r.loaded_step == n);
    check_same(resumed, straight);
    CHECK_FALSE(bit_equal(saver[0].params_at_save, straight[0].params));
    if constexpr (!std::is_same_v<Sp, test::on_host>) {
      check_same(straight, leg(s, 0, n + m));  // the same run as in host memory
      check_same(leg<test::on_host>(s, n, n + m, dir.path), straight);  // resumed there
    }
  };
  SUBCASE("weighted_average with unequal tokens per group, SGD with momentum, lr schedule") {
    // K = 3 syncs after steps 2 and 5; saved after step 3, whose tokens (3 vs 2 per rank)
    // count towards the sync after step 5 (3 + 1 + 1 vs 2 + 2 + 2): without them the weights
    // would be 1 : 2 instead of 5 : 6.
    using wavg =
        algorithm<shard::full_shard, federation::weighted_average, schedule::periodic, every<3>>;
    setup<wavg, optim::sgd> s{{2, 1, 2}, {.lr = 0.1f, .momentum = 0.9f}};
    s.batch_size = [](int g, int step) { return g == 0 ? (step < 4 ? 3 : 1) : 2; };
    s.opts.total_steps = 9;
    s.opts.lr_schedule = [](std::int64_t step) { return 0.1f / static_cast<float>(1 + step); };
    check(s, 4, 5);
  }
  SUBCASE("fedadam outer optimizer (moments and step count), inner moments averaged") {
    using fedadam = algorithm<shard::hybrid_shard, federation::outer_optimizer<federation::fedadam>,
                              schedule::periodic, every<2>>;
    setup<fedadam, optim::adamw> s{{2, 2, 1}, {.lr = 1e-2f}};
    s.opts.federation.average_inner_moments = true;
    s.opts.federation.rule.lr = 0.1f;
    s.opts.total_steps = 8;
    check(s, 5, 3);
  }
  SUBCASE("streaming DiLoCo saved with a fragment in flight") {
    with_scenario("streaming", check);
  }
  SUBCASE("streaming DiLoCo saved right after a fragment applied") {
    setup<streaming_diloco, optim::adamw> s{{2, 1, 2}, {.lr = 1e-2f}};
    s.opts.schedule = {.period = 6, .fragments = 3, .delay = 1, .alpha = 0.5f};
    s.opts.total_steps = 12;
    check(s, 4, 8);
  }
}

// The topk codec's error-feedback residual is state: a resumed run needs it to send what the
// straight run sends (without it the first sync after the resume differs).
TEST_CASE("sparseloco: resuming is bit-identical, its codec residuals saved and restored") {
  using sloco = algorithm<
      shard::hybrid_shard,
      federation::with_codec<federation::outer_optimizer<federation::outer_sgd>, codec::topk>,
      schedule::periodic, every<2>>;
  setup<sloco, optim::adamw> s{{2, 2, 1}, {.lr = 1e-2f}};
  s.opts.federation.codec = {.chunk = 16, .k = 2, .bits = 2};  // sparse on small shards
  s.opts.total_steps = 9;
  temp_dir dir;
  const result straight = leg(s, 0, 9);
  const result saver = leg(s, 0, 9, {}, 5, dir.path);
  check_same(saver, straight);
  const result resumed = leg(s, 5, 9, dir.path);
  for (const auto& r : resumed) CHECK(r.loaded_step == 5);
  check_same(resumed, straight);
}

// ---- refusals -----------------------------------------------------------------------------

namespace {

/// One rank's view of a load() attempt.
struct attempt {
  std::string error;  // empty when load() succeeded
  std::string kind;   // "invalid_argument", "backend_error", "other"
  std::vector<float> before, after;
  std::int64_t step_before = -1, step_after = -1;
  std::vector<float> final_params;  // after recovering (see try_load)
};

/// Fresh trainers take `pre` steps, then try load(dir) on every rank. When recover_from is
/// given they then load it and train to step `recover_to`.
template <class Alg, class Opt>
std::vector<attempt> try_load(const setup<Alg, Opt>& s, int pre, const fs::path& dir,
                              const fs::path& recover_from = {}, int recover_to = 0) {
  std::vector<attempt> out(static_cast<std::size_t>(s.shape.size()));
  test::spawn_ranks(s.shape.size(), [&](inproc::communicator& world) {
    mesh m(world, s.shape);
    trainer_t<Alg, Opt> t(m, s.model, s.oc, s.opts);
    auto& a = out[static_cast<std::size_t>(world.rank())];
    for (int step = 0; step < pre; ++step) t.step(batch_at(t, s, step));
    a.before = t.parameters();
    a.step_before = t.step_count();
    try {
      t.load(dir);
    } catch (const invalid_argument& e) {
      a.error = e.what();
      a.kind = "invalid_argument";
    } catch (const backend_error& e) {
      a.error = e.what();
      a.kind = "backend_error";
    } catch (const std::exception& e) {
      a.error = e.what();
      a.kind = "other";
    }
    a.after = t.parameters();
    a.step_after = t.step_count();
    if (recover_from.empty()) return;
    t.load(recover_from);
    for (auto step = t.step_count(); step < recover_to; ++step)
      t.step(batch_at(t, s, static_cast<int>(step)));
    a.final_params = t.parameters();
  });
  return out;
}

/// Every rank failed and kept its state exactly.
void check_refused_unchanged(const std::vector<attempt>& as) {
  for (std::size_t r = 0; r < as.size(); ++r) {
    CAPTURE(r);
    CAPTURE(as[r].error);
    CHECK_FALSE(as[r].error.empty());
    CHECK(as[r].step_after == as[r].step_before);
    CHECK(bit_equal(as[r].after, as[r].before));
  }
}

using ckpt_alg = diloco;
using ckpt_opt = optim::adamw;
/// The run whose checkpoints the refusal tests corrupt: DiLoCo on {2,1,2}, AdamW.
setup<ckpt_alg, ckpt_opt> ckpt_setup() {
  setup<ckpt_alg, ckpt_opt> s{{2, 1, 2}, {.lr = 1e-2f}};
  s.opts.schedule = {.period = 3};
  s.opts.total_steps = 8;
  return s;
}

}  // namespace

TEST_CASE(
    "a checkpoint of another model, or a rank file of another setup, is refused on every "
    "rank, naming the difference") {
  temp_dir dir;
  leg(ckpt_setup(), 0, 4, {}, 4, dir.path);

  SUBCASE("hidden width 16 loaded with hidden width 12") {
    auto s = ckpt_setup();
    s.model.net.h = 12;
    const auto as = try_load(s, 1, dir.path);
    check_refused_unchanged(as);
    for (const auto& a : as) {
      CAPTURE(a.error);
      CHECK(a.kind == "invalid_argument");
      CHECK(contains(a.error, "holds another model than this run's"));
      CHECK(contains(a.error,
                     "tensor 'layer0.w0' has shape [16, 8] in the checkpoint, [12, 8] "
                     "in this run"));
      CHECK(contains(a.error, dir.path.string()));
    }
  }
  SUBCASE("one rank's file from a run with another layout") {
    auto narrow = ckpt_setup();
    narrow.model.net.h = 12;
    temp_dir other;
    leg(narrow, 0, 2, {}, 2, other.path);
    fs::copy_file(rank_file(other.path, 2), rank_file(dir.path, 2),
                  fs::copy_options::overwrite_existing);
    const auto as = try_load(ckpt_setup(), 1, dir.path);
    check_refused_unchanged(as);
    for (std::size_t r = 0; r < as.size(); ++r) {
      CAPTURE(as[r].error);
      CHECK(as[r].kind == "invalid_argument");
      if (r == 2) {
        CHECK(contains(as[r].error, rank_file(dir.path, 2).string()));
        CHECK(contains(as[r].error, "layout: checkpoint has '"));
      } else {
        CHECK(contains(as[r].error, "world rank 2"));
      }
    }
  }
  SUBCASE("a directory that does not exist") {
    const auto missing = dir.path / "no-such-checkpoint";
    const auto as = try_load(ckpt_setup(), 1, missing);
    check_refused_unchanged(as);
    for (const auto& a : as) {
      CAPTURE(a.error);
      CHECK(a.kind == "backend_error");
      CHECK(contains(a.error, (missing / "manifest.bin").string()));
    }
  }
  SUBCASE("one rank's file is missing") {
    fs::remove(rank_file(dir.path, 2));
    const auto as = try_load(ckpt_setup(), 1, dir.path);
    check_refused_unchanged(as);
    for (std::size_t r = 0; r < as.size(); ++r) {
      CAPTURE(as[r].error);
      if (r == 2) {
        CHECK(as[r].kind == "backend_error");
        CHECK(contains(as[r].error, (dir.path / "rank-00002-").string()));
      } else {
        CHECK(as[r].kind == "invalid_argument");
        CHECK(contains(as[r].error, "world rank 2"));
      }
    }
  }
}

TEST_CASE("a torn, truncated or corrupt file is refused on every rank and nothing is half-loaded") {
  const auto s = ckpt_setup();
  temp_dir good;
  leg(s, 0, 4, {}, 4, good.path);
  const result straight = leg(s, 0, 8);
  const std::string original = read_all(rank_file(good.path, 2));
  REQUIRE(original.size() > 64);

  SUBCASE("one rank's file is damaged") {
    struct variant {
      const char* what;
      std::function<std::string(std::string)> damage;
      const char* says;
    };
    const variant variants[] = {
        {"1 byte cut off", [](std::string d) { return d.substr(0, d.size() - 1); }, "truncated"},
        {"half cut off", [](std::string d) { return d.substr(0, d.size() / 2); }, "truncated"},
        {"end marker deleted", [](std::string d) { return d.substr(0, d.size() - 8); },
         "truncated"},
        {"empty", [](std::string) { return std::string(); }, "truncated"},
        {"one byte flipped in the middle",
         [](std::string d) {
           d[d.size() / 2] = static_cast<char>(d[d.size() / 2] ^ 0x10);
           return d;
         },
         "corrupt"},
    };
    for (const auto& v : variants) {
      const std::string what = v.what;
      CAPTURE(what);
      temp_dir bad;
      fs::copy(good.path, bad.path, fs::copy_options::recursive);
      write_all(rank_file(bad.path, 2), v.damage(original));
      // the trainers have a state of their own (2 steps) that a half-load would overwrite
      const auto as = try_load(s, 2, bad.path, good.path, 8);
      check_refused_unchanged(as);
      for (std::size_t r = 0; r < as.size(); ++r) {
        CAPTURE(r);
        CAPTURE(as[r].error);
        if (r == 2) {
          CHECK(contains(as[r].error, "rank-00002-"));
          CHECK(contains(as[r].error, v.says));
        } else {
          CHECK(contains(as[r].error, "world rank 2"));
          CHECK(contains(as[r].error, "no state was changed"));
        }
        // a failed load leaves a trainer that can still load and train normally
        CHECK(bit_equal(as[r].final_params, straight[r].params));
      }
    }
  }
  SUBCASE("a corrupt manifest is refused by every rank itself") {
    temp_dir bad;
    fs::copy(good.path, bad.path, fs::copy_options::recursive);
    std::string m = read_all(bad.path / "manifest.bin");
    REQUIRE(m.size() > 32);
    m[m.size() / 2] = static_cast<char>(m[m.size() / 2] ^ 0x01);
    write_all(bad.path / "manifest.bin", m);
    const auto as = try_load(s, 2, bad.path);
    check_refused_unchanged(as);
    for (const auto& a : as) {
      CAPTURE(a.error);
      CHECK(contains(a.error, (bad.path / "manifest.bin").string()));
      CHECK(contains(a.error, "corrupt"));
    }
  }
}

// A save that stopped half-way leaves some ranks' files from one save and some from an earlier
// one; each file is intact and matches the manifest, so only a check across ranks can see it.
TEST_CASE("rank files from different saves are refused on every rank") {
  const auto s = ckpt_setup();
  temp_dir a, b;
  leg(s, 0, 6, {}, 4, a.path);
  leg(s, 0, 6, {}, 6, b.path);
  fs::copy_file(rank_file(b.path, 1), rank_file(a.path, 1), fs::copy_options::overwrite_existing);
  const auto as = try_load(s, 2, a.path);
  check_refused_unchanged(as);
  for (std::size_t r = 0; r < as.size(); ++r) {
    CAPTURE(r);
    CAPTURE(as[r].error);
    CHECK(contains(as[r].error, r == 1 ? "belongs to another save" : "world rank 1"));
  }
}

// ---- the file format ----------------------------------------------------------------------

namespace {
std::string parse_error(std::string data) {
  try {
    ck::file_reader r(std::move(data), "test.bin");
  } catch (const invalid_argument& e) {
    return e.what();
  }
  return {};
}
std::string read_error(const ck::file_reader& r, const char* section) {
  try {
    (void)r.section(section);
  } catch (const invalid_argument& e) {
    return e.what();
  }
  return {};
}
}  // namespace

TEST_CASE("file_writer and file_reader round-trip text, spans and values") {
  ck::file_writer w;
  const std::string text("line one\nkey=value\0binary", 25);
  const std::vector<float> floats{1.5f, -0.0f, 3e-38f, 1e30f};
  const std::vector<std::int64_t> ints{-1, 0, 1LL << 40};
  w.add_text("text", text);
  w.add_span("floats", std::span<const float>(floats));
  w.add_span("ints", std::span<const std::int64_t>(ints));
  w.add_value("double", 0.1);
  w.add_span("empty", std::span<const float>());
  const ck::file_reader r(w.bytes(), "mem");
  CHECK(r.names().size() == 5);
  CHECK(r.section("text") == text);
  std::vector<float> f(4);
  r.read_span("floats", std::span<float>(f));
  CHECK(bit_equal(f, floats));
  std::vector<std::int64_t> i(3);
  r.read_span("ints", std::span<std::int64_t>(i));
  CHECK(i == ints);
  CHECK(r.read_value<double>("double") == 0.1);
  CHECK(r.has("empty"));
  CHECK(r.section("empty").empty());
  CHECK_NOTHROW(r.read_span("empty", std::span<float>()));  // null data(): no memcpy (UBSan)
  CHECK_FALSE(r.has("missing"));
  CHECK(ck::rank_file_name(3, 0xabc) == "rank-00003-0000000000000abc.bin");
  CHECK(ck::rank_file_name(12345, 1) == "rank-12345-0000000000000001.bin");
}

TEST_CASE(
    "file_reader reads any element range across chunks, checking only the chunks it touches") {
  ck::file_writer w(64);  // 16 floats per chunk
  std::vector<float> v(1000);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i) * 0.5f;
  w.add_span("v", std::span<const float>(v));
  w.add_text("tail", "after");
  std::string bytes = w.bytes();
  const ck::file_reader r(bytes, "mem");
  for (const auto& [first, n] : {std::pair{0, 1000}, {15, 2}, {16, 16}, {17, 300}, {999, 1}}) {
    CAPTURE(first);
    std::vector<float> got(static_cast<std::size_t>(n));
    r.read_elements("v", static_cast<std::size_t>(first), std::span<float>(got));
    CHECK(std::equal(got.begin(), got.end(), v.begin() + first));
  }
  std::vector<float> past(2);
  CHECK_THROWS_WITH_AS(
      r.read_elements("v", 999, std::span<float>(past)),
      doctest::Contains("section 'v' holds 4000 bytes, asked for bytes [3996, 4004)"),
      invalid_argument);
  // One flipped byte in element 500 (chunk 31): reads that touch that chunk are refused, the
  // others still succeed.
  bytes[16 + 500 * 4 + 1] = static_cast<char>(bytes[16 + 500 * 4 + 1] ^ 0x40);
  const ck::file_reader damaged(bytes, "damaged.bin");
  std::vector<float> got(10);
  CHECK_NOTHROW(damaged.read_elements("v", 480, std::span<float>(got)));  // chunk 30
  CHECK_THROWS_WITH_AS(damaged.read_elements("v", 490, std::span<float>(got)),
                       doctest::Contains("'damaged.bin' is corrupt: section 'v' fails the "
                                         "checksum of its bytes [1984, 2048)"),
                       invalid_argument);
  CHECK(damaged.section("tail") == "after");
}

TEST_CASE("checksum64 changes with every single-bit flip, word swap and length") {
  std::vector<unsigned char> d(101);
  for (std::size_t i = 0; i < d.size(); ++i) d[i] = static_cast<unsigned char>(i * 37 + 11);
  const std::uint64_t base = ck::checksum64(d.data(), d.size());
  std::set<std::uint64_t> seen{base};
  for (std::size_t bit = 0; bit < d.size() * 8; ++bit) {
    d[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
    seen.insert(ck::checksum64(d.data(), d.size()));
    d[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
  }
  CHECK(seen.size() == 1 + d.size() * 8);  // all different from each other and from base
  // Two flips of the same bit in two words of one lane (what a plain multiply chain misses).
  d[7] ^= 0x80;
  d[39] ^= 0x80;
  CHECK(ck::checksum64(d.data(), d.size()) != base);
  d[7] ^= 0x80;
  d[39] ^= 0x80;
  std::swap_ranges(d.begin(), d.begin() + 8, d.begin() + 32);  // two words of one lane
  CHECK(ck::checksum64(d.data(), d.size()) != base);
  CHECK(ck::checksum64(d.data(), 100) != ck::checksum64(d.data(), 101));
}

TEST_CASE(
    "file_digest: a file's trailer names it, and every changed byte of its data changes "
    "that name; bytes without a trailer are named by checksum64") {
  auto file_of = [](float x) {
    ck::file_writer w(64);  // 16 floats per chunk
    std::vector<float> v(100, 1.0f);
    v[57] = x;
    w.add_span("master", std::span<const float>(v));
    w.add_value("step", std::int64_t{3});
    return w.bytes();
  };
  const std::string a = file_of(1.0f), b = file_of(2.0f);
  // The trailer: u64 contents offset | u64 contents size | u64 checksum | "FEDSHEND".
  std::uint64_t named = 0;
  std::memcpy(&named, a.data() + a.size() - 16, 8);
  CHECK(ck::file_digest(a) == named);
  CHECK(a.capacity() >= a.size());
  ck::file_writer w(64);
  w.add_span("x", std::span<const float>(std::vector<float>(33, 1.0f)));  // 3 chunks
  // header 16 + count 4 + section (4 + 1 name + 8 offset + 8 size + 3 x 8 checksums) + 132 B
  // of data + trailer 32
  CHECK(w.file_bytes() == 16 + 4 + 4 + 1 + 8 + 8 + 24 + 132 + 32);
  CHECK(w.bytes().size() == w.file_bytes());
  CHECK(w.bytes(64).capacity() >= w.file_bytes() + 64);
  CHECK(ck::file_digest(a) != ck::file_digest(b));  // one float of one chunk differs
  const std::string plain = "not a checkpoint file, no trailer at all";
  CHECK(ck::file_digest(plain) == ck::checksum64(plain.data(), plain.size()));
}

TEST_CASE("file_writer::recycle: the next snapshot fills the same buffers") {
  ck::file_writer first;
  const auto a = first.add_elements<float>("master", 1000);
  std::fill(a.begin(), a.end(), 1.5f);
  const char* where = reinterpret_cast<const char*>(a.data());
  ck::file_writer next;
  next.recycle(std::move(first));
  CHECK(first.size_bytes() == 0);
  const auto b = next.add_elements<float>("master", 1000);
  CHECK(reinterpret_cast<const char*>(b.data()) == where);
  const auto c = next.add_elements<float>("other", 10);  // a name it has no buffer for
  CHECK(reinterpret_cast<const char*>(c.data()) != where);
  std::fill(b.begin(), b.end(), 2.0f);
  std::fill(c.begin(), c.end(), 3.0f);
  const ck::file_reader r(next.bytes(), "mem");
  std::vector<float> got(1000);
  r.read_span("master", std::span<float>(got));
  CHECK(got == std::vector<float>(1000, 2.0f));
}

TEST_CASE("new_save_id gives a different id each call, held exactly by a double") {
  const std::uint64_t a = ck::new_save_id(), b = ck::new_save_id();
  CHECK(a != b);
  for (std::uint64_t id : {a, b}) {
    CHECK(id < (std::uint64_t{1} << 53));
    CHECK(static_cast<std::uint64_t>(static_cast<double>(id)) == id);
  }
}

TEST_CASE("file_writer and file_reader report misuse naming what is wrong") {
  ck::file_writer w;
  w.add_value("a", 1.0f);
  CHECK_THROWS_WITH_AS(w.add_value("a", 2.0f), doctest::Contains("'a' added twice"),
                       invalid_argument);
  w.add_span("four", std::span<const float>(std::vector<float>(4)));
  const ck::file_reader r(w.bytes(), "where.bin");
  CHECK_THROWS_WITH_AS(r.section("nope"), doctest::Contains("'where.bin' has no section 'nope'"),
                       invalid_argument);
  std::vector<float> three(3);
  CHECK_THROWS_WITH_AS(r.read_span("four", std::span<float>(three)),
                       doctest::Contains("section 'four' holds 16 bytes, this run expects 12"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(r.read_value<double>("a"),
                       doctest::Contains("section 'a' holds 4 bytes, this run expects 8"),
                       invalid_argument);
}

TEST_CASE("file_reader refuses a damaged header, trailer or table of contents before any read") {
  ck::file_writer w;
  w.add_text("alpha", "first section");
  w.add_text("beta", "second");
  const std::string good = w.bytes();
  REQUIRE(parse_error(good).empty());
  CHECK(contains(parse_error(good.substr(0, 20)), "is truncated: 20 bytes"));
  CHECK(contains(parse_error(good.substr(0, good.size() - 3)), "truncated or torn"));
  CHECK(contains(parse_error("XXXXXXXX" + good.substr(8)), "bad magic"));
  std::string v1 = good;
  v1[7] = '1';
  CHECK(contains(parse_error(v1), "has format version 1, this fedshard reads version 2 only"));
  // The table of contents sits between the data and the 32-byte trailer.
  const std::size_t toc = good.find("alpha");
  REQUIRE(toc != std::string::npos);
  std::string flipped = good;
  flipped[toc + 2] = static_cast<char>(flipped[toc + 2] ^ 1);
  CHECK(contains(parse_error(flipped), "table of contents fails its checksum"));
  std::string moved = good;
  moved[good.size() - 32] = static_cast<char>(moved[good.size() - 32] + 1);  // contents offset
  CHECK(contains(parse_error(moved), "not where its trailer says"));
  // A flipped data byte is found by the read of its section, not before.
  std::string data = good;
  data[16] = 'F';  // the first byte of "first section"
  const ck::file_reader r(data, "test.bin");
  CHECK(
      contains(read_error(r, "alpha"), "section 'alpha' fails the checksum of its bytes [0, 13)"));
  CHECK(r.section("beta") == "second");
}

TEST_CASE(
    "file_reader on 3000 seeded random corruptions: refused with invalid_argument, or read "
    "whole and unchanged") {
  // Each case damages a good file one way (flip bits, overwrite, cut, insert, repeat a run),
  // at random places, from a fixed seed. What must never happen: a crash, an exception other
  // than invalid_argument, or a section read back different from what was written without
  // an error (the checksums must catch every damage that reaches the bytes).
  ck::file_writer w;
  w.add_text("alpha", "first section");
  w.add_text("beta", std::string(300, 'b'));
  w.add_text("gamma", "");
  const std::string good = w.bytes();
  const std::map<std::string, std::string> want{
      {"alpha", "first section"}, {"beta", std::string(300, 'b')}, {"gamma", ""}};
  std::mt19937_64 rng(20261205);
  auto pick = [&](std::size_t n) {
    return static_cast<std::size_t>(rng() % std::max<std::size_t>(n, 1));
  };
  int refused = 0, intact = 0;
  for (int c = 0; c < 3000; ++c) {
    CAPTURE(c);
    std::string bad = good;
    switch (c % 5) {
      case 0:  // flip 1 to 4 bits
        for (std::size_t k = 0, n = 1 + pick(4); k < n; ++k)
          bad[pick(bad.size())] ^= static_cast<char>(1u << pick(8));
        break;
      case 1:  // overwrite a run with random bytes
        for (std::size_t at = pick(bad.size()), k = 0, n = 1 + pick(16);
             k < n && at + k < bad.size(); ++k)
          bad[at + k] = static_cast<char>(rng());
        break;
      case 2:  // cut the file short
        bad.resize(pick(bad.size()));
        break;
      case 3:  // insert random bytes
        bad.insert(pick(bad.size()), std::string(1 + pick(8), static_cast<char>(rng())));
        break;
      default:  // repeat a run of the file elsewhere
        bad.insert(pick(bad.size()), good.substr(pick(good.size()), 1 + pick(32)));
        break;
    }
    if (bad == good) continue;
    std::string error;
    try {
      const ck::file_reader r(bad, "fuzz.bin");
      for (const auto& [name, text] : want) {
        if (r.section(name) != text) FAIL_CHECK("section '", name, "' read back changed");
      }
      ++intact;
    } catch (const invalid_argument&) {
      ++refused;
    } catch (const std::exception& e) {
      FAIL_CHECK("not an invalid_argument: ", e.what());
    }
  }
  CHECK(refused > 2500);  // nearly every damage is caught; the rest left the sections intact
  MESSAGE(refused, " refused, ", intact, " read back intact");
}

TEST_CASE("file_writer::write replaces a file atomically and leaves no temporary behind") {
  temp_dir dir;
  const fs::path p = dir.path / "f.bin";
  ck::file_writer a;
  a.add_text("v", "one");
  a.write(p);
  ck::file_writer b;
  b.add_text("v", "two, longer");
  b.write(p);
  CHECK(ck::file_reader::open(p).section("v") == "two, longer");
  CHECK(read_all(p) == b.bytes());
  CHECK_FALSE(fs::exists(p.string() + ".tmp"));
  CHECK(std::distance(fs::directory_iterator(dir.path), fs::directory_iterator()) == 1);
  const fs::path nowhere = dir.path / "missing" / "f.bin";
  CHECK_THROWS_WITH_AS(a.write(nowhere), doctest::Contains((nowhere.string() + ".tmp").c_str()),
                       backend_error);
  CHECK_THROWS_WITH_AS(ck::file_reader::open(nowhere), doctest::Contains(nowhere.string().c_str()),
                       backend_error);
}

TEST_CASE("manifest: text round trip, and require_same names every differing field") {
  ck::manifest run;
  run.fields = {{"mesh", "2x1x2"}, {"layout", "abc"}, {"precision", "f32/f32"}, {"x", "a=b"}};
  CHECK(ck::manifest::parse(run.text()).fields == run.fields);
  CHECK_NOTHROW(run.require_same(ck::manifest::parse(run.text()), "dir"));
  ck::manifest saved = run;
  saved.fields["mesh"] = "1x2x2";
  saved.fields.erase("layout");
  saved.fields["extra"] = "ignored";
  try {
    run.require_same(saved, "the/dir");
    FAIL("require_same accepted a different setup");
  } catch (const invalid_argument& e) {
    const std::string msg = e.what();
    CHECK(contains(msg, "'the/dir'"));
    CHECK(contains(msg, "mesh: checkpoint has '1x2x2', this run has '2x1x2'"));
    CHECK(contains(msg, "layout: checkpoint has '(missing)', this run has 'abc'"));
    CHECK_FALSE(contains(msg, "precision"));
    CHECK_FALSE(contains(msg, "x:"));
  }
}
