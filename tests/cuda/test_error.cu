#include "fedshard/cuda/error.cuh"

#include <doctest/doctest.h>

#include <string>

#include "fedshard/error.hpp"

namespace {

__global__ void empty_kernel() {}

TEST_SUITE("no_device") {
  TEST_CASE("FEDSHARD_CUDA_TRY throws backend_error naming the error, the call and the place") {
    CHECK_NOTHROW(FEDSHARD_CUDA_TRY(cudaSuccess));
    try {
      FEDSHARD_CUDA_TRY(static_cast<cudaError_t>(cudaErrorMemoryAllocation));
      FAIL("expected a throw");
    } catch (const fedshard::backend_error& e) {
      const std::string what = e.what();
      CHECK(what.find("cudaErrorMemoryAllocation") != std::string::npos);
      CHECK(what.find(cudaGetErrorString(cudaErrorMemoryAllocation)) != std::string::npos);
      CHECK(what.find("static_cast<cudaError_t>(cudaErrorMemoryAllocation)") != std::string::npos);
      CHECK(what.find("test_error.cu") != std::string::npos);
    }
  }

  TEST_CASE("FEDSHARD_CUDA_TRY is one statement") {
    int calls = 0;
    auto ok = [&] {
      ++calls;
      return cudaSuccess;
    };
    if (calls == 0)
      FEDSHARD_CUDA_TRY(ok());
    else
      FEDSHARD_CUDA_TRY(ok());
    CHECK(calls == 1);  // evaluated once
  }
}

TEST_CASE("check_launch reports a failed launch") {
  empty_kernel<<<1, 4096>>>();  // more threads per block than any device allows
  // The error code depends on the runtime (CUDA 13 on an H200 reports cudaErrorInvalidValue,
  // older ones cudaErrorInvalidConfiguration): the message names the kernel and the code.
  CHECK_THROWS_WITH_AS(fedshard::gpu::detail::check_launch("empty_kernel"),
                       doctest::Contains("launching empty_kernel failed: CUDA error cudaError"),
                       fedshard::backend_error);
  empty_kernel<<<1, 32>>>();
  CHECK_NOTHROW(fedshard::gpu::detail::check_launch("empty_kernel"));
  FEDSHARD_CUDA_TRY(cudaDeviceSynchronize());
}

}  // namespace
