#pragma once
// The demo's two models (--model), each with what train<A> needs of it: how to make it, the
// batch a rank trains on at a step and evaluates on, the tokens the world trains on per step,
// and the evaluation loss over the world.
//  - mlp: charlm::model (the k-gram MLP; its batches are examples of 8 characters);
//  - attention: charlm::attention_model (causal attention over sequences of up to 256
//    characters, skewed lengths: charlm::draw_sequences). Under an algorithm with context
//    parallelism over the group (fcp), every rank of a group is given the group's batch,
//    batch x (ranks in the group) sequences, which the model spreads over them; otherwise
//    each rank draws batch sequences of its own. Both evaluate the same sequences: eval_examples
//    / 16 of them (at least one per rank), dealt to the ranks (no context parallelism) or to
//    the groups (context parallelism), the loss weighed by tokens.
#include <cstdint>
#include <optional>
#include <string>

#include "charlm/attention_model.hpp"
#include "charlm/charlm.hpp"
#include "fedshard/error.hpp"
#include "fedshard/mesh/mesh.hpp"

namespace demo {

/// charlm::model (--model mlp).
struct mlp_kit {
  using model_type = charlm::model;
  using batch_type = charlm::batch;

  const charlm::corpus* data;
  charlm::dims dims;  ///< demo::dims_of the settings
  int batch = 16;     ///< examples per rank per step
  int eval_examples = 1024;
  std::uint64_t seed = 1;

  model_type make() const { return model_type(dims, seed); }
  /// Rank `rank`'s examples at step `step`.
  template <class M>
  batch_type train_batch(const M& m, int step) const {
    return model_type::training_batch(*data, dims.context, seed, step, m.rank(), batch);
  }
  /// The world's eval examples, rank r's share of them (equal shares).
  template <class M>
  batch_type eval_batch(const M& m) const {
    const auto all = model_type::eval_batch(*data, dims.context, eval_examples);
    const std::size_t per = all.size() / static_cast<std::size_t>(m.size());
    const auto r = static_cast<std::size_t>(m.rank());
    return {all.begin() + static_cast<std::ptrdiff_t>(per * r),
            all.begin() + static_cast<std::ptrdiff_t>(per * (r + 1))};
  }
  /// Tokens the world trains on per step (every rank's batch).
  template <class M>
  double world_tokens(const M& m, int) const {
    return double(m.size()) * batch;
  }
  /// The mean evaluation loss over the world (equal shares: the mean of the ranks').
  template <class T>
  double eval_loss(T& t, const batch_type& b) const {
    return t.mean_over_world(t.evaluate(b));
  }
};

/// charlm::attention_model (--model attention).
struct attention_kit {
  using model_type = charlm::attention_model;
  using batch_type = charlm::sequence_batch;
  static constexpr int max_length = 256;

  const charlm::corpus* data;
  int batch = 16;  ///< sequences per rank per step
  int eval_examples = 1024;
  std::uint64_t seed = 1;
  std::optional<fedshard::axis> context;  ///< trainer_options::context_axis

  model_type make() const {
    return model_type({.vocab = data->vocab(),
                       .embed = 32,
                       .head = 16,
                       .max_length = max_length,
                       .block_tokens = 16},
                      seed);
  }
  /// Context parallelism over the group: the group's batch, shared by its ranks.
  template <class M>
  batch_type train_batch(const M& m, int step) const {
    check(m);
    if (context)
      return charlm::draw_sequences(*data, max_length, seed, step, m.coords().group,
                                    batch * m.axis_size(fedshard::axis::group));
    return charlm::draw_sequences(*data, max_length, seed, step, m.rank(), batch);
  }
  /// The eval sequences dealt to the ranks, or to the groups under context parallelism.
  template <class M>
  batch_type eval_batch(const M& m) const {
    const int n = std::max(m.size(), eval_examples / 16);
    const auto all =
        charlm::draw_sequences(*data, max_length, seed, 0, 0, n, charlm::part::evaluation);
    const int takers = context ? m.shape().groups : m.size();
    const int mine = context ? m.coords().group : m.rank();
    batch_type b;
    for (int i = mine; i < n; i += takers)
      b.sequences.push_back(all.sequences[static_cast<std::size_t>(i)]);
    return b;
  }
  /// Tokens the world trains on at `step`: every stream's batch (one per group under context
  /// parallelism, one per rank otherwise), drawn again here (a few KB).
  template <class M>
  double world_tokens(const M& m, int step) const {
    const int streams = context ? m.shape().groups : m.size();
    const int count = context ? batch * m.axis_size(fedshard::axis::group) : batch;
    double n = 0;
    for (int k = 0; k < streams; ++k)
      for (const auto& q :
           charlm::draw_sequences(*data, max_length, seed, step, k, count).sequences)
        n += double(q.size() - 1);
    return n;
  }
  /// The evaluation loss over the world, weighed by tokens.
  template <class T>
  double eval_loss(T& t, const batch_type& b) const {
    (void)t.evaluate(b);
    const double sum = t.mean_over_world(t.model().last_loss_sum());
    const double tokens = t.mean_over_world(double(t.model().last_tokens()));
    return sum / tokens;
  }

 private:
  template <class M>
  void check(const M& m) const {
    FEDSHARD_EXPECTS(!context || *context == fedshard::axis::group,
                     "demo: the attention model spreads a group's batch over the group axis "
                     "(fcp's), found the ",
                     to_string(*context), " axis");
    (void)m;
  }
};

}  // namespace demo
