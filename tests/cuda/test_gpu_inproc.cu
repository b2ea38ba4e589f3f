// gpu_inproc: every collective bit-identical to the host inproc communicator on the same
// inputs (f32 and bf16; 2, 4 and 8 ranks sharing one GPU), the stream-ordered path (after,
// record) without host waits, send/recv, split, and errors raised on every rank.
#include "fedshard/cuda/gpu_inproc.cuh"

#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/comm/inproc.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/cuda/cuda_space.cuh"
#include "fedshard/error.hpp"
#include "fedshard/space/space_of.hpp"
#include "space/space_checks.hpp"

namespace {

namespace gpu = fedshard::gpu;
namespace gpu_inproc = fedshard::gpu_inproc;
using namespace fedshard;

static_assert(Communicator<gpu_inproc::communicator>);
static_assert(std::is_same_v<space::space_of_t<gpu_inproc::communicator>, gpu::cuda_space>);
static_assert(space::StreamOrdered<gpu_inproc::communicator, gpu::cuda_space>);

/// Every rank on device 0.
gpu_inproc::options one_gpu() {
  gpu_inproc::options o;
  o.devices = {0};
  o.timeout = std::chrono::seconds(60);
  return o;
}

/// Rank r's inputs: n values of T in [-100, 100).
template <class T>
std::vector<T> inputs(int r, std::size_t n, std::uint64_t salt = 0) {
  std::mt19937_64 rng(1000 + 17 * static_cast<std::uint64_t>(r) + salt);
  std::uniform_real_distribution<double> value(-100.0, 100.0);
  std::vector<T> v(n);
  for (T& x : v) x = from_accum<T>(value(rng));
  return v;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

/// One collective: its input and output sizes on n ranks, and the call on any communicator
/// (buffers of the communicator's memory); in_place: the input is the output buffer.
struct shape {
  std::size_t in = 0, out = 0;
  bool in_place = false;
};

/// Runs call(comm, in, out) on inproc (host buffers) and on gpu_inproc (device buffers,
/// queued with after/record and read back without a host wait), and compares every rank's
/// output bit for bit.
template <class T, class Call>
void compare(int n, shape sh, Call call, const char* what) {
  std::vector<std::vector<T>> want(static_cast<std::size_t>(n)), got(want.size());
  inproc::run(n, [&](inproc::communicator& c) {
    const int r = c.rank();
    std::vector<T> out = inputs<T>(r, sh.out, 99);
    std::vector<T> in = sh.in_place ? std::vector<T>{} : inputs<T>(r, sh.in);
    if (sh.in_place) out = inputs<T>(r, sh.out);
    call(c, sh.in_place ? out.data() : in.data(), out.data());
    want[static_cast<std::size_t>(r)] = out;
  });
  gpu_inproc::run(
      n,
      [&](gpu_inproc::communicator& c) {
        const int r = c.rank();
        auto s = c.make_space();
        auto st = s->make_stream();
        auto dout =
            test::upload(*s, st, sh.in_place ? inputs<T>(r, sh.out) : inputs<T>(r, sh.out, 99));
        auto din = test::upload(*s, st, sh.in_place ? std::vector<T>{} : inputs<T>(r, sh.in));
        c.after(s->record(st));
        call(c, sh.in_place ? dout.data() : din.data(), dout.data());
        s->wait(st, c.record());
        got[static_cast<std::size_t>(r)] = test::read_back(*s, st, dout);
      },
      one_gpu());
  for (int r = 0; r < n; ++r) {
    INFO(what, " on ", n, " ranks, ", to_string(dtype_of<T>), ", rank ", r);
    CHECK(same_bits(got[static_cast<std::size_t>(r)], want[static_cast<std::size_t>(r)]));
  }
}

template <class T>
void every_collective(int n) {
  const std::int64_t count = 100003;  // odd: chunks end inside cache lines
  const auto un = static_cast<std::size_t>(n), uc = static_cast<std::size_t>(count);
  const dtype t = dtype_of<T>;
  for (reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::min, reduce_op::max}) {
    compare<T>(
        n, {uc, uc, false},
        [&](auto& c, const T* in, T* out) { c.all_reduce(in, out, count, t, op); }, "all_reduce");
    compare<T>(
        n, {uc, uc, true},
        [&](auto& c, const T* in, T* out) { c.all_reduce_async(in, out, count, t, op); },
        "in-place all_reduce_async");
    compare<T>(
        n, {uc * un, uc, false},
        [&](auto& c, const T* in, T* out) { c.reduce_scatter(in, out, count, t, op); },
        "reduce_scatter");
  }
  compare<T>(
      n, {uc, uc * un, false},
      [&](auto& c, const T* in, T* out) { c.all_gather_async(in, out, count, t).wait(); },
      "all_gather");
  compare<T>(
      n, {0, uc, false}, [&](auto& c, const T*, T* out) { c.broadcast(out, count, t, n - 1); },
      "broadcast");
  compare<T>(
      n, {uc, uc, false},
      [&](auto& c, const T* in, T* out) {
        // pairs (2k, 2k + 1) swap their inputs; even ranks send first
        const int r = c.rank(), peer = r ^ 1;
        if (peer >= c.size()) return;
        if (r % 2 == 0) {
          c.send(in, count, t, peer, 5);
          c.recv(out, count, t, peer, 6);
        } else {
          c.recv(out, count, t, peer, 5);
          c.send(in, count, t, peer, 6);
        }
      },
      "send/recv");
  compare<T>(
      n, {uc, uc, false},
      [&](auto& c, const T* in, T* out) {
        auto sub = c.split(c.rank() % 2, -c.rank());  // reversed order inside colors
        sub.all_reduce(in, out, count, t, reduce_op::sum);
        sub.barrier();
        c.barrier();
      },
      "split then all_reduce");
  compare<T>(
      n, {uc, uc, false},
      [&](auto& c, const T* in, T* out) {
        c.all_reduce(in, out, 0, t, reduce_op::sum);  // nothing moves
        c.broadcast(out, 0, t, 0);
      },
      "empty calls");
}

TEST_SUITE("no_device") {
  TEST_CASE("gpu_inproc::run refuses 0 ranks and more than max_ranks") {
    CHECK_THROWS_AS(gpu_inproc::run(0, [](gpu_inproc::communicator&) {}), invalid_argument);
    CHECK_THROWS_AS(gpu_inproc::run(gpu_inproc::max_ranks + 1, [](gpu_inproc::communicator&) {}),
                    invalid_argument);
  }
}

TEST_CASE("every collective is bit-identical to inproc's (f32, bf16; 2, 4, 8 ranks on one GPU)") {
  for (int n : {2, 4, 8}) {
    every_collective<float>(n);
    every_collective<bf16>(n);
  }
  every_collective<f16>(3);
  every_collective<double>(3);
}

TEST_CASE("ranks get the devices asked for; the rank's device is current in its body") {
  gpu_inproc::options o = one_gpu();
  std::atomic<int> wrong{0};
  gpu_inproc::run(
      4,
      [&](gpu_inproc::communicator& c) {
        if (c.device() != 0 || gpu::current_device() != 0) ++wrong;
        auto s = c.make_space();
        if (s->device() != c.device()) ++wrong;
        if (c.stream() == nullptr) ++wrong;
      },
      o);
  CHECK(wrong.load() == 0);
}

TEST_CASE("stream order: a collective waits for after(ev), the consumer for record()") {
  const std::int64_t count = std::int64_t{8} << 20;
  const int n = 4;
  std::vector<int> wrong(static_cast<std::size_t>(n));  // rounds with a wrong sum, per rank
  gpu_inproc::run(
      n,
      [&](gpu_inproc::communicator& c) {
        auto s = c.make_space();
        auto st = s->make_stream();
        auto buf = s->allocate<float>(static_cast<std::size_t>(count));
        for (int round = 1; round <= 3; ++round) {
          s->fill(st, buf.view(), double(round * (c.rank() + 1)));  // long write, no host wait
          c.after(s->record(st));
          auto req = c.all_reduce_async(buf.data(), buf.data(), count, dtype::f32, reduce_op::sum);
          s->wait(st, c.record());
          std::vector<float> host(static_cast<std::size_t>(count));
          s->to_host(st, buf.view(), view(std::span<float>(host)));
          s->synchronize(st);
          req.wait();
          const float want = float(round * n * (n + 1) / 2);
          if (host.front() != want || host[host.size() / 2] != want || host.back() != want)
            ++wrong[static_cast<std::size_t>(c.rank())];
        }
      },
      one_gpu());
  for (int w : wrong) CHECK(w == 0);
}

/// Runs body on n ranks of one GPU; returns each rank's exception message ("" if none).
template <class F>
std::vector<std::string> errors_of(int n, F body) {
  std::vector<std::string> msgs(static_cast<std::size_t>(n));
  std::mutex mu;
  gpu_inproc::options o = one_gpu();
  o.timeout = std::chrono::seconds(20);
  try {
    gpu_inproc::run(
        n,
        [&](gpu_inproc::communicator& c) {
          try {
            body(c);
          } catch (const std::exception& e) {
            std::lock_guard lock(mu);
            msgs[static_cast<std::size_t>(c.rank())] = e.what();
            throw;
          }
        },
        o);
  } catch (...) {
  }
  return msgs;
}

TEST_CASE("mismatched calls raise collective_mismatch on every rank, naming the call") {
  const int n = 4;
  std::atomic<int> mismatches{0};
  auto msgs = errors_of(n, [&](gpu_inproc::communicator& c) {
    auto s = c.make_space();
    auto b = s->allocate<float>(64);
    const std::int64_t count = c.rank() == 2 ? 32 : 64;
    try {
      c.all_reduce(b.data(), b.data(), count, dtype::f32, reduce_op::sum);
    } catch (const collective_mismatch&) {
      ++mismatches;
      throw;
    }
  });
  CHECK(mismatches.load() == n);
  for (const auto& m : msgs) CHECK(m.find("all_reduce") != std::string::npos);
}

TEST_CASE("invalid arguments raise invalid_argument on every rank") {
  const int n = 2;
  std::atomic<int> invalid{0};
  errors_of(n, [&](gpu_inproc::communicator& c) {
    try {
      c.broadcast(nullptr, 16, dtype::f32, 0);  // null buffer with a count
    } catch (const invalid_argument&) {
      ++invalid;
      throw;
    }
  });
  CHECK(invalid.load() == n);
}

TEST_CASE("a rank that fails makes its peers raise peer_failure instead of hanging") {
  const int n = 3;
  std::atomic<int> failures{0};
  auto msgs = errors_of(n, [&](gpu_inproc::communicator& c) {
    if (c.rank() == 1) throw std::runtime_error("rank 1 gives up");
    try {
      c.barrier();
    } catch (const peer_failure&) {
      ++failures;
      throw;
    }
  });
  CHECK(failures.load() == n - 1);
  CHECK(msgs[1] == "rank 1 gives up");
  CHECK(msgs[0].find("peer_failure") != std::string::npos);
}

}  // namespace
