#include "fedshard/kernels/pack.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace {

using fedshard::bf16;
namespace kernels = fedshard::kernels;
using kernels::pack_segment;
using kernels::tensor_ref;

constexpr float sentinel = -777.0f;

/// A unit: tensors with their own storage and their offsets in the flat buffer.
struct unit {
  std::vector<std::vector<float>> storage;
  std::vector<std::size_t> offsets;
  std::size_t flat_size = 0;

  std::vector<tensor_ref<const float>> cref() const {
    std::vector<tensor_ref<const float>> r;
    for (std::size_t i = 0; i < storage.size(); ++i)
      r.push_back({storage[i].data(), storage[i].size(), offsets[i]});
    return r;
  }
  /// The first `size` elements of the flat buffer by definition: tensor elements at their
  /// offsets, zero elsewhere and beyond.
  std::vector<float> reference_flat(std::size_t size) const {
    std::vector<float> flat(size, 0.0f);
    for (std::size_t i = 0; i < storage.size(); ++i)
      for (std::size_t j = 0; j < storage[i].size(); ++j)
        if (offsets[i] + j < size) flat[offsets[i] + j] = storage[i][j];
    return flat;
  }
};

/// 1-8 tensors of 0-40 elements (no elements too), gaps of 0-5 between them, a leading
/// gap and 0-7 trailing elements; values are distinct and non-zero.
unit random_unit(std::mt19937& rng) {
  unit u;
  const int n = std::uniform_int_distribution<int>(1, 8)(rng);
  std::size_t pos = std::uniform_int_distribution<std::size_t>(0, 3)(rng);
  float value = 1.0f;
  for (int i = 0; i < n; ++i) {
    const std::size_t count = std::uniform_int_distribution<std::size_t>(0, 40)(rng);
    std::vector<float> t(count);
    for (float& x : t) x = value++;
    u.offsets.push_back(pos);
    u.storage.push_back(std::move(t));
    pos += count + std::uniform_int_distribution<std::size_t>(0, 5)(rng);
  }
  u.flat_size = pos + std::uniform_int_distribution<std::size_t>(0, 7)(rng);
  if (u.flat_size == 0) u.flat_size = 1;
  return u;
}

/// Mutable refs into a copy of the unit's tensors, every element set to `fill`.
struct targets {
  std::vector<std::vector<float>> storage;
  std::vector<tensor_ref<float>> refs;
  targets(const unit& u, float fill) {
    for (const auto& t : u.storage) storage.emplace_back(t.size(), fill);
    for (std::size_t i = 0; i < storage.size(); ++i)
      refs.push_back({storage[i].data(), storage[i].size(), u.offsets[i]});
  }
};

template <class T>
std::span<const T> cspan(const std::vector<T>& v) {
  return {v.data(), v.size()};
}

TEST_CASE("pack and unpack round-trip random units split into 1 to 16 shards") {
  std::mt19937 rng(7);
  std::size_t padded_elements = 0, cut_tensors = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const unit u = random_unit(rng);
    const auto tensors = u.cref();
    for (std::size_t shards = 1; shards <= 16; ++shards) {
      CAPTURE(trial);
      CAPTURE(shards);
      const std::size_t shard_size = (u.flat_size + shards - 1) / shards;
      const std::vector<float> flat = u.reference_flat(shard_size * shards);
      targets back(u, sentinel);
      for (std::size_t s = 0; s < shards; ++s) {
        const std::size_t begin = s * shard_size;
        std::vector<float> shard(shard_size, sentinel);  // padding must be overwritten
        kernels::pack(std::span<const tensor_ref<const float>>(tensors), begin,
                      std::span<float>(shard));
        for (std::size_t i = 0; i < shard_size; ++i) {
          REQUIRE(shard[i] == flat[begin + i]);
          if (flat[begin + i] == 0.0f) ++padded_elements;
        }
        for (std::size_t t = 0; t < tensors.size(); ++t) {
          const std::size_t lo = tensors[t].offset, hi = lo + tensors[t].count;
          if (lo < begin && hi > begin) ++cut_tensors;
        }
        kernels::unpack(cspan(shard), begin, std::span<const tensor_ref<float>>(back.refs));
      }
      for (std::size_t t = 0; t < u.storage.size(); ++t) REQUIRE(back.storage[t] == u.storage[t]);
    }
  }
  CHECK(padded_elements > 0);  // the random layouts did exercise padding and cut tensors
  CHECK(cut_tensors > 0);
}

TEST_CASE("unpack writes only the tensor elements inside the shard") {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const unit u = random_unit(rng);
    const std::size_t begin = std::uniform_int_distribution<std::size_t>(0, u.flat_size)(rng);
    const std::size_t size = std::uniform_int_distribution<std::size_t>(0, u.flat_size)(rng);
    const std::vector<float> flat = u.reference_flat(begin + size);
    std::vector<float> shard(flat.begin() + static_cast<std::ptrdiff_t>(begin), flat.end());
    for (float& x : shard)
      if (x == 0.0f) x = 12345.0f;  // unpack must ignore what sits in padding
    targets back(u, sentinel);
    kernels::unpack(cspan(shard), begin, std::span<const tensor_ref<float>>(back.refs));
    for (std::size_t t = 0; t < u.storage.size(); ++t) {
      for (std::size_t j = 0; j < u.storage[t].size(); ++j) {
        const std::size_t pos = u.offsets[t] + j;
        const bool inside = pos >= begin && pos < begin + size;
        REQUIRE(back.storage[t][j] == (inside ? u.storage[t][j] : sentinel));
      }
    }
  }
}

TEST_CASE("pack of any range: beyond the tensors is zero") {
  std::mt19937 rng(13);
  for (int trial = 0; trial < 200; ++trial) {
    const unit u = random_unit(rng);
    const auto tensors = u.cref();
    const std::size_t begin = std::uniform_int_distribution<std::size_t>(0, u.flat_size + 4)(rng);
    const std::size_t size = std::uniform_int_distribution<std::size_t>(0, u.flat_size + 4)(rng);
    const std::vector<float> flat = u.reference_flat(begin + size);
    std::vector<float> shard(size, sentinel);
    kernels::pack(std::span<const tensor_ref<const float>>(tensors), begin,
                  std::span<float>(shard));
    for (std::size_t i = 0; i < size; ++i) REQUIRE(shard[i] == flat[begin + i]);
  }
}

TEST_CASE("converting pack: f32 tensors to a bf16 shard and back") {
  std::mt19937 rng(17);
  std::uniform_real_distribution<float> value(-3.0f, 3.0f);
  for (int trial = 0; trial < 40; ++trial) {
    unit u = random_unit(rng);
    for (auto& t : u.storage)
      for (float& x : t) x = value(rng);  // values that bf16 must round
    const auto tensors = u.cref();
    const std::size_t shards = 1 + static_cast<std::size_t>(trial % 5);
    const std::size_t shard_size = (u.flat_size + shards - 1) / shards;
    const std::vector<float> flat = u.reference_flat(shard_size * shards);
    targets back(u, sentinel);
    for (std::size_t s = 0; s < shards; ++s) {
      std::vector<bf16> shard(shard_size, bf16(sentinel));
      kernels::pack(std::span<const tensor_ref<const float>>(tensors), s * shard_size,
                    std::span<bf16>(shard));
      for (std::size_t i = 0; i < shard_size; ++i)
        REQUIRE(shard[i].bits == bf16(flat[s * shard_size + i]).bits);
      kernels::unpack(cspan(shard), s * shard_size, std::span<const tensor_ref<float>>(back.refs));
    }
    for (std::size_t t = 0; t < u.storage.size(); ++t)
      for (std::size_t j = 0; j < u.storage[t].size(); ++j)
        REQUIRE(back.storage[t][j] == static_cast<float>(bf16(u.storage[t][j])));
  }
}

TEST_CASE("f32 packed into f64 comes back exactly") {
  std::mt19937 rng(19);
  const unit u = random_unit(rng);
  const auto tensors = u.cref();
  std::vector<double> flat(u.flat_size, -1.0);
  kernels::pack(std::span<const tensor_ref<const float>>(tensors), std::span<double>(flat));
  const std::vector<float> ref = u.reference_flat(u.flat_size);
  for (std::size_t i = 0; i < flat.size(); ++i) REQUIRE(flat[i] == static_cast<double>(ref[i]));
  targets back(u, sentinel);
  kernels::unpack(cspan(flat), std::span<const tensor_ref<float>>(back.refs));
  for (std::size_t t = 0; t < u.storage.size(); ++t) REQUIRE(back.storage[t] == u.storage[t]);
}

TEST_CASE("whole-buffer pack and unpack") {
  std::mt19937 rng(23);
  for (int trial = 0; trial < 50; ++trial) {
    const unit u = random_unit(rng);
    const auto tensors = u.cref();
    std::vector<float> flat(u.flat_size, sentinel);
    kernels::pack(std::span<const tensor_ref<const float>>(tensors), std::span<float>(flat));
    REQUIRE(flat == u.reference_flat(u.flat_size));
    targets back(u, sentinel);
    kernels::unpack(cspan(flat), std::span<const tensor_ref<float>>(back.refs));
    for (std::size_t t = 0; t < u.storage.size(); ++t) REQUIRE(back.storage[t] == u.storage[t]);
  }
}

TEST_CASE("segments of a hand-made layout") {
  const float a[3] = {1, 2, 3}, b[4] = {4, 5, 6, 7}, c[1] = {8};
  // flat: [0,2) gap, a at [2,5), b at [5,9), gap [9,12), an empty tensor at 10, c at [12,13)
  const std::vector<tensor_ref<const float>> tensors = {
      {a, 3, 2}, {b, 4, 5}, {nullptr, 0, 10}, {c, 1, 12}};
  std::vector<pack_segment> segments;
  kernels::for_each_segment(std::span<const tensor_ref<const float>>(tensors), 4, 11,
                            [&](const pack_segment& s) { segments.push_back(s); });
  // shard [4, 15): a's last element, all of b, padding, c, padding
  const std::vector<pack_segment> expected = {{0, 2, 0, 1},
                                              {1, 0, 1, 4},
                                              {pack_segment::padding, 0, 5, 3},
                                              {3, 0, 8, 1},
                                              {pack_segment::padding, 0, 9, 2}};
  REQUIRE(segments.size() == expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    CAPTURE(i);
    CHECK(segments[i].tensor == expected[i].tensor);
    CHECK(segments[i].tensor_pos == expected[i].tensor_pos);
    CHECK(segments[i].shard_pos == expected[i].shard_pos);
    CHECK(segments[i].count == expected[i].count);
  }
  std::vector<float> shard(11, sentinel);
  kernels::pack(std::span<const tensor_ref<const float>>(tensors), 4, std::span<float>(shard));
  CHECK(shard == std::vector<float>{3, 4, 5, 6, 7, 0, 0, 0, 8, 0, 0});
}

TEST_CASE("the per-element functors over the segments give what pack and unpack give") {
  // What a device kernel does: one thread per element of each segment.
  std::mt19937 rng(29);
  for (int trial = 0; trial < 50; ++trial) {
    const unit u = random_unit(rng);
    const auto tensors = u.cref();
    const std::size_t begin = std::uniform_int_distribution<std::size_t>(0, u.flat_size)(rng);
    const std::size_t size = std::uniform_int_distribution<std::size_t>(1, u.flat_size)(rng);
    std::vector<bf16> by_host(size), by_functor(size, bf16(sentinel));
    kernels::pack(std::span<const tensor_ref<const float>>(tensors), begin,
                  std::span<bf16>(by_host));
    targets back(u, sentinel);
    kernels::for_each_segment(
        std::span<const tensor_ref<const float>>(tensors), begin, size, [&](const pack_segment& s) {
          if (s.tensor == pack_segment::padding) {
            const kernels::zero_fn<bf16> zero{by_functor.data() + s.shard_pos};
            for (std::size_t i = 0; i < s.count; ++i) zero(i);
          } else {
            const kernels::copy_fn<float, bf16> copy{tensors[s.tensor].data + s.tensor_pos,
                                                     by_functor.data() + s.shard_pos};
            for (std::size_t i = 0; i < s.count; ++i) copy(i);
            const kernels::copy_fn<bf16, float> back_copy{by_functor.data() + s.shard_pos,
                                                          back.refs[s.tensor].data + s.tensor_pos};
            for (std::size_t i = 0; i < s.count; ++i) back_copy(i);
          }
        });
    for (std::size_t i = 0; i < size; ++i) REQUIRE(by_functor[i].bits == by_host[i].bits);
    targets back_host(u, sentinel);
    kernels::unpack(cspan(by_host), begin, std::span<const tensor_ref<float>>(back_host.refs));
    for (std::size_t t = 0; t < u.storage.size(); ++t)
      REQUIRE(back.storage[t] == back_host.storage[t]);
  }
}

std::string message_of_pack(const std::vector<tensor_ref<const float>>& tensors,
                            std::size_t shard_begin, std::size_t shard_size) {
  std::vector<float> shard(shard_size);
  try {
    kernels::pack(std::span<const tensor_ref<const float>>(tensors), shard_begin,
                  std::span<float>(shard));
  } catch (const fedshard::invalid_argument& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST_CASE("layout errors name the tensors and their ranges") {
  const float x[8] = {};
  SUBCASE("overlap") {
    const std::string m = message_of_pack({{x, 4, 0}, {x, 4, 10}, {x, 4, 12}}, 0, 4);
    CHECK(contains(m, "tensor 1 covers [10, 14)"));
    CHECK(contains(m, "tensor 2 starts at 12"));
  }
  SUBCASE("unsorted") {
    const std::string m = message_of_pack({{x, 2, 20}, {x, 2, 3}}, 0, 4);
    CHECK(contains(m, "tensor 0 covers [20, 22)"));
    CHECK(contains(m, "tensor 1 starts at 3"));
  }
  SUBCASE("null data") {
    const std::string m = message_of_pack({{x, 2, 0}, {nullptr, 5, 2}}, 0, 4);
    CHECK(contains(m, "tensor 1 has 5 elements but a null data pointer"));
  }
  SUBCASE("offset + count wraps around") {
    const std::size_t huge = std::numeric_limits<std::size_t>::max() - 1;
    const std::string m = message_of_pack({{x, 4, huge}}, 0, 4);
    CHECK(contains(m, "tensor 0 (offset " + std::to_string(huge) + ", count 4)"));
  }
  SUBCASE("shard range wraps around") {
    const std::size_t huge = std::numeric_limits<std::size_t>::max() - 1;
    const std::string m = message_of_pack({{x, 4, 0}}, huge, 4);
    CHECK(contains(m, "shard [" + std::to_string(huge) + ", +4)"));
  }
  SUBCASE("unpack checks too") {
    float y[4] = {};
    const std::vector<tensor_ref<float>> t = {{y, 4, 6}, {y, 4, 8}};
    std::vector<float> shard(4);
    try {
      kernels::unpack(cspan(shard), 0, std::span<const tensor_ref<float>>(t));
      FAIL("expected invalid_argument");
    } catch (const fedshard::invalid_argument& e) {
      CHECK(contains(e.what(), "unpack"));
      CHECK(contains(e.what(), "tensor 0 covers [6, 10)"));
    }
  }
  CHECK(message_of_pack({{x, 4, 0}, {x, 0, 4}, {x, 4, 4}}, 0, 8).empty());  // empty tensor
  CHECK(message_of_pack({{nullptr, 0, 3}}, 0, 8).empty());
}

TEST_CASE("whole-buffer variants reject tensors beyond the buffer") {
  const float x[4] = {};
  const std::vector<tensor_ref<const float>> tensors = {{x, 4, 0}, {x, 4, 6}};
  std::vector<float> flat(9);
  try {
    kernels::pack(std::span<const tensor_ref<const float>>(tensors), std::span<float>(flat));
    FAIL("expected invalid_argument");
  } catch (const fedshard::invalid_argument& e) {
    CHECK(contains(e.what(), "tensor 1 covers [6, 10), beyond the flat buffer of 9 elements"));
  }
  float y[4] = {};
  const std::vector<tensor_ref<float>> out = {{y, 4, 6}};
  CHECK_THROWS_AS(kernels::unpack(cspan(flat), std::span<const tensor_ref<float>>(out)),
                  fedshard::invalid_argument);
  flat.resize(10);
  kernels::pack(std::span<const tensor_ref<const float>>(tensors), std::span<float>(flat));
  kernels::unpack(cspan(flat), std::span<const tensor_ref<float>>(out));
}

TEST_CASE("no tensors: the shard is all padding") {
  std::vector<float> shard(5, sentinel);
  kernels::pack(std::span<const tensor_ref<const float>>(), 3, std::span<float>(shard));
  CHECK(shard == std::vector<float>(5, 0.0f));
  std::vector<float> empty;
  kernels::pack(std::span<const tensor_ref<const float>>(), 3, std::span<float>(empty));
}

}  // namespace
