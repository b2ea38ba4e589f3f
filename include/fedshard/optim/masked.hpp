#pragma once
/// optim::masked<O, S>: the masked step of an element-wise ShardOptimizer O (shard::sparse's
/// optimizer step): only the elements of a shard at given indices are updated.
///
/// The step gathers the parameters and every state buffer of the main optimizer at the
/// indices into a packed optimizer of k elements (an O of its own, with the main one's
/// settings), which takes one step with the main one's step count and the packed gradients;
/// then the parameters and the state are scattered back and the main optimizer's step count
/// advances by one. O's updates are element-wise (optim/optimizer.hpp, requirement 4), so
/// each updated element gets bit for bit what a full step would give it, and every other
/// element keeps its parameter and its whole state (no weight decay either). The packing
/// runs through the memory space's gather_index / scatter_index (kernels/index.hpp) on the
/// step's stream, so it works wherever O does. Cost: O(k) per step, and the packed
/// optimizer's state (k elements per state buffer) plus k packed parameters.

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/optim/optimizer.hpp"
#include "fedshard/space/host_space.hpp"

namespace fedshard::optim {

/// The masked step of optimizer O (of shards in memory space S) over k elements; see the
/// file comment.
template <class O, class S = space::host_space>
class masked {
 public:
  /// A packed optimizer of k elements with settings cfg, its buffers in space.
  masked(const typename O::config& cfg, std::size_t k, S& space)
      : space_(&space), packed_(make(cfg, k, space)), param_(space.template allocate<float>(k)) {}

  /// Elements the masked step updates (k).
  std::size_t size() const noexcept { return param_.size(); }
  /// The bytes it holds: the packed optimizer's state and the k packed parameters.
  std::size_t bytes() {
    std::size_t n = param_.size();
    for (const state_tensor& t : packed_.state()) n += t.data.size();
    return n * sizeof(float);
  }

  /// One step of main (whose shard is param) at the k elements idx (offsets into param,
  /// distinct) with their gradients `grad` (k values, packed in idx's order) and learning
  /// rate lr, queued on st; invalid_argument unless idx and grad hold k elements.
  void step(O& main, std::span<float> param, std::span<const float> grad,
            std::span<const std::uint32_t> idx, float lr, typename S::stream& st) {
    FEDSHARD_EXPECTS(idx.size() == size() && grad.size() == size(),
                     "optim::masked::step: "
                     "expected ",
                     size(), " indices and packed gradients, found ", idx.size(), " and ",
                     grad.size());
    std::vector<state_tensor> ms = main.state(), ps = packed_.state();
    for (std::size_t t = 0; t < ms.size(); ++t)
      space_->gather_index(st, ms[t].data, idx, 0, ps[t].data);
    space_->gather_index(st, param, idx, 0, param_.span());
    packed_.set_step_count(main.step_count());
    packed_.step(param_.span(), grad, lr, st);
    space_->scatter_index(st, param_.span(), idx, 0, param);
    for (std::size_t t = 0; t < ms.size(); ++t)
      space_->scatter_index(st, ps[t].data, idx, 0, ms[t].data);
    main.set_step_count(main.step_count() + 1);
  }

 private:
  static O make(const typename O::config& cfg, std::size_t k, S& space) {
    if constexpr (std::is_constructible_v<O, typename O::config, std::size_t, S&>)
      return O(cfg, k, space);
    else
      return O(cfg, k);
  }

  S* space_;
  O packed_;
  typename S::template buffer<float> param_;
};

}  // namespace fedshard::optim
