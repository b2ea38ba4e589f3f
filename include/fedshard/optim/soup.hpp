#pragma once
/// Local Superior Soups (LSS, arXiv 2410.23660): the local soup of one rank's f32 shard, a
/// pool of up to M members and the anchor (the model the round started from), trained by
/// sequential random interpolation with an affinity and a diversity regulariser.
///
/// What the authors' code does (github.com/ubc-tea/Local-Superior-Soups, commit 1e244c0;
/// system/flcore/clients/clientlocalsuperiorsoups.py `train`, system/utils/soups/
/// superior_soups.py class SuperiorSoups), with a the anchor, v_0..v_{k-1} the k members now
/// in the pool (flattened over every souped parameter) and t = k - 1 the newest:
///
/// - Weights (superior_soups.py `vertex_weights`, drawn anew by every `forward`):
///   e_i = -log(U_i), U_i ~ Uniform[0,1) independent, w_i = e_i / sum_j e_j over all k
///   members, i.e. w ~ Dirichlet(1, ..., 1), uniform on the simplex; sum_i w_i = 1.
///   The model evaluated is p = sum_i w_i v_i (`sample`).
/// - Trained member: only v_t; `_fix_points` detaches every older member, so the gradient
///   reaching v_t through p is w_t * dL/dp. A fresh Adam is built whenever a member joins.
/// - Affinity (`dist_from_init`): R_a = aff_coeff * ||v_t - a||^2 (squared L2, no 1/2),
///   added to the loss: dR_a/dv_t = 2 aff_coeff (v_t - a).
/// - Diversity (`total_volume`): D_ij = ||v_i - v_j||^2 (gpytorch covar_dist, then
///   .pow(2)); CM is the (k+1) x (k+1) Cayley-Menger matrix [[D, 1], [1^T, 0]];
///   vol = |det CM| / ((k-1)!^2 2^(k-1)), the squared volume of the members' simplex (k = 2:
///   D_01; k = 3: the triangle's squared area). The loss gets - div_coeff * vol (the volume
///   is maximised): with C the cofactors of CM and CM symmetric,
///   dvol/dv_t = sum_{j != t} 4 sign(det CM) C_tj / ((k-1)!^2 2^(k-1)) * (v_t - v_j),
///   and sign(0) = 0 (torch's abs), so a degenerate simplex (a member that just joined as
///   the mean of the others) gets no diversity gradient.
/// - Schedule (`train`): phase 0 trains v_0 = a alone for local_steps epochs with the task
///   loss + R_a (no diversity); then for each of n_verts phases a member joins as the mean of
///   the pool (`add_vertex`: sum of the members, divided by k), the older ones are frozen,
///   and it trains for local_steps // 8 epochs with loss - div_coeff * vol + R_a. The pool
///   ends with n_verts + 1 members (defaults: n_verts 2, aff_coeff 1e-3, div_coeff 1e-3).
/// - What the client sends (`unsoups`): the members' uniform mean sum_i v_i / k; the server
///   (serverbase.py `aggregate_parameters`) averages clients weighted by their sample counts.
/// - Details not reproduced here: their phases after the first draw n_soups_sampling (2)
///   interpolations per batch and sum their losses (`loss.div(n)` is discarded), divide that
///   by 15 and step every 15 batches while adding the regularisers unscaled each batch, so
///   per optimizer step the regularisers weigh 15x against the mean task loss (scale the
///   coefficients to match); options used_imp (Fisher-weighted distances) and no_soups_fc
///   (linear layers outside the soup) are off by default and not built.
///
/// This file's pool: M members and the anchor held from construction ((M + 1) n floats);
/// weights are the spacings of k - 1 sorted uniforms (also Dirichlet(1, ..., 1)), drawn
/// from mix64 keyed by (seed, round, step, draw), so every rank of a group draws the same
/// weights without communicating, bit for bit on any platform (no log, no std::
/// distribution). The diversity gradient needs the D of the whole model: each rank computes
/// its shard's part (shard_distances), the group sums them over its shard axis, and every
/// rank derives the same coefficients from the sum (regularizer).
///
/// Use, per round and local step s (0-based within the round):
///   round start   start_round(round, master shard)
///   before fwd    if maybe_add_member(s): reset the inner optimizer's state; w = weights(s);
///                 interpolate(w, the parameters the engine gathers)
///   after bwd     shard_distances(d); sum d over the group's shard axis (not its replicas);
///                 add_regularizer_gradients(w, regularizer(d), the shard's gradient)
///   opt step      the inner optimizer steps trained_member() with that gradient
///   sync          average(the shard the federation policy sends)

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "fedshard/core/buffer.hpp"
#include "fedshard/core/mix.hpp"
#include "fedshard/error.hpp"
#include "fedshard/kernels/for_each.hpp"
#include "fedshard/kernels/soup.hpp"
#include "fedshard/kernels/weighted_sum.hpp"

namespace fedshard::optim {

/// The largest pool a soup_config may ask for.
inline constexpr int max_soup_pool = 16;

/// A local soup's settings (the authors' names in brackets).
struct soup_config {
  /// M, the members at the round's end, 1..max_soup_pool [n_verts + 1].
  int pool_size = 3;
  /// lambda_a, the affinity coefficient, >= 0 [aff_coeff].
  float affinity = 1e-3f;
  /// lambda_d, the diversity coefficient, >= 0 [div_coeff].
  float diversity = 1e-3f;
  /// Local steps member 0 trains alone before the second member joins, >= 0.
  std::int64_t first_steps = 8;
  /// Local steps each later member trains before the next joins, >= 1.
  std::int64_t add_every = 1;
  /// Keys the interpolation weights (with the round, the step and the draw).
  std::uint64_t seed = 0;
};

/// Throws invalid_argument unless cfg is a valid soup_config; returns it.
inline soup_config validated(soup_config cfg) {
  FEDSHARD_EXPECTS(cfg.pool_size >= 1 && cfg.pool_size <= max_soup_pool,
                   "soup_config: pool_size must be in [1, ", max_soup_pool, "], found ",
                   cfg.pool_size);
  FEDSHARD_EXPECTS(std::isfinite(cfg.affinity) && cfg.affinity >= 0.0f,
                   "soup_config: affinity must be finite and >= 0, found ", cfg.affinity);
  FEDSHARD_EXPECTS(std::isfinite(cfg.diversity) && cfg.diversity >= 0.0f,
                   "soup_config: diversity must be finite and >= 0, found ", cfg.diversity);
  FEDSHARD_EXPECTS(cfg.first_steps >= 0, "soup_config: first_steps must be >= 0, found ",
                   cfg.first_steps);
  FEDSHARD_EXPECTS(cfg.add_every >= 1, "soup_config: add_every must be >= 1, found ",
                   cfg.add_every);
  return cfg;
}

/// One step's regularisers, from the group's summed distances (soup_pool::regularizer).
struct soup_regularizer {
  /// lambda_a ||v_t - a||^2 over the whole model (NaN when no distances were given).
  double affinity_loss = 0.0;
  /// vol, the squared volume of the members' simplex (1 for one member; NaN when no
  /// distances were given).
  double volume = 1.0;
  /// -lambda_d vol, the diversity term of the loss.
  double diversity_loss = 0.0;
  /// 2 lambda_a: the affinity gradient is affinity_coef (v_t - a).
  float affinity_coef = 0.0f;
  /// Per member j: the diversity gradient is sum_{j != t} coef[j] (v_t - v_j).
  std::vector<float> coef;
};

namespace detail {

/// The determinant of the k x k row-major matrix a (Gaussian elimination with partial
/// pivoting, in double); 0 for a singular matrix.
inline double determinant(std::vector<double> a, std::size_t k) {
  double det = 1.0;
  for (std::size_t c = 0; c < k; ++c) {
    std::size_t p = c;
    for (std::size_t r = c + 1; r < k; ++r)
      if (std::fabs(a[r * k + c]) > std::fabs(a[p * k + c])) p = r;
    if (a[p * k + c] == 0.0) return 0.0;
    if (p != c) {
      for (std::size_t j = 0; j < k; ++j) std::swap(a[p * k + j], a[c * k + j]);
      det = -det;
    }
    det *= a[c * k + c];
    for (std::size_t r = c + 1; r < k; ++r) {
      const double f = a[r * k + c] / a[c * k + c];
      for (std::size_t j = c; j < k; ++j) a[r * k + j] -= f * a[c * k + j];
    }
  }
  return det;
}

/// The (k+1) x (k+1) Cayley-Menger matrix of k points from their pairwise squared
/// distances d (pairs (0,1), (0,2), ..., (1,2), ... in order).
inline std::vector<double> cayley_menger(std::span<const double> d, std::size_t k) {
  const std::size_t s = k + 1;
  std::vector<double> m(s * s, 0.0);
  std::size_t p = 0;
  for (std::size_t i = 0; i < k; ++i) {
    for (std::size_t j = i + 1; j < k; ++j, ++p) m[i * s + j] = m[j * s + i] = d[p];
    m[i * s + k] = m[k * s + i] = 1.0;
  }
  return m;
}

/// The cofactor (r, c) of the s x s matrix m.
inline double cofactor(const std::vector<double>& m, std::size_t s, std::size_t r, std::size_t c) {
  std::vector<double> minor;
  minor.reserve((s - 1) * (s - 1));
  for (std::size_t i = 0; i < s; ++i)
    for (std::size_t j = 0; j < s; ++j)
      if (i != r && j != c) minor.push_back(m[i * s + j]);
  const double det = determinant(std::move(minor), s - 1);
  return (r + c) % 2 == 0 ? det : -det;
}

/// (k-1)!^2 2^(k-1): the Cayley-Menger determinant over the squared volume.
inline double cayley_menger_norm(std::size_t k) {
  double f = 1.0;
  for (std::size_t i = 2; i < k; ++i) f *= static_cast<double>(i);
  return f * f * std::ldexp(1.0, static_cast<int>(k) - 1);
}

/// A uniform double in [0, 1): the top 53 bits of x.
inline double unit_interval(std::uint64_t x) noexcept {
  return static_cast<double>(x >> 11) * 0x1.0p-53;
}

}  // namespace detail

/// The local soup of one rank's shard of n floats, in host memory.
class soup_pool {
 public:
  /// Validates cfg and allocates the M members and the anchor (held_bytes()).
  soup_pool(soup_config cfg, std::size_t n)
      : cfg_(validated(cfg)),
        n_(n),
        storage_((static_cast<std::size_t>(cfg_.pool_size) + 1) * n, 0.0f) {}

  /// Starts round `round` from master (the shard's n floats): anchor = master, pool =
  /// {master}.
  void start_round(std::int64_t round, std::span<const float> master) {
    check_size("start_round: master", master.size());
    std::copy(master.begin(), master.end(), anchor().begin());
    std::copy(master.begin(), master.end(), member(0).begin());
    round_ = round;
    count_ = 1;
  }

  /// Restores a checkpointed round: its number and its member count (the members' and the
  /// anchor's values are written through member() and anchor()).
  void resume(std::int64_t round, std::size_t members) {
    FEDSHARD_EXPECTS(members >= 1 && members <= capacity(),
                     "soup_pool::resume: members must be "
                     "in [1, ",
                     capacity(), "], found ", members);
    round_ = round;
    count_ = members;
  }

  /// Adds the members the schedule has by local step `step` (0-based within the round),
  /// each the mean of the pool so far; call it before each step's weights. Returns whether
  /// one joined: the trained member changed, so reset the inner optimizer's state.
  bool maybe_add_member(std::int64_t step) {
    check_started("maybe_add_member");
    bool added = false;
    while (count_ < scheduled_members(step)) {
      mean_of_pool(member(count_));
      ++count_;
      added = true;
    }
    return added;
  }

  /// The members the schedule has at local step `step`.
  std::size_t scheduled_members(std::int64_t step) const noexcept {
    if (step < cfg_.first_steps) return 1;
    const std::int64_t later = 2 + (step - cfg_.first_steps) / cfg_.add_every;
    return static_cast<std::size_t>(std::min<std::int64_t>(later, cfg_.pool_size));
  }

  /// The interpolation weights of local step `step` (draw: a further index for several
  /// interpolations per step), one per member, >= 0, summing to 1 before their rounding to
  /// float: the spacings of members() - 1 sorted uniforms from mix64.
  std::vector<float> weights(std::int64_t step, std::int64_t draw = 0) const {
    check_started("weights");
    const std::uint64_t key =
        mix64(mix64(mix64(mix64(cfg_.seed) ^ static_cast<std::uint64_t>(round_)) ^
                    static_cast<std::uint64_t>(step)) ^
              static_cast<std::uint64_t>(draw));
    std::array<double, max_soup_pool + 1> cut{};
    const std::size_t k = count_;
    for (std::size_t i = 0; i + 1 < k; ++i) cut[i + 1] = detail::unit_interval(mix64(key + i));
    std::sort(cut.begin() + 1, cut.begin() + static_cast<std::ptrdiff_t>(k));
    cut[k] = 1.0;
    std::vector<float> w(k);
    for (std::size_t i = 0; i < k; ++i) w[i] = static_cast<float>(cut[i + 1] - cut[i]);
    return w;
  }

  /// out = sum_i w_i member_i, summed in member order (kernels::weighted_sum; a zero weight
  /// skips its member): the parameters the step's forward and backward see.
  void interpolate(std::span<const float> w, std::span<float> out) const {
    check_weights("interpolate", w);
    check_size("interpolate: out", out.size());
    std::array<const_buffer_view, max_soup_pool> ins{};
    std::array<double, max_soup_pool> wd{};
    for (std::size_t i = 0; i < count_; ++i) {
      ins[i] = const_buffer_view(member(i).data(), n_, dtype::f32);
      wd[i] = w[i];
    }
    kernels::weighted_sum(std::span(ins.data(), count_), std::span(wd.data(), count_), view(out));
  }

  /// The entries of shard_distances: one per pair of members, and the trained member's
  /// distance to the anchor.
  std::size_t distance_count() const noexcept { return count_ * (count_ - 1) / 2 + 1; }

  /// Whether regularizer() needs the distances (the diversity gradient): lambda_d > 0 and
  /// two members or more. Without them it still gives the affinity gradient.
  bool needs_distances() const noexcept { return cfg_.diversity != 0.0f && count_ >= 2; }

  /// This shard's part of the squared distances, in double: ||v_i - v_j||^2 for the pairs
  /// (0,1), (0,2), ..., (1,2), ... in order, then ||v_t - a||^2. The whole model's are the
  /// sum over the group's shards (the same on every replica).
  void shard_distances(std::span<double> out) const {
    check_started("shard_distances");
    FEDSHARD_EXPECTS(out.size() == distance_count(), "soup_pool::shard_distances: out must have ",
                     distance_count(), " entries for ", count_, " members, found ", out.size());
    std::size_t p = 0;
    for (std::size_t i = 0; i < count_; ++i)
      for (std::size_t j = i + 1; j < count_; ++j)
        out[p++] = squared_distance(member(i), member(j));
    out[p] = squared_distance(member(count_ - 1), anchor());
  }

  /// The step's regularisers from the whole model's distances (shard_distances summed over
  /// the shards; empty when !needs_distances(), then the losses are NaN).
  soup_regularizer regularizer(std::span<const double> distances) const;

  /// grad = w_t grad + affinity_coef (v_t - a) + sum_{j != t} coef[j] (v_t - v_j): the
  /// gradient at the interpolated parameters (from backprop) turned into the trained
  /// member's, regularisers included, ready for the inner optimizer's step on
  /// trained_member(). One member without regularisers leaves grad's bits alone.
  void add_regularizer_gradients(std::span<const float> w, const soup_regularizer& reg,
                                 std::span<float> grad) const {
    check_weights("add_regularizer_gradients", w);
    check_size("add_regularizer_gradients: grad", grad.size());
    FEDSHARD_EXPECTS(reg.coef.size() == count_,
                     "soup_pool::add_regularizer_gradients: the "
                     "regularizer has ",
                     reg.coef.size(), " coefficients, the pool ", count_, " members");
    // kernels::soup_gradient_fn's terms as whole-array passes (vectorised; the same bits).
    const std::size_t t = count_ - 1;
    const float* trained = member(t).data();
    if (w[t] != 1.0f) kernels::for_each_element(kernels::soup_scale_fn{w[t]}, n_, grad.data());
    if (reg.affinity_coef != 0.0f)
      kernels::for_each_element(kernels::soup_term_fn{reg.affinity_coef}, n_, grad.data(), trained,
                                anchor().data());
    for (std::size_t j = 0; j < count_; ++j)
      if (j != t && reg.coef[j] != 0.0f)
        kernels::for_each_element(kernels::soup_term_fn{reg.coef[j]}, n_, grad.data(), trained,
                                  member(j).data());
  }

  /// out = the members' mean (summed in member order, divided by members()): what the group
  /// contributes at sync.
  void average(std::span<float> out) const {
    check_started("average");
    check_size("average: out", out.size());
    mean_of_pool(out);
  }

  /// Member i (i < members()); the trained one is the last.
  std::span<float> member(std::size_t i) {
    FEDSHARD_EXPECTS(i < capacity(), "soup_pool::member: index must be < ", capacity(), ", found ",
                     i);
    return {storage_.data() + i * n_, n_};
  }
  /// Member i, read-only.
  std::span<const float> member(std::size_t i) const {
    FEDSHARD_EXPECTS(i < capacity(), "soup_pool::member: index must be < ", capacity(), ", found ",
                     i);
    return {storage_.data() + i * n_, n_};
  }
  /// The member the inner optimizer steps (the newest).
  std::span<float> trained_member() {
    check_started("trained_member");
    return member(count_ - 1);
  }
  /// The anchor: the model the round started from.
  std::span<float> anchor() noexcept { return {storage_.data() + capacity() * n_, n_}; }
  /// The anchor, read-only.
  std::span<const float> anchor() const noexcept { return {storage_.data() + capacity() * n_, n_}; }

  /// The members in the pool now (0 before start_round).
  std::size_t members() const noexcept { return count_; }
  /// M, the members the pool holds room for.
  std::size_t capacity() const noexcept { return static_cast<std::size_t>(cfg_.pool_size); }
  /// The round start_round or resume set.
  std::int64_t round() const noexcept { return round_; }
  /// The shard's element count n.
  std::size_t size() const noexcept { return n_; }
  /// The bytes the pool holds: (M + 1) x n x 4, members and anchor, from construction.
  std::size_t held_bytes() const noexcept { return storage_.size() * sizeof(float); }
  /// The settings.
  const soup_config& settings() const noexcept { return cfg_; }

 private:
  void check_started(const char* what) const {
    FEDSHARD_EXPECTS(count_ >= 1, "soup_pool::", what,
                     ": the pool is empty, call start_round "
                     "first");
  }
  void check_size(const char* what, std::size_t found) const {
    FEDSHARD_EXPECTS(found == n_, "soup_pool::", what, " must have ", n_,
                     " elements (the shard size), found ", found);
  }
  void check_weights(const char* what, std::span<const float> w) const {
    check_started(what);
    FEDSHARD_EXPECTS(w.size() == count_, "soup_pool::", what, ": expected one weight per member (",
                     count_, "), found ", w.size());
  }
  static double squared_distance(std::span<const float> x, std::span<const float> y) noexcept {
    double s = 0.0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double d = static_cast<double>(x[i]) - static_cast<double>(y[i]);
      s += d * d;
    }
    return s;
  }
  void mean_of_pool(std::span<float> out) const {
    std::array<const float*, max_soup_pool> ms{};
    for (std::size_t i = 0; i < count_; ++i) ms[i] = member(i).data();
    const kernels::soup_mean_fn f{ms.data(), count_};
    for (std::size_t i = 0; i < n_; ++i) out[i] = f(i);
  }

  soup_config cfg_;
  std::size_t n_;
  std::vector<float> storage_;  // members 0..M-1, then the anchor
  std::size_t count_ = 0;
  std::int64_t round_ = 0;
};

inline soup_regularizer soup_pool::regularizer(std::span<const double> distances) const {
  check_started("regularizer");
  const std::size_t k = count_;
  soup_regularizer r;
  r.affinity_coef = 2.0f * cfg_.affinity;
  r.coef.assign(k, 0.0f);
  if (distances.empty() && !needs_distances()) {
    r.affinity_loss = r.volume = r.diversity_loss = std::numeric_limits<double>::quiet_NaN();
    return r;
  }
  FEDSHARD_EXPECTS(distances.size() == distance_count(), "soup_pool::regularizer: expected ",
                   distance_count(), " distances for ", k, " members, found ", distances.size());
  r.affinity_loss = static_cast<double>(cfg_.affinity) * distances[distance_count() - 1];
  const std::vector<double> cm = detail::cayley_menger(distances, k);
  const double det = detail::determinant(cm, k + 1);
  const double norm = detail::cayley_menger_norm(k);
  r.volume = std::fabs(det) / norm;
  r.diversity_loss = -static_cast<double>(cfg_.diversity) * r.volume;
  if (cfg_.diversity == 0.0f || det == 0.0) return r;
  const double sign = det > 0.0 ? 1.0 : -1.0;
  const std::size_t t = k - 1;
  for (std::size_t j = 0; j < t; ++j)
    r.coef[j] = static_cast<float>(-static_cast<double>(cfg_.diversity) * 4.0 * sign *
                                   detail::cofactor(cm, k + 1, t, j) / norm);
  return r;
}

}  // namespace fedshard::optim
