#pragma once
// The model, data and loss both fedshard sides of bench/peer/ train (peer_data_parallel.cpp,
// peer_local_sgd.cpp), as peer_model.py makes them for the torch and torchft sides.
//
// Model: 4 x Linear(1024, 1024) with ReLU between, torch's initialisation after
// torch::manual_seed(0). Data: step s of rank (or group) r reads 64 x 1024 inputs and targets
// from torch::randn with a CPU generator seeded 1000 s + r. Loss: MSE. SGD's rate 0.01.
#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "torch_model.hpp"

namespace peer {

inline constexpr std::int64_t kWidth = 1024;
inline constexpr std::int64_t kBatch = 64;
inline constexpr float kLr = 0.01f;

using net_t = torch::nn::Sequential;
using model_t = fedshard_torch::torch_model<net_t>;

/// The layers made in order, as Python makes them: C++ evaluates a call's arguments in no set
/// order (GCC: last first), and each Linear draws its initial values from the seeded generator.
inline net_t make_net() {
  torch::manual_seed(0);
  std::vector<torch::nn::Linear> l;
  for (int i = 0; i < 4; ++i) l.emplace_back(kWidth, kWidth);
  return net_t(l[0], torch::nn::ReLU(), l[1], torch::nn::ReLU(), l[2], torch::nn::ReLU(), l[3]);
}

/// Step `step`'s batch of rank (or group) r.
inline fedshard_torch::batch batch_of(std::int64_t step, std::int64_t r) {
  auto gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(1000 * step + r));
  torch::Tensor x = torch::randn({kBatch, kWidth}, gen);
  torch::Tensor y = torch::randn({kBatch, kWidth}, gen);
  return {x, y};
}

inline torch::Tensor mse(net_t& net, const fedshard_torch::batch& b) {
  return torch::mse_loss(net->forward(b.input), b.target);
}

}  // namespace peer
