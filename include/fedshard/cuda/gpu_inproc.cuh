#pragma once
/// The in-process GPU communicator: N ranks as threads of one process, each with a CUDA
/// stream on a device (several ranks may share a device), buffers in device memory
/// (cuda_space). The GPU counterpart of comm/inproc.hpp, with the same structure: a world
/// made by run(n, body), rank(), size(), split(color, key), the *_async collectives and the
/// blocking ones of blocking_calls, send/recv, barrier.
///
/// Stream order. A rank's calls run on its communicator's stream, stream(), in call order:
/// a call's buffers must be ready when that stream reaches it (queue the producing work on
/// stream(), or call after(ev) with an event of it) and stay untouched until the call's
/// request, or an event record()ed after it, completes. So the communicator is StreamOrdered
/// in cuda_space (space/space_of.hpp), like nccl::communicator.
///
/// How a collective runs. The ranks meet on the host as inproc's do (each publishes its
/// arguments in a slot of the communicator, waits for all, and every rank judges all calls,
/// so bad arguments and mismatched calls throw the same invalid_argument or
/// collective_mismatch on every rank). At arrival each rank records an event on its stream;
/// after the meeting its stream waits for the peers' arrival events (cudaStreamWaitEvent:
/// the host does not wait for the device), queues its share of the work on its stream,
/// records a done event, and, after a second meeting, waits for the peers' done events. The
/// shares are inproc's: all_reduce cuts the elements into one chunk per rank and rank r
/// reduces chunk r of every input, in rank order, into every output; reduce_scatter: block r
/// of every input into rank r's output; all_gather: rank r copies its input into block r of
/// every output; broadcast: rank r copies chunk r of the root's buffer into the others'.
/// The reduction is comm/detail/reduction.hpp's: operands widened by kernels::operand_fn to
/// accum_t (float for f32, bf16, f16; double for f64), combined over ranks 0..n-1 with
/// fedshard::combine, avg divides by n, rounded once to T; so results are bit-identical to
/// inproc's (and mpi's) on the same inputs. Peers' buffers are read and written directly
/// when they are on the same device or peer access is enabled between the devices (run()
/// enables it where cudaDeviceCanAccessPeer allows); otherwise their parts are staged
/// through a scratch buffer of the rank's device with cudaMemcpyAsync.
///
/// Host blocking. Every call (async or not) blocks the calling thread until the peers of its
/// communicator have made the matching call (not until the device work is done): calls on
/// communicators that share ranks must be made in the same order on every rank, the rule
/// NCCL has as well. send_async / recv_async block until the peer posted the matching
/// receive / send (tags match as in inproc); the copy is queued on the stream of the rank
/// that arrived second, and both streams are ordered around it with events.
///
/// Requests complete when the device work of the call has completed (an event recorded
/// after it); blocking calls are the async call followed by wait(). Errors: as inproc's
/// (invalid_argument, collective_mismatch, peer_failure when a peer failed or left,
/// timeout_error after options::timeout instead of a hang), and backend_error for CUDA
/// failures.

#include "fedshard/cuda/config.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "fedshard/comm/async_calls.hpp"
#include "fedshard/comm/blocking.hpp"
#include "fedshard/comm/communicator.hpp"
#include "fedshard/comm/detail/call.hpp"
#include "fedshard/comm/detail/reduction.hpp"
#include "fedshard/comm/inproc.hpp"
#include "fedshard/comm/request.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/core/timeout.hpp"
#include "fedshard/cuda/cuda_space.cuh"
#include "fedshard/cuda/device_buffer.cuh"
#include "fedshard/cuda/error.cuh"
#include "fedshard/cuda/stream.cuh"
#include "fedshard/error.hpp"
#include "fedshard/kernels/cast.hpp"
#include "fedshard/space/space_of.hpp"

namespace fedshard::gpu_inproc {

/// The most ranks of one gpu_inproc communicator (their buffer pointers travel as kernel
/// parameters).
inline constexpr int max_ranks = 64;

/// Settings of a GPU in-process world.
struct options {
  /// How long a rank waits for its peers on the host before throwing timeout_error.
  std::chrono::duration<double> timeout = ::fedshard::detail::default_timeout();
  /// inproc::options::spin_polls: polls of a waiting rank before it sleeps (-1: automatic).
  int spin_polls = -1;
  /// The device of each rank (rank r: devices[r % devices.size()]); empty: the process's
  /// devices round-robin (rank r on device r % device_count()).
  std::vector<int> devices;
};

namespace detail {

using fedshard::detail::call_args;
using fedshard::detail::make_call;
using fedshard::detail::op_kind;

/// Arguments of one rank-order reduction launch: element i of every input, reduced in rank
/// order, stored to every output.
template <class T>
struct reduce_args {
  const T* ins[max_ranks];
  T* outs[max_ranks];
  int n = 0;
  int nout = 0;
  std::uint64_t len = 0;
};

/// The value of an accumulator rounded once to T (reduction.hpp's last step).
template <class T, class A>
__device__ __forceinline__ T round_to(A acc) {
  if constexpr (std::is_same_v<T, A>)
    return acc;
  else
    return T(acc);
}

/// outs[q][i] = op over p = 0..n-1 of ins[p][i] (comm/detail/reduction.hpp's order and
/// widening), for every i < len and q < nout. Elements [0, nvec * V) go as 16-byte vectors
/// of V elements (every pointer is 16-byte aligned then), the rest one by one; the
/// arithmetic per element is the same either way.
template <class T, reduce_op Op>
__global__ void __launch_bounds__(gpu::block_threads)
    rank_order_kernel(const reduce_args<T> a, std::uint64_t nvec) {
  using A = fedshard::detail::accum_t<T>;
  constexpr int V = static_cast<int>(gpu::vector_bytes / sizeof(T));
  const kernels::operand_fn<T, A> widen;
  const std::uint64_t stride = std::uint64_t{gridDim.x} * gpu::block_threads;
  const std::uint64_t first = std::uint64_t{blockIdx.x} * gpu::block_threads + threadIdx.x;
  for (std::uint64_t j = first; j < nvec; j += stride) {
    const std::uint64_t i = j * V;
    auto x = gpu::detail::load_vec<T, V>(a.ins[0] + i);
    A acc[V];
#pragma unroll
    for (int l = 0; l < V; ++l) acc[l] = widen(x.v[l]);
    for (int p = 1; p < a.n; ++p) {
      x = gpu::detail::load_vec<T, V>(a.ins[p] + i);
#pragma unroll
      for (int l = 0; l < V; ++l) acc[l] = combine(Op, acc[l], widen(x.v[l]));
    }
#pragma unroll
    for (int l = 0; l < V; ++l) {
      if constexpr (Op == reduce_op::avg) acc[l] = acc[l] / static_cast<A>(a.n);
      x.v[l] = round_to<T>(acc[l]);
    }
    for (int q = 0; q < a.nout; ++q) gpu::detail::store_vec<T, V>(a.outs[q] + i, x);
  }
  for (std::uint64_t i = nvec * V + first; i < a.len; i += stride) {
    A acc = widen(a.ins[0][i]);
    for (int p = 1; p < a.n; ++p) acc = combine(Op, acc, widen(a.ins[p][i]));
    if constexpr (Op == reduce_op::avg) acc = acc / static_cast<A>(a.n);
    const T r = round_to<T>(acc);
    for (int q = 0; q < a.nout; ++q) a.outs[q][i] = r;
  }
}

template <class T>
void launch_reduce(const reduce_args<T>& a, reduce_op op, cudaStream_t s) {
  if (a.len == 0) return;
  constexpr std::uint64_t v = gpu::vector_bytes / sizeof(T);
  bool aligned = true;
  for (int p = 0; p < a.n; ++p) aligned = aligned && gpu::detail::address(a.ins[p]) % 16 == 0;
  for (int q = 0; q < a.nout; ++q) aligned = aligned && gpu::detail::address(a.outs[q]) % 16 == 0;
  const std::uint64_t nvec = aligned ? a.len / v : 0;
  const std::uint64_t threads = nvec + (a.len - nvec * v);
  const std::uint64_t blocks = (threads + gpu::block_threads - 1) / gpu::block_threads;
  fedshard::detail::visit_op(op, [&](auto opc) {
    rank_order_kernel<T, decltype(opc)::value>
        <<<gpu::detail::grid_for(blocks), gpu::block_threads, 0, s>>>(a, nvec);
  });
  gpu::detail::check_launch("fedshard::gpu_inproc rank-order reduction");
}

/// What the ranks of one run() share: the host world (failures, exits, timeout), the devices'
/// peer access.
struct gpu_world {
  gpu_world(int n, const options& o)
      : host(std::make_shared<inproc::detail::world_state>(n, o.timeout, o.spin_polls)) {}
  std::shared_ptr<inproc::detail::world_state> host;
  int device_count = 0;
  std::vector<char> peer;  // peer[a * device_count + b]: device a reads b's memory directly

  bool direct(int from, int to) const {
    return from == to || peer[static_cast<std::size_t>(from * device_count + to)] != 0;
  }
};

/// A send or receive posted by one rank, shared with the rank that matches it.
struct p2p_op : inproc::detail::p2p_message {
  gpu::cuda_event posted;  // the poster's stream when it posted
  // Set by the rank that matched it (guarded by group_state::p2p_mu):
  bool done = false;
  gpu::cuda_event copied;  // after the copy, on the matcher's stream
  std::string error;
};

/// The state shared by the ranks of one communicator: inproc's meeting slots, the members'
/// devices and, per slot and member, the arrival and done events the peers wait on.
struct gpu_group {
  gpu_group(std::shared_ptr<gpu_world> w, std::vector<int> members, std::vector<int> devs)
      : world(std::move(w)), host(world->host, std::move(members)), devices(std::move(devs)) {
    const std::size_t n = static_cast<std::size_t>(host.size) * inproc::detail::group_state::ring;
    arrive_events.assign(n, nullptr);
    done_events.assign(n, nullptr);
    try {
      for (std::size_t i = 0; i < n; ++i) {
        gpu::device_guard guard(devices[i % devices.size()]);
        FEDSHARD_CUDA_TRY(cudaEventCreateWithFlags(&arrive_events[i], cudaEventDisableTiming));
        FEDSHARD_CUDA_TRY(cudaEventCreateWithFlags(&done_events[i], cudaEventDisableTiming));
      }
    } catch (...) {
      destroy_events();
      throw;
    }
  }
  gpu_group(const gpu_group&) = delete;
  gpu_group& operator=(const gpu_group&) = delete;
  ~gpu_group() { destroy_events(); }

  /// The events of member m at slot s.
  cudaEvent_t arrive_event(std::uint64_t s, int m) const {
    return arrive_events[s * static_cast<std::size_t>(host.size) + static_cast<std::size_t>(m)];
  }
  cudaEvent_t done_event(std::uint64_t s, int m) const {
    return done_events[s * static_cast<std::size_t>(host.size) + static_cast<std::size_t>(m)];
  }
  int device_of(int m) const { return devices[static_cast<std::size_t>(m)]; }

  std::shared_ptr<gpu_world> world;
  inproc::detail::group_state host;
  const std::vector<int> devices;  // per member
  std::vector<cudaEvent_t> arrive_events, done_events;

  std::map<std::pair<std::uint64_t, int>, inproc::detail::split_entry<gpu_group>>
      splits;                                    // guarded by host.mu
  std::vector<std::shared_ptr<p2p_op>> pending;  // unmatched sends and receives (host.p2p_mu)

 private:
  void destroy_events() noexcept {
    for (std::size_t i = 0; i < arrive_events.size(); ++i) {
      gpu::detail::quiet_device_guard guard(devices[i % devices.size()]);
      if (arrive_events[i] != nullptr) (void)cudaEventDestroy(arrive_events[i]);
      if (done_events[i] != nullptr) (void)cudaEventDestroy(done_events[i]);
    }
  }
};

/// One rank's device side of a communicator: its device, stream, events and scratch.
struct rank_device {
  explicit rank_device(int d)
      : device(d), stream(d), events(std::make_shared<gpu::detail::event_pool>(d)) {}
  int device;
  gpu::cuda_stream stream;
  std::shared_ptr<gpu::detail::event_pool> events;
  gpu::device_buffer<std::byte> scratch;

  /// At least `bytes` bytes of scratch on the device. A larger one replaces the old only
  /// after the stream has passed its earlier uses.
  std::byte* reserve(std::size_t bytes) {
    if (bytes > scratch.size()) {
      FEDSHARD_CUDA_TRY(cudaStreamSynchronize(stream.get()));
      scratch = gpu::device_buffer<std::byte>();
      scratch = gpu::device_buffer<std::byte>::uninitialized(bytes);
    }
    return scratch.data();
  }
};

/// Queues member me's share of a validated, non-empty all_reduce or reduce_scatter on its
/// stream: chunk (block) me of every input, staged first from peers not reachable directly,
/// reduced into every output (into its own).
inline void execute_reduction(const gpu_group& g, const std::vector<call_args>& d, int me,
                              rank_device& rd) {
  const int n = g.host.size;
  const call_args& mine = d[static_cast<std::size_t>(me)];
  const std::int64_t count = mine.count;
  const std::size_t esz = size_of(mine.type);
  const cudaStream_t s = rd.stream.get();
  const gpu_world& w = *g.world;
  const auto direct = [&](int p) { return w.direct(rd.device, g.device_of(p)); };
  const auto copy = [&](void* to, const void* from, std::size_t bytes) {
    if (bytes != 0 && to != from)
      FEDSHARD_CUDA_TRY(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDefault, s));
  };
  visit(mine.type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const bool all = mine.kind == op_kind::all_reduce;
    const auto part = all ? fedshard::detail::chunk_of(count, n, esz, me)
                          : fedshard::detail::elem_range{count * me, count * (me + 1)};
    const auto len = static_cast<std::size_t>(part.end - part.begin);
    if (len == 0) return;
    const std::size_t bytes = len * sizeof(T);
    // Staging: one block per peer not reachable directly, plus one for the result.
    int staged_in = 0;
    bool staged_out = false;
    for (int p = 0; p < n; ++p)
      if (!direct(p)) {
        ++staged_in;
        staged_out = staged_out || all;
      }
    std::byte* scratch = nullptr;
    if (staged_in > 0)
      scratch = rd.reserve(bytes * static_cast<std::size_t>(staged_in + (staged_out ? 1 : 0)));
    reduce_args<T> a{};
    a.n = n;
    a.len = len;
    int next = 0;
    for (int p = 0; p < n; ++p) {
      const T* in = static_cast<const T*>(d[p].in) + part.begin;
      if (!direct(p)) {
        T* st = reinterpret_cast<T*>(scratch + bytes * static_cast<std::size_t>(next++));
        copy(st, in, bytes);
        in = st;
      }
      a.ins[p] = in;
    }
    T* staged_result = staged_out ? reinterpret_cast<T*>(scratch + bytes * staged_in) : nullptr;
    if (all) {
      for (int p = 0; p < n; ++p)
        if (direct(p)) a.outs[a.nout++] = static_cast<T*>(d[p].out) + part.begin;
      if (staged_out) a.outs[a.nout++] = staged_result;
    } else {
      a.outs[a.nout++] = static_cast<T*>(mine.out);
    }
    launch_reduce(a, mine.op, s);
    if (staged_out)
      for (int p = 0; p < n; ++p)
        if (!direct(p)) copy(static_cast<T*>(d[p].out) + part.begin, staged_result, bytes);
  });
}

/// Queues member me's share of a validated, non-empty collective on its stream (the device
/// is current). It copies between ranks what inproc's execute does (inproc::detail::moved_by).
inline void execute(const gpu_group& g, const std::vector<call_args>& d, int me, rank_device& rd) {
  const int n = g.host.size;
  const call_args& mine = d[static_cast<std::size_t>(me)];
  const std::int64_t count = mine.count;
  const std::size_t esz = size_of(mine.type);
  const cudaStream_t s = rd.stream.get();
  const auto copy = [&](void* to, const void* from, std::size_t bytes) {
    if (bytes != 0 && to != from)
      FEDSHARD_CUDA_TRY(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDefault, s));
  };
  switch (mine.kind) {
    case op_kind::all_reduce:
    case op_kind::reduce_scatter: execute_reduction(g, d, me, rd); return;
    case op_kind::all_gather: {
      const std::size_t bytes = static_cast<std::size_t>(count) * esz;
      for (int p = 0; p < n; ++p)
        copy(static_cast<char*>(d[p].out) + bytes * static_cast<std::size_t>(me), mine.in, bytes);
      return;
    }
    case op_kind::broadcast: {
      const int root = mine.root;
      const auto [begin, end] = fedshard::detail::chunk_of(count, n, esz, me);
      if (end <= begin) return;
      const std::size_t off = static_cast<std::size_t>(begin) * esz;
      const std::size_t bytes = static_cast<std::size_t>(end - begin) * esz;
      for (int p = 0; p < n; ++p)
        if (p != root)
          copy(static_cast<char*>(d[p].out) + off, static_cast<const char*>(d[root].out) + off,
               bytes);
      return;
    }
    case op_kind::barrier:
    case op_kind::split: return;
  }
}

/// True when a call moves nothing (count 0); every rank's count is the same once checked.
inline bool moves_nothing(const call_args& a) {
  return a.count == 0;
}

/// Runs collective number seq for member me (see the file comment); returns the new group
/// of a split.
inline std::shared_ptr<gpu_group> run_collective(gpu_group& g, int me, std::uint64_t seq,
                                                 const call_args& args, rank_device& rd) {
  using namespace inproc::detail;
  group_state& h = g.host;
  const int n = h.size;
  const bool device_work = args.kind != op_kind::split;
  const cudaStream_t stream = rd.stream.get();
  gpu::device_guard guard(rd.device);
  meeting m(h, me, seq, args.kind);
  const std::uint64_t slot_index = m.slot_index;
  const auto& d = m.meet(args, [&] {
    if (device_work) FEDSHARD_CUDA_TRY(cudaEventRecord(g.arrive_event(slot_index, me), stream));
  });

  std::shared_ptr<gpu_group> result;
  std::exception_ptr error;
  if (!device_work) {
    const std::vector<int> members = split_members(d, me);
    try {
      result =
          fetch_split(h.mu, g.splits, seq, d[static_cast<std::size_t>(me)].color,
                      static_cast<int>(members.size()), [&] {
                        std::vector<int> wr, devs;
                        for (int w : members) {
                          wr.push_back(h.world_ranks[static_cast<std::size_t>(w)]);
                          devs.push_back(g.device_of(w));
                        }
                        return std::make_shared<gpu_group>(g.world, std::move(wr), std::move(devs));
                      });
    } catch (...) {
      error = std::current_exception();
    }
  } else {
    try {
      const bool empty = moves_nothing(d[static_cast<std::size_t>(me)]);
      if (!empty || args.kind == op_kind::barrier) {
        for (int p = 0; p < n; ++p)
          if (p != me)
            FEDSHARD_CUDA_TRY(cudaStreamWaitEvent(stream, g.arrive_event(slot_index, p), 0));
        if (!empty) execute(g, d, me, rd);
      }
      FEDSHARD_CUDA_TRY(cudaEventRecord(g.done_event(slot_index, me), stream));
    } catch (...) {
      error = std::current_exception();
      h.world->fail(h.world_ranks[static_cast<std::size_t>(me)],
                    fedshard::detail::concat("gpu_inproc ", m.what, " (call #", seq,
                                             ") failed on member ", me));
    }
  }
  m.leave();
  if (error) std::rethrow_exception(error);
  if (device_work &&
      (!moves_nothing(d[static_cast<std::size_t>(me)]) || args.kind == op_kind::barrier))
    for (int p = 0; p < n; ++p)
      if (p != me) FEDSHARD_CUDA_TRY(cudaStreamWaitEvent(stream, g.done_event(slot_index, p), 0));
  return result;
}

/// A request that completes with an event of the rank's stream.
class event_request final : public fedshard::detail::request_state {
 public:
  explicit event_request(gpu::cuda_event e) : e_(std::move(e)) {}
  void wait() override { e_.synchronize(); }
  bool test() override { return e_.ready(); }

 private:
  gpu::cuda_event e_;
};

}  // namespace detail

/// One rank's handle on a GPU in-process communicator; models fedshard::Communicator with
/// device buffers, and is stream-ordered in cuda_space (see the file comment). Move-only;
/// one thread per rank drives it. The *_async calls are async_calls': barrier_async's
/// request completes once every rank has entered the barrier and the work queued on the
/// ranks' streams before it has completed; send_async posts a send of count elements to
/// peer and returns once the peer posted the matching receive (see the file comment), and
/// its request completes with the copy; recv_async posts a receive likewise.
class communicator : public blocking_calls<communicator>, public async_calls<communicator> {
 public:
  /// The buffers' space: device memory.
  using memory_space = gpu::cuda_space;

  communicator(std::shared_ptr<detail::gpu_group> g, int member)
      : g_(std::move(g)),
        me_(member),
        rd_(std::make_unique<detail::rank_device>(g_->device_of(member))) {}
  communicator(communicator&&) noexcept = default;
  communicator& operator=(communicator&&) noexcept = default;
  ~communicator() {
    if (rd_) (void)cudaStreamSynchronize(rd_->stream.get());  // peers' buffers in use
  }

  /// This rank's index in the communicator.
  int rank() const noexcept { return me_; }
  /// Number of ranks in the communicator.
  int size() const noexcept { return g_->host.size; }
  /// This rank's index in the world the communicator was split from.
  int world_rank() const noexcept { return g_->host.world_ranks[static_cast<std::size_t>(me_)]; }
  /// The CUDA device of this rank.
  int device() const noexcept { return rd_->device; }
  /// The stream every call is queued on.
  cudaStream_t stream() const noexcept { return rd_->stream.get(); }
  /// Bytes copied between ranks by the calls queued so far, counted when queued: the copies
  /// are inproc's (inproc::detail::moved_by).
  moved_bytes moved() const noexcept { return moved_; }
  /// Every collective moves what a ring moves, as inproc's.
  wire_algorithm algorithm_of(collective, std::int64_t, dtype) const noexcept {
    return wire_algorithm::ring;
  }

  /// A cuda_space on this rank's device, for the buffers of this communicator's user.
  std::unique_ptr<gpu::cuda_space> make_space() const {
    return std::make_unique<gpu::cuda_space>(rd_->device);
  }
  /// Later calls wait for ev (on the stream; the host does not wait).
  void after(const gpu::cuda_event& ev) {
    gpu::device_guard guard(rd_->device);
    ev.wait_on(rd_->stream.get());
  }
  /// An event after the calls made so far.
  gpu::cuda_event record() {
    gpu::device_guard guard(rd_->device);
    return gpu::cuda_event::record(rd_->events, rd_->stream.get());
  }

  /// Collective: the communicator of the ranks that passed the same color (>= 0), ordered by
  /// key, then by rank; it has a stream of its own on this rank's device.
  communicator split(int color, int key) {
    auto d = detail::make_call(detail::op_kind::split, nullptr, nullptr, 0, dtype::f32);
    d.color = color;
    d.key = key;
    auto g = detail::run_collective(*g_, me_, next_seq_++, d, *rd_);
    int member = 0;
    for (int i = 0; i < g->host.size; ++i)
      if (g->host.world_ranks[static_cast<std::size_t>(i)] == world_rank()) member = i;
    return communicator(std::move(g), member);
  }

 private:
  friend class async_calls<communicator>;

  request collective(const detail::call_args& a) {
    detail::run_collective(*g_, me_, next_seq_++, a, *rd_);
    moved_ += inproc::detail::moved_by(a, size(), me_);
    return request(std::make_unique<detail::event_request>(record()));
  }

  request p2p(bool is_send, const void* sbuf, void* rbuf, std::int64_t n, dtype t, int peer,
              int tag) {
    inproc::detail::group_state& h = g_->host;
    fedshard::detail::check_p2p_args(is_send, is_send ? sbuf : rbuf, n, t, peer, size());
    moved_ += fedshard::detail::p2p_moved(is_send, n, t, me_, peer);
    gpu::device_guard guard(rd_->device);
    auto op = std::make_shared<detail::p2p_op>();
    static_cast<inproc::detail::p2p_message&>(*op) =
        inproc::detail::p2p_message::of(is_send, sbuf, rbuf, n, t, me_, peer, tag);
    op->posted = gpu::cuda_event::record(rd_->events, rd_->stream.get());
    std::shared_ptr<detail::p2p_op> other;
    {
      std::lock_guard lock(h.p2p_mu);
      auto it = std::find_if(pending_p2p().begin(), pending_p2p().end(),
                             [&](const auto& q) { return q->matches(*op); });
      if (it == pending_p2p().end()) {
        pending_p2p().push_back(op);
      } else {
        other = *it;
        pending_p2p().erase(it);
      }
    }
    if (other) return copy_matched(*op, *other);
    return await_match(op, peer);
  }

  /// op arrived second and matches `other`: copies the message on this rank's stream and
  /// completes other (with the copy's event, or the error).
  request copy_matched(detail::p2p_op& op, detail::p2p_op& other) {
    inproc::detail::group_state& h = g_->host;
    detail::p2p_op& s = op.is_send ? op : other;
    detail::p2p_op& r = op.is_send ? other : op;
    std::string err;
    gpu::cuda_event copied;
    try {
      if (s.count != r.count || s.type != r.type) {
        err = fedshard::detail::p2p_mismatch(s.src, s.dst, s.tag, s.count, s.type, r.count, r.type);
      } else {
        other.posted.wait_on(rd_->stream.get());
        if (s.count > 0)
          FEDSHARD_CUDA_TRY(cudaMemcpyAsync(r.rbuf, s.sbuf,
                                            static_cast<std::size_t>(s.count) * size_of(s.type),
                                            cudaMemcpyDefault, rd_->stream.get()));
      }
      copied = gpu::cuda_event::record(rd_->events, rd_->stream.get());
    } catch (...) {
      err = "the copy failed on the matching rank";
      {
        std::lock_guard lock(h.p2p_mu);
        other.error = err;
        other.done = true;
      }
      h.p2p_cv.notify_all();
      throw;
    }
    {
      std::lock_guard lock(h.p2p_mu);
      other.copied = copied;
      other.error = err;
      other.done = true;
    }
    h.p2p_cv.notify_all();
    if (!err.empty()) throw collective_mismatch(err);
    return request(std::make_unique<detail::event_request>(std::move(copied)));
  }

  /// op arrived first: waits on the host for the peer's match, then orders this stream after
  /// the copy.
  request await_match(const std::shared_ptr<detail::p2p_op>& op, int peer) {
    using namespace inproc::detail;
    group_state& h = g_->host;
    const auto deadline =
        clock::now() + std::chrono::duration_cast<clock::duration>(h.world->timeout);
    std::unique_lock lock(h.p2p_mu);
    while (!op->done) {
      auto it = std::find(pending_p2p().begin(), pending_p2p().end(), op);
      if (it != pending_p2p().end()) {
        try {
          // still pending under p2p_mu: the peer has not matched op
          check_progress(h, me_, op->is_send ? "send" : "recv", 0, {peer}, deadline,
                         [](int) { return false; });
        } catch (...) {
          pending_p2p().erase(it);
          throw;
        }
      }
      h.p2p_cv.wait_for(lock, std::chrono::milliseconds(20));
    }
    if (!op->error.empty()) throw collective_mismatch(op->error);
    gpu::cuda_event copied = op->copied;
    lock.unlock();
    copied.wait_on(rd_->stream.get());
    return request(std::make_unique<detail::event_request>(record()));
  }

  /// The unmatched sends and receives of the group (guarded by host.p2p_mu).
  std::vector<std::shared_ptr<detail::p2p_op>>& pending_p2p() { return g_->pending; }

  std::shared_ptr<detail::gpu_group> g_;
  int me_;
  std::uint64_t next_seq_ = 0;
  std::unique_ptr<detail::rank_device> rd_;
  moved_bytes moved_{};
};

static_assert(Communicator<communicator>);
static_assert(space::StreamOrdered<communicator, gpu::cuda_space>);

/// The devices of a world of n ranks: o.devices round-robin, else all devices round-robin.
inline std::vector<int> rank_devices(int n, const options& o) {
  const int count = gpu::device_count();
  FEDSHARD_EXPECTS(count > 0, "gpu_inproc::run: no CUDA device");
  std::vector<int> devs(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    const int d =
        o.devices.empty() ? r % count : o.devices[static_cast<std::size_t>(r) % o.devices.size()];
    FEDSHARD_EXPECTS(d >= 0 && d < count, "gpu_inproc::run: device ", d, " of rank ", r,
                     " does not exist (this process sees ", count, " CUDA devices)");
    devs[static_cast<std::size_t>(r)] = d;
  }
  return devs;
}

/// Runs body(communicator& world) on n threads, one per rank (rank r's device current on its
/// thread), and returns when all have returned. If any rank throws, peers blocked in calls
/// throw peer_failure, and run() rethrows the exception of the rank that failed first.
template <class F>
void run(int n, F&& body, options opt = {}) {
  FEDSHARD_EXPECTS(n >= 1 && n <= max_ranks, "gpu_inproc::run: the number of ranks must be in [1, ",
                   max_ranks, "], found ", n);
  FEDSHARD_EXPECTS(opt.timeout.count() > 0, "gpu_inproc::run: timeout must be > 0 s, found ",
                   opt.timeout.count());
  std::vector<int> devs = rank_devices(n, opt);
  auto world = std::make_shared<detail::gpu_world>(n, opt);
  world->device_count = gpu::device_count();
  const auto dc = static_cast<std::size_t>(world->device_count);
  world->peer.assign(dc * dc, 0);
  for (int a = 0; a < world->device_count; ++a)
    for (int b = 0; b < world->device_count; ++b) {
      if (a == b) continue;
      int can = 0;
      if (cudaDeviceCanAccessPeer(&can, a, b) != cudaSuccess || can == 0) {
        (void)cudaGetLastError();
        continue;
      }
      gpu::device_guard guard(a);
      const cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
      if (e == cudaSuccess || e == cudaErrorPeerAccessAlreadyEnabled)
        world->peer[static_cast<std::size_t>(a) * dc + static_cast<std::size_t>(b)] = 1;
      (void)cudaGetLastError();
    }
  std::vector<int> ranks(static_cast<std::size_t>(n));
  std::iota(ranks.begin(), ranks.end(), 0);
  auto group = std::make_shared<detail::gpu_group>(world, std::move(ranks), devs);
  inproc::detail::run_ranks<communicator>(
      *world->host, n,
      [&](std::optional<communicator>& c, int r) {
        FEDSHARD_CUDA_TRY(cudaSetDevice(devs[static_cast<std::size_t>(r)]));
        c.emplace(group, r);
      },
      body);
}

}  // namespace fedshard::gpu_inproc
