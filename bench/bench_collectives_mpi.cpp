/// The peer that inproc collectives must beat: raw MPI_Allreduce, MPI_Allgather,
/// MPI_Reduce_scatter_block and MPI_Bcast on float buffers, timed like bench_collectives.
///
/// Run under mpirun (one process per rank). Rank 0 prints one CSV line per case:
///   impl,op,bytes,ranks,iters,seconds_per_iter,algbw_GBps,busbw_GBps
/// where bytes is S, the whole array (nccl-tests convention): the all_reduce and broadcast
/// buffer, the all_gather output, the reduce_scatter input. algbw = S / t in 1e9 bytes/s and
/// busbw = algbw * 2(n-1)/n (all_reduce), * (n-1)/n (all_gather, reduce_scatter), * 1
/// (broadcast).
///
/// Options: --sizes=B1,B2,... (bytes), --ops=all_reduce,all_gather,reduce_scatter,broadcast,
///          --min_time=SECONDS (per timed run, default 0.1), --warmup=N (default 5),
///          --repetitions=N (timed runs per case, default 3; the fastest is reported, as the
///          compare script also does with Google Benchmark's repetitions).

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "fedshard/core/buffer.hpp"

namespace {

struct bench_options {
  std::vector<std::int64_t> sizes = {4 << 10, 16 << 10, 64 << 10, 256 << 10,
                                     1 << 20, 4 << 20,  16 << 20, 64 << 20};
  std::vector<std::string> ops = {"all_reduce", "all_gather", "reduce_scatter", "broadcast"};
  double min_time = 0.1;
  int warmup = 5;
  int repetitions = 3;
};

std::vector<std::string> split_list(std::string_view s) {
  std::vector<std::string> out;
  while (!s.empty()) {
    const auto comma = s.find(',');
    out.emplace_back(s.substr(0, comma));
    if (comma == std::string_view::npos) break;
    s.remove_prefix(comma + 1);
  }
  return out;
}

bench_options parse(int argc, char** argv) {
  bench_options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    const auto value = [&](std::string_view key) -> std::string_view {
      return a.substr(key.size());
    };
    if (a.starts_with("--sizes=")) {
      o.sizes.clear();
      for (const auto& s : split_list(value("--sizes="))) o.sizes.push_back(std::stoll(s));
    } else if (a.starts_with("--ops=")) {
      o.ops = split_list(value("--ops="));
    } else if (a.starts_with("--min_time=")) {
      o.min_time = std::stod(std::string(value("--min_time=")));
    } else if (a.starts_with("--warmup=")) {
      o.warmup = std::stoi(std::string(value("--warmup=")));
    } else if (a.starts_with("--repetitions=")) {
      o.repetitions = std::max(1, std::stoi(std::string(value("--repetitions="))));
    } else {
      throw std::invalid_argument(
          "unknown option '" + std::string(a) +
          "', expected --sizes=, --ops=, --min_time=, --warmup= or --repetitions=");
    }
  }
  return o;
}

double bus_factor(const std::string& op, int n) {
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "all_gather" || op == "reduce_scatter") return static_cast<double>(n - 1) / n;
  return 1.0;
}

/// One collective on S = bytes: the buffers of one rank, allocated and touched up front.
class mpi_case {
 public:
  mpi_case(std::string op, std::int64_t bytes, int ranks, int rank)
      : op_(std::move(op)), ranks_(ranks) {
    const auto whole = static_cast<std::size_t>(bytes) / sizeof(float);
    if (whole % static_cast<std::size_t>(ranks) != 0)
      throw std::invalid_argument("size " + std::to_string(bytes) +
                                  " bytes is not a multiple of ranks * sizeof(float)");
    block_ = whole / static_cast<std::size_t>(ranks);
    if (op_ == "all_reduce") {
      in_ = fedshard::aligned_buffer<float>(whole);
      out_ = fedshard::aligned_buffer<float>(whole);
    } else if (op_ == "all_gather") {
      in_ = fedshard::aligned_buffer<float>(block_);
      out_ = fedshard::aligned_buffer<float>(whole);
    } else if (op_ == "reduce_scatter") {
      in_ = fedshard::aligned_buffer<float>(whole);
      out_ = fedshard::aligned_buffer<float>(block_);
    } else if (op_ == "broadcast") {
      out_ = fedshard::aligned_buffer<float>(whole);
    } else {
      throw std::invalid_argument(
          "unknown op '" + op_ + "', expected all_reduce, all_gather, reduce_scatter or broadcast");
    }
    std::fill(in_.begin(), in_.end(), static_cast<float>(rank + 1));
    std::fill(out_.begin(), out_.end(), 0.0f);
  }

  void run_once() {
    const int count = static_cast<int>(block_);
    const int whole = static_cast<int>(block_ * static_cast<std::size_t>(ranks_));
    if (op_ == "all_reduce")
      MPI_Allreduce(in_.data(), out_.data(), whole, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    else if (op_ == "all_gather")
      MPI_Allgather(in_.data(), count, MPI_FLOAT, out_.data(), count, MPI_FLOAT, MPI_COMM_WORLD);
    else if (op_ == "reduce_scatter")
      MPI_Reduce_scatter_block(in_.data(), out_.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    else
      MPI_Bcast(out_.data(), whole, MPI_FLOAT, 0, MPI_COMM_WORLD);
  }

  /// Seconds for iters back-to-back calls, from a barrier before to a barrier after (so the
  /// slowest rank's completion is included), as seen by rank 0 and shared with all ranks.
  double time(std::int64_t iters) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    for (std::int64_t i = 0; i < iters; ++i) run_once();
    MPI_Barrier(MPI_COMM_WORLD);
    double elapsed = MPI_Wtime() - t0;
    MPI_Bcast(&elapsed, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    return elapsed;
  }

 private:
  std::string op_;
  int ranks_;
  std::size_t block_ = 0;
  fedshard::aligned_buffer<float> in_;
  fedshard::aligned_buffer<float> out_;
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  int ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  int rc = 0;
  try {
    const bench_options opt = parse(argc, argv);
    if (rank == 0)
      std::printf("impl,op,bytes,ranks,iters,seconds_per_iter,algbw_GBps,busbw_GBps\n");
    for (const auto& op : opt.ops) {
      for (const std::int64_t bytes : opt.sizes) {
        mpi_case c(op, bytes, ranks, rank);
        for (int i = 0; i < opt.warmup; ++i) c.run_once();
        // Grow the iteration count (as Google Benchmark does) until one timed run lasts
        // min_time; that run and repetitions - 1 more of the same length are the measurement.
        std::int64_t iters = 1;
        double elapsed = c.time(iters);
        while (elapsed < opt.min_time && iters < (std::int64_t{1} << 30)) {
          const double per = std::max(elapsed / static_cast<double>(iters), 1e-9);
          const auto want = static_cast<std::int64_t>(1.4 * opt.min_time / per) + 1;
          iters = std::clamp(want, iters + 1, iters * 10);
          elapsed = c.time(iters);
        }
        for (int r = 1; r < opt.repetitions; ++r) elapsed = std::min(elapsed, c.time(iters));
        const double t = elapsed / static_cast<double>(iters);
        const double algbw = static_cast<double>(bytes) / t / 1e9;
        if (rank == 0)
          std::printf("mpi,%s,%lld,%d,%lld,%.9e,%.4f,%.4f\n", op.c_str(),
                      static_cast<long long>(bytes), ranks, static_cast<long long>(iters), t, algbw,
                      algbw * bus_factor(op, ranks));
        std::fflush(stdout);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_collectives_mpi (rank %d): %s\n", rank, e.what());
    rc = 1;
  }
  if (rc != 0) MPI_Abort(MPI_COMM_WORLD, rc);
  MPI_Finalize();
  return rc;
}
