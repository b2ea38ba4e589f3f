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
///  7. Optionally `static constexpr float encode_passes, decode_passes`: the memory passes over
///     n f32 elements its kernels make (the simulator prices codec time by them); default those
///     of a dense codec, 1.5 and 2.5 (encode: read the input, write a smaller wire; decode:
///     read the wire, read and write the output). Detected in codec_capabilities<C> alone; one
///     without the other, or `encoding_passes` / `decoding_passes`, is a compile error.
/// Encoding is deterministic: the same state and input give the same wire, bit for bit.
/// Inputs are finite (a NaN or infinity in the input gives unspecified values in the wire,
/// never a crash or an out-of-bounds write).

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <utility>

#include "fedshard/core/member_names.hpp"
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
// The member names codec_capabilities<C> looks for: its own and near misses of them.
FEDSHARD_MEMBER_NAME(encode_passes)
FEDSHARD_MEMBER_NAME(decode_passes)
FEDSHARD_MEMBER_NAME(encoding_passes)
FEDSHARD_MEMBER_NAME(decoding_passes)
}  // namespace detail

/// The optional requirement 7 of Codec C, detected here and nowhere else.
template <class C>
struct codec_capabilities {
  /// 7.
  static constexpr bool passes = requires {
    { C::encode_passes + C::decode_passes } -> std::convertible_to<float>;
  };
  static_assert(!detail::names_encoding_passes<C> && !detail::names_decoding_passes<C>,
                "Codec: the codec has a member `encoding_passes` or `decoding_passes`; did you "
                "mean `encode_passes` and `decode_passes` (requirement 7, codec/codec.hpp)?");
  static_assert((!detail::names_encode_passes<C> && !detail::names_decode_passes<C>) || passes,
                "Codec: the codec declares one of `encode_passes` and `decode_passes` without "
                "the other, or not as numbers (requirement 7): the simulator would price it "
                "as a dense codec");

  /// The memory passes of C's kernels: (encode, decode).
  static constexpr std::pair<float, float> passes_or_default() noexcept {
    if constexpr (passes)
      return {static_cast<float>(C::encode_passes), static_cast<float>(C::decode_passes)};
    else
      return {1.5f, 2.5f};
  }
};

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
