#pragma once
/// SGD with momentum, dampening, Nesterov and weight decay: the per-element update as a
/// FEDSHARD_HOST_DEVICE functor, its per-step scalars, and a host loop over a shard.
///
/// The update is torch.optim.SGD's (torch 2.x `_single_tensor_sgd`, maximize=False) on
/// float32 tensors, with g the gradient:
///
///   g     = g + weight_decay * param                  if weight_decay != 0
///   buf   = g                                         first step           } if momentum != 0
///   buf   = momentum * buf + (1 - dampening) * g      later steps          }
///   g     = nesterov ? g + momentum * buf : buf                            }
///   param = param - lr * g
///
/// Rounding, op by op. Python computes the scalars in double (1 - dampening; -lr) and torch
/// rounds each to float when it enters a float32 kernel. fl() is one float rounding; fma()
/// is a fused multiply-add, rounded once:
///
///   grad.add(param, alpha=wd)         g     = fma(param, float(wd), g)
///   buf.mul_(m).add_(g, alpha=1-d)    buf   = fma(g, float(1 - d), fl(buf * float(m)))
///   g.add(buf, alpha=m)               g     = fma(buf, float(m), g)
///   param.add_(g, alpha=-lr)          param = fma(g, float(-lr), param)
///
/// torch's `add(other, alpha)` is `self + alpha * other`; its vectorised CPU kernels fuse
/// it into one fma (checked on torch 2.15 with ATEN_CPU_CAPABILITY avx2 and avx512, the
/// ones its wheels pick on current x86 CPUs), which is what this file computes. The fma is
/// explicit, so the result depends neither on compiler flags (GCC contracts a * b + c by
/// default where the target has an fma) nor on host versus device. torch forced to
/// ATEN_CPU_CAPABILITY=default rounds the product first and may differ by an ulp per op.
/// Compile without -ffast-math: the functors rely on IEEE float arithmetic.

#include <cmath>
#include <cstddef>
#include <span>
#include <type_traits>

#include "fedshard/config.hpp"
#include "fedshard/kernels/for_each.hpp"

namespace fedshard::kernels {

namespace detail {

/// a * b + c rounded once (IEEE fused multiply-add), on host and device.
FEDSHARD_HOST_DEVICE inline float fma_rn(float a, float b, float c) noexcept {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

/// Whether the host has a hardware fma for T (float or double), where GCC contracts
/// `x * y + z` across statements by default (-ffp-contract=fast).
template <class T>
inline constexpr bool host_fast_fma =
#if defined(__FP_FAST_FMAF) || defined(FP_FAST_FMAF)
    std::is_same_v<T, float> ||
#endif
#if defined(__FP_FAST_FMA) || defined(FP_FAST_FMA)
    std::is_same_v<T, double> ||
#endif
    false;

/// a * b rounded once (float or double); a device compiler may not fuse it into a later
/// addition.
template <class T>
FEDSHARD_HOST_DEVICE inline T mul_rn(T a, T b) noexcept {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>);
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>)
    return __fmul_rn(a, b);
  else
    return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

/// a + b rounded once (float or double), never fused with a product that produced a or b.
/// Where the host has a hardware fma (host_fast_fma), fma(a, 1, b) equals a + b exactly and
/// leaves nothing to contract.
template <class T>
FEDSHARD_HOST_DEVICE inline T add_rn(T a, T b) noexcept {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>);
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>)
    return __fadd_rn(a, b);
  else
    return __dadd_rn(a, b);
#else
  if constexpr (host_fast_fma<T>)
    return std::fma(a, T{1}, b);
  else
    return a + b;
#endif
}

/// a / b rounded once (IEEE division, also under a device fast-math flag).
FEDSHARD_HOST_DEVICE inline float div_rn(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

/// sqrt(a) rounded once (IEEE square root, also under a device fast-math flag).
FEDSHARD_HOST_DEVICE inline float sqrt_rn(float a) noexcept {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

/// a + b in double rounded once, as Python computes a per-step scalar (host only). The
/// volatile operands keep a compiler from fusing the sum with the product that made them.
inline double add_scalar(double a, double b) noexcept {
  const volatile double va = a;
  const volatile double vb = b;
  return va + vb;
}

}  // namespace detail

/// The float scalars of one SGD step, rounded as torch rounds them (see the file comment).
struct sgd_scalars {
  float neg_lr = 0.0f;               ///< float(-lr)
  float weight_decay = 0.0f;         ///< float(weight_decay); 0 skips the decay term
  float momentum = 0.0f;             ///< float(momentum); 0: no momentum buffer
  float one_minus_dampening = 1.0f;  ///< float(1 - dampening), the difference in double
  bool nesterov = false;             ///< g + momentum * buf instead of buf
  bool first_step = true;            ///< the buffer is set to g instead of updated
};

/// The scalars of an SGD step from the hyper-parameters (given as the doubles Python holds).
inline sgd_scalars make_sgd_scalars(double lr, double momentum, double dampening,
                                    double weight_decay, bool nesterov, bool first_step) noexcept {
  sgd_scalars s;
  s.neg_lr = static_cast<float>(-lr);
  s.weight_decay = static_cast<float>(weight_decay);
  s.momentum = static_cast<float>(momentum);
  s.one_minus_dampening = static_cast<float>(detail::add_scalar(1.0, -dampening));
  s.nesterov = nesterov;
  s.first_step = first_step;
  return s;
}

/// The SGD update of one element: `sgd_update{s}(param, grad[, buf])`.
struct sgd_update {
  sgd_scalars s;

  /// One element without momentum (s.momentum == 0).
  FEDSHARD_HOST_DEVICE void operator()(float& param, float grad) const noexcept {
    const float g = s.weight_decay != 0.0f ? detail::fma_rn(param, s.weight_decay, grad) : grad;
    param = detail::fma_rn(g, s.neg_lr, param);
  }

  /// One element with its momentum buffer element (s.momentum != 0, or a buffer that starts
  /// at zero: optim::momentum_start::zero).
  FEDSHARD_HOST_DEVICE void operator()(float& param, float grad, float& buf) const noexcept {
    const float g = s.weight_decay != 0.0f ? detail::fma_rn(param, s.weight_decay, grad) : grad;
    const float b = s.first_step
                        ? g
                        : detail::fma_rn(g, s.one_minus_dampening, detail::mul_rn(buf, s.momentum));
    buf = b;
    const float d = s.nesterov ? detail::fma_rn(b, s.momentum, g) : b;
    param = detail::fma_rn(d, s.neg_lr, param);
  }
};

/// One SGD step on a host shard. param, grad and (when s.momentum != 0) buf have the same
/// size and do not overlap; buf is ignored when s.momentum == 0. Sizes are not checked here
/// (optim::sgd checks them).
inline void sgd_step(std::span<float> param, std::span<const float> grad, std::span<float> buf,
                     const sgd_scalars& s) noexcept {
  if (s.momentum == 0.0f)
    for_each_element(sgd_update{s}, param.size(), param.data(), grad.data());
  else
    for_each_element(sgd_update{s}, param.size(), param.data(), grad.data(), buf.data());
}

}  // namespace fedshard::kernels
