#pragma once
/// The collective calls of the host backends (inproc, mpi and any later one): what one rank
/// passed, its validation, and how n ranks' calls become invalid_argument or
/// collective_mismatch. One wording for every backend.
///
/// A rank summarises its own call (call_summary: the arguments as numbers, its buffers'
/// problems as flags, since only the caller can judge its pointers); the ranks exchange the
/// summaries (shared memory, or pack()ed over a transport) and every rank judges all of them
/// with check_calls, so all ranks throw the same error.

#include <array>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <span>
#include <string>
#include <string_view>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/error.hpp"

namespace fedshard::detail {

/// An environment variable that is "1" (true) or "0" (false), else `fallback`.
inline bool env_flag(const char* name, bool fallback) {
  if (const char* s = std::getenv(name)) {
    if (std::string_view(s) == "1") return true;
    if (std::string_view(s) == "0") return false;
  }
  return fallback;
}

/// True when environment variable `name` is set to `value`.
inline bool env_is(const char* name, std::string_view value) {
  const char* s = std::getenv(name);
  return s != nullptr && std::string_view(s) == value;
}

/// True in builds without NDEBUG: the backends check calls across ranks by default there.
#ifdef NDEBUG
inline constexpr bool checked_build = false;
#else
inline constexpr bool checked_build = true;
#endif

/// The collectives whose calls ranks match.
enum class op_kind : std::uint8_t {
  all_reduce,
  all_gather,
  reduce_scatter,
  broadcast,
  barrier,
  split
};

/// The name of a collective.
inline const char* to_string(op_kind k) {
  switch (k) {
    case op_kind::all_reduce: return "all_reduce";
    case op_kind::all_gather: return "all_gather";
    case op_kind::reduce_scatter: return "reduce_scatter";
    case op_kind::broadcast: return "broadcast";
    case op_kind::barrier: return "barrier";
    case op_kind::split: return "split";
  }
  return "unknown";
}

/// The op_kind of a collective.
constexpr op_kind kind_of(collective k) noexcept {
  switch (k) {
    case collective::all_reduce: return op_kind::all_reduce;
    case collective::all_gather: return op_kind::all_gather;
    case collective::reduce_scatter: return op_kind::reduce_scatter;
    case collective::broadcast: return op_kind::broadcast;
  }
  return op_kind::barrier;
}

/// What a send (is_send) or a receive of n elements of t between this rank `me` and `peer`
/// moves between ranks: the message, or nothing for a message to oneself or a bad argument.
inline moved_bytes p2p_moved(bool is_send, std::int64_t n, dtype t, int me, int peer) {
  if (peer == me || n <= 0 || !is_valid(t)) return {};
  const std::int64_t b = n * static_cast<std::int64_t>(size_of(t));
  return is_send ? moved_bytes{b, 0} : moved_bytes{0, b};
}

/// True for the collectives that take a reduce_op.
inline bool is_reduction(op_kind k) {
  return k == op_kind::all_reduce || k == op_kind::reduce_scatter;
}

/// One rank's arguments to one collective.
struct call_args {
  op_kind kind = op_kind::barrier;
  const void* in = nullptr;
  void* out = nullptr;
  std::int64_t count = 0;
  dtype type = dtype::f32;
  reduce_op op = reduce_op::sum;
  int root = 0;
  int color = 0;
  int key = 0;
};

/// The arguments of a collective without root, color and key (set those afterwards).
inline call_args make_call(op_kind k, const void* in, void* out, std::int64_t n, dtype t,
                           reduce_op op = reduce_op::sum, int root = 0) {
  return {.kind = k,
          .in = in,
          .out = out,
          .count = n,
          .type = t,
          .op = op,
          .root = root,
          .color = 0,
          .key = 0};
}

/// What ranks compare: a call's arguments as numbers, its pointers reduced to flags.
struct call_summary {
  std::int64_t kind = 0;
  std::int64_t count = 0;
  std::int64_t type = 0;
  std::int64_t op = 0;
  std::int64_t root = 0;
  std::int64_t color = 0;
  std::int64_t key = 0;
  std::int64_t flags = 0;  // bit 0: in null, 1: out null, 2: overlap, 3: count too large

  /// The number of 64-bit words of pack().
  static constexpr int words = 8;
  /// The summary as words, for a transport.
  std::array<std::int64_t, words> pack() const {
    return {kind, count, type, op, root, color, key, flags};
  }
  /// The summary from `words` words written by pack().
  static call_summary unpack(const std::int64_t* w) {
    return {w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]};
  }
  op_kind k() const { return static_cast<op_kind>(kind); }
  dtype t() const { return static_cast<dtype>(type); }
  reduce_op o() const { return static_cast<reduce_op>(op); }
};

/// The summary of member me's call on a communicator of n ranks.
inline call_summary summarize(const call_args& a, int me, int n) {
  call_summary s;
  s.kind = static_cast<std::int64_t>(a.kind);
  s.count = a.count;
  s.type = static_cast<std::int64_t>(a.type);
  s.op = static_cast<std::int64_t>(a.op);
  s.root = a.root;
  s.color = a.color;
  s.key = a.key;
  if (a.count <= 0 || !is_valid(a.type)) return s;
  const std::size_t esz = size_of(a.type);
  if (a.count > std::numeric_limits<std::int64_t>::max() / 8 / n) {
    s.flags |= 8;
    return s;
  }
  const auto cnt = static_cast<std::size_t>(a.count);
  const auto un = static_cast<std::size_t>(n);
  const auto um = static_cast<std::size_t>(me);
  const bool reads_in = a.kind == op_kind::all_reduce || a.kind == op_kind::all_gather ||
                        a.kind == op_kind::reduce_scatter;
  if (reads_in && a.in == nullptr) s.flags |= 1;
  if (a.out == nullptr) s.flags |= 2;
  if ((s.flags & 3) != 0) return s;
  const auto* in = static_cast<const char*>(a.in);
  const auto* out = static_cast<const char*>(a.out);
  switch (a.kind) {
    case op_kind::all_reduce:
      if (in != out && overlaps(in, cnt * esz, out, cnt * esz)) s.flags |= 4;
      break;
    case op_kind::all_gather:
      if (in != out + cnt * esz * um && overlaps(in, cnt * esz, out, cnt * esz * un)) s.flags |= 4;
      break;
    case op_kind::reduce_scatter:
      if (out != in + cnt * esz * um && overlaps(in, cnt * esz * un, out, cnt * esz)) s.flags |= 4;
      break;
    default: break;
  }
  return s;
}

/// What is wrong with member me's call on a communicator of n ranks (empty when fine).
inline std::string validate(const call_summary& d, int me, int n) {
  if (d.count < 0) return concat("count must be >= 0, found ", d.count);
  if (!is_valid(d.t())) return concat("dtype must be f32, f64, bf16 or f16, found code ", d.type);
  if (is_reduction(d.k()) && !is_valid(d.o()))
    return concat("reduce_op must be sum, avg, min or max, found code ", d.op);
  if (d.k() == op_kind::broadcast && (d.root < 0 || d.root >= n))
    return concat("root must be in [0, ", n, "), found ", d.root);
  if (d.k() == op_kind::split && d.color < 0)
    return concat("split color must be >= 0, found ", d.color);
  if (d.count == 0) return {};
  if ((d.flags & 8) != 0)
    return concat("count ", d.count, " times ", n, " ranks does not fit a 64-bit byte count");
  if ((d.flags & 1) != 0) return concat("input buffer is null with count ", d.count);
  if ((d.flags & 2) != 0) return concat("output buffer is null with count ", d.count);
  if ((d.flags & 4) != 0) {
    switch (d.k()) {
      case op_kind::all_reduce:
        return "input and output overlap partially (only in == out is allowed)";
      case op_kind::all_gather:
        return concat("input overlaps the output (only in == out + rank * count = out + ", me,
                      " * ", d.count, " is allowed)");
      case op_kind::reduce_scatter:
        return concat("output overlaps the input (only out == in + rank * count = in + ", me, " * ",
                      d.count, " is allowed)");
      default: break;
    }
  }
  return {};
}

/// A call as text, for mismatch messages: "all_reduce(count=8, dtype=f32, op=sum)".
inline std::string describe(const call_summary& d) {
  const auto t = is_valid(d.t()) ? std::string(to_string(d.t())) : concat("code ", d.type);
  switch (d.k()) {
    case op_kind::all_reduce:
    case op_kind::reduce_scatter: {
      const auto o = is_valid(d.o()) ? std::string(to_string(d.o())) : concat("code ", d.op);
      return concat(to_string(d.k()), "(count=", d.count, ", dtype=", t, ", op=", o, ")");
    }
    case op_kind::all_gather:
      return concat(to_string(d.k()), "(count=", d.count, ", dtype=", t, ")");
    case op_kind::broadcast:
      return concat(to_string(d.k()), "(count=", d.count, ", dtype=", t, ", root=", d.root, ")");
    default: return concat(to_string(d.k()), "()");
  }
}

/// True when two ranks' calls match (the arguments their kind uses are equal).
inline bool same_call(const call_summary& a, const call_summary& b) {
  if (a.kind != b.kind) return false;
  switch (a.k()) {
    case op_kind::all_reduce:
    case op_kind::reduce_scatter: return a.count == b.count && a.type == b.type && a.op == b.op;
    case op_kind::all_gather: return a.count == b.count && a.type == b.type;
    case op_kind::broadcast: return a.count == b.count && a.type == b.type && a.root == b.root;
    default: return true;
  }
}

/// The invalid_argument of member `rank`'s call number seq of kind k, wrong for reason `why`.
inline invalid_argument invalid_call(op_kind k, int rank, int n, std::uint64_t seq,
                                     const std::string& why) {
  return invalid_argument(concat("fedshard: invalid arguments to ", to_string(k), " on rank ", rank,
                                 " of ", n, " (call #", seq, "): ", why));
}

/// Throws for the calls d[0..n) of call number seq: invalid_argument for the first rank whose
/// call is invalid, else collective_mismatch naming the ranks that disagree with rank 0.
inline void check_calls(std::span<const call_summary> d, std::uint64_t seq) {
  const int n = static_cast<int>(d.size());
  for (int p = 0; p < n; ++p) {
    const std::string why = validate(d[static_cast<std::size_t>(p)], p, n);
    if (!why.empty()) throw invalid_call(d[static_cast<std::size_t>(p)].k(), p, n, seq, why);
  }
  bool agree = true;
  for (int p = 1; p < n; ++p) agree = agree && same_call(d[0], d[static_cast<std::size_t>(p)]);
  if (agree) return;
  std::string calls;
  std::string differ;
  for (int p = 0; p < n; ++p) {
    calls += concat(p == 0 ? "" : "; ", "rank ", p, ": ", describe(d[static_cast<std::size_t>(p)]));
    if (p > 0 && !same_call(d[0], d[static_cast<std::size_t>(p)]))
      differ += concat(differ.empty() ? "" : ", ", p);
  }
  throw collective_mismatch(concat("fedshard: collective_mismatch at call #", seq,
                                   " on a communicator of ", n, " ranks: ranks ", differ,
                                   " disagree with rank 0 (", calls, ")"));
}

/// The message of a send and its receive that disagree: "send from rank src to rank dst
/// (tag t) carries s_count x s_type but the receive expects r_count x r_type".
inline std::string p2p_mismatch(int src, int dst, int tag, std::int64_t s_count, dtype s_type,
                                std::int64_t r_count, dtype r_type) {
  return concat("fedshard: collective_mismatch: send from rank ", src, " to rank ", dst, " (tag ",
                tag, ") carries ", s_count, " x ", to_string(s_type), " but the receive expects ",
                r_count, " x ", to_string(r_type));
}

/// Throws invalid_argument unless a send (is_send) or receive of n elements of t through buf,
/// with peer `peer` on a communicator of `size` ranks, has valid arguments.
inline void check_p2p_args(bool is_send, const void* buf, std::int64_t n, dtype t, int peer,
                           int size) {
  const char* what = is_send ? "send" : "recv";
  FEDSHARD_EXPECTS(n >= 0, what, ": count must be >= 0, found ", n);
  FEDSHARD_EXPECTS(is_valid(t), what, ": invalid dtype code ", static_cast<int>(t));
  FEDSHARD_EXPECTS(peer >= 0 && peer < size, what, ": peer must be in [0, ", size, "), found ",
                   peer);
  FEDSHARD_EXPECTS(n == 0 || buf != nullptr, what, ": buffer is null with count ", n);
  FEDSHARD_EXPECTS(n <= std::numeric_limits<std::int64_t>::max() / 8, what, ": count ", n,
                   " does not fit a 64-bit byte count");
}

}  // namespace fedshard::detail
