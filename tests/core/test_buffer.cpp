#include "fedshard/core/buffer.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

using fedshard::aligned_buffer;
using fedshard::bf16;
using fedshard::buffer_view;
using fedshard::const_buffer_view;
using fedshard::dtype;
using fedshard::f16;

namespace {

bool is_aligned(const void* p, std::size_t a) {
  return reinterpret_cast<std::uintptr_t>(p) % a == 0;
}

std::size_t sum_of_sizes(std::span<const float> s) {
  return s.size();
}

void fill(std::span<float> s, float v) {
  for (float& x : s) x = v;
}

template <class V>
std::string as_error_message(const V& v, dtype asked) {
  try {
    fedshard::visit(asked, [&](auto tag) { (void)v.template as<typename decltype(tag)::type>(); });
  } catch (const fedshard::invalid_argument& e) {
    return e.what();
  }
  return {};
}

template <class T>
concept viewable = requires(std::span<T> s) {
  fedshard::view(s);
};

}  // namespace

static_assert(!std::is_copy_constructible_v<aligned_buffer<float>>);
static_assert(!std::is_copy_assignable_v<aligned_buffer<float>>);
static_assert(std::is_nothrow_move_constructible_v<aligned_buffer<float>>);
static_assert(std::is_nothrow_move_assignable_v<aligned_buffer<float>>);
static_assert(aligned_buffer<double>::alignment == 64);
static_assert(viewable<float> && !viewable<const float>);

TEST_CASE_TEMPLATE("aligned_buffer is 64-byte aligned and zero-initialised", T, float, double, bf16,
                   f16) {
  std::vector<std::size_t> sizes;
  for (std::size_t n = 0; n <= 130; ++n) sizes.push_back(n);
  for (std::size_t n : {255u, 256u, 257u, 1000u, 4095u, 4096u, 65537u, 1u << 20})
    sizes.push_back(n);
  std::vector<aligned_buffer<T>> keep;  // live at once, so the allocator cannot reuse one block
  for (std::size_t n : sizes) {
    CAPTURE(n);
    aligned_buffer<T> b(n);
    CHECK(b.size() == n);
    CHECK(b.empty() == (n == 0));
    CHECK(is_aligned(b.data(), 64));
    CHECK(b.end() - b.begin() == static_cast<std::ptrdiff_t>(n));
    if (n == 0) {
      CHECK(b.data() == nullptr);
      continue;
    }
    std::size_t nonzero = 0;
    const auto* bytes = reinterpret_cast<const unsigned char*>(b.data());
    for (std::size_t i = 0; i < n * sizeof(T); ++i) nonzero += bytes[i] != 0;
    CHECK(nonzero == 0);
    std::memset(static_cast<void*>(b.data()), 0xab, n * sizeof(T));  // dirty it for reuse
    if (n <= 130) keep.push_back(std::move(b));
  }
  aligned_buffer<T> def;
  CHECK(def.empty());
  CHECK(def.data() == nullptr);
  CHECK(def.span().empty());
}

TEST_CASE("aligned_buffer refuses a size whose byte count overflows") {
  const std::size_t too_many = std::numeric_limits<std::size_t>::max() / sizeof(double) + 1;
  CHECK_THROWS_AS(aligned_buffer<double>{too_many}, fedshard::invalid_argument);
  CHECK_THROWS_AS(aligned_buffer<bf16>{std::numeric_limits<std::size_t>::max()},
                  fedshard::invalid_argument);
}

TEST_CASE("aligned_buffer moves its storage") {
  aligned_buffer<float> a(100);
  a[0] = 1.0f;
  a[99] = 2.0f;
  float* p = a.data();

  aligned_buffer<float> b(std::move(a));
  CHECK(b.data() == p);
  CHECK(b.size() == 100);
  CHECK(b[0] == 1.0f);
  CHECK(b[99] == 2.0f);
  CHECK(a.data() == nullptr);  // NOLINT(bugprone-use-after-move): moved-from state is specified
  CHECK(a.size() == 0);
  CHECK(a.empty());

  aligned_buffer<float> c(7);
  c = std::move(b);
  CHECK(c.data() == p);
  CHECK(c.size() == 100);
  CHECK(b.data() == nullptr);  // NOLINT(bugprone-use-after-move)
  CHECK(b.size() == 0);

  aligned_buffer<float>& alias = c;
  c = std::move(alias);  // self-move keeps the contents
  CHECK(c.data() == p);
  CHECK(c.size() == 100);
  CHECK(c[99] == 2.0f);

  c = aligned_buffer<float>();
  CHECK(c.empty());
  CHECK(c.data() == nullptr);

  a = aligned_buffer<float>(3);  // a moved-from buffer is reusable
  CHECK(a.size() == 3);
  CHECK(is_aligned(a.data(), 64));
}

TEST_CASE("aligned_buffer converts to spans over its elements") {
  aligned_buffer<float> b(10);
  fill(b, 3.0f);
  for (float x : b) CHECK(x == 3.0f);
  CHECK(sum_of_sizes(b) == 10);

  std::span<float> s = b;
  CHECK(s.data() == b.data());
  CHECK(s.size() == 10);
  s[4] = 5.0f;
  CHECK(b[4] == 5.0f);

  const aligned_buffer<float>& cb = b;
  std::span<const float> cs = cb;
  CHECK(cs.data() == b.data());
  CHECK(cs.size() == 10);
  CHECK(cb.span().data() == b.data());
  static_assert(std::is_same_v<decltype(cb.span()), std::span<const float>>);
  static_assert(std::is_same_v<decltype(b.span()), std::span<float>>);
  static_assert(!std::is_convertible_v<const aligned_buffer<float>&, std::span<float>>);
}

TEST_CASE("view and cview describe a span as (pointer, count, dtype)") {
  aligned_buffer<bf16> b(12);
  const buffer_view v = fedshard::view(b.span());
  CHECK(v.data == b.data());
  CHECK(v.count == 12);
  CHECK(v.type == dtype::bf16);
  CHECK(v.size_bytes() == 24);

  std::vector<double> d(5, 1.0);
  const const_buffer_view cv = fedshard::cview(std::span<const double>(d));
  CHECK(cv.data == d.data());
  CHECK(cv.count == 5);
  CHECK(cv.type == dtype::f64);
  CHECK(cv.size_bytes() == 40);

  const const_buffer_view from_mutable = v;
  CHECK(from_mutable.data == v.data);
  CHECK(from_mutable.count == v.count);
  CHECK(from_mutable.type == v.type);

  for (dtype t : fedshard::all_dtypes) {
    const buffer_view any{nullptr, 3, t};
    CHECK(any.size_bytes() == 3 * fedshard::size_of(t));
  }
}

TEST_CASE("as<T> returns the typed elements when T matches the dtype") {
  std::vector<float> x = {1, 2, 3};
  const buffer_view v = fedshard::view(std::span<float>(x));
  const std::span<float> s = v.as<float>();
  CHECK(s.data() == x.data());
  CHECK(s.size() == 3);
  s[1] = 9;
  CHECK(x[1] == 9);
  const std::span<const float> c = const_buffer_view(v).as<float>();
  CHECK(c.data() == x.data());
  CHECK(c.size() == 3);
}

TEST_CASE("as<T> with the wrong type throws invalid_argument naming both dtypes") {
  for (dtype held : fedshard::all_dtypes) {
    for (dtype asked : fedshard::all_dtypes) {
      if (held == asked) continue;
      CAPTURE(fedshard::to_string(held));
      CAPTURE(fedshard::to_string(asked));
      const buffer_view v{nullptr, 4, held};
      for (const std::string& msg :
           {as_error_message(v, asked), as_error_message(const_buffer_view(v), asked)}) {
        CAPTURE(msg);
        REQUIRE_FALSE(msg.empty());
        // A leading space keeps "f16" from matching inside "bf16".
        CHECK(msg.find(" " + std::string(fedshard::to_string(held))) != std::string::npos);
        CHECK(msg.find(" " + std::string(fedshard::to_string(asked))) != std::string::npos);
      }
    }
  }
  const buffer_view v{nullptr, 4, dtype::f32};
  CHECK_THROWS_AS((void)v.as<double>(), fedshard::invalid_argument);
  CHECK_THROWS_AS((void)const_buffer_view(v).as<bf16>(), fedshard::invalid_argument);
}
