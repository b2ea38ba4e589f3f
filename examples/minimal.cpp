// The shortest useful fedshard program: a model, FL+HSDP, 8 in-process ranks, a few steps.
#include <cstdio>
#include <vector>

#include <fedshard/fedshard.hpp>

// y = w . x + b, fitted to y = 2 x0 - x1 + 0.5 (squared error). One unit = one all-gather.
struct linear {
  std::vector<fedshard::unit_spec> units() const { return {{"layer", {{"w", {2}}, {"b", {1}}}}}; }

  float forward_backward(fedshard::step_context& ctx, const std::vector<std::vector<float>>& xs) {
    std::vector<float> err;  // forward: the unit's parameters are gathered, then freed
    ctx.acquire(0);
    for (const auto& x : xs)
      err.push_back(ctx.param(0, 0)[0] * x[0] + ctx.param(0, 0)[1] * x[1] + ctx.param(0, 1)[0] -
                    (2 * x[0] - x[1] + 0.5f));
    ctx.release(0);
    ctx.acquire(0, fedshard::phase::backward);  // backward: gathered again, gradients reduced
    auto gw = ctx.grad(0, 0), gb = ctx.grad(0, 1);
    float loss = 0;
    for (std::size_t i = 0; i < xs.size(); ++i) {
      loss += err[i] * err[i] / xs.size();
      gw[0] += 2 * err[i] * xs[i][0] / xs.size();
      gw[1] += 2 * err[i] * xs[i][1] / xs.size();
      gb[0] += 2 * err[i] / xs.size();
    }
    ctx.release(0);
    ctx.grads_ready(0);
    return loss;
  }
};

int main() {
  fedshard::inproc::run(8, [](fedshard::inproc::communicator& world) {
    fedshard::mesh mesh(world, {.groups = 2, .replicas = 2, .shards = 2});
    fedshard::trainer<linear, fedshard::fl_hsdp, fedshard::optim::adamw,
                      fedshard::inproc::communicator>
        t(mesh, linear{}, {.lr = 0.05f}, {.schedule = {.period = 8}});
    for (int step = 0; step < 200; ++step) {
      std::vector<std::vector<float>> batch;  // each rank draws its own data
      for (int i = 0; i < 4; ++i)
        batch.push_back({float((step * 7 + i * 3 + world.rank()) % 11) / 5 - 1,
                         float((step * 5 + i + 2 * world.rank()) % 13) / 6 - 1});
      const float loss = t.step(batch);
      if (world.rank() == 0 && step % 50 == 49)
        std::printf("step %3d  loss %.5f\n", step + 1, loss);
    }
    const auto w = t.tensor("w"), b = t.tensor("b");  // collective: every rank asks
    if (world.rank() == 0)
      std::printf(
          "w = (%.3f, %.3f), b = %.3f  (target 2, -1, 0.5); %.0f bytes/rank crossed groups\n", w[0],
          w[1], b[0], t.traffic()[fedshard::axis::federation].wire_bytes);
  });
}
