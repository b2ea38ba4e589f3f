// checked_space, the stream-checking space: the MemorySpace requirements
// (tests/space/space_checks.hpp) in each of its modes, deferred work, waits that order streams
// for real, poisoned free blocks, refused arguments, timeouts and failures that reach the host.
#include "fedshard/space/checked_space.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fedshard/space/host_space.hpp"
#include "space/space_checks.hpp"
#include "support/collective_checks.hpp"

using namespace fedshard;
using space::checked_options;
using space::checked_space;
using space::host_space;

static_assert(space::MemorySpace<checked_space>);

namespace {

/// The message of the E that f throws (and a failed check when it throws none).
template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  FAIL_CHECK("expected an exception, found none");
  return {};
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

/// out = 2 * in + 1.
struct twice_plus_one {
  void operator()(float& out, float in) const noexcept { out = 2.0f * in + 1.0f; }
};

/// A producer stream fills a with 1, a consumer stream copies a into b, waiting for the
/// producer's event or not; returns b as the host reads it after synchronizing the consumer.
template <class S>
std::vector<float> produce_then_consume(S& s, bool wait) {
  auto producer = s.make_stream();
  auto consumer = s.make_stream();
  auto a = s.template allocate<float>(256);
  auto b = s.template allocate<float>(256);
  s.fill(producer, a.view(), 1.0);
  if (wait) s.wait(consumer, s.record(producer));
  s.copy(consumer, a.view(), b.view());
  auto seen = test::read_back(s, consumer, b);
  s.synchronize(producer);
  return seen;
}

/// The engine's pattern on three streams: each round a gather stream writes a unit, a
/// compute stream reads it into a gradient, a reduce stream copies the gradient out; events
/// order each read after its write and each overwrite after the read before it. The host
/// synchronizes once, at the end.
template <class S>
void check_pipeline(S& s) {
  auto gather = s.make_stream();
  auto compute = s.make_stream();
  auto reduce = s.make_stream();
  constexpr std::size_t n = 1000;
  constexpr int rounds = 25;
  auto gathered = s.template allocate<float>(n);
  auto grad = s.template allocate<float>(n);
  auto reduced = s.template allocate<float>(n);
  std::vector<std::vector<float>> out(rounds, std::vector<float>(n, -1.0f));
  for (int r = 0; r < rounds; ++r) {
    s.fill(gather, gathered.view(), double(r));
    s.wait(compute, s.record(gather));
    s.for_each(compute, twice_plus_one{}, grad.span(), std::span<const float>(gathered.span()));
    const auto computed = s.record(compute);
    s.wait(gather, computed);  // the next gather overwrites what compute read
    s.wait(reduce, computed);
    s.copy(reduce, grad.view(), reduced.view());
    s.to_host(reduce, reduced.view(), view(std::span<float>(out[std::size_t(r)])));
    s.wait(compute, s.record(reduce));  // the next compute overwrites what reduce read
  }
  s.synchronize(reduce);
  s.synchronize(compute);
  s.synchronize(gather);
  for (int r = 0; r < rounds; ++r)
    for (float x : out[std::size_t(r)]) REQUIRE(x == 2.0f * float(r) + 1.0f);
}

}  // namespace

TEST_CASE("checked_space meets the MemorySpace requirements in each mode") {
  CHECK(checked_space::name == "checked");
  CHECK(checked_space::host_accessible);
  SUBCASE("default") {
    checked_space s;
    test::check_allocation(s);
    test::check_kernels(s);
    test::check_streams(s);
  }
  SUBCASE("hold") {
    checked_space s({.hold = true});
    test::check_allocation(s);
    test::check_kernels(s);
    test::check_streams(s);
  }
  SUBCASE("delay") {
    checked_space s({.delay = std::chrono::microseconds(100)});
    test::check_allocation(s);
    test::check_kernels(s);
    test::check_streams(s);
  }
}

TEST_CASE("checked_space refuses a timeout that is not positive") {
  CHECK_THROWS_AS(checked_space({.timeout = std::chrono::duration<double>(0)}), invalid_argument);
}

TEST_CASE("checked_space defers work: in hold mode a fill shows only after synchronize") {
  checked_space s({.hold = true});
  auto st = s.make_stream();
  auto b = s.allocate<float>(64);
  s.fill(st, b.view(), 3.0);
  const auto filled = s.record(st);
  CHECK_FALSE(s.ready(filled));
  for (float x : b.span()) CHECK(x == 0.0f);  // queued, not run
  s.synchronize(st);
  CHECK(s.ready(filled));
  for (float x : b.span()) CHECK(x == 3.0f);
}

TEST_CASE("checked_space: a wait asks for the work it waits for; ready() asks for nothing") {
  checked_space s({.hold = true});
  auto producer = s.make_stream("producer");
  auto consumer = s.make_stream("consumer");
  auto a = s.allocate<float>(32);
  auto b = s.allocate<float>(32);
  s.fill(producer, a.view(), 5.0);
  const auto produced = s.record(producer);
  s.wait(consumer, produced);
  s.copy(consumer, a.view(), b.view());
  const auto consumed = s.record(consumer);
  CHECK_FALSE(s.ready(produced));
  CHECK_FALSE(s.ready(consumed));
  CHECK_FALSE(s.ready(produced));
  for (float x : a.span()) CHECK(x == 0.0f);
  s.synchronize(consumed);  // runs the consumer, whose wait runs the producer's fill
  CHECK(s.ready(produced));
  for (float x : b.span()) CHECK(x == 5.0f);
}

TEST_CASE("checked_space: destroying a stream runs what was queued on it") {
  checked_space s({.hold = true});
  auto b = s.allocate<float>(16);
  {
    auto st = s.make_stream();
    s.fill(st, b.view(), 4.0);
  }
  for (float x : b.span()) CHECK(x == 4.0f);
  SUBCASE("also when it is paused") {
    {
      auto st = s.make_stream();
      s.pause(st);
      s.fill(st, b.view(), 6.0);
    }
    for (float x : b.span()) CHECK(x == 6.0f);
  }
  SUBCASE("and when a stream is assigned over it") {
    auto st = s.make_stream();
    s.fill(st, b.view(), 7.0);
    st = s.make_stream();
    for (float x : b.span()) CHECK(x == 7.0f);
  }
}

TEST_CASE("a missing wait gives wrong values on checked_space, where host_space hides it") {
  host_space h;
  for (float x : produce_then_consume(h, false)) CHECK(x == 1.0f);  // right by luck
  checked_space s({.hold = true});
  for (float x : produce_then_consume(s, false)) CHECK(x == 0.0f);  // the fill had not run
  for (float x : produce_then_consume(s, true)) CHECK(x == 1.0f);
}

TEST_CASE("checked_space orders three streams by events (gather, compute, reduce)") {
  SUBCASE("host_space") {
    host_space s;
    check_pipeline(s);
  }
  SUBCASE("checked_space") {
    checked_space s;
    check_pipeline(s);
  }
  SUBCASE("checked_space, hold") {
    checked_space s({.hold = true});
    check_pipeline(s);
  }
  SUBCASE("checked_space, delay") {
    checked_space s({.delay = std::chrono::microseconds(50)});
    check_pipeline(s);
  }
}

TEST_CASE_TEMPLATE("checked_space: a span kept past its buffer's release reads NaN", T, float,
                   double, bf16, f16) {
  // What catches a use after release on the host: the block is back in the cache, filled
  // with 0xFF bytes, a NaN in every dtype.
  checked_space s;
  auto st = s.make_stream();
  std::span<T> stale;
  {
    auto b = s.template allocate<T>(100);
    s.fill(st, b.view(), 1.0);
    s.synchronize(st);
    stale = b.span();
    for (T x : stale) CHECK(static_cast<float>(x) == 1.0f);
  }
  for (T x : stale) CHECK(std::isnan(static_cast<float>(x)));
  auto again = s.template allocate<T>(100);  // the same block, zeroed for its new owner
  CHECK(again.data() == stale.data());
  for (T x : again.span()) CHECK(static_cast<float>(x) == 0.0f);
  // the block's bytes past the buffer's end are NaN too
  T past;
  std::memcpy(&past, again.data() + again.size(), sizeof(T));
  CHECK(std::isnan(static_cast<float>(past)));
}

TEST_CASE("checked_space: a buffer released while a stream still uses it fails that stream") {
  checked_space s({.hold = true});
  auto st = s.make_stream("gather");
  const void* where = nullptr;
  {
    auto b = s.allocate<float>(64);
    where = b.data();
    s.fill(st, b.view(), 7.0);
  }  // released with the fill still queued
  const std::string msg = message_of<invalid_argument>([&] { s.synchronize(st); });
  CHECK(contains(msg, "was released while task 1 (fill) of stream 'gather' was queued"));
  CHECK_THROWS_AS(s.synchronize(st), invalid_argument);  // the stream stays failed
  auto c = s.allocate<float>(64);
  CHECK(c.data() == where);
  for (float x : c.span()) CHECK(x == 0.0f);  // the fill was skipped, not run on the new owner
}

TEST_CASE("checked_space refuses, at the call, memory a GPU kernel could not use") {
  checked_space s;
  auto st = s.make_stream();
  std::vector<float> host(8, 9.0f);
  auto b = s.allocate<float>(8);
  const auto host_view = view(std::span<float>(host));
  SUBCASE("host memory") {
    CHECK(contains(message_of<invalid_argument>([&] { s.fill(st, host_view, 1.0); }),
                   "found other memory"));
    CHECK_THROWS_AS(s.copy(st, host_view, b.view()), invalid_argument);
    CHECK_THROWS_AS(s.cast(st, b.view(), host_view), invalid_argument);
    CHECK_THROWS_AS(s.for_each(st, space::assign_update{}, std::span<float>(host),
                               std::span<const float>(b.span())),
                    invalid_argument);
  }
  SUBCASE("past the end of a buffer") {
    const buffer_view longer{b.data(), 9, dtype::f32};
    CHECK(contains(message_of<invalid_argument>([&] { s.fill(st, longer, 1.0); }),
                   "inside its buffer of 32 bytes, found 36 bytes from byte 0"));
    const buffer_view shifted{b.data() + 1, 8, dtype::f32};
    CHECK_THROWS_AS(s.to_host(st, shifted, host_view), invalid_argument);
  }
  SUBCASE("a released buffer") {
    buffer_view stale;
    {
      auto c = s.allocate<float>(8);
      stale = c.view();
    }
    CHECK(contains(message_of<invalid_argument>([&] { s.fill(st, stale, 1.0); }),
                   "use after release"));
    CHECK_THROWS_AS(s.to_host(st, b.view(), stale), invalid_argument);  // a host side, too
  }
  SUBCASE("an invalid dtype") {
    CHECK_THROWS_AS(s.fill(st, buffer_view{b.data(), 8, static_cast<dtype>(42)}, 1.0),
                    invalid_argument);
  }
  // host memory is fine on the host side of to_host and from_host; nothing refused was queued
  s.from_host(st, host_view, b.view());
  s.to_host(st, b.view(), host_view);
  s.synchronize(st);
  for (float x : b.span()) CHECK(x == 9.0f);
}

TEST_CASE("checked_space: a wait for an event that never completes times out") {
  test::scoped_env env("FEDSHARD_TIMEOUT_S", "0.2");
  checked_space s;
  CHECK(s.options().timeout.count() == doctest::Approx(0.2));
  auto producer = s.make_stream("producer");
  auto consumer = s.make_stream("consumer");
  auto a = s.allocate<float>(16);
  auto b = s.allocate<float>(16);
  s.pause(producer);
  s.fill(producer, a.view(), 1.0);
  const auto filled = s.record(producer);
  s.wait(consumer, filled);
  s.copy(consumer, a.view(), b.view());
  const auto start = std::chrono::steady_clock::now();
  const std::string msg = message_of<timeout_error>([&] { s.synchronize(consumer); });
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(60));  // no hang
  CHECK(contains(msg,
                 "stream 'consumer' waited more than 0.2 s for an event of stream "
                 "'producer' (its first 1 tasks)"));
  CHECK(contains(msg, "'producer' has completed 0 of its 1 queued tasks and is paused"));
  CHECK_FALSE(s.ready(filled));
  const std::string host_msg = message_of<timeout_error>([&] { s.synchronize(filled); });
  CHECK(contains(host_msg,
                 "the host waited in synchronize(event) more than 0.2 s for stream "
                 "'producer'"));
  s.resume(producer);
  s.synchronize(producer);
  for (float x : a.span()) CHECK(x == 1.0f);
  // the consumer failed for good: its copy was skipped, and it keeps reporting the timeout
  CHECK_THROWS_AS(s.synchronize(consumer), timeout_error);
  for (float x : b.span()) CHECK(x == 0.0f);
}

TEST_CASE("checked_space: the host times out on a stream that makes no progress") {
  test::scoped_env env("FEDSHARD_TIMEOUT_S", "0.2");
  checked_space s;
  auto st = s.make_stream("stuck");
  auto b = s.allocate<float>(16);
  s.pause(st);
  s.fill(st, b.view(), 2.0);
  const std::string msg = message_of<timeout_error>([&] { s.synchronize(st); });
  CHECK(contains(msg,
                 "the host waited in synchronize(stream) more than 0.2 s for stream 'stuck' "
                 "to complete its first 1 tasks"));
  CHECK(contains(msg, "is paused (resume it)"));
  s.resume(st);  // a host timeout does not fail the stream
  s.synchronize(st);
  for (float x : b.span()) CHECK(x == 2.0f);
}

TEST_CASE("checked_space: an exception in a task reaches the host at synchronize") {
  checked_space s;
  auto st = s.make_stream("compute");
  auto b = s.allocate<float>(8);
  s.fill(st, b.view(), 1.0);
  const auto before = s.record(st);
  s.host_task(
      st, [] { throw backend_error("injected failure"); }, "injected");
  s.fill(st, b.view(), 2.0);
  const auto after = s.record(st);
  s.synchronize(before);  // the failure comes later
  CHECK_THROWS_WITH_AS(s.synchronize(st), "injected failure", backend_error);
  CHECK_THROWS_WITH_AS(s.synchronize(st), "injected failure", backend_error);  // for good
  CHECK(s.ready(after));
  CHECK_THROWS_AS(s.synchronize(after), backend_error);
  for (float x : b.span()) CHECK(x == 1.0f);  // the fill after the failure was skipped
  SUBCASE("a stream that waits for a later event fails with the same error") {
    auto reduce = s.make_stream("reduce");
    s.wait(reduce, after);
    s.fill(reduce, b.view(), 3.0);
    CHECK_THROWS_WITH_AS(s.synchronize(reduce), "injected failure", backend_error);
    for (float x : b.span()) CHECK(x == 1.0f);
  }
  SUBCASE("a stream that waits for an earlier event goes on") {
    auto reduce = s.make_stream("reduce");
    s.wait(reduce, before);
    s.fill(reduce, b.view(), 3.0);
    s.synchronize(reduce);
    for (float x : b.span()) CHECK(x == 3.0f);
  }
}

TEST_CASE("checked_space streams: names, moves, and streams of another space") {
  checked_space s;
  auto a = s.make_stream("gather");
  CHECK(a.name() == "gather");
  CHECK(s.make_stream().name().substr(0, 7) == "stream ");
  auto b = s.allocate<float>(4);
  auto moved = std::move(a);
  CHECK(moved.name() == "gather");
  CHECK(a.name().empty());  // NOLINT(bugprone-use-after-move): a moved-from handle is empty
  CHECK(contains(message_of<invalid_argument>([&] { s.fill(a, b.view(), 1.0); }), "moved-from"));
  checked_space other;
  auto foreign = other.make_stream("theirs");
  CHECK(contains(message_of<invalid_argument>([&] { s.synchronize(foreign); }),
                 "'theirs', a stream of another checked_space"));
  // a default event, and an event of the stream itself, need no wait
  s.wait(moved, checked_space::event{});
  s.wait(moved, s.record(moved));
  s.fill(moved, b.view(), 8.0);
  s.synchronize(moved);
  for (float x : b.span()) CHECK(x == 8.0f);
}
