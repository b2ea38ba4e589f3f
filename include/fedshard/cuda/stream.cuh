#pragma once
/// Owning handles of CUDA streams and events, and device selection.
///
/// stream and event are move-only RAII wrappers; their destructors never throw (a failing
/// cudaStreamDestroy / cudaEventDestroy is ignored). Both convert implicitly to the raw
/// handle so that they can be passed to CUDA and fedshard::gpu functions directly.

#include "fedshard/cuda/config.cuh"

#include <cuda_runtime.h>

#include <utility>

#include "fedshard/cuda/error.cuh"
#include "fedshard/error.hpp"

namespace fedshard::gpu {

/// The number of CUDA devices this process can use; 0 when there is none or no driver
/// (the error is cleared, nothing is thrown).
inline int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

/// The calling thread's current device.
inline int current_device() {
  int device = 0;
  FEDSHARD_CUDA_TRY(cudaGetDevice(&device));
  return device;
}

/// Makes a device current for the guard's lifetime, then restores the previous one.
class device_guard {
 public:
  /// Switches to `device` (no call when it is already current).
  explicit device_guard(int device) : previous_(current_device()) {
    if (device != previous_) FEDSHARD_CUDA_TRY(cudaSetDevice(device));
    switched_ = device != previous_;
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  ~device_guard() {
    if (switched_) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool switched_ = false;
};

namespace detail {

/// Makes a device current without throwing (destructors, noexcept paths); device_guard
/// otherwise.
class quiet_device_guard {
 public:
  explicit quiet_device_guard(int device) noexcept {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device)
      switched_ = cudaSetDevice(device) == cudaSuccess;
  }
  quiet_device_guard(const quiet_device_guard&) = delete;
  quiet_device_guard& operator=(const quiet_device_guard&) = delete;
  ~quiet_device_guard() {
    if (switched_) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool switched_ = false;
};

}  // namespace detail

/// An owned CUDA stream on the device that was current when it was created.
class stream {
 public:
  /// A new stream; by default non-blocking (no implicit sync with the legacy stream 0).
  explicit stream(unsigned flags = cudaStreamNonBlocking) {
    FEDSHARD_CUDA_TRY(cudaStreamCreateWithFlags(&handle_, flags));
  }
  stream(stream&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  stream& operator=(stream&& other) noexcept {
    if (this != &other) {
      reset();
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;
  ~stream() { reset(); }

  /// The raw handle (nullptr after a move).
  cudaStream_t get() const noexcept { return handle_; }
  operator cudaStream_t() const noexcept { return handle_; }  // NOLINT: handle conversion

  /// Blocks until every operation enqueued so far has completed.
  void synchronize() const { FEDSHARD_CUDA_TRY(cudaStreamSynchronize(handle_)); }

  /// True when every operation enqueued so far has completed.
  bool ready() const {
    const cudaError_t status = cudaStreamQuery(handle_);
    if (status == cudaErrorNotReady) return false;
    FEDSHARD_CUDA_TRY(status);
    return true;
  }

 private:
  void reset() noexcept {
    if (handle_ != nullptr) (void)cudaStreamDestroy(handle_);
    handle_ = nullptr;
  }
  cudaStream_t handle_ = nullptr;
};

/// An owned CUDA event: a point in a stream that the host or other streams can wait for.
class event {
 public:
  /// A new event; by default without timing (cheaper to record and to wait for). Pass
  /// cudaEventDefault for an event that elapsed_ms() can measure.
  explicit event(unsigned flags = cudaEventDisableTiming) {
    FEDSHARD_CUDA_TRY(cudaEventCreateWithFlags(&handle_, flags));
  }
  event(event&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  event& operator=(event&& other) noexcept {
    if (this != &other) {
      reset();
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }
  event(const event&) = delete;
  event& operator=(const event&) = delete;
  ~event() { reset(); }

  /// The raw handle (nullptr after a move).
  cudaEvent_t get() const noexcept { return handle_; }
  operator cudaEvent_t() const noexcept { return handle_; }  // NOLINT: handle conversion

  /// Captures the work enqueued on s so far.
  void record(cudaStream_t s) { FEDSHARD_CUDA_TRY(cudaEventRecord(handle_, s)); }

  /// Blocks until the captured work has completed.
  void synchronize() const { FEDSHARD_CUDA_TRY(cudaEventSynchronize(handle_)); }

  /// True when the captured work has completed (also for an event never recorded).
  bool ready() const {
    const cudaError_t status = cudaEventQuery(handle_);
    if (status == cudaErrorNotReady) return false;
    FEDSHARD_CUDA_TRY(status);
    return true;
  }

  /// Milliseconds between two completed timing events (created with cudaEventDefault).
  static float elapsed_ms(const event& start, const event& stop) {
    float ms = 0.0f;
    FEDSHARD_CUDA_TRY(cudaEventElapsedTime(&ms, start.handle_, stop.handle_));
    return ms;
  }

 private:
  void reset() noexcept {
    if (handle_ != nullptr) (void)cudaEventDestroy(handle_);
    handle_ = nullptr;
  }
  cudaEvent_t handle_ = nullptr;
};

/// Makes future work on s wait until e's captured work has completed (no host blocking).
inline void wait(cudaStream_t s, const event& e) {
  FEDSHARD_CUDA_TRY(cudaStreamWaitEvent(s, e.get(), 0));
}

}  // namespace fedshard::gpu
