/// Tests of the Communicator concept and of its typed front-ends.

#include "fedshard/comm/communicator.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "support/error_of.hpp"
#include "support/spawn_ranks.hpp"

namespace {

using fedshard::bf16;
using fedshard::dtype;
using fedshard::f16;
using fedshard::reduce_op;
using fedshard::request;

/// Members of the concept, one bit each, that partial_comm can leave out.
enum member : unsigned {
  m_rank = 1u << 0,
  m_size = 1u << 1,
  m_all_reduce = 1u << 2,
  m_all_gather = 1u << 3,
  m_reduce_scatter = 1u << 4,
  m_broadcast = 1u << 5,
  m_send = 1u << 6,
  m_recv = 1u << 7,
  m_barrier = 1u << 8,
  m_split = 1u << 9,
  m_all_reduce_async = 1u << 10,
  m_all_gather_async = 1u << 11,
  m_reduce_scatter_async = 1u << 12,
  m_broadcast_async = 1u << 13,
  m_send_async = 1u << 14,
  m_recv_async = 1u << 15,
  m_moved = 1u << 16,
  m_algorithm_of = 1u << 17,
};

/// A communicator-shaped type without the members named in Missing.
template <unsigned Missing>
struct partial_comm {
  int rank() const requires((Missing & m_rank) == 0) { return 0; }
  int size() const requires((Missing & m_size) == 0) { return 1; }
  void all_reduce(const void*, void*, std::int64_t, dtype,
                  reduce_op) requires((Missing & m_all_reduce) == 0) {}
  void all_gather(const void*, void*, std::int64_t, dtype) requires((Missing & m_all_gather) == 0) {
  }
  void reduce_scatter(const void*, void*, std::int64_t, dtype,
                      reduce_op) requires((Missing & m_reduce_scatter) == 0) {}
  void broadcast(void*, std::int64_t, dtype, int) requires((Missing & m_broadcast) == 0) {}
  void send(const void*, std::int64_t, dtype, int, int) requires((Missing & m_send) == 0) {}
  void recv(void*, std::int64_t, dtype, int, int) requires((Missing & m_recv) == 0) {}
  void barrier() requires((Missing & m_barrier) == 0) {}
  partial_comm split(int, int) requires((Missing & m_split) == 0) { return {}; }
  request all_reduce_async(const void*, void*, std::int64_t, dtype,
                           reduce_op) requires((Missing & m_all_reduce_async) == 0) {
    return {};
  }
  request all_gather_async(const void*, void*, std::int64_t,
                           dtype) requires((Missing & m_all_gather_async) == 0) {
    return {};
  }
  request reduce_scatter_async(const void*, void*, std::int64_t, dtype,
                               reduce_op) requires((Missing & m_reduce_scatter_async) == 0) {
    return {};
  }
  request broadcast_async(void*, std::int64_t, dtype,
                          int) requires((Missing & m_broadcast_async) == 0) {
    return {};
  }
  request send_async(const void*, std::int64_t, dtype, int,
                     int) requires((Missing & m_send_async) == 0) {
    return {};
  }
  request recv_async(void*, std::int64_t, dtype, int, int) requires((Missing & m_recv_async) == 0) {
    return {};
  }
  fedshard::moved_bytes moved() const requires((Missing & m_moved) == 0) { return {}; }
  fedshard::wire_algorithm algorithm_of(fedshard::collective, std::int64_t, dtype) const
      requires((Missing & m_algorithm_of) == 0) {
    return fedshard::wire_algorithm::ring;
  }
};

static_assert(fedshard::Communicator<fedshard::inproc::communicator>);
static_assert(fedshard::Communicator<partial_comm<0>>);
static_assert(!fedshard::Communicator<partial_comm<m_rank>>);
static_assert(!fedshard::Communicator<partial_comm<m_size>>);
static_assert(!fedshard::Communicator<partial_comm<m_all_reduce>>);
static_assert(!fedshard::Communicator<partial_comm<m_all_gather>>);
static_assert(!fedshard::Communicator<partial_comm<m_reduce_scatter>>);
static_assert(!fedshard::Communicator<partial_comm<m_broadcast>>);
static_assert(!fedshard::Communicator<partial_comm<m_send>>);
static_assert(!fedshard::Communicator<partial_comm<m_recv>>);
static_assert(!fedshard::Communicator<partial_comm<m_barrier>>);
static_assert(!fedshard::Communicator<partial_comm<m_split>>);
static_assert(!fedshard::Communicator<partial_comm<m_all_reduce_async>>);
static_assert(!fedshard::Communicator<partial_comm<m_all_gather_async>>);
static_assert(!fedshard::Communicator<partial_comm<m_reduce_scatter_async>>);
static_assert(!fedshard::Communicator<partial_comm<m_broadcast_async>>);
static_assert(!fedshard::Communicator<partial_comm<m_send_async>>);
static_assert(!fedshard::Communicator<partial_comm<m_recv_async>>);
static_assert(!fedshard::Communicator<partial_comm<m_moved>>);
static_assert(!fedshard::Communicator<partial_comm<m_algorithm_of>>);

/// split must return the communicator type itself.
struct split_returns_other : partial_comm<m_split> {
  partial_comm<0> split(int, int) { return {}; }
};
static_assert(!fedshard::Communicator<split_returns_other>);

/// Async operations must return a fedshard::request.
struct async_returns_void : partial_comm<m_all_reduce_async> {
  void all_reduce_async(const void*, void*, std::int64_t, dtype, reduce_op) {}
};
static_assert(!fedshard::Communicator<async_returns_void>);

/// A communicator must be movable.
struct not_movable : partial_comm<0> {
  not_movable() = default;
  not_movable(not_movable&&) = delete;
};
static_assert(!fedshard::Communicator<not_movable>);

/// One call a recording_comm received.
struct call {
  std::string name;
  const void* in = nullptr;
  void* out = nullptr;
  std::int64_t count = -1;
  dtype type = dtype::f32;
  reduce_op op = reduce_op::sum;
  int peer_or_root = -1;
  int tag = -1;
};

/// A Communicator of 4 ranks that records the calls it receives and moves no data.
struct recording_comm {
  std::vector<call> calls;

  int rank() const { return 1; }
  int size() const { return 4; }
  void all_reduce(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    calls.push_back({"all_reduce", in, out, n, t, op});
  }
  void all_gather(const void* in, void* out, std::int64_t n, dtype t) {
    calls.push_back({"all_gather", in, out, n, t});
  }
  void reduce_scatter(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    calls.push_back({"reduce_scatter", in, out, n, t, op});
  }
  void broadcast(void* buf, std::int64_t n, dtype t, int root) {
    calls.push_back({"broadcast", buf, buf, n, t, reduce_op::sum, root});
  }
  void send(const void* in, std::int64_t n, dtype t, int peer, int tag) {
    calls.push_back({"send", in, nullptr, n, t, reduce_op::sum, peer, tag});
  }
  void recv(void* out, std::int64_t n, dtype t, int peer, int tag) {
    calls.push_back({"recv", nullptr, out, n, t, reduce_op::sum, peer, tag});
  }
  void barrier() { calls.push_back({"barrier"}); }
  recording_comm split(int, int) { return {}; }
  request all_reduce_async(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    calls.push_back({"all_reduce_async", in, out, n, t, op});
    return {};
  }
  request all_gather_async(const void* in, void* out, std::int64_t n, dtype t) {
    calls.push_back({"all_gather_async", in, out, n, t});
    return {};
  }
  request reduce_scatter_async(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    calls.push_back({"reduce_scatter_async", in, out, n, t, op});
    return {};
  }
  request broadcast_async(void* buf, std::int64_t n, dtype t, int root) {
    calls.push_back({"broadcast_async", buf, buf, n, t, reduce_op::sum, root});
    return {};
  }
  request send_async(const void* in, std::int64_t n, dtype t, int peer, int tag) {
    calls.push_back({"send_async", in, nullptr, n, t, reduce_op::sum, peer, tag});
    return {};
  }
  request recv_async(void* out, std::int64_t n, dtype t, int peer, int tag) {
    calls.push_back({"recv_async", nullptr, out, n, t, reduce_op::sum, peer, tag});
    return {};
  }
  fedshard::moved_bytes moved() const { return {}; }  // moves no data
  fedshard::wire_algorithm algorithm_of(fedshard::collective, std::int64_t, dtype) const {
    return fedshard::wire_algorithm::ring;
  }
};
static_assert(fedshard::Communicator<recording_comm>);

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("front-ends: all_reduce passes pointers, size and dtype; sizes must match") {
  recording_comm c;
  std::vector<double> in(5);
  std::vector<double> out(5);
  fedshard::all_reduce(c, std::span<const double>(in), std::span<double>(out), reduce_op::min);
  REQUIRE(c.calls.size() == 1);
  CHECK(c.calls[0].name == "all_reduce");
  CHECK(c.calls[0].in == in.data());
  CHECK(c.calls[0].out == out.data());
  CHECK(c.calls[0].count == 5);
  CHECK(c.calls[0].type == dtype::f64);
  CHECK(c.calls[0].op == reduce_op::min);

  std::vector<double> short_out(4);
  const std::string msg = fedshard::test::error_of([&] {
    fedshard::all_reduce(c, std::span<const double>(in), std::span<double>(short_out),
                         reduce_op::sum);
  });
  CAPTURE(msg);
  CHECK(contains(msg, "5"));
  CHECK(contains(msg, "4"));
  CHECK(c.calls.size() == 1);  // nothing reached the communicator
}

TEST_CASE("front-ends: in-place all_reduce and its async variant") {
  recording_comm c;
  std::vector<bf16> buf(9);
  fedshard::all_reduce(c, std::span<bf16>(buf), reduce_op::avg);
  request r = fedshard::all_reduce_async(c, std::span<bf16>(buf), reduce_op::max);
  r.wait();
  REQUIRE(c.calls.size() == 2);
  CHECK(c.calls[0].name == "all_reduce");
  CHECK(c.calls[1].name == "all_reduce_async");
  for (const call& k : c.calls) {
    CHECK(k.in == buf.data());
    CHECK(k.out == buf.data());
    CHECK(k.count == 9);
    CHECK(k.type == dtype::bf16);
  }
  CHECK(c.calls[0].op == reduce_op::avg);
  CHECK(c.calls[1].op == reduce_op::max);
}

TEST_CASE("front-ends: all_gather needs out = in * size and passes the input count") {
  recording_comm c;
  std::vector<f16> in(3);
  std::vector<f16> out(12);
  fedshard::all_gather(c, std::span<const f16>(in), std::span<f16>(out));
  request r = fedshard::all_gather_async(c, std::span<const f16>(in), std::span<f16>(out));
  REQUIRE(c.calls.size() == 2);
  CHECK(c.calls[0].name == "all_gather");
  CHECK(c.calls[1].name == "all_gather_async");
  for (const call& k : c.calls) {
    CHECK(k.in == in.data());
    CHECK(k.out == out.data());
    CHECK(k.count == 3);
    CHECK(k.type == dtype::f16);
  }

  std::vector<f16> wrong(11);
  for (bool async : {false, true}) {
    CAPTURE(async);
    const std::string msg = fedshard::test::error_of([&] {
      if (async)
        (void)fedshard::all_gather_async(c, std::span<const f16>(in), std::span<f16>(wrong));
      else
        fedshard::all_gather(c, std::span<const f16>(in), std::span<f16>(wrong));
    });
    CAPTURE(msg);
    CHECK(contains(msg, "3 * 4"));
    CHECK(contains(msg, "11"));
  }
  CHECK(c.calls.size() == 2);
}

TEST_CASE("front-ends: reduce_scatter needs in = out * size and passes the output count") {
  recording_comm c;
  std::vector<float> in(8);
  std::vector<float> out(2);
  fedshard::reduce_scatter(c, std::span<const float>(in), std::span<float>(out), reduce_op::sum);
  request r = fedshard::reduce_scatter_async(c, std::span<const float>(in), std::span<float>(out),
                                             reduce_op::avg);
  REQUIRE(c.calls.size() == 2);
  CHECK(c.calls[0].name == "reduce_scatter");
  CHECK(c.calls[1].name == "reduce_scatter_async");
  for (const call& k : c.calls) {
    CHECK(k.in == in.data());
    CHECK(k.out == out.data());
    CHECK(k.count == 2);
    CHECK(k.type == dtype::f32);
  }
  CHECK(c.calls[1].op == reduce_op::avg);

  std::vector<float> wrong(7);
  for (bool async : {false, true}) {
    CAPTURE(async);
    const std::string msg = fedshard::test::error_of([&] {
      if (async)
        (void)fedshard::reduce_scatter_async(c, std::span<const float>(wrong),
                                             std::span<float>(out), reduce_op::sum);
      else
        fedshard::reduce_scatter(c, std::span<const float>(wrong), std::span<float>(out),
                                 reduce_op::sum);
    });
    CAPTURE(msg);
    CHECK(contains(msg, "2 * 4"));
    CHECK(contains(msg, "7"));
  }
  CHECK(c.calls.size() == 2);
}

TEST_CASE("front-ends: broadcast, send and recv pass count, dtype, root, peer and tag") {
  recording_comm c;
  std::vector<double> buf(6);
  std::vector<bf16> msg(3);
  fedshard::broadcast(c, std::span<double>(buf), 2);
  fedshard::send(c, std::span<const bf16>(msg), 3, 11);
  fedshard::recv(c, std::span<bf16>(msg), 0);
  REQUIRE(c.calls.size() == 3);
  CHECK(c.calls[0].name == "broadcast");
  CHECK(c.calls[0].out == buf.data());
  CHECK(c.calls[0].count == 6);
  CHECK(c.calls[0].type == dtype::f64);
  CHECK(c.calls[0].peer_or_root == 2);
  CHECK(c.calls[1].name == "send");
  CHECK(c.calls[1].in == msg.data());
  CHECK(c.calls[1].count == 3);
  CHECK(c.calls[1].type == dtype::bf16);
  CHECK(c.calls[1].peer_or_root == 3);
  CHECK(c.calls[1].tag == 11);
  CHECK(c.calls[2].name == "recv");
  CHECK(c.calls[2].out == msg.data());
  CHECK(c.calls[2].peer_or_root == 0);
  CHECK(c.calls[2].tag == 0);  // the default tag
}

TEST_CASE("front-ends: typed collectives on an inproc world") {
  constexpr int n = 3;
  std::vector<std::vector<float>> reduced(n), gathered(n), scattered(n), broadcasted(n), got(n);
  fedshard::test::spawn_ranks(n, [&](fedshard::inproc::communicator& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    const float me = static_cast<float>(c.rank() + 1);
    const std::vector<float> in = {me, 10 * me};
    reduced[r].resize(2);
    fedshard::all_reduce(c, std::span<const float>(in), std::span<float>(reduced[r]),
                         reduce_op::sum);
    gathered[r].resize(2 * n);
    fedshard::all_gather(c, std::span<const float>(in), std::span<float>(gathered[r]));
    std::vector<float> wide = {me, 2 * me, 3 * me, 4 * me, 5 * me, 6 * me};
    scattered[r].resize(2);
    fedshard::reduce_scatter(c, std::span<const float>(wide), std::span<float>(scattered[r]),
                             reduce_op::max);
    broadcasted[r] = {me, me};
    fedshard::broadcast(c, std::span<float>(broadcasted[r]), 1);
    got[r].resize(2);
    request s = c.send_async(in.data(), 2, dtype::f32, (c.rank() + 1) % n, 4);
    fedshard::recv(c, std::span<float>(got[r]), (c.rank() + n - 1) % n, 4);
    s.wait();
  });
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    const auto i = static_cast<std::size_t>(r);
    CHECK(reduced[i] == std::vector<float>{6, 60});
    CHECK(gathered[i] == std::vector<float>{1, 10, 2, 20, 3, 30});
    // Block r of every rank's {me, 2me, ..., 6me}; the max comes from rank 2 (me = 3).
    CHECK(scattered[i] == std::vector<float>{3.0f * (2 * r + 1), 3.0f * (2 * r + 2)});
    CHECK(broadcasted[i] == std::vector<float>{2, 2});
    const float left = static_cast<float>((r + n - 1) % n + 1);
    CHECK(got[i] == std::vector<float>{left, 10 * left});
  }
}

TEST_CASE("checked_count: a span's size as a count, refused when it does not fit in int64") {
  using fedshard::detail::checked_count;
  CHECK(checked_count(0) == 0);
  CHECK(checked_count(12345) == 12345);
  CHECK(checked_count(std::size_t{9223372036854775807u}) == INT64_MAX);  // 2^63 - 1 fits
  try {
    (void)checked_count(std::size_t{9223372036854775808u});  // 2^63 does not
    FAIL("a count of 2^63 was accepted");
  } catch (const fedshard::invalid_argument& e) {
    const std::string m = e.what();
    CHECK(m.find("at most 9223372036854775807") != std::string::npos);
    CHECK(m.find("found 9223372036854775808") != std::string::npos);
  }
}
