#pragma once
/// Space-generic checks of the MemorySpace requirements (include/fedshard/space/memory_space.hpp),
/// written once and run on every space: host_space and the stream-checking space on the host,
/// cuda_space on a GPU. Each function takes a space and throws check_failed (through
/// doctest's REQUIRE/CHECK macros in the including test) when a requirement does not hold.
/// Buffers are read back through to_host, so the checks hold for device spaces too.

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <vector>

#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/kernels/adamw.hpp"
#include "fedshard/kernels/cast.hpp"
#include "fedshard/space/memory_space.hpp"

namespace fedshard::test {

/// The elements of a buffer of S, read back to the host on stream st (synchronizes st).
template <class S, class B>
auto read_back(S& s, typename S::stream& st, const B& b) {
  using T = std::remove_pointer_t<decltype(b.data())>;
  std::vector<T> host(b.size());
  s.to_host(st, b.view(), view(std::span<T>(host)));
  s.synchronize(st);
  return host;
}

/// A buffer of S holding `values` (uploaded on st, which is synchronized).
template <class S, class T>
typename S::template buffer<T> upload(S& s, typename S::stream& st, const std::vector<T>& values) {
  auto b = s.template allocate<T>(values.size());
  s.from_host(st, cview(std::span<const T>(values)), b.view());
  s.synchronize(st);
  return b;
}

/// A buffer of S holding the indices `values` (uploaded as 4-byte f32 bit patterns, which a
/// copy moves untouched; st is synchronized).
template <class S>
typename S::template buffer<std::uint32_t> upload_indices(
    S& s, typename S::stream& st, const std::vector<std::uint32_t>& values) {
  auto b = s.template allocate<std::uint32_t>(values.size());
  s.from_host(st, const_buffer_view{values.data(), values.size(), dtype::f32},
              buffer_view{b.data(), b.size(), dtype::f32});
  s.synchronize(st);
  return b;
}

/// Requirement 2: zeroed buffers, and a freed block served again from the cache.
template <class S>
void check_allocation(S& s) {
  auto st = s.make_stream();
  const auto before = s.system_allocations();
  {
    auto a = s.template allocate<float>(1000);
    CHECK(a.size() == 1000);
    for (float x : read_back(s, st, a)) CHECK(x == 0.0f);
    CHECK(s.system_allocations() == before + 1);
  }
  // the same size again, many times: served from the cache
  for (int i = 0; i < 5; ++i) {
    auto b = s.template allocate<float>(1000);
    for (float x : read_back(s, st, b)) CHECK(x == 0.0f);  // zeroed again
  }
  CHECK(s.system_allocations() == before + 1);
  auto empty = s.template allocate<double>(0);
  CHECK(empty.empty());
  CHECK(empty.data() == nullptr);
}

template <class S>
void check_index_kernels(S& s);

/// Requirements 4 and 5: copies, casts, fills and element functors give the host kernels'
/// results, bit for bit.
template <class S>
void check_kernels(S& s) {
  auto st = s.make_stream();
  std::vector<float> x(777), g(777), m(777), v(777);
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = 0.001f * float(i) - 0.3f;
    g[i] = 0.01f * float(i % 17) - 0.05f;
    m[i] = 0.002f * float(i % 5);
    v[i] = 0.0001f * float(i % 7);
  }
  // copy within the space
  auto a = upload(s, st, x);
  auto b = s.template allocate<float>(x.size());
  s.copy(st, a.view(), b.view());
  CHECK(read_back(s, st, b) == x);
  // cast to bf16 and back: kernels::cast's rounding
  auto h = s.template allocate<bf16>(x.size());
  s.cast(st, a.view(), h.view());
  const auto hb = read_back(s, st, h);
  std::vector<bf16> expected(x.size());
  kernels::cast(std::span<const float>(x), std::span<bf16>(expected));
  CHECK(std::memcmp(hb.data(), expected.data(), x.size() * sizeof(bf16)) == 0);
  // fill
  s.fill(st, b.view(), 2.5);
  for (float e : read_back(s, st, b)) CHECK(e == 2.5f);
  // an element functor: AdamW, against the host kernel
  auto p = upload(s, st, x);
  auto gg = upload(s, st, g);
  auto mm = upload(s, st, m);
  auto vv = upload(s, st, v);
  const auto sc = kernels::make_adamw_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 3);
  s.for_each(st, kernels::adamw_update{sc}, p.span(), std::span<const float>(gg.span()), mm.span(),
             vv.span());
  std::vector<float> px = x, mx = m, vx = v;
  kernels::adamw_step(px, g, mx, vx, sc);
  const auto pr = read_back(s, st, p), mr = read_back(s, st, mm), vr = read_back(s, st, vv);
  CHECK(std::memcmp(pr.data(), px.data(), px.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(mr.data(), mx.data(), mx.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(vr.data(), vx.data(), vx.size() * sizeof(float)) == 0);
  // mismatched arguments are refused
  auto short_one = s.template allocate<float>(3);
  CHECK_THROWS_AS(s.copy(st, a.view(), short_one.view()), invalid_argument);
  CHECK_THROWS_AS(
      s.for_each(st, space::assign_update{}, short_one.span(), std::span<const float>(a.span())),
      invalid_argument);
  check_index_kernels(s);
}

/// Requirement 5's gather_index and scatter_index, worked by hand: in = {10, 11, ..., 17}
/// seen from base 100 (element i of in is index 100 + i).
template <class S>
void check_index_kernels(S& s) {
  auto st = s.make_stream();
  const auto in = upload(s, st, std::vector<float>{10, 11, 12, 13, 14, 15, 16, 17});
  const auto idx = upload_indices(s, st, {107, 100, 103});
  auto packed = s.template allocate<float>(3);
  s.gather_index(st, std::span<const float>(in.span()), std::span<const std::uint32_t>(idx.span()),
                 100, packed.span());
  CHECK(read_back(s, st, packed) == std::vector<float>{17, 10, 13});
  auto out = upload(s, st, std::vector<float>{-1, -1, -1, -1, -1, -1, -1, -1});
  s.scatter_index(st, std::span<const float>(packed.span()),
                  std::span<const std::uint32_t>(idx.span()), 100, out.span());
  CHECK(read_back(s, st, out) == std::vector<float>{10, -1, -1, 13, -1, -1, -1, 17});
  // as many indices as packed elements, or invalid_argument
  auto two = s.template allocate<float>(2);
  CHECK_THROWS_AS(s.gather_index(st, std::span<const float>(in.span()),
                                 std::span<const std::uint32_t>(idx.span()), 100, two.span()),
                  invalid_argument);
  CHECK_THROWS_AS(s.scatter_index(st, std::span<const float>(two.span()),
                                  std::span<const std::uint32_t>(idx.span()), 100, out.span()),
                  invalid_argument);
}

/// Requirement 3: an event orders work between two streams; a default event is complete.
template <class S>
void check_streams(S& s) {
  auto producer = s.make_stream();
  auto consumer = s.make_stream();
  const typename S::event none{};
  CHECK(s.ready(none));
  std::vector<float> ones(4096, 1.0f);
  auto a = s.template allocate<float>(ones.size());
  auto b = s.template allocate<float>(ones.size());
  for (int round = 0; round < 20; ++round) {
    s.fill(producer, a.view(), double(round));
    const auto produced = s.record(producer);
    s.wait(consumer, produced);
    s.copy(consumer, a.view(), b.view());
    const auto copied = s.record(consumer);
    s.synchronize(copied);
    CHECK(s.ready(copied));
    for (float e : read_back(s, consumer, b)) CHECK(e == float(round));
  }
}

}  // namespace fedshard::test
