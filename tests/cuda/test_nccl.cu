#include "fedshard/cuda/nccl.cuh"

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/cuda/device_buffer.cuh"
#include "fedshard/error.hpp"

namespace {

namespace gpu = fedshard::gpu;
namespace nccl = fedshard::nccl;
using fedshard::bf16;
using fedshard::dtype;
using fedshard::f16;
using fedshard::reduce_op;

static_assert(fedshard::Communicator<nccl::communicator>);

template <class T>
std::uint64_t bits_of(T x) {
  std::uint64_t u = 0;
  std::memcpy(&u, &x, sizeof(T));
  return u;
}

template <class T>
void require_bits(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    if (bits_of(got[i]) != bits_of(want[i]))
      FAIL(what << ": element " << i << " has bits 0x" << std::hex << bits_of(got[i])
                << ", expected 0x" << bits_of(want[i]));
}

template <class T>
std::vector<T> random_values(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> value(-100.0, 100.0);
  std::vector<T> v(n);
  for (T& x : v) x = fedshard::from_accum<T>(value(rng));
  return v;
}

/// The communicator of one rank on device 0 (ncclCommInitAll with one device).
nccl::communicator solo() {
  const int devices[] = {0};
  auto all = nccl::communicator::init_all(devices);
  REQUIRE(all.size() == 1);
  return std::move(all.front());
}

TEST_SUITE("no_device") {
  TEST_CASE("FEDSHARD_NCCL_TRY: backend_error, or peer_failure for a failed peer, with the texts") {
    CHECK_NOTHROW(FEDSHARD_NCCL_TRY(ncclSuccess));
    CHECK_NOTHROW(FEDSHARD_NCCL_TRY(ncclInProgress));
    try {
      FEDSHARD_NCCL_TRY(static_cast<ncclResult_t>(ncclInvalidArgument));
      FAIL("expected a throw");
    } catch (const fedshard::backend_error& e) {
      const std::string what = e.what();
      CHECK(what.find("ncclInvalidArgument") != std::string::npos);
      CHECK(what.find(ncclGetErrorString(ncclInvalidArgument)) != std::string::npos);
      CHECK(what.find("test_nccl.cu") != std::string::npos);
    }
    CHECK_THROWS_WITH_AS(FEDSHARD_NCCL_TRY(static_cast<ncclResult_t>(ncclRemoteError)),
                         doctest::Contains("ncclRemoteError"), fedshard::peer_failure);
    CHECK_THROWS_AS(FEDSHARD_NCCL_TRY(static_cast<ncclResult_t>(ncclSystemError)),
                    fedshard::peer_failure);
  }

  TEST_CASE("dtypes and reduce_ops map to NCCL's own") {
    CHECK(nccl::detail::to_nccl(dtype::f32) == ncclFloat32);
    CHECK(nccl::detail::to_nccl(dtype::f64) == ncclFloat64);
    CHECK(nccl::detail::to_nccl(dtype::bf16) == ncclBfloat16);
    CHECK(nccl::detail::to_nccl(dtype::f16) == ncclFloat16);
    CHECK(nccl::detail::to_nccl(reduce_op::sum) == ncclSum);
    CHECK(nccl::detail::to_nccl(reduce_op::avg) == ncclAvg);
    CHECK(nccl::detail::to_nccl(reduce_op::min) == ncclMin);
    CHECK(nccl::detail::to_nccl(reduce_op::max) == ncclMax);
  }
}

TEST_CASE("a one-rank communicator: rank, size, device, stream") {
  nccl::communicator c = solo();
  CHECK(c.rank() == 0);
  CHECK(c.size() == 1);
  CHECK(c.device() == 0);
  CHECK(c.stream() != nullptr);
  CHECK(c.native_handle() != nullptr);
  CHECK_FALSE(c.aborted());
}

TEST_CASE_TEMPLATE("collectives on one rank return the input, for every dtype and op", T, float,
                   double, bf16, f16) {
  nccl::communicator c = solo();
  const std::size_t n = 100003;
  const dtype t = fedshard::dtype_of<T>;
  const std::vector<T> host = random_values<T>(n, 61);
  auto in = gpu::device_buffer<T>::from_host(host);
  gpu::device_buffer<T> out(n);
  for (reduce_op op : fedshard::all_reduce_ops) {
    CAPTURE(fedshard::to_string(op));
    c.all_reduce(in.data(), out.data(), static_cast<std::int64_t>(n), t, op);
    require_bits(out.to_host(), host, "all_reduce");
    c.reduce_scatter(in.data(), out.data(), static_cast<std::int64_t>(n), t, op);
    require_bits(out.to_host(), host, "reduce_scatter");
  }
  auto inplace = gpu::device_buffer<T>::from_host(host);
  c.all_reduce(inplace.data(), inplace.data(), static_cast<std::int64_t>(n), t, reduce_op::sum);
  require_bits(inplace.to_host(), host, "in-place all_reduce");
  gpu::device_buffer<T> gathered(n);
  c.all_gather(in.data(), gathered.data(), static_cast<std::int64_t>(n), t);
  require_bits(gathered.to_host(), host, "all_gather");
  c.broadcast(inplace.data(), static_cast<std::int64_t>(n), t, 0);
  require_bits(inplace.to_host(), host, "broadcast");
}

TEST_CASE_TEMPLATE("weighted all_reduce and reduce_scatter multiply by the rank's weight", T, float,
                   double, bf16, f16) {
  nccl::communicator c = solo();
  const std::size_t n = 5003;
  const dtype t = fedshard::dtype_of<T>;
  const std::vector<T> host = random_values<T>(n, 62);
  // 0.375 is exact in every dtype, and w * x of two such values is exact in float, so NCCL's
  // pre-multiplication rounds once, like this reference.
  const double w = 0.375;
  std::vector<T> want(n);
  for (std::size_t i = 0; i < n; ++i)
    want[i] = fedshard::from_accum<T>(w * static_cast<double>(fedshard::to_accum(host[i])));
  auto in = gpu::device_buffer<T>::from_host(host);
  gpu::device_buffer<T> out(n);
  c.all_reduce_weighted(in.data(), out.data(), static_cast<std::int64_t>(n), t, w);
  require_bits(out.to_host(), want, "all_reduce_weighted");
  c.reduce_scatter_weighted(in.data(), out.data(), static_cast<std::int64_t>(n), t, w);
  require_bits(out.to_host(), want, "reduce_scatter_weighted");
}

TEST_CASE("async operations: test() polls, wait() completes, requests drain when dropped") {
  nccl::communicator c = solo();
  const std::size_t n = std::size_t{16} << 20;
  const std::vector<float> host = random_values<float>(n, 63);
  auto in = gpu::device_buffer<float>::from_host(host);
  gpu::device_buffer<float> a(n), b(n);
  fedshard::request r1 = c.all_reduce_async(in.data(), a.data(), static_cast<std::int64_t>(n),
                                            dtype::f32, reduce_op::sum);
  fedshard::request r2 =
      c.all_gather_async(in.data(), b.data(), static_cast<std::int64_t>(n), dtype::f32);
  CHECK(r1.pending());
  r2.wait();
  CHECK(r1.test());  // same stream: r1 completed before r2
  r1.wait();
  CHECK_FALSE(r1.pending());
  require_bits(a.to_host(), host, "async all_reduce");
  require_bits(b.to_host(), host, "async all_gather");
  {
    fedshard::request dropped =
        c.broadcast_async(a.data(), static_cast<std::int64_t>(n), dtype::f32, 0);
  }
  c.barrier();
  fedshard::request br = c.barrier_async();
  br.wait();
}

TEST_CASE("split gives a working communicator with its own stream") {
  nccl::communicator c = solo();
  nccl::communicator child = c.split(3, 0);
  CHECK(child.size() == 1);
  CHECK(child.rank() == 0);
  CHECK(child.stream() != c.stream());
  const std::vector<double> host = random_values<double>(1000, 64);
  auto buf = gpu::device_buffer<double>::from_host(host);
  child.all_reduce(buf.data(), buf.data(), 1000, dtype::f64, reduce_op::avg);
  require_bits(buf.to_host(), host, "all_reduce on a split");
  CHECK_THROWS_WITH_AS(c.split(-1, 0), doctest::Contains("color must be >= 0"),
                       fedshard::invalid_argument);
}

TEST_CASE("invalid arguments throw invalid_argument before anything is enqueued") {
  nccl::communicator c = solo();
  gpu::device_buffer<float> buf(64);
  float* p = buf.data();
  CHECK_THROWS_WITH_AS(c.all_reduce(p, p, -1, dtype::f32, reduce_op::sum),
                       doctest::Contains("count must be >= 0"), fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(c.all_reduce(nullptr, p, 4, dtype::f32, reduce_op::sum),
                       doctest::Contains("input buffer is null"), fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(c.all_reduce(p, p + 1, 8, dtype::f32, reduce_op::sum),
                       doctest::Contains("overlap partially"), fedshard::invalid_argument);
  CHECK_THROWS_AS(c.all_reduce(p, p, 4, static_cast<dtype>(7), reduce_op::sum),
                  fedshard::invalid_argument);
  CHECK_THROWS_AS(c.all_reduce(p, p, 4, dtype::f32, static_cast<reduce_op>(9)),
                  fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(c.broadcast(p, 4, dtype::f32, 1), doctest::Contains("root must be in"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(c.send(p, 4, dtype::f32, 0), doctest::Contains("is this rank"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(c.recv(p, 4, dtype::f32, 2), doctest::Contains("peer must be in"),
                       fedshard::invalid_argument);
  c.all_reduce(p, p, 0, dtype::f32, reduce_op::sum);  // nothing to do, still valid
  CHECK_FALSE(c.aborted());
}

TEST_CASE("after abort() every call throws peer_failure") {
  nccl::communicator c = solo();
  gpu::device_buffer<float> buf(16);
  c.abort();
  CHECK(c.aborted());
  CHECK_THROWS_WITH_AS(c.all_reduce(buf.data(), buf.data(), 16, dtype::f32, reduce_op::sum),
                       doctest::Contains("aborted"), fedshard::peer_failure);
  CHECK_THROWS_AS(c.barrier(), fedshard::peer_failure);
}

}  // namespace
