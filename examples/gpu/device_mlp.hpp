#pragma once
/// A multilayer perceptron whose math is written once, as FEDSHARD_HOST_DEVICE functors of
/// explicitly rounded float operations (kernels::detail::add_rn / mul_rn / div_rn: never
/// fused, never reordered), so that a run on a host space and a run on a GPU compute the same
/// bits. This header is plain C++ (g++ compiles it): the functors run as host loops through
/// host_launch; examples/gpu/device_mlp.cuh adds cuda_launch, which runs them as kernels on
/// the step context's stream when the space is a device one (device_mlp).
///
///   y = W_L s(... s(W_1 s(W_0 x + b_0) + b_1) ...) + b_L,  s(z) = z / (1 + |z|) (softsign)
///   loss = (sum over the batch of 0.5 |y - t|^2) / B
///
/// Units: "layer0" .. "layer{L-1}" {w_l [hidden, in_l], b_l [hidden]} (in_0 = input, else
/// hidden) and "head" {w_L [output, hidden], b_L [output]}; a batch is a range of samples of
/// a deterministic stream, generated where the model computes (no host data per step): x is
/// uniform in [-1, 1), t = s(T x) for a fixed random "teacher" matrix T.
///
/// Every reduction runs in one fixed order: a matrix product sums over its inner index in
/// ascending order, starting from the bias (forward), from the gradient already there
/// (parameter gradients) or from zero (input gradients); the loss sums each sample's outputs
/// in order, then the samples in order.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "fedshard/config.hpp"
#include "fedshard/core/buffer.hpp"
#include "fedshard/kernels/sgd.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/shard/flat_layout.hpp"

namespace fedshard_examples {

namespace mlp_math {

using fedshard::kernels::detail::add_rn;
using fedshard::kernels::detail::div_rn;
using fedshard::kernels::detail::mul_rn;

/// a - b rounded once (negation is exact).
FEDSHARD_HOST_DEVICE inline float sub_rn(float a, float b) {
  return add_rn(a, -b);
}
/// softsign(z) = z / (1 + |z|).
FEDSHARD_HOST_DEVICE inline float softsign(float z) {
  return div_rn(z, add_rn(1.0f, z < 0.0f ? -z : z));
}
/// softsign'(z) = 1 / (1 + |z|)^2.
FEDSHARD_HOST_DEVICE inline float softsign_grad(float z) {
  const float r = div_rn(1.0f, add_rn(1.0f, z < 0.0f ? -z : z));
  return mul_rn(r, r);
}

/// A reproducible value in [-1, 1) from (seed, i): a splitmix64 hash, 24 bits of it scaled
/// exactly (integer arithmetic and exact float steps, the same on host and device).
FEDSHARD_HOST_DEVICE inline float uniform(std::uint64_t seed, std::uint64_t i) {
  std::uint64_t z = seed * 0x9e3779b97f4a7c15ull + i + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return add_rn(mul_rn(static_cast<float>(z >> 40), 1.0f / 8388608.0f), -1.0f);
}

/// A strided read-only matrix: m(r, c) = p[r * row_stride + c * col_stride].
struct matrix_ref {
  const float* p = nullptr;
  int row_stride = 0;
  int col_stride = 0;
  FEDSHARD_HOST_DEVICE float operator()(int r, int c) const {
    return p[static_cast<std::ptrdiff_t>(r) * row_stride +
             static_cast<std::ptrdiff_t>(c) * col_stride];
  }
};

/// out(r, c) = finish(init(r, c) + sum_k a(r, k) b(k, c)), k ascending, each step rounded:
/// the one matrix product of the model. init is bias[c] when there is a bias, out(r, c)
/// when accumulating, else 0; finish stores the sum into out, and also softsign(sum) into
/// act (forward of a hidden layer), or stores sum * softsign'(gate(r, c)) (input gradient
/// through an activation). operator()(idx) computes the element idx = r * cols + c alone
/// (host loops, or a naive kernel); a tiled kernel calls init, a, b and finish itself, in the
/// same order.
struct contraction {
  matrix_ref a, b;
  int rows = 0, cols = 0, depth = 0;
  float* out = nullptr;         ///< out[r * cols + c]
  const float* bias = nullptr;  ///< init = bias[c]
  bool accumulate = false;      ///< init = out[r * cols + c]
  float* act = nullptr;         ///< act[r * cols + c] = softsign(sum)
  const float* gate = nullptr;  ///< out = sum * softsign'(gate[r * cols + c])

  FEDSHARD_HOST_DEVICE float init(int r, int c) const {
    if (bias != nullptr) return bias[c];
    if (accumulate) return out[static_cast<std::ptrdiff_t>(r) * cols + c];
    return 0.0f;
  }
  FEDSHARD_HOST_DEVICE void finish(int r, int c, float sum) const {
    const std::ptrdiff_t i = static_cast<std::ptrdiff_t>(r) * cols + c;
    out[i] = gate != nullptr ? mul_rn(sum, softsign_grad(gate[i])) : sum;
    if (act != nullptr) act[i] = softsign(sum);
  }
  FEDSHARD_HOST_DEVICE void operator()(int idx) const {
    const int r = idx / cols, c = idx % cols;
    float acc = init(r, c);
    for (int k = 0; k < depth; ++k) acc = add_rn(acc, mul_rn(a(r, k), b(k, c)));
    finish(r, c, acc);
  }
};

/// Samples first .. first + n - 1 of the stream: x[s, j] = uniform(seed, (first + s) dim + j),
/// idx = s * dim + j.
struct make_inputs {
  std::uint64_t seed, first;
  int dim;
  float* x;
  FEDSHARD_HOST_DEVICE void operator()(int idx) const {
    const auto s = static_cast<std::uint64_t>(idx / dim), j = static_cast<std::uint64_t>(idx % dim);
    x[idx] = uniform(seed, (first + s) * static_cast<std::uint64_t>(dim) + j);
  }
};

/// t[s, k] = softsign(sum_j scale T[k, j] x[s, j]) with T[k, j] = uniform(seed, k in + j):
/// idx = s * out + k.
struct make_targets {
  std::uint64_t seed;
  const float* x;
  float* t;
  int in, out;
  float scale;
  FEDSHARD_HOST_DEVICE void operator()(int idx) const {
    const int s = idx / out, k = idx % out;
    float acc = 0.0f;
    for (int j = 0; j < in; ++j) {
      const float w = mul_rn(scale, uniform(seed, static_cast<std::uint64_t>(k) * in + j));
      acc = add_rn(acc, mul_rn(w, x[s * in + j]));
    }
    t[idx] = softsign(acc);
  }
};

/// dy = (y - t) / B: idx = s * out + k.
struct loss_grad {
  const float *y, *t;
  float* dy;
  int batch;
  FEDSHARD_HOST_DEVICE void operator()(int idx) const {
    dy[idx] = div_rn(sub_rn(y[idx], t[idx]), static_cast<float>(batch));
  }
};

/// per_sample[s] = sum_k 0.5 (y - t)^2, k ascending: idx = s.
struct sample_loss {
  const float *y, *t;
  float* per_sample;
  int out;
  FEDSHARD_HOST_DEVICE void operator()(int s) const {
    float acc = 0.0f;
    for (int k = 0; k < out; ++k) {
      const float d = sub_rn(y[s * out + k], t[s * out + k]);
      acc = add_rn(acc, mul_rn(0.5f, mul_rn(d, d)));
    }
    per_sample[s] = acc;
  }
};

/// *loss = (sum_s per_sample[s], s ascending) / B: one element.
struct batch_loss {
  const float* per_sample;
  float* loss;
  int batch;
  FEDSHARD_HOST_DEVICE void operator()(int) const {
    float acc = 0.0f;
    for (int s = 0; s < batch; ++s) acc = add_rn(acc, per_sample[s]);
    *loss = div_rn(acc, static_cast<float>(batch));
  }
};

/// gb[i] += sum_s dz[s, i], s ascending: idx = i.
struct bias_grad {
  const float* dz;
  float* gb;
  int out, batch;
  FEDSHARD_HOST_DEVICE void operator()(int i) const {
    float acc = gb[i];
    for (int s = 0; s < batch; ++s) acc = add_rn(acc, dz[s * out + i]);
    gb[i] = acc;
  }
};

}  // namespace mlp_math

/// The model's sizes and seeds.
struct mlp_config {
  int input = 8;          ///< features of a sample
  int hidden = 16;        ///< width of every hidden layer
  int output = 4;         ///< outputs (targets) of a sample
  int hidden_layers = 2;  ///< hidden layers (units "layer0" ..); the head is one more unit
  std::uint64_t init_seed = 7;
  std::uint64_t data_seed = 11;
};

/// A batch: samples first .. first + size - 1 of the model's stream.
struct mlp_batch {
  std::uint64_t first = 0;
  int size = 0;
};

/// Runs the functors as loops on the calling thread (host-accessible spaces only).
struct host_launch {
  template <class S, class F>
  static void range(typename S::stream&, int n, const F& f) {
    static_assert(S::host_accessible,
                  "host_launch: a device space needs cuda_launch (device_mlp.cuh)");
    for (int i = 0; i < n; ++i) f(i);
  }
  template <class S>
  static void contract(typename S::stream& st, const mlp_math::contraction& c) {
    range<S>(st, c.rows * c.cols, c);
  }
};

/// The MLP as a fedshard::Model (batches: mlp_batch); Launch runs its functors (host_launch
/// here, cuda_launch in device_mlp.cuh).
template <class Launch>
struct basic_mlp {
  mlp_config cfg{};

  int units_count() const { return cfg.hidden_layers + 1; }
  int fan_in(int u) const { return u == 0 ? cfg.input : cfg.hidden; }
  int fan_out(int u) const { return u == cfg.hidden_layers ? cfg.output : cfg.hidden; }

  std::vector<fedshard::unit_spec> units() const {
    std::vector<fedshard::unit_spec> us;
    for (int u = 0; u < units_count(); ++u) {
      const std::string n = std::to_string(u);
      us.push_back({u == cfg.hidden_layers ? "head" : "layer" + n,
                    {{"w" + n, {fan_out(u), fan_in(u)}}, {"b" + n, {fan_out(u)}}}});
    }
    return us;
  }

  /// Unit u's starting values: uniform in [-1, 1) / sqrt(fan_in), the same on every rank.
  std::vector<float> initial_values(const fedshard::flat_layout& l, std::size_t u) const {
    std::vector<float> v(l.unit(u).numel);
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(fan_in(int(u)))));
    for (std::size_t i = 0; i < v.size(); ++i)
      v[i] = scale * mlp_math::uniform(cfg.init_seed + 101 * u, i);
    return v;
  }

  /// Samples in a batch (the weight of weighted federation).
  std::int64_t tokens(const mlp_batch& b) const { return b.size; }

  /// The batch of data-parallel stream `index` of `count` at step `step`, `per_rank` samples:
  /// the streams read disjoint parts of the sample stream.
  static mlp_batch batch(std::int64_t step, int index, int count, int per_rank) {
    const auto first = (static_cast<std::uint64_t>(step) * static_cast<std::uint64_t>(count) +
                        static_cast<std::uint64_t>(index)) *
                       static_cast<std::uint64_t>(per_rank);
    return {.first = first, .size = per_rank};
  }

  /// One training step's loss; the gradients go to ctx.grad_buffer.
  template <class Ctx>
  float forward_backward(Ctx& ctx, const mlp_batch& batch) {
    return run(ctx, batch, true);
  }
  /// The loss without gradients (forward only).
  template <class Ctx>
  float evaluate(Ctx& ctx, const mlp_batch& batch) {
    return run(ctx, batch, false);
  }

 private:
  template <class Ctx>
  float run(Ctx& ctx, const mlp_batch& batch, bool train) {
    namespace m = mlp_math;
    using S = typename Ctx::space_type;
    S& sp = ctx.space();
    auto& st = ctx.stream();
    const fedshard::flat_layout& l = ctx.layout();
    const int B = batch.size, D = cfg.input, H = cfg.hidden, O = cfg.output, L = cfg.hidden_layers;
    auto buf = [&](int n) { return sp.template allocate<float>(static_cast<std::size_t>(n)); };
    using buffer = decltype(buf(1));
    auto x = buf(B * D), t = buf(B * O), y = buf(B * O), dy = buf(B * O), per_sample = buf(B),
         loss = buf(1), d_out = buf(B * H), d_in = buf(B * H);
    std::vector<buffer> z, a;
    for (int u = 0; u < L; ++u) {
      z.push_back(buf(B * H));
      a.push_back(buf(B * H));
    }
    const float teacher_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
    Launch::template range<S>(st, B * D, m::make_inputs{cfg.data_seed, batch.first, D, x.data()});
    Launch::template range<S>(
        st, B * O, m::make_targets{cfg.data_seed + 1, x.data(), t.data(), D, O, teacher_scale});
    auto weights = [&](auto p, int u) { return l.tensor_view(p, std::size_t(u), 0).data(); };
    auto biases = [&](auto p, int u) { return l.tensor_view(p, std::size_t(u), 1).data(); };
    auto input_of = [&](int u) -> const float* { return u == 0 ? x.data() : a[u - 1].data(); };

    // forward: s(W_u in + b_u) for the hidden layers, then the head, the loss and dy
    for (int u = 0; u < L; ++u) {
      auto p = ctx.acquire(std::size_t(u));
      const int in = fan_in(u);
      Launch::template contract<S>(st, {.a = {input_of(u), in, 1},
                                        .b = {weights(p, u), 1, in},
                                        .rows = B,
                                        .cols = H,
                                        .depth = in,
                                        .out = z[u].data(),
                                        .bias = biases(p, u),
                                        .act = a[u].data()});
      ctx.release(std::size_t(u));
    }
    const auto head = std::size_t(L);
    {
      auto p = ctx.acquire(head);
      const int in = fan_in(L);
      Launch::template contract<S>(st, {.a = {input_of(L), in, 1},
                                        .b = {weights(p, L), 1, in},
                                        .rows = B,
                                        .cols = O,
                                        .depth = in,
                                        .out = y.data(),
                                        .bias = biases(p, L)});
      if (train)
        Launch::template range<S>(st, B * O, m::loss_grad{y.data(), t.data(), dy.data(), B});
      Launch::template range<S>(st, B, m::sample_loss{y.data(), t.data(), per_sample.data(), O});
      Launch::template range<S>(st, 1, m::batch_loss{per_sample.data(), loss.data(), B});
      ctx.release(head);
    }

    // backward: unit u's gradients from dz (its output gradient), then dz of the unit below
    const float* dz = dy.data();
    float* dx = d_in.data();  // dz and dx alternate between d_in and d_out
    for (int u = train ? L : -1; u >= 0; --u) {
      const auto uu = std::size_t(u);
      auto p = ctx.acquire(uu, fedshard::phase::backward);
      auto g = ctx.grad_buffer(uu);
      const int in = fan_in(u), out = fan_out(u);
      Launch::template contract<S>(st, {.a = {dz, 1, out},
                                        .b = {input_of(u), in, 1},
                                        .rows = out,
                                        .cols = in,
                                        .depth = B,
                                        .out = weights(g, u),
                                        .accumulate = true});
      Launch::template range<S>(st, out, m::bias_grad{dz, biases(g, u), out, B});
      if (u > 0) {
        Launch::template contract<S>(st, {.a = {dz, out, 1},
                                          .b = {weights(p, u), in, 1},
                                          .rows = B,
                                          .cols = in,
                                          .depth = out,
                                          .out = dx,
                                          .gate = z[u - 1].data()});
      }
      ctx.release(uu);
      ctx.grads_ready(uu);
      if (u > 0) {
        dz = dx;
        dx = dx == d_in.data() ? d_out.data() : d_in.data();
      }
    }

    float value = 0.0f;
    sp.to_host(st, loss.view(), fedshard::view(std::span<float>(&value, 1)));
    sp.synchronize(st);  // the loss, and the scratch buffers above may go
    return value;
  }
};

/// The MLP on host spaces.
using host_mlp = basic_mlp<host_launch>;

}  // namespace fedshard_examples
