#pragma once
/// The compute model of the simulator: decoder-only transformer dimensions (with cited
/// presets), their parameter count, training FLOPs per token, and the compute time of a step.
///
/// FLOPs per token of training (forward + backward), PaLM's count (Chowdhery et al. 2022,
/// "PaLM: Scaling Language Modeling with Pathways", Appendix B):
///     6 N + 12 L H Q T
/// N = parameters that enter a matrix multiply (all of them but the input embedding table
/// and learned positions; a tied embedding counts once, as the output projection), L layers,
/// H Q = heads x head dimension, T the sequence length. The attention term counts QK^T and
/// AV over the whole T x T matrix (no causal discount), as the MFU convention does. With
/// activation recomputation the forward runs twice: 8 N + 16 L H Q T.

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fedshard/error.hpp"

namespace fedshard::sim {

/// The dimensions of a decoder-only transformer.
struct transformer_dims {
  std::string name;
  int layers = 1;
  int d_model = 1;
  int heads = 1;
  int kv_heads = 1;  ///< grouped-query attention: K and V have kv_heads x head_dim rows
  int ffn = 1;       ///< hidden width of the MLP
  int vocab = 1;
  bool gated_mlp = true;         ///< SwiGLU (3 matrices) rather than 2
  bool tied_embeddings = false;  ///< output projection shares the embedding table
  bool biases = false;           ///< linear layers have biases, norms are LayerNorm (w and b)
  int positions = 0;             ///< rows of a learned position table (0: rotary, none)

  /// d_model / heads.
  int head_dim() const noexcept { return d_model / heads; }
  /// Throws invalid_argument for non-positive dimensions or heads not dividing d_model.
  void check() const {
    FEDSHARD_EXPECTS(layers >= 1 && d_model >= 1 && heads >= 1 && kv_heads >= 1 && ffn >= 1 &&
                         vocab >= 1 && positions >= 0,
                     "sim::transformer_dims '", name,
                     "': every dimension must be >= 1 (positions >= 0), found layers ", layers,
                     ", d_model ", d_model, ", heads ", heads, ", kv_heads ", kv_heads, ", ffn ",
                     ffn, ", vocab ", vocab, ", positions ", positions);
    FEDSHARD_EXPECTS(d_model % heads == 0 && heads % kv_heads == 0, "sim::transformer_dims '", name,
                     "': heads must divide d_model and kv_heads must divide heads, found ",
                     "d_model ", d_model, ", heads ", heads, ", kv_heads ", kv_heads);
  }
};

/// Llama 3.1 8B. Meta, "The Llama 3 Herd of Models" (2024), Table 3, and the model's
/// config.json: 32 layers, d 4096, 32 heads, 8 KV heads, FFN 14336, vocabulary 128256,
/// untied embeddings, RMSNorm, rotary positions. 8.03 B parameters.
inline transformer_dims llama31_8b() {
  return {"llama3.1-8b", 32, 4096, 32, 8, 14336, 128256, true, false, false, 0};
}

/// Llama 3 70B. Same sources: 80 layers, d 8192, 64 heads, 8 KV heads, FFN 28672,
/// vocabulary 128256. 70.6 B parameters.
inline transformer_dims llama3_70b() {
  return {"llama3-70b", 80, 8192, 64, 8, 28672, 128256, true, false, false, 0};
}

/// GPT-2 small. Radford et al. 2019 and the released checkpoint: 12 layers, d 768, 12 heads,
/// MLP 3072 (GELU, 2 matrices), vocabulary 50257, 1024 learned positions, tied embeddings,
/// biases and LayerNorm. 124.4 M parameters.
inline transformer_dims gpt2_small() {
  return {"gpt2-124m", 12, 768, 12, 12, 3072, 50257, false, true, true, 1024};
}

/// Names of the model presets.
inline std::vector<std::string> model_preset_names() {
  return {"llama3.1-8b", "llama3-70b", "gpt2-124m"};
}

/// The model preset called name; invalid_argument naming the presets otherwise.
inline transformer_dims model_preset(std::string_view name) {
  if (name == "llama3.1-8b") return llama31_8b();
  if (name == "llama3-70b") return llama3_70b();
  if (name == "gpt2-124m" || name == "gpt2") return gpt2_small();
  std::string known;
  for (const auto& n : model_preset_names()) known += (known.empty() ? "" : ", ") + n;
  FEDSHARD_EXPECTS(false, "sim: unknown model preset '", name, "', expected one of ", known);
  return {};
}

/// Parameters of one decoder layer.
inline std::int64_t layer_params(const transformer_dims& m) {
  const std::int64_t d = m.d_model, kv = std::int64_t{m.kv_heads} * m.head_dim(), f = m.ffn;
  const std::int64_t norm = m.biases ? 2 * d : d;
  std::int64_t attn = d * d + 2 * kv * d + d * d;
  std::int64_t mlp = (m.gated_mlp ? 3 : 2) * d * f;
  if (m.biases) {
    attn += d + 2 * kv + d;
    mlp += (m.gated_mlp ? 2 * f : f) + d;
  }
  return attn + mlp + 2 * norm;
}

/// Parameters of the embedding table (and learned positions).
inline std::int64_t embedding_params(const transformer_dims& m) {
  return std::int64_t{m.vocab} * m.d_model + std::int64_t{m.positions} * m.d_model;
}

/// Parameters of the final norm and, when untied, the output projection.
inline std::int64_t head_params(const transformer_dims& m) {
  const std::int64_t norm = m.biases ? 2 * std::int64_t{m.d_model} : m.d_model;
  return norm + (m.tied_embeddings ? 0 : std::int64_t{m.vocab} * m.d_model);
}

/// All parameters.
inline std::int64_t total_params(const transformer_dims& m) {
  return embedding_params(m) + m.layers * layer_params(m) + head_params(m);
}

/// N of the FLOP count: parameters that enter a matrix multiply.
inline std::int64_t matmul_params(const transformer_dims& m) {
  std::int64_t n = m.layers * layer_params(m) + head_params(m);
  if (m.tied_embeddings) n += std::int64_t{m.vocab} * m.d_model;  // used as the output projection
  return n;
}

/// Training FLOPs per token at sequence length seq: 6 N + 12 L H Q T (8 N + 16 L H Q T when
/// activations are recomputed).
inline double train_flops_per_token(const transformer_dims& m, int seq, bool recompute = false) {
  FEDSHARD_EXPECTS(seq >= 1, "sim::train_flops_per_token: seq must be >= 1, found ", seq);
  const double passes = recompute ? 4.0 : 3.0;  // forward = 1, backward = 2
  const double attn = 4.0 * m.layers * double(m.heads) * m.head_dim() * seq;
  return passes * (2.0 * static_cast<double>(matmul_params(m)) + attn);
}

/// What one GPU computes in a step, and how fast.
struct compute_model {
  double peak_flops = 0;  ///< dense bf16 FLOP/s of one GPU
  double mfu = 0.5;       ///< achieved fraction of peak (0, 1]
  bool recompute = false;

  /// Seconds of compute for `tokens` tokens of model m at sequence length seq.
  double seconds(const transformer_dims& m, double tokens, int seq) const {
    FEDSHARD_EXPECTS(peak_flops > 0 && std::isfinite(peak_flops) && mfu > 0 && mfu <= 1,
                     "sim::compute_model: need a finite peak_flops > 0 and 0 < mfu <= 1, found ",
                     peak_flops, " and ", mfu);
    return tokens * train_flops_per_token(m, seq, recompute) / (peak_flops * mfu);
  }
};

}  // namespace fedshard::sim
