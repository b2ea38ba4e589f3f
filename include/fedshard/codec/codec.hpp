#pragma once
/// The Codec concept: how a rank's shard of f32 values is turned into wire bytes, and how
/// received wire bytes are added into an f32 buffer.
///
/// A codec object belongs to one rank and one buffer (a shard or a sync fragment) of n
/// elements; it holds that rank's state where the codec has any (the error-feedback residual
/// of topk). Any rank's object can decode any rank's wire of the same n, so aggregation is a
/// gather of wires followed by decode_add of each (a sparse wire cannot be summed in flight).
///
/// A Codec C provides:
///  1. `C::name`, a std::string_view;
///  2. `C::config`, a default-constructible, equality-comparable aggregate of run-time
///     settings (empty when the codec has none; its defaults are the codec's usual numbers),
///     and the constructor `C(config, n)` for a buffer of n elements, which throws
///     fedshard::invalid_argument, saying what it expected and found, for settings it cannot
///     run with (codec::spec_of checks them so, with n = 0);
///  3. `C::encoded_bytes(cfg, n)`, static: the exact size of the wire for n elements with
///     settings cfg, in closed form (constexpr: buffers and plans are sized from it without
///     running the codec); `c.encoded_bytes(n)` gives the same for c's settings;
///  4. `c.encode(in, wire)`: in is a std::span<const float> of the buffer's n elements, wire
///     a std::span<std::byte> of exactly encoded_bytes(n) bytes aligned to
///     codec::wire_alignment; fills the whole wire (no byte left unwritten, so wires compare
///     bit for bit) and may update c's state;
///  5. `c.decode_add(wire, out)` (const): out[i] += decoded[i] for the n = out.size()
///     elements of a wire of encoded_bytes(n) bytes (std::span<const std::byte>, aligned);
///  6. `C::stateful` (bool); when true, `c.residual()` (const) gives the state as a
///     std::span<const float> of n elements, and `c.reset()` zeroes it.
/// Encoding is deterministic: the same state and input give the same wire, bit for bit.
/// Inputs are finite (a NaN or infinity in the input gives unspecified values in the wire,
/// never a crash or an out-of-bounds write).

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "fedshard/error.hpp"

namespace fedshard::codec {

/// The alignment, in bytes, that encode and decode_add require of a wire buffer: every
/// codec puts its 4-byte fields (scales, f32 values) first, so they are aligned in place.
inline constexpr std::size_t wire_alignment = 4;

/// The requirements listed above.
template <class C>
concept Codec = std::default_initializable<typename C::config> &&
    std::equality_comparable<typename C::config> &&
    std::constructible_from<C, typename C::config, std::size_t> &&
    requires(C& c, const C& cc, const typename C::config& cfg, std::span<const float> in,
             std::span<std::byte> wire, std::span<const std::byte> cwire, std::span<float> out,
             std::size_t n) {
  { C::name } -> std::convertible_to<std::string_view>;
  { C::stateful } -> std::convertible_to<bool>;
  { C::encoded_bytes(cfg, n) } -> std::same_as<std::size_t>;
  { cc.encoded_bytes(n) } -> std::same_as<std::size_t>;
  c.encode(in, wire);
  cc.decode_add(cwire, out);
} &&(!C::stateful || requires(C & c, const C& cc) {
  { cc.residual() } -> std::same_as<std::span<const float>>;
  c.reset();
});

namespace detail {

/// Ceil(a / b) for b > 0.
constexpr std::size_t ceil_div(std::size_t a, std::size_t b) noexcept {
  return a / b + (a % b != 0 ? 1 : 0);
}

/// The checks of a wire buffer handed to encode or decode_add: exact size, alignment.
inline void check_wire(std::string_view codec, std::string_view what, const void* data,
                       std::size_t bytes, std::size_t expected, std::size_t n) {
  FEDSHARD_EXPECTS(bytes == expected, codec, "::", what, ": wire of ", bytes, " bytes for ", n,
                   " elements, expected ", expected, " (encoded_bytes)");
  FEDSHARD_EXPECTS(bytes == 0 || reinterpret_cast<std::uintptr_t>(data) % wire_alignment == 0,
                   codec, "::", what, ": wire at ", data, " is not aligned to ", wire_alignment,
                   " bytes");
}

}  // namespace detail

}  // namespace fedshard::codec
