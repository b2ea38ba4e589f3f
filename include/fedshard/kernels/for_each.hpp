#pragma once
/// The host loop of the element-wise kernels: an element functor of kernels/ (sgd_update,
/// adamw_update, the outer_*_update functors) applied to element i of a few parallel host
/// arrays, for every i. The CUDA kernels apply the same functors (cuda/kernels.cuh).
///
/// The loop is compiled once per instruction set (kernels/dispatch.hpp) and runs the widest
/// the CPU supports; every version gives the same bits.
///
/// Where the compiler cannot vectorise a functor's loop at the default flags (a square root:
/// under GCC's default -fmath-errno its errno branch keeps the loop scalar), the functor's
/// kernel declares hand-vectorised blocks by specialising vector_blocks<F>: the loop runs
/// them first, then f on the elements they left. Each lane of a block must run f's
/// operations in f's order with IEEE-exact instructions, so the bits stay the portable ones.

#include <cstddef>

#include "fedshard/kernels/dispatch.hpp"

#if FEDSHARD_DISPATCH
#include <immintrin.h>
#endif

namespace fedshard::kernels {

/// The hand-vectorised blocks of element functor F (see the file comment). A specialisation
/// sets `defined` and provides, for the arrays of for_each_element,
///   static std::size_t avx2(const F&, std::size_t n, T*... p)    (FEDSHARD_TARGET_AVX2)
///   static std::size_t avx512(const F&, std::size_t n, T*... p)  (FEDSHARD_TARGET_AVX512)
/// each running f on a leading run of the n elements and returning its length.
template <class F>
struct vector_blocks {
  static constexpr bool defined = false;
};

namespace detail {

#if FEDSHARD_DISPATCH
/// The IEEE square root of 8 or 16 lanes, for vector_blocks (the AVX-512 one with every lane
/// masked in: the same instruction, without GCC 12's -Wmaybe-uninitialized on the unmasked
/// intrinsic's undefined source operand).
FEDSHARD_TARGET_AVX2 FEDSHARD_ALWAYS_INLINE inline __m256 sqrt_ps(__m256 a) noexcept {
  return _mm256_sqrt_ps(a);
}
FEDSHARD_TARGET_AVX512 FEDSHARD_ALWAYS_INLINE inline __m512 sqrt_ps(__m512 a) noexcept {
  return _mm512_mask_sqrt_ps(a, static_cast<__mmask16>(0xFFFF), a);
}
#endif

template <class F, class... T>
FEDSHARD_TARGET_PORTABLE inline void for_each_portable(F f, std::size_t n, T*... p) noexcept {
  for (std::size_t i = 0; i < n; ++i) f(p[i]...);
}
#if FEDSHARD_DISPATCH
template <class F, class... T>
FEDSHARD_TARGET_AVX2 inline void for_each_avx2(F f, std::size_t n, T*... p) noexcept {
  for (std::size_t i = 0; i < n; ++i) f(p[i]...);
}
template <class F, class... T>
FEDSHARD_TARGET_AVX512 inline void for_each_avx512(F f, std::size_t n, T*... p) noexcept {
  for (std::size_t i = 0; i < n; ++i) f(p[i]...);
}
#endif

}  // namespace detail

/// f(p[i]...) for every i < n, in order, with the instruction set `which`. f takes T& for the
/// arrays it updates (T*) and T for those it only reads (const T*). Every array has n
/// elements; they do not overlap, except that a read array may be an updated one when f
/// reads its element first. f is copied, so that a store through p cannot change it and
/// the loop can vectorise.
template <class F, class... T>
inline void for_each_element_on(isa which, F f, std::size_t n, T*... p) noexcept {
#if FEDSHARD_DISPATCH
  if constexpr (vector_blocks<F>::defined) {
    std::size_t done = 0;
    if (which == isa::avx512 && detected_isa() >= isa::avx512)
      done = vector_blocks<F>::avx512(f, n, p...);
    else if (which >= isa::avx2 && detected_isa() >= isa::avx2)
      done = vector_blocks<F>::avx2(f, n, p...);
    n -= done;
    ((p += done), ...);
  }
  if (which == isa::avx512 && detected_isa() >= isa::avx512)
    return detail::for_each_avx512(f, n, p...);
  if (which >= isa::avx2 && detected_isa() >= isa::avx2) return detail::for_each_avx2(f, n, p...);
#else
  (void)which;
#endif
  detail::for_each_portable(f, n, p...);
}

/// for_each_element_on(active_isa(), f, n, p...).
template <class F, class... T>
inline void for_each_element(F f, std::size_t n, T*... p) noexcept {
  for_each_element_on(active_isa(), f, n, p...);
}

}  // namespace fedshard::kernels
