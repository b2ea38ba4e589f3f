#pragma once
/// The units a transformer would declare to fedshard (one FSDP unit per decoder layer, plus
/// the embedding and the head), so that the simulator lays it out and plans it exactly as the
/// trainer would.

#include <cstdint>
#include <string>
#include <vector>

#include "fedshard/core/dtype.hpp"
#include "fedshard/shard/flat_layout.hpp"
#include "fedshard/sim/compute.hpp"

namespace fedshard::sim {

/// Units of model m: "embed" {tok [vocab, d] (, pos [positions, d])}, "layer<i>" for each
/// decoder layer {attn_norm, wq, wk, wv, wo, mlp_norm, w1, (w3,) w2 (and biases)}, "head"
/// {norm (, out [vocab, d] when untied)}; every tensor of dtype t.
inline std::vector<unit_spec> transformer_units(const transformer_dims& m, dtype t = dtype::bf16) {
  m.check();
  const std::int64_t d = m.d_model, kv = std::int64_t{m.kv_heads} * m.head_dim(), f = m.ffn;
  auto tensor = [t](std::string name, std::vector<std::int64_t> shape) {
    return tensor_spec{std::move(name), std::move(shape), t};
  };
  auto norm = [&](std::vector<tensor_spec>& ts, const std::string& name) {
    ts.push_back(tensor(name + "_w", {d}));
    if (m.biases) ts.push_back(tensor(name + "_b", {d}));
  };
  auto linear = [&](std::vector<tensor_spec>& ts, const std::string& name, std::int64_t out,
                    std::int64_t in) {
    ts.push_back(tensor(name, {out, in}));
    if (m.biases) ts.push_back(tensor(name + "_b", {out}));
  };

  std::vector<unit_spec> units;
  unit_spec embed{"embed", {tensor("tok", {m.vocab, d})}};
  if (m.positions > 0) embed.tensors.push_back(tensor("pos", {m.positions, d}));
  units.push_back(std::move(embed));
  for (int l = 0; l < m.layers; ++l) {
    unit_spec u{"layer" + std::to_string(l), {}};
    norm(u.tensors, "attn_norm");
    linear(u.tensors, "wq", d, d);
    linear(u.tensors, "wk", kv, d);
    linear(u.tensors, "wv", kv, d);
    linear(u.tensors, "wo", d, d);
    norm(u.tensors, "mlp_norm");
    linear(u.tensors, "w1", f, d);
    if (m.gated_mlp) linear(u.tensors, "w3", f, d);
    linear(u.tensors, "w2", d, f);
    units.push_back(std::move(u));
  }
  unit_spec head{"head", {}};
  norm(head.tensors, "norm");
  if (!m.tied_embeddings) head.tensors.push_back(tensor("out", {m.vocab, d}));
  units.push_back(std::move(head));
  return units;
}

/// The flat layout of model m over `shards` shards (dtype t).
inline flat_layout transformer_layout(const transformer_dims& m, int shards,
                                      dtype t = dtype::bf16) {
  return flat_layout(transformer_units(m, t), shards);
}

}  // namespace fedshard::sim
