// Calibration from measurements: nccl-tests text, Google Benchmark JSON and the MPI bench's
// CSV are read, latency and bus bandwidth are fitted, and price_collective uses them.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/sim/calibrate.hpp"
#include "fedshard/sim/collective_cost.hpp"

#include "support/sim.hpp"

using namespace fedshard;
using namespace fedshard::sim;
using namespace fedshard::test;  // the fixtures of support/sim.hpp

namespace {

/// nccl-tests' output of `perf` (e.g. "all_reduce_perf") on `ranks` GPUs over `hosts` hosts,
/// sizes 8 B to 1 GiB by x2, with times latency + bus_factor S / busbw and a deterministic
/// relative noise within +-2%. header_kind: write the "Collective test starting" line.
std::string synthetic_nccl_tests(const std::string& perf, comm_kind k, int ranks, int hosts,
                                 double latency, double busbw, bool header_kind = true) {
  std::ostringstream os;
  if (header_kind) os << "# Collective test starting: " << perf << "\n";
  os << "# nThread 1 nGpus 1 minBytes 8 maxBytes 1073741824 step: 2(factor) warmup iters: 5 "
        "iters: 20 agg iters: 1 validation: 1 graph: 0\n#\n# Using devices\n";
  for (int r = 0; r < ranks; ++r)
    os << "#  Rank " << r << " Group  0 Pid  " << 4000 + r << " on node-" << r * hosts / ranks
       << " device  " << r % (ranks / hosts) << " [0x07] NVIDIA H100 80GB HBM3\n";
  os << "#\n#                                                              out-of-place           "
        "            in-place\n"
        "#       size         count      type   redop    root     time   algbw   busbw #wrong  "
        "   time   algbw   busbw #wrong\n"
        "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)         "
        "   (us)  (GB/s)  (GB/s)\n";
  int i = 0;
  for (double s = 8; s <= 1073741824.0; s *= 2, ++i) {
    const double noise = 0.02 * std::sin(1.7 * i + 0.3);
    const double t = (latency + bus_factor(k, ranks) * s / busbw) * (1 + noise);
    const double algbw = s / t / 1e9;
    char line[256];
    std::snprintf(line, sizeof line,
                  "%12.0f %12.0f     float     sum      -1 %8.2f %7.2f %7.2f      0 %8.2f %7.2f "
                  "%7.2f      0\n",
                  s, s / 4, t * 1e6, algbw, algbw * bus_factor(k, ranks), t * 1e6 * 1.01, algbw,
                  algbw * bus_factor(k, ranks));
    os << line;
  }
  os << "# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 91.5\n#\n\n";
  return os.str();
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Shaped as bench_collectives --benchmark_out writes it (copied from a real run, shortened),
// plus an aggregate, an errored run and a memcpy case, which are left out.
const char* const benchmark_json = R"({
  "context": {
    "date": "2026-12-03T19:19:59+00:00",
    "host_name": "vm",
    "executable": "/work/build-dev/bench/bench_collectives",
    "num_cpus": 2,
    "caches": [
      {
        "type": "Data",
        "level": 1,
        "size": 49152,
        "num_sharing": 1
      }
    ],
    "load_avg": [0.638672,1.97559,2.31396],
    "library_build_type": "debug"
  },
  "benchmarks": [
    {
      "name": "bm_inproc/all_reduce/bytes:4096/ranks:2/manual_time",
      "family_index": 0,
      "per_family_instance_index": 0,
      "run_name": "bm_inproc/all_reduce/bytes:4096/ranks:2/manual_time",
      "run_type": "iteration",
      "repetitions": 1,
      "repetition_index": 0,
      "threads": 1,
      "iterations": 4046,
      "real_time": 5.5325936727628687e+03,
      "cpu_time": 5.0173010380622856e+00,
      "time_unit": "ns",
      "algbw": 7.4033992775657353e-01,
      "busbw": 7.4033992775657353e-01,
      "bytes_per_second": 7.4033992775662088e+08
    },
    {
      "name": "bm_inproc/all_reduce/bytes:65536/ranks:2/manual_time",
      "family_index": 0,
      "per_family_instance_index": 1,
      "run_name": "bm_inproc/all_reduce/bytes:65536/ranks:2/manual_time",
      "run_type": "iteration",
      "repetitions": 1,
      "repetition_index": 0,
      "threads": 1,
      "iterations": 1072,
      "real_time": 1.3422576492537142e+04,
      "cpu_time": 5.2322761194023339e+00,
      "time_unit": "ns",
      "algbw": 4.8825201358648789e+00,
      "busbw": 4.8825201358648789e+00,
      "bytes_per_second": 4.8825201358649406e+09
    },
    {
      "name": "bm_inproc/all_reduce/bytes:1048576/ranks:2/manual_time",
      "run_name": "bm_inproc/all_reduce/bytes:1048576/ranks:2/manual_time",
      "run_type": "iteration",
      "iterations": 100,
      "real_time": 1.1e+02,
      "cpu_time": 1.0,
      "time_unit": "us"
    },
    {
      "name": "bm_inproc/all_reduce/bytes:1048576/ranks:2/manual_time_mean",
      "run_name": "bm_inproc/all_reduce/bytes:1048576/ranks:2/manual_time",
      "run_type": "aggregate",
      "aggregate_name": "mean",
      "real_time": 9.9e+09,
      "time_unit": "ns"
    },
    {
      "name": "bm_inproc/all_gather/bytes:4096/ranks:4/manual_time",
      "run_name": "bm_inproc/all_gather/bytes:4096/ranks:4/manual_time",
      "run_type": "iteration",
      "error_occurred": true,
      "error_message": "inproc: rank 3 failed",
      "real_time": 0.0,
      "time_unit": "ns"
    },
    {
      "name": "bm_memcpy/bytes:4096/real_time",
      "run_type": "iteration",
      "real_time": 1.2e+02,
      "time_unit": "ns"
    }
  ]
}
)";

}  // namespace

TEST_CASE(
    "nccl-tests text: 25 us and 180 GB/s are recovered within 5% for all_reduce and all_gather") {
  const double latency = 25e-6, busbw = 180e9;
  for (auto [perf, k] : {std::pair{"all_reduce_perf", comm_kind::all_reduce},
                         std::pair{"all_gather_perf", comm_kind::all_gather}}) {
    CAPTURE(perf);
    std::istringstream in(synthetic_nccl_tests(perf, k, 8, 2, latency, busbw));
    const auto points = parse_nccl_tests(in, "results.txt");
    REQUIRE(points.size() == 28);  // 8 B .. 1 GiB by x2
    CHECK(points.front().kind == k);
    CHECK(points.front().ranks == 8);
    CHECK(points.front().level == level_kind::inter);  // two hosts
    CHECK(points.front().bytes == 8);
    CHECK(points.back().bytes == 1073741824.0);
    CHECK(contains(points.front().source, "results.txt:"));
    const calibration cal = fit_collectives(points);
    REQUIRE(cal.collectives.size() == 1);
    const fitted_collective* f = cal.find(k, level_kind::inter, 8);
    REQUIRE(f != nullptr);
    CHECK(f->latency == doctest::Approx(latency).epsilon(0.05));
    CHECK(f->bus_bandwidth == doctest::Approx(busbw).epsilon(0.05));
    CHECK(f->max_residual < 0.05);
    CHECK(f->rms_residual <= f->max_residual);
    CHECK(f->rms_residual > 0.001);  // the noise is there
    CHECK(f->points.size() == 28);
    std::ostringstream table;
    print_calibration(table, cal);
    CHECK(contains(table.str(), "busbw GB/s"));
    CHECK(contains(table.str(), std::string(to_string(k))));
  }
}

TEST_CASE("nccl-tests text: the kind from the header, else the file name, else an override") {
  const auto text = synthetic_nccl_tests("reduce_scatter_perf", comm_kind::reduce_scatter, 4, 1,
                                         10e-6, 100e9, /*header_kind=*/false);
  {
    std::istringstream in(text);
    const auto p = parse_nccl_tests(in, "/logs/run-3/reduce_scatter_perf.log");
    CHECK(p.front().kind == comm_kind::reduce_scatter);
    CHECK(p.front().ranks == 4);
    CHECK(p.front().level == level_kind::intra);  // one host
  }
  {
    std::istringstream in(text);
    const std::string e = error_of([&] { parse_nccl_tests(in, "out.txt"); });
    CHECK(contains(e, "out.txt"));
    CHECK(contains(e, "cannot tell which collective"));
  }
  {
    std::istringstream in(text);
    const auto p = parse_nccl_tests(
        in, "out.txt", {.kind = comm_kind::broadcast, .ranks = 16, .level = level_kind::wan});
    CHECK(p.front().kind == comm_kind::broadcast);
    CHECK(p.front().ranks == 16);
    CHECK(p.front().level == level_kind::wan);
  }
  {
    // The header wins over the file name.
    std::istringstream in(
        synthetic_nccl_tests("broadcast_perf", comm_kind::broadcast, 2, 1, 10e-6, 100e9));
    CHECK(parse_nccl_tests(in, "all_reduce_perf.txt").front().kind == comm_kind::broadcast);
  }
  CHECK(parse_level_kind("intra") == level_kind::intra);
  CHECK(parse_level_kind("inter") == level_kind::inter);
  CHECK(parse_level_kind("wan") == level_kind::wan);
  CHECK(contains(error_of([] { parse_level_kind("pcie"); }), "expected intra, inter or wan"));
  CHECK(parse_measured_kind("reduce_scatter") == comm_kind::reduce_scatter);
  CHECK(contains(error_of([] { parse_measured_kind("alltoall"); }),
                 "expected all_reduce, all_gather, reduce_scatter or broadcast"));
}

TEST_CASE("nccl-tests text: old layout without redop and root columns, log lines skipped") {
  std::istringstream in(
      "# Collective test starting: all_gather_perf\n"
      "#  Rank  0 Pid  100 on a device  0 [0x07] A100\n"
      "#  Rank  1 Pid  101 on a device  1 [0x0b] A100\n"
      "#       size         count      type     time   algbw   busbw  error     time   algbw   "
      "busbw  error\n"
      "a:100:100 [0] NCCL INFO Launch mode Parallel\n"
      "        1024           128     float    20.00    0.05    0.03  0e+00    20.00    0.05    "
      "0.03  0e+00\n"
      "     1048576        131072     float    70.00   14.98    7.49  0e+00    70.00   14.98    "
      "7.49  0e+00\n");
  const auto p = parse_nccl_tests(in, "old.txt");
  REQUIRE(p.size() == 2);
  CHECK(p[0].seconds == doctest::Approx(20e-6));
  CHECK(p[1].seconds == doctest::Approx(70e-6));
  CHECK(p[1].bytes == 1048576);
  const auto cal = fit_collectives(p);
  CHECK(cal.collectives.at(0).max_residual < 1e-9);  // two points, two constants
}

TEST_CASE("malformed nccl-tests rows name the file, the line and what was expected") {
  const std::string head =
      "# Collective test starting: all_reduce_perf\n"
      "#  Rank  0 Group  0 Pid  1 on h device  0 [0x07] A100\n"
      "#  Rank  1 Group  0 Pid  2 on h device  1 [0x0b] A100\n";
  {
    std::istringstream in(head + "1024 256 float sum -1 abc 1.0 1.0 0 1.0 1.0 1.0 0\n");
    const std::string e = error_of([&] { parse_nccl_tests(in, "bad.txt"); });
    CHECK(contains(e, "bad.txt:4"));
    CHECK(contains(e, "expected the out-of-place time"));
    CHECK(contains(e, "'abc'"));
  }
  {
    std::istringstream in(head + "1024 256 float sum\n");
    const std::string e = error_of([&] { parse_nccl_tests(in, "bad.txt"); });
    CHECK(contains(e, "bad.txt:4"));
    CHECK(contains(e, "expected a data row of at least 8 columns"));
  }
  {
    std::istringstream in(head + "10.5 256 float sum -1 20.0 1.0 1.0 0\n");
    const std::string e = error_of([&] { parse_nccl_tests(in, "bad.txt"); });
    CHECK(contains(e, "bad.txt:4"));
    CHECK(contains(e, "size in bytes"));
  }
  {
    std::istringstream in(head);
    CHECK(contains(error_of([&] { parse_nccl_tests(in, "empty.txt"); }),
                   "empty.txt: expected nccl-tests data rows"));
  }
  {
    std::istringstream in(
        "# Collective test starting: all_reduce_perf\n"
        "1024 256 float sum -1 20.0 1.0 1.0 0\n"
        "2048 512 float sum -1 21.0 1.0 1.0 0\n");
    const std::string e = error_of([&] { parse_nccl_tests(in, "norank.txt"); });
    CHECK(contains(e, "norank.txt"));
    CHECK(contains(e, "Rank N"));
    CHECK(contains(e, "give the rank count explicitly"));
  }
  {
    std::istringstream in("# Collective test starting: alltoall_perf\n");
    const std::string e = error_of([&] { parse_nccl_tests(in, "a2a.txt"); });
    CHECK(contains(e, "a2a.txt:1"));
    CHECK(contains(e, "alltoall_perf"));
  }
}

TEST_CASE("Google Benchmark JSON of bench_collectives parses and fits") {
  std::istringstream in(benchmark_json);
  const auto p = parse_benchmark_json(in, "bench.json");
  REQUIRE(p.size() == 3);  // aggregate, errored run and memcpy left out
  for (const auto& x : p) {
    CHECK(x.kind == comm_kind::all_reduce);
    CHECK(x.ranks == 2);
    CHECK(x.level == level_kind::intra);
  }
  CHECK(p[0].bytes == 4096);
  CHECK(p[0].seconds == doctest::Approx(5.5325936727628687e-6));
  CHECK(p[2].seconds == doctest::Approx(110e-6));  // time_unit us
  CHECK(contains(p[1].source, "bench.json: bm_inproc/all_reduce/bytes:65536/ranks:2"));
  const calibration cal = fit_collectives(p);
  REQUIRE(cal.collectives.size() == 1);
  const auto& f = cal.collectives[0];
  CHECK(f.latency > 0);
  CHECK(f.bus_bandwidth > 1e9);
  CHECK(f.bus_bandwidth < 100e9);
  std::ostringstream table;
  print_calibration(table, cal);
  CHECK(contains(table.str(), "bm_inproc/all_reduce/bytes:65536"));  // every point, small set

  std::istringstream inter(benchmark_json);
  CHECK(parse_benchmark_json(inter, "b.json", level_kind::inter).front().level ==
        level_kind::inter);
}

TEST_CASE("malformed benchmark JSON and CSV name the file, the line and what was expected") {
  {
    std::istringstream in("{\n  \"benchmarks\": [\n    {\"name\": \"x\",}\n  ]\n}\n");
    const std::string e = error_of([&] { parse_benchmark_json(in, "b.json"); });
    CHECK(contains(e, "b.json:3"));
    CHECK(contains(e, "expected a member name"));
  }
  {
    std::istringstream in("{\"context\": {}}");
    CHECK(contains(error_of([&] { parse_benchmark_json(in, "b.json"); }),
                   "expected Google Benchmark JSON"));
  }
  {
    std::istringstream in(
        "{\"benchmarks\": [\n{\"name\": \"bm_inproc/all_gather/bytes:64/manual_time\", "
        "\"real_time\": 1, \"time_unit\": \"ns\"}]}");
    const std::string e = error_of([&] { parse_benchmark_json(in, "b.json"); });
    CHECK(contains(e, "b.json:2"));
    CHECK(contains(e, "'ranks:n'"));
  }
  {
    std::istringstream in(
        "{\"benchmarks\": [{\"name\": \"bm_inproc/all_gather/bytes:64/ranks:2\", "
        "\"real_time\": 1, \"time_unit\": \"fortnights\"}]}");
    CHECK(contains(error_of([&] { parse_benchmark_json(in, "b.json"); }),
                   "expected \"time_unit\" ns, us, ms or s"));
  }
  {
    std::istringstream in(
        "impl,op,bytes,ranks,iters,seconds_per_iter,algbw_GBps,busbw_GBps\n"
        "mpi,all_reduce,4096,2,1000,1.0e-05,0.4,0.4\n"
        "mpi,all_reduce,65536,2,1000,oops,4.0,4.0\n");
    const std::string e = error_of([&] { parse_benchmark_csv(in, "mpi.csv"); });
    CHECK(contains(e, "mpi.csv:3"));
    CHECK(contains(e, "seconds_per_iter > 0"));
  }
}

TEST_CASE("bench_collectives_mpi's CSV parses and fits") {
  std::istringstream in(
      "impl,op,bytes,ranks,iters,seconds_per_iter,algbw_GBps,busbw_GBps\n"
      "mpi,all_gather,4096,4,1000,2.0e-05,0.2,0.15\n"
      "mpi,all_gather,4194304,4,100,5.0e-04,8.4,6.3\n"
      "mpi,all_gather,67108864,4,10,8.0e-03,8.4,6.3\n");
  const auto p = parse_benchmark_csv(in, "mpi.csv");
  REQUIRE(p.size() == 3);
  CHECK(p[0].kind == comm_kind::all_gather);
  CHECK(p[0].ranks == 4);
  CHECK(p[2].seconds == 8e-3);
  CHECK(fit_collectives(p).collectives.size() == 1);
}

TEST_CASE("fits need two distinct sizes, keep latency >= 0 and report residuals") {
  const auto point = [](double bytes, double seconds) {
    return measured_point{.kind = comm_kind::all_reduce,
                          .ranks = 2,
                          .level = level_kind::intra,
                          .bytes = bytes,
                          .seconds = seconds,
                          .source = "p"};
  };
  const std::string e = error_of([&] { fit_collectives({point(1024, 1e-5), point(1024, 2e-5)}); });
  CHECK(contains(e, "all_reduce over 2 ranks (nvlink)"));
  CHECK(contains(e, ">= 2 distinct sizes"));
  CHECK(contains(e, "found 1"));

  // Times that grow faster than linearly from 0 make the free intercept negative.
  const auto cal = fit_collectives({point(1e3, 1e-7), point(1e6, 1e-3), point(1e7, 1.2e-2)});
  const auto& f = cal.collectives.at(0);
  CHECK(f.latency_clamped);
  CHECK(f.latency == 0);
  CHECK(f.bus_bandwidth > 0);
  CHECK(f.points.at(0).model == doctest::Approx(f.seconds(1e3)));

  CHECK(contains(error_of([&] {
                   fit_collectives({point(1e3, 1e-3), point(1e6, 1e-4)});
                 }),
                 "expected times that grow with the size"));

  // Exact data: exact constants, zero residuals.
  const double lat = 7e-6, bw = 50e9, bf = bus_factor(comm_kind::all_reduce, 2);
  std::vector<measured_point> exact;
  for (double s = 64; s <= 1 << 30; s *= 8) exact.push_back(point(s, lat + bf * s / bw));
  const fitted_collective g = fit_collectives(exact).collectives.at(0);
  CHECK(g.latency == doctest::Approx(lat).epsilon(1e-9));
  CHECK(g.bus_bandwidth == doctest::Approx(bw).epsilon(1e-9));
  CHECK(g.max_residual < 1e-9);
}

TEST_CASE("price_collective with measured constants") {
  calibration cal;
  cal.collectives.push_back({.kind = comm_kind::all_reduce,
                             .ranks = 8,
                             .level = level_kind::intra,
                             .latency = 30e-6,
                             .bus_bandwidth = 200e9});
  cal.collectives.push_back({.kind = comm_kind::all_gather,
                             .ranks = 16,
                             .level = level_kind::inter,
                             .latency = 50e-6,
                             .bus_bandwidth = 40e9});
  const cluster plain = h100_8gpu_node();
  cluster c = plain;
  c.measured = std::make_shared<const calibration>(cal);
  const double S = 3e8;
  const comm_span node{8, 1, 8, 1};
  const comm_span two_nodes{16, 2, 8, 1};

  SUBCASE("a measured (kind, level, ranks): latency + bus_factor S / busbw exactly") {
    for (auto algo :
         {collective_algorithm::best, collective_algorithm::ring, collective_algorithm::tree}) {
      const auto r = price_collective(comm_kind::all_reduce, S, node, {}, c, algo);
      CHECK(r.measured);
      CHECK(r.seconds == 30e-6 + bus_factor(comm_kind::all_reduce, 8) * S / 200e9);
      CHECK(r.latency == 30e-6);
    }
    const auto g = price_collective(comm_kind::all_gather, S, two_nodes, {}, c);
    CHECK(g.measured);
    CHECK(g.seconds == 50e-6 + bus_factor(comm_kind::all_gather, 16) * S / 40e9);
    // Communicators sharing the nodes' NICs share the measured bandwidth.
    const auto shared = price_collective(comm_kind::all_gather, S, two_nodes, {4, 1}, c);
    CHECK(shared.seconds == 50e-6 + bus_factor(comm_kind::all_gather, 16) * S / (40e9 / 4));
    // Inside a node nothing is shared.
    CHECK(price_collective(comm_kind::all_reduce, S, node, {4, 4}, c).seconds ==
          price_collective(comm_kind::all_reduce, S, node, {}, c).seconds);
  }
  SUBCASE("another rank count: busbw as measured, latency scaled by the ring steps") {
    const comm_span four{4, 1, 4, 1};
    const auto r = price_collective(comm_kind::all_reduce, S, four, {}, c);
    CHECK(r.measured);
    const double lat = 30e-6 * (sim::detail::ring_steps(comm_kind::all_reduce, 4) /
                                sim::detail::ring_steps(comm_kind::all_reduce, 8));
    CHECK(r.latency == lat);
    CHECK(r.seconds == lat + bus_factor(comm_kind::all_reduce, 4) * S / 200e9);
    const comm_span many{64, 8, 8, 1};
    const auto g = price_collective(comm_kind::all_gather, S, many, {}, c);
    CHECK(g.measured);
    CHECK(g.latency == 50e-6 * (63.0 / 15.0));
  }
  SUBCASE("unmeasured kinds and levels, and no calibration: the alpha-beta model, bit-equal") {
    const comm_span wide{16, 2, 8, 1};
    for (auto k : {comm_kind::reduce_scatter, comm_kind::broadcast, comm_kind::all_reduce}) {
      const auto with = price_collective(k, S, wide, {2, 1}, c);  // all_reduce: intra only
      const auto without = price_collective(k, S, wide, {2, 1}, plain);
      CHECK_FALSE(with.measured);
      CHECK(with.seconds == without.seconds);
      CHECK(with.latency == without.latency);
      CHECK(with.transfer == without.transfer);
      CHECK(with.algorithm == without.algorithm);
    }
    CHECK_FALSE(price_collective(comm_kind::all_reduce, S, node, {}, plain).measured);
    CHECK(price_collective(comm_kind::all_reduce, S, {1, 1, 1, 1}, {}, c).seconds == 0);
  }
}

TEST_CASE("read_measurements picks the format from the name and the first line") {
  std::string nccl = "all_reduce_perf.out", json = "bench.json", csv = "mpi.out";
  {
    std::ofstream(nccl) << synthetic_nccl_tests("all_reduce_perf", comm_kind::all_reduce, 8, 1,
                                                20e-6, 150e9, false);
    std::ofstream(json) << benchmark_json;
    std::ofstream(csv) << "impl,op,bytes,ranks,iters,seconds_per_iter,algbw_GBps,busbw_GBps\n"
                          "mpi,broadcast,4096,2,1000,1.0e-05,0.4,0.4\n";
  }
  CHECK(read_measurements(nccl).front().kind == comm_kind::all_reduce);
  CHECK(read_measurements(nccl, {.level = level_kind::inter}).front().level == level_kind::inter);
  CHECK(read_measurements(json).size() == 3);
  CHECK(read_measurements(csv).front().kind == comm_kind::broadcast);
  CHECK(contains(error_of([] { read_measurements("no-such-file.txt"); }),
                 "cannot read calibration file 'no-such-file.txt'"));
  std::remove(nccl.c_str());
  std::remove(json.c_str());
  std::remove(csv.c_str());
}
