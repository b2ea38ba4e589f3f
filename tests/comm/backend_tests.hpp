#pragma once
/// The test cases every Communicator backend passes, written once and registered by each
/// backend's test file for its traits type:
///
///     FEDSHARD_COMM_TESTS(my_backend)          // every backend
///     FEDSHARD_COMM_CHECKED_TESTS(my_backend)  // backends that report a mismatched call and
///                                              // an invalid argument on every rank
///
/// (at namespace scope, without a semicolon).
///
/// A backend traits type B provides:
///  1. `B::comm`, the Communicator under test;
///  2. `B::max_ranks()`, the most ranks one of its communicators can have;
///  3. `B::run(n, body)`, n <= max_ranks(): runs body(B::comm&) on every rank of
///     communicators of n ranks (a backend whose processes are more than n cuts them into
///     groups of n, the last one smaller, so bodies take the size from the communicator)
///     and returns a ranked<R> for every rank whose result this process sees, R being what
///     body returns; a rank whose body throws fails the test case with the message;
///  4. `B::determinism_runs`, how many times the determinism test repeats its calls.
/// Bodies check results with the throwing checks of support/collective_checks.hpp and return
/// what the test case then checks for every rank it sees.

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "support/collective_checks.hpp"

namespace fedshard::test {

/// What body returned on one rank of a communicator of `size` ranks.
template <class R>
struct ranked {
  int rank = 0;
  int size = 0;
  R value{};
};

/// For backends whose ranks are threads of this process: calls all(), which returns every
/// rank's result in rank order, and ranks them; fails the test case if all() throws.
template <class All>
auto every_rank(All&& all) {
  using R = typename decltype(all())::value_type;
  std::vector<ranked<R>> seen;
  std::string error;
  try {
    auto values = all();
    const int n = static_cast<int>(values.size());
    for (int r = 0; r < n; ++r)
      seen.push_back({r, n, std::move(values[static_cast<std::size_t>(r)])});
  } catch (const std::exception& e) {
    error = e.what();
  }
  CHECK_MESSAGE(error.empty(), error);
  return seen;
}

/// What on_ranks' bodies return to B::run.
struct no_result {};

/// Runs body(c) on every rank of B's communicators of n ranks; a rank that throws fails the
/// test case.
template <class B, class F>
void on_ranks(int n, F&& body) {
  (void)B::run(n, [&](typename B::comm& c) {
    body(c);
    return no_result{};
  });
}

/// The rank counts of `wanted` that B can run, each capped at B::max_ranks(), without repeats.
template <class B>
std::vector<int> rank_counts(std::initializer_list<int> wanted) {
  std::vector<int> counts;
  for (int n : wanted) {
    const int m = std::min(n, B::max_ranks());
    if (std::find(counts.begin(), counts.end(), m) == counts.end()) counts.push_back(m);
  }
  return counts;
}

/// 1 to B::max_ranks().
template <class B>
std::vector<int> every_rank_count() {
  std::vector<int> counts;
  for (int n = 1; n <= B::max_ranks(); ++n) counts.push_back(n);
  return counts;
}

/// True when text contains part.
inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// ------------------------------------------------------------------ every backend

/// Runs case_grid(kind, ...) (every dtype, op, size and placement or root) on B's
/// communicators of 1 to max_ranks() ranks.
template <class B>
void check_grid(coll kind, std::uint64_t seed) {
  for (int n : every_rank_count<B>()) {
    CAPTURE(n);
    on_ranks<B>(n, [&](auto& c) { run_cases(c, case_grid(kind, c.size(), small_counts, seed)); });
  }
}

TEST_CASE_TEMPLATE_DEFINE("all_reduce of every dtype, op and size, in and out of place", B,
                          comm_all_reduce_grid) {
  check_grid<B>(coll::all_reduce, 100);
}

TEST_CASE_TEMPLATE_DEFINE("all_gather of every dtype and size, in and out of place", B,
                          comm_all_gather_grid) {
  check_grid<B>(coll::all_gather, 200);
}

TEST_CASE_TEMPLATE_DEFINE("reduce_scatter of every dtype, op and size, in and out of place", B,
                          comm_reduce_scatter_grid) {
  check_grid<B>(coll::reduce_scatter, 300);
}

TEST_CASE_TEMPLATE_DEFINE("broadcast of every dtype and size from every root", B,
                          comm_broadcast_grid) {
  check_grid<B>(coll::broadcast, 400);
}

TEST_CASE_TEMPLATE_DEFINE("a large count that is not a multiple of the ranks", B,
                          comm_large_count) {
  const auto big = large_count;
  on_ranks<B>(std::min(8, B::max_ranks()), [&](auto& c) {
    run_cases(c, {{.kind = coll::all_reduce, .type = dtype::f32, .count = big, .seed = 1}});
  });
  on_ranks<B>(std::min(5, B::max_ranks()), [&](auto& c) {
    run_cases(c, {{.kind = coll::all_reduce,
                   .type = dtype::bf16,
                   .op = reduce_op::max,
                   .count = big,
                   .in_place = true,
                   .seed = 2}});
  });
  on_ranks<B>(std::min(3, B::max_ranks()), [&](auto& c) {
    const int last = c.size() - 1;
    run_cases(
        c,
        {{.kind = coll::all_reduce,
          .type = dtype::f64,
          .op = reduce_op::avg,
          .count = big,
          .in_place = true,
          .seed = 3},
         {.kind = coll::all_reduce,
          .type = dtype::f16,
          .op = reduce_op::min,
          .count = big,
          .seed = 4},
         {.kind = coll::all_gather, .type = dtype::f16, .count = big, .in_place = true, .seed = 5},
         {.kind = coll::reduce_scatter,
          .type = dtype::bf16,
          .count = big,
          .in_place = true,
          .seed = 6},
         {.kind = coll::reduce_scatter,
          .type = dtype::f32,
          .op = reduce_op::avg,
          .count = big,
          .seed = 7},
         {.kind = coll::broadcast, .type = dtype::f64, .count = big, .root = last, .seed = 8}});
  });
}

TEST_CASE_TEMPLATE_DEFINE("send/recv around a ring for every dtype and size", B, comm_ring) {
  for (int n : every_rank_count<B>()) {
    CAPTURE(n);
    on_ranks<B>(n, [](auto& c) {
      int tag = 0;
      for (dtype t : all_dtypes)
        for (std::int64_t count : small_counts) {
          check_ring(c, t, count, 500 + static_cast<std::uint64_t>(tag), tag);
          ++tag;
        }
    });
  }
}

TEST_CASE_TEMPLATE_DEFINE("messages are matched by tag and in order per sender and tag", B,
                          comm_message_order) {
  for (int n : rank_counts<B>({1, 2, 3, 5, 8})) {
    CAPTURE(n);
    on_ranks<B>(n, [](auto& c) { check_message_order(c, 5, 61, 600); });
  }
}

TEST_CASE_TEMPLATE_DEFINE("split by colors and keys, nested", B, comm_split) {
  for (int n : every_rank_count<B>()) {
    CAPTURE(n);
    on_ranks<B>(n, [](auto& c) {
      const int size = c.size();
      std::vector<int> ids(static_cast<std::size_t>(size));
      for (int p = 0; p < size; ++p) ids[p] = p;
      check_split(
          c, ids, [](int r) { return r % 3; }, [](int r) { return r; }, 700);
      // Keys reverse the order.
      auto reversed = check_split(
          c, ids, [](int) { return 0; }, [&](int r) { return size - r; }, 701);
      if (reversed.comm.rank() != size - 1 - c.rank())
        fail("rank ", c.rank(), ": reversed keys give rank ", reversed.comm.rank());
      // Equal keys keep the parent's order.
      check_split(
          c, ids, [](int r) { return r % 2; }, [](int) { return 7; }, 702);
      check_split(
          c, ids, [](int r) { return r / 2; }, [](int r) { return -r; }, 703);
      // Nested: split a split, twice; ranks index the parent, ids stay the parent's ranks.
      auto half = check_split(
          c, ids, [](int r) { return r % 2; }, [](int r) { return r; }, 704);
      auto quarter = check_split(
          half.comm, half.ids, [](int r) { return r / 2; }, [](int r) { return -r; }, 705);
      check_split(
          quarter.comm, quarter.ids, [](int) { return 3; }, [](int r) { return -r; }, 706);
      if constexpr (requires { c.world_rank(); }) {
        if (quarter.comm.world_rank() != c.world_rank())
          fail("rank ", c.rank(), ": a nested split changed the world rank");
      }
      check_ring(quarter.comm, dtype::bf16, 61, 707);
    });
  }
}

TEST_CASE_TEMPLATE_DEFINE(
    "sub-communicators used concurrently from the same ranks, async in flight", B,
    comm_concurrent_splits) {
  for (int n : rank_counts<B>({2, 3, 4, 5, 6, 7, 8})) {
    CAPTURE(n);
    on_ranks<B>(n, [](auto& c) {
      if (c.size() >= 2) check_concurrent_splits(c, 800, 3);
    });
  }
}

TEST_CASE_TEMPLATE_DEFINE("async operations in flight together, mixed with blocking ones, polled",
                          B, comm_async) {
  for (int n : every_rank_count<B>()) {
    CAPTURE(n);
    on_ranks<B>(n, [](auto& c) {
      check_async(c, 900);
      if constexpr (requires { c.barrier_async(); }) {
        request b = c.barrier_async();
        b.wait();
        if (b.pending()) fail("rank ", c.rank(), ": a waited barrier_async is still pending");
      }
    });
  }
}

TEST_CASE_TEMPLATE_DEFINE("a request destroyed without wait() completes its operation", B,
                          comm_dropped_request) {
  for (int n : rank_counts<B>({1, 2, 3, 8})) {
    CAPTURE(n);
    on_ranks<B>(n, [](auto& c) { check_dropped_request(c, 1000); });
  }
}

TEST_CASE_TEMPLATE_DEFINE(
    "results are bit-identical on every rank and every run, whatever the timing", B,
    comm_deterministic) {
  const std::size_t reduce_results = 16;  // all_reduce digests come first
  for (int n : rank_counts<B>({3, 8})) {
    CAPTURE(n);
    std::vector<std::vector<ranked<std::vector<std::uint64_t>>>> runs;
    for (int run = 0; run < B::determinism_runs; ++run)
      runs.push_back(B::run(n, [&](auto& c) {
        jitter j(static_cast<std::uint64_t>(run * 64 + c.rank()));
        return deterministic_reductions(c, 1100, j);
      }));
    for (std::size_t run = 0; run < runs.size(); ++run) {
      CAPTURE(run);
      REQUIRE(runs[run].size() == runs[0].size());
      for (std::size_t i = 0; i < runs[run].size(); ++i) {
        const auto& r = runs[run][i];
        CAPTURE(r.rank);
        REQUIRE(r.value.size() == 2 * reduce_results);
        // The same on every run; all_reduce results the same on every rank too.
        CHECK(r.value == runs[0][i].value);
        for (std::size_t k = 0; k < reduce_results; ++k) {
          CAPTURE(k);
          if (r.size == runs[run][0].size) CHECK(r.value[k] == runs[run][0].value[k]);
        }
      }
    }
  }
}

TEST_CASE_TEMPLATE_DEFINE("a moved communicator keeps working", B, comm_moved) {
  on_ranks<B>(std::min(3, B::max_ranks()), [](auto& c) {
    using C = std::remove_cvref_t<decltype(c)>;
    C moved = std::move(c);
    check_usable(moved, 1600);
    C again(std::move(moved));
    check_ring(again, dtype::f64, 7, 1601);
    C other = again.split(0, 0);
    other = std::move(again);
    check_usable(other, 1602);
  });
}

TEST_CASE_TEMPLATE_DEFINE("invalid point-to-point arguments throw invalid_argument at once", B,
                          comm_invalid_p2p) {
  for (int n : rank_counts<B>({1, 3}))
    for (invalid_p2p what : all_invalid_p2p_args) {
      CAPTURE(n);
      CAPTURE(static_cast<int>(what));
      const auto seen = B::run(n, [&](auto& c) {
        const outcome o = provoke_invalid_p2p(c, what);
        check_ring(c, dtype::f32, 7, 1400);  // nothing half-posted is left behind
        return o;
      });
      for (const auto& r : seen) {
        CAPTURE(r.rank);
        CAPTURE(r.value.what);
        CHECK(r.value.kind == outcome_kind::invalid_argument);
      }
    }
}

// ------------------------------------------------------------------ backends that check calls

TEST_CASE_TEMPLATE_DEFINE("a mismatched collective throws collective_mismatch on every rank", B,
                          comm_mismatch) {
  for (int n : rank_counts<B>({2, 3, 5}))
    for (mismatch_in what : all_mismatches)
      for (bool last : {false, true})
        for (bool async : {false, true}) {
          CAPTURE(n);
          CAPTURE(to_string(what));
          CAPTURE(last);
          CAPTURE(async);
          const auto seen = B::run(n, [&](auto& c) {
            if (c.size() < 2) return outcome{};
            const outcome o = provoke_mismatch(c, what, last ? c.size() - 1 : 0, async);
            check_usable(c, 1200);  // still usable after the error
            return o;
          });
          for (const auto& r : seen) {
            if (r.size < 2) continue;
            const int culprit = last ? r.size - 1 : 0;
            const int odd_root = culprit == r.size - 1 ? 0 : r.size - 1;
            const int root = culprit == r.size - 1 ? r.size - 1 : 0;
            std::string culprit_value, others_value;
            switch (what) {
              case mismatch_in::count:
                culprit_value = std::to_string(mismatch_count_culprit);
                others_value = std::to_string(mismatch_count_others);
                break;
              case mismatch_in::dtype:
                culprit_value = "f64";
                others_value = "f32";
                break;
              case mismatch_in::op:
                culprit_value = "max";
                others_value = "sum";
                break;
              case mismatch_in::root:
                culprit_value = fedshard::detail::concat("root=", odd_root);
                others_value = fedshard::detail::concat("root=", root);
                break;
              case mismatch_in::kind:
                culprit_value = "all_gather";
                others_value = "all_reduce";
                break;
            }
            CAPTURE(r.rank);
            CAPTURE(r.value.what);
            CHECK(r.value.kind == outcome_kind::collective_mismatch);
            CHECK(contains(r.value.what, fedshard::detail::concat("rank ", culprit)));
            CHECK(contains(r.value.what, culprit_value));
            CHECK(contains(r.value.what, others_value));
          }
        }
}

TEST_CASE_TEMPLATE_DEFINE("invalid collective arguments throw invalid_argument on every rank", B,
                          comm_invalid_collective) {
  for (int n : rank_counts<B>({1, 3}))
    for (invalid_in what : all_invalid_collective_args)
      for (bool everyone : {true, false}) {
        CAPTURE(n);
        CAPTURE(static_cast<int>(what));
        CAPTURE(everyone);
        const auto seen = B::run(n, [&](auto& c) {
          const outcome o = provoke_invalid(c, what, everyone ? -1 : c.size() - 1);
          check_usable(c, 1300);
          return o;
        });
        for (const auto& r : seen) {
          CAPTURE(r.rank);
          CAPTURE(r.value.what);
          CHECK(r.value.kind == outcome_kind::invalid_argument);
          if (!everyone)
            CHECK(contains(r.value.what, fedshard::detail::concat("rank ", r.size - 1)));
        }
      }
}

TEST_CASE_TEMPLATE_DEFINE(
    "a send and a receive that disagree throw collective_mismatch on both sides", B,
    comm_p2p_mismatch) {
  for (int n : rank_counts<B>({2, 3}))
    for (bool dtype_differs : {false, true}) {
      CAPTURE(n);
      CAPTURE(dtype_differs);
      const auto seen = B::run(n, [&](auto& c) {
        if (c.size() < 2) return outcome{};
        const outcome o = provoke_p2p_mismatch(c, dtype_differs);
        check_ring(c, dtype::f16, 61, 1500);
        return o;
      });
      for (const auto& r : seen) {
        CAPTURE(r.rank);
        CAPTURE(r.value.what);
        if (r.size < 2 || r.rank > 1) {
          CHECK(r.value.kind == outcome_kind::ok);
          continue;
        }
        CHECK(r.value.kind == outcome_kind::collective_mismatch);
        CHECK(contains(r.value.what, dtype_differs ? "f64" : "11"));
        CHECK(contains(r.value.what, dtype_differs ? "f32" : "10"));
      }
    }
}

TEST_CASE_TEMPLATE_DEFINE(
    "a failing operation whose request is dropped leaves the communicator usable", B,
    comm_dropped_failure) {
  for (int n : rank_counts<B>({1, 2, 3, 8})) {
    CAPTURE(n);
    on_ranks<B>(n, [](auto& c) {
      // The error is dropped with the request; nothing hangs.
      std::vector<float> buf(64 * static_cast<std::size_t>(c.size()));
      {
        request r = c.all_reduce_async(buf.data(), buf.data(), c.rank() == 0 ? 8 : 9, dtype::f32,
                                       reduce_op::sum);
      }
      check_usable(c, 1001);
    });
  }
}

}  // namespace fedshard::test

/// Registers the test cases of every backend for the traits types given.
#define FEDSHARD_COMM_TESTS(...)                                    \
  namespace fedshard::test {                                        \
  TEST_CASE_TEMPLATE_INVOKE(comm_all_reduce_grid, __VA_ARGS__);     \
  TEST_CASE_TEMPLATE_INVOKE(comm_all_gather_grid, __VA_ARGS__);     \
  TEST_CASE_TEMPLATE_INVOKE(comm_reduce_scatter_grid, __VA_ARGS__); \
  TEST_CASE_TEMPLATE_INVOKE(comm_broadcast_grid, __VA_ARGS__);      \
  TEST_CASE_TEMPLATE_INVOKE(comm_large_count, __VA_ARGS__);         \
  TEST_CASE_TEMPLATE_INVOKE(comm_ring, __VA_ARGS__);                \
  TEST_CASE_TEMPLATE_INVOKE(comm_message_order, __VA_ARGS__);       \
  TEST_CASE_TEMPLATE_INVOKE(comm_split, __VA_ARGS__);               \
  TEST_CASE_TEMPLATE_INVOKE(comm_concurrent_splits, __VA_ARGS__);   \
  TEST_CASE_TEMPLATE_INVOKE(comm_async, __VA_ARGS__);               \
  TEST_CASE_TEMPLATE_INVOKE(comm_dropped_request, __VA_ARGS__);     \
  TEST_CASE_TEMPLATE_INVOKE(comm_deterministic, __VA_ARGS__);       \
  TEST_CASE_TEMPLATE_INVOKE(comm_moved, __VA_ARGS__);               \
  TEST_CASE_TEMPLATE_INVOKE(comm_invalid_p2p, __VA_ARGS__);         \
  }  // namespace fedshard::test

/// Registers the test cases of backends that check calls across ranks (a mismatched or
/// invalid call throws on every rank) for the traits types given.
#define FEDSHARD_COMM_CHECKED_TESTS(...)                           \
  namespace fedshard::test {                                       \
  TEST_CASE_TEMPLATE_INVOKE(comm_mismatch, __VA_ARGS__);           \
  TEST_CASE_TEMPLATE_INVOKE(comm_invalid_collective, __VA_ARGS__); \
  TEST_CASE_TEMPLATE_INVOKE(comm_p2p_mismatch, __VA_ARGS__);       \
  TEST_CASE_TEMPLATE_INVOKE(comm_dropped_failure, __VA_ARGS__);    \
  }  // namespace fedshard::test
