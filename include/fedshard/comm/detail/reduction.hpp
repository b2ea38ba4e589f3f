#pragma once
/// The rank-order reduction of the host backends (inproc, mpi and any later one).
///
/// Every element is combined over ranks 0, 1, ..., n-1 in that order, in accum_t<T> (float for
/// f32, bf16 and f16, double for f64); avg divides the sum by n; min and max propagate NaN;
/// the result is rounded once to T. Backends that reduce through this file are bit-identical
/// to each other on every rank and run, whoever reduces which element.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "fedshard/config.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/kernels/cast.hpp"
#include "fedshard/kernels/for_each.hpp"

namespace fedshard::detail {

/// The type the rank-order reduction accumulates T in.
template <class T>
using accum_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

/// fedshard::combine for an op known at compile time.
template <reduce_op Op>
struct combine_fn {
  template <class A>
  A operator()(A a, A b) const {
    return combine(Op, a, b);
  }
};

/// Calls f(std::integral_constant<reduce_op, op>{}) (sum for an invalid op).
template <class F>
decltype(auto) visit_op(reduce_op op, F&& f) {
  switch (op) {
    case reduce_op::avg: return f(std::integral_constant<reduce_op, reduce_op::avg>{});
    case reduce_op::min: return f(std::integral_constant<reduce_op, reduce_op::min>{});
    case reduce_op::max: return f(std::integral_constant<reduce_op, reduce_op::max>{});
    case reduce_op::sum: break;
  }
  return f(std::integral_constant<reduce_op, reduce_op::sum>{});
}

/// Elements reduced per pass: the accumulator stays in L1.
inline constexpr std::int64_t reduce_block_elems = 2048;

/// acc = combine(acc, in), the input widened as an operand (a NaN keeps its quiet bit as it
/// is: the result is rounded back to T, which quiets it).
template <class T, reduce_op Op>
struct accumulate_update {
  void operator()(accum_t<T>& acc, T in) const noexcept {
    acc = combine(Op, acc, kernels::operand_fn<T, accum_t<T>>{}(in));
  }
};

/// acc = in, widened as an operand.
template <class T>
struct widen_update {
  void operator()(accum_t<T>& acc, T in) const noexcept {
    acc = kernels::operand_fn<T, accum_t<T>>{}(in);
  }
};

/// acc = acc / n (avg).
template <class A>
struct divide_update {
  A n;
  void operator()(A& acc) const noexcept { acc = acc / n; }
};

/// out = acc rounded to T.
template <class T>
struct narrow_update {
  void operator()(T& out, accum_t<T> acc) const noexcept { out = T(acc); }
};

/// Reduces len elements of n ranks' inputs in rank order, where input(p) points at the first
/// element of rank p, and stores the result to each of outs[0..nout). Every pass over a block
/// is a loop of kernels/for_each.hpp, compiled for each instruction set (the same bits on
/// each: one IEEE operation per element and pass, in the same order).
template <class T, reduce_op Op, class Input>
void reduce_rank_order(const Input& input, int n, T* const* outs, int nout, std::int64_t len) {
  using A = accum_t<T>;
  const kernels::isa which = kernels::active_isa();
  A acc[reduce_block_elems];
  for (std::int64_t b = 0; b < len; b += reduce_block_elems) {
    const auto m = static_cast<std::size_t>(std::min(reduce_block_elems, len - b));
    kernels::for_each_element_on(which, widen_update<T>{}, m, acc, input(0) + b);
    for (int p = 1; p < n; ++p)
      kernels::for_each_element_on(which, accumulate_update<T, Op>{}, m, acc, input(p) + b);
    if constexpr (Op == reduce_op::avg)
      kernels::for_each_element_on(which, divide_update<A>{static_cast<A>(n)}, m, acc);
    for (int p = 0; p < nout; ++p) {
      T* o = outs[p] + b;
      if constexpr (std::is_same_v<T, A>) {
        std::memcpy(o, acc, m * sizeof(T));
      } else {
        kernels::for_each_element_on(which, narrow_update<T>{}, m, o, static_cast<const A*>(acc));
      }
    }
  }
}

/// out[j] = op over p = 0..n-1, in rank order, of element j of block p, for j < len, where
/// the blocks lie `stride` bytes apart from `blocks`: the layout in which a transport receives
/// every rank's part.
inline void reduce_blocks(dtype t, reduce_op op, const void* blocks, std::size_t stride, int n,
                          void* out, std::int64_t len) {
  if (len <= 0) return;
  visit(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto* base = static_cast<const unsigned char*>(blocks);
    const auto input = [&](int p) {
      return static_cast<const T*>(
          static_cast<const void*>(base + stride * static_cast<std::size_t>(p)));
    };
    T* const o = static_cast<T*>(out);
    visit_op(op,
             [&](auto opc) { reduce_rank_order<T, decltype(opc)::value>(input, n, &o, 1, len); });
  });
}

/// Elements [begin, end) of a range.
struct elem_range {
  std::int64_t begin = 0;
  std::int64_t end = 0;
};

/// Elements per chunk when n ranks split count elements on cache-line boundaries.
inline std::int64_t chunk_elems(std::int64_t count, int n, std::size_t elem) {
  const auto line = std::max<std::int64_t>(1, static_cast<std::int64_t>(cache_line_bytes / elem));
  const std::int64_t per = (count + n - 1) / n;
  return (per + line - 1) / line * line;
}

/// The chunk of rank p when n ranks split count elements on cache-line boundaries (empty for
/// the ranks past the end).
inline elem_range chunk_of(std::int64_t count, int n, std::size_t elem, int p) {
  const std::int64_t c = chunk_elems(count, n, elem);
  const std::int64_t begin = std::min(count, c * p);
  return {begin, std::min(count, begin + c)};
}

}  // namespace fedshard::detail
