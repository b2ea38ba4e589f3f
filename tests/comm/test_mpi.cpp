/// Tests of the MPI communicator, run by every rank of `mpirun -np 4` (tests/mpi/main.cpp): the
/// backend-generic test cases of comm/backend_tests.hpp on communicators of 1 to 4 ranks,
/// checked and unchecked (the checked ones also the cases of mismatches and invalid
/// arguments); both all_reduce algorithms, reduction::mpi and messages cut into pieces;
/// results bit-identical to inproc's; unchecked errors; timeouts; options and the environment.

#include "fedshard/comm/mpi.hpp"

#include <doctest/doctest.h>
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/backend_tests.hpp"
#include "fedshard/comm/inproc.hpp"
#include "mpi/mpi_support.hpp"
#include "support/collective_checks.hpp"

namespace {

using fedshard::dtype;
using fedshard::reduce_op;
using fedshard::detail::concat;
using fedshard::mpi::communicator;
namespace ft = fedshard::test;
using ft::outcome_kind;

using ft::contains;
using ft::scoped_env;

/// The traits of the MPI communicator for comm/backend_tests.hpp, checked or not: every run
/// cuts a new duplicate of MPI_COMM_WORLD into groups of n ranks (checked: all_reduce always
/// in two stages, so that its exchange and both stages are checked).
template <bool Checked>
struct mpi_ranks {
  using comm = communicator;
  static constexpr int determinism_runs = 3;
  static int max_ranks() { return ft::world_size(); }
  template <class F>
  static auto run(int n, F&& body) {
    using R = std::invoke_result_t<F&, communicator&>;
    auto opt = ft::mpi_options(Checked);
    if (Checked) opt.small_all_reduce_bytes = 0;
    communicator world = communicator::world(opt);
    communicator c = world.split(world.rank() / n, world.rank());
    std::vector<ft::ranked<R>> seen;
    ft::on_this_rank([&] { seen.push_back({c.rank(), c.size(), body(c)}); });
    return seen;
  }
};
using mpi_checked = mpi_ranks<true>;
using mpi_unchecked = mpi_ranks<false>;

/// Sub-communicators of world: ranks [0, k) and [k, n) for k = 1, 2 (sizes 1, 3, 2, 2) and the
/// whole world, so every size from 1 to 4 is covered.
std::vector<communicator> all_sizes(communicator& world) {
  std::vector<communicator> subs;
  for (int k : {1, 2}) subs.push_back(world.split(world.rank() < k ? 0 : 1, world.rank()));
  subs.push_back(world.split(0, world.rank()));
  return subs;
}

/// Runs body(sub) on every communicator of all_sizes(world), failing on this rank's errors.
template <class F>
void on_all_sizes(communicator& world, F&& body) {
  for (communicator& c : all_sizes(world)) {
    CAPTURE(c.size());
    ft::on_this_rank([&] { body(c); });
  }
}

/// Bits of precision of T's significand.
template <class T>
constexpr int precision_bits() {
  if constexpr (std::is_same_v<T, double>)
    return 53;
  else if constexpr (std::is_same_v<T, float>)
    return 24;
  else if constexpr (std::is_same_v<T, fedshard::f16>)
    return 11;
  else
    return 8;
}

/// One all_reduce or reduce_scatter with reduction::mpi on c, checked against the rank-order
/// reference: NaN where an input is NaN, the same value for min and max (a zero's sign aside),
/// within (n + 1) roundings of the sum of magnitudes for sum and avg.
template <class T>
void check_mpi_reduction(communicator& c, ft::coll kind, reduce_op op, std::int64_t count,
                         bool in_place, std::uint64_t seed) {
  using A = decltype(fedshard::to_accum(T{}));
  const int n = c.size();
  const int me = c.rank();
  const bool scatter = kind == ft::coll::reduce_scatter;
  const std::int64_t in_len = scatter ? count * n : count;
  std::vector<T> in(static_cast<std::size_t>(in_len) + 1);
  for (std::int64_t i = 0; i < in_len; ++i) in[i] = ft::input_value<T>(seed, me, i);
  std::vector<T> out(static_cast<std::size_t>(count) + 1);
  T* o = in_place ? (scatter ? in.data() + count * me : in.data()) : out.data();
  const dtype t = fedshard::dtype_of<T>;
  if (scatter)
    c.reduce_scatter(in.data(), o, count, t, op);
  else
    c.all_reduce(in.data(), o, count, t, op);
  const double eps = std::ldexp(1.0, -precision_bits<T>());
  for (std::int64_t i = 0; i < count; ++i) {
    const std::int64_t element = scatter ? count * me + i : i;
    bool any_nan = false;
    double magnitude = 0;
    const T want = ft::reference_reduce<T>(op, n, [&](int p) {
      const T v = ft::input_value<T>(seed, p, element);
      any_nan = any_nan || ft::is_nan(v);
      magnitude += std::abs(static_cast<double>(fedshard::to_accum(v)));
      return v;
    });
    const A got = fedshard::to_accum(o[i]);
    const A ref = fedshard::to_accum(want);
    CAPTURE(i);
    CAPTURE(static_cast<double>(got));
    CAPTURE(static_cast<double>(ref));
    if (any_nan || ref != ref) {
      CHECK(got != got);
    } else if (op == reduce_op::min || op == reduce_op::max || std::isinf(ref)) {
      CHECK(got == ref);
    } else {
      const double scale = op == reduce_op::avg ? magnitude / n : magnitude;
      CHECK(std::abs(static_cast<double>(got) - static_cast<double>(ref)) <=
            eps * (n + 1) * scale + 1e-7);
    }
  }
}

}  // namespace

static_assert(fedshard::Communicator<communicator>);

TYPE_TO_STRING_AS("mpi, checked", mpi_checked);
TYPE_TO_STRING_AS("mpi, unchecked", mpi_unchecked);
FEDSHARD_COMM_TESTS(mpi_checked, mpi_unchecked)
FEDSHARD_COMM_CHECKED_TESTS(mpi_checked)

TEST_CASE("mpi: ranks and sizes are MPI's; a communicator can be built from any MPI_Comm") {
  communicator world = communicator::world(ft::mpi_options());
  CHECK(world.rank() == ft::world_rank());
  CHECK(world.size() == ft::world_size());
  CHECK(world.world_rank() == ft::world_rank());
  MPI_Comm halves = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, ft::world_rank() % 2, -ft::world_rank(), &halves);
  {
    communicator half(halves, ft::mpi_options());
    int r = 0;
    int n = 0;
    MPI_Comm_rank(halves, &r);
    MPI_Comm_size(halves, &n);
    CHECK(half.rank() == r);
    CHECK(half.size() == n);
    ft::on_this_rank([&] { ft::check_usable(half, 1); });
  }
  MPI_Comm_free(&halves);
  CHECK_THROWS_AS(communicator(MPI_COMM_NULL), fedshard::invalid_argument);
}

TEST_CASE("mpi: both all_reduce algorithms, gather-all and reduce-scatter + all-gather") {
  for (std::int64_t small : {std::int64_t{0}, std::int64_t{1} << 30}) {
    CAPTURE(small);
    auto opt = ft::mpi_options(false);
    opt.small_all_reduce_bytes = small;
    communicator world = communicator::world(opt);
    on_all_sizes(world, [](communicator& c) {
      ft::run_cases(c, ft::case_grid(ft::coll::all_reduce, c.size(), ft::small_counts, 150));
    });
  }
}

TEST_CASE("mpi: moved() counts what is handed to MPI for the algorithm used (4 ranks)") {
  if (ft::world_size() != 4) return;
  const int me = ft::world_rank();
  std::vector<float> x(1000, 1.0f), y(4000);
  SUBCASE("a small all_reduce gathers every input") {
    communicator world = communicator::world(ft::mpi_options());
    CHECK(world.algorithm_of(fedshard::collective::all_reduce, 1000, dtype::f32) ==
          fedshard::wire_algorithm::gather_all);  // 4 x 4000 B <= 64 KiB
    const fedshard::moved_bytes before = world.moved();
    world.all_reduce(x.data(), x.data(), 1000, dtype::f32, reduce_op::sum);
    // its 4000 B to 3 ranks and theirs to it: 12000 B each way, not a ring's 6000
    CHECK(world.moved() - before == fedshard::moved_bytes{12000, 12000});
    CHECK(x[0] == 4.0f);
  }
  SUBCASE("a large one reduces chunks where they belong: a ring's bytes") {
    auto opt = ft::mpi_options();
    opt.small_all_reduce_bytes = 0;
    communicator world = communicator::world(opt);
    CHECK(world.algorithm_of(fedshard::collective::all_reduce, 1000, dtype::f32) ==
          fedshard::wire_algorithm::ring);
    world.all_reduce(x.data(), x.data(), 1000, dtype::f32, reduce_op::sum);
    // chunks of 256, 256, 256, 232 f32: (4000 - c) + 3 c = 4000 + 2 c
    const std::int64_t b = me < 3 ? 6048 : 5856;
    CHECK(world.moved() == fedshard::moved_bytes{b, b});
    // all_gather of 1000 f32 per rank and reduce_scatter of blocks of 1000: 3 x 4000 each way
    world.all_gather(x.data(), y.data(), 1000, dtype::f32);
    world.reduce_scatter(y.data(), x.data(), 1000, dtype::f32, reduce_op::sum);
    // broadcast of 4000 B from rank 1, and a 40-B message from rank 0 to 2
    world.broadcast(x.data(), 1000, dtype::f32, 1);
    if (me == 0) world.send(x.data(), 10, dtype::f32, 2, 5);
    if (me == 2) world.recv(x.data(), 10, dtype::f32, 0, 5);
    const std::int64_t bs = me == 1 ? 12000 : 0, br = me == 1 ? 0 : 4000;
    CHECK(world.moved() == fedshard::moved_bytes{b + 24000 + bs + (me == 0 ? 40 : 0),
                                                 b + 24000 + br + (me == 2 ? 40 : 0)});
  }
}

TEST_CASE("mpi: reduction::mpi reduces through MPI within rounding, min and max exactly") {
  for (std::int64_t max_bytes : {std::int64_t{1} << 30, std::int64_t{40}}) {
    CAPTURE(max_bytes);
    auto opt = ft::mpi_options(max_bytes == 40);
    opt.reduce = fedshard::mpi::reduction::mpi;
    opt.max_message_bytes = max_bytes;
    communicator world = communicator::world(opt);
    on_all_sizes(world, [](communicator& c) {
      std::uint64_t seed = 2000;
      for (ft::coll kind : {ft::coll::all_reduce, ft::coll::reduce_scatter})
        for (dtype t : fedshard::all_dtypes)
          for (reduce_op op : fedshard::all_reduce_ops)
            for (std::int64_t count : {0, 1, 7, 61, 1000})
              for (bool in_place : {false, true}) {
                CAPTURE(ft::to_string(kind));
                CAPTURE(fedshard::to_string(t));
                CAPTURE(fedshard::to_string(op));
                CAPTURE(count);
                CAPTURE(in_place);
                fedshard::visit(t, [&](auto tag) {
                  using T = typename decltype(tag)::type;
                  check_mpi_reduction<T>(c, kind, op, count, in_place, seed++);
                });
              }
      // The other collectives are unchanged by the option.
      ft::run_cases(c, ft::case_grid(ft::coll::all_gather, c.size(), ft::small_counts, 2500));
    });
  }
}

TEST_CASE("mpi: messages cut into pieces at max_message_bytes give the same results") {
  for (std::int64_t max_bytes : {1, 1000}) {
    CAPTURE(max_bytes);
    auto opt = ft::mpi_options(max_bytes == 1);
    opt.max_message_bytes = max_bytes;
    opt.small_all_reduce_bytes = 0;
    communicator world = communicator::world(opt);
    constexpr std::int64_t counts[] = {0, 1, 7, 61};
    constexpr std::int64_t more_counts[] = {0, 1, 61, 1000};
    const auto& cs = max_bytes == 1 ? counts : more_counts;
    on_all_sizes(world, [&](communicator& c) {
      for (ft::coll k : ft::all_colls) ft::run_cases(c, ft::case_grid(k, c.size(), cs, 450));
      for (dtype t : fedshard::all_dtypes) ft::check_ring(c, t, 61, 460, 3);
      ft::check_message_order(c, 3, 61, 470);
    });
  }
}

TEST_CASE("mpi: nobody leaves a barrier before everyone entered") {
  constexpr int rounds = 20;
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  int node_size = 0;
  MPI_Comm_size(node, &node_size);
  int* counters = nullptr;
  MPI_Win win = MPI_WIN_NULL;
  int node_rank = 0;
  MPI_Comm_rank(node, &node_rank);
  MPI_Win_allocate_shared(node_rank == 0 ? static_cast<MPI_Aint>(rounds * sizeof(int)) : 0,
                          sizeof(int), MPI_INFO_NULL, node, &counters, &win);
  MPI_Aint bytes = 0;
  int unit = 0;
  MPI_Win_shared_query(win, 0, &bytes, &unit, &counters);
  if (node_rank == 0)
    for (int r = 0; r < rounds; ++r) std::atomic_ref<int>(counters[r]).store(0);
  MPI_Barrier(node);
  {
    communicator c(node, ft::mpi_options());
    ft::jitter j(static_cast<std::uint64_t>(c.rank() + 1));
    for (int r = 0; r < rounds; ++r) {
      j();
      std::atomic_ref<int>(counters[r]).fetch_add(1);
      c.barrier();
      CHECK(std::atomic_ref<int>(counters[r]).load() == c.size());
    }
    c.barrier_async().wait();
  }
  MPI_Win_free(&win);
  MPI_Comm_free(&node);
}

TEST_CASE("mpi: receives completed out of order still match in order") {
  communicator c = communicator::world(ft::mpi_options(true));
  const int n = c.size();
  const int right = (c.rank() + 1) % n;
  const int left = (c.rank() + n - 1) % n;
  std::vector<float> a(8, static_cast<float>(c.rank()));
  std::vector<float> b(8, static_cast<float>(c.rank() + 100));
  std::vector<float> ra(8, -1.0f);
  std::vector<float> rb(8, -1.0f);
  fedshard::request r1 = c.recv_async(ra.data(), 8, dtype::f32, left, 4);
  fedshard::request r2 = c.recv_async(rb.data(), 8, dtype::f32, left, 4);
  fedshard::request s1 = c.send_async(a.data(), 8, dtype::f32, right, 4);
  fedshard::request s2 = c.send_async(b.data(), 8, dtype::f32, right, 4);
  ft::on_this_rank([&] {
    r2.wait();
    r1.wait();
    s2.wait();
    s1.wait();
  });
  CHECK(ra[0] == static_cast<float>(left));
  CHECK(rb[7] == static_cast<float>(left + 100));
}

TEST_CASE("mpi: ranks that wait in different orders or block on another communicator progress") {
  // All reductions in two stages: a rank must start the second stage of an operation a peer
  // waits for while it waits for something else itself.
  for (bool checked : {false, true}) {
    CAPTURE(checked);
    auto opt = ft::mpi_options(checked, 20.0);
    opt.small_all_reduce_bytes = 0;
    communicator world = communicator::world(opt);
    communicator pair = world.split(world.rank() / 2, world.rank());
    const bool even = world.rank() % 2 == 0;
    std::vector<float> a(1000, 1.0f), b(1000, 1.0f), ra(1000), rb(1000);
    auto on_world = [&] {
      return world.all_reduce_async(a.data(), ra.data(), 1000, dtype::f32, reduce_op::sum);
    };
    auto on_pair = [&] {
      return pair.all_reduce_async(b.data(), rb.data(), 1000, dtype::f32, reduce_op::sum);
    };
    ft::on_this_rank([&] {
      fedshard::request x = on_world();
      fedshard::request y = on_pair();
      if (even) {
        x.wait();
        y.wait();
      } else {
        y.wait();
        x.wait();
      }
    });
    CHECK(ra[999] == static_cast<float>(world.size()));
    CHECK(rb[0] == static_cast<float>(pair.size()));
    ft::on_this_rank([&] {
      fedshard::request z = on_world();
      if (even) {
        on_pair().wait();
        z.wait();
      } else {
        z.wait();
        on_pair().wait();
      }
    });
    ft::on_this_rank([&] {
      fedshard::request z = on_world();
      if (even) {
        communicator s = pair.split(0, 0);
        z.wait();
        ft::check_usable(s, 1050);
      } else {
        z.wait();
        communicator s = pair.split(0, 0);
        ft::check_usable(s, 1050);
      }
    });
  }
}

TEST_CASE("mpi: a communicator destroyed with operations pending completes them first") {
  std::vector<float> in(1000, 1.0f);
  std::vector<float> out(1000, 0.0f);
  fedshard::request r;
  {
    communicator c = communicator::world(ft::mpi_options(false));
    r = c.all_reduce_async(in.data(), out.data(), 1000, dtype::f32, reduce_op::sum);
  }
  CHECK(r.test());
  ft::on_this_rank([&] { r.wait(); });
  CHECK(out[999] == static_cast<float>(ft::world_size()));
}

TEST_CASE("mpi: results are bit-identical on every process and to inproc's") {
  communicator world = communicator::world(ft::mpi_options(false));
  const int n = world.size();
  std::vector<std::uint64_t> mine;
  ft::jitter j(static_cast<std::uint64_t>(world.rank()));
  ft::on_this_rank([&] { mine = ft::deterministic_reductions(world, 1100, j); });
  const std::size_t reduce_results = 16;
  REQUIRE(mine.size() == 2 * reduce_results);
  // all_reduce results are the same on every process.
  const auto all = ft::gather_world(mine);
  for (int p = 0; p < n; ++p)
    for (std::size_t k = 0; k < reduce_results; ++k)
      CHECK(all[static_cast<std::size_t>(p) * mine.size() + k] == mine[k]);
  // The same calls on n inproc ranks give the same bits.
  std::vector<std::vector<std::uint64_t>> inproc(static_cast<std::size_t>(n));
  fedshard::inproc::run(n, [&](fedshard::inproc::communicator& c) {
    ft::jitter j(static_cast<std::uint64_t>(c.rank()));
    inproc[static_cast<std::size_t>(c.rank())] = ft::deterministic_reductions(c, 1100, j);
  });
  CHECK(inproc[static_cast<std::size_t>(world.rank())] == mine);
}

TEST_CASE("mpi: unchecked: invalid arguments throw invalid_argument on the rank that passed them") {
  communicator world = communicator::world(ft::mpi_options(false));
  for (ft::invalid_in what : ft::all_invalid_collective_args) {
    CAPTURE(static_cast<int>(what));
    const ft::outcome o = ft::provoke_invalid(world, what, -1);  // every rank is a culprit
    CAPTURE(o.what);
    CHECK(o.kind == outcome_kind::invalid_argument);
    // split exchanges its arguments in every mode: all ranks name the first culprit.
    const int named = what == ft::invalid_in::split_negative_color ? 0 : world.rank();
    CHECK(contains(o.what, concat("rank ", named, " of ")));
    ft::on_this_rank([&] { ft::check_usable(world, 1350); });
  }
}

TEST_CASE("mpi: a tag outside [0, MPI_TAG_UB] throws invalid_argument at once") {
  for (bool checked : {true, false}) {
    CAPTURE(checked);
    communicator world = communicator::world(ft::mpi_options(checked));
    std::vector<float> b(4);
    CHECK_THROWS_WITH_AS(world.send(b.data(), 4, dtype::f32, 0, -3),
                         doctest::Contains("tag must be in [0, "), fedshard::invalid_argument);
    ft::on_this_rank([&] { ft::check_ring(world, dtype::f32, 7, 1400); });
  }
}

TEST_CASE("mpi: unchecked: a receive of another size throws collective_mismatch on the receiver") {
  communicator world = communicator::world(ft::mpi_options(false));
  for (int recv_count : {5, 11}) {  // shorter (truncated) and longer than the 10 sent
    CAPTURE(recv_count);
    std::vector<float> buf(16);
    const ft::outcome o = ft::capture([&] {
      if (world.rank() == 0) world.send(buf.data(), 10, dtype::f32, 1, 5);
      if (world.rank() == 1) world.recv(buf.data(), recv_count, dtype::f32, 0, 5);
    });
    CAPTURE(o.what);
    CHECK(o.kind == (world.rank() == 1 ? outcome_kind::collective_mismatch : outcome_kind::ok));
    if (world.rank() == 1) CHECK(contains(o.what, concat(recv_count, " x f32")));
    ft::on_this_rank([&] { ft::check_ring(world, dtype::f32, 61, 1550); });
  }
}

TEST_CASE("mpi: an operation a rank joins too late throws timeout_error naming it") {
  const ft::wait_point points[] = {ft::wait_point::all_reduce, ft::wait_point::recv,
                                   ft::wait_point::all_reduce_async, ft::wait_point::barrier,
                                   ft::wait_point::broadcast};
  for (bool checked : {false, true})
    for (ft::wait_point w : points) {
      CAPTURE(checked);
      CAPTURE(ft::to_string(w));
      // The buffers outlive the communicator: MPI may write them until the operation completes.
      std::vector<float> in(32, 1.0f);
      const bool late = ft::world_rank() == ft::world_size() - 1;
      std::vector<float> out(32, late ? 5.0f : 0.0f);
      ft::outcome seen;
      {
        communicator c = communicator::world(ft::mpi_options(checked, 0.3));
        const int straggler = c.size() - 1;
        auto call = [&] {
          return ft::capture([&] {
            switch (w) {
              case ft::wait_point::all_reduce:
                c.all_reduce(in.data(), out.data(), 8, dtype::f32, reduce_op::sum);
                return;
              case ft::wait_point::all_reduce_async:
                c.all_reduce_async(in.data(), out.data(), 8, dtype::f32, reduce_op::sum).wait();
                return;
              case ft::wait_point::barrier: c.barrier(); return;
              case ft::wait_point::broadcast:
                c.broadcast(out.data(), 8, dtype::f32, straggler);
                return;
              case ft::wait_point::recv:
                if (c.rank() != straggler) c.recv(out.data(), 8, dtype::f32, straggler, 0);
                for (int p = 0; c.rank() == straggler && p < straggler; ++p)
                  c.send(in.data(), 8, dtype::f32, p, 0);
                return;
              default: return;
            }
          });
        };
        if (c.rank() != straggler) seen = call();
        MPI_Barrier(MPI_COMM_WORLD);  // the others timed out
        // The straggler joins late: what the others started completes while they drain the
        // communicator in its destructor.
        if (c.rank() == straggler) seen = call();
        CAPTURE(seen.what);
        if (c.rank() == straggler) {
          CHECK(seen.kind == outcome_kind::ok);
        } else {
          CHECK(seen.kind == outcome_kind::timeout_error);
          const std::string name =
              w == ft::wait_point::all_reduce_async ? "all_reduce" : std::string(ft::to_string(w));
          CHECK(contains(seen.what, name));
          CHECK(contains(seen.what, "did not complete within 0.3 s"));
          // The communicator is unusable from now on.
          std::vector<float> x(4);
          CHECK_THROWS_WITH_AS(c.all_reduce(x.data(), x.data(), 4, dtype::f32, reduce_op::sum),
                               doctest::Contains("unusable"), fedshard::backend_error);
        }
      }
      // The late operations completed: their results are there.
      const bool reduced = w == ft::wait_point::all_reduce || w == ft::wait_point::all_reduce_async;
      if (reduced) CHECK(out[7] == static_cast<float>(ft::world_size()));
      if (w == ft::wait_point::broadcast) CHECK(out[7] == 5.0f);
      if (w == ft::wait_point::recv) CHECK(out[7] == (late ? 5.0f : 1.0f));
      MPI_Barrier(MPI_COMM_WORLD);
    }
}

TEST_CASE("mpi: options come from FEDSHARD_TIMEOUT_S and FEDSHARD_MPI_CHECKED") {
  scoped_env timeout("FEDSHARD_TIMEOUT_S", nullptr);
  scoped_env checked("FEDSHARD_MPI_CHECKED", nullptr);
  CHECK(fedshard::mpi::options{}.timeout.count() == 300.0);
#ifdef NDEBUG
  CHECK_FALSE(fedshard::mpi::options{}.checked);
#else
  CHECK(fedshard::mpi::options{}.checked);
#endif
  timeout.set("2.5");
  CHECK(fedshard::mpi::options{}.timeout.count() == 2.5);
  checked.set("1");
  CHECK(fedshard::mpi::options{}.checked);
  checked.set("0");
  CHECK_FALSE(fedshard::mpi::options{}.checked);
  for (const char* ignored : {"", "junk", "0", "-4"}) {
    CAPTURE(ignored);
    timeout.set(ignored);
    CHECK(fedshard::mpi::options{}.timeout.count() == 300.0);
  }
}

TEST_CASE("mpi: ranks that pass different options are told so on every rank") {
  auto opt = ft::mpi_options(true);
  if (ft::world_rank() == 2) opt.max_message_bytes = 4096;
  CHECK_THROWS_WITH_AS(communicator::world(opt), doctest::Contains("max_message_bytes=4096"),
                       fedshard::invalid_argument);
  auto bad = ft::mpi_options(true);
  bad.max_message_bytes = 0;
  CHECK_THROWS_AS(communicator::world(bad), fedshard::invalid_argument);
  bad = ft::mpi_options(true, 0.0);
  CHECK_THROWS_AS(communicator::world(bad), fedshard::invalid_argument);
  ft::on_this_rank([] {
    communicator c = communicator::world(ft::mpi_options());
    ft::check_usable(c, 1700);
  });
}

TEST_CASE("mpi: MPI error codes become backend_error with MPI's error string") {
  const std::string text = fedshard::mpi::detail::error_string(MPI_ERR_COUNT);
  CHECK_FALSE(text.empty());
  CHECK_THROWS_WITH_AS(fedshard::mpi::detail::check(MPI_ERR_COUNT, "MPI_Something", 1, 4),
                       doctest::Contains(("MPI_Something failed on rank 1 of 4: " + text).c_str()),
                       fedshard::backend_error);
  CHECK_NOTHROW(fedshard::mpi::detail::check(MPI_SUCCESS, "MPI_Something"));
}

TEST_CASE("mpi: the environment reports MPI's thread support; a nested one does not own MPI") {
  fedshard::mpi::environment nested;
  CHECK_FALSE(nested.owns_mpi());
  CHECK(nested.provided() >= fedshard::mpi::thread_level::funneled);
  CHECK_THROWS_AS(fedshard::mpi::environment(fedshard::mpi::thread_level::multiple),
                  fedshard::backend_error);
}
