/// The main() of the MPI test executables: every rank of the job runs the same doctest session
/// (the test cases in the same order, so their collectives match). Rank 0 prints to stdout;
/// the other ranks' reports are collected and printed by rank 0 with a "[rank r]" prefix when
/// they failed. Every rank exits with 1 when a test failed on any rank.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "fedshard/comm/mpi.hpp"

namespace {

/// Rank 0 prints every failing rank's report, each line prefixed with its rank.
void print_failed_reports(const std::string& report, bool failed, int rank, int size) {
  const std::string mine = failed ? report : std::string();
  const int len = static_cast<int>(mine.size());
  std::vector<int> lens(static_cast<std::size_t>(size));
  MPI_Gather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  std::vector<int> displs(static_cast<std::size_t>(size));
  int total = 0;
  for (int p = 0; p < size; ++p) {
    displs[static_cast<std::size_t>(p)] = total;
    total += lens[static_cast<std::size_t>(p)];
  }
  std::string all(static_cast<std::size_t>(total), '\0');
  MPI_Gatherv(mine.data(), len, MPI_CHAR, all.data(), lens.data(), displs.data(), MPI_CHAR, 0,
              MPI_COMM_WORLD);
  if (rank != 0) return;
  for (int p = 1; p < size; ++p) {
    std::istringstream lines(
        all.substr(static_cast<std::size_t>(displs[static_cast<std::size_t>(p)]),
                   static_cast<std::size_t>(lens[static_cast<std::size_t>(p)])));
    for (std::string line; std::getline(lines, line);)
      std::printf("[rank %d] %s\n", p, line.c_str());
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  fedshard::mpi::environment env(argc, argv);
  int rank = 0;
  int size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);

  doctest::Context context;
  context.applyCommandLine(argc, argv);
  std::ostringstream report;
  if (rank != 0) {
    context.setOption("minimal", true);  // only failures
    context.setCout(&report);
  }
  const int result = context.run();
  const bool failed = result != 0;

  print_failed_reports(report.str(), failed, rank, size);
  int mine = failed ? 1 : 0;
  int any = 0;
  MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && any != 0 && !failed)
    std::printf("fedshard: tests failed on another rank (see the [rank r] lines above)\n");
  return any;
}
