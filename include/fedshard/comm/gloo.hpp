#pragma once
/// The Gloo communicator: ranks are processes (of one job or of several) connected by Gloo's
/// TCP transport, which meet through a key-value store they can all reach.
///
/// Stores (`gloo::store`, a gloo::rendezvous::Store with create-if-absent and timeouts):
///  - file_store: a directory several jobs on one machine (or on a shared file system) can
///    reach; every key is a file, written to a temporary name and renamed (or linked, for
///    try_set) into place, so a reader never sees half a value;
///  - redis_store: a Redis server (Debian's redis-server), through hiredis; a lost
///    connection is made again with back-off.
/// Keys are never deleted: every context a communicator makes has its own key prefix.
///
/// The communicator follows the Communicator concept (comm/communicator.hpp):
///  - reductions are fedshard's rank-order reduction (comm/detail/reduction.hpp), so results
///    are bit-identical to inproc's and mpi's for every dtype and op: an all_reduce of at most
///    options::small_all_reduce_bytes (n * count * element size) all-gathers the inputs and
///    every rank reduces every element; a larger one sends chunk p of every input to rank p
///    (point to point, straight from the input), which reduces it straight into the output,
///    then sends it to every rank (received in place): in stages of at most
///    options::pipeline_bytes of each chunk, a second thread reducing stage s while stage s+1
///    is exchanged, and over options::stripes connections between every two ranks (stage s
///    on stripe s % stripes, each stripe its own Gloo context, transport thread and thread);
///    bench_link: 64 MiB between two processes at 8.5 Gbit/s on one stripe, 14.7 on 8, 2.8
///    in one stage on this 2-core machine. reduce_scatter is an alltoall of the blocks and a
///    local reduction;
///  - all_gather, broadcast and barrier are Gloo's; send and recv are Gloo unbound buffers
///    (slots derived from the tag, matched in order per sender, receiver and tag); a message
///    of 512 KiB or more is cut in contiguous pieces over the stripes (at least 256 KiB each,
///    the cut a function of its size alone), each stripe matching its pieces in order
///    (bench_link: 1 GiB from one process to another in 249 ms on one connection, 165 ms on
///    8);
///  - moved(): the bytes handed to Gloo for the data of each call (argument exchanges are not
///    counted): all_gather and reduce_scatter's alltoall (n-1) blocks each way; a small
///    all_reduce's all-gather (n-1) inputs each way (algorithm_of: gather_all); a large one's
///    exchange and gather of chunks padded to whole cache lines, 2 (n-1) padded chunks each
///    way, which is a ring's bytes plus the padding (however it is staged and striped); a broadcast
///    S received by every other rank, counted as sent by the root (Gloo may forward through other
///    ranks; the total is the same). A call is counted once it succeeded;
///  - collectives run when they are called (the *_async variants return a completed request,
///    or one that rethrows the call's error); send and recv are posted and complete in wait();
///  - checked mode (options::checked: on unless FEDSHARD_GLOO_CHECKED=0, in every build)
///    exchanges every call's arguments first (one small all-gather), so a mismatch throws
///    collective_mismatch and an invalid argument invalid_argument on every rank, with
///    inproc's messages; split always exchanges. Calls a plan vouches for (vouch(), capability
///    12 of comm/communicator.hpp: the interpreter vouches for the calls of each firing) are
///    exchanged until the ranks agree: the first call of a firing exchanges its arguments
///    with the fingerprint of the firing's calls; when every rank sent the same one, the
///    firing's other calls run without an exchange (their arguments follow from the plan the
///    ranks agreed on). options::every_call (FEDSHARD_GLOO_CHECKED=always, for debugging)
///    exchanges every call all the same; exchanges() counts them. Unchecked, a mismatched
///    collective is Gloo's to handle: its transport thread aborts the process on a size
///    mismatch;
///  - every call has a deadline (options::timeout: FEDSHARD_TIMEOUT_S, else 300 s): a peer
///    that does not answer in time gives timeout_error, a peer whose process died (its sockets
///    closed) gives peer_failure, as soon as the transport notices. After either the
///    communicator is unusable (later calls throw backend_error saying why); the processes of
///    the other ranks go on (this is what cross-job federation relies on). Every call into
///    Gloo or hiredis runs with SIGPIPE blocked in the calling thread (and Gloo's transport
///    thread starts with it blocked), so a write into the socket of a peer that died is
///    EPIPE, reported as peer_failure, and never ends this process (comm/detail/sigpipe.hpp;
///    the process's own SIGPIPE disposition is left alone).
///
/// Listening addresses: options::hostname (default 127.0.0.1, the loopback).
///
/// Naming: Gloo's own namespace is ::gloo; code that says `using namespace fedshard;` writes
/// fedshard::gloo:: for this one.

#include <fcntl.h>
#include <gloo/allgather.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <hiredis/hiredis.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "fedshard/comm/async_calls.hpp"
#include "fedshard/comm/blocking.hpp"
#include "fedshard/comm/communicator.hpp"
#include "fedshard/comm/detail/call.hpp"
#include "fedshard/comm/detail/reduction.hpp"
#include "fedshard/comm/detail/sigpipe.hpp"
#include "fedshard/comm/request.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/error.hpp"

namespace fedshard::gloo {

namespace detail {
using fedshard::detail::concat;

inline std::chrono::milliseconds to_ms(std::chrono::duration<double> d) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(d);
  return std::max(ms, std::chrono::milliseconds(1));
}

/// Polls `ready` with a growing sleep (1 ms to 20 ms) until it is true or `timeout` passed.
template <class F>
bool poll_until(F&& ready, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto nap = std::chrono::milliseconds(1);
  for (;;) {
    if (ready()) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::milliseconds(20));
  }
}
}  // namespace detail

/// A store that cannot do what was asked (its directory gone, its server unreachable): a
/// backend_error, told apart so that callers can outlive a store that is away.
class store_error : public backend_error {
 public:
  using backend_error::backend_error;
};

/// A key-value store several processes reach: the rendezvous of Gloo contexts (it is a
/// gloo::rendezvous::Store) and the meeting point of cross-job federation. Values are bytes.
/// Thread-safe.
class store : public ::gloo::rendezvous::Store {
 public:
  /// Sets key to value (replacing a value already there).
  void set(const std::string& key, const std::vector<char>& value) override = 0;
  /// Sets key to value unless the key exists; true when this call created it.
  virtual bool try_set(const std::string& key, const std::vector<char>& value) = 0;
  /// The value of key if it exists (no waiting), else nothing: `found` says which.
  virtual std::vector<char> try_get(const std::string& key, bool& found) = 0;
  /// True when the key exists.
  bool has(const std::string& key) {
    bool found = false;
    (void)try_get(key, found);
    return found;
  }
  /// The value of key, waiting up to the store's timeout for it (timeout_error naming it).
  std::vector<char> get(const std::string& key) override { return get(key, timeout_); }
  /// The value of key, waiting up to `timeout` for it (timeout_error naming the key).
  std::vector<char> get(const std::string& key, std::chrono::milliseconds timeout) {
    std::vector<char> value;
    bool found = false;
    if (!detail::poll_until(
            [&] {
              value = try_get(key, found);
              return found;
            },
            timeout))
      throw timeout_error(detail::concat("fedshard: ", name(), ": key '", key,
                                         "' did not appear within ", timeout.count(), " ms"));
    return value;
  }
  /// Waits until every key exists (timeout_error naming the first missing one).
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    for (const auto& k : keys) (void)get(k, timeout);
  }
  /// The value as a string.
  std::string get_string(const std::string& key, std::chrono::milliseconds timeout) {
    const auto v = get(key, timeout);
    return {v.begin(), v.end()};
  }
  /// The default timeout of get() and wait() without one.
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  /// "file_store(<dir>)" or "redis_store(<host>:<port>)".
  virtual std::string name() const = 0;

 private:
  std::chrono::milliseconds timeout_ = detail::to_ms(fedshard::detail::default_timeout());
};

/// Bytes of a string.
inline std::vector<char> bytes_of(std::string_view s) {
  return {s.begin(), s.end()};
}

/// A store in a directory: one file per key (its name the key with every byte other than
/// [A-Za-z0-9._-] written as %XX). The directory is made if missing.
class file_store final : public store {
 public:
  explicit file_store(std::filesystem::path dir) : dir_(std::move(dir)) {
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    FEDSHARD_EXPECTS(std::filesystem::is_directory(dir_), "file_store: cannot use directory '",
                     dir_.string(), "'", ec ? ": " + ec.message() : std::string());
  }

  void set(const std::string& key, const std::vector<char>& value) override {
    const auto tmp = write_temp(value);
    if (std::rename(tmp.c_str(), path(key).c_str()) != 0) {
      const int e = errno;
      std::remove(tmp.c_str());
      check_directory("cannot set key '" + key + "'");
      throw store_error(
          detail::concat("fedshard: ", name(), ": cannot set key '", key, "': ", std::strerror(e)));
    }
  }
  bool try_set(const std::string& key, const std::vector<char>& value) override {
    const auto tmp = write_temp(value);
    const int rc = ::link(tmp.c_str(), path(key).c_str());
    const int e = errno;
    std::remove(tmp.c_str());
    if (rc == 0) return true;
    if (e == EEXIST) return false;
    check_directory("cannot create key '" + key + "'");
    throw store_error(detail::concat("fedshard: ", name(), ": cannot create key '", key,
                                     "': ", std::strerror(e)));
  }
  std::vector<char> try_get(const std::string& key, bool& found) override {
    std::ifstream in(path(key), std::ios::binary);
    found = static_cast<bool>(in);
    if (!found) {
      check_directory("cannot read key '" + key + "'");
      return {};
    }
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }
  std::string name() const override { return "file_store(" + dir_.string() + ")"; }
  const std::filesystem::path& directory() const noexcept { return dir_; }

 private:
  std::string path(const std::string& key) const {
    std::string file;
    for (unsigned char ch : key) {
      if (std::isalnum(ch) || ch == '.' || ch == '_' || ch == '-') {
        file += static_cast<char>(ch);
      } else {
        char hex[4];
        std::snprintf(hex, sizeof hex, "%%%02X", ch);
        file += hex;
      }
    }
    if (file.empty() || file[0] == '.') file = "%" + file;  // never hidden, never a temp name
    return (dir_ / file).string();
  }
  std::string write_temp(const std::vector<char>& value) {
    static std::atomic<std::uint64_t> counter{0};
    const auto tmp = (dir_ / detail::concat(".tmp.", ::getpid(), '.', counter++)).string();
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      out.write(value.data(), static_cast<std::streamsize>(value.size()));
      out.flush();
      if (!out) {
        check_directory("cannot write a value");
        throw store_error(detail::concat("fedshard: ", name(), ": cannot write '", tmp, "'"));
      }
    }
    return tmp;
  }
  /// Throws backend_error naming the store's directory when it is gone (removed, or its
  /// file system unmounted, while the store was in use): every key would be missing, and
  /// waiting for one would only end in a timeout that names the key, not the cause.
  void check_directory(const std::string& doing) const {
    std::error_code ec;
    if (std::filesystem::is_directory(dir_, ec)) return;
    throw store_error(detail::concat("fedshard: ", name(), ": ", doing, ": the store's directory '",
                                     dir_.string(), "' no longer exists",
                                     ec ? " (" + ec.message() + ")" : std::string(),
                                     "; was it removed while groups were using it?"));
  }
  std::filesystem::path dir_;
};

/// A store on a Redis server (SET, SET NX and GET through hiredis). The connection is made
/// at construction: backend_error naming host and port when the server cannot be reached.
/// A connection lost later (the server restarted, a network blip, a server that does not
/// answer a command within 5 s) is made again with back-off (50 ms, doubling to 1 s) for up
/// to `reconnect_for` (30 s by default) per call, and the command sent again; past that the
/// call throws backend_error saying the server is unreachable. SET and GET are idempotent; a
/// SET NX whose first reply was lost checks whether the key now holds its own value.
/// A restarted server without persistence comes back empty: keys written before are gone
/// (run it with --appendonly yes if the groups must find them again).
class redis_store final : public store {
 public:
  /// Connects to the server at host:port (backend_error at once when nobody answers). A
  /// connection lost later is retried for `reconnect_for` (see the class comment).
  explicit redis_store(std::string host = "127.0.0.1", int port = 6379,
                       std::chrono::milliseconds reconnect_for = std::chrono::seconds(30))
      : host_(std::move(host)), port_(port), reconnect_for_(reconnect_for) {
    FEDSHARD_EXPECTS(reconnect_for.count() >= 0,
                     "redis_store: reconnect_for must be >= 0 ms, found ", reconnect_for.count());
    ctx_ = redisConnectWithTimeout(host_.c_str(), port_, command_timeout());
    if (ctx_ == nullptr || ctx_->err != 0) {
      const std::string why = ctx_ ? ctx_->errstr : "out of memory";
      if (ctx_) redisFree(ctx_);
      throw store_error(detail::concat("fedshard: redis_store: cannot connect to ", host_, ':',
                                       port_, ": ", why, " (is redis-server running there?)"));
    }
    (void)redisSetTimeout(ctx_, command_timeout());
  }
  redis_store(const redis_store&) = delete;
  redis_store& operator=(const redis_store&) = delete;
  ~redis_store() override { redisFree(ctx_); }

  void set(const std::string& key, const std::vector<char>& value) override {
    auto r = command("SET", key, &value, false);
    freeReplyObject(r.reply);
  }
  bool try_set(const std::string& key, const std::vector<char>& value) override {
    auto r = command("SET", key, &value, true);
    bool created = r.reply->type == REDIS_REPLY_STATUS;
    freeReplyObject(r.reply);
    if (!created && r.resent) {
      // The first SET NX may have been applied before its reply was lost: the key then holds
      // exactly our value. (A peer that created it with the very same bytes is taken for us;
      // for create-if-absent decisions the outcome is the same.)
      bool found = false;
      created = try_get(key, found) == value && found;
    }
    return created;
  }
  std::vector<char> try_get(const std::string& key, bool& found) override {
    auto r = command("GET", key, nullptr, false);
    found = r.reply->type == REDIS_REPLY_STRING;
    std::vector<char> v;
    if (found) v.assign(r.reply->str, r.reply->str + r.reply->len);
    freeReplyObject(r.reply);
    return v;
  }
  std::string name() const override {
    return detail::concat("redis_store(", host_, ':', port_, ")");
  }
  /// How many times a lost connection was made again.
  std::int64_t reconnects() const {
    std::lock_guard lock(mu_);
    return reconnects_;
  }

 private:
  /// A reply, and whether the command was sent more than once (a connection was lost after
  /// sending it, so the server may have applied the first one).
  struct answer {
    redisReply* reply = nullptr;
    bool resent = false;
  };
  /// The bound of one command's round trip (and of a connect): a server that stops answering
  /// counts as lost.
  static timeval command_timeout() { return timeval{5, 0}; }

  redisReply* issue(const char* verb, const std::string& key, const std::vector<char>* value,
                    bool nx) {
    void* reply = nullptr;
    if (value == nullptr)
      reply = redisCommand(ctx_, "%s %b", verb, key.data(), key.size());
    else if (nx)
      reply = redisCommand(ctx_, "%s %b %b NX", verb, key.data(), key.size(), value->data(),
                           value->size());
    else
      reply = redisCommand(ctx_, "%s %b %b", verb, key.data(), key.size(), value->data(),
                           value->size());
    return static_cast<redisReply*>(reply);
  }

  answer command(const char* verb, const std::string& key, const std::vector<char>* value,
                 bool nx) {
    std::lock_guard lock(mu_);
    const fedshard::detail::sigpipe_shield shield;  // a Redis server that went away is an error
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + reconnect_for_;
    auto pause = std::chrono::milliseconds(50);
    answer a;
    bool sent = false;
    std::string last;
    for (;;) {
      if (connected_) {
        a.resent = sent;
        a.reply = issue(verb, key, value, nx);
        sent = true;
        if (a.reply != nullptr) break;
        last = ctx_->errstr;  // the connection is lost: hiredis cannot use this context again
        connected_ = false;
      }
      const auto now = clock::now();
      if (now >= deadline)
        throw store_error(detail::concat("fedshard: ", name(), ": ", verb, " '", key,
                                         "' failed: the server is unreachable (", last,
                                         "), retried for ", reconnect_for_.count(),
                                         " ms; is redis-server still running there?"));
      std::this_thread::sleep_for(std::min<clock::duration>(pause, deadline - now));
      pause = std::min(pause * 2, std::chrono::milliseconds(1000));
      if (redisReconnect(ctx_) == REDIS_OK) {
        (void)redisSetTimeout(ctx_, command_timeout());
        connected_ = true;
        ++reconnects_;
      } else {
        last = ctx_->errstr;
      }
    }
    if (a.reply->type == REDIS_REPLY_ERROR) {
      const std::string why(a.reply->str, a.reply->len);
      freeReplyObject(a.reply);
      throw store_error(
          detail::concat("fedshard: ", name(), ": ", verb, " '", key, "' failed: ", why));
    }
    return a;
  }
  std::string host_;
  int port_;
  std::chrono::milliseconds reconnect_for_;
  redisContext* ctx_ = nullptr;
  bool connected_ = true;
  std::int64_t reconnects_ = 0;
  mutable std::mutex mu_;
};

/// Settings of a Gloo communicator (the ranks must agree on all but timeout).
struct options {
  /// The deadline of every call (rendezvous included): FEDSHARD_TIMEOUT_S, else 300 s.
  std::chrono::duration<double> timeout = fedshard::detail::default_timeout();
  /// The address this rank listens on (the loopback by default).
  std::string hostname = "127.0.0.1";
  /// Exchange every collective's arguments first (see the file comment): on by default,
  /// since a cross-job link's calls are few and large, and Gloo aborts on a mismatch.
  bool checked = fedshard::detail::env_flag("FEDSHARD_GLOO_CHECKED", true);
  /// Checked mode exchanges every call's arguments, also those of a firing whose plan the
  /// ranks agreed on (see the file comment): FEDSHARD_GLOO_CHECKED=always.
  bool every_call = fedshard::detail::env_is("FEDSHARD_GLOO_CHECKED", "always");
  /// all_reduce of at most this many bytes (ranks x count x element size) all-gathers.
  std::int64_t small_all_reduce_bytes = 256 * 1024;
  /// A larger all_reduce exchanges each rank's chunk in stages of at most this many bytes,
  /// reducing one stage while the next is exchanged; 0: one stage (no overlap).
  std::int64_t pipeline_bytes = 1 << 20;
  /// Connections between every two ranks (1 to 64): a larger all_reduce's stages go round
  /// the stripes, each on its own Gloo context, device (transport thread) and thread, and a
  /// large send or recv is cut over them.
  int stripes = 1;
  /// The deadline of connecting the context (meeting the peers and making the pairs);
  /// 0: Gloo's own, 5 x timeout.
  std::chrono::duration<double> connect_timeout{0};
};

/// The Gloo communicator (see the file comment). Movable; calls from one thread at a time.
class communicator : public blocking_calls<communicator>, public async_calls<communicator> {
 public:
  using blocking_calls<communicator>::all_reduce;

  /// Collective over `size` processes: rank `rank` of the context named `prefix` in store
  /// `st` (every rank passes the same prefix; a prefix names one context, once). Connects a
  /// full mesh of TCP pairs; timeout_error when the others do not arrive within the timeout.
  communicator(std::shared_ptr<store> st, std::string prefix, int rank, int size, options o = {})
      : s_(std::make_unique<state>()) {
    FEDSHARD_EXPECTS(st != nullptr, "gloo::communicator: the store is null");
    FEDSHARD_EXPECTS(size >= 1 && rank >= 0 && rank < size,
                     "gloo::communicator: rank must be in [0, size) with size >= 1, found rank ",
                     rank, " of ", size);
    s_->kv = std::move(st);
    s_->prefix = std::move(prefix);
    s_->rank = rank;
    s_->size = size;
    s_->opts = std::move(o);
    FEDSHARD_EXPECTS(s_->opts.stripes >= 1 && s_->opts.stripes <= 64,
                     "gloo::communicator: options::stripes must be in [1, 64], found ",
                     s_->opts.stripes);
    FEDSHARD_EXPECTS(s_->opts.pipeline_bytes >= 0,
                     "gloo::communicator: options::pipeline_bytes must be >= 0 (0: one stage), "
                     "found ",
                     s_->opts.pipeline_bytes);
    ::gloo::transport::tcp::attr attr;
    attr.hostname = s_->opts.hostname;
    try {
      const fedshard::detail::sigpipe_shield
          shield;  // the transport thread starts with SIGPIPE blocked
      s_->device = ::gloo::transport::tcp::CreateDevice(attr);
      for (int k = 1; k < s_->opts.stripes; ++k)
        s_->stripe_devices.push_back(::gloo::transport::tcp::CreateDevice(attr));
    } catch (const std::exception& e) {
      throw backend_error(detail::concat("fedshard: gloo::communicator: cannot listen on ",
                                         s_->opts.hostname, ": ", e.what()));
    }
    connect();
  }

  communicator(communicator&&) noexcept = default;
  communicator& operator=(communicator&&) noexcept = default;
  ~communicator() = default;

  int rank() const noexcept { return s_->rank; }
  int size() const noexcept { return s_->size; }
  /// The bytes handed to Gloo for the data of the calls so far (see the file comment).
  moved_bytes moved() const noexcept { return s_->moved; }
  /// A small all_reduce (n ranks x count x element size up to small_all_reduce_bytes)
  /// gathers every input; everything else moves a ring's bytes (plus chunk padding).
  wire_algorithm algorithm_of(collective k, std::int64_t n, dtype t) const {
    const bool small = is_valid(t) && n * s_->size * static_cast<std::int64_t>(size_of(t)) <=
                                          s_->opts.small_all_reduce_bytes;
    return k == collective::all_reduce && s_->size > 1 && small ? wire_algorithm::gather_all
                                                                : wire_algorithm::ring;
  }
  /// The context's key prefix in the store.
  const std::string& prefix() const noexcept { return s_->prefix; }
  /// The store the ranks met through.
  const std::shared_ptr<store>& meeting_store() const noexcept { return s_->kv; }
  const options& settings() const noexcept { return s_->opts; }

  /// Capability 12 (comm/communicator.hpp): the calls made from now on belong to a firing
  /// whose calls on this communicator have fingerprint `fingerprint` (0: none; a call that
  /// is no plan's), `first` when the next one is the firing's first. Checked mode skips the
  /// exchange of a firing's later calls once the ranks agreed on it (see the file comment).
  void vouch(std::uint64_t fingerprint, bool first) noexcept {
    s_->vouched = fingerprint;
    s_->first = first;
  }
  /// The argument exchanges of checked mode so far (splits included).
  std::int64_t exchanges() const noexcept { return s_->exchanges; }

  /// Collective: the communicator of the ranks that passed the same color (>= 0), ordered
  /// by key then rank; a new Gloo context under this one's prefix.
  communicator split(int color, int key) {
    auto a = fedshard::detail::make_call(fedshard::detail::op_kind::split, nullptr, nullptr, 0,
                                         dtype::f32);
    a.color = color;
    a.key = key;
    const auto all = exchange(a, false);  // always: split must agree
    std::vector<std::pair<std::int64_t, int>> members;
    for (int p = 0; p < s_->size; ++p)
      if (all[static_cast<std::size_t>(p)].color == color)
        members.emplace_back(all[static_cast<std::size_t>(p)].key, p);
    std::sort(members.begin(), members.end());
    int me = 0;
    for (std::size_t i = 0; i < members.size(); ++i)
      if (members[i].second == s_->rank) me = static_cast<int>(i);
    const auto seq = s_->splits++;
    return communicator(s_->kv, detail::concat(s_->prefix, "/split", seq, "c", color), me,
                        static_cast<int>(members.size()), s_->opts, s_->device, s_->stripe_devices);
  }

 private:
  friend class async_calls<communicator>;
  using call_args = fedshard::detail::call_args;
  using op_kind = fedshard::detail::op_kind;
  using call_summary = fedshard::detail::call_summary;

  /// A posted receive of a message to itself.
  struct self_receive {
    char* out = nullptr;
    std::size_t bytes = 0;
    int tag = 0;
    bool done = false;
    std::string error;
  };
  /// Messages to itself on one tag: sent and not yet received, or receives still waiting.
  struct self_box {
    std::deque<std::vector<char>> messages;
    std::deque<std::shared_ptr<self_receive>> receivers;
  };

  struct state {
    // Buffers Gloo's transport writes into, declared before the contexts so that they are
    // freed after them: after an op failed (a peer died), a receive it had posted from a
    // live peer may still land, and must land in memory we have not freed.
    std::vector<std::vector<char>> scratch;    // a large all_reduce's buffers, per stripe
    std::vector<std::int64_t> exchange_words;  // checked mode's argument exchange
    std::shared_ptr<gloo::store> kv;
    std::string prefix;
    int rank = 0;
    int size = 1;
    options opts;
    std::shared_ptr<::gloo::transport::Device> device;
    std::shared_ptr<::gloo::rendezvous::Context> ctx;
    std::vector<std::shared_ptr<::gloo::transport::Device>> stripe_devices;  // stripes 1, 2, ...
    std::vector<std::shared_ptr<::gloo::rendezvous::Context>> stripes;       // and their contexts
    std::uint64_t seq = 0;
    int splits = 0;
    std::uint64_t vouched = 0;  // the fingerprint vouch() gave for the next calls (0: none)
    bool first = true;          // whether the next call is the first of its firing
    std::uint64_t agreed = 0;   // the firing fingerprint every rank sent (0: none agreed)
    std::int64_t exchanges = 0;
    std::string broken;               // why the communicator is unusable, empty while it is fine
    moved_bytes moved;                // the data handed to Gloo so far (see the file comment)
    std::map<int, self_box> mailbox;  // messages to itself, per tag
  };

  communicator(std::shared_ptr<store> st, std::string prefix, int rank, int size, options o,
               std::shared_ptr<::gloo::transport::Device> dev,
               std::vector<std::shared_ptr<::gloo::transport::Device>> stripe_devices)
      : s_(std::make_unique<state>()) {
    s_->kv = std::move(st);
    s_->prefix = std::move(prefix);
    s_->rank = rank;
    s_->size = size;
    s_->opts = std::move(o);
    s_->device = std::move(dev);
    s_->stripe_devices = std::move(stripe_devices);
    connect();
  }

  std::chrono::milliseconds timeout() const { return timeout_of(*s_); }
  static std::chrono::milliseconds timeout_of(const state& s) {
    return detail::to_ms(s.opts.timeout);
  }

  void connect() {
    s_->ctx = std::make_shared<::gloo::rendezvous::Context>(s_->rank, s_->size);
    s_->ctx->setTimeout(timeout());
    if (s_->size == 1) return;  // nobody to connect to
    ::gloo::rendezvous::PrefixStore prefixed(s_->prefix, *s_->kv);
    const fedshard::detail::sigpipe_shield shield;
    const auto connect_in = s_->opts.connect_timeout.count() > 0
                                ? detail::to_ms(s_->opts.connect_timeout)
                                : 5 * timeout();
    try {
      connect_mesh(s_->ctx, prefixed, s_->device, connect_in);
      for (std::size_t k = 0; k < s_->stripe_devices.size(); ++k) {
        s_->stripes.push_back(std::make_shared<::gloo::rendezvous::Context>(s_->rank, s_->size));
        ::gloo::rendezvous::PrefixStore stripe(detail::concat(s_->prefix, "/stripe", k + 1),
                                               *s_->kv);
        connect_mesh(s_->stripes.back(), stripe, s_->stripe_devices[k], connect_in);
      }
    } catch (const fedshard::error& e) {
      throw timeout_error(detail::concat("fedshard: gloo::communicator: rank ", s_->rank, " of ",
                                         s_->size, " ('", s_->prefix,
                                         "') could not meet its peers: ", e.what()));
    } catch (const std::exception& e) {
      throw backend_error(detail::concat("fedshard: gloo::communicator: rank ", s_->rank, " of ",
                                         s_->size, " ('", s_->prefix,
                                         "') could not connect: ", e.what()));
    }
  }

  /// Connects ctx's pairs through the store within connect_in.
  void connect_mesh(const std::shared_ptr<::gloo::rendezvous::Context>& ctx,
                    ::gloo::rendezvous::Store& st, std::shared_ptr<::gloo::transport::Device> dev,
                    std::chrono::milliseconds connect_in) {
    // Gloo waits 5 x the context's timeout for a pair to connect, 1 x for an address.
    ctx->setTimeout(std::max(connect_in / 5, std::chrono::milliseconds(1)));
    ctx->connectFullMesh(st, dev);
    // connectFullMesh can return on one rank while a peer still completes its side of their
    // pair; a rank that then closed the context at once (a split used and dropped, an
    // elastic round abandoned) would fail that peer's connect. The barrier makes the
    // constructor's promise symmetric: when it returns anywhere, every rank has connected.
    ::gloo::BarrierOptions all_connected(ctx);
    all_connected.setTimeout(connect_in);
    ::gloo::barrier(all_connected);
    ctx->setTimeout(timeout());
  }

  /// Runs f(), turning Gloo's errors into fedshard's (and marking the communicator broken).
  template <class F>
  void guarded(const char* what, F&& f) {
    guard(*s_, what, std::forward<F>(f));
  }
  template <class F>
  static void guard(state& s, const char* what, F&& f) {
    const auto* s_ = &s;  // the messages below read the state as the members do
    if (!s_->broken.empty())
      throw backend_error(detail::concat("fedshard: gloo::communicator (rank ", s_->rank, " of ",
                                         s_->size,
                                         ") is unusable after an earlier failure: ", s_->broken));
    const fedshard::detail::sigpipe_shield shield;  // a closed peer is an error, not the end of us
    try {
      f();
    } catch (const fedshard::error&) {
      throw;
    } catch (const ::gloo::IoException& e) {
      const std::string msg = e.what();
      const bool timed_out = msg.find("imed out") != std::string::npos;
      s.broken = detail::concat(what, " #", s_->seq, ": ", msg);
      const auto text = detail::concat(
          "fedshard: gloo ", what, " on rank ", s_->rank, " of ", s_->size, " (call #", s_->seq,
          "): ", timed_out ? "timed out after " : "a peer failed: ",
          timed_out ? detail::concat(timeout_of(s).count(), " ms: ") : std::string(), msg);
      if (timed_out) throw timeout_error(text);
      throw peer_failure(text);
    } catch (const std::exception& e) {
      s.broken = detail::concat(what, " #", s_->seq, ": ", e.what());
      throw backend_error(detail::concat("fedshard: gloo ", what, " on rank ", s_->rank, " of ",
                                         s_->size, " (call #", s_->seq, "): ", e.what()));
    }
  }

  void gather_bytes(const void* in, void* out, std::size_t bytes) {
    ::gloo::AllgatherOptions o(s_->ctx);
    o.setInput(static_cast<char*>(const_cast<void*>(in)), bytes);
    o.setOutput(static_cast<char*>(out), bytes * static_cast<std::size_t>(s_->size));
    o.setTimeout(timeout());
    ::gloo::allgather(o);
  }
  void alltoall_bytes(const void* in, void* out, std::size_t bytes_per_rank) {
    ::gloo::AlltoallOptions o(s_->ctx);
    const auto total = bytes_per_rank * static_cast<std::size_t>(s_->size);
    o.setInput(static_cast<char*>(const_cast<void*>(in)), total);
    o.setOutput(static_cast<char*>(out), total);
    o.setTimeout(timeout());
    ::gloo::alltoall(o);
  }

  /// Every rank's summary of call a (all-gathered), checked: throws the same error everywhere.
  /// Every rank's summary of call a (all-gathered with the fingerprint vouched for it, and
  /// whether it is its firing's first call), checked: throws the same error everywhere.
  /// Agreed on a fingerprint when every rank sent the same one (not 0) with a first call:
  /// from there on the ranks make the same calls of the same firing.
  std::vector<call_summary> exchange(const call_args& a, bool first) {
    ++s_->seq;
    ++s_->exchanges;
    constexpr int per = call_summary::words + 1;
    std::array<std::int64_t, per> mine{};
    const auto summary = fedshard::detail::summarize(a, s_->rank, s_->size).pack();
    std::copy(summary.begin(), summary.end(), mine.begin());
    // A first call's fingerprint, else 0 (two ranks at different calls of a firing of the
    // same plan never agree).
    mine.back() = first ? static_cast<std::int64_t>(s_->vouched) : 0;
    std::vector<std::int64_t>& words = s_->exchange_words;  // outlives a failed gather (state)
    words.assign(mine.size() * static_cast<std::size_t>(s_->size), 0);
    s_->agreed = 0;
    if (s_->size == 1) {
      std::copy(mine.begin(), mine.end(), words.begin());
    } else {
      guarded("argument exchange", [&] { gather_bytes(mine.data(), words.data(), sizeof mine); });
    }
    std::vector<call_summary> all;
    bool same = mine.back() != 0;
    for (int p = 0; p < s_->size; ++p) {
      all.push_back(call_summary::unpack(words.data() + p * per));
      same = same && words[static_cast<std::size_t>(p * per + per - 1)] == mine.back();
    }
    fedshard::detail::check_calls(all, s_->seq);
    if (same) s_->agreed = s_->vouched;
    return all;
  }

  /// True when call a may skip checked mode's exchange: it continues a firing whose
  /// fingerprint every rank sent with the firing's first call.
  bool vouched_for() const noexcept {
    return !s_->opts.every_call && !s_->first && s_->vouched != 0 && s_->vouched == s_->agreed;
  }

  /// Runs a collective now; its error (if any) is rethrown by the request's wait().
  request collective(const call_args& a) {
    return run_now([&] { run_collective(a); });
  }

  void run_collective(const call_args& a) {
    const bool skip = vouched_for(), first = s_->first;
    s_->first = false;  // a call that makes several: the first one checks the firing
    if (s_->opts.checked && !skip) {
      exchange(a, first);
    } else {
      ++s_->seq;
      const auto why = fedshard::detail::validate(
          fedshard::detail::summarize(a, s_->rank, s_->size), s_->rank, s_->size);
      if (!why.empty())
        throw fedshard::detail::invalid_call(a.kind, s_->rank, s_->size, s_->seq, why);
    }
    const int n = s_->size;
    const std::size_t esz = a.count > 0 ? size_of(a.type) : 0;
    const auto cnt = static_cast<std::size_t>(std::max<std::int64_t>(a.count, 0));
    const auto bytes = cnt * esz;
    guarded(fedshard::detail::to_string(a.kind), [&] {
      switch (a.kind) {
        case op_kind::barrier: {
          if (n == 1) return;
          ::gloo::BarrierOptions o(s_->ctx);
          o.setTimeout(timeout());
          ::gloo::barrier(o);
          return;
        }
        case op_kind::broadcast: {
          if (n == 1 || bytes == 0) return;
          ::gloo::BroadcastOptions o(s_->ctx);
          o.setOutput(static_cast<char*>(a.out), bytes);
          o.setRoot(a.root);
          o.setTimeout(timeout());
          ::gloo::broadcast(o);
          const auto b = static_cast<std::int64_t>(bytes);
          s_->moved += s_->rank == a.root ? moved_bytes{(n - 1) * b, 0} : moved_bytes{0, b};
          return;
        }
        case op_kind::all_gather: {
          if (bytes == 0) return;
          auto* out = static_cast<char*>(a.out);
          std::vector<char> in(static_cast<const char*>(a.in),
                               static_cast<const char*>(a.in) + bytes);
          if (n == 1) {
            std::memcpy(out, in.data(), bytes);
            return;
          }
          gather_bytes(in.data(), out, bytes);
          count_both((n - 1) * bytes);
          return;
        }
        case op_kind::reduce_scatter: {
          if (bytes == 0) return;
          std::vector<char> blocks(bytes * static_cast<std::size_t>(n));
          if (n == 1)
            std::memcpy(blocks.data(), a.in, bytes);
          else
            alltoall_bytes(a.in, blocks.data(), bytes);
          count_both((n - 1) * bytes);
          fedshard::detail::reduce_blocks(a.type, a.op, blocks.data(), bytes, n, a.out, a.count);
          return;
        }
        case op_kind::all_reduce: {
          if (bytes == 0) return;
          all_reduce_now(a, n, esz, cnt);
          return;
        }
        case op_kind::split: break;
      }
      throw invalid_argument("fedshard: gloo::communicator: split is not a data collective");
    });
  }

  void all_reduce_now(const call_args& a, int n, std::size_t esz, std::size_t cnt) {
    const auto bytes = cnt * esz;
    const auto un = static_cast<std::size_t>(n);
    if (n == 1 || static_cast<std::int64_t>(bytes * un) <= s_->opts.small_all_reduce_bytes) {
      std::vector<char> all(bytes * un);
      if (n == 1)
        std::memcpy(all.data(), a.in, bytes);
      else
        gather_bytes(a.in, all.data(), bytes);
      count_both((un - 1) * bytes);
      fedshard::detail::reduce_blocks(a.type, a.op, all.data(), bytes, n, a.out, a.count);
      return;
    }
    // Chunk p of every input goes to rank p, which reduces it; then the chunks are gathered,
    // in stages (see stage_cut): stage s on stripe s % stripes, each stripe's stages in
    // order on its own context and thread, reducing one while exchanging the next.
    const stage_cut cut(a, n, esz, s_->opts.pipeline_bytes);
    const auto lanes = static_cast<std::int64_t>(s_->stripes.size()) + 1;
    s_->scratch.resize(static_cast<std::size_t>(lanes));  // before the lanes' threads start
    std::vector<std::future<void>> others;
    for (std::int64_t k = 1; k < std::min(lanes, cut.stages); ++k)
      others.push_back(std::async(std::launch::async, [this, &cut, k, lanes] {
        run_stripe(cut, s_->stripes[static_cast<std::size_t>(k - 1)], k, lanes);
      }));
    std::exception_ptr failed;
    try {
      run_stripe(cut, s_->ctx, 0, lanes);
    } catch (...) {
      failed = std::current_exception();
    }
    for (auto& f : others) try {
        f.get();
      } catch (...) {
        if (!failed) failed = std::current_exception();
      }
    if (failed) std::rethrow_exception(failed);
    // The chunks out and in, then the reduced chunks out and in: summed over the stages and
    // stripes, what one exchange of the whole chunks moves.
    count_both(2 * (un - 1) * static_cast<std::size_t>(cut.chunk) * esz);
  }

  /// A large all_reduce cut in stages: chunk p (chunk elements, whole cache lines) of every
  /// input belongs to rank p; stage s of a chunk is its elements [s * stage, min(chunk,
  /// (s+1) * stage)), stage being whole cache lines of at most pipeline_bytes (the whole chunk
  /// when pipeline_bytes is 0).
  struct stage_cut {
    stage_cut(const call_args& call, int ranks, std::size_t elem, std::int64_t pipeline_bytes)
        : a(call),
          n(ranks),
          esz(elem),
          chunk(fedshard::detail::chunk_elems(call.count, ranks, elem)),
          stage(stage_elems(chunk, elem, pipeline_bytes)),
          stages((chunk + stage - 1) / stage) {}
    std::int64_t len(std::int64_t s) const { return std::min(stage, chunk - s * stage); }
    const call_args& a;
    int n;
    std::size_t esz;
    std::int64_t chunk, stage, stages;
  };

  /// Stripe k of `lanes` runs stages k, k + lanes, ... of cut on context ctx (see
  /// pipelined_stages and stripe_lane).
  void run_stripe(const stage_cut& c, const std::shared_ptr<::gloo::rendezvous::Context>& ctx,
                  std::int64_t k, std::int64_t lanes) {
    stripe_lane lane(c, ctx, s_->rank, timeout(), s_->scratch[static_cast<std::size_t>(k)]);
    const auto stage_of = [&](std::int64_t i) { return k + i * lanes; };
    pipelined_stages((c.stages - k + lanes - 1) / lanes,
                     [&](std::int64_t i) { lane.exchange(stage_of(i), i % 2); },
                     [&](std::int64_t i) { lane.reduce(stage_of(i), i % 2); },
                     [&](std::int64_t i) { lane.gather(stage_of(i)); });
  }

  /// One stripe's stages, point to point: every rank sends block p of stage s straight from
  /// the input to rank p, which sums the blocks in rank order straight into the output, then
  /// sends its reduced stage straight from the output to every rank, which receives it in
  /// place. Only a block that crosses the end of the message (its padding) and the rank's
  /// own block go through a copy. In place (in == out) is safe: a stage's positions are read
  /// (sent, or copied for the own block) before they are written. Received blocks alternate
  /// between two buffers, so stage s is reduced while the next one arrives.
  struct stripe_lane {
    using buffer = std::unique_ptr<::gloo::transport::UnboundBuffer>;
    static constexpr std::uint64_t exchange_slot = std::uint64_t{0x7e} << 56;
    static constexpr std::uint64_t gather_slot = exchange_slot + 1;

    /// scratch: the lane's buffers, kept by the communicator between calls (grown to 4
    /// stages of n blocks: two halves of received blocks, the padded blocks, the tails).
    stripe_lane(const stage_cut& cut, const std::shared_ptr<::gloo::rendezvous::Context>& ctx,
                int rank, std::chrono::milliseconds timeout, std::vector<char>& scratch)
        : c(cut),
          r(rank),
          esz(static_cast<std::int64_t>(cut.esz)),
          sb(static_cast<std::size_t>(cut.stage * esz) * static_cast<std::size_t>(cut.n)),
          wait_for(timeout),
          in(const_cast<char*>(static_cast<const char*>(cut.a.in))),
          out(static_cast<char*>(cut.a.out)) {
      if (scratch.size() < 4 * sb) scratch.resize(4 * sb);
      blocks = {scratch.data(), scratch.data() + sb};
      padded = scratch.data() + 2 * sb;
      tail = scratch.data() + 3 * sb;
      const auto total = static_cast<std::size_t>(c.a.count * esz);
      const auto over = [&](void* p, std::size_t bytes) {
        return ctx->createUnboundBuffer(p, std::max<std::size_t>(bytes, 1));
      };
      in_b = over(in, total);
      out_b = over(out, total);
      block_b = {over(blocks[0], sb), over(blocks[1], sb)};
      pad_b = over(padded, sb);
      tail_b = over(tail, sb);
    }

    /// Block p of stage s to rank p; the blocks of stage s from every rank into blocks[half].
    void exchange(std::int64_t s, std::int64_t half) {
      const auto len = c.len(s);
      const auto lb = static_cast<std::size_t>(len * esz);
      auto& recv_b = *block_b[static_cast<std::size_t>(half)];
      int from_in = 0, from_pad = 0;
      for (int p = 0; p < c.n; ++p) {
        if (p == r) continue;
        recv_b.recv(p, exchange_slot, static_cast<std::size_t>(p) * lb, lb);
        if (valid(p, s) == len) {
          in_b->send(p, exchange_slot, at(p, s), lb);
          ++from_in;
        } else {
          copy_range(in, c.a.count, p * c.chunk + s * c.stage, len, c.esz,
                     padded + static_cast<std::size_t>(p) * lb);
          pad_b->send(p, exchange_slot, static_cast<std::size_t>(p) * lb, lb);
          ++from_pad;
        }
      }
      copy_range(in, c.a.count, r * c.chunk + s * c.stage, len, c.esz,
                 blocks[static_cast<std::size_t>(half)] + static_cast<std::size_t>(r) * lb);
      wait(*in_b, from_in, 0);
      wait(*pad_b, from_pad, 0);
      wait(recv_b, 0, c.n - 1);
    }
    /// This rank's stage s, summed in rank order, into its place in out.
    void reduce(std::int64_t s, std::int64_t half) {
      fedshard::detail::reduce_blocks(c.a.type, c.a.op, blocks[static_cast<std::size_t>(half)],
                                      static_cast<std::size_t>(c.len(s) * esz), c.n, out + at(r, s),
                                      valid(r, s));
    }
    /// Every rank's reduced stage s into its place in out (padding received aside).
    void gather(std::int64_t s) {
      const auto len = c.len(s);
      const auto lb = static_cast<std::size_t>(len * esz);
      const bool whole = valid(r, s) == len;
      if (!whole) {  // the padding of this rank's stage travels too
        std::memset(padded, 0, lb);
        std::memcpy(padded, out + at(r, s), static_cast<std::size_t>(valid(r, s) * esz));
      }
      int tails = 0;
      for (int p = 0; p < c.n; ++p) {
        if (p == r) continue;
        if (valid(p, s) == len) {
          out_b->recv(p, gather_slot, at(p, s), lb);
        } else {
          tail_b->recv(p, gather_slot, static_cast<std::size_t>(p) * lb, lb);
          ++tails;
        }
        if (whole)
          out_b->send(p, gather_slot, at(r, s), lb);
        else
          pad_b->send(p, gather_slot, 0, lb);
      }
      wait(whole ? *out_b : *pad_b, c.n - 1, 0);
      wait(*out_b, 0, c.n - 1 - tails);
      wait(*tail_b, 0, tails);
      for (int p = 0; p < c.n; ++p)
        if (p != r && valid(p, s) < len)
          std::memcpy(out + at(p, s), tail + static_cast<std::size_t>(p) * lb,
                      static_cast<std::size_t>(valid(p, s) * esz));
    }

    /// Elements of stage s of chunk p inside the message (the rest is padding).
    std::int64_t valid(int p, std::int64_t s) const {
      return std::clamp<std::int64_t>(c.a.count - (p * c.chunk + s * c.stage), 0, c.len(s));
    }
    /// Where stage s of chunk p starts in the message, in bytes.
    std::size_t at(int p, std::int64_t s) const {
      return static_cast<std::size_t>((p * c.chunk + s * c.stage) * esz);
    }
    void wait(::gloo::transport::UnboundBuffer& b, int sends, int recvs) const {
      for (int i = 0; i < sends; ++i) b.waitSend(wait_for);
      for (int i = 0; i < recvs; ++i) b.waitRecv(wait_for);
    }

    const stage_cut& c;
    int r;
    std::int64_t esz;
    std::size_t sb;  // bytes of a stage's n blocks
    std::chrono::milliseconds wait_for;
    char* in;
    char* out;
    std::array<char*, 2> blocks{};
    char* padded = nullptr;
    char* tail = nullptr;
    buffer in_b, out_b, pad_b, tail_b;
    std::array<buffer, 2> block_b;
  };

  /// Elements per pipeline stage of a chunk of `chunk` elements: whole cache lines of at most
  /// `limit` bytes, the whole chunk when pipelining is off (0).
  static std::int64_t stage_elems(std::int64_t chunk, std::size_t esz, std::int64_t limit) {
    if (limit <= 0) return std::max<std::int64_t>(chunk, 1);
    const auto line =
        std::max<std::int64_t>(1, static_cast<std::int64_t>(fedshard::cache_line_bytes / esz));
    const auto per =
        std::max<std::int64_t>(line, limit / static_cast<std::int64_t>(esz) / line * line);
    return std::min(std::max<std::int64_t>(chunk, 1), per);
  }

  /// Elements [begin, begin + len) of in (count elements of esz bytes) into dst, zeros past
  /// the end of in (the padding of the last chunks).
  static void copy_range(const char* in, std::int64_t count, std::int64_t begin, std::int64_t len,
                         std::size_t esz, char* dst) {
    const auto keep = std::clamp<std::int64_t>(count - begin, 0, len);
    if (keep > 0)
      std::memcpy(dst, in + begin * static_cast<std::int64_t>(esz),
                  static_cast<std::size_t>(keep) * esz);
    std::memset(dst + keep * static_cast<std::int64_t>(esz), 0,
                static_cast<std::size_t>(len - keep) * esz);
  }

  /// Runs exchange(s), reduce(s) and gather(s) for s in [0, stages), in that order for each s,
  /// with reduce(s) on a second thread while this one runs exchange(s+1) (every rank calls
  /// Gloo in the same order: exchange 0, exchange 1, gather 0, exchange 2, gather 1, ...).
  /// One stage runs on this thread alone.
  template <class X, class R, class G>
  static void pipelined_stages(std::int64_t stages, X&& exchange, R&& reduce, G&& gather) {
    exchange(0);
    for (std::int64_t s = 0; s < stages; ++s) {
      if (s + 1 < stages) {
        auto reducing = std::async(std::launch::async, [&reduce, s] { reduce(s); });
        try {
          exchange(s + 1);
        } catch (...) {
          reducing.wait();
          throw;
        }
        reducing.get();
      } else {
        reduce(s);
      }
      gather(s);
    }
  }

  /// Counts `bytes` sent and as many received.
  void count_both(std::size_t bytes) {
    s_->moved += moved_bytes{static_cast<std::int64_t>(bytes), static_cast<std::int64_t>(bytes)};
  }

  /// A posted send or receive; wait() blocks until it completed or timed out. test() does not
  /// block (Gloo has no poll that leaves the context usable: a wait that times out fails the
  /// whole context), so its first call starts a thread that waits for the pieces, and it
  /// says whether that thread is done; errors reach the caller through wait(), on its thread.
  class p2p_request final : public fedshard::detail::request_state {
   public:
    p2p_request(state* s, std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> pieces,
                bool send)
        : s_(s), pieces_(std::move(pieces)), send_(send), timeout_(timeout_of(*s)) {}
    ~p2p_request() override {
      if (waiter_.valid()) waiter_.wait();  // the thread uses pieces_
    }
    void wait() override {
      if (done_) return;
      done_ = true;
      guard(*s_, send_ ? "send" : "recv", [&] {
        if (waiter_.valid())
          waiter_.get();
        else
          wait_pieces();
      });
    }
    bool test() override {
      if (done_) return true;
      if (!waiter_.valid()) waiter_ = std::async(std::launch::async, [this] { wait_pieces(); });
      return waiter_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    }

   private:
    void wait_pieces() {
      for (auto& b : pieces_) {
        if (send_)
          b->waitSend(timeout_);
        else
          b->waitRecv(timeout_);
      }
    }

    state* s_;  // the communicator's state: its address survives moves of the communicator
    std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> pieces_;  // one per stripe used
    bool send_;
    std::chrono::milliseconds timeout_;
    bool done_ = false;
    std::future<void> waiter_;  // test()'s thread
  };

  request p2p(bool is_send, const void* sbuf, void* rbuf, std::int64_t count, dtype t, int peer,
              int tag) {
    fedshard::detail::check_p2p_args(is_send, is_send ? sbuf : rbuf, count, t, peer, s_->size);
    FEDSHARD_EXPECTS(tag >= 0, is_send ? "send" : "recv", ": tag must be >= 0, found ", tag);
    const auto bytes = static_cast<std::size_t>(count) * size_of(t);
    if (bytes == 0) return {};
    if (peer == s_->rank) return to_self(is_send, sbuf, rbuf, bytes, tag);
    s_->moved += fedshard::detail::p2p_moved(is_send, count, t, s_->rank, peer);
    const std::uint64_t slot = (std::uint64_t{0x7f} << 56) | static_cast<std::uint32_t>(tag);
    std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> pieces;
    auto* base = static_cast<char*>(is_send ? const_cast<void*>(sbuf) : rbuf);
    guarded(is_send ? "send" : "recv", [&] {
      // A large message goes over the stripes in contiguous pieces (both sides cut it alike:
      // the cut depends on the size alone); each stripe matches its pieces in order.
      const auto parts =
          std::clamp<std::size_t>(bytes / stripe_piece_min, 1, s_->stripes.size() + 1);
      const auto per = (bytes + parts - 1) / parts;
      for (std::size_t k = 0; k < parts; ++k) {
        const auto& ctx = k == 0 ? s_->ctx : s_->stripes[k - 1];
        const auto begin = k * per, len = std::min(bytes, begin + per) - begin;
        pieces.push_back(ctx->createUnboundBuffer(base + begin, len));
        if (is_send)
          pieces.back()->send(peer, slot);
        else
          pieces.back()->recv(peer, slot);
      }
    });
    return request(std::make_unique<p2p_request>(s_.get(), std::move(pieces), is_send));
  }
  /// The smallest piece a send or recv is cut into over the stripes.
  static constexpr std::size_t stripe_piece_min = std::size_t{256} << 10;

  /// A message to this rank itself: matched in order per tag through a mailbox.
  request to_self(bool is_send, const void* sbuf, void* rbuf, std::size_t bytes, int tag) {
    auto& box = s_->mailbox[tag];
    if (is_send) {
      const auto* p = static_cast<const char*>(sbuf);
      if (!box.receivers.empty()) {
        auto r = box.receivers.front();
        box.receivers.pop_front();
        deliver(*r, p, bytes);
      } else {
        box.messages.emplace_back(p, p + bytes);
      }
      return {};
    }
    auto r = std::make_shared<self_receive>();
    r->out = static_cast<char*>(rbuf);
    r->bytes = bytes;
    r->tag = tag;
    if (!box.messages.empty()) {
      const auto m = std::move(box.messages.front());
      box.messages.pop_front();
      deliver(*r, m.data(), m.size());
    } else {
      box.receivers.push_back(r);
    }
    return request(std::make_unique<self_request>(std::move(r)));
  }
  static void deliver(self_receive& r, const char* data, std::size_t bytes) {
    r.done = true;
    if (bytes != r.bytes) {
      r.error = detail::concat("fedshard: collective_mismatch: a message to itself on tag ", r.tag,
                               " carries ", bytes, " bytes but the receive expects ", r.bytes);
      return;
    }
    std::memcpy(r.out, data, bytes);
  }
  class self_request final : public fedshard::detail::request_state {
   public:
    explicit self_request(std::shared_ptr<self_receive> r) : r_(std::move(r)) {}
    void wait() override {
      if (!r_->done)
        throw timeout_error(
            detail::concat("fedshard: gloo recv from itself on tag ", r_->tag,
                           " waited for a send this thread never made (post the send first)"));
      if (!r_->error.empty()) throw collective_mismatch(r_->error);
    }
    bool test() override { return r_->done; }

   private:
    std::shared_ptr<self_receive> r_;
  };

  std::unique_ptr<state> s_;
};

static_assert(Communicator<communicator>);

}  // namespace fedshard::gloo
