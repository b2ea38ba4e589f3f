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

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/core/buffer.hpp"
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
  int ranks = 0;             ///< ranks on the federation axis (G)
  int donor = -1;            ///< the rank whose state the joiners take
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

  /// True when this rank is one of the joiners.
  bool joining() const { return std::find(joiners.begin(), joiners.end(), me) != joiners.end(); }
};

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
  for (const int j : r.joiners) {
    FEDSHARD_EXPECTS(j >= 0 && j < r.ranks && j != r.donor, "heal: joiner ", j,
                     " must be a rank of the federation axis in [0, ", r.ranks,
                     ") other than the donor ", r.donor);
    FEDSHARD_EXPECTS(std::count(r.joiners.begin(), r.joiners.end(), j) == 1, "heal: joiner ", j,
                     " is named more than once");
  }
}

namespace detail {
/// The op moving `bytes` of role `what` between the donor and joiner j, as r.me runs it: a
/// send on the donor, a recv on j.
inline comm_op heal_op(const heal_round& r, int j, role what, std::int64_t bytes) {
  check(r);
  FEDSHARD_EXPECTS(std::find(r.joiners.begin(), r.joiners.end(), j) != r.joiners.end(), "heal: ", j,
                   " is not a joiner of the round");
  FEDSHARD_EXPECTS(r.me == r.donor || r.me == j, "heal: rank ", r.me,
                   " takes no part in the transfer from donor ", r.donor, " to joiner ", j);
  const bool sends = r.me == r.donor;
  comm_op op{.kind = sends ? comm_kind::send : comm_kind::recv,
             .axis = axis::federation,
             .dtype = dtype::f64,
             .bytes = bytes,
             .ranks = r.ranks,
             .peer = sends ? j : r.donor,
             .trigger = trigger::on_demand,
             .phase = phase::sync,
             .overlappable = false};
  (sends ? op.in : op.out).role = what;
  return op;
}
}  // namespace detail

/// The op that announces the state's size (heal_size_bytes) to joiner j: the donor's send, or
/// j's recv.
inline comm_op heal_size_op(const heal_round& r, int j) {
  return detail::heal_op(r, j, role::state_size, heal_size_bytes);
}

/// The op that moves a state of `state_bytes` to joiner j (padded_state_bytes of it): the
/// donor's send, or j's recv.
inline comm_op heal_state_op(const heal_round& r, int j, std::int64_t state_bytes) {
  FEDSHARD_EXPECTS(state_bytes >= 1, "heal: a state of ", state_bytes,
                   " bytes, expected at least 1");
  return detail::heal_op(r, j, role::state, padded_state_bytes(state_bytes));
}

/// This rank's heal plan for a state of `state_bytes` (see the file comment).
inline plan heal_plan(const heal_round& r, std::int64_t state_bytes) {
  check(r);
  plan p;
  for (const int j : r.joiners)
    if (r.me == r.donor || r.me == j) {
      p.ops.push_back(heal_size_op(r, j));
      p.ops.push_back(heal_state_op(r, j, state_bytes));
    }
  return p;
}

/// The donor's side: sends `state` to every joiner of r through the interpreter (heal_plan,
/// op by op; the first that fails throws, and the rest never run).
template <Communicator C, space::MemorySpace S>
void send_heal(interpreter<C, S>& in, const heal_round& r, std::string state) {
  static_assert(S::host_accessible,
                "fedshard::federation::send_heal: the state travels from "
                "host memory; the interpreter's space must be host-accessible");
  FEDSHARD_EXPECTS(r.me == r.donor, "heal: send_heal runs on the donor ", r.donor,
                   ", this is rank ", r.me);
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
  double announced = 0;
  in.run(heal_size_op(r, r.me), [&](const comm_op&, const operand&) -> buffer_view {
    return {&announced, 1, dtype::f64};
  });
  FEDSHARD_EXPECTS(std::isfinite(announced) && announced >= 1 &&
                       announced <= static_cast<double>(max_state_bytes) &&
                       announced == std::floor(announced),
                   "heal: donor ", r.donor, " announced a state of ", announced,
                   " bytes, expected a whole number of bytes in [1, ", max_state_bytes, "]");
  const auto size = static_cast<std::int64_t>(announced);
  std::string state = std::move(buffer);
  state.resize(static_cast<std::size_t>(padded_state_bytes(size)));  // every byte received
  in.run(heal_state_op(r, r.me, size), [&](const comm_op&, const operand&) -> buffer_view {
    return {state.data(), state.size() / 8, dtype::f64};
  });
  state.resize(static_cast<std::size_t>(size));
  return state;
}

/// What a heal moved for this rank.
struct heal_report {
  std::int64_t state_bytes = 0;  ///< S: the state sent or received (0: neither)
  int sent = 0;                  ///< joiners the state was sent to (the donor's)
  bool received = false;         ///< this rank is a joiner and took the state
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
    take(std::move(s));
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
  return fedshard::detail::concat("fedshard: heal: group ", m.coords().group,
                                  " took the state of group ", round.donor, " (", h.state_bytes,
                                  " bytes) in round ", round.round, ": heal ", h.seconds, " s");
}

}  // namespace fedshard::federation
