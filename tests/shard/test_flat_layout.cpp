#include "fedshard/shard/flat_layout.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/core/buffer.hpp"
#include "support/spawn_ranks.hpp"

namespace {

using fedshard::dtype;
using fedshard::flat_layout;
using fedshard::tensor_spec;
using fedshard::unit_spec;

// ---- An independent statement of the layout rules (nothing here calls the header) ----

std::size_t bytes_of(dtype t) {
  switch (t) {
    case dtype::f64: return 8;
    case dtype::f32: return 4;
    default: return 2;
  }
}

/// Elements per 64 bytes.
std::size_t align_of(dtype t) {
  return 64 / bytes_of(t);
}

std::size_t numel_of(const std::vector<std::int64_t>& shape) {
  std::size_t n = 1;
  for (auto d : shape) n *= static_cast<std::size_t>(d);
  return n;
}

std::size_t expected_shard_numel(std::size_t numel, std::size_t shards, dtype t) {
  const std::size_t per = (numel + shards - 1) / shards;
  const std::size_t a = align_of(t);
  return (per + a - 1) / a * a;
}

/// Random layouts: 1-6 units of 1-5 tensors; 1-4 dims of 1..50 (fewer and smaller when there
/// are more dims, so buffers stay small), some scalars and some long vectors.
struct generator {
  std::mt19937 rng{20260611};

  int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

  std::vector<std::int64_t> shape() {
    const int kind = uniform(0, 19);
    if (kind == 0) return {};                      // scalar
    if (kind == 1) return {uniform(1000, 70000)};  // big
    const int dims = uniform(1, 4);
    const int top = dims <= 2 ? 50 : dims == 3 ? 20 : 8;
    std::vector<std::int64_t> s;
    for (int d = 0; d < dims; ++d) s.push_back(uniform(1, top));
    return s;
  }

  std::vector<unit_spec> units() {
    std::vector<unit_spec> out;
    const int n_units = uniform(1, 6);
    const bool one_dtype = uniform(0, 1) == 0;
    const dtype shared = fedshard::all_dtypes[uniform(0, 3)];
    int tensor_id = 0;
    for (int u = 0; u < n_units; ++u) {
      unit_spec us{"unit" + std::to_string(u), {}};
      const dtype t = one_dtype ? shared : fedshard::all_dtypes[uniform(0, 3)];
      const int n_tensors = uniform(1, 5);
      for (int i = 0; i < n_tensors; ++i)
        us.tensors.push_back({"t" + std::to_string(tensor_id++), shape(), t});
      out.push_back(std::move(us));
    }
    return out;
  }
};

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

/// The message of the invalid_argument that f throws, or a note that it threw none.
template <class F>
std::string invalid_argument_of(F&& f) {
  try {
    f();
  } catch (const fedshard::invalid_argument& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no exception";
}

/// How verify_same_layout's message describes a layout.
std::string digest_text(const flat_layout& l) {
  char hex[32];
  std::snprintf(hex, sizeof hex, "0x%016llx", static_cast<unsigned long long>(l.fingerprint()));
  return "S = " + std::to_string(l.shards()) + ", " + std::to_string(l.num_units()) + " units, " +
         std::to_string(l.total_numel()) + " elements, fingerprint " + hex;
}

std::vector<unit_spec> tiny_mlp() {
  return {{"layer0", {{"w", {64, 32}}, {"b", {64}}}}, {"layer1", {{"w", {10, 64}}, {"b", {10}}}}};
}

}  // namespace

TEST_CASE("the tiny MLP over 2 shards") {
  const flat_layout l(tiny_mlp(), 2);
  REQUIRE(l.num_units() == 2);
  CHECK(l.shards() == 2);
  const auto& u0 = l.unit(0);
  CHECK(u0.name == "layer0");
  CHECK(u0.type == dtype::f32);
  CHECK(u0.tensors[0].offset == 0);
  CHECK(u0.tensors[0].numel == 2048);
  CHECK(u0.tensors[1].offset == 2048);
  CHECK(u0.tensors[1].numel == 64);
  CHECK(u0.numel == 2112);
  CHECK(u0.shard_numel == 1056);  // 2112 / 2 = 1056, already a multiple of 16 floats
  CHECK(u0.padded_numel == 2112);
  const auto& u1 = l.unit(1);
  CHECK(u1.numel == 650);
  CHECK(u1.shard_numel == 336);  // ceil(650 / 2) = 325, rounded up to 16 floats
  CHECK(u1.padded_numel == 672);
  CHECK(l.shard_of(1, 1) == fedshard::shard_range{336, 672});
  CHECK(l.shard_of(1, 1).size() == 336);
  CHECK(l.total_numel() == 2762);
  CHECK(l.total_padded_numel() == 2784);
  CHECK(l.total_shard_numel() == 1392);
  CHECK(l.shard_offset(1) == 1056);
  CHECK(l.unit_offset(1) == 2112);
}

TEST_CASE("shards start every 64 bytes: 16 f32, 8 f64, 32 bf16 or f16 elements") {
  for (dtype t : fedshard::all_dtypes) {
    CAPTURE(fedshard::to_string(t));
    const flat_layout one({{"u", {{"x", {1}, t}}}}, 1);
    CHECK(one.unit(0).shard_numel * bytes_of(t) == 64);
    const flat_layout three({{"u", {{"x", {1}, t}}}}, 3);
    CHECK(three.unit(0).padded_numel * bytes_of(t) == 3 * 64);
  }
}

TEST_CASE("a scalar (shape {}) has one element") {
  const flat_layout l({{"u", {{"a", {}}, {"b", {3}}, {"c", {}}}}}, 1);
  CHECK(l.unit(0).tensors[0].numel == 1);
  CHECK(l.unit(0).tensors[1].offset == 1);
  CHECK(l.unit(0).tensors[2].offset == 4);
  CHECK(l.unit(0).numel == 5);
}

TEST_CASE("random layouts: packing, padding, shard ranges and offsets") {
  generator gen;
  for (int iter = 0; iter < 300; ++iter) {
    const auto specs = gen.units();
    const int S = gen.uniform(1, 16);
    CAPTURE(iter);
    CAPTURE(S);
    const flat_layout l(specs, S);
    REQUIRE(l.num_units() == specs.size());
    REQUIRE(l.units().size() == specs.size());
    std::size_t total = 0, total_padded = 0, total_shard = 0;
    bool one_dtype = true;
    for (std::size_t u = 0; u < specs.size(); ++u) {
      CAPTURE(u);
      const auto& ul = l.unit(u);
      const dtype t = specs[u].tensors[0].type;
      one_dtype = one_dtype && t == specs[0].tensors[0].type;
      CHECK(ul.name == specs[u].name);
      CHECK(ul.type == t);
      CHECK(&l.units()[u] == &ul);
      // Tensors back to back, in declaration order, from 0.
      std::size_t offset = 0;
      REQUIRE(ul.tensors.size() == specs[u].tensors.size());
      for (std::size_t i = 0; i < ul.tensors.size(); ++i) {
        CHECK(ul.tensors[i].name == specs[u].tensors[i].name);
        CHECK(ul.tensors[i].shape == specs[u].tensors[i].shape);
        CHECK(ul.tensors[i].numel == numel_of(specs[u].tensors[i].shape));
        CHECK(ul.tensors[i].offset == offset);
        offset += numel_of(specs[u].tensors[i].shape);
      }
      CHECK(ul.numel == offset);
      // Padding: the smallest 64-byte multiple per shard that holds numel.
      const auto s = static_cast<std::size_t>(S);
      CHECK(ul.shard_numel == expected_shard_numel(ul.numel, s, t));
      CHECK(ul.padded_numel == s * ul.shard_numel);
      CHECK(ul.padded_numel >= ul.numel);
      CHECK(ul.padded_numel - ul.numel < s * align_of(t));
      CHECK(ul.shard_numel * bytes_of(t) % 64 == 0);
      // Shard ranges partition [0, padded_numel) into S equal pieces.
      std::size_t next = 0;
      for (int k = 0; k < S; ++k) {
        const auto r = l.shard_of(u, k);
        CHECK(r.begin == next);
        CHECK(r.size() == ul.shard_numel);
        CHECK(r.begin * bytes_of(t) % 64 == 0);
        next = r.end;
      }
      CHECK(next == ul.padded_numel);
      CHECK(l.unit_offset(u) == total_padded);
      CHECK(l.shard_offset(u) == total_shard);
      total += ul.numel;
      total_padded += ul.padded_numel;
      total_shard += ul.shard_numel;
    }
    CHECK(l.total_numel() == total);
    CHECK(l.total_padded_numel() == total_padded);
    CHECK(l.total_shard_numel() == total_shard);
    if (one_dtype) {  // in a concatenation of one dtype, every unit (and shard) is aligned too
      const std::size_t b = bytes_of(l.unit(0).type);
      for (std::size_t u = 0; u < l.num_units(); ++u) {
        CHECK(l.unit_offset(u) * b % 64 == 0);
        CHECK(l.shard_offset(u) * b % 64 == 0);
      }
    }
  }
}

TEST_CASE("random layouts: tensor views cover their elements and never the padding") {
  generator gen;
  for (int iter = 0; iter < 200; ++iter) {
    const auto specs = gen.units();
    const int S = gen.uniform(1, 16);
    CAPTURE(iter);
    const flat_layout l(specs, S);
    for (std::size_t u = 0; u < l.num_units(); ++u) {
      const auto& ul = l.unit(u);
      // Distinct values written through each view land exactly where the rules say.
      std::vector<std::uint64_t> flat(ul.padded_numel, 0);
      for (std::size_t t = 0; t < ul.tensors.size(); ++t) {
        auto v = l.tensor_view(std::span<std::uint64_t>(flat), u, t);
        REQUIRE(v.size() == numel_of(specs[u].tensors[t].shape));
        for (std::size_t j = 0; j < v.size(); ++j) v[j] = (std::uint64_t{t + 1} << 32) | (j + 1);
      }
      std::size_t k = 0;
      bool ok = true;
      for (std::size_t t = 0; t < ul.tensors.size(); ++t)
        for (std::size_t j = 0; j < numel_of(specs[u].tensors[t].shape); ++j, ++k)
          ok = ok && flat[k] == ((std::uint64_t{t + 1} << 32) | (j + 1));
      for (; k < flat.size(); ++k) ok = ok && flat[k] == 0;  // padding untouched
      CHECK(ok);

      // Typed: a 64-byte aligned unit buffer of the unit's dtype, every shard start aligned,
      // tensors written through their views, the padding bytes still zero.
      fedshard::visit(ul.type, [&](auto tag) {
        using T = typename decltype(tag)::type;
        fedshard::aligned_buffer<T> buf(ul.padded_numel);
        for (int s = 0; s < S; ++s)
          CHECK(reinterpret_cast<std::uintptr_t>(buf.data() + l.shard_of(u, s).begin) % 64 == 0);
        for (std::size_t t = 0; t < ul.tensors.size(); ++t)
          for (T& x : l.tensor_view(buf.span(), u, t)) x = T(1.0f);
        const auto* bytes = reinterpret_cast<const unsigned char*>(buf.data());
        bool padding_zero = true;
        for (std::size_t i = ul.numel * sizeof(T); i < ul.padded_numel * sizeof(T); ++i)
          padding_zero = padding_zero && bytes[i] == 0;
        CHECK(padding_zero);
        bool tensors_set = true;
        for (std::size_t i = 0; i < ul.numel; ++i)
          tensors_set = tensors_set && float(buf[i]) == 1.0f;
        CHECK(tensors_set);
      });
    }
  }
}

TEST_CASE("random layouts: the fingerprint tells layouts apart") {
  generator gen;
  for (int iter = 0; iter < 200; ++iter) {
    auto specs = gen.units();
    const int S = gen.uniform(1, 16);
    CAPTURE(iter);
    const flat_layout base(specs, S);
    const flat_layout same(specs, S);
    CHECK(base.fingerprint() == same.fingerprint());
    CHECK(base == same);

    const std::size_t u = static_cast<std::size_t>(gen.uniform(0, int(specs.size()) - 1));
    const std::size_t t =
        static_cast<std::size_t>(gen.uniform(0, int(specs[u].tensors.size()) - 1));
    std::vector<std::vector<unit_spec>> variants;
    {
      auto v = specs;  // one dimension grows
      auto& shape = v[u].tensors[t].shape;
      if (shape.empty())
        shape.push_back(2);
      else
        ++shape[static_cast<std::size_t>(gen.uniform(0, int(shape.size()) - 1))];
      variants.push_back(v);
    }
    {
      auto v = specs;  // same numel, other shape
      v[u].tensors[t].shape.push_back(1);
      variants.push_back(v);
    }
    {
      auto v = specs;  // a tensor renamed
      v[u].tensors[t].name += "x";
      variants.push_back(v);
    }
    {
      auto v = specs;  // a unit renamed
      v[u].name += "x";
      variants.push_back(v);
    }
    {
      auto v = specs;  // a unit changes dtype
      const dtype to = v[u].tensors[0].type == dtype::f32 ? dtype::bf16 : dtype::f32;
      for (auto& ts : v[u].tensors) ts.type = to;
      variants.push_back(v);
    }
    {
      auto v = specs;  // a tensor appended
      v[u].tensors.push_back({"extra", {1}, v[u].tensors[0].type});
      variants.push_back(v);
    }
    if (specs[u].tensors.size() >= 2) {
      auto v = specs;  // two tensors swapped
      std::swap(v[u].tensors[0], v[u].tensors[1]);
      variants.push_back(v);
    }
    if (specs.size() >= 2) {
      auto v = specs;  // the first tensor of unit 1 moves to the end of unit 0
      if (v[1].tensors.size() >= 2 && v[1].tensors[0].type == v[0].tensors[0].type) {
        v[0].tensors.push_back(v[1].tensors[0]);
        v[1].tensors.erase(v[1].tensors.begin());
        variants.push_back(v);
      }
    }
    for (std::size_t i = 0; i < variants.size(); ++i) {
      CAPTURE(i);
      const flat_layout other(variants[i], S);
      CHECK(other.fingerprint() != base.fingerprint());
      CHECK_FALSE(other == base);
    }
    const flat_layout other_s(specs, S % 16 + 1);
    CHECK(other_s.fingerprint() != base.fingerprint());
    CHECK_FALSE(other_s == base);
  }
}

TEST_CASE("find: qualified names, unique bare names, ambiguity") {
  const flat_layout l({{"layer0", {{"w", {4, 4}}, {"b", {4}}, {"norm", {4}}}},
                       {"layer1", {{"w", {2}}, {"b", {2}}}}},
                      3);
  CHECK(l.find("layer0.w") == std::pair<std::size_t, std::size_t>{0, 0});
  CHECK(l.find("layer1.b") == std::pair<std::size_t, std::size_t>{1, 1});
  CHECK(l.find("norm") == std::pair<std::size_t, std::size_t>{0, 2});
  CHECK(l.find("layer0", "b") == std::pair<std::size_t, std::size_t>{0, 1});
  CHECK(l.find("missing") == std::nullopt);
  CHECK(l.find("layer2.w") == std::nullopt);
  CHECK(l.find("layer1", "norm") == std::nullopt);
  const std::string msg = invalid_argument_of([&] { (void)l.find("w"); });
  CHECK(contains(msg, "'w' is ambiguous"));
  CHECK(contains(msg, "'layer0', 'layer1'"));

  generator gen;  // every tensor of random layouts is found where it is
  for (int iter = 0; iter < 50; ++iter) {
    const flat_layout r(gen.units(), gen.uniform(1, 16));
    for (std::size_t u = 0; u < r.num_units(); ++u)
      for (std::size_t t = 0; t < r.unit(u).tensors.size(); ++t) {
        const auto& name = r.unit(u).tensors[t].name;
        const auto where = std::pair{u, t};
        CHECK(r.find(name) == where);  // names are unique in generated layouts
        CHECK(r.find(r.unit(u).name + "." + name) == where);
        CHECK(r.find(r.unit(u).name, name) == where);
      }
  }
}

TEST_CASE("describe and summary name every unit and tensor with their numbers") {
  const flat_layout l(tiny_mlp(), 2);
  const std::string d = l.describe();
  for (const char* part : {"S = 2", "2 units", "2762 elements", "2784 padded", "1392 per shard",
                           "'layer0' f32", "'layer1' f32", "w [64, 32] at 0", "b [64] at 2048",
                           "b [10] at 640", "padded 672, shard 336"})
    CHECK_MESSAGE(contains(d, part), part, " not in:\n", d);
  char hex[32];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(l.fingerprint()));
  CHECK(contains(l.summary(), hex));
}

TEST_CASE("invalid layouts throw invalid_argument naming the unit, tensor and values") {
  struct bad {
    const char* what;
    std::vector<unit_spec> units;
    int shards;
    std::vector<std::string> words;
  };
  const std::int64_t big = std::int64_t{1} << 31;
  const std::vector<bad> cases = {
      {"S < 1", tiny_mlp(), 0, {"shards must be >= 1", "found 0"}},
      {"negative S", tiny_mlp(), -3, {"found -3"}},
      {"no units", {}, 2, {"at least one unit"}},
      {"empty unit", {{"a", {{"x", {1}}}}, {"empty", {}}}, 1, {"'empty'", "no tensors"}},
      {"zero dim", {{"a", {{"x", {3, 0, 2}}}}}, 1, {"'x'", "'a'", "[3, 0, 2]"}},
      {"negative dim", {{"a", {{"x", {-4}}}}}, 1, {"'x'", "[-4]"}},
      {"duplicate tensor",
       {{"a", {{"x", {1}}, {"y", {1}}, {"x", {2}}}}},
       1,
       {"'x'", "twice", "'a'"}},
      {"duplicate unit",
       {{"a", {{"x", {1}}}}, {"b", {{"y", {1}}}}, {"a", {{"z", {1}}}}},
       1,
       {"'a'", "twice", "units 0 and 2"}},
      {"mixed dtypes",
       {{"a", {{"x", {1}, dtype::f32}, {"y", {1}, dtype::bf16}}}},
       1,
       {"'a'", "'x' of f32", "'y' of bf16"}},
      {"empty unit name", {{"", {{"x", {1}}}}}, 1, {"unit 0", "empty name"}},
      {"empty tensor name", {{"a", {{"x", {1}}, {"", {1}}}}}, 1, {"tensor 1", "'a'", "empty name"}},
      {"qualified clash", {{"a.b", {{"c", {1}}}}, {"a", {{"b.c", {1}}}}}, 1, {"'a.b.c'"}},
      {"tensor overflow",
       {{"a", {{"x", {big, big, big}}}}},
       1,
       {"'x'", "[2147483648, 2147483648, 2147483648]"}},
      {"unit overflow",
       {{"a", {{"x", {big, big / 4}}, {"y", {big, big / 4}}}}},
       1,
       {"unit 'a' has more than 2305843009213693951 elements of f32", "'y'"}},
      {"padded overflow",
       {{"a", {{"x", {std::numeric_limits<std::int64_t>::max() / 4}}}}},
       1,
       {"'a'", "padded"}},
      {"total overflow",
       {{"a", {{"x", {3 * (std::int64_t{1} << 60)}, dtype::f16}}},
        {"b", {{"x", {3 * (std::int64_t{1} << 60)}, dtype::f16}}},
        {"c", {{"x", {3 * (std::int64_t{1} << 60)}, dtype::f16}}}},
       1,
       {"'c'", "in all"}},
  };
  for (const bad& b : cases) {
    CAPTURE(b.what);
    const std::string msg = invalid_argument_of([&] { flat_layout l(b.units, b.shards); });
    CAPTURE(msg);
    CHECK(contains(msg, "flat_layout"));
    for (const auto& w : b.words) CHECK(contains(msg, w));
  }
}

TEST_CASE("accessors reject out-of-range units, shards, tensors and wrong buffer sizes") {
  const flat_layout l(tiny_mlp(), 4);
  std::vector<float> right(l.unit(1).padded_numel), wrong(l.unit(1).numel);
  CHECK(l.tensor_view(std::span<float>(right), 1, 1).size() == 10);
  std::string msg =
      invalid_argument_of([&] { (void)l.tensor_view(std::span<float>(wrong), 1, 0); });
  CHECK(contains(msg, "'layer1'"));
  CHECK(contains(msg, "padded_numel = 704"));
  CHECK(contains(msg, "found 650"));
  msg = invalid_argument_of([&] { (void)l.tensor_view(std::span<float>(right), 1, 2); });
  CHECK(contains(msg, "has 2 tensors, asked for tensor 2"));
  msg = invalid_argument_of([&] { (void)l.shard_of(0, 4); });
  CHECK(contains(msg, "[0, 4), found 4"));
  msg = invalid_argument_of([&] { (void)l.shard_of(0, -1); });
  CHECK(contains(msg, "found -1"));
  msg = invalid_argument_of([&] { (void)l.unit(2); });
  CHECK(contains(msg, "[0, 2), found 2"));
  CHECK(contains(invalid_argument_of([&] { (void)l.shard_of(5, 0); }), "found 5"));
  CHECK(contains(invalid_argument_of([&] { (void)l.shard_offset(2); }), "found 2"));
  CHECK(contains(invalid_argument_of([&] { (void)l.unit_offset(2); }), "found 2"));
}

TEST_CASE("verify_same_layout passes equal layouts") {
  fedshard::test::spawn_ranks(4, [](fedshard::inproc::communicator& world) {
    const flat_layout l(tiny_mlp(), 4);
    fedshard::verify_same_layout(world, l);
    fedshard::verify_same_layout(world, l);  // and leaves the communicator in step
  });
}

TEST_CASE("verify_same_layout: a rank with another layout makes every rank throw") {
  struct variant {
    const char* what;
    std::vector<int> odd_ranks;
    int odd_shards;
    std::vector<unit_spec> odd_units;
    std::string names;  // how the message lists the odd ranks
  };
  auto bigger = tiny_mlp();
  bigger[1].tensors[1].shape = {11};
  auto renamed = tiny_mlp();
  renamed[0].name = "layer_0";
  auto fewer = tiny_mlp();
  fewer.pop_back();
  const std::vector<variant> variants = {
      {"one shape", {2}, 4, bigger, "rank(s) 2 of 4"},
      {"a unit name", {3}, 4, renamed, "rank(s) 3 of 4"},
      {"S", {1}, 2, tiny_mlp(), "rank(s) 1 of 4"},
      {"unit count, two ranks", {1, 3}, 4, fewer, "rank(s) 1, 3 of 4"},
  };
  const flat_layout reference(tiny_mlp(), 4);
  for (const variant& v : variants) {
    CAPTURE(v.what);
    const flat_layout odd(v.odd_units, v.odd_shards);
    std::vector<std::string> outcome(4);
    fedshard::test::spawn_ranks(4, [&](fedshard::inproc::communicator& world) {
      const int me = world.rank();
      const bool is_odd =
          std::find(v.odd_ranks.begin(), v.odd_ranks.end(), me) != v.odd_ranks.end();
      outcome[static_cast<std::size_t>(me)] = invalid_argument_of(
          [&] { fedshard::verify_same_layout(world, is_odd ? odd : reference); });
    });
    for (int r = 0; r < 4; ++r) {
      CAPTURE(r);
      const std::string& msg = outcome[static_cast<std::size_t>(r)];
      CAPTURE(msg);
      CHECK(contains(msg, v.names));
      CHECK(contains(msg, "rank 0 has " + digest_text(reference) + ";"));
      const bool is_odd = std::find(v.odd_ranks.begin(), v.odd_ranks.end(), r) != v.odd_ranks.end();
      CHECK(contains(msg, "this rank (" + std::to_string(r) + ") has " +
                              digest_text(is_odd ? odd : reference)));
    }
  }
}
