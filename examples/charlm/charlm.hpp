#pragma once
/// A character-level language model in plain C++, forward and backward written by hand, and
/// its data: fedshard's example of a real model behind the step_context hooks.
///
/// Model: the previous k characters are embedded (a table of V x E), concatenated, passed
/// through two tanh layers of width H and a softmax over the V characters of the corpus.
/// Units (one all-gather each): "embed" {table [V, E]}, "hidden1" {w1 [H, kE], b1 [H]},
/// "hidden2" {w2 [H, H], b2 [H]}, "head" {w3 [V, H], b3 [V]}.
/// Loss: mean cross-entropy of the next character, in nats; perplexity = exp(loss).
///
/// Data: any text; the first 90% (by position) trains, the last 10% evaluates. Rank r's
/// batch at step t is drawn from the training part by a hash of (seed, t, r, i), so every
/// run sees the same data whatever the thread timing.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/shard/flat_layout.hpp"

namespace charlm {

/// A text and its alphabet.
struct corpus {
  std::vector<std::uint8_t> ids;  ///< the text as alphabet indices
  std::vector<char> alphabet;     ///< index -> byte
  std::size_t train_end = 0;      ///< [0, train_end) trains, [train_end, size) evaluates

  int vocab() const { return static_cast<int>(alphabet.size()); }

  /// Builds a corpus from text (at least 1000 bytes).
  static corpus from_text(const std::string& text) {
    FEDSHARD_EXPECTS(text.size() >= 1000, "charlm: the corpus needs at least 1000 bytes, found ",
                     text.size());
    std::array<int, 256> index{};
    index.fill(-1);
    corpus c;
    for (unsigned char ch : text) index[ch] = 0;
    for (int b = 0; b < 256; ++b)
      if (index[static_cast<std::size_t>(b)] == 0) {
        index[static_cast<std::size_t>(b)] = static_cast<int>(c.alphabet.size());
        c.alphabet.push_back(static_cast<char>(b));
      }
    c.ids.reserve(text.size());
    for (unsigned char ch : text) c.ids.push_back(static_cast<std::uint8_t>(index[ch]));
    c.train_end = text.size() * 9 / 10;
    return c;
  }

  /// Reads a file, or every regular file of a directory (sorted by name, concatenated).
  static corpus load(const std::filesystem::path& path) {
    std::vector<std::filesystem::path> files;
    if (std::filesystem::is_directory(path)) {
      for (const auto& e : std::filesystem::directory_iterator(path))
        if (e.is_regular_file()) files.push_back(e.path());
      std::sort(files.begin(), files.end());
    } else {
      files.push_back(path);
    }
    std::string text;
    for (const auto& f : files) {
      std::ifstream in(f, std::ios::binary);
      if (!in)
        throw fedshard::invalid_argument("charlm: cannot read corpus file '" + f.string() + "'");
      std::ostringstream ss;
      ss << in.rdbuf();
      text += ss.str();
    }
    return from_text(text);
  }
};

/// One training example: k context characters and the next one.
struct example {
  std::vector<std::uint8_t> context;
  std::uint8_t next = 0;
};
using batch = std::vector<example>;

inline std::uint64_t mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// The model's sizes.
struct dims {
  int vocab = 0;
  int context = 8;   ///< k
  int embed = 16;    ///< E
  int hidden = 256;  ///< H
};

/// The model: a fedshard::Model over charlm::batch.
class model {
 public:
  model() = default;
  explicit model(dims d, std::uint64_t init_seed = 1) : d_(d), seed_(init_seed) {
    FEDSHARD_EXPECTS(d.vocab >= 2 && d.context >= 1 && d.embed >= 1 && d.hidden >= 1,
                     "charlm: dims must be positive (vocab >= 2), found vocab ", d.vocab,
                     ", context ", d.context, ", embed ", d.embed, ", hidden ", d.hidden);
  }
  const dims& sizes() const { return d_; }

  std::vector<fedshard::unit_spec> units() const {
    const std::int64_t V = d_.vocab, E = d_.embed, H = d_.hidden, KE = d_.context * d_.embed;
    return {{"embed", {{"table", {V, E}}}},
            {"hidden1", {{"w1", {H, KE}}, {"b1", {H}}}},
            {"hidden2", {{"w2", {H, H}}, {"b2", {H}}}},
            {"head", {{"w3", {V, H}}, {"b3", {V}}}}};
  }

  /// Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) weights, zero biases, N(0,1)-ish embeddings.
  std::vector<float> initial_values(const fedshard::flat_layout& l, std::size_t u) const {
    std::vector<float> v(l.unit(u).numel, 0.0f);
    const auto& ul = l.unit(u);
    for (std::size_t t = 0; t < ul.tensors.size(); ++t) {
      const auto& ts = ul.tensors[t];
      if (ts.shape.size() != 2) continue;  // biases stay zero
      const double fan_in = u == 0 ? 1.0 : static_cast<double>(ts.shape[1]);
      const double scale = u == 0 ? 1.0 : 1.0 / std::sqrt(fan_in);
      for (std::size_t i = 0; i < ts.numel; ++i) {
        const std::uint64_t h = mix(seed_ * 0x9e3779b97f4a7c15ull + (u << 40) + i);
        const double unit = static_cast<double>(h >> 11) / 9007199254740992.0 * 2.0 - 1.0;
        v[ts.offset + i] = static_cast<float>(scale * unit);
      }
    }
    return v;
  }

  std::int64_t tokens(const batch& b) const { return static_cast<std::int64_t>(b.size()); }

  /// Mean cross-entropy over the batch; writes the gradients of the batch mean.
  template <class Ctx>
  float forward_backward(Ctx& ctx, const batch& b) {
    return run(ctx, b, true);
  }
  /// Mean cross-entropy over the batch, no gradients.
  template <class Ctx>
  float evaluate(Ctx& ctx, const batch& b) {
    return run(ctx, b, false);
  }

  /// The batch of `n` examples of rank `rank` at step `step` from the training part.
  static batch training_batch(const corpus& c, int context, std::uint64_t seed, std::int64_t step,
                              int rank, int n) {
    batch b;
    const std::size_t span = c.train_end - static_cast<std::size_t>(context) - 1;
    for (int i = 0; i < n; ++i) {
      const std::uint64_t h =
          mix(mix(seed + 0x51ed27u) ^
              mix(static_cast<std::uint64_t>(step) * 131071u +
                  static_cast<std::uint64_t>(rank) * 8191u + static_cast<std::uint64_t>(i)));
      b.push_back(at(c, context, static_cast<std::size_t>(h % span)));
    }
    return b;
  }
  /// n evenly spaced examples from the evaluation part.
  static batch eval_batch(const corpus& c, int context, int n) {
    batch b;
    const std::size_t first = c.train_end;
    const std::size_t span = c.ids.size() - first - static_cast<std::size_t>(context) - 1;
    for (int i = 0; i < n; ++i)
      b.push_back(
          at(c, context, first + span * static_cast<std::size_t>(i) / static_cast<std::size_t>(n)));
    return b;
  }

 private:
  static example at(const corpus& c, int context, std::size_t pos) {
    example e;
    e.context.assign(c.ids.begin() + static_cast<std::ptrdiff_t>(pos),
                     c.ids.begin() + static_cast<std::ptrdiff_t>(pos) + context);
    e.next = c.ids[pos + static_cast<std::size_t>(context)];
    return e;
  }

  /// Dot product with 8 independent partial sums (vectorisable, fixed summation order).
  static float dot(const float* a, const float* b, std::size_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::size_t j = 0;
    for (; j + 8 <= n; j += 8)
      for (std::size_t q = 0; q < 8; ++q) acc[q] += a[j + q] * b[j + q];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; j < n; ++j) s += a[j] * b[j];
    return s;
  }
  static void axpy(float alpha, const float* x, float* y, std::size_t n) {
    for (std::size_t j = 0; j < n; ++j) y[j] += alpha * x[j];
  }

  /// y[n, out] = act(W[out, in] x[n, in] + b)
  static void dense(std::span<const float> w, std::span<const float> bias,
                    const std::vector<float>& x, std::size_t in, std::size_t out, std::size_t n,
                    bool tanh_act, std::vector<float>& y) {
    y.assign(n * out, 0.0f);
    for (std::size_t s = 0; s < n; ++s)
      for (std::size_t i = 0; i < out; ++i) {
        const float z = bias[i] + dot(&w[i * in], &x[s * in], in);
        y[s * out + i] = tanh_act ? std::tanh(z) : z;
      }
  }
  /// Gradients of a dense layer from dz[n, out]; dx[n, in] if wanted.
  static void dense_back(std::span<const float> w, std::span<float> gw, std::span<float> gb,
                         const std::vector<float>& x, const std::vector<float>& dz, std::size_t in,
                         std::size_t out, std::size_t n, std::vector<float>* dx) {
    if (dx) dx->assign(n * in, 0.0f);
    for (std::size_t s = 0; s < n; ++s)
      for (std::size_t i = 0; i < out; ++i) {
        const float g = dz[s * out + i];
        gb[i] += g;
        axpy(g, &x[s * in], &gw[i * in], in);
        if (dx) axpy(g, &w[i * in], &(*dx)[s * in], in);
      }
  }

  template <class Ctx>
  float run(Ctx& ctx, const batch& b, bool train) {
    const fedshard::flat_layout& l = ctx.layout();
    const auto V = static_cast<std::size_t>(d_.vocab), E = static_cast<std::size_t>(d_.embed),
               H = static_cast<std::size_t>(d_.hidden), K = static_cast<std::size_t>(d_.context);
    const std::size_t KE = K * E, n = b.size();
    FEDSHARD_EXPECTS(n > 0, "charlm: empty batch");
    for (const auto& e : b)
      FEDSHARD_EXPECTS(e.context.size() == K, "charlm: an example has ", e.context.size(),
                       " context characters, the model expects ", K);
    // forward
    std::vector<float> x(n * KE), h1, h2, logits;
    {
      auto p = ctx.acquire(0);
      auto table = l.tensor_view(p, 0, 0);
      for (std::size_t s = 0; s < n; ++s)
        for (std::size_t c = 0; c < K; ++c) {
          const std::size_t id = b[s].context[c];
          FEDSHARD_EXPECTS(id < V, "charlm: character id ", id, " outside the vocabulary of ", V);
          std::copy_n(&table[id * E], E, &x[s * KE + c * E]);
        }
      ctx.release(0);
    }
    {
      auto p = ctx.acquire(1);
      dense(l.tensor_view(p, 1, 0), l.tensor_view(p, 1, 1), x, KE, H, n, true, h1);
      ctx.release(1);
    }
    {
      auto p = ctx.acquire(2);
      dense(l.tensor_view(p, 2, 0), l.tensor_view(p, 2, 1), h1, H, H, n, true, h2);
      ctx.release(2);
    }
    double loss = 0;
    std::vector<float> dlogits(n * V);
    {
      auto p = ctx.acquire(3);
      dense(l.tensor_view(p, 3, 0), l.tensor_view(p, 3, 1), h2, H, V, n, false, logits);
      for (std::size_t s = 0; s < n; ++s) {
        const float* z = &logits[s * V];
        const float m = *std::max_element(z, z + V);
        double sum = 0;
        for (std::size_t v = 0; v < V; ++v) sum += std::exp(double(z[v] - m));
        const std::size_t y = b[s].next;
        loss += std::log(sum) - double(z[y] - m);
        for (std::size_t v = 0; v < V; ++v)
          dlogits[s * V + v] = static_cast<float>(std::exp(double(z[v] - m)) / sum / double(n));
        dlogits[s * V + y] -= 1.0f / static_cast<float>(n);
      }
      ctx.release(3);
    }
    if (!train) return static_cast<float>(loss / double(n));
    // backward
    std::vector<float> dh2, dh1, dx;
    {
      auto p = ctx.acquire(3, fedshard::phase::backward);
      auto g = ctx.grad_buffer(3);
      dense_back(l.tensor_view(p, 3, 0), l.tensor_view(g, 3, 0), l.tensor_view(g, 3, 1), h2,
                 dlogits, H, V, n, &dh2);
      ctx.release(3);
      ctx.grads_ready(3);
    }
    for (std::size_t i = 0; i < dh2.size(); ++i) dh2[i] *= 1.0f - h2[i] * h2[i];
    {
      auto p = ctx.acquire(2, fedshard::phase::backward);
      auto g = ctx.grad_buffer(2);
      dense_back(l.tensor_view(p, 2, 0), l.tensor_view(g, 2, 0), l.tensor_view(g, 2, 1), h1, dh2, H,
                 H, n, &dh1);
      ctx.release(2);
      ctx.grads_ready(2);
    }
    for (std::size_t i = 0; i < dh1.size(); ++i) dh1[i] *= 1.0f - h1[i] * h1[i];
    {
      auto p = ctx.acquire(1, fedshard::phase::backward);
      auto g = ctx.grad_buffer(1);
      dense_back(l.tensor_view(p, 1, 0), l.tensor_view(g, 1, 0), l.tensor_view(g, 1, 1), x, dh1, KE,
                 H, n, &dx);
      ctx.release(1);
      ctx.grads_ready(1);
    }
    {
      ctx.acquire(0, fedshard::phase::backward);
      auto g = ctx.grad_buffer(0);
      auto gtable = l.tensor_view(g, 0, 0);
      for (std::size_t s = 0; s < n; ++s)
        for (std::size_t c = 0; c < K; ++c)
          axpy(1.0f, &dx[s * KE + c * E], &gtable[b[s].context[c] * E], E);
      ctx.release(0);
      ctx.grads_ready(0);
    }
    return static_cast<float>(loss / double(n));
  }

  dims d_{};
  std::uint64_t seed_ = 1;
};

}  // namespace charlm
