#pragma once
/// Scaling and axpy: per-element functors shared by host loops and CUDA kernels, and host
/// loops over typed spans and type-erased buffers.
///
/// Arithmetic runs in accum_t (float, or double when an operand is f64) and rounds once to
/// the element type, to nearest even.

#include <cstddef>
#include <span>
#include <type_traits>

#include "fedshard/config.hpp"
#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/error.hpp"
#include "fedshard/kernels/cast.hpp"
#include "fedshard/kernels/for_each.hpp"

namespace fedshard::kernels {

/// x -> x * alpha.
template <class T>
struct scale_fn {
  accum_t<T> alpha;
  FEDSHARD_HOST_DEVICE constexpr T operator()(T x) const noexcept {
    return cast_fn<accum_t<T>, T>{}(operand_fn<T, accum_t<T>>{}(x)*alpha);
  }
};

/// (x, y) -> y + a * x, computed in accum_t<X, Y> and rounded to Y.
template <class X, class Y>
struct axpy_fn {
  accum_t<X, Y> a;
  FEDSHARD_HOST_DEVICE constexpr Y operator()(X x, Y y) const noexcept {
    using A = accum_t<X, Y>;
    return cast_fn<A, Y>{}(operand_fn<Y, A>{}(y) + a * operand_fn<X, A>{}(x));
  }
};

namespace detail {

/// x = scale_fn(x), as an element update of kernels/for_each.hpp.
template <class T>
struct scale_update {
  scale_fn<T> f;
  FEDSHARD_HOST_DEVICE void operator()(T& x) const noexcept { x = f(x); }
};

/// y = axpy_fn(x, y), as an element update of kernels/for_each.hpp.
template <class X, class Y>
struct axpy_update {
  axpy_fn<X, Y> f;
  FEDSHARD_HOST_DEVICE void operator()(X x, Y& y) const noexcept { y = f(x, y); }
};

/// The host loop of scale (compiled for each instruction set, kernels/for_each.hpp).
template <class T>
void scale_n(T* x, std::size_t n, double alpha) noexcept {
  for_each_element(scale_update<T>{{static_cast<accum_t<T>>(alpha)}}, n, x);
}

/// The host loop of axpy for one pair of element types (compiled for each instruction set);
/// a function of its own, as weighted_sum_n is. x may be y itself (each element reads x
/// before it writes y).
template <class X, class Y>
[[gnu::noinline]] void axpy_n(double a, const X* x, Y* y, std::size_t n) noexcept {
  for_each_element(axpy_update<X, Y>{{static_cast<accum_t<X, Y>>(a)}}, n, x, y);
}

}  // namespace detail

/// x[i] *= alpha for every element; alpha is rounded to accum_t<T> first.
template <class T>
void scale(std::span<T> x, double alpha) {
  static_assert(!std::is_const_v<T>, "fedshard::kernels::scale: x must be writable");
  detail::scale_n(x.data(), x.size(), alpha);
}

/// x[i] *= alpha for every element of a type-erased buffer.
inline void scale(buffer_view x, double alpha) {
  FEDSHARD_EXPECTS(is_valid(x.type), "scale: invalid dtype ", static_cast<int>(x.type));
  FEDSHARD_EXPECTS(x.count == 0 || x.data != nullptr, "scale: null data pointer for ", x.count,
                   " elements");
  visit(x.type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    detail::scale_n(static_cast<T*>(x.data), x.count, alpha);
  });
}

/// y[i] += a * x[i]; sizes must match, and x must not overlap y unless it is y itself.
template <class X, class Y>
void axpy(double a, std::span<X> x, std::span<Y> y) {
  static_assert(!std::is_const_v<Y>, "fedshard::kernels::axpy: y must be writable");
  FEDSHARD_EXPECTS(x.size() == y.size(), "axpy: x has ", x.size(), " elements, y has ", y.size(),
                   " (sizes must match)");
  detail::axpy_n<std::remove_const_t<X>, Y>(a, x.data(), y.data(), x.size());
}

/// y[i] += a * x[i] on type-erased buffers of any dtypes.
inline void axpy(double a, const_buffer_view x, buffer_view y) {
  FEDSHARD_EXPECTS(is_valid(x.type) && is_valid(y.type), "axpy: invalid dtype (x ",
                   static_cast<int>(x.type), ", y ", static_cast<int>(y.type), ")");
  FEDSHARD_EXPECTS(x.count == y.count, "axpy: x has ", x.count, " elements of ", to_string(x.type),
                   ", y has ", y.count, " elements of ", to_string(y.type), " (counts must match)");
  FEDSHARD_EXPECTS(x.count == 0 || (x.data != nullptr && y.data != nullptr),
                   "axpy: null data pointer for ", x.count, " elements");
  visit(x.type, y.type, [&](auto xt, auto yt) {
    using X = typename decltype(xt)::type;
    using Y = typename decltype(yt)::type;
    detail::axpy_n(a, static_cast<const X*>(x.data), static_cast<Y*>(y.data), x.count);
  });
}

}  // namespace fedshard::kernels
