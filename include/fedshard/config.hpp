#pragma once
/// Compile-time configuration: host/device annotations and which backends are built.

#if defined(__CUDACC__) || defined(__HIPCC__)
/// Marks a function usable from host code and from CUDA kernels.
#define FEDSHARD_HOST_DEVICE __host__ __device__
#else
#define FEDSHARD_HOST_DEVICE
#endif

// The component targets fedshard::mpi, fedshard::cuda and fedshard::nccl define these to 1.
#ifndef FEDSHARD_HAS_MPI
#define FEDSHARD_HAS_MPI 0
#endif
#ifndef FEDSHARD_HAS_CUDA
#define FEDSHARD_HAS_CUDA 0
#endif
#ifndef FEDSHARD_HAS_NCCL
#define FEDSHARD_HAS_NCCL 0
#endif

#include <cstddef>

namespace fedshard {
/// Size of a cache line on the targets we care about (x86-64, Neoverse): chunks and
/// shard starts are aligned to it.
inline constexpr std::size_t cache_line_bytes = 64;
}  // namespace fedshard
