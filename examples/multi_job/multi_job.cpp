// fedshard-multi-job: cross-job federation, every group a process of its own.
//
// One binary, two roles:
//  - the launcher (default) starts redis-server on 127.0.0.1 at a free port (or, when no
//    redis-server is found, uses a file store in a temporary directory), then starts G group
//    processes (itself again, with --group g --store URL) and waits for them. With
//    --kill-group g --kill-at-step s that group SIGKILLs itself when it reaches step s (between
//    two syncs); with --restart-after T the launcher starts it again (the same command, with
//    --life 1) T seconds after it died, and it heals at the next sync: it receives a live
//    group's state (parameters, optimizer state, step) and goes on from there. At the end the
//    launcher stops Redis, removes its temporary directory and exits non-zero when a group
//    failed in a way nobody asked for (or the run took longer than --timeout);
//  - a group (--group g) is an inproc job of R x S thread ranks training the character-level
//    LM of examples/charlm with fl_hsdp: sharded inside the group, the groups averaged every
//    --k steps over an elastic link (comm/elastic.hpp) that meets the other groups through
//    the store. After every sync its rank 0 prints the round's outcome (who was combined, of
//    which members; who healed, was dropped, rejected or left out) and the group's perplexity
//    on held-out text (exp of the mean evaluation loss of its ranks, averaged inside the group
//    only).
//
// Every line is prefixed with "[launcher]" or "[group g]". A run that shows a group leaving
// and healing (about 30-60 s on two cores):
//   fedshard-multi-job --kill-group 2 --kill-at-step 105 --restart-after 5

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "charlm/charlm.hpp"
#include "common/cli.hpp"
#include "fedshard/comm/elastic.hpp"
#include "fedshard/comm/gloo.hpp"
#include "fedshard/comm/hybrid.hpp"
#include "fedshard/comm/inproc.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/trainer/trainer.hpp"

#ifdef FEDSHARD_REDIS_SERVER
constexpr const char* default_redis_server = FEDSHARD_REDIS_SERVER;
#else
constexpr const char* default_redis_server = "redis-server";
#endif

namespace {

namespace el = fedshard::elastic;
namespace gl = fedshard::gloo;
using fedshard::detail::concat;
using clock_type = std::chrono::steady_clock;
using seconds = std::chrono::duration<double>;

struct settings {
  // both roles (the launcher passes its whole command line on to the groups)
  int groups = 3;
  int replicas = 1;
  int shards = 2;
  int steps = 400;
  int k = 10;  // steps between syncs
  int hidden = 256;
  int batch = 32;  // examples per rank per step
  int eval_examples = 512;
  float lr = 3e-3f;
  std::uint64_t seed = 1;
  std::string corpus = "/usr/share/common-licenses";
  double join_timeout = 3.0;  // the federation timeout: how long a round waits for a group
  double op_timeout = 60.0;   // deadline of every collective between groups
  int kill_group = -1;
  int kill_at_step = -1;
  // launcher
  std::string redis_server = default_redis_server;
  double restart_after = -1;  // < 0: a killed group stays dead
  double timeout = 240;       // the whole run
  // group
  int group = -1;
  std::string store;
  int life = 0;  // 0: first start, 1: restarted by the launcher
};

/// The --help text.
std::string usage_text() {
  return "usage: fedshard-multi-job [--groups G] [--replicas R] [--shards S] [--steps N] [--k K]\n"
         "       [--hidden H] [--batch B] [--eval-examples N] [--lr LR] [--seed S] [--corpus "
         "PATH]\n"
         "       [--join-timeout SECONDS] [--op-timeout SECONDS]\n"
         "       [--kill-group g --kill-at-step s [--restart-after SECONDS]]\n"
         "       [--redis-server PATH] [--timeout SECONDS]\n"
         "  launcher (default): starts redis-server on 127.0.0.1 and G group processes of R x S\n"
         "  thread ranks (default 3 x 1 x 2) training a char-level LM with fl_hsdp (sync every K\n"
         "  steps); --kill-group/--kill-at-step make group g SIGKILL itself at step s,\n"
         "  --restart-after restarts it that many seconds after it died.\n"
         "  group role (started by the launcher): --group g --store redis://HOST:PORT | "
         "file://DIR\n"
         "  [--life 1]\n"
         "  Limits: G <= 64, R x S <= 64 ranks, --hidden <= 4096, --batch <= 4096,\n"
         "  --eval-examples <= 65536. A bad value exits 2 with a message before anything starts.\n";
}

constexpr int max_groups = 64;
constexpr int max_ranks = 64;  // thread ranks of one group, R x S
constexpr int max_steps = 10'000'000;

/// Declares the options on p, writing into s.
void declare_options(cli::parser& p, settings& s) {
  const cli::bounds seconds_bounds = cli::closed(1e-3, 86400);
  p.integer("--groups", s.groups, 1, max_groups)
      .integer("--replicas", s.replicas, 1, max_ranks)
      .integer("--shards", s.shards, 1, max_ranks)
      .integer("--steps", s.steps, 1, max_steps)
      .integer("--k", s.k, 1, max_steps)
      .integer("--hidden", s.hidden, 1, 4096)
      .integer("--batch", s.batch, 1, 4096)
      .integer("--eval-examples", s.eval_examples, 8, 65536)
      .real("--lr", s.lr, cli::closed(0, 10))
      .integer("--seed", s.seed, 0, std::numeric_limits<std::uint64_t>::max())
      .text("--corpus", s.corpus)
      .real("--join-timeout", s.join_timeout, seconds_bounds)
      .real("--op-timeout", s.op_timeout, seconds_bounds)
      .integer("--kill-group", s.kill_group, 0, max_groups - 1)
      .integer("--kill-at-step", s.kill_at_step, 0, max_steps)
      .real("--restart-after", s.restart_after, cli::closed(0, 86400))
      .text("--redis-server", s.redis_server)
      .real("--timeout", s.timeout, cli::closed(1, 7 * 86400))
      .integer("--group", s.group, 0, max_groups - 1)
      .text("--store", s.store)
      .integer("--life", s.life, 0, 1)
      .flag("--help",
            [] {
              std::fputs(usage_text().c_str(), stdout);
              std::exit(0);
            })
      .alias("-h", "--help");
}

/// The settings of the command line; fedshard::invalid_argument naming the option for a bad
/// one (common/cli.hpp's rules) or for settings that do not go together.
settings parse(int argc, char** argv) {
  settings s;
  cli::parser p;
  declare_options(p, s);
  p.parse(argc, argv);
  if ((s.kill_group >= 0) != (s.kill_at_step >= 0))
    cli::fail("--kill-group and --kill-at-step go together: expected both or neither, found one");
  if (s.kill_group >= s.groups)
    cli::fail(
        concat("--kill-group expects a group < --groups (", s.groups, "), found ", s.kill_group));
  if (s.group >= s.groups)
    cli::fail(concat("--group expects a group < --groups (", s.groups, "), found ", s.group));
  if (s.group >= 0 && s.store.empty()) cli::fail("--group needs --store: found no --store");
  if (s.replicas * s.shards > max_ranks)
    cli::fail(concat("--replicas x --shards expects at most ", max_ranks,
                     " thread ranks per group, found ", s.replicas, " x ", s.shards));
  if (s.eval_examples < s.replicas * s.shards)
    cli::fail(concat("--eval-examples expects at least one example per rank of a group (>= ",
                     s.replicas * s.shards, "), found ", s.eval_examples));
  return s;
}

/// Writes one line to stdout with a single write(): the processes share the terminal (or
/// pipe), and a line written at once is never cut by another process's line.
void say(const std::string& line) {
  const std::string s = line + "\n";
  const char* p = s.data();
  std::size_t n = s.size();
  while (n > 0) {
    const ssize_t w = ::write(1, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return;
    }
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

std::string fixed(double x, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, x);
  return buf;
}

// ---------------------------------------------------------------- the group role

/// The store a group meets the others through: redis://HOST:PORT or file://DIR.
std::shared_ptr<gl::store> open_store(const std::string& url) {
  if (url.rfind("redis://", 0) == 0) {
    const std::string rest = url.substr(8);
    const auto colon = rest.rfind(':');
    if (colon == std::string::npos || colon == 0)
      cli::fail("--store expects redis://HOST:PORT or file://DIR, found '" + url + "'");
    return std::make_shared<gl::redis_store>(
        rest.substr(0, colon),
        cli::parse_integer<int>("--store (port)", rest.substr(colon + 1), 1, 65535));
  }
  if (url.rfind("file://", 0) == 0) return std::make_shared<gl::file_store>(url.substr(7));
  cli::fail("--store expects redis://HOST:PORT or file://DIR, found '" + url + "'");
}

using world_type = fedshard::hybrid<fedshard::inproc::communicator, el::link>;
using trainer_type =
    fedshard::trainer<charlm::model, fedshard::fl_hsdp, fedshard::optim::adamw, world_type>;

int run_group(const settings& s) {
  const auto started = std::chrono::steady_clock::now();
  const std::string tag = concat("[group ", s.group, "] ");
  const charlm::corpus data = charlm::corpus::load(s.corpus);
  const charlm::dims dims{data.vocab(), 8, 16, s.hidden};
  const int L = s.replicas * s.shards;
  const fedshard::mesh_shape shape{s.groups, s.replicas, s.shards};
  // The held-out text every group is evaluated on, split among the group's ranks.
  const auto eval_all = charlm::model::eval_batch(data, dims.context, s.eval_examples);
  say(tag + concat(s.life == 0 ? "started" : "restarted", " (pid ", ::getpid(), "): ", L,
                   " thread ranks (", s.replicas, " x ", s.shards, "), store ", s.store));

  fedshard::inproc::options run_options;
  run_options.spin_polls = 0;  // more ranks than cores: waiting ranks sleep
  fedshard::inproc::run(
      L,
      [&](fedshard::inproc::communicator& c) {
        const int l = c.rank();
        el::options o;
        o.job = "multi_job";
        o.join_timeout = seconds(s.join_timeout);
        o.transport.timeout = seconds(s.op_timeout);
        // The link's own lines (a late group, a failed op retried among the survivors, a
        // rejected group), once per group; its round's outcome is in our round line below.
        o.log = [tag, l](const std::string& line) {
          if (l == 0 && line.rfind("fedshard elastic: round ", 0) != 0) say(tag + line);
        };
        el::link lk(open_store(s.store), s.groups, s.group, L, l, o);
        world_type w(c.split(0, l), std::move(lk));
        fedshard::mesh m(w, shape);
        fedshard::trainer_options<fedshard::fl_hsdp> to;
        to.total_steps = s.steps;
        to.schedule.period = s.k;
        trainer_type t(m, charlm::model(dims, s.seed), {.lr = s.lr, .weight_decay = 0.0f}, to);
        el::link& link = t.topology().federation().federation_side();

        const std::size_t per = eval_all.size() / static_cast<std::size_t>(L);
        const charlm::batch eval(eval_all.begin() + static_cast<std::ptrdiff_t>(per * l),
                                 eval_all.begin() + static_cast<std::ptrdiff_t>(per * (l + 1)));
        // The group's perplexity: its ranks' mean loss, averaged inside the group (not over
        // the link: the other groups need not be there).
        auto group_ppl = [&] {
          double loss = t.evaluate(eval);
          c.all_reduce(&loss, &loss, 1, fedshard::dtype::f64, fedshard::reduce_op::avg);
          return std::exp(loss);
        };
        const double ppl0 = group_ppl();
        if (l == 0) say(tag + concat("step 0: eval ppl ", fixed(ppl0, 3)));

        while (t.step_count() < s.steps) {
          const std::int64_t step = t.step_count();
          if (s.life == 0 && s.group == s.kill_group && step == s.kill_at_step) {
            c.barrier();
            if (l == 0) {
              say(tag + concat("step ", step, ": killing this group (SIGKILL), as asked"));
              ::kill(::getpid(), SIGKILL);
            }
            std::this_thread::sleep_for(std::chrono::seconds(60));
          }
          const auto rounds = link.rounds_seen();
          // Rank (g, l)'s batch; a healed group jumps to the donor's step, so the step is read
          // from the trainer every time.
          const auto before = std::chrono::steady_clock::now();
          t.step(charlm::model::training_batch(data, dims.context, s.seed, step, s.group * L + l,
                                               s.batch));
          const auto after = std::chrono::steady_clock::now();
          if (link.rounds_seen() == rounds) continue;
          // The step with the round: its compute, the round (arrive, decide, connect, heal)
          // and the sync; a survivor's stall when a group died shows here.
          const double sync_step = std::chrono::duration<double>(after - before).count();
          const double ppl = group_ppl();
          if (l != 0) continue;
          const el::round_info& r = link.round();
          std::string healed;
          if (r.has(r.joiners, s.group))
            healed = concat(" (healed: took group ", r.donor, "'s state, step ", step + 1, " -> ",
                            t.step_count(), "; first sync ",
                            fixed(std::chrono::duration<double>(after - started).count(), 2),
                            " s after this process started)");
          say(tag + concat(link.outcome(), "; sync step ", fixed(sync_step, 3), " s; now at step ",
                           t.step_count(), ", eval ppl ", fixed(ppl, 3), healed));
        }
        if (l == 0)
          say(tag + concat("done: ", t.step_count(), " steps, ", t.syncs_applied(), " syncs, ",
                           link.rounds_seen(), " rounds in this process"));
      },
      run_options);
  return 0;
}

// ---------------------------------------------------------------- the launcher

volatile sig_atomic_t stop_signal = 0;
extern "C" void on_stop_signal(int sig) {
  stop_signal = sig;
}

/// A directory under the system's temporary folder, removed with everything in it.
class temp_dir {
 public:
  temp_dir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "fedshard-multi-job-XXXXXX");
    if (::mkdtemp(pattern.data()) == nullptr)
      throw fedshard::backend_error(
          concat("cannot make a temporary directory: ", std::strerror(errno)));
    path_ = pattern;
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

/// A child process of the launcher. It is reaped at most once, and signalled only while it
/// has not been reaped: once reaped (or found not to be our child), its pid may already name
/// another process.
class child_process {
 public:
  child_process() = default;
  explicit child_process(pid_t pid) : pid_(pid) {}

  pid_t pid() const { return pid_; }
  /// True once it has exited and been reaped (or waitpid says it is not our child).
  bool reaped() const { return reaped_; }
  /// Its wait status, once reaped; known() is false when waitpid could not tell it.
  int status() const { return status_; }
  bool known() const { return known_; }
  /// "exit code 0", "signal 9 (Killed)", once reaped.
  std::string describe() const {
    if (!known_) return "unknown status (not a child of the launcher)";
    if (WIFEXITED(status_)) return concat("exit code ", WEXITSTATUS(status_));
    if (WIFSIGNALED(status_))
      return concat("signal ", WTERMSIG(status_), " (", ::strsignal(WTERMSIG(status_)), ")");
    return "unknown status";
  }

  /// Reaps it when it has exited; true once reaped. Never blocks.
  bool poll() {
    if (reaped_ || pid_ <= 0) return true;
    int st = 0;
    const pid_t r = ::waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      reaped_ = known_ = true;
      status_ = st;
    } else if (r < 0 && errno == ECHILD) {
      reaped_ = true;  // not (or no longer) ours: never signal it
    }
    return reaped_;
  }

  /// Unless it is already reaped: sends sig, waits up to `grace` seconds for it to exit, then
  /// SIGKILLs it and reaps it. True when a signal was sent.
  bool stop(int sig, double grace) {
    if (poll()) return false;
    ::kill(pid_, sig);
    const auto deadline = clock_type::now() + seconds(grace);
    while (clock_type::now() < deadline) {
      if (poll()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (poll()) return true;
    ::kill(pid_, SIGKILL);
    int st = 0;
    while (::waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
    }
    reaped_ = known_ = true;
    status_ = st;
    return true;
  }

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
  bool known_ = false;
  int status_ = 0;
};

/// Forks and execs argv; the child dies with the launcher (PR_SET_PDEATHSIG), starts in
/// `cwd` when given and writes its output to `log` when given.
pid_t start_process(const std::vector<std::string>& args, const std::string& cwd = "",
                    const std::string& log = "") {
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) throw fedshard::backend_error(concat("fork failed: ", std::strerror(errno)));
  if (pid > 0) return pid;
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(127);  // the launcher is already gone
  if (!cwd.empty() && ::chdir(cwd.c_str()) != 0) ::_exit(127);
  if (!log.empty()) {
    if (FILE* f = std::fopen(log.c_str(), "w")) {
      ::dup2(::fileno(f), 1);
      ::dup2(::fileno(f), 2);
    }
  }
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execv(argv[0], argv.data());
  std::fprintf(stderr, "fedshard-multi-job: cannot run %s: %s\n", argv[0], std::strerror(errno));
  ::_exit(127);
}

/// The redis-server binary: `name` itself when it holds a '/', else the first one on PATH;
/// empty when there is none.
std::string find_program(const std::string& name) {
  auto runnable = [](const std::filesystem::path& p) {
    return !p.empty() && std::filesystem::is_regular_file(p) && ::access(p.c_str(), X_OK) == 0;
  };
  if (name.find('/') != std::string::npos) return runnable(name) ? name : "";
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "");
  for (std::string d; std::getline(dirs, d, ':');)
    if (!d.empty() && runnable(std::filesystem::path(d) / name))
      return (std::filesystem::path(d) / name).string();
  return "";
}

/// A port on 127.0.0.1 that nobody listens on right now (the kernel picks it).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t n = sizeof a;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

/// redis-server on 127.0.0.1 at a free port, without persistence, run in `dir`; stopped
/// (SIGTERM, then SIGKILL) by the destructor.
class redis_server {
 public:
  redis_server(const std::string& binary, const std::filesystem::path& dir) {
    for (int attempt = 0; attempt < 10 && !running_; ++attempt) {
      port_ = free_port();
      if (port_ == 0) continue;
      const std::string log = (dir / "redis.log").string();
      child_process p(start_process(
          {binary, "--port", std::to_string(port_), "--bind", "127.0.0.1", "--save", "",
           "--appendonly", "no", "--protected-mode", "yes", "--loglevel", "warning"},
          dir.string(), log));
      // Up when a store connects; a port taken meanwhile makes the server exit.
      for (int i = 0; i < 400 && !p.poll(); ++i) {
        try {
          gl::redis_store probe("127.0.0.1", port_);
          running_ = true;
          break;
        } catch (const fedshard::backend_error&) {
          std::this_thread::sleep_for(std::chrono::milliseconds(25));
        }
      }
      if (running_)
        process_ = p;
      else
        p.stop(SIGKILL, 0);  // signals it only when it has not exited (and been reaped)
    }
  }
  redis_server(const redis_server&) = delete;
  redis_server& operator=(const redis_server&) = delete;
  ~redis_server() { stop(); }
  /// Stops the server: SIGTERM, then SIGKILL after 5 s; nothing when it already exited.
  void stop() {
    if (running_) process_.stop(SIGTERM, 5);
    running_ = false;
  }
  bool running() const { return running_; }
  /// True when the server has exited on its own (it is reaped: stop() will not signal it).
  bool exited() { return running_ && process_.poll(); }
  const child_process& process() const { return process_; }
  pid_t pid() const { return process_.pid(); }
  int port() const { return port_; }

 private:
  child_process process_;
  bool running_ = false;
  int port_ = 0;
};

/// The corpus every group trains on, read once by the launcher before anything starts:
/// fedshard::invalid_argument naming --corpus when it cannot be read or is too short.
void check_corpus(const settings& s) {
  try {
    (void)charlm::corpus::load(s.corpus);
  } catch (const fedshard::invalid_argument& e) {
    cli::fail(std::string("--corpus: ") + e.what());
  }
}

int run_launcher(const settings& s, int argc, char** argv) {
  const std::string tag = "[launcher] ";
  std::string self(4096, '\0');
  const ssize_t n = ::readlink("/proc/self/exe", self.data(), self.size() - 1);
  self = n > 0 ? self.substr(0, static_cast<std::size_t>(n)) : std::string(argv[0]);

  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);

  temp_dir tmp;
  std::optional<redis_server> redis;
  std::string store;
  std::string binary = find_program(s.redis_server);
  if (binary.empty() && s.redis_server != "redis-server") binary = find_program("redis-server");
  if (!binary.empty()) {
    redis.emplace(binary, tmp.path());
    if (redis->running()) {
      store = concat("redis://127.0.0.1:", redis->port());
      say(tag + concat("redis-server (", binary, ") on 127.0.0.1:", redis->port(), ", pid ",
                       redis->pid()));
    } else {
      say(tag + concat(binary, " did not start"));
      redis.reset();
    }
  }
  if (store.empty()) {
    store = "file://" + (tmp.path() / "store").string();
    say(tag + concat("no redis-server (looked for '", s.redis_server,
                     "'); the groups meet through a file store in ", tmp.path().string()));
  }
  say(tag + concat(s.groups, " groups x ", s.replicas, " x ", s.shards,
                   " thread ranks, charlm (hidden ", s.hidden, "), fl_hsdp: ", s.steps,
                   " steps, a sync every ", s.k, " steps, join timeout ", s.join_timeout,
                   " s; a dead group is noticed after ", el::options{}.missed_beats,
                   " missed beats of ", el::options{}.beat_period.count(), " s"));
  if (s.kill_group >= 0)
    say(tag + concat("group ", s.kill_group, " will SIGKILL itself at step ", s.kill_at_step,
                     s.restart_after >= 0
                         ? concat("; restarted ", s.restart_after, " s after it dies")
                         : std::string("; not restarted")));

  struct child {
    int group;
    int life;
    child_process process;
  };
  std::vector<child> children;
  auto start_group = [&](int g, int life) {
    std::vector<std::string> args{self};
    for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
    for (const auto& a : {std::string("--group"), std::to_string(g), std::string("--store"), store,
                          std::string("--life"), std::to_string(life)})
      args.push_back(a);
    children.push_back({g, life, child_process(start_process(args))});
    say(tag + concat(life == 0 ? "started" : "restarted", " group ", g, " (pid ",
                     children.back().process.pid(), ")"));
  };
  const auto t0 = clock_type::now();
  for (int g = 0; g < s.groups; ++g) start_group(g, 0);

  bool failed = false;
  // A flag and a time rather than an optional: GCC 12 at -O1 warns (falsely) that the
  // optional's time may be read uninitialized.
  bool restart_pending = false;
  clock_type::time_point restart_at{};
  for (;;) {
    bool any = false;
    for (auto& ch : children) {
      if (ch.process.reaped()) continue;
      if (!ch.process.poll()) {
        any = true;
        continue;
      }
      const int status = ch.process.status();
      const bool known = ch.process.known();
      const bool asked = known && ch.group == s.kill_group && ch.life == 0 && WIFSIGNALED(status) &&
                         WTERMSIG(status) == SIGKILL;
      if (known && WIFEXITED(status) && WEXITSTATUS(status) == 0) {
        say(tag + concat("group ", ch.group, " finished"));
      } else if (asked) {
        say(tag + concat("group ", ch.group, " died (SIGKILL, as asked)"));
        if (s.restart_after >= 0) {
          restart_pending = true;
          restart_at = clock_type::now() +
                       std::chrono::duration_cast<clock_type::duration>(seconds(s.restart_after));
        }
      } else {
        say(tag + concat("group ", ch.group, " FAILED: ", ch.process.describe()));
        failed = true;
      }
    }
    if (restart_pending && clock_type::now() >= restart_at) {
      restart_pending = false;
      if (any) {
        start_group(s.kill_group, 1);
        any = true;
      } else {  // it would wait for a round that never comes
        say(tag + concat("not restarting group ", s.kill_group, ": the others have finished"));
      }
    }
    if (!any && !restart_pending) break;
    // Why the run stops early, if it does: a signal only when one was delivered.
    std::string stop_why;
    if (redis && redis->exited()) {  // reaped: redis.reset() below will not signal it
      stop_why = "redis-server died (" + redis->process().describe() + ")";
      redis.reset();
    } else if (const int sig = stop_signal; sig != 0) {
      stop_why = concat("stopped by signal ", sig, " (", ::strsignal(sig), ")");
    } else if (clock_type::now() - t0 > seconds(s.timeout)) {
      stop_why = concat("the run took longer than ", s.timeout, " s");
    }
    if (!stop_why.empty()) {
      say(tag + stop_why + "; stopping the groups");
      for (auto& ch : children) ch.process.stop(SIGKILL, 0);  // only those not reaped
      failed = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (redis && redis->exited()) {  // died after the groups (which it made fail): never signalled
    say(tag + "redis-server died (" + redis->process().describe() + ")");
    failed = true;
  } else if (redis) {
    redis->stop();
    say(tag + "redis-server stopped");
  }
  say(tag + concat(failed ? "FAILED" : "all groups done", " after ",
                   seconds(clock_type::now() - t0).count(), " s"));
  return failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Bad input (an option, the store URL, the corpus) exits 2 with one line on stderr before
  // anything starts (common/cli.hpp); a failure while running is reported with the role's tag
  // and exits 1.
  return cli::run_main("fedshard-multi-job", [&] {
    const settings s = parse(argc, argv);
    if (s.group < 0) {
      check_corpus(s);
      try {
        return run_launcher(s, argc, argv);
      } catch (const std::exception& e) {
        say(concat("[launcher] failed: ", e.what()));
        return 1;
      }
    }
    try {
      return run_group(s);
    } catch (const fedshard::invalid_argument&) {
      throw;  // bad input (the store URL): exit 2
    } catch (const std::exception& e) {
      say(concat("[group ", s.group, "] failed: ", e.what()));
      return 1;
    }
  });
}
