#pragma once
/// elastic::link: the federation axis between groups that are independent jobs, which may
/// crash, be pre-empted, start late or restart. It is the federation side of a hybrid world
/// (comm/hybrid.hpp): hybrid<C, elastic::link>, C being the group's own communicator.
///
/// Rounds. Every federation sync is a round (the trainer calls begin_round(step) on each rank
/// where a sync starts). The groups meet through a store (gloo::store: a file store or Redis):
///  1. arrive: rank (g, l) writes `<job>/r<e>/arrive/<g>/<l>`;
///  2. decide: the group leaders (local rank 0) of the groups that took part in the previous
///     round wait until every expected group has arrived (expected: the previous round's
///     members and late arrivals, less the groups dropped by a failure), at most
///     options::join_timeout, then the first of them writes the decision `<job>/r<e>/decision`
///     (create-if-absent: one decision per round): the members (groups that arrived with all
///     their ranks), the joiners among them (groups that take part for the first time after
///     round 0: started late or restarted), the participants (members that are not joiners,
///     sampled by options::participation), and the donor (the lowest member that is not a
///     joiner). Every rank reads the same decision;
///  3. connect: the members' ranks with local rank l make a Gloo context for the round
///     (`<job>/r<e>/link<l>`), so each round runs over the groups that are there.
/// A group that arrives after the decision, or is not a member, runs the round alone.
///
/// Collectives of a round (the rank is the group g, the size the configured G):
///  - all_reduce combines the participants' inputs in group order with the rank-order
///    reduction (comm/detail/reduction.hpp); avg divides by the number of participants. When
///    every group participates the result is bit-identical to inproc's over G ranks;
///  - all_gather: the participants' blocks in their group's slot, zeros in the others';
///  - robust aggregation (options::reject_nonfinite, options::clip_ratio): before an
///    all_reduce combines, every participant's input is checked: a non-finite value, or a
///    distance from the round's coordinate-wise median above clip_ratio x the median of the
///    participants' distances, rejects the group for this op (and the rest of the round),
///    with one log line naming group, round and reason. The groups' ranks agree on the
///    verdict through the store (each link's lowest member writes its statistics), so a
///    group is rejected on all its shards or on none; a rejected input is never combined;
///  - broadcast from a member; send and recv between members; barrier.
/// Outside a round (before the first) the link is the group alone (a communicator of one).
///
/// Bytes moved (moved()): what the round's Gloo contexts moved for the link's calls, retries
/// included: an all_reduce gathers every member's whole input (algorithm_of: gather_all; a
/// reduce_scatter is an all_reduce of the whole input), so it moves what the members
/// actually combined, and nothing alone.
///
/// Failures. A member that dies (peer_failure) or hangs (timeout_error) in a round's
/// collective: the surviving ranks of the link retry the op among themselves (they meet
/// under `<job>/r<e>/op<k>/l<l>/a<attempt>`, waiting at most join_timeout for each other),
/// mark the missing groups dropped, and go on; later rounds no longer wait for them. No rank
/// of a live group throws, hangs or has its group's state touched.
///
/// Limits: screening judges all_reduce inputs (an encoded op's all_gather of wires is not
/// screened; use median / trimmed_mean for coordinate-wise robustness there); a group
/// rejected inside an op leaves weighted_average's scales, computed before the op, as they
/// were (plain averages and outer optimizers stay exact); a round ends when the next begins,
/// so a schedule whose federation ops outlive the step they start in (a delayed sync that
/// averages inner moments after the next fragment's round began) is not supported; store keys
/// are never deleted (a few per rank and round).
///
/// Healing: in a round with joiners, the trainer sends the donor's state (global model,
/// outer-optimizer state, step) to the joiners with send and recv over the round's context
/// before the sync (the heal plan of federation/heal.hpp, run by the interpreter), and the
/// joiners take part in the sync without contributing: after it their parameters equal the
/// others'.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fedshard/comm/blocking.hpp"
#include "fedshard/comm/communicator.hpp"
#include "fedshard/comm/detail/reduction.hpp"
#include "fedshard/comm/gloo.hpp"
#include "fedshard/comm/request.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/error.hpp"
#include "fedshard/kernels/cast.hpp"

namespace fedshard::elastic {

/// Each round a seeded sample of the live groups combines its models (Flower's fraction_fit):
/// max(min_groups, ceil(fraction x candidates)) of them, at most all; the same sample on every
/// rank (it is part of the round's decision).
struct participation {
  double fraction = 1.0;
  int min_groups = 1;
  std::uint64_t seed = 0;
};

/// Settings of an elastic link (the groups of one run must agree on all but the timeouts).
struct options {
  /// Namespace of the run's keys in the store.
  std::string job = "fedshard";
  /// How long a round waits for the expected groups (the federation timeout).
  std::chrono::duration<double> join_timeout{10.0};
  /// Settings of the rounds' Gloo contexts (their timeout bounds every collective).
  gloo::options transport{};
  participation sample{};
  /// Reject a participant whose input holds a NaN or an infinity.
  bool reject_nonfinite = true;
  /// Reject a participant whose distance from the coordinate-wise median exceeds clip_ratio
  /// times the median distance (0 = off; needs 3 or more participants). On by default: one
  /// group sending finite but wild values (x1e6) would otherwise be averaged into every
  /// model. Honest groups trained on the same task sit at comparable distances (ratios near
  /// 1); 3 leaves room for groups whose data differ.
  double clip_ratio = 3.0;
  /// Where the link's log lines go (default: stderr).
  std::function<void(const std::string&)> log{};
};

/// What a round decided.
struct round_info {
  std::int64_t round = -1;        ///< its number, from 0
  std::int64_t step = 0;          ///< the donor's step: the sync after that step
  std::vector<int> members;       ///< groups in the round's context, ascending
  std::vector<int> participants;  ///< members whose inputs are combined
  std::vector<int> joiners;       ///< members that heal in this round
  std::vector<int> left_out;      ///< expected groups that did not arrive in time
  int donor = -1;                 ///< the member joiners receive state from (-1: none)

  bool has(const std::vector<int>& v, int g) const {
    return std::find(v.begin(), v.end(), g) != v.end();
  }
  std::string text() const {
    auto list = [](const std::vector<int>& v) {
      std::string s = "{";
      for (std::size_t i = 0; i < v.size(); ++i) {
        if (i > 0) s += ',';  // not `"," + to_string(...)`: GCC 12's -Wrestrict misfires at -O3
        s += std::to_string(v[i]);
      }
      return s + "}";
    };
    return fedshard::detail::concat("round ", round, " (step ", step, "): members ", list(members),
                                    ", participants ", list(participants), ", joiners ",
                                    list(joiners), ", left out ", list(left_out), ", donor ",
                                    donor);
  }
};

namespace detail {
using fedshard::detail::concat;

inline std::string serialize(const round_info& r) {
  std::ostringstream os;
  auto put = [&](const std::vector<int>& v) {
    os << v.size();
    for (int g : v) os << ' ' << g;
    os << '\n';
  };
  os << r.round << ' ' << r.step << ' ' << r.donor << '\n';
  put(r.members);
  put(r.participants);
  put(r.joiners);
  put(r.left_out);
  return os.str();
}
inline round_info parse(const std::string& s) {
  std::istringstream is(s);
  round_info r;
  auto get = [&](std::vector<int>& v) {
    std::size_t n = 0;
    is >> n;
    v.resize(n);
    for (auto& g : v) is >> g;
  };
  is >> r.round >> r.step >> r.donor;
  get(r.members);
  get(r.participants);
  get(r.joiners);
  get(r.left_out);
  if (!is)
    throw backend_error("fedshard: elastic: a round decision in the store is corrupt: '" + s + "'");
  return r;
}

inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// The participation sample of round e among `candidates` (ascending): a seeded shuffle,
/// the first k, ascending.
inline std::vector<int> sample_of(std::vector<int> candidates, const participation& p,
                                  std::int64_t e) {
  const int n = static_cast<int>(candidates.size());
  if (p.fraction >= 1.0 || n == 0) return candidates;
  int k = static_cast<int>(std::ceil(p.fraction * n - 1e-9));
  k = std::clamp(std::max(k, p.min_groups), std::min(1, n), n);
  std::uint64_t s = mix(p.seed ^ mix(static_cast<std::uint64_t>(e)));
  for (int i = n - 1; i > 0; --i) {
    s = mix(s);
    std::swap(candidates[static_cast<std::size_t>(i)],
              candidates[static_cast<std::size_t>(s % static_cast<std::uint64_t>(i + 1))]);
  }
  candidates.resize(static_cast<std::size_t>(k));
  std::sort(candidates.begin(), candidates.end());
  return candidates;
}
}  // namespace detail

/// See the file comment. A Communicator of G ranks (rank = the group); one per rank.
class link : public blocking_calls<link> {
 public:
  /// Rank `local_rank` of group `group` (of `groups`), whose group has `group_size` ranks.
  /// Not collective: nothing is exchanged before the first round.
  link(std::shared_ptr<gloo::store> st, int groups, int group, int group_size, int local_rank,
       options o = {})
      : st_(std::move(st)),
        groups_(groups),
        group_(group),
        group_size_(group_size),
        local_(local_rank),
        o_(std::move(o)) {
    FEDSHARD_EXPECTS(st_ != nullptr, "elastic::link: the store is null");
    FEDSHARD_EXPECTS(groups >= 1 && group >= 0 && group < groups,
                     "elastic::link: group must be in [0, groups) with groups >= 1, found group ",
                     group, " of ", groups);
    FEDSHARD_EXPECTS(group_size >= 1 && local_rank >= 0 && local_rank < group_size,
                     "elastic::link: local_rank must be in [0, group_size), found ", local_rank,
                     " of ", group_size);
    FEDSHARD_EXPECTS(o_.join_timeout.count() > 0, "elastic::link: join_timeout must be > 0");
    FEDSHARD_EXPECTS(o_.sample.fraction > 0 && o_.sample.fraction <= 1,
                     "elastic::link: participation fraction must be in (0, 1], found ",
                     o_.sample.fraction);
    FEDSHARD_EXPECTS(o_.clip_ratio >= 0, "elastic::link: clip_ratio must be >= 0, found ",
                     o_.clip_ratio);
    alone();
  }
  link(link&&) noexcept = default;
  link& operator=(link&&) noexcept = default;

  int rank() const noexcept { return group_; }
  int size() const noexcept { return groups_; }
  /// The bytes the round's contexts moved for this link so far (see the file comment).
  moved_bytes moved() const noexcept { return moved_; }
  /// Reductions gather every member's input; gathers and broadcasts are Gloo's.
  wire_algorithm algorithm_of(collective k, std::int64_t, dtype) const noexcept {
    const bool reduces = k == collective::all_reduce || k == collective::reduce_scatter;
    return reduces && groups_ > 1 ? wire_algorithm::gather_all : wire_algorithm::ring;
  }
  const options& settings() const noexcept { return o_; }

  /// Collective over the members of the round: arrive, read the decision, connect (see the
  /// file comment). Every rank of a group calls it at the same sync, after step `step`.
  const round_info& begin_round(std::int64_t step) {
    ++rounds_seen_;
    std::int64_t e = next_round_;
    for (;;) {
      if (!ever_member_) {
        bool found = false;
        const auto latest = st_->try_get(key("latest"), found);
        if (found)
          e = std::max<std::int64_t>(e, std::stoll(std::string(latest.begin(), latest.end())) + 1);
      }
      const bool joining = !ever_member_ && e > 0;
      st_->set(key(detail::concat("r", e, "/arrive/", group_, "/", local_)),
               gloo::bytes_of(detail::concat(step, joining ? " join" : " member")));
      if (local_ == 0 && !joining) decide(e, step);
      const auto wait = joining ? gloo::detail::to_ms(o_.transport.timeout)
                                : gloo::detail::to_ms(o_.join_timeout + o_.transport.timeout);
      round_info r = detail::parse(st_->get_string(key(detail::concat("r", e, "/decision")), wait));
      next_round_ = e + 1;
      rejected_.clear();
      ops_ = 0;
      if (r.has(r.members, group_)) {
        round_ = std::move(r);
        break;
      }
      // Decided without this group (it came late): it heals at the next round, waiting there.
      log(detail::concat("fedshard elastic: group ", group_, " missed round ", e,
                         " (it arrived after the decision); it joins round ", e + 1));
      ever_member_ = false;
      e = e + 1;
    }
    e = round_.round;
    ctx_.reset();
    prefix_ = key(detail::concat("r", e, "/link", local_));
    retrying("connect", [](gloo::communicator&) {});
    if (local_ == 0) st_->set(key("latest"), gloo::bytes_of(std::to_string(e)));
    ever_member_ = true;
    if (local_ == 0 && group_ == round_.members.front()) log("fedshard elastic: " + round_.text());
    return round_;
  }

  /// The round in progress (round -1 before the first: this group alone).
  const round_info& round() const noexcept { return round_; }
  /// True when this group heals in the current round.
  bool joining() const { return round_.has(round_.joiners, group_); }
  /// Participants of the current op, as a mask over the G groups (rejected ones cleared).
  std::vector<std::uint8_t> included() const {
    std::vector<std::uint8_t> m(static_cast<std::size_t>(groups_), 0);
    for (int g : round_.participants)
      if (!round_.has(rejected_, g)) m[static_cast<std::size_t>(g)] = 1;
    return m;
  }
  /// Groups rejected in the current round.
  const std::vector<int>& rejected() const noexcept { return rejected_; }
  /// Rounds this link took part in (begin_round calls).
  std::int64_t rounds_seen() const noexcept { return rounds_seen_; }

  // ------------------------------------------------------------ the Communicator
  void all_reduce(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    check("all_reduce", n, t, in, out);
    if (n == 0) return;
    const auto bytes = static_cast<std::size_t>(n) * size_of(t);
    const auto M = round_.members.size();
    std::vector<std::byte> all(bytes * M);
    gather_members(in, all.data(), bytes, n, t);
    if (o_.reject_nonfinite || o_.clip_ratio > 0) screen(all.data(), bytes, n, t);
    std::vector<std::byte> picked;
    int count = 0;
    for (std::size_t i = 0; i < M; ++i) {
      const int g = round_.members[i];
      if (!round_.has(round_.participants, g) || round_.has(rejected_, g)) continue;
      picked.insert(picked.end(), all.begin() + static_cast<std::ptrdiff_t>(i * bytes),
                    all.begin() + static_cast<std::ptrdiff_t>((i + 1) * bytes));
      ++count;
    }
    if (count == 0) {  // nobody to combine: keep this group's own values
      if (out != in) std::memcpy(out, in, bytes);
      return;
    }
    fedshard::detail::reduce_blocks(t, op, picked.data(), bytes, count, out, n);
  }
  void all_gather(const void* in, void* out, std::int64_t n, dtype t) {
    check("all_gather", n, t, in, out);
    if (n == 0) return;
    const auto bytes = static_cast<std::size_t>(n) * size_of(t);
    std::vector<std::byte> all(bytes * round_.members.size());
    gather_members(in, all.data(), bytes, n, t);
    auto* o = static_cast<std::byte*>(out);
    std::memset(o, 0, bytes * static_cast<std::size_t>(groups_));
    for (std::size_t i = 0; i < round_.members.size(); ++i) {
      const int g = round_.members[i];
      if (!round_.has(round_.participants, g) || round_.has(rejected_, g)) continue;
      std::memcpy(o + bytes * static_cast<std::size_t>(g), all.data() + i * bytes, bytes);
    }
  }
  void reduce_scatter(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    check("reduce_scatter", n, t, in, out);
    if (n == 0) return;
    const auto bytes = static_cast<std::size_t>(n) * size_of(t);
    std::vector<std::byte> whole(bytes * static_cast<std::size_t>(groups_));
    all_reduce(in, whole.data(), n * groups_, t, op);
    std::memcpy(out, whole.data() + bytes * static_cast<std::size_t>(group_), bytes);
  }
  void broadcast(void* buf, std::int64_t n, dtype t, int root) {
    FEDSHARD_EXPECTS(root >= 0 && root < groups_, "elastic::link: broadcast root must be in [0, ",
                     groups_, "), found ", root);
    if (!round_.has(round_.members, root)) {
      FEDSHARD_EXPECTS(round_.round < 0 || round_.members.size() == 1,
                       "elastic::link: broadcast from group ", root, ", which is not in ",
                       round_.text());
      return;  // alone: the buffer is already the group's
    }
    retrying("broadcast", [&](gloo::communicator& c) {
      c.broadcast(buf, n, t, index_in(round_.members, root));
    });
  }
  void barrier() {
    retrying("barrier", [&](gloo::communicator& c) { c.barrier(); });
  }
  void send(const void* in, std::int64_t n, dtype t, int peer, int tag = 0) {
    FEDSHARD_EXPECTS(round_.has(round_.members, peer), "elastic::link: send to group ", peer,
                     ", which is not in ", round_.text());
    if (!ctx_) retrying("connect", [](gloo::communicator&) {});
    FEDSHARD_EXPECTS(ctx_.has_value(), "elastic::link: send: group ", peer, " left the round");
    counted(*ctx_,
            [&](gloo::communicator& c) { c.send(in, n, t, index_in(round_.members, peer), tag); });
  }
  void recv(void* out, std::int64_t n, dtype t, int peer, int tag = 0) {
    FEDSHARD_EXPECTS(round_.has(round_.members, peer), "elastic::link: recv from group ", peer,
                     ", which is not in ", round_.text());
    if (!ctx_) retrying("connect", [](gloo::communicator&) {});
    FEDSHARD_EXPECTS(ctx_.has_value(), "elastic::link: recv: group ", peer, " left the round");
    counted(*ctx_,
            [&](gloo::communicator& c) { c.recv(out, n, t, index_in(round_.members, peer), tag); });
  }
  request all_reduce_async(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    return eager([&] { all_reduce(in, out, n, t, op); });
  }
  request all_gather_async(const void* in, void* out, std::int64_t n, dtype t) {
    return eager([&] { all_gather(in, out, n, t); });
  }
  request reduce_scatter_async(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    return eager([&] { reduce_scatter(in, out, n, t, op); });
  }
  request broadcast_async(void* buf, std::int64_t n, dtype t, int root) {
    return eager([&] { broadcast(buf, n, t, root); });
  }
  request send_async(const void* in, std::int64_t n, dtype t, int peer, int tag = 0) {
    return eager([&] { send(in, n, t, peer, tag); });
  }
  request recv_async(void* out, std::int64_t n, dtype t, int peer, int tag = 0) {
    return eager([&] { recv(out, n, t, peer, tag); });
  }
  /// An elastic link is not split: invalid_argument.
  link split(int, int) {
    throw invalid_argument(
        "fedshard: elastic::link cannot be split (it is the federation axis of a hybrid world)");
  }

 private:
  template <class F>
  static request eager(F&& f) {
    return run_now(std::forward<F>(f));
  }

  std::string key(const std::string& k) const { return o_.job + "/" + k; }
  static int index_in(const std::vector<int>& v, int g) {
    return static_cast<int>(std::find(v.begin(), v.end(), g) - v.begin());
  }
  void log(const std::string& line) const {
    if (o_.log)
      o_.log(line);
    else
      std::fprintf(stderr, "%s\n", line.c_str());
  }
  /// This group alone (outside rounds, or left out of one).
  void alone() {
    ctx_.reset();
    round_ = {};
    round_.members = round_.participants = {group_};
  }

  static void check(const char* what, std::int64_t n, dtype t, const void* in, const void* out) {
    FEDSHARD_EXPECTS(n >= 0, "elastic::link: ", what, ": count must be >= 0, found ", n);
    FEDSHARD_EXPECTS(is_valid(t), "elastic::link: ", what, ": invalid dtype code ",
                     static_cast<int>(t));
    FEDSHARD_EXPECTS(n == 0 || (in != nullptr && out != nullptr), "elastic::link: ", what,
                     ": null buffer with count ", n);
  }

  /// The leaders' decision of round e (see the file comment); first writer wins.
  void decide(std::int64_t e, std::int64_t step) {
    const auto dkey = key(detail::concat("r", e, "/decision"));
    std::vector<int> expected;
    if (e == 0) {
      for (int g = 0; g < groups_; ++g) expected.push_back(g);
    } else {
      bool found = false;
      const auto prev = st_->try_get(key(detail::concat("r", e - 1, "/decision")), found);
      std::vector<int> known;
      if (found) known = detail::parse(std::string(prev.begin(), prev.end())).members;
      for (int g = 0; g < groups_; ++g) {
        const bool was = std::find(known.begin(), known.end(), g) != known.end() ||
                         st_->has(key(detail::concat("r", e - 1, "/arrive/", g, "/0")));
        if (was && !st_->has(key(detail::concat("r", e - 1, "/dropped/", g))))
          expected.push_back(g);
      }
    }
    auto arrived = [&](int g, bool& joiner) {
      for (int l = 0; l < group_size_; ++l) {
        bool found = false;
        const auto v = st_->try_get(key(detail::concat("r", e, "/arrive/", g, "/", l)), found);
        if (!found) return false;
        if (l == 0) joiner = std::string(v.begin(), v.end()).find("join") != std::string::npos;
      }
      return true;
    };
    const auto deadline =
        std::chrono::steady_clock::now() +
        std::chrono::duration_cast<std::chrono::steady_clock::duration>(o_.join_timeout);
    std::vector<int> members, joiners;
    auto nap = std::chrono::milliseconds(1);
    for (;;) {
      if (st_->has(dkey)) return;
      members.clear();
      joiners.clear();
      for (int g = 0; g < groups_; ++g) {
        bool joiner = false;
        if (arrived(g, joiner)) {
          members.push_back(g);
          if (joiner) joiners.push_back(g);
        }
      }
      const bool all_there = std::all_of(expected.begin(), expected.end(), [&](int g) {
        return std::find(members.begin(), members.end(), g) != members.end();
      });
      if (all_there || std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::milliseconds(10));
    }
    round_info r;
    r.round = e;
    r.step = step;
    r.members = members;
    r.joiners = joiners;
    std::vector<int> candidates;
    for (int g : members)
      if (!r.has(joiners, g)) candidates.push_back(g);
    r.participants = detail::sample_of(candidates, o_.sample, e);
    r.donor = candidates.empty() ? -1 : candidates.front();
    for (int g : expected)
      if (!r.has(members, g)) r.left_out.push_back(g);
    st_->try_set(dkey, gloo::bytes_of(detail::serialize(r)));
  }

  /// out (members x bytes) = the members' inputs, in member order, over the round's context;
  /// a failure is retried among the survivors.
  void gather_members(const void* in, void* out, std::size_t bytes, std::int64_t n, dtype t) {
    retrying("all_gather", [&](gloo::communicator& c) { c.all_gather(in, out, n, t); });
    if (round_.members.size() == 1) std::memcpy(out, in, bytes);  // alone (from the start or now)
  }

  /// Runs f on the round's context (connecting it first if needed); when that fails (a
  /// member died or hung, or its context broke), the ranks of this link that are left meet
  /// again under a fresh prefix and f runs among them. Alone, f does not run.
  template <class F>
  void retrying(const char* what, F&& f) {
    const std::int64_t k = ops_++;
    for (int attempt = 0;; ++attempt) {
      if (round_.members.size() <= 1) {
        ctx_.reset();
        return;
      }
      try {
        if (!ctx_)
          ctx_.emplace(st_, prefix_, index_in(round_.members, group_),
                       static_cast<int>(round_.members.size()), o_.transport);
        counted(*ctx_, f);
        return;
      } catch (const peer_failure& e) {
        regroup(what, k, attempt, e.what());
      } catch (const timeout_error& e) {
        regroup(what, k, attempt, e.what());
      } catch (const backend_error& e) {
        regroup(what, k, attempt, e.what());
      }
    }
  }

  /// Runs f(c) and adds what c moved meanwhile to moved_, also when f throws (the bytes of a
  /// failed attempt moved too).
  template <class F>
  void counted(gloo::communicator& c, F&& f) {
    const moved_bytes before = c.moved();
    try {
      f(c);
    } catch (...) {
      moved_ += c.moved() - before;
      throw;
    }
    moved_ += c.moved() - before;
  }

  /// After op k failed: the link's survivors say they are here, the first to see all (or the
  /// deadline) decides who goes on, and the missing groups are marked dropped for later rounds.
  void regroup(const char* what, std::int64_t k, int attempt, const std::string& why) {
    ctx_.reset();
    const auto e = round_.round;
    const auto base = key(detail::concat("r", e, "/op", k, "/l", local_, "/a", attempt));
    st_->set(base + "/here/" + std::to_string(group_), gloo::bytes_of("1"));
    const auto dkey = base + "/decision";
    const auto deadline =
        std::chrono::steady_clock::now() +
        std::chrono::duration_cast<std::chrono::steady_clock::duration>(o_.join_timeout);
    for (;;) {
      if (st_->has(dkey)) break;
      std::vector<int> here;
      for (int g : round_.members)
        if (st_->has(base + "/here/" + std::to_string(g))) here.push_back(g);
      if (here.size() == round_.members.size() || std::chrono::steady_clock::now() >= deadline) {
        round_info r = round_;
        r.members = here;
        st_->try_set(dkey, gloo::bytes_of(detail::serialize(r)));
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    const round_info r = detail::parse(st_->get_string(dkey, gloo::detail::to_ms(o_.join_timeout)));
    std::vector<int> dropped;
    for (int g : round_.members)
      if (!r.has(r.members, g)) dropped.push_back(g);
    for (int g : dropped)
      st_->set(key(detail::concat("r", e, "/dropped/", g)), gloo::bytes_of("1"));
    log(detail::concat("fedshard elastic: group ", group_, " link ", local_, ": ", what, " #", k,
                       " of round ", e, " failed (", why, "); dropped ", dropped.size(),
                       " group(s), going on with ", r.members.size()));
    std::vector<int> members = r.members, parts;
    if (!r.has(members, group_)) members = {group_};  // decided without this rank: alone
    for (int g : round_.participants)
      if (std::find(members.begin(), members.end(), g) != members.end()) parts.push_back(g);
    round_.members = members;
    round_.participants = parts;
    prefix_ = base + "/ctx";
  }

  /// Robust aggregation: judges every participant's block of an all_reduce (see the file
  /// comment); the groups' links agree through the store.
  void screen(const std::byte* all, std::size_t bytes, std::int64_t n, dtype t) {
    const std::int64_t k = ops_ - 1;  // the gather just done
    const auto M = round_.members.size();
    std::vector<std::size_t> live;
    for (std::size_t i = 0; i < M; ++i)
      if (round_.has(round_.participants, round_.members[i]) &&
          !round_.has(rejected_, round_.members[i]))
        live.push_back(i);
    if (live.empty() || M < 2) return;
    // Per member: non-finite count and squared distance from the coordinate-wise median.
    std::vector<double> nonfinite(M, 0), dist2(M, 0);
    member_stats(all, bytes, n, t, live, nonfinite, dist2);
    // This link's statistics, written by its lowest member; summed over the group's links.
    const auto base = key(detail::concat("r", round_.round, "/op", k, "/stats/"));
    if (group_ == round_.members.front()) {
      std::ostringstream os;
      os.precision(17);
      for (std::size_t i = 0; i < M; ++i)
        os << round_.members[i] << ' ' << nonfinite[i] << ' ' << dist2[i] << '\n';
      st_->set(base + std::to_string(local_), gloo::bytes_of(os.str()));
    }
    std::vector<double> nf(static_cast<std::size_t>(groups_), 0),
        d2(static_cast<std::size_t>(groups_), 0);
    for (int l = 0; l < group_size_; ++l) {
      std::istringstream is(st_->get_string(
          base + std::to_string(l), gloo::detail::to_ms(o_.join_timeout + o_.transport.timeout)));
      int g = 0;
      double a = 0, b = 0;
      while (is >> g >> a >> b) {
        if (g < 0 || g >= groups_) continue;
        nf[static_cast<std::size_t>(g)] += a;
        d2[static_cast<std::size_t>(g)] += b;
      }
    }
    judge(live, nf, d2);
  }

  /// For each live member i of this link's gathered blocks `all`: its non-finite values
  /// (nonfinite[i]) and, with clip_ratio, its squared distance from the coordinate-wise
  /// median of the live members (dist2[i]).
  void member_stats(const std::byte* all, std::size_t bytes, std::int64_t n, dtype t,
                    const std::vector<std::size_t>& live, std::vector<double>& nonfinite,
                    std::vector<double>& dist2) const {
    std::vector<double> column(live.size());
    visit(t, [&](auto tag) {
      using T = typename decltype(tag)::type;
      auto at = [&](std::size_t i, std::int64_t j) {
        T v;
        std::memcpy(&v, all + i * bytes + static_cast<std::size_t>(j) * sizeof(T), sizeof(T));
        return static_cast<double>(kernels::operand_fn<T, fedshard::detail::accum_t<T>>{}(v));
      };
      for (std::int64_t j = 0; j < n; ++j) {
        std::size_t c = 0;
        for (std::size_t i : live) {
          const double v = at(i, j);
          if (!std::isfinite(v)) nonfinite[i] += 1;
          column[c++] = std::isfinite(v) ? v : 0.0;
        }
        if (o_.clip_ratio <= 0) continue;
        auto mid = column.begin() + static_cast<std::ptrdiff_t>(column.size() / 2);
        std::nth_element(column.begin(), mid, column.end());
        const double median = *mid;
        for (std::size_t i : live) {
          const double v = at(i, j);
          if (std::isfinite(v)) dist2[i] += (v - median) * (v - median);
        }
      }
    });
  }

  /// Rejects the live members whose group-wide statistics (nf: non-finite values, d2:
  /// squared distance, indexed by group) fail the options, logging each once.
  void judge(const std::vector<std::size_t>& live, const std::vector<double>& nf,
             const std::vector<double>& d2) {
    std::vector<double> norms;
    for (std::size_t i : live)
      if (nf[static_cast<std::size_t>(round_.members[i])] == 0)
        norms.push_back(std::sqrt(d2[static_cast<std::size_t>(round_.members[i])]));
    double median_norm = 0;
    if (!norms.empty()) {
      std::sort(norms.begin(), norms.end());
      median_norm = norms[norms.size() / 2];
    }
    for (std::size_t i : live) {
      const int g = round_.members[i];
      const auto gi = static_cast<std::size_t>(g);
      std::string reason;
      if (o_.reject_nonfinite && nf[gi] > 0)
        reason = detail::concat(nf[gi], " non-finite value(s)");
      else if (o_.clip_ratio > 0 && live.size() >= 3 && median_norm > 0 &&
               std::sqrt(d2[gi]) > o_.clip_ratio * median_norm)
        reason = detail::concat("update norm ", std::sqrt(d2[gi]), " > clip_ratio ", o_.clip_ratio,
                                " x median ", median_norm);
      if (reason.empty()) continue;
      rejected_.push_back(g);
      if (local_ == 0 && group_ == round_.members.front())
        log(detail::concat("fedshard elastic: rejected group ", g, " in round ", round_.round, ": ",
                           reason));
    }
  }

  std::shared_ptr<gloo::store> st_;
  int groups_;
  int group_;
  int group_size_;
  int local_;
  options o_;
  std::optional<gloo::communicator> ctx_;
  std::string prefix_;  // where the round's context (re)connects
  round_info round_;
  std::vector<int> rejected_;
  std::int64_t next_round_ = 0;
  std::int64_t ops_ = 0;
  std::int64_t rounds_seen_ = 0;
  bool ever_member_ = false;
  moved_bytes moved_{};
};

static_assert(Communicator<link>);

}  // namespace fedshard::elastic
