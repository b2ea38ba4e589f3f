/// Cross-job federation: every group is a process of its own (an inproc job of 2 thread
/// ranks) and the groups federate over Gloo, meeting through a file store:
///  - with a static Gloo link and with an elastic link, 3 group processes end with the
///    parameters of the same run inside one inproc world, bit for bit;
///  - a group SIGKILLed between syncs: the other two finish every remaining sync (no hang);
///  - restarted (the groups meeting through a signed store), it heals at the next sync: its
///    state arrives sealed with the secret; right after it its parameters equal the live
///    groups', and all three end equal; the heal is a plan: the donor's wire tap records its
///    messages on the federation axis (the size, 8 bytes, and the state the joiner took);
///  - a group whose parameters turn NaN is rejected for the round and every model stays
///    finite.

#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fedshard/comm/elastic.hpp"
#include "fedshard/comm/gloo.hpp"
#include "fedshard/comm/hybrid.hpp"
#include "fedshard/comm/inproc.hpp"
#include "fedshard/comm/signed_store.hpp"
#include "support/federated_run.hpp"
#include "support/gloo_support.hpp"
#include "support/processes.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

namespace {

using namespace fedshard;
namespace el = fedshard::elastic;
namespace gl = fedshard::gloo;
namespace ft = fedshard::test;
using detail::concat;

constexpr int G = 3, L = 2, steps = 12, period = 3;
const mesh_shape shape{G, 1, L};

void write_floats(const std::filesystem::path& p, const std::vector<float>& v) {
  std::ofstream out(p.string() + ".tmp", std::ios::binary);
  out.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * 4));
  out.close();
  std::filesystem::rename(p.string() + ".tmp", p);
}
std::vector<float> read_floats(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> b((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<float> v(b.size() / 4);
  std::memcpy(v.data(), b.data(), v.size() * 4);
  return v;
}
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return !a.empty() && a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

using ft::exited_ok;
using ft::spawn;
using ft::wait_for;

/// The join timeout only matters when a group is missing; where none should be, a long one
/// keeps a group that is merely slow (a loaded machine, sanitizers) from being left out.
el::options elastic_options(const std::filesystem::path& logs, int g, double join = 30) {
  el::options o;
  o.job = "run";
  o.join_timeout = std::chrono::duration<double>(join);
  o.transport = ft::gloo_timeout(30);
  auto mu = std::make_shared<std::mutex>();
  const auto file = logs / concat("log", g);
  o.log = [mu, file](const std::string& s) {
    std::lock_guard lock(*mu);
    std::ofstream(file, std::ios::app) << s << '\n';
  };
  return o;
}

using elastic_world = hybrid<inproc::communicator, el::link>;

/// Group g's job: 2 inproc ranks whose federation link is elastic. Each rank trains until
/// step `steps` (or until `die_at`, where the process kills itself), writes its parameters
/// after every sync to <life>sync<step>_<g>_<l> and at the end to <life>final_<g>_<l>; at the
/// end also the bytes of each point-to-point message its tap recorded on the federation axis
/// (one a line) to <life>p2p_<g>_<l>, and its federation payload bytes to <life>fed_<g>_<l>.
/// Its trainer's log lines go to <life>trainer_log_<g>_<l>. Alg: fl_hsdp unless named.
template <class Alg = fl_hsdp>
void elastic_group(const std::filesystem::path& dir, int g, int die_at = -1,
                   const std::string& life = "", double join = 30,
                   std::int64_t await_joiner_at = -1, bool sign = false) {
  inproc::run(L, [&](inproc::communicator& c) {
    std::shared_ptr<gl::store> st = std::make_shared<gl::file_store>(dir / "store");
    if (sign) st = std::make_shared<gl::signed_store>(st, "a secret of the test's groups");
    el::link lk(st, G, g, L, c.rank(), elastic_options(dir, g, join));
    elastic_world w(c.split(0, c.rank()), std::move(lk));
    mesh m(w, shape);
    trainer_options<Alg> o;
    o.total_steps = steps;
    o.schedule.period = period;
    const auto log_file = dir / concat(life, "trainer_log_", g, "_", c.rank());
    o.log = [log_file](const std::string& s) {
      std::ofstream(log_file, std::ios::app) << s << '\n';
    };
    trainer<ft::mlp_model, Alg, optim::adamw, elastic_world> t(m, ft::mlp_model{}, {.lr = 0.02f},
                                                               o);
    t.wire().keep_calls(true);
    while (t.step_count() < steps) {
      const auto s = t.step_count();
      if (s == await_joiner_at) {
        // Before the step whose sync is round 2, wait until the restarted group 2 has
        // arrived there with all its ranks, so that round includes it as a joiner however
        // slowly its process started (sanitizers, a loaded machine).
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
        while ((!st->has("run/r2/arrive/2/0") || !st->has("run/r2/arrive/2/1")) &&
               std::chrono::steady_clock::now() < deadline)
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      if (s == die_at) {
        c.barrier();
        if (c.rank() == 0) ::kill(::getpid(), SIGKILL);
        std::this_thread::sleep_for(std::chrono::seconds(60));
      }
      const auto syncs = t.syncs_applied();
      t.step(t.model().batch(11, static_cast<int>(s), g, G, c.rank(), L, 2));
      if (t.syncs_applied() != syncs) {
        auto p = t.parameters();
        write_floats(dir / concat(life, "sync", t.step_count() - 1, "_", g, "_", c.rank()), p);
      }
    }
    write_floats(dir / concat(life, "final_", g, "_", c.rank()), t.parameters());
    std::ofstream p2p(dir / concat(life, "p2p_", g, "_", c.rank()));
    for (const wire_call& w : t.wire().calls())
      if (w.axis == axis::federation && w.kind == comm_kind::send_recv) p2p << w.bytes << '\n';
    std::ofstream(dir / concat(life, "fed_", g, "_", c.rank()))
        << t.traffic()[axis::federation].payload_bytes;
  });
}

std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p);
  return {(std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()};
}

}  // namespace

TEST_CASE("cross-job: 3 group processes over Gloo end where one inproc world ends, bit for bit") {
  auto reference = ft::collect_ranks(G * L, [&](inproc::communicator& c) {
    return ft::train_mlp<fl_hsdp>(c, shape, steps, period).params;
  });
  SUBCASE("static Gloo links") {
    ft::temp_dir dir;
    std::vector<pid_t> pids;
    for (int g = 0; g < G; ++g)
      pids.push_back(spawn([&, g] {
        inproc::run(L, [&](inproc::communicator& c) {
          auto st = std::make_shared<gl::file_store>(dir.path());
          gl::communicator lk(st, concat("link", c.rank()), g, G, ft::gloo_timeout(30));
          hybrid<inproc::communicator, gl::communicator> w(c.split(0, c.rank()), std::move(lk));
          write_floats(dir.path() / concat("final_", g, "_", c.rank()),
                       ft::train_mlp<fl_hsdp>(w, shape, steps, period).params);
        });
      }));
    for (pid_t p : pids) CHECK(exited_ok(wait_for(p, 120)));
    for (int r = 0; r < G * L; ++r) {
      CAPTURE(r);
      CHECK(same_bits(read_floats(dir.path() / concat("final_", r / L, "_", r % L)),
                      reference[static_cast<std::size_t>(r)]));
    }
  }
  SUBCASE("elastic links") {
    ft::temp_dir dir;
    std::vector<pid_t> pids;
    for (int g = 0; g < G; ++g) pids.push_back(spawn([&, g] { elastic_group(dir.path(), g); }));
    for (pid_t p : pids) CHECK(exited_ok(wait_for(p, 120)));
    for (int r = 0; r < G * L; ++r) {
      CAPTURE(r);
      CHECK(same_bits(read_floats(dir.path() / concat("final_", r / L, "_", r % L)),
                      reference[static_cast<std::size_t>(r)]));
    }
  }
}

TEST_CASE("cross-job: a group killed mid-run is left out, the others finish; restarted, it heals") {
  // The survivors wait this long once, for the dead group; a live group later than that
  // (far beyond a loaded machine's jitter) would be left out and heal.
  const double join = 4;
  for (bool restart : {false, true}) {
    CAPTURE(restart);
    ft::temp_dir dir;
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<pid_t> pids;
    for (int g = 0; g < G; ++g)
      pids.push_back(spawn([&, g] {
        // With a restart, the survivors wait for it before the step that syncs round 2.
        elastic_group(dir.path(), g, g == 2 ? 4 : -1, "", join,
                      restart && g != 2 ? 3 * period - 1 : -1, restart);
      }));
    const int killed = wait_for(pids[2], 120);
    CHECK((killed >= 0 && WIFSIGNALED(killed)));
    pid_t again = -1;
    if (restart) {
      // Restarted once the others have synced without it (so it is left out first, then heals).
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (!std::filesystem::exists(dir.path() / concat("sync", 2 * period - 1, "_0_0")) &&
             std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      again = spawn([&] { elastic_group(dir.path(), 2, -1, "again_", join, -1, true); });
    }
    CHECK(exited_ok(wait_for(pids[0], 120)));
    CHECK(exited_ok(wait_for(pids[1], 120)));
    if (restart) CHECK(exited_ok(wait_for(again, 120)));
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(took < 60);
    // The survivors applied every sync and agree.
    for (int s = period - 1; s < steps; s += period)
      for (int g = 0; g < 2; ++g) {
        CAPTURE(s);
        CAPTURE(g);
        CHECK(std::filesystem::exists(dir.path() / concat("sync", s, "_", g, "_0")));
      }
    const auto a = read_floats(dir.path() / "final_0_0");
    CHECK(same_bits(a, read_floats(dir.path() / "final_1_1")));
    std::ifstream log(dir.path() / "log0");
    const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
    CAPTURE(text);
    CHECK(text.find("left out {2}") != std::string::npos);
    if (!restart) continue;
    // The restarted group's first sync: its parameters equal the live groups' after it.
    int first = -1;
    for (int s = period - 1; s < steps && first < 0; s += period)
      if (std::filesystem::exists(dir.path() / concat("again_sync", s, "_2_0"))) first = s;
    REQUIRE(first > 2 * period - 1);
    for (int l = 0; l < L; ++l)
      CHECK(same_bits(read_floats(dir.path() / concat("again_sync", first, "_2_", l)),
                      read_floats(dir.path() / concat("sync", first, "_0_", l))));
    CHECK(same_bits(read_floats(dir.path() / "again_final_2_0"), a));
    CHECK(text.find("healed {2}") != std::string::npos);
    // The heal ran as a plan: each joiner rank took the state of its counterpart in group 0
    // (the donor: the lowest member that is not a joiner), and that rank's tap recorded it on
    // the federation axis: the size (8 B), then the state with its seal (the groups meet
    // through a signed store here: a 32-byte HMAC tag) in whole 8-byte words. Group 1 ran
    // the same rounds and sent no state, so group 0's federation bytes exceed its by exactly
    // those; the joiner sent none.
    for (int l = 0; l < L; ++l) {
      CAPTURE(l);
      const std::string healed = read_text(dir.path() / concat("again_trainer_log_2_", l));
      CAPTURE(healed);
      const std::string said = "fedshard: heal: group 2 took the state of group 0 (";
      const auto at = healed.find(said);
      REQUIRE(at != std::string::npos);
      const std::int64_t state = std::stoll(healed.substr(at + said.size()));
      CHECK(state > 0);
      const std::int64_t padded = (state + 32 + 7) / 8 * 8;  // sealed: a 32-byte tag
      CHECK(read_text(dir.path() / concat("p2p_0_", l)) == concat("8\n", padded, "\n"));
      CHECK(read_text(dir.path() / concat("p2p_1_", l)).empty());
      CHECK(read_text(dir.path() / concat("again_p2p_2_", l)).empty());
      CHECK(std::stoll(read_text(dir.path() / concat("fed_0_", l))) -
                std::stoll(read_text(dir.path() / concat("fed_1_", l))) ==
            8 + padded);
    }
  }
}

TEST_CASE(
    "cross-job: a diloco group restarted after a kill heals from two donors, the donor's own "
    "state and the other's anchors and outer momentum, and syncs equal to them") {
  // As the test above with restart, on diloco: its anchor and outer momentum are held alike
  // in every group, so the joiner takes its state from groups 0 and 1 (options::heal_donors
  // is 2 by default): group 0 sends its own state (master, inner optimizer, records),
  // group 1 the shared state with a 16-byte trailer; each sealed with a 32-byte tag, in
  // whole words.
  const double join = 4;
  ft::temp_dir dir;
  std::vector<pid_t> pids;
  for (int g = 0; g < G; ++g)
    pids.push_back(spawn([&, g] {
      elastic_group<diloco>(dir.path(), g, g == 2 ? 4 : -1, "", join, g != 2 ? 3 * period - 1 : -1,
                            true);
    }));
  const int killed = wait_for(pids[2], 120);
  CHECK((killed >= 0 && WIFSIGNALED(killed)));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!std::filesystem::exists(dir.path() / concat("sync", 2 * period - 1, "_0_0")) &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const pid_t again =
      spawn([&] { elastic_group<diloco>(dir.path(), 2, -1, "again_", join, -1, true); });
  CHECK(exited_ok(wait_for(pids[0], 120)));
  CHECK(exited_ok(wait_for(pids[1], 120)));
  CHECK(exited_ok(wait_for(again, 120)));
  int first = -1;
  for (int s = period - 1; s < steps && first < 0; s += period)
    if (std::filesystem::exists(dir.path() / concat("again_sync", s, "_2_0"))) first = s;
  REQUIRE(first > 2 * period - 1);
  for (int l = 0; l < L; ++l) {
    CAPTURE(l);
    // A wrong anchor or momentum would give the joiner another outer step than the others'.
    CHECK(same_bits(read_floats(dir.path() / concat("again_sync", first, "_2_", l)),
                    read_floats(dir.path() / concat("sync", first, "_0_", l))));
    CHECK(same_bits(read_floats(dir.path() / concat("again_final_2_", l)),
                    read_floats(dir.path() / concat("final_0_", l))));
    const std::string healed = read_text(dir.path() / concat("again_trainer_log_2_", l));
    CAPTURE(healed);
    const std::string said = "fedshard: heal: group 2 took the state of groups 0, 1 (";
    const auto at = healed.find(said);
    REQUIRE(at != std::string::npos);
    const std::int64_t state = std::stoll(healed.substr(at + said.size()));  // own + shared
    std::istringstream p0(read_text(dir.path() / concat("p2p_0_", l)));
    std::istringstream p1(read_text(dir.path() / concat("p2p_1_", l)));
    std::int64_t size0 = 0, own = 0, size1 = 0, piece = 0;
    p0 >> size0 >> own;
    p1 >> size1 >> piece;
    CHECK(size0 == 8);
    CHECK(size1 == 8);
    CHECK(piece > 16 + 32);
    // Both blobs padded to words: own + 32 and 16 + shared + 32, each up to 7 bytes more.
    const std::int64_t slack = own + piece - (state + 32 + 16 + 32);
    CHECK(slack >= 0);
    CHECK(slack <= 14);
    CHECK(read_text(dir.path() / concat("again_p2p_2_", l)).empty());
  }
}

TEST_CASE(
    "cross-job: a group whose model turns NaN is rejected, then healed before its next round; "
    "every model stays finite") {
  ft::temp_dir dir;
  std::mutex mu;
  std::vector<std::string> trainer_lines;
  auto results = ft::on_threads(G, [&](int g) {
    std::vector<std::vector<float>> finals(L);
    inproc::run(L, [&](inproc::communicator& c) {
      auto st = std::make_shared<gl::file_store>(dir.path() / "store");
      el::link lk(st, G, g, L, c.rank(), elastic_options(dir.path(), g));
      elastic_world w(c.split(0, c.rank()), std::move(lk));
      mesh m(w, shape);
      trainer_options<fl_hsdp> o;
      o.total_steps = 9;
      o.schedule.period = period;
      o.log = [&](const std::string& line) {
        std::lock_guard lock(mu);
        trainer_lines.push_back(line);
      };
      trainer<ft::mlp_model, fl_hsdp, optim::adamw, elastic_world> t(m, ft::mlp_model{},
                                                                     {.lr = 0.02f}, o);
      for (int s = 0; s < 9; ++s) {
        if (g == 1 && s == 2) {  // poison this rank's master shard before the first sync
          t.synchronize();
          auto master = t.engine().master();
          master[master.size() / 2] = std::numeric_limits<float>::quiet_NaN();
        }
        t.step(t.model().batch(11, s, g, G, c.rank(), L, 2));
      }
      finals[static_cast<std::size_t>(c.rank())] = t.parameters();
    });
    return finals;
  });
  for (int g = 0; g < G; ++g)
    for (const auto& p : results[static_cast<std::size_t>(g)]) {
      CAPTURE(g);
      REQUIRE(!p.empty());
      bool finite = true;
      for (float x : p) finite = finite && std::isfinite(x);
      CHECK(finite);
      CHECK(same_bits(p, results[0][0]));
    }
  std::ifstream log(dir.path() / "log0");
  const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  CAPTURE(text);
  CHECK(text.find("rejected group 1 in round 0") != std::string::npos);
  // Its optimizer state is NaN too (the sync replaced only its parameters): before the fix it
  // was rejected again in every later round. Now it is a joiner in round 1 and takes group
  // 0's whole state on both ranks; round 2 combines all three groups.
  CHECK(text.find("rejected group 1 in round 1") == std::string::npos);
  CHECK(text.find("rejected group 1 in round 2") == std::string::npos);
  CHECK(text.find("round 1 (step 5): combined {0,2} of members {0,1,2}; healed {1}") !=
        std::string::npos);
  CHECK(text.find("round 2 (step 8): combined {0,1,2} of members {0,1,2}; healed {}") !=
        std::string::npos);
  int healed = 0;
  for (const auto& line : trainer_lines)
    if (line.find("heal: group 1 took the state of group 0") != std::string::npos &&
        line.find("in round 1") != std::string::npos)
      ++healed;
  CHECK(healed == L);
}
