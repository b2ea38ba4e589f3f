// A LibTorch MLP trained by fedshard: FL+HSDP (parameters averaged across the 2 groups every
// K steps, each group sharding the model over 2 ranks) on 4 in-process ranks. torch computes
// forward and backward; fedshard owns the parameters and gradients, and autograd fires the
// plan's gathers and reductions unit by unit (see torch_model.hpp).
//
//   train_torch [steps] [K]      (defaults 300 and 4)
//
// Task: regress y = sin(2 x0) cos(x1) from x uniform in [-1.5, 1.5]^2; each rank draws its
// own samples.
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <fedshard/comm/inproc.hpp>
#include <fedshard/mesh/axis.hpp>
#include <fedshard/mesh/mesh.hpp>
#include <fedshard/optim/adamw.hpp>
#include <fedshard/trainer/algorithm.hpp>
#include <fedshard/trainer/trainer.hpp>

#include "../common/cli.hpp"
#include "torch_model.hpp"

namespace {

using net_t = torch::nn::Sequential;

fedshard_torch::batch make_batch(at::Generator& gen, std::int64_t n) {
  const torch::Tensor x = torch::rand({n, 2}, gen) * 3.0 - 1.5;
  const torch::Tensor y =
      (torch::sin(2 * x.select(1, 0)) * torch::cos(x.select(1, 1))).unsqueeze(1);
  return {x, y};
}

torch::Tensor mse(net_t& net, const fedshard_torch::batch& b) {
  return torch::mse_loss(net->forward(b.input), b.target);
}

/// Trains for `steps` steps, averaging every `period`.
int train(int steps, int period) {
  constexpr int kRanks = 4;
  torch::set_num_threads(1);  // the ranks are threads: one torch thread each

  torch::manual_seed(0);
  net_t proto(torch::nn::Linear(2, 64), torch::nn::Tanh(), torch::nn::Linear(64, 64),
              torch::nn::Tanh(), torch::nn::Linear(64, 1));
  std::vector<net_t> nets;  // every rank starts from the same initialisation
  for (int r = 0; r < kRanks; ++r) nets.push_back(fedshard_torch::deep_copy(proto));
  auto test_gen = at::detail::createCPUGenerator(12345);
  const fedshard_torch::batch test = make_batch(test_gen, 1024);

  using model = fedshard_torch::torch_model<net_t>;
  fedshard::inproc::run(kRanks, [&](fedshard::inproc::communicator& world) {
    const int rank = world.rank();
    fedshard::mesh mesh(world, {.groups = 2, .replicas = 1, .shards = 2});
    fedshard::trainer<model, fedshard::fl_hsdp, fedshard::optim::adamw,
                      fedshard::inproc::communicator>
        t(mesh, model(nets[static_cast<std::size_t>(rank)], mse), {.lr = 1e-2f},
          {.total_steps = steps, .schedule = {.period = period}});
    if (rank == 0) std::printf("%s", t.layout().describe().c_str());
    const double before = t.evaluate(test);

    auto gen = at::detail::createCPUGenerator(1000 + static_cast<std::uint64_t>(rank));
    double window = 0;
    for (int step = 0; step < steps; ++step) {
      window += t.step(make_batch(gen, 32));
      if ((step + 1) % 50 == 0 || step + 1 == steps) {
        const int n = (step % 50) + 1;
        const double mean = t.mean_over_world(window / n);  // collective: every rank asks
        if (rank == 0) std::printf("step %4d  training loss %.5f\n", step + 1, mean);
        window = 0;
      }
    }
    const double after = t.evaluate(test);

    t.model().load_from(t);  // collective: the torch module takes the trained parameters
    torch::NoGradGuard no_grad;
    const double plain = mse(t.model().net(), test).item<double>();
    if (rank == 0)
      std::printf(
          "test loss %.5f -> %.5f (plain LibTorch on the loaded module: %.5f); K = %d: %lld "
          "syncs, %.0f bytes/rank crossed groups, %.0f stayed in the group; at most %d gathered "
          "units live (limit %d)\n",
          before, after, plain, period, static_cast<long long>(t.syncs_applied()),
          t.traffic()[fedshard::axis::federation].wire_bytes,
          t.traffic()[fedshard::axis::shard].wire_bytes, t.engine().peak_live_units(),
          t.engine().max_live_units());
  });
  return 0;
}

}  // namespace

// Bad arguments ("2.5", "8x", 0, more than two) exit 2 with one line on stderr (common/cli.hpp).
int main(int argc, char** argv) {
  return cli::run_main("train_torch", [&] {
    if (argc > 3)
      cli::fail("expected at most 2 arguments, [steps] [K], found " + std::to_string(argc - 1));
    const int steps = argc > 1 ? cli::parse_integer<int>("steps", argv[1], 1, 1000000) : 300;
    const int period = argc > 2 ? cli::parse_integer<int>("K", argv[2], 1, 1000000) : 4;
    return train(steps, period);
  });
}
