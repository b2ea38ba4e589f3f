#pragma once
/// Norms and finiteness checks of device arrays with cub::DeviceReduce: the sum of
/// squares (squared L2 norm), the largest magnitude (L-infinity norm) and the number of
/// non-finite elements, of f32, f64, bf16 and f16 arrays.
///
/// Elements are converted with kernels::cast_fn to double and the sums accumulate in double,
/// so the result is within a few ulps of double of the exact sum for any order; the order
/// is CUB's (fixed for a given device, size and CUB version), not the host's. max_abs is
/// exact and propagates NaN. The *_async functions enqueue the reduction on a stream and
/// write the result to device memory, using a reduce_workspace for CUB's temporary
/// storage; the others also wait for the result and return it.

#include "fedshard/cuda/config.cuh"

#include <cuda_runtime.h>

#include <cub/device/device_reduce.cuh>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/cuda/device_buffer.cuh"
#include "fedshard/cuda/error.cuh"
#include "fedshard/error.hpp"
#include "fedshard/kernels/cast.hpp"

namespace fedshard::gpu {

/// CUB's temporary storage, kept between reductions (grows, never shrinks). Not for
/// reductions in flight on two streams at once.
class reduce_workspace {
 public:
  /// At least `bytes` bytes of device memory, valid until the next call.
  void* reserve(std::size_t bytes) {
    if (bytes > temp_.size()) {
      temp_ = device_buffer<std::byte>();  // free first: cudaFree waits for users of the old one
      temp_ = device_buffer<std::byte>::uninitialized(bytes);
    }
    return temp_.data();
  }

 private:
  device_buffer<std::byte> temp_;
};

namespace detail {

/// x converted exactly to double.
template <class T>
FEDSHARD_HOST_DEVICE inline double to_double(T x) noexcept {
  return kernels::cast_fn<T, double>{}(x);
}

template <class T>
struct square_op {
  FEDSHARD_HOST_DEVICE double operator()(T x) const noexcept {
    const double d = to_double(x);
    return d * d;
  }
};

template <class T>
struct magnitude_op {
  FEDSHARD_HOST_DEVICE double operator()(T x) const noexcept {
    const auto bits = ::fedshard::detail::bit_cast<std::uint64_t>(to_double(x));
    return ::fedshard::detail::bit_cast<double>(bits & 0x7fffffffffffffffull);
  }
};

/// 1 for NaN and infinities, 0 otherwise (an exponent of all ones, tested on the bits).
template <class T>
struct nonfinite_op {
  FEDSHARD_HOST_DEVICE unsigned long long operator()(T x) const noexcept {
    const auto bits = ::fedshard::detail::bit_cast<std::uint64_t>(to_double(x));
    return (bits & 0x7ff0000000000000ull) == 0x7ff0000000000000ull ? 1ull : 0ull;
  }
};

struct plus_op {
  template <class A>
  FEDSHARD_HOST_DEVICE A operator()(A a, A b) const noexcept {
    return a + b;
  }
};

/// max that propagates NaN from either side.
struct max_nan_op {
  FEDSHARD_HOST_DEVICE double operator()(double a, double b) const noexcept {
    return (a != a || a > b) ? a : b;
  }
};

template <class T, class R, class Reduce, class Transform>
void transform_reduce(std::span<const T> x, R* result, Reduce reduce, Transform transform, R init,
                      reduce_workspace& ws, cudaStream_t stream, const char* what) {
  FEDSHARD_EXPECTS(result != nullptr, what, ": null result pointer");
  FEDSHARD_EXPECTS(x.empty() || x.data() != nullptr, what, ": null data pointer for ", x.size(),
                   " elements");
  const auto n = static_cast<std::int64_t>(x.size());
  std::size_t bytes = 0;
  FEDSHARD_CUDA_TRY(cub::DeviceReduce::TransformReduce(nullptr, bytes, x.data(), result, n, reduce,
                                                       transform, init, stream));
  void* temp = ws.reserve(bytes);
  FEDSHARD_CUDA_TRY(cub::DeviceReduce::TransformReduce(temp, bytes, x.data(), result, n, reduce,
                                                       transform, init, stream));
}

/// Runs enqueue(x, result, ws, stream), one of the *_async reductions below, into a scratch
/// device value with a scratch workspace, and returns the value (waits for stream).
template <class R, class T>
R reduce_now(void (*enqueue)(std::span<T>, R*, reduce_workspace&, cudaStream_t), std::span<T> x,
             cudaStream_t stream) {
  device_buffer<R> result = device_buffer<R>::uninitialized(1);
  reduce_workspace ws;
  enqueue(x, result.data(), ws, stream);
  R value{};
  FEDSHARD_CUDA_TRY(
      cudaMemcpyAsync(&value, result.data(), sizeof(R), cudaMemcpyDeviceToHost, stream));
  FEDSHARD_CUDA_TRY(cudaStreamSynchronize(stream));
  return value;
}

}  // namespace detail

/// Enqueues *result = sum of x[i]^2 (in double); result is device memory.
template <class T>
void sum_of_squares_async(std::span<T> x, double* result, reduce_workspace& ws,
                          cudaStream_t stream) {
  using U = std::remove_const_t<T>;
  detail::transform_reduce(std::span<const U>(x), result, detail::plus_op{}, detail::square_op<U>{},
                           0.0, ws, stream, "gpu::sum_of_squares_async");
}

/// Enqueues *result = max of |x[i]| (NaN if any element is NaN, 0 for an empty x).
template <class T>
void max_abs_async(std::span<T> x, double* result, reduce_workspace& ws, cudaStream_t stream) {
  using U = std::remove_const_t<T>;
  detail::transform_reduce(std::span<const U>(x), result, detail::max_nan_op{},
                           detail::magnitude_op<U>{}, 0.0, ws, stream, "gpu::max_abs_async");
}

/// Enqueues *result = the number of NaN and infinite elements of x.
template <class T>
void count_nonfinite_async(std::span<T> x, unsigned long long* result, reduce_workspace& ws,
                           cudaStream_t stream) {
  using U = std::remove_const_t<T>;
  detail::transform_reduce(std::span<const U>(x), result, detail::plus_op{},
                           detail::nonfinite_op<U>{}, 0ull, ws, stream,
                           "gpu::count_nonfinite_async");
}

/// The sum of squares of x; waits for stream.
template <class T>
double sum_of_squares(std::span<T> x, cudaStream_t stream) {
  return detail::reduce_now(&sum_of_squares_async<T>, x, stream);
}

/// The L2 norm of x, sqrt(sum_of_squares(x)); waits for stream.
template <class T>
double l2_norm(std::span<T> x, cudaStream_t stream) {
  return std::sqrt(sum_of_squares(x, stream));
}

/// The largest |x[i]| (NaN if any element is NaN); waits for stream.
template <class T>
double max_abs(std::span<T> x, cudaStream_t stream) {
  return detail::reduce_now(&max_abs_async<T>, x, stream);
}

/// True when no element of x is NaN or infinite; waits for stream.
template <class T>
bool all_finite(std::span<T> x, cudaStream_t stream) {
  return detail::reduce_now(&count_nonfinite_async<T>, x, stream) == 0;
}

namespace detail {
template <class F>
decltype(auto) visit_view(const_buffer_view x, const char* what, F&& f) {
  FEDSHARD_EXPECTS(is_valid(x.type), what, ": invalid dtype ", static_cast<int>(x.type));
  return visit(x.type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return f(std::span<const T>(static_cast<const T*>(x.data), x.count));
  });
}
}  // namespace detail

/// The L2 norm of a type-erased device buffer; waits for stream.
inline double l2_norm(const_buffer_view x, cudaStream_t stream) {
  return detail::visit_view(x, "gpu::l2_norm", [&](auto s) { return l2_norm(s, stream); });
}

/// The largest magnitude in a type-erased device buffer; waits for stream.
inline double max_abs(const_buffer_view x, cudaStream_t stream) {
  return detail::visit_view(x, "gpu::max_abs", [&](auto s) { return max_abs(s, stream); });
}

/// True when a type-erased device buffer holds no NaN or infinity; waits for stream.
inline bool all_finite(const_buffer_view x, cudaStream_t stream) {
  return detail::visit_view(x, "gpu::all_finite", [&](auto s) { return all_finite(s, stream); });
}

}  // namespace fedshard::gpu
