/// The Gloo link between two processes on this machine (comm/gloo.hpp): how fast an all_reduce
/// of S bytes goes, against S and the link's settings.
///
/// Every benchmark forks a second process (rank 1); the benchmark process is rank 0. They meet
/// through a file store in a fresh temporary directory, connect one gloo::communicator with the
/// settings under test, and run a fixed number of all_reduce(sum) calls of S bytes of f32
/// (warm-up calls first, not timed). Before every timed call the two ranks pass a barrier; rank
/// 0 times the call alone (manual time). Rank 1 runs the same calls and exits.
///
/// Arguments: S in MiB, checked (1: every call's arguments exchanged first, options::checked;
/// 0: not), pipelined (1: options::pipeline_bytes at its default; 0: one exchange for the
/// whole message) and stripes (options::stripes: TCP connections between the two ranks, each
/// with its own Gloo context and threads).
///
/// Counters:
///  - Gbit/s: S x 8 / time (what the caller sees: the algorithm's bandwidth);
///  - wire_Gbit/s: the bytes this rank handed to Gloo (moved().sent) x 8 / time;
///  - GB/s: S / time (the heal's measure: bm_transfer, S from rank 0 to rank 1, striped);
///  - median_ms: the median of the timed calls (the time column is their mean).
///
/// bm_firing/tensors/check: one firing of a plan of `tensors` all_reduce(sum) ops of 16 KiB
/// each (a sync of a model of that many tensors) over the federation axis of a mesh of the two
/// ranks, through the interpreter, timed from a barrier to the firing's completion. check 0:
/// unchecked; 1: checked, every call (options::every_call, FEDSHARD_GLOO_CHECKED=always);
/// 2: checked as by default, the firing's first call only (the plan vouches for the others).
///
/// bm_heal_donors/MiB/donors: a heal of S bytes (federation/heal.hpp) into one joiner from
/// `donors` donors, donors + 1 processes: with one donor the whole state from it (heal()),
/// with more the split of a heal from several donors (heal_from_donors): 3/5 of S the first
/// donor's own state, 2/5 the shared one (diloco's proportions with AdamW inside: master and
/// two moments against anchor and outer momentum), in pieces from the others, side by side.
/// The shared state is named in O(1) (as the trainer's: checkpoint::file_digest). Timed on
/// rank 0 from a barrier to the joiner's answer once it holds the state (checked after).
///
/// Across network namespaces (bench/netns_link.sh): with FEDSHARD_BENCH_NETNS=
/// "<ns0>@<addr0>,<ns1>@<addr1>" rank r enters network namespace <nsr> (ip netns's
/// /run/netns/<nsr>) before it connects and listens on <addrr>, so the two ranks talk over
/// whatever joins the namespaces (a veth pair with a rate limit) instead of the loopback.

#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "fedshard/comm/gloo.hpp"
#include "fedshard/federation/heal.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/interpreter.hpp"

namespace {

namespace gl = fedshard::gloo;
using fedshard::dtype;
using fedshard::reduce_op;

constexpr int warmup = 2;
constexpr int iterations = 8;
constexpr int firing_iterations = 48;  // bm_firing: short calls, whose times spread widely

struct setting {
  std::int64_t bytes;
  bool checked;
  bool pipelined;
  int stripes;
  bool transfer = false;  // rank 0 sends the bytes to rank 1 instead of an all_reduce
  bool heal = false;      // rank 0 heals rank 1 with a state of the bytes (federation/heal.hpp)
  int donors = 0;         // > 0: bm_heal_donors, on donors + 1 ranks
  int tensors = 0;        // > 0: a firing of that many all_reduces of `bytes` (bm_firing)
  bool every_call = false;
};

/// Where rank `rank` runs under FEDSHARD_BENCH_NETNS (file comment): its namespace and
/// address; nothing when the variable is unset; std::runtime_error when it is malformed.
struct place {
  std::string netns;
  std::string address;
};
std::optional<place> place_of(int rank) {
  const char* v = std::getenv("FEDSHARD_BENCH_NETNS");
  if (v == nullptr || *v == '\0') return std::nullopt;
  const std::string all(v);
  const auto comma = all.find(',');
  const std::string mine = rank == 0                    ? all.substr(0, comma)
                           : comma == std::string::npos ? std::string()
                                                        : all.substr(comma + 1);
  const auto at = mine.find('@');
  if (at == std::string::npos || at == 0 || at + 1 == mine.size())
    throw std::runtime_error(
        "bench_link: FEDSHARD_BENCH_NETNS must be "
        "'<ns0>@<addr0>,<ns1>@<addr1>', found '" +
        all + "'");
  return place{mine.substr(0, at), mine.substr(at + 1)};
}
/// Moves the calling thread (and the threads it starts from now on: Gloo's) into namespace
/// p.netns.
void enter(const place& p) {
  const std::string path = "/run/netns/" + p.netns;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("bench_link: cannot open " + path);
  const int rc = ::setns(fd, CLONE_NEWNET);
  ::close(fd);
  if (rc != 0) throw std::runtime_error("bench_link: setns into " + path + " failed");
}

gl::options options_of(const setting& s) {
  gl::options o;
  o.timeout = std::chrono::seconds(120);
  o.checked = s.checked;
  if (!s.pipelined) o.pipeline_bytes = 0;
  o.stripes = s.stripes;
  o.every_call = s.every_call;
  return o;
}

/// Rank c.rank() of bm_firing: fires a plan of s.tensors all_reduces of s.bytes each on the
/// federation axis; rank 0 times each firing from a barrier to its completion.
template <class Time>
void firing_rank(gl::communicator& c, const setting& s, Time&& time) {
  fedshard::mesh m(c, {2, 1, 1});
  fedshard::interpreter<gl::communicator> in(m);
  const auto n = static_cast<std::size_t>(s.bytes / 4);
  fedshard::plan p;
  std::vector<std::vector<float>> bufs;
  for (int i = 0; i < s.tensors; ++i) {
    p.ops.push_back({.kind = fedshard::comm_kind::all_reduce,
                     .axis = fedshard::axis::federation,
                     .bytes = s.bytes,
                     .ranks = 2,
                     .reduce = reduce_op::sum,
                     .in = {.role = fedshard::role::value, .index = 2 * i},
                     .out = {.role = fedshard::role::value, .index = 2 * i + 1}});
    bufs.emplace_back(n, 1.0f + static_cast<float>(c.rank()));
    bufs.emplace_back(n, 0.0f);
  }
  const auto bind = [&](const fedshard::comm_op&, const fedshard::operand& o) {
    auto& v = bufs[static_cast<std::size_t>(o.index)];
    return fedshard::buffer_view{v.data(), v.size(), dtype::f32};
  };
  for (int i = 0; i < warmup + firing_iterations; ++i) {
    c.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    in.wait(in.fire(p, {}, bind));
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i >= warmup) time(t);
  }
  if (bufs.back().front() != 3.0f) throw std::runtime_error("bench_link: wrong firing result");
}

/// Rank c.rank() of a heal of s.bytes: rank 0 (the donor) sends its state through the heal
/// plan and the interpreter (federation::send_heal), rank 1 (the joiner) receives it
/// (receive_heal: the size, then the state, into the memory of the joiner's own state of the
/// same size, made before the clock starts, as federation::heal passes it) and answers with
/// one float once it holds it; rank 0 times from before send_heal to the answer.
template <class Time>
std::int64_t heal_rank(gl::communicator& c, const setting& s, Time&& time) {
  fedshard::mesh m(c, {2, 1, 1});
  fedshard::interpreter<gl::communicator> in(m);
  const fedshard::federation::heal_round r{.ranks = 2, .donor = 0, .joiners = {1}, .me = c.rank()};
  const std::string blob(static_cast<std::size_t>(s.bytes), 'x');
  float ack = 0;
  for (int i = 0; i < warmup + iterations; ++i) {
    if (r.me == 0) {
      std::string state = blob;  // the donor's serialized state, made before the clock starts
      c.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      fedshard::federation::send_heal(in, r, std::move(state));
      c.recv(&ack, 1, dtype::f32, 1);
      const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (i >= warmup) time(t);
    } else {
      std::string own(blob.size(), 'y');  // the joiner's own state, made before the clock starts
      c.barrier();
      const auto got = fedshard::federation::receive_heal(in, r, s.bytes, std::move(own));
      c.send(&ack, 1, dtype::f32, 0);
      if (got != blob) throw std::runtime_error("bench_link: the healed state differs");
    }
  }
  return in.traffic().total().sent;
}

/// Rank c.rank() of bm_heal_donors (file comment): ranks 0..donors-1 donate, the last rank
/// joins; the states are made before the clock starts.
template <class Time>
void heal_donors_rank(gl::communicator& c, const setting& s, Time&& time) {
  namespace fed = fedshard::federation;
  const int n = c.size(), joiner = n - 1;
  fedshard::mesh m(c, {n, 1, 1});
  fedshard::interpreter<gl::communicator> in(m);
  fed::heal_round r{.ranks = n, .donor = 0, .joiners = {joiner}, .me = c.rank()};
  if (s.donors > 1)
    for (int d = 0; d < s.donors; ++d) r.donors.push_back(d);
  // Named in O(1), as the trainer's shared state is (a checkpoint file's trailer names it:
  // checkpoint::file_digest); here its first 8 bytes.
  r.digest = [](const std::string& b) {
    std::uint64_t d = 0;
    std::memcpy(&d, b.data(), std::min(b.size(), sizeof d));
    return d;
  };
  const auto own_bytes = static_cast<std::size_t>(s.bytes * 3 / 5) / 8 * 8;  // whole words
  const auto shared_bytes = static_cast<std::size_t>(s.bytes) - own_bytes;
  // What each rank holds before the clock starts, with room for the padding (as the
  // trainer's serialized states: checkpoint::heal_spare_bytes).
  auto held = [](std::size_t n, char c) {
    std::string b;
    b.reserve(n + 64);
    b.assign(n, c);
    return b;
  };
  const bool joins = r.me == joiner;
  float ack = 0;
  for (int i = 0; i < warmup + iterations; ++i) {
    std::string all, own, shared;
    if (s.donors == 1) {
      all = held(own_bytes + shared_bytes, joins ? 'y' : 'o');
    } else {
      if (joins || r.me == 0) own = held(own_bytes, joins ? 'y' : 'o');
      if (joins || r.me > 0) shared = held(shared_bytes, joins ? 'z' : 's');
    }
    auto is = [](const std::string& b, std::size_t n, char c) {
      return b.size() == n && std::all_of(b.begin(), b.end(), [c](char x) { return x == c; });
    };
    c.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    if (s.donors == 1) {
      fed::heal(
          in, r, [&] { return std::move(all); }, [&](std::string got) { all = std::move(got); });
    } else {
      fed::heal_from_donors(
          in, r, [&] { return std::move(own); }, [&] { return std::move(shared); },
          [&](fed::heal_parts p) {
            own = std::move(p.own);
            shared = std::move(p.shared);
          });
    }
    if (joins) {
      c.send(&ack, 1, dtype::f32, 0);  // it holds the state; checked after the clock
      const bool right = s.donors == 1 ? is(all, own_bytes + shared_bytes, 'o')
                                       : is(own, own_bytes, 'o') && is(shared, shared_bytes, 's');
      if (!right) throw std::runtime_error("bench_link: the healed state differs");
    } else if (r.me == 0) {
      c.recv(&ack, 1, dtype::f32, joiner);
      const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (i >= warmup) time(t);
    }
  }
}

/// Runs `calls` all_reduces of s.bytes on rank `rank` (or transfers: rank 0 sends, rank 1
/// receives and answers with one float, which rank 0 receives); rank 0 reports each timed
/// call's seconds to `time` and returns the bytes it sent.
template <class Time>
std::int64_t run_rank(const std::filesystem::path& dir, int rank, const setting& s, Time&& time) {
  auto st = std::make_shared<gl::file_store>(dir);
  auto o = options_of(s);
  if (const auto p = place_of(rank)) {
    enter(*p);
    o.hostname = p->address;
  }
  gl::communicator c(st, "link", rank, s.donors > 0 ? s.donors + 1 : 2, o);
  if (s.heal) return heal_rank(c, s, time);
  if (s.donors > 0) {
    heal_donors_rank(c, s, time);
    return 0;
  }
  if (s.tensors > 0) {
    firing_rank(c, s, time);
    return 0;
  }
  const auto n = s.bytes / static_cast<std::int64_t>(sizeof(float));
  std::vector<float> in(static_cast<std::size_t>(n), 1.0f + static_cast<float>(rank));
  std::vector<float> out(in.size());
  float ack = 0;
  const auto call = [&] {
    if (!s.transfer) {
      c.all_reduce(in.data(), out.data(), n, dtype::f32, reduce_op::sum);
    } else if (rank == 0) {
      c.send(in.data(), n, dtype::f32, 1);
      c.recv(&ack, 1, dtype::f32, 1);
    } else {
      c.recv(out.data(), n, dtype::f32, 0);
      c.send(&ack, 1, dtype::f32, 0);
    }
  };
  for (int i = 0; i < warmup; ++i) call();
  const auto before = c.moved();
  for (int i = 0; i < iterations; ++i) {
    c.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    call();
    time(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const float want = s.transfer ? 1.0f : 3.0f;
  if ((!s.transfer || rank == 1) && (out.front() != want || out.back() != want))
    throw std::runtime_error("bench_link: wrong result");
  return (c.moved() - before).sent;
}

void run(benchmark::State& state, const setting& s) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("fedshard_bench_link_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::vector<pid_t> children;
  for (int rank = 1; rank < (s.donors > 0 ? s.donors + 1 : 2); ++rank) {
    const pid_t child = ::fork();
    if (child == 0) {
      try {
        (void)run_rank(dir, rank, s, [](double) {});
        ::_exit(0);
      } catch (...) {
        ::_exit(3);
      }
    }
    children.push_back(child);
  }
  std::vector<double> seconds;
  std::int64_t sent = 0;
  try {
    sent = run_rank(dir, 0, s, [&](double t) { seconds.push_back(t); });
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
  bool failed = false;
  for (const pid_t child : children) {
    int status = 0;
    ::waitpid(child, &status, 0);
    failed = failed || !WIFEXITED(status) || WEXITSTATUS(status) != 0;
  }
  std::filesystem::remove_all(dir);
  if (failed) state.SkipWithError("another rank failed");
  double total = 0;
  std::size_t i = 0;
  for (auto _ : state) {
    const double t = i < seconds.size() ? seconds[i++] : 0.0;
    state.SetIterationTime(t);
    total += t;
  }
  if (total > 0) {
    const auto timed = static_cast<double>(seconds.size());
    const auto bytes = static_cast<double>(s.bytes) * std::max(1, s.tensors);  // per timed call
    std::sort(seconds.begin(), seconds.end());
    state.counters["median_ms"] = seconds[seconds.size() / 2] * 1e3;
    state.counters["Gbit/s"] = bytes * 8 * timed / total / 1e9;
    state.counters["wire_Gbit/s"] = static_cast<double>(sent) * 8 / total / 1e9;
    state.counters["GB/s"] = bytes * timed / total / 1e9;
  }
}

void bm_all_reduce(benchmark::State& state) {
  run(state, {state.range(0) << 20, state.range(1) != 0, state.range(2) != 0,
              static_cast<int>(state.range(3))});
}

/// A heal's transfer: S MiB from rank 0 to rank 1 over `stripes` connections.
void bm_transfer(benchmark::State& state) {
  run(state, {state.range(0) << 20, false, true, static_cast<int>(state.range(1)), true});
}

/// A heal of S MiB (the plan's size and state transfers, through the interpreter) over
/// `stripes` connections.
void bm_heal(benchmark::State& state) {
  setting s{state.range(0) << 20, false, true, static_cast<int>(state.range(1))};
  s.heal = true;
  run(state, s);
}

/// A heal of S MiB into one joiner from `donors` donors (file comment).
void bm_heal_donors(benchmark::State& state) {
  setting s{state.range(0) << 20, false, true, 1};
  s.donors = static_cast<int>(state.range(1));
  run(state, s);
}

/// A firing of `tensors` all_reduces of 16 KiB, checked as `check` says (file comment).
void bm_firing(benchmark::State& state) {
  const auto check = state.range(1);
  setting s{16 << 10, check != 0, true, 1};
  s.tensors = static_cast<int>(state.range(0));
  s.every_call = check == 1;
  run(state, s);
}

}  // namespace

BENCHMARK(bm_all_reduce)
    ->ArgNames({"MiB", "checked", "pipelined", "stripes"})
    ->ArgsProduct({{1, 16, 64}, {1, 0}, {1, 0}, {1}})
    ->Iterations(iterations)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
// Stripes against one connection, unchecked and pipelined.
BENCHMARK(bm_all_reduce)
    ->ArgNames({"MiB", "checked", "pipelined", "stripes"})
    ->ArgsProduct({{16, 64}, {0}, {1}, {2, 4, 8}})
    ->Iterations(iterations)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(bm_transfer)
    ->ArgNames({"MiB", "stripes"})
    ->ArgsProduct({{64, 1024}, {1, 4, 8}})
    ->Iterations(iterations)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(bm_heal)
    ->ArgNames({"MiB", "stripes"})
    ->ArgsProduct({{1024}, {1, 8}})
    ->Iterations(iterations)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(bm_heal_donors)
    ->ArgNames({"MiB", "donors"})
    ->ArgsProduct({{1024}, {1, 2, 3}})
    ->Iterations(iterations)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(bm_firing)
    ->ArgNames({"tensors", "check"})
    ->ArgsProduct({{8, 64}, {0, 1, 2}})
    ->Iterations(firing_iterations)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
