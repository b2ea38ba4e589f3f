#pragma once
/// codec::cast<T>: each f32 element sent as one element of type T (float, bf16, f16 or
/// fp8_e4m3), rounded to nearest even; the receiver adds the exact value of each.
///
/// The conversions are those of kernels/cast.hpp (bf16, f16) and core/fp8.hpp (fp8_e4m3),
/// bit for bit. bf16 and f16 keep NaN, infinities and signed zeros; f16 overflows to
/// infinity beyond 65504; fp8_e4m3 saturates to +-448 and has no scaling, so values are
/// expected in its range (an int8_block or a scaled codec suits arbitrary deltas better).
/// Wire: n elements of T, sizeof(T) * n bytes.
///
/// The host loops are compiled once per instruction set (kernels/dispatch.hpp) and run the
/// widest the CPU supports; every version gives the same bits.

#include <cstddef>
#include <span>
#include <string_view>
#include <type_traits>

#include "fedshard/codec/codec.hpp"
#include "fedshard/config.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/fp8.hpp"
#include "fedshard/kernels/cast.hpp"
#include "fedshard/kernels/dispatch.hpp"
#include "fedshard/kernels/for_each.hpp"

namespace fedshard::codec {

namespace detail {

/// The wire element T of one f32 value (round to nearest even, as kernels::cast_fn).
template <class T>
struct cast_encode_fn {
  FEDSHARD_HOST_DEVICE constexpr T operator()(float v) const noexcept {
    if constexpr (std::is_same_v<T, fp8_e4m3>)
      return fp8_e4m3(v);
    else
      return kernels::cast_fn<float, T>{}(v);
  }
};

/// out += the exact value of one wire element.
template <class T>
struct cast_decode_add_fn {
  FEDSHARD_HOST_DEVICE constexpr void operator()(T w, float& out) const noexcept {
    if constexpr (std::is_same_v<T, fp8_e4m3>)
      out += w.to_float();
    else
      out += kernels::cast_fn<T, float>{}(w);
  }
};

/// wire[i] = T(in[i]) for i < n, with the instruction set `which`.
template <class T>
void cast_encode_on(kernels::isa which, const float* in, T* wire, std::size_t n) noexcept {
  if constexpr (std::is_same_v<T, fp8_e4m3>)
    kernels::for_each_element_on(
        which, [](float v, T& w) { w = cast_encode_fn<T>{}(v); }, n, in, wire);
  else
    kernels::detail::cast_n_on(which, in, wire, n);
}

/// out[i] += the value of wire[i] for i < n, with the instruction set `which`.
template <class T>
void cast_decode_add_on(kernels::isa which, const T* wire, float* out, std::size_t n) noexcept {
  kernels::for_each_element_on(which, cast_decode_add_fn<T>{}, n, wire, out);
}

/// The name of cast<T>.
template <class T>
constexpr std::string_view cast_name() noexcept {
  if constexpr (std::is_same_v<T, float>)
    return "cast_f32";
  else if constexpr (std::is_same_v<T, bf16>)
    return "cast_bf16";
  else if constexpr (std::is_same_v<T, f16>)
    return "cast_f16";
  else
    return "cast_fp8_e4m3";
}

}  // namespace detail

/// Sends each element as a T (float, bf16, f16 or fp8_e4m3); stateless.
template <class T>
class cast {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, f16> ||
                    std::is_same_v<T, fp8_e4m3>,
                "fedshard::codec::cast: T must be float, fedshard::bf16, fedshard::f16 or "
                "fedshard::fp8_e4m3");

 public:
  /// No settings.
  struct config {
    friend bool operator==(const config&, const config&) = default;
  };

  static constexpr std::string_view name = detail::cast_name<T>();
  static constexpr bool stateful = false;

  cast() = default;
  /// A codec for buffers of n elements (cast works on any n).
  cast(config, std::size_t) noexcept {}

  /// sizeof(T) bytes per element.
  static constexpr std::size_t encoded_bytes(std::size_t n) noexcept { return n * sizeof(T); }
  /// The same (cast has no settings).
  static constexpr std::size_t encoded_bytes(config, std::size_t n) noexcept {
    return encoded_bytes(n);
  }

  /// wire = the elements of in converted to T.
  static void encode(std::span<const float> in, std::span<std::byte> wire) {
    detail::check_wire(name, "encode", wire.data(), wire.size(), encoded_bytes(in.size()),
                       in.size());
    detail::cast_encode_on(kernels::active_isa(), in.data(), reinterpret_cast<T*>(wire.data()),
                           in.size());
  }

  /// out[i] += the value of wire element i.
  static void decode_add(std::span<const std::byte> wire, std::span<float> out) {
    detail::check_wire(name, "decode_add", wire.data(), wire.size(), encoded_bytes(out.size()),
                       out.size());
    detail::cast_decode_add_on(kernels::active_isa(), reinterpret_cast<const T*>(wire.data()),
                               out.data(), out.size());
  }
};

}  // namespace fedshard::codec
