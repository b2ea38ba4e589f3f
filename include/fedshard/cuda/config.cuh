#pragma once
/// Entry point of the CUDA layer (CMake components fedshard::cuda and fedshard::nccl): every
/// header of fedshard/cuda/ includes it first. These headers hold device code and CUDA
/// types, so they compile only as CUDA (.cu files compiled by nvcc, or clang in CUDA mode);
/// host headers never include them.
///
/// Their namespace is fedshard::gpu (fedshard::nccl for the communicator), not
/// fedshard::cuda: with `using namespace fedshard;` at global scope, a nested `cuda` would
/// make every `cuda::` of libcu++ ambiguous, including those nvcc writes into the host stubs
/// of CUB kernels, which then fail to compile.

#if !defined(__CUDACC__)
#error \
    "fedshard/cuda/*.cuh need a CUDA compiler: include them only from .cu files built by nvcc (link fedshard::cuda)"
#endif

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "fedshard/config.hpp"

namespace fedshard::gpu {

/// Threads per block of every fedshard kernel (their tile sizes are derived from it).
inline constexpr unsigned block_threads = 256;

/// Bytes of the widest load or store a thread issues (int4 / uint4).
inline constexpr std::size_t vector_bytes = 16;

/// Upper bound on the blocks of a grid-stride launch; larger ranges loop.
inline constexpr std::uint64_t max_grid_blocks = std::uint64_t{1} << 20;

}  // namespace fedshard::gpu
