// Bad input to every command-line program (issue 28): fedshard-demo, fedshard-sim and
// fedshard-multi-job each run with a list of bad arguments must exit with status 2 within
// seconds (before any training or pricing), printing one line on stderr that starts with the
// program's name and names the option; a short good invocation still exits 0. And
// fedshard-multi-job, whose redis-server is killed mid-run, reports that it died (not "stopped
// by a signal", none was sent) and stops at once (it never signals nor waits for the dead
// server). Built by examples/CMakeLists.txt with the programs' paths (FEDSHARD_*_EXE).
#include <doctest/doctest.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;

/// A program run to its end (or killed at a deadline): its exit code (-signal when a signal
/// ended it), stdout, stderr and wall time.
struct outcome {
  int code = -1;
  std::string out, err;
  double seconds = 0;
};

/// A child process with its stdout and stderr on pipes.
class process {
 public:
  process(const std::string& exe, const std::vector<std::string>& args, const std::string& cwd) {
    int o[2], e[2];
    REQUIRE(::pipe(o) == 0);
    REQUIRE(::pipe(e) == 0);
    start_ = clock_type::now();
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      ::dup2(o[1], 1);
      ::dup2(e[1], 2);
      for (int fd : {o[0], o[1], e[0], e[1]}) ::close(fd);
      if (::chdir(cwd.c_str()) != 0) ::_exit(126);
      std::vector<char*> argv{const_cast<char*>(exe.c_str())};
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(exe.c_str(), argv.data());
      ::_exit(127);
    }
    ::close(o[1]);
    ::close(e[1]);
    out_fd_ = o[0];
    err_fd_ = e[0];
  }
  process(const process&) = delete;
  process& operator=(const process&) = delete;
  ~process() {
    if (pid_ > 0 && !done_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    ::close(out_fd_);
    ::close(err_fd_);
  }

  /// Reads what the pipes hold, waiting up to `ms` milliseconds; false once both are at
  /// their end (every process holding them has exited).
  bool pump(int ms) {
    pollfd fds[2] = {{open_[0] ? out_fd_ : -1, POLLIN, 0}, {open_[1] ? err_fd_ : -1, POLLIN, 0}};
    if (!open_[0] && !open_[1]) return false;
    if (::poll(fds, 2, ms) <= 0) return true;
    for (int i = 0; i < 2; ++i) {
      if (!open_[i] || fds[i].revents == 0) continue;
      char buf[4096];
      const ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
      if (n > 0)
        (i == 0 ? out_ : err_).append(buf, static_cast<std::size_t>(n));
      else
        open_[i] = false;
    }
    return open_[0] || open_[1];
  }
  /// Waits until stdout holds `text` or `seconds` pass; true when it does.
  bool wait_for_output(const std::string& text, double seconds) {
    const auto until = clock_type::now() + std::chrono::duration<double>(seconds);
    while (out_.find(text) == std::string::npos && clock_type::now() < until)
      if (!pump(50)) break;
    return out_.find(text) != std::string::npos;
  }
  /// Runs to the end (killed after `seconds`), and what it printed.
  outcome finish(double seconds) {
    const auto until = clock_type::now() + std::chrono::duration<double>(seconds);
    while (clock_type::now() < until && pump(50)) {
    }
    if (clock_type::now() >= until) ::kill(pid_, SIGKILL);
    while (pump(50)) {
    }
    int status = 0;
    ::waitpid(pid_, &status, 0);
    done_ = true;
    outcome r;
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
    r.out = out_;
    r.err = err_;
    r.seconds = std::chrono::duration<double>(clock_type::now() - start_).count();
    return r;
  }
  const std::string& out() const { return out_; }

 private:
  pid_t pid_ = -1;
  int out_fd_ = -1, err_fd_ = -1;
  bool done_ = false;
  bool open_[2] = {true, true};
  std::string out_, err_;
  clock_type::time_point start_;
};

/// A fresh directory for a program's files, removed afterwards.
struct scratch {
  std::filesystem::path dir;
  scratch() {
    std::string pattern = (std::filesystem::temp_directory_path() / "fedshard-cli-XXXXXX");
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    dir = pattern;
    std::ofstream(dir / "plain-file") << "not a directory\n";
  }
  ~scratch() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  /// A path whose parent is a regular file: nothing can be written there, even by root.
  std::string unwritable() const { return (dir / "plain-file" / "out").string(); }
};

/// One bad invocation and a text its stderr must hold (the option's name, with what it
/// expected when that is the point).
struct bad_case {
  std::vector<std::string> args;
  std::string names;
};

/// Runs program with every case: exit status 2 within 10 s (in practice milliseconds: no
/// case gets to training or pricing), stderr one line "<program>: ..." holding c.names.
void check_refused(const std::string& exe, const std::string& program,
                   const std::vector<bad_case>& cases, const scratch& s) {
  for (const auto& c : cases) {
    std::string shown;
    for (const auto& a : c.args) shown += " '" + a + "'";
    CAPTURE(shown);
    process p(exe, c.args, s.dir.string());
    const outcome r = p.finish(10);
    CHECK(r.code == 2);
    CHECK_MESSAGE(r.err.find(c.names) != std::string::npos, r.err);
    CHECK(r.err.rfind(program + ": ", 0) == 0);
    CHECK(r.err.find('\n') == r.err.size() - 1);  // one line
    CHECK(r.seconds < 10);
    MESSAGE(program, shown, " -> exit ", r.code, ", ", r.seconds, " s: ", r.err);
  }
}

/// The bad inputs every program shares (a value that is missing, not a number, trailing
/// garbage, out of range, negative, NaN, empty; an unknown option).
std::vector<bad_case> common_cases(const std::string& count, const std::string& range) {
  return {
      {{count, "2.5"}, count + " expects a whole number in " + range + ", found '2.5'"},
      {{count, "1e10"}, count + " expects a whole number in " + range + ", found '1e10'"},
      {{count, "8x"}, count + " expects a whole number in " + range + ", found '8x'"},
      {{count, "-4"}, count + " expects a whole number in " + range + ", found '-4'"},
      {{count, "nan"}, count + " expects a whole number"},
      {{count, "99999999999999999999"}, count + " expects a whole number in " + range},
      {{count, ""}, count + " expects a value, found an empty argument"},
      {{count}, count + " expects a value, found nothing"},
      {{count, "--hidden", "8"}, count + " expects a value, found the option '--hidden'"},
      {{"--no-such-option"}, "unknown option '--no-such-option'"},
      {{"--no-such-option", "3"}, "unknown option '--no-such-option'"},
  };
}

}  // namespace

TEST_CASE("fedshard-demo refuses bad input with exit status 2 and runs a good one") {
  const scratch s;
  std::vector<bad_case> cases = common_cases("--steps", "[1, 10000000]");
  const std::vector<bad_case> own{
      {{"--hidden", "100000000"},
       "--hidden expects a whole number in [1, 4096], found '100000000'"},
      {{"--scape-density", "5"}, "--scape-density expects a finite number in (0, 1], found '5'"},
      {{"--scape-density", "nan"}, "--scape-density expects a finite number in (0, 1]"},
      {{"--scape-density", "0"}, "--scape-density expects a finite number in (0, 1]"},
      {{"--algorithms", ""}, "--algorithms expects a value"},
      {{"--algorithms", ","}, "--algorithms expects a comma-separated list"},
      {{"--algorithms", "ddp,,fsdp"}, "--algorithms expects a comma-separated list"},
      {{"--algorithms", "ddp,nosuch"}, "--algorithms expects names from"},
      {{"--algorithms", "fomoe"}, "--experts"},
      {{"--model", "rnn"}, "--model expects mlp or attention, found 'rnn'"},
      {{"--sync-dtype", "f64"}, "--sync-dtype expects f32, bf16 or f16, found 'f64'"},
      {{"--time-budget", "0"}, "--time-budget expects a finite number in (0, 1000000], found '0'"},
      {{"--time-budget", "nan"}, "--time-budget expects a finite number"},
      {{"--token-budget", "0"}, "--token-budget expects a whole number in [1, "},
      {{"--token-budget", "1000", "--steps", "8"},
       "--token-budget 1000 and --steps 8 both set the tokens every row trains: expected one of "
       "them"},
      {{"--algorithms", "fcp"},
       "--algorithms fcp spreads each group's batch of sequences over its ranks: expected "
       "--model attention, found --model mlp"},
      {{"--model", "attention", "--experts", "2"}, "--model attention has no experts"},
      {{"--out", s.unwritable()}, "--out expects a directory it can write"},
      {{"--out", ""}, "--out expects a value"},
      {{"--corpus", (s.dir / "missing").string()}, "--corpus"},
      {{"--lr", "-1"}, "--lr expects a finite number in [0, 10], found '-1'"},
      {{"--lr", "inf"}, "--lr expects a finite number in [0, 10], found 'inf'"},
      {{"--bandwidth-gbit", "0"}, "--bandwidth-gbit expects a finite number in [1e-06, 1000000]"},
      {{"--bandwidth-gbit", "-5"}, "--bandwidth-gbit"},
      {{"--latency-ms", "nan"}, "--latency-ms"},
      {{"--slow-factor", "0.5"}, "--slow-factor"},
      {{"--seed", "-1"}, "--seed expects a whole number in [0, 18446744073709551615]"},
      {{"--ranks", "0"}, "--ranks"},
      {{"--ranks", "6", "--groups", "4"}, "--ranks 6 do not split into --groups 4"},
      {{"--slow-site", "5"}, "--slow-site 5 is not one of the 2 sites"},
      {{"--group-shapes", "2x2,0x1"}, "--group-shapes"},
      {{"--group-shapes", "100x100"}, "--group-shapes expects at most 256 ranks"},
      {{"--scape-per-tensor", "2"}, "--scape-per-tensor expects a whole number in [0, 1]"},
      {{"--eval-examples", "4"}, "--eval-examples expects a whole number in [8, 65536]"},
      {{"--k", "0"}, "--k expects a whole number"},
  };
  cases.insert(cases.end(), own.begin(), own.end());
  check_refused(FEDSHARD_DEMO_EXE, "fedshard-demo", cases, s);

  const std::string out = (s.dir / "good").string();
  process p(FEDSHARD_DEMO_EXE,
            {"--steps", "1", "--eval-every", "1", "--eval-examples", "8", "--hidden", "8",
             "--batch", "2", "--algorithms", "ddp", "--out", out},
            s.dir.string());
  const outcome r = p.finish(120);
  CHECK_MESSAGE(r.code == 0, r.err);
  CHECK(std::filesystem::exists(std::filesystem::path(out) / "curves.csv"));
  CHECK(process(FEDSHARD_DEMO_EXE, {"--help"}, s.dir.string()).finish(10).code == 0);
}

TEST_CASE("fedshard-sim refuses bad input and non-physical settings with exit status 2") {
  const scratch s;
  std::vector<bad_case> cases = common_cases("--gpus", "[1, 1048576]");
  const std::vector<bad_case> own{
      {{"--node-gbps", "-5"}, "--node-gbps expects a finite number in (0, 1e+09], found '-5'"},
      {{"--node-gbps", "0"}, "--node-gbps expects a finite number in (0, 1e+09], found '0'"},
      {{"--node-gbps", "nan"}, "--node-gbps expects a finite number in (0, 1e+09], found 'nan'"},
      {{"--nvlink-gbs", "inf"}, "--nvlink-gbs expects a finite number"},
      {{"--nvlink-gbs", "-450"}, "--nvlink-gbs"},
      {{"--sites", "2", "--wan-gbps", "-100"}, "--wan-gbps expects a finite number in (0, 1e+09]"},
      {{"--wan-latency-ms", "-10"}, "--wan-latency-ms expects a finite number in [0, 10000000]"},
      {{"--wan-latency-ms", "nan"}, "--wan-latency-ms"},
      {{"--mfu", "0"}, "--mfu expects a finite number in (0, 1]"},
      {{"--mfu", "1.5"}, "--mfu"},
      {{"--seconds-per-token", "-1"}, "--seconds-per-token"},
      {{"--straggler-cv", "2"}, "--straggler-cv expects a finite number in [0, 1]"},
      {{"--oversubscription", "wan=0.5"}, "--oversubscription wan=F expects a finite number"},
      {{"--oversubscription", "disk=2"}, "--oversubscription expects LEVEL=F"},
      {{"--mesh", "2x2"}, "--mesh expects GxRxS"},
      {{"--mesh", "0x1x8"}, "--mesh"},
      {{"--mesh", "1048576x1048576x1"}, "--mesh expects at most 1048576 GPUs"},
      {{"--K", "0"}, "--K expects a whole number in [1, 67108864]"},
      {{"--k", "8x"}, "--k expects a whole number"},
      {{"--alpha", "2"}, "--alpha expects a finite number in (0, 1]"},
      {{"--scape-density", "5", "--algo", "scape_fsdp"}, "--scape-density expects a finite number"},
      {{"--sweep", "--sweep-k", ""}, "--sweep-k expects a value"},
      {{"--sweep", "--sweep-k", "1,,2"}, "--sweep-k expects a comma-separated list"},
      {{"--sweep", "--sweep-gbps", "100,-1"}, "--sweep-gbps expects a finite number"},
      {{"--sweep", "--csv", s.unwritable()}, "--csv expects a file it can write"},
      {{"--calibrate-ranks", "1"}, "--calibrate-ranks"},
      {{"--layers", "0"}, "--layers"},
      {{"--cluster", "nope"}, "--cluster"},
      {{"--sync", "sometimes"}, "--sync expects hierarchical or reference"},
      {{"--sync-dtype", "f64"}, "--sync-dtype expects f32 or bf16 or f16, found 'f64'"},
      {{"--failures", "--mtbf-hours", "0"}, "--mtbf-hours expects a finite number in [0.001, "},
      {{"--failures", "--mtbf-per", "rack"}, "--mtbf-per expects gpu or node, found 'rack'"},
      {{"--failures", "--storage-gbs", "0"}, "--storage-gbs expects a finite number in (0, "},
      {{"--failures", "--checkpoint-every-s", "-5"}, "--checkpoint-every-s expects a finite"},
      {{"--failures", "--quorum-s", "nan"}, "--quorum-s expects a finite number"},
      {{"--check-multi-job", "/bin/true"},
       "--check-multi-job checks --failures' model: expected --failures with it, found none"},
      {{"--failures", "--check-multi-job", "/bin/true", "--check-tolerance", "-1"},
       "--check-tolerance expects a finite number in [0, 100]"},
      {{"--algo", "gasloc", "--sync-dtype", "bf16"},
       "sync dtype bf16, but federation policy gossip averages nothing in it"},
      {{"--algo"}, "--algo expects a value, found nothing"},
      {{"--predict-demo", "--rounds", "0"}, "--rounds expects a whole number"},
      {{"--predict-demo", "--fail-above", "nan"}, "--fail-above"},
      {{"--predict-demo", "--steps", "2.5"}, "--steps expects a whole number"},
  };
  cases.insert(cases.end(), own.begin(), own.end());
  check_refused(FEDSHARD_SIM_EXE, "fedshard-sim", cases, s);

  const outcome r =
      process(FEDSHARD_SIM_EXE, {"--gpus", "8", "--algo", "fsdp"}, s.dir.string()).finish(60);
  CHECK_MESSAGE(r.code == 0, r.err);
  CHECK(r.out.find("tokens/s per GPU") != std::string::npos);
}

TEST_CASE("fedshard-sim prices every alias the demo accepts by name, gasloc and fomoe included") {
  const scratch s;
  // One step priced: the step line "  step   <seconds> s = compute ..." after the alias's
  // header line with its cadence (gasloc's H = 500, fomoe's K = 8 by default).
  for (const auto& [algo, header] : std::vector<std::pair<std::string, std::string>>{
           {"gasloc", "gasloc on mesh 2x2x2"}, {"fomoe", "fomoe on mesh 2x2x2"}}) {
    CAPTURE(algo);
    const outcome r =
        process(FEDSHARD_SIM_EXE, {"--gpus", "8", "--groups", "2", "--hsdp", "2", "--algo", algo},
                s.dir.string())
            .finish(60);
    CHECK_MESSAGE(r.code == 0, r.err);
    CHECK(r.out.find(header) != std::string::npos);
    CHECK(r.out.find(algo == "gasloc" ? "K = 500" : "K = 8") != std::string::npos);
    const auto at = r.out.find("\n  step ");
    REQUIRE(at != std::string::npos);
    const double step = std::strtod(r.out.c_str() + at + 8, nullptr);
    CHECK(step > 0);
    CHECK(r.out.find(" s = compute ", at) != std::string::npos);
  }
  // SCAPE's aliases: a run of step kinds, priced beside the dense alias of the catalogue.
  for (const auto& [algo, base] : std::vector<std::pair<std::string, std::string>>{
           {"scape_fsdp", "fsdp"}, {"fl_scape_fsdp", "fl_fsdp"}}) {
    CAPTURE(algo);
    const outcome r =
        process(FEDSHARD_SIM_EXE, {"--gpus", "8", "--algo", algo, "--scape-steps", "20"},
                s.dir.string())
            .finish(60);
    CHECK_MESSAGE(r.code == 0, r.err);
    CHECK(r.out.find("a run of 20 steps") != std::string::npos);
    CHECK(r.out.find("\n  " + base + " ") != std::string::npos);
    CHECK(r.out.find("\n  " + algo + " ") != std::string::npos);
  }
  // The unknown name's message lists the catalogue (and exits 2).
  const outcome bad = process(FEDSHARD_SIM_EXE, {"--algo", "scape"}, s.dir.string()).finish(60);
  CHECK(bad.code == 2);
  CHECK(bad.err.find("unknown algorithm 'scape', expected one of ddp, zero2, fsdp, hsdp, "
                     "fl_fsdp, fl_hsdp, fl_hsdp_int8, diloco, streaming_diloco, sparseloco, "
                     "gasloc, fomoe, scape_fsdp, fl_scape_fsdp, hofl, lss, fcp, feast, collate") !=
        std::string::npos);
}

#ifdef FEDSHARD_MULTI_JOB_EXE
TEST_CASE("fedshard-multi-job refuses bad input with exit status 2 before starting anything") {
  const scratch s;
  std::vector<bad_case> cases = common_cases("--steps", "[1, 10000000]");
  const std::vector<bad_case> own{
      {{"--groups", "0"}, "--groups expects a whole number in [1, 64]"},
      {{"--hidden", "1000000"}, "--hidden expects a whole number in [1, 4096]"},
      {{"--join-timeout", "-1"}, "--join-timeout expects a finite number in [0.001, 86400]"},
      {{"--join-timeout", "nan"}, "--join-timeout"},
      {{"--op-timeout", "0"}, "--op-timeout"},
      {{"--lr", "inf"}, "--lr"},
      {{"--seed", "1.5"}, "--seed"},
      {{"--kill-group", "1"}, "--kill-group and --kill-at-step go together"},
      {{"--kill-group", "5", "--kill-at-step", "3"}, "--kill-group expects a group < --groups"},
      {{"--restart-after", "-2"}, "--restart-after"},
      {{"--timeout", "0"}, "--timeout"},
      {{"--replicas", "8", "--shards", "16"}, "--replicas x --shards expects at most 64"},
      {{"--eval-examples", "2"}, "--eval-examples"},
      {{"--corpus", (s.dir / "missing").string()}, "--corpus"},
      {{"--group", "0"}, "--group needs --store"},
      {{"--group", "0", "--store", "redis://127.0.0.1:99999"}, "--store (port) expects"},
      {{"--group", "0", "--store", "redis://127.0.0.1:80x"}, "--store (port) expects"},
      {{"--group", "0", "--store", "ftp://x"}, "--store expects redis://HOST:PORT or file://DIR"},
      {{"--life", "2"}, "--life"},
  };
  cases.insert(cases.end(), own.begin(), own.end());
  check_refused(FEDSHARD_MULTI_JOB_EXE, "fedshard-multi-job", cases, s);
  CHECK(process(FEDSHARD_MULTI_JOB_EXE, {"--help"}, s.dir.string()).finish(10).code == 0);
}

TEST_CASE(
    "fedshard-multi-job: a short run exits 0; a dead redis-server is reported, not signalled") {
  const scratch s;
  const std::vector<std::string> small{"--groups",        "2", "--hidden", "8", "--batch",   "2",
                                       "--eval-examples", "8", "--k",      "2", "--timeout", "60"};
  std::vector<std::string> good = small;
  good.insert(good.end(), {"--steps", "4"});
  const outcome r = process(FEDSHARD_MULTI_JOB_EXE, good, s.dir.string()).finish(90);
  CHECK_MESSAGE(r.code == 0, (r.out + r.err));
  CHECK(r.out.find("[launcher] all groups done") != std::string::npos);

  // A long run: once both groups train, kill its redis-server (the launcher's child).
  std::vector<std::string> long_run = small;
  long_run.insert(long_run.end(), {"--steps", "1000000"});
  process p(FEDSHARD_MULTI_JOB_EXE, long_run, s.dir.string());
  if (!p.wait_for_output("[launcher] redis-server (", 30)) {
    MESSAGE("no redis-server: the groups met through a file store, nothing to kill");
    return;
  }
  REQUIRE(p.wait_for_output("[group 1] step 0", 60));
  REQUIRE(p.wait_for_output("[group 0] step 0", 60));
  const std::string& out = p.out();
  const auto at = out.find(", pid ", out.find("[launcher] redis-server ("));
  const pid_t redis = static_cast<pid_t>(std::stol(out.substr(at + 6)));
  const auto killed = clock_type::now();
  REQUIRE(::kill(redis, SIGKILL) == 0);
  const outcome end = p.finish(60);
  const double after = std::chrono::duration<double>(clock_type::now() - killed).count();
  CHECK(end.code == 1);
  // Reported when the launcher sees it (before or after the groups fail on the lost store).
  CHECK(end.out.find("[launcher] redis-server died (signal 9 (Killed))") != std::string::npos);
  CHECK(end.out.find("stopped by") == std::string::npos);  // no signal was sent to it
  CHECK(end.out.find("redis-server stopped") == std::string::npos);
  // The launcher no longer sends SIGTERM to the reaped pid and waits 5 s for it.
  CHECK(after < 4);
  MESSAGE("launcher exited ", after, " s after its redis-server was killed");
}
#endif
