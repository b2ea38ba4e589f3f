#include "fedshard/optim/optimizer.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "fedshard/optim/adamw.hpp"
#include "fedshard/optim/sgd.hpp"

namespace {

using fedshard::optim::ShardOptimizer;
using fedshard::optim::state_tensor;

/// Everything a ShardOptimizer needs, for the negative checks below to remove one piece at a
/// time.
struct complete {
  struct config {
    float lr = 0.1f;
  };
  complete(config, std::size_t) {}
  void step(std::span<float>, std::span<const float>, float) {}
  std::vector<state_tensor> state() { return {}; }
  std::int64_t step_count() const { return 0; }
  void set_step_count(std::int64_t) {}
  std::size_t size() const { return 0; }
};

struct no_step_count {
  struct config {
    float lr = 0.1f;
  };
  no_step_count(config, std::size_t) {}
  void step(std::span<float>, std::span<const float>, float) {}
  std::vector<state_tensor> state() { return {}; }
  void set_step_count(std::int64_t) {}
  std::size_t size() const { return 0; }
};

struct no_lr {
  struct config {
    float rate = 0.1f;
  };
  no_lr(config, std::size_t) {}
  void step(std::span<float>, std::span<const float>, float) {}
  std::vector<state_tensor> state() { return {}; }
  std::int64_t step_count() const { return 0; }
  void set_step_count(std::int64_t) {}
  std::size_t size() const { return 0; }
};

struct double_step {
  struct config {
    float lr = 0.1f;
  };
  double_step(config, std::size_t) {}
  void step(std::span<double>, std::span<const double>, float) {}
  std::vector<state_tensor> state() { return {}; }
  std::int64_t step_count() const { return 0; }
  void set_step_count(std::int64_t) {}
  std::size_t size() const { return 0; }
};

static_assert(ShardOptimizer<complete>);
static_assert(!ShardOptimizer<no_step_count>);
static_assert(!ShardOptimizer<no_lr>);
static_assert(!ShardOptimizer<double_step>);
static_assert(!ShardOptimizer<int>);
static_assert(ShardOptimizer<fedshard::optim::sgd>);
static_assert(ShardOptimizer<fedshard::optim::adamw>);

template <class O>
typename O::config options();
template <>
fedshard::optim::sgd::config options<fedshard::optim::sgd>() {
  return {.lr = 0.05f, .momentum = 0.9f, .weight_decay = 1e-2f, .nesterov = true};
}
template <>
fedshard::optim::adamw::config options<fedshard::optim::adamw>() {
  return {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = 0.1f};
}

bool bitwise_equal(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

}  // namespace

TEST_CASE_TEMPLATE("a shard split among several optimizers evolves bit for bit as the whole", O,
                   fedshard::optim::sgd, fedshard::optim::adamw) {
  const std::size_t n = 1009;
  // Each split lists where the pieces start; the first is the two halves.
  const std::vector<std::vector<std::size_t>> splits{{0, n / 2}, {0, 1, 500, 1008}, {0, 0, 3}};
  for (const auto& starts : splits) {
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> whole(n);
    for (float& x : whole) x = normal(rng);
    std::vector<float> pieces_param = whole;

    O one(options<O>(), n);
    std::vector<O> pieces;
    for (std::size_t k = 0; k < starts.size(); ++k) {
      const std::size_t end = k + 1 < starts.size() ? starts[k + 1] : n;
      pieces.emplace_back(options<O>(), end - starts[k]);
    }

    for (int step = 0; step < 20; ++step) {
      std::vector<float> grad(n);
      for (float& g : grad) g = normal(rng);
      const float lr = options<O>().lr / static_cast<float>(1 + step);
      one.step(whole, grad, lr);
      for (std::size_t k = 0; k < pieces.size(); ++k) {
        const std::size_t begin = starts[k];
        const std::size_t count = pieces[k].size();
        pieces[k].step(std::span<float>(pieces_param).subspan(begin, count),
                       std::span<const float>(grad).subspan(begin, count), lr);
      }
    }

    CHECK(bitwise_equal(whole, pieces_param));
    const auto whole_state = one.state();
    REQUIRE_FALSE(whole_state.empty());
    for (std::size_t s = 0; s < whole_state.size(); ++s) {
      std::vector<float> joined;
      for (O& piece : pieces) {
        const auto piece_state = piece.state();
        REQUIRE(piece_state.size() == whole_state.size());
        CHECK(piece_state[s].name == whole_state[s].name);
        joined.insert(joined.end(), piece_state[s].data.begin(), piece_state[s].data.end());
      }
      CHECK(bitwise_equal(whole_state[s].data, joined));
    }
    for (const O& piece : pieces) CHECK(piece.step_count() == one.step_count());
  }
}

TEST_CASE_TEMPLATE("a moved optimizer keeps its state", O, fedshard::optim::sgd,
                   fedshard::optim::adamw) {
  O a(options<O>(), 4);
  std::vector<float> param{1.0f, 2.0f, 3.0f, 4.0f};
  a.step(param, std::vector<float>{1.0f, -1.0f, 0.5f, 2.0f}, 0.1f);
  const std::vector<float> first(a.state()[0].data.begin(), a.state()[0].data.end());
  O b(std::move(a));
  CHECK(b.size() == 4);
  CHECK(b.step_count() == 1);
  CHECK(bitwise_equal(b.state()[0].data, first));
}
