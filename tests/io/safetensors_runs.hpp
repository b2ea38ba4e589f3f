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
#include "support/files.hpp"
#include "support/tiny_mlp.hpp"

namespace fedshard::test {

namespace fs = std::filesystem;

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
