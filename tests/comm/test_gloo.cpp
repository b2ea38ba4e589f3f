/// Tests of the Gloo communicator: the backend-generic test cases of comm/backend_tests.hpp
/// on worlds of 1 to 8 thread ranks meeting through a file store (both all_reduce
/// algorithms), results bit-identical to inproc's, the stores (file and Redis, a server the
/// test starts on the loopback), and failures: a peer process killed mid-run gives
/// peer_failure at once, a silent peer timeout_error, and the other ranks go on.

#include <doctest/doctest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/backend_tests.hpp"
#include "fedshard/comm/detail/sigpipe.hpp"
#include "fedshard/comm/gloo.hpp"
#include "fedshard/comm/inproc.hpp"
#include "support/collective_checks.hpp"
#include "support/gloo_support.hpp"
#include "support/spawn_ranks.hpp"

namespace {

using fedshard::dtype;
using fedshard::reduce_op;
using fedshard::detail::concat;
namespace gl = fedshard::gloo;
namespace ft = fedshard::test;

/// One store for the whole test program; every world gets a prefix of its own.
std::shared_ptr<gl::file_store> shared_store() {
  static ft::temp_dir dir("fedshard-gloo-test");
  static auto st = std::make_shared<gl::file_store>(dir.path());
  return st;
}
std::string next_prefix() {
  static std::atomic<int> n{0};
  return concat("world", n++);
}

/// The traits of gloo for comm/backend_tests.hpp; SmallBytes is the all-gather limit of
/// all_reduce (0: every all_reduce of more than one rank takes the alltoall path).
template <std::int64_t SmallBytes>
struct gloo_ranks {
  using comm = gl::communicator;
  static constexpr int determinism_runs = 3;
  static int max_ranks() { return 5; }  // every size to 5: each case connects n^2 sockets
  template <class F>
  static auto run(int n, F&& body) {
    return ft::every_rank([&] {
      const auto prefix = next_prefix();
      return ft::on_threads(n, [&](int r) {
        gl::options o = ft::gloo_timeout(60);
        o.small_all_reduce_bytes = SmallBytes;
        gl::communicator c(shared_store(), prefix, r, n, o);
        return body(c);
      });
    });
  }
};
using gloo_gather = gloo_ranks<256 * 1024>;
using gloo_alltoall = gloo_ranks<0>;

}  // namespace

FEDSHARD_COMM_TESTS(gloo_gather)

namespace fedshard::test {
TEST_CASE_TEMPLATE_INVOKE(comm_all_reduce_grid, gloo_alltoall);
TEST_CASE_TEMPLATE_INVOKE(comm_deterministic, gloo_alltoall);
TEST_CASE_TEMPLATE_INVOKE(comm_mismatch, gloo_gather);
TEST_CASE_TEMPLATE_INVOKE(comm_invalid_collective, gloo_gather);
TEST_CASE_TEMPLATE_INVOKE(comm_dropped_failure, gloo_gather);
}  // namespace fedshard::test

namespace {

/// f32 inputs of rank r: values whose sum depends on the order of the additions.
std::vector<float> inputs_of(int r, std::size_t n) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = ft::input_value<float>(77, r, static_cast<std::int64_t>(i));
  return v;
}

}  // namespace

TEST_CASE("gloo: every reduction is bit-identical to inproc's, on every all_reduce path") {
  for (int n : {2, 3, 5}) {
    CAPTURE(n);
    const std::size_t count = 100003;
    auto reference = ft::collect_ranks(n, [&](fedshard::inproc::communicator& c) {
      std::vector<std::vector<float>> outs;
      for (reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::max}) {
        auto v = inputs_of(c.rank(), count);
        c.all_reduce(v.data(), v.data(), static_cast<std::int64_t>(count), dtype::f32, op);
        outs.push_back(v);
      }
      auto in = inputs_of(c.rank(), count * static_cast<std::size_t>(n));
      std::vector<float> mine(count);
      c.reduce_scatter(in.data(), mine.data(), static_cast<std::int64_t>(count), dtype::f32,
                       reduce_op::sum);
      outs.push_back(mine);
      return outs;
    });
    // The all-gather path; the alltoall path in one stage; in stages of 4096 B, 33 of them
    // for n = 3 (chunks of 33344 f32, the last stage 576), with padded chunks for n = 5; and
    // those stages over 3 stripes (stage s on stripe s % 3).
    struct path {
      std::int64_t small, pipeline;
      int stripes;
    };
    for (path p :
         {path{std::int64_t{1} << 40, 0, 1}, path{0, 0, 1}, path{0, 4096, 1}, path{0, 4096, 3}}) {
      CAPTURE(p.small);
      CAPTURE(p.pipeline);
      CAPTURE(p.stripes);
      const auto prefix = next_prefix();
      auto got = ft::on_threads(n, [&](int r) {
        gl::options o = ft::gloo_timeout(60);
        o.small_all_reduce_bytes = p.small;
        o.pipeline_bytes = p.pipeline;
        o.stripes = p.stripes;
        gl::communicator c(shared_store(), prefix, r, n, o);
        std::vector<std::vector<float>> outs;
        for (reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::max}) {
          auto v = inputs_of(r, count);
          c.all_reduce(v.data(), v.data(), static_cast<std::int64_t>(count), dtype::f32, op);
          outs.push_back(v);
        }
        auto in = inputs_of(r, count * static_cast<std::size_t>(n));
        std::vector<float> mine(count);
        c.reduce_scatter(in.data(), mine.data(), static_cast<std::int64_t>(count), dtype::f32,
                         reduce_op::sum);
        outs.push_back(mine);
        return outs;
      });
      for (int r = 0; r < n; ++r)
        for (std::size_t k = 0; k < got[r].size(); ++k) {
          CAPTURE(r);
          CAPTURE(k);
          CHECK(std::memcmp(got[r][k].data(), reference[r][k].data(), count * sizeof(float)) == 0);
        }
    }
  }
}

TEST_CASE("gloo: file_store keys are created once, read whole, and missing ones time out") {
  ft::temp_dir dir;
  gl::file_store st(dir.path());
  CHECK(st.try_set("a/b c", gl::bytes_of("first")));
  CHECK_FALSE(st.try_set("a/b c", gl::bytes_of("second")));
  CHECK(st.get_string("a/b c", std::chrono::milliseconds(10)) == "first");
  st.set("a/b c", gl::bytes_of("third"));
  CHECK(st.get_string("a/b c", std::chrono::milliseconds(10)) == "third");
  CHECK_FALSE(st.has("missing"));
  try {
    (void)st.get("missing", std::chrono::milliseconds(30));
    FAIL("get of a missing key returned");
  } catch (const fedshard::timeout_error& e) {
    CHECK(ft::contains(e.what(), "'missing'"));
    CHECK(ft::contains(e.what(), "30 ms"));
  }
  // Concurrent creators: exactly one wins.
  std::atomic<int> wins{0};
  ft::on_threads(8, [&](int r) {
    wins += st.try_set("race", gl::bytes_of(std::to_string(r))) ? 1 : 0;
    return 0;
  });
  CHECK(wins == 1);
}

TEST_CASE("gloo: a file_store whose directory vanished says so, on every kind of call") {
  ft::temp_dir parent;
  const auto dir = parent.path() / "store";
  gl::file_store st(dir);
  st.set("k", gl::bytes_of("v"));
  std::filesystem::remove_all(dir);
  const std::string expected = "the store's directory '" + dir.string() + "' no longer exists";
  CHECK_THROWS_WITH_AS(st.set("k", gl::bytes_of("w")), doctest::Contains(expected.c_str()),
                       fedshard::backend_error);
  CHECK_THROWS_WITH_AS((void)st.try_set("n", gl::bytes_of("w")),
                       doctest::Contains(expected.c_str()), fedshard::backend_error);
  CHECK_THROWS_WITH_AS((void)st.has("k"), doctest::Contains(expected.c_str()),
                       fedshard::backend_error);
  // a wait ends at once with the cause, not after its timeout with the key's name
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS((void)st.get("k", std::chrono::milliseconds(5000)),
                       doctest::Contains(expected.c_str()), fedshard::backend_error);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(2));
}

TEST_CASE("gloo: ranks meet through a Redis server on the loopback") {
  ft::redis_server server(FEDSHARD_REDIS_SERVER);
  if (!server.available()) {
    MESSAGE("redis-server not found (install redis-server): the Redis store is not tested");
    return;
  }
  auto st = std::make_shared<gl::redis_store>("127.0.0.1", server.port());
  const auto k = concat("k-", ::getpid());
  CHECK(st->try_set(k, gl::bytes_of("v1")));
  CHECK_FALSE(st->try_set(k, gl::bytes_of("v2")));
  CHECK(st->get_string(k, std::chrono::milliseconds(10)) == "v1");
  const auto world = concat("redis-world-", ::getpid(), "-", next_prefix());  // fresh keys
  auto sums = ft::on_threads(3, [&](int r) {
    gl::communicator c(st, world, r, 3, ft::gloo_timeout(30));
    double v = r + 1;
    c.all_reduce(&v, &v, 1, dtype::f64, reduce_op::sum);
    auto half = c.split(r % 2, r);
    double w = 1;
    half.all_reduce(&w, &w, 1, dtype::f64, reduce_op::sum);
    return v * 10 + w;
  });
  CHECK(sums == std::vector<double>{62, 61, 62});
  CHECK_THROWS_WITH_AS(gl::redis_store("127.0.0.1", 1), doctest::Contains("127.0.0.1:1"),
                       fedshard::backend_error);
}

TEST_CASE("gloo: redis_store makes a lost connection again, and says so when it cannot") {
  ft::redis_server server(FEDSHARD_REDIS_SERVER, ft::redis_server::own_t{});
  if (!server.available()) {
    MESSAGE("redis-server not found (install redis-server): reconnection is not tested");
    return;
  }
  gl::redis_store st("127.0.0.1", server.port(), std::chrono::milliseconds(10000));
  CHECK(st.try_set("before", gl::bytes_of("1")));
  // Killed, and started again on the same port 300 ms later (empty: no persistence); the
  // calls made meanwhile wait for it and succeed.
  server.kill();
  std::thread restart([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    CHECK(server.start_again());
  });
  st.set("after", gl::bytes_of("2"));
  restart.join();
  CHECK(st.reconnects() == 1);
  CHECK(st.get_string("after", std::chrono::milliseconds(10)) == "2");
  CHECK(st.try_set("created", gl::bytes_of("3")));
  CHECK_FALSE(st.try_set("created", gl::bytes_of("4")));
  CHECK_FALSE(st.has("before"));  // what the killed server held is gone
  // Killed for good: a call fails once reconnect_for has passed, naming the server.
  gl::redis_store quick("127.0.0.1", server.port(), std::chrono::milliseconds(400));
  server.kill();
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(quick.set("k", gl::bytes_of("v")),
                       doctest::Contains(concat("redis_store(127.0.0.1:", server.port(),
                                                "): SET 'k' failed: the server is unreachable")
                                             .c_str()),
                       fedshard::backend_error);
  const auto waited = std::chrono::steady_clock::now() - t0;
  CHECK(waited >= std::chrono::milliseconds(400));
  CHECK(waited < std::chrono::seconds(5));
}

TEST_CASE("gloo: a silent peer gives timeout_error, and the communicator says so afterwards") {
  const auto prefix = next_prefix();
  std::atomic<bool> done{false};
  auto seen = ft::on_threads(2, [&](int r) -> std::string {
    gl::communicator c(shared_store(), prefix, r, 2, ft::gloo_timeout(1.0));
    if (r == 1) {  // stays connected, never calls
      while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return "";
    }
    std::string first, second;
    const auto t0 = std::chrono::steady_clock::now();
    double v = 1;
    try {
      c.all_reduce(&v, &v, 1, dtype::f64, reduce_op::sum);
    } catch (const fedshard::timeout_error& e) {
      first = e.what();
    }
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    try {
      c.barrier();
    } catch (const fedshard::backend_error& e) {
      second = e.what();
    }
    done = true;
    return concat(first, "|", second, "|", waited < 10 ? "fast" : "slow");
  });
  CAPTURE(seen[0]);
  CHECK(ft::contains(seen[0], "timed out"));
  CHECK(ft::contains(seen[0], "unusable after an earlier failure"));
  CHECK(ft::contains(seen[0], "|fast"));
}

TEST_CASE(
    "gloo: receives posted from two peers complete in the order their peers send, and "
    "test() never blocks") {
  // Rank 0 posts a receive from rank 1 and one from rank 2; neither peer sends until rank 0
  // lets it. test() on both says false at once (a blocking test() would wait for rank 1,
  // which waits for rank 0: the op timeout). Rank 2 sends first: its receive completes while
  // rank 1's is still pending. 2^18 f32 each, over 2 stripes: each receive is two pieces.
  const auto prefix = next_prefix();
  std::atomic<bool> go1{false}, go2{false};
  constexpr std::int64_t n = 1 << 18;
  auto seen = ft::on_threads(3, [&](int r) -> std::string {
    gl::options o = ft::gloo_timeout(20);
    o.stripes = 2;
    gl::communicator c(shared_store(), prefix, r, 3, o);
    if (r > 0) {
      while (!(r == 1 ? go1 : go2)) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      const std::vector<float> v(n, static_cast<float>(r));
      c.send(v.data(), n, dtype::f32, 0);
      return "";
    }
    std::vector<float> from1(n), from2(n);
    fedshard::request a = c.recv_async(from1.data(), n, dtype::f32, 1);
    fedshard::request b = c.recv_async(from2.data(), n, dtype::f32, 2);
    const bool a0 = a.test(), b0 = b.test();
    go2 = true;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
    while (!b.test() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const bool b1 = b.test(), a1 = a.test();
    go1 = true;
    a.wait();
    b.wait();
    const bool right = std::all_of(from1.begin(), from1.end(), [](float x) { return x == 1; }) &&
                       std::all_of(from2.begin(), from2.end(), [](float x) { return x == 2; });
    return concat(a0, b0, "|", b1, a1, "|", right);
  });
  // before: neither done; rank 2 sent: its receive done, rank 1's not; both right at the end
  CHECK(seen[0] == "00|10|1");
}

TEST_CASE("gloo: a peer process killed mid-run gives peer_failure at once, not a hang") {
  // On one connection; and over 3 stripes in stages of 4096 B (2^16 f32 between 2 ranks:
  // 32 stages, 3 threads waiting on the dead peer at once: all of them must come back, and
  // the call throws once).
  for (const int stripes : {1, 3}) {
    CAPTURE(stripes);
    ft::temp_dir dir;
    gl::options o = ft::gloo_timeout(60);
    if (stripes > 1) o.pipeline_bytes = 4096;
    o.stripes = stripes;
    const pid_t child = ::fork();
    if (child == 0) {
      // Rank 1 in its own process: one all_reduce, then it dies without a word.
      try {
        auto st = std::make_shared<gl::file_store>(dir.path());
        gl::communicator c(st, "killed", 1, 2, o);
        double v = 2;
        c.all_reduce(&v, &v, 1, dtype::f64, reduce_op::sum);
      } catch (...) {
        ::_exit(3);
      }
      ::kill(::getpid(), SIGKILL);
      ::_exit(4);
    }
    REQUIRE(child > 0);
    auto st = std::make_shared<gl::file_store>(dir.path());
    gl::communicator c(st, "killed", 0, 2, o);
    double v = 1;
    c.all_reduce(&v, &v, 1, dtype::f64, reduce_op::sum);
    CHECK(v == 3);
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    CHECK(WIFSIGNALED(status));
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<float> big(1 << 16, 1.0f);
    CHECK_THROWS_AS(c.all_reduce(big.data(), big.data(), static_cast<std::int64_t>(big.size()),
                                 dtype::f32, reduce_op::sum),
                    fedshard::peer_failure);
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(waited < 30);  // far below the 60 s timeout: the closed socket is noticed
    CHECK_THROWS_WITH_AS(c.barrier(), doctest::Contains("unusable after an earlier failure"),
                         fedshard::backend_error);
  }
}

TEST_CASE(
    "gloo: stripes outside [1, 64] and a negative pipeline_bytes are refused with what "
    "was found") {
  ft::temp_dir dir;
  const auto refused = [&](const gl::options& o, const std::string& want) {
    CHECK_THROWS_WITH_AS(
        gl::communicator(std::make_shared<gl::file_store>(dir.path()), "bad", 0, 1, o),
        doctest::Contains(want.c_str()), fedshard::invalid_argument);
  };
  for (int bad : {0, 65}) {
    gl::options o = ft::gloo_timeout(5);
    o.stripes = bad;
    refused(o, fedshard::detail::concat("stripes must be in [1, 64], found ", bad));
  }
  gl::options o = ft::gloo_timeout(5);
  o.pipeline_bytes = -1;
  refused(o, "pipeline_bytes must be >= 0 (0: one stage), found -1");
}

/// Runs body() in a child process whose SIGPIPE disposition is the default (the process
/// ends); returns how the child ended: "exit N" or "signal N".
template <class F>
std::string in_child_with_default_sigpipe(F&& body) {
  const pid_t child = ::fork();
  if (child == 0) {
    ::signal(SIGPIPE, SIG_DFL);
    ::_exit(body());
  }
  REQUIRE(child > 0);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  if (WIFSIGNALED(status)) return concat("signal ", WTERMSIG(status));
  return concat("exit ", WEXITSTATUS(status));
}

TEST_CASE("gloo: sigpipe_shield turns a write to a closed socket into EPIPE, and leaves no trace") {
  const auto how = in_child_with_default_sigpipe([] {
    int fds[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) return 10;
    ::close(fds[1]);
    sigset_t before;
    ::pthread_sigmask(SIG_SETMASK, nullptr, &before);
    int err = 0;
    {
      const fedshard::detail::sigpipe_shield shield;
      const char byte = 1;
      if (::write(fds[0], &byte, 1) != -1) return 11;
      err = errno;
    }
    if (err != EPIPE) return 12;
    sigset_t after;
    ::pthread_sigmask(SIG_SETMASK, nullptr, &after);
    if (sigismember(&after, SIGPIPE) != sigismember(&before, SIGPIPE)) return 13;  // restored
    sigset_t pending;
    ::sigpending(&pending);
    if (sigismember(&pending, SIGPIPE) == 1) return 14;  // taken back, not left to fire
    return 0;
  });
  CHECK(how == "exit 0");  // "signal 13": the process died of SIGPIPE
}

TEST_CASE("gloo: a rank writing to a peer that closed its sockets gets peer_failure, not SIGPIPE") {
  // The survivor is in the middle of a large send (the transport thread writes it as the
  // socket drains) when its peer closes the link without reading, the way a killed group's
  // links look to the others. Without the shield this child dies of SIGPIPE.
  ft::temp_dir dir;
  const auto how = in_child_with_default_sigpipe([&] {
    try {
      auto st = std::make_shared<gl::file_store>(dir.path());
      std::jthread peer([&] {  // joined however this scope ends
        gl::communicator c(st, "closed", 1, 2, ft::gloo_timeout(60));
        double v = 1;
        c.all_reduce(&v, &v, 1, dtype::f64, reduce_op::sum);
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
      });  // leaves without reading: the destructor closes its sockets
      gl::communicator c(st, "closed", 0, 2, ft::gloo_timeout(60));
      double v = 1;
      c.all_reduce(&v, &v, 1, dtype::f64, reduce_op::sum);
      std::vector<float> big(std::size_t{1} << 26, 1.0f);  // 256 MiB: far more than a socket holds
      c.send(big.data(), static_cast<std::int64_t>(big.size()), dtype::f32, 1, 0);
      return 20;  // the send completed into a closed peer
    } catch (const fedshard::peer_failure&) {
      return 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "unexpected: %s\n", e.what());
      return 21;
    }
  });
  CHECK(how == "exit 0");
}

/// A store in front of another that makes every lookup of one rank late by `delay`.
class late_store final : public gl::store {
 public:
  late_store(std::shared_ptr<gl::store> inner, std::chrono::milliseconds delay)
      : inner_(std::move(inner)), delay_(delay) {}
  void set(const std::string& key, const std::vector<char>& value) override {
    inner_->set(key, value);
  }
  bool try_set(const std::string& key, const std::vector<char>& value) override {
    return inner_->try_set(key, value);
  }
  std::vector<char> try_get(const std::string& key, bool& found) override {
    std::this_thread::sleep_for(delay_);
    return inner_->try_get(key, found);
  }
  std::string name() const override { return inner_->name(); }

 private:
  std::shared_ptr<gl::store> inner_;
  std::chrono::milliseconds delay_;
};

TEST_CASE("gloo: a communicator dropped as soon as it is made leaves no peer half-connected") {
  // The constructor returns on a rank only once every rank has connected, so the ranks that
  // finish first may close the context at once (a split used and dropped, an abandoned
  // elastic round) without failing a slower peer's connect. Rank r looks keys up r x 7 ms
  // late, which orders the ranks differently in every round.
  for (int round = 0; round < 12; ++round) {
    CAPTURE(round);
    const auto prefix = next_prefix();
    const auto made = ft::on_threads(3, [&](int r) {
      const auto lateness = std::chrono::milliseconds(((r + round) % 3) * 7);
      auto st = std::make_shared<late_store>(shared_store(), lateness);
      gl::communicator c(st, prefix, r, 3, ft::gloo_timeout(60));
      return c.size();
    });
    CHECK(made == std::vector<int>{3, 3, 3});
  }
}

TEST_CASE("gloo: moved() counts what is handed to Gloo for the algorithm used (4 ranks)") {
  // The large path in one stage and in 4 stages of 256 B (64 f32) over 2 stripes: the same
  // bytes.
  for (std::int64_t small : {std::int64_t{256} * 1024, std::int64_t{0}, std::int64_t{-1}}) {
    CAPTURE(small);
    const auto prefix = next_prefix();
    auto got = ft::on_threads(4, [&](int r) {
      gl::options o = ft::gloo_timeout(60);
      o.small_all_reduce_bytes = std::max<std::int64_t>(small, 0);
      o.pipeline_bytes = small < 0 ? 256 : 0;
      o.stripes = small < 0 ? 2 : 1;
      gl::communicator c(shared_store(), prefix, r, 4, o);
      std::vector<float> x(1000, 1.0f);
      std::vector<fedshard::moved_bytes> seen;
      const bool gathers = c.algorithm_of(fedshard::collective::all_reduce, 1000, dtype::f32) ==
                           fedshard::wire_algorithm::gather_all;
      c.all_reduce(x.data(), x.data(), 1000, dtype::f32, reduce_op::sum);
      seen.push_back(c.moved());
      c.broadcast(x.data(), 1000, dtype::f32, 3);
      seen.push_back(c.moved() - seen[0]);
      return std::pair(gathers, seen);
    });
    for (int r = 0; r < 4; ++r) {
      CAPTURE(r);
      const auto& [gathers, seen] = got[static_cast<std::size_t>(r)];
      // small: the all-gather of every 4000-B input, 3 x 4000 each way; large: chunks of 1000
      // f32 / 4 = 250 rounded up to 256 f32 (1024 B) in an alltoall and a gather, 2 x 3 x 1024
      // = 6144 each way: a ring's 6000 plus the padding of the chunks.
      CHECK(gathers == (small > 0));
      const std::int64_t b = small > 0 ? 12000 : 6144;
      CHECK(seen[0] == fedshard::moved_bytes{b, b});
      // broadcast from rank 3: its 4000 B reach 3 ranks
      CHECK(seen[1] == (r == 3 ? fedshard::moved_bytes{12000, 0} : fedshard::moved_bytes{0, 4000}));
    }
  }
}
