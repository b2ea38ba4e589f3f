#pragma once
/// The element kernels of zeroth-order (SPSA / MeZO) updates: a counter-based direction and
/// the two element operations a step needs, on host and device.
///
/// Direction. z(key, i) in {-1, +1} for element i of the flat parameter space (the element's
/// index in the unit layout, not in a rank's shard): bit 63 of mix64(key + mix64(i)), -1 when
/// set. Any rank regenerates the elements of its own shard from their global indices, and a
/// group that receives only the key regenerates the whole direction. Rademacher signs, not
/// Gaussian values: every element of z is exact, so a product with z is exact and the host,
/// the device and another host compute the same bits (no transcendental function whose
/// rounding differs between math libraries). SPSA's classic direction is Rademacher; MeZO's
/// is Gaussian, with the same expected update.
///
/// Elements:
///   zo_add:  p = p + z * s     (one rounding: z * s is exact)
/// The key of (seed, step, probe) is zo_key; optim/zeroth_order.hpp builds the step and the
/// replay of records on these.

#include <cstddef>
#include <cstdint>
#include <span>

#include "fedshard/config.hpp"
#include "fedshard/core/mix.hpp"
#include "fedshard/kernels/sgd.hpp"

namespace fedshard::kernels {

/// The key of one probe's direction: seed, step and probe mixed so that neighbouring steps
/// and probes give unrelated directions.
constexpr std::uint64_t zo_key(std::uint64_t seed, std::int64_t step, std::int32_t probe) noexcept {
  return mix64(seed ^ mix64(static_cast<std::uint64_t>(step) ^
                            mix64(static_cast<std::uint64_t>(static_cast<std::uint32_t>(probe)))));
}

/// Element i's direction under key: +1 or -1 (see the file comment).
FEDSHARD_HOST_DEVICE constexpr float zo_sign(std::uint64_t key, std::uint64_t i) noexcept {
  return (mix64(key + mix64(i)) >> 63) != 0 ? -1.0f : 1.0f;
}

/// p[j] = p[j] + z(key, offset + j) * s for the n elements of p (a shard whose first element
/// has global index offset), each rounded once.
inline void zo_add(std::span<float> p, std::uint64_t offset, std::uint64_t key, float s) noexcept {
  for (std::size_t j = 0; j < p.size(); ++j)
    p[j] = detail::add_rn(p[j], zo_sign(key, offset + j) * s);
}

}  // namespace fedshard::kernels
