#pragma once
/// AdamW (decoupled weight decay, bias correction, eps outside the square root): the
/// per-element update as a FEDSHARD_HOST_DEVICE functor, its per-step scalars, and a host
/// loop over a shard.
///
/// The update is torch.optim.AdamW's (torch 2.x `_single_tensor_adam` with
/// decoupled_weight_decay, amsgrad=False, maximize=False, capturable=False) on float32
/// tensors; step counts from 1 on the first update:
///
///   param    = param * (1 - lr * weight_decay)              if weight_decay != 0
///   exp_avg  = lerp(exp_avg, grad, 1 - beta1)
///   exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * grad * grad
///   bias_correction1 = 1 - beta1^step,  bias_correction2 = 1 - beta2^step
///   step_size = lr / bias_correction1
///   denom    = sqrt(exp_avg_sq) / bias_correction2^0.5 + eps
///   param    = param + (-step_size) * exp_avg / denom
///
/// Rounding, op by op. Python computes every scalar in double (1 - lr * wd, 1 - beta1,
/// 1 - beta2, beta^step with step a float, lr / bias_correction1, bias_correction2 ** 0.5,
/// i.e. pow(x, 0.5), not sqrt) and torch rounds each to float when it enters a float32
/// kernel. fl() is one float rounding, fma() a fused multiply-add rounded once, w = float(1 -
/// beta1), d = fl(grad - exp_avg):
///
///   param.mul_(decay)                   p  = fl(param * float(1 - lr * wd))
///   exp_avg.lerp_(grad, w)              m  = w < 0.5 ? fma(w, d, exp_avg)
///                                                    : fma(fl(w - 1), d, grad)
///   exp_avg_sq.mul_(b2)                 v0 = fl(exp_avg_sq * float(beta2))
///     .addcmul_(grad, grad, 1 - b2)     v  = fma(fl(float(1 - beta2) * grad), grad, v0)
///   (v.sqrt() / bc2_sqrt).add_(eps)     q  = fl(fl(fl(sqrt(v)) / float(bc2_sqrt)) + float(eps))
///   param.addcdiv_(m, q, -step_size)    param = fl(p + fl(fl(float(-step_size) * m) / q))
///
/// lerp and addcmul are fused as torch's vectorised CPU kernels fuse them (see
/// kernels/sgd.hpp for why the fma is explicit). sqrt is the IEEE, correctly rounded one.
/// torch's x86 CPU wheels compute Tensor.sqrt with MKL (vsSqrt), which is not always
/// correctly rounded (within 0.75 ulp; about 1 in 6 results differ by an ulp), so there
/// torch's AdamW may differ from this one by an ulp in denom, and its params drift apart
/// at that level; with an IEEE sqrt (replayed op by op in torch) the two agree bit for bit.
/// The host loop picks a version with hardware fma at run time (kernels/dispatch.hpp). GCC
/// vectorises the functor's loop only with -fno-math-errno (else the sqrt's errno branch
/// stops it), so the AVX2 and AVX-512 versions run hand-vectorised blocks of 8 and 16
/// elements (vector_blocks<adamw_update>): each lane runs the operations above in their order
/// with the IEEE instructions (mul, sub, fmadd, sqrt, div, add), which gives the functor's
/// bits at any flags; the last elements run through the functor.
/// Compile without -ffast-math.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>

#include "fedshard/config.hpp"
#include "fedshard/kernels/for_each.hpp"
#include "fedshard/kernels/sgd.hpp"

namespace fedshard::kernels {

/// The float scalars of one AdamW step, rounded as torch rounds them (see the file comment).
struct adamw_scalars {
  float decay = 1.0f;                  ///< float(1 - lr * weight_decay); 1 when wd == 0
  float lerp_weight = 0.0f;            ///< float(1 - beta1)
  float beta2 = 0.0f;                  ///< float(beta2)
  float one_minus_beta2 = 0.0f;        ///< float(1 - beta2)
  float bias_correction2_sqrt = 1.0f;  ///< float((1 - beta2^step) ** 0.5)
  float eps = 0.0f;                    ///< float(eps)
  float neg_step_size = 0.0f;          ///< float(-(lr / (1 - beta1^step)))
};

/// The scalars of AdamW step number `step` (1 on the first update) from the hyper-parameters
/// (given as the doubles Python holds).
inline adamw_scalars make_adamw_scalars(double lr, double beta1, double beta2, double eps,
                                        double weight_decay, std::int64_t step) noexcept {
  const double t = static_cast<double>(step);
  const double bias_correction1 = detail::add_scalar(1.0, -std::pow(beta1, t));
  const double bias_correction2 = detail::add_scalar(1.0, -std::pow(beta2, t));
  const double lr_wd = lr * weight_decay;
  adamw_scalars s;
  s.decay = weight_decay != 0.0 ? static_cast<float>(detail::add_scalar(1.0, -lr_wd)) : 1.0f;
  s.lerp_weight = static_cast<float>(detail::add_scalar(1.0, -beta1));
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(detail::add_scalar(1.0, -beta2));
  s.bias_correction2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  return s;
}

/// The AdamW update of one element: `adamw_update{s}(param, grad, exp_avg, exp_avg_sq)`.
struct adamw_update {
  adamw_scalars s;

  /// Updates one element and its two moments in place.
  FEDSHARD_HOST_DEVICE void operator()(float& param, float grad, float& exp_avg,
                                       float& exp_avg_sq) const noexcept {
    const float p = detail::mul_rn(param, s.decay);
    const float m0 = exp_avg;
    const float d = detail::add_rn(grad, -m0);
    const float m = s.lerp_weight < 0.5f
                        ? detail::fma_rn(s.lerp_weight, d, m0)
                        : detail::fma_rn(detail::add_rn(s.lerp_weight, -1.0f), d, grad);
    const float v = detail::fma_rn(detail::mul_rn(s.one_minus_beta2, grad), grad,
                                   detail::mul_rn(exp_avg_sq, s.beta2));
    const float q =
        detail::add_rn(detail::div_rn(detail::sqrt_rn(v), s.bias_correction2_sqrt), s.eps);
    param = detail::add_rn(p, detail::div_rn(detail::mul_rn(s.neg_step_size, m), q));
    exp_avg = m;
    exp_avg_sq = v;
  }
};

#if FEDSHARD_DISPATCH
/// The body of adamw_update's blocks of one instruction set (kernels/for_each.hpp):
/// `name(f, n, p, g, m, v)` with the attributes `target`, on vectors of type `vec` of `width`
/// floats, with the intrinsics whose names start with `pfx` (_mm256 or _mm512). Each lane runs
/// adamw_update's operations in its order; m takes the lerp branch adamw_update takes.
#define FEDSHARD_DETAIL_ADAMW_BLOCKS(target, name, vec, width, pfx)                              \
  target static std::size_t name(const adamw_update& f, std::size_t n, float* p, const float* g, \
                                 float* m, float* v) noexcept {                                  \
    const adamw_scalars& s = f.s;                                                                \
    const bool low = s.lerp_weight < 0.5f;                                                       \
    const vec w = pfx##_set1_ps(low ? s.lerp_weight : s.lerp_weight - 1.0f);                     \
    const vec decay = pfx##_set1_ps(s.decay), beta2 = pfx##_set1_ps(s.beta2);                    \
    const vec one_minus_beta2 = pfx##_set1_ps(s.one_minus_beta2);                                \
    const vec bc2 = pfx##_set1_ps(s.bias_correction2_sqrt), eps = pfx##_set1_ps(s.eps);          \
    const vec neg_step = pfx##_set1_ps(s.neg_step_size);                                         \
    std::size_t i = 0;                                                                           \
    for (; i + (width) <= n; i += (width)) {                                                     \
      const vec param = pfx##_loadu_ps(p + i), grad = pfx##_loadu_ps(g + i);                     \
      const vec m0 = pfx##_loadu_ps(m + i), v0 = pfx##_loadu_ps(v + i);                          \
      const vec d = pfx##_sub_ps(grad, m0);                                                      \
      const vec mm = pfx##_fmadd_ps(w, d, low ? m0 : grad);                                      \
      const vec vv =                                                                             \
          pfx##_fmadd_ps(pfx##_mul_ps(one_minus_beta2, grad), grad, pfx##_mul_ps(v0, beta2));    \
      const vec q = pfx##_add_ps(pfx##_div_ps(detail::sqrt_ps(vv), bc2), eps);                   \
      pfx##_storeu_ps(p + i, pfx##_add_ps(pfx##_mul_ps(param, decay),                            \
                                          pfx##_div_ps(pfx##_mul_ps(neg_step, mm), q)));         \
      pfx##_storeu_ps(m + i, mm);                                                                \
      pfx##_storeu_ps(v + i, vv);                                                                \
    }                                                                                            \
    return i;                                                                                    \
  }

/// adamw_update's hand-vectorised blocks: 8 lanes (AVX2 + FMA), 16 (AVX-512).
template <>
struct vector_blocks<adamw_update> {
  static constexpr bool defined = true;
  FEDSHARD_DETAIL_ADAMW_BLOCKS(FEDSHARD_TARGET_AVX2, avx2, __m256, 8, _mm256)
  FEDSHARD_DETAIL_ADAMW_BLOCKS(FEDSHARD_TARGET_AVX512, avx512, __m512, 16, _mm512)
};
#undef FEDSHARD_DETAIL_ADAMW_BLOCKS
#endif

/// One AdamW step on a host shard; the four spans have the same size and do not overlap
/// (not checked here: optim::adamw checks them).
inline void adamw_step(std::span<float> param, std::span<const float> grad,
                       std::span<float> exp_avg, std::span<float> exp_avg_sq,
                       const adamw_scalars& s) noexcept {
  for_each_element(adamw_update{s}, param.size(), param.data(), grad.data(), exp_avg.data(),
                   exp_avg_sq.data());
}

}  // namespace fedshard::kernels
