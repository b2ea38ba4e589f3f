#pragma once
/// An owning, move-only array in device memory (cudaMalloc, or the stream-ordered
/// cudaMallocAsync), with host copies and type-erased views.
///
/// The destructor frees the memory and never throws. cudaFree waits for the device to be
/// idle; a buffer allocated on a stream is freed with cudaFreeAsync on that stream instead
/// (the stream must outlive the buffer). Pointers and spans of a device_buffer are device
/// addresses: pass them to kernels and CUDA calls, never dereference them on the host.

#include "fedshard/cuda/config.cuh"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/cuda/error.cuh"
#include "fedshard/error.hpp"

namespace fedshard::gpu {

/// n elements of T in device memory; see the file comment.
template <class T>
class device_buffer {
  static_assert(std::is_trivially_copyable_v<T>, "device_buffer holds trivially copyable types");

 public:
  device_buffer() = default;

  /// n zero elements on the current device (cudaMalloc and cudaMemset; synchronous: the
  /// zeros are written when it returns, so work on any stream, non-blocking ones included,
  /// sees them; cudaMemset alone is asynchronous to the host and ordered only with the
  /// default stream).
  explicit device_buffer(std::size_t n) : device_buffer(allocate(n, nullptr, false)) {
    if (size_ != 0) {
      FEDSHARD_CUDA_TRY(cudaMemset(data_, 0, size_bytes()));
      FEDSHARD_CUDA_TRY(cudaStreamSynchronize(nullptr));
    }
  }

  /// n zero elements allocated and zeroed in the order of stream s (cudaMallocAsync,
  /// cudaMemsetAsync); freed with cudaFreeAsync on s, which must outlive the buffer.
  device_buffer(std::size_t n, cudaStream_t s) : device_buffer(allocate(n, s, true)) {
    if (size_ != 0) FEDSHARD_CUDA_TRY(cudaMemsetAsync(data_, 0, size_bytes(), s));
  }

  /// n elements with unspecified contents (no memset).
  static device_buffer uninitialized(std::size_t n) { return allocate(n, nullptr, false); }

  /// A buffer holding a copy of host (synchronous).
  static device_buffer from_host(std::span<const T> host) {
    device_buffer b = allocate(host.size(), nullptr, false);
    b.copy_from_host(host);
    return b;
  }

  device_buffer(device_buffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)),
        stream_(std::exchange(o.stream_, nullptr)),
        stream_ordered_(std::exchange(o.stream_ordered_, false)) {}
  device_buffer& operator=(device_buffer&& o) noexcept {
    if (this != &o) {
      reset();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      stream_ = std::exchange(o.stream_, nullptr);
      stream_ordered_ = std::exchange(o.stream_ordered_, false);
    }
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { reset(); }

  /// Device address of the first element (nullptr when empty).
  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  bool empty() const noexcept { return size_ == 0; }

  /// The elements as a span of device memory.
  std::span<T> span() noexcept { return {data_, size_}; }
  std::span<const T> span() const noexcept { return {data_, size_}; }

  /// The type-erased view (device pointer, count, dtype) of a buffer of a fedshard dtype.
  buffer_view view() noexcept requires(std::is_same_v<T, float> || std::is_same_v<T, double> ||
                                       std::is_same_v<T, bf16> || std::is_same_v<T, f16>) {
    return {data_, size_, dtype_of<T>};
  }
  /// The read-only type-erased view.
  const_buffer_view cview() const noexcept
      requires(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bf16> ||
               std::is_same_v<T, f16>) {
    return {data_, size_, dtype_of<T>};
  }

  /// Copies host (exactly size() elements) into the buffer; synchronous: the elements are in
  /// device memory when it returns, for work on any stream. (cudaMemcpy from pageable host
  /// memory may return once the source is staged, before the DMA lands: a kernel on a
  /// non-blocking stream could then read old contents. Seen on an H200: the default stream
  /// is synchronized after the copy.)
  void copy_from_host(std::span<const T> host) {
    FEDSHARD_EXPECTS(host.size() == size_, "device_buffer::copy_from_host: the buffer holds ",
                     size_, " elements, the host span ", host.size());
    if (size_ != 0) {
      FEDSHARD_CUDA_TRY(cudaMemcpy(data_, host.data(), size_bytes(), cudaMemcpyHostToDevice));
      FEDSHARD_CUDA_TRY(cudaStreamSynchronize(nullptr));
    }
  }

  /// Copies the buffer into host (exactly size() elements); synchronous with the default
  /// stream only: work that wrote the buffer on another stream (a non-blocking one) must be
  /// synchronized first.
  void copy_to_host(std::span<T> host) const {
    FEDSHARD_EXPECTS(host.size() == size_, "device_buffer::copy_to_host: the buffer holds ", size_,
                     " elements, the host span ", host.size());
    if (size_ != 0)
      FEDSHARD_CUDA_TRY(cudaMemcpy(host.data(), data_, size_bytes(), cudaMemcpyDeviceToHost));
  }

  /// The elements copied to a host vector; synchronous.
  std::vector<T> to_host() const {
    std::vector<T> host(size_);
    copy_to_host(host);
    return host;
  }

  /// Frees the memory now; the buffer becomes empty.
  void reset() noexcept {
    if (data_ != nullptr) {
      if (stream_ordered_)
        (void)cudaFreeAsync(data_, stream_);
      else
        (void)cudaFree(data_);
    }
    data_ = nullptr;
    size_ = 0;
    stream_ = nullptr;
    stream_ordered_ = false;
  }

 private:
  static device_buffer allocate(std::size_t n, cudaStream_t s, bool stream_ordered) {
    FEDSHARD_EXPECTS(n <= std::numeric_limits<std::size_t>::max() / sizeof(T), "device_buffer: ", n,
                     " elements of ", sizeof(T), " bytes overflow std::size_t");
    device_buffer b;
    if (n == 0) return b;
    void* p = nullptr;
    if (stream_ordered)
      FEDSHARD_CUDA_TRY(cudaMallocAsync(&p, n * sizeof(T), s));
    else
      FEDSHARD_CUDA_TRY(cudaMalloc(&p, n * sizeof(T)));
    b.data_ = static_cast<T*>(p);
    b.size_ = n;
    b.stream_ = s;
    b.stream_ordered_ = stream_ordered;
    return b;
  }

  T* data_ = nullptr;
  std::size_t size_ = 0;
  cudaStream_t stream_ = nullptr;
  bool stream_ordered_ = false;
};

}  // namespace fedshard::gpu
