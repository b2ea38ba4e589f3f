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
  struct config {};
  static constexpr std::string_view name = "no_decode";
  static constexpr bool stateful = false;
  no_decode(config, std::size_t) {}
  static constexpr std::size_t encoded_bytes(std::size_t n) { return n; }
  void encode(std::span<const float>, std::span<std::byte>) {}
};

/// A codec that says it is stateful but has no residual.
struct stateful_without_state {
  struct config {};
  static constexpr std::string_view name = "stateful_without_state";
  static constexpr bool stateful = true;
  stateful_without_state(config, std::size_t) {}
  static constexpr std::size_t encoded_bytes(std::size_t n) { return n; }
  void encode(std::span<const float>, std::span<std::byte>) {}
  void decode_add(std::span<const std::byte>, std::span<float>) const {}
};

/// encoded_bytes is usable in constant expressions.
template <class C>
constexpr bool constexpr_size = (C::encoded_bytes(10000) > 0);

}  // namespace

TEST_CASE("Codec: the library's codecs satisfy it; incomplete ones do not") {
  static_assert(codec::Codec<codec::identity>);
  static_assert(codec::Codec<codec::cast<float>>);
  static_assert(codec::Codec<codec::cast<fedshard::bf16>>);
  static_assert(codec::Codec<codec::cast<fedshard::f16>>);
  static_assert(codec::Codec<codec::cast<fedshard::fp8_e4m3>>);
  static_assert(codec::Codec<codec::int8_block<>>);
  static_assert(codec::Codec<codec::topk<>>);
  static_assert(codec::Codec<codec::topk<128, 128, codec::topk_unquantised>>);
  static_assert(!codec::Codec<no_decode>);
  static_assert(!codec::Codec<stateful_without_state>);
  static_assert(constexpr_size<codec::identity> && constexpr_size<codec::cast<fedshard::bf16>> &&
                constexpr_size<codec::int8_block<>> && constexpr_size<codec::topk<>>);
}

TEST_CASE("Codec: wires of the wrong size or alignment are refused") {
  alignas(8) std::byte wire[64] = {};
  float in[4] = {1, 2, 3, 4};
  CHECK_THROWS_AS(codec::identity::encode(in, std::span(wire, 15)), fedshard::invalid_argument);
  CHECK_THROWS_AS(codec::identity::encode(in, std::span(wire + 1, 16)), fedshard::invalid_argument);
  CHECK_NOTHROW(codec::identity::encode(in, std::span(wire, 16)));
  CHECK_THROWS_AS(codec::int8_block<4>::decode_add(std::span<const std::byte>(wire, 9), in),
                  fedshard::invalid_argument);
}
