// train_torch's MLP and task on the GPU: FL+HSDP (2 groups of 2 shards, parameters averaged
// every K steps) on 4 gpu_inproc ranks sharing GPU 0. Each rank's module lives on the GPU;
// fedshard's buffers are CUDA memory that torch wraps with from_blob, and torch computes on
// the trainer's compute stream (torch_model.hpp, device path). Needs a LibTorch with CUDA.
//
//   train_torch_gpu [steps] [K]      (defaults 300 and 4)
#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "../common/cli.hpp"
#include "torch_device_model.hpp"

namespace {

using net_t = torch::nn::Sequential;

fedshard_torch::batch make_batch(at::Generator& gen, std::int64_t n) {
  const torch::Tensor x = torch::rand({n, 2}, gen) * 3.0 - 1.5;
  const torch::Tensor y =
      (torch::sin(2 * x.select(1, 0)) * torch::cos(x.select(1, 1))).unsqueeze(1);
  return {x, y};
}

/// Trains for `steps` steps, averaging every `period`.
int train(int steps, int period) {
  if (fedshard_torch::bridge::cuda_device_count() == 0) {
    std::printf("train_torch_gpu: no CUDA device, nothing to do\n");
    return 77;
  }
  constexpr int kRanks = 4;
  const torch::Device dev(torch::kCUDA, 0);

  torch::manual_seed(0);
  net_t proto(torch::nn::Linear(2, 64), torch::nn::Tanh(), torch::nn::Linear(64, 64),
              torch::nn::Tanh(), torch::nn::Linear(64, 1));
  // The batches on the host, made up front: rank r's batch of step s is s * kRanks + r.
  std::vector<fedshard_torch::batch> data;
  {
    std::vector<at::Generator> gens;
    for (int r = 0; r < kRanks; ++r)
      gens.push_back(at::detail::createCPUGenerator(1000 + static_cast<std::uint64_t>(r)));
    for (int s = 0; s < steps; ++s)
      for (int r = 0; r < kRanks; ++r) data.push_back(make_batch(gens[std::size_t(r)], 32));
  }
  auto test_gen = at::detail::createCPUGenerator(12345);
  const fedshard_torch::batch test = make_batch(test_gen, 1024);

  // The loss moves the batch to the GPU: it runs inside the step, on the trainer's stream.
  auto mse = [dev](net_t& net, const fedshard_torch::batch& b) {
    return torch::mse_loss(net->forward(b.input.to(dev)), b.target.to(dev));
  };
  using model = fedshard_torch::torch_device_model<net_t>;
  std::vector<std::shared_ptr<model>> models;
  for (int r = 0; r < kRanks; ++r) {
    net_t net = fedshard_torch::deep_copy(proto);
    net->to(dev);
    models.push_back(std::make_shared<model>(model::model_type(net, mse), [&](std::int64_t i) {
      return i < 0 ? test : data[static_cast<std::size_t>(i)];
    }));
  }

  fedshard_torch::bridge::run_options o;
  o.shape = {2, 1, 2};
  o.steps = steps;
  o.period = period;
  o.lr = 1e-2f;
  o.opt = fedshard_torch::bridge::optimizer::adamw;
  const auto res = fedshard_torch::bridge::run_fl_hsdp(
      o, [&](int r) { return models[static_cast<std::size_t>(r)]; });

  for (int s = 49; s < steps; s += 50) {
    double mean = 0;
    for (int r = 0; r < kRanks; ++r) mean += res.losses[std::size_t(r)][std::size_t(s)] / kRanks;
    std::printf("step %4d  training loss %.5f (rank mean)\n", s + 1, mean);
  }
  torch::NoGradGuard no_grad;
  net_t start = fedshard_torch::deep_copy(proto);
  start->to(dev);
  const double before = mse(start, test).item<double>();
  const double after = mse(models[0]->model().net(), test).item<double>();
  std::printf(
      "test loss %.5f -> %.5f (plain LibTorch on rank 0's loaded CUDA module); at most %d "
      "gathered units live\n",
      before, after, res.peak_live_units[0]);
  return after < before ? 0 : 1;
}

}  // namespace

// Bad arguments ("2.5", "8x", 0, more than two) exit 2 with one line on stderr (common/cli.hpp).
int main(int argc, char** argv) {
  return cli::run_main("train_torch_gpu", [&] {
    if (argc > 3)
      cli::fail("expected at most 2 arguments, [steps] [K], found " + std::to_string(argc - 1));
    const int steps = argc > 1 ? cli::parse_integer<int>("steps", argv[1], 1, 1000000) : 300;
    const int period = argc > 2 ? cli::parse_integer<int>("K", argv[2], 1, 1000000) : 4;
    return train(steps, period);
  });
}
