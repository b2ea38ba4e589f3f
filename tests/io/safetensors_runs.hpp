#pragma once
/// Test support of the safetensors tests: a temporary directory, the tiny MLP's trainers on
/// thread ranks, and the values a file must hold (the model's tensors rounded to a dtype).

#include <doctest/doctest.h>

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/error.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/trainer/algorithm.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/tiny_mlp.hpp"

namespace fedshard::test {

namespace fs = std::filesystem;

/// A fresh, empty directory under the system temp directory, removed at scope exit.
struct temp_dir {
  fs::path path;
  temp_dir() {
    static std::atomic<int> counter{0};
    path = fs::temp_directory_path() /
           fedshard::detail::concat("fedshard-st-", ::getpid(), "-", counter++);
    fs::remove_all(path);
    fs::create_directories(path);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

inline std::string read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

inline void write_all(const fs::path& p, std::string_view data) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(data.data(), static_cast<std::streamsize>(data.size()));
  REQUIRE(f.good());
}

inline bool contains(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

inline bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

/// The trainer of the tests: the tiny MLP with AdamW on inproc thread ranks.
template <class Alg>
using mlp_trainer = trainer<mlp_model, Alg, optim::adamw, inproc::communicator>;

/// Tensor name ("unit.tensor") -> its full values.
using model_values = std::map<std::string, std::vector<float>>;

/// Collective over the shard axis: every tensor of the trainer by qualified name.
template <class T>
model_values tensors_of(T& t) {
  model_values out;
  for (const auto& u : t.layout().units())
    for (const auto& s : u.tensors) {
      const std::string name = u.name + "." + s.name;
      out[name] = t.tensor(name);
    }
  return out;
}

/// The values rounded to dtype d (to nearest even, by core/dtype.hpp's conversions) and
/// widened back to f32, exactly: what a file of dtype d holds.
inline std::vector<float> rounded(std::vector<float> v, dtype d) {
  for (float& x : v) {
    if (d == dtype::bf16) x = static_cast<float>(bf16(x));
    if (d == dtype::f16) x = static_cast<float>(f16(x));
  }
  return v;
}

inline model_values rounded(model_values m, dtype d) {
  for (auto& [name, v] : m) v = rounded(std::move(v), d);
  return m;
}

/// Rank `local` of its group's batch at step `step` (groups read disjoint samples).
template <class T>
std::vector<sample> batch_at(T& t, int step) {
  auto& m = t.topology();
  const auto& s = m.shape();
  const int local = m.coords().replica * s.shards + m.coords().shard;
  return t.model().batch(11, step, m.coords().group, s.groups, local, s.replicas * s.shards, 2);
}

}  // namespace fedshard::test
