#pragma once
/// The host loop of the element-wise kernels: an element functor of kernels/ (sgd_update,
/// adamw_update, the outer_*_update functors) applied to element i of a few parallel host
/// arrays, for every i. The CUDA kernels apply the same functors (cuda/kernels.cuh).

#include <cstddef>

namespace fedshard::kernels {

/// f(p[i]...) for every i < n, in order. f takes T& for the arrays it updates (T*) and T
/// for those it only reads (const T*). Every array has n elements; they do not overlap,
/// except that a read array may be an updated one when f reads its element first. f is
/// copied, so that a store through p cannot change it and the loop can vectorise.
template <class F, class... T>
inline void for_each_element(F f, std::size_t n, T*... p) noexcept {
  for (std::size_t i = 0; i < n; ++i) f(p[i]...);
}

}  // namespace fedshard::kernels
