#pragma once
/// Test support: a stateless codec gives, on every instruction set this machine supports,
/// the wire and decode_add sums of its portable version, bit for bit.

#include <doctest/doctest.h>

#include <cstddef>
#include <cstring>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

#include "fedshard/kernels/dispatch.hpp"

namespace fedshard::test {

/// For each n of `sizes`: encodes the first n of `in`, decode_adds the wire onto the first n
/// of `base`, on every supported instruction set, and requires the portable bytes (C with
/// settings cfg).
template <class C>
void check_codec_on_every_isa(const std::vector<float>& in, const std::vector<float>& base,
                              std::initializer_list<std::size_t> sizes,
                              typename C::config cfg = {}) {
  const auto run = [&](std::size_t n, std::vector<std::byte>& wire, std::vector<float>& out) {
    C c(cfg, n);
    wire.assign(c.encoded_bytes(n), std::byte{0});
    c.encode(std::span<const float>(in.data(), n), wire);
    out.assign(base.begin(), base.begin() + static_cast<std::ptrdiff_t>(n));
    c.decode_add(wire, out);
  };
  for (std::size_t n : sizes) {
    std::vector<std::byte> want_wire, wire;
    std::vector<float> want_out, out;
    {
      kernels::isa_limit_guard g(kernels::isa::portable);
      run(n, want_wire, want_out);
    }
    for (kernels::isa which : kernels::supported_isas()) {
      CAPTURE(std::string(kernels::to_string(which)));
      CAPTURE(n);
      kernels::isa_limit_guard g(which);
      run(n, wire, out);
      REQUIRE(wire == want_wire);
      REQUIRE(std::memcmp(out.data(), want_out.data(), n * sizeof(float)) == 0);
    }
  }
}

}  // namespace fedshard::test
