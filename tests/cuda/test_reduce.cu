#include "fedshard/cuda/reduce.cuh"

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/cuda/device_buffer.cuh"
#include "fedshard/cuda/stream.cuh"
#include "fedshard/error.hpp"

namespace {

namespace gpu = fedshard::gpu;
using fedshard::bf16;
using fedshard::f16;

template <class T>
double value_of(T x) {
  return static_cast<double>(fedshard::to_accum(x));
}

TEST_SUITE("no_device") {
  TEST_CASE("reductions check their arguments before touching the device") {
    alignas(16) static float data[8] = {};
    gpu::reduce_workspace ws;
    CHECK_THROWS_WITH_AS(
        gpu::sum_of_squares_async(std::span<const float>(data, 8), nullptr, ws, nullptr),
        doctest::Contains("null result pointer"), fedshard::invalid_argument);
    CHECK_THROWS_AS(
        gpu::l2_norm(fedshard::const_buffer_view(data, 8, static_cast<fedshard::dtype>(9)),
                     nullptr),
        fedshard::invalid_argument);
  }
}

TEST_CASE_TEMPLATE("norms and finiteness of every dtype, against host references", T, float, double,
                   bf16, f16) {
  std::mt19937_64 rng(51);
  std::uniform_real_distribution<double> value(-2.0, 2.0);
  gpu::stream s;
  for (std::size_t n : {0, 1, 1000, (1 << 20) + 3}) {
    CAPTURE(n);
    std::vector<T> x(n);
    for (T& e : x) e = fedshard::from_accum<T>(value(rng));
    auto dx = gpu::device_buffer<T>::from_host(x);
    long double exact = 0;
    double largest = 0;
    for (T e : x) {
      exact += static_cast<long double>(value_of(e)) * value_of(e);
      largest = std::max(largest, std::fabs(value_of(e)));
    }
    const double sum = gpu::sum_of_squares(dx.span(), s);
    CHECK(std::fabs(sum - static_cast<double>(exact)) <= 1e-12 * static_cast<double>(exact));
    CHECK(gpu::l2_norm(dx.cview(), s) == doctest::Approx(std::sqrt(static_cast<double>(exact))));
    CHECK(gpu::max_abs(dx.span(), s) == largest);  // exact: no arithmetic
    CHECK(gpu::all_finite(dx.cview(), s));
    if (n < 2) continue;

    x[n / 3] = fedshard::from_accum<T>(std::numeric_limits<double>::infinity());
    dx.copy_from_host(x);
    CHECK_FALSE(gpu::all_finite(dx.span(), s));
    CHECK(gpu::max_abs(dx.span(), s) == std::numeric_limits<double>::infinity());
    x[n - 1] = fedshard::from_accum<T>(-std::numeric_limits<double>::quiet_NaN());
    dx.copy_from_host(x);
    CHECK(std::isnan(gpu::max_abs(dx.cview(), s)));

    gpu::reduce_workspace ws;
    gpu::device_buffer<unsigned long long> count(1);
    gpu::count_nonfinite_async(std::span<const T>(dx.span()), count.data(), ws, s);
    s.synchronize();
    CHECK(count.to_host()[0] == 2);
  }
}

TEST_CASE("one workspace serves reductions of different sizes in stream order") {
  std::mt19937_64 rng(52);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  gpu::stream s;
  gpu::reduce_workspace ws;
  gpu::device_buffer<double> results(2);
  std::vector<float> a(100), b(3000001);
  for (float& e : a) e = value(rng);
  for (float& e : b) e = value(rng);
  auto da = gpu::device_buffer<float>::from_host(a);
  auto db = gpu::device_buffer<float>::from_host(b);
  gpu::sum_of_squares_async(std::span<const float>(da.span()), results.data(), ws, s);
  gpu::max_abs_async(std::span<const float>(db.span()), results.data() + 1, ws, s);
  s.synchronize();
  const std::vector<double> r = results.to_host();
  double sa = 0, mb = 0;
  for (float e : a) sa += static_cast<double>(e) * e;
  for (float e : b) mb = std::max(mb, static_cast<double>(std::fabs(e)));
  CHECK(r[0] == doctest::Approx(sa).epsilon(1e-12));
  CHECK(r[1] == mb);
}

}  // namespace
