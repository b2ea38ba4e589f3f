#pragma once
/// elastic::link: the federation axis between groups that are independent jobs, which may
/// crash, be pre-empted, start late or restart. It is the federation side of a hybrid world
/// (comm/hybrid.hpp): hybrid<C, elastic::link>, C being the group's own communicator.
///
/// Identity. Every link object is an incarnation with a random 64-bit token; a process that
/// restarts is a new incarnation and never takes the place of its previous one. A rank that
/// finds its own life key (`<job>/life/<g>/<l>`) already written is a restart: it comes
/// back as a joiner. Each group's leader (local rank 0) beats: a thread writes
/// `<job>/beat/<g>` = "<token> <count>" every options::beat_period (100 ms). An observer
/// declares a group dead when its beat has not changed for options::missed_beats periods
/// (3) of the observer's own polling, or carries another incarnation's token than the one
/// the round recorded. A group that never beat is not known dead: only deadlines end waits
/// for it.
///
/// Rounds. Every federation sync is a round (the trainer calls begin_round(step) on each rank
/// where a sync starts, end_round() after it). The groups meet through a store (gloo::store:
/// a file store or Redis; wrap it in gloo::signed_store so only holders of the secret take
/// part). A rank goes through these states in round e:
///
///   ARRIVE   read `latest` (the highest round decided): when it is e or more, rounds went
///            on without this group (it is new, or fell behind, or split off and decided
///            rounds alone), so it moves to round latest+1 as a joiner. Then write
///            `r<e>/arrive/<g>/<l>` = "<step> member|join <token>" (join: a restart, or a
///            rank that was in no round yet while rounds before e exist);
///   DECIDE   (leaders of non-joining groups) wait until every expected group has arrived
///            with all its ranks (each under its rank's latest life token: an arrival a dead
///            incarnation left is stale), is dead, or options::join_timeout passed; expected: the
///            previous round's members and arrivals, less the groups dropped there. The
///            first leader to finish writes `r<e>/decision` (create-if-absent: one decision
///            per round) and `latest` = e. Members: groups arrived with all ranks, with each
///            rank's token; joiners among them: arrived as joiners, or dropped or marked
///            unhealthy (rejected for non-finite values, or a failed heal) in round e-1;
///            participants: the other members (the federation's participation stage may
///            narrow them to a sample: set_participants); donor: the lowest of them. With
///            none (every member a joiner: all restarted, or back after the store was away)
///            the lowest joiner becomes the donor and the others heal from it;
///   READ     every rank waits for the decision: a rank other than the leader as long as its
///            leader beats; a joining leader as long as some other group beats (they may
///            train long between syncs), and it decides the round itself when every live
///            group arrived as a joiner, or none has beaten for join_timeout. A rank that is
///            not in the decision under its own token missed the round: it waits as a
///            joiner for round e+1 (never in e);
///   CONNECT  the members' ranks with local rank l meet under `r<e>/link<l>`: each writes
///            `ready/<g>` = the name of the context it holds from an earlier round ("-" if
///            none). All ready: when every member names the same context, and that
///            context's members (groups and incarnations) are this round's, they keep it
///            (options::reuse_connections; every rank reads the same names, so all decide
///            alike, and a member that died since fails the first op, below). Otherwise a
///            Gloo context connects within options::connect_timeout.
///            A member not ready when it is dead, or at join_timeout, fails the connect.
///            Then each writes `done/<g>` or `failed/<g>`, and the first to know the
///            outcome writes `verdict` (create-if-absent): a connect that failed on one
///            member (one that died mid-connect) fails on all, so all REGROUP at one op;
///   OPS      the sync's collectives (below); the members agree on each one's outcome the
///            same way (under `r<e>/op<k>/l<l>/a<attempt>`): a Gloo call can complete on one
///            member and fail on another when a third dies in it;
///   REGROUP  after a failed connect or op k (a member died: peer_failure; hung: the op's
///            timeout; broke: backend_error) the link's survivors write
///            `r<e>/op<k>/l<l>/a<attempt>/here/<g>` and wait until every member is here,
///            dead, or the op's timeout plus join_timeout passed (a live member may still be
///            inside the op: a Gloo send completes once its receiver posted the receive, and
///            one to a member that died mid-op was seen to wait out the op's timeout;
///            dropping that survivor would split the survivors for the round);
///            the first to see that decides (create-if-absent)
///            who goes on; the missing groups are marked `r<e>/dropped/<g>`, and the op runs
///            again among the rest, under a fresh prefix. A rank the decision leaves out goes
///            on alone. A group dropped by any of its links heals in its next round;
///   END      end_round() (or the next begin_round) logs the outcome: who was combined, who
///            was dropped, rejected, left out, healed.
///
/// Bounds (P = beat_period, D = missed_beats x P, J = join_timeout, C = connect_timeout,
/// T = the transport's op timeout): a group killed between syncs delays the next round by
/// at most D (+ the store's polling, 20 ms); killed after arrival or after the decision, by
/// at most D (its ready key never comes); killed while connecting, by at most C + D; killed
/// inside an op, by D (its sockets close: the op fails at once, then REGROUP), or by up to T
/// when a survivor's send to it waits out the op's timeout (see REGROUP: the others wait for
/// that survivor); a group that hangs without dying
/// (stopped, not killed) by T + J. A live group that is slow is waited for J in DECIDE and
/// T + J in REGROUP. No rank of a live group throws or hangs because another
/// group died or restarted, and a store that stays away is not fatal either (below).
///
/// The store away. A store call that fails (after the Redis store's own reconnect attempts)
/// ends the round for this group: it runs the sync alone, logs it, and comes back as a
/// joiner at its next sync, so it is healed before it contributes again. Rounds missed while
/// the store is away are not made up; each group trains on.
///
/// Collectives of a round (the rank is the group g, the size the configured G):
///  - all_reduce combines the participants' inputs (less the groups the federation
///    rejected: reject()) in group order with the rank-order reduction
///    (comm/detail/reduction.hpp); avg divides by their number. When every group
///    participates the result is bit-identical to inproc's over G ranks;
///  - all_gather: those groups' blocks in their group's slot, zeros in the others';
///  - the federation's participation stage (federation/participation.hpp) decides whom a
///    sync combines and screens their inputs; the link offers it what it needs of the round:
///    set_participants (the sample), included(), agreed_sum() (one verdict for a group on all
///    its shards, the same in every group: statistics agreed through the store, a wait that
///    is never fatal) and reject() (logged, and a group rejected for non-finite values is
///    marked unhealthy: it heals in its next round);
///  - broadcast from a member; send and recv between members; barrier.
/// Outside a round (before the first) the link is the group alone (a communicator of one).
///
/// Bytes moved (moved()): what the round's Gloo contexts moved for the link's calls, retries
/// included: an all_reduce gathers every member's whole input (algorithm_of: gather_all; a
/// reduce_scatter is an all_reduce of the whole input), so it moves what the members
/// actually combined, and nothing alone.
///
/// Limits: a group rejected inside an op leaves weighted_average's scales, computed before
/// the op, as they were (plain averages and outer optimizers stay exact); a round ends when the
/// next begins, so a schedule whose federation ops outlive the step they start in (a delayed sync
/// that averages inner moments after the next fragment's round began) is not supported; links of
/// one group that see different failures inside a round may drop a group on one shard and
/// not on another: that group heals in its next round, and the survivors agree on every
/// shard; store keys are never deleted (a few per rank and round).
///
/// Healing: in a round with joiners, the trainer sends the donor's state (global model,
/// optimizer and outer-optimizer state, step) to the joiners with send and recv over the
/// round's context before the sync (the heal plan of federation/heal.hpp, run by the
/// interpreter), and the joiners take part in the sync without contributing: after it their
/// parameters equal the others'. A heal that fails (the donor or a joiner died, a blob
/// refused) is not fatal: heal_failed() marks a joiner unhealthy, so it heals next round.

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "fedshard/comm/blocking.hpp"
#include "fedshard/comm/communicator.hpp"
#include "fedshard/comm/detail/reduction.hpp"
#include "fedshard/comm/gloo.hpp"
#include "fedshard/comm/request.hpp"
#include "fedshard/comm/signed_store.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/mix.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/error.hpp"

namespace fedshard::elastic {

/// Settings of an elastic link (the groups of one run must agree on all but the timeouts).
struct options {
  /// Namespace of the run's keys in the store.
  std::string job = "fedshard";
  /// How long a round waits for the expected groups (the federation timeout).
  std::chrono::duration<double> join_timeout{10.0};
  /// Settings of the rounds' Gloo contexts (their timeout bounds every collective).
  gloo::options transport{};
  /// Where the link's log lines go (default: stderr).
  std::function<void(const std::string&)> log{};
  /// How often each group's leader beats (see the file comment).
  std::chrono::duration<double> beat_period{0.1};
  /// Beats an observer misses before it declares a group dead.
  int missed_beats = 3;
  /// How long a round's Gloo context may take to connect once every member is ready: a
  /// member that dies in between fails the connect by then (not at Gloo's own connect
  /// timeout, 5 x the op timeout).
  std::chrono::duration<double> connect_timeout{10.0};
  /// Keep a round's Gloo context for the next round when that round's members (each
  /// rank's incarnation) are the same and every one of them still holds it (CONNECT of the
  /// file comment); false: connect a new context every round. FEDSHARD_ELASTIC_REUSE=0
  /// turns it off (for debugging).
  bool reuse_connections = fedshard::detail::env_flag("FEDSHARD_ELASTIC_REUSE", true);
  /// The most participants a round's joiners heal from at once (round_info::donors): the
  /// donor sends what differs between groups, the others what every group holds alike
  /// (federation/heal.hpp); 1: from the donor alone. A round whose joiner was marked
  /// unhealthy in the round before (a failed heal among them) heals from the donor alone.
  /// 2 by default: the other donor sends the shared state whole, from its own memory; 3 or
  /// more cut it in pieces, which costs a copy of each piece and of their join (bench_link's
  /// bm_heal_donors on this 2-core machine: 1 GiB in 308-311 ms from one donor, 234-246 ms
  /// from two, 681-695 ms from three), so more pay where each donor's link, not memory,
  /// bounds the heal.
  int heal_donors = 2;
  /// Called on every rank as it passes a point of the round's state machine (see the file
  /// comment), with the round's number: "arrived", "decided" (the decision read),
  /// "ready" (before the context connects), "connected", "op" (before each collective of
  /// the round), "send" and "recv" (before a point-to-point transfer: the heal). For tracing,
  /// and for fault injection in tests (tests/federation/test_chaos_gloo.cpp).
  std::function<void(std::string_view, std::int64_t)> on_phase{};
};

/// What a round decided.
struct round_info {
  std::int64_t round = -1;   ///< its number, from 0
  std::int64_t step = 0;     ///< the donor's step: the sync after that step
  std::vector<int> members;  ///< groups in the round's context, ascending
  /// Members that may contribute (not joiners); the federation's participation stage
  /// samples among them (set_participants).
  std::vector<int> participants;
  std::vector<int> joiners;   ///< members that heal in this round
  std::vector<int> left_out;  ///< expected groups that did not arrive in time
  int donor = -1;             ///< the member joiners receive state from (-1: none)
  /// The participants joiners heal from, the donor first (options::heal_donors); empty
  /// without joiners.
  std::vector<int> donors;
  /// The incarnation of each member's ranks: members.size() x ranks per group tokens, in
  /// member order (see the file comment).
  std::vector<std::uint64_t> incarnations;

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
                                    list(joiners), ", left out ", list(left_out), ", donor ", donor,
                                    ", donors ", list(donors));
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
  os << r.incarnations.size() << std::hex;
  for (auto t : r.incarnations) os << ' ' << t;
  os << std::dec << '\n';
  put(r.donors);
  return os.str();
}
/// The decision serialized in s; nothing when s is not one.
inline std::optional<round_info> parse(const std::string& s) {
  std::istringstream is(s);
  round_info r;
  auto get = [&](std::vector<int>& v) {
    std::size_t n = 0;
    is >> n;
    if (n > (std::size_t{1} << 16)) is.setstate(std::ios::failbit);
    if (!is) return;
    v.resize(n);
    for (auto& g : v) is >> g;
  };
  is >> r.round >> r.step >> r.donor;
  get(r.members);
  get(r.participants);
  get(r.joiners);
  get(r.left_out);
  std::size_t n = 0;
  if (is && !(is >> n)) {
    if (!is.eof()) return std::nullopt;
    is.clear();  // written without incarnations: none recorded
    n = 0;
  }
  if (n > (std::size_t{1} << 20)) return std::nullopt;
  r.incarnations.resize(n);
  is >> std::hex;
  for (auto& t : r.incarnations) is >> t;
  if (!is) return std::nullopt;
  is >> std::dec;
  get(r.donors);
  if (!is) {
    if (!is.eof()) return std::nullopt;
    r.donors.clear();  // written without donors: the donor alone
  }
  return r;
}

/// True when r is a decision a link of `groups` groups of `ranks` ranks can use: groups in
/// [0, groups), members ascending and distinct, participants and joiners among them, the
/// donor a member or -1, no or one incarnation per member rank.
inline bool usable(const round_info& r, int groups, int ranks) {
  const auto in = [&](const std::vector<int>& v) {
    return std::all_of(v.begin(), v.end(), [&](int g) { return g >= 0 && g < groups; });
  };
  const auto among = [&](const std::vector<int>& v) {
    return std::all_of(v.begin(), v.end(), [&](int g) { return r.has(r.members, g); });
  };
  return in(r.members) &&
         std::adjacent_find(r.members.begin(), r.members.end(), std::greater_equal<>()) ==
             r.members.end() &&
         among(r.participants) && among(r.joiners) && in(r.left_out) &&
         (r.donor == -1 || r.has(r.members, r.donor)) &&
         (r.donors.empty() || (r.donors.front() == r.donor && among(r.donors))) &&
         (r.incarnations.empty() ||
          r.incarnations.size() == r.members.size() * static_cast<std::size_t>(ranks));
}

/// The store as a round's Gloo context meets through it: every call goes to the link's
/// store, but a read without a deadline waits at most `bound` (Gloo's rendezvous reads each
/// peer's address with the store's default timeout, 300 s: a member killed after READY and
/// before it wrote its address would hold the survivors' connect that long).
class bounded_store final : public gloo::store {
 public:
  bounded_store(std::shared_ptr<gloo::store> inner, std::chrono::milliseconds bound)
      : inner_(std::move(inner)) {
    set_timeout(bound);
  }
  void set(const std::string& key, const std::vector<char>& value) override {
    inner_->set(key, value);
  }
  bool try_set(const std::string& key, const std::vector<char>& value) override {
    return inner_->try_set(key, value);
  }
  std::vector<char> try_get(const std::string& key, bool& found) override {
    return inner_->try_get(key, found);
  }
  std::string name() const override { return inner_->name(); }

 private:
  std::shared_ptr<gloo::store> inner_;
};

/// A fresh incarnation token: never 0 (0 means "any incarnation" to a watcher).
inline std::uint64_t new_token(const void* salt) {
  std::random_device rd;
  std::uint64_t t = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
  t ^= mix64(
      static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  t ^= mix64(static_cast<std::uint64_t>(::getpid()) ^ reinterpret_cast<std::uintptr_t>(salt));
  return t == 0 ? 1 : t;
}

/// What a rank wrote when it arrived: its step, whether it joins, its token.
struct arrival {
  std::int64_t step = 0;
  bool joins = false;
  std::uint64_t token = 0;
};
inline std::string arrival_text(const arrival& a) {
  std::ostringstream os;
  os << a.step << (a.joins ? " join " : " member ") << std::hex << a.token;
  return os.str();
}
inline std::optional<arrival> parse_arrival(const std::vector<char>& v) {
  std::istringstream is(std::string(v.begin(), v.end()));
  arrival a;
  std::string kind;
  is >> a.step >> kind >> std::hex >> a.token;
  if (!is || (kind != "join" && kind != "member")) return std::nullopt;
  a.joins = kind == "join";
  return a;
}

/// The leader's heartbeat: a thread that writes "<token> <count>" to a key every period
/// until destroyed. A store error is swallowed (the store may come back); the beats resume.
class beater {
 public:
  beater(std::shared_ptr<gloo::store> st, std::string key, std::uint64_t token,
         std::chrono::duration<double> period)
      : st_(std::move(st)), key_(std::move(key)), token_(token), period_(period) {
    beat();  // the first beat before the constructor returns: observers know this incarnation
    thread_ = std::jthread([this](std::stop_token stop) { run(stop); });
  }
  beater(const beater&) = delete;
  beater& operator=(const beater&) = delete;
  ~beater() {
    thread_.request_stop();
    cv_.notify_all();
  }

 private:
  void beat() {
    std::ostringstream os;
    os << std::hex << token_ << ' ' << count_++;
    try {
      st_->set(key_, gloo::bytes_of(os.str()));
    } catch (const std::exception&) {  // the store is away: the next beat tries again
    }
  }
  void run(std::stop_token stop) {
    std::mutex mu;
    std::unique_lock lock(mu);
    const auto period = std::chrono::duration_cast<std::chrono::steady_clock::duration>(period_);
    for (;;) {
      (void)cv_.wait_for(lock, stop, period, [] { return false; });
      if (stop.stop_requested()) return;
      beat();
    }
  }
  std::shared_ptr<gloo::store> st_;
  std::string key_;
  std::uint64_t token_;
  std::chrono::duration<double> period_;
  std::uint64_t count_ = 0;
  std::condition_variable_any cv_;
  std::jthread thread_;  // last: started after, and stopped before, the members it reads
};

/// An observer's view of the groups' beats (see the file comment): a group is dead when its
/// beat has not changed for `missed` periods of this observer's polling, or carries another
/// token than the one expected.
class watcher {
 public:
  watcher(std::string job, int groups, std::chrono::duration<double> period, int missed)
      : job_(std::move(job)),
        seen_(static_cast<std::size_t>(groups)),
        period_(std::chrono::duration_cast<clock::duration>(period)),
        missed_(missed) {}

  /// True when group g is known dead; `token` 0 accepts any incarnation.
  bool dead(gloo::store& st, int g, std::uint64_t token) {
    return state(st, g, token) == life::dead;
  }
  /// What this observer knows of group g: never beat (unseen), alive, or dead.
  enum class life { unseen, alive, dead };
  life state(gloo::store& st, int g, std::uint64_t token) {
    const auto now = clock::now();
    if (polled_ != clock::time_point{} && now - polled_ > 2 * period_)
      for (auto& s : seen_) s.since = now;  // our own polling stalled: we saw nothing meanwhile
    polled_ = now;
    bool found = false;
    const auto v = st.try_get(job_ + "/beat/" + std::to_string(g), found);
    if (!found) return life::unseen;
    const std::string text(v.begin(), v.end());
    std::istringstream is(text);
    std::uint64_t t = 0;
    is >> std::hex >> t;
    if (token != 0 && t != token) return life::dead;
    auto& s = seen_[static_cast<std::size_t>(g)];
    if (text != s.value) {
      s.value = text;
      s.since = now;
      return life::alive;
    }
    return now - s.since >= missed_ * period_ ? life::dead : life::alive;
  }

 private:
  using clock = std::chrono::steady_clock;
  struct seen {
    std::string value;
    clock::time_point since{};
  };
  std::string job_;
  std::vector<seen> seen_;
  clock::duration period_;
  int missed_;
  clock::time_point polled_{};
};
}  // namespace detail

/// See the file comment. A Communicator of G ranks (rank = the group); one per rank.
class link : public blocking_calls<link> {
 public:
  /// Rank `local_rank` of group `group` (of `groups`), whose group has `group_size` ranks: a
  /// new incarnation (see the file comment). Not collective: it writes its life key (and the
  /// leader starts beating); nothing is exchanged with other ranks before the first round.
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
    FEDSHARD_EXPECTS(o_.heal_donors >= 1, "elastic::link: heal_donors must be >= 1, found ",
                     o_.heal_donors);
    FEDSHARD_EXPECTS(o_.beat_period.count() > 0 && o_.missed_beats >= 1,
                     "elastic::link: beat_period must be > 0 s and missed_beats >= 1, found ",
                     o_.beat_period.count(), " s and ", o_.missed_beats);
    FEDSHARD_EXPECTS(o_.connect_timeout.count() > 0,
                     "elastic::link: connect_timeout must be > 0 s, found ",
                     o_.connect_timeout.count());
    auto lives = std::make_unique<life>(o_.job, groups_, o_);
    lives->token = detail::new_token(lives.get());
    const auto life_key = key(detail::concat("life/", group_, "/", local_));
    restarted_ = st_->has(life_key);
    st_->set(life_key, gloo::bytes_of(detail::concat(lives->token)));
    if (local_ == 0)
      lives->beats = std::make_unique<detail::beater>(st_, key(detail::concat("beat/", group_)),
                                                      lives->token, o_.beat_period);
    life_ = std::move(lives);
    alone();
  }
  link(link&&) noexcept = default;
  link& operator=(link&&) noexcept = default;
  /// Logs the outcome of a round still in progress (end_round).
  ~link() {
    if (!life_) return;  // moved from
    try {
      end_round();
    } catch (...) {  // a log callback that throws: nothing to do about it here
    }
  }

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
  /// This incarnation's token (see the file comment).
  std::uint64_t incarnation() const noexcept { return life_->token; }

  /// Collective over the members of the round: arrive, read the decision, connect (see the
  /// file comment). Every rank of a group calls it at the same sync, after step `step`.
  /// A store that fails (away past its own retries) leaves this group alone for the round.
  const round_info& begin_round(std::int64_t step) {
    end_round();
    ++rounds_seen_;
    try {
      enter_round(step);
    } catch (const gloo::store_error& e) {
      store_failed(e);
      round_.round = -1;
      decided_ = round_;
    }
    in_round_ = true;
    return round_;
  }

  /// How many Gloo contexts this link connected (a round that kept the previous round's
  /// context connected none; see CONNECT in the file comment).
  std::int64_t connects() const { return connects_; }

  /// Logs the outcome of the round in progress (once; begin_round calls it too).
  void end_round() {
    if (!in_round_) return;
    in_round_ = false;
    if (round_.round < 0 || local_ != 0 || decided_.members.empty() ||
        group_ != decided_.members.front())
      return;
    log("fedshard elastic: " + outcome());
  }

  /// The outcome of the current round so far (END of the file comment): who was combined,
  /// of which members; who healed, was dropped, rejected, left out; the donor.
  std::string outcome() const {
    auto list = [](const std::vector<int>& v) {
      std::string s = "{";
      for (std::size_t i = 0; i < v.size(); ++i) {
        if (i > 0) s += ',';
        s += std::to_string(v[i]);
      }
      return s + "}";
    };
    std::vector<int> combined;
    for (int g : round_.participants)
      if (!round_.has(rejected_, g)) combined.push_back(g);
    std::vector<int> healed;
    if (!heal_failed_)
      for (int g : decided_.joiners)
        if (round_.has(round_.members, g)) healed.push_back(g);
    return detail::concat("round ", round_.round, " (step ", round_.step, "): combined ",
                          list(combined), " of members ", list(decided_.members), "; healed ",
                          list(healed), ", dropped ", list(dropped_), ", rejected ",
                          list(rejected_), ", left out ", list(decided_.left_out), ", donor ",
                          decided_.donor);
  }
  /// A heal blob as the donor sends it: over a signed store (gloo::signed_store) with the
  /// store's HMAC tag of it appended (seal_bytes() more); else unchanged.
  std::string seal(std::string blob) const {
    if (const auto* s = signer()) {
      const auto t = s->tag_of(blob);
      blob.append(reinterpret_cast<const char*>(t.data()), t.size());
    }
    return blob;
  }
  /// A received heal blob without its seal; invalid_argument when the tag is missing or
  /// wrong (a sender without the secret, or damage on the way).
  std::string open(std::string blob) const {
    const auto* s = signer();
    if (s == nullptr) return blob;
    gloo::signed_store::tag t{};
    FEDSHARD_EXPECTS(blob.size() >= t.size(), "elastic::link: a heal blob of ", blob.size(),
                     " bytes carries no tag (expected >= ", t.size(), " bytes)");
    std::memcpy(t.data(), blob.data() + blob.size() - t.size(), t.size());
    blob.resize(blob.size() - t.size());
    FEDSHARD_EXPECTS(s->verify(blob, t), "elastic::link: the tag of a heal blob of ", blob.size(),
                     " bytes is wrong: it was not sealed with this federation's secret");
    return blob;
  }
  /// Bytes seal() adds.
  std::int64_t seal_bytes() const {
    return signer() ? static_cast<std::int64_t>(gloo::signed_store::tag_bytes) : 0;
  }

  /// Called by the trainer when this rank's heal in the current round failed (why): a
  /// joiner is marked unhealthy, so it heals in its next round; no rank throws.
  void heal_failed(const std::string& why) {
    log(detail::concat("fedshard elastic: group ", group_, " link ", local_, ": the heal of round ",
                       round_.round, " failed (", why, ")",
                       joining() ? "; this group heals in its next round" : ""));
    if (joining()) {
      heal_failed_ = true;
      mark("unhealthy", group_);
    }
  }

  /// The round in progress (round -1 before the first: this group alone).
  const round_info& round() const noexcept { return round_; }
  /// True when this group heals in the current round.
  bool joining() const { return round_.has(round_.joiners, group_); }
  /// Narrows the current round's participants to the groups `mask` marks (a mask over the
  /// G groups): the federation's participation stage (federation/participation.hpp) draws
  /// that sample; the link only combines whom it is given. Every rank of the round calls it
  /// with the same mask before the round's collectives.
  void set_participants(const std::vector<std::uint8_t>& mask) {
    FEDSHARD_EXPECTS(static_cast<int>(mask.size()) == groups_,
                     "elastic::link::set_participants: a mask of ", groups_, " groups, found ",
                     mask.size());
    std::vector<int> kept;
    for (int g : round_.participants)
      if (mask[static_cast<std::size_t>(g)] != 0) kept.push_back(g);
    round_.participants = std::move(kept);
  }
  /// Capability 12 (comm/communicator.hpp): vouched for on the round's Gloo context, for
  /// the data call of each op (its retries on a new context are checked again).
  void vouch(std::uint64_t fingerprint, bool first) noexcept {
    vouched_ = fingerprint;
    first_ = first;
  }

  /// Participants of the current op, as a mask over the G groups (rejected ones cleared).
  std::vector<std::uint8_t> included() const {
    std::vector<std::uint8_t> m(static_cast<std::size_t>(groups_), 0);
    for (int g : round_.participants)
      if (!round_.has(rejected_, g)) m[static_cast<std::size_t>(g)] = 1;
    return m;
  }
  /// Groups rejected in the current round (reject()).
  const std::vector<int>& rejected() const noexcept { return rejected_; }
  /// Records the federation's verdict (its screening: federation/participation.hpp): group g
  /// leaves the current round (its input is combined no more; the outcome lists it); why is
  /// logged once per round's lowest member; unhealthy marks it to heal in its next round.
  void reject(int g, const std::string& why, bool unhealthy) {
    FEDSHARD_EXPECTS(g >= 0 && g < groups_, "elastic::link::reject: group must be in [0, ", groups_,
                     "), found ", g);
    if (round_.has(rejected_, g)) return;
    rejected_.push_back(g);
    if (unhealthy) mark("unhealthy", g);
    if (local_ == 0 && !round_.members.empty() && group_ == round_.members.front())
      log(detail::concat("fedshard elastic: rejected group ", g, " in round ", round_.round, ": ",
                         why));
  }
  /// Agreement among the round's groups: every rank of this link passes the same values
  /// (computed from what the round's collectives gave them all); returns their element-wise
  /// sum over the group's links, in local rank order, the same on every rank of every member
  /// group. Each link's lowest member writes its values to the store (create-if-absent);
  /// a reader that waited join_timeout for one, or whose writer died, creates it empty
  /// (counted as zeros): whichever came first counts for every reader. Nothing when this
  /// group is alone (outside a round, or left alone by a store that failed: then it is).
  std::optional<std::vector<double>> agreed_sum(const std::vector<double>& mine) {
    if (round_.round < 0 || round_.members.size() < 2) return std::nullopt;
    try {
      const auto base = key(detail::concat("r", round_.round, "/agree", agreements_++, "/"));
      if (group_ == round_.members.front()) {
        std::ostringstream os;
        os.precision(17);
        for (double v : mine) os << v << '\n';
        st_->try_set(base + std::to_string(local_), gloo::bytes_of(os.str()));
      }
      std::vector<double> sum(mine.size(), 0.0);
      for (int l = 0; l < group_size_; ++l) {
        std::istringstream is(agreed(base + std::to_string(l)));
        std::vector<double> v;
        for (double x = 0; is >> x;) v.push_back(x);
        if (v.size() != sum.size()) continue;  // empty (its writer is gone) or damaged
        for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += v[i];
      }
      return sum;
    } catch (const gloo::store_error& e) {  // no verdict to agree on: this group alone
      store_failed(e);
      return std::nullopt;
    }
  }
  /// Rounds this link took part in (begin_round calls).
  std::int64_t rounds_seen() const noexcept { return rounds_seen_; }

  // ------------------------------------------------------------ the Communicator
  void all_reduce(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    check("all_reduce", n, t, in, out);
    if (n == 0) return;
    const auto bytes = static_cast<std::size_t>(n) * size_of(t);
    std::vector<std::byte> all(bytes * round_.members.size());
    gather_members(in, all.data(), bytes, n, t);
    const auto M = round_.members.size();  // after the gather: a retry may have dropped members
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
      vouched_call(c, [&] { c.broadcast(buf, n, t, index_in(round_.members, root)); });
    });
  }
  void barrier() {
    retrying("barrier", [&](gloo::communicator& c) { c.barrier(); });
  }
  void send(const void* in, std::int64_t n, dtype t, int peer, int tag = 0) {
    send_async(in, n, t, peer, tag).wait();
  }
  void recv(void* out, std::int64_t n, dtype t, int peer, int tag = 0) {
    recv_async(out, n, t, peer, tag).wait();
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
  /// Point to point: posted on the round's context (connected first where needed), so
  /// receives from several members run side by side (a heal from several donors); the
  /// request fails as the context's does (peer_failure, timeout_error), and nothing retries.
  request send_async(const void* in, std::int64_t n, dtype t, int peer, int tag = 0) {
    return p2p("send", peer,
               [&](gloo::communicator& c, int p) { return c.send_async(in, n, t, p, tag); });
  }
  request recv_async(void* out, std::int64_t n, dtype t, int peer, int tag = 0) {
    return p2p("recv", peer,
               [&](gloo::communicator& c, int p) { return c.recv_async(out, n, t, p, tag); });
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

  /// A point-to-point call `what` with member `peer`, posted on the round's context.
  template <class Post>
  request p2p(const char* what, int peer, Post&& post) {
    FEDSHARD_EXPECTS(round_.has(round_.members, peer), "elastic::link: ", what,
                     std::string_view(what) == "send" ? " to" : " from", " group ", peer,
                     ", which is not in ", round_.text());
    phase(what, round_.round);
    if (!ctx_) retrying("connect", [](gloo::communicator&) {});
    FEDSHARD_EXPECTS(ctx_.has_value(), "elastic::link: ", what, ": group ", peer,
                     " left the round");
    request r;
    counted(*ctx_, [&](gloo::communicator& c) { r = post(c, index_in(round_.members, peer)); });
    return r;
  }

  std::string key(const std::string& k) const { return o_.job + "/" + k; }
  static int index_in(const std::vector<int>& v, int g) {
    return static_cast<int>(std::find(v.begin(), v.end(), g) - v.begin());
  }
  const gloo::signed_store* signer() const {
    return dynamic_cast<const gloo::signed_store*>(st_.get());
  }
  void phase(std::string_view what, std::int64_t e) const {
    if (o_.on_phase) o_.on_phase(what, e);
  }
  void log(const std::string& line) const {
    if (o_.log)
      o_.log(line);
    else
      std::fprintf(stderr, "%s\n", line.c_str());
  }
  /// Round e with this group alone.
  round_info alone_in(std::int64_t e) const {
    round_info r;
    r.round = e;
    r.members = r.participants = {group_};
    return r;
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

  /// Per incarnation, on the heap (the beater's thread outlives moves of the link).
  struct life {
    life(const std::string& job, int groups, const options& o)
        : watch(job, groups, o.beat_period, o.missed_beats) {}
    std::uint64_t token = 0;
    detail::watcher watch;
    std::unique_ptr<detail::beater> beats;  // the leader's only
  };

  /// ARRIVE, DECIDE, READ and CONNECT of the file comment.
  void enter_round(std::int64_t step) {
    std::int64_t e = next_round_;
    for (;;) {
      // Rounds decided up to `latest` went on without this group (a newcomer, or a group
      // that fell behind: left out, or split off and deciding rounds alone): it joins the
      // next one. Read before arriving, so no decision of a later round can include it yet.
      bool found = false;
      const auto latest = number(st_->try_get(key("latest"), found));
      if (found && latest >= e) {
        if (ever_member_)
          log(detail::concat("fedshard elastic: group ", group_, " link ", local_, ": rounds ", e,
                             "..", latest, " were decided without it; it joins round ",
                             latest + 1));
        e = latest + 1;
        ever_member_ = false;
      }
      const bool joins = restarted_ || (!ever_member_ && e > 0);
      st_->set(key(detail::concat("r", e, "/arrive/", group_, "/", local_)),
               gloo::bytes_of(detail::arrival_text({step, joins, life_->token})));
      phase("arrived", e);
      if (local_ == 0 && !joins) decide(e, step);
      round_info r = await_decision(e, step);
      phase("decided", e);
      next_round_ = e + 1;
      rejected_.clear();
      dropped_.clear();
      heal_failed_ = false;
      ops_ = 0;
      agreements_ = 0;
      if (r.has(r.members, group_) && token_in(r, group_, local_) == life_->token) {
        round_ = std::move(r);
        break;
      }
      // Decided without this incarnation: it joins the next round, waiting there.
      log(detail::concat("fedshard elastic: group ", group_, " link ", local_, " missed round ", e,
                         " (decided without it); it joins round ", e + 1));
      ever_member_ = false;
      e = e + 1;
    }
    decided_ = round_;
    held_ = std::move(ctx_);  // kept when every member holds it still (connect())
    ctx_.reset();
    prefix_ = key(detail::concat("r", round_.round, "/link", local_));
    retrying("connect", [](gloo::communicator&) {});
    phase("connected", round_.round);
    ever_member_ = true;
    restarted_ = false;
  }

  /// The store failed (after its own retries): this group goes on alone for the rest of the
  /// round and joins the next one (see the file comment).
  void store_failed(const gloo::store_error& e) {
    log(detail::concat("fedshard elastic: group ", group_, " link ", local_, ": the store failed (",
                       e.what(), "); this group goes on alone and joins its next round"));
    const auto e_round = round_.round;
    alone();
    round_.round = e_round;
    if (decided_.round != e_round) decided_ = round_;
    ever_member_ = false;
  }

  static std::int64_t number(const std::vector<char>& v) {
    try {
      return std::stoll(std::string(v.begin(), v.end()));
    } catch (const std::exception&) {
      return -1;
    }
  }

  /// The token the decision r recorded for rank l of member g (0: none recorded).
  std::uint64_t token_in(const round_info& r, int g, int l) const {
    const auto i =
        static_cast<std::size_t>(index_in(r.members, g)) * static_cast<std::size_t>(group_size_) +
        static_cast<std::size_t>(l);
    return i < r.incarnations.size() ? r.incarnations[i] : 0;
  }
  bool dead(int g, std::uint64_t token = 0) { return life_->watch.dead(*st_, g, token); }
  /// Marks group g `what` in the current round (dropped, unhealthy) for the next decision.
  void mark(const char* what, int g) {
    try {
      st_->set(key(detail::concat("r", round_.round, "/", what, "/", g)), gloo::bytes_of("1"));
    } catch (const gloo::store_error& e) {  // best effort: a NaN group is rejected again
      log(detail::concat("fedshard elastic: group ", group_, " link ", local_,
                         ": could not mark group ", g, " ", what, " (", e.what(), ")"));
    }
  }
  bool marked(std::int64_t e, const char* what, int g) {
    return e >= 0 && st_->has(key(detail::concat("r", e, "/", what, "/", g)));
  }

  /// READ of the file comment: the decision of round e.
  round_info await_decision(std::int64_t e, std::int64_t step) {
    const auto dkey = key(detail::concat("r", e, "/decision"));
    using clock = std::chrono::steady_clock;
    const auto join = std::chrono::duration_cast<clock::duration>(o_.join_timeout);
    auto nobody_since = clock::now();
    auto nap = std::chrono::milliseconds(1);
    for (;;) {
      bool found = false;
      const auto v = st_->try_get(dkey, found);
      if (found) return checked(detail::parse(std::string(v.begin(), v.end())), e);
      const auto now = clock::now();
      if (local_ != 0) {
        if (dead(group_)) throw_leader_gone(e);
      } else if (others_alive()) {
        nobody_since = now;
        if (live_ones_join(e)) decide(e, step);  // nobody else would decide
      } else if (now - nobody_since >= join) {
        decide(e, step);  // nobody else beats: this joiner decides the round itself
        continue;
      }
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::milliseconds(20));
    }
  }
  /// r when it is a usable decision of round e; else a round without members, after a log
  /// line (a store holding garbage: this rank takes no part in what it cannot read).
  round_info checked(std::optional<round_info> r, std::int64_t e) const {
    if (r && detail::usable(*r, groups_, group_size_)) return std::move(*r);
    log(detail::concat("fedshard elastic: group ", group_, " link ", local_,
                       ": a decision of round ", e,
                       " in the store is corrupt; this group takes no part in it"));
    round_info none;
    none.round = e;
    return none;
  }
  [[noreturn]] void throw_leader_gone(std::int64_t e) const {
    throw peer_failure(detail::concat("fedshard: elastic::link: group ", group_, " rank ", local_,
                                      ": this group's leader (local rank 0) stopped beating "
                                      "while waiting for the decision of round ",
                                      e));
  }
  bool others_alive() {
    bool any = false;
    for (int g = 0; g < groups_; ++g)
      if (g != group_ && alive(g)) any = true;
    return any;
  }
  /// True when group g has beaten and is not dead (one read of its beat).
  bool alive(int g) { return life_->watch.state(*st_, g, 0) == detail::watcher::life::alive; }
  /// True when every other live group arrived in round e as a joiner (so no leader of a
  /// member would decide it).
  bool live_ones_join(std::int64_t e) {
    std::vector<std::uint64_t> tokens;
    for (int g = 0; g < groups_; ++g) {
      if (g == group_ || !alive(g)) continue;
      const auto a = arrived(e, g, tokens);
      if (!a || !a->joins) return false;
    }
    return true;
  }

  /// The groups the leaders of round e wait for: round e-1's members and arrivals, less its
  /// dropped ones (every group in round 0).
  std::vector<int> expected_in(std::int64_t e) {
    std::vector<int> expected;
    if (e == 0) {
      for (int g = 0; g < groups_; ++g) expected.push_back(g);
      return expected;
    }
    bool found = false;
    const auto prev = st_->try_get(key(detail::concat("r", e - 1, "/decision")), found);
    std::vector<int> known;
    if (found) known = checked(detail::parse(std::string(prev.begin(), prev.end())), e - 1).members;
    for (int g = 0; g < groups_; ++g) {
      const bool was = std::find(known.begin(), known.end(), g) != known.end() ||
                       st_->has(key(detail::concat("r", e - 1, "/arrive/", g, "/0")));
      if (was && !marked(e - 1, "dropped", g)) expected.push_back(g);
    }
    return expected;
  }

  /// Group g's arrival in round e with all its ranks (their tokens appended to `tokens`;
  /// a joiner when any rank arrived as one), or nothing. An arrival is stale, and the rank
  /// not arrived, when its token is not the rank's life token: a dead incarnation arrived
  /// and its restart has not yet (a decision mixing the two would count the group as a
  /// member on its new ranks and not on the restarted one, which then misses every round
  /// while the others wait for it inside the group). A restart writes its life keys when its
  /// links are built, before any of its ranks syncs.
  std::optional<detail::arrival> arrived(std::int64_t e, int g,
                                         std::vector<std::uint64_t>& tokens) {
    std::optional<detail::arrival> first;
    std::vector<std::uint64_t> mine;
    for (int l = 0; l < group_size_; ++l) {
      bool found = false;
      const auto v = st_->try_get(key(detail::concat("r", e, "/arrive/", g, "/", l)), found);
      const auto a = found ? detail::parse_arrival(v) : std::nullopt;
      if (!a || stale(g, l, a->token)) return std::nullopt;
      if (l == 0) first = a;
      first->joins = first->joins || a->joins;  // one rank joining makes the group a joiner
      mine.push_back(a->token);
    }
    tokens.insert(tokens.end(), mine.begin(), mine.end());
    return first;
  }

  /// True when `token` is not the token of the incarnation of rank l of group g that wrote
  /// its life key last. A life key that is missing (a store that lost its keys) or unreadable
  /// stales nothing.
  bool stale(int g, int l, std::uint64_t token) {
    bool found = false;
    const auto v = st_->try_get(key(detail::concat("life/", g, "/", l)), found);
    if (!found) return false;
    try {
      return std::stoull(std::string(v.begin(), v.end())) != token;
    } catch (const std::exception&) {
      return false;
    }
  }

  /// DECIDE of the file comment; first writer wins.
  void decide(std::int64_t e, std::int64_t step) {
    const auto dkey = key(detail::concat("r", e, "/decision"));
    const std::vector<int> expected = expected_in(e);
    const auto deadline =
        std::chrono::steady_clock::now() +
        std::chrono::duration_cast<std::chrono::steady_clock::duration>(o_.join_timeout);
    round_info r;
    auto nap = std::chrono::milliseconds(1);
    for (;;) {
      if (st_->has(dkey)) return;
      r = {};
      for (int g = 0; g < groups_; ++g)
        if (auto a = arrived(e, g, r.incarnations)) {
          r.members.push_back(g);
          if (a->joins || marked(e - 1, "dropped", g) || marked(e - 1, "unhealthy", g))
            r.joiners.push_back(g);
        }
      const bool waited = std::all_of(expected.begin(), expected.end(),
                                      [&](int g) { return r.has(r.members, g) || dead(g); });
      if (waited || std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::milliseconds(10));
    }
    r.round = e;
    r.step = step;
    std::vector<int> candidates;
    for (int g : r.members)
      if (!r.has(r.joiners, g)) candidates.push_back(g);
    if (candidates.empty() && !r.joiners.empty()) {  // nobody to heal from: the lowest leads
      candidates.push_back(r.joiners.front());
      r.joiners.erase(r.joiners.begin());
    }
    r.participants = candidates;
    r.donor = candidates.empty() ? -1 : candidates.front();
    if (!r.joiners.empty() && r.donor >= 0) {
      // Several donors, unless a joiner was marked unhealthy (a failed heal among the reasons).
      const bool from_one = std::any_of(r.joiners.begin(), r.joiners.end(),
                                        [&](int g) { return marked(e - 1, "unhealthy", g); });
      const auto n = std::min<std::size_t>(from_one ? 1 : static_cast<std::size_t>(o_.heal_donors),
                                           candidates.size());
      r.donors.assign(candidates.begin(), candidates.begin() + static_cast<std::ptrdiff_t>(n));
    }
    for (int g : expected)
      if (!r.has(r.members, g)) r.left_out.push_back(g);
    bool found = false;
    if (st_->try_set(dkey, gloo::bytes_of(detail::serialize(r))) &&
        number(st_->try_get(key("latest"), found)) < e)  // never back (a race may, rarely)
      st_->set(key("latest"), gloo::bytes_of(std::to_string(e)));
  }

  /// out (members x bytes) = the members' inputs, in member order, over the round's context;
  /// a failure is retried among the survivors.
  void gather_members(const void* in, void* out, std::size_t bytes, std::int64_t n, dtype t) {
    retrying("all_gather",
             [&](gloo::communicator& c) { vouched_call(c, [&] { c.all_gather(in, out, n, t); }); });
    if (round_.members.size() == 1) std::memcpy(out, in, bytes);  // alone (from the start or now)
  }

  /// Runs f, a call on c, with what vouch() said (the firing's first call only once).
  template <class F>
  void vouched_call(gloo::communicator& c, F&& f) {
    c.vouch(vouched_, first_);
    first_ = false;
    try {
      f();
    } catch (...) {
      c.vouch(0, true);
      throw;
    }
    c.vouch(0, true);
  }

  /// Runs f on the round's context (connecting it first if needed); when that fails (a
  /// member died or hung, or its context broke), the ranks of this link that are left meet
  /// again under a fresh prefix and f runs among them. Alone, f does not run. A store that
  /// fails meanwhile leaves this group alone for the rest of the round.
  template <class F>
  void retrying(const char* what, F&& f) {
    const std::int64_t k = ops_++;
    if (k > 0) phase("op", round_.round);
    for (int attempt = 0;; ++attempt) {
      if (round_.members.size() <= 1) {
        ctx_.reset();
        return;
      }
      // Connecting alone needs no agreement of its own: connect() has one.
      const bool agreed_op = std::string_view(what) != "connect";
      const auto base =
          key(detail::concat("r", round_.round, "/op", k, "/l", local_, "/a", attempt));
      const auto wait = o_.transport.timeout + o_.join_timeout;
      const auto failed = [&](const std::exception& e) {
        if (agreed_op) (void)agree(base, false, wait);
        regroup(what, k, attempt, e.what());
      };
      try {
        try {
          if (!ctx_) connect();
          counted(*ctx_, f);
          if (!agreed_op || agree(base, true, wait)) return;
          regroup(what, k, attempt, "it failed on another member");
        } catch (const gloo::store_error&) {
          throw;
        } catch (const peer_failure& e) {
          failed(e);
        } catch (const timeout_error& e) {
          failed(e);
        } catch (const backend_error& e) {
          failed(e);
        }
      } catch (const gloo::store_error& e) {
        store_failed(e);
        return;
      }
    }
  }

  /// CONNECT of the file comment: every member's rank of this link says it is ready; when
  /// all are, the context connects within connect_timeout. A member that is dead before it
  /// is ready fails the connect at once (peer_failure), one that is late at join_timeout.
  /// When every member holds the previous round's context for these members, they keep it
  /// instead (await_ready). Then the members agree whether the context is whole (agree): a
  /// connect that failed on one member fails on all, so the survivors REGROUP at the same op;
  /// and no member starts an op before every other one is through CONNECT (a member that
  /// dies mid-op can leave a survivor that only sends to it waiting for the op's timeout:
  /// Gloo notices a closed socket only where it reads).
  void connect() {
    try {
      const bool keep = await_ready();
      phase("ready", round_.round);
      if (keep) {
        ctx_ = std::move(held_);
      } else {
        held_.reset();
        gloo::options t = o_.transport;
        t.connect_timeout = o_.connect_timeout;
        ctx_.emplace(
            std::make_shared<detail::bounded_store>(st_, gloo::detail::to_ms(o_.connect_timeout)),
            prefix_, index_in(round_.members, group_), static_cast<int>(round_.members.size()), t);
        ctx_prefix_ = prefix_;
        ctx_members_ = members_key();
        ++connects_;
      }
      held_.reset();
    } catch (const gloo::store_error&) {
      throw;
    } catch (const fedshard::error&) {
      ctx_.reset();
      (void)agree(prefix_, false, o_.join_timeout + o_.connect_timeout);
      throw;
    }
    if (!agree(prefix_, true, o_.join_timeout + o_.connect_timeout)) {
      ctx_.reset();
      throw peer_failure(detail::concat("fedshard: elastic::link: a member of round ", round_.round,
                                        " could not connect ('", prefix_, "')"));
    }
  }

  /// The members' agreement on a call's outcome (a connect, or an op: a Gloo call can
  /// complete on one member and fail on another when a third dies in it): this rank writes
  /// `<base>/done/<g>` or `<base>/failed/<g>`, and the first rank to know the outcome
  /// writes `<base>/verdict` (create-if-absent): "ok" once every member is done, "failed"
  /// once one failed, or is dead without being done (read again after its death: a key it
  /// wrote before dying counts), or `wait` passed. True for "ok".
  bool agree(const std::string& base, bool ok, std::chrono::duration<double> wait) {
    const auto vkey = base + "/verdict";
    const auto said = [&](int g, const char* what) {
      return base + "/" + what + "/" + std::to_string(g);
    };
    st_->set(said(group_, ok ? "done" : "failed"), gloo::bytes_of("1"));
    if (!ok) (void)st_->try_set(vkey, gloo::bytes_of("failed"));
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(wait);
    auto nap = std::chrono::milliseconds(1);
    for (;;) {
      bool found = false;
      const auto v = st_->try_get(vkey, found);
      if (found) return std::string(v.begin(), v.end()) == "ok";
      bool all = true, failed = false;
      for (int g : round_.members) {
        if (st_->has(said(g, "done"))) continue;
        all = false;
        failed = failed || st_->has(said(g, "failed")) ||
                 (dead(g, token_in(decided_, g, 0)) && !st_->has(said(g, "done")));
      }
      if (all || failed || std::chrono::steady_clock::now() >= deadline) {
        (void)st_->try_set(vkey, gloo::bytes_of(all ? "ok" : "failed"));
        continue;
      }
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::milliseconds(10));
    }
  }

  /// This link's members as a context knows them: each group with its rank's incarnation.
  std::string members_key() const {
    std::string k;
    for (int g : round_.members) k += detail::concat(g, ":", token_in(decided_, g, local_), ",");
    return k;
  }

  /// CONNECT's ready barrier (see connect()): true when every member named the context this
  /// rank holds (held_), made for this round's members, so all keep it.
  bool await_ready() {
    const bool can_keep = o_.reuse_connections && held_ && ctx_members_ == members_key();
    const std::string mine = can_keep ? ctx_prefix_ + "|" + ctx_members_ : "-";
    st_->set(prefix_ + "/ready/" + std::to_string(group_), gloo::bytes_of(mine));
    const auto deadline =
        std::chrono::steady_clock::now() +
        std::chrono::duration_cast<std::chrono::steady_clock::duration>(o_.join_timeout);
    auto nap = std::chrono::milliseconds(1);
    for (;;) {
      int missing = -1;
      for (int g : round_.members)
        if (!st_->has(prefix_ + "/ready/" + std::to_string(g))) {
          missing = g;
          if (dead(g, token_in(decided_, g, 0)))
            throw peer_failure(detail::concat("fedshard: elastic::link: group ", g,
                                              " died before connecting round ", round_.round));
        }
      if (missing < 0) break;
      if (std::chrono::steady_clock::now() >= deadline)
        throw timeout_error(detail::concat("fedshard: elastic::link: group ", missing,
                                           " was not ready to connect round ", round_.round,
                                           " within the join timeout"));
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::milliseconds(10));
    }
    if (!can_keep) return false;
    for (int g : round_.members) {
      bool found = false;
      const auto v = st_->try_get(prefix_ + "/ready/" + std::to_string(g), found);
      if (!found || std::string(v.begin(), v.end()) != mine) return false;
    }
    return true;
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

  /// REGROUP of the file comment, after op k failed: the link's survivors say they are here,
  /// the first to see all (or every missing one dead, or the deadline) decides who goes on,
  /// and the missing groups are marked dropped (they heal in their next round).
  void regroup(const char* what, std::int64_t k, int attempt, const std::string& why) {
    ctx_.reset();
    const auto e = round_.round;
    const auto base = key(detail::concat("r", e, "/op", k, "/l", local_, "/a", attempt));
    st_->set(base + "/here/" + std::to_string(group_), gloo::bytes_of("1"));
    const auto dkey = base + "/decision";
    // A live member not here yet may be inside the op still, until its timeout.
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              o_.transport.timeout + o_.join_timeout);
    std::string proposal;  // who goes on: the rest of the link's round is theirs
    for (;;) {
      if (st_->has(dkey)) break;
      std::vector<int> here;
      bool waiting = false;
      for (int g : round_.members) {
        if (st_->has(base + "/here/" + std::to_string(g)))
          here.push_back(g);
        else
          waiting = waiting || !dead(g, token_in(decided_, g, 0));
      }
      if (!waiting || std::chrono::steady_clock::now() >= deadline) {
        round_info r;
        r.round = e;
        r.step = round_.step;
        r.members = here;
        for (int g : round_.participants)
          if (r.has(here, g)) r.participants.push_back(g);
        proposal = detail::serialize(r);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    if (proposal.empty()) proposal = detail::serialize(alone_in(e));  // lost: this rank alone
    const round_info r = checked(detail::parse(first_of(dkey, proposal)), e);
    regrouped(r, what, k, why);
    prefix_ = base + "/ctx";
  }

  /// Takes the regroup decision r: who is left, who was dropped (marked for the next round).
  void regrouped(const round_info& r, const char* what, std::int64_t k, const std::string& why) {
    std::vector<int> dropped;
    for (int g : round_.members)
      if (!r.has(r.members, g)) dropped.push_back(g);
    for (int g : dropped) {
      mark("dropped", g);
      if (!round_.has(dropped_, g)) dropped_.push_back(g);
    }
    log(detail::concat("fedshard elastic: group ", group_, " link ", local_, ": ", what, " #", k,
                       " of round ", round_.round, " failed (", why, "); dropped ", dropped.size(),
                       " group(s), going on with ", r.members.size()));
    std::vector<int> members = r.members, parts;
    if (!r.has(members, group_)) members = {group_};  // decided without this rank: alone
    for (int g : round_.participants)
      if (std::find(members.begin(), members.end(), g) != members.end()) parts.push_back(g);
    round_.members = members;
    round_.participants = parts;
  }

  /// The value of key once it exists; after join_timeout, or once the round's lowest member
  /// (every link's first writer) is dead, "" created in its place unless it appeared
  /// meanwhile (create-if-absent: every reader takes whichever came first).
  std::string agreed(const std::string& k) {
    bool found = false;
    const int first = decided_.members.empty() ? group_ : decided_.members.front();
    (void)gloo::detail::poll_until(
        [&] {
          (void)st_->try_get(k, found);
          return found || (first != group_ && dead(first, token_in(decided_, first, 0)));
        },
        gloo::detail::to_ms(o_.join_timeout));
    return first_of(k, "");  // found: the value there; else "" created in its place
  }
  /// Creates k = proposal unless it exists, then returns what k holds: the first writer's
  /// value for every caller. A store that lost the key meanwhile (a Redis server restarted
  /// empty) gives the proposal itself.
  std::string first_of(const std::string& k, const std::string& proposal) {
    (void)st_->try_set(k, gloo::bytes_of(proposal));
    bool found = false;
    const auto v = st_->try_get(k, found);
    return found ? std::string(v.begin(), v.end()) : proposal;
  }

  std::shared_ptr<gloo::store> st_;
  int groups_;
  int group_;
  int group_size_;
  int local_;
  options o_;
  std::optional<gloo::communicator> ctx_;
  std::uint64_t vouched_ = 0;  // vouch(): the firing's fingerprint, and whether its first call
  bool first_ = true;          // is the next one
  std::optional<gloo::communicator> held_;  // the last round's context, while connecting
  std::string ctx_prefix_;                  // where the newest context connected
  std::string ctx_members_;                 // and its members (members_key())
  std::string prefix_;                      // where the round's context (re)connects
  round_info round_;
  std::vector<int> rejected_;
  std::vector<int> dropped_;  // groups this link dropped in the current round
  round_info decided_;        // the current round as decided (round_ loses groups)
  std::unique_ptr<life> life_;
  bool restarted_ = false;
  bool in_round_ = false;
  bool heal_failed_ = false;
  std::int64_t next_round_ = 0;
  std::int64_t ops_ = 0;
  std::int64_t agreements_ = 0;  // agreed_sum calls in the current round
  std::int64_t rounds_seen_ = 0;
  bool ever_member_ = false;
  moved_bytes moved_{};
  std::int64_t connects_ = 0;
};

static_assert(Communicator<link>);

}  // namespace fedshard::elastic
