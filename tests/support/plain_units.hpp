#pragma once
/// Test support: a model's unit hooks over plain full buffers (one rank, no sharding), for
/// checking its hand-written backward without an engine.

#include <cstddef>
#include <span>
#include <vector>

#include "fedshard/plan/comm_op.hpp"
#include "fedshard/shard/flat_layout.hpp"

namespace fedshard::test {

/// Every unit of model m whole, its initial values with the padding zero in p, its gradients
/// (zero at first) in g.
struct plain_units {
  flat_layout l;
  std::vector<std::vector<float>> p, g;

  template <class M>
  explicit plain_units(const M& m) : l(m.units(), 1) {
    for (std::size_t u = 0; u < l.num_units(); ++u) {
      auto v = m.initial_values(l, u);
      v.resize(l.unit(u).padded_numel, 0.0f);
      p.push_back(v);
      g.emplace_back(v.size(), 0.0f);
    }
  }
  const flat_layout& layout() const { return l; }
  std::span<const float> acquire(std::size_t u, phase = phase::forward) { return p[u]; }
  void release(std::size_t) {}
  std::span<float> grad_buffer(std::size_t u) { return g[u]; }
  void grads_ready(std::size_t) {}
  bool takes_gradients(std::size_t) const { return true; }
};

}  // namespace fedshard::test
