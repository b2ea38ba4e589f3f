#pragma once
/// Outer (server) optimizers of a federation: the per-element updates of FedAvg/outer SGD,
/// Nesterov (DiLoCo), FedMom, FedAdam and FedYogi as FEDSHARD_HOST_DEVICE functors, their
/// float scalars, and host loops over an anchor shard.
///
/// θ is an element of the anchor (the model every group starts a round from), d the same
/// element of the mean pseudo-gradient θ_anchor − θ_group, m and v the outer state, which
/// the caller owns and sets before the first step (federation/outer_rules.hpp: m = 0, and
/// v = τ² as in Reddi et al. 2021, Algorithm 2); no bias correction. The formulas
/// (PAPERS.md section 3):
///
///   outer_sgd  θ ← θ − η·d                                        (η = 1: plain averaging)
///   nesterov   m ← μ·m + d;  θ ← θ − η·(μ·m + d)                   (m is the new m)
///   fedmom     m ← μ·m + d;  θ ← θ − η·m
///   fedadam    m ← β1·m + (1−β1)·d;  v ← β2·v + (1−β2)·d²;  θ ← θ − η·m / (√v + τ)
///   fedyogi    v ← v − (1−β2)·d²·sign(v − d²);  otherwise as fedadam
///
/// Outer SGD, Nesterov and FedMom are SGD (kernels/sgd.hpp's sgd_update) with learning rate
/// η, momentum μ, no dampening, no weight decay and no first step: the buffer m starts at
/// zero and every step decays it (optim::momentum_start::zero). Their functors below only
/// hand these scalars to sgd_update, which rounds every op; written out (fl() is one float
/// rounding to nearest even, fma() a fused multiply-add rounded once):
///
///   outer_sgd  θ' = fma(d, -η, θ)
///   nesterov   m' = fma(d, 1, fl(m·μ)) = fl(fl(m·μ) + d);  u = fma(m', μ, d);
///              θ' = fma(u, -η, θ)
///   fedmom     m' = fl(fl(m·μ) + d);  θ' = fma(m', -η, θ)
///
/// So outer_sgd with η = 1 is fl(θ − d), one rounding, and Nesterov and FedMom are
/// torch.optim.SGD(momentum=μ, dampening=0, nesterov=…) on a later step: the DiLoCo outer
/// optimizer, bit for bit (torch's first step copies d into the buffer; here the zero
/// buffer gives fl(0 + d) = d, which differs only for d = −0). fma(d, 1, p) and fl(p + d)
/// are one rounding of the same exact sum, so both forms of m' give the same bits, signed
/// zeros included, except where m·μ and d are both NaN: which NaN comes out is left open
/// by IEEE 754 (on x86 an add and an fma may pick different ones).
///
/// FedAdam and FedYogi round op by op, in this fixed order:
///
///   scalars    -η, β1, β2, τ as given;  c1 = fl(1 − β1),  c2 = fl(1 − β2)
///   fedadam    m' = fma(d, c1, fl(m·β1));  d2 = fl(d·d);  v' = fma(d2, c2, fl(v·β2))
///              q = fl(fl(sqrt(v')) + τ);  θ' = fma(fl(m' / q), -η, θ)
///   fedyogi    as fedadam, except  t = fl(c2·d2);
///              v' = v > d2 ? fl(v − t) : v < d2 ? fl(v + t) : v
///
/// In FedYogi sign(v − d²) is that of the exact difference (0 when v == d2, and when d is
/// NaN, which then reaches θ through m); a v that starts >= 0 stays so because t <= d2. An
/// element reads only its own θ, d, m and v, so a shard split among objects evolves bit for
/// bit as the whole. The fma and the separate roundings are explicit (kernels/sgd.hpp:
/// fma_rn, mul_rn, add_rn, div_rn, sqrt_rn), so neither compiler flags nor host versus
/// device change a bit. FedAdam's and FedYogi's AVX2 and AVX-512 loops run hand-vectorised
/// blocks (vector_blocks: GCC keeps a sqrt's loop scalar under its default -fmath-errno),
/// each lane the same operations with IEEE instructions. Compile without -ffast-math.

#include <cstddef>
#include <span>

#include "fedshard/config.hpp"
#include "fedshard/kernels/for_each.hpp"
#include "fedshard/kernels/sgd.hpp"

namespace fedshard::kernels {

/// The float scalar of an outer SGD step.
struct outer_sgd_scalars {
  float neg_lr = -1.0f;  ///< -η
};

/// The float scalars of a Nesterov or FedMom step.
struct outer_momentum_scalars {
  float neg_lr = 0.0f;    ///< -η
  float momentum = 0.0f;  ///< μ
};

/// The float scalars of a FedAdam or FedYogi step.
struct outer_adaptive_scalars {
  float neg_lr = 0.0f;           ///< -η
  float beta1 = 0.0f;            ///< β1
  float one_minus_beta1 = 1.0f;  ///< fl(1 − β1)
  float beta2 = 0.0f;            ///< β2
  float one_minus_beta2 = 1.0f;  ///< fl(1 − β2)
  float tau = 0.0f;              ///< τ
};

/// The scalars of an outer SGD step with learning rate lr.
FEDSHARD_HOST_DEVICE inline outer_sgd_scalars make_outer_sgd_scalars(float lr) noexcept {
  return {-lr};
}

/// The scalars of a Nesterov or FedMom step.
FEDSHARD_HOST_DEVICE inline outer_momentum_scalars make_outer_momentum_scalars(
    float lr, float momentum) noexcept {
  return {-lr, momentum};
}

/// The scalars of a FedAdam or FedYogi step; 1 − β is rounded once to float.
FEDSHARD_HOST_DEVICE inline outer_adaptive_scalars make_outer_adaptive_scalars(float lr,
                                                                               float beta1,
                                                                               float beta2,
                                                                               float tau) noexcept {
  return {-lr, beta1, detail::add_rn(1.0f, -beta1), beta2, detail::add_rn(1.0f, -beta2), tau};
}

namespace detail {

/// The sgd_update scalars of an outer SGD, Nesterov or FedMom step: learning rate -neg_lr,
/// the momentum, no dampening or weight decay, never a first step.
FEDSHARD_HOST_DEVICE inline sgd_scalars outer_as_sgd(float neg_lr, float momentum,
                                                     bool nesterov) noexcept {
  return {.neg_lr = neg_lr,
          .weight_decay = 0.0f,
          .momentum = momentum,
          .one_minus_dampening = 1.0f,
          .nesterov = nesterov,
          .first_step = false};
}

}  // namespace detail

/// θ ← θ − η·d for one element: sgd_update without momentum.
struct outer_sgd_update {
  outer_sgd_scalars s;
  FEDSHARD_HOST_DEVICE void operator()(float& theta, float d) const noexcept {
    sgd_update{detail::outer_as_sgd(s.neg_lr, 0.0f, false)}(theta, d);
  }
};

/// Nesterov momentum for one element and its momentum: sgd_update with Nesterov's momentum.
struct outer_nesterov_update {
  outer_momentum_scalars s;
  FEDSHARD_HOST_DEVICE void operator()(float& theta, float d, float& m) const noexcept {
    sgd_update{detail::outer_as_sgd(s.neg_lr, s.momentum, true)}(theta, d, m);
  }
};

/// Heavy-ball momentum (FedMom) for one element and its momentum: sgd_update with momentum.
struct outer_fedmom_update {
  outer_momentum_scalars s;
  FEDSHARD_HOST_DEVICE void operator()(float& theta, float d, float& m) const noexcept {
    sgd_update{detail::outer_as_sgd(s.neg_lr, s.momentum, false)}(theta, d, m);
  }
};

namespace detail {

/// θ ← θ − η·m / (√v + τ), the last line of FedAdam and FedYogi.
FEDSHARD_HOST_DEVICE inline float adaptive_apply(float theta, float m, float v,
                                                 const outer_adaptive_scalars& s) noexcept {
  const float q = add_rn(sqrt_rn(v), s.tau);
  return fma_rn(div_rn(m, q), s.neg_lr, theta);
}

}  // namespace detail

/// FedAdam for one element and its two moments.
struct outer_fedadam_update {
  outer_adaptive_scalars s;
  FEDSHARD_HOST_DEVICE void operator()(float& theta, float d, float& m, float& v) const noexcept {
    const float m1 = detail::fma_rn(d, s.one_minus_beta1, detail::mul_rn(m, s.beta1));
    const float d2 = detail::mul_rn(d, d);
    const float v1 = detail::fma_rn(d2, s.one_minus_beta2, detail::mul_rn(v, s.beta2));
    theta = detail::adaptive_apply(theta, m1, v1, s);
    m = m1;
    v = v1;
  }
};

/// FedYogi for one element and its two moments.
struct outer_fedyogi_update {
  outer_adaptive_scalars s;
  FEDSHARD_HOST_DEVICE void operator()(float& theta, float d, float& m, float& v) const noexcept {
    const float m1 = detail::fma_rn(d, s.one_minus_beta1, detail::mul_rn(m, s.beta1));
    const float d2 = detail::mul_rn(d, d);
    const float t = detail::mul_rn(s.one_minus_beta2, d2);
    const float v0 = v;
    const float v1 = v0 > d2 ? detail::add_rn(v0, -t) : (v0 < d2 ? detail::add_rn(v0, t) : v0);
    theta = detail::adaptive_apply(theta, m1, v1, s);
    m = m1;
    v = v1;
  }
};

// Host loops. All spans have anchor's size and do not overlap, except that d may be anchor
// itself (each element reads d[i] before it writes θ[i]). Sizes are not checked here
// (federation/outer_rules.hpp checks them).

/// One outer SGD step on a host anchor shard.
inline void outer_sgd_step(std::span<float> anchor, std::span<const float> d,
                           const outer_sgd_scalars& s) noexcept {
  for_each_element(outer_sgd_update{s}, anchor.size(), anchor.data(), d.data());
}

/// One Nesterov step on a host anchor shard and its momentum.
inline void outer_nesterov_step(std::span<float> anchor, std::span<const float> d,
                                std::span<float> momentum,
                                const outer_momentum_scalars& s) noexcept {
  for_each_element(outer_nesterov_update{s}, anchor.size(), anchor.data(), d.data(),
                   momentum.data());
}

/// One FedMom step on a host anchor shard and its momentum.
inline void outer_fedmom_step(std::span<float> anchor, std::span<const float> d,
                              std::span<float> momentum, const outer_momentum_scalars& s) noexcept {
  for_each_element(outer_fedmom_update{s}, anchor.size(), anchor.data(), d.data(), momentum.data());
}

/// One FedAdam step on a host anchor shard and its moments m and v.
inline void outer_fedadam_step(std::span<float> anchor, std::span<const float> d,
                               std::span<float> m, std::span<float> v,
                               const outer_adaptive_scalars& s) noexcept {
  for_each_element(outer_fedadam_update{s}, anchor.size(), anchor.data(), d.data(), m.data(),
                   v.data());
}

/// One FedYogi step on a host anchor shard and its moments m and v.
inline void outer_fedyogi_step(std::span<float> anchor, std::span<const float> d,
                               std::span<float> m, std::span<float> v,
                               const outer_adaptive_scalars& s) noexcept {
  for_each_element(outer_fedyogi_update{s}, anchor.size(), anchor.data(), d.data(), m.data(),
                   v.data());
}

#if FEDSHARD_DISPATCH
namespace detail {

// FedAdam's and FedYogi's second moment v' on 8 or 16 lanes (the functors' v1; b2 = β2,
// c2 = fl(1 − β2), d2 = fl(d·d)). Yogi's comparisons are ordered: a NaN lane keeps v.
FEDSHARD_TARGET_AVX2 FEDSHARD_ALWAYS_INLINE inline __m256 adam_v(__m256 v0, __m256 d2, __m256 c2,
                                                                 __m256 b2) noexcept {
  return _mm256_fmadd_ps(d2, c2, _mm256_mul_ps(v0, b2));
}
FEDSHARD_TARGET_AVX512 FEDSHARD_ALWAYS_INLINE inline __m512 adam_v(__m512 v0, __m512 d2, __m512 c2,
                                                                   __m512 b2) noexcept {
  return _mm512_fmadd_ps(d2, c2, _mm512_mul_ps(v0, b2));
}
FEDSHARD_TARGET_AVX2 FEDSHARD_ALWAYS_INLINE inline __m256 yogi_v(__m256 v0, __m256 d2, __m256 c2,
                                                                 __m256) noexcept {
  const __m256 t = _mm256_mul_ps(c2, d2);
  const __m256 r = _mm256_blendv_ps(v0, _mm256_sub_ps(v0, t), _mm256_cmp_ps(v0, d2, _CMP_GT_OQ));
  return _mm256_blendv_ps(r, _mm256_add_ps(v0, t), _mm256_cmp_ps(v0, d2, _CMP_LT_OQ));
}
FEDSHARD_TARGET_AVX512 FEDSHARD_ALWAYS_INLINE inline __m512 yogi_v(__m512 v0, __m512 d2, __m512 c2,
                                                                   __m512) noexcept {
  const __m512 t = _mm512_mul_ps(c2, d2);
  const __m512 r =
      _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v0, d2, _CMP_GT_OQ), v0, _mm512_sub_ps(v0, t));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v0, d2, _CMP_LT_OQ), r, _mm512_add_ps(v0, t));
}

}  // namespace detail

/// The body of FedAdam's or FedYogi's blocks (kernels/for_each.hpp): `name(f, n, theta, d,
/// m, v)` with the attributes `target`, on vectors `vec` of `width` floats, with the
/// intrinsics named `pfx`_..., in a class with the member `second(v0, d2, c2, b2)` (the second
/// moment: adam_v or yogi_v). Each lane
/// runs the functor's operations in its order: m' = fma(d, c1, fl(m·β1)), d2 = fl(d·d),
/// v' = second, q = fl(fl(sqrt(v')) + τ), θ' = fma(fl(m' / q), -η, θ).
#define FEDSHARD_DETAIL_ADAPTIVE_BLOCKS(target, name, vec, width, pfx)                          \
  target static std::size_t name(const functor& f, std::size_t n, float* theta, const float* d, \
                                 float* m, float* v) noexcept {                                 \
    const outer_adaptive_scalars& s = f.s;                                                      \
    const vec b1 = pfx##_set1_ps(s.beta1), c1 = pfx##_set1_ps(s.one_minus_beta1);               \
    const vec b2 = pfx##_set1_ps(s.beta2), c2 = pfx##_set1_ps(s.one_minus_beta2);               \
    const vec tau = pfx##_set1_ps(s.tau), neg_lr = pfx##_set1_ps(s.neg_lr);                     \
    std::size_t i = 0;                                                                          \
    for (; i + (width) <= n; i += (width)) {                                                    \
      const vec th = pfx##_loadu_ps(theta + i), dd = pfx##_loadu_ps(d + i);                     \
      const vec m1 = pfx##_fmadd_ps(dd, c1, pfx##_mul_ps(pfx##_loadu_ps(m + i), b1));           \
      const vec v1 = second(pfx##_loadu_ps(v + i), pfx##_mul_ps(dd, dd), c2, b2);               \
      const vec q = pfx##_add_ps(detail::sqrt_ps(v1), tau);                                     \
      pfx##_storeu_ps(theta + i, pfx##_fmadd_ps(pfx##_div_ps(m1, q), neg_lr, th));              \
      pfx##_storeu_ps(m + i, m1);                                                               \
      pfx##_storeu_ps(v + i, v1);                                                               \
    }                                                                                           \
    return i;                                                                                   \
  }

namespace detail {
/// FedAdam's (Yogi false) or FedYogi's (Yogi true) hand-vectorised blocks: 8 lanes (AVX2 +
/// FMA), 16 (AVX-512).
template <class functor, bool Yogi>
struct adaptive_blocks {
  static constexpr bool defined = true;
  FEDSHARD_TARGET_AVX2 FEDSHARD_ALWAYS_INLINE static __m256 second(__m256 v0, __m256 d2, __m256 c2,
                                                                   __m256 b2) noexcept {
    return Yogi ? yogi_v(v0, d2, c2, b2) : adam_v(v0, d2, c2, b2);
  }
  FEDSHARD_TARGET_AVX512 FEDSHARD_ALWAYS_INLINE static __m512 second(__m512 v0, __m512 d2,
                                                                     __m512 c2,
                                                                     __m512 b2) noexcept {
    return Yogi ? yogi_v(v0, d2, c2, b2) : adam_v(v0, d2, c2, b2);
  }
  FEDSHARD_DETAIL_ADAPTIVE_BLOCKS(FEDSHARD_TARGET_AVX2, avx2, __m256, 8, _mm256)
  FEDSHARD_DETAIL_ADAPTIVE_BLOCKS(FEDSHARD_TARGET_AVX512, avx512, __m512, 16, _mm512)
};
}  // namespace detail

template <>
struct vector_blocks<outer_fedadam_update> : detail::adaptive_blocks<outer_fedadam_update, false> {
};
template <>
struct vector_blocks<outer_fedyogi_update> : detail::adaptive_blocks<outer_fedyogi_update, true> {};
#undef FEDSHARD_DETAIL_ADAPTIVE_BLOCKS
#endif

}  // namespace fedshard::kernels
