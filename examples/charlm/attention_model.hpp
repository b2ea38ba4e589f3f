#pragma once
/// A character-level language model with causal self-attention over whole sequences, forward
/// and backward by hand on host memory, that can spread each batch over the ranks of its
/// group by FCP's placement (context parallelism: plan/context_plan.hpp,
/// charlm/context_attention.hpp): fedshard's example of a model using step_context::exchange.
///
/// Model, for the token at position t of a sequence (ids x_0 .. x_{L-1}, predicting x_{t+1}):
///   e = table[x_t] + pos[t]                        ("embed" {table [V, E], pos [T, E]})
///   q, k, v = Wq e, Wk e, Wv e                      ("attention" {wq, wk, wv [D, E],
///   o = causal attention of q over k, v (one head)   wo [E, D]})
///   h = tanh(e + Wo o);  logits = W h + b           ("head" {w [V, E], b [V]})
/// Loss: the mean cross-entropy over the batch's predicted tokens, in nats.
///
/// Batches (sequence_batch): sequences of L + 1 ids (L predictions each). With context
/// parallelism on (ctx.context_axis(): trainer_options::context_axis, the group's under fcp),
/// every rank of that axis is given the same batch; the rank computes the blocks the plan
/// places on it (rank ctx.axis_rank(a) of ctx.axis_size(a)), exchanging key/value blocks and
/// their gradients with the others through ctx.exchange, after checking once per step that
/// every rank was given the same batch (check_same_batch through ctx.agree). Its loss and gradients
/// are P / N x the sum over its tokens (P ranks, N predicted tokens in the batch): the group's
/// average of the ranks' gradients (its shard policy reduces with AVG) and of their losses is
/// then the batch's mean, as one rank computing the whole batch gets it (up to the order of
/// float sums: tests/examples/test_attention_model.cpp). tokens(b) is the rank's own tokens.
/// Without context parallelism every rank computes the whole of its own batch.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "charlm/charlm.hpp"
#include "charlm/context_attention.hpp"
#include "fedshard/core/buffer.hpp"
#include "fedshard/error.hpp"
#include "fedshard/plan/context_plan.hpp"
#include "fedshard/shard/flat_layout.hpp"

namespace charlm {

/// Sequences of ids: each predicts its ids 1.. from the ids before them.
struct sequence_batch {
  std::vector<std::vector<std::uint8_t>> sequences;
};

/// The attention model's sizes.
struct attention_dims {
  int vocab = 0;
  int embed = 32;         ///< E
  int head = 16;          ///< D
  int max_length = 256;   ///< T: longest sequence (predictions), the rows of pos
  int block_tokens = 16;  ///< FCP's block size
};

/// The part of a corpus a batch is drawn from.
enum class part { training, evaluation };

/// Draws `count` sequences from a part of c: lengths skewed as FCP's batches are (one in 8
/// long, in [max/2, max], the others in [8, max/8]), from a hash of (seed, step, stream): a
/// context-parallel group draws one batch per step with its group as the stream.
inline sequence_batch draw_sequences(const corpus& c, int max_length, std::uint64_t seed,
                                     std::int64_t step, int stream, int count,
                                     part from = part::training) {
  const std::size_t first = from == part::training ? 0 : c.train_end;
  const std::size_t end = from == part::training ? c.train_end : c.ids.size();
  FEDSHARD_EXPECTS(max_length >= 64 && first + static_cast<std::size_t>(max_length) + 1 < end,
                   "charlm: sequences of up to ", max_length,
                   " predictions need max_length >= 64 and a longer text, found ", end - first,
                   " bytes in the ", from == part::training ? "training" : "evaluation", " part");
  sequence_batch b;
  for (int i = 0; i < count; ++i) {
    const std::uint64_t h =
        mix(mix(seed ^ 0xfc9u) ^
            mix(static_cast<std::uint64_t>(step) * 524287u +
                static_cast<std::uint64_t>(stream) * 8191u + static_cast<std::uint64_t>(i)));
    const auto m = static_cast<std::uint64_t>(max_length);
    const std::uint64_t len =
        i % 8 == 7 ? m / 2 + (h >> 20) % (m / 2 + 1) : 8 + (h >> 20) % (m / 8 - 7);
    const std::size_t at = first + static_cast<std::size_t>(h % (end - first - len - 1));
    b.sequences.emplace_back(c.ids.begin() + static_cast<std::ptrdiff_t>(at),
                             c.ids.begin() + static_cast<std::ptrdiff_t>(at + len + 1));
  }
  return b;
}

/// The model: a fedshard::Model over sequence_batch; see the file comment.
class attention_model {
 public:
  attention_model() = default;
  /// Initial values from seed.
  explicit attention_model(attention_dims d, std::uint64_t seed = 1) : d_(d), seed_(seed) {
    FEDSHARD_EXPECTS(
        d.vocab >= 2 && d.embed >= 1 && d.head >= 1 && d.max_length >= 1 && d.block_tokens >= 1,
        "charlm::attention_model: sizes must be positive (vocab >= 2), found vocab ", d.vocab,
        ", embed ", d.embed, ", head ", d.head, ", max_length ", d.max_length, ", block_tokens ",
        d.block_tokens);
  }
  const attention_dims& sizes() const { return d_; }

  std::vector<fedshard::unit_spec> units() const {
    const std::int64_t V = d_.vocab, E = d_.embed, D = d_.head, T = d_.max_length;
    return {{"embed", {{"table", {V, E}}, {"pos", {T, E}}}},
            {"attention", {{"wq", {D, E}}, {"wk", {D, E}}, {"wv", {D, E}}, {"wo", {E, D}}}},
            {"head", {{"w", {V, E}}, {"b", {V}}}}};
  }

  /// Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) matrices (the embeddings: (-0.5, 0.5)), zero b.
  std::vector<float> initial_values(const fedshard::flat_layout& l, std::size_t u) const {
    std::vector<float> v(l.unit(u).numel, 0.0f);
    for (const auto& ts : l.unit(u).tensors) {
      if (ts.shape.size() != 2) continue;
      const double scale = u == 0 ? 0.5 : 1.0 / std::sqrt(static_cast<double>(ts.shape[1]));
      for (std::size_t i = 0; i < ts.numel; ++i) {
        const std::uint64_t h = mix(seed_ * 0x9e3779b97f4a7c15ull + (u << 40) + ts.offset + i);
        v[ts.offset + i] = static_cast<float>(
            scale * (static_cast<double>(h >> 11) / 9007199254740992.0 * 2.0 - 1.0));
      }
    }
    return v;
  }

  /// The last forward's cross-entropy summed over this rank's tokens, and their count.
  double last_loss_sum() const noexcept { return last_sum_; }
  std::int64_t last_tokens() const noexcept { return last_tokens_; }
  /// The tokens this rank predicts of b (all of them without context parallelism).
  std::int64_t tokens(const sequence_batch& b) {
    return static_cast<std::int64_t>(rows_of(b, rank_, ranks_).size());
  }

  template <class Ctx>
  float forward_backward(Ctx& ctx, const sequence_batch& b) {
    return run(ctx, b, true);
  }
  template <class Ctx>
  float evaluate(Ctx& ctx, const sequence_batch& b) {
    return run(ctx, b, false);
  }

 private:
  /// One row: a predicted token of a sequence.
  struct row {
    std::uint8_t id = 0, next = 0;
    std::size_t position = 0;
  };

  const fedshard::context_plan& plan_of(const sequence_batch& b, int ranks) {
    const fedshard::axis a = context_.value_or(fedshard::axis::group);
    std::vector<std::int64_t> lengths;
    for (const auto& s : b.sequences) {
      FEDSHARD_EXPECTS(s.size() >= 2 && s.size() <= static_cast<std::size_t>(d_.max_length) + 1,
                       "charlm::attention_model: a sequence of ", s.size(),
                       " ids; expected 2 to max_length + 1 = ", d_.max_length + 1);
      lengths.push_back(static_cast<std::int64_t>(s.size()) - 1);
    }
    auto& cache = caches_[{a, ranks}];
    if (!cache)
      cache = std::make_unique<fedshard::context_plan_cache>(
          fedshard::context_settings{.block_tokens = d_.block_tokens,
                                     .ranks = ranks,
                                     .kv_dim = d_.head,
                                     .element_bytes = 4},
          a);
    current_ = cache->get(lengths);
    return *current_;
  }

  /// The rows of `rank` of `ranks`: its blocks in the plan's order.
  std::vector<row> rows_of(const sequence_batch& b, int rank, int ranks) {
    const fedshard::context_plan& p = plan_of(b, ranks);
    std::vector<row> rows;
    for (const fedshard::context_block& blk : p.placement().blocks) {
      if (blk.rank != rank) continue;
      const auto& s = b.sequences[static_cast<std::size_t>(blk.sequence)];
      for (std::int64_t t = blk.first_token; t < blk.first_token + blk.tokens; ++t) {
        const auto i = static_cast<std::size_t>(t);
        rows.push_back({s[i], s[i + 1], i});
      }
    }
    return rows;
  }

  /// Work of one step, kept from forward to backward.
  struct cache {
    std::vector<float> e, q, k, v, o, h, dlogits;
  };

  template <class Ctx>
  float run(Ctx& ctx, const sequence_batch& b, bool train);
  template <class Ctx>
  float forward(Ctx& ctx, const std::vector<row>& rows, context_attention& att, float weight,
                cache& c, bool train);
  template <class Ctx>
  void backward(Ctx& ctx, const std::vector<row>& rows, context_attention& att, cache& c);

  /// context_attention's exchange over the step context (its f32 areas).
  template <class Ctx>
  static auto exchanger(Ctx& ctx) {
    return [&ctx](const fedshard::plan& ops, std::span<std::byte> a0, std::span<std::byte> a1) {
      ctx.exchange(ops, {a0.data(), a0.size() / 4, fedshard::dtype::f32},
                   {a1.data(), a1.size() / 4, fedshard::dtype::f32});
    };
  }

  static float dot(const float* a, const float* b, std::size_t n) {
    float s = 0.0f;
    for (std::size_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
  }
  /// y[rows, out] = W[out, in] x[rows, in]
  static std::vector<float> times(std::span<const float> w, const std::vector<float>& x,
                                  std::size_t in, std::size_t out) {
    const std::size_t n = x.size() / in;
    std::vector<float> y(n * out);
    for (std::size_t r = 0; r < n; ++r)
      for (std::size_t i = 0; i < out; ++i) y[r * out + i] = dot(&w[i * in], &x[r * in], in);
    return y;
  }
  /// gw[out, in] += dy[rows, out]^T x[rows, in]; dx[rows, in] += W^T dy.
  static void times_back(std::span<const float> w, std::span<float> gw, const std::vector<float>& x,
                         const std::vector<float>& dy, std::size_t in, std::size_t out,
                         std::vector<float>& dx) {
    const std::size_t n = x.size() / in;
    for (std::size_t r = 0; r < n; ++r)
      for (std::size_t i = 0; i < out; ++i) {
        const float g = dy[r * out + i];
        for (std::size_t j = 0; j < in; ++j) {
          gw[i * in + j] += g * x[r * in + j];
          dx[r * in + j] += g * w[i * in + j];
        }
      }
  }

  attention_dims d_{};
  std::uint64_t seed_ = 1;
  std::optional<fedshard::axis> context_;  // the context axis, as the last step saw it
  int rank_ = 0, ranks_ = 1;               // on that axis
  double last_sum_ = 0;
  std::int64_t last_tokens_ = 0;
  std::map<std::pair<fedshard::axis, int>, std::unique_ptr<fedshard::context_plan_cache>>
      caches_;  // by axis and ranks
  std::shared_ptr<const fedshard::context_plan> current_;
};

template <class Ctx>
float attention_model::run(Ctx& ctx, const sequence_batch& b, bool train) {
  FEDSHARD_EXPECTS(!b.sequences.empty(), "charlm::attention_model: empty batch");
  context_ = ctx.context_axis();
  ranks_ = context_ ? ctx.axis_size(*context_) : 1;
  rank_ = context_ ? ctx.axis_rank(*context_) : 0;
  const std::vector<row> rows = rows_of(b, rank_, ranks_);
  fedshard::check_same_batch(*current_, [&](std::span<double> v) {
    ctx.agree(fedshard::batch_agreement_op(current_->axis(), ranks_), v);
  });
  std::int64_t total = 0;
  for (const auto& s : b.sequences) total += static_cast<std::int64_t>(s.size()) - 1;
  // The rank's share: P / N x the sum over its tokens (the file comment).
  const float weight = static_cast<float>(ranks_) / static_cast<float>(total);
  context_attention att(*current_, rank_);
  cache c;
  const float loss = forward(ctx, rows, att, weight, c, train);
  if (train) backward(ctx, rows, att, c);
  return loss;
}

template <class Ctx>
float attention_model::forward(Ctx& ctx, const std::vector<row>& rows, context_attention& att,
                               float weight, cache& c, bool train) {
  const fedshard::flat_layout& l = ctx.layout();
  const auto V = static_cast<std::size_t>(d_.vocab), E = static_cast<std::size_t>(d_.embed),
             D = static_cast<std::size_t>(d_.head);
  const std::size_t n = rows.size();
  c.e.assign(n * E, 0.0f);
  {
    auto p = ctx.acquire(0);
    auto table = l.tensor_view(p, 0, 0), pos = l.tensor_view(p, 0, 1);
    for (std::size_t r = 0; r < n; ++r) {
      FEDSHARD_EXPECTS(rows[r].id < V && rows[r].next < V,
                       "charlm::attention_model: an id outside the vocabulary of ", V);
      for (std::size_t j = 0; j < E; ++j)
        c.e[r * E + j] = table[rows[r].id * E + j] + pos[rows[r].position * E + j];
    }
    ctx.release(0);
  }
  {
    auto p = ctx.acquire(1);
    c.q = times(l.tensor_view(p, 1, 0), c.e, E, D);
    c.k = times(l.tensor_view(p, 1, 1), c.e, E, D);
    c.v = times(l.tensor_view(p, 1, 2), c.e, E, D);
    c.o.assign(n * D, 0.0f);
    att.forward(exchanger(ctx), c.q, c.k, c.v, c.o);
    c.h = times(l.tensor_view(p, 1, 3), c.o, D, E);
    for (std::size_t i = 0; i < c.h.size(); ++i) c.h[i] = std::tanh(c.e[i] + c.h[i]);
    ctx.release(1);
  }
  double loss = 0;
  c.dlogits.assign(train ? n * V : 0, 0.0f);
  {
    auto p = ctx.acquire(2);
    auto w = l.tensor_view(p, 2, 0), bias = l.tensor_view(p, 2, 1);
    std::vector<float> z(V);
    for (std::size_t r = 0; r < n; ++r) {
      for (std::size_t v = 0; v < V; ++v) z[v] = bias[v] + dot(&w[v * E], &c.h[r * E], E);
      const float m = *std::max_element(z.begin(), z.end());
      double sum = 0;
      for (std::size_t v = 0; v < V; ++v) sum += std::exp(double(z[v] - m));
      loss += std::log(sum) - double(z[rows[r].next] - m);
      if (!train) continue;
      for (std::size_t v = 0; v < V; ++v)
        c.dlogits[r * V + v] = static_cast<float>(std::exp(double(z[v] - m)) / sum) * weight;
      c.dlogits[r * V + rows[r].next] -= weight;
    }
    ctx.release(2);
  }
  last_sum_ = loss;
  last_tokens_ = static_cast<std::int64_t>(n);
  return static_cast<float>(loss * weight);
}

template <class Ctx>
void attention_model::backward(Ctx& ctx, const std::vector<row>& rows, context_attention& att,
                               cache& c) {
  const fedshard::flat_layout& l = ctx.layout();
  const auto V = static_cast<std::size_t>(d_.vocab), E = static_cast<std::size_t>(d_.embed),
             D = static_cast<std::size_t>(d_.head);
  const std::size_t n = rows.size();
  std::vector<float> dh(n * E, 0.0f);
  {
    auto p = ctx.acquire(2, fedshard::phase::backward);
    auto g = ctx.grad_buffer(2);
    auto gb = l.tensor_view(g, 2, 1);
    for (std::size_t r = 0; r < n; ++r)
      for (std::size_t v = 0; v < V; ++v) gb[v] += c.dlogits[r * V + v];
    times_back(l.tensor_view(p, 2, 0), l.tensor_view(g, 2, 0), c.h, c.dlogits, E, V, dh);
    ctx.release(2);
    ctx.grads_ready(2);
  }
  for (std::size_t i = 0; i < dh.size(); ++i) dh[i] *= 1.0f - c.h[i] * c.h[i];
  std::vector<float> de = dh;  // the residual
  {
    auto p = ctx.acquire(1, fedshard::phase::backward);
    auto g = ctx.grad_buffer(1);
    std::vector<float> dout(n * D, 0.0f), dq(n * D), dk(n * D), dv(n * D);
    times_back(l.tensor_view(p, 1, 3), l.tensor_view(g, 1, 3), c.o, dh, D, E, dout);
    att.backward(exchanger(ctx), dout, dq, dk, dv);
    times_back(l.tensor_view(p, 1, 0), l.tensor_view(g, 1, 0), c.e, dq, E, D, de);
    times_back(l.tensor_view(p, 1, 1), l.tensor_view(g, 1, 1), c.e, dk, E, D, de);
    times_back(l.tensor_view(p, 1, 2), l.tensor_view(g, 1, 2), c.e, dv, E, D, de);
    ctx.release(1);
    ctx.grads_ready(1);
  }
  {
    ctx.acquire(0, fedshard::phase::backward);
    auto g = ctx.grad_buffer(0);
    auto table = l.tensor_view(g, 0, 0), pos = l.tensor_view(g, 0, 1);
    for (std::size_t r = 0; r < n; ++r)
      for (std::size_t j = 0; j < E; ++j) {
        table[rows[r].id * E + j] += de[r * E + j];
        pos[rows[r].position * E + j] += de[r * E + j];
      }
    ctx.release(0);
    ctx.grads_ready(0);
  }
}

}  // namespace charlm
