#pragma once
/// Test support: a small deterministic MLP with analytic gradients, written against the unit
/// hooks (acquire / release / grad_buffer / grads_ready) so that it runs under any shard
/// policy, plus a deterministic sample stream.
///
/// y = W2 tanh(W1 tanh(W0 x + b0) + b1) + b2, loss = mean over the batch of 0.5 |y - t|^2.
/// Units: "layer0" {w0 [H, D], b0 [H]}, "layer1" {w1 [H, H], b1 [H]}, "head" {w2 [O, H], b2 [O]}.

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "fedshard/plan/comm_op.hpp"
#include "fedshard/shard/flat_layout.hpp"

namespace fedshard::test {

/// One sample of the synthetic regression task.
struct sample {
  std::vector<float> x;
  std::vector<float> t;
};

/// A reproducible value in [-1, 1) from (seed, index).
inline float hash_uniform(std::uint64_t seed, std::uint64_t i) {
  std::uint64_t z = seed * 0x9e3779b97f4a7c15ull + i + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/// The MLP's dimensions and its sample stream.
struct tiny_mlp {
  int d = 8;   ///< input features
  int h = 16;  ///< hidden width
  int o = 4;   ///< outputs

  std::vector<unit_spec> units() const {
    return {{"layer0", {{"w0", {h, d}}, {"b0", {h}}}},
            {"layer1", {{"w1", {h, h}}, {"b1", {h}}}},
            {"head", {{"w2", {o, h}}, {"b2", {o}}}}};
  }

  /// Initial values of unit u (numel of the unit), the same on every rank.
  std::vector<float> init_unit(const flat_layout& l, std::size_t u, std::uint64_t seed) const {
    std::vector<float> v(l.unit(u).numel);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.4f * hash_uniform(seed + 101 * u, i);
    return v;
  }

  /// Sample number i of the global stream.
  sample make_sample(std::uint64_t seed, std::uint64_t i) const {
    sample s{std::vector<float>(static_cast<std::size_t>(d)),
             std::vector<float>(static_cast<std::size_t>(o))};
    for (int k = 0; k < d; ++k) s.x[k] = hash_uniform(seed, i * 64 + static_cast<std::uint64_t>(k));
    for (int k = 0; k < o; ++k) {
      float acc = 0;
      for (int j = 0; j < d; ++j) acc += std::sin(0.3f * static_cast<float>(k + 1) * s.x[j] + j);
      s.t[k] = 0.5f * acc / static_cast<float>(d);
    }
    return s;
  }

  /// Forward and backward over a batch through the hooks of E (shard::engine or a trainer's
  /// step context); writes the batch-mean gradients and returns the mean loss. Backward
  /// stops at the first unit from the top that takes no gradients (a zeroth-order unit: it
  /// and the units below it get none).
  template <class E>
  float forward_backward(E& e, std::span<const sample> batch) const {
    const flat_layout& l = e.layout();
    const auto D = static_cast<std::size_t>(d), H = static_cast<std::size_t>(h),
               O = static_cast<std::size_t>(o);
    const std::size_t B = batch.size();
    std::vector<float> a0(B * H), a1(B * H), y(B * O);
    // forward
    {
      auto p = e.acquire(0);
      auto w0 = l.tensor_view(p, 0, 0), b0 = l.tensor_view(p, 0, 1);
      for (std::size_t n = 0; n < B; ++n)
        for (std::size_t i = 0; i < H; ++i) {
          float z = b0[i];
          for (std::size_t j = 0; j < D; ++j) z += w0[i * D + j] * batch[n].x[j];
          a0[n * H + i] = std::tanh(z);
        }
      e.release(0);
    }
    {
      auto p = e.acquire(1);
      auto w1 = l.tensor_view(p, 1, 0), b1 = l.tensor_view(p, 1, 1);
      for (std::size_t n = 0; n < B; ++n)
        for (std::size_t i = 0; i < H; ++i) {
          float z = b1[i];
          for (std::size_t j = 0; j < H; ++j) z += w1[i * H + j] * a0[n * H + j];
          a1[n * H + i] = std::tanh(z);
        }
      e.release(1);
    }
    float loss = 0;
    std::vector<float> dy(B * O), da1(B * H), da0(B * H);
    const bool t2 = e.takes_gradients(2), t1 = t2 && e.takes_gradients(1),
               t0 = t1 && e.takes_gradients(0);
    {
      auto p = e.acquire(2);
      auto w2 = l.tensor_view(p, 2, 0), b2 = l.tensor_view(p, 2, 1);
      for (std::size_t n = 0; n < B; ++n)
        for (std::size_t k = 0; k < O; ++k) {
          float z = b2[k];
          for (std::size_t j = 0; j < H; ++j) z += w2[k * H + j] * a1[n * H + j];
          const float diff = z - batch[n].t[k];
          loss += 0.5f * diff * diff;
          dy[n * O + k] = diff / static_cast<float>(B);
        }
      // backward of the head: released after forward, acquired again for backward
      e.release(2);
      if (!t2) return loss / static_cast<float>(B);
      p = e.acquire(2, phase::backward);
      w2 = l.tensor_view(p, 2, 0);
      auto g = e.grad_buffer(2);
      auto gw2 = l.tensor_view(g, 2, 0), gb2 = l.tensor_view(g, 2, 1);
      for (std::size_t n = 0; n < B; ++n)
        for (std::size_t k = 0; k < O; ++k) {
          const float gk = dy[n * O + k];
          gb2[k] += gk;
          for (std::size_t j = 0; j < H; ++j) {
            gw2[k * H + j] += gk * a1[n * H + j];
            da1[n * H + j] += gk * w2[k * H + j];
          }
        }
      e.release(2);
      e.grads_ready(2);
    }
    if (!t1) return loss / static_cast<float>(B);
    {
      auto p = e.acquire(1, phase::backward);
      auto w1 = l.tensor_view(p, 1, 0);
      auto g = e.grad_buffer(1);
      auto gw1 = l.tensor_view(g, 1, 0), gb1 = l.tensor_view(g, 1, 1);
      for (std::size_t n = 0; n < B; ++n)
        for (std::size_t i = 0; i < H; ++i) {
          const float dz = da1[n * H + i] * (1 - a1[n * H + i] * a1[n * H + i]);
          gb1[i] += dz;
          for (std::size_t j = 0; j < H; ++j) {
            gw1[i * H + j] += dz * a0[n * H + j];
            da0[n * H + j] += dz * w1[i * H + j];
          }
        }
      e.release(1);
      e.grads_ready(1);
    }
    if (!t0) return loss / static_cast<float>(B);
    {
      e.acquire(0, phase::backward);
      auto g = e.grad_buffer(0);
      auto gw0 = l.tensor_view(g, 0, 0), gb0 = l.tensor_view(g, 0, 1);
      for (std::size_t n = 0; n < B; ++n)
        for (std::size_t i = 0; i < H; ++i) {
          const float dz = da0[n * H + i] * (1 - a0[n * H + i] * a0[n * H + i]);
          gb0[i] += dz;
          for (std::size_t j = 0; j < D; ++j) gw0[i * D + j] += dz * batch[n].x[j];
        }
      e.release(0);
      e.grads_ready(0);
    }
    return loss / static_cast<float>(B);
  }
};

}  // namespace fedshard::test

namespace fedshard::test {

/// tiny_mlp as a fedshard::Model for the trainer: batches are std::vector<sample>.
struct mlp_model {
  tiny_mlp net;
  std::uint64_t init_seed = 7;

  std::vector<unit_spec> units() const { return net.units(); }
  std::vector<float> initial_values(const flat_layout& l, std::size_t u) const {
    return net.init_unit(l, u, init_seed);
  }
  template <class Ctx>
  float forward_backward(Ctx& ctx, const std::vector<sample>& batch) {
    return net.forward_backward(ctx, std::span<const sample>(batch));
  }
  /// Loss without gradients: the forward half of forward_backward.
  template <class Ctx>
  float evaluate(Ctx& ctx, const std::vector<sample>& batch) {
    const flat_layout& l = ctx.layout();
    const auto D = static_cast<std::size_t>(net.d), H = static_cast<std::size_t>(net.h),
               O = static_cast<std::size_t>(net.o);
    float loss = 0;
    for (const auto& s : batch) {
      std::vector<float> a0(H), a1(H);
      auto p0 = ctx.params(0);
      auto w0 = l.tensor_view(p0, 0, 0), b0 = l.tensor_view(p0, 0, 1);
      for (std::size_t i = 0; i < H; ++i) {
        float z = b0[i];
        for (std::size_t j = 0; j < D; ++j) z += w0[i * D + j] * s.x[j];
        a0[i] = std::tanh(z);
      }
      auto p1 = ctx.params(1);
      auto w1 = l.tensor_view(p1, 1, 0), b1 = l.tensor_view(p1, 1, 1);
      for (std::size_t i = 0; i < H; ++i) {
        float z = b1[i];
        for (std::size_t j = 0; j < H; ++j) z += w1[i * H + j] * a0[j];
        a1[i] = std::tanh(z);
      }
      auto p2 = ctx.params(2);
      auto w2 = l.tensor_view(p2, 2, 0), b2 = l.tensor_view(p2, 2, 1);
      for (std::size_t k = 0; k < O; ++k) {
        float z = b2[k];
        for (std::size_t j = 0; j < H; ++j) z += w2[k * H + j] * a1[j];
        loss += 0.5f * (z - s.t[k]) * (z - s.t[k]);
      }
    }
    return loss / static_cast<float>(batch.size());
  }

  /// Rank `local` of a group of `group_size` ranks in group `group`: its batch of `per_rank`
  /// samples at step `step` (groups read disjoint parts of the stream).
  std::vector<sample> batch(std::uint64_t seed, int step, int group, int groups, int local,
                            int group_size, int per_rank) const {
    std::vector<sample> b;
    const auto world = static_cast<std::uint64_t>(groups * group_size * per_rank);
    const auto base = static_cast<std::uint64_t>(step) * world +
                      static_cast<std::uint64_t>((group * group_size + local) * per_rank);
    for (int i = 0; i < per_rank; ++i)
      b.push_back(net.make_sample(seed, base + static_cast<std::uint64_t>(i)));
    return b;
  }
};

}  // namespace fedshard::test
