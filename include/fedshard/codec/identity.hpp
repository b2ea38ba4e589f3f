#pragma once
/// codec::identity: the f32 values themselves on the wire (4 bytes per element), the
/// reference every other codec is compared with; the receiver adds them exactly.

#include <cstddef>
#include <cstring>
#include <span>
#include <string_view>

#include "fedshard/codec/codec.hpp"

namespace fedshard::codec {

/// Sends the f32 bytes unchanged; stateless.
class identity {
 public:
  /// No settings.
  struct config {
    friend bool operator==(const config&, const config&) = default;
  };

  static constexpr std::string_view name = "identity";
  static constexpr bool stateful = false;

  identity() = default;
  /// A codec for buffers of n elements (identity works on any n).
  identity(config, std::size_t) noexcept {}

  /// 4 bytes per element.
  static constexpr std::size_t encoded_bytes(std::size_t n) noexcept { return n * sizeof(float); }
  /// The same (identity has no settings).
  static constexpr std::size_t encoded_bytes(config, std::size_t n) noexcept {
    return encoded_bytes(n);
  }

  /// wire = the bytes of in.
  static void encode(std::span<const float> in, std::span<std::byte> wire) {
    detail::check_wire(name, "encode", wire.data(), wire.size(), encoded_bytes(in.size()),
                       in.size());
    if (!in.empty()) std::memcpy(wire.data(), in.data(), wire.size());
  }

  /// out[i] += wire value i.
  static void decode_add(std::span<const std::byte> wire, std::span<float> out) {
    detail::check_wire(name, "decode_add", wire.data(), wire.size(), encoded_bytes(out.size()),
                       out.size());
    const float* w = reinterpret_cast<const float*>(wire.data());
    for (std::size_t i = 0; i < out.size(); ++i) out[i] += w[i];
  }
};

}  // namespace fedshard::codec
