/// Tests of the in-process communicator: the backend-generic test cases of
/// comm/backend_tests.hpp on worlds of 1 to 8 thread ranks, and what only inproc does (a
/// failed or departed rank makes its peers throw peer_failure, timeouts, run()).

#include "fedshard/comm/inproc.hpp"

#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/backend_tests.hpp"
#include "support/collective_checks.hpp"
#include "support/spawn_ranks.hpp"

namespace {

using namespace fedshard;
using fedshard::detail::concat;
using fedshard::inproc::communicator;
namespace ft = fedshard::test;
using ft::outcome_kind;

constexpr int most_ranks = 8;

/// The traits of inproc for comm/backend_tests.hpp: every run is a world of its own.
struct inproc_ranks {
  using comm = communicator;
  static constexpr int determinism_runs = 20;
  static int max_ranks() { return most_ranks; }
  template <class F>
  static auto run(int n, F&& body) {
    return ft::every_rank([&] { return ft::collect_ranks(n, body); });
  }
};

/// Runs body on n ranks and fails the check (with the rank's message) if any rank threw.
template <class F>
void on_ranks(int n, F&& body, fedshard::inproc::options opt = {}) {
  CAPTURE(n);
  CHECK_NOTHROW(ft::spawn_ranks(n, body, opt));
}

/// The exception a rank throws on purpose in the failure tests.
class rank_crash : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Keeps a straggler rank alive until done() or for 30 s at most: a timeout that never fires
/// then shows as peer_failure (the straggler left) instead of hanging the test.
template <class Done>
void linger(Done done) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!done() && std::chrono::steady_clock::now() < give_up)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

using ft::contains;
using ft::scoped_env;

}  // namespace

static_assert(fedshard::Communicator<communicator>);

TYPE_TO_STRING_AS("inproc", inproc_ranks);
FEDSHARD_COMM_TESTS(inproc_ranks)
FEDSHARD_COMM_CHECKED_TESTS(inproc_ranks)

TEST_CASE("inproc: ranks are 0..n-1 of a world of size n") {
  for (int n = 1; n <= most_ranks; ++n) {
    std::vector<int> seen(static_cast<std::size_t>(n), -1);
    std::vector<int> sizes(static_cast<std::size_t>(n), -1);
    std::atomic<int> calls{0};
    on_ranks(n, [&](communicator& c) {
      ++calls;
      seen[static_cast<std::size_t>(c.world_rank())] = c.rank();
      sizes[static_cast<std::size_t>(c.rank())] = c.size();
    });
    CHECK(calls.load() == n);
    for (int r = 0; r < n; ++r) {
      CHECK(seen[static_cast<std::size_t>(r)] == r);
      CHECK(sizes[static_cast<std::size_t>(r)] == n);
    }
  }
}

TEST_CASE("inproc: nobody leaves a barrier before everyone entered it") {
  constexpr int rounds = 20;
  for (int n = 1; n <= most_ranks; ++n) {
    std::array<std::atomic<int>, rounds> entered{};
    std::vector<std::array<int, rounds>> seen(static_cast<std::size_t>(n));
    on_ranks(n, [&](communicator& c) {
      ft::jitter j(static_cast<std::uint64_t>(c.rank() + 1));
      for (int r = 0; r < rounds; ++r) {
        j();
        entered[r].fetch_add(1);
        c.barrier();
        seen[static_cast<std::size_t>(c.rank())][r] = entered[r].load();
      }
    });
    for (int rank = 0; rank < n; ++rank)
      for (int r = 0; r < rounds; ++r) {
        CAPTURE(rank);
        CAPTURE(r);
        CHECK(seen[static_cast<std::size_t>(rank)][r] == n);
      }
  }
}

TEST_CASE("inproc: a rank that throws makes every peer waiting for it throw peer_failure") {
  for (int n : {2, 4})
    for (ft::wait_point w : ft::all_wait_points)
      for (int delay_ms : {0, 20}) {
        CAPTURE(n);
        CAPTURE(ft::to_string(w));
        CAPTURE(delay_ms);
        const int culprit = n - 1;
        std::vector<ft::outcome> seen(static_cast<std::size_t>(n));
        CHECK_THROWS_AS(
            ft::spawn_ranks(n,
                            [&](communicator& c) {
                              if (c.rank() == culprit) {
                                std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
                                throw rank_crash("boom from the culprit");
                              }
                              seen[static_cast<std::size_t>(c.rank())] = ft::wait_in(c, w, culprit);
                            }),
            rank_crash);
        for (int r = 0; r < culprit; ++r) {
          CAPTURE(r);
          const ft::outcome& o = seen[static_cast<std::size_t>(r)];
          CAPTURE(o.what);
          CHECK(o.kind == outcome_kind::peer_failure);
          CHECK(contains(o.what, "boom from the culprit"));
          CHECK(contains(o.what, concat("rank ", culprit)));
        }
      }
}

TEST_CASE("inproc: run() rethrows the original exception, not the peers' peer_failure") {
  for (int n : {2, 5}) {
    CAPTURE(n);
    CHECK_THROWS_WITH_AS(ft::spawn_ranks(n,
                                         [](communicator& c) {
                                           if (c.rank() == 1) throw rank_crash("first failure");
                                           c.barrier();  // throws peer_failure, uncaught
                                         }),
                         "first failure", rank_crash);
  }
}

TEST_CASE("inproc: a rank that returns early makes every peer waiting for it throw peer_failure") {
  for (int n : {2, 4})
    for (ft::wait_point w : ft::all_wait_points) {
      CAPTURE(n);
      CAPTURE(ft::to_string(w));
      const int culprit = n - 1;
      std::vector<ft::outcome> seen(static_cast<std::size_t>(n));
      on_ranks(n, [&](communicator& c) {
        if (c.rank() == culprit) return;
        seen[static_cast<std::size_t>(c.rank())] = ft::wait_in(c, w, culprit);
      });
      for (int r = 0; r < culprit; ++r) {
        CAPTURE(r);
        const ft::outcome& o = seen[static_cast<std::size_t>(r)];
        CAPTURE(o.what);
        CHECK(o.kind == outcome_kind::peer_failure);
        CHECK(contains(o.what, concat("rank ", culprit)));
        CHECK(contains(o.what, "left"));
      }
    }
}

TEST_CASE("inproc: a failure in a sub-communicator reaches its waiting members") {
  std::vector<ft::outcome> seen(4);
  CHECK_THROWS_AS(ft::spawn_ranks(4,
                                  [&](communicator& c) {
                                    communicator sub = c.split(c.rank() % 2, c.rank());
                                    if (c.rank() == 3) throw rank_crash("sub failure");
                                    if (c.rank() == 1)
                                      seen[1] = ft::wait_in(sub, ft::wait_point::barrier, 0);
                                  }),
                  rank_crash);
  CAPTURE(seen[1].what);
  CHECK(seen[1].kind == outcome_kind::peer_failure);
  CHECK(contains(seen[1].what, "sub failure"));
}

TEST_CASE("inproc: a rank that throws with async work pending does not hang its peers") {
  for (int n : {2, 3}) {
    CAPTURE(n);
    CHECK_THROWS_AS(ft::spawn_ranks(n,
                                    [](communicator& c) {
                                      if (c.rank() != 0) return;
                                      std::vector<float> buf(8);
                                      fedshard::request r = c.all_reduce_async(
                                          buf.data(), buf.data(), 8, dtype::f32, reduce_op::sum);
                                      throw rank_crash("unwinding with a pending request");
                                    }),
                    rank_crash);
  }
}

TEST_CASE("inproc: a rank that throws with its own operation unanswered fails its peers at once") {
  // Rank 0 starts an operation rank 1 never answers (rank 1 waits in a recv rank 0 never
  // matches), then throws: the unwinding must not wait for the operation until the timeout.
  // The 2 s timeout only bounds the test when it fails.
  enum class pending { send, recv, collective };
  for (pending p : {pending::send, pending::recv, pending::collective}) {
    CAPTURE(static_cast<int>(p));
    ft::outcome seen;
    CHECK_THROWS_AS(ft::spawn_ranks(
                        2,
                        [&](communicator& c) {
                          if (c.rank() == 1) {
                            seen = ft::wait_in(c, ft::wait_point::recv, 0);  // tag 0
                            return;
                          }
                          std::vector<float> buf(8);
                          fedshard::request r;
                          if (p == pending::send)
                            r = c.send_async(buf.data(), 8, dtype::f32, 1, 1);
                          else if (p == pending::recv)
                            r = c.recv_async(buf.data(), 8, dtype::f32, 1, 1);
                          else
                            r = c.all_reduce_async(buf.data(), buf.data(), 8, dtype::f32,
                                                   reduce_op::sum);
                          throw rank_crash("boom with an operation pending");
                        },
                        ft::short_timeout(2.0)),
                    rank_crash);
    CAPTURE(seen.what);
    CHECK(seen.kind == outcome_kind::peer_failure);
    CHECK(contains(seen.what, "rank 0"));
    CHECK_FALSE(contains(seen.what, "timeout"));
  }
}

TEST_CASE("inproc: a collective a rank never joins throws timeout_error naming it") {
  const std::pair<int, ft::wait_point> cases[] = {{2, ft::wait_point::all_reduce},
                                                  {2, ft::wait_point::recv},
                                                  {2, ft::wait_point::all_reduce_async},
                                                  {3, ft::wait_point::barrier},
                                                  {3, ft::wait_point::broadcast}};
  for (const auto& [n, w] : cases) {
    CAPTURE(n);
    CAPTURE(ft::to_string(w));
    const int straggler = n - 1;
    std::vector<ft::outcome> seen(static_cast<std::size_t>(n));
    std::atomic<int> finished{0};
    on_ranks(
        n,
        [&](communicator& c) {
          if (c.rank() == straggler) {  // alive, but never calls: a hang, not a departure
            linger([&] { return finished.load() == n - 1; });
            return;
          }
          seen[static_cast<std::size_t>(c.rank())] = ft::wait_in(c, w, straggler);
          ++finished;
        },
        ft::short_timeout(0.3));
    const std::string name =
        w == ft::wait_point::all_reduce_async ? "all_reduce" : std::string(ft::to_string(w));
    int timeouts = 0;
    for (int r = 0; r < straggler; ++r) {
      CAPTURE(r);
      const ft::outcome& o = seen[static_cast<std::size_t>(r)];
      CAPTURE(o.what);
      // The first rank to time out fails the world: the others may see peer_failure.
      CHECK((o.kind == outcome_kind::timeout_error || o.kind == outcome_kind::peer_failure));
      if (o.kind != outcome_kind::timeout_error) continue;
      ++timeouts;
      CHECK(contains(o.what, name));
      CHECK(contains(o.what, concat("did not arrive: ", straggler)));
    }
    CHECK(timeouts >= 1);
  }
}

TEST_CASE("inproc: options take the timeout from FEDSHARD_TIMEOUT_S, else 300 s") {
  scoped_env env("FEDSHARD_TIMEOUT_S", nullptr);
  CHECK(fedshard::inproc::options{}.timeout.count() == 300.0);
  env.set("2.5");
  CHECK(fedshard::inproc::options{}.timeout.count() == 2.5);
  for (const char* ignored : {"", "junk", "0", "-4"}) {
    CAPTURE(ignored);
    env.set(ignored);
    CHECK(fedshard::inproc::options{}.timeout.count() == 300.0);
  }
  // run() with default options honours it.
  env.set("0.25");
  std::atomic<bool> done{false};
  ft::outcome seen;
  on_ranks(2, [&](communicator& c) {
    if (c.rank() == 1) {
      linger([&] { return done.load(); });
      return;
    }
    seen = ft::wait_in(c, ft::wait_point::barrier, 1);
    done = true;
  });
  CAPTURE(seen.what);
  CHECK(seen.kind == outcome_kind::timeout_error);
  CHECK(contains(seen.what, "0.25"));
}

TEST_CASE("inproc: run() rejects a rank count below 1 and a non-positive timeout") {
  std::atomic<int> calls{0};
  auto body = [&](communicator&) { ++calls; };
  CHECK_THROWS_AS(fedshard::inproc::run(0, body), fedshard::invalid_argument);
  CHECK_THROWS_AS(fedshard::inproc::run(-2, body), fedshard::invalid_argument);
  CHECK_THROWS_AS(fedshard::inproc::run(2, body, ft::short_timeout(0.0)),
                  fedshard::invalid_argument);
  CHECK(calls.load() == 0);
}
