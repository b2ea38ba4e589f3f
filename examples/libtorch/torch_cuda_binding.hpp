#pragma once
/// The CUDA side of torch_model (torch_model.hpp includes it only when FEDSHARD_TORCH_CUDA is
/// defined, i.e. when the LibTorch found has CUDA): the torch device and stream of a step
/// context whose memory space is a CUDA device (fedshard::gpu::cuda_space, or any step
/// context Ctx whose `ctx.space().device()` is a CUDA device index and whose
/// `ctx.stream().get()` is a cudaStream_t, or a void* holding one).
///
/// The stream is fedshard's compute stream wrapped by c10::cuda::getStreamFromExternal: torch
/// queues on it and never destroys it. torch_model holds it as a c10::Stream, the
/// device-generic form of c10::cuda::CUDAStream, so that its own code needs no CUDA header:
/// c10::StreamGuard on it is c10::cuda::CUDAStreamGuard (current device and current stream of
/// that device, restored on exit) through c10's registered CUDA guard.
///
/// Needs the CUDA toolkit's headers (cuda_runtime_api.h) and LibTorch's c10/cuda headers; no
/// fedshard CUDA header, so it compiles with the host compiler (LibTorch's headers do not
/// compile with nvcc in C++20, see examples/libtorch/README.md).

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/torch.h>

#include <cuda_runtime_api.h>

#include "fedshard/error.hpp"

namespace fedshard_torch::detail::cuda_binding {

/// The CUDA device the step context's space computes on.
template <class Ctx>
torch::Device device(Ctx& ctx) {
  const int index = ctx.space().device();
  FEDSHARD_EXPECTS(index >= 0 && index < static_cast<int>(c10::cuda::device_count()),
                   "torch_model: the step's memory space is on CUDA device ", index, " but ",
                   "LibTorch sees ", static_cast<int>(c10::cuda::device_count()), " devices");
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
}

/// The step context's compute stream, as a torch stream of its device.
template <class Ctx>
c10::Stream stream(Ctx& ctx) {
  const torch::Device d = device(ctx);
  const auto raw = static_cast<cudaStream_t>(ctx.stream().get());
  const c10::cuda::CUDAStream s = c10::cuda::getStreamFromExternal(raw, d.index());
  return s.unwrap();
}

}  // namespace fedshard_torch::detail::cuda_binding
