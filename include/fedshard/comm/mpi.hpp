#pragma once
/// The MPI communicator: ranks are the processes of an MPI communicator (any MPI-3 library).
///
/// Reductions (options::reduce):
///  - reduction::rank_order (default): results are bit-identical to inproc's
///    (comm/inproc.hpp) for every dtype and op, on every rank and run. MPI only moves bytes;
///    fedshard reduces each element in rank order, in float (f32, bf16, f16) or double (f64),
///    avg = sum / n, min and max propagating NaN, rounded once to the dtype, with the core
///    inproc uses (comm/detail/reduction.hpp):
///    - all_reduce of at most options::small_all_reduce_bytes (n * count * element size):
///      MPI_Iallgather of the inputs, then every rank reduces every element (one round trip);
///    - larger all_reduce: MPI_Ialltoallv sends chunk p of every input to rank p, which
///      reduces it, then MPI_Iallgatherv spreads the chunks (the bytes of a ring all_reduce);
///    - reduce_scatter: MPI_Ialltoall of the blocks, then every rank reduces its own block.
///  - reduction::mpi: MPI_Iallreduce and MPI_Ireduce_scatter_block with MPI_SUM (f32, f64) or
///    fedshard's user ops (min and max propagating NaN; bf16 and f16 as a 2-byte user datatype,
///    combined in float and rounded at every combine); avg divides MPI's sum by n. MPI's
///    algorithms: within rounding of rank_order (min and max exact but for a zero's sign).
/// all_gather, broadcast, send and recv are MPI_Iallgather, MPI_Ibcast, MPI_Isend and
/// MPI_Irecv on bytes. Messages above options::max_message_bytes are cut into pieces.
///
/// Bytes moved (moved(), counted when a call is issued; detail::moved_by): the counts handed
/// to MPI for the call's data, for the algorithm above: a small all_reduce's all-gather sends
/// its input to, and receives one from, each of n-1 ranks (algorithm_of: gather_all); a
/// larger one's all-to-all and all-gather move a ring's bytes: (S - c) + (n-1) c each way, c
/// this rank's chunk; all_gather and reduce_scatter (n-1) blocks each way; a broadcast S
/// received by every other rank, counted as sent by the root (MPI may forward it through
/// other ranks; the total is the same). reduction::mpi hands the reduction to MPI, whose
/// algorithm is its own: counted as the ring of a large rank_order all_reduce (that is what
/// the algorithm would move, not measured). The checked mode's exchanges and headers are not
/// counted.
///
/// Async operations are MPI nonblocking calls. An operation that needs a second MPI call
/// (rank_order all_reduce's all-gather, checked mode's exchange before the data, a checked
/// receive's ack) is advanced by whichever fedshard call polls next: every wait and test polls
/// all pending operations of the process (MPI_Test, not MPI_Wait), so no rank sits in MPI
/// while a peer waits for it to start the next stage. Each communicator starts the stages of
/// its collectives in call order on each of its three duplicated MPI communicators, as MPI
/// requires; the only blocking MPI calls (in split) follow an exchange that all ranks passed.
///
/// Checked mode (options::checked: on by default without NDEBUG, or FEDSHARD_MPI_CHECKED=1)
/// exchanges (kind, count, dtype, op, root, argument validity) with MPI_Iallgather before each
/// collective, so a mismatch throws collective_mismatch and an invalid argument throws
/// invalid_argument on every rank, with inproc's messages (comm/detail/call.hpp); a send and its
/// receive exchange (count, dtype) and both throw collective_mismatch when they disagree (a checked
/// send returns once the receive is matched). Unchecked, only the rank with an invalid argument
/// throws (its peers wait in the collective until the timeout), and a mismatched collective is
/// undefined behaviour of MPI; a receive still reports a message of another size. split always
/// exchanges.
///
/// Failures: an MPI error throws backend_error with MPI's error string (the duplicated
/// communicators use MPI_ERRORS_RETURN). MPI cannot tell a dead peer from a slow one and
/// cannot cancel a collective, so there is no peer_failure here: a rank that crashes, or
/// whose environment is destroyed by an exception (it calls MPI_Abort), ends the whole job
/// under mpirun; a rank that returns while its peers wait makes them throw timeout_error after
/// options::timeout (FEDSHARD_TIMEOUT_S, else 300 s), which leaves their communicator unusable
/// (later calls throw backend_error; MPI may still write the buffers of the abandoned
/// operation): report it and let the exception end the rank (or call MPI_Abort).
///
/// Threads: fedshard serialises its own MPI calls with a process-wide mutex. One thread
/// driving fedshard needs MPI_THREAD_FUNNELED (environment's default); several need
/// MPI_THREAD_SERIALIZED; MPI_THREAD_MULTIPLE is never required.

#include <mpi.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
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

namespace fedshard::mpi {

namespace detail {
using fedshard::detail::default_timeout;

/// FEDSHARD_MPI_CHECKED=1 or 0 from the environment, else `fallback`.
inline bool checked_from_env(bool fallback) {
  return fedshard::detail::env_flag("FEDSHARD_MPI_CHECKED", fallback);
}

using fedshard::detail::checked_build;
}  // namespace detail

/// Who reduces in all_reduce and reduce_scatter.
enum class reduction {
  /// fedshard, in rank order: bit-identical to inproc on every rank and run (the default).
  rank_order,
  /// MPI's MPI_Iallreduce and MPI_Ireduce_scatter_block (MPI_SUM on f32/f64; fedshard's user
  /// ops for min/max, which propagate NaN, and for bf16/f16, which travel as a 2-byte user
  /// datatype and are added in float and rounded at every combine): MPI's algorithms, results
  /// within rounding of rank_order (exact for min and max but the sign of a zero), avg = the
  /// reduced sum divided by n and rounded once more.
  mpi
};

/// Settings of an MPI communicator; the ranks of one communicator must agree on all but
/// timeout (checked when it is created).
struct options {
  /// How long a rank waits for an operation before throwing timeout_error.
  std::chrono::duration<double> timeout = detail::default_timeout();
  /// Exchange and check every collective's arguments across ranks first.
  bool checked = detail::checked_from_env(detail::checked_build);
  /// Largest MPI message in bytes (1 to 2^30); larger transfers are cut into pieces.
  std::int64_t max_message_bytes = std::int64_t{1} << 30;
  /// all_reduce gathers every input and reduces locally up to this many bytes in all
  /// (ranks * count * element size); above it reduce-scatters then all-gathers.
  std::int64_t small_all_reduce_bytes = 64 * 1024;
  /// Who reduces: fedshard in rank order (bit-identical to inproc) or MPI.
  reduction reduce = reduction::rank_order;
};

/// The thread support fedshard asks MPI for.
enum class thread_level { single, funneled, serialized, multiple };

class communicator;

namespace detail {

using clock = std::chrono::steady_clock;
using fedshard::detail::accum_t;
using fedshard::detail::call_args;
using fedshard::detail::call_summary;
using fedshard::detail::chunk_of;
using fedshard::detail::combine_fn;
using fedshard::detail::concat;
using fedshard::detail::make_call;
using fedshard::detail::op_kind;
using fedshard::detail::overlaps;
using fedshard::detail::reduce_blocks;

inline int to_mpi(thread_level l) {
  switch (l) {
    case thread_level::single: return MPI_THREAD_SINGLE;
    case thread_level::funneled: return MPI_THREAD_FUNNELED;
    case thread_level::serialized: return MPI_THREAD_SERIALIZED;
    case thread_level::multiple: return MPI_THREAD_MULTIPLE;
  }
  return MPI_THREAD_SINGLE;
}

inline thread_level from_mpi(int l) {
  if (l >= MPI_THREAD_MULTIPLE) return thread_level::multiple;
  if (l >= MPI_THREAD_SERIALIZED) return thread_level::serialized;
  if (l >= MPI_THREAD_FUNNELED) return thread_level::funneled;
  return thread_level::single;
}

inline const char* to_string(thread_level l) {
  switch (l) {
    case thread_level::single: return "MPI_THREAD_SINGLE";
    case thread_level::funneled: return "MPI_THREAD_FUNNELED";
    case thread_level::serialized: return "MPI_THREAD_SERIALIZED";
    case thread_level::multiple: return "MPI_THREAD_MULTIPLE";
  }
  return "unknown";
}

/// MPI's description of an error code.
inline std::string error_string(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS)
    return concat("unknown MPI error code ", code);
  return std::string(text, static_cast<std::size_t>(len));
}

/// Throws backend_error naming the MPI call, the rank and MPI's error string unless code is
/// MPI_SUCCESS.
inline void check(int code, const char* call, int rank = -1, int size = 0) {
  if (code == MPI_SUCCESS) return;
  int error_class = code;
  MPI_Error_class(code, &error_class);
  throw backend_error(concat("fedshard: mpi: ", call, " failed",
                             rank >= 0 ? concat(" on rank ", rank, " of ", size) : std::string(),
                             ": ", error_string(code), " (MPI error class ", error_class, ")"));
}

inline bool mpi_running() {
  int init = 0;
  int fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init != 0 && fin == 0;
}

// ------------------------------------------------------------------ MPI's reductions

/// inout[i] = in[i] op inout[i] in accum_t<T>, rounded to T: an MPI user function.
template <class T, reduce_op Op>
void user_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  using A = accum_t<T>;
  const combine_fn<Op> combine;
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = T(combine(static_cast<A>(a[i]), static_cast<A>(b[i])));
}

/// The datatypes and ops of reduction::mpi, created on first use (registry mutex held) and
/// freed by the environment that finalizes MPI.
struct mpi_reducers {
  bool ready = false;
  MPI_Datatype half[2] = {MPI_DATATYPE_NULL, MPI_DATATYPE_NULL};  // bf16, f16
  MPI_Op ops[4][3] = {};                                          // [dtype][sum, min, max]

  void create() {
    if (ready) return;
    for (MPI_Datatype& t : half) {
      check(MPI_Type_contiguous(2, MPI_BYTE, &t), "MPI_Type_contiguous");
      check(MPI_Type_commit(&t), "MPI_Type_commit");
    }
    for (dtype t : all_dtypes)
      visit(t, [&](auto tag) {
        using T = typename decltype(tag)::type;
        MPI_Op* o = ops[static_cast<int>(t)];
        if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
          o[0] = MPI_SUM;
        } else {
          check(MPI_Op_create(&user_reduce<T, reduce_op::sum>, 1, &o[0]), "MPI_Op_create");
        }
        check(MPI_Op_create(&user_reduce<T, reduce_op::min>, 1, &o[1]), "MPI_Op_create");
        check(MPI_Op_create(&user_reduce<T, reduce_op::max>, 1, &o[2]), "MPI_Op_create");
      });
    ready = true;
  }
  void release() noexcept {
    if (!ready) return;
    for (auto& per_type : ops)
      for (MPI_Op& o : per_type)
        if (o != MPI_SUM && o != MPI_OP_NULL) MPI_Op_free(&o);
    for (MPI_Datatype& t : half) MPI_Type_free(&t);
    ready = false;
  }
  MPI_Datatype type(dtype t) const {
    switch (t) {
      case dtype::f32: return MPI_FLOAT;
      case dtype::f64: return MPI_DOUBLE;
      case dtype::bf16: return half[0];
      case dtype::f16: return half[1];
    }
    return MPI_DATATYPE_NULL;
  }
  MPI_Op op(dtype t, reduce_op o) const {
    const int i = o == reduce_op::min ? 1 : o == reduce_op::max ? 2 : 0;
    const auto d = static_cast<std::size_t>(t);
    return d < 4 ? ops[d][i] : MPI_OP_NULL;
  }
};

inline mpi_reducers& reducers() {
  static mpi_reducers r;
  return r;
}

/// Divides count elements of out by n in accum_t<T> and rounds them to T.
inline void divide_by(dtype t, void* out, std::int64_t count, int n) {
  visit(t, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = accum_t<T>;
    T* o = static_cast<T*>(out);
    const A div = static_cast<A>(n);
    for (std::int64_t i = 0; i < count; ++i) o[i] = T(static_cast<A>(o[i]) / div);
  });
}

// ------------------------------------------------------------------ communicator state

struct op_base;
struct coll_op;
struct p2p_op;

/// The MPI side of one fedshard communicator: three duplicates of one group of ranks, so that
/// each stage of an operation is ordered on its own MPI communicator: `main` carries data
/// (collectives and point-to-point), `aux` all_reduce's all-gather and receive acks, `ctl`
/// checked mode's exchanges and send headers.
struct comm_state {
  MPI_Comm main = MPI_COMM_NULL;
  MPI_Comm aux = MPI_COMM_NULL;
  MPI_Comm ctl = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
  int world_rank = 0;
  int tag_ub = 32767;
  options opt;
  std::uint64_t next_seq = 0;
  std::deque<std::shared_ptr<coll_op>> colls;  // pending collectives in call order
  std::deque<std::shared_ptr<p2p_op>> p2ps;    // pending point-to-point operations
  std::map<std::pair<int, int>, std::weak_ptr<p2p_op>> last_recv;  // (peer, tag) -> newest
  std::string broken;  // why the communicator is unusable (after a timeout)
  moved_bytes moved;   // the data handed to MPI so far (moved_by of each call)
};

/// True when a rank_order all_reduce of n elements of esz bytes over `ranks` ranks gathers
/// every input (the small all_reduce) instead of reducing chunks where they belong.
inline bool gathers_all(const options& o, std::int64_t n, std::size_t esz, int ranks) {
  return n * ranks * static_cast<std::int64_t>(esz) <=
         std::min(o.small_all_reduce_bytes, o.max_message_bytes);
}

/// What rank me of n sends and receives in an all_reduce of count elements of esz bytes that
/// reduces chunk p of every piece on rank p, then gathers the chunks (pieces of at most
/// max_message_bytes): per piece of s bytes, (s - c) + (n-1) c each way.
inline moved_bytes chunked_all_reduce(const options& o, std::int64_t count, std::size_t esz, int n,
                                      int me) {
  const auto e = static_cast<std::int64_t>(esz);
  const std::int64_t step = std::max<std::int64_t>(1, o.max_message_bytes / e);
  std::int64_t b = 0;
  for (std::int64_t at = 0; at < count; at += step) {
    const std::int64_t len = std::min(step, count - at);
    const auto [lo, hi] = chunk_of(len, n, esz, me);
    b += (len - (hi - lo)) * e + (n - 1) * (hi - lo) * e;
  }
  return {b, b};
}

/// The bytes rank me of n hands to MPI for the data of collective a (see the file comment).
inline moved_bytes moved_by(const call_args& a, const options& o, int n, int me) {
  if (n <= 1 || a.count <= 0 || !is_valid(a.type)) return {};
  const std::size_t esz = size_of(a.type);
  const std::int64_t s = a.count * static_cast<std::int64_t>(esz);  // or one rank's block
  switch (a.kind) {
    case op_kind::all_reduce:
      if (o.reduce == reduction::rank_order && gathers_all(o, a.count, esz, n))
        return {(n - 1) * s, (n - 1) * s};
      return chunked_all_reduce(o, a.count, esz, n, me);
    case op_kind::all_gather:
    case op_kind::reduce_scatter: return {(n - 1) * s, (n - 1) * s};
    case op_kind::broadcast: return me == a.root ? moved_bytes{(n - 1) * s, 0} : moved_bytes{0, s};
    case op_kind::barrier:
    case op_kind::split: break;
  }
  return {};
}

/// Every live comm_state of the process and the mutex serialising fedshard's MPI calls.
struct registry {
  std::mutex mu;
  std::vector<comm_state*> comms;
};

inline registry& global() {
  static registry r;
  return r;
}

/// An operation in flight: the MPI requests of its current stage and its outcome.
struct op_base {
  op_base() = default;
  op_base(const op_base&) = delete;
  op_base& operator=(const op_base&) = delete;
  virtual ~op_base() { free_types(); }

  /// "all_reduce (call #3)" or "recv from rank 2 (tag 5)", for timeout messages.
  virtual std::string what() const = 0;

  comm_state* cs = nullptr;  // valid while !done (a communicator drains before it goes)
  int rank = 0;
  int size = 1;
  std::chrono::duration<double> timeout{};
  bool done = false;
  std::exception_ptr error;
  std::vector<MPI_Request> reqs;
  std::vector<MPI_Status> statuses;
  std::vector<MPI_Datatype> types;

  void finish(std::exception_ptr e = nullptr) {
    if (e && !error) error = std::move(e);
    done = true;
    reqs.clear();
    free_types();
  }

  void check(int code, const char* call) const { detail::check(code, call, rank, size); }

  /// True once every request of the stage completed; their statuses are in `statuses`.
  /// An MPI error throws (a truncated receive throws collective_mismatch via on_truncate).
  bool test_all() {
    statuses.resize(reqs.size());
    for (std::size_t i = 0; i < reqs.size(); ++i) {
      if (reqs[i] == MPI_REQUEST_NULL) continue;
      int flag = 0;
      const int rc = MPI_Test(&reqs[i], &flag, &statuses[i]);
      if (rc != MPI_SUCCESS) {
        int cls = rc;
        MPI_Error_class(rc, &cls);
        if (cls == MPI_ERR_TRUNCATE) on_truncate();
        check(rc, "MPI_Test");
      }
      if (!flag) return false;
    }
    return true;
  }
  virtual void on_truncate() {}

  /// A committed datatype of `bytes` bytes whose extent is `stride` bytes, freed with the op.
  MPI_Datatype strided_bytes(std::int64_t bytes, std::int64_t stride) {
    MPI_Datatype contig = MPI_DATATYPE_NULL;
    MPI_Datatype resized = MPI_DATATYPE_NULL;
    check(MPI_Type_contiguous(static_cast<int>(bytes), MPI_BYTE, &contig), "MPI_Type_contiguous");
    const int rc = MPI_Type_create_resized(contig, 0, static_cast<MPI_Aint>(stride), &resized);
    MPI_Type_free(&contig);
    check(rc, "MPI_Type_create_resized");
    types.push_back(resized);
    check(MPI_Type_commit(&types.back()), "MPI_Type_commit");
    return types.back();
  }

  void free_types() noexcept {
    if (types.empty()) return;
    if (mpi_running())
      for (auto& t : types) MPI_Type_free(&t);
    types.clear();
  }
};

/// A collective: [exchange of summaries on ctl] -> first data stage on main -> [all_reduce's
/// all-gather on aux]. A stage on an MPI communicator starts only once every earlier
/// collective of the communicator has started all its stages on that MPI communicator.
struct coll_op final : op_base {
  enum class phase : std::uint8_t {
    exchange_pending,
    exchanging,
    first_pending,
    first,
    second_pending,
    second,
    finished
  };

  call_args a;
  std::uint64_t seq = 0;
  phase ph = phase::first_pending;
  std::array<std::int64_t, call_summary::words> mine{};
  std::vector<std::int64_t> all;
  std::vector<unsigned char> tmp;
  // all_reduce: the pieces, and per piece the counts and displacements (bytes) of its stages
  struct piece {
    std::int64_t begin = 0;  // first element of the piece
    std::int64_t len = 0;    // elements in the piece (all_reduce) or per block
    std::size_t tmp_off = 0;
    std::vector<int> scount, sdispl, rcount, rdispl;
  };
  std::vector<piece> pieces;
  bool gather_all = false;  // small all_reduce: all inputs gathered, reduced locally
  bool by_mpi = false;      // reduction::mpi: MPI reduces, in one stage
  static constexpr std::size_t no_stage = static_cast<std::size_t>(-1);
  std::size_t staged_result = no_stage;  // offset in tmp of a result still to copy out
  MPI_Comm split_main = MPI_COMM_NULL;
  MPI_Comm split_aux = MPI_COMM_NULL;
  MPI_Comm split_ctl = MPI_COMM_NULL;

  ~coll_op() override {
    if (mpi_running())
      for (MPI_Comm* c : {&split_main, &split_aux, &split_ctl})
        if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
  }

  std::string what() const override { return concat(to_string(a.kind), " (call #", seq, ")"); }

  /// Whether the op has stages left to start on main, aux and ctl.
  bool pending_on_ctl() const { return ph == phase::exchange_pending; }
  bool pending_on_main() const { return ph <= phase::first_pending; }
  bool pending_on_aux() const {
    return ph <= phase::second_pending && a.kind == op_kind::all_reduce && !gather_all && !by_mpi;
  }

  /// Advances as far as the order allows; may_* say whether a stage may start on each comm.
  void advance(bool may_ctl, bool may_main, bool may_aux) {
    try {
      for (;;) {
        switch (ph) {
          case phase::exchange_pending:
            if (!may_ctl) return;
            start_exchange();
            ph = phase::exchanging;
            break;
          case phase::exchanging: {
            if (!test_all()) return;
            std::vector<call_summary> d;
            for (int p = 0; p < size; ++p)
              d.push_back(call_summary::unpack(all.data() +
                                               static_cast<std::size_t>(p) * call_summary::words));
            fedshard::detail::check_calls(d, seq);
            ph = phase::first_pending;
            break;
          }
          case phase::first_pending:
            if (!may_main) return;
            start_first();
            ph = phase::first;
            break;
          case phase::first:
            if (!test_all()) return;
            finish_first();
            ph = pending_on_aux() ? phase::second_pending : phase::finished;
            break;
          case phase::second_pending:
            if (!may_aux) return;
            start_second();
            ph = phase::second;
            break;
          case phase::second:
            if (!test_all()) return;
            ph = phase::finished;
            break;
          case phase::finished: finish(); return;
        }
      }
    } catch (...) {
      ph = phase::finished;
      finish(std::current_exception());
    }
  }

  void start_exchange() {
    all.assign(static_cast<std::size_t>(size) * call_summary::words, 0);
    reqs.assign(1, MPI_REQUEST_NULL);
    check(MPI_Iallgather(mine.data(), call_summary::words, MPI_INT64_T, all.data(),
                         call_summary::words, MPI_INT64_T, cs->ctl, &reqs[0]),
          "MPI_Iallgather");
  }

  std::size_t esz() const { return size_of(a.type); }
  unsigned char* out_bytes(std::int64_t elems) const {
    return static_cast<unsigned char*>(a.out) + static_cast<std::size_t>(elems) * esz();
  }
  const unsigned char* in_bytes(std::int64_t elems) const {
    return static_cast<const unsigned char*>(a.in) + static_cast<std::size_t>(elems) * esz();
  }
  /// Elements per block piece such that `blocks` blocks of it fit one message.
  std::int64_t piece_elems(int blocks) const {
    const std::int64_t per = cs->opt.max_message_bytes / blocks / static_cast<std::int64_t>(esz());
    return std::max<std::int64_t>(1, per);
  }

  void start_first() {
    reqs.clear();
    const std::int64_t n = a.count;
    if (a.kind == op_kind::barrier) {
      reqs.push_back(MPI_REQUEST_NULL);
      check(MPI_Ibarrier(cs->main, &reqs.back()), "MPI_Ibarrier");
      return;
    }
    if (a.kind == op_kind::split) {
      start_split();
      return;
    }
    if (n == 0) return;
    if (by_mpi) {
      start_mpi_reduction();
      return;
    }
    switch (a.kind) {
      case op_kind::all_reduce: start_all_reduce(); return;
      case op_kind::all_gather: start_all_gather(); return;
      case op_kind::reduce_scatter: start_reduce_scatter(); return;
      case op_kind::broadcast: start_broadcast(); return;
      default: return;
    }
  }

  void start_split() {
    // Every rank passed the exchange, so all are here: the blocking calls cannot wait for a
    // rank that waits for us elsewhere.
    check(MPI_Comm_split(cs->main, a.color, a.key, &split_main), "MPI_Comm_split");
    check(MPI_Comm_dup(split_main, &split_aux), "MPI_Comm_dup");
    check(MPI_Comm_dup(split_main, &split_ctl), "MPI_Comm_dup");
  }

  void start_broadcast() {
    const std::int64_t step = piece_elems(1);
    for (std::int64_t b = 0; b < a.count; b += step) {
      const std::int64_t len = std::min(step, a.count - b);
      reqs.push_back(MPI_REQUEST_NULL);
      check(MPI_Ibcast(out_bytes(b), static_cast<int>(len * static_cast<std::int64_t>(esz())),
                       MPI_BYTE, a.root, cs->main, &reqs.back()),
            "MPI_Ibcast");
    }
  }

  void start_all_gather() {
    const std::int64_t n = a.count;
    const auto e = static_cast<std::int64_t>(esz());
    const bool in_place = static_cast<const unsigned char*>(a.in) == out_bytes(n * rank);
    const std::int64_t step = piece_elems(size);
    for (std::int64_t b = 0; b < n; b += step) {
      const std::int64_t len = std::min(step, n - b);
      const int bytes = static_cast<int>(len * e);
      reqs.push_back(MPI_REQUEST_NULL);
      if (len == n) {
        check(MPI_Iallgather(in_place ? MPI_IN_PLACE : a.in, bytes, MPI_BYTE, a.out, bytes,
                             MPI_BYTE, cs->main, &reqs.back()),
              "MPI_Iallgather");
      } else {
        const MPI_Datatype t = strided_bytes(len * e, n * e);
        check(MPI_Iallgather(in_place ? MPI_IN_PLACE : in_bytes(b), bytes, MPI_BYTE, out_bytes(b),
                             1, t, cs->main, &reqs.back()),
              "MPI_Iallgather");
      }
    }
  }

  void start_reduce_scatter() {
    const std::int64_t n = a.count;
    const auto e = static_cast<std::int64_t>(esz());
    tmp.resize(static_cast<std::size_t>(n * size * e));
    const std::int64_t step = piece_elems(size);
    for (std::int64_t b = 0; b < n; b += step) {
      const std::int64_t len = std::min(step, n - b);
      const int bytes = static_cast<int>(len * e);
      unsigned char* dst = tmp.data() + static_cast<std::size_t>(b * size * e);
      reqs.push_back(MPI_REQUEST_NULL);
      if (len == n) {
        check(MPI_Ialltoall(a.in, bytes, MPI_BYTE, dst, bytes, MPI_BYTE, cs->main, &reqs.back()),
              "MPI_Ialltoall");
      } else {
        const MPI_Datatype t = strided_bytes(len * e, n * e);
        check(MPI_Ialltoall(in_bytes(b), 1, t, dst, bytes, MPI_BYTE, cs->main, &reqs.back()),
              "MPI_Ialltoall");
      }
    }
  }

  void start_all_reduce() {
    const std::int64_t n = a.count;
    const auto e = static_cast<std::int64_t>(esz());
    const std::int64_t total = n * size * e;
    gather_all = gathers_all(cs->opt, n, esz(), size);
    if (gather_all) {
      tmp.resize(static_cast<std::size_t>(total));
      reqs.push_back(MPI_REQUEST_NULL);
      check(MPI_Iallgather(a.in, static_cast<int>(n * e), MPI_BYTE, tmp.data(),
                           static_cast<int>(n * e), MPI_BYTE, cs->main, &reqs.back()),
            "MPI_Iallgather");
      return;
    }
    // Pieces of at most max_message_bytes; in each, rank p reduces chunk p.
    const std::int64_t step = std::max<std::int64_t>(1, cs->opt.max_message_bytes / e);
    std::size_t off = 0;
    for (std::int64_t b = 0; b < n; b += step) {
      piece pc;
      pc.begin = b;
      pc.len = std::min(step, n - b);
      pc.tmp_off = off;
      const auto us = static_cast<std::size_t>(size);
      pc.scount.resize(us);
      pc.sdispl.resize(us);
      pc.rcount.resize(us);
      pc.rdispl.resize(us);
      const auto [my_lo, my_hi] = chunk_of(pc.len, size, esz(), rank);
      for (int p = 0; p < size; ++p) {
        const auto [lo, hi] = chunk_of(pc.len, size, esz(), p);
        pc.scount[static_cast<std::size_t>(p)] = static_cast<int>((hi - lo) * e);
        pc.sdispl[static_cast<std::size_t>(p)] = static_cast<int>(lo * e);
        pc.rcount[static_cast<std::size_t>(p)] = static_cast<int>((my_hi - my_lo) * e);
        pc.rdispl[static_cast<std::size_t>(p)] = static_cast<int>(p * (my_hi - my_lo) * e);
      }
      off += static_cast<std::size_t>(size * (my_hi - my_lo) * e);
      pieces.push_back(std::move(pc));
    }
    tmp.resize(off);
    for (piece& pc : pieces) {
      reqs.push_back(MPI_REQUEST_NULL);
      check(MPI_Ialltoallv(in_bytes(pc.begin), pc.scount.data(), pc.sdispl.data(), MPI_BYTE,
                           tmp.data() + pc.tmp_off, pc.rcount.data(), pc.rdispl.data(), MPI_BYTE,
                           cs->main, &reqs.back()),
            "MPI_Ialltoallv");
    }
  }

  /// reduction::mpi: MPI_Iallreduce or MPI_Ireduce_scatter_block per piece. A reduce_scatter
  /// in pieces packs each piece's blocks contiguously into tmp first (a copy of the input); one
  /// in place reduces into tmp and copies the result out once done.
  void start_mpi_reduction() {
    auto& r = reducers();
    r.create();
    const MPI_Datatype t = r.type(a.type);
    const MPI_Op o = r.op(a.type, a.op);
    const std::int64_t n = a.count;
    const auto e = static_cast<std::int64_t>(esz());
    if (a.kind == op_kind::all_reduce) {
      const std::int64_t step = piece_elems(1);
      for (std::int64_t b = 0; b < n; b += step) {
        reqs.push_back(MPI_REQUEST_NULL);
        check(MPI_Iallreduce(a.in == a.out ? MPI_IN_PLACE : in_bytes(b), out_bytes(b),
                             static_cast<int>(std::min(step, n - b)), t, o, cs->main, &reqs.back()),
              "MPI_Iallreduce");
      }
      return;
    }
    const std::int64_t step = piece_elems(size);
    const bool in_pieces = step < n;
    const auto total = static_cast<std::size_t>(n * size * e);
    const bool aliased = overlaps(a.in, total, a.out, static_cast<std::size_t>(n * e));
    const std::size_t packed = in_pieces ? total : 0;
    tmp.resize(packed + (aliased ? static_cast<std::size_t>(n * e) : 0));
    if (aliased) staged_result = packed;
    unsigned char* result = aliased ? tmp.data() + packed : out_bytes(0);
    for (std::int64_t b = 0; b < n; b += step) {
      const std::int64_t len = std::min(step, n - b);
      const void* src = a.in;
      if (in_pieces) {
        unsigned char* dst = tmp.data() + static_cast<std::size_t>(b * size * e);
        for (int p = 0; p < size; ++p)
          std::memcpy(dst + static_cast<std::size_t>(p * len * e), in_bytes(p * n + b),
                      static_cast<std::size_t>(len * e));
        src = dst;
      }
      reqs.push_back(MPI_REQUEST_NULL);
      check(MPI_Ireduce_scatter_block(src, result + b * e, static_cast<int>(len), t, o, cs->main,
                                      &reqs.back()),
            "MPI_Ireduce_scatter_block");
    }
  }

  /// reduction::mpi, once MPI is done: the staged result copied out, avg divided by n.
  void finish_mpi_reduction() {
    if (staged_result != no_stage)
      std::memcpy(a.out, tmp.data() + staged_result, static_cast<std::size_t>(a.count) * esz());
    tmp = {};
    if (a.op == reduce_op::avg) divide_by(a.type, a.out, a.count, size);
  }

  void finish_first() {
    const auto e = esz();
    if (by_mpi) {
      if (a.count > 0) finish_mpi_reduction();
      return;
    }
    switch (a.kind) {
      case op_kind::reduce_scatter: {
        if (a.count == 0) return;
        const std::int64_t step = piece_elems(size);
        for (std::int64_t b = 0; b < a.count; b += step) {
          const std::int64_t len = std::min(step, a.count - b);
          reduce_blocks(a.type, a.op, tmp.data() + static_cast<std::size_t>(b * size) * e,
                        static_cast<std::size_t>(len) * e, size, out_bytes(b), len);
        }
        tmp = {};
        return;
      }
      case op_kind::all_reduce: {
        if (a.count == 0) return;
        if (gather_all) {
          reduce_blocks(a.type, a.op, tmp.data(), static_cast<std::size_t>(a.count) * e, size,
                        a.out, a.count);
          tmp = {};
          return;
        }
        for (const piece& pc : pieces) {
          const auto [lo, hi] = chunk_of(pc.len, size, e, rank);
          reduce_blocks(a.type, a.op, tmp.data() + pc.tmp_off,
                        static_cast<std::size_t>(hi - lo) * e, size, out_bytes(pc.begin + lo),
                        hi - lo);
        }
        return;
      }
      default: return;
    }
  }

  void start_second() {
    reqs.clear();
    tmp = {};
    for (piece& pc : pieces) {
      // The all-gather moves what the all-to-all received: counts swap roles.
      for (int p = 0; p < size; ++p) {
        pc.rcount[static_cast<std::size_t>(p)] = pc.scount[static_cast<std::size_t>(p)];
        pc.rdispl[static_cast<std::size_t>(p)] = pc.sdispl[static_cast<std::size_t>(p)];
      }
      reqs.push_back(MPI_REQUEST_NULL);
      check(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, out_bytes(pc.begin),
                            pc.rcount.data(), pc.rdispl.data(), MPI_BYTE, cs->aux, &reqs.back()),
            "MPI_Iallgatherv");
    }
  }
};

/// A send or a receive. Checked: the sender also sends a header (count, dtype) on ctl and
/// waits for the receiver's ack (its count, dtype) on aux; the receiver posts its data
/// receives once the header arrived (after the previous receive of the same peer and tag).
struct p2p_op final : op_base {
  bool is_send = false;
  bool checked = false;
  const void* sbuf = nullptr;
  void* rbuf = nullptr;
  std::int64_t count = 0;
  dtype type = dtype::f32;
  int peer = 0;
  int tag = 0;
  enum class phase : std::uint8_t { header, data, finished };
  phase ph = phase::data;
  std::array<std::int64_t, 2> header{};       // what this side sends: count, dtype
  std::array<std::int64_t, 2> peer_header{};  // what the other side sent
  std::shared_ptr<p2p_op> prev;               // checked recv: the previous one of its stream
  bool data_posted = false;
  std::string mismatch;
  std::vector<unsigned char> scratch;
  std::vector<std::int64_t> expected_bytes;  // per data request, for receives
  std::size_t data_first = 0;                // index of the first data request in reqs

  std::string what() const override {
    return is_send ? concat("send to rank ", peer, " (tag ", tag, ")")
                   : concat("recv from rank ", peer, " (tag ", tag, ")");
  }

  /// The message of a send of s_count x s_type and a receive of r_count x r_type between this
  /// rank and its peer.
  std::string mismatch_message(std::int64_t s_count, std::int64_t s_type, std::int64_t r_count,
                               std::int64_t r_type) const {
    return fedshard::detail::p2p_mismatch(is_send ? rank : peer, is_send ? peer : rank, tag,
                                          s_count, static_cast<dtype>(s_type), r_count,
                                          static_cast<dtype>(r_type));
  }

  void on_truncate() override {
    throw collective_mismatch(concat("fedshard: collective_mismatch: recv from rank ", peer,
                                     " (tag ", tag, ") on rank ", rank, " expects ", count, " x ",
                                     to_string(type), " but the message is larger"));
  }

  std::int64_t piece_bytes() const { return cs->opt.max_message_bytes; }

  /// Posts the data pieces: sends of `bytes` bytes from sbuf, or receives into dst.
  void post_data(bool send, const void* src, void* dst, std::int64_t bytes) {
    data_first = reqs.size();
    const std::int64_t step = piece_bytes();
    std::int64_t b = 0;
    do {
      const std::int64_t len = std::min(step, bytes - b);
      reqs.push_back(MPI_REQUEST_NULL);
      if (send) {
        check(MPI_Isend(static_cast<const unsigned char*>(src) + b, static_cast<int>(len), MPI_BYTE,
                        peer, tag, cs->main, &reqs.back()),
              "MPI_Isend");
      } else {
        expected_bytes.push_back(len);
        check(MPI_Irecv(static_cast<unsigned char*>(dst) + b, static_cast<int>(len), MPI_BYTE, peer,
                        tag, cs->main, &reqs.back()),
              "MPI_Irecv");
      }
      b += len;
    } while (b < bytes);
    data_posted = true;
  }

  void start() {
    const std::int64_t bytes = count * static_cast<std::int64_t>(size_of(type));
    header = {count, static_cast<std::int64_t>(type)};
    if (is_send) {
      if (checked) {
        reqs.push_back(MPI_REQUEST_NULL);
        check(MPI_Isend(header.data(), 2, MPI_INT64_T, peer, tag, cs->ctl, &reqs.back()),
              "MPI_Isend");
        reqs.push_back(MPI_REQUEST_NULL);
        check(MPI_Irecv(peer_header.data(), 2, MPI_INT64_T, peer, tag, cs->aux, &reqs.back()),
              "MPI_Irecv");
      }
      post_data(true, sbuf, nullptr, bytes);
      ph = phase::data;
    } else if (checked) {
      reqs.push_back(MPI_REQUEST_NULL);
      check(MPI_Irecv(peer_header.data(), 2, MPI_INT64_T, peer, tag, cs->ctl, &reqs.back()),
            "MPI_Irecv");
      ph = phase::header;
    } else {
      post_data(false, nullptr, rbuf, bytes);
      ph = phase::data;
    }
  }

  /// Advances the operation without blocking; records errors instead of throwing.
  void step() {
    try {
      if (ph == phase::header) {
        if (!test_all()) return;
        if (prev && !prev->data_posted && !prev->done) return;  // keep the stream's order
        prev.reset();
        reqs.clear();
        const std::int64_t s_bytes =
            peer_header[0] * static_cast<std::int64_t>(size_of(static_cast<dtype>(peer_header[1])));
        if (peer_header[0] != count || peer_header[1] != static_cast<std::int64_t>(type)) {
          mismatch = mismatch_message(peer_header[0], peer_header[1], count,
                                      static_cast<std::int64_t>(type));
          scratch.resize(static_cast<std::size_t>(s_bytes));
          post_data(false, nullptr, scratch.data(), s_bytes);
        } else {
          post_data(false, nullptr, rbuf, s_bytes);
        }
        reqs.push_back(MPI_REQUEST_NULL);
        check(MPI_Isend(header.data(), 2, MPI_INT64_T, peer, tag, cs->aux, &reqs.back()),
              "MPI_Isend");
        ph = phase::data;
      }
      if (ph == phase::data) {
        if (!test_all()) return;
        if (!mismatch.empty()) throw collective_mismatch(mismatch);
        if (is_send && checked &&
            (peer_header[0] != count || peer_header[1] != static_cast<std::int64_t>(type)))
          throw collective_mismatch(mismatch_message(count, static_cast<std::int64_t>(type),
                                                     peer_header[0], peer_header[1]));
        if (!is_send) {
          for (std::size_t i = 0; i < expected_bytes.size(); ++i) {
            int got = 0;
            MPI_Get_count(&statuses[data_first + i], MPI_BYTE, &got);
            if (got != expected_bytes[i])
              throw collective_mismatch(
                  concat("fedshard: collective_mismatch: recv from rank ", peer, " (tag ", tag,
                         ") on rank ", rank, " expects ", count, " x ", to_string(type),
                         " but the message is shorter (", got, " bytes where ", expected_bytes[i],
                         " were expected)"));
          }
        }
        ph = phase::finished;
        finish();
      }
    } catch (...) {
      ph = phase::finished;
      prev.reset();
      data_posted = true;
      finish(std::current_exception());
    }
  }
};

/// Steps cs's collectives in call order, each stage starting only after every earlier
/// collective started its stages on the same MPI communicator; drops finished ones.
inline void step_colls(comm_state& cs) {
  bool may_ctl = true, may_main = true, may_aux = true;
  for (auto& op : cs.colls) {
    if (!op->done) op->advance(may_ctl, may_main, may_aux);
    if (!op->done) {
      may_ctl = may_ctl && !op->pending_on_ctl();
      may_main = may_main && !op->pending_on_main();
      may_aux = may_aux && !op->pending_on_aux();
    }
  }
  std::erase_if(cs.colls, [](const auto& op) { return op->done; });
}

inline void step_p2ps(comm_state& cs) {
  for (auto& op : cs.p2ps)
    if (!op->done) op->step();
  std::erase_if(cs.p2ps, [](const auto& op) { return op->done; });
}

/// Advances every pending operation of the process once (the registry's mutex is held).
inline void poll_all() {
  auto& comms = global().comms;
  for (std::size_t i = 0; i < comms.size(); ++i) {
    step_colls(*comms[i]);
    step_p2ps(*comms[i]);
  }
}

/// Polls until op is done; throws timeout_error after its timeout (and marks its
/// communicator unusable). Does not throw the op's own error.
inline void wait_done(op_base& op) {
  auto& g = global();
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(op.timeout);
  for (int spin = 0;; ++spin) {
    {
      std::lock_guard lock(g.mu);
      if (op.done) return;
      poll_all();
      if (op.done) return;
      if ((spin & 63) == 63 && clock::now() >= deadline) {
        const std::string msg = concat(
            "fedshard: timeout_error: ", op.what(), " on a communicator of ", op.size,
            " ranks did not complete within ", op.timeout.count(), " s on rank ", op.rank,
            "; MPI cannot cancel it, so this communicator is unusable from now on (report and "
            "call MPI_Abort)");
        if (op.cs != nullptr && op.cs->broken.empty()) op.cs->broken = msg;
        throw timeout_error(msg);
      }
    }
    if (spin >= 16) std::this_thread::yield();
  }
}

class op_request final : public fedshard::detail::request_state {
 public:
  explicit op_request(std::shared_ptr<op_base> op) : op_(std::move(op)) {}
  void wait() override {
    wait_done(*op_);
    if (op_->error) std::rethrow_exception(op_->error);
  }
  bool test() override {
    std::lock_guard lock(global().mu);
    if (!op_->done) poll_all();
    return op_->done;
  }

 private:
  std::shared_ptr<op_base> op_;
};

/// Waits for every pending operation of cs, errors dropped; after one times out, leaves the
/// rest (MPI cannot cancel them).
inline void drain(comm_state& cs) {
  for (;;) {
    std::shared_ptr<op_base> op;
    {
      std::lock_guard lock(global().mu);
      if (!cs.colls.empty())
        op = cs.colls.back();
      else if (!cs.p2ps.empty())
        op = cs.p2ps.back();
      else
        return;
    }
    try {
      wait_done(*op);
    } catch (...) {
      return;
    }
    std::lock_guard lock(global().mu);
    std::erase(cs.colls, op);
    std::erase(cs.p2ps, op);
  }
}

/// Polls until the MPI request completes (used while building communicators).
inline void wait_request(MPI_Request& r, const char* call, std::chrono::duration<double> timeout,
                         int rank, int size) {
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(timeout);
  for (int spin = 0;; ++spin) {
    {
      std::lock_guard lock(global().mu);
      int flag = 0;
      check(MPI_Test(&r, &flag, MPI_STATUS_IGNORE), call, rank, size);
      if (flag) return;
      poll_all();
    }
    if ((spin & 63) == 63 && clock::now() >= deadline)
      throw timeout_error(concat("fedshard: timeout_error: ", call, " on rank ", rank, " of ", size,
                                 " did not complete within ", timeout.count(), " s"));
    if (spin >= 16) std::this_thread::yield();
  }
}

/// Owns a comm_state: registers it for polling, drains and frees it on destruction.
class state_handle {
 public:
  /// Takes ownership of three duplicates of one group (errors on them return codes).
  state_handle(MPI_Comm main, MPI_Comm aux, MPI_Comm ctl, options opt)
      : s_(std::make_unique<comm_state>()) {
    std::lock_guard lock(global().mu);
    s_->main = main;
    s_->aux = aux;
    s_->ctl = ctl;
    s_->opt = opt;
    for (MPI_Comm c : {main, aux, ctl})
      check(MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check(MPI_Comm_rank(main, &s_->rank), "MPI_Comm_rank");
    check(MPI_Comm_size(main, &s_->size), "MPI_Comm_size");
    check(MPI_Comm_rank(MPI_COMM_WORLD, &s_->world_rank), "MPI_Comm_rank");
    void* ub = nullptr;
    int flag = 0;
    check(MPI_Comm_get_attr(main, MPI_TAG_UB, &ub, &flag), "MPI_Comm_get_attr");
    if (flag && ub != nullptr) s_->tag_ub = *static_cast<int*>(ub);
    global().comms.push_back(s_.get());
  }
  state_handle(const state_handle&) = delete;
  state_handle& operator=(const state_handle&) = delete;
  ~state_handle() {
    if (!s_) return;
    if (mpi_running()) drain(*s_);
    std::lock_guard lock(global().mu);
    std::erase(global().comms, s_.get());
    for (auto& op : s_->colls) op->cs = nullptr;
    for (auto& op : s_->p2ps) op->cs = nullptr;
    if (mpi_running())
      for (MPI_Comm* c : {&s_->main, &s_->aux, &s_->ctl})
        if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
  }
  comm_state& operator*() const noexcept { return *s_; }
  comm_state* operator->() const noexcept { return s_.get(); }

 private:
  std::unique_ptr<comm_state> s_;
};

inline void expect_mpi_running(const char* what) {
  int init = 0;
  int fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init == 0 || fin != 0)
    throw invalid_argument(concat("fedshard: mpi: ", what,
                                  " needs MPI to be initialized and not "
                                  "finalized (create a fedshard::mpi::environment first), found ",
                                  init == 0 ? "MPI not initialized" : "MPI finalized"));
}

}  // namespace detail

/// MPI's lifetime for a program: MPI_Init_thread on construction (unless MPI is already
/// initialized), MPI_Finalize on destruction (only if it initialized MPI), after waiting for
/// fedshard's pending operations. Destroyed while an exception propagates, it prints a line
/// on stderr and calls MPI_Abort(MPI_COMM_WORLD, 1) instead, so that the peers stop too.
class environment {
 public:
  /// Initializes MPI with at least `required` thread support (backend_error if MPI offers less).
  environment(int& argc, char**& argv, thread_level required = thread_level::funneled)
      : environment(&argc, &argv, required) {}
  /// Initializes MPI without the program's arguments.
  explicit environment(thread_level required = thread_level::funneled)
      : environment(nullptr, nullptr, required) {}
  environment(const environment&) = delete;
  environment& operator=(const environment&) = delete;

  ~environment() {
    if (!owns_ || !detail::mpi_running()) return;
    if (abort_on_unwind_ && std::uncaught_exceptions() > uncaught_) {
      int rank = -1;
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      std::fprintf(stderr,
                   "fedshard: mpi::environment on world rank %d is destroyed by an exception; "
                   "calling MPI_Abort so that the other ranks do not wait for it\n",
                   rank);
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);
      return;
    }
    // Finish what is pending (each bounded by its timeout), then finalize.
    std::vector<detail::comm_state*> comms;
    {
      std::lock_guard lock(detail::global().mu);
      comms = detail::global().comms;
    }
    for (auto* c : comms) detail::drain(*c);
    {
      std::lock_guard lock(detail::global().mu);
      detail::reducers().release();
    }
    MPI_Finalize();
  }

  /// The thread support MPI provides.
  thread_level provided() const noexcept { return provided_; }
  /// True when this object initialized MPI (and so finalizes it).
  bool owns_mpi() const noexcept { return owns_; }
  /// Whether destruction by an exception calls MPI_Abort (default true) or MPI_Finalize.
  void abort_on_unwind(bool on) noexcept { abort_on_unwind_ = on; }

 private:
  environment(int* argc, char*** argv, thread_level required)
      : uncaught_(std::uncaught_exceptions()) {
    int init = 0;
    MPI_Initialized(&init);
    int level = MPI_THREAD_SINGLE;
    if (init != 0) {
      MPI_Query_thread(&level);
    } else {
      detail::check(MPI_Init_thread(argc, argv, detail::to_mpi(required), &level),
                    "MPI_Init_thread");
      owns_ = true;
    }
    provided_ = detail::from_mpi(level);
    if (provided_ < required) {
      if (owns_) MPI_Finalize();
      owns_ = false;
      throw backend_error(detail::concat("fedshard: mpi: MPI provides ",
                                         detail::to_string(provided_), ", at least ",
                                         detail::to_string(required), " is required"));
    }
  }

  int uncaught_ = 0;
  bool owns_ = false;
  bool abort_on_unwind_ = true;
  thread_level provided_ = thread_level::single;
};

/// One rank's handle on an MPI communicator; models fedshard::Communicator. Move-only. Owns
/// three duplicates of the MPI communicator it was built from (freed by the destructor, which
/// first waits for the pending operations).
class communicator : public blocking_calls<communicator>, public async_calls<communicator> {
 public:
  /// Collective over comm: duplicates it (MPI_Comm_idup) and checks that every rank passed
  /// the same options (but the timeout); invalid_argument on every rank otherwise.
  explicit communicator(MPI_Comm comm, options opt = {}) {
    detail::expect_mpi_running("communicator");
    FEDSHARD_EXPECTS(comm != MPI_COMM_NULL,
                     "mpi::communicator: the MPI communicator must not "
                     "be MPI_COMM_NULL");
    FEDSHARD_EXPECTS(opt.timeout.count() > 0, "mpi::communicator: timeout must be > 0 s, found ",
                     opt.timeout.count());
    FEDSHARD_EXPECTS(opt.max_message_bytes >= 1 && opt.max_message_bytes <= (1 << 30),
                     "mpi::communicator: max_message_bytes must be in [1, 2^30], found ",
                     opt.max_message_bytes);
    FEDSHARD_EXPECTS(opt.small_all_reduce_bytes >= 0,
                     "mpi::communicator: small_all_reduce_bytes must be >= 0, found ",
                     opt.small_all_reduce_bytes);
    int rank = 0;
    int size = 1;
    std::array<MPI_Comm, 3> dup{MPI_COMM_NULL, MPI_COMM_NULL, MPI_COMM_NULL};
    std::array<MPI_Request, 3> req{MPI_REQUEST_NULL, MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    {
      std::lock_guard lock(detail::global().mu);
      detail::check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
      detail::check(MPI_Comm_size(comm, &size), "MPI_Comm_size");
      for (int i = 0; i < 3; ++i)
        detail::check(MPI_Comm_idup(comm, &dup[static_cast<std::size_t>(i)],
                                    &req[static_cast<std::size_t>(i)]),
                      "MPI_Comm_idup", rank, size);
    }
    for (auto& r : req) detail::wait_request(r, "MPI_Comm_idup", opt.timeout, rank, size);
    h_ = std::make_unique<detail::state_handle>(dup[0], dup[1], dup[2], opt);
    agree_on_options();
  }

  /// A duplicate of MPI_COMM_WORLD.
  static communicator world(options opt = {}) { return communicator(MPI_COMM_WORLD, opt); }

  communicator(communicator&&) noexcept = default;
  communicator& operator=(communicator&&) noexcept = default;
  ~communicator() = default;

  /// This rank's index in the communicator.
  int rank() const noexcept { return (*h_)->rank; }
  /// Number of ranks in the communicator.
  int size() const noexcept { return (*h_)->size; }
  /// This process's rank in MPI_COMM_WORLD.
  int world_rank() const noexcept { return (*h_)->world_rank; }
  /// The options the communicator runs with.
  const options& settings() const noexcept { return (*h_)->opt; }
  /// The bytes handed to MPI for the data of the calls issued so far (see the file comment).
  moved_bytes moved() const noexcept { return (*h_)->moved; }
  /// A small rank_order all_reduce gathers every input; everything else moves a ring's bytes.
  wire_algorithm algorithm_of(collective k, std::int64_t n, dtype t) const {
    const detail::comm_state& cs = **h_;
    const bool small = cs.opt.reduce == reduction::rank_order && is_valid(t) &&
                       detail::gathers_all(cs.opt, n, size_of(t), cs.size);
    return k == collective::all_reduce && cs.size > 1 && small ? wire_algorithm::gather_all
                                                               : wire_algorithm::ring;
  }

  /// Collective: the communicator of the ranks that passed the same color (>= 0), ordered by
  /// key, then by rank (MPI_Comm_split, after an exchange of the arguments in every mode).
  communicator split(int color, int key) {
    auto a = detail::make_call(detail::op_kind::split, nullptr, nullptr, 0, dtype::f32);
    a.color = color;
    a.key = key;
    auto op = post(a, true);
    detail::wait_done(*op);
    if (op->error) std::rethrow_exception(op->error);
    std::array<MPI_Comm, 3> c{op->split_main, op->split_aux, op->split_ctl};
    op->split_main = op->split_aux = op->split_ctl = MPI_COMM_NULL;
    return communicator(c, (*h_)->opt);
  }

 private:
  friend class async_calls<communicator>;

  communicator(std::array<MPI_Comm, 3> c, const options& opt)
      : h_(std::make_unique<detail::state_handle>(c[0], c[1], c[2], opt)) {}

  void expect_usable() const {
    const auto& why = (*h_)->broken;
    if (!why.empty())
      throw backend_error(detail::concat("fedshard: mpi: the communicator is unusable: ", why));
  }

  std::shared_ptr<detail::coll_op> post(const detail::call_args& a, bool always_checked) {
    auto& g = detail::global();
    std::lock_guard lock(g.mu);
    detail::comm_state& cs = **h_;
    expect_usable();
    auto op = std::make_shared<detail::coll_op>();
    op->cs = &cs;
    op->rank = cs.rank;
    op->size = cs.size;
    op->timeout = cs.opt.timeout;
    op->a = a;
    op->seq = cs.next_seq++;
    op->by_mpi = cs.opt.reduce == reduction::mpi && fedshard::detail::is_reduction(a.kind);
    const detail::call_summary s = fedshard::detail::summarize(a, cs.rank, cs.size);
    if (cs.opt.checked || always_checked) {
      op->mine = s.pack();
      op->ph = detail::coll_op::phase::exchange_pending;
    } else {
      const std::string why = fedshard::detail::validate(s, cs.rank, cs.size);
      if (!why.empty())
        throw fedshard::detail::invalid_call(a.kind, cs.rank, cs.size, op->seq, why);
      op->ph = detail::coll_op::phase::first_pending;
    }
    cs.moved += detail::moved_by(a, cs.opt, cs.size, cs.rank);
    cs.colls.push_back(op);
    detail::step_colls(cs);
    return op;
  }

  request collective(const detail::call_args& a) {
    return request(std::make_unique<detail::op_request>(post(a, false)));
  }

  request p2p(bool is_send, const void* sbuf, void* rbuf, std::int64_t n, dtype t, int peer,
              int tag) {
    detail::comm_state& cs = **h_;
    const char* what = is_send ? "send" : "recv";
    fedshard::detail::check_p2p_args(is_send, is_send ? sbuf : rbuf, n, t, peer, cs.size);
    FEDSHARD_EXPECTS(tag >= 0 && tag <= cs.tag_ub, what, ": tag must be in [0, ", cs.tag_ub,
                     "] (MPI_TAG_UB), found ", tag);
    auto& g = detail::global();
    std::lock_guard lock(g.mu);
    expect_usable();
    auto op = std::make_shared<detail::p2p_op>();
    op->cs = &cs;
    op->rank = cs.rank;
    op->size = cs.size;
    op->timeout = cs.opt.timeout;
    op->is_send = is_send;
    op->checked = cs.opt.checked;
    op->sbuf = sbuf;
    op->rbuf = rbuf;
    op->count = n;
    op->type = t;
    op->peer = peer;
    op->tag = tag;
    cs.moved += fedshard::detail::p2p_moved(is_send, n, t, cs.rank, peer);
    if (!is_send && op->checked) {
      auto& last = cs.last_recv[{peer, tag}];
      op->prev = last.lock();
      last = op;
    }
    try {
      op->start();
    } catch (...) {
      op->finish(std::current_exception());
    }
    cs.p2ps.push_back(op);
    detail::step_p2ps(cs);
    std::erase_if(cs.last_recv, [](const auto& kv) { return kv.second.expired(); });
    return request(std::make_unique<detail::op_request>(std::move(op)));
  }

  /// Every rank must have passed the same options (but the timeout).
  void agree_on_options() {
    detail::comm_state& cs = **h_;
    constexpr int k = 4;
    const std::array<std::int64_t, k> mine{cs.opt.checked ? 1 : 0, cs.opt.max_message_bytes,
                                           cs.opt.small_all_reduce_bytes,
                                           static_cast<std::int64_t>(cs.opt.reduce)};
    std::vector<std::int64_t> all(k * static_cast<std::size_t>(cs.size));
    MPI_Request r = MPI_REQUEST_NULL;
    {
      std::lock_guard lock(detail::global().mu);
      detail::check(
          MPI_Iallgather(mine.data(), k, MPI_INT64_T, all.data(), k, MPI_INT64_T, cs.ctl, &r),
          "MPI_Iallgather", cs.rank, cs.size);
    }
    detail::wait_request(r, "MPI_Iallgather", cs.opt.timeout, cs.rank, cs.size);
    auto show = [](const std::int64_t* o) {
      return detail::concat("checked=", o[0], ", max_message_bytes=", o[1],
                            ", small_all_reduce_bytes=", o[2],
                            ", reduce=", o[3] == 0 ? "rank_order" : "mpi");
    };
    for (int p = 0; p < cs.size; ++p) {
      const std::int64_t* o = all.data() + k * static_cast<std::size_t>(p);
      if (!std::equal(mine.begin(), mine.end(), o))
        throw invalid_argument(detail::concat(
            "fedshard: mpi::communicator: every rank must pass the same options but the "
            "timeout; rank ",
            cs.rank, " has ", show(mine.data()), " but rank ", p, " has ", show(o)));
    }
  }

  std::unique_ptr<detail::state_handle> h_;
};

static_assert(Communicator<communicator>);

}  // namespace fedshard::mpi
