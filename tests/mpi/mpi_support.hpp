#pragma once
/// Test support for the MPI test executables (tests/mpi/main.cpp runs doctest on every rank).

#include <doctest/doctest.h>
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "fedshard/comm/mpi.hpp"

namespace fedshard::test {

/// Options for tests: checked or not, and a timeout that ends a stuck test in reasonable time.
inline mpi::options mpi_options(bool checked = true, double timeout_s = 60.0) {
  mpi::options o;
  o.checked = checked;
  o.timeout = std::chrono::duration<double>(timeout_s);
  return o;
}

/// Runs body() on this rank and fails the test case (on this rank) with the message of what it
/// threw.
template <class F>
void on_this_rank(F&& body) {
  std::string error;
  try {
    body();
  } catch (const std::exception& e) {
    error = e.what();
  }
  CHECK_MESSAGE(error.empty(), error);
}

/// Every rank's values (the same number on each), in rank order, through MPI_COMM_WORLD.
inline std::vector<std::uint64_t> gather_world(const std::vector<std::uint64_t>& mine) {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<std::uint64_t> all(mine.size() * static_cast<std::size_t>(size));
  MPI_Allgather(mine.data(), static_cast<int>(mine.size()), MPI_UINT64_T, all.data(),
                static_cast<int>(mine.size()), MPI_UINT64_T, MPI_COMM_WORLD);
  return all;
}

/// This process's rank in MPI_COMM_WORLD.
inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

/// The number of processes in MPI_COMM_WORLD.
inline int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

}  // namespace fedshard::test
