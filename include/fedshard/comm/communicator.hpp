#pragma once
/// The Communicator concept and its typed front-ends.
///
/// A Communicator C provides, for a fixed set of ranks 0..size()-1:
///  1. `rank()` and `size()`.
///  2. Blocking collectives on (pointer, count, dtype) buffers; every rank of the
///     communicator must call them in the same order with the same count, dtype, op, root:
///     - `all_reduce(in, out, n, t, op)`: out = op over ranks of in (n elements; in == out
///       is in place);
///     - `all_gather(in, out, n, t)`: out (n * size() elements) = the ranks' in (n each) in
///       rank order; in == out + rank() * n is in place;
///     - `reduce_scatter(in, out, n, t, op)`: in holds n * size() elements, out (n) = op
///       over ranks of block rank() of in; out == in + rank() * n is in place;
///     - `broadcast(buf, n, t, root)`: every rank's buf = root's buf.
///  3. Point-to-point `send(in, n, t, peer, tag)` and `recv(out, n, t, peer, tag)`, matched
///     in order per (sender, receiver, tag).
///  4. `barrier()`.
///  5. `split(color, key)`: collective; returns the communicator of the ranks that passed
///     the same color (color >= 0), ordered by key then by rank.
///  6. Async variants `*_async` with the same arguments returning a fedshard::request.
///  7. Errors: fedshard::invalid_argument for bad arguments, collective_mismatch when ranks
///     disagree, peer_failure when a peer failed, timeout_error instead of a hang.
///  8. `moved()` (const): a moved_bytes, the bytes of data this rank has sent to other ranks
///     and received from them through this communicator object so far, for the algorithm
///     the backend really runs (what it copies between ranks, or the counts it hands to its
///     library). A call is counted when it is issued (an async one too: the algorithm is
///     chosen then), so the difference of moved() around a call is what that call moves (the
///     wire tap, plan/wire_tap.hpp, records it). Barriers, splits, argument checks and
///     control messages move no data and are not counted; a message to oneself neither.
///  9. `algorithm_of(k, n, t)` (const): the wire_algorithm a collective k of count n of
///     dtype t runs with on this communicator (the plan's closed forms and the simulator
///     follow it: plan/traffic.hpp).
/// Counts are std::int64_t so that a negative count is reported, not wrapped.
///
/// Optional capabilities (declared here, detected once in comm_capabilities<C>):
/// 10. `included() const -> std::vector<std::uint8_t>`: a communicator whose ranks come and go
///     (elastic::link, and hybrid on its federation side) says which ranks its current round
///     combines (1) and which it leaves out (0); empty = all. Default: all.
/// 11. `federation_side()`, returning a communicator with rounds (`begin_round(step)`,
///     `end_round()`): a world whose federation axis is an elastic link (comm/hybrid.hpp);
///     the trainer then begins and ends a round around each sync. Default: no rounds.
/// 12. `vouch(std::uint64_t fingerprint, bool first)`: the calls made from now on are those
///     of a plan's firing whose calls on this communicator have fingerprint `fingerprint`
///     (0: none, the calls are no plan's), `first` for the firing's first call. The
///     interpreter vouches for each call it makes and clears it after (plan/interpreter.hpp);
///     a backend that checks calls across ranks may check a firing's first call with its
///     fingerprint, and its other calls no more once every rank sent the same one (gloo's
///     checked mode). Default: every call checked as the backend's settings say.

#include <concepts>
#include <cstdint>
#include <span>
#include <vector>

#include "fedshard/comm/request.hpp"
#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/core/timeout.hpp"
#include "fedshard/error.hpp"

namespace fedshard {

/// Bytes one rank moved: sent to other ranks and received from them.
struct moved_bytes {
  std::int64_t sent = 0;
  std::int64_t received = 0;

  moved_bytes& operator+=(const moved_bytes& o) noexcept {
    sent += o.sent;
    received += o.received;
    return *this;
  }
  friend moved_bytes operator+(moved_bytes a, const moved_bytes& b) noexcept { return a += b; }
  friend moved_bytes operator-(const moved_bytes& a, const moved_bytes& b) noexcept {
    return {a.sent - b.sent, a.received - b.received};
  }
  friend bool operator==(const moved_bytes&, const moved_bytes&) = default;
};

/// The collectives, as algorithm_of names them.
enum class collective : std::uint8_t { all_reduce, all_gather, reduce_scatter, broadcast };

/// How a backend moves a collective's data. With S the whole array (the buffer of all_reduce
/// and broadcast, the gathered buffer of all_gather, the input of reduce_scatter) and n
/// ranks, the bytes all ranks send together (and receive together) are:
enum class wire_algorithm : std::uint8_t {
  /// bandwidth-optimal (a ring, or reduce-scatter then all-gather, or a pipelined broadcast):
  /// 2 (n-1) S for all_reduce, (n-1) S for all_gather, reduce_scatter and broadcast;
  ring,
  /// every rank's whole input to every other rank, combined locally (a small all_reduce, or
  /// a reduction over a world made of levels): n (n-1) S for all_reduce and reduce_scatter
  /// (all_gather and broadcast move what a ring moves).
  gather_all,
};

/// What every communication backend (inproc, mpi, nccl) provides; see the list above.
template <class C>
concept Communicator = std::movable<C> && requires(C& c, const C& cc, const void* in, void* out,
                                                   std::int64_t n, dtype t, reduce_op op, int r) {
  { cc.rank() } -> std::convertible_to<int>;
  { cc.size() } -> std::convertible_to<int>;
  c.all_reduce(in, out, n, t, op);
  c.all_gather(in, out, n, t);
  c.reduce_scatter(in, out, n, t, op);
  c.broadcast(out, n, t, r);
  c.send(in, n, t, r, r);
  c.recv(out, n, t, r, r);
  c.barrier();
  { c.split(r, r) } -> std::same_as<C>;
  { c.all_reduce_async(in, out, n, t, op) } -> std::same_as<request>;
  { c.all_gather_async(in, out, n, t) } -> std::same_as<request>;
  { c.reduce_scatter_async(in, out, n, t, op) } -> std::same_as<request>;
  { c.broadcast_async(out, n, t, r) } -> std::same_as<request>;
  { c.send_async(in, n, t, r, r) } -> std::same_as<request>;
  { c.recv_async(out, n, t, r, r) } -> std::same_as<request>;
  { cc.moved() } -> std::same_as<moved_bytes>;
  { cc.algorithm_of(collective::all_reduce, n, t) } -> std::same_as<wire_algorithm>;
};

/// The optional capabilities 10 to 12 of Communicator C, detected here and nowhere else.
template <class C>
struct comm_capabilities {
  /// 10.
  static constexpr bool included = requires(const C& c) {
    { c.included() } -> std::convertible_to<std::vector<std::uint8_t>>;
  };
  /// 11.
  static constexpr bool elastic_federation = requires(C & c) {
    c.federation_side().begin_round(std::int64_t{});
    c.federation_side().end_round();
  };
  /// 12.
  static constexpr bool vouch = requires(C & c) { c.vouch(std::uint64_t{}, bool{}); };
};

namespace detail {
/// n as a backend's element count (std::int64_t); invalid_argument when it does not fit.
inline std::int64_t checked_count(std::size_t n) {
  constexpr auto max = static_cast<std::size_t>(INT64_MAX);
  FEDSHARD_EXPECTS(n <= max, "communicator: a count of at most ", max,
                   " elements (std::int64_t) was expected, found ", n);
  return static_cast<std::int64_t>(n);
}

/// True when the byte ranges [a, a + an) and [b, b + bn) share a byte.
inline bool overlaps(const void* a, std::size_t an, const void* b, std::size_t bn) {
  const auto pa = reinterpret_cast<std::uintptr_t>(a);
  const auto pb = reinterpret_cast<std::uintptr_t>(b);
  return an > 0 && bn > 0 && pa < pb + bn && pb < pa + an;
}
}  // namespace detail

/// all_reduce of typed spans of equal size (in.data() == out.data() is in place).
template <Communicator C, class T>
void all_reduce(C& c, std::span<const T> in, std::span<T> out, reduce_op op) {
  FEDSHARD_EXPECTS(in.size() == out.size(), "all_reduce: in has ", in.size(),
                   " elements but out has ", out.size());
  c.all_reduce(in.data(), out.data(), detail::checked_count(in.size()), dtype_of<T>, op);
}
/// In-place all_reduce of a typed span.
template <Communicator C, class T>
void all_reduce(C& c, std::span<T> inout, reduce_op op) {
  c.all_reduce(inout.data(), inout.data(), detail::checked_count(inout.size()), dtype_of<T>, op);
}
/// Async in-place all_reduce of a typed span.
template <Communicator C, class T>
request all_reduce_async(C& c, std::span<T> inout, reduce_op op) {
  return c.all_reduce_async(inout.data(), inout.data(), detail::checked_count(inout.size()),
                            dtype_of<T>, op);
}
/// all_gather: out.size() must be in.size() * c.size().
template <Communicator C, class T>
void all_gather(C& c, std::span<const T> in, std::span<T> out) {
  FEDSHARD_EXPECTS(out.size() == in.size() * static_cast<std::size_t>(c.size()),
                   "all_gather: out must hold in.size() * size() = ", in.size(), " * ", c.size(),
                   " elements, found ", out.size());
  c.all_gather(in.data(), out.data(), detail::checked_count(in.size()), dtype_of<T>);
}
/// Async all_gather: out.size() must be in.size() * c.size().
template <Communicator C, class T>
request all_gather_async(C& c, std::span<const T> in, std::span<T> out) {
  FEDSHARD_EXPECTS(out.size() == in.size() * static_cast<std::size_t>(c.size()),
                   "all_gather_async: out must hold in.size() * size() = ", in.size(), " * ",
                   c.size(), " elements, found ", out.size());
  return c.all_gather_async(in.data(), out.data(), detail::checked_count(in.size()), dtype_of<T>);
}
/// reduce_scatter: in.size() must be out.size() * c.size().
template <Communicator C, class T>
void reduce_scatter(C& c, std::span<const T> in, std::span<T> out, reduce_op op) {
  FEDSHARD_EXPECTS(in.size() == out.size() * static_cast<std::size_t>(c.size()),
                   "reduce_scatter: in must hold out.size() * size() = ", out.size(), " * ",
                   c.size(), " elements, found ", in.size());
  c.reduce_scatter(in.data(), out.data(), detail::checked_count(out.size()), dtype_of<T>, op);
}
/// Async reduce_scatter: in.size() must be out.size() * c.size().
template <Communicator C, class T>
request reduce_scatter_async(C& c, std::span<const T> in, std::span<T> out, reduce_op op) {
  FEDSHARD_EXPECTS(in.size() == out.size() * static_cast<std::size_t>(c.size()),
                   "reduce_scatter_async: in must hold out.size() * size() = ", out.size(), " * ",
                   c.size(), " elements, found ", in.size());
  return c.reduce_scatter_async(in.data(), out.data(), detail::checked_count(out.size()),
                                dtype_of<T>, op);
}
/// broadcast of a typed span from root.
template <Communicator C, class T>
void broadcast(C& c, std::span<T> buf, int root) {
  c.broadcast(buf.data(), detail::checked_count(buf.size()), dtype_of<T>, root);
}
/// send of a typed span to peer.
template <Communicator C, class T>
void send(C& c, std::span<const T> buf, int peer, int tag = 0) {
  c.send(buf.data(), detail::checked_count(buf.size()), dtype_of<T>, peer, tag);
}
/// recv of a typed span from peer.
template <Communicator C, class T>
void recv(C& c, std::span<T> buf, int peer, int tag = 0) {
  c.recv(buf.data(), detail::checked_count(buf.size()), dtype_of<T>, peer, tag);
}

}  // namespace fedshard
