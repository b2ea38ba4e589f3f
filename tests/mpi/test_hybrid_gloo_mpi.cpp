/// A hybrid world of MPI inside each group and Gloo between the groups (mpiexec -n 4: 2
/// groups of 2 ranks, each group an MPI sub-communicator, the links Gloo contexts meeting
/// through a file store in a directory rank 0 makes): a trainer on it ends bit-identical to
/// the same run on the plain MPI world, and every axis moved the same bytes.

#include <doctest/doctest.h>
#include <mpi.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "fedshard/comm/gloo.hpp"
#include "fedshard/comm/hybrid.hpp"
#include "fedshard/comm/mpi.hpp"
#include "mpi/mpi_support.hpp"
#include "support/federated_run.hpp"

using namespace fedshard;
namespace ft = fedshard::test;

namespace {

/// Trains A (sync every 3 steps) on the MPI world and on the hybrid world; both end alike.
template <class A>
void check_hybrid_equals_mpi() {
  mpi::communicator world(MPI_COMM_WORLD, ft::mpi_options());
  REQUIRE(world.size() == 4);
  const mesh_shape shape{2, 1, 2};
  const int g = world.rank() / 2, l = world.rank() % 2;
  // A store directory every rank reaches: made by rank 0, its name broadcast.
  char dir[256] = {};
  if (world.rank() == 0) {
    std::string tmpl =
        (std::filesystem::temp_directory_path() / "fedshard-mpi-gloo-XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    std::strncpy(dir, tmpl.c_str(), sizeof dir - 1);
  }
  MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, MPI_COMM_WORLD);
  ft::run_outcome plain, split;
  ft::on_this_rank([&] { plain = ft::train_mlp<A>(world, shape, 9, 3); });
  ft::on_this_rank([&] {
    auto st = std::make_shared<fedshard::gloo::file_store>(dir);
    fedshard::gloo::options o;
    o.timeout = std::chrono::duration<double>(60);
    fedshard::gloo::communicator link(st, "link" + std::to_string(l), g, 2, o);
    hybrid<mpi::communicator, fedshard::gloo::communicator> w(world.split(g, l), std::move(link));
    split = ft::train_mlp<A>(w, shape, 9, 3);
  });
  REQUIRE(plain.params.size() == split.params.size());
  CHECK(std::memcmp(plain.params.data(), split.params.data(), plain.params.size() * 4) == 0);
  CHECK(plain.losses == split.losses);
  CHECK(plain.traffic.same_traffic(split.traffic));
  CHECK(split.syncs == 3);
  world.barrier();
  if (world.rank() == 0) std::filesystem::remove_all(dir);
}

}  // namespace

TEST_CASE("hybrid of mpi groups and gloo links: a trainer ends where the MPI world ends") {
  check_hybrid_equals_mpi<fl_hsdp>();
}

TEST_CASE("gasloc's exchanges run over gloo links as over MPI") {
  check_hybrid_equals_mpi<gasloc>();  // every 3 steps, as train_mlp is told
}
