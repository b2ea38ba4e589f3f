/// What a sub-communicator costs with Open MPI, next to the raw MPI call: bench_split's rows
/// for the MPI backend. Run under mpirun (one process per rank); rank 0 prints one CSV line
/// per row:
///   impl,row,ranks,calls,us_per_call
/// Rows:
/// - mpi,comm_split: MPI_Comm_split(world, rank % 2, rank) then MPI_Comm_free: the raw
///   creation cost.
/// - fedshard,split: fedshard::mpi::communicator::split(rank % 2, rank), destroyed before the
///   next call (it exchanges and checks the arguments, then splits its three communicators:
///   calls, nonblocking calls, control messages).
/// - fedshard,split_members_cached: interpreter::split_members on the federation axis of a
///   ranks x 1 x 1 mesh with a set made before: the cost every later op among those groups
///   pays (no communication).
/// Each row: a barrier, `calls` calls timed by rank 0 up to a barrier after them, the fastest
/// of --repetitions (default 3) such runs. Options: --calls=N (default 200).

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string_view>

#include "fedshard/comm/mpi.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/interpreter.hpp"

namespace {

using fedshard::mpi::communicator;

/// The fastest of `repetitions` runs of `calls` calls of f, in seconds per call (rank 0's
/// clock between barriers).
template <class F>
double fastest(int repetitions, int calls, F f) {
  double best = std::numeric_limits<double>::infinity();
  for (int r = 0; r < repetitions; ++r) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) f();
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count() / calls);
  }
  return best;
}

int parse_int(std::string_view arg, std::string_view flag, int fallback) {
  if (arg.substr(0, flag.size()) != flag) return fallback;
  return std::atoi(std::string(arg.substr(flag.size())).c_str());
}

}  // namespace

int main(int argc, char** argv) {
  fedshard::mpi::environment env(argc, argv);
  int calls = 200;
  int repetitions = 3;
  for (int i = 1; i < argc; ++i) {
    calls = parse_int(argv[i], "--calls=", calls);
    repetitions = parse_int(argv[i], "--repetitions=", repetitions);
  }
  if (calls < 1 || repetitions < 1) {
    std::fprintf(stderr, "bench_split_mpi: --calls and --repetitions must be >= 1\n");
    return 2;
  }
  int rank = 0;
  int size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);

  const double raw = fastest(repetitions, calls, [&] {
    MPI_Comm sub = MPI_COMM_NULL;
    MPI_Comm_split(MPI_COMM_WORLD, rank % 2, rank, &sub);
    MPI_Comm_free(&sub);
  });

  communicator world = communicator::world();
  const double ours = fastest(repetitions, calls, [&] {
    communicator sub = world.split(rank % 2, rank);
    (void)sub.size();
  });

  fedshard::mesh<communicator> m(world, {.groups = size, .replicas = 1, .shards = 1});
  fedshard::interpreter<communicator> interp(m);
  const std::uint64_t set = size >= 2 ? (std::uint64_t{1} << size) - 2 : 1;  // all but group 0
  interp.split_members(fedshard::axis::federation, {set});
  const double cached = fastest(repetitions, calls * 100,
                                [&] { interp.split_members(fedshard::axis::federation, {set}); });

  if (rank == 0) {
    std::printf("impl,row,ranks,calls,us_per_call\n");
    std::printf("mpi,comm_split,%d,%d,%.4f\n", size, calls, raw * 1e6);
    std::printf("fedshard,split,%d,%d,%.4f\n", size, calls, ours * 1e6);
    std::printf("fedshard,split_members_cached,%d,%d,%.4f\n", size, calls * 100, cached * 1e6);
  }
  return 0;
}
