// examples/libtorch on the GPU (label gpu; exit 77, skipped, without a device): the same
// module trained by fl_hsdp (K = 1, plain SGD) on 4 gpu_inproc ranks sharing GPU 0 through
// torch_model's device path equals the run on 4 host inproc ranks through its CPU path, and
// torch_model refuses a module on the wrong device. Needs a LibTorch with CUDA.
// LibTorch before doctest, as in test_torch_equivalence.cpp.
#include <torch/torch.h>
#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "torch_device_model.hpp"

namespace {

using net_t = torch::nn::Sequential;
using batch = fedshard_torch::batch;

constexpr int kRanks = 4;
constexpr int kSteps = 10;
constexpr int kPerRank = 8;
constexpr std::int64_t kIn = 6, kHidden = 16, kOut = 3;
constexpr float kLr = 0.1f;

net_t make_net(std::uint64_t seed) {
  torch::manual_seed(seed);
  return net_t(torch::nn::Linear(kIn, kHidden), torch::nn::Tanh(),
               torch::nn::Linear(kHidden, kHidden), torch::nn::Tanh(),
               torch::nn::Linear(kHidden, kOut));
}

/// batches[s * kRanks + r], then one held-out batch (index -1).
struct data_set {
  std::vector<batch> batches;
  batch held_out;
  batch operator()(std::int64_t i) const {
    return i < 0 ? held_out : batches.at(static_cast<std::size_t>(i));
  }
};

data_set make_data(std::uint64_t seed) {
  torch::manual_seed(seed);
  const torch::Tensor a = torch::randn({kIn, kOut});
  auto make = [&](std::int64_t n) {
    const torch::Tensor x = torch::randn({n, kIn});
    return batch{x, torch::sin(x.matmul(a))};
  };
  data_set d;
  for (int i = 0; i < kSteps * kRanks; ++i) d.batches.push_back(make(kPerRank));
  d.held_out = make(64);
  return d;
}

/// The mse of net on b, the batch moved to dev (inside the step: on the trainer's stream).
auto mse_on(torch::Device dev) {
  return [dev](net_t& net, const batch& b) {
    return torch::mse_loss(net->forward(b.input.to(dev)), b.target.to(dev));
  };
}

/// The largest relative difference (infinite where a value is not finite).
double max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(double(a[i]) - b[i]) / std::max(1e-2, std::abs(double(b[i])));
    worst = std::isfinite(d) ? std::max(worst, d) : std::numeric_limits<double>::infinity();
    if (std::isinf(worst)) break;
  }
  return worst;
}

using fedshard_torch::bridge::device_step;

/// A device_step on device 0 that fails on any use of the trainer: enough for torch_model's
/// checks at the start of a step.
class refusing_step final : public device_step {
 public:
  explicit refusing_step(const fedshard::flat_layout& l) : l_(&l) {}
  const fedshard::flat_layout& layout() const override { return *l_; }
  std::span<const float> acquire(std::size_t, fedshard::phase) override { return fail(); }
  void release(std::size_t) override { fail(); }
  std::span<float> grad_buffer(std::size_t) override {
    fail();
    return {};
  }
  void grads_ready(std::size_t) override { fail(); }
  int device() const override { return 0; }
  void* stream() const override { return nullptr; }  // the legacy default stream

 private:
  static std::span<const float> fail() {
    FAIL("the trainer was used");
    return {};
  }
  const fedshard::flat_layout* l_;
};

}  // namespace

// Both runs start from one module and read the same batches; they differ only in the
// floating-point order of the products and sums: cuBLAS and CUDA kernels against CPU BLAS and
// loops (TF32 is turned off, so every product is an f32 one). Each such difference is a few
// ulps (1e-7 relative) per operation; over 10 SGD steps with lr 0.1 on a 6-16-16-3 tanh MLP
// they grow to about 1e-6. The bound 1e-4 leaves room for that and still catches any real
// error: a missed re-gather (stale or foreign parameters), a missed stream wait (the values of
// a previous step) or a lost gradient moves the parameters by lr * |g|, about 1e-2.
TEST_CASE("fl_hsdp on gpu_inproc with the device path equals fl_hsdp on inproc with the CPU path") {
  torch::set_num_threads(1);
  at::globalContext().setAllowTF32CuBLAS(false);
  const torch::Device cuda(torch::kCUDA, 0);
  net_t proto = make_net(7);
  const data_set data = make_data(3);

  // The host run.
  std::vector<std::vector<float>> host(kRanks);
  std::vector<std::vector<float>> host_losses(kRanks);
  using host_model = fedshard_torch::torch_model<net_t>;
  fedshard::inproc::run(kRanks, [&](fedshard::inproc::communicator& world) {
    const auto r = static_cast<std::size_t>(world.rank());
    fedshard::mesh m(world, {2, 1, 2});
    fedshard::trainer<host_model, fedshard::fl_hsdp, fedshard::optim::sgd,
                      fedshard::inproc::communicator>
        t(m, host_model(fedshard_torch::deep_copy(proto), mse_on(torch::kCPU)), {.lr = kLr},
          {.total_steps = kSteps, .schedule = {.period = 1}});
    for (int s = 0; s < kSteps; ++s)
      host_losses[r].push_back(t.step(data(std::int64_t{s} * kRanks + world.rank())));
    host[r] = t.parameters();
  });

  // The device run: each rank's module on GPU 0.
  using device_model = fedshard_torch::torch_device_model<net_t>;
  std::vector<std::shared_ptr<device_model>> models;
  for (int r = 0; r < kRanks; ++r) {
    net_t net = fedshard_torch::deep_copy(proto);
    net->to(cuda);
    models.push_back(std::make_shared<device_model>(device_model::model_type(net, mse_on(cuda)),
                                                    [&data](std::int64_t i) { return data(i); }));
  }
  fedshard_torch::bridge::run_options o;
  o.shape = {2, 1, 2};
  o.steps = kSteps;
  o.period = 1;
  o.lr = kLr;
  o.opt = fedshard_torch::bridge::optimizer::sgd;
  const auto dev = fedshard_torch::bridge::run_fl_hsdp(
      o, [&](int r) { return models[static_cast<std::size_t>(r)]; });

  for (int r = 0; r < kRanks; ++r) {
    CAPTURE(r);
    const double rel = max_rel(dev.parameters[std::size_t(r)], host[std::size_t(r)]);
    const double loss_rel = max_rel(dev.losses[std::size_t(r)], host_losses[std::size_t(r)]);
    MESSAGE("rank ", r, ": max relative difference device - host: parameters ", rel, ", losses ",
            loss_rel);
    CHECK(rel <= 1e-4);
    CHECK(loss_rel <= 1e-4);
    CHECK(models[std::size_t(r)]->model().grad_copies() == 0);  // accumulated in place
    // load_unit handed the trained values to the CUDA module.
    std::vector<float> loaded;
    for (const auto& p : models[std::size_t(r)]->model().net()->parameters()) {
      const torch::Tensor c = p.detach().to(torch::kCPU).contiguous();
      loaded.insert(loaded.end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
    }
    CHECK(loaded == dev.parameters[std::size_t(r)]);
  }
  CHECK(max_rel(host[0], std::vector<float>(host[0].size(), 0.0f)) > 1e-3);  // it trained
}

TEST_CASE("torch_model refuses a module on another device than the step's memory space") {
  const torch::Device cuda(torch::kCUDA, 0);
  const data_set data = make_data(5);
  fedshard_torch::torch_model<net_t> on_cpu(make_net(1), mse_on(cuda));
  const fedshard::flat_layout layout(on_cpu.units(), 1);
  refusing_step step(layout);
  fedshard_torch::bridge::device_context ctx(step);
  CHECK_THROWS_WITH_AS(on_cpu.forward_backward(ctx, data(0)),
                       doctest::Contains("is on cpu but the trainer's memory space computes on "
                                         "cuda:0"),
                       fedshard::invalid_argument);

  net_t net = make_net(1);
  net->to(cuda);
  fedshard_torch::torch_model<net_t> on_gpu(net, mse_on(torch::kCPU));
  fedshard::inproc::run(1, [&](fedshard::inproc::communicator& world) {
    fedshard::mesh m(world, {1, 1, 1});
    using host_trainer = fedshard::trainer<fedshard_torch::torch_model<net_t>, fedshard::fsdp,
                                           fedshard::optim::sgd, fedshard::inproc::communicator>;
    CHECK_THROWS_WITH_AS(
        [&] {
          host_trainer t(m, on_gpu, {.lr = kLr});
          t.step(data(0));
        }(),
        doctest::Contains("is on cuda:0 but the trainer's memory space computes on cpu"),
        fedshard::invalid_argument);
  });
}
