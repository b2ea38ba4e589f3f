#pragma once
/// Healing is a plan: bringing a group that joins the federation (elastic::link's joiners,
/// comm/elastic.hpp) up to date moves the donor group's state over the federation axis as
/// one-way transfers (comm_kind::send and recv, plan/comm_op.hpp), run by the interpreter
/// like every op: the wire tap records them on the federation axis and the simulator prices
/// them (sim::price_chain).
///
/// A heal_round names the donor and the joiners as ranks of the federation axis (the groups,
/// on a uniform mesh); every rank heals its counterpart of the same replica and shard. The
/// donor's state is a blob of S bytes (a checkpoint's: the joiner verifies its checksums when
/// it restores it). For each joiner j, in the round's order, the donor's plan (heal_plan)
/// holds
///  1. a send of S as one f64 to j (role state_size, 8 bytes): j cannot know S;
///  2. a send of the blob to j as f64 words (role state, padded_state_bytes(S) bytes: S
///     rounded up to whole 8-byte words, zero-padded);
/// joiner j's plan holds the two matching recv ops from the donor; every other rank's plan is
/// empty. The ops run on demand in phase sync.
///
/// heal() runs it: the donor runs its plan op by op (an op that fails leaves none of the
/// rest pending in the interpreter, to start later on a broken or newer context); a joiner
/// runs its size op, checks the announced S against a bound before allocating anything
/// (receive_heal: a whole number of bytes in [1, bound], else invalid_argument naming the donor,
/// the bound and what was announced; the donor's blob send then fails at the transport's timeout),
/// runs its blob op and hands the S bytes to the caller. The bound heal() gives is heal_bound of
/// the joiner's own serialized state: the donor's state has the joiner's layout.
///
/// So a heal of S bytes shows on the donor's federation axis as two calls per joiner, of
/// 8 and padded_state_bytes(S) bytes; a joiner sends nothing.
///
/// Several donors (heal_round::donors, n >= 2 of them, the donor first; heal_from_donors):
/// the state splits in two blobs, the donor's own (what differs between groups: its master,
/// its inner optimizer) and the shared one (state_entry::same_in_every_group: anchors and
/// outer-optimizer state, which every participant of the last round holds bit for bit). The
/// first donor sends its own blob; donor k >= 1 sends piece k-1 of n-1 of its shared blob
/// (shared_piece: equal cuts) followed by a trailer of heal_piece_header_bytes: the shared
/// blob's size and digest (heal_round::digest; checksum64 of its bytes by default). Each
/// donor's plan is the two ops above with its blob; a joiner
/// receives every donor's size op in donor order, then posts the blob receives of all donors
/// at once (the interpreter issues them as async requests, so the donors' links run side by
/// side) and waits for them all. It refuses the heal unless every piece names the same size
/// and checksum and the pieces put together have them: donors that hold different shared
/// states are caught, never mixed.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/core/buffer.hpp"
#include "fedshard/core/checksum.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/error.hpp"
#include "fedshard/federation/participation.hpp"
#include "fedshard/mesh/axis.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/plan/interpreter.hpp"
#include "fedshard/schedule/sync_schedule.hpp"

namespace fedshard::federation {

/// Who heals whom in a round, as ranks of the federation axis (the groups, on a uniform
/// mesh).
struct heal_round {
  int ranks = 0;   ///< ranks on the federation axis (G)
  int donor = -1;  ///< the rank whose state the joiners take
  /// Every rank that holds the shared state alike, `donor` first (see the file comment);
  /// empty or `donor` alone: a heal from `donor` alone.
  std::vector<int> donors{};
  std::vector<int> joiners;  ///< the ranks that take it (distinct, not the donor)
  int me = -1;               ///< this rank's place on the axis
  /// What the donor sends instead of its state s (e.g. s with a tag appended: an elastic
  /// link over a signed store seals it); empty: s itself.
  std::function<std::string(std::string)> seal{};
  /// What a joiner takes from what it received (checking and removing the seal: throws
  /// when it is wrong); empty: what it received.
  std::function<std::string(std::string)> open{};
  /// Bytes the seal adds (the joiner's bound on what it accepts grows by them).
  std::int64_t seal_bytes = 0;
  /// How a heal from several donors names the shared blob in its pieces' trailers (the same
  /// on every donor, else the heal is refused); empty: checksum64 of its bytes. A blob that
  /// checks itself when it is taken may name itself at less cost (the trainer's is a
  /// checkpoint file: the checksum its trailer holds covers every chunk's checksum).
  std::function<std::uint64_t(const std::string&)> digest{};

  /// True when this rank is one of the joiners.
  bool joining() const { return std::find(joiners.begin(), joiners.end(), me) != joiners.end(); }
  /// True when this rank is one of the donors (`donor` or one of `donors`).
  bool donating() const {
    return me == donor || std::find(donors.begin(), donors.end(), me) != donors.end();
  }
  /// The donors, `donor` first ({donor} without `donors`).
  std::vector<int> all_donors() const { return donors.empty() ? std::vector<int>{donor} : donors; }
  /// "0" or "0, 2, 3": the donors in a message.
  std::string donors_text() const {
    std::string s;
    for (const int d : all_donors()) s += (s.empty() ? "" : ", ") + std::to_string(d);
    return s;
  }
};

/// The two blobs of a heal from several donors (see the file comment).
struct heal_parts {
  std::string own;     ///< what differs between groups: the first donor's
  std::string shared;  ///< what every donor holds alike
};

/// Bytes of the trailer behind a shared piece: the shared blob's size and digest.
inline constexpr std::int64_t heal_piece_header_bytes = 16;

/// [begin, end) of piece k of n equal cuts of a blob of `bytes` (the last pieces may be one
/// byte shorter).
constexpr std::pair<std::int64_t, std::int64_t> shared_piece(std::int64_t bytes, int k,
                                                             int n) noexcept {
  return {bytes * k / n, bytes * (k + 1) / n};
}

/// Bytes of the op that announces the state's size (one f64).
inline constexpr std::int64_t heal_size_bytes = 8;

/// The bytes a state of `state_bytes` travels in: whole 8-byte words.
constexpr std::int64_t padded_state_bytes(std::int64_t state_bytes) noexcept {
  return (state_bytes + 7) / 8 * 8;
}

/// The largest state a joiner whose own serialized state is `own_bytes` accepts from a donor:
/// twice its own plus 1 MiB (the donor's state has the joiner's layout; the slack covers
/// records that differ in length).
constexpr std::int64_t heal_bound(std::int64_t own_bytes) noexcept {
  return 2 * own_bytes + (std::int64_t{1} << 20);
}

/// Throws invalid_argument unless r is a round: ranks >= 2, donor and me on the axis, joiners
/// distinct ranks of the axis other than the donor.
inline void check(const heal_round& r) {
  FEDSHARD_EXPECTS(r.ranks >= 2, "heal: a heal needs a federation axis of 2 or more ranks, found ",
                   r.ranks);
  FEDSHARD_EXPECTS(r.donor >= 0 && r.donor < r.ranks && r.me >= 0 && r.me < r.ranks,
                   "heal: the donor and this rank must be ranks of the federation axis, in [0, ",
                   r.ranks, "), found donor ", r.donor, " and rank ", r.me);
  FEDSHARD_EXPECTS(r.donors.empty() || r.donors.front() == r.donor, "heal: the donors ",
                   "must start with the donor ", r.donor, ", found ", r.donors.front());
  for (const int d : r.donors) {
    FEDSHARD_EXPECTS(d >= 0 && d < r.ranks, "heal: donor ", d,
                     " must be a rank of the federation axis in [0, ", r.ranks, ")");
    FEDSHARD_EXPECTS(std::count(r.donors.begin(), r.donors.end(), d) == 1, "heal: donor ", d,
                     " is named more than once");
  }
  for (const int j : r.joiners) {
    const auto donors = r.all_donors();
    FEDSHARD_EXPECTS(
        j >= 0 && j < r.ranks && std::find(donors.begin(), donors.end(), j) == donors.end(),
        "heal: joiner ", j, " must be a rank of the federation axis in [0, ", r.ranks,
        ") other than the donor", donors.size() > 1 ? "s " : " ", r.donors_text());
    FEDSHARD_EXPECTS(std::count(r.joiners.begin(), r.joiners.end(), j) == 1, "heal: joiner ", j,
                     " is named more than once");
  }
}

namespace detail {
/// The op moving `bytes` of role `what` between donor d and joiner j, as r.me runs it: a
/// send on d, a recv on j.
inline comm_op heal_op(const heal_round& r, int d, int j, role what, std::int64_t bytes) {
  check(r);
  FEDSHARD_EXPECTS(std::find(r.joiners.begin(), r.joiners.end(), j) != r.joiners.end(), "heal: ", j,
                   " is not a joiner of the round");
  const auto donors = r.all_donors();
  FEDSHARD_EXPECTS(std::find(donors.begin(), donors.end(), d) != donors.end(), "heal: ", d,
                   " is not a donor of the round");
  FEDSHARD_EXPECTS(r.me == d || r.me == j, "heal: rank ", r.me,
                   " takes no part in the transfer from donor ", d, " to joiner ", j);
  const bool sends = r.me == d;
  comm_op op{.kind = sends ? comm_kind::send : comm_kind::recv,
             .axis = axis::federation,
             .dtype = dtype::f64,
             .bytes = bytes,
             .ranks = r.ranks,
             .peer = sends ? j : d,
             .trigger = trigger::on_demand,
             .phase = phase::sync,
             .overlappable = false};
  (sends ? op.in : op.out).role = what;
  return op;
}
}  // namespace detail

/// The op that announces the state's size (heal_size_bytes) to joiner j: donor d's send (d:
/// r.donor when -1), or j's recv.
inline comm_op heal_size_op(const heal_round& r, int j, int d = -1) {
  return detail::heal_op(r, d < 0 ? r.donor : d, j, role::state_size, heal_size_bytes);
}

/// The op that moves a state of `state_bytes` to joiner j (padded_state_bytes of it): donor
/// d's send (d: r.donor when -1), or j's recv.
inline comm_op heal_state_op(const heal_round& r, int j, std::int64_t state_bytes, int d = -1) {
  FEDSHARD_EXPECTS(state_bytes >= 1, "heal: a state of ", state_bytes,
                   " bytes, expected at least 1");
  return detail::heal_op(r, d < 0 ? r.donor : d, j, role::state, padded_state_bytes(state_bytes));
}

/// This rank's heal plan for a state of `state_bytes` (see the file comment): a donor's sends
/// to every joiner, or a joiner's receives from r.donor.
inline plan heal_plan(const heal_round& r, std::int64_t state_bytes) {
  check(r);
  plan p;
  const int d = r.donating() ? r.me : r.donor;
  for (const int j : r.joiners)
    if (r.me == d || r.me == j) {
      p.ops.push_back(heal_size_op(r, j, d));
      p.ops.push_back(heal_state_op(r, j, state_bytes, d));
    }
  return p;
}

/// A donor's side: sends `state` to every joiner of r through the interpreter (heal_plan,
/// op by op; the first that fails throws, and the rest never run).
template <Communicator C, space::MemorySpace S>
void send_heal(interpreter<C, S>& in, const heal_round& r, std::string state) {
  static_assert(S::host_accessible,
                "fedshard::federation::send_heal: the state travels from "
                "host memory; the interpreter's space must be host-accessible");
  FEDSHARD_EXPECTS(r.donating(), "heal: send_heal runs on a donor (", r.donor,
                   " or one of the donors), this is rank ", r.me);
  const auto size = static_cast<std::int64_t>(state.size());
  const plan p = heal_plan(r, size);
  double announced = static_cast<double>(size);
  state.resize(static_cast<std::size_t>(padded_state_bytes(size)), '\0');
  const auto words = state.size() / 8;
  auto bind = [&](const comm_op&, const operand& o) -> buffer_view {
    if (o.role == role::state_size) return {&announced, 1, dtype::f64};
    return {state.data(), words, dtype::f64};
  };
  for (const comm_op& op : p.ops) in.run(op, bind);
}

namespace detail {
/// A joiner's receive of donor d's size op: the announced size, checked to be a whole number
/// of bytes in [1, max_state_bytes] before anything is allocated.
template <Communicator C, space::MemorySpace S>
std::int64_t receive_size(interpreter<C, S>& in, const heal_round& r, int d,
                          std::int64_t max_state_bytes) {
  double announced = 0;
  in.run(heal_size_op(r, r.me, d), [&](const comm_op&, const operand&) -> buffer_view {
    return {&announced, 1, dtype::f64};
  });
  FEDSHARD_EXPECTS(std::isfinite(announced) && announced >= 1 &&
                       announced <= static_cast<double>(max_state_bytes) &&
                       announced == std::floor(announced),
                   "heal: donor ", d, " announced a state of ", announced,
                   " bytes, expected a whole number of bytes in [1, ", max_state_bytes, "]");
  return static_cast<std::int64_t>(announced);
}

/// Sizes `buffer` for a state of `size` bytes received whole (padded to words).
inline std::string sized(std::string buffer, std::int64_t size) {
  buffer.resize(static_cast<std::size_t>(padded_state_bytes(size)));
  return buffer;
}
}  // namespace detail

/// A joiner's side: receives the donor's state through the interpreter (its size, checked to
/// be a whole number of bytes in [1, max_state_bytes] before anything is allocated, then the
/// state) and returns it. The state lands in `buffer`'s memory when its capacity holds it
/// (a joiner passes its own serialized state, the same layout: memory it has already
/// touched, so no page of a fresh gigabyte is faulted in during the heal); whatever buffer
/// held is overwritten.
template <Communicator C, space::MemorySpace S>
std::string receive_heal(interpreter<C, S>& in, const heal_round& r, std::int64_t max_state_bytes,
                         std::string buffer = {}) {
  static_assert(S::host_accessible,
                "fedshard::federation::receive_heal: the state arrives in "
                "host memory; the interpreter's space must be host-accessible");
  FEDSHARD_EXPECTS(r.joining(), "heal: receive_heal runs on a joiner, rank ", r.me,
                   " is not one of the round's joiners");
  const std::int64_t size = detail::receive_size(in, r, r.donor, max_state_bytes);
  std::string state = detail::sized(std::move(buffer), size);  // every byte received
  in.run(heal_state_op(r, r.me, size), [&](const comm_op&, const operand&) -> buffer_view {
    return {state.data(), state.size() / 8, dtype::f64};
  });
  state.resize(static_cast<std::size_t>(size));
  return state;
}

/// A joiner's side of a heal from several donors: every donor's size op in donor order
/// (donor k's checked against bounds[k]), then the blob receives of all donors posted at once
/// and waited for (the first error is thrown once every receive ended). Returns the blobs in
/// donor order, each in the memory of buffers[k] where its capacity holds it.
template <Communicator C, space::MemorySpace S>
std::vector<std::string> receive_from_donors(interpreter<C, S>& in, const heal_round& r,
                                             const std::vector<std::int64_t>& bounds,
                                             std::vector<std::string> buffers) {
  static_assert(S::host_accessible,
                "fedshard::federation::receive_from_donors: the state arrives in "
                "host memory; the interpreter's space must be host-accessible");
  FEDSHARD_EXPECTS(r.joining(), "heal: receive_from_donors runs on a joiner, rank ", r.me,
                   " is not one of the round's joiners");
  const auto donors = r.all_donors();
  FEDSHARD_EXPECTS(bounds.size() == donors.size() && buffers.size() == donors.size(),
                   "heal: one bound and one buffer per donor (", donors.size(), "), found ",
                   bounds.size(), " and ", buffers.size());
  std::vector<std::int64_t> sizes;
  for (std::size_t k = 0; k < donors.size(); ++k)
    sizes.push_back(detail::receive_size(in, r, donors[k], bounds[k]));
  std::vector<std::string> blobs;
  for (std::size_t k = 0; k < donors.size(); ++k)
    blobs.push_back(detail::sized(std::move(buffers[k]), sizes[k]));
  std::vector<ticket> pending;
  std::exception_ptr failed;
  for (std::size_t k = 0; k < donors.size() && !failed; ++k) {
    try {
      plan p{{heal_state_op(r, r.me, sizes[k], donors[k])}};
      std::string& b = blobs[k];
      pending.push_back(in.fire(p, trigger_point{}, [&b](const comm_op&, const operand&) {
        return buffer_view{b.data(), b.size() / 8, dtype::f64};
      }));
    } catch (...) {
      failed = std::current_exception();
    }
  }
  for (const ticket t : pending) try {
      in.wait(t);
    } catch (...) {
      if (!failed) failed = std::current_exception();
    }
  if (failed) std::rethrow_exception(failed);
  for (std::size_t k = 0; k < donors.size(); ++k)
    blobs[k].resize(static_cast<std::size_t>(sizes[k]));
  return blobs;
}

/// The digest that names shared state `shared` in round r (heal_round::digest).
inline std::uint64_t digest_of(const heal_round& r, const std::string& shared) {
  return r.digest ? r.digest(shared) : checksum64(shared.data(), shared.size());
}

/// Donor k >= 1's blob of a shared state: piece k-1 of n-1 (n donors) and the trailer (the
/// state's size and digest). With one piece, the state's own memory becomes the blob.
inline std::string shared_blob(const heal_round& r, std::string shared, int k, int n) {
  const auto size = static_cast<std::int64_t>(shared.size());
  const auto [begin, end] = shared_piece(size, k - 1, n - 1);
  const std::uint64_t tail[2] = {static_cast<std::uint64_t>(size), digest_of(r, shared)};
  std::string b;
  if (n == 2) {
    b = std::move(shared);
  } else {
    b.reserve(static_cast<std::size_t>(end - begin + heal_piece_header_bytes));
    b.append(shared, static_cast<std::size_t>(begin), static_cast<std::size_t>(end - begin));
  }
  b.append(reinterpret_cast<const char*>(tail), sizeof tail);
  return b;
}

/// The shared state put together from donors 1..n-1's blobs (shared_blob, taken from them),
/// checked: every trailer names the same size and digest, the pieces are the cuts of that
/// size, and the state they make has that digest; else invalid_argument naming the donors.
/// With one piece, its memory becomes the state.
inline std::string join_shared(const heal_round& r, std::vector<std::string>& blobs) {
  const std::vector<int>& donors = r.donors;
  const int n = static_cast<int>(donors.size());
  std::uint64_t tail[2] = {}, first[2] = {};
  for (int k = 1; k < n; ++k) {
    std::string& b = blobs[static_cast<std::size_t>(k)];
    FEDSHARD_EXPECTS(b.size() >= heal_piece_header_bytes, "heal: donor ", donors[k], " sent ",
                     b.size(), " bytes, expected a piece of the shared state and a trailer of ",
                     heal_piece_header_bytes);
    std::memcpy(tail, b.data() + b.size() - sizeof tail, sizeof tail);
    b.resize(b.size() - sizeof tail);
    if (k == 1) std::memcpy(first, tail, sizeof tail);
    FEDSHARD_EXPECTS(tail[0] == first[0] && tail[1] == first[1], "heal: donors ", donors[1],
                     " and ", donors[k], " hold different shared states (", first[0],
                     " bytes, digest ", first[1], " against ", tail[0], " bytes, digest ", tail[1],
                     "): the heal is refused");
    FEDSHARD_EXPECTS(tail[0] <= (std::uint64_t{1} << 48), "heal: donor ", donors[k],
                     " names a shared state of ", tail[0], " bytes, expected at most 2^48");
    const auto [begin, end] = shared_piece(static_cast<std::int64_t>(tail[0]), k - 1, n - 1);
    FEDSHARD_EXPECTS(static_cast<std::int64_t>(b.size()) == end - begin, "heal: donor ", donors[k],
                     " sent a piece of ", b.size(), " bytes, expected ", end - begin, " (piece ",
                     k - 1, " of ", n - 1, " of ", tail[0], " bytes)");
  }
  std::string shared;
  if (n == 2) {
    shared = std::move(blobs[1]);
  } else {
    shared.reserve(static_cast<std::size_t>(first[0]));
    for (int k = 1; k < n; ++k) shared += blobs[static_cast<std::size_t>(k)];
  }
  FEDSHARD_EXPECTS(
      digest_of(r, shared) == first[1], "heal: the pieces of the shared state from donors ",
      donors[1], " to ", donors[static_cast<std::size_t>(n - 1)],
      " do not make the state their trailers name (digest ", first[1], "): the heal is refused");
  return shared;
}

/// What a heal moved for this rank.
struct heal_report {
  std::int64_t state_bytes = 0;  ///< S: the state sent or received (0: neither)
  int sent = 0;                  ///< joiners the state was sent to (the donor's)
  bool received = false;         ///< this rank is a joiner and took the state
  int donors = 0;                ///< donors a joiner took it from
  /// Wall-clock seconds of the heal on this rank: a joiner's from serializing its own state
  /// (the bound) to take() returning, the donor's from serializing to the last send.
  double seconds = 0;
};

/// Runs round r's heal on this rank: the donor sends state() (a std::string of the
/// serialized state) to the joiners; a joiner receives the donor's, bounded by
/// heal_bound(state().size()), into the memory of its own state() string, and calls
/// take(std::string) with it; other ranks do nothing.
/// Every call goes through the interpreter (see the file comment).
template <Communicator C, space::MemorySpace S, class State, class Take>
heal_report heal(interpreter<C, S>& in, const heal_round& r, State&& state, Take&& take) {
  check(r);
  heal_report h;
  if (r.joiners.empty() || (r.me != r.donor && !r.joining())) return h;
  const auto start = std::chrono::steady_clock::now();
  if (r.me == r.donor) {
    std::string s = state();
    if (r.seal) s = r.seal(std::move(s));
    h.state_bytes = static_cast<std::int64_t>(s.size());
    h.sent = static_cast<int>(r.joiners.size());
    send_heal(in, r, std::move(s));
  } else if (r.joining()) {
    std::string own = state();
    const auto own_bytes = static_cast<std::int64_t>(own.size());
    std::string s = receive_heal(in, r, heal_bound(own_bytes) + r.seal_bytes, std::move(own));
    if (r.open) s = r.open(std::move(s));
    h.state_bytes = static_cast<std::int64_t>(s.size());
    h.received = true;
    h.donors = 1;
    take(std::move(s));
  }
  h.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return h;
}

/// Runs round r's heal from several donors (r.donors, two or more; see the file comment) on
/// this rank: own() and shared() return this rank's two blobs (std::string). The first donor
/// sends its own(), donor k >= 1 piece k-1 of n-1 of its shared(), each sealed as r says; a
/// joiner receives them into the memory of its own two blobs, bounded by heal_bound of their
/// sizes, opens and checks them (join_shared) and calls take(heal_parts); other ranks do
/// nothing.
template <Communicator C, space::MemorySpace S, class Own, class Shared, class Take>
heal_report heal_from_donors(interpreter<C, S>& in, const heal_round& r, Own&& own, Shared&& shared,
                             Take&& take) {
  check(r);
  const auto n = static_cast<int>(r.donors.size());
  FEDSHARD_EXPECTS(n >= 2, "heal: heal_from_donors needs two or more donors, found ", n);
  heal_report h;
  if (r.joiners.empty() || (!r.donating() && !r.joining())) return h;
  const auto start = std::chrono::steady_clock::now();
  if (r.donating()) {
    const auto k =
        static_cast<int>(std::find(r.donors.begin(), r.donors.end(), r.me) - r.donors.begin());
    std::string b = k == 0 ? own() : shared_blob(r, shared(), k, n);
    if (r.seal) b = r.seal(std::move(b));
    h.state_bytes = static_cast<std::int64_t>(b.size());
    h.sent = static_cast<int>(r.joiners.size());
    send_heal(in, r, std::move(b));
  } else {
    std::string mine_own = own(), mine_shared = shared();
    std::vector<std::int64_t> bounds{heal_bound(static_cast<std::int64_t>(mine_own.size())) +
                                     r.seal_bytes};
    bounds.resize(static_cast<std::size_t>(n),
                  heal_bound(static_cast<std::int64_t>(mine_shared.size())) +
                      heal_piece_header_bytes + r.seal_bytes);
    std::vector<std::string> buffers(static_cast<std::size_t>(n));
    buffers[0] = std::move(mine_own);
    buffers[1] = std::move(mine_shared);
    auto blobs = receive_from_donors(in, r, bounds, std::move(buffers));
    if (r.open)
      for (auto& b : blobs) b = r.open(std::move(b));
    heal_parts p{.own = std::move(blobs[0]), .shared = join_shared(r, blobs)};
    h.state_bytes = static_cast<std::int64_t>(p.own.size() + p.shared.size());
    h.received = true;
    h.donors = n;
    take(std::move(p));
  }
  h.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return h;
}

/// Where a sync may start after 0-based `step` of a run of `total_steps` and the mesh's
/// federation axis is an elastic link (comm/elastic.hpp): when the schedule starts a sync of
/// any fragment, begins the link's round, draws its participation sample
/// (federation/participation.hpp, the sync's participation_settings()), gives the sync the
/// link's round (its groups, its agreement for screening, where verdicts go), heals its joiners
/// (`heal_fn(heal_round)` runs the heal, returning its heal_report) and makes `sync` combine the
/// round's participants. A heal that throws fedshard::error is reported to the link (heal_failed: a
/// joiner heals in its next round) and the sync goes on. Returns the line to log when this rank
/// took a donor's state, else "".
template <class Sync, class Mesh, class Heal>
std::string begin_elastic_round(Sync& sync, Mesh& m, std::int64_t step, std::int64_t total_steps,
                                Heal&& heal_fn) {
  bool starts = false;
  for (int f = 0; f < sync.fragments(); ++f)
    starts = starts || schedule::starts(sync.schedule().action(f, step, total_steps));
  if (!starts) return {};
  auto& link = m.federation().federation_side();
  const auto& round = link.begin_round(step);
  // The participation stage: the sample of the round's participants (its members that are
  // not joiners), the same on every rank; the sync's ops combine only those (the link keeps
  // them for its direct collectives and its round report).
  std::vector<std::uint8_t> eligible(static_cast<std::size_t>(link.size()), 0);
  for (int g : round.participants) eligible[static_cast<std::size_t>(g)] = 1;
  link.set_participants(
      sampled_mask(link.size(), eligible, sync.participation_settings(), round.round));
  sync.set_round_hooks(
      {.included = [&link] { return link.included(); },
       .agree = [&link](const std::vector<double>& v) { return link.agreed_sum(v); },
       .reject = [&link](int g, const std::string& why,
                         bool unhealthy) { link.reject(g, why, unhealthy); }});
  if (round.joiners.empty()) return {};
  heal_report h;
  try {
    h = heal_fn(heal_round{.ranks = m.axis_size(axis::federation),
                           .donor = round.donor,
                           .donors = round.donors,
                           .joiners = round.joiners,
                           .me = m.axis_rank(axis::federation),
                           .seal = [&link](std::string b) { return link.seal(std::move(b)); },
                           .open = [&link](std::string b) { return link.open(std::move(b)); },
                           .seal_bytes = link.seal_bytes()});
  } catch (const fedshard::error& e) {
    // The donor or a joiner died, or a blob was refused: not fatal (the link's file comment).
    link.heal_failed(e.what());
    return {};
  }
  if (!h.received) return {};
  heal_round took;
  took.donor = round.donor;
  if (h.donors > 1) took.donors = round.donors;
  return fedshard::detail::concat("fedshard: heal: group ", m.coords().group,
                                  " took the state of group", h.donors > 1 ? "s " : " ",
                                  took.donors_text(), " (", h.state_bytes, " bytes) in round ",
                                  round.round, ": heal ", h.seconds, " s");
}

}  // namespace fedshard::federation
