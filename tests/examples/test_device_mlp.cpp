// The MLP of examples/gpu/device_mlp.hpp on the host (its CUDA path is tested by
// tests/cuda/test_trainer_gpu.cu): its gradients against finite differences for several
// depths, its sample stream, and training through the trainer.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <span>
#include <utility>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/space/host_space.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "gpu/device_mlp.hpp"
#include "support/plain_units.hpp"

namespace {

using fedshard_examples::host_mlp;
using fedshard_examples::mlp_batch;
using fedshard_examples::mlp_config;

/// A step context over plain full buffers of a host space (one rank, no sharding).
struct plain_ctx : fedshard::test::plain_units {
  using space_type = fedshard::space::host_space;
  space_type sp;
  space_type::stream st;

  using plain_units::plain_units;
  space_type& space() { return sp; }
  space_type::stream& stream() { return st; }
};

void check_gradients(mlp_config cfg) {
  host_mlp m{cfg};
  const mlp_batch b = host_mlp::batch(2, 1, 3, 4);
  plain_ctx ctx(m);
  const float loss = m.forward_backward(ctx, b);
  REQUIRE(std::isfinite(loss));
  REQUIRE(loss > 0.0f);
  const float h = 1e-2f;
  for (std::size_t u = 0; u < ctx.l.num_units(); ++u) {
    const std::size_t n = ctx.l.unit(u).numel;
    for (std::size_t i = 0; i < n; i += std::max<std::size_t>(1, n / 7)) {
      auto at = [&](float delta) {
        plain_ctx c(m);
        c.p[u][i] += delta;
        return m.forward_backward(c, b);
      };
      const double fd = (double(at(h)) - double(at(-h))) / (2.0 * h);
      INFO("hidden layers ", cfg.hidden_layers, ", unit ", u, ", element ", i);
      CHECK(std::abs(fd - ctx.g[u][i]) <= 2e-3 + 2e-2 * std::abs(fd));
    }
  }
}

TEST_CASE("device_mlp on the host: gradients match finite differences") {
  for (int layers : {0, 1, 2, 3})
    check_gradients({.input = 5, .hidden = 6, .output = 3, .hidden_layers = layers});
}

TEST_CASE("device_mlp: units, initial values and the sample stream") {
  const host_mlp m{{.input = 5, .hidden = 6, .output = 3, .hidden_layers = 2}};
  const auto us = m.units();
  REQUIRE(us.size() == 3);
  CHECK(us[0].name == "layer0");
  CHECK(us[2].name == "head");
  CHECK(us[2].tensors[0].shape == std::vector<std::int64_t>{3, 6});
  const fedshard::flat_layout l(us, 1);
  CHECK(m.initial_values(l, 1) == m.initial_values(l, 1));
  CHECK(m.initial_values(l, 1) != m.initial_values(l, 0));
  // streams of a step are disjoint and consecutive; steps follow each other
  CHECK(host_mlp::batch(0, 1, 4, 8).first == 8);
  CHECK(host_mlp::batch(1, 0, 4, 8).first == 32);
  CHECK(m.tokens(host_mlp::batch(1, 0, 4, 8)) == 8);
  for (std::uint64_t i = 0; i < 1000; ++i) {
    const float v = fedshard_examples::mlp_math::uniform(3, i);
    REQUIRE(v >= -1.0f);
    REQUIRE(v < 1.0f);
  }
}

/// Rank 0's losses and final parameters after `steps` steps of A on 2 host ranks.
template <class A>
std::pair<std::vector<float>, std::vector<float>> train(fedshard::mesh_shape shape, int steps) {
  std::vector<float> losses, params;
  fedshard::inproc::run(2, [&](fedshard::inproc::communicator& world) {
    fedshard::mesh mesh(world, shape);
    const host_mlp model{{.input = 8, .hidden = 32, .output = 4, .hidden_layers = 2}};
    fedshard::trainer<host_mlp, A, fedshard::optim::adamw, fedshard::inproc::communicator> t(
        mesh, model, {.lr = 0.01f});
    std::vector<float> ls;
    for (int s = 0; s < steps; ++s) ls.push_back(t.step(host_mlp::batch(s, world.rank(), 2, 16)));
    // evaluate is the step's forward: the same loss, and nothing changes
    const auto b = host_mlp::batch(steps, world.rank(), 2, 16);
    const float before = t.evaluate(b);
    CHECK(t.evaluate(b) == before);
    CHECK(t.step(b) == before);
    auto p = t.parameters();
    if (world.rank() == 0) {
      losses = ls;
      params = p;
    }
  });
  return {losses, params};
}

TEST_CASE("device_mlp trains through the trainer (ddp and fsdp on 2 host ranks agree)") {
  const auto [ddp_losses, ddp_params] = train<fedshard::ddp>({1, 2, 1}, 40);
  const auto [fsdp_losses, fsdp_params] = train<fedshard::fsdp>({1, 1, 2}, 40);
  CHECK(ddp_losses.back() < 0.7f * ddp_losses.front());
  REQUIRE(ddp_params.size() == fsdp_params.size());
  double worst = 0;
  for (std::size_t i = 0; i < ddp_params.size(); ++i)
    worst = std::max(worst, std::abs(double(ddp_params[i]) - fsdp_params[i]));
  CHECK(worst <= 1e-5);
}

}  // namespace
