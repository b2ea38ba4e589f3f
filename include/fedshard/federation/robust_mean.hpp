#pragma once
/// median and trimmed_mean: coordinate-wise robust combinations of the groups'
/// parameters, so that a few groups with wild values (a diverged or malicious group, 1e30 or
/// NaN) cannot drag the synchronised model with them.
///
/// The sync plan (fragment_gather_ops) gathers every group's copy of the fragment on every
/// replica: one all_gather over the federation axis, role fragment -> role gathered (G x
/// numel f32, by group), at sync_exchange. end() then writes into the fragment buffer, element
/// by element, the median (or trimmed mean) over the included groups (sync_info::included;
/// the groups left out are ignored) of gathered[g * numel + i]:
///  - the included values are sorted in a total order: -0 before +0, NaN after +inf (NaNs
///    sort last, whatever their payload);
///  - median: the middle value of an odd count; (a + b) / 2 in float of the two middle ones
///    of an even count (so for G = 2 it is bit-identical to `average`'s (θ_0 + θ_1) / 2; two
///    middle values of ±3e38 overflow to ±inf, -inf and +inf give NaN);
///  - trimmed_mean: k = floor(n Num / Den) values dropped from each end (Num / Den: the
///    run-time setting config::trim, 1/4 unless set; it must be below 1/2), the other
///    n - 2k summed in float in ascending order, then divided by n - 2k
///    (a trim of 0 / 1 is a plain mean, summed in sorted order, not rank order);
///  - NaN, sorting last, is ignored where the rule ignores the largest values: a median is
///    NaN only when a middle value is (at least half of the included groups hold NaN there),
///    a trimmed mean only when more than k of them do.
/// Every rank computes the same bits from the same gathered values.
///
/// Cost. Every replica of a group gathers the whole fragment (B bytes): each rank sends
/// (G - 1) B on the federation axis, R (G - 1) B per group, against 2 (G - 1) B / (G R) per
/// rank and 2 (G - 1) B / G per group for a hierarchical average. A factor G / 2 comes from
/// gathering G copies instead of reducing them on the way; a factor R from not splitting
/// the fragment over the replicas. The split would be correct (the rule is coordinate-wise:
/// replica r could combine its 1/R piece, then the replicas all-gather the pieces), but the
/// sharing inside the group runs at sync_finish, before end(), and nothing runs between
/// end() and the mix-in: the combined values must be complete on every replica before
/// anything could be shared inside the group, so every replica gathers and combines all of
/// it.
///
/// State. The gathered buffer of fragment f holds G x numel elements, and G is not known
/// when the policy is built (F(config, fragment_sizes): the synchronizer passes no mesh).
/// begin(), which the synchronizer calls on every sync before it fires sync_exchange, sizes it
/// from sync_info::groups (prepare()): allocated from the space at the first sync and kept
/// afterwards (a sync with the same G allocates nothing). state() is empty: nothing is
/// carried from one sync to the next. A sync in flight or communicated cannot be resumed
/// from a checkpoint (the gathered copies are not saved): end() without a begin() on this
/// object since the last end() is an invalid_argument.
///
/// Memory spaces: the combination runs on the host, after end() synchronizes with the sync
/// stream, so any host-accessible space works (host_space, checked_space); a device space is
/// refused at compile time.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/federation/federation_policy.hpp"
#include "fedshard/federation/sync_plan.hpp"
#include "fedshard/optim/optimizer.hpp"
#include "fedshard/space/host_space.hpp"
#include "fedshard/space/memory_space.hpp"

namespace fedshard::federation {

/// The settings of median.
struct robust_mean_config {
  /// Ignored: both modes give the same plan (every replica gathers the whole fragment).
  sync_mode sync = sync_mode::hierarchical;
};

/// The fraction num / den of the included groups that trimmed_mean drops at each end.
struct trim_fraction {
  int num = 1;
  int den = 4;

  friend bool operator==(const trim_fraction&, const trim_fraction&) = default;
};

/// The settings of trimmed_mean.
struct trimmed_mean_config {
  /// Ignored: both modes give the same plan (every replica gathers the whole fragment).
  sync_mode sync = sync_mode::hierarchical;
  /// floor(n num / den) values dropped from each end of n; den > 0, 0 <= num / den < 1/2.
  trim_fraction trim{};
};

namespace detail {

/// The total order robust means sort by: -0 before +0, every NaN after +inf.
inline bool nan_last_less(float a, float b) noexcept {
  if (std::isnan(a)) return false;
  if (std::isnan(b)) return true;
  if (a != b) return a < b;
  return std::signbit(a) && !std::signbit(b);
}

/// The median of values sorted by nan_last_less (at least one).
struct median_rule {
  using config = robust_mean_config;
  static constexpr std::string_view name = "median";
  explicit median_rule(const config&) noexcept {}
  float combine(std::span<const float> sorted) const noexcept {
    const std::size_t n = sorted.size(), h = n / 2;
    if (n % 2 == 1) return sorted[h];
    return (sorted[h - 1] + sorted[h]) / 2.0f;
  }
};

/// The mean of values sorted by nan_last_less (at least one) without floor(n num / den) of
/// them at each end (config::trim), summed in ascending order.
class trimmed_rule {
 public:
  using config = trimmed_mean_config;
  static constexpr std::string_view name = "trimmed_mean";
  /// invalid_argument unless 0 <= num / den < 1/2 with den > 0.
  explicit trimmed_rule(const config& c) : num_(c.trim.num), den_(c.trim.den) {
    FEDSHARD_EXPECTS(c.trim.den > 0 && c.trim.num >= 0 && 2 * c.trim.num < c.trim.den,
                     "trimmed_mean: the fraction trimmed from each end, trim = num / den, must be "
                     "in [0, 1/2) with den > 0, found ",
                     c.trim.num, " / ", c.trim.den, " (use federation::median for the middle)");
  }
  float combine(std::span<const float> sorted) const noexcept {
    const std::size_t n = sorted.size();
    const std::size_t k = n * static_cast<std::size_t>(num_) / static_cast<std::size_t>(den_);
    float sum = 0.0f;
    for (std::size_t i = k; i < n - k; ++i) sum += sorted[i];
    return sum / static_cast<float>(n - 2 * k);
  }

 private:
  int num_;
  int den_;
};

}  // namespace detail

/// The coordinate-wise Rule (detail::median_rule, detail::trimmed_rule) of the groups'
/// parameters, in host-accessible memory space S (see the file comment).
template <class Rule, space::MemorySpace S = space::host_space>
class basic_robust_mean {
  static_assert(S::host_accessible,
                "federation::median and trimmed_mean combine the groups' copies on the host: "
                "their memory space must be host-accessible (host_space); a device kernel is "
                "not written yet, so use federation::average in device memory");

 public:
  /// The Rule's settings (robust_mean_config, trimmed_mean_config).
  using config = typename Rule::config;
  template <space::MemorySpace T>
  using in_space = basic_robust_mean<Rule, T>;
  static constexpr std::string_view name = Rule::name;
  static constexpr bool syncs = true;

  basic_robust_mean() : rule_(config{}), space_(space::space_ref<S>::make()) {}
  basic_robust_mean(config c, std::vector<std::size_t> sizes)
      : basic_robust_mean(c, std::move(sizes), space::space_ref<S>::make()) {}
  basic_robust_mean(config c, std::vector<std::size_t> sizes, S& s)
      : basic_robust_mean(c, std::move(sizes), space::space_ref<S>(s)) {}

  /// Every group's fragment gathered on every replica (fragment_gather_ops).
  plan sync_plan(const sync_context& ctx) const { return fragment_gather_ops(ctx); }

  /// Sizes fragment f's gathered buffer for `groups` groups (allocates only when its size
  /// changes); begin() does it.
  void prepare(int f, int groups) {
    const std::size_t i = checked(f, "prepare");
    FEDSHARD_EXPECTS(groups >= 1, name, ": expected at least one group, found ", groups);
    const std::size_t want = static_cast<std::size_t>(groups) * sizes_[i];
    if (gathered_[i].size() != want) gathered_[i] = space_->template allocate<float>(want);
  }
  /// Fragment f's copies of every group (G x numel, by group; role gathered), in the space's
  /// memory; empty before the first prepare().
  std::span<float> gathered(int f) { return gathered_[checked(f, "gathered")].span(); }

  /// Leaves buf (the parameters) as it is; sizes the gathered buffer for info.groups.
  void begin(int f, std::span<float> buf, const sync_info& info, typename S::stream&) {
    const std::size_t i = checked(f, "begin");
    expect_numel(i, buf);
    prepare(f, info.groups);
    pending_[i] = true;
  }
  /// buf = the Rule over the included groups of the gathered copies, element by element;
  /// the host waits for the work queued on st first.
  void end(int f, std::span<float> buf, const sync_info& info, typename S::stream& st) {
    const std::size_t i = checked(f, "end");
    expect_numel(i, buf);
    FEDSHARD_EXPECTS(pending_[i], name, ": end() of fragment ", f,
                     " without a begin() since the last end(): the groups' copies were not "
                     "gathered by this object (a sync restored from a checkpoint in flight cannot "
                     "be completed)");
    const std::size_t n = sizes_[i];
    const auto G = static_cast<std::size_t>(info.groups);
    FEDSHARD_EXPECTS(gathered_[i].size() == G * n, name, ": fragment ", f, " gathered ",
                     gathered_[i].size() / std::max<std::size_t>(n, 1), " groups' copies, but ",
                     "the sync has ", info.groups);
    FEDSHARD_EXPECTS(info.included.empty() || info.included.size() == G, name,
                     ": sync_info::included names ", info.included.size(), " groups, expected ",
                     info.groups);
    groups_.clear();
    for (std::size_t g = 0; g < G; ++g)
      if (info.includes(static_cast<int>(g))) groups_.push_back(g);
    FEDSHARD_EXPECTS(!groups_.empty(), name, ": sync_info::included leaves out all ", info.groups,
                     " groups");
    space_->synchronize(st);  // the gathered copies (and buf) as the sync stream leaves them
    const float* all = gathered_[i].data();
    values_.resize(groups_.size());
    for (std::size_t e = 0; e < n; ++e) {
      for (std::size_t k = 0; k < groups_.size(); ++k) values_[k] = all[groups_[k] * n + e];
      std::sort(values_.begin(), values_.end(), detail::nan_last_less);
      buf[e] = rule_.combine(values_);
    }
    pending_[i] = false;
  }
  /// Nothing to restart from.
  void reset(int, std::span<const float>, typename S::stream&) {}

  /// begin(), end() and reset() on a stream of their own, done when they return.
  void begin(int f, std::span<float> buf, const sync_info& info) {
    auto st = space_->make_stream();
    begin(f, buf, info, st);
  }
  void end(int f, std::span<float> buf, const sync_info& info) {
    auto st = space_->make_stream();
    end(f, buf, info, st);
  }
  void reset(int, std::span<const float>) {}

  /// Nothing to checkpoint.
  std::vector<optim::state_tensor> state() { return {}; }

 private:
  basic_robust_mean(config c, std::vector<std::size_t> sizes, space::space_ref<S> sr)
      : rule_(c), space_(std::move(sr)), sizes_(std::move(sizes)), pending_(sizes_.size(), false) {
    gathered_.resize(sizes_.size());
  }

  std::size_t checked(int f, const char* what) const {
    FEDSHARD_EXPECTS(f >= 0 && static_cast<std::size_t>(f) < sizes_.size(), name, "::", what,
                     ": fragment must be in [0, ", sizes_.size(), "), found ", f);
    return static_cast<std::size_t>(f);
  }
  void expect_numel(std::size_t i, std::span<float> buf) const {
    FEDSHARD_EXPECTS(buf.size() == sizes_[i], name, ": fragment ", i, " has ", sizes_[i],
                     " elements, found a buffer of ", buf.size());
  }

  Rule rule_;                  // first: bad settings throw before anything is allocated
  space::space_ref<S> space_;  // before the buffers: they go back to it
  std::vector<std::size_t> sizes_;
  std::vector<typename S::template buffer<float>> gathered_;  // role gathered, per fragment
  std::vector<bool> pending_;        // begin() called, end() not yet, per fragment
  std::vector<std::size_t> groups_;  // end()'s scratch: the included groups
  std::vector<float> values_;        // end()'s scratch: one element's included values
};

/// The coordinate-wise median of the groups' parameters, on the host.
using median = basic_robust_mean<detail::median_rule>;

/// The coordinate-wise mean of the groups' parameters without the floor(n num / den) lowest
/// and highest values of each element (n: the included groups; num / den: config::trim,
/// 1/4 unless set), on the host.
using trimmed_mean = basic_robust_mean<detail::trimmed_rule>;

}  // namespace fedshard::federation
