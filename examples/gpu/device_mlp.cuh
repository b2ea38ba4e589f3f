#pragma once
/// device_mlp: the MLP of device_mlp.hpp on any memory space. On a host-accessible space its
/// functors run as host loops; on a device space (cuda_space) as kernels on the step
/// context's stream: one thread per element for the element-wise functors, and a tiled
/// kernel for the matrix products in which every thread owns one output element and adds
/// the products of its row and column in ascending k, the order of the host loop, with the
/// same rounded operations. So a run on a host space and a run on a GPU give the same bits.

#include "device_mlp.hpp"
#include "fedshard/cuda/cuda_space.cuh"
#include "fedshard/cuda/error.cuh"

namespace fedshard_examples {

namespace detail {

/// f(i) for i in [0, n): one thread each.
template <class F>
__global__ void range_kernel(F f, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) f(i);
}

/// Side of the square tiles of contraction_kernel (a block is tile x tile threads).
inline constexpr int tile = 16;

/// c's outputs, tile x tile per block: each step of k0 stages a tile of a and a tile of b in
/// shared memory; thread (ty, tx) accumulates its element over k = k0, k0 + 1, ... in order.
__global__ void contraction_kernel(mlp_math::contraction c) {
  __shared__ float as[tile][tile + 1];
  __shared__ float bs[tile][tile + 1];
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  const int r0 = static_cast<int>(blockIdx.y) * tile, c0 = static_cast<int>(blockIdx.x) * tile;
  const int r = r0 + ty, col = c0 + tx;
  const bool inside = r < c.rows && col < c.cols;
  float acc = inside ? c.init(r, col) : 0.0f;
  for (int k0 = 0; k0 < c.depth; k0 += tile) {
    as[ty][tx] = r0 + ty < c.rows && k0 + tx < c.depth ? c.a(r0 + ty, k0 + tx) : 0.0f;
    bs[ty][tx] = k0 + ty < c.depth && c0 + tx < c.cols ? c.b(k0 + ty, c0 + tx) : 0.0f;
    __syncthreads();
    const int kn = c.depth - k0 < tile ? c.depth - k0 : tile;
    for (int k = 0; k < kn; ++k)
      acc = mlp_math::add_rn(acc, mlp_math::mul_rn(as[ty][k], bs[k][tx]));
    __syncthreads();
  }
  if (inside) c.finish(r, col, acc);
}

}  // namespace detail

/// Runs the functors as host loops on a host-accessible space, else as kernels on the stream.
struct cuda_launch {
  template <class S, class F>
  static void range(typename S::stream& st, int n, const F& f) {
    if (n <= 0) return;
    if constexpr (S::host_accessible) {
      for (int i = 0; i < n; ++i) f(i);
    } else {
      detail::range_kernel<<<(n + 255) / 256, 256, 0, st.get()>>>(f, n);
      fedshard::gpu::detail::check_launch("device_mlp range_kernel");
    }
  }
  template <class S>
  static void contract(typename S::stream& st, const mlp_math::contraction& c) {
    if (c.rows <= 0 || c.cols <= 0) return;
    if constexpr (S::host_accessible) {
      range<S>(st, c.rows * c.cols, c);
    } else {
      const dim3 block(detail::tile, detail::tile);
      const dim3 grid(static_cast<unsigned>((c.cols + detail::tile - 1) / detail::tile),
                      static_cast<unsigned>((c.rows + detail::tile - 1) / detail::tile));
      detail::contraction_kernel<<<grid, block, 0, st.get()>>>(c);
      fedshard::gpu::detail::check_launch("device_mlp contraction_kernel");
    }
  }
};

/// The MLP on host and CUDA spaces.
using device_mlp = basic_mlp<cuda_launch>;

}  // namespace fedshard_examples
