#pragma once
/// Causal self-attention over a batch of sequences spread over the ranks of a context-parallel
/// group by FCP's placement (fedshard/plan/context_plan.hpp): forward and backward by hand, on
/// host memory, one head of dimension d (the plan's kv_dim).
///
/// Rows. A rank holds the rows (tokens) of its blocks, in the placement's block order, each
/// block's tokens in order: its queries, keys and values, and the outputs and gradients of the
/// same rows. The forward pass sends each key/value block a later block of its sequence needs
/// to that block's rank (the plan's forward ops), then every query attends to its sequence's
/// positions 0..t. The backward pass computes the gradients of the queries, keys and values it
/// attended to, sends the key and value gradients of received blocks back to their owners
/// (the plan's backward ops), and each owner adds them to its own.
///
/// Arithmetic, per query row q at position t (scale = 1 / sqrt(d)), over the keys in position
/// order: s_i = scale (q . k_i), the dot product summed over d in order; m = max_i s_i;
/// e_i = exp(s_i - m); z = sum_i e_i in order; p_i = e_i / z; out = sum_i p_i v_i in order.
/// Backward, with the output gradient g: dp_i = g . v_i; D = sum_i p_i dp_i; ds_i = p_i
/// (dp_i - D); dq = scale sum_i ds_i k_i; dk_i += scale ds_i q; dv_i += p_i g.
///
/// What equals what. A query's output and its gradient dq read only its sequence's keys and
/// values, which arrive unchanged, in the same order: they are bit-equal whatever the
/// placement (and on one rank equal the plain loop of the arithmetic above). A key's dk and
/// dv sum over every later query; on one rank in position order, spread over ranks as each
/// rank's partial sum (its queries in position order) plus, at the owner, the partials it
/// receives, in the plan's order: the same terms in another order, equal up to float rounding
/// (a relative 1e-5 of the sum of the terms' magnitudes; tests/examples/test_context_attention).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/plan/context_plan.hpp"

namespace charlm {

/// One rank's share of the attention over a context_plan's batch; see the file comment.
class context_attention {
 public:
  /// The attention of `rank` under plan (f32 keys and values: element_bytes 4).
  context_attention(const fedshard::context_plan& plan, int rank)
      : plan_(&plan), rank_(rank), d_(static_cast<std::size_t>(plan.settings().kv_dim)) {
    FEDSHARD_EXPECTS(plan.settings().element_bytes == 4,
                     "context_attention: computes in f32 (element_bytes 4), the plan has ",
                     plan.settings().element_bytes);
    FEDSHARD_EXPECTS(rank >= 0 && rank < plan.ranks(), "context_attention: expected a rank in [0, ",
                     plan.ranks(), "), found ", rank);
    const auto& blocks = plan.placement().blocks;
    row_.assign(blocks.size(), not_here);
    for (std::size_t b = 0; b < blocks.size(); ++b)
      if (blocks[b].rank == rank) {
        row_[b] = rows_;
        rows_ += static_cast<std::size_t>(blocks[b].tokens);
      }
    place_received();
  }

  /// This rank's rows (tokens).
  std::size_t rows() const noexcept { return rows_; }
  /// The head dimension d.
  std::size_t dim() const noexcept { return d_; }

  /// out = attention(q, k, v) of this rank's rows (rows() x d each, row-major). exchange(ops,
  /// area0, area1) runs the plan's ops of this rank on the plan's axis (fedshard::
  /// run_context_ops on its communicator, or a step_context's exchange); every rank of the
  /// group calls forward together.
  template <class Exchange>
  void forward(Exchange&& exchange, std::span<const float> q, std::span<const float> k,
               std::span<const float> v, std::span<float> out) {
    check(q, "q");
    check(k, "k");
    check(v, "v");
    check(out, "out");
    q_.assign(q.begin(), q.end());
    k_.assign(k.begin(), k.end());
    v_.assign(v.begin(), v.end());
    std::vector<float> send = pack_sent();
    received_.assign(received_elements_, 0.0f);
    exchange(plan_->forward(rank_), std::as_writable_bytes(std::span(send)),
             std::as_writable_bytes(std::span(received_)));
    std::vector<float> p;
    for_each_query([&](std::size_t row, const std::vector<key_block>& keys) {
      probabilities(row, keys, p);
      float* o = out.data() + row * d_;
      std::fill(o, o + d_, 0.0f);
      std::size_t i = 0;
      for (const key_block& kb : keys)
        for (std::size_t t = 0; t < kb.tokens; ++t, ++i)
          for (std::size_t e = 0; e < d_; ++e) o[e] += p[i] * kb.v[t * d_ + e];
    });
  }

  /// The gradients of the last forward's q, k and v (rows() x d each) from the outputs'
  /// gradient g; exchange as in forward.
  template <class Exchange>
  void backward(Exchange&& exchange, std::span<const float> g, std::span<float> dq,
                std::span<float> dk, std::span<float> dv) {
    check(g, "g");
    check(dq, "dq");
    check(dk, "dk");
    check(dv, "dv");
    std::fill(dq.begin(), dq.end(), 0.0f);
    std::fill(dk.begin(), dk.end(), 0.0f);
    std::fill(dv.begin(), dv.end(), 0.0f);
    std::vector<float> received_grad(received_elements_, 0.0f);
    std::vector<float> p, dp;
    for_each_query([&](std::size_t row, const std::vector<key_block>& keys) {
      probabilities(row, keys, p);
      query_backward(row, keys, p, g.subspan(row * d_, d_), dq.subspan(row * d_, d_), dk, dv,
                     received_grad, dp);
    });
    std::vector<float> returned(sent_elements(), 0.0f);
    exchange(plan_->backward(rank_), std::as_writable_bytes(std::span(returned)),
             std::as_writable_bytes(std::span(received_grad)));
    add_returned(returned, dk, dv);
  }

 private:
  static constexpr std::size_t not_here = std::numeric_limits<std::size_t>::max();

  /// One key block a query reads: its tokens' keys and values, and where its gradients go.
  struct key_block {
    const float* k = nullptr;
    const float* v = nullptr;
    std::size_t tokens = 0;
    std::size_t grad_row = 0;  ///< its first row in dk/dv, or in the received gradients
    bool local = true;
  };

  template <class Span>
  void check(const Span& s, const char* what) const {
    FEDSHARD_EXPECTS(s.size() == rows_ * d_, "context_attention: ", what, " holds ", s.size(),
                     " floats, expected rows x d = ", rows_, " x ", d_);
  }

  /// Where each received block sits in the receive area (in the plan's order).
  void place_received() {
    const auto& blocks = plan_->placement().blocks;
    received_at_.assign(blocks.size(), not_here);
    std::size_t at = 0;
    for (const fedshard::context_transfer* t : plan_->received_by(rank_))
      for (int b : t->blocks) {
        received_at_[static_cast<std::size_t>(b)] = at;
        at += 2 * static_cast<std::size_t>(blocks[static_cast<std::size_t>(b)].tokens) * d_;
      }
    received_elements_ = at;
  }

  std::size_t sent_elements() const {
    std::size_t n = 0;
    for (const fedshard::context_transfer* t : plan_->sent_by(rank_))
      n += 2 * static_cast<std::size_t>(t->tokens) * d_;
    return n;
  }

  /// The send area: each sent block's keys, then its values, in the plan's order.
  std::vector<float> pack_sent() const {
    const auto& blocks = plan_->placement().blocks;
    std::vector<float> out;
    out.reserve(sent_elements());
    for (const fedshard::context_transfer* t : plan_->sent_by(rank_))
      for (int b : t->blocks) {
        const std::size_t at = row_[static_cast<std::size_t>(b)] * d_;
        const std::size_t n =
            static_cast<std::size_t>(blocks[static_cast<std::size_t>(b)].tokens) * d_;
        out.insert(out.end(), k_.begin() + static_cast<std::ptrdiff_t>(at),
                   k_.begin() + static_cast<std::ptrdiff_t>(at + n));
        out.insert(out.end(), v_.begin() + static_cast<std::ptrdiff_t>(at),
                   v_.begin() + static_cast<std::ptrdiff_t>(at + n));
      }
    return out;
  }

  /// The key blocks of block b's sequence up to b itself (local or received).
  std::vector<key_block> keys_of(std::size_t b) const {
    const auto& blocks = plan_->placement().blocks;
    std::vector<key_block> keys;
    for (std::size_t j = b - static_cast<std::size_t>(blocks[b].index); j <= b; ++j) {
      const auto tokens = static_cast<std::size_t>(blocks[j].tokens);
      if (row_[j] != not_here) {
        keys.push_back({k_.data() + row_[j] * d_, v_.data() + row_[j] * d_, tokens, row_[j], true});
      } else {
        FEDSHARD_EXPECTS(received_at_[j] != not_here, "context_attention: block ", j,
                         " was neither placed on nor sent to rank ", rank_);
        const float* kv = received_.data() + received_at_[j];
        keys.push_back({kv, kv + tokens * d_, tokens, received_at_[j], false});
      }
    }
    return keys;
  }

  /// f(row, keys) for every query row of this rank, keys trimmed to the positions it sees.
  template <class F>
  void for_each_query(F f) const {
    const auto& blocks = plan_->placement().blocks;
    for (std::size_t b = 0; b < blocks.size(); ++b) {
      if (row_[b] == not_here) continue;
      std::vector<key_block> keys = keys_of(b);
      const std::size_t full = keys.back().tokens;
      for (std::size_t t = 0; t < full; ++t) {
        keys.back().tokens = t + 1;
        f(row_[b] + t, keys);
      }
    }
  }

  /// p: the attention probabilities of query `row` over keys (the header's arithmetic).
  void probabilities(std::size_t row, const std::vector<key_block>& keys,
                     std::vector<float>& p) const {
    const float scale = 1.0f / std::sqrt(static_cast<float>(d_));
    const float* q = q_.data() + row * d_;
    p.clear();
    float m = -std::numeric_limits<float>::infinity();
    for (const key_block& kb : keys)
      for (std::size_t t = 0; t < kb.tokens; ++t) {
        float s = 0.0f;
        for (std::size_t e = 0; e < d_; ++e) s += q[e] * kb.k[t * d_ + e];
        p.push_back(scale * s);
        m = std::max(m, p.back());
      }
    float z = 0.0f;
    for (float& x : p) {
      x = std::exp(x - m);
      z += x;
    }
    for (float& x : p) x /= z;
  }

  void query_backward(std::size_t row, const std::vector<key_block>& keys,
                      const std::vector<float>& p, std::span<const float> g, std::span<float> dq,
                      std::span<float> dk, std::span<float> dv, std::vector<float>& received_grad,
                      std::vector<float>& dp) const {
    const float scale = 1.0f / std::sqrt(static_cast<float>(d_));
    dp.clear();
    float D = 0.0f;
    std::size_t i = 0;
    for (const key_block& kb : keys)
      for (std::size_t t = 0; t < kb.tokens; ++t, ++i) {
        float x = 0.0f;
        for (std::size_t e = 0; e < d_; ++e) x += g[e] * kb.v[t * d_ + e];
        dp.push_back(x);
        D += p[i] * x;
      }
    const float* q = q_.data() + row * d_;
    i = 0;
    for (const key_block& kb : keys) {
      // A received block's gradients sit where its keys and values sat in the receive area
      // (a received block is earlier than the query's own, so never trimmed: kb.tokens).
      float* gk = kb.local ? dk.data() + kb.grad_row * d_ : received_grad.data() + kb.grad_row;
      float* gv = kb.local ? dv.data() + kb.grad_row * d_ : gk + kb.tokens * d_;
      for (std::size_t t = 0; t < kb.tokens; ++t, ++i) {
        const float ds = p[i] * (dp[i] - D);
        for (std::size_t e = 0; e < d_; ++e) {
          dq[e] += scale * ds * kb.k[t * d_ + e];
          gk[t * d_ + e] += scale * ds * q[e];
          gv[t * d_ + e] += p[i] * g[e];
        }
      }
    }
  }

  /// Adds the key and value gradients the other ranks sent back (laid out as the send area).
  void add_returned(const std::vector<float>& returned, std::span<float> dk,
                    std::span<float> dv) const {
    const auto& blocks = plan_->placement().blocks;
    std::size_t at = 0;
    for (const fedshard::context_transfer* t : plan_->sent_by(rank_))
      for (int b : t->blocks) {
        const std::size_t row = row_[static_cast<std::size_t>(b)] * d_;
        const std::size_t n =
            static_cast<std::size_t>(blocks[static_cast<std::size_t>(b)].tokens) * d_;
        for (std::size_t e = 0; e < n; ++e) dk[row + e] += returned[at + e];
        for (std::size_t e = 0; e < n; ++e) dv[row + e] += returned[at + n + e];
        at += 2 * n;
      }
  }

  const fedshard::context_plan* plan_;
  int rank_;
  std::size_t d_;
  std::size_t rows_ = 0;
  std::vector<std::size_t> row_;          // per block: its first row here, or not_here
  std::vector<std::size_t> received_at_;  // per block: its offset in the receive area
  std::size_t received_elements_ = 0;
  std::vector<float> q_, k_, v_, received_;
};

}  // namespace charlm
