#pragma once
/// Element-type conversions: a per-element functor shared by host loops and CUDA kernels,
/// and host loops over typed spans and type-erased buffers.
///
/// Every conversion rounds to nearest, ties to even, exactly once (f64 -> bf16/f16 too, as
/// from_accum does), and the results are bit for bit those of core/dtype.hpp: NaN stays
/// NaN (quiet, sign and the payload that fits kept), infinities and signed zeros are kept,
/// subnormals are produced and read exactly. The conversions from float to bf16 and f16 and
/// from f16 to float are rewritten here without branches so that host loops vectorise;
/// they assume the default floating-point rounding mode (to nearest).
///
/// The host loops are compiled once per instruction set (kernels/dispatch.hpp) and run the
/// widest the CPU supports; every version gives the same bits.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <type_traits>

#include "fedshard/config.hpp"
#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/error.hpp"
#include "fedshard/kernels/dispatch.hpp"

namespace fedshard::kernels {

/// The arithmetic type of kernels over the given element types: double if any is double,
/// else float (bf16 and f16 compute in float).
template <class... Ts>
using accum_t =
    std::conditional_t<(std::is_same_v<std::remove_cv_t<Ts>, double> || ...), double, float>;

namespace detail {

/// bf16(f).bits, written as selects so that host loops vectorise.
FEDSHARD_HOST_DEVICE constexpr std::uint16_t float_to_bf16_bits(float f) noexcept {
  const std::uint32_t u = ::fedshard::detail::bit_cast<std::uint32_t>(f);
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const std::uint32_t quiet_nan = (u >> 16) | 0x0040u;
  return static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

/// f16(f).bits, written without branches so that host loops vectorise. Subnormal results
/// come from one float addition that rounds |f| onto the 2^-24 grid (nearest even); it runs
/// for every element (on 0 where unused) because a compiler may not speculate a float
/// operation that it would otherwise move into a branch.
FEDSHARD_HOST_DEVICE constexpr std::uint16_t float_to_f16_bits(float f) noexcept {
  const std::uint32_t u = ::fedshard::detail::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t x = u & 0x7fffffffu;
  const bool is_nan = x > 0x7f800000u;
  const bool is_inf = !is_nan && x >= 0x477ff000u;  // >= 65520 rounds to infinity
  const bool is_normal = !is_nan && !is_inf && x >= 0x38800000u;
  const bool is_subnormal = x < 0x38800000u;
  const std::uint32_t normal =
      (((x + 0xfffu + ((x >> 13) & 1u)) >> 13) - (112u << 10)) & (0u - std::uint32_t{is_normal});
  const float tiny = ::fedshard::detail::bit_cast<float>(x & (0u - std::uint32_t{is_subnormal}));
  const std::uint32_t subnormal =
      ::fedshard::detail::bit_cast<std::uint32_t>(tiny + 0.5f) - 0x3f000000u;
  const std::uint32_t special = (0x7c00u & (0u - std::uint32_t{is_inf})) |
                                ((0x7e00u | ((x >> 13) & 0x3ffu)) & (0u - std::uint32_t{is_nan}));
  return static_cast<std::uint16_t>(sign | ((normal + subnormal) | special));
}

/// float(f16::from_bits(bits)), written without branches so that host loops vectorise; the
/// float subtraction that makes subnormals runs for every element (subtracting 0 where
/// unused), for the reason given above. Quiet = false skips setting a NaN's quiet bit (for
/// operand_fn).
template <bool Quiet = true>
FEDSHARD_HOST_DEVICE constexpr float f16_bits_to_float(std::uint16_t bits) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t em = bits & 0x7fffu;
  const std::uint32_t exp = em & 0x7c00u;
  const std::uint32_t sub_mask = 0u - std::uint32_t{exp == 0};
  // Normal: rebias. Subnormal m: (1 + m/1024) 2^-14 - 2^-14 = m 2^-24, exact.
  const std::uint32_t biased = (em << 13) + (112u << 23) + ((1u << 23) & sub_mask);
  const float value = ::fedshard::detail::bit_cast<float>(biased) -
                      ::fedshard::detail::bit_cast<float>((113u << 23) & sub_mask);
  const std::uint32_t inf_nan = 0x7f800000u & (0u - std::uint32_t{exp == 0x7c00u});
  const std::uint32_t quiet = Quiet ? 0x00400000u & (0u - std::uint32_t{em > 0x7c00u}) : 0u;
  return ::fedshard::detail::bit_cast<float>(
      sign | ::fedshard::detail::bit_cast<std::uint32_t>(value) | inf_nan | quiet);
}

}  // namespace detail

/// Converts one element of type From to type To, rounding to nearest even. The results
/// are those of the bf16/f16 constructors and float conversions of core/dtype.hpp (f64 ->
/// bf16/f16 rounds once, directly).
template <class From, class To>
struct cast_fn {
  FEDSHARD_HOST_DEVICE constexpr To operator()(From v) const noexcept {
    if constexpr (std::is_same_v<From, To>) {
      return v;
    } else if constexpr (std::is_same_v<From, f16>) {
      return cast_fn<float, To>{}(detail::f16_bits_to_float(v.bits));
    } else if constexpr (std::is_same_v<From, double>) {
      return from_accum<To>(v);  // rounds once, also to bf16 and f16
    } else if constexpr (std::is_same_v<To, double> || std::is_same_v<To, float>) {
      return static_cast<To>(static_cast<float>(v));  // exact
    } else if constexpr (std::is_same_v<To, bf16>) {
      return bf16::from_bits(detail::float_to_bf16_bits(static_cast<float>(v)));
    } else {
      return f16::from_bits(detail::float_to_f16_bits(static_cast<float>(v)));
    }
  }
};

/// Converts one element to A (float or double) as an operand of arithmetic, as scale_fn,
/// axpy_fn and weighted_sum_fn read their inputs: cast_fn's value, except that a NaN keeps
/// its quiet bit as it is. The arithmetic it feeds returns a quiet NaN either way, and a
/// 16-bit input widens without the work of quieting it.
template <class From, class A>
struct operand_fn {
  FEDSHARD_HOST_DEVICE constexpr A operator()(From v) const noexcept {
    if constexpr (std::is_same_v<From, bf16>)
      return static_cast<A>(
          ::fedshard::detail::bit_cast<float>(static_cast<std::uint32_t>(v.bits) << 16));
    else if constexpr (std::is_same_v<From, f16>)
      return static_cast<A>(detail::f16_bits_to_float<false>(v.bits));
    else
      return cast_fn<From, A>{}(v);
  }
};

namespace detail {

template <class From, class To>
FEDSHARD_TARGET_PORTABLE inline void cast_loop_portable(const From* __restrict in,
                                                        To* __restrict out,
                                                        std::size_t n) noexcept {
  const cast_fn<From, To> f;
  for (std::size_t i = 0; i < n; ++i) out[i] = f(in[i]);
}
#if FEDSHARD_DISPATCH
template <class From, class To>
FEDSHARD_TARGET_AVX2 inline void cast_loop_avx2(const From* __restrict in, To* __restrict out,
                                                std::size_t n) noexcept {
  const cast_fn<From, To> f;
  for (std::size_t i = 0; i < n; ++i) out[i] = f(in[i]);
}
template <class From, class To>
FEDSHARD_TARGET_AVX512 inline void cast_loop_avx512(const From* __restrict in, To* __restrict out,
                                                    std::size_t n) noexcept {
  const cast_fn<From, To> f;
  for (std::size_t i = 0; i < n; ++i) out[i] = f(in[i]);
}
#endif

/// out[i] = cast(in[i]) for i < n with the instruction set `which`, without checks; in and
/// out must not overlap (unless From and To are the same type: a copy, none in place).
template <class From, class To>
void cast_n_on(isa which, const From* in, To* out, std::size_t n) noexcept {
  if constexpr (std::is_same_v<From, To>) {
    (void)which;
    if (n != 0 && in != out) std::memcpy(out, in, n * sizeof(To));
  } else {
#if FEDSHARD_DISPATCH
    if (which == isa::avx512 && detected_isa() >= isa::avx512) return cast_loop_avx512(in, out, n);
    if (which >= isa::avx2 && detected_isa() >= isa::avx2) return cast_loop_avx2(in, out, n);
#else
    (void)which;
#endif
    cast_loop_portable(in, out, n);
  }
}

/// cast_n_on(active_isa(), in, out, n).
template <class From, class To>
void cast_n(const From* in, To* out, std::size_t n) noexcept {
  cast_n_on(active_isa(), in, out, n);
}

}  // namespace detail

/// cast(in, out) with the instruction set `which` (tests and benchmarks compare them).
template <class From, class To>
void cast_on(isa which, std::span<From> in, std::span<To> out) {
  static_assert(!std::is_const_v<To>, "fedshard::kernels::cast: the output must be writable");
  FEDSHARD_EXPECTS(in.size() == out.size(), "cast: input has ", in.size(), " elements, output has ",
                   out.size(), " (sizes must match)");
  detail::cast_n_on<std::remove_const_t<From>, To>(which, in.data(), out.data(), in.size());
}

/// Converts in into out element by element; sizes must match and the spans must not
/// overlap (unless they are the same span of the same type).
template <class From, class To>
void cast(std::span<From> in, std::span<To> out) {
  cast_on(active_isa(), in, out);
}

namespace detail {

/// The checks of a type-erased cast, on the host and on the device: valid dtypes, equal
/// counts, data where there are elements; `what` starts the message.
inline void check_cast_views(const_buffer_view in, buffer_view out, std::string_view what) {
  FEDSHARD_EXPECTS(is_valid(in.type) && is_valid(out.type), what, ": invalid dtype (input ",
                   static_cast<int>(in.type), ", output ", static_cast<int>(out.type), ")");
  FEDSHARD_EXPECTS(in.count == out.count, what, ": input has ", in.count, " elements of ",
                   to_string(in.type), ", output has ", out.count, " elements of ",
                   to_string(out.type), " (counts must match)");
  FEDSHARD_EXPECTS(in.count == 0 || (in.data != nullptr && out.data != nullptr), what,
                   ": null data pointer for ", in.count, " elements");
}

}  // namespace detail

/// Converts a type-erased buffer into another of any dtype; same dtype is a plain copy.
inline void cast(const_buffer_view in, buffer_view out) {
  detail::check_cast_views(in, out, "cast");
  visit(in.type, out.type, [&](auto from, auto to) {
    using From = typename decltype(from)::type;
    using To = typename decltype(to)::type;
    detail::cast_n(static_cast<const From*>(in.data), static_cast<To*>(out.data), in.count);
  });
}

}  // namespace fedshard::kernels
