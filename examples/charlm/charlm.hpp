#pragma once
/// A character-level language model in plain C++, forward and backward written by hand, and
/// its data: fedshard's example of a real model behind the step_context hooks.
///
/// Model: the previous k characters are embedded (a table of V x E), concatenated, passed
/// through two tanh layers of width H and a softmax over the V characters of the corpus.
/// Units (one all-gather each): "embed" {table [V, E]}, "hidden1" {w1 [H, kE], b1 [H]},
/// "hidden2" {w2 [H, H], b2 [H]}, "head" {w3 [V, H], b3 [V]}.
///
/// Optional mixture of experts (dims::experts = X > 0; off by default, and then the model is
/// the one above, unit for unit): between hidden2 and the head, a router picks one of X
/// experts per example (top-1 of softmax(Wr h2 + br)) and h2 becomes h2 + p_e * expert_e(h2),
/// with expert_e(x) = We2 tanh(We1 x + be1) + be2 of width F (dims::expert_hidden) and p_e
/// the router's probability of e (so the router learns, as in the Switch Transformer).
/// Units then: embed, hidden1, hidden2, "router" {wr [X, H], br [X]}, "expert0" ..
/// "expert<X-1>" {we1 [F, H], be1 [F], we2 [H, F], be2 [H]}, head. Each expert is its own
/// unit, so that a placement can hold it on some groups only (expert_of, placement,
/// ownership: FoMoE); every rank acquires every expert its group holds in every step (a
/// gathered unit is a collective), an expert no example was routed to gets zero gradients,
/// and under an ownership mask the router chooses among the group's own experts only (its
/// softmax runs over them).
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
#include "fedshard/shard/ownership.hpp"

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
  int context = 8;        ///< k
  int embed = 16;         ///< E
  int hidden = 256;       ///< H
  int experts = 0;        ///< X: 0 = no mixture-of-experts layer
  int expert_hidden = 0;  ///< F: width of each expert's hidden layer (0 = H)
};

/// The model: a fedshard::Model over charlm::batch.
class model {
 public:
  model() = default;
  explicit model(dims d, std::uint64_t init_seed = 1) : d_(d), seed_(init_seed) {
    FEDSHARD_EXPECTS(d.vocab >= 2 && d.context >= 1 && d.embed >= 1 && d.hidden >= 1,
                     "charlm: dims must be positive (vocab >= 2), found vocab ", d.vocab,
                     ", context ", d.context, ", embed ", d.embed, ", hidden ", d.hidden);
    FEDSHARD_EXPECTS(d.experts >= 0 && d.expert_hidden >= 0,
                     "charlm: experts and expert_hidden must be >= 0, found ", d.experts, " and ",
                     d.expert_hidden);
    if (d_.expert_hidden == 0) d_.expert_hidden = d_.hidden;
  }
  const dims& sizes() const { return d_; }

  std::vector<fedshard::unit_spec> units() const {
    const std::int64_t V = d_.vocab, E = d_.embed, H = d_.hidden, KE = d_.context * d_.embed;
    std::vector<fedshard::unit_spec> u{{"embed", {{"table", {V, E}}}},
                                       {"hidden1", {{"w1", {H, KE}}, {"b1", {H}}}},
                                       {"hidden2", {{"w2", {H, H}}, {"b2", {H}}}}};
    if (d_.experts > 0) {
      const std::int64_t X = d_.experts, F = d_.expert_hidden;
      u.push_back({"router", {{"wr", {X, H}}, {"br", {X}}}});
      for (int e = 0; e < d_.experts; ++e)
        u.push_back({"expert" + std::to_string(e),
                     {{"we1", {F, H}}, {"be1", {F}}, {"we2", {H, F}}, {"be2", {H}}}});
    }
    u.push_back({"head", {{"w3", {V, H}}, {"b3", {V}}}});
    return u;
  }

  /// The number of experts (0: no mixture-of-experts layer).
  int num_experts() const { return d_.experts; }
  /// Index of the head unit (the last).
  std::size_t head_unit() const { return d_.experts > 0 ? 4 + std::size_t(d_.experts) : 3; }
  /// The expert unit u holds, or -1 for a dense unit (embed, hidden*, router, head).
  int expert_of(std::size_t u) const {
    if (d_.experts == 0 || u < 4 || u >= head_unit()) return -1;
    return static_cast<int>(u - 4);
  }
  /// The unit of expert e.
  std::size_t unit_of_expert(int e) const { return 4 + static_cast<std::size_t>(e); }
  /// A placement over `groups` groups: expert e is held by group e mod groups; -1 (every
  /// group) for a dense unit. One entry per unit.
  std::vector<int> placement(int groups) const {
    FEDSHARD_EXPECTS(groups >= 1, "charlm: placement over ", groups, " groups");
    std::vector<int> p;
    for (std::size_t u = 0; u <= head_unit(); ++u) {
      const int e = expert_of(u);
      p.push_back(e < 0 ? -1 : e % groups);
    }
    return p;
  }
  /// placement(groups) as an ownership mask, for federation::holder_average's `owners` (the
  /// fomoe row): dense units on every group; expert e on the `copies` groups e mod G,
  /// (e + 1) mod G, ... (copies = 1: each expert on one group only, never averaged).
  fedshard::shard::ownership ownership(int groups, int copies = 1) const {
    FEDSHARD_EXPECTS(copies >= 1 && copies <= groups, "charlm: ", copies,
                     " copies of each expert over ", groups, " groups; expected 1 to ", groups);
    fedshard::shard::ownership o{.groups = groups, .holders = {}};
    for (const int g : placement(groups)) {
      fedshard::shard::group_set h = g < 0 ? fedshard::shard::all_groups(groups) : 0;
      for (int c = 0; g >= 0 && c < copies; ++c)
        h |= fedshard::shard::group_set{1} << ((g + c) % groups);
      o.holders.push_back(h);
    }
    return o;
  }
  /// The expert each example of the last forward pass was routed to (empty without experts).
  const std::vector<int>& last_routes() const { return routes_; }

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
    // the mixture of experts (if any): hm = h2 + p_e * expert_e(h2)
    moe_cache mc;
    if (d_.experts > 0) moe_forward(ctx, h2, n, mc);
    const std::vector<float>& top = d_.experts > 0 ? mc.out : h2;
    const std::size_t hu = head_unit();
    double loss = 0;
    std::vector<float> dlogits(n * V);
    {
      auto p = ctx.acquire(hu);
      dense(l.tensor_view(p, hu, 0), l.tensor_view(p, hu, 1), top, H, V, n, false, logits);
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
      ctx.release(hu);
    }
    if (!train) return static_cast<float>(loss / double(n));
    // backward
    std::vector<float> dh2, dh1, dx;
    {
      auto p = ctx.acquire(hu, fedshard::phase::backward);
      auto g = ctx.grad_buffer(hu);
      dense_back(l.tensor_view(p, hu, 0), l.tensor_view(g, hu, 0), l.tensor_view(g, hu, 1), top,
                 dlogits, H, V, n, &dh2);
      ctx.release(hu);
      ctx.grads_ready(hu);
    }
    if (d_.experts > 0) moe_backward(ctx, h2, n, mc, dh2);  // dh2: d/d(hm) in, d/d(h2) out
    for (std::size_t i = 0; i < dh2.size(); ++i) dh2[i] *= 1.0f - h2[i] * h2[i];
    {
      auto p = ctx.acquire(2, fedshard::phase::backward);
      auto g = ctx.grad_buffer(2);
      dense_back(l.tensor_view(p, 2, 0), l.tensor_view(g, 2, 0), l.tensor_view(g, 2, 1), h1, dh2, H,
                 H, n, &dh1);
      ctx.release(2);
      ctx.grads_ready(2);
    }
    // Units trained without gradients (zeroth-order: the lowest ones) end the backward.
    if (!ctx.takes_gradients(1)) {
      if (ctx.takes_gradients(0))
        throw fedshard::invalid_argument(
            "charlm: hidden1 is trained without gradients, so the embedding below it gets none "
            "either: make the zeroth-order units the lowest ones (embed, then hidden1)");
      return static_cast<float>(loss / double(n));
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
    if (!ctx.takes_gradients(0)) return static_cast<float>(loss / double(n));
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

  /// What the mixture's backward needs from its forward.
  struct moe_cache {
    std::vector<float> probs;                    // [n, X] router softmax
    std::vector<int> held;                       // [X] 1: this group holds expert e
    std::vector<int> route;                      // [n] chosen expert
    std::vector<std::vector<float>> a;           // per expert: [m_e, F] tanh hidden of its examples
    std::vector<std::vector<float>> y;           // per expert: [m_e, H] expert output
    std::vector<std::vector<std::size_t>> rows;  // per expert: the examples routed to it
    std::vector<float> out;                      // [n, H] h2 + p_e * y
  };

  template <class Ctx>
  void moe_forward(Ctx& ctx, const std::vector<float>& h2, std::size_t n, moe_cache& mc) {
    const fedshard::flat_layout& l = ctx.layout();
    const auto H = static_cast<std::size_t>(d_.hidden), X = static_cast<std::size_t>(d_.experts),
               F = static_cast<std::size_t>(d_.expert_hidden);
    std::vector<float> r;
    {
      auto p = ctx.acquire(3);
      dense(l.tensor_view(p, 3, 0), l.tensor_view(p, 3, 1), h2, H, X, n, false, r);
      ctx.release(3);
    }
    // Under an ownership mask (FoMoE: experts placed on groups) the router chooses among the
    // experts this group holds: the softmax runs over them, the others get probability 0.
    mc.held.assign(X, 1);
    for (std::size_t e = 0; e < X; ++e)
      if constexpr (requires { ctx.holds(std::size_t{}); })
        mc.held[e] = ctx.holds(unit_of_expert(static_cast<int>(e))) ? 1 : 0;
    FEDSHARD_EXPECTS(std::find(mc.held.begin(), mc.held.end(), 1) != mc.held.end(),
                     "charlm: this group holds none of the ", X,
                     " experts; place at least one expert on every group");
    mc.probs.assign(n * X, 0.0f);
    mc.route.assign(n, 0);
    mc.rows.assign(X, {});
    for (std::size_t s = 0; s < n; ++s) {
      const float* z = &r[s * X];
      std::size_t e = X;
      for (std::size_t j = 0; j < X; ++j)
        if (mc.held[j] != 0 && (e == X || z[j] > z[e])) e = j;
      double sum = 0;
      for (std::size_t j = 0; j < X; ++j)
        if (mc.held[j] != 0) sum += std::exp(double(z[j] - z[e]));
      for (std::size_t j = 0; j < X; ++j)
        if (mc.held[j] != 0)
          mc.probs[s * X + j] = static_cast<float>(std::exp(double(z[j] - z[e])) / sum);
      mc.route[s] = static_cast<int>(e);
      mc.rows[e].push_back(s);
    }
    routes_ = mc.route;
    mc.out = h2;
    mc.a.assign(X, {});
    mc.y.assign(X, {});
    for (std::size_t e = 0; e < X; ++e) {
      if (mc.held[e] == 0) continue;  // not on this group: no storage, no examples
      const std::size_t u = unit_of_expert(static_cast<int>(e));
      auto p = ctx.acquire(u);  // every held expert, routed to or not: its gather is collective
      const auto& rows = mc.rows[e];
      std::vector<float> xe(rows.size() * H);
      for (std::size_t i = 0; i < rows.size(); ++i) std::copy_n(&h2[rows[i] * H], H, &xe[i * H]);
      dense(l.tensor_view(p, u, 0), l.tensor_view(p, u, 1), xe, H, F, rows.size(), true, mc.a[e]);
      dense(l.tensor_view(p, u, 2), l.tensor_view(p, u, 3), mc.a[e], F, H, rows.size(), false,
            mc.y[e]);
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const float pe = mc.probs[rows[i] * X + e];
        axpy(pe, &mc.y[e][i * H], &mc.out[rows[i] * H], H);
      }
      ctx.release(u);
    }
  }

  /// Backward of the mixture: `d` holds d loss / d out on entry, d loss / d h2 on exit.
  template <class Ctx>
  void moe_backward(Ctx& ctx, const std::vector<float>& h2, std::size_t n, const moe_cache& mc,
                    std::vector<float>& d) {
    const fedshard::flat_layout& l = ctx.layout();
    const auto H = static_cast<std::size_t>(d_.hidden), X = static_cast<std::size_t>(d_.experts),
               F = static_cast<std::size_t>(d_.expert_hidden);
    std::vector<float> dh = d;           // the residual path
    std::vector<float> dr(n * X, 0.0f);  // d loss / d router logits
    for (std::size_t e = X; e-- > 0;) {
      if (mc.held[e] == 0) continue;
      const std::size_t u = unit_of_expert(static_cast<int>(e));
      auto p = ctx.acquire(u, fedshard::phase::backward);
      auto g = ctx.grad_buffer(u);
      const auto& rows = mc.rows[e];
      const std::size_t m = rows.size();
      std::vector<float> xe(m * H), dy(m * H);
      for (std::size_t i = 0; i < m; ++i) {
        const std::size_t s = rows[i];
        std::copy_n(&h2[s * H], H, &xe[i * H]);
        const float pe = mc.probs[s * X + e];
        // d out / d p_e = y; the router's softmax: d p_e / d z_j = p_e (delta_ej - p_j)
        const float dpe = dot(&d[s * H], &mc.y[e][i * H], H);
        for (std::size_t j = 0; j < X; ++j)
          dr[s * X + j] += dpe * pe * ((j == e ? 1.0f : 0.0f) - mc.probs[s * X + j]);
        for (std::size_t k = 0; k < H; ++k) dy[i * H + k] = pe * d[s * H + k];
      }
      std::vector<float> da, dxe;
      dense_back(l.tensor_view(p, u, 2), l.tensor_view(g, u, 2), l.tensor_view(g, u, 3), mc.a[e],
                 dy, F, H, m, &da);
      for (std::size_t i = 0; i < da.size(); ++i) da[i] *= 1.0f - mc.a[e][i] * mc.a[e][i];
      dense_back(l.tensor_view(p, u, 0), l.tensor_view(g, u, 0), l.tensor_view(g, u, 1), xe, da, H,
                 F, m, &dxe);
      for (std::size_t i = 0; i < m; ++i) axpy(1.0f, &dxe[i * H], &dh[rows[i] * H], H);
      ctx.release(u);
      ctx.grads_ready(u);
    }
    {
      auto p = ctx.acquire(3, fedshard::phase::backward);
      auto g = ctx.grad_buffer(3);
      std::vector<float> dxr;
      dense_back(l.tensor_view(p, 3, 0), l.tensor_view(g, 3, 0), l.tensor_view(g, 3, 1), h2, dr, H,
                 X, n, &dxr);
      for (std::size_t i = 0; i < dh.size(); ++i) dh[i] += dxr[i];
      ctx.release(3);
      ctx.grads_ready(3);
    }
    d = std::move(dh);
  }

  dims d_{};
  std::uint64_t seed_ = 1;
  std::vector<int> routes_;
};

}  // namespace charlm
