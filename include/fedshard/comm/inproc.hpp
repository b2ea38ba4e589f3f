#pragma once
/// The in-process communicator: N ranks as threads of one process.
///
/// Collectives work directly on the peers' buffers through shared memory; nothing is copied
/// through a mailbox. Every rank publishes its buffer pointers in a slot shared by the
/// communicator's ranks, waits until all have arrived, then does its share of the work on
/// everyone's buffers and waits until all are done:
///  - all_reduce: the element range is cut into one chunk per rank on cache-line boundaries;
///    rank r reduces chunk r from all inputs, in rank order, and writes the result into every
///    rank's output (each input read once, each output written once: the shared-memory bound);
///  - reduce_scatter: rank r reduces block r of all inputs into its own output;
///  - all_gather: rank r copies its input into block r of every output;
///  - broadcast: rank r copies chunk r of the root's buffer into every other rank's buffer.
/// Results are bit-identical on every rank and every run: each element is reduced by one rank,
/// always in rank order, by the host backends' shared core (comm/detail/reduction.hpp).
///
/// Async operations run on a progress thread owned by the rank's communicator (started on
/// first use); point-to-point operations are completed by whichever side arrives second.
/// Errors instead of hangs: see Communicator (comm/communicator.hpp); the timeout comes from
/// options::timeout, by default the environment variable FEDSHARD_TIMEOUT_S or 300 s.
/// A request dropped while its rank unwinds an exception does not wait for peers that may
/// never answer: an unmatched send or receive is withdrawn, an async collective fails the
/// world first (its peers throw peer_failure).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fedshard/comm/async_calls.hpp"
#include "fedshard/comm/blocking.hpp"
#include "fedshard/comm/communicator.hpp"
#include "fedshard/comm/detail/call.hpp"
#include "fedshard/comm/detail/reduction.hpp"
#include "fedshard/comm/request.hpp"
#include "fedshard/config.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/error.hpp"

namespace fedshard::inproc {

namespace detail {
using fedshard::detail::call_args;
using fedshard::detail::default_timeout;
using fedshard::detail::make_call;
using fedshard::detail::op_kind;
}  // namespace detail

/// Settings of an in-process world.
struct options {
  /// How long a rank waits for its peers before throwing timeout_error.
  std::chrono::duration<double> timeout = detail::default_timeout();
  /// How many times a waiting rank polls (yielding its core) before it sleeps; -1 = automatic:
  /// 256 when every rank can have a core of its own, else 48. Polling makes short
  /// collectives fast; with many more ranks than cores and heavy compute between collectives
  /// 0 can be better, since a polling rank takes time from the ranks it waits for.
  int spin_polls = -1;
};

class communicator;

namespace detail {

using clock = std::chrono::steady_clock;

/// What all communicators of one inproc::run share: failure and exit state of every rank.
struct world_state {
  world_state(int n, std::chrono::duration<double> t, int spin_polls)
      : size(n),
        timeout(t),
        spins(spin_polls >= 0 ? spin_polls : auto_spins(n)),
        exited(static_cast<std::size_t>(n)) {}

  static int auto_spins(int ranks) {
    static const int cores = static_cast<int>(std::thread::hardware_concurrency());
    return cores >= ranks ? 256 : 48;
  }

  const int size;
  const std::chrono::duration<double> timeout;
  const int spins;  // polls before a waiting rank sleeps
  std::atomic<bool> failed{false};
  std::vector<std::atomic<bool>> exited;
  std::mutex mu;
  int failed_rank = -1;
  std::string failure;

  /// Records the first failure of the world; later ones keep the first.
  void fail(int world_rank, const std::string& what) {
    std::lock_guard lock(mu);
    if (failed_rank >= 0) return;
    failed_rank = world_rank;
    failure = what;
    failed.store(true);
  }
  std::pair<int, std::string> first_failure() {
    std::lock_guard lock(mu);
    return {failed_rank, failure};
  }
};

/// What a posted send or receive carries and who it is between (inproc's and gpu_inproc's).
struct p2p_message {
  bool is_send = false;
  const void* sbuf = nullptr;
  void* rbuf = nullptr;
  std::int64_t count = 0;
  dtype type = dtype::f32;
  int src = 0;  // member indices
  int dst = 0;
  int tag = 0;

  /// Rank me's send to (or receive from) peer.
  static p2p_message of(bool is_send, const void* sbuf, void* rbuf, std::int64_t n, dtype t, int me,
                        int peer, int tag) {
    return {.is_send = is_send,
            .sbuf = sbuf,
            .rbuf = rbuf,
            .count = n,
            .type = t,
            .src = is_send ? me : peer,
            .dst = is_send ? peer : me,
            .tag = tag};
  }
  /// True when o is the other end of this message (a receive for a send, the same tag).
  bool matches(const p2p_message& o) const {
    return is_send != o.is_send && src == o.src && dst == o.dst && tag == o.tag;
  }
};

struct p2p_op : p2p_message {
  bool done = false;  // guarded by group_state::p2p_mu
  std::string error;  // set when the matched peer disagreed
};

/// A group made by a split, until every member of it has fetched it.
template <class Group>
struct split_entry {
  std::shared_ptr<Group> group;
  int fetched = 0;
};

/// The state shared by the ranks of one communicator (the world or a split).
struct group_state {
  static constexpr std::uint64_t ring = 16;  // collectives that may be in flight at once

  group_state(std::shared_ptr<world_state> w, std::vector<int> members)
      : world(std::move(w)),
        world_ranks(std::move(members)),
        size(static_cast<int>(world_ranks.size())) {
    for (auto& s : slots) {
      s.args.resize(static_cast<std::size_t>(size));
      s.calls.resize(static_cast<std::size_t>(size));
      s.marks = std::make_unique<std::atomic<std::uint64_t>[]>(static_cast<std::size_t>(size));
      for (int i = 0; i < size; ++i) s.marks[i].store(0);
    }
  }

  struct slot {
    // Every member's arguments, and their summaries (each made by its member).
    std::vector<call_args> args;
    std::vector<fedshard::detail::call_summary> calls;
    // marks[i] = barrier points member i has passed at this slot: 2 per collective.
    std::unique_ptr<std::atomic<std::uint64_t>[]> marks;
  };

  std::shared_ptr<world_state> world;
  const std::vector<int> world_ranks;
  const int size;
  slot slots[ring];

  std::mutex mu;
  std::condition_variable cv;
  std::atomic<int> sleepers{0};

  std::map<std::pair<std::uint64_t, int>, split_entry<group_state>> splits;  // guarded by mu

  std::mutex p2p_mu;
  std::condition_variable p2p_cv;
  std::deque<p2p_op*> posted;  // unmatched sends and receives, in posting order

  void wake() {
    if (sleepers.load() > 0) {
      { std::lock_guard lock(mu); }
      cv.notify_all();
    }
  }
};

/// Throws peer_failure if the world failed or a member we wait for left; timeout_error past
/// the deadline. `missing` lists the members not yet arrived when last looked at;
/// `arrived(m)` looks again (a member may arrive, complete the call and exit in between).
template <class Arrived>
void check_progress(group_state& g, int me, const char* what, std::uint64_t seq,
                    const std::vector<int>& missing, clock::time_point deadline,
                    Arrived&& arrived) {
  world_state& w = *g.world;
  const int my_world = g.world_ranks[static_cast<std::size_t>(me)];
  // Read the exit flags before the failure flag: a rank that threw records its failure before
  // it exits, so seeing it exited implies seeing its failure (reported as such, not as "left").
  // Likewise a member arrives before it exits: once its exit flag is seen, a second look at
  // its arrival is up to date, and only a member that exited without arriving has left.
  int left = -1;
  for (int m : missing) {
    const int wr = g.world_ranks[static_cast<std::size_t>(m)];
    if (w.exited[static_cast<std::size_t>(wr)].load() && !arrived(m)) {
      left = wr;
      break;
    }
  }
  if (w.failed.load()) {
    auto [r, msg] = w.first_failure();
    throw peer_failure(fedshard::detail::concat("fedshard: peer_failure: rank ", my_world,
                                                " was waiting in ", what, " (call #", seq,
                                                ") when world rank ", r, " failed: ", msg));
  }
  if (left >= 0) {
    const std::string msg = fedshard::detail::concat(
        "fedshard: peer_failure: world rank ", left, " left (its body returned) while rank ",
        my_world, " waited for it in ", what, " (call #", seq, ")");
    w.fail(my_world, msg);
    throw peer_failure(msg);
  }
  if (clock::now() >= deadline) {
    std::string names;
    for (int m : missing)
      names += fedshard::detail::concat(names.empty() ? "" : ", ", m, " (world rank ",
                                        g.world_ranks[static_cast<std::size_t>(m)], ")");
    const std::string msg = fedshard::detail::concat(
        "fedshard: timeout_error: ", what, " (call #", seq, ") on a communicator of ", g.size,
        " ranks did not complete within ", w.timeout.count(), " s on rank ", me,
        "; ranks that did not arrive: ", names.empty() ? std::string("none") : names);
    w.fail(my_world, msg);
    throw timeout_error(msg);
  }
}

/// Waits until every member's mark at slot s is >= target.
inline void wait_marks(group_state& g, int me, group_state::slot& s, std::uint64_t target,
                       const char* what, std::uint64_t seq, clock::time_point deadline) {
  auto all_arrived = [&] {
    for (int i = 0; i < g.size; ++i)
      if (s.marks[i].load(std::memory_order_acquire) < target) return false;
    return true;
  };
  // Poll briefly (yielding, so that the ranks we wait for can run) before sleeping.
  const int spins = g.world->spins;
  for (int spin = 0; spin < spins; ++spin) {
    if (all_arrived()) return;
    if (spin >= 16 || spins < 256) std::this_thread::yield();
  }
  std::vector<int> missing;
  for (;;) {
    missing.clear();
    for (int i = 0; i < g.size; ++i)
      if (s.marks[i].load(std::memory_order_acquire) < target) missing.push_back(i);
    if (missing.empty()) return;
    check_progress(g, me, what, seq, missing, deadline,
                   [&](int m) { return s.marks[m].load(std::memory_order_acquire) >= target; });
    std::unique_lock lock(g.mu);
    g.sleepers.fetch_add(1);
    if (!all_arrived()) g.cv.wait_for(lock, std::chrono::milliseconds(20));
    g.sleepers.fetch_sub(1);
  }
}

inline void arrive(group_state& g, group_state::slot& s, int me, std::uint64_t value) {
  s.marks[me].store(value);
  g.wake();
}

/// Copies [begin, end) bytes of src to each dst, in blocks that stay in cache.
inline void copy_to_all(const char* src, char* const* dsts, int ndst, std::size_t bytes) {
  constexpr std::size_t blk = 32 * 1024;
  for (std::size_t b = 0; b < bytes; b += blk) {
    const std::size_t m = std::min(blk, bytes - b);
    for (int p = 0; p < ndst; ++p)
      if (dsts[p] != src) std::memcpy(dsts[p] + b, src + b, m);
  }
}

/// Does member me's share of a validated collective whose arguments are d[0..n).
inline void execute(const std::vector<call_args>& d, int me, int n) {
  const call_args& mine = d[static_cast<std::size_t>(me)];
  const std::int64_t count = mine.count;
  if (count == 0) return;
  const std::size_t esz = size_of(mine.type);
  switch (mine.kind) {
    case op_kind::all_reduce:
    case op_kind::reduce_scatter:
      visit(mine.type, [&](auto tag) {
        using T = typename decltype(tag)::type;
        // all_reduce: chunk me of every input into every output; reduce_scatter: block me of
        // every input into this rank's output.
        const bool all = mine.kind == op_kind::all_reduce;
        const auto part = all ? fedshard::detail::chunk_of(count, n, esz, me)
                              : fedshard::detail::elem_range{count * me, count * (me + 1)};
        std::vector<const T*> ins(static_cast<std::size_t>(n));
        std::vector<T*> outs(static_cast<std::size_t>(all ? n : 1));
        for (int p = 0; p < n; ++p) ins[p] = static_cast<const T*>(d[p].in) + part.begin;
        if (all) {
          for (int p = 0; p < n; ++p) outs[p] = static_cast<T*>(d[p].out) + part.begin;
        } else {
          outs[0] = static_cast<T*>(mine.out);
        }
        const auto input = [&](int p) { return ins[p]; };
        fedshard::detail::visit_op(mine.op, [&](auto opc) {
          fedshard::detail::reduce_rank_order<T, decltype(opc)::value>(
              input, n, outs.data(), static_cast<int>(outs.size()), part.end - part.begin);
        });
      });
      return;
    case op_kind::all_gather: {
      std::vector<char*> dsts(static_cast<std::size_t>(n));
      for (int p = 0; p < n; ++p)
        dsts[p] = static_cast<char*>(d[p].out) + static_cast<std::size_t>(count * me) * esz;
      copy_to_all(static_cast<const char*>(mine.in), dsts.data(), n,
                  static_cast<std::size_t>(count) * esz);
      return;
    }
    case op_kind::broadcast: {
      const int root = mine.root;
      const auto [begin, end] = fedshard::detail::chunk_of(count, n, esz, me);
      if (end <= begin) return;
      const std::size_t off = static_cast<std::size_t>(begin) * esz;
      std::vector<char*> dsts;
      for (int p = 0; p < n; ++p)
        if (p != root) dsts.push_back(static_cast<char*>(d[p].out) + off);
      copy_to_all(static_cast<const char*>(d[root].out) + off, dsts.data(),
                  static_cast<int>(dsts.size()), static_cast<std::size_t>(end - begin) * esz);
      return;
    }
    case op_kind::barrier:
    case op_kind::split: return;
  }
}

/// The bytes member me of n moves in the collective a, as execute() copies them: a copy from
/// one rank's buffer into another's is sent by the first and received by the second, whichever
/// rank's thread makes it. gpu_inproc (cuda/gpu_inproc.cuh) copies the same way.
inline moved_bytes moved_by(const call_args& a, int n, int me) {
  if (n <= 1 || a.count <= 0 || !is_valid(a.type)) return {};
  const auto esz = static_cast<std::int64_t>(size_of(a.type));
  const std::int64_t s = a.count * esz;  // the buffer, or one rank's block (gather, scatter)
  switch (a.kind) {
    case op_kind::all_reduce: {
      // Chunk me of every peer's input is read here and chunk p of this rank's input by p;
      // then this rank writes its reduced chunk into every peer's output, and each peer its
      // chunk into this rank's output.
      const auto [lo, hi] = fedshard::detail::chunk_of(a.count, n, size_of(a.type), me);
      const std::int64_t mine = (hi - lo) * esz;
      const std::int64_t b = (s - mine) + (n - 1) * mine;
      return {b, b};
    }
    case op_kind::all_gather:      // this rank's input into n-1 outputs, theirs into its own
    case op_kind::reduce_scatter:  // block me of n-1 inputs read here, block p of its own by p
      return {(n - 1) * s, (n - 1) * s};
    case op_kind::broadcast:  // the root's buffer into every other rank's
      return me == a.root ? moved_bytes{(n - 1) * s, 0} : moved_bytes{0, s};
    case op_kind::barrier:
    case op_kind::split: break;
  }
  return {};
}

/// Where the members of one collective, call number seq, meet: the slot it takes in the ring
/// and its generation there, and the deadline of member me. A collective is meet(), the
/// member's share of the work, then leave(); gpu_inproc's are as well.
struct meeting {
  meeting(group_state& grp, int member, std::uint64_t n, op_kind kind)
      : g(grp),
        me(member),
        seq(n),
        what(to_string(kind)),
        deadline(clock::now() + std::chrono::duration_cast<clock::duration>(g.world->timeout)),
        slot_index(seq % group_state::ring),
        gen(seq / group_state::ring),
        s(g.slots[slot_index]) {}

  /// Waits until the slot's previous call is done, calls before_publish() (gpu_inproc records
  /// its arrival event there), publishes args and their summary, and waits until every member
  /// has; then checks the calls, and on a mismatch leaves the slot to the next call and
  /// rethrows (the same error on every member). Returns every member's arguments.
  template <class Hook>
  const std::vector<call_args>& meet(const call_args& args, Hook&& before_publish) {
    const fedshard::detail::call_summary summary = fedshard::detail::summarize(args, me, g.size);
    wait_marks(g, me, s, 2 * gen, what, seq, deadline);  // the slot's previous call is done
    before_publish();
    s.args[static_cast<std::size_t>(me)] = args;
    s.calls[static_cast<std::size_t>(me)] = summary;
    arrive(g, s, me, 2 * gen + 1);
    wait_marks(g, me, s, 2 * gen + 1, what, seq, deadline);
    try {
      fedshard::detail::check_calls(s.calls, seq);
    } catch (...) {
      arrive(g, s, me, 2 * gen + 2);  // leave the slot to the next call, then throw
      throw;
    }
    return s.args;
  }

  /// Waits until every member has done its share (the slot is free for the next call then).
  void leave() {
    arrive(g, s, me, 2 * gen + 2);
    wait_marks(g, me, s, 2 * gen + 2, what, seq, deadline);
  }

  group_state& g;
  const int me;
  const std::uint64_t seq;
  const char* const what;
  const clock::time_point deadline;
  const std::uint64_t slot_index;
  const std::uint64_t gen;
  group_state::slot& s;
};

/// The members that passed member me's color in a split whose arguments are d, ordered by
/// key, then by member index.
inline std::vector<int> split_members(const std::vector<call_args>& d, int me) {
  const int color = d[static_cast<std::size_t>(me)].color;
  std::vector<int> members;
  for (int p = 0; p < static_cast<int>(d.size()); ++p)
    if (d[static_cast<std::size_t>(p)].color == color) members.push_back(p);
  std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
    return d[static_cast<std::size_t>(a)].key < d[static_cast<std::size_t>(b)].key;
  });
  return members;
}

/// The group of split seq for color, made by make() (a shared_ptr<Group>) for the first of
/// its `size` members to ask; the entry of splits (guarded by mu) goes once all have fetched
/// it.
template <class Group, class Make>
std::shared_ptr<Group> fetch_split(
    std::mutex& mu, std::map<std::pair<std::uint64_t, int>, split_entry<Group>>& splits,
    std::uint64_t seq, int color, int size, Make&& make) {
  std::lock_guard lock(mu);
  auto& e = splits[{seq, color}];
  if (!e.group) e.group = make();
  std::shared_ptr<Group> result = e.group;
  if (++e.fetched == size) splits.erase({seq, color});
  return result;
}

/// Runs one collective, call number seq, for member me. Returns the split result for splits.
inline std::shared_ptr<group_state> run_collective(group_state& g, int me, std::uint64_t seq,
                                                   const call_args& args) {
  meeting m(g, me, seq, args.kind);
  const auto& d = m.meet(args, [] {});
  std::shared_ptr<group_state> result;
  if (d[0].kind == op_kind::split) {
    const std::vector<int> members = split_members(d, me);
    result = fetch_split(g.mu, g.splits, seq, d[static_cast<std::size_t>(me)].color,
                         static_cast<int>(members.size()), [&] {
                           std::vector<int> wr;
                           for (int w : members)
                             wr.push_back(g.world_ranks[static_cast<std::size_t>(w)]);
                           return std::make_shared<group_state>(g.world, std::move(wr));
                         });
  } else {
    execute(d, me, g.size);
  }
  m.leave();
  return result;
}

/// Completion shared between an async task and its request.
struct completion {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;

  void finish(std::exception_ptr e) {
    {
      std::lock_guard lock(mu);
      done = true;
      error = std::move(e);
    }
    cv.notify_all();
  }
};

class async_request final : public fedshard::detail::request_state {
 public:
  async_request(std::shared_ptr<completion> c, std::shared_ptr<group_state> g, int me)
      : c_(std::move(c)), g_(std::move(g)), me_(me) {}
  void wait() override {
    if (std::uncaught_exceptions() > 0 && !test()) {
      // Dropped while this rank unwinds: its peers may wait for this rank elsewhere, so fail
      // the world (they throw peer_failure) instead of waiting until the timeout.
      const int wr = g_->world_ranks[static_cast<std::size_t>(me_)];
      g_->world->fail(
          wr, fedshard::detail::concat("world rank ", wr,
                                       " unwound an exception with an async collective pending"));
    }
    std::unique_lock lock(c_->mu);
    c_->cv.wait(lock, [&] { return c_->done; });
    if (auto e = std::exchange(c_->error, nullptr)) std::rethrow_exception(e);
  }
  bool test() override {
    std::lock_guard lock(c_->mu);
    return c_->done;
  }

 private:
  std::shared_ptr<completion> c_;
  std::shared_ptr<group_state> g_;
  int me_;
};

/// Runs queued collectives of one rank in call order.
class progress_thread {
 public:
  progress_thread() : thread_([this] { loop(); }) {}
  progress_thread(const progress_thread&) = delete;
  progress_thread& operator=(const progress_thread&) = delete;
  ~progress_thread() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void post(std::function<void()> task) {
    {
      std::lock_guard lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_all();
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;  // stop requested and queue drained
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members above exist
};

class p2p_request final : public fedshard::detail::request_state {
 public:
  p2p_request(std::shared_ptr<group_state> g, int me, std::unique_ptr<p2p_op> op)
      : g_(std::move(g)), me_(me), op_(std::move(op)) {}
  void wait() override;
  bool test() override {
    std::lock_guard lock(g_->p2p_mu);
    return op_->done;
  }

 private:
  std::shared_ptr<group_state> g_;
  int me_;
  std::unique_ptr<p2p_op> op_;
};

/// Posts a send or receive; if the peer's matching operation is already posted, completes
/// both by copying directly from the sender's buffer into the receiver's.
inline void p2p_post(group_state& g, p2p_op& op) {
  p2p_op* peer = nullptr;
  {
    std::lock_guard lock(g.p2p_mu);
    auto it = std::find_if(g.posted.begin(), g.posted.end(),
                           [&](const p2p_op* q) { return q->matches(op); });
    if (it == g.posted.end()) {
      g.posted.push_back(&op);
      return;
    }
    peer = *it;
    g.posted.erase(it);
  }
  p2p_op& s = op.is_send ? op : *peer;
  p2p_op& r = op.is_send ? *peer : op;
  std::string err;
  if (s.count != r.count || s.type != r.type) {
    err = fedshard::detail::p2p_mismatch(s.src, s.dst, s.tag, s.count, s.type, r.count, r.type);
  } else if (s.count > 0) {
    std::memcpy(r.rbuf, s.sbuf, static_cast<std::size_t>(s.count) * size_of(s.type));
  }
  {
    std::lock_guard lock(g.p2p_mu);
    s.error = err;
    r.error = err;
    s.done = true;
    r.done = true;
  }
  g.p2p_cv.notify_all();
}

/// Waits until op is done (throws its error), failing with peer_failure/timeout_error.
inline void p2p_wait(group_state& g, int me, p2p_op& op) {
  const auto deadline =
      clock::now() + std::chrono::duration_cast<clock::duration>(g.world->timeout);
  const char* what = op.is_send ? "send" : "recv";
  const int peer = op.is_send ? op.dst : op.src;
  std::unique_lock lock(g.p2p_mu);
  while (!op.done) {
    // Under p2p_mu nobody can match op meanwhile: a peer that left or a deadline that passed
    // fails the world only while op is still unmatched (once matched, the copy completes).
    auto it = std::find(g.posted.begin(), g.posted.end(), &op);
    if (it != g.posted.end()) {
      try {
        // still posted under p2p_mu: the peer has not matched op
        check_progress(g, me, what, 0, {peer}, deadline, [](int) { return false; });
      } catch (...) {
        g.posted.erase(it);
        throw;
      }
    }
    g.p2p_cv.wait_for(lock, std::chrono::milliseconds(20));
  }
  if (!op.error.empty()) throw collective_mismatch(op.error);
}

inline void p2p_request::wait() {
  if (std::uncaught_exceptions() > 0) {  // dropped while this rank unwinds
    std::lock_guard lock(g_->p2p_mu);
    auto it = std::find(g_->posted.begin(), g_->posted.end(), op_.get());
    if (it != g_->posted.end()) {  // unmatched: withdraw it instead of waiting for the peer
      g_->posted.erase(it);
      return;
    }
  }
  p2p_wait(*g_, me_, *op_);
}

inline std::unique_ptr<p2p_op> make_p2p(bool is_send, const void* sbuf, void* rbuf, std::int64_t n,
                                        dtype t, int me, int peer, int tag, int size) {
  fedshard::detail::check_p2p_args(is_send, is_send ? sbuf : rbuf, n, t, peer, size);
  auto op = std::make_unique<p2p_op>();
  static_cast<p2p_message&>(*op) = p2p_message::of(is_send, sbuf, rbuf, n, t, me, peer, tag);
  return op;
}

/// Everything one rank holds for one communicator; owned by inproc::communicator.
struct rank_handle {
  rank_handle(std::shared_ptr<group_state> g, int m) : group(std::move(g)), me(m) {}
  rank_handle(const rank_handle&) = delete;
  rank_handle& operator=(const rank_handle&) = delete;
  ~rank_handle() {
    // Destroyed while an exception unwinds with async collectives still queued or running: the
    // peers would wait for them forever, so fail the world (they throw peer_failure) before
    // draining. A collective that already returned needs no peer any more, even if its
    // task has not finished signalling its request.
    if (worker && std::uncaught_exceptions() > 0 && running->load() > 0) {
      const int wr = group->world_ranks[static_cast<std::size_t>(me)];
      group->world->fail(
          wr, fedshard::detail::concat("world rank ", wr,
                                       " unwound an exception with async collectives pending"));
    }
    worker.reset();  // drain async work before the group can go away
  }

  std::shared_ptr<group_state> group;
  int me;
  std::uint64_t next_seq = 0;
  std::unique_ptr<progress_thread> worker;
  /// Async collectives posted whose run_collective has not returned yet.
  std::shared_ptr<std::atomic<int>> running = std::make_shared<std::atomic<int>>(0);

  /// Bytes moved so far (moved_by of each call: blocking ones once they succeeded, async
  /// ones when issued).
  moved_bytes moved;

  std::shared_ptr<group_state> collective(const call_args& a) {
    auto result = run_collective(*group, me, next_seq++, a);
    moved += moved_by(a, group->size, me);
    return result;
  }
  request collective_async(const call_args& a) {
    moved += moved_by(a, group->size, me);
    const std::uint64_t seq = next_seq++;
    auto done = std::make_shared<completion>();
    if (!worker) worker = std::make_unique<progress_thread>();
    running->fetch_add(1);
    worker->post([g = group, m = me, seq, a, done, left = running] {
      std::exception_ptr error;
      try {
        run_collective(*g, m, seq, a);
      } catch (...) {
        error = std::current_exception();
      }
      left->fetch_sub(1);
      done->finish(std::move(error));  // outside the handler: the waiter owns the exception
    });
    return request(std::make_unique<async_request>(std::move(done), group, me));
  }
};

}  // namespace detail

/// One rank's handle on an in-process communicator; models fedshard::Communicator.
/// Move-only; not thread-safe (one thread per rank drives it).
class communicator : public blocking_calls<communicator>, public async_calls<communicator> {
 public:
  communicator(std::shared_ptr<detail::group_state> g, int member)
      : h_(std::make_unique<detail::rank_handle>(std::move(g), member)) {}
  communicator(communicator&&) noexcept = default;
  communicator& operator=(communicator&&) noexcept = default;
  ~communicator() = default;

  /// This rank's index in the communicator.
  int rank() const noexcept { return h_->me; }
  /// Number of ranks in the communicator.
  int size() const noexcept { return h_->group->size; }
  /// This rank's index in the world the communicator was split from.
  int world_rank() const noexcept {
    return h_->group->world_ranks[static_cast<std::size_t>(h_->me)];
  }

  /// out = op over ranks of in (count elements); in == out is in place.
  void all_reduce(const void* in, void* out, std::int64_t count, dtype t, reduce_op op) {
    h_->collective(detail::make_call(detail::op_kind::all_reduce, in, out, count, t, op));
  }
  /// out (count * size() elements) = every rank's in (count elements) in rank order.
  void all_gather(const void* in, void* out, std::int64_t count, dtype t) {
    h_->collective(detail::make_call(detail::op_kind::all_gather, in, out, count, t));
  }
  /// out (count elements) = op over ranks of block rank() of in (count * size() elements).
  void reduce_scatter(const void* in, void* out, std::int64_t count, dtype t, reduce_op op) {
    h_->collective(detail::make_call(detail::op_kind::reduce_scatter, in, out, count, t, op));
  }
  /// buf = root's buf on every rank.
  void broadcast(void* buf, std::int64_t count, dtype t, int root) {
    h_->collective(
        detail::make_call(detail::op_kind::broadcast, buf, buf, count, t, reduce_op::sum, root));
  }
  /// Returns once every rank has entered the barrier.
  void barrier() {
    h_->collective(detail::make_call(detail::op_kind::barrier, nullptr, nullptr, 0, dtype::f32));
  }

  /// Bytes this rank moved through this communicator so far (detail::moved_by per call).
  moved_bytes moved() const noexcept { return h_->moved; }
  /// What a collective k of count n of t (broadcast from root) moves on this rank: inproc's
  /// algorithms follow from the arguments alone.
  moved_bytes moved_by(collective k, std::int64_t n, dtype t, int root = 0) const {
    return detail::moved_by(detail::make_call(fedshard::detail::kind_of(k), nullptr, nullptr, n, t,
                                              reduce_op::sum, root),
                            size(), rank());
  }
  /// Every collective moves what a ring moves: chunks reduced where they belong, blocks copied
  /// once.
  wire_algorithm algorithm_of(collective, std::int64_t, dtype) const noexcept {
    return wire_algorithm::ring;
  }

  /// Collective: the communicator of the ranks that passed the same color (>= 0), ordered by
  /// key, then by rank. Sub-communicators run concurrently with each other and the parent.
  communicator split(int color, int key) {
    auto d = detail::make_call(detail::op_kind::split, nullptr, nullptr, 0, dtype::f32);
    d.color = color;
    d.key = key;
    auto g = h_->collective(d);
    int member = 0;
    for (int i = 0; i < g->size; ++i)
      if (g->world_ranks[static_cast<std::size_t>(i)] == world_rank()) member = i;
    return communicator(std::move(g), member);
  }

 private:
  friend class async_calls<communicator>;

  request collective(const detail::call_args& a) { return h_->collective_async(a); }
  request p2p(bool is_send, const void* sbuf, void* rbuf, std::int64_t count, dtype t, int peer,
              int tag) {
    auto op = detail::make_p2p(is_send, sbuf, rbuf, count, t, h_->me, peer, tag, size());
    h_->moved += fedshard::detail::p2p_moved(is_send, count, t, h_->me, peer);
    detail::p2p_post(*h_->group, *op);
    return request(std::make_unique<detail::p2p_request>(h_->group, h_->me, std::move(op)));
  }

  std::unique_ptr<detail::rank_handle> h_;
};

static_assert(Communicator<communicator>);

namespace detail {
/// The message of a caught exception (the "unknown exception" of one that is not a
/// std::exception).
inline std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
  }
  return "unknown exception";
}

/// Runs body(c) on n threads, c being rank r's Comm, which make(c, r) emplaces into an empty
/// std::optional<Comm>; returns when all have returned. A rank that throws is recorded in w
/// (its peers blocked in collectives then throw peer_failure), and the exception of the rank
/// that failed first is rethrown. The communicator outlives the catch, so a failure is
/// recorded before its async work is drained.
template <class Comm, class Make, class F>
void run_ranks(world_state& w, int n, Make&& make, F&& body) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      std::optional<Comm> c;
      try {
        make(c, r);
        body(*c);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        w.fail(r, what_of(errors[static_cast<std::size_t>(r)]));
      }
      c.reset();
      w.exited[static_cast<std::size_t>(r)].store(true);
    });
  }
  for (auto& t : threads) t.join();
  const int first = w.first_failure().first;
  if (first >= 0 && errors[static_cast<std::size_t>(first)])
    std::rethrow_exception(errors[static_cast<std::size_t>(first)]);
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}
}  // namespace detail

/// Runs body(communicator& world) on n threads, one per rank, and returns when all have
/// returned. If any rank throws, peers blocked in collectives throw peer_failure, and run()
/// rethrows the exception of the rank that failed first.
template <class F>
void run(int n, F&& body, options opt = {}) {
  FEDSHARD_EXPECTS(n >= 1, "inproc::run: the number of ranks must be >= 1, found ", n);
  FEDSHARD_EXPECTS(opt.timeout.count() > 0, "inproc::run: timeout must be > 0 s, found ",
                   opt.timeout.count());
  auto world = std::make_shared<detail::world_state>(n, opt.timeout, opt.spin_polls);
  std::vector<int> ranks(static_cast<std::size_t>(n));
  std::iota(ranks.begin(), ranks.end(), 0);
  auto group = std::make_shared<detail::group_state>(world, std::move(ranks));
  detail::run_ranks<communicator>(
      *world, n, [&](std::optional<communicator>& c, int r) { c.emplace(group, r); }, body);
}

}  // namespace fedshard::inproc
