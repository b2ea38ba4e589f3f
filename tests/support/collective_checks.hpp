#pragma once
/// Backend-generic test bodies for fedshard::Communicator implementations.
///
/// Every function here runs on one rank of any Communicator C and throws check_failed when
/// that rank sees a wrong result, so the same bodies run on inproc ranks (threads, see
/// spawn_ranks.hpp) and on MPI processes. Inputs are a pure function of (seed, id, index): each
/// rank recomputes its peers' inputs and the expected result without communicating. Reductions
/// are recomputed in rank order with the documented accumulation (float for f32, bf16 and f16,
/// double for f64; avg = sum / n; min and max propagate NaN). Error bodies return this rank's
/// outcome instead of throwing, so a driver can check what every rank saw.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <iomanip>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/comm/request.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/error.hpp"
#include "support/bits.hpp"

namespace fedshard::test {

/// Thrown by a check when this rank observed a wrong result.
class check_failed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Throws check_failed with the concatenated parts (call it only once a check failed: the
/// message is built eagerly).
template <class... Args>
[[noreturn]] void fail(Args&&... parts) {
  throw check_failed(fedshard::detail::concat("check failed: ", std::forward<Args>(parts)...));
}

namespace detail {

inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

template <class T>
T load(const void* base, std::int64_t i) {
  T v;
  std::memcpy(&v, static_cast<const unsigned char*>(base) + static_cast<std::size_t>(i) * sizeof(T),
              sizeof(T));
  return v;
}

template <class T>
void store(void* base, std::int64_t i, T v) {
  std::memcpy(static_cast<unsigned char*>(base) + static_cast<std::size_t>(i) * sizeof(T), &v,
              sizeof(T));
}

inline std::uint64_t fnv1a(const void* p, std::size_t bytes) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

inline constexpr unsigned char guard_byte = 0xa5;
inline constexpr unsigned char garbage_byte = 0x5c;

}  // namespace detail

/// Element i of the input of the rank with the given id: uniform in [-4, 4) with a full
/// mantissa, rarely (5 in 509) NaN, +-infinity or +-0, rounded to T.
template <class T>
T input_value(std::uint64_t seed, int id, std::int64_t i) {
  const std::uint64_t h =
      detail::mix(seed * 0xd6e8feb86659fd93ull ^ (static_cast<std::uint64_t>(id) << 40) ^
                  static_cast<std::uint64_t>(i));
  double v = 0;
  switch (h % 509) {
    case 0: v = std::numeric_limits<double>::quiet_NaN(); break;
    case 1: v = std::numeric_limits<double>::infinity(); break;
    case 2: v = -std::numeric_limits<double>::infinity(); break;
    case 3: v = -0.0; break;
    case 4: v = 0.0; break;
    default: v = static_cast<double>(h >> 11) * 0x1p-53 * 8.0 - 4.0;
  }
  if constexpr (std::is_same_v<T, double>)
    return v;
  else if constexpr (std::is_same_v<T, float>)
    return static_cast<float>(v);
  else
    return T(static_cast<float>(v));
}

/// A value and its bit pattern, for messages.
template <class T>
std::string show(T v) {
  std::uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  std::ostringstream os;
  os << std::setprecision(17) << static_cast<double>(to_accum(v)) << " (bits 0x" << std::hex << bits
     << ")";
  return os.str();
}

/// The documented reduction of input(0..n) for op: accumulated in rank order in float (double
/// for f64), avg divides the sum by n, the result rounded once to T.
template <class T, class Input>
T reference_reduce(reduce_op op, int n, Input&& input) {
  auto acc = to_accum(input(0));
  for (int p = 1; p < n; ++p) acc = combine(op, acc, to_accum(input(p)));
  if (op == reduce_op::avg) acc = acc / static_cast<decltype(acc)>(n);
  return from_accum<T>(acc);
}

/// The collectives with (pointer, count, dtype) buffers.
enum class coll : std::uint8_t { all_reduce, all_gather, reduce_scatter, broadcast };

/// Every collective kind.
inline constexpr coll all_colls[] = {coll::all_reduce, coll::all_gather, coll::reduce_scatter,
                                     coll::broadcast};

/// The name of a collective kind.
constexpr std::string_view to_string(coll k) noexcept {
  switch (k) {
    case coll::all_reduce: return "all_reduce";
    case coll::all_gather: return "all_gather";
    case coll::reduce_scatter: return "reduce_scatter";
    case coll::broadcast: return "broadcast";
  }
  return "unknown-collective";
}

/// One collective call to check: count is per rank (all_gather's input, reduce_scatter's output).
struct case_spec {
  coll kind = coll::all_reduce;
  dtype type = dtype::f32;
  reduce_op op = reduce_op::sum;
  std::int64_t count = 0;
  bool in_place = false;
  int root = 0;
  std::uint64_t seed = 1;
};

/// A readable description of a case, for messages.
inline std::string describe(const case_spec& s) {
  using fedshard::detail::concat;
  std::string r = concat(to_string(s.kind), "(", to_string(s.type), ", count=", s.count);
  if (s.kind == coll::all_reduce || s.kind == coll::reduce_scatter)
    r += concat(", op=", to_string(s.op));
  if (s.kind == coll::broadcast) r += concat(", root=", s.root);
  if (s.in_place) r += ", in place";
  return r + concat(", seed=", s.seed, ")");
}

/// The buffers of one collective on one rank: filled with this rank's inputs, surrounded by
/// guard elements, and checked against the expected result after the call.
class collective_case {
 public:
  /// Guard elements on each side of every buffer.
  static constexpr std::int64_t guard = 3;

  /// A case for rank `rank` of `size` ranks; ids[p] is the input id of rank p (empty: p).
  collective_case(int size, int rank, case_spec s, std::vector<int> ids = {})
      : s_(s), n_(size), me_(rank), ids_(std::move(ids)), esz_(size_of(s.type)) {
    const std::int64_t c = s_.count;
    const std::int64_t wide = c * n_;
    switch (s_.kind) {
      case coll::all_reduce:
        out_ = allocate(out_store_, c);
        in_ = s_.in_place ? out_ : allocate(in_store_, c);
        fill_inputs(in_, me_, 0, c);
        break;
      case coll::all_gather:
        out_ = allocate(out_store_, wide);
        std::memset(out_, detail::garbage_byte, bytes(wide));
        in_ = s_.in_place ? static_cast<unsigned char*>(out_) + bytes(c * me_)
                          : allocate(in_store_, c);
        fill_inputs(in_, me_, 0, c);
        break;
      case coll::reduce_scatter:
        in_ = allocate(in_store_, wide);
        fill_inputs(in_, me_, 0, wide);
        out_ = s_.in_place ? static_cast<unsigned char*>(in_) + bytes(c * me_)
                           : allocate(out_store_, c);
        if (!s_.in_place) std::memset(out_, detail::garbage_byte, bytes(c));
        break;
      case coll::broadcast:
        out_ = allocate(out_store_, c);
        in_ = out_;
        if (me_ == s_.root)
          fill_inputs(out_, s_.root, 0, c);
        else
          std::memset(out_, detail::garbage_byte, bytes(c));
        break;
    }
  }

  /// A case for this rank of communicator c.
  template <Communicator C>
  collective_case(const C& c, case_spec s, std::vector<int> ids = {})
      : collective_case(c.size(), c.rank(), s, std::move(ids)) {}

  collective_case(const collective_case&) = delete;
  collective_case& operator=(const collective_case&) = delete;

  /// What this case checks.
  const case_spec& spec() const noexcept { return s_; }

  /// Runs the collective (blocking) on c.
  template <Communicator C>
  void run(C& c) {
    switch (s_.kind) {
      case coll::all_reduce: c.all_reduce(in_, out_, s_.count, s_.type, s_.op); return;
      case coll::all_gather: c.all_gather(in_, out_, s_.count, s_.type); return;
      case coll::reduce_scatter: c.reduce_scatter(in_, out_, s_.count, s_.type, s_.op); return;
      case coll::broadcast: c.broadcast(out_, s_.count, s_.type, s_.root); return;
    }
  }

  /// Starts the async variant of the collective on c.
  template <Communicator C>
  request start(C& c) {
    switch (s_.kind) {
      case coll::all_reduce: return c.all_reduce_async(in_, out_, s_.count, s_.type, s_.op);
      case coll::all_gather: return c.all_gather_async(in_, out_, s_.count, s_.type);
      case coll::reduce_scatter: return c.reduce_scatter_async(in_, out_, s_.count, s_.type, s_.op);
      case coll::broadcast: return c.broadcast_async(out_, s_.count, s_.type, s_.root);
    }
    return {};
  }

  /// Throws check_failed unless the guards, the inputs (out of place) and the result are right.
  void verify() const {
    visit(s_.type, [&](auto tag) { verify_typed<typename decltype(tag)::type>(); });
  }

  /// A hash of this rank's result bytes.
  std::uint64_t digest() const {
    const std::int64_t len = s_.kind == coll::all_gather ? s_.count * n_ : s_.count;
    return detail::fnv1a(out_, bytes(len));
  }

 private:
  std::size_t bytes(std::int64_t elems) const { return static_cast<std::size_t>(elems) * esz_; }
  int id(int p) const { return ids_.empty() ? p : ids_[static_cast<std::size_t>(p)]; }

  void* allocate(std::vector<unsigned char>& store, std::int64_t elems) const {
    store.assign(bytes(elems + 2 * guard), detail::guard_byte);
    return store.data() + bytes(guard);
  }

  void fill_inputs(void* base, int rank, std::int64_t first, std::int64_t len) const {
    visit(s_.type, [&](auto tag) {
      using T = typename decltype(tag)::type;
      for (std::int64_t i = 0; i < len; ++i)
        detail::store(base, i, input_value<T>(s_.seed, id(rank), first + i));
    });
  }

  std::string where() const {
    return fedshard::detail::concat("rank ", me_, " of ", n_, ", ", describe(s_), ": ");
  }

  void check_guards(const std::vector<unsigned char>& store, const char* name) const {
    if (store.empty()) return;
    const std::size_t g = bytes(guard);
    for (std::size_t b = 0; b < g; ++b) {
      if (store[b] != detail::guard_byte)
        fail(where(), "the guard before the ", name, " buffer was overwritten");
      if (store[store.size() - 1 - b] != detail::guard_byte)
        fail(where(), "the guard after the ", name, " buffer was overwritten");
    }
  }

  template <class T>
  void check_reduced(std::int64_t i, std::int64_t element) const {
    const T got = detail::load<T>(out_, i);
    bool any_nan = false;
    const T want = reference_reduce<T>(s_.op, n_, [&](int p) {
      const T v = input_value<T>(s_.seed, id(p), element);
      any_nan = any_nan || is_nan(v);
      return v;
    });
    if (any_nan && !is_nan(got))
      fail(where(), "element ", i, ": an input is NaN but the result is ", show(got));
    if (!same_value(got, want))
      fail(where(), "element ", i, ": expected ", show(want), ", found ", show(got));
  }

  template <class T>
  void check_copied(std::int64_t i, int from, std::int64_t element) const {
    const T got = detail::load<T>(out_, i);
    const T want = input_value<T>(s_.seed, id(from), element);
    if (!same_bits(got, want))
      fail(where(), "element ", i, ": expected ", show(want), " (element ", element, " of rank ",
           from, "), found ", show(got));
  }

  template <class T>
  void verify_typed() const {
    check_guards(in_store_, "input");
    check_guards(out_store_, "output");
    const std::int64_t c = s_.count;
    if (!s_.in_place && s_.kind != coll::broadcast) {
      const std::int64_t len = s_.kind == coll::reduce_scatter ? c * n_ : c;
      for (std::int64_t i = 0; i < len; ++i)
        if (!same_bits(detail::load<T>(in_, i), input_value<T>(s_.seed, id(me_), i)))
          fail(where(), "input element ", i, " was modified");
    }
    switch (s_.kind) {
      case coll::all_reduce:
        for (std::int64_t i = 0; i < c; ++i) check_reduced<T>(i, i);
        return;
      case coll::reduce_scatter:
        for (std::int64_t i = 0; i < c; ++i) check_reduced<T>(i, c * me_ + i);
        return;
      case coll::all_gather:
        for (int p = 0; p < n_; ++p)
          for (std::int64_t i = 0; i < c; ++i) check_copied<T>(c * p + i, p, i);
        return;
      case coll::broadcast:
        for (std::int64_t i = 0; i < c; ++i) check_copied<T>(i, s_.root, i);
        return;
    }
  }

  case_spec s_;
  int n_;
  int me_;
  std::vector<int> ids_;
  std::size_t esz_;
  std::vector<unsigned char> in_store_;
  std::vector<unsigned char> out_store_;
  void* in_ = nullptr;
  void* out_ = nullptr;
};

/// Sizes every collective is checked with: empty, one, small, prime, not a multiple of 2..8.
inline constexpr std::int64_t small_counts[] = {0, 1, 7, 61, 1000};
/// A large size that is not a multiple of 2, 3, 4, 5, 6 or 8.
inline constexpr std::int64_t large_count = (std::int64_t{1} << 20) + 3;

/// Every dtype x op (where it applies) x count x placement (or root) of one collective kind.
inline std::vector<case_spec> case_grid(coll kind, int size, std::span<const std::int64_t> counts,
                                        std::uint64_t seed) {
  std::vector<case_spec> specs;
  for (dtype t : all_dtypes)
    for (std::int64_t count : counts) {
      case_spec s;
      s.kind = kind;
      s.type = t;
      s.count = count;
      s.seed = seed++;
      switch (kind) {
        case coll::all_reduce:
        case coll::reduce_scatter:
          for (reduce_op op : all_reduce_ops)
            for (bool in_place : {false, true}) {
              s.op = op;
              s.in_place = in_place;
              s.seed = seed++;
              specs.push_back(s);
            }
          break;
        case coll::all_gather:
          for (bool in_place : {false, true}) {
            s.in_place = in_place;
            s.seed = seed++;
            specs.push_back(s);
          }
          break;
        case coll::broadcast:
          for (int root = 0; root < size; ++root) {
            s.root = root;
            s.seed = seed++;
            specs.push_back(s);
          }
          break;
      }
    }
  return specs;
}

/// Runs each case blocking on c, one after the other, and verifies it.
template <Communicator C>
void run_cases(C& c, const std::vector<case_spec>& specs, const std::vector<int>& ids = {}) {
  for (const case_spec& s : specs) {
    collective_case k(c, s, ids);
    k.run(c);
    k.verify();
  }
}

/// Every rank sends count elements of type t to rank + 1 and receives from rank - 1 (a ring).
template <Communicator C>
void check_ring(C& c, dtype t, std::int64_t count, std::uint64_t seed, int tag = 0) {
  visit(t, [&](auto tg) {
    using T = typename decltype(tg)::type;
    const int n = c.size();
    const int me = c.rank();
    const int right = (me + 1) % n;
    const int left = (me + n - 1) % n;
    const auto g = collective_case::guard;
    std::vector<T> sent(static_cast<std::size_t>(count));
    for (std::int64_t i = 0; i < count; ++i) sent[i] = input_value<T>(seed, me, i);
    std::vector<unsigned char> got(static_cast<std::size_t>(count + 2 * g) * sizeof(T),
                                   detail::guard_byte);
    unsigned char* rbuf = got.data() + g * sizeof(T);
    std::memset(rbuf, detail::garbage_byte, static_cast<std::size_t>(count) * sizeof(T));
    request s = c.send_async(sent.data(), count, t, right, tag);
    c.recv(rbuf, count, t, left, tag);
    s.wait();
    const auto where = fedshard::detail::concat("ring of ", n, " ranks, rank ", me, ", ",
                                                to_string(t), " x ", count, ", tag ", tag, ": ");
    for (std::size_t b = 0; b < static_cast<std::size_t>(g) * sizeof(T); ++b)
      if (got[b] != detail::guard_byte || got[got.size() - 1 - b] != detail::guard_byte)
        fail(where, "a guard around the receive buffer was overwritten");
    for (std::int64_t i = 0; i < count; ++i) {
      const T want = input_value<T>(seed, left, i);
      const T have = detail::load<T>(rbuf, i);
      if (!same_bits(have, want))
        fail(where, "element ", i, ": expected ", show(want), ", found ", show(have));
      if (!same_bits(sent[i], input_value<T>(seed, me, i)))
        fail(where, "send buffer element ", i, " was modified");
    }
  });
}

/// Each rank posts `messages` sends on tag 1, then `messages` on tag 2, to rank + 1; only then
/// does it receive from rank - 1, tag 2 first, then tag 1. Every message of a tag must arrive
/// in the order it was sent, whatever the other tag does.
template <Communicator C>
void check_message_order(C& c, int messages, std::int64_t count, std::uint64_t seed) {
  const int n = c.size();
  const int me = c.rank();
  const int right = (me + 1) % n;
  const int left = (me + n - 1) % n;
  auto seed_of = [&](int tag, int k) { return seed + 1000u * static_cast<unsigned>(tag) + k; };
  std::deque<std::vector<float>> sent;
  std::vector<request> sends;
  for (int tag : {1, 2})
    for (int k = 0; k < messages; ++k) {
      auto& v = sent.emplace_back(static_cast<std::size_t>(count));
      for (std::int64_t i = 0; i < count; ++i) v[i] = input_value<float>(seed_of(tag, k), me, i);
      sends.push_back(c.send_async(v.data(), count, dtype::f32, right, tag));
    }
  std::vector<float> got(static_cast<std::size_t>(count));
  for (int tag : {2, 1})
    for (int k = 0; k < messages; ++k) {
      c.recv(got.data(), count, dtype::f32, left, tag);
      for (std::int64_t i = 0; i < count; ++i)
        if (!same_bits(got[i], input_value<float>(seed_of(tag, k), left, i)))
          fail("rank ", me, ": message ", k, " received on tag ", tag, " from rank ", left,
               " is not message ", k, " sent on that tag (element ", i, ")");
    }
  wait_all(sends);
}

/// The ids of sub's ranks in rank order, learnt through an all_gather on sub.
template <Communicator C>
std::vector<int> gather_ids(C& sub, int my_id) {
  const double mine = my_id;
  std::vector<double> all(static_cast<std::size_t>(sub.size()));
  sub.all_gather(&mine, all.data(), 1, dtype::f64);
  return {all.begin(), all.end()};
}

/// The ranks of split(color, key) that share my color, ordered by key, then by rank.
inline std::vector<int> expected_members(const std::vector<int>& colors,
                                         const std::vector<int>& keys, int me) {
  std::vector<int> members;
  for (int p = 0; p < static_cast<int>(colors.size()); ++p)
    if (colors[p] == colors[me]) members.push_back(p);
  std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return keys[a] < keys[b]; });
  return members;
}

/// A communicator and the id of each of its ranks.
template <class C>
struct sub_comm {
  C comm;
  std::vector<int> ids;
};

/// Splits c (whose rank p has id ids[p]) with color_of(rank) and key_of(rank); checks the new
/// size, rank and members (in key order), and one all_reduce on it.
template <Communicator C, class ColorOf, class KeyOf>
sub_comm<C> check_split(C& c, const std::vector<int>& ids, ColorOf color_of, KeyOf key_of,
                        std::uint64_t seed) {
  const int n = c.size();
  const int me = c.rank();
  std::vector<int> colors(static_cast<std::size_t>(n));
  std::vector<int> keys(static_cast<std::size_t>(n));
  for (int p = 0; p < n; ++p) {
    colors[p] = color_of(p);
    keys[p] = key_of(p);
  }
  C sub = c.split(colors[me], keys[me]);
  const std::vector<int> members = expected_members(colors, keys, me);
  std::vector<int> want_ids;
  for (int m : members) want_ids.push_back(ids[m]);
  const auto pos = std::find(members.begin(), members.end(), me) - members.begin();
  const auto where = fedshard::detail::concat("split of ", n, " ranks, rank ", me, " (color ",
                                              colors[me], ", key ", keys[me], "): ");
  if (sub.size() != static_cast<int>(members.size()))
    fail(where, "expected size ", members.size(), ", found ", sub.size());
  if (sub.rank() != pos) fail(where, "expected rank ", pos, ", found ", sub.rank());
  const std::vector<int> got = gather_ids(sub, ids[me]);
  if (got != want_ids) fail(where, "the members are not the expected ones in key order");
  case_spec s;
  s.count = 61;
  s.seed = seed;
  run_cases(sub, {s}, want_ids);
  return {std::move(sub), want_ids};
}

/// Splits c by rank % 2 and by rank / 2 and runs collectives on both sub-communicators and on
/// c, with async operations of all three in flight at once and blocking calls in between.
template <Communicator C>
void check_concurrent_splits(C& c, std::uint64_t seed, int rounds) {
  std::vector<int> ids(static_cast<std::size_t>(c.size()));
  for (int p = 0; p < c.size(); ++p) ids[p] = p;
  auto a = check_split(
      c, ids, [](int r) { return r % 2; }, [](int r) { return r; }, seed);
  auto b = check_split(
      c, ids, [](int r) { return r / 2; }, [](int r) { return -r; }, seed + 1);
  for (int round = 0; round < rounds; ++round) {
    const std::uint64_t s = seed + 100u * static_cast<unsigned>(round + 1);
    std::deque<collective_case> cases;
    std::vector<request> pending;
    auto spec = [&](coll k, dtype t, reduce_op op, std::int64_t count, std::uint64_t sd) {
      case_spec x;
      x.kind = k;
      x.type = t;
      x.op = op;
      x.count = count;
      x.seed = sd;
      return x;
    };
    auto& ka = cases.emplace_back(
        a.comm, spec(coll::all_reduce, dtype::f32, reduce_op::sum, 1000, s), a.ids);
    pending.push_back(ka.start(a.comm));
    auto& kb = cases.emplace_back(
        b.comm, spec(coll::reduce_scatter, dtype::bf16, reduce_op::avg, 61, s + 1), b.ids);
    pending.push_back(kb.start(b.comm));
    auto& kw = cases.emplace_back(c, spec(coll::all_gather, dtype::f16, reduce_op::sum, 7, s + 2));
    pending.push_back(kw.start(c));
    auto& kb2 = cases.emplace_back(
        b.comm, spec(coll::all_reduce, dtype::f64, reduce_op::max, 1000, s + 3), b.ids);
    pending.push_back(kb2.start(b.comm));
    collective_case blocking_a(
        a.comm, spec(coll::all_reduce, dtype::f16, reduce_op::min, 61, s + 4), a.ids);
    blocking_a.run(a.comm);
    collective_case blocking_w(c, spec(coll::all_reduce, dtype::f32, reduce_op::avg, 61, s + 5));
    blocking_w.run(c);
    auto& ka2 = cases.emplace_back(
        a.comm, spec(coll::all_gather, dtype::f64, reduce_op::sum, 61, s + 6), a.ids);
    pending.push_back(ka2.start(a.comm));
    b.comm.barrier();
    wait_all(pending);
    blocking_a.verify();
    blocking_w.verify();
    for (const auto& k : cases) k.verify();
  }
}

/// Polls r until test() is true (or throws check_failed after a minute).
inline void poll_until_done(request& r, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(1);
  while (!r.test()) {
    if (std::chrono::steady_clock::now() >= deadline)
      fail(what, ": test() stayed false for a minute");
    std::this_thread::yield();
  }
}

/// Every async operation, many (more than 16) in flight at once, mixed with blocking calls;
/// one request polled with test() until done, whose result must then be visible.
template <Communicator C>
void check_async(C& c, std::uint64_t seed) {
  const int n = c.size();
  const int me = c.rank();
  std::deque<collective_case> cases;
  std::vector<request> pending;
  auto post = [&](coll k, dtype t, reduce_op op, std::int64_t count, bool in_place, int root) {
    case_spec s;
    s.kind = k;
    s.type = t;
    s.op = op;
    s.count = count;
    s.in_place = in_place;
    s.root = root;
    s.seed = seed++;
    pending.push_back(cases.emplace_back(c, s).start(c));
  };
  post(coll::all_reduce, dtype::f32, reduce_op::sum, 1000, false, 0);
  post(coll::all_gather, dtype::bf16, reduce_op::sum, 61, true, 0);
  post(coll::reduce_scatter, dtype::f64, reduce_op::max, 7, false, 0);
  post(coll::broadcast, dtype::f16, reduce_op::sum, 1000, false, n - 1);

  const std::uint64_t ring_seed = seed++;
  std::vector<double> sent(61);
  std::vector<double> got(61, -1.0);
  for (std::size_t i = 0; i < sent.size(); ++i) sent[i] = input_value<double>(ring_seed, me, i);
  pending.push_back(c.recv_async(got.data(), 61, dtype::f64, (me + n - 1) % n, 9));
  pending.push_back(c.send_async(sent.data(), 61, dtype::f64, (me + 1) % n, 9));

  case_spec blocking;
  blocking.kind = coll::all_reduce;
  blocking.type = dtype::f64;
  blocking.op = reduce_op::avg;
  blocking.count = 61;
  blocking.seed = seed + 500;
  collective_case k(c, blocking);
  k.run(c);
  k.verify();

  for (int i = 0; i < 20; ++i)
    post(all_colls[i % 4], all_dtypes[(i + i / 4) % 4], all_reduce_ops[(i / 4) % 4],
         i % 3 == 0 ? 0 : 7 * i, i % 2 == 0, i % n);
  c.barrier();
  wait_all(pending);
  for (const auto& kc : cases) kc.verify();
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!same_bits(got[i], input_value<double>(ring_seed, (me + n - 1) % n, i)))
      fail("rank ", me, ": async ring element ", i, " is wrong");

  case_spec polled;
  polled.kind = coll::reduce_scatter;
  polled.type = dtype::bf16;
  polled.op = reduce_op::sum;
  polled.count = 1000;
  polled.seed = seed + 600;
  collective_case kp(c, polled);
  request r = kp.start(c);
  poll_until_done(r, "reduce_scatter_async");
  kp.verify();
  r.wait();
  if (!(r.test() && !r.pending())) fail("a waited request must be complete");
}

/// A request destroyed without wait() waits for its operation: the result is there afterwards.
template <Communicator C>
void check_dropped_request(C& c, std::uint64_t seed) {
  for (coll k : all_colls) {
    case_spec s;
    s.kind = k;
    s.type = dtype::f32;
    s.count = 1000;
    s.seed = seed++;
    collective_case kc(c, s);
    { request dropped = kc.start(c); }
    kc.verify();
  }
}

/// Perturbs thread timing before a call: nothing, a yield, or a sleep of up to 200 us.
class jitter {
 public:
  explicit jitter(std::uint64_t seed) : rng_(seed) {}
  void operator()() {
    const std::uint64_t r = rng_();
    switch (r % 4) {
      case 0: return;
      case 1: std::this_thread::yield(); return;
      default: std::this_thread::sleep_for(std::chrono::microseconds((r >> 8) % 200));
    }
  }

 private:
  std::mt19937_64 rng_;
};

/// A fixed list of reductions (every dtype and op; blocking, async and several in flight),
/// with jitter before every call; each is verified against the reference. Returns the digest
/// of every result, in order: all_reduce results first (the same on every rank), then the
/// reduce_scatter ones (this rank's block).
template <Communicator C>
std::vector<std::uint64_t> deterministic_reductions(C& c, std::uint64_t seed, jitter& j) {
  std::deque<collective_case> reduce_cases;
  std::deque<collective_case> scatter_cases;
  std::vector<request> pending;
  bool async = false;
  for (dtype t : all_dtypes)
    for (reduce_op op : all_reduce_ops) {
      case_spec s;
      s.type = t;
      s.op = op;
      s.count = 1000;
      s.seed = seed;
      s.in_place = async;
      auto& kr = reduce_cases.emplace_back(c, s);
      s.kind = coll::reduce_scatter;
      s.count = 61;
      auto& ks = scatter_cases.emplace_back(c, s);
      j();
      if (async) {
        pending.push_back(kr.start(c));
        j();
        pending.push_back(ks.start(c));
      } else {
        kr.run(c);
        j();
        ks.run(c);
      }
      async = !async;
    }
  wait_all(pending);
  std::vector<std::uint64_t> digests;
  for (const auto& k : reduce_cases) {
    k.verify();
    digests.push_back(k.digest());
  }
  for (const auto& k : scatter_cases) {
    k.verify();
    digests.push_back(k.digest());
  }
  return digests;
}

/// What a call did on one rank.
enum class outcome_kind : std::uint8_t {
  ok,
  invalid_argument,
  collective_mismatch,
  peer_failure,
  timeout_error,
  other
};

/// The name of an outcome kind.
constexpr std::string_view to_string(outcome_kind k) noexcept {
  switch (k) {
    case outcome_kind::ok: return "ok";
    case outcome_kind::invalid_argument: return "invalid_argument";
    case outcome_kind::collective_mismatch: return "collective_mismatch";
    case outcome_kind::peer_failure: return "peer_failure";
    case outcome_kind::timeout_error: return "timeout_error";
    case outcome_kind::other: return "other";
  }
  return "unknown-outcome";
}

/// The outcome of a call on one rank: what was thrown, with its message.
struct outcome {
  outcome_kind kind = outcome_kind::ok;
  std::string what;
};

/// Runs f and classifies what it threw.
template <class F>
outcome capture(F&& f) {
  try {
    f();
    return {};
  } catch (const fedshard::invalid_argument& e) {
    return {outcome_kind::invalid_argument, e.what()};
  } catch (const fedshard::collective_mismatch& e) {
    return {outcome_kind::collective_mismatch, e.what()};
  } catch (const fedshard::peer_failure& e) {
    return {outcome_kind::peer_failure, e.what()};
  } catch (const fedshard::timeout_error& e) {
    return {outcome_kind::timeout_error, e.what()};
  } catch (const std::exception& e) {
    return {outcome_kind::other, e.what()};
  }
}

/// Sets (or unsets, with nullptr) an environment variable for one scope.
class scoped_env {
 public:
  scoped_env(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    set(value);
  }
  ~scoped_env() { set(old_ ? old_->c_str() : nullptr); }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;
  /// Sets the variable to value (unsets it for nullptr).
  void set(const char* value) {
    if (value)
      ::setenv(name_, value, 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

/// Checks that c still works: one verified all_reduce.
template <Communicator C>
void check_usable(C& c, std::uint64_t seed) {
  case_spec s;
  s.count = 61;
  s.op = reduce_op::max;
  s.seed = seed;
  run_cases(c, {s});
}

/// The argument in which one rank's collective differs from its peers'.
enum class mismatch_in : std::uint8_t { count, dtype, op, root, kind };

/// Every way ranks can disagree.
inline constexpr mismatch_in all_mismatches[] = {
    mismatch_in::count, mismatch_in::dtype, mismatch_in::op, mismatch_in::root, mismatch_in::kind};

/// The name of a mismatch.
constexpr std::string_view to_string(mismatch_in m) noexcept {
  switch (m) {
    case mismatch_in::count: return "count";
    case mismatch_in::dtype: return "dtype";
    case mismatch_in::op: return "op";
    case mismatch_in::root: return "root";
    case mismatch_in::kind: return "kind";
  }
  return "unknown-mismatch";
}

/// Counts used by provoke_mismatch: the culprit's and everyone else's.
inline constexpr std::int64_t mismatch_count_culprit = 4321;
inline constexpr std::int64_t mismatch_count_others = 1234;

/// One collective on every rank of c (size >= 2) in which rank `culprit` differs from the
/// others in `what`: count 4321 vs 1234, f64 vs f32, max vs sum, broadcast root size-1 vs 0
/// (0 vs size-1 when the culprit is size-1), all_gather vs all_reduce. With async the *_async
/// variant is called and waited. Returns this rank's outcome.
template <Communicator C>
outcome provoke_mismatch(C& c, mismatch_in what, int culprit, bool async) {
  const int n = c.size();
  const bool mine = c.rank() == culprit;
  std::vector<double> in(static_cast<std::size_t>(mismatch_count_culprit * n));
  std::vector<double> out(in.size());
  const int odd_root = culprit == n - 1 ? 0 : n - 1;
  const int root = mine ? odd_root : (culprit == n - 1 ? n - 1 : 0);
  return capture([&] {
    request r;
    switch (what) {
      case mismatch_in::count: {
        const auto count = mine ? mismatch_count_culprit : mismatch_count_others;
        if (async)
          r = c.all_reduce_async(in.data(), out.data(), count, dtype::f32, reduce_op::sum);
        else
          c.all_reduce(in.data(), out.data(), count, dtype::f32, reduce_op::sum);
        break;
      }
      case mismatch_in::dtype: {
        const dtype t = mine ? dtype::f64 : dtype::f32;
        if (async)
          r = c.all_reduce_async(in.data(), out.data(), 16, t, reduce_op::sum);
        else
          c.all_reduce(in.data(), out.data(), 16, t, reduce_op::sum);
        break;
      }
      case mismatch_in::op: {
        const reduce_op op = mine ? reduce_op::max : reduce_op::sum;
        if (async)
          r = c.reduce_scatter_async(in.data(), out.data(), 16, dtype::f32, op);
        else
          c.reduce_scatter(in.data(), out.data(), 16, dtype::f32, op);
        break;
      }
      case mismatch_in::root:
        if (async)
          r = c.broadcast_async(out.data(), 16, dtype::f32, root);
        else
          c.broadcast(out.data(), 16, dtype::f32, root);
        break;
      case mismatch_in::kind:
        if (mine) {
          if (async)
            r = c.all_gather_async(in.data(), out.data(), 16, dtype::f32);
          else
            c.all_gather(in.data(), out.data(), 16, dtype::f32);
        } else {
          if (async)
            r = c.all_reduce_async(in.data(), out.data(), 16, dtype::f32, reduce_op::sum);
          else
            c.all_reduce(in.data(), out.data(), 16, dtype::f32, reduce_op::sum);
        }
        break;
    }
    r.wait();
  });
}

/// An invalid argument to a collective.
enum class invalid_in : std::uint8_t {
  all_reduce_negative_count,
  all_gather_negative_count,
  reduce_scatter_negative_count,
  broadcast_negative_count,
  all_reduce_null_input,
  all_reduce_null_output,
  all_gather_null_input,
  all_gather_null_output,
  reduce_scatter_null_input,
  reduce_scatter_null_output,
  broadcast_null_buffer,
  root_too_large,
  root_negative,
  bad_dtype,
  bad_op,
  all_reduce_overlap,
  all_gather_overlap,
  reduce_scatter_overlap,
  split_negative_color
};

/// Every invalid collective argument.
inline constexpr invalid_in all_invalid_collective_args[] = {
    invalid_in::all_reduce_negative_count,
    invalid_in::all_gather_negative_count,
    invalid_in::reduce_scatter_negative_count,
    invalid_in::broadcast_negative_count,
    invalid_in::all_reduce_null_input,
    invalid_in::all_reduce_null_output,
    invalid_in::all_gather_null_input,
    invalid_in::all_gather_null_output,
    invalid_in::reduce_scatter_null_input,
    invalid_in::reduce_scatter_null_output,
    invalid_in::broadcast_null_buffer,
    invalid_in::root_too_large,
    invalid_in::root_negative,
    invalid_in::bad_dtype,
    invalid_in::bad_op,
    invalid_in::all_reduce_overlap,
    invalid_in::all_gather_overlap,
    invalid_in::reduce_scatter_overlap,
    invalid_in::split_negative_color};

/// One collective on every rank of c in which rank `culprit` (every rank when culprit < 0)
/// passes the invalid argument `what` and the others pass valid ones; returns this rank's
/// outcome.
template <Communicator C>
outcome provoke_invalid(C& c, invalid_in what, int culprit) {
  constexpr std::int64_t count = 16;
  const int n = c.size();
  const int me = c.rank();
  const bool bad = culprit < 0 || me == culprit;
  std::vector<float> in(static_cast<std::size_t>(count * n + 1));
  std::vector<float> out(in.size());
  float* const i0 = in.data();
  float* const o0 = out.data();
  const auto f32 = dtype::f32;
  const auto sum = reduce_op::sum;
  return capture([&] {
    switch (what) {
      case invalid_in::all_reduce_negative_count:
        c.all_reduce(i0, o0, bad ? -5 : count, f32, sum);
        return;
      case invalid_in::all_gather_negative_count:
        c.all_gather(i0, o0, bad ? -5 : count, f32);
        return;
      case invalid_in::reduce_scatter_negative_count:
        c.reduce_scatter(i0, o0, bad ? -5 : count, f32, sum);
        return;
      case invalid_in::broadcast_negative_count: c.broadcast(o0, bad ? -5 : count, f32, 0); return;
      case invalid_in::all_reduce_null_input:
        c.all_reduce(bad ? nullptr : i0, o0, count, f32, sum);
        return;
      case invalid_in::all_reduce_null_output:
        c.all_reduce(i0, bad ? nullptr : o0, count, f32, sum);
        return;
      case invalid_in::all_gather_null_input:
        c.all_gather(bad ? nullptr : i0, o0, count, f32);
        return;
      case invalid_in::all_gather_null_output:
        c.all_gather(i0, bad ? nullptr : o0, count, f32);
        return;
      case invalid_in::reduce_scatter_null_input:
        c.reduce_scatter(bad ? nullptr : i0, o0, count, f32, sum);
        return;
      case invalid_in::reduce_scatter_null_output:
        c.reduce_scatter(i0, bad ? nullptr : o0, count, f32, sum);
        return;
      case invalid_in::broadcast_null_buffer:
        c.broadcast(bad ? nullptr : o0, count, f32, 0);
        return;
      case invalid_in::root_too_large: c.broadcast(o0, count, f32, bad ? n : 0); return;
      case invalid_in::root_negative: c.broadcast(o0, count, f32, bad ? -1 : 0); return;
      case invalid_in::bad_dtype:
        c.all_reduce(i0, o0, count, bad ? static_cast<dtype>(7) : f32, sum);
        return;
      case invalid_in::bad_op:
        c.all_reduce(i0, o0, count, f32, bad ? static_cast<reduce_op>(9) : sum);
        return;
      case invalid_in::all_reduce_overlap:  // out starts one element into in
        c.all_reduce(i0, bad ? i0 + 1 : o0, count, f32, sum);
        return;
      case invalid_in::all_gather_overlap:  // in one element past its in-place position
        c.all_gather(bad ? o0 + count * me + 1 : i0, o0, count, f32);
        return;
      case invalid_in::reduce_scatter_overlap:  // out one element past its in-place position
        c.reduce_scatter(i0, bad ? i0 + count * me + 1 : o0, count, f32, sum);
        return;
      case invalid_in::split_negative_color: (void)c.split(bad ? -1 : 0, 0); return;
    }
  });
}

/// An invalid argument to a point-to-point call (checked locally, before any matching).
enum class invalid_p2p : std::uint8_t {
  send_peer_too_large,
  send_peer_negative,
  recv_peer_too_large,
  recv_peer_negative,
  send_negative_count,
  recv_negative_count,
  send_null_buffer,
  recv_null_buffer,
  send_async_bad_peer,
  recv_async_bad_peer
};

/// Every invalid point-to-point argument.
inline constexpr invalid_p2p all_invalid_p2p_args[] = {
    invalid_p2p::send_peer_too_large, invalid_p2p::send_peer_negative,
    invalid_p2p::recv_peer_too_large, invalid_p2p::recv_peer_negative,
    invalid_p2p::send_negative_count, invalid_p2p::recv_negative_count,
    invalid_p2p::send_null_buffer,    invalid_p2p::recv_null_buffer,
    invalid_p2p::send_async_bad_peer, invalid_p2p::recv_async_bad_peer};

/// The point-to-point call with the invalid argument `what`; returns its outcome.
template <Communicator C>
outcome provoke_invalid_p2p(C& c, invalid_p2p what) {
  const int n = c.size();
  const int next = (c.rank() + 1) % n;
  std::vector<float> buf(8);
  float* const b = buf.data();
  const auto f32 = dtype::f32;
  return capture([&] {
    switch (what) {
      case invalid_p2p::send_peer_too_large: c.send(b, 8, f32, n, 0); return;
      case invalid_p2p::send_peer_negative: c.send(b, 8, f32, -1, 0); return;
      case invalid_p2p::recv_peer_too_large: c.recv(b, 8, f32, n, 0); return;
      case invalid_p2p::recv_peer_negative: c.recv(b, 8, f32, -1, 0); return;
      case invalid_p2p::send_negative_count: c.send(b, -1, f32, next, 0); return;
      case invalid_p2p::recv_negative_count: c.recv(b, -1, f32, next, 0); return;
      case invalid_p2p::send_null_buffer: c.send(nullptr, 8, f32, next, 0); return;
      case invalid_p2p::recv_null_buffer: c.recv(nullptr, 8, f32, next, 0); return;
      case invalid_p2p::send_async_bad_peer: (void)c.send_async(b, 8, f32, n + 3, 0); return;
      case invalid_p2p::recv_async_bad_peer: (void)c.recv_async(b, 8, f32, -7, 0); return;
    }
  });
}

/// Rank 0 sends 10 f32 to rank 1 (tag 5), which receives 11 f32 (count) or 10 f64 (dtype);
/// other ranks do nothing. Returns this rank's outcome.
template <Communicator C>
outcome provoke_p2p_mismatch(C& c, bool dtype_differs) {
  std::vector<double> buf(16);
  return capture([&] {
    if (c.rank() == 0) c.send(buf.data(), 10, dtype::f32, 1, 5);
    if (c.rank() == 1)
      c.recv(buf.data(), dtype_differs ? 10 : 11, dtype_differs ? dtype::f64 : dtype::f32, 0, 5);
  });
}

/// Where a rank waits for a peer that may fail.
enum class wait_point : std::uint8_t {
  all_reduce,
  all_gather,
  reduce_scatter,
  broadcast,
  barrier,
  split,
  recv,
  all_reduce_async
};

/// Every wait point.
inline constexpr wait_point all_wait_points[] = {
    wait_point::all_reduce, wait_point::all_gather,      wait_point::reduce_scatter,
    wait_point::broadcast,  wait_point::barrier,         wait_point::split,
    wait_point::recv,       wait_point::all_reduce_async};

/// The name of a wait point.
constexpr std::string_view to_string(wait_point w) noexcept {
  switch (w) {
    case wait_point::all_reduce: return "all_reduce";
    case wait_point::all_gather: return "all_gather";
    case wait_point::reduce_scatter: return "reduce_scatter";
    case wait_point::broadcast: return "broadcast";
    case wait_point::barrier: return "barrier";
    case wait_point::split: return "split";
    case wait_point::recv: return "recv";
    case wait_point::all_reduce_async: return "all_reduce_async";
  }
  return "unknown-wait-point";
}

/// Calls a small valid operation of kind w on c (recv: from rank `peer`); returns its outcome.
template <Communicator C>
outcome wait_in(C& c, wait_point w, int peer) {
  std::vector<float> in(static_cast<std::size_t>(8 * c.size()), 1.0f);
  std::vector<float> out(in.size());
  const auto f32 = dtype::f32;
  return capture([&] {
    switch (w) {
      case wait_point::all_reduce:
        c.all_reduce(in.data(), out.data(), 8, f32, reduce_op::sum);
        return;
      case wait_point::all_gather: c.all_gather(in.data(), out.data(), 8, f32); return;
      case wait_point::reduce_scatter:
        c.reduce_scatter(in.data(), out.data(), 8, f32, reduce_op::sum);
        return;
      case wait_point::broadcast: c.broadcast(out.data(), 8, f32, peer); return;
      case wait_point::barrier: c.barrier(); return;
      case wait_point::split: (void)c.split(0, 0); return;
      case wait_point::recv: c.recv(out.data(), 8, f32, peer, 0); return;
      case wait_point::all_reduce_async:
        c.all_reduce_async(in.data(), out.data(), 8, f32, reduce_op::sum).wait();
        return;
    }
  });
}

}  // namespace fedshard::test
