// examples/libtorch: a LibTorch module trained by fedshard through torch_model equals the same
// training done by plain LibTorch, computes in fedshard's buffers, and learns.
// LibTorch before doctest: Debian's c10 logs through glog, whose CHECK macros doctest's
// replace here (torch's headers are already expanded by then).
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
#include <memory>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/spawn_ranks.hpp"
#include "torch_model.hpp"

using namespace fedshard;
using fedshard_torch::batch;
using net_t = torch::nn::Sequential;
using model_t = fedshard_torch::torch_model<net_t>;

namespace {

constexpr int kRanks = 4;
constexpr int kPerRank = 8;
constexpr std::int64_t kIn = 6, kHidden = 16, kOut = 3;

net_t make_net(std::uint64_t seed) {
  torch::manual_seed(seed);
  return net_t(torch::nn::Linear(kIn, kHidden), torch::nn::Tanh(),
               torch::nn::Linear(kHidden, kHidden), torch::nn::Tanh(),
               torch::nn::Linear(kHidden, kOut));
}

torch::Tensor mse(net_t& net, const batch& b) {
  return torch::mse_loss(net->forward(b.input), b.target);
}

/// n samples of the task: x ~ N(0, 1), target sin(x A) for a fixed random A.
batch make_batch(std::int64_t n) {
  static const torch::Tensor a = [] {
    torch::manual_seed(1);
    return torch::randn({kIn, kOut});
  }();
  const torch::Tensor x = torch::randn({n, kIn});
  return {x, torch::sin(x.matmul(a))};
}

/// batches[step][rank], drawn from seed.
std::vector<std::vector<batch>> make_data(int steps, std::uint64_t seed) {
  (void)make_batch(1);  // fixes A before the seed below
  torch::manual_seed(seed);
  std::vector<std::vector<batch>> data(static_cast<std::size_t>(steps));
  for (auto& step : data)
    for (int r = 0; r < kRanks; ++r) step.push_back(make_batch(kPerRank));
  return data;
}

/// The module's parameters, flattened in torch's order.
std::vector<float> flatten(net_t& net) {
  std::vector<float> out;
  for (const auto& p : net->parameters()) {
    const torch::Tensor c = p.detach().contiguous();
    out.insert(out.end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  }
  return out;
}

double max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::abs(double(a[i]) - b[i]) / std::max(1e-2, std::abs(double(b[i]))));
  return worst;
}

/// Plain LibTorch on one rank: SGD on the concatenation of the ranks' batches.
std::vector<float> train_plain(const net_t& proto, const std::vector<std::vector<batch>>& data,
                               float lr) {
  net_t net = fedshard_torch::deep_copy(proto);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(lr));
  for (const auto& step : data) {
    std::vector<torch::Tensor> xs, ys;
    for (const auto& b : step) {
      xs.push_back(b.input);
      ys.push_back(b.target);
    }
    opt.zero_grad();
    mse(net, {torch::cat(xs), torch::cat(ys)}).backward();
    opt.step();
  }
  return flatten(net);
}

/// What the loss function saw of the parameters' storage during forward.
struct probe {
  step_context* ctx = nullptr;
  int checked = 0;
  int outside = 0;  // parameters or gradients not at their place in fedshard's buffers
};

/// torch_model, with the step_context made visible to the loss function.
struct probing_model {
  model_t inner;
  std::shared_ptr<probe> seen;

  std::vector<unit_spec> units() const { return inner.units(); }
  std::vector<float> initial_values(const flat_layout& l, std::size_t u) const {
    return inner.initial_values(l, u);
  }
  float forward_backward(step_context& ctx, const batch& b) {
    seen->ctx = &ctx;
    const float loss = inner.forward_backward(ctx, b);
    seen->ctx = nullptr;
    return loss;
  }
};

}  // namespace

// With K = 1 and plain SGD, fl_hsdp averages the groups' (θ - lr g_g) after every step, which
// is θ - lr * (mean of all ranks' gradients); with equal batch sizes that is the gradient of
// the mean loss over the concatenated batch, i.e. one SGD step of plain LibTorch. The two
// differ only in float rounding (fedshard averages per-rank gradients in two stages, torch
// sums over the whole batch at once), so within 1e-6 relative.
TEST_CASE("fl_hsdp<1> with plain SGD on 4 ranks equals LibTorch SGD on the concatenated batch") {
  torch::set_num_threads(1);
  constexpr int kSteps = 10;
  constexpr float kLr = 0.1f;
  net_t proto = make_net(7);
  const auto data = make_data(kSteps, 3);
  const std::vector<float> start = flatten(proto);
  const std::vector<float> expected = train_plain(proto, data, kLr);
  REQUIRE(max_rel(start, expected) > 1e-3);  // training moved the parameters

  for (const mesh_shape shape : {mesh_shape{2, 1, 2}, mesh_shape{2, 2, 1}}) {
    INFO("mesh ", to_string(shape));
    std::vector<net_t> nets;
    for (int r = 0; r < kRanks; ++r) nets.push_back(fedshard_torch::deep_copy(proto));
    std::vector<std::vector<float>> initial(kRanks), trained(kRanks), loaded(kRanks);
    test::spawn_ranks(kRanks, [&](inproc::communicator& world) {
      const auto r = static_cast<std::size_t>(world.rank());
      mesh m(world, shape);
      trainer<model_t, fl_hsdp<1>, optim::sgd> t(m, model_t(nets[r], mse), {.lr = kLr},
                                                 {.total_steps = kSteps});
      initial[r] = t.parameters();
      for (const auto& step : data) t.step(step[r]);
      trained[r] = t.parameters();
      t.model().load_from(t);
      loaded[r] = flatten(t.model().net());
    });
    for (int r = 0; r < kRanks; ++r) {
      CHECK(initial[r] == start);  // fedshard starts from the module's own initialisation
      const double rel = max_rel(trained[r], expected);
      MESSAGE("rank ", r, ": max relative difference to plain LibTorch ", rel);
      CHECK(rel <= 1e-6);
      CHECK(loaded[r] == trained[r]);  // load_from hands the trained values to the module
    }
  }
}

TEST_CASE("units follow the module's submodules and parameters are fedshard's buffers, no copy") {
  torch::set_num_threads(1);
  net_t proto = make_net(5);
  const auto data = make_data(3, 4);

  const model_t plain(fedshard_torch::deep_copy(proto), mse);
  const auto units = plain.units();
  REQUIRE(units.size() == 3);  // the three Linear layers; Tanh has no parameters
  std::vector<std::string> names;
  for (const auto& u : units)
    for (const auto& t : u.tensors) names.push_back(u.name + "." + t.name);
  std::vector<std::string> torch_names;
  for (const auto& p : proto->named_parameters()) torch_names.push_back(p.key());
  CHECK(names == torch_names);  // "0.weight", "0.bias", "2.weight", ...
  CHECK(units[1].tensors[0].shape == std::vector<std::int64_t>{kHidden, kHidden});

  std::vector<net_t> nets;
  for (int r = 0; r < kRanks; ++r) nets.push_back(fedshard_torch::deep_copy(proto));
  const std::vector<float> start = flatten(nets[0]);
  std::vector<std::shared_ptr<probe>> probes;
  for (int r = 0; r < kRanks; ++r) probes.push_back(std::make_shared<probe>());
  std::vector<std::vector<const void*>> home_before(kRanks), home_after(kRanks);
  std::vector<std::vector<float>> module_after(kRanks);

  test::spawn_ranks(kRanks, [&](inproc::communicator& world) {
    const auto r = static_cast<std::size_t>(world.rank());
    auto seen = probes[r];
    auto check_storage = [seen](net_t& net, const batch& b) {
      step_context& ctx = *seen->ctx;
      const flat_layout& l = ctx.layout();
      auto named = net->named_parameters();
      for (std::size_t u = 0; u < l.num_units(); ++u)
        for (const auto& slot : l.unit(u).tensors) {
          const torch::Tensor& p = named[l.unit(u).name + "." + slot.name];
          ++seen->checked;
          if (p.data_ptr() != static_cast<const void*>(ctx.params(u).data() + slot.offset) ||
              !p.grad().defined() ||
              p.grad().data_ptr() != static_cast<void*>(ctx.grad_buffer(u).data() + slot.offset))
            ++seen->outside;
        }
      return mse(net, b);
    };
    mesh m(world, {2, 1, 2});
    for (const auto& p : nets[r]->parameters()) home_before[r].push_back(p.data_ptr());
    trainer<probing_model, fl_hsdp<1>, optim::sgd> t(
        m, probing_model{model_t(nets[r], check_storage), seen}, {.lr = 0.1f});
    for (const auto& step : data) t.step(step[r]);
    for (const auto& p : nets[r]->parameters()) home_after[r].push_back(p.data_ptr());
    module_after[r] = flatten(nets[r]);
  });

  for (int r = 0; r < kRanks; ++r) {
    CHECK(probes[r]->checked == 3 * 6);  // 3 steps x 6 parameters
    CHECK(probes[r]->outside == 0);
    // Between steps the module is back on its own storage, untouched by training.
    CHECK(home_after[r] == home_before[r]);
    CHECK(module_after[r] == start);
  }
}

TEST_CASE("fl_hsdp<4> trains the LibTorch module: the loss goes down") {
  torch::set_num_threads(1);
  constexpr int kSteps = 150;
  net_t proto = make_net(11);
  const auto data = make_data(kSteps, 12);
  torch::manual_seed(99);
  const batch held_out = make_batch(256);
  std::vector<net_t> nets;
  for (int r = 0; r < kRanks; ++r) nets.push_back(fedshard_torch::deep_copy(proto));
  std::vector<double> first(kRanks), last(kRanks), eval_before(kRanks), eval_after(kRanks);

  test::spawn_ranks(kRanks, [&](inproc::communicator& world) {
    const auto r = static_cast<std::size_t>(world.rank());
    mesh m(world, {2, 1, 2});
    trainer<model_t, fl_hsdp<4>, optim::adamw> t(m, model_t(nets[r], mse), {.lr = 0.02f},
                                                 {.total_steps = kSteps});
    eval_before[r] = t.evaluate(held_out);
    for (int s = 0; s < kSteps; ++s) {
      const float loss = t.step(data[static_cast<std::size_t>(s)][r]);
      if (s < 10) first[r] += loss / 10;
      if (s >= kSteps - 10) last[r] += loss / 10;
    }
    eval_after[r] = t.evaluate(held_out);
  });

  for (int r = 0; r < kRanks; ++r) {
    MESSAGE("rank ", r, ": training loss ", first[r], " -> ", last[r], ", held-out ",
            eval_before[r], " -> ", eval_after[r]);
    CHECK(last[r] < 0.7 * first[r]);
    CHECK(eval_after[r] < 0.7 * eval_before[r]);
  }
}
