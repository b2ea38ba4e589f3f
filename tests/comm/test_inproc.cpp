/// Tests of the in-process communicator: the backend-generic collective checks on 1 to 8
/// thread ranks, and what a driver can only observe in one process (every rank's outcome of
/// an error, timeouts, run()).

#include "fedshard/comm/inproc.hpp"

#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "support/collective_checks.hpp"
#include "support/spawn_ranks.hpp"

namespace {

using fedshard::dtype;
using fedshard::reduce_op;
using fedshard::detail::concat;
using fedshard::inproc::communicator;
namespace ft = fedshard::test;
using ft::outcome_kind;

constexpr int max_ranks = 8;

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

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

/// Sets (or unsets, with nullptr) an environment variable for one scope.
class scoped_env {
 public:
  scoped_env(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    set(value);
  }
  ~scoped_env() { set(old_ ? old_->c_str() : nullptr); }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;
  void set(const char* value) {
    if (value)
      ::setenv(name_, value, 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace

static_assert(fedshard::Communicator<communicator>);

TEST_CASE("inproc: ranks are 0..n-1 of a world of size n") {
  for (int n = 1; n <= max_ranks; ++n) {
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

TEST_CASE("inproc: all_reduce of every dtype, op and size, in and out of place, on 1 to 8 ranks") {
  for (int n = 1; n <= max_ranks; ++n)
    on_ranks(n, [](communicator& c) {
      ft::run_cases(c, ft::case_grid(ft::coll::all_reduce, c.size(), ft::small_counts, 100));
    });
}

TEST_CASE("inproc: all_gather of every dtype and size, in and out of place, on 1 to 8 ranks") {
  for (int n = 1; n <= max_ranks; ++n)
    on_ranks(n, [](communicator& c) {
      ft::run_cases(c, ft::case_grid(ft::coll::all_gather, c.size(), ft::small_counts, 200));
    });
}

TEST_CASE(
    "inproc: reduce_scatter of every dtype, op and size, in and out of place, on 1 to 8 ranks") {
  for (int n = 1; n <= max_ranks; ++n)
    on_ranks(n, [](communicator& c) {
      ft::run_cases(c, ft::case_grid(ft::coll::reduce_scatter, c.size(), ft::small_counts, 300));
    });
}

TEST_CASE("inproc: broadcast of every dtype and size from every root on 1 to 8 ranks") {
  for (int n = 1; n <= max_ranks; ++n)
    on_ranks(n, [](communicator& c) {
      ft::run_cases(c, ft::case_grid(ft::coll::broadcast, c.size(), ft::small_counts, 400));
    });
}

TEST_CASE("inproc: a large count that is not a multiple of the ranks") {
  auto spec = [](ft::coll k, dtype t, reduce_op op, bool in_place, int root, std::uint64_t seed) {
    ft::case_spec s;
    s.kind = k;
    s.type = t;
    s.op = op;
    s.count = ft::large_count;
    s.in_place = in_place;
    s.root = root;
    s.seed = seed;
    return s;
  };
  using ft::coll;
  on_ranks(8, [&](communicator& c) {
    ft::run_cases(c, {spec(coll::all_reduce, dtype::f32, reduce_op::sum, false, 0, 1)});
  });
  on_ranks(5, [&](communicator& c) {
    ft::run_cases(c, {spec(coll::all_reduce, dtype::bf16, reduce_op::max, true, 0, 2)});
  });
  on_ranks(3, [&](communicator& c) {
    ft::run_cases(c, {spec(coll::all_reduce, dtype::f64, reduce_op::avg, true, 0, 3),
                      spec(coll::all_reduce, dtype::f16, reduce_op::min, false, 0, 4),
                      spec(coll::all_gather, dtype::f16, reduce_op::sum, true, 0, 5),
                      spec(coll::reduce_scatter, dtype::bf16, reduce_op::sum, true, 0, 6),
                      spec(coll::reduce_scatter, dtype::f32, reduce_op::avg, false, 0, 7),
                      spec(coll::broadcast, dtype::f64, reduce_op::sum, false, 2, 8)});
  });
}

TEST_CASE("inproc: nobody leaves a barrier before everyone entered it") {
  constexpr int rounds = 20;
  for (int n = 1; n <= max_ranks; ++n) {
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

TEST_CASE("inproc: send/recv around a ring for every dtype and size on 1 to 8 ranks") {
  for (int n = 1; n <= max_ranks; ++n)
    on_ranks(n, [](communicator& c) {
      int tag = 0;
      for (dtype t : fedshard::all_dtypes)
        for (std::int64_t count : ft::small_counts) {
          ft::check_ring(c, t, count, 500 + static_cast<std::uint64_t>(tag), tag);
          ++tag;
        }
    });
}

TEST_CASE("inproc: messages are matched by tag and in order per sender and tag") {
  for (int n : {1, 2, 3, 5, 8})
    on_ranks(n, [](communicator& c) { ft::check_message_order(c, 5, 61, 600); });
}

TEST_CASE("inproc: split by colors and keys, nested, on 1 to 8 ranks") {
  for (int n = 1; n <= max_ranks; ++n)
    on_ranks(n, [](communicator& c) {
      const int size = c.size();
      std::vector<int> ids(static_cast<std::size_t>(size));
      for (int p = 0; p < size; ++p) ids[p] = p;
      ft::check_split(
          c, ids, [](int r) { return r % 3; }, [](int r) { return r; }, 700);
      // Keys reverse the order.
      auto reversed = ft::check_split(
          c, ids, [](int) { return 0; }, [&](int r) { return size - r; }, 701);
      CHECK_EQ(reversed.comm.rank(), size - 1 - c.rank());
      // Equal keys keep the parent's order.
      ft::check_split(
          c, ids, [](int r) { return r % 2; }, [](int) { return 7; }, 702);
      ft::check_split(
          c, ids, [](int r) { return r / 2; }, [](int r) { return -r; }, 703);
      // Nested: split a split, twice; ranks index the parent, ids stay world ranks.
      auto half = ft::check_split(
          c, ids, [](int r) { return r % 2; }, [](int r) { return r; }, 704);
      auto quarter = ft::check_split(
          half.comm, half.ids, [](int r) { return r / 2; }, [](int r) { return -r; }, 705);
      ft::check_split(
          quarter.comm, quarter.ids, [](int) { return 3; }, [](int r) { return -r; }, 706);
      CHECK_EQ(quarter.comm.world_rank(), c.rank());
      ft::check_ring(quarter.comm, dtype::bf16, 61, 707);
    });
}

TEST_CASE("inproc: sub-communicators used concurrently from the same ranks, async in flight") {
  for (int n = 2; n <= max_ranks; ++n)
    on_ranks(n, [](communicator& c) { ft::check_concurrent_splits(c, 800, 3); });
}

TEST_CASE("inproc: async operations in flight together, mixed with blocking ones, polled") {
  for (int n = 1; n <= max_ranks; ++n)
    on_ranks(n, [](communicator& c) {
      ft::check_async(c, 900);
      fedshard::request b = c.barrier_async();
      b.wait();
      CHECK_FALSE(b.pending());
    });
}

TEST_CASE("inproc: a request destroyed without wait() completes its operation") {
  for (int n : {1, 2, 3, 8})
    on_ranks(n, [](communicator& c) {
      ft::check_dropped_request(c, 1000);
      // A failing operation whose request is dropped: the error is dropped, nothing hangs.
      std::vector<float> buf(64 * static_cast<std::size_t>(c.size()));
      {
        fedshard::request r = c.all_reduce_async(buf.data(), buf.data(), c.rank() == 0 ? 8 : 9,
                                                 dtype::f32, reduce_op::sum);
      }
      ft::check_usable(c, 1001);
    });
}

TEST_CASE("inproc: results are bit-identical on every rank and every run, whatever the timing") {
  constexpr int runs = 20;
  for (int n : {3, 8}) {
    CAPTURE(n);
    std::vector<std::vector<std::vector<std::uint64_t>>> digests(runs);
    for (int run = 0; run < runs; ++run) {
      digests[run].resize(static_cast<std::size_t>(n));
      on_ranks(n, [&](communicator& c) {
        ft::jitter j(static_cast<std::uint64_t>(run * 64 + c.rank()));
        digests[run][static_cast<std::size_t>(c.rank())] = ft::deterministic_reductions(c, 1100, j);
      });
    }
    const std::size_t reduce_results = 16;  // all_reduce digests come first
    for (int run = 0; run < runs; ++run)
      for (int rank = 0; rank < n; ++rank) {
        CAPTURE(run);
        CAPTURE(rank);
        const auto& d = digests[run][static_cast<std::size_t>(rank)];
        REQUIRE(d.size() == 2 * reduce_results);
        for (std::size_t k = 0; k < d.size(); ++k) {
          CAPTURE(k);
          // Same on every run; all_reduce results are the same on every rank too.
          CHECK(d[k] == digests[0][static_cast<std::size_t>(rank)][k]);
          if (k < reduce_results) CHECK(d[k] == digests[run][0][k]);
        }
      }
  }
}

TEST_CASE("inproc: a mismatched collective throws collective_mismatch on every rank") {
  for (int n : {2, 3, 5})
    for (ft::mismatch_in what : ft::all_mismatches)
      for (int culprit : {0, n - 1})
        for (bool async : {false, true}) {
          CAPTURE(n);
          CAPTURE(ft::to_string(what));
          CAPTURE(culprit);
          CAPTURE(async);
          std::vector<ft::outcome> seen(static_cast<std::size_t>(n));
          on_ranks(n, [&](communicator& c) {
            seen[static_cast<std::size_t>(c.rank())] =
                ft::provoke_mismatch(c, what, culprit, async);
            ft::check_usable(c, 1200);  // still usable after the error
          });
          const int odd_root = culprit == n - 1 ? 0 : n - 1;
          const int root = culprit == n - 1 ? n - 1 : 0;
          std::string culprit_value, others_value;
          switch (what) {
            case ft::mismatch_in::count:
              culprit_value = std::to_string(ft::mismatch_count_culprit);
              others_value = std::to_string(ft::mismatch_count_others);
              break;
            case ft::mismatch_in::dtype:
              culprit_value = "f64";
              others_value = "f32";
              break;
            case ft::mismatch_in::op:
              culprit_value = "max";
              others_value = "sum";
              break;
            case ft::mismatch_in::root:
              culprit_value = concat("root=", odd_root);
              others_value = concat("root=", root);
              break;
            case ft::mismatch_in::kind:
              culprit_value = "all_gather";
              others_value = "all_reduce";
              break;
          }
          for (int r = 0; r < n; ++r) {
            CAPTURE(r);
            const ft::outcome& o = seen[static_cast<std::size_t>(r)];
            CAPTURE(o.what);
            CHECK(o.kind == outcome_kind::collective_mismatch);
            CHECK(contains(o.what, concat("rank ", culprit)));
            CHECK(contains(o.what, culprit_value));
            CHECK(contains(o.what, others_value));
          }
        }
}

TEST_CASE("inproc: invalid collective arguments throw invalid_argument on every rank") {
  for (int n : {1, 3})
    for (ft::invalid_in what : ft::all_invalid_collective_args)
      for (int culprit : {-1, n - 1}) {
        CAPTURE(n);
        CAPTURE(static_cast<int>(what));
        CAPTURE(culprit);
        std::vector<ft::outcome> seen(static_cast<std::size_t>(n));
        on_ranks(n, [&](communicator& c) {
          seen[static_cast<std::size_t>(c.rank())] = ft::provoke_invalid(c, what, culprit);
          ft::check_usable(c, 1300);
        });
        for (int r = 0; r < n; ++r) {
          CAPTURE(r);
          const ft::outcome& o = seen[static_cast<std::size_t>(r)];
          CAPTURE(o.what);
          CHECK(o.kind == outcome_kind::invalid_argument);
          if (culprit >= 0) CHECK(contains(o.what, concat("rank ", culprit)));
        }
      }
}

TEST_CASE("inproc: invalid point-to-point arguments throw invalid_argument at once") {
  for (int n : {1, 3})
    for (ft::invalid_p2p what : ft::all_invalid_p2p_args) {
      CAPTURE(n);
      CAPTURE(static_cast<int>(what));
      std::vector<ft::outcome> seen(static_cast<std::size_t>(n));
      on_ranks(n, [&](communicator& c) {
        seen[static_cast<std::size_t>(c.rank())] = ft::provoke_invalid_p2p(c, what);
        ft::check_ring(c, dtype::f32, 7, 1400);  // nothing half-posted is left behind
      });
      for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        CAPTURE(seen[static_cast<std::size_t>(r)].what);
        CHECK(seen[static_cast<std::size_t>(r)].kind == outcome_kind::invalid_argument);
      }
    }
}

TEST_CASE("inproc: a send and a receive that disagree throw collective_mismatch on both sides") {
  for (int n : {2, 3})
    for (bool dtype_differs : {false, true}) {
      CAPTURE(n);
      CAPTURE(dtype_differs);
      std::vector<ft::outcome> seen(static_cast<std::size_t>(n));
      on_ranks(n, [&](communicator& c) {
        seen[static_cast<std::size_t>(c.rank())] = ft::provoke_p2p_mismatch(c, dtype_differs);
        ft::check_ring(c, dtype::f16, 61, 1500);
      });
      for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        const ft::outcome& o = seen[static_cast<std::size_t>(r)];
        CAPTURE(o.what);
        if (r > 1) {
          CHECK(o.kind == outcome_kind::ok);
          continue;
        }
        CHECK(o.kind == outcome_kind::collective_mismatch);
        CHECK(contains(o.what, dtype_differs ? "f64" : "11"));
        CHECK(contains(o.what, dtype_differs ? "f32" : "10"));
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

TEST_CASE("inproc: a moved communicator keeps working") {
  on_ranks(3, [](communicator& c) {
    communicator moved = std::move(c);
    ft::check_usable(moved, 1600);
    communicator again(std::move(moved));
    ft::check_ring(again, dtype::f64, 7, 1601);
  });
}
