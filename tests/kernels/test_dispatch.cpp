#include "fedshard/kernels/dispatch.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "fedshard/comm/detail/reduction.hpp"
#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/kernels/adamw.hpp"
#include "fedshard/kernels/cast.hpp"
#include "fedshard/kernels/for_each.hpp"
#include "fedshard/kernels/outer.hpp"
#include "fedshard/kernels/scale.hpp"
#include "fedshard/kernels/sgd.hpp"
#include "fedshard/kernels/sync.hpp"
#include "fedshard/kernels/weighted_sum.hpp"

namespace kernels = fedshard::kernels;
using kernels::isa;

TEST_CASE("parse_isa reads the three names and names them back in its error") {
  CHECK(kernels::parse_isa("portable") == isa::portable);
  CHECK(kernels::parse_isa("avx2") == isa::avx2);
  CHECK(kernels::parse_isa("avx512") == isa::avx512);
  CHECK_THROWS_WITH_AS(
      kernels::parse_isa("sse9"),
      "fedshard: unknown instruction set 'sse9', expected portable, avx2 or avx512",
      fedshard::invalid_argument);
}

TEST_CASE("supported_isas starts with portable and ends with the detected one") {
  const auto all = kernels::supported_isas();
  REQUIRE(!all.empty());
  CHECK(all.front() == isa::portable);
  CHECK(all.back() == kernels::detected_isa());
  MESSAGE("this machine: " << std::string(kernels::to_string(kernels::detected_isa())));
}

TEST_CASE("isa_limit_guard lowers the active instruction set and restores it") {
  const isa before = kernels::active_isa();
  {
    kernels::isa_limit_guard g(isa::portable);
    CHECK(kernels::active_isa() == isa::portable);
  }
  CHECK(kernels::active_isa() == before);
}

TEST_CASE("a loop with a * b + c gives the portable bits on every instruction set") {
  // Without fp-contract off the AVX2 loop would fuse x * a + y into one rounding.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  std::vector<float> x0(4099), y(4099);
  for (auto& v : x0) v = u(rng);
  for (auto& v : y) v = u(rng);
  auto f = [](float& x, float yi) { x = x * 1.37f + yi * yi; };
  std::vector<float> want = x0;
  kernels::for_each_element_on(isa::portable, f, want.size(), want.data(),
                               static_cast<const float*>(y.data()));
  for (isa i : kernels::supported_isas()) {
    CAPTURE(std::string(kernels::to_string(i)));
    std::vector<float> got = x0;
    kernels::for_each_element_on(i, f, got.size(), got.data(), static_cast<const float*>(y.data()));
    CHECK(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0);
  }
}

// Every dispatched kernel on every instruction set this machine runs, against the portable
// loop, bit for bit, on random data with awkward sizes (a vector body and a tail) and
// special values (signed zeros, subnormals, infinities, NaN).

namespace {

constexpr std::size_t kN = 4099;

/// n floats: mostly uniform in [-lo, hi], with special values spread through.
std::vector<float> random_floats(std::size_t n, std::uint32_t seed, float lo = -2.0f,
                                 float hi = 2.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  const float special[] = {0.0f, -0.0f, 1e-40f, -1e-40f, 1e30f, -1e30f};
  for (std::size_t i = 0; i < std::size(special) && 97 * i < n; ++i)
    if (special[i] >= lo || special[i] == 0.0f) v[97 * i] = special[i];
  return v;
}

/// n floats >= 0 (second moments), with zeros and subnormals.
std::vector<float> random_nonnegative(std::size_t n, std::uint32_t seed) {
  std::vector<float> v = random_floats(n, seed, 0.0f, 3.0f);
  for (auto& x : v) x = x < 0.0f ? -x : x;
  return v;
}

/// The bytes of some vectors.
template <class... V>
std::vector<unsigned char> bytes_of(const V&... v) {
  std::vector<unsigned char> out;
  (out.insert(out.end(), reinterpret_cast<const unsigned char*>(v.data()),
              reinterpret_cast<const unsigned char*>(v.data() + v.size())),
   ...);
  return out;
}

/// Runs run() (which returns the bytes it computed) with the active instruction set lowered
/// to each supported one, and checks that each gives the portable bytes.
template <class Run>
void check_same_bits_on_every_isa(Run run) {
  std::vector<unsigned char> want;
  {
    kernels::isa_limit_guard g(isa::portable);
    want = run();
  }
  for (isa i : kernels::supported_isas()) {
    CAPTURE(std::string(kernels::to_string(i)));
    kernels::isa_limit_guard g(i);
    REQUIRE(kernels::active_isa() == i);
    const std::vector<unsigned char> got = run();
    REQUIRE(got.size() == want.size());
    std::size_t first_diff = got.size();
    for (std::size_t b = 0; b < got.size() && first_diff == got.size(); ++b)
      if (got[b] != want[b]) first_diff = b;
    CHECK_MESSAGE(first_diff == got.size(), "first differing byte: ", first_diff);
  }
}

}  // namespace

TEST_CASE("adamw_step gives the portable bits on every instruction set") {
  const auto p0 = random_floats(kN, 1), g = random_floats(kN, 2), m0 = random_floats(kN, 3);
  const auto v0 = random_nonnegative(kN, 4);
  // beta1 = 0.9: lerp weight 0.1 (< 0.5); beta1 = 0.3: weight 0.7 (the other lerp branch).
  for (double beta1 : {0.9, 0.3})
    for (double wd : {0.0, 0.01}) {
      CAPTURE(beta1);
      CAPTURE(wd);
      check_same_bits_on_every_isa([&] {
        auto p = p0, m = m0, v = v0;
        for (std::int64_t step = 1; step <= 3; ++step)
          kernels::adamw_step(p, g, m, v,
                              kernels::make_adamw_scalars(1e-3, beta1, 0.999, 1e-8, wd, step));
        return bytes_of(p, m, v);
      });
    }
}

TEST_CASE("sgd_step with and without momentum gives the portable bits on every instruction set") {
  const auto p0 = random_floats(kN, 5), g = random_floats(kN, 6), b0 = random_floats(kN, 7);
  for (double momentum : {0.0, 0.9})
    for (double wd : {0.0, 1e-4})
      for (bool nesterov : {false, true})
        for (bool first : {true, false}) {
          if (momentum == 0.0 && (nesterov || !first)) continue;
          CAPTURE(momentum);
          CAPTURE(wd);
          CAPTURE(nesterov);
          CAPTURE(first);
          check_same_bits_on_every_isa([&] {
            auto p = p0, b = b0;
            kernels::sgd_step(p, g, b,
                              kernels::make_sgd_scalars(0.1, momentum, 0.1, wd, nesterov, first));
            return bytes_of(p, b);
          });
        }
}

TEST_CASE("every outer rule gives the portable bits on every instruction set") {
  const auto a0 = random_floats(kN, 8), d = random_floats(kN, 9), m0 = random_floats(kN, 10);
  const auto v0 = random_nonnegative(kN, 11);
  const auto momentum = kernels::make_outer_momentum_scalars(0.7f, 0.9f);
  const auto adaptive = kernels::make_outer_adaptive_scalars(0.01f, 0.9f, 0.99f, 1e-3f);
  SUBCASE("outer_sgd") {
    for (float lr : {1.0f, 0.7f})
      check_same_bits_on_every_isa([&] {
        auto a = a0;
        kernels::outer_sgd_step(a, d, kernels::make_outer_sgd_scalars(lr));
        return bytes_of(a);
      });
  }
  SUBCASE("outer_sgd with d the anchor itself") {
    check_same_bits_on_every_isa([&] {
      auto a = a0;
      kernels::outer_sgd_step(a, a, kernels::make_outer_sgd_scalars(0.5f));
      return bytes_of(a);
    });
  }
  SUBCASE("nesterov") {
    check_same_bits_on_every_isa([&] {
      auto a = a0, m = m0;
      kernels::outer_nesterov_step(a, d, m, momentum);
      return bytes_of(a, m);
    });
  }
  SUBCASE("fedmom") {
    check_same_bits_on_every_isa([&] {
      auto a = a0, m = m0;
      kernels::outer_fedmom_step(a, d, m, momentum);
      return bytes_of(a, m);
    });
  }
  SUBCASE("fedadam") {
    check_same_bits_on_every_isa([&] {
      auto a = a0, m = m0, v = v0;
      kernels::outer_fedadam_step(a, d, m, v, adaptive);
      return bytes_of(a, m, v);
    });
  }
  SUBCASE("fedyogi") {
    check_same_bits_on_every_isa([&] {
      auto a = a0, m = m0, v = v0;
      kernels::outer_fedyogi_step(a, d, m, v, adaptive);
      return bytes_of(a, m, v);
    });
  }
  SUBCASE("fedyogi where v equals d * d, and where d is NaN") {
    // Every 5th element v == fl(d * d) (Yogi keeps v there), every 11th d is NaN (both
    // comparisons false: v kept, the NaN reaches θ and m); both land in vector lanes and in
    // the tail (kN = 4099).
    auto dd = d, vv = v0;
    for (std::size_t i = 0; i < kN; ++i) {
      if (i % 5 == 0) vv[i] = dd[i] * dd[i];
      if (i % 11 == 0) dd[i] = std::nanf("");
    }
    check_same_bits_on_every_isa([&] {
      auto a = a0, m = m0, v = vv;
      kernels::outer_fedyogi_step(a, dd, m, v, adaptive);
      return bytes_of(a, m, v);
    });
  }
}

TEST_CASE("the federation sync updates give the portable bits on every instruction set") {
  const auto x0 = random_floats(kN, 12), y = random_floats(kN, 13);
  check_same_bits_on_every_isa([&] {
    auto a = x0, b = x0, c = x0;
    kernels::for_each_element(kernels::pseudo_gradient_update{}, kN, a.data(), y.data());
    kernels::for_each_element(kernels::scale_by_update{0.37f}, kN, b.data());
    kernels::for_each_element(kernels::mix_update{0.3f}, kN, c.data(), y.data());
    return bytes_of(a, b, c);
  });
}

namespace {

/// n random values of dtype t (random floats cast to t).
std::vector<unsigned char> random_buffer(fedshard::dtype t, std::size_t n, std::uint32_t seed) {
  const std::vector<float> f = random_floats(n, seed);
  std::vector<unsigned char> out(n * fedshard::size_of(t));
  kernels::cast(fedshard::const_buffer_view{f.data(), n, fedshard::dtype::f32},
                fedshard::buffer_view{out.data(), n, t});
  return out;
}

}  // namespace

TEST_CASE("scale and axpy give the portable bits on every instruction set, in every dtype") {
  for (fedshard::dtype tx : fedshard::all_dtypes)
    for (fedshard::dtype ty : fedshard::all_dtypes) {
      CAPTURE(std::string(fedshard::to_string(tx)));
      CAPTURE(std::string(fedshard::to_string(ty)));
      const auto x = random_buffer(tx, kN, 14), y0 = random_buffer(ty, kN, 15);
      check_same_bits_on_every_isa([&] {
        auto y = y0;
        kernels::axpy(-0.37, fedshard::const_buffer_view{x.data(), kN, tx},
                      fedshard::buffer_view{y.data(), kN, ty});
        kernels::scale(fedshard::buffer_view{y.data(), kN, ty}, 1.7);
        return y;
      });
    }
}

TEST_CASE("weighted_sum gives the portable bits and weighted_sum_fn's on every instruction set") {
  // More than one block of the host loop, and a zero weight whose input is all NaN.
  constexpr std::size_t n = 5000;
  for (fedshard::dtype tin : fedshard::all_dtypes)
    for (fedshard::dtype tout : fedshard::all_dtypes) {
      CAPTURE(std::string(fedshard::to_string(tin)));
      CAPTURE(std::string(fedshard::to_string(tout)));
      std::vector<std::vector<unsigned char>> in;
      for (std::uint32_t k = 0; k < 4; ++k) in.push_back(random_buffer(tin, n, 20 + k));
      {
        const std::vector<float> nan(n, std::numeric_limits<float>::quiet_NaN());
        kernels::cast(fedshard::const_buffer_view{nan.data(), n, fedshard::dtype::f32},
                      fedshard::buffer_view{in[2].data(), n, tin});
      }
      std::vector<fedshard::const_buffer_view> views;
      for (const auto& b : in) views.emplace_back(b.data(), n, tin);
      const std::vector<double> weights = {0.25, -1.5, 0.0, 0.3};
      check_same_bits_on_every_isa([&] {
        std::vector<unsigned char> out(n * fedshard::size_of(tout));
        kernels::weighted_sum(views, weights, fedshard::buffer_view{out.data(), n, tout});
        return out;
      });
      // The host loop sums in passes; the per-element functor (the CUDA kernel's) must agree.
      std::vector<unsigned char> host(n * fedshard::size_of(tout));
      kernels::weighted_sum(views, weights, fedshard::buffer_view{host.data(), n, tout});
      fedshard::visit(tin, tout, [&](auto it, auto ot) {
        using In = typename decltype(it)::type;
        using Out = typename decltype(ot)::type;
        using A = kernels::accum_t<In, Out>;
        std::vector<const In*> ptrs;
        for (const auto& b : in) ptrs.push_back(reinterpret_cast<const In*>(b.data()));
        const std::vector<A> w(weights.begin(), weights.end());
        const kernels::weighted_sum_fn<In, Out> f{ptrs.data(), w.data(), ptrs.size()};
        std::vector<Out> want(n);
        for (std::size_t i = 0; i < n; ++i) want[i] = f(i);
        CHECK(std::memcmp(want.data(), host.data(), host.size()) == 0);
      });
    }
}

TEST_CASE("the rank-order reduction gives the portable bits on every instruction set") {
  constexpr int ranks = 3;
  constexpr std::size_t n = 5000;  // more than two blocks
  for (fedshard::dtype t : fedshard::all_dtypes)
    for (fedshard::reduce_op op : fedshard::all_reduce_ops) {
      CAPTURE(std::string(fedshard::to_string(t)));
      CAPTURE(std::string(fedshard::to_string(op)));
      std::vector<unsigned char> blocks;
      for (std::uint32_t p = 0; p < ranks; ++p) {
        const auto b = random_buffer(t, n, 30 + p);
        blocks.insert(blocks.end(), b.begin(), b.end());
      }
      check_same_bits_on_every_isa([&] {
        std::vector<unsigned char> out(n * fedshard::size_of(t));
        fedshard::detail::reduce_blocks(t, op, blocks.data(), n * fedshard::size_of(t), ranks,
                                        out.data(), static_cast<std::int64_t>(n));
        return out;
      });
    }
}
