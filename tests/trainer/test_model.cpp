// The tensor-backend boundary: bounds-checked tensor views, the step_context a model computes
// with, the Model concept, tokens_of, and what a model that writes outside its tensors gets
// inside a real trainer step.
#define FEDSHARD_CHECKED_VIEWS 1
#include "fedshard/trainer/model.hpp"

#include <doctest/doctest.h>

#include <array>
#include <mutex>
#include <string>
#include <typeinfo>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;

namespace {

/// Unit hooks over plain full buffers (one rank, no sharding) that count the calls.
struct plain_hooks final : detail::unit_hooks<> {
  flat_layout l;
  std::vector<std::vector<float>> p, g;
  space::host_space host;
  space::host_space::stream st;
  int acquires = 0, params_calls = 0, releases = 0, grad_buffers = 0, readies = 0;

  explicit plain_hooks(std::vector<unit_spec> units) : l(std::move(units), 1) {
    for (std::size_t u = 0; u < l.num_units(); ++u) {
      std::vector<float> v(l.unit(u).padded_numel);
      for (std::size_t i = 0; i < l.unit(u).numel; ++i) v[i] = float(100 * u + i);
      p.push_back(v);
      g.emplace_back(v.size(), 0.0f);
    }
  }
  const flat_layout& layout() const override { return l; }
  space::host_space& space() override { return host; }
  space::host_space::stream& compute_stream() override { return st; }
  phase last_phase = phase::setup;
  std::span<const float> acquire(std::size_t u, phase ph) override {
    ++acquires;
    last_phase = ph;
    return p.at(u);
  }
  std::span<const float> params(std::size_t u) override {
    ++params_calls;
    return p.at(u);
  }
  void release(std::size_t) override { ++releases; }
  std::span<float> grad_buffer(std::size_t u) override {
    ++grad_buffers;
    return g.at(u);
  }
  void grads_ready(std::size_t) override { ++readies; }
  const_buffer_view acquire_as(std::size_t u, phase ph, dtype t) override {
    REQUIRE(t == dtype::f32);
    return cview(acquire(u, ph));
  }
  buffer_view grad_buffer_as(std::size_t u, dtype t) override {
    REQUIRE(t == dtype::f32);
    return view(grad_buffer(u));
  }
};

/// "layer" {w [2, 3], b [2]}, "head" {w [4]}: "w" is in both units, "b" in one.
std::vector<unit_spec> two_units() {
  return {{"layer", {{"w", {2, 3}}, {"b", {2}}}}, {"head", {{"w", {4}}}}};
}

}  // namespace

TEST_CASE("tensor_view reads and writes inside its tensor, throws outside naming both") {
  plain_hooks h(two_units());
  step_context ctx(h, true, 0, 0);
  tensor_view<const float> w = ctx.param(0, 0);
  CHECK(w.size() == 6);
  CHECK(w.shape() == std::vector<std::int64_t>{2, 3});
  CHECK(w[5] == 5.0f);
  CHECK(w.data() == h.p[0].data());
  CHECK(std::span<const float>(w).size() == 6);
  CHECK(w.span().data() == w.data());
  float sum = 0;
  for (float x : w) sum += x;
  CHECK(sum == 15.0f);
  CHECK_THROWS_WITH_AS(w[6], doctest::Contains("index 6 is outside tensor 'w' of 6 elements"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(w[std::size_t(-1)], doctest::Contains("outside tensor 'w'"),
                       invalid_argument);

  tensor_view<float> gb = ctx.grad(0, 1);
  CHECK(gb.shape() == std::vector<std::int64_t>{2});
  gb[1] = 2.5f;
  CHECK(h.g[0][7] == 2.5f);  // b sits after w's 6 elements
  CHECK_THROWS_WITH_AS(gb[2] = 1.0f,
                       doctest::Contains("index 2 is outside tensor 'b' of 2 elements"),
                       invalid_argument);
  CHECK(h.g[0][8] == 0.0f);  // the padding after b was not written

  const tensor_view<float> empty;
  CHECK(empty.size() == 0);
  CHECK_THROWS_WITH_AS(empty[0], doctest::Contains("outside tensor '?' of 0 elements"),
                       invalid_argument);
}

TEST_CASE("step_context: parameters and gradients by index and by name") {
  plain_hooks h(two_units());
  step_context ctx(h, true, 41, 3);
  CHECK(ctx.training());
  CHECK(ctx.step() == 41);
  CHECK(ctx.rank() == 3);
  CHECK(&ctx.layout() == &h.l);

  CHECK(ctx.param("b")[0] == 6.0f);  // unit 0, elements [6, 8)
  CHECK(ctx.param("layer.b")[1] == 7.0f);
  CHECK(ctx.param("head.w")[3] == 103.0f);
  CHECK(ctx.param(1, 0).data() == ctx.param("head.w").data());
  CHECK_THROWS_WITH_AS(ctx.param("w"), doctest::Contains("ambiguous"), invalid_argument);
  CHECK_THROWS_WITH_AS(ctx.param("nope"), doctest::Contains("no tensor named 'nope'"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(ctx.param(0, 2), doctest::Contains("has 2 tensors, asked for tensor 2"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(ctx.grad(1, 1), doctest::Contains("has 1 tensors, asked for tensor 1"),
                       invalid_argument);

  ctx.grad("head.w")[0] = 1.5f;
  CHECK(h.g[1][0] == 1.5f);
  ctx.grad("layer.w")[5] = -1.0f;
  CHECK(h.g[0][5] == -1.0f);
  CHECK(ctx.grad_buffer(1).size() == h.l.unit(1).padded_numel);

  // the hooks are forwarded as they are called
  const int before_acquires = h.acquires;
  ctx.acquire(1);
  CHECK(h.last_phase == phase::forward);  // the default phase
  ctx.acquire(1, phase::backward);
  CHECK(h.last_phase == phase::backward);
  ctx.release(1);
  ctx.grads_ready(1);
  CHECK(h.acquires == before_acquires + 2);
  CHECK(h.releases == 1);
  CHECK(h.readies == 1);
  CHECK(ctx.params(0).data() == h.p[0].data());
}

TEST_CASE("in evaluation, gradients are refused without touching the hooks") {
  plain_hooks h(two_units());
  step_context ctx(h, false, 0, 0);
  CHECK_FALSE(ctx.training());
  CHECK(ctx.param("b")[0] == 6.0f);  // parameters are fine
  CHECK_THROWS_WITH_AS(ctx.grad(0, 0), doctest::Contains("grad called during evaluation"),
                       invalid_argument);
  CHECK_THROWS_WITH_AS(ctx.grad("b"), doctest::Contains("during evaluation"), invalid_argument);
  CHECK_THROWS_WITH_AS(ctx.grad_buffer(0),
                       doctest::Contains("grad_buffer called during evaluation"), invalid_argument);
  CHECK_THROWS_WITH_AS(ctx.grads_ready(0),
                       doctest::Contains("grads_ready called during evaluation"), invalid_argument);
  CHECK(h.grad_buffers == 0);
  CHECK(h.readies == 0);
}

namespace {

struct no_forward_backward {
  std::vector<unit_spec> units() const { return {}; }
};
struct forward_backward_returns_nothing {
  std::vector<unit_spec> units() const { return {}; }
  void forward_backward(step_context&, const std::vector<float>&) {}
};
struct units_of_wrong_type {
  std::vector<int> units() const { return {}; }
  float forward_backward(step_context&, const std::vector<float>&) { return 0; }
};
struct minimal_model {
  std::vector<unit_spec> units() const { return {{"u", {{"t", {1}}}}}; }
  double forward_backward(step_context&, const std::vector<float>&) { return 0; }
};

struct counts_tokens {
  std::int64_t tokens(const std::vector<int>& b) const { return 10 * std::int64_t(b.size()); }
};
struct counts_other_batches {
  std::int64_t tokens(const std::string&) const { return 99; }
};
struct counts_tokens_non_const {
  std::int64_t tokens(const std::vector<int>&) { return 7; }
};
struct opaque_batch {
  int id = 0;
};

}  // namespace

TEST_CASE("Model accepts the test MLP and a minimal model, refuses incomplete ones") {
  CHECK(Model<test::mlp_model, std::vector<test::sample>>);
  CHECK(Model<minimal_model, std::vector<float>>);
  CHECK_FALSE(Model<test::mlp_model, int>);  // no forward_backward for that batch
  CHECK_FALSE(Model<no_forward_backward, std::vector<float>>);
  CHECK_FALSE(Model<forward_backward_returns_nothing, std::vector<float>>);
  CHECK_FALSE(Model<units_of_wrong_type, std::vector<float>>);
}

TEST_CASE("tokens_of: the model's tokens(), else the batch's size, else 1") {
  const std::vector<int> three{1, 2, 3};
  CHECK(tokens_of(counts_tokens{}, three) == 30);
  CHECK(tokens_of(counts_other_batches{}, three) == 3);
  CHECK(tokens_of(counts_other_batches{}, std::string("ab")) == 99);
  CHECK(tokens_of(test::mlp_model{}, std::vector<test::sample>(5)) == 5);
  CHECK(tokens_of(minimal_model{}, std::array<float, 7>{}) == 7);
  CHECK(tokens_of(minimal_model{}, opaque_batch{}) == 1);
  CHECK(tokens_of(minimal_model{}, std::vector<int>{}) == 0);
}

TEST_CASE("tokens_of uses a tokens() that is not const instead of ignoring it") {
  // The trainer holds its model non-const and calls forward_backward on it; a tokens() it
  // can call must not be skipped silently (the groups' weights would be batch sizes).
  counts_tokens_non_const m;
  CHECK(tokens_of(m, std::vector<int>{1, 2, 3}) == 7);
}

namespace {

/// One unit {w [4], b [2]}; writes b[2] (one past its end) on the ranks told to.
struct writes_outside {
  bool outside = true;
  std::vector<unit_spec> units() const { return {{"layer", {{"w", {4}}, {"b", {2}}}}}; }
  float forward_backward(step_context& ctx, const std::vector<float>& batch) {
    auto w = ctx.param("w");
    auto gb = ctx.grad("b");
    gb[0] = w[0] + batch.at(0);
    if (outside) gb[2] = 1.0f;
    return 0.0f;
  }
};

struct rank_error {
  std::string type;
  std::string what;
};

}  // namespace

TEST_CASE("a model writing outside a tensor in a trainer step fails the step on every rank") {
  using fsdp_trainer = trainer<writes_outside, fsdp, optim::sgd, inproc::communicator>;
  SUBCASE("every rank writes outside: each gets its own invalid_argument") {
    std::vector<rank_error> errors(2);
    test::spawn_ranks(
        2,
        [&](inproc::communicator& world) {
          mesh m(world, {1, 1, 2});
          fsdp_trainer t(m, writes_outside{}, {.lr = 0.1f});
          auto& e = errors[static_cast<std::size_t>(world.rank())];
          try {
            t.step(std::vector<float>{1.0f});
          } catch (const invalid_argument& ex) {
            e = {"invalid_argument", ex.what()};
          } catch (const std::exception& ex) {
            e = {typeid(ex).name(), ex.what()};
          }
        },
        test::short_timeout(60));
    for (const auto& e : errors) {
      CHECK(e.type == "invalid_argument");
      CHECK(e.what.find("index 2 is outside tensor 'b' of 2 elements") != std::string::npos);
    }
  }
  SUBCASE("one rank writes outside: it throws invalid_argument, its peer peer_failure") {
    std::vector<rank_error> errors(2);
    std::mutex mu;
    auto body = [&](inproc::communicator& world) {
      auto record = [&](std::string type, const char* what) {
        std::lock_guard lock(mu);
        errors[static_cast<std::size_t>(world.rank())] = {std::move(type), what};
      };
      try {
        mesh m(world, {1, 1, 2});
        writes_outside model;
        model.outside = world.rank() == 1;
        fsdp_trainer t(m, model, {.lr = 0.1f});
        t.step(std::vector<float>{1.0f});
      } catch (const invalid_argument& ex) {
        record("invalid_argument", ex.what());
        throw;
      } catch (const peer_failure& ex) {
        record("peer_failure", ex.what());
        throw;
      } catch (const std::exception& ex) {
        record(typeid(ex).name(), ex.what());
        throw;
      }
    };
    // the first failure is rethrown by the runner: rank 1's
    CHECK_THROWS_WITH_AS(test::spawn_ranks(2, body, test::short_timeout(60)),
                         doctest::Contains("outside tensor 'b'"), invalid_argument);
    CHECK(errors[1].type == "invalid_argument");
    CHECK(errors[1].what.find("index 2 is outside tensor 'b' of 2 elements") != std::string::npos);
    CHECK(errors[0].type == "peer_failure");
    CHECK(errors[0].what.find("world rank 1") != std::string::npos);  // names the culprit
  }
}
