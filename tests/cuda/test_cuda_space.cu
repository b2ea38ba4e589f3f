// cuda_space: the MemorySpace requirements (the generic checks of tests/space, which read
// buffers back through to_host), casts bit-identical to the host conversion for every dtype
// pair and awkward values, element functors, the allocation counter across steps, events
// ordering two streams, and the raw stream for other libraries.
#include "fedshard/cuda/cuda_space.cuh"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/error.hpp"
#include "fedshard/kernels/adamw.hpp"
#include "fedshard/kernels/cast.hpp"
#include "fedshard/kernels/sgd.hpp"
#include "fedshard/space/memory_space.hpp"
#include "space/space_checks.hpp"

namespace {

namespace gpu = fedshard::gpu;
using namespace fedshard;

static_assert(space::MemorySpace<gpu::cuda_space>);

/// A reproducible value in [-1, 1) for index i.
double hash_value(int i) {
  std::uint64_t z = static_cast<std::uint64_t>(i) * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}
static_assert(!gpu::cuda_space::host_accessible);
static_assert(
    std::is_same_v<decltype(std::declval<gpu::cuda_space::stream&>().get()), cudaStream_t>);

TEST_SUITE("no_device") {
  TEST_CASE("a cuda_space of a device that does not exist is refused") {
    CHECK_THROWS_AS(gpu::cuda_space(100000), invalid_argument);
    CHECK_THROWS_AS(gpu::cuda_space(-1), invalid_argument);
    const gpu::cuda_space::event none{};
    CHECK(none.empty());
    CHECK(none.ready());
  }
}

TEST_CASE("cuda_space meets the MemorySpace requirements (generic checks)") {
  gpu::cuda_space s;
  CHECK(s.device() == gpu::current_device());
  test::check_allocation(s);
  test::check_kernels(s);
  test::check_streams(s);
}

/// Values that exercise rounding: ties, subnormals, overflow, infinities, NaN, signed zero.
std::vector<double> awkward_values() {
  std::vector<double> v = {0.0,
                           -0.0,
                           1.0,
                           -1.0,
                           1.00390625,  // bf16 tie
                           1.01171875,
                           65504.0,
                           65520.0,  // f16 overflow to inf
                           1e-8,
                           -3e-39,  // float subnormal
                           1e-45,
                           3.4e38,
                           1e300,
                           std::numeric_limits<double>::infinity(),
                           -std::numeric_limits<double>::infinity(),
                           std::numeric_limits<double>::quiet_NaN()};
  for (int i = 0; i < 2000; ++i) v.push_back(std::ldexp(hash_value(i), (i % 80) - 40));
  return v;
}

template <class From, class To>
void check_cast_pair(gpu::cuda_space& s, gpu::cuda_space::stream& st) {
  std::vector<From> in;
  for (double x : awkward_values()) in.push_back(kernels::cast_fn<double, From>{}(x));
  std::vector<To> want(in.size());
  kernels::cast(std::span<const From>(in), std::span<To>(want));
  auto din = test::upload(s, st, in);
  auto dout = s.allocate<To>(in.size());
  s.cast(st, din.view(), dout.view());
  const auto got = test::read_back(s, st, dout);
  INFO(to_string(dtype_of<From>), " -> ", to_string(dtype_of<To>));
  CHECK(std::memcmp(got.data(), want.data(), want.size() * sizeof(To)) == 0);
}

TEST_CASE("cast is bit-identical to kernels::cast for every dtype pair") {
  gpu::cuda_space s;
  auto st = s.make_stream();
  for (dtype a : {dtype::f32, dtype::f64, dtype::bf16, dtype::f16})
    for (dtype b : {dtype::f32, dtype::f64, dtype::bf16, dtype::f16})
      visit(a, b, [&](auto from, auto to) {
        check_cast_pair<typename decltype(from)::type, typename decltype(to)::type>(s, st);
      });
}

TEST_CASE("fill writes cast_fn<double, T>(value) in every dtype") {
  gpu::cuda_space s;
  auto st = s.make_stream();
  auto h = s.allocate<bf16>(1001);
  s.fill(st, h.view(), 1.00390625);
  const bf16 want = kernels::cast_fn<double, bf16>{}(1.00390625);
  for (bf16 x : test::read_back(s, st, h)) CHECK(x.bits == want.bits);
  auto d = s.allocate<double>(17);
  s.fill(st, d.view(), -2.25);
  for (double x : test::read_back(s, st, d)) CHECK(x == -2.25);
}

TEST_CASE("for_each runs the SGD functor with momentum like the host loop, at odd offsets") {
  gpu::cuda_space s;
  auto st = s.make_stream();
  const std::size_t n = 100003;
  std::vector<float> p(n), g(n), b(n);
  for (std::size_t i = 0; i < n; ++i) {
    p[i] = static_cast<float>(hash_value(static_cast<int>(i)));
    g[i] = static_cast<float>(hash_value(static_cast<int>(i) + 7)) * 0.1f;
    b[i] = static_cast<float>(hash_value(static_cast<int>(i) + 13)) * 0.01f;
  }
  auto dp = test::upload(s, st, p), dg = test::upload(s, st, g), db = test::upload(s, st, b);
  const kernels::sgd_scalars sc = kernels::make_sgd_scalars(0.05, 0.9, 0.1, 0.01, true, false);
  // Offsets of 1 element: the spans are not 16-byte aligned (element-wise path).
  s.for_each(st, kernels::sgd_update{sc}, dp.span().subspan(1),
             std::span<const float>(dg.span().subspan(1)), db.span().subspan(1));
  for (std::size_t i = 1; i < n; ++i) kernels::sgd_update{sc}(p[i], g[i], b[i]);
  const auto rp = test::read_back(s, st, dp), rb = test::read_back(s, st, db);
  CHECK(std::memcmp(rp.data(), p.data(), n * sizeof(float)) == 0);
  CHECK(std::memcmp(rb.data(), b.data(), n * sizeof(float)) == 0);
}

TEST_CASE("the allocation counter stays flat after the first step") {
  gpu::cuda_space s;
  auto st = s.make_stream();
  const std::size_t sizes[] = {1, 511, 4096, 100000, 3 << 20};
  std::int64_t after_first = 0;
  for (int step = 0; step < 10; ++step) {
    std::vector<gpu::cuda_space::buffer<float>> live;
    for (std::size_t n : sizes) live.push_back(s.allocate<float>(n));
    auto h = s.allocate<bf16>(12345);
    for (auto& b : live) s.fill(st, b.view(), double(step));
    s.synchronize(st);  // the rule: users synchronized before the buffers go
    if (step == 0) after_first = s.system_allocations();
    CHECK(s.system_allocations() == after_first);
  }
  CHECK(after_first == static_cast<std::int64_t>(std::size(sizes)) + 1);
  CHECK(s.cached_bytes() > 0);
}

TEST_CASE("events order two streams and are reused from the pool") {
  gpu::cuda_space s;
  test::check_streams(s);
  auto a = s.make_stream(), b = s.make_stream();
  CHECK(a.get() != b.get());
  CHECK(a.device() == s.device());
  const std::size_t n = std::size_t{16} << 20;
  auto big = s.allocate<float>(n);
  auto copy = s.allocate<float>(n);
  for (int round = 1; round <= 5; ++round) {
    s.fill(a, big.view(), double(round));  // a long write on a
    const auto ev = s.record(a);
    const auto ev2 = ev;  // copies share the event
    s.wait(b, ev2);
    s.copy(b, big.view(), copy.view());
    const auto back = test::read_back(s, b, copy);
    CHECK(back.front() == float(round));
    CHECK(back[n / 2] == float(round));
    CHECK(back.back() == float(round));
    CHECK(s.ready(ev));
  }
  // every event went back to the pool: recording more does not create new ones
  const std::size_t pooled = s.event_pool()->free_events();
  CHECK(pooled >= 1);
  for (int i = 0; i < 3; ++i) (void)s.record(a);
  CHECK(s.event_pool()->free_events() == pooled);
}

TEST_CASE("the raw stream takes other libraries' work in the same order") {
  gpu::cuda_space s;
  auto st = s.make_stream();
  auto b = s.allocate<float>(1000);
  s.fill(st, b.view(), 3.0);
  FEDSHARD_CUDA_TRY(cudaMemsetAsync(b.data(), 0, 10 * sizeof(float), st.get()));
  const auto back = test::read_back(s, st, b);
  CHECK(back[0] == 0.0f);
  CHECK(back[9] == 0.0f);
  CHECK(back[10] == 3.0f);
}

TEST_CASE("bad arguments are refused before anything is queued") {
  gpu::cuda_space s;
  auto st = s.make_stream();
  auto a = s.allocate<float>(8);
  auto h = s.allocate<bf16>(9);
  CHECK_THROWS_AS(s.cast(st, a.view(), h.view()), invalid_argument);
  CHECK_THROWS_AS(s.to_host(st, a.view(), h.view()), invalid_argument);
}

}  // namespace
