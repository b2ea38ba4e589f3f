#pragma once
/// checked_space, the stream-checking space: a MemorySpace (memory_space.hpp) in host memory
/// whose streams behave like a GPU's, so that ordering bugs fail tests on a machine without
/// one. Every kernel and copy is checked on the calling thread, then queued on its stream and
/// run later, in order, by the stream's worker thread (the kernels/ host loops, the math of
/// host_space); events order streams for real; a block that goes back to the cache is filled
/// with 0xFF bytes (NaN in f32, f64, bf16 and f16). So a missing wait between two streams
/// reads values that are not ready yet, and a buffer used after its release reads NaN or
/// fails the stream that used it, instead of giving the right result by luck.
///
/// How tests use it:
///  - hold mode (checked_options::hold) runs a task only once something needs it, so work
///    that nothing waited for has not run, on every run: a missing wait reads the old values
///    deterministically, and a test can show that results appear only after synchronize;
///  - pause(st) / resume(st) keep a stream from running at all (an event that never
///    completes), host_task(st, f) queues arbitrary host code (e.g. one that throws);
///  - under ThreadSanitizer a missing wait is also reported as a data race between workers.
///
/// Checks beyond host_space's:
///  - kernels and copies take memory of this space (a live buffer, within its size); host
///    memory is accepted only as the host side of to_host and from_host, as on a GPU;
///  - a buffer released while a queued or running task of a stream uses it fails that stream
///    with invalid_argument (the task and the rest of the stream are skipped, so the block is
///    poisoned and handed out again only once no task can touch it); a span kept past its
///    buffer's release reads NaN on the host (until the block is handed out again);
///  - a stream waiting on an event, and the host waiting on a stream that makes no progress,
///    fail with timeout_error after checked_options::timeout instead of hanging.
/// A task that fails (it throws, or its wait times out) fails its stream for good, as a fault
/// does on a GPU: the stream skips its later tasks, and every synchronize of the stream, or of
/// an event recorded after the failure, throws the error on the host; a stream that waits on
/// such an event fails with the same error. Destructors never throw.
///
/// One host thread drives a space and its streams (as a rank does); the workers only run
/// tasks.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/timeout.hpp"
#include "fedshard/error.hpp"
#include "fedshard/kernels/cast.hpp"
#include "fedshard/kernels/for_each.hpp"
#include "fedshard/kernels/index.hpp"
#include "fedshard/space/caching_allocator.hpp"
#include "fedshard/space/host_space.hpp"
#include "fedshard/space/memory_space.hpp"

namespace fedshard::space {

/// Settings of a checked_space.
struct checked_options {
  /// Hold mode: a task starts only once something needs it: a host synchronize of its stream
  /// or of an event recorded after it, a wait of another stream that has reached such an
  /// event, or the destruction of its stream. Work that nothing waited for has not run, on
  /// every run, so a missing wait gives the same wrong result every time. ready() is not a
  /// need: in hold mode a host loop that polls ready() without synchronizing never ends.
  bool hold = false;
  /// How long a worker sleeps before each task it runs (0: it only yields its core first), to
  /// make work run well after the call that queued it.
  std::chrono::microseconds delay{0};
  /// How long a stream waits for an event, or the host for a stream that makes no progress,
  /// before failing with timeout_error (FEDSHARD_TIMEOUT_S, else 300 s).
  std::chrono::duration<double> timeout = fedshard::detail::default_timeout();
};

namespace detail {

using checked_clock = std::chrono::steady_clock;

/// A timeout as a clock duration (at most a year, so that it cannot overflow the clock).
inline checked_clock::duration clock_step(std::chrono::duration<double> timeout) {
  return std::chrono::duration_cast<checked_clock::duration>(
      std::min(timeout, std::chrono::duration<double>(365.0 * 24 * 3600)));
}

/// The byte that fills free blocks: 0xFF... is a NaN in f32, f64, bf16 and f16.
inline constexpr unsigned char poison_byte = 0xFF;

/// The blocks of a checked_space: every block the system handed out, whether a buffer holds
/// it, and how many of its bytes that buffer uses. Thread-safe.
class block_registry {
 public:
  /// What the registry knows of one block.
  struct entry {
    std::size_t bytes = 0;  ///< its (rounded) size
    std::size_t used = 0;   ///< the bytes of the buffer that holds it
    bool live = false;      ///< whether a buffer holds it (else it is in the cache)
  };
  /// A block found by address: its first byte and its entry.
  struct found {
    const std::byte* base = nullptr;
    entry info;
  };

  void add(void* p, std::size_t bytes) {
    std::lock_guard lock(mu_);
    blocks_.insert_or_assign(address(p), entry{.bytes = bytes, .used = 0, .live = false});
  }
  void remove(void* p) noexcept {
    std::lock_guard lock(mu_);
    blocks_.erase(address(p));
  }
  /// Marks a block as held by a buffer of `used` bytes.
  void set_live(void* p, std::size_t used) noexcept {
    std::lock_guard lock(mu_);
    if (auto it = blocks_.find(address(p)); it != blocks_.end()) {
      it->second.used = used;
      it->second.live = true;
    }
  }
  /// Marks a block as back in the cache.
  void set_free(void* p) noexcept {
    std::lock_guard lock(mu_);
    if (auto it = blocks_.find(address(p)); it != blocks_.end()) {
      it->second.used = 0;
      it->second.live = false;
    }
  }
  /// The block that holds the byte at p, if any.
  std::optional<found> find(const void* p) const noexcept {
    std::lock_guard lock(mu_);
    auto it = blocks_.upper_bound(address(p));
    if (it == blocks_.begin()) return std::nullopt;
    --it;
    if (address(p) - it->first >= it->second.bytes) return std::nullopt;
    return found{reinterpret_cast<const std::byte*>(it->first), it->second};
  }

 private:
  static std::uintptr_t address(const void* p) noexcept {
    return reinterpret_cast<std::uintptr_t>(p);
  }

  mutable std::mutex mu_;
  std::map<std::uintptr_t, entry> blocks_;
};

/// The system allocator under checked_space's cache: 64-byte aligned host memory whose
/// blocks are registered and filled with poison_byte when new and whenever they return to
/// the cache.
struct checked_host_memory {
  block_registry* registry = nullptr;

  void* allocate(std::size_t bytes) {
    void* p = aligned_host_memory{}.allocate(bytes);
    try {
      registry->add(p, bytes);
    } catch (...) {
      aligned_host_memory{}.release(p, bytes);
      throw;
    }
    std::memset(p, poison_byte, bytes);
    return p;
  }
  void release(void* p, std::size_t bytes) noexcept {
    registry->remove(p);
    aligned_host_memory{}.release(p, bytes);
  }
  void recycled(void* p, std::size_t bytes) noexcept {
    std::memset(p, poison_byte, bytes);
    registry->set_free(p);
  }
};

/// A task queued on a checked_space stream.
struct checked_task {
  /// The work, run on the stream's worker.
  std::function<void()> run;
  /// What it is, for messages ("fill", "wait for ...").
  std::string what;
  /// The blocks of the space it reads or writes (their first bytes).
  std::vector<const void*> blocks;
  /// Whether it is a wait for an event (which times out on its own).
  bool is_wait = false;
};

/// The first task of a stream that failed, and its error.
struct stream_failure {
  std::uint64_t index = 0;
  std::exception_ptr error;
};

/// The state a stream's handle, its worker and its events share. Tasks are numbered from 0
/// in the order they were queued; an event is a number of tasks.
struct stream_state {
  stream_state(const void* owner_space, std::string stream_name, const checked_options& o)
      : owner(owner_space), name(std::move(stream_name)), options(o) {}

  const void* const owner;  ///< the checked_space that made the stream
  const std::string name;
  const checked_options options;

  std::mutex mu;
  std::condition_variable work_cv;  ///< the worker waits here for a task it may start
  std::condition_variable done_cv;  ///< waiters for completed tasks wait here
  std::deque<checked_task> queue;   ///< tasks not yet completed; the front may be running
  std::uint64_t completed = 0;      ///< tasks run, failed or skipped so far
  std::uint64_t released = 0;       ///< hold mode: tasks below this number may start
  bool running = false;             ///< the front task is running
  bool paused = false;
  bool closing = false;
  std::optional<stream_failure> failure;

  /// The number of tasks queued so far; mu is held.
  std::uint64_t queued_locked() const { return completed + queue.size(); }

  /// Sentinel target of await_from_host: every task queued so far.
  static constexpr std::uint64_t all_queued = ~std::uint64_t{0};

  void push(checked_task t) {
    {
      std::lock_guard lock(mu);
      queue.push_back(std::move(t));
    }
    work_cv.notify_one();
  }

  /// Lets the tasks below target start (hold mode); mu is held.
  void demand_locked(std::uint64_t target) {
    if (target > released) {
      released = target;
      work_cv.notify_one();
    }
  }

  /// Whether a task below seq failed or was skipped; mu is held.
  bool failed_before_locked(std::uint64_t seq) const {
    return failure.has_value() && failure->index < seq;
  }

  /// How far the stream is, for messages; mu is held.
  std::string describe_locked() const {
    std::string s = fedshard::detail::concat("'", name, "' has completed ", completed, " of its ",
                                             queued_locked(), " queued tasks");
    if (paused) s += " and is paused (resume it)";
    if (running)
      s += fedshard::detail::concat("; its task ", completed + 1, " (", queue.front().what,
                                    ") has not returned");
    return s;
  }

  /// The worker's loop: runs or skips the front task once it may start, until the stream
  /// closes and its queue is empty.
  void work() noexcept {
    std::unique_lock lk(mu);
    for (;;) {
      work_cv.wait(lk, [&] {
        if (queue.empty()) return closing;
        return !paused && (!options.hold || completed < released);
      });
      if (queue.empty()) return;
      checked_task& t = queue.front();  // stays put while the host queues more
      const std::uint64_t index = completed;
      std::exception_ptr error;
      if (!(failure && failure->index <= index)) {
        running = true;
        lk.unlock();
        if (options.delay.count() > 0)
          std::this_thread::sleep_for(options.delay);
        else
          std::this_thread::yield();
        try {
          t.run();
        } catch (...) {
          error = std::current_exception();
        }
        lk.lock();
        running = false;
      }
      if (error && !(failure && failure->index <= index))
        failure = stream_failure{index, std::move(error)};
      queue.pop_front();
      ++completed;
      done_cv.notify_all();
    }
  }

  /// Blocks the host until the first target tasks (all_queued: those queued so far) have
  /// completed, then throws the stream's error if one of them failed. Throws timeout_error
  /// when the stream makes no progress for the timeout, except while it runs a wait (which
  /// fails on its own).
  void await_from_host(std::uint64_t target, std::string_view what) {
    std::unique_lock lk(mu);
    if (target == all_queued) target = queued_locked();
    demand_locked(target);
    const auto step = clock_step(options.timeout);
    std::uint64_t seen = completed;
    auto deadline = checked_clock::now() + step;
    while (completed < target) {
      const bool timed_out = done_cv.wait_until(lk, deadline) == std::cv_status::timeout;
      if (completed != seen || (timed_out && running && queue.front().is_wait)) {
        seen = completed;
        deadline = checked_clock::now() + step;
      } else if (timed_out && completed < target) {
        throw timeout_error(fedshard::detail::concat(
            "fedshard: timeout_error: checked_space: the host waited in ", what, " more than ",
            options.timeout.count(), " s for stream '", name, "' to complete its first ", target,
            " tasks without progress; ", describe_locked()));
      }
    }
    if (failed_before_locked(target)) std::rethrow_exception(failure->error);
  }

  /// Blocks waiter's worker until the first target tasks of this stream have completed (in
  /// hold mode it asks for them); throws timeout_error after waiter's timeout, and this
  /// stream's error if one of them failed.
  void await_from_stream(std::uint64_t target, const stream_state& waiter) {
    std::unique_lock lk(mu);
    demand_locked(target);
    const auto deadline = checked_clock::now() + clock_step(waiter.options.timeout);
    if (!done_cv.wait_until(lk, deadline, [&] { return completed >= target; }))
      throw timeout_error(fedshard::detail::concat(
          "fedshard: timeout_error: checked_space: stream '", waiter.name, "' waited more than ",
          waiter.options.timeout.count(), " s for an event of stream '", name, "' (its first ",
          target, " tasks); ", describe_locked()));
    if (failed_before_locked(target)) std::rethrow_exception(failure->error);
  }

  /// Called as a block of `bytes` at base goes back to the cache: the first task of this
  /// stream that still uses it fails the stream (so it and its successors are skipped), and
  /// if that task is running, returns once it has.
  void retire_block(const void* base, std::size_t bytes) noexcept {
    std::unique_lock lk(mu);
    std::uint64_t index = completed;
    for (const checked_task& t : queue) {
      if (std::find(t.blocks.begin(), t.blocks.end(), base) != t.blocks.end()) {
        const bool is_running = index == completed && running;
        if (!(failure && failure->index <= index)) {
          std::exception_ptr error;
          try {
            throw invalid_argument(fedshard::detail::concat(
                "fedshard: checked_space: a buffer (", bytes, " bytes at ", base,
                ") was released while task ", index + 1, " (", t.what, ") of stream '", name,
                is_running ? "' was running on it" : "' was queued to use it",
                "; a buffer must not be destroyed while a stream uses it: synchronize the "
                "stream, or an event recorded after that task, first"));
          } catch (...) {
            error = std::current_exception();
          }
          failure = stream_failure{index, std::move(error)};
        }
        if (is_running) done_cv.wait(lk, [&] { return completed > index; });
        return;
      }
      ++index;
    }
  }
};

}  // namespace detail

/// The stream-checking MemorySpace: host memory, work deferred to one worker thread per
/// stream, real events, poisoned free blocks (see the top of this header).
class checked_space {
 public:
  static constexpr std::string_view name = "checked";
  /// The host may read and write buffers directly, once it has synchronized with their
  /// streams.
  static constexpr bool host_accessible = true;

  /// An ordered queue of work run by its own worker thread; move-only. Destroying it runs
  /// (or skips, if the stream failed) everything queued on it, then joins its worker.
  class stream {
   public:
    /// An empty handle (as after a move); the space refuses it.
    stream() = default;
    stream(stream&&) noexcept = default;
    stream& operator=(stream&& o) noexcept {
      if (this != &o) {
        close();
        state_ = std::move(o.state_);
        worker_ = std::move(o.worker_);
      }
      return *this;
    }
    ~stream() { close(); }

    /// The name given to make_stream (or "stream <n>"), which messages use; empty when empty.
    std::string_view name() const noexcept {
      return state_ ? std::string_view(state_->name) : std::string_view();
    }

   private:
    friend class checked_space;

    void close() noexcept {
      if (state_ != nullptr) {
        {
          std::lock_guard lock(state_->mu);
          state_->closing = true;
          state_->paused = false;
          state_->released = state_->queued_locked();
        }
        state_->work_cv.notify_all();
      }
      if (worker_.joinable()) {
        try {
          worker_.join();
        } catch (...) {  // closed from its own worker (a host task): let it finish alone
          try {
            worker_.detach();
          } catch (...) {
          }
        }
      }
      state_.reset();
    }

    std::shared_ptr<detail::stream_state> state_;
    std::thread worker_;
  };

  /// A point in a stream: complete once the stream has completed every task queued on it
  /// before record() made the event. Copyable; a default event is complete.
  class event {
   public:
    event() = default;

   private:
    friend class checked_space;
    event(std::shared_ptr<detail::stream_state> s, std::uint64_t seq)
        : state_(std::move(s)), seq_(seq) {}

    std::shared_ptr<detail::stream_state> state_;
    std::uint64_t seq_ = 0;
  };

  /// n elements of T in a block of this space (memory_space.hpp's basic_buffer).
  template <class T>
  using buffer = basic_buffer<T, checked_space>;

  /// A space with the given settings (by default: no hold, no delay, the default timeout).
  explicit checked_space(checked_options options = {})
      : options_(options), alloc_(detail::checked_host_memory{&registry_}) {
    FEDSHARD_EXPECTS(options_.timeout.count() > 0,
                     "checked_space: expected a positive timeout, found ", options_.timeout.count(),
                     " s");
    FEDSHARD_EXPECTS(options_.delay.count() >= 0,
                     "checked_space: expected a delay of 0 us or more, found ",
                     options_.delay.count(), " us");
  }
  checked_space(const checked_space&) = delete;  // buffers and streams point at their space
  checked_space& operator=(const checked_space&) = delete;

  /// The settings the space was made with.
  const checked_options& options() const noexcept { return options_; }

  /// n zero elements, 64-byte aligned; the rest of the block holds NaN bytes.
  template <class T>
  buffer<T> allocate(std::size_t n) {
    FEDSHARD_EXPECTS(n <= ~std::size_t{0} / sizeof(T), "checked_space::allocate: ", n,
                     " elements of ", sizeof(T), " bytes do not fit in std::size_t");
    const block b = alloc_.allocate(n * sizeof(T));
    if (b.ptr != nullptr) {
      std::memset(b.ptr, 0, n * sizeof(T));
      registry_.set_live(b.ptr, n * sizeof(T));
    }
    return buffer<T>(*this, b, n);
  }
  /// Blocks requested from the system allocator so far.
  std::int64_t system_allocations() const { return alloc_.system_allocations(); }
  /// Takes a buffer's block back (called by the buffer): fails the streams whose tasks still
  /// use it (see the top of this header), then fills it with NaN bytes and caches it.
  void release_block(block b) noexcept {
    if (b.ptr == nullptr) return;
    const auto found = registry_.find(b.ptr);
    const std::size_t used = found ? found->info.used : b.bytes;
    {
      std::lock_guard lock(streams_mu_);
      for (const auto& weak : streams_)
        if (auto s = weak.lock()) s->retire_block(b.ptr, used);
    }
    alloc_.release(b);
  }

  /// A new stream with its own worker thread, named "stream <n>" in messages.
  stream make_stream() { return make_stream(std::string()); }
  /// A new stream with its own worker thread, named `stream_name` in messages.
  stream make_stream(std::string stream_name) {
    std::lock_guard lock(streams_mu_);
    ++streams_made_;
    if (stream_name.empty()) stream_name = fedshard::detail::concat("stream ", streams_made_);
    std::erase_if(streams_, [](const auto& weak) { return weak.expired(); });
    stream st;
    st.state_ = std::make_shared<detail::stream_state>(this, std::move(stream_name), options_);
    streams_.push_back(st.state_);
    try {
      st.worker_ = std::thread([s = st.state_] { s->work(); });
    } catch (const std::system_error& e) {
      throw backend_error(fedshard::detail::concat(
          "fedshard: checked_space::make_stream: could not start the worker thread of stream '",
          st.state_->name, "': ", e.what()));
    }
    return st;
  }

  /// The event after every task queued on st so far.
  event record(stream& st) {
    detail::stream_state& s = state_of(st, "checked_space::record");
    std::lock_guard lock(s.mu);
    return event(st.state_, s.queued_locked());
  }
  /// Queues on st a task that blocks its worker until ev completes (in hold mode, it asks
  /// for ev's work); it fails st with timeout_error after the timeout, or with the error of
  /// ev's stream if a task before ev failed.
  void wait(stream& st, const event& ev) {
    detail::stream_state& s = state_of(st, "checked_space::wait");
    if (ev.state_ == nullptr || ev.state_.get() == &s) return;  // nothing to wait for
    std::string what = fedshard::detail::concat("wait for an event of stream '", ev.state_->name,
                                                "' (its first ", ev.seq_, " tasks)");
    auto run = [producer = ev.state_, seq = ev.seq_, waiter = &s] {
      producer->await_from_stream(seq, *waiter);
    };
    queue(s, std::move(what), {}, std::move(run), true);
  }
  /// Blocks until ev completes; throws the error of its stream if a task before ev failed,
  /// timeout_error if the stream makes no progress for the timeout.
  void synchronize(const event& ev) {
    if (ev.state_ != nullptr) ev.state_->await_from_host(ev.seq_, "synchronize(event)");
  }
  /// Blocks until every task queued on st so far has completed; throws st's error if it
  /// failed, timeout_error if it makes no progress for the timeout.
  void synchronize(stream& st) {
    state_of(st, "checked_space::synchronize")
        .await_from_host(detail::stream_state::all_queued, "synchronize(stream)");
  }
  /// Whether ev has completed (synchronize(ev) would return or throw at once); asks for
  /// nothing, also in hold mode.
  bool ready(const event& ev) const {
    if (ev.state_ == nullptr) return true;
    std::lock_guard lock(ev.state_->mu);
    return ev.state_->completed >= ev.seq_;
  }

  /// Queues a copy between buffers of the space (which may overlap).
  void copy(stream& st, const_buffer_view from, buffer_view to) {
    queue_copy(st, from, to, "copy", false, false);
  }
  /// Queues a copy from a buffer of the space into host memory.
  void to_host(stream& st, const_buffer_view from, buffer_view host) {
    queue_copy(st, from, host, "to_host", false, true);
  }
  /// Queues a copy from host memory into a buffer of the space.
  void from_host(stream& st, const_buffer_view host, buffer_view to) {
    queue_copy(st, host, to, "from_host", true, false);
  }
  /// Queues kernels::cast from one buffer of the space into another.
  void cast(stream& st, const_buffer_view in, buffer_view out) {
    constexpr std::string_view what = "checked_space::cast";
    kernels::detail::check_cast_views(in, out, what);
    detail::stream_state& s = state_of(st, what);
    queue(s, "cast",
          {block_of(in.data, in.size_bytes(), what, "input", false),
           block_of(out.data, out.size_bytes(), what, "output", false)},
          [in, out] { kernels::cast(in, out); });
  }
  /// Queues out = value (converted to out's dtype) in every element.
  void fill(stream& st, buffer_view out, double value) {
    constexpr std::string_view what = "checked_space::fill";
    FEDSHARD_EXPECTS(is_valid(out.type), what, ": expected an output of f32, f64, bf16 or f16, ",
                     "found dtype value ", static_cast<int>(out.type));
    detail::stream_state& s = state_of(st, what);
    queue(s, "fill", {block_of(out.data, out.size_bytes(), what, "output", false)},
          [out, value] { space::detail::fill_host(out, value); });
  }
  /// Queues f(spans[i]...) for every i (kernels::for_each_element), with copies of f and of
  /// the spans, which must be buffers of the space of one size.
  template <class F, class... T>
  void for_each(stream& st, F f, std::span<T>... spans) {
    constexpr std::string_view what = "checked_space::for_each";
    const std::size_t n = space::detail::common_size("checked_space::for_each", spans...);
    detail::stream_state& s = state_of(st, what);
    queue(s, "for_each", {block_of(spans.data(), spans.size_bytes(), what, "array", false)...},
          [f = std::move(f), n, spans...] { kernels::for_each_element(f, n, spans.data()...); });
  }
  /// Queues out[j] = in[idx[j] - base] for j < idx.size() (kernels::gather_index; an index
  /// out of range fails the stream); in, idx and out are buffers of the space.
  void gather_index(stream& st, std::span<const float> in, std::span<const std::uint32_t> idx,
                    std::uint32_t base, std::span<float> out) {
    queue_index(st, in, idx, base, out, "gather_index", out.size());
  }
  /// Queues out[idx[j] - base] = in[j] for j < idx.size() (kernels::scatter_index).
  void scatter_index(stream& st, std::span<const float> in, std::span<const std::uint32_t> idx,
                     std::uint32_t base, std::span<float> out) {
    queue_index(st, in, idx, base, out, "scatter_index", in.size());
  }

  /// Queues f() on st, run by its worker in order like a kernel (as cudaLaunchHostFunc does);
  /// an exception it throws fails the stream. f must not use the space. `what` names it in
  /// messages.
  void host_task(stream& st, std::function<void()> f, std::string what = "host task") {
    FEDSHARD_EXPECTS(f != nullptr, "checked_space::host_task: expected a callable, found none");
    queue(state_of(st, "checked_space::host_task"), std::move(what), {}, std::move(f));
  }
  /// Keeps st's worker from starting tasks until resume(st), whatever needs them: a test
  /// hook for work that does not come, e.g. an event that never completes.
  void pause(stream& st) {
    detail::stream_state& s = state_of(st, "checked_space::pause");
    std::lock_guard lock(s.mu);
    s.paused = true;
  }
  /// Lets a paused stream's worker go on.
  void resume(stream& st) {
    detail::stream_state& s = state_of(st, "checked_space::resume");
    {
      std::lock_guard lock(s.mu);
      s.paused = false;
    }
    s.work_cv.notify_all();
  }

 private:
  /// Copies the bytes of a view into another of the same size (they may overlap).
  static void move_bytes(const_buffer_view from, buffer_view to) noexcept {
    if (to.count != 0 && from.data != to.data) std::memmove(to.data, from.data, to.size_bytes());
  }

  /// The state of a stream of this space; throws invalid_argument for any other.
  detail::stream_state& state_of(stream& st, std::string_view what) const {
    FEDSHARD_EXPECTS(st.state_ != nullptr, what,
                     ": expected a stream made by make_stream(), found an empty (moved-from) one");
    FEDSHARD_EXPECTS(st.state_->owner == this, what, ": expected a stream of this space, found '",
                     st.state_->name, "', a stream of another checked_space");
    return *st.state_;
  }

  /// The block of a live buffer of this space that holds [data, data + bytes) (nullptr for no
  /// bytes, or for host memory where host_ok); throws invalid_argument for memory of a
  /// released buffer, past the end of a buffer, or outside the space where !host_ok.
  void queue_index(stream& st, std::span<const float> in, std::span<const std::uint32_t> idx,
                   std::uint32_t base, std::span<float> out, std::string_view kind,
                   std::size_t packed) {
    const std::string what = fedshard::detail::concat("checked_space::", kind);
    FEDSHARD_EXPECTS(idx.size() == packed, what, ": expected as many indices as packed elements (",
                     packed, "), found ", idx.size());
    detail::stream_state& s = state_of(st, what);
    const bool gather = kind == "gather_index";
    queue(s, std::string(kind),
          {block_of(in.data(), in.size_bytes(), what, "input", false),
           block_of(idx.data(), idx.size_bytes(), what, "indices", false),
           block_of(out.data(), out.size_bytes(), what, "output", false)},
          [in, idx, base, out, gather] {
            if (gather)
              kernels::gather_index(in, idx, base, out);
            else
              kernels::scatter_index(in, idx, base, out);
          });
  }
  const void* block_of(const void* data, std::size_t bytes, std::string_view what,
                       std::string_view role, bool host_ok) const {
    if (bytes == 0) return nullptr;
    const auto found = registry_.find(data);
    if (!found) {
      FEDSHARD_EXPECTS(host_ok, what, ": expected the ", role,
                       " in a buffer of this space (from allocate<T>(n)), found other memory (",
                       bytes, " bytes at ", data, "), which a GPU kernel could not use");
      return nullptr;
    }
    const auto offset = static_cast<std::size_t>(static_cast<const std::byte*>(data) - found->base);
    FEDSHARD_EXPECTS(found->info.live, what, ": expected the ", role,
                     " in a live buffer, found a released one (", bytes, " bytes at ", data,
                     ", in a block back in the cache, filled with NaN): a use after release");
    FEDSHARD_EXPECTS(offset <= found->info.used && bytes <= found->info.used - offset, what,
                     ": expected the ", role, " inside its buffer of ", found->info.used,
                     " bytes, found ", bytes, " bytes from byte ", offset);
    return found->base;
  }

  /// Queues a copy of bytes for copy, to_host or from_host (`kind`), after their checks; the
  /// sides marked as host may be host memory.
  void queue_copy(stream& st, const_buffer_view from, buffer_view to, std::string_view kind,
                  bool host_from, bool host_to) {
    const std::string what = fedshard::detail::concat("checked_space::", kind);
    space::detail::check_copy(from, to, what.c_str());
    detail::stream_state& s = state_of(st, what);
    queue(s, std::string(kind),
          {block_of(from.data, from.size_bytes(), what, host_from ? "host source" : "source",
                    host_from),
           block_of(to.data, to.size_bytes(), what, host_to ? "host destination" : "destination",
                    host_to)},
          [from, to] { move_bytes(from, to); });
  }

  /// Queues a task on s.
  static void queue(detail::stream_state& s, std::string what, std::vector<const void*> blocks,
                    std::function<void()> run, bool is_wait = false) {
    std::erase(blocks, nullptr);
    s.push(detail::checked_task{.run = std::move(run),
                                .what = std::move(what),
                                .blocks = std::move(blocks),
                                .is_wait = is_wait});
  }

  checked_options options_;
  detail::block_registry registry_;  // outlives alloc_, whose destructor releases blocks
  caching_allocator<detail::checked_host_memory> alloc_;
  std::mutex streams_mu_;
  std::vector<std::weak_ptr<detail::stream_state>> streams_;
  std::uint64_t streams_made_ = 0;
};

static_assert(MemorySpace<checked_space>);

}  // namespace fedshard::space
