// Safetensors files: the format as written and read, refusal of malformed files naming the
// file and the tensor, export from a trained model and import into another mesh bit for bit,
// and errors raised on every rank with the trainer unchanged and still training.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/error.hpp"
#include "fedshard/io/safetensors.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/traffic.hpp"
#include "io/safetensors_runs.hpp"
#include "support/spawn_ranks.hpp"

using namespace fedshard;
using namespace fedshard::test;
namespace st = fedshard::safetensors;

namespace {

template <class T>
std::vector<std::byte> bytes_of(const std::vector<T>& v) {
  std::vector<std::byte> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

/// A small valid file: a.w [2, 3] F32, a.b [3] F16, c [] F64, ids [4] I64, metadata.
std::vector<st::tensor_data> sample_tensors() {
  std::vector<st::tensor_data> t;
  t.push_back({"a.w", "F32", {2, 3}, bytes_of(std::vector<float>{1, -2, 3.5f, 0, -0.0f, 1e-3f})});
  std::vector<f16> h;
  for (float x : {0.5f, -1.25f, 65504.0f}) h.push_back(f16(x));
  t.push_back({"a.b", "F16", {3}, bytes_of(h)});
  t.push_back({"c", "F64", {}, bytes_of(std::vector<double>{0.1})});
  t.push_back({"ids", "I64", {4}, bytes_of(std::vector<std::int64_t>{1, 2, 3, 4})});
  return t;
}

/// The file's header as JSON and its data bytes.
struct split_file {
  nlohmann::ordered_json header;
  std::string data;
};

split_file split(const std::string& file) {
  std::uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  return {nlohmann::ordered_json::parse(file.substr(8, n)), file.substr(8 + n)};
}

/// A file of the given header text and data.
std::string join(std::string_view header, std::string_view data) {
  std::string out(8, '\0');
  const std::uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + std::string(header) + std::string(data);
}

std::string join(const nlohmann::ordered_json& header, std::string_view data) {
  const std::string text = header.dump();
  return join(std::string_view(text), data);
}

}  // namespace

// ---- the format ---------------------------------------------------------------------------

TEST_CASE(
    "write_file lays out the header and the data as the format says; read_info reads "
    "them back") {
  temp_dir dir;
  const auto path = dir.path / "m.safetensors";
  const auto tensors = sample_tensors();
  st::write_file(path, tensors, {{"format", "pt"}, {"note", "x"}});
  CHECK_FALSE(fs::exists(path.string() + ".tmp"));

  const std::string file = read_all(path);
  std::uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  CHECK(n % 8 == 0);
  CHECK(n + 8 + 24 + 6 + 8 + 32 == file.size());  // header, then the data back to back
  const auto [header, data] = split(file);
  CHECK(header["__metadata__"] == nlohmann::ordered_json{{"format", "pt"}, {"note", "x"}});
  CHECK(header["a.w"]["dtype"] == "F32");
  CHECK(header["a.w"]["shape"] == nlohmann::json{2, 3});
  CHECK(header["a.w"]["data_offsets"] == nlohmann::json{0, 24});
  CHECK(header["a.b"]["data_offsets"] == nlohmann::json{24, 30});
  CHECK(header["c"]["shape"] == nlohmann::json::array());
  CHECK(header["ids"]["data_offsets"] == nlohmann::json{38, 70});
  CHECK(data.substr(0, 24) == std::string(reinterpret_cast<const char*>(tensors[0].bytes.data()),
                                          24));  // f32 little-endian, as the host holds them
  const std::string text = file.substr(8, n);
  CHECK(text.find_first_not_of(' ', text.find_last_of('}') + 1) == std::string::npos);

  const st::file_info info = st::read_info(path);
  CHECK(info.header_size == n);
  CHECK(info.data_start() == 8 + n);
  CHECK(info.file_size == file.size());
  REQUIRE(info.tensors.size() == 4);
  CHECK(info.metadata.at("note") == "x");
  const st::tensor_info* w = info.find("a.w");
  REQUIRE(w != nullptr);
  CHECK(w->shape == std::vector<std::int64_t>{2, 3});
  CHECK(w->type == dtype::f32);
  CHECK(info.find("ids")->type == std::nullopt);
  CHECK(info.find("ids")->element_size == 8);
  CHECK(bit_equal(st::read_f32(info, "a.w"), {1, -2, 3.5f, 0, -0.0f, 1e-3f}));
  CHECK(st::read_f32(info, "a.b") == std::vector<float>{0.5f, -1.25f, 65504.0f});
  CHECK(st::read_f32(info, "c") == std::vector<float>{0.1f});  // f64 rounded to nearest f32
  CHECK_THROWS_WITH_AS(st::read_f32(info, "ids"), doctest::Contains("dtype I64"), invalid_argument);
}

namespace {

/// The bytes of sample_tensors() as write_file writes them (to dir/good.safetensors).
std::string sample_file_bytes(const temp_dir& dir) {
  const auto path = dir.path / "good.safetensors";
  st::write_file(path, sample_tensors());
  return read_all(path);
}

}  // namespace

TEST_CASE(
    "read_info refuses a malformed file with an error naming the file, the tensor, what "
    "it expected and what it found") {
  temp_dir dir;
  const auto [header, data] = split(sample_file_bytes(dir));
  const auto bad = dir.path / "bad.safetensors";

  struct refusal {
    const char* what;
    std::function<std::string()> file;
    std::vector<std::string> says;
  };
  auto edited = [&](std::function<void(nlohmann::ordered_json&)> edit) {
    return [=, h = header, d = data]() mutable {
      edit(h);
      return join(h, d);
    };
  };
  const std::vector<refusal> cases = {
      {"unknown dtype",
       edited([](auto& h) { h["a.w"]["dtype"] = "F33"; }),
       {"tensor 'a.w'", "unknown dtype 'F33'", "expected one of F64, F32"}},
      {"shape and byte size differ",
       edited([](auto& h) {
         h["a.w"]["shape"] = {2, 4};
       }),
       {"tensor 'a.w'", "shape [2, 4] of F32 needs 32 bytes", "hold 24"}},
      {"overlapping data",
       edited([](auto& h) {
         h["a.b"]["data_offsets"] = {20, 26};
       }),
       {"tensor 'a.b'", "overlap those of tensor 'a.w' [0, 24]"}},
      {"offsets past the data",
       edited([](auto& h) {
         h["ids"]["data_offsets"] = {64, 96};
       }),
       {"tensor 'ids'", "run past the end of the data", "70 data bytes"}},
      {"truncated data",
       [&] { return join(header, data.substr(0, 50)); },
       {"tensor 'ids'", "data_offsets [38, 70] run past the end", "50 data bytes", "truncated"}},
      {"negative dimension",
       edited([](auto& h) { h["c"]["shape"] = {-1}; }),
       {"tensor 'c'", "integer >= 0, found the number -1"}},
      {"offsets not two integers",
       edited([](auto& h) { h["c"]["data_offsets"] = {30}; }),
       {"tensor 'c'", "data_offsets must be [begin, end]", "found [30]"}},
      {"a key other than dtype, shape, data_offsets",
       edited([](auto& h) { h["c"]["strides"] = {1}; }),
       {"tensor 'c'", "unexpected key 'strides'"}},
      {"no dtype", edited([](auto& h) { h["c"].erase("dtype"); }), {"tensor 'c'", "no 'dtype'"}},
      {"metadata not strings",
       edited([](auto& h) {
         h["__metadata__"] = {{"step", 3}};
       }),
       {"'__metadata__' entry 'step' must be a string, found the number 3"}},
      {"header not an object",
       [&] { return join(std::string_view("[1, 2]  "), data); },
       {"must be a JSON object", "found a JSON array"}},
      {"corrupt header (bad JSON)",
       [&] {
         std::string text = header.dump();
         text[text.size() / 2] = '{';
         return join(std::string_view(text), data);
       },
       {"is not valid JSON", "parse error"}},
      {"a tensor named twice",
       [&] {
         std::string text = header.dump();
         text.insert(1, R"("c": {"dtype": "F64", "shape": [], "data_offsets": [30, 38]}, )");
         return join(std::string_view(text), data);
       },
       {"names 'c' twice"}},
      {"header length larger than the file",
       [&] {
         std::string f = join(header, data);
         const std::uint64_t n = f.size();
         std::memcpy(f.data(), &n, 8);
         return f;
       },
       {"header length", "is larger than the file: expected at most"}},
      {"a hole in the data",
       [&] {
         auto h = header;
         h["ids"]["data_offsets"] = {40, 72};
         return join(h, data.substr(0, 38) + std::string(2, '\0') + data.substr(38));
       },
       {"tensor 'ids': data_offsets [40, 72] leave bytes [38, 40) of the data unused", "no holes"}},
      {"trailing bytes after the last tensor",
       [&] { return join(header, data + "xyz"); },
       {"the tensors cover 70 bytes of data but the file holds 73",
        "3 trailing byte(s) belong to no tensor"}},
      {"nesting deeper than a header has",
       edited([](auto& h) { h["c"]["shape"] = {nlohmann::ordered_json::array({1})}; }),
       {"the header nests deeper than 3 levels"}},
      {"shorter than the header length",
       [] { return std::string("\x10\0\0", 3); },
       {"is truncated: 3 bytes"}},
  };
  for (const refusal& c : cases) {
    CAPTURE(c.what);
    write_all(bad, c.file());
    std::string message;
    CHECK_THROWS_AS(
        [&] {
          try {
            st::read_info(bad);
          } catch (const std::exception& e) {
            message = e.what();
            throw;
          }
        }(),
        invalid_argument);
    CAPTURE(message);
    CHECK(contains(message, bad.string()));
    for (const std::string& s : c.says) CHECK(contains(message, s));
  }
  CHECK_THROWS_WITH_AS(st::read_info(dir.path / "missing.safetensors"),
                       doctest::Contains("missing.safetensors': cannot be read"), invalid_argument);
}

TEST_CASE("read_info reads a header of 80,000 tensors (parsing is not quadratic in them)") {
  // Tensor "t<i>" is one F32 at data bytes [4 (n - 1 - i), 4 (n - i)): the header lists them
  // in the reverse order of their data, with the metadata among them.
  constexpr int n = 80'000;
  std::string text = "{";
  for (int i = 0; i < n; ++i) {
    const int at = 4 * (n - 1 - i);
    text += "\"t" + std::to_string(i) + "\": {\"dtype\": \"F32\", \"shape\": [1], " +
            "\"data_offsets\": [" + std::to_string(at) + ", " + std::to_string(at + 4) + "]}, ";
    if (i == n / 2) text += "\"__metadata__\": {\"format\": \"pt\"}, ";
  }
  text.resize(text.size() - 2);
  text += "}";
  temp_dir dir;
  const auto path = dir.path / "many.safetensors";
  write_all(path, join(std::string_view(text), std::string(4 * n, '\0')));
  const st::file_info info = st::read_info(path);
  REQUIRE(info.tensors.size() == 80'000);
  CHECK(info.metadata.at("format") == "pt");
  CHECK(info.tensors.front().name == "t79999");  // by data offset: the last one listed first
  CHECK(info.tensors.front().begin == 0);
  CHECK(info.tensors.back().name == "t0");
  CHECK(info.tensors.back().end == 320'000);
  CHECK(info.tensors[40'000].name == "t39999");
  CHECK(info.tensors[40'000].begin == 160'000);
}

TEST_CASE(
    "read_info refuses a header nested 200,000 deep, of 1,000,001 entries, or of 300,000 "
    "numbers, at once") {
  temp_dir dir;
  const auto path = dir.path / "hostile.safetensors";
  const std::string deep =
      "{\"a\": {\"shape\": " + std::string(200'000, '[') + std::string(200'000, ']') + "}}";
  write_all(path, join(std::string_view(deep), ""));
  CHECK_THROWS_WITH_AS(st::read_info(path), doctest::Contains("nests deeper than 3 levels"),
                       invalid_argument);
  std::string many = "{";
  for (std::size_t i = 0; i <= st::max_tensors; ++i) many += "\"" + std::to_string(i) + "\":{},";
  many.back() = '}';
  write_all(path, join(std::string_view(many), ""));
  CHECK_THROWS_WITH_AS(st::read_info(path),
                       doctest::Contains("more than 1000000 entries, the limit"), invalid_argument);
  // Entries that are not objects are refused at the first: kept, they would make every later
  // key a scan over all of them (300,000 numbers took minutes before).
  std::string numbers = "{";
  for (int i = 0; i < 300'000; ++i) numbers += "\"" + std::to_string(i) + "\":0,";
  numbers.back() = '}';
  write_all(path, join(std::string_view(numbers), ""));
  CHECK_THROWS_WITH_AS(
      st::read_info(path),
      doctest::Contains("tensor '0': expected an object {\"dtype\", \"shape\", \"data_offsets\"}, "
                        "found the number 0"),
      invalid_argument);
}

TEST_CASE(
    "read_info and read_f32 on 3000 seeded random corruptions: refused with "
    "invalid_argument, or every tensor read at its size") {
  // A good file damaged one way per case (bits flipped in the length, the header or the
  // data, the header's text edited, the file cut or grown), from a fixed seed. Never a crash,
  // an exception other than invalid_argument, or a tensor read at another size.
  temp_dir dir;
  const std::string good = sample_file_bytes(dir);
  std::uint64_t n = 0;
  std::memcpy(&n, good.data(), 8);
  const auto path = dir.path / "fuzz.safetensors";
  std::mt19937_64 rng(20261205);
  auto pick = [&](std::size_t m) {
    return static_cast<std::size_t>(rng() % std::max<std::size_t>(m, 1));
  };
  const std::string json_bytes = "{}[]\",:0123456789-eE.tfnul ";
  int refused = 0, read = 0;
  for (int c = 0; c < 3000; ++c) {
    CAPTURE(c);
    std::string bad = good;
    switch (c % 5) {
      case 0:  // a bit of the header length
        bad[pick(8)] ^= static_cast<char>(1u << pick(8));
        break;
      case 1:  // 1 to 3 header characters replaced by characters JSON gives meaning to
        for (std::size_t k = 0, m = 1 + pick(3); k < m; ++k)
          bad[8 + pick(n)] = json_bytes[pick(json_bytes.size())];
        break;
      case 2:  // a run of the header deleted (the length fixed up to match)
      {
        const std::size_t at = 8 + pick(n), len = 1 + pick(12);
        bad.erase(at, std::min(len, 8 + n - at));
        const std::uint64_t m = n - std::min<std::uint64_t>(len, 8 + n - at);
        std::memcpy(bad.data(), &m, 8);
        break;
      }
      case 3:  // the file cut short or grown
        if (rng() % 2)
          bad.resize(pick(bad.size()));
        else
          bad += std::string(1 + pick(16), static_cast<char>(rng()));
        break;
      default:  // data bytes flipped: the file stays valid, values change
        bad[8 + n + pick(bad.size() - 8 - n)] ^= static_cast<char>(1u << pick(8));
        break;
    }
    write_all(path, bad);
    try {
      const st::file_info info = st::read_info(path);
      for (const st::tensor_info& t : info.tensors) {
        CHECK(t.end - t.begin == t.numel() * t.element_size);
        if (t.type) CHECK(st::read_f32(info, t.name).size() == t.numel());
      }
      ++read;
    } catch (const invalid_argument&) {
      ++refused;
    } catch (const std::exception& e) {
      FAIL_CHECK("not an invalid_argument: ", e.what());
    }
  }
  CHECK(refused > 1000);
  CHECK(read > 600);  // at least the data flips read back
  MESSAGE(refused, " refused, ", read, " read");
}

// ---- export and import --------------------------------------------------------------------

namespace {

/// What the exporting run ended with, seen from world rank 0 (group 0).
struct exported {
  model_values group0;            // every tensor of group 0's model at the export
  model_values group1;            // group 1's, when there is one (fl_hsdp: differs from group 0's)
  std::int64_t shard_calls = -1;  // rank 0's shard-axis collectives during the exports
  std::int64_t world_calls = -1;  // rank 0's world-axis collectives during the exports
};

/// Trains Alg on `shape` for `steps` steps, then exports to each (path, dtype).
template <class Alg>
exported train_and_export(mesh_shape shape, int steps,
                          const std::vector<std::pair<fs::path, dtype>>& files) {
  exported out;
  spawn_ranks(shape.size(), [&](inproc::communicator& world) {
    mesh m(world, shape);
    mlp_trainer<Alg> t(m, mlp_model{});
    for (int s = 0; s < steps; ++s) t.step(batch_at(t, s));
    const auto before = t.traffic();
    for (const auto& [path, type] : files) st::export_safetensors(t, path, type);
    const auto after = t.traffic();
    auto values = tensors_of(t);
    if (world.rank() == 0) {
      out.group0 = std::move(values);
      out.shard_calls = after[axis::shard].calls - before[axis::shard].calls;
      out.world_calls = after[axis::world].calls - before[axis::world].calls;
    } else if (m.coords().group == 1 && m.coords().replica == 0 && m.coords().shard == 0) {
      out.group1 = std::move(values);
    }
  });
  return out;
}

/// What every rank of an importing run saw.
struct imported {
  std::vector<model_values> tensors;        // per world rank, right after the import
  std::vector<std::vector<float>> padding;  // per rank, its master's padding after the import
  std::vector<float> losses;                // rank 0's losses of two steps after the import
};

/// Fresh trainers of Alg on `shape` import `path` and train two steps.
template <class Alg>
imported import_into(mesh_shape shape, const fs::path& path, st::import_options o = {}) {
  imported out;
  out.tensors.resize(static_cast<std::size_t>(shape.size()));
  out.padding.resize(static_cast<std::size_t>(shape.size()));
  spawn_ranks(shape.size(), [&](inproc::communicator& world) {
    mesh m(world, shape);
    mlp_trainer<Alg> t(m, mlp_model{});
    st::import_safetensors(t, path, o);
    const auto r = static_cast<std::size_t>(world.rank());
    out.tensors[r] = tensors_of(t);
    auto& e = t.engine();
    for (std::size_t u = 0; u < e.layout().num_units(); ++u) {
      const auto master = e.download(e.master_of(u));
      const std::size_t first =
          e.layout().shards() > 1 ? e.layout().shard_of(u, m.coords().shard).begin : 0;
      for (std::size_t i = 0; i < master.size(); ++i)
        if (first + i >= e.layout().unit(u).numel) out.padding[r].push_back(master[i]);
    }
    for (int s = 0; s < 2; ++s) {
      const float loss = t.step(batch_at(t, s));
      if (r == 0) out.losses.push_back(loss);
    }
  });
  return out;
}

void check_all_ranks_hold(const imported& got, const model_values& want) {
  for (std::size_t r = 0; r < got.tensors.size(); ++r) {
    CAPTURE(r);
    REQUIRE(got.tensors[r].size() == want.size());
    for (const auto& [name, values] : want) {
      CAPTURE(name);
      CHECK(bit_equal(got.tensors[r].at(name), values));
    }
    for (float p : got.padding[r]) CHECK(p == 0.0f);  // padding stays zero
  }
  for (float l : got.losses) CHECK(std::isfinite(l));
}

}  // namespace

TEST_CASE(
    "a model exported from fsdp 1x1x4 imports into 1x1x3, ddp 1x2x1 and fl_hsdp 2x1x2 "
    "bit for bit (f32), and a bf16 export equals the bf16-rounded model") {
  temp_dir dir;
  const auto f32_file = dir.path / "model.safetensors";
  const auto bf16_file = dir.path / "model-bf16.safetensors";
  const auto f16_file = dir.path / "model-f16.safetensors";
  const exported ex = train_and_export<fsdp>(
      {1, 1, 4}, 3, {{f32_file, dtype::f32}, {bf16_file, dtype::bf16}, {f16_file, dtype::f16}});
  REQUIRE(ex.group0.size() == 6);
  // No rank gathered anything: each wrote its own shard; 3 agreements per export.
  CHECK(ex.shard_calls == 0);
  CHECK(ex.world_calls == 9);
  for (const auto& f : {f32_file, bf16_file, f16_file})
    CHECK_FALSE(fs::exists(f.string() + ".tmp"));

  // The files, read back in this process.
  const st::file_info info = st::read_info(f32_file);
  CHECK(info.metadata.at("format") == "pt");
  CHECK(info.metadata.at("fedshard_step") == "3");
  CHECK(info.file_size == info.data_start() + 4 * (16 * 8 + 16 + 16 * 16 + 16 + 4 * 16 + 4));
  for (const auto& [name, values] : ex.group0) {
    CAPTURE(name);
    CHECK(bit_equal(st::read_f32(info, name), values));
    CHECK(bit_equal(st::read_f32(st::read_info(bf16_file), name), rounded(values, dtype::bf16)));
    CHECK(bit_equal(st::read_f32(st::read_info(f16_file), name), rounded(values, dtype::f16)));
  }
  CHECK(st::read_info(f32_file).find("layer0.w0")->shape == std::vector<std::int64_t>{16, 8});
  CHECK(st::read_info(bf16_file).find("head.b2")->dtype == "BF16");
  // Not a file of the initial parameters: training changed them.
  auto initial = mlp_model{}.initial_values(flat_layout(mlp_model{}.units(), 1), 0);
  initial.resize(16 * 8);  // layer0.w0
  CHECK_FALSE(bit_equal(ex.group0.at("layer0.w0"), initial));

  SUBCASE("f32 into fsdp 1x1x3 (other shard boundaries)") {
    check_all_ranks_hold(import_into<fsdp>({1, 1, 3}, f32_file), ex.group0);
  }
  SUBCASE("f32 into ddp 1x2x1 (an unsharded layout)") {
    check_all_ranks_hold(import_into<ddp>({1, 2, 1}, f32_file), ex.group0);
  }
  SUBCASE("bf16 into fl_hsdp 2x1x2: every group starts from the bf16-rounded model") {
    check_all_ranks_hold(import_into<fl_hsdp>({2, 1, 2}, bf16_file),
                         rounded(ex.group0, dtype::bf16));
  }
  SUBCASE("f16 into hsdp 1x2x2") {
    check_all_ranks_hold(import_into<hsdp>({1, 2, 2}, f16_file), rounded(ex.group0, dtype::f16));
  }
}

TEST_CASE(
    "fl_hsdp 2x1x2 exports group 0's model, written by group 0's shards; ddp exports "
    "from one rank") {
  temp_dir dir;
  const auto path = dir.path / "fl.safetensors";
  const exported ex = train_and_export<fl_hsdp>({2, 1, 2}, 3, {{path, dtype::f32}});
  REQUIRE(ex.group1.size() == 6);
  CHECK(ex.group0 != ex.group1);  // the groups diverged since their last sync (K = 8)
  const st::file_info info = st::read_info(path);
  for (const auto& [name, values] : ex.group0) CHECK(bit_equal(st::read_f32(info, name), values));

  const auto ddp_path = dir.path / "ddp.safetensors";
  const exported d = train_and_export<ddp>({1, 2, 1}, 2, {{ddp_path, dtype::f32}});
  check_all_ranks_hold(import_into<fsdp>({1, 1, 2}, ddp_path), d.group0);
}

TEST_CASE(
    "import converts F64, F16 and BF16 tensors of a pretrained file to f32, and "
    "ignores extra tensors when asked") {
  temp_dir dir;
  const auto path = dir.path / "pretrained.safetensors";
  const flat_layout l(mlp_model{}.units(), 1);
  model_values want;
  std::vector<st::tensor_data> tensors;
  const char* types[] = {"F64", "F32", "BF16", "F16", "F32", "F64"};
  int k = 0;
  for (const auto& u : l.units())
    for (const auto& s : u.tensors) {
      const std::string name = u.name + "." + s.name;
      std::vector<double> v(s.numel);
      for (std::size_t i = 0; i < v.size(); ++i)
        v[i] = 0.3 * hash_uniform(99 + static_cast<std::uint64_t>(k), i);
      const std::string type = types[k++];
      std::vector<float> f(v.begin(), v.end());  // f64 -> f32 to nearest
      if (type == "F64") {
        tensors.push_back({name, type, s.shape, bytes_of(v)});
      } else if (type == "F32") {
        tensors.push_back({name, type, s.shape, bytes_of(f)});
      } else if (type == "BF16") {
        std::vector<bf16> b(f.begin(), f.end());
        tensors.push_back({name, type, s.shape, bytes_of(b)});
        f = rounded(f, dtype::bf16);
      } else {
        std::vector<f16> h(f.begin(), f.end());
        tensors.push_back({name, type, s.shape, bytes_of(h)});
        f = rounded(f, dtype::f16);
      }
      want[name] = f;
    }
  tensors.push_back({"head.extra", "I64", {2}, bytes_of(std::vector<std::int64_t>{1, 2})});
  st::write_file(path, tensors);
  check_all_ranks_hold(import_into<fsdp>({1, 1, 3}, path, {.ignore_extra_tensors = true}), want);
}

// ---- errors -------------------------------------------------------------------------------

namespace {

/// One rank's view of a failed import.
struct failure {
  std::string message;
  bool invalid = false;  // an invalid_argument
  bool unchanged = false;
  bool trains = false;  // a step after the error changed the parameters, loss finite
};

/// Fresh fsdp 1x1x3 trainers try import_safetensors(path_of(rank)) after `pre` steps.
std::vector<failure> failed_import(const std::function<fs::path(int)>& path_of, int pre = 0,
                                   st::import_options o = {}) {
  std::vector<failure> out(3);
  spawn_ranks(3, [&](inproc::communicator& world) {
    mesh m(world, {1, 1, 3});
    mlp_trainer<fsdp> t(m, mlp_model{});
    for (int s = 0; s < pre; ++s) t.step(batch_at(t, s));
    auto& f = out[static_cast<std::size_t>(world.rank())];
    const auto before = t.parameters();
    try {
      st::import_safetensors(t, path_of(world.rank()), o);
    } catch (const invalid_argument& e) {
      f.message = e.what();
      f.invalid = true;
    } catch (const std::exception& e) {
      f.message = e.what();
    }
    f.unchanged = bit_equal(t.parameters(), before);
    const float loss = t.step(batch_at(t, pre));
    f.trains = std::isfinite(loss) && !bit_equal(t.parameters(), before);
  });
  return out;
}

void check_refused_everywhere(const std::vector<failure>& got,
                              const std::vector<std::string>& says) {
  for (std::size_t r = 0; r < got.size(); ++r) {
    CAPTURE(r);
    CAPTURE(got[r].message);
    CHECK(got[r].invalid);
    for (const std::string& s : says) CHECK(contains(got[r].message, s));
    CHECK(got[r].unchanged);
    CHECK(got[r].trains);
  }
}

}  // namespace

TEST_CASE(
    "a bad file is refused on every rank, naming the file and the tensor; the trainer "
    "is unchanged and still trains") {
  temp_dir dir;
  const auto good = dir.path / "good.safetensors";
  train_and_export<fsdp>({1, 1, 2}, 1, {{good, dtype::f32}});
  const auto [header, data] = split(read_all(good));
  const auto bad = dir.path / "bad.safetensors";
  const auto everyone = [&](int) { return bad; };
  auto with_header = [&](std::function<void(nlohmann::ordered_json&)> edit) {
    auto h = header;
    edit(h);
    write_all(bad, join(h, data));
  };

  SUBCASE("a tensor missing") {
    with_header([](auto& h) {  // renamed: its bytes stay covered, so the file has no hole
      h["layer1.bias"] = h["layer1.b1"];
      h.erase("layer1.b1");
    });
    check_refused_everywhere(failed_import(everyone),
                             {bad.string(), "tensor 'layer1.b1' of shape [16] is missing"});
  }
  SUBCASE("a shape that differs") {
    with_header([](auto& h) { h["layer1.w1"]["shape"] = {8, 32}; });
    check_refused_everywhere(
        failed_import(everyone),
        {bad.string(), "tensor 'layer1.w1' has shape [8, 32]", "expected [16, 16]"});
  }
  SUBCASE("an unknown dtype") {
    with_header([](auto& h) { h["head.w2"]["dtype"] = "Q4"; });
    check_refused_everywhere(failed_import(everyone),
                             {bad.string(), "tensor 'head.w2'", "unknown dtype 'Q4'"});
  }
  SUBCASE("a dtype that is not floating point") {
    with_header([](auto& h) { h["head.b2"]["dtype"] = "I32"; });
    check_refused_everywhere(failed_import(everyone),
                             {bad.string(), "tensor 'head.b2': dtype I32 cannot be converted"});
  }
  SUBCASE("a truncated file") {
    write_all(bad, read_all(good).substr(0, read_all(good).size() - 10));
    check_refused_everywhere(failed_import(everyone),
                             {bad.string(), "tensor 'head.b2'", "run past the end", "truncated"});
  }
  SUBCASE("a corrupt header (bad JSON)") {
    std::string f = read_all(good);
    f[8 + 40] = '"';
    write_all(bad, f);
    check_refused_everywhere(failed_import(everyone), {bad.string(), "is not valid JSON"});
  }
  SUBCASE("a header length larger than the file") {
    std::string f = read_all(good);
    const std::uint64_t n = f.size() + 100;
    std::memcpy(f.data(), &n, 8);
    write_all(bad, f);
    check_refused_everywhere(
        failed_import(everyone),
        {bad.string(), fedshard::detail::concat("header length ", n), "larger than the file"});
  }
  SUBCASE("extra tensors, unless ignored") {
    with_header([](auto& h) {
      h["layer2.w"] = {{"dtype", "F32"}, {"shape", {0}}, {"data_offsets", {0, 0}}};
      h["layer3.w"] = {{"dtype", "F32"}, {"shape", {0}}, {"data_offsets", {0, 0}}};
    });
    check_refused_everywhere(failed_import(everyone),
                             {bad.string(),
                              "2 tensor(s) the trainer's layout lacks: 'layer2.w', "
                              "'layer3.w'",
                              "ignore_extra_tensors"});
    const auto ok = failed_import(everyone, 0, {.ignore_extra_tensors = true});
    for (const auto& f : ok) {
      CHECK(f.message.empty());
      CHECK(f.trains);
    }
  }
  SUBCASE("non-finite values, unless allowed (then imported, and said)") {
    // layer1.w1's elements 5 (NaN) and 7 (+inf) are both in rank 0's shard of fsdp 1x1x3.
    std::string d = data;
    const auto at = header["layer1.w1"]["data_offsets"][0].get<std::size_t>();
    const float nan = std::nanf(""), inf = INFINITY;
    std::memcpy(d.data() + at + 5 * 4, &nan, 4);
    std::memcpy(d.data() + at + 7 * 4, &inf, 4);
    write_all(bad, join(header, d));
    const auto got = failed_import(everyone);
    check_refused_everywhere(
        got, {bad.string(), "2 non-finite value(s) (NaN or infinity)",
              "the first in tensor 'layer1.w1' at element 5", "import_options::allow_nonfinite"});
    CHECK(contains(got[1].message, "raised on world rank 0"));
    const auto allowed = failed_import(everyone, 0, {.allow_nonfinite = true});
    for (const auto& f : allowed) {
      CHECK(f.message.empty());
      CHECK_FALSE(f.unchanged);
      CHECK_FALSE(f.trains);  // the NaN reaches the loss: what the refusal protects from
    }
  }
  SUBCASE("after the first step") {
    check_refused_everywhere(failed_import([&](int) { return good; }, 1),
                             {good.string(), "before the first step", "took 1"});
  }
  SUBCASE("a failure on one rank only: every rank raises it, with that rank's message") {
    const auto missing = dir.path / "missing.safetensors";
    const auto got = failed_import([&](int r) { return r == 1 ? missing : good; });
    check_refused_everywhere(got, {missing.string(), "cannot be read"});
    CHECK(contains(got[0].message, "raised on world rank 1"));
    CHECK(contains(got[2].message, "raised on world rank 1"));
    CHECK_FALSE(contains(got[1].message, "raised on world rank"));
  }
}

TEST_CASE("an export that fails on any rank fails on every rank and leaves no file") {
  temp_dir dir;
  SUBCASE("rank 0 cannot create the file") {
    const auto path = dir.path / "no-such-dir" / "m.safetensors";
    std::vector<std::string> messages(4);
    spawn_ranks(4, [&](inproc::communicator& world) {
      mesh m(world, {1, 1, 4});
      mlp_trainer<fsdp> t(m, mlp_model{});
      try {
        st::export_safetensors(t, path);
      } catch (const backend_error& e) {
        messages[static_cast<std::size_t>(world.rank())] = e.what();
      }
      t.step(batch_at(t, 0));  // still trains
    });
    for (const auto& msg : messages) {
      CAPTURE(msg);
      CHECK(contains(msg, (path.string() + ".tmp")));
      CHECK(contains(msg, "cannot be created"));
    }
  }
  SUBCASE("a writer rank fails: rank 0 removes the partial file") {
    const auto path = dir.path / "m.safetensors";
    const auto elsewhere = dir.path / "sub" / "m.safetensors";  // rank 2 names another path
    std::vector<std::string> messages(4);
    spawn_ranks(4, [&](inproc::communicator& world) {
      mesh m(world, {1, 1, 4});
      mlp_trainer<fsdp> t(m, mlp_model{});
      try {
        st::export_safetensors(t, world.rank() == 2 ? elsewhere : path, dtype::bf16);
      } catch (const backend_error& e) {
        messages[static_cast<std::size_t>(world.rank())] = e.what();
      }
    });
    for (std::size_t r = 0; r < messages.size(); ++r) {
      CAPTURE(r);
      CAPTURE(messages[r]);
      CHECK(contains(messages[r], elsewhere.string() + ".tmp"));
      CHECK(contains(messages[r], "cannot be opened for writing tensor 'layer0.w0'"));
      CHECK(contains(messages[r], "raised on world rank") == (r != 2));
    }
    CHECK_FALSE(fs::exists(path));
    CHECK_FALSE(fs::exists(path.string() + ".tmp"));
  }
}
