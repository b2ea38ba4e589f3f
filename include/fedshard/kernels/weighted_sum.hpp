#pragma once
/// Weighted aggregation of K shards, out[i] = sum_k w_k * in_k[i]: the core of weighted
/// federated averaging. A per-element functor shared by host loops and CUDA kernels, and a
/// checked host loop over type-erased buffers.
///
/// The sum accumulates in accum_t<In, Out> (float, or double when f64 is involved), adds
/// the terms in k order (the same bits on every run and every rank) and rounds once to Out.
/// A zero weight skips its input entirely, so a NaN or infinity in an input that does not
/// take part does not poison the result.

#include <cstddef>
#include <span>
#include <string_view>

#include "fedshard/config.hpp"
#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/error.hpp"
#include "fedshard/kernels/cast.hpp"
#include "fedshard/kernels/for_each.hpp"
#include "fedshard/kernels/sgd.hpp"

namespace fedshard::kernels {

/// i -> sum over j < k of weights[j] * ins[j][i], rounded to Out; +0 when every weight is 0.
template <class In, class Out>
struct weighted_sum_fn {
  using accum = accum_t<In, Out>;
  const In* const* ins;
  const accum* weights;
  std::size_t k;

  FEDSHARD_HOST_DEVICE constexpr Out operator()(std::size_t i) const noexcept {
    accum sum = 0;
    bool first = true;
    for (std::size_t j = 0; j < k; ++j) {
      if (weights[j] == 0) continue;
      const accum term = detail::mul_rn(weights[j], operand_fn<In, accum>{}(ins[j][i]));
      sum = first ? term : detail::add_rn(sum, term);  // from the first term: keeps a -0 result
      first = false;
    }
    return cast_fn<accum, Out>{}(sum);
  }
};

namespace detail {

/// acc = w * in, the first term of weighted_sum_fn's sum.
template <class In, class A>
struct weighted_first_update {
  A w;
  void operator()(A& acc, In in) const noexcept { acc = mul_rn(w, operand_fn<In, A>{}(in)); }
};

/// acc = acc + w * in, a later term of weighted_sum_fn's sum.
template <class In, class A>
struct weighted_term_update {
  A w;
  void operator()(A& acc, In in) const noexcept {
    acc = add_rn(acc, mul_rn(w, operand_fn<In, A>{}(in)));
  }
};

/// out = acc rounded to Out.
template <class A, class Out>
struct weighted_store_update {
  void operator()(Out& out, A acc) const noexcept { out = cast_fn<A, Out>{}(acc); }
};

/// Elements weighted_sum_n sums per pass: its accumulator stays in L1.
inline constexpr std::size_t weighted_sum_block = 2048;

/// The host loop of weighted_sum for one pair of element types: weighted_sum_fn's sum, one
/// pass per input over blocks of weighted_sum_block elements (the same operations in the
/// same order, so the same bits), each pass a loop of kernels/for_each.hpp compiled for each
/// instruction set. A function of its own, so that its loops compile alike wherever the
/// dtype dispatch is inlined.
template <class In, class Out>
[[gnu::noinline]] void weighted_sum_n(std::span<const const_buffer_view> ins,
                                      std::span<const double> weights, Out* out, std::size_t n) {
  using accum = accum_t<In, Out>;
  const isa which = active_isa();
  accum acc[weighted_sum_block];
  for (std::size_t b = 0; b < n; b += weighted_sum_block) {
    const std::size_t m = n - b < weighted_sum_block ? n - b : weighted_sum_block;
    bool first = true;
    for (std::size_t j = 0; j < ins.size(); ++j) {
      const auto w = static_cast<accum>(weights[j]);
      if (w == 0) continue;
      const In* in = static_cast<const In*>(ins[j].data) + b;
      if (first)
        for_each_element_on(which, weighted_first_update<In, accum>{w}, m, acc, in);
      else
        for_each_element_on(which, weighted_term_update<In, accum>{w}, m, acc, in);
      first = false;
    }
    if (first)  // every weight is 0: +0
      for (std::size_t i = 0; i < m; ++i) acc[i] = accum{0};
    for_each_element_on(which, weighted_store_update<accum, Out>{}, m, out + b,
                        static_cast<const accum*>(acc));
  }
}

/// The checks of a type-erased weighted_sum, on the host and on the device: at least one
/// input and one weight per input, valid dtypes, inputs of one count and dtype, out of that
/// count, data where there are elements; `what` starts the message.
inline void check_weighted_sum_views(std::span<const const_buffer_view> ins,
                                     std::span<const double> weights, buffer_view out,
                                     std::string_view what) {
  FEDSHARD_EXPECTS(!ins.empty(), what, ": expected at least one input, got 0");
  FEDSHARD_EXPECTS(weights.size() == ins.size(), what, ": expected one weight per input (",
                   ins.size(), " inputs), got ", weights.size(), " weights");
  const const_buffer_view& first = ins[0];
  FEDSHARD_EXPECTS(is_valid(first.type) && is_valid(out.type), what, ": invalid dtype (input ",
                   static_cast<int>(first.type), ", output ", static_cast<int>(out.type), ")");
  for (std::size_t j = 0; j < ins.size(); ++j) {
    const const_buffer_view& in = ins[j];
    FEDSHARD_EXPECTS(in.count == first.count && in.type == first.type, what, ": input ", j, " has ",
                     in.count, " elements of ", to_string(in.type), ", input 0 has ", first.count,
                     " elements of ", to_string(first.type), " (inputs must match)");
    FEDSHARD_EXPECTS(in.count == 0 || in.data != nullptr, what, ": input ", j,
                     " has a null data pointer for ", in.count, " elements");
  }
  FEDSHARD_EXPECTS(out.count == first.count, what, ": output has ", out.count,
                   " elements, the inputs have ", first.count);
  FEDSHARD_EXPECTS(out.count == 0 || out.data != nullptr, what, ": null output data pointer for ",
                   out.count, " elements");
}

}  // namespace detail

/// out[i] = sum_k weights[k] * ins[k][i]. All inputs have the same count and dtype, out has
/// that count and any dtype, there is one weight per input and at least one input; weights
/// are rounded to the accumulation type first. out may be one of the inputs (same data,
/// count and dtype) but must not partly overlap one.
inline void weighted_sum(std::span<const const_buffer_view> ins, std::span<const double> weights,
                         buffer_view out) {
  detail::check_weighted_sum_views(ins, weights, out, "weighted_sum");
  visit(ins[0].type, out.type, [&](auto it, auto ot) {
    using In = typename decltype(it)::type;
    using Out = typename decltype(ot)::type;
    detail::weighted_sum_n<In>(ins, weights, static_cast<Out*>(out.data), out.count);
  });
}

}  // namespace fedshard::kernels
