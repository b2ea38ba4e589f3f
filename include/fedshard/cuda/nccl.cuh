#pragma once
/// The NCCL communicator (component fedshard::nccl): a fedshard::Communicator over an
/// ncclComm_t, for buffers in device memory.
///
/// Every operation is enqueued on the communicator's own CUDA stream, stream(), in call
/// order; the buffers must be ready when that stream reaches the operation (produce them on
/// stream(), or make it wait for an event with fedshard::gpu::wait) and stay untouched
/// until it completes. An async operation returns a fedshard::request backed by a CUDA
/// event recorded right after it: test() queries the event, wait() polls it until it has
/// completed. A blocking operation is the async one followed by wait(), so it returns when
/// the result is in device memory. An operation on 0 elements calls no NCCL function (every
/// rank skips it alike) and completes in stream order.
///
/// Mapping to NCCL: all_reduce, all_gather, reduce_scatter, broadcast, send and recv are
/// ncclAllReduce, ncclAllGather, ncclReduceScatter, ncclBroadcast, ncclSend and ncclRecv;
/// f64, f32, bf16 and f16 travel as ncclFloat64, ncclFloat32, ncclBfloat16 and ncclFloat16
/// (no conversion); reduce_op avg is ncclAvg; split is ncclCommSplit; barrier is an
/// all_reduce of one float. all_reduce_weighted and reduce_scatter_weighted (sum over ranks
/// of weight_r * in_r, each rank passing its own weight) use a reduction operator from
/// ncclRedOpCreatePreMulSum. The reduction order and accumulation type are NCCL's, so
/// results may differ in the last bits from the inproc and MPI communicators; NCCL's min
/// and max need not propagate NaN.
///
/// Differences from the Communicator contract that NCCL imposes: send/recv ignore the tag
/// (messages between two ranks match in call order) and a rank cannot send to itself;
/// a blocking send waits for the matching receive to be posted, as inproc's does. Calls
/// that disagree between ranks are not detected (NCCL exchanges no call descriptors): they
/// end in timeout_error or in wrong results, never in collective_mismatch.
///
/// Failures never hang silently while a request is waited for: besides the event, wait()
/// polls ncclCommGetAsyncError, and gives up after options::timeout (default: the
/// environment variable FEDSHARD_TIMEOUT_S, else 300 s). On any NCCL or CUDA error, and on
/// timeout, the communicator is aborted (ncclCommAbort) and the call throws peer_failure
/// (ncclRemoteError, ncclSystemError: a peer or the network failed), timeout_error, or
/// backend_error (anything else), with ncclGetLastError's text; every later call on it
/// throws peer_failure. Creation (init_rank, init_all) and split block inside NCCL until
/// all ranks arrive and are not covered by the timeout.
///
/// Memory space: `memory_space` is gpu::cuda_space (cuda/cuda_space.cuh) and the
/// communicator is stream-ordered in it (space/space_of.hpp): after(ev) makes stream() wait
/// for a cuda_space event, record() returns one after the operations enqueued so far, and
/// make_space() gives a cuda_space on the communicator's device; so the trainer takes its
/// buffers and its event chains from the communicator.
///
/// A communicator and its requests are driven by one host thread at a time (like inproc's).

#include "fedshard/cuda/config.cuh"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fedshard/comm/blocking.hpp"
#include "fedshard/comm/communicator.hpp"
#include "fedshard/comm/detail/call.hpp"
#include "fedshard/comm/request.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/core/timeout.hpp"
#include "fedshard/cuda/cuda_space.cuh"
#include "fedshard/cuda/error.cuh"
#include "fedshard/cuda/stream.cuh"
#include "fedshard/error.hpp"
#include "fedshard/space/space_of.hpp"

namespace fedshard::nccl {

namespace detail {

using ::fedshard::detail::default_timeout;
using ::fedshard::detail::overlaps;

/// The enumerator name of an NCCL result.
inline const char* result_name(ncclResult_t r) noexcept {
  switch (r) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
    case ncclRemoteError: return "ncclRemoteError";
    case ncclInProgress: return "ncclInProgress";
    default: return "ncclResult(unknown)";
  }
}

/// "ncclX (description): last error text" for an NCCL result.
inline std::string describe(ncclResult_t r) {
  const char* last = ncclGetLastError(nullptr);
  return ::fedshard::detail::concat(result_name(r), " (", ncclGetErrorString(r), ")",
                                    last != nullptr && *last != '\0' ? ": " : "",
                                    last != nullptr ? last : "");
}

/// True for the results that mean a peer or the network failed.
inline bool is_peer_failure(ncclResult_t r) noexcept {
  return r == ncclRemoteError || r == ncclSystemError;
}

/// Throws peer_failure for results that mean a peer failed, else backend_error.
[[noreturn]] inline void throw_for(ncclResult_t r, const std::string& message) {
  if (is_peer_failure(r)) throw peer_failure(message);
  throw backend_error(message);
}

/// Throws for a failed FEDSHARD_NCCL_TRY.
[[noreturn]] inline void nccl_failed(ncclResult_t r, const char* expression, const char* file,
                                     int line) {
  throw_for(r, ::fedshard::detail::concat("fedshard: NCCL error ", describe(r), " from '",
                                          expression, "' at ", file, ":", line));
}

/// What NCCL's ring algorithms move for rank me of n (not measured: the bytes of the ring
/// algorithm as NCCL's documentation states them, its bus bandwidth being busbw = algbw x
/// bus factor): S = count x element size (one rank's block for all_gather and
/// reduce_scatter). all_reduce: a reduce-scatter then an all-gather around the ring, each
/// rank sending all chunks but one in each, 2 (S - c) with S cut evenly by bytes into n
/// chunks c (together 2 (n-1) S); all_gather and reduce_scatter: (n-1) blocks; broadcast: S
/// from the root along the ring, forwarded by every rank but the last before the root.
/// Every figure is sent and received alike but the broadcast's ends.
inline moved_bytes ring_moved(bool reduce_all, bool gather_or_scatter, bool bcast,
                              std::int64_t count, dtype t, int n, int me, int root) {
  if (n <= 1 || count <= 0 || !is_valid(t)) return {};
  const std::int64_t s = count * static_cast<std::int64_t>(size_of(t));
  if (reduce_all) {
    const std::int64_t c = s / n + (me < s % n ? 1 : 0);
    return {2 * (s - c), 2 * (s - c)};
  }
  if (gather_or_scatter) return {(n - 1) * s, (n - 1) * s};
  if (!bcast) return {};
  const bool last = me == (root + n - 1) % n;
  return {last ? 0 : s, me == root ? 0 : s};
}

}  // namespace detail
}  // namespace fedshard::nccl

/// Evaluates an NCCL call; unless it returns ncclSuccess (or ncclInProgress), throws
/// fedshard::peer_failure (ncclRemoteError, ncclSystemError) or fedshard::backend_error with
/// the result's name, ncclGetErrorString, ncclGetLastError, the call and its place.
#define FEDSHARD_NCCL_TRY(...)                                                            \
  do {                                                                                    \
    const ncclResult_t fedshard_nccl_status = (__VA_ARGS__);                              \
    if (fedshard_nccl_status != ncclSuccess && fedshard_nccl_status != ncclInProgress)    \
      ::fedshard::nccl::detail::nccl_failed(fedshard_nccl_status, #__VA_ARGS__, __FILE__, \
                                            __LINE__);                                    \
  } while (0)

namespace fedshard::nccl {

/// Settings of a communicator (inherited by its splits).
struct options {
  /// How long wait() polls an operation before aborting the communicator.
  std::chrono::duration<double> timeout = detail::default_timeout();
};

namespace detail {

/// The NCCL type of a dtype.
inline ncclDataType_t to_nccl(dtype t) noexcept {
  switch (t) {
    case dtype::f64: return ncclFloat64;
    case dtype::bf16: return ncclBfloat16;
    case dtype::f16: return ncclFloat16;
    case dtype::f32: break;
  }
  return ncclFloat32;
}

/// The NCCL operator of a reduce_op.
inline ncclRedOp_t to_nccl(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::avg: return ncclAvg;
    case reduce_op::min: return ncclMin;
    case reduce_op::max: return ncclMax;
    case reduce_op::sum: break;
  }
  return ncclSum;
}

using gpu::detail::quiet_device_guard;

/// What a communicator and its requests share: the NCCL communicator, its stream, a pool
/// of completion events and the abort state.
class comm_state {
 public:
  comm_state(ncclComm_t comm, options opt) : comm_(comm), opt_(opt) {
    try {
      FEDSHARD_NCCL_TRY(ncclCommUserRank(comm_, &rank_));
      FEDSHARD_NCCL_TRY(ncclCommCount(comm_, &size_));
      FEDSHARD_NCCL_TRY(ncclCommCuDevice(comm_, &device_));
      gpu::device_guard guard(device_);
      FEDSHARD_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      space_events_ = std::make_shared<gpu::detail::event_pool>(device_);
    } catch (...) {
      (void)ncclCommAbort(comm_);
      throw;
    }
  }
  comm_state(const comm_state&) = delete;
  comm_state& operator=(const comm_state&) = delete;

  ~comm_state() {
    quiet_device_guard guard(device_);
    if (!aborted_.load()) {
      // Let the work in flight finish; abort instead of destroying if it fails or stalls.
      bool clean = false;
      cudaEvent_t ev = nullptr;
      if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) == cudaSuccess) {
        if (cudaEventRecord(ev, stream_) == cudaSuccess) {
          try {
            wait_event(ev, "destruction", calls_);
            clean = true;
          } catch (...) {  // destructors never throw; wait_event aborted the communicator
          }
        }
        (void)cudaEventDestroy(ev);
      }
      if (!aborted_.load()) {
        if (clean)
          (void)ncclCommDestroy(comm_);
        else
          (void)ncclCommAbort(comm_);
      }
    }
    for (cudaEvent_t e : free_events_) (void)cudaEventDestroy(e);
    if (barrier_scratch_ != nullptr) (void)cudaFree(barrier_scratch_);
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }

  ncclComm_t comm() const noexcept { return comm_; }
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  int device() const noexcept { return device_; }
  cudaStream_t stream() const noexcept { return stream_; }
  const options& settings() const noexcept { return opt_; }
  /// The pool of the events record() returns (cuda_space events of the device).
  const std::shared_ptr<gpu::detail::event_pool>& space_events() const noexcept {
    return space_events_;
  }
  bool aborted() const noexcept { return aborted_.load(); }

  /// The number of the next call (for messages).
  std::uint64_t next_call() noexcept { return calls_++; }

  /// "nccl <what> (call #n) on rank r of n (device d)".
  std::string where(const char* what, std::uint64_t call) const {
    return ::fedshard::detail::concat("nccl ", what, " (call #", call, ") on rank ", rank_, " of ",
                                      size_, " (device ", device_, ")");
  }

  /// Throws peer_failure if the communicator was aborted.
  void check_usable(const char* what, std::uint64_t call) {
    if (!aborted_.load()) return;
    std::lock_guard lock(mu_);
    throw peer_failure(
        ::fedshard::detail::concat("fedshard: peer_failure: ", where(what, call),
                                   ": the communicator was aborted earlier: ", abort_reason_));
  }

  /// Aborts the NCCL communicator (once); later calls throw peer_failure with `reason`.
  void abort(const std::string& reason) noexcept {
    std::lock_guard lock(mu_);
    if (aborted_.load()) return;
    try {
      abort_reason_ = reason;
    } catch (...) {
    }
    aborted_.store(true);
    quiet_device_guard guard(device_);
    (void)ncclCommAbort(comm_);
  }

  /// Aborts, then throws peer_failure / backend_error for an NCCL result r.
  [[noreturn]] void fail(ncclResult_t r, const char* what, std::uint64_t call) {
    const std::string message = ::fedshard::detail::concat(
        "fedshard: ", is_peer_failure(r) ? "peer_failure: " : "", where(what, call),
        " failed: NCCL reported ", describe(r), "; the communicator was aborted (ncclCommAbort)");
    abort(message);
    throw_for(r, message);
  }

  /// Aborts, then throws backend_error for a CUDA error e.
  [[noreturn]] void fail(cudaError_t e, const char* what, std::uint64_t call) {
    const std::string message = ::fedshard::detail::concat(
        "fedshard: ", where(what, call), " failed: CUDA error ", gpu::detail::describe(e),
        "; the communicator was aborted (ncclCommAbort)");
    abort(message);
    throw backend_error(message);
  }

  /// An event for a request (from the pool, or new).
  cudaEvent_t acquire_event() {
    {
      std::lock_guard lock(mu_);
      if (!free_events_.empty()) {
        cudaEvent_t e = free_events_.back();
        free_events_.pop_back();
        return e;
      }
    }
    gpu::device_guard guard(device_);
    cudaEvent_t e = nullptr;
    FEDSHARD_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }

  /// Returns a request's event to the pool.
  void release_event(cudaEvent_t e) noexcept {
    std::lock_guard lock(mu_);
    try {
      free_events_.push_back(e);
    } catch (...) {
      (void)cudaEventDestroy(e);
    }
  }

  /// True once the work before e completed, or once the communicator failed (wait_event
  /// then throws).
  bool event_done(cudaEvent_t e) {
    if (aborted_.load()) return true;
    const cudaError_t status = cudaEventQuery(e);
    if (status != cudaErrorNotReady) return true;
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &async) != ncclSuccess) return true;
    return async != ncclSuccess && async != ncclInProgress;
  }

  /// Polls e until the work before it completed; on a CUDA or NCCL error or past the
  /// timeout, aborts and throws (see the file comment).
  void wait_event(cudaEvent_t e, const char* what, std::uint64_t call) {
    using clock = std::chrono::steady_clock;
    constexpr auto busy = std::chrono::milliseconds(2);
    constexpr auto nap = std::chrono::microseconds(50);
    const auto start = clock::now();
    const auto deadline = start + std::chrono::duration_cast<clock::duration>(opt_.timeout);
    for (;;) {
      check_usable(what, call);
      const cudaError_t status = cudaEventQuery(e);
      if (status == cudaSuccess) return;
      if (status != cudaErrorNotReady) fail(status, what, call);
      ncclResult_t async = ncclSuccess;
      const ncclResult_t query = ncclCommGetAsyncError(comm_, &async);
      if (query != ncclSuccess) async = query;
      if (async != ncclSuccess && async != ncclInProgress) fail(async, what, call);
      const auto now = clock::now();
      if (now >= deadline) {
        const std::string message = ::fedshard::detail::concat(
            "fedshard: timeout_error: ", where(what, call), " did not complete within ",
            opt_.timeout.count(), " s; the communicator was aborted (ncclCommAbort)");
        abort(message);
        throw timeout_error(message);
      }
      if (now - start > busy) std::this_thread::sleep_for(nap);
    }
  }

  /// One float of device memory for barriers.
  float* barrier_scratch() {
    if (barrier_scratch_ == nullptr) {
      gpu::device_guard guard(device_);
      void* p = nullptr;
      FEDSHARD_CUDA_TRY(cudaMalloc(&p, sizeof(float)));
      FEDSHARD_CUDA_TRY(cudaMemset(p, 0, sizeof(float)));
      FEDSHARD_CUDA_TRY(cudaStreamSynchronize(nullptr));  // before the non-blocking stream uses it
      barrier_scratch_ = static_cast<float*>(p);
    }
    return barrier_scratch_;
  }

 private:
  ncclComm_t comm_ = nullptr;
  options opt_;
  int rank_ = 0;
  int size_ = 0;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  std::atomic<bool> aborted_{false};
  std::uint64_t calls_ = 0;
  float* barrier_scratch_ = nullptr;
  std::mutex mu_;  // guards free_events_ and abort_reason_
  std::vector<cudaEvent_t> free_events_;
  std::string abort_reason_;
  std::shared_ptr<gpu::detail::event_pool> space_events_;
};

/// The request of one enqueued operation: an event recorded right after it.
class event_request final : public fedshard::detail::request_state {
 public:
  event_request(std::shared_ptr<comm_state> s, cudaEvent_t e, const char* what, std::uint64_t call)
      : s_(std::move(s)), event_(e), what_(what), call_(call) {}
  event_request(const event_request&) = delete;
  event_request& operator=(const event_request&) = delete;
  ~event_request() override { s_->release_event(event_); }

  void wait() override { s_->wait_event(event_, what_, call_); }
  bool test() override { return s_->event_done(event_); }

 private:
  std::shared_ptr<comm_state> s_;
  cudaEvent_t event_;
  const char* what_;
  std::uint64_t call_;
};

/// What a call checks on its own arguments before anything is enqueued.
struct call_args {
  const char* what;
  const void* in = nullptr;
  void* out = nullptr;
  std::int64_t count = 0;
  dtype type = dtype::f32;
  bool reads_in = false;
  bool writes_out = false;
};

}  // namespace detail

/// One rank's handle on an NCCL communicator; models fedshard::Communicator with device
/// buffers (see the file comment). Move-only.
class communicator : public blocking_calls<communicator> {
 public:
  /// The buffers' space: device memory (space/space_of.hpp); the communicator is
  /// stream-ordered in it (after, record).
  using memory_space = gpu::cuda_space;

  /// Adopts an initialised NCCL communicator (destroyed or aborted with this object) and
  /// creates its stream on the communicator's device.
  explicit communicator(ncclComm_t comm, options opt = {})
      : s_(std::make_shared<detail::comm_state>(comm, opt)) {}

  /// A new unique id, created on one rank and sent to the others before init_rank.
  static ncclUniqueId make_unique_id() {
    ncclUniqueId id;
    FEDSHARD_NCCL_TRY(ncclGetUniqueId(&id));
    return id;
  }

  /// Rank `rank` of a communicator of nranks processes or threads sharing id, on the
  /// current device; blocks until every rank has joined (ncclCommInitRank).
  static communicator init_rank(int nranks, const ncclUniqueId& id, int rank, options opt = {}) {
    FEDSHARD_EXPECTS(nranks >= 1 && rank >= 0 && rank < nranks,
                     "nccl::communicator::init_rank: expected 0 <= rank < nranks, found rank ",
                     rank, " and nranks ", nranks);
    ncclComm_t comm = nullptr;
    FEDSHARD_NCCL_TRY(ncclCommInitRank(&comm, nranks, id, rank));
    return communicator(comm, opt);
  }

  /// One communicator per listed device, all of this process (ncclCommInitAll); rank i is
  /// devices[i]. Blocking operations on them need one host thread per rank.
  static std::vector<communicator> init_all(std::span<const int> devices, options opt = {}) {
    FEDSHARD_EXPECTS(!devices.empty(),
                     "nccl::communicator::init_all: expected at least one device");
    std::vector<ncclComm_t> comms(devices.size(), nullptr);
    FEDSHARD_NCCL_TRY(
        ncclCommInitAll(comms.data(), static_cast<int>(devices.size()), devices.data()));
    std::vector<communicator> out;
    out.reserve(comms.size());
    std::size_t adopted = 0;
    try {
      for (; adopted < comms.size(); ++adopted) out.emplace_back(comms[adopted], opt);
    } catch (...) {
      for (std::size_t i = adopted + 1; i < comms.size(); ++i) (void)ncclCommAbort(comms[i]);
      throw;
    }
    return out;
  }

  communicator(communicator&&) noexcept = default;
  communicator& operator=(communicator&&) noexcept = default;
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;
  ~communicator() = default;

  /// This rank's index in the communicator.
  int rank() const noexcept { return s_->rank(); }
  /// Number of ranks in the communicator.
  int size() const noexcept { return s_->size(); }
  /// The CUDA device of this rank.
  int device() const noexcept { return s_->device(); }
  /// The stream every operation is enqueued on.
  cudaStream_t stream() const noexcept { return s_->stream(); }
  /// The underlying NCCL communicator (still owned by this object).
  ncclComm_t native_handle() const noexcept { return s_->comm(); }
  /// True once the communicator was aborted (by an error, a timeout or abort()).
  bool aborted() const noexcept { return s_->aborted(); }
  /// The settings (timeout).
  const options& settings() const noexcept { return s_->settings(); }
  /// The bytes NCCL's ring algorithms move for the operations enqueued so far (counted when
  /// enqueued: detail::ring_moved; what NCCL's algorithm moves, not measured).
  moved_bytes moved() const noexcept { return moved_; }
  /// NCCL runs rings (or trees of the same bytes); every collective counts a ring's bytes.
  wire_algorithm algorithm_of(collective, std::int64_t, dtype) const noexcept {
    return wire_algorithm::ring;
  }

  /// A cuda_space on this rank's device, for the buffers of this communicator's user.
  std::unique_ptr<gpu::cuda_space> make_space() const {
    return std::make_unique<gpu::cuda_space>(device());
  }
  /// Later operations wait for ev (cudaStreamWaitEvent on stream(); the host does not wait).
  void after(const gpu::cuda_event& ev) {
    gpu::device_guard guard(device());
    ev.wait_on(stream());
  }
  /// An event of cuda_space after the operations enqueued so far.
  gpu::cuda_event record() {
    gpu::device_guard guard(device());
    return gpu::cuda_event::record(s_->space_events(), stream());
  }

  /// Aborts the communicator now (ncclCommAbort): operations in flight on any rank fail,
  /// and every later call on this one throws peer_failure.
  void abort() noexcept { s_->abort("abort() was called on this rank"); }

  /// out = sum over ranks r of weight_r * in_r, each rank passing its own weight (rounded
  /// to the dtype); in == out is in place.
  void all_reduce_weighted(const void* in, void* out, std::int64_t count, dtype t, double weight) {
    all_reduce_weighted_async(in, out, count, t, weight).wait();
  }
  /// out (count elements) = sum over ranks r of weight_r * block rank() of in_r.
  void reduce_scatter_weighted(const void* in, void* out, std::int64_t count, dtype t,
                               double weight) {
    reduce_scatter_weighted_async(in, out, count, t, weight).wait();
  }

  request all_reduce_async(const void* in, void* out, std::int64_t count, dtype t, reduce_op op) {
    check_op("all_reduce", op);
    check({"all_reduce", in, out, count, t, true, true});
    check_in_place_or_disjoint("all_reduce", in, out, count, t);
    moved_ += detail::ring_moved(true, false, false, count, t, size(), rank(), 0);
    return enqueue("all_reduce", count, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(in, out, static_cast<std::size_t>(count), detail::to_nccl(t),
                           detail::to_nccl(op), c, s);
    });
  }

  request all_gather_async(const void* in, void* out, std::int64_t count, dtype t) {
    check({"all_gather", in, out, count, t, true, true});
    const std::size_t bytes = static_cast<std::size_t>(count) * size_of(t);
    if (in != static_cast<const char*>(out) + bytes * static_cast<std::size_t>(rank()) &&
        detail::overlaps(in, bytes, out, bytes * static_cast<std::size_t>(size())))
      invalid("all_gather", ::fedshard::detail::concat(
                                "input overlaps the output (only in == out + rank * count = out + ",
                                rank(), " * ", count, " is allowed)"));
    moved_ += detail::ring_moved(false, true, false, count, t, size(), rank(), 0);
    return enqueue("all_gather", count, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllGather(in, out, static_cast<std::size_t>(count), detail::to_nccl(t), c, s);
    });
  }

  request reduce_scatter_async(const void* in, void* out, std::int64_t count, dtype t,
                               reduce_op op) {
    check_op("reduce_scatter", op);
    check({"reduce_scatter", in, out, count, t, true, true});
    check_scatter_overlap("reduce_scatter", in, out, count, t);
    moved_ += detail::ring_moved(false, true, false, count, t, size(), rank(), 0);
    return enqueue("reduce_scatter", count, [&](ncclComm_t c, cudaStream_t s) {
      return ncclReduceScatter(in, out, static_cast<std::size_t>(count), detail::to_nccl(t),
                               detail::to_nccl(op), c, s);
    });
  }

  request broadcast_async(void* buf, std::int64_t count, dtype t, int root) {
    check({"broadcast", nullptr, buf, count, t, false, true});
    if (root < 0 || root >= size())
      invalid("broadcast",
              ::fedshard::detail::concat("root must be in [0, ", size(), "), found ", root));
    moved_ += detail::ring_moved(false, false, true, count, t, size(), rank(), root);
    return enqueue("broadcast", count, [&](ncclComm_t c, cudaStream_t s) {
      return ncclBroadcast(buf, buf, static_cast<std::size_t>(count), detail::to_nccl(t), root, c,
                           s);
    });
  }

  request send_async(const void* buf, std::int64_t count, dtype t, int peer, int /*tag*/ = 0) {
    check({"send", buf, nullptr, count, t, true, false});
    check_peer("send", peer);
    moved_ += ::fedshard::detail::p2p_moved(true, count, t, rank(), peer);
    return enqueue("send", count, [&](ncclComm_t c, cudaStream_t s) {
      return ncclSend(buf, static_cast<std::size_t>(count), detail::to_nccl(t), peer, c, s);
    });
  }

  request recv_async(void* buf, std::int64_t count, dtype t, int peer, int /*tag*/ = 0) {
    check({"recv", nullptr, buf, count, t, false, true});
    check_peer("recv", peer);
    moved_ += ::fedshard::detail::p2p_moved(false, count, t, rank(), peer);
    return enqueue("recv", count, [&](ncclComm_t c, cudaStream_t s) {
      return ncclRecv(buf, static_cast<std::size_t>(count), detail::to_nccl(t), peer, c, s);
    });
  }

  /// Completes once every rank has entered the barrier and this rank's earlier operations on
  /// stream() have completed.
  request barrier_async() {
    float* scratch = s_->barrier_scratch();
    return enqueue("barrier", 1, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(scratch, scratch, 1, ncclFloat32, ncclSum, c, s);
    });
  }

  request all_reduce_weighted_async(const void* in, void* out, std::int64_t count, dtype t,
                                    double weight) {
    check({"all_reduce_weighted", in, out, count, t, true, true});
    check_in_place_or_disjoint("all_reduce_weighted", in, out, count, t);
    moved_ += detail::ring_moved(true, false, false, count, t, size(), rank(), 0);
    return enqueue_weighted("all_reduce_weighted", count, t, weight,
                            [&](ncclRedOp_t op, ncclComm_t c, cudaStream_t s) {
                              return ncclAllReduce(in, out, static_cast<std::size_t>(count),
                                                   detail::to_nccl(t), op, c, s);
                            });
  }

  request reduce_scatter_weighted_async(const void* in, void* out, std::int64_t count, dtype t,
                                        double weight) {
    check({"reduce_scatter_weighted", in, out, count, t, true, true});
    check_scatter_overlap("reduce_scatter_weighted", in, out, count, t);
    moved_ += detail::ring_moved(false, true, false, count, t, size(), rank(), 0);
    return enqueue_weighted("reduce_scatter_weighted", count, t, weight,
                            [&](ncclRedOp_t op, ncclComm_t c, cudaStream_t s) {
                              return ncclReduceScatter(in, out, static_cast<std::size_t>(count),
                                                       detail::to_nccl(t), op, c, s);
                            });
  }

  /// Collective: the communicator of the ranks that passed the same color (>= 0), ordered by
  /// key, then by rank (ncclCommSplit); it has its own stream and this one's options.
  communicator split(int color, int key) {
    const std::uint64_t call = s_->next_call();
    s_->check_usable("split", call);
    if (color < 0)
      invalid("split", ::fedshard::detail::concat("split color must be >= 0, found ", color));
    gpu::device_guard guard(s_->device());
    ncclComm_t child = nullptr;
    const ncclResult_t r = ncclCommSplit(s_->comm(), color, key, &child, nullptr);
    if (r != ncclSuccess) s_->fail(r, "split", call);
    return communicator(child, s_->settings());
  }

 private:
  [[noreturn]] void invalid(const char* what, const std::string& message) const {
    throw invalid_argument(::fedshard::detail::concat("fedshard: invalid arguments to nccl ", what,
                                                      " on rank ", rank(), " of ", size(), ": ",
                                                      message));
  }

  void check(const detail::call_args& a) const {
    using ::fedshard::detail::concat;
    if (a.count < 0) invalid(a.what, concat("count must be >= 0, found ", a.count));
    if (!is_valid(a.type))
      invalid(a.what,
              concat("dtype must be f32, f64, bf16 or f16, found code ", static_cast<int>(a.type)));
    if (a.count == 0) return;
    if (a.reads_in && a.in == nullptr)
      invalid(a.what, concat("input buffer is null with count ", a.count));
    if (a.writes_out && a.out == nullptr)
      invalid(a.what, concat("output buffer is null with count ", a.count));
  }

  void check_op(const char* what, reduce_op op) const {
    if (!is_valid(op))
      invalid(what,
              ::fedshard::detail::concat("reduce_op must be sum, avg, min or max, found code ",
                                         static_cast<int>(op)));
  }

  void check_in_place_or_disjoint(const char* what, const void* in, const void* out,
                                  std::int64_t count, dtype t) const {
    const std::size_t bytes = static_cast<std::size_t>(count) * size_of(t);
    if (in != out && detail::overlaps(in, bytes, out, bytes))
      invalid(what, "input and output overlap partially (only in == out is allowed)");
  }

  void check_scatter_overlap(const char* what, const void* in, const void* out, std::int64_t count,
                             dtype t) const {
    const std::size_t bytes = static_cast<std::size_t>(count) * size_of(t);
    if (out != static_cast<const char*>(in) + bytes * static_cast<std::size_t>(rank()) &&
        detail::overlaps(in, bytes * static_cast<std::size_t>(size()), out, bytes))
      invalid(what, ::fedshard::detail::concat(
                        "output overlaps the input (only out == in + rank * count = in + ", rank(),
                        " * ", count, " is allowed)"));
  }

  void check_peer(const char* what, int peer) const {
    if (peer < 0 || peer >= size())
      invalid(what, ::fedshard::detail::concat("peer must be in [0, ", size(), "), found ", peer));
    if (peer == rank())
      invalid(what, ::fedshard::detail::concat("peer ", peer,
                                               " is this rank; NCCL point-to-point to oneself "
                                               "needs a grouped send and receive, which this "
                                               "communicator does not offer"));
  }

  /// Enqueues call(comm, stream) unless count is 0 (every rank skips it alike) and records
  /// the request's event after it.
  template <class Call>
  request enqueue(const char* what, std::int64_t count, Call&& call) {
    const std::uint64_t n = s_->next_call();
    s_->check_usable(what, n);
    gpu::device_guard guard(s_->device());
    if (count != 0) {
      const ncclResult_t r = call(s_->comm(), s_->stream());
      if (r != ncclSuccess && r != ncclInProgress) s_->fail(r, what, n);
    }
    return record(what, n);
  }

  /// enqueue with a pre-multiplied sum operator for this rank's weight.
  template <class Call>
  request enqueue_weighted(const char* what, std::int64_t count, dtype t, double weight,
                           Call&& call) {
    const std::uint64_t n = s_->next_call();
    s_->check_usable(what, n);
    if (count == 0) return record(what, n);
    gpu::device_guard guard(s_->device());
    double w64 = weight;
    float w32 = static_cast<float>(weight);
    bf16 w_bf16 = from_accum<bf16>(weight);
    f16 w_f16 = from_accum<f16>(weight);
    void* scalar = t == dtype::f64    ? static_cast<void*>(&w64)
                   : t == dtype::f32  ? static_cast<void*>(&w32)
                   : t == dtype::bf16 ? static_cast<void*>(&w_bf16)
                                      : static_cast<void*>(&w_f16);
    ncclRedOp_t op{};
    ncclResult_t r = ncclRedOpCreatePreMulSum(&op, scalar, detail::to_nccl(t),
                                              ncclScalarHostImmediate, s_->comm());
    if (r != ncclSuccess) s_->fail(r, what, n);
    r = call(op, s_->comm(), s_->stream());
    (void)ncclRedOpDestroy(op, s_->comm());  // allowed once the call returned
    if (r != ncclSuccess && r != ncclInProgress) s_->fail(r, what, n);
    return record(what, n);
  }

  request record(const char* what, std::uint64_t n) {
    cudaEvent_t e = s_->acquire_event();
    const cudaError_t status = cudaEventRecord(e, s_->stream());
    if (status != cudaSuccess) {
      s_->release_event(e);
      s_->fail(status, what, n);
    }
    return request(std::make_unique<detail::event_request>(s_, e, what, n));
  }

  std::shared_ptr<detail::comm_state> s_;
  moved_bytes moved_{};
};

static_assert(Communicator<communicator>);
static_assert(space::StreamOrdered<communicator, gpu::cuda_space>);

}  // namespace fedshard::nccl
