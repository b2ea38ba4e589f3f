#pragma once
/// The element-wise math of a local soup (optim/soup.hpp): the trained member's gradient
/// with the affinity and diversity regularisers, and the members' mean. Index functors
/// shared by the host loops of optim/soup.hpp and, later, a CUDA kernel; every product and
/// sum is rounded once (kernels/sgd.hpp's fma_rn, mul_rn, add_rn, div_rn), in a fixed order.

#include <cstddef>

#include "fedshard/config.hpp"
#include "fedshard/kernels/sgd.hpp"

namespace fedshard::kernels {

/// grad[i] = w * grad[i] + aff * (trained[i] - anchor[i])
///           + sum over j < k, j != t, in j order, of coef[j] * (trained[i] - members[j][i]),
/// where trained = members[t]. A zero aff or coef[j] skips its term, and w == 1 skips the
/// scaling, so that with one member and no regulariser grad keeps its bits (-0 included).
struct soup_gradient_fn {
  const float* const* members;
  const float* anchor;
  const float* coef;
  std::size_t k;
  std::size_t t;
  float w;
  float aff;

  FEDSHARD_HOST_DEVICE void operator()(std::size_t i, float& g) const noexcept {
    const float mt = members[t][i];
    float r = w == 1.0f ? g : detail::mul_rn(w, g);
    if (aff != 0.0f) r = detail::fma_rn(aff, mt - anchor[i], r);
    for (std::size_t j = 0; j < k; ++j)
      if (j != t && coef[j] != 0.0f) r = detail::fma_rn(coef[j], mt - members[j][i], r);
    g = r;
  }
};

/// The passes of soup_gradient_fn over whole arrays, for for_each_element (kernels/
/// for_each.hpp: vectorised at the default flags): g = w g (skipped for w == 1), then
/// g = fma(c, trained - other, g) for each term in soup_gradient_fn's order. Each element
/// gets soup_gradient_fn's operations in its order, so the bits are the same.
struct soup_scale_fn {
  float w;
  FEDSHARD_HOST_DEVICE void operator()(float& g) const noexcept { g = detail::mul_rn(w, g); }
};
/// One term of soup_gradient_fn: g = fma(c, trained - other, g).
struct soup_term_fn {
  float c;
  FEDSHARD_HOST_DEVICE void operator()(float& g, float trained, float other) const noexcept {
    g = detail::fma_rn(c, trained - other, g);
  }
};

/// (members[0][i] + members[1][i] + ... + members[k-1][i]) / k: summed in member order,
/// divided once (one member: itself, bit for bit).
struct soup_mean_fn {
  const float* const* members;
  std::size_t k;

  FEDSHARD_HOST_DEVICE float operator()(std::size_t i) const noexcept {
    float s = members[0][i];
    for (std::size_t j = 1; j < k; ++j) s = detail::add_rn(s, members[j][i]);
    return k == 1 ? s : detail::div_rn(s, static_cast<float>(k));
  }
};

}  // namespace fedshard::kernels
