#pragma once
/// The element functors of a federation sync (federation/sync.hpp and the federation
/// policies), run by a memory space's for_each on the host or the device.

#include "fedshard/config.hpp"
#include "fedshard/kernels/sgd.hpp"

namespace fedshard::kernels {

/// buf = anchor − buf: a group's parameters into its pseudo-gradient Δ = θ_anchor − θ.
struct pseudo_gradient_update {
  FEDSHARD_HOST_DEVICE void operator()(float& buf, float anchor) const noexcept {
    buf = anchor - buf;
  }
};

/// x = x · s, rounded once (a group's parameters weighted by G w_g / W).
struct scale_by_update {
  float s = 1.0f;
  FEDSHARD_HOST_DEVICE void operator()(float& x) const noexcept { x = x * s; }
};

/// local = local + α (synced − local), each op rounded once (streaming's mixing), also where
/// a compiler would fuse the product into the sum (nvcc does by default); α = 1 is not
/// special-cased here (use a copy for it).
struct mix_update {
  float alpha = 1.0f;
  FEDSHARD_HOST_DEVICE void operator()(float& local, float synced) const noexcept {
    const float diff = synced - local;
    local = detail::add_rn(local, detail::mul_rn(alpha, diff));
  }
};

}  // namespace fedshard::kernels
