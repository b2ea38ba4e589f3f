#include "fedshard/cuda/kernels.cuh"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/cuda/device_buffer.cuh"
#include "fedshard/cuda/error.cuh"
#include "fedshard/cuda/stream.cuh"
#include "fedshard/error.hpp"
#include "fedshard/kernels/adamw.hpp"
#include "fedshard/kernels/cast.hpp"
#include "fedshard/kernels/outer.hpp"
#include "fedshard/kernels/pack.hpp"
#include "fedshard/kernels/sgd.hpp"
#include "fedshard/kernels/weighted_sum.hpp"

// Helpers live in a named namespace and the test cases at global scope: TEST_CASE_TEMPLATE
// opens an anonymous namespace, and nvcc's host stubs fail on kernels instantiated inside
// nested anonymous namespaces.
namespace test_kernels_cu {

namespace gpu = fedshard::gpu;
namespace kernels = fedshard::kernels;
using fedshard::bf16;
using fedshard::const_buffer_view;
using fedshard::f16;
using kernels::tensor_ref;

template <class T>
std::uint64_t bits_of(T x) {
  std::uint64_t u = 0;
  std::memcpy(&u, &x, sizeof(T));
  return u;
}

/// x's bits as 0x... (doctest's message stream prints no std::hex).
template <class T>
std::string hex(T x) {
  std::ostringstream os;
  os << "0x" << std::hex << bits_of(x);
  return os.str();
}

template <class T>
bool is_nan(T x) {
  return std::isnan(static_cast<double>(fedshard::to_accum(x)));
}

/// The same bits, or both NaN: the payload of a NaN made by hardware arithmetic or float/double
/// conversion differs between host and device.
template <class T>
bool same(T a, T b) {
  return bits_of(a) == bits_of(b) || (is_nan(a) && is_nan(b));
}

template <class T>
void require_same(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!same(got[i], want[i]))
      FAIL(what << ": element " << i << " of " << got.size() << " has bits " << hex(got[i])
                << ", the host functor gives " << hex(want[i]));
}

/// A value with uniformly random bits: every class of value (NaN, infinities, zeros,
/// subnormals) appears.
template <class T>
T random_bits(std::mt19937_64& rng) {
  using U = std::conditional_t<sizeof(T) == 2, std::uint16_t,
                               std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>>;
  return fedshard::detail::bit_cast<T>(static_cast<U>(rng()));
}

template <class T>
T random_value(std::mt19937_64& rng, double lo, double hi) {
  return fedshard::from_accum<T>(std::uniform_real_distribution<double>(lo, hi)(rng));
}

/// n elements of device memory starting `offset` elements into an allocation, with guard
/// elements before and after that hold a byte pattern no kernel may write.
template <class T>
class guarded {
 public:
  static constexpr std::size_t guard = 16;
  static constexpr unsigned char pattern = 0x5a;

  guarded(std::size_t n, std::size_t offset)
      : n_(n), offset_(offset), storage_(gpu::device_buffer<T>::uninitialized(offset + n + guard)) {
    FEDSHARD_CUDA_TRY(cudaMemset(storage_.data(), pattern, storage_.size_bytes()));
    // cudaMemset and the pageable cudaMemcpy below are ordered with the default stream only;
    // the kernels under test run on a non-blocking stream (seen failing on an H200 without).
    FEDSHARD_CUDA_TRY(cudaDeviceSynchronize());
  }

  T* data() { return storage_.data() + offset_; }
  std::span<T> span() { return {data(), n_}; }
  std::span<const T> cspan() { return {data(), n_}; }

  void upload(const std::vector<T>& host) {
    REQUIRE(host.size() == n_);
    if (n_ != 0) {
      FEDSHARD_CUDA_TRY(cudaMemcpy(data(), host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
      FEDSHARD_CUDA_TRY(cudaDeviceSynchronize());
    }
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    if (n_ != 0)
      FEDSHARD_CUDA_TRY(cudaMemcpy(host.data(), storage_.data() + offset_, n_ * sizeof(T),
                                   cudaMemcpyDeviceToHost));
    return host;
  }
  /// True when no byte outside the n elements changed.
  bool guards_intact() const {
    std::vector<unsigned char> bytes(storage_.size_bytes());
    FEDSHARD_CUDA_TRY(
        cudaMemcpy(bytes.data(), storage_.data(), bytes.size(), cudaMemcpyDeviceToHost));
    const std::size_t lo = offset_ * sizeof(T), hi = (offset_ + n_) * sizeof(T);
    for (std::size_t b = 0; b < bytes.size(); ++b)
      if ((b < lo || b >= hi) && bytes[b] != pattern) return false;
    return true;
  }

 private:
  std::size_t n_;
  std::size_t offset_;
  gpu::device_buffer<T> storage_;
};

template <class A, class B>
struct pair_of {
  using first = A;
  using second = B;
};

}  // namespace test_kernels_cu

using namespace test_kernels_cu;

#define FEDSHARD_ALL_DTYPE_PAIRS                                                              \
  pair_of<float, float>, pair_of<float, double>, pair_of<float, bf16>, pair_of<float, f16>,   \
      pair_of<double, float>, pair_of<double, double>, pair_of<double, bf16>,                 \
      pair_of<double, f16>, pair_of<bf16, float>, pair_of<bf16, double>, pair_of<bf16, bf16>, \
      pair_of<bf16, f16>, pair_of<f16, float>, pair_of<f16, double>, pair_of<f16, bf16>,      \
      pair_of<f16, f16>

// ---------------------------------------------------------------- argument checks (no device)

TEST_SUITE("no_device") {
  TEST_CASE("kernels check their arguments before touching the device") {
    alignas(16) static unsigned char bytes[256] = {};
    auto* f = reinterpret_cast<float*>(bytes);
    auto* misaligned = reinterpret_cast<float*>(bytes + 2);
    auto* h = reinterpret_cast<bf16*>(bytes + 128);
    cudaStream_t s = nullptr;

    CHECK_THROWS_AS(gpu::cast(std::span<const float>(f, 4), std::span<bf16>(h, 3), s),
                    fedshard::invalid_argument);
    CHECK_THROWS_WITH_AS(gpu::cast(std::span<const float>(misaligned, 4), std::span<bf16>(h, 4), s),
                         doctest::Contains("not aligned to its element size 4"),
                         fedshard::invalid_argument);
    CHECK_THROWS_AS(gpu::cast(const_buffer_view(f, 4, fedshard::dtype::f32),
                              fedshard::buffer_view{h, 5, fedshard::dtype::bf16}, s),
                    fedshard::invalid_argument);

    const float* ins[65] = {};
    for (auto& p : ins) p = f;
    std::vector<double> w(65, 1.0);
    const auto sum_f32 = [&](std::span<const float* const> in, std::span<const double> weights) {
      gpu::weighted_sum<float, float>(in, weights, std::span<float>(f, 4), s);
    };
    CHECK_THROWS_WITH_AS(sum_f32(std::span<const float* const>(ins, 65), w),
                         doctest::Contains("at most 64 inputs"), fedshard::invalid_argument);
    CHECK_THROWS_AS(sum_f32(std::span<const float* const>(ins, 0), {}), fedshard::invalid_argument);
    CHECK_THROWS_WITH_AS(
        sum_f32(std::span<const float* const>(ins, 2), std::span<const double>(w.data(), 3)),
        doctest::Contains("one weight per input"), fedshard::invalid_argument);
    const const_buffer_view views[] = {{f, 4, fedshard::dtype::f32}, {f, 5, fedshard::dtype::f32}};
    CHECK_THROWS_WITH_AS(gpu::weighted_sum(views, std::span<const double>(w.data(), 2),
                                           fedshard::buffer_view{f, 4, fedshard::dtype::f32}, s),
                         doctest::Contains("inputs must match"), fedshard::invalid_argument);

    CHECK_THROWS_AS(gpu::adamw_step(std::span<float>(f, 4), std::span<const float>(f + 4, 3),
                                    std::span<float>(f + 8, 4), std::span<float>(f + 12, 4),
                                    kernels::make_adamw_scalars(1e-3, 0.9, 0.999, 1e-8, 0.0, 1), s),
                    fedshard::invalid_argument);
    const auto momentum = kernels::make_sgd_scalars(0.1, 0.9, 0.0, 0.0, false, false);
    CHECK_THROWS_AS(gpu::sgd_step(std::span<float>(f, 4), std::span<const float>(f + 4, 4),
                                  std::span<float>(f + 8, 2), momentum, s),
                    fedshard::invalid_argument);
    CHECK_THROWS_AS(
        gpu::outer_fedadam_step(std::span<float>(f, 4), std::span<const float>(f, 4),
                                std::span<float>(f + 8, 4), std::span<float>(f + 12, 1),
                                kernels::make_outer_adaptive_scalars(1, 0.9f, 0.99f, 1), s),
        fedshard::invalid_argument);
  }

  TEST_CASE("pack and unpack plans check the layout before touching the device") {
    alignas(16) static float storage[64] = {};
    const std::vector<tensor_ref<const float>> overlapping = {{storage, 8, 0}, {storage + 8, 4, 6}};
    CHECK_THROWS_WITH_AS(
        (gpu::pack_plan<const float, float>(overlapping, 0, std::span<float>(storage + 32, 8))),
        doctest::Contains("sorted by offset"), fedshard::invalid_argument);
    const std::vector<tensor_ref<const float>> outside = {{storage, 8, 4}};
    CHECK_THROWS_WITH_AS(
        (gpu::pack_plan<const float, float>(outside, std::span<float>(storage + 32, 10))),
        doctest::Contains("beyond the flat buffer"), fedshard::invalid_argument);
    const std::vector<tensor_ref<float>> writable = {{storage, 8, 0}, {storage + 8, 4, 6}};
    CHECK_THROWS_AS((gpu::unpack_plan<const float, float>(std::span<const float>(storage + 32, 8),
                                                          0, writable)),
                    fedshard::invalid_argument);
  }
}

// ---------------------------------------------------------------- cast

TEST_CASE_TEMPLATE("cast equals kernels::cast_fn bit for bit, any size and alignment", P,
                   FEDSHARD_ALL_DTYPE_PAIRS) {
  using From = typename P::first;
  using To = typename P::second;
  std::mt19937_64 rng(11);
  gpu::stream s;
  for (std::size_t n : {1, 2, 5, 31, 1000, 70001})
    for (std::size_t in_off : {0, 1, 3})
      for (std::size_t out_off : {0, 1, 2}) {
        CAPTURE(n);
        CAPTURE(in_off);
        CAPTURE(out_off);
        std::vector<From> in(n);
        for (From& x : in) x = random_bits<From>(rng);
        guarded<From> din(n, in_off);
        guarded<To> dout(n, out_off);
        din.upload(in);
        gpu::cast(din.cspan(), dout.span(), s);
        s.synchronize();
        std::vector<To> want(n);
        for (std::size_t i = 0; i < n; ++i) want[i] = kernels::cast_fn<From, To>{}(in[i]);
        require_same(dout.download(), want, "cast");
        CHECK(dout.guards_intact());
      }
}

TEST_CASE("type-erased cast dispatches on the dtypes; a span cast onto itself is a no-op") {
  std::mt19937_64 rng(12);
  gpu::stream s;
  const std::size_t n = 4097;
  std::vector<float> in(n);
  for (float& x : in) x = random_value<float>(rng, -1e5, 1e5);
  auto din = gpu::device_buffer<float>::from_host(in);
  gpu::device_buffer<f16> dout(n);
  gpu::cast(din.cview(), dout.view(), s);
  s.synchronize();
  std::vector<f16> want(n);
  kernels::cast(std::span<const float>(in), std::span<f16>(want));
  require_same(dout.to_host(), want, "type-erased cast");

  gpu::cast(din.cview(), din.view(), s);
  s.synchronize();
  require_same(din.to_host(), in, "cast onto itself");
}

// ---------------------------------------------------------------- pack and unpack

namespace test_kernels_cu {

/// A unit on the device: tensors in separate guarded allocations at random element offsets
/// (so any alignment occurs), host copies, and their offsets in the flat buffer.
template <class T>
struct device_unit {
  std::vector<std::vector<T>> host;
  std::vector<guarded<T>> dev;
  std::vector<std::size_t> offsets;
  std::size_t flat_size = 0;

  template <class U>
  std::vector<tensor_ref<U>> host_refs() {
    std::vector<tensor_ref<U>> r;
    for (std::size_t i = 0; i < host.size(); ++i)
      r.push_back({host[i].data(), host[i].size(), offsets[i]});
    return r;
  }
  template <class U>
  std::vector<tensor_ref<U>> dev_refs() {
    std::vector<tensor_ref<U>> r;
    for (std::size_t i = 0; i < host.size(); ++i)
      r.push_back({dev[i].data(), host[i].size(), offsets[i]});
    return r;
  }
};

/// 1-8 tensors of 0-40 elements, and now and then one of 3000-20000 (several tiles), with
/// gaps of 0-5 elements, a leading gap and 0-7 trailing elements; random bits.
template <class T>
device_unit<T> random_unit(std::mt19937_64& rng) {
  device_unit<T> u;
  const int n = std::uniform_int_distribution<int>(1, 8)(rng);
  std::size_t pos = std::uniform_int_distribution<std::size_t>(0, 3)(rng);
  for (int i = 0; i < n; ++i) {
    const bool big = std::uniform_int_distribution<int>(0, 5)(rng) == 0;
    const std::size_t count = big ? std::uniform_int_distribution<std::size_t>(3000, 20000)(rng)
                                  : std::uniform_int_distribution<std::size_t>(0, 40)(rng);
    std::vector<T> t(count);
    for (T& x : t) x = random_bits<T>(rng);
    u.dev.emplace_back(count, std::uniform_int_distribution<std::size_t>(0, 3)(rng));
    u.dev.back().upload(t);
    u.host.push_back(std::move(t));
    u.offsets.push_back(pos);
    pos += count + std::uniform_int_distribution<std::size_t>(0, 5)(rng);
  }
  u.flat_size = pos + std::uniform_int_distribution<std::size_t>(0, 7)(rng);
  return u;
}

}  // namespace test_kernels_cu

TEST_CASE_TEMPLATE("pack_plan and unpack_plan equal kernels::pack and unpack bit for bit", P,
                   pair_of<float, float>, pair_of<float, bf16>, pair_of<float, f16>,
                   pair_of<double, float>, pair_of<bf16, bf16>, pair_of<f16, double>) {
  using T = typename P::first;   // tensors
  using W = typename P::second;  // shard (wire)
  std::mt19937_64 rng(21);
  gpu::stream s;
  for (int trial = 0; trial < 12; ++trial) {
    device_unit<T> u = random_unit<T>(rng);
    const auto host_c = u.template host_refs<const T>();
    const auto dev_c = u.template dev_refs<const T>();
    const std::size_t ranks = std::uniform_int_distribution<std::size_t>(1, 4)(rng);
    const std::size_t shard_size = (u.flat_size + ranks - 1) / ranks;
    for (std::size_t r = 0; r < ranks; ++r) {
      CAPTURE(trial);
      CAPTURE(r);
      const std::size_t begin = r * shard_size;
      guarded<W> dshard(shard_size, std::uniform_int_distribution<std::size_t>(0, 3)(rng));
      const gpu::pack_plan<const T, W> pack(dev_c, begin, dshard.span());
      pack.run(s);
      s.synchronize();
      std::vector<W> want(shard_size);
      kernels::pack<const T, W>(host_c, begin, want);
      require_same(dshard.download(), want, "pack");
      CHECK(dshard.guards_intact());

      // unpack a shard of random bits into tensors that hold the unit's values
      std::vector<W> wire(shard_size);
      for (W& x : wire) x = random_bits<W>(rng);
      dshard.upload(wire);
      const auto host_m = u.template host_refs<T>();
      const auto dev_m = u.template dev_refs<T>();
      const gpu::unpack_plan<const W, T> unpack(dshard.cspan(), begin, dev_m);
      unpack.run(s);
      s.synchronize();
      kernels::unpack<const W, T>(std::span<const W>(wire), begin, host_m);
      for (std::size_t i = 0; i < u.host.size(); ++i) {
        CAPTURE(i);
        require_same(u.dev[i].download(), u.host[i], "unpack");
        CHECK(u.dev[i].guards_intact());
      }
    }
  }
}

TEST_CASE("pack_plan over the whole flat buffer, and an empty shard") {
  std::mt19937_64 rng(22);
  gpu::stream s;
  device_unit<float> u = random_unit<float>(rng);
  guarded<bf16> flat(u.flat_size, 1);
  const gpu::pack_plan<const float, bf16> pack(u.dev_refs<const float>(), flat.span());
  pack.run(s);
  s.synchronize();
  std::vector<bf16> want(u.flat_size);
  kernels::pack<const float, bf16>(u.host_refs<const float>(), want);
  require_same(flat.download(), want, "pack of the flat buffer");

  const gpu::pack_plan<const float, bf16> empty(u.dev_refs<const float>(), 0, std::span<bf16>());
  CHECK(empty.segments() == 0);
  empty.run(s);
  s.synchronize();
}

// ---------------------------------------------------------------- weighted sum

namespace test_kernels_cu {

/// Runs gpu::weighted_sum and kernels::weighted_sum on the same inputs and compares. The
/// inputs start at offsets[j] elements into their allocations; an input with weight 0 is
/// filled with NaN (it must not take part).
template <class In, class Out>
void check_weighted_sum(std::mt19937_64& rng, std::size_t n, const std::vector<double>& w,
                        const std::vector<std::size_t>& offsets, std::size_t out_offset) {
  CAPTURE(n);
  CAPTURE(w.size());
  const std::size_t k = w.size();
  std::vector<std::vector<In>> in(k, std::vector<In>(n));
  std::vector<guarded<In>> dev;
  std::vector<const In*> pointers;
  std::vector<const_buffer_view> views;
  for (std::size_t j = 0; j < k; ++j) {
    for (In& x : in[j])
      x = w[j] == 0 ? fedshard::from_accum<In>(std::numeric_limits<double>::quiet_NaN())
                    : random_value<In>(rng, -50, 50);
    dev.emplace_back(n, offsets[j]);
    dev.back().upload(in[j]);
    views.push_back(fedshard::cview(std::span<const In>(in[j])));
  }
  for (auto& d : dev) pointers.push_back(d.data());
  guarded<Out> dout(n, out_offset);
  gpu::stream s;
  gpu::weighted_sum<In, Out>(pointers, w, dout.span(), s);
  s.synchronize();
  std::vector<Out> want(n);
  kernels::weighted_sum(views, w, fedshard::view(std::span<Out>(want)));
  require_same(dout.download(), want, "weighted_sum");
  CHECK(dout.guards_intact());
}

}  // namespace test_kernels_cu

// Bit-for-bit equality needs weighted_sum_fn to round its products and sums explicitly
// (kernels::detail::mul_rn / add_rn): a plain `sum + w * x` may be contracted into a fused
// multiply-add by the device compiler (nvcc --fmad=true, the default).
TEST_CASE_TEMPLATE("weighted_sum equals kernels::weighted_sum bit for bit", P,
                   FEDSHARD_ALL_DTYPE_PAIRS) {
  using In = typename P::first;
  using Out = typename P::second;
  std::mt19937_64 rng(31);
  std::uniform_real_distribution<double> weight(-1.0, 1.0);
  for (std::size_t k : {1, 2, 5})
    for (std::size_t n : {1, 3, 1000, 50001})
      for (int layout = 0; layout < 3; ++layout) {
        CAPTURE(layout);
        std::vector<double> w(k);
        for (double& x : w) x = weight(rng);
        if (k > 1) w[1] = 0.0;
        std::vector<std::size_t> offsets(k);
        for (std::size_t j = 0; j < k; ++j)
          offsets[j] = layout == 0 ? 0 : layout == 1 ? 1 : j % 4;  // aligned, shifted, mixed
        check_weighted_sum<In, Out>(rng, n, w, offsets, layout == 2 ? 3 : 0);
      }
}

TEST_CASE("weighted_sum of many inputs: opt-in shared memory and the direct kernel") {
  std::mt19937_64 rng(32);
  std::uniform_real_distribution<double> weight(0.0, 1.0);
  for (std::size_t k : {13, 20, 60, 64}) {  // 13, 20: > 48 KiB staged; 60, 64: direct
    std::vector<double> w(k);
    for (double& x : w) x = weight(rng);
    w[k / 2] = 0.0;
    std::vector<std::size_t> offsets(k);
    for (std::size_t j = 0; j < k; ++j) offsets[j] = j % 3;
    check_weighted_sum<float, float>(rng, 20001, w, offsets, 0);
    check_weighted_sum<bf16, float>(rng, 20001, w, offsets, 1);
  }
}

TEST_CASE("weighted_sum in place: out is one of the inputs") {
  std::mt19937_64 rng(33);
  const std::size_t n = 30001;
  std::vector<std::vector<float>> in(3, std::vector<float>(n));
  std::vector<gpu::device_buffer<float>> dev;
  for (auto& v : in) {
    for (float& x : v) x = random_value<float>(rng, -10, 10);
    dev.push_back(gpu::device_buffer<float>::from_host(v));
  }
  const std::vector<double> w = {0.25, 0.5, 0.25};
  const float* pointers[] = {dev[0].data(), dev[1].data(), dev[2].data()};
  gpu::stream s;
  gpu::weighted_sum<float, float>(pointers, w, dev[1].span(), s);
  s.synchronize();
  std::vector<const_buffer_view> views;
  for (auto& v : in) views.push_back(fedshard::cview(std::span<const float>(v)));
  std::vector<float> want(n);
  kernels::weighted_sum(views, w, fedshard::view(std::span<float>(want)));
  require_same(dev[1].to_host(), want, "in-place weighted_sum");
}

TEST_CASE("type-erased weighted_sum: f32 inputs, bf16 output") {
  std::mt19937_64 rng(34);
  const std::size_t n = 5003;
  std::vector<std::vector<float>> in(4, std::vector<float>(n));
  std::vector<gpu::device_buffer<float>> dev;
  std::vector<const_buffer_view> host_views, dev_views;
  for (auto& v : in) {
    for (float& x : v) x = random_value<float>(rng, -10, 10);
    dev.push_back(gpu::device_buffer<float>::from_host(v));
    host_views.push_back(fedshard::cview(std::span<const float>(v)));
    dev_views.push_back(dev.back().cview());
  }
  const std::vector<double> w = {0.125, 0.375, 0.0, 0.5};
  gpu::device_buffer<bf16> out(n);
  gpu::stream s;
  gpu::weighted_sum(dev_views, w, out.view(), s);
  s.synchronize();
  std::vector<bf16> want(n);
  kernels::weighted_sum(host_views, w, fedshard::view(std::span<bf16>(want)));
  require_same(out.to_host(), want, "type-erased weighted_sum");
}

// ---------------------------------------------------------------- optimizer steps

namespace test_kernels_cu {

/// Float arrays on host and device (at the given element offsets) with the same values; runs
/// a host step and a device step and compares every array afterwards.
struct float_arrays {
  std::vector<std::vector<float>> host;
  std::vector<guarded<float>> dev;

  float_arrays(std::mt19937_64& rng, std::size_t n, const std::vector<std::size_t>& offsets,
               const std::vector<std::pair<double, double>>& ranges) {
    for (std::size_t j = 0; j < offsets.size(); ++j) {
      std::vector<float> v(n);
      for (float& x : v) x = random_value<float>(rng, ranges[j].first, ranges[j].second);
      dev.emplace_back(n, offsets[j]);
      dev.back().upload(v);
      host.push_back(std::move(v));
    }
  }
  std::span<float> h(std::size_t j) { return host[j]; }
  std::span<float> d(std::size_t j) { return dev[j].span(); }
  void check(const char* what) {
    for (std::size_t j = 0; j < host.size(); ++j) {
      CAPTURE(j);
      require_same(dev[j].download(), host[j], what);
      CHECK(dev[j].guards_intact());
    }
  }
};

/// Runs `step(arrays, on_device)` for sizes and layouts (aligned, co-aligned shifted,
/// misaligned) and compares host and device.
void for_layouts(std::size_t arrays, const std::vector<std::pair<double, double>>& ranges,
                 const char* what, const std::function<void(float_arrays&, bool)>& step) {
  std::mt19937_64 rng(41);
  for (std::size_t n : {1, 5, 4099, 100003})
    for (int layout = 0; layout < 3; ++layout) {
      CAPTURE(n);
      CAPTURE(layout);
      std::vector<std::size_t> offsets(arrays);
      for (std::size_t j = 0; j < arrays; ++j)
        offsets[j] = layout == 0 ? 0 : layout == 1 ? 1 : (j + 1) % 4;
      float_arrays a(rng, n, offsets, ranges);
      step(a, false);
      step(a, true);
      FEDSHARD_CUDA_TRY(cudaDeviceSynchronize());
      a.check(what);
    }
}

}  // namespace test_kernels_cu

TEST_CASE("adamw_step equals kernels::adamw_step bit for bit") {
  const auto s = kernels::make_adamw_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 7);
  for_layouts(4, {{-1, 1}, {-1, 1}, {-0.1, 0.1}, {0, 0.01}}, "adamw",
              [&](float_arrays& a, bool device) {
                if (device)
                  gpu::adamw_step(a.d(0), a.d(1), a.d(2), a.d(3), s, nullptr);
                else
                  kernels::adamw_step(a.h(0), a.h(1), a.h(2), a.h(3), s);
              });
}

TEST_CASE("sgd_step equals kernels::sgd_step bit for bit (plain, momentum, Nesterov)") {
  const kernels::sgd_scalars variants[] = {
      kernels::make_sgd_scalars(0.1, 0.0, 0.0, 0.01, false, true),
      kernels::make_sgd_scalars(0.1, 0.9, 0.1, 0.0, false, true),
      kernels::make_sgd_scalars(0.05, 0.9, 0.0, 0.001, true, false)};
  for (const auto& s : variants)
    for_layouts(3, {{-1, 1}, {-1, 1}, {-0.5, 0.5}}, "sgd", [&](float_arrays& a, bool device) {
      if (device)
        gpu::sgd_step(a.d(0), a.d(1), a.d(2), s, nullptr);
      else
        kernels::sgd_step(a.h(0), a.h(1), a.h(2), s);
    });
}

TEST_CASE("outer optimizer steps equal the host loops bit for bit") {
  const auto sgd = kernels::make_outer_sgd_scalars(0.8f);
  const auto mom = kernels::make_outer_momentum_scalars(0.7f, 0.9f);
  const auto ada = kernels::make_outer_adaptive_scalars(0.05f, 0.9f, 0.99f, 1e-3f);
  const std::vector<std::pair<double, double>> ranges = {
      {-1, 1}, {-0.1, 0.1}, {-0.05, 0.05}, {0, 0.001}};
  for_layouts(2, ranges, "outer_sgd", [&](float_arrays& a, bool device) {
    if (device)
      gpu::outer_sgd_step(a.d(0), a.d(1), sgd, nullptr);
    else
      kernels::outer_sgd_step(a.h(0), a.h(1), sgd);
  });
  for_layouts(3, ranges, "outer_nesterov", [&](float_arrays& a, bool device) {
    if (device)
      gpu::outer_nesterov_step(a.d(0), a.d(1), a.d(2), mom, nullptr);
    else
      kernels::outer_nesterov_step(a.h(0), a.h(1), a.h(2), mom);
  });
  for_layouts(3, ranges, "outer_fedmom", [&](float_arrays& a, bool device) {
    if (device)
      gpu::outer_fedmom_step(a.d(0), a.d(1), a.d(2), mom, nullptr);
    else
      kernels::outer_fedmom_step(a.h(0), a.h(1), a.h(2), mom);
  });
  for_layouts(4, ranges, "outer_fedadam", [&](float_arrays& a, bool device) {
    if (device)
      gpu::outer_fedadam_step(a.d(0), a.d(1), a.d(2), a.d(3), ada, nullptr);
    else
      kernels::outer_fedadam_step(a.h(0), a.h(1), a.h(2), a.h(3), ada);
  });
  for_layouts(4, ranges, "outer_fedyogi", [&](float_arrays& a, bool device) {
    if (device)
      gpu::outer_fedyogi_step(a.d(0), a.d(1), a.d(2), a.d(3), ada, nullptr);
    else
      kernels::outer_fedyogi_step(a.h(0), a.h(1), a.h(2), a.h(3), ada);
  });
}

TEST_CASE("outer steps with d == anchor, as the host allows") {
  const auto mom = kernels::make_outer_momentum_scalars(0.7f, 0.9f);
  for_layouts(2, {{-1, 1}, {-0.1, 0.1}}, "outer_nesterov, d aliasing anchor",
              [&](float_arrays& a, bool device) {
                if (device)
                  gpu::outer_nesterov_step(a.d(0), a.d(0), a.d(1), mom, nullptr);
                else
                  kernels::outer_nesterov_step(a.h(0), a.h(0), a.h(1), mom);
              });
}
