/// Saving without stopping (issue 14): the step time of a trainer while trainer::save_async
/// writes a checkpoint of about 100 MB in the background, against the step time without a
/// save, measured side by side in one process; trainer::save (synchronous) for reference.
///
/// The trainer: one inproc rank, ddp on a 1 x 1 x 1 mesh, AdamW. The model (`wide_mlp`) has
/// `layers` = 8 units of a 1024 x 1024 weight and a 1024 bias (tanh between layers, a squared
/// loss on the last one's output): 8,396,800 parameters, so its saved state (the f32 master,
/// AdamW's exp_avg and exp_avg_sq) is 3 x 4 x 8,396,800 B = 100.8 MB. Its forward_backward
/// computes with batches of `batch` = 32 samples (3 x 32 multiply-adds per parameter: the
/// forward product, the weight gradient and the input gradient), single-threaded, through the
/// step context's acquire / release / grad_buffer / grads_ready hooks; with AdamW's update a
/// step takes about 100-200 ms on the 2-core machine. The batch is made once and reused.
///
/// A *block* is `every` = N = 3 steps on the rank's thread, timed with steady_clock:
///  - plain: N steps;
///  - async: save_async(dir), then N steps, then wait_for_save() (so that no save overlaps the
///    next block; its time counts, and is about 0 when the save ended within the block). The
///    first step's time includes the save_async call: the snapshot of the state into host
///    memory on the calling thread is part of the price;
///  - sync: save(dir), then N steps.
/// The block's time / N is its step time. A step *overlaps* the save when it is the first of
/// the block or save_in_flight() is true right before it starts.
///
/// Rows (Iterations = rounds; every round runs one block of each kind listed, back to back, so
/// that load from elsewhere on the shared machine hits them alike; manual time = the step time
/// of the row's second kind):
///  - `checkpoint/interleaved`: plain, async, sync. The criterion's figures: `async_over_plain`
///    (step time of the async blocks over the plain ones, all rounds) and
///    `async_overlapped_over_plain` (the mean time of the steps that overlapped a save, the one
///    that called save_async included, over the plain step time); `sync_over_plain`;
///  - `checkpoint/writer_own_core`, `writer_same_core`, `writer_sched_idle` (plain, async):
///    the writer thread placed as `placement` says (where the time goes).
/// Counters, per kind K (plain, async, sync): `K_step_ms`, `K_over_plain`,
/// `K_cpu_step_ms` and `K_cpu_over_plain` (the same with the rank thread's CPU time instead of
/// the wall clock: what the save adds to the compute thread's own work, whatever the load
/// from elsewhere; wall minus CPU is time the thread waited or was preempted); per background
/// kind also `K_overlapped_step_ms`, `K_overlapped_over_plain`, `K_first_step_ms` (the step
/// that started the save, the call included), `K_later_step_ms` (the other overlapping steps:
/// the writer's interference alone), `K_overlap_fraction` (overlapping steps / steps),
/// `K_snapshot_ms` (time in the call that started the save), `K_save_ms` (from that call to the
/// mtime of the last file written: the manifest, for save_async; i.e. the whole save as it ran
/// during training, to the kernel's file-time resolution of a few ms), `K_wait_ms` (time in the
/// block's final wait); `sync_save_ms` (time in save); `state_MB` (bytes of the rank file),
/// `batch`, `every`, and `load_avg` (the 1-minute load average at the end of the row: other
/// work on the machine). Each row first takes 2 steps and one save_async + wait_for_save,
/// untimed, and prints a one-line summary to stderr at its end.
///
/// `checkpoint_parts/*` time what a save does, on 100 MB, without training: `snapshot`
/// (save_async's call: the state copied into host memory), `save_async_idle` (save_async +
/// wait_for_save: the whole save with nothing else running), `fnv1a` (the checksum of
/// checkpoint.hpp before this change, byte-wise, per 1 MiB chunk), `checksum64` (the chunk
/// checksum of checkpoint.hpp), `memcpy_warm` (a copy into pages written before: a snapshot
/// into the buffers of the previous one), `copy_into_fresh_string` (a copy into a new
/// std::string, as file_writer::add did before the buffers were reused: every page is touched
/// for the first time), `file_write` (ofstream writes of the bytes into a fresh
/// file in a temporary directory, renamed, the previous file removed: file_writer::write
/// without the checksums). Each sets bytes_per_second.
///
/// Checkpoints go to a fresh directory under std::filesystem::temp_directory_path() ($TMPDIR
/// or /tmp), removed at the end of each row. The environment variables FEDSHARD_CKPT_BATCH,
/// FEDSHARD_CKPT_EVERY and FEDSHARD_CKPT_ROUNDS (default 8) change batch, N and the rounds of
/// `interleaved` (the other rows run half as many, at least 2). About 1.5 minutes in all.

#include <benchmark/benchmark.h>
#include <sched.h>
#include <sys/stat.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/trainer/checkpoint.hpp"
#include "fedshard/trainer/trainer.hpp"

namespace {

namespace fs = std::filesystem;
using fedshard::detail::concat;
using clock_type = std::chrono::steady_clock;

constexpr int width = 1024, layers = 8;

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  const int x = std::atoi(v);
  return x > 0 ? x : fallback;
}
int batch_size() {
  return env_int("FEDSHARD_CKPT_BATCH", 32);
}
int save_every() {
  return env_int("FEDSHARD_CKPT_EVERY", 3);
}
int rounds() {
  return env_int("FEDSHARD_CKPT_ROUNDS", 8);
}

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

/// A reproducible value in [-1, 1) from (seed, index).
float hash_uniform(std::uint64_t seed, std::uint64_t i) {
  std::uint64_t z = seed * 0x9e3779b97f4a7c15ull + i + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/// Inputs and targets, feature-major: x[j * n + s] is feature j of sample s.
struct wide_batch {
  int n = 0;
  std::vector<float> x, t;
};

wide_batch make_batch(int n) {
  wide_batch b{n, std::vector<float>(std::size_t(width) * n),
               std::vector<float>(std::size_t(width) * n)};
  for (std::size_t i = 0; i < b.x.size(); ++i) {
    b.x[i] = hash_uniform(3, i);
    b.t[i] = 0.5f * hash_uniform(5, i);
  }
  return b;
}

/// `layers` units of y = W a + b (W: width x width), tanh between them, loss 0.5 / n x the
/// squared distance of the last output to the targets. Activations are kept feature-major
/// (a[j * n + s]) so that the inner loops run over the batch, contiguous and independent
/// (vectorised at -O2 / -O3 without -ffast-math); the weight gradient's inner loop runs over
/// the input features of a sample-major copy of the activations.
struct wide_mlp {
  std::vector<fedshard::unit_spec> units() const {
    std::vector<fedshard::unit_spec> u;
    for (int k = 0; k < layers; ++k)
      u.push_back({concat("layer", k), {{"w", {width, width}}, {"b", {width}}}});
    return u;
  }
  std::vector<float> initial_values(const fedshard::flat_layout& l, std::size_t u) const {
    std::vector<float> v(l.unit(u).numel, 0.0f);
    const float scale = 1.0f / std::sqrt(float(width));
    for (std::size_t i = 0; i < std::size_t(width) * width; ++i)
      v[i] = scale * hash_uniform(17 + u, i);  // w; b stays 0
    return v;
  }

  template <class Ctx>
  float forward_backward(Ctx& ctx, const wide_batch& batch) {
    const fedshard::flat_layout& l = ctx.layout();
    const std::size_t D = width, B = static_cast<std::size_t>(batch.n), L = layers;
    acts_.resize(L + 1);
    acts_[0] = batch.x;
    // forward: acts_[k + 1] = f(W_k acts_[k] + b_k), f = tanh but on the last layer
    for (std::size_t k = 0; k < L; ++k) {
      auto p = ctx.acquire(k);
      const float* w = l.tensor_view(p, k, 0).data();
      const float* b = l.tensor_view(p, k, 1).data();
      const float* a = acts_[k].data();
      auto& out = acts_[k + 1];
      out.assign(D * B, 0.0f);
      for (std::size_t i = 0; i < D; ++i) {
        float* y = out.data() + i * B;
        for (std::size_t s = 0; s < B; ++s) y[s] = b[i];
        for (std::size_t j = 0; j < D; ++j) {
          const float wij = w[i * D + j];
          const float* aj = a + j * B;
          for (std::size_t s = 0; s < B; ++s) y[s] += wij * aj[s];
        }
        if (k + 1 < L)
          for (std::size_t s = 0; s < B; ++s) y[s] = std::tanh(y[s]);
      }
      ctx.release(k);
    }
    // loss and its gradient with respect to the last output
    double loss = 0;
    dz_.assign(D * B, 0.0f);
    for (std::size_t i = 0; i < D * B; ++i) {
      const float diff = acts_[L][i] - batch.t[i];
      loss += 0.5 * double(diff) * double(diff);
      dz_[i] = diff / float(B);
    }
    // backward: dz_ is the gradient of layer k's pre-activation output
    for (std::size_t k = L; k-- > 0;) {
      auto p = ctx.acquire(k, fedshard::phase::backward);
      auto g = ctx.grad_buffer(k);
      const float* w = l.tensor_view(p, k, 0).data();
      float* gw = l.tensor_view(g, k, 0).data();
      float* gb = l.tensor_view(g, k, 1).data();
      const float* a = acts_[k].data();
      at_.resize(B * D);  // sample-major copy of the layer's input
      for (std::size_t j = 0; j < D; ++j)
        for (std::size_t s = 0; s < B; ++s) at_[s * D + j] = a[j * B + s];
      for (std::size_t i = 0; i < D; ++i) {
        const float* dzi = dz_.data() + i * B;
        float* gwi = gw + i * D;
        for (std::size_t s = 0; s < B; ++s) {
          gb[i] += dzi[s];
          const float d = dzi[s];
          const float* as = at_.data() + s * D;
          for (std::size_t j = 0; j < D; ++j) gwi[j] += d * as[j];
        }
      }
      if (k > 0) {
        da_.assign(D * B, 0.0f);
        for (std::size_t i = 0; i < D; ++i) {
          const float* dzi = dz_.data() + i * B;
          for (std::size_t j = 0; j < D; ++j) {
            const float wij = w[i * D + j];
            float* daj = da_.data() + j * B;
            for (std::size_t s = 0; s < B; ++s) daj[s] += wij * dzi[s];
          }
        }
        for (std::size_t i = 0; i < D * B; ++i) dz_[i] = da_[i] * (1.0f - a[i] * a[i]);
      }
      ctx.release(k);
      ctx.grads_ready(k);
    }
    return static_cast<float>(loss / double(B));
  }

  std::vector<std::vector<float>> acts_;
  std::vector<float> dz_, da_, at_;
};

using trainer_type = fedshard::trainer<wide_mlp, fedshard::ddp, fedshard::optim::adamw,
                                       fedshard::inproc::communicator>;

/// A fresh directory under the temporary directory, removed with everything in it.
struct temp_dir {
  fs::path path;
  temp_dir() {
    std::string pattern = (fs::temp_directory_path() / "fedshard-bench-ckpt-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr)
      throw std::runtime_error("cannot make a temporary directory");
    path = pattern;
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

/// CLOCK_REALTIME now and a file's mtime, in seconds.
double realtime_now() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}
/// CPU time of the calling thread, in seconds.
double thread_cpu_now() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}
double mtime_of(const fs::path& p) {
  struct stat st {};
  if (::stat(p.c_str(), &st) != 0) return 0;
  return double(st.st_mtim.tv_sec) + 1e-9 * double(st.st_mtim.tv_nsec);
}

/// Where the save's writer thread runs: wherever the OS puts it (`free`); pinned to CPU 1 while
/// the rank's thread is pinned to CPU 0 (`apart`: the writer has a core of its own); pinned,
/// with the rank's thread, to CPU 0 (`same`: the writer takes its time from the compute core,
/// as on a machine whose every core computes); anywhere, under SCHED_IDLE (`idle`: it runs only
/// on a core that nothing else wants). The writer is found as the thread of the process that
/// the call starting the save created (/proc/self/task before and after).
enum class placement { free, apart, same, idle };

std::vector<pid_t> threads_of_process() {
  std::vector<pid_t> v;
  for (const auto& e : fs::directory_iterator("/proc/self/task"))
    v.push_back(static_cast<pid_t>(std::stol(e.path().filename().string())));
  std::sort(v.begin(), v.end());
  return v;
}

/// Pins thread `tid` (0: the calling thread) to CPU `cpu`, or lets it run anywhere (cpu < 0).
void pin(pid_t tid, int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (cpu >= 0)
    CPU_SET(cpu, &set);
  else
    for (int c = 0; c < CPU_SETSIZE; ++c) CPU_SET(c, &set);
  if (::sched_setaffinity(tid, sizeof set, &set) != 0 && cpu >= 0)
    throw std::runtime_error(concat("cannot pin thread ", tid, " to CPU ", cpu));
}

/// Applies `where` to the threads of `after` that are not in `before` (the writer).
void place_writer(placement where, const std::vector<pid_t>& before,
                  const std::vector<pid_t>& after) {
  for (pid_t tid : after) {
    if (std::binary_search(before.begin(), before.end(), tid)) continue;
    if (where == placement::apart) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(1, &set);
      ::sched_setaffinity(tid, sizeof set, &set);  // fails only if the writer is done already
    }
    if (where == placement::idle) {
      sched_param none{};
      ::sched_setscheduler(tid, SCHED_IDLE, &none);
    }
  }
}

/// plain: steps only; async: save_async first; sync: save first.
enum class block_kind { plain, async, sync };

/// What the blocks of one kind added up to.
struct tally {
  double seconds = 0;      // all blocks, the saves and waits included
  double cpu_seconds = 0;  // the rank thread's CPU time in them
  std::int64_t steps = 0, blocks = 0;
  double first_seconds = 0;  // async: the steps that started the save (its call included)
  double later_seconds = 0;  // async: the other steps that overlapped the save
  std::int64_t later = 0;
  double snapshot = 0, save = 0, wait = 0, sync_save = 0;
  double step_ms() const { return steps ? 1e3 * seconds / double(steps) : 0; }
  double cpu_step_ms() const { return steps ? 1e3 * cpu_seconds / double(steps) : 0; }
  double per_block_ms(double x) const { return blocks ? 1e3 * x / double(blocks) : 0; }
  std::int64_t overlapped() const { return blocks + later; }
  double overlapped_ms() const {
    return overlapped() ? 1e3 * (first_seconds + later_seconds) / double(overlapped()) : 0;
  }
};

/// The trainer and everything a block needs.
struct rig {
  trainer_type t;
  wide_batch batch;
  temp_dir dir;
  int every;
  placement where = placement::free;

  rig(fedshard::mesh<fedshard::inproc::communicator>& m, int n, int every_)
      : t(m, wide_mlp{}, {.lr = 1e-4f}), batch(make_batch(n)), every(every_) {}

  fs::path checkpoint_dir() const { return dir.path / "ckpt"; }

  /// Starts a save_async with the writer placed as `where` says.
  void start_save() {
    const bool placed = where == placement::apart || where == placement::idle;
    const auto before = placed ? threads_of_process() : std::vector<pid_t>{};
    t.save_async(checkpoint_dir());
    if (placed) place_writer(where, before, threads_of_process());
  }

  /// Runs one block of kind k; returns its seconds.
  double block(block_kind k, tally& out) {
    const bool background = k == block_kind::async;
    const double cpu0 = thread_cpu_now();
    const auto t0 = clock_type::now();
    double save_started = 0;
    if (background) {
      save_started = realtime_now();
      start_save();
      out.snapshot += seconds_since(t0);
    } else if (k == block_kind::sync) {
      t.save(checkpoint_dir());
      out.sync_save += seconds_since(t0);
    }
    auto step_start = t0;  // the first step's time holds the call that started the save
    for (int s = 0; s < every; ++s) {
      const bool overlaps = background && (s == 0 || t.save_in_flight());
      benchmark::DoNotOptimize(t.step(batch));
      const auto now = clock_type::now();
      const double took = std::chrono::duration<double>(now - step_start).count();
      if (overlaps && s == 0) out.first_seconds += took;
      if (overlaps && s > 0) {
        out.later += 1;
        out.later_seconds += took;
      }
      step_start = now;
    }
    if (background) {
      const auto w0 = clock_type::now();
      t.wait_for_save();
      out.wait += seconds_since(w0);
      out.save +=
          mtime_of(checkpoint_dir() / fedshard::checkpoint::manifest_file_name) - save_started;
    }
    const double secs = seconds_since(t0);
    out.cpu_seconds += thread_cpu_now() - cpu0;
    out.seconds += secs;
    out.steps += every;
    out.blocks += 1;
    return secs;
  }

  /// Untimed: 2 steps and one save_async + wait_for_save (first-touch of every buffer).
  void warm_up() {
    t.step(batch);
    t.step(batch);
    t.save_async(checkpoint_dir());
    t.wait_for_save();
  }

  double state_mb() {
    for (const auto& e : fs::directory_iterator(checkpoint_dir()))
      if (e.path().filename().string().rfind("rank-", 0) == 0) return double(e.file_size()) / 1e6;
    return 0;
  }
};

/// The 1-minute load average (other work on the shared machine).
double load_average() {
  double l[1] = {0};
  return ::getloadavg(l, 1) == 1 ? l[0] : -1;
}

/// The counters of one tally, named "<prefix>_...".
void report_kind(benchmark::State& state, const std::string& prefix, const tally& x,
                 const tally& plain) {
  auto& c = state.counters;
  if (!x.steps) return;
  c[prefix + "_step_ms"] = x.step_ms();
  c[prefix + "_cpu_step_ms"] = x.cpu_step_ms();
  if (plain.steps && &x != &plain) {
    c[prefix + "_over_plain"] = x.step_ms() / plain.step_ms();
    c[prefix + "_cpu_over_plain"] = x.cpu_step_ms() / plain.cpu_step_ms();
  }
  if (&x == &plain || x.sync_save > 0) {
    if (x.sync_save > 0) c["sync_save_ms"] = x.per_block_ms(x.sync_save);
    return;
  }
  // a background save
  c[prefix + "_overlapped_step_ms"] = x.overlapped_ms();
  c[prefix + "_first_step_ms"] = x.per_block_ms(x.first_seconds);
  if (x.later) c[prefix + "_later_step_ms"] = 1e3 * x.later_seconds / double(x.later);
  c[prefix + "_overlap_fraction"] = double(x.overlapped()) / double(x.steps);
  c[prefix + "_snapshot_ms"] = x.per_block_ms(x.snapshot);
  c[prefix + "_save_ms"] = x.per_block_ms(x.save);
  c[prefix + "_wait_ms"] = x.per_block_ms(x.wait);
  if (plain.steps) c[prefix + "_overlapped_over_plain"] = x.overlapped_ms() / plain.step_ms();
}

/// Runs body(rig&) on one inproc rank; a failure skips the row with its message.
template <class F>
void on_one_rank(benchmark::State& state, placement where, F&& body) {
  try {
    fedshard::inproc::run(1, [&](fedshard::inproc::communicator& c) {
      const bool pinned = where == placement::apart || where == placement::same;
      if (pinned) pin(0, 0);
      try {
        fedshard::mesh m(c, {1, 1, 1});
        rig r(m, batch_size(), save_every());
        r.where = where;
        r.warm_up();
        body(r);
      } catch (...) {
        if (pinned) pin(0, -1);
        throw;
      }
      if (pinned) pin(0, -1);
    });
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

/// Rounds of one block of each kind in `kinds`, back to back; manual time: the step time of the
/// second kind (the first is plain).
void bm_interleaved(benchmark::State& state, const char* label, placement where,
                    std::vector<block_kind> kinds) {
  static const char* const names[] = {"plain", "async", "sync"};
  on_one_rank(state, where, [&](rig& r) {
    tally tallies[3];
    auto of = [&](block_kind k) -> tally& { return tallies[static_cast<int>(k)]; };
    for (auto _ : state) {
      double timed = 0;
      for (std::size_t i = 0; i < kinds.size(); ++i) {
        const double s = r.block(kinds[i], of(kinds[i]));
        if (i == std::min<std::size_t>(1, kinds.size() - 1)) timed = s;
      }
      state.SetIterationTime(timed / r.every);
    }
    const tally& plain = of(block_kind::plain);
    for (int k = 0; k < 3; ++k) report_kind(state, names[k], tallies[k], plain);
    state.counters["batch"] = batch_size();
    state.counters["every"] = r.every;
    state.counters["state_MB"] = r.state_mb();
    state.counters["load_avg"] = load_average();
    std::string line = concat("bench_checkpoint ", label, ": plain step ", plain.step_ms(), " ms");
    for (std::size_t i = 1; i < kinds.size(); ++i) {
      const tally& x = of(kinds[i]);
      line += concat("; ", names[static_cast<int>(kinds[i])], " ", x.step_ms(), " ms, x",
                     x.step_ms() / plain.step_ms(), " (thread CPU x",
                     x.cpu_step_ms() / plain.cpu_step_ms(), ")");
      if (kinds[i] == block_kind::async)
        line += concat(", steps during the save x", x.overlapped_ms() / plain.step_ms(), " (",
                       x.overlapped(), " of ", x.steps, "; snapshot ", x.per_block_ms(x.snapshot),
                       " ms, save ", x.per_block_ms(x.save), " ms)");
    }
    std::fprintf(stderr, "%s; load %.1f\n", line.c_str(), load_average());
  });
}

// ---------------------------------------------------------------- the parts of a save

/// save_async's call alone, or save_async + wait_for_save (`whole`), no steps.
void bm_save_parts(benchmark::State& state, bool whole) {
  on_one_rank(state, placement::free, [&](rig& r) {
    double snapshot = 0;
    for (auto _ : state) {
      const auto t0 = clock_type::now();
      r.t.save_async(r.checkpoint_dir());
      const double s = seconds_since(t0);
      snapshot += s;
      if (whole) r.t.wait_for_save();
      const double total = seconds_since(t0);
      if (!whole) r.t.wait_for_save();  // untimed
      state.SetIterationTime(whole ? total : s);
    }
    const double mb = r.state_mb();
    state.counters["state_MB"] = mb;
    state.counters["snapshot_ms"] = 1e3 * snapshot / double(state.iterations());
    state.counters["load_avg"] = load_average();
    state.SetBytesProcessed(static_cast<std::int64_t>(mb * 1e6) * state.iterations());
  });
}

constexpr std::size_t part_bytes = std::size_t(3) * 4 * layers * (width * width + width);

std::vector<char> filled(std::size_t n) {
  std::vector<char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<char>(i * 131 + (i >> 12));
  return v;
}

/// The chunk checksum of the format (`lanes`: checkpoint::checksum64) or byte-wise FNV-1a (the
/// one before), per 1 MiB chunk of 100 MB.
void bm_checksum(benchmark::State& state, bool lanes) {
  const auto data = filled(part_bytes);
  const std::size_t chunk = fedshard::checkpoint::default_chunk_bytes;
  for (auto _ : state) {
    const auto t0 = clock_type::now();
    std::uint64_t h = 0;
    for (std::size_t c = 0; c < data.size(); c += chunk) {
      const std::size_t n = std::min(chunk, data.size() - c);
      h ^= lanes ? fedshard::checkpoint::checksum64(data.data() + c, n)
                 : fedshard::checkpoint::fnv1a(data.data() + c, n);
    }
    benchmark::DoNotOptimize(h);
    state.SetIterationTime(seconds_since(t0));
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(part_bytes) * state.iterations());
}

/// A copy of 100 MB into a buffer written before (warm pages), or into a fresh allocation
/// (`fresh`: first touch of every page, as a snapshot into new memory pays).
void bm_memcpy(benchmark::State& state, bool fresh) {
  const auto src = filled(part_bytes);
  std::vector<char> warm(part_bytes, 1);
  for (auto _ : state) {
    const auto t0 = clock_type::now();
    if (fresh) {
      std::string dst(src.data(), src.size());  // what file_writer::add did
      benchmark::DoNotOptimize(dst.data());
    } else {
      std::memcpy(warm.data(), src.data(), part_bytes);
    }
    benchmark::ClobberMemory();
    state.SetIterationTime(seconds_since(t0));
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(part_bytes) * state.iterations());
}

/// ofstream writes of the bytes into a fresh file (then renamed and the previous one removed,
/// as a save does), one write per layer's size.
void bm_file_write(benchmark::State& state) {
  const auto data = filled(part_bytes);
  temp_dir dir;
  const std::size_t section = std::size_t(4) * layers * (width * width + width);
  int n = 0;
  for (auto _ : state) {
    const auto t0 = clock_type::now();
    const fs::path final_path = dir.path / concat("file-", n % 2, ".bin");
    const fs::path tmp = final_path.string() + ".tmp";
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      for (std::size_t at = 0; at < data.size(); at += section)
        f.write(data.data() + at,
                static_cast<std::streamsize>(std::min(section, data.size() - at)));
      f.flush();
      if (!f) {
        state.SkipWithError("writing the file failed");
        return;
      }
    }
    fs::rename(tmp, final_path);
    std::error_code ec;
    fs::remove(dir.path / concat("file-", (n + 1) % 2, ".bin"), ec);
    ++n;
    state.SetIterationTime(seconds_since(t0));
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(part_bytes) * state.iterations());
}

}  // namespace

BENCHMARK_CAPTURE(bm_interleaved, free, "checkpoint/interleaved", placement::free,
                  {block_kind::plain, block_kind::async, block_kind::sync})
    ->Name("checkpoint/interleaved")
    ->Iterations(rounds())
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_interleaved, apart, "checkpoint/writer_own_core", placement::apart,
                  {block_kind::plain, block_kind::async})
    ->Name("checkpoint/writer_own_core")
    ->Iterations(std::max(2, rounds() / 2))
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_interleaved, same, "checkpoint/writer_same_core", placement::same,
                  {block_kind::plain, block_kind::async})
    ->Name("checkpoint/writer_same_core")
    ->Iterations(std::max(2, rounds() / 2))
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_interleaved, idle, "checkpoint/writer_sched_idle", placement::idle,
                  {block_kind::plain, block_kind::async})
    ->Name("checkpoint/writer_sched_idle")
    ->Iterations(std::max(2, rounds() / 2))
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_save_parts, snapshot, false)
    ->Name("checkpoint_parts/snapshot")
    ->Iterations(4)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_save_parts, save_async_idle, true)
    ->Name("checkpoint_parts/save_async_idle")
    ->Iterations(4)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_checksum, fnv1a, false)
    ->Name("checkpoint_parts/fnv1a")
    ->Iterations(4)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_checksum, checksum64, true)
    ->Name("checkpoint_parts/checksum64")
    ->Iterations(4)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_memcpy, warm, false)
    ->Name("checkpoint_parts/memcpy_warm")
    ->Iterations(4)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_memcpy, fresh, true)
    ->Name("checkpoint_parts/copy_into_fresh_string")
    ->Iterations(4)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(bm_file_write)
    ->Name("checkpoint_parts/file_write")
    ->Iterations(4)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
