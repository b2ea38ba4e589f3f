#pragma once
/// CUDA runtime errors as fedshard exceptions: FEDSHARD_CUDA_TRY throws
/// fedshard::backend_error naming the error, its description, the failed expression and
/// where it was. The NCCL counterpart, FEDSHARD_NCCL_TRY, lives in fedshard/cuda/nccl.cuh
/// (fedshard::nccl) so that this header does not need nccl.h.

#include "fedshard/cuda/config.cuh"

#include <cuda_runtime.h>

#include <string>

#include "fedshard/error.hpp"

namespace fedshard::gpu::detail {

/// The text of a CUDA error: "cudaErrorX (description)".
inline std::string describe(cudaError_t status) {
  return ::fedshard::detail::concat(cudaGetErrorName(status), " (", cudaGetErrorString(status),
                                    ")");
}

/// Throws backend_error for a failed FEDSHARD_CUDA_TRY.
[[noreturn]] inline void cuda_failed(cudaError_t status, const char* expression, const char* file,
                                     int line) {
  throw backend_error(::fedshard::detail::concat("fedshard: CUDA error ", describe(status),
                                                 " from '", expression, "' at ", file, ":", line));
}

/// Throws backend_error if the last kernel launch on this thread failed (bad configuration,
/// no kernel image for the device, ...). `what` names the kernel.
inline void check_launch(const char* what) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess)
    throw backend_error(::fedshard::detail::concat("fedshard: launching ", what,
                                                   " failed: CUDA error ", describe(status)));
}

}  // namespace fedshard::gpu::detail

/// Evaluates a CUDA runtime call; unless it returns cudaSuccess, throws
/// fedshard::backend_error with the error's name and description, the call and its place.
#define FEDSHARD_CUDA_TRY(...)                                                           \
  do {                                                                                   \
    const cudaError_t fedshard_cuda_status = (__VA_ARGS__);                              \
    if (fedshard_cuda_status != cudaSuccess)                                             \
      ::fedshard::gpu::detail::cuda_failed(fedshard_cuda_status, #__VA_ARGS__, __FILE__, \
                                           __LINE__);                                    \
  } while (0)
