#include "fedshard/codec/codec.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <span>
#include <string_view>

#include "fedshard/codec/cast.hpp"
#include "fedshard/codec/identity.hpp"
#include "fedshard/codec/int8_block.hpp"
#include "fedshard/codec/topk.hpp"

namespace codec = fedshard::codec;

namespace {

/// A codec missing decode_add.
struct no_decode {
  struct config {
    friend bool operator==(const config&, const config&) = default;
  };
  static constexpr std::string_view name = "no_decode";
  static constexpr bool stateful = false;
  no_decode(config, std::size_t) {}
  static constexpr std::size_t encoded_bytes(config, std::size_t n) { return n; }
  static constexpr std::size_t encoded_bytes(std::size_t n) { return n; }
  void encode(std::span<const float>, std::span<std::byte>) {}
};

/// A codec that says it is stateful but has no residual.
struct stateful_without_state {
  struct config {
    friend bool operator==(const config&, const config&) = default;
  };
  static constexpr std::string_view name = "stateful_without_state";
  static constexpr bool stateful = true;
  stateful_without_state(config, std::size_t) {}
  static constexpr std::size_t encoded_bytes(config, std::size_t n) { return n; }
  static constexpr std::size_t encoded_bytes(std::size_t n) { return n; }
  void encode(std::span<const float>, std::span<std::byte>) {}
  void decode_add(std::span<const std::byte>, std::span<float>) const {}
};

/// A codec whose wire size does not depend on its settings' values (no encoded_bytes(cfg, n)).
struct size_without_settings {
  struct config {
    int level = 1;
    friend bool operator==(const config&, const config&) = default;
  };
  static constexpr std::string_view name = "size_without_settings";
  static constexpr bool stateful = false;
  size_without_settings(config, std::size_t) {}
  static constexpr std::size_t encoded_bytes(std::size_t n) { return n; }
  void encode(std::span<const float>, std::span<std::byte>) {}
  void decode_add(std::span<const std::byte>, std::span<float>) const {}
};

/// encoded_bytes is usable in constant expressions, with the default settings.
template <class C>
constexpr bool constexpr_size = (C::encoded_bytes(typename C::config{}, 10000) > 0);

}  // namespace

TEST_CASE("Codec: the library's codecs satisfy it; incomplete ones do not") {
  static_assert(codec::Codec<codec::identity>);
  static_assert(codec::Codec<codec::cast<float>>);
  static_assert(codec::Codec<codec::cast<fedshard::bf16>>);
  static_assert(codec::Codec<codec::cast<fedshard::f16>>);
  static_assert(codec::Codec<codec::cast<fedshard::fp8_e4m3>>);
  static_assert(codec::Codec<codec::int8_block>);
  static_assert(codec::Codec<codec::topk>);
  static_assert(!codec::Codec<no_decode>);
  static_assert(!codec::Codec<stateful_without_state>);
  static_assert(!codec::Codec<size_without_settings>);
  static_assert(constexpr_size<codec::identity> && constexpr_size<codec::cast<fedshard::bf16>> &&
                constexpr_size<codec::int8_block> && constexpr_size<codec::topk>);
  // The closed forms at compile time for settings other than the defaults: int8_block of
  // 1000 elements in blocks of 100 is 10 scales (40 B) + 1000 codes; topk of 256 elements in
  // chunks of 128, k 4, 3 bits: 2 scales (8 B) + 8 u16 indices (16 B) + 2 x ceil(12 / 8) B.
  static_assert(codec::int8_block::encoded_bytes({.block = 100}, 1000) == 1040);
  static_assert(codec::topk::encoded_bytes({.chunk = 128, .k = 4, .bits = 3}, 256) == 28);
}

TEST_CASE("Codec: wires of the wrong size or alignment are refused") {
  alignas(8) std::byte wire[64] = {};
  float in[4] = {1, 2, 3, 4};
  CHECK_THROWS_AS(codec::identity::encode(in, std::span(wire, 15)), fedshard::invalid_argument);
  CHECK_THROWS_AS(codec::identity::encode(in, std::span(wire + 1, 16)), fedshard::invalid_argument);
  CHECK_NOTHROW(codec::identity::encode(in, std::span(wire, 16)));
  CHECK_THROWS_AS(
      codec::int8_block({.block = 4}).decode_add(std::span<const std::byte>(wire, 9), in),
      fedshard::invalid_argument);
}
