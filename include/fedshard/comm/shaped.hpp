#pragma once
/// A Communicator wrapper that emulates a slow link between sites.
///
/// World ranks are placed on sites. A collective whose members span more than one site also
/// crosses the inter-site link: it completes no earlier than latency + cross-site bytes /
/// bandwidth after its last member arrived (its result needs every member's data) and the
/// link is free. Cross-site bytes follow the ring algorithms: a ring over
/// the members crosses the link once in each direction, and each ring edge carries the
/// op's bus bytes (nccl-tests: all_reduce 2(n-1)/n x S, all_gather and reduce_scatter
/// (n-1)/n x S, broadcast S, with S the whole array). The link is one shared resource of the
/// world: concurrent cross-site collectives (for example the replica all_reduces of
/// different shards) queue on it. Async operations overlap their delay with whatever the
/// caller does until wait(). Point-to-point messages between sites take latency + bytes /
/// bandwidth, without queueing. The emulation only adds waiting: results are those of the
/// wrapped communicator, bit for bit.
///
/// Uneven links: a topology may give each site its own link (`site_links`, e.g. one site 10x
/// slower than the rest). A pair of sites then talks at the slower of its two links (the
/// lower bandwidth, the higher latency), a collective spanning a set of sites at the slowest
/// of theirs, and each site's link is its own resource: a collective occupies the links of
/// every site its members sit on, so collectives over disjoint sets of sites do not queue on
/// each other. Without `site_links` every site uses `wan` and the world has the one link above.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fedshard/comm/blocking.hpp"
#include "fedshard/comm/communicator.hpp"
#include "fedshard/comm/request.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/error.hpp"

namespace fedshard::shaped {

/// The emulated inter-site link.
struct link {
  double bandwidth_bytes_per_s = 125e6;  ///< 1 Gbit/s
  double latency_s = 5e-3;               ///< one way, per collective
};

/// Which site each world rank sits on, and the link between sites.
struct topology {
  std::vector<int> site_of_rank;
  link wan{};
  /// Each site's own link, indexed by site (optional): empty means every site uses `wan` and
  /// the world shares one link; otherwise it names a link for every site of site_of_rank.
  std::vector<link> site_links{};

  /// n ranks in `sites` contiguous blocks of equal size.
  static topology blocks(int n, int sites, link l = {}) {
    FEDSHARD_EXPECTS(sites >= 1 && n >= sites && n % sites == 0, "shaped::topology: ", n,
                     " ranks do not split into ", sites, " equal sites");
    topology t;
    t.wan = l;
    for (int r = 0; r < n; ++r) t.site_of_rank.push_back(r / (n / sites));
    return t;
  }
  /// blocks(n, sites, l), each site with its own link l, except site `slow`, whose link is
  /// `factor` times slower (bandwidth / factor, latency x factor).
  static topology blocks_with_slow_site(int n, int sites, link l, int slow, double factor) {
    FEDSHARD_EXPECTS(slow >= 0 && slow < sites && factor >= 1.0, "shaped::topology: the slow site ",
                     slow, " must be one of the ", sites, " sites and its factor >= 1, found ",
                     factor);
    topology t = blocks(n, sites, l);
    t.site_links.assign(static_cast<std::size_t>(sites), l);
    t.site_links[static_cast<std::size_t>(slow)] = {
        .bandwidth_bytes_per_s = l.bandwidth_bytes_per_s / factor,
        .latency_s = l.latency_s * factor};
    return t;
  }

  /// The number of sites (1 + the highest site of a rank).
  int num_sites() const {
    int n = 0;
    for (int s : site_of_rank) n = std::max(n, s + 1);
    return n;
  }
  /// The link a transfer among `sites` uses: the slowest of their links (the lowest
  /// bandwidth, the highest latency); `wan` without site_links.
  link between(const std::vector<int>& sites) const {
    if (site_links.empty() || sites.empty()) return wan;
    link l = site_links.at(static_cast<std::size_t>(sites.front()));
    for (int s : sites) {
      const link& x = site_links.at(static_cast<std::size_t>(s));
      l.bandwidth_bytes_per_s = std::min(l.bandwidth_bytes_per_s, x.bandwidth_bytes_per_s);
      l.latency_s = std::max(l.latency_s, x.latency_s);
    }
    return l;
  }
  /// Emulated seconds of `bytes` among `sites` on an idle link: latency + bytes / bandwidth.
  double transfer_seconds(double bytes, const std::vector<int>& sites) const {
    const link l = between(sites);
    return l.latency_s + bytes / l.bandwidth_bytes_per_s;
  }
};

/// What one rank spent on the emulated link.
struct link_stats {
  std::int64_t crossing_ops = 0;
  double crossing_bytes = 0;  ///< one direction, bus bytes of the ops that crossed
  double delay_s = 0;         ///< time waited beyond the wrapped operation
  double link_s = 0;  ///< emulated link time of the crossing ops (latency + bytes / bandwidth
                      ///< each, without queueing): the model's figure, free of wall-clock noise
};

namespace detail {
using clock = std::chrono::steady_clock;

/// The link_stats of one rank's world communicator and of every communicator split from it
/// (the mesh's axes, the interpreter's sub-communicators of holder sets): a rank's threads
/// may use several of them at once.
struct family_stats {
  std::mutex mu;
  link_stats s;
};
}  // namespace detail

/// The emulated network of one in-process world: create it once, before the ranks start,
/// and give it to every rank's shaped::communicator; it serialises the cross-site
/// collectives of the whole world on the one link.
class network {
  using clock = std::chrono::steady_clock;

 public:
  explicit network(topology t)
      : topo(std::move(t)),
        free_at_(topo.site_links.empty() ? 1 : topo.site_links.size(), clock::time_point{}) {
    FEDSHARD_EXPECTS(topo.wan.bandwidth_bytes_per_s > 0 && topo.wan.latency_s >= 0,
                     "shaped::network: link bandwidth must be > 0 and latency >= 0, found ",
                     topo.wan.bandwidth_bytes_per_s, " B/s and ", topo.wan.latency_s, " s");
    FEDSHARD_EXPECTS(
        topo.site_links.empty() || static_cast<int>(topo.site_links.size()) >= topo.num_sites(),
        "shaped::network: site_links names ", topo.site_links.size(),
        " links but the ranks sit on ", topo.num_sites(), " sites");
    for (const link& l : topo.site_links)
      FEDSHARD_EXPECTS(l.bandwidth_bytes_per_s > 0 && l.latency_s >= 0,
                       "shaped::network: link bandwidth must be > 0 and latency >= 0, found ",
                       l.bandwidth_bytes_per_s, " B/s and ", l.latency_s, " s");
  }
  /// A shared network for the given topology.
  static std::shared_ptr<network> create(topology t) {
    return std::make_shared<network>(std::move(t));
  }

  /// Member arrival at collective `key` carrying `bytes` over `members` ranks on `sites`
  /// (sorted, distinct). The link carries it once every member has arrived (a collective's
  /// result needs every member's data): the last to arrive reserves the link (with site
  /// links: the link of each of `sites`) from then, or from when it is free.
  void arrive(const std::string& key, double bytes, int members,
              const std::vector<int>& sites = {}) {
    std::lock_guard lock(mu_);
    entry& e = pending_[key];
    if (++e.arrived < members) return;
    const link l = topo.between(sites);
    std::vector<std::size_t> used;
    if (topo.site_links.empty() || sites.empty())
      used.push_back(0);
    else
      for (int s : sites) used.push_back(static_cast<std::size_t>(s));
    auto start = clock::now();
    for (std::size_t u : used) start = std::max(start, free_at_[u]);
    const auto end = start + seconds(bytes / l.bandwidth_bytes_per_s);
    for (std::size_t u : used) free_at_[u] = end;
    e.done = end + seconds(l.latency_s);
    e.reserved = true;
    reserved_.notify_all();
  }
  /// When collective `key` completes on the link, once its last member arrived (nullopt
  /// before, unless `block`: then it waits for that). Each of the `members` asks until it has
  /// an answer; the last answer forgets the key.
  std::optional<clock::time_point> completion(const std::string& key, int members, bool block) {
    std::unique_lock lock(mu_);
    if (block) reserved_.wait(lock, [&] { return pending_[key].reserved; });
    auto it = pending_.find(key);
    if (it == pending_.end() || !it->second.reserved) return std::nullopt;
    const auto done = it->second.done;
    if (++it->second.answered == members) pending_.erase(it);
    return done;
  }
  static clock::duration seconds(double s) {
    return std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(s));
  }

  const topology topo;

 private:
  struct entry {
    int arrived = 0;
    bool reserved = false;
    clock::time_point done{};
    int answered = 0;
  };
  std::mutex mu_;
  std::condition_variable reserved_;
  std::vector<clock::time_point> free_at_;  // per link: one, or one per site
  std::map<std::string, entry> pending_;
};

namespace detail {
enum class kind : std::uint8_t { all_reduce, all_gather, reduce_scatter, broadcast };

inline double bus_bytes(kind k, std::int64_t count, dtype t, int n) {
  const double per = static_cast<double>(count) * static_cast<double>(size_of(t));
  const double nn = n;
  switch (k) {
    case kind::all_reduce: return 2.0 * (nn - 1) / nn * per;
    case kind::all_gather:
    case kind::reduce_scatter: return (nn - 1) * per;  // count is per rank: S = n x count
    case kind::broadcast: return per;
  }
  return 0;
}

/// A request that also waits for the emulated link: the wrapped call, then the link's
/// completion of collective `key` (reserved when its last member arrived).
class shaped_request final : public fedshard::detail::request_state {
 public:
  shaped_request(request inner, network& net, std::string key, int members, link_stats* stats)
      : inner_(std::move(inner)),
        net_(&net),
        key_(std::move(key)),
        members_(members),
        stats_(stats) {}
  /// A request that completes at `done` on the link (a point-to-point message).
  shaped_request(request inner, clock::time_point done, link_stats* stats)
      : inner_(std::move(inner)), net_(nullptr), members_(0), done_(done), stats_(stats) {}
  void wait() override {
    inner_.wait();
    if (!done_) done_ = net_->completion(key_, members_, true);
    const auto now = clock::now();
    if (now < *done_) {
      stats_->delay_s += std::chrono::duration<double>(*done_ - now).count();
      std::this_thread::sleep_until(*done_);
    }
  }
  bool test() override {
    if (!inner_.test()) return false;
    if (!done_) done_ = net_->completion(key_, members_, false);
    return done_ && clock::now() >= *done_;
  }

 private:
  request inner_;
  network* net_;
  std::string key_;
  int members_;
  std::optional<clock::time_point> done_;
  link_stats* stats_;
};
}  // namespace detail

/// Wraps Communicator C; models Communicator itself.
template <Communicator C>
class communicator : public blocking_calls<communicator<C>> {
 public:
  /// Wraps a world communicator (its rank() is the world rank used by the network's
  /// topology); every rank of the world passes the same network.
  communicator(C world, std::shared_ptr<network> net)
      : inner_(std::move(world)),
        link_(std::move(net)),
        stats_(std::make_unique<link_stats>()),
        family_(std::make_shared<detail::family_stats>()),
        uid_("w") {
    FEDSHARD_EXPECTS(static_cast<int>(link_->topo.site_of_rank.size()) == inner_.size(),
                     "shaped::communicator: the topology places ", link_->topo.site_of_rank.size(),
                     " ranks but the world has ", inner_.size());
    for (int r = 0; r < inner_.size(); ++r) members_.push_back(r);
    set_crossing();
  }

  communicator(communicator&&) noexcept = default;
  communicator& operator=(communicator&&) noexcept = default;

  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  /// What the wrapped communicator moved: the emulation only adds waiting.
  moved_bytes moved() const { return inner_.moved(); }
  /// The wrapped communicator's algorithm.
  wire_algorithm algorithm_of(collective k, std::int64_t n, dtype t) const {
    return inner_.algorithm_of(k, n, t);
  }
  /// True when this communicator's members span more than one site.
  bool crosses_sites() const noexcept { return crosses_; }
  /// What this rank spent on the link through this communicator.
  const link_stats& stats() const noexcept { return *stats_; }
  /// What this rank spent on the link through this communicator, the world communicator it
  /// was split from and every communicator split from that world (delay_s: not counted):
  /// on the world communicator, everything the rank sent across.
  link_stats family_stats() const {
    std::lock_guard lock(family_->mu);
    return family_->s;
  }
  /// The wrapped communicator.
  C& inner() noexcept { return inner_; }

  /// The wrapped barrier, then the link's latency when this communicator crosses sites.
  void barrier() {
    inner_.barrier();
    ++seq_;
    delay(0).wait();
  }
  request all_reduce_async(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    return shape(inner_.all_reduce_async(in, out, n, t, op), detail::kind::all_reduce, n, t);
  }
  request all_gather_async(const void* in, void* out, std::int64_t n, dtype t) {
    return shape(inner_.all_gather_async(in, out, n, t), detail::kind::all_gather, n, t);
  }
  request reduce_scatter_async(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    return shape(inner_.reduce_scatter_async(in, out, n, t, op), detail::kind::reduce_scatter, n,
                 t);
  }
  request broadcast_async(void* buf, std::int64_t n, dtype t, int root) {
    return shape(inner_.broadcast_async(buf, n, t, root), detail::kind::broadcast, n, t);
  }
  request send_async(const void* buf, std::int64_t n, dtype t, int peer, int tag = 0) {
    return p2p(inner_.send_async(buf, n, t, peer, tag), peer, n, t, true);
  }
  /// Waits as long as the matching send; the bytes are counted once, by the sender.
  request recv_async(void* buf, std::int64_t n, dtype t, int peer, int tag = 0) {
    return p2p(inner_.recv_async(buf, n, t, peer, tag), peer, n, t, false);
  }

  /// Collective: as C::split; the result is shaped by the same link.
  communicator split(int color, int key) {
    C child = inner_.split(color, key);
    // The child's members as world ranks, in child rank order.
    double mine = members_[static_cast<std::size_t>(inner_.rank())];
    std::vector<double> all(static_cast<std::size_t>(child.size()));
    child.all_gather(&mine, all.data(), 1, dtype::f64);
    communicator c(std::move(child), link_, family_,
                   uid_ + "/" + std::to_string(splits_++) + "." + std::to_string(color));
    for (double w : all) c.members_.push_back(static_cast<int>(w));
    c.set_crossing();
    return c;
  }

 private:
  communicator(C inner, std::shared_ptr<network> l, std::shared_ptr<detail::family_stats> family,
               std::string uid)
      : inner_(std::move(inner)),
        link_(std::move(l)),
        stats_(std::make_unique<link_stats>()),
        family_(std::move(family)),
        uid_(std::move(uid)) {}

  /// Counts one crossing op of `bytes` (one direction) and `seconds` of link time.
  void count(double bytes, double seconds) {
    stats_->crossing_ops += 1;
    stats_->crossing_bytes += bytes;
    stats_->link_s += seconds;
    std::lock_guard lock(family_->mu);
    family_->s.crossing_ops += 1;
    family_->s.crossing_bytes += bytes;
    family_->s.link_s += seconds;
  }

  void set_crossing() {
    sites_.clear();
    for (int w : members_) sites_.push_back(link_->topo.site_of_rank[static_cast<std::size_t>(w)]);
    std::sort(sites_.begin(), sites_.end());
    sites_.erase(std::unique(sites_.begin(), sites_.end()), sites_.end());
    crosses_ = sites_.size() > 1;
  }

  request shape(request inner, detail::kind k, std::int64_t n, dtype t) {
    const std::uint64_t seq = seq_++;
    if (!crosses_) return inner;
    const double bytes = detail::bus_bytes(k, n, t, size());
    std::string key = uid_ + "#" + std::to_string(seq);
    link_->arrive(key, bytes, size(), sites_);
    count(bytes, link_->topo.transfer_seconds(bytes, sites_));
    return request(std::make_unique<detail::shaped_request>(std::move(inner), *link_,
                                                            std::move(key), size(), stats_.get()));
  }
  request delay(double bytes) {
    if (!crosses_) return request();
    std::string key = uid_ + "#" + std::to_string(seq_ - 1);
    link_->arrive(key, bytes, size(), sites_);
    return request(std::make_unique<detail::shaped_request>(request(), *link_, std::move(key),
                                                            size(), stats_.get()));
  }
  request p2p(request inner, int peer, std::int64_t n, dtype t, bool sends) {
    const auto& site = link_->topo.site_of_rank;
    const int me = members_[static_cast<std::size_t>(rank())];
    const int other = members_.at(static_cast<std::size_t>(peer));
    if (site[static_cast<std::size_t>(me)] == site[static_cast<std::size_t>(other)]) return inner;
    const double bytes = static_cast<double>(n) * static_cast<double>(size_of(t));
    const std::vector<int> pair{site[static_cast<std::size_t>(me)],
                                site[static_cast<std::size_t>(other)]};
    const double s = link_->topo.transfer_seconds(bytes, pair);
    const auto done = detail::clock::now() + network::seconds(s);
    if (sends) count(bytes, s);
    return request(std::make_unique<detail::shaped_request>(std::move(inner), done, stats_.get()));
  }

  C inner_;
  std::shared_ptr<network> link_;
  std::unique_ptr<link_stats> stats_;
  std::shared_ptr<detail::family_stats> family_;  // shared with the world and its splits
  std::string uid_;
  std::vector<int> members_;  // world ranks, in this communicator's rank order
  std::vector<int> sites_;    // the sites of the members, sorted, distinct
  bool crosses_ = false;
  std::uint64_t seq_ = 0;
  int splits_ = 0;
};

}  // namespace fedshard::shaped
