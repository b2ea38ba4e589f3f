#pragma once
/// The seam between the two translation units of a LibTorch model trained on fedshard's CUDA
/// space: LibTorch's headers compile only with the host compiler (nvcc's C++20 front end
/// rejects them: std::vector<c10::IValue> of an incomplete type in ATen/core/List.h), and
/// fedshard's CUDA headers only with nvcc. So the trainer (gpu_inproc, cuda_space) lives in
/// an nvcc unit (torch_gpu_run.cu) that sees the model only through device_model, and the
/// torch_model lives in a host-compiler unit that sees the step only through device_step.
/// This header is plain C++ (neither torch nor CUDA).
///
/// device_context dresses a device_step as the step context torch_model's device path uses
/// (layout, acquire, release, grad_buffer, grads_ready, space().device(), stream().get()), so
/// torch_model<Net>::forward_backward(ctx, batch) runs unchanged on it.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/shard/flat_layout.hpp"

namespace fedshard_torch::bridge {

/// The trainer's step on a CUDA space, as the host-compiler unit sees it.
class device_step {
 public:
  virtual ~device_step() = default;
  virtual const fedshard::flat_layout& layout() const = 0;
  virtual std::span<const float> acquire(std::size_t u, fedshard::phase ph) = 0;
  virtual void release(std::size_t u) = 0;
  virtual std::span<float> grad_buffer(std::size_t u) = 0;
  virtual void grads_ready(std::size_t u) = 0;
  /// The CUDA device index of the step's memory space.
  virtual int device() const = 0;
  /// The step's compute stream (a cudaStream_t).
  virtual void* stream() const = 0;
};

/// A step context over a device_step (see the file comment).
class device_context {
 public:
  /// What torch_model asks of the space: not host-accessible, on a CUDA device.
  struct space_type {
    static constexpr bool host_accessible = false;
    static constexpr std::string_view name = "cuda (bridged)";
    int index = 0;
    int device() const noexcept { return index; }
  };
  /// The compute stream, get() as cuda_stream's.
  struct stream_type {
    void* handle = nullptr;
    void* get() const noexcept { return handle; }
  };

  explicit device_context(device_step& s) : step_(&s), space_{s.device()}, stream_{s.stream()} {}

  const fedshard::flat_layout& layout() const { return step_->layout(); }
  std::span<const float> acquire(std::size_t u, fedshard::phase ph = fedshard::phase::forward) {
    return step_->acquire(u, ph);
  }
  void release(std::size_t u) { step_->release(u); }
  std::span<float> grad_buffer(std::size_t u) { return step_->grad_buffer(u); }
  void grads_ready(std::size_t u) { step_->grads_ready(u); }
  space_type& space() noexcept { return space_; }
  stream_type& stream() noexcept { return stream_; }

 private:
  device_step* step_;
  space_type space_;
  stream_type stream_;
};

/// A model trained on the device, as the nvcc unit sees it; batches are named by an index
/// (see run_options).
class device_model {
 public:
  virtual ~device_model() = default;
  virtual std::vector<fedshard::unit_spec> units() const = 0;
  virtual std::vector<float> initial_values(const fedshard::flat_layout& layout,
                                            std::size_t u) const = 0;
  virtual float forward_backward(device_step& step, std::int64_t batch) = 0;
  virtual float evaluate(device_step& step, std::int64_t batch) = 0;
  virtual std::int64_t tokens(std::int64_t batch) const = 0;
  /// Takes unit u's trained values (host memory).
  virtual void load_unit(const fedshard::flat_layout& layout, std::size_t u,
                         std::span<const float> values) = 0;
};

/// The shard optimizer of a run.
enum class optimizer { sgd, adamw };

/// A run of fl_hsdp on gpu_inproc ranks sharing one device. Rank r's batch at step s is
/// batch s * ranks + r. (trainer::evaluate is not called: its static_assert's requires-
/// expression does not compile with nvcc 13; device_model::evaluate is there for a caller
/// that can.)
struct run_options {
  fedshard::mesh_shape shape{2, 1, 2};
  int steps = 100;
  int period = 4;  ///< K
  float lr = 1e-2f;
  optimizer opt = optimizer::adamw;
  int device = 0;
  std::chrono::seconds timeout{300};
};

/// What each rank saw.
struct run_result {
  std::vector<std::vector<float>> parameters;  ///< per rank: the trained parameters
  std::vector<std::vector<float>> losses;      ///< per rank: the training loss of each step
  std::vector<int> peak_live_units;            ///< per rank
};

/// Trains model(r) on rank r of o.shape.size() gpu_inproc ranks of device o.device, then
/// hands each its trained parameters (load_unit). Defined in torch_gpu_run.cu.
run_result run_fl_hsdp(const run_options& o,
                       const std::function<std::shared_ptr<device_model>(int rank)>& model);

/// CUDA devices visible (0 without a device or driver). Defined in torch_gpu_run.cu.
int cuda_device_count();

}  // namespace fedshard_torch::bridge
