#pragma once
/// Stragglers: what the variance of per-rank compute costs a synchronous schedule.
///
/// The model (analytic and deterministic, no sampling). Each rank's compute in a step is
/// drawn independently from a normal distribution of mean C and standard deviation cv x C.
/// A collective completes when its slowest member arrives, so:
///  - the ranks the step plan's ops join every step (a component of n_step ranks: the shard
///    communicator for FSDP, the whole group R x S for HSDP with both axes > 1, one rank when
///    the step communicates nothing) finish a step when the slowest of them does: the step's
///    compute is E[max of n_step] = C (1 + cv e(n_step)), with e(n) = E[max of n iid N(0,1)];
///  - between two syncs the components run independently. Over the k steps since the last
///    barrier, a component's time is a sum of k independent maxima: mean k C (1 + cv
///    e(n_step)), standard deviation C cv s(n_step) sqrt(k), with s(n) the standard deviation
///    of the max of n. The sync waits for the slowest of the G_sync components its plans join
///    (taken as normal, the sum of k maxima is close to it), which costs
///    C cv s(n_step) sqrt(k) e(G_sync) per sync beyond the mean.
///  - A sync every k steps on average (periodic: K; streaming: H / P, every fragment's sync
///    being a barrier of the groups) adds C cv s(n_step) e(G_sync) / sqrt(k) per step.
///    Approximations: a streaming sync in flight τ steps is not credited with absorbing the
///    wait (an upper bound); each fragment's sync is taken to be its own barrier.
/// e(n) and s(n) are integrated numerically (Simpson on [-9, 10], exact to ~1e-9 for n up to
/// 1e9) and cached per n.

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>

#include "fedshard/error.hpp"

namespace fedshard::sim {

/// Per-rank compute variability of the simulator (price_options::stragglers).
struct straggler_model {
  /// Coefficient of variation of one rank's step compute (sd / mean); 0: no stragglers, the
  /// price is exactly the one without the model.
  double cv = 0;

  /// True when the model changes anything.
  bool active() const noexcept { return cv > 0; }
};

/// Mean and standard deviation of the max of n iid N(0, 1).
struct max_normal_moments {
  double mean = 0;  ///< e(n): 0 for n = 1, 1/sqrt(pi) for n = 2
  double sd = 1;    ///< s(n): 1 for n = 1, falling slowly as n grows
};

namespace detail {

/// log Φ(x), accurate in both tails.
inline double log_normal_cdf(double x) noexcept {
  const double z = x / std::sqrt(2.0);
  return x < 0 ? std::log(0.5 * std::erfc(-z)) : std::log1p(-0.5 * std::erfc(z));
}

/// The moments of the max of n iid N(0, 1) by Simpson's rule over its density
/// n φ(x) Φ(x)^(n-1).
inline max_normal_moments integrate_max_normal(double n) noexcept {
  constexpr double lo = -9, hi = 10;
  constexpr int steps = 19000;  // h = 1e-3, even
  const double h = (hi - lo) / steps;
  const double inv_sqrt_2pi = 1.0 / std::sqrt(2.0 * std::acos(-1.0));
  double m0 = 0, m1 = 0, m2 = 0;
  for (int i = 0; i <= steps; ++i) {
    const double x = lo + i * h;
    const double w = (i == 0 || i == steps) ? 1.0 : (i % 2 == 1 ? 4.0 : 2.0);
    const double f = n * inv_sqrt_2pi * std::exp(-0.5 * x * x + (n - 1) * log_normal_cdf(x));
    m0 += w * f;
    m1 += w * f * x;
    m2 += w * f * x * x;
  }
  // Normalise by the integrated mass (1 up to the rule's error) so the moments are consistent.
  const double mean = m1 / m0;
  return {mean, std::sqrt(std::max(0.0, m2 / m0 - mean * mean))};
}

}  // namespace detail

/// e(n) and s(n) of the max of n iid N(0, 1), computed once per n and cached (thread-safe).
/// invalid_argument for n < 1.
inline max_normal_moments max_of_normals(long long n) {
  FEDSHARD_EXPECTS(n >= 1, "sim::max_of_normals: the number of ranks must be >= 1, found ", n);
  if (n == 1) return {0.0, 1.0};
  static std::mutex lock;
  static std::map<long long, max_normal_moments> cache;
  const std::lock_guard<std::mutex> guard(lock);
  auto it = cache.find(n);
  if (it == cache.end())
    it = cache.emplace(n, detail::integrate_max_normal(static_cast<double>(n))).first;
  return it->second;
}

/// e(n) = E[max of n iid N(0, 1)].
inline double expected_max_normal(long long n) {
  return max_of_normals(n).mean;
}

/// s(n), the standard deviation of the max of n iid N(0, 1).
inline double sd_max_normal(long long n) {
  return max_of_normals(n).sd;
}

/// Seconds the slowest of n_step ranks adds to a step of mean compute C: C cv e(n_step).
inline double straggler_step_wait(const straggler_model& m, double compute, long long n_step) {
  return m.active() ? compute * m.cv * expected_max_normal(n_step) : 0.0;
}

/// Seconds per step the syncs add by waiting for the slowest of `components` components of
/// n_step ranks, with `syncs_per_step` barriers per step (1 / K): C cv s(n_step)
/// e(components) sqrt(syncs_per_step). 0 when nothing syncs.
inline double straggler_sync_wait(const straggler_model& m, double compute, long long n_step,
                                  long long components, double syncs_per_step) {
  if (!m.active() || components <= 1 || syncs_per_step <= 0) return 0.0;
  return compute * m.cv * sd_max_normal(n_step) * expected_max_normal(components) *
         std::sqrt(syncs_per_step);
}

}  // namespace fedshard::sim
