#include "fedshard/codec/identity.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <cstring>
#include <vector>

namespace codec = fedshard::codec;

TEST_CASE("identity: the wire is the f32 bytes; decode_add adds them") {
  static_assert(codec::identity::encoded_bytes(7) == 28);
  const std::vector<float> in = {1.5f, -0.0f, 3e-40f, -7.25f, 1e30f, 0.1f, -2.0f};
  std::vector<float> wire_storage(in.size());
  auto wire = std::as_writable_bytes(std::span(wire_storage));
  codec::identity c(codec::identity::config{}, in.size());
  c.encode(in, wire);
  CHECK(std::memcmp(wire.data(), in.data(), wire.size()) == 0);
  std::vector<float> out = {1, 1, 1, 1, 1, 1, 1};
  c.decode_add(wire, out);
  for (std::size_t i = 0; i < in.size(); ++i) CHECK(out[i] == 1.0f + in[i]);
  // Empty buffers.
  c.encode({}, {});
  c.decode_add({}, {});
}
