#pragma once
/// The element functors of gossip's mixing (federation/gossip.hpp), run by a memory space's
/// for_each on the host or the device: y = y − α Σ_k (y − peer_k), the sum accumulated peer
/// by peer in float, every operation rounded once.

#include "fedshard/config.hpp"
#include "fedshard/kernels/sgd.hpp"

namespace fedshard::kernels {

/// acc = acc + (own − peer): one peer's term of the Laplacian sum.
struct laplacian_term_update {
  FEDSHARD_HOST_DEVICE void operator()(float& acc, float delta, float peer) const noexcept {
    acc = detail::add_rn(acc, detail::add_rn(delta, -peer));
  }
};

/// own = own − fl(α · acc): the mixing step.
struct laplacian_mix_update {
  float alpha = 0.0f;
  FEDSHARD_HOST_DEVICE void operator()(float& delta, float acc) const noexcept {
    delta = detail::add_rn(delta, -detail::mul_rn(alpha, acc));
  }
};

}  // namespace fedshard::kernels
