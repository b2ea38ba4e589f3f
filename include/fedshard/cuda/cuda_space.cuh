#pragma once
/// cuda_space: the MemorySpace (space/memory_space.hpp) of one CUDA device.
///
/// - Buffers live in the device's global memory (not host accessible). Blocks come from
///   cudaMalloc through the space's caching allocator (space/caching_allocator.hpp), so a
///   training loop calls cudaMalloc only in its first step; system_allocations() counts the
///   cudaMalloc calls. allocate() zeroes the block on an internal stream and waits for it, so
///   a new buffer is ready for work on any stream.
/// - Freeing: a buffer goes back to the cache when it is destroyed, at once, without an
///   event. The rule of the concept holds: destroy a buffer only after the streams that use
///   it have passed their last use (the host synchronized with them, or with an event after
///   that use, or a later allocation reuses the block only in stream order behind such a
///   wait). The engine, optimizers and federation sync follow it (checked_space poisons
///   recycled blocks to catch violations on the host).
/// - Streams are non-blocking CUDA streams of the device (no implicit synchronisation with
///   the legacy stream 0); `st.get()` is the raw cudaStream_t, for libraries that enqueue
///   their own work (cuBLAS, LibTorch's CUDAStream wrappers).
/// - Events are copyable handles of a CUDA event with shared ownership, taken from a pool of
///   the device (no cudaEventCreate per record once the pool is warm); a default-constructed
///   event is complete. wait() is cudaStreamWaitEvent (the host does not wait), also for an
///   event of another device.
/// - copy, to_host and from_host are cudaMemcpyAsync (cudaMemcpyDefault: unified addressing
///   finds each side's memory, so a copy from a peer device's buffer works as well); cast
///   is fedshard::gpu::cast (kernels::cast_fn, bit-identical to the host conversion); fill
///   writes cast_fn<double, T>(value); for_each runs an element functor of kernels/ over
///   float spans (fedshard::gpu::detail::for_each, float4 loads where aligned).
/// Errors: invalid_argument for bad arguments (before anything is enqueued), backend_error
/// with the CUDA error's name and text for failures of the runtime.

#include "fedshard/cuda/config.cuh"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/cuda/error.cuh"
#include "fedshard/cuda/kernels.cuh"
#include "fedshard/cuda/stream.cuh"
#include "fedshard/error.hpp"
#include "fedshard/kernels/cast.hpp"
#include "fedshard/kernels/index.hpp"
#include "fedshard/space/caching_allocator.hpp"
#include "fedshard/space/memory_space.hpp"

namespace fedshard::gpu {

namespace detail {

/// cudaMalloc / cudaFree on one device: the System of cuda_space's caching allocator.
struct device_memory {
  int device = 0;
  void* allocate(std::size_t bytes) {
    device_guard guard(device);
    void* p = nullptr;
    FEDSHARD_CUDA_TRY(cudaMalloc(&p, bytes));
    return p;
  }
  void release(void* p, std::size_t) noexcept {
    quiet_device_guard guard(device);
    (void)cudaFree(p);
  }
};

/// The CUDA events of one device, kept for reuse once no handle refers to them.
class event_pool : public std::enable_shared_from_this<event_pool> {
 public:
  explicit event_pool(int device) : device_(device) {}
  event_pool(const event_pool&) = delete;
  event_pool& operator=(const event_pool&) = delete;
  ~event_pool() {
    quiet_device_guard guard(device_);
    for (cudaEvent_t e : free_) (void)cudaEventDestroy(e);
  }

  int device() const noexcept { return device_; }

  /// An event of the pool's device (a free one, else a new one without timing).
  cudaEvent_t acquire() {
    {
      std::lock_guard lock(mu_);
      if (!free_.empty()) {
        cudaEvent_t e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    device_guard guard(device_);
    cudaEvent_t e = nullptr;
    FEDSHARD_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }

  /// Takes an event back (nobody waits on it any more).
  void release(cudaEvent_t e) noexcept {
    std::lock_guard lock(mu_);
    try {
      free_.push_back(e);
    } catch (...) {
      (void)cudaEventDestroy(e);
    }
  }

  /// Events created so far and now free (for tests).
  std::size_t free_events() const {
    std::lock_guard lock(mu_);
    return free_.size();
  }

 private:
  int device_;
  mutable std::mutex mu_;
  std::vector<cudaEvent_t> free_;
};

/// out[i] = v for i < n.
template <class T>
__global__ void __launch_bounds__(block_threads) fill_kernel(T* out, std::uint64_t n, T v) {
  const std::uint64_t stride = std::uint64_t{gridDim.x} * block_threads;
  for (std::uint64_t i = std::uint64_t{blockIdx.x} * block_threads + threadIdx.x; i < n;
       i += stride)
    out[i] = v;
}

/// f(j) for j < n: an index functor of kernels/ (kernels/index.hpp).
template <class F>
__global__ void __launch_bounds__(block_threads) index_kernel(F f, std::uint64_t n) {
  const std::uint64_t stride = std::uint64_t{gridDim.x} * block_threads;
  for (std::uint64_t j = std::uint64_t{blockIdx.x} * block_threads + threadIdx.x; j < n;
       j += stride)
    f(j);
}

}  // namespace detail

/// An event of cuda_space: a recorded CUDA event shared by its copies (back to its pool when
/// the last copy goes), or none (default-constructed: complete).
class cuda_event {
 public:
  cuda_event() = default;

  /// Records a pooled event on stream s (of the pool's device; that device must be current).
  static cuda_event record(const std::shared_ptr<detail::event_pool>& pool, cudaStream_t s) {
    cudaEvent_t e = pool->acquire();
    const cudaError_t status = cudaEventRecord(e, s);
    if (status != cudaSuccess) {
      pool->release(e);
      FEDSHARD_CUDA_TRY(status);
    }
    cuda_event ev;
    ev.h_ = std::make_shared<holder>(pool, e);
    return ev;
  }

  /// The raw event, nullptr for the complete default event.
  cudaEvent_t get() const noexcept { return h_ ? h_->e : nullptr; }
  /// True for a default-constructed (complete) event.
  bool empty() const noexcept { return !h_; }

  /// Makes s wait for the event (nothing for an empty one); the host does not wait.
  void wait_on(cudaStream_t s) const {
    if (h_) FEDSHARD_CUDA_TRY(cudaStreamWaitEvent(s, h_->e, 0));
  }
  /// The host waits for the event.
  void synchronize() const {
    if (h_) FEDSHARD_CUDA_TRY(cudaEventSynchronize(h_->e));
  }
  /// True once the work before the event has completed.
  bool ready() const {
    if (!h_) return true;
    const cudaError_t status = cudaEventQuery(h_->e);
    if (status == cudaErrorNotReady) return false;
    FEDSHARD_CUDA_TRY(status);
    return true;
  }

 private:
  struct holder {
    holder(std::shared_ptr<detail::event_pool> p, cudaEvent_t ev) : pool(std::move(p)), e(ev) {}
    holder(const holder&) = delete;
    holder& operator=(const holder&) = delete;
    ~holder() { pool->release(e); }
    std::shared_ptr<detail::event_pool> pool;
    cudaEvent_t e;
  };
  std::shared_ptr<holder> h_;
};

/// A stream of cuda_space: an owned non-blocking CUDA stream of the space's device.
class cuda_stream {
 public:
  /// A new non-blocking stream on `device`.
  explicit cuda_stream(int device) : device_(device), s_(make(device)) {}

  /// The raw handle (for cuBLAS, LibTorch and other libraries that enqueue work).
  cudaStream_t get() const noexcept { return s_.get(); }
  /// The device of the stream.
  int device() const noexcept { return device_; }

 private:
  static stream make(int device) {
    device_guard guard(device);
    return stream(cudaStreamNonBlocking);
  }
  int device_;
  stream s_;
};

/// The MemorySpace of one CUDA device; see the file comment. Not copyable (buffers point at
/// it); its member functions may be called from several host threads.
class cuda_space {
 public:
  static constexpr std::string_view name = "cuda";
  static constexpr bool host_accessible = false;

  using stream = cuda_stream;
  using event = cuda_event;
  template <class T>
  using buffer = space::basic_buffer<T, cuda_space>;

  /// The space of the calling thread's current device.
  cuda_space() : cuda_space(current_device()) {}
  /// The space of CUDA device `device`.
  explicit cuda_space(int device)
      : device_(check_device(device)),
        alloc_(detail::device_memory{device}),
        events_(std::make_shared<detail::event_pool>(device)) {}
  cuda_space(const cuda_space&) = delete;
  cuda_space& operator=(const cuda_space&) = delete;
  ~cuda_space() = default;

  /// The CUDA device of the space.
  int device() const noexcept { return device_; }

  /// n zero elements of T in device memory (see the file comment).
  template <class T>
  buffer<T> allocate(std::size_t n) {
    FEDSHARD_EXPECTS(n <= ~std::size_t{0} / sizeof(T), "cuda_space::allocate: ", n, " elements of ",
                     sizeof(T), " bytes do not fit in std::size_t");
    const space::block b = alloc_.allocate(n * sizeof(T));
    buffer<T> out(*this, b, n);
    if (b.ptr != nullptr) {
      device_guard guard(device_);
      std::lock_guard lock(zero_mu_);
      if (!zero_stream_) zero_stream_ = std::make_unique<cuda_stream>(device_);
      FEDSHARD_CUDA_TRY(cudaMemsetAsync(b.ptr, 0, n * sizeof(T), zero_stream_->get()));
      FEDSHARD_CUDA_TRY(cudaStreamSynchronize(zero_stream_->get()));
    }
    return out;
  }
  /// cudaMalloc calls made so far.
  std::int64_t system_allocations() const { return alloc_.system_allocations(); }
  /// Bytes of device memory held in the cache.
  std::size_t cached_bytes() const { return alloc_.cached_bytes(); }
  /// Takes a buffer's block back into the cache (called by the buffer).
  void release_block(space::block b) noexcept { alloc_.release(b); }

  /// A new non-blocking stream of the device.
  stream make_stream() { return stream(device_); }
  /// An event after the work queued on st so far.
  event record(stream& st) {
    device_guard guard(device_);
    return event::record(events_, st.get());
  }
  /// st's later work waits for ev (the host does not wait).
  void wait(stream& st, const event& ev) {
    device_guard guard(device_);
    ev.wait_on(st.get());
  }
  /// The host waits for ev.
  void synchronize(const event& ev) { ev.synchronize(); }
  /// The host waits for the work queued on st.
  void synchronize(stream& st) { FEDSHARD_CUDA_TRY(cudaStreamSynchronize(st.get())); }
  /// True once ev's work has completed.
  bool ready(const event& ev) const { return ev.ready(); }

  /// to = from, in st's order (both in device memory, of any device).
  void copy(stream& st, const_buffer_view from, buffer_view to) {
    space::detail::check_copy(from, to, "cuda_space::copy");
    memcpy_async(st, from, to);
  }
  /// host = from (host memory; pageable or pinned).
  void to_host(stream& st, const_buffer_view from, buffer_view host) {
    space::detail::check_copy(from, host, "cuda_space::to_host");
    memcpy_async(st, from, host);
  }
  /// to = host (host memory stays untouched until st passes the copy).
  void from_host(stream& st, const_buffer_view host, buffer_view to) {
    space::detail::check_copy(host, to, "cuda_space::from_host");
    memcpy_async(st, host, to);
  }
  /// out = in converted to out's dtype (kernels::cast_fn).
  void cast(stream& st, const_buffer_view in, buffer_view out) {
    kernels::detail::check_cast_views(in, out, "cuda_space::cast");
    device_guard guard(device_);
    gpu::cast(in, out, st.get());
  }
  /// Every element of out = value converted to out's dtype (kernels::cast_fn<double, T>).
  void fill(stream& st, buffer_view out, double value) {
    FEDSHARD_EXPECTS(is_valid(out.type), "cuda_space::fill: invalid dtype ",
                     static_cast<int>(out.type));
    FEDSHARD_EXPECTS(out.count == 0 || out.data != nullptr,
                     "cuda_space::fill: null data pointer for ", out.count, " elements");
    if (out.count == 0) return;
    device_guard guard(device_);
    visit(out.type, [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T v = kernels::cast_fn<double, T>{}(value);
      const std::uint64_t blocks = (out.count + block_threads - 1) / block_threads;
      detail::fill_kernel<T><<<gpu::detail::grid_for(blocks), block_threads, 0, st.get()>>>(
          static_cast<T*>(out.data), out.count, v);
      detail::check_launch("fedshard::gpu::cuda_space::fill");
    });
  }
  /// f(s0[i], s1[i], ...) for every i on the device: f is a FEDSHARD_HOST_DEVICE element
  /// functor taking float& for the std::span<float> it updates and float for the
  /// std::span<const float> it reads; every span has the first's size.
  template <class F, class... T>
  void for_each(stream& st, F f, std::span<T>... spans) {
    static_assert(sizeof...(T) >= 1, "cuda_space::for_each: pass at least one span");
    static_assert((std::is_same_v<std::remove_const_t<T>, float> && ...),
                  "cuda_space::for_each: the spans hold float");
    const std::size_t n = space::detail::common_size("cuda_space::for_each", spans...);
    if (n == 0) return;
    device_guard guard(device_);
    gpu::detail::for_each("cuda_space::for_each", st.get(), n, f, spans.data()...);
  }

  /// out[j] = in[idx[j] - base] for j < idx.size() on the device (kernels::gather_index_fn);
  /// the indices must lie in [base, base + in.size()) (not checked on the device).
  void gather_index(stream& st, std::span<const float> in, std::span<const std::uint32_t> idx,
                    std::uint32_t base, std::span<float> out) {
    FEDSHARD_EXPECTS(idx.size() == out.size(),
                     "cuda_space::gather_index: expected as many "
                     "indices as packed elements (",
                     out.size(), "), found ", idx.size());
    launch_index(st, kernels::gather_index_fn<float>{in.data(), idx.data(), base, out.data()},
                 idx.size(), "fedshard::gpu::cuda_space::gather_index");
  }
  /// out[idx[j] - base] = in[j] for j < idx.size() on the device (kernels::scatter_index_fn);
  /// the indices must lie in [base, base + out.size()) (not checked on the device).
  void scatter_index(stream& st, std::span<const float> in, std::span<const std::uint32_t> idx,
                     std::uint32_t base, std::span<float> out) {
    FEDSHARD_EXPECTS(idx.size() == in.size(),
                     "cuda_space::scatter_index: expected as many "
                     "indices as packed elements (",
                     in.size(), "), found ", idx.size());
    launch_index(st, kernels::scatter_index_fn<float>{in.data(), idx.data(), base, out.data()},
                 idx.size(), "fedshard::gpu::cuda_space::scatter_index");
  }

  /// The pool the space's events come from (shared with communicators of the device).
  const std::shared_ptr<detail::event_pool>& event_pool() const noexcept { return events_; }

 private:
  template <class F>
  void launch_index(stream& st, F f, std::size_t n, const char* what) {
    if (n == 0) return;
    device_guard guard(device_);
    const std::uint64_t blocks = (n + block_threads - 1) / block_threads;
    detail::index_kernel<F><<<gpu::detail::grid_for(blocks), block_threads, 0, st.get()>>>(f, n);
    detail::check_launch(what);
  }

  static int check_device(int device) {
    const int n = device_count();
    FEDSHARD_EXPECTS(device >= 0 && device < n, "cuda_space: device ", device,
                     " does not exist (this process sees ", n, " CUDA devices)");
    return device;
  }

  void memcpy_async(stream& st, const_buffer_view from, buffer_view to) {
    if (to.count == 0 || from.data == to.data) return;
    device_guard guard(device_);
    FEDSHARD_CUDA_TRY(
        cudaMemcpyAsync(to.data, from.data, to.size_bytes(), cudaMemcpyDefault, st.get()));
  }

  int device_;
  space::caching_allocator<detail::device_memory> alloc_;
  std::shared_ptr<detail::event_pool> events_;
  std::mutex zero_mu_;
  std::unique_ptr<cuda_stream> zero_stream_;
};

static_assert(space::MemorySpace<cuda_space>);

}  // namespace fedshard::gpu
