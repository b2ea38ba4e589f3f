// What fedshard costs on top of the compute: one training step of the same LibTorch model,
// plain and through fedshard's LibTorch adapter (examples/libtorch/torch_model.hpp), on one
// rank, so that no communication hides or adds anything.
//
// Model: a 4-layer MLP, 1024 wide (Linear 1024 -> 1024 four times, ReLU between), MSE
// against a fixed target, batch 64, AdamW (lr 1e-3, weight decay 1e-2); torch on one thread
// (the machines that run this are shared).
//
//   plain      torch::optim::AdamW on the module: zero_grad, forward, backward, step.
//   ddp        fedshard::trainer<torch_model, ddp, optim::adamw> on a 1-rank inproc mesh.
//   fsdp       the same with fsdp (full_shard over 1 shard).
//   fl_hsdp    fl_hsdp on a 1x1x1 mesh with a period larger than the run, so the step never
//              syncs: on one rank this is the closest configuration to "a local step of a
//              federated run" (one group, so a sync would only average one group with
//              itself); it differs from fsdp by hybrid_shard over 1x1 and the federation's
//              per-step bookkeeping.
//
// BM_step/<variant> times each variant alone. BM_side_by_side runs one step of every variant
// per iteration (a round), in a rotating order, times each, and reports as counters the
// medians over rounds of the ratios within a round (fedshard/plain for ddp and fsdp,
// fl_hsdp/fsdp and fl_hsdp/ddp): the figures to quote, since neighbours on a shared machine
// slow the steps of one round alike. Targets (issue 12):
// ddp/plain <= 1.05 and fl_hsdp/fsdp <= 1.05 with the project's default flags (Release, no
// -march).
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <fedshard/comm/inproc.hpp>
#include <fedshard/kernels/dispatch.hpp>
#include <fedshard/mesh/mesh.hpp>
#include <fedshard/optim/adamw.hpp>
#include <fedshard/trainer/algorithm.hpp>
#include <fedshard/trainer/trainer.hpp>

#include "torch_model.hpp"

namespace {

constexpr std::int64_t kWidth = 1024;
constexpr std::int64_t kBatch = 64;
constexpr float kLr = 1e-3f;
constexpr float kWeightDecay = 1e-2f;

using net_t = torch::nn::Sequential;
using model_t = fedshard_torch::torch_model<net_t>;
using comm_t = fedshard::inproc::communicator;

net_t make_net() {
  torch::manual_seed(0);
  return net_t(torch::nn::Linear(kWidth, kWidth), torch::nn::ReLU(),
               torch::nn::Linear(kWidth, kWidth), torch::nn::ReLU(),
               torch::nn::Linear(kWidth, kWidth), torch::nn::ReLU(),
               torch::nn::Linear(kWidth, kWidth));
}

fedshard_torch::batch make_batch() {
  auto gen = at::detail::createCPUGenerator(42);
  return {torch::randn({kBatch, kWidth}, gen), torch::randn({kBatch, kWidth}, gen)};
}

torch::Tensor mse(net_t& net, const fedshard_torch::batch& b) {
  return torch::mse_loss(net->forward(b.input), b.target);
}

/// A training step of some kind, built on the calling (rank) thread.
using step_fn = std::function<void()>;

/// Plain LibTorch: the module and torch's AdamW.
struct plain_step {
  net_t net = make_net();
  torch::optim::AdamW opt{net->parameters(),
                          torch::optim::AdamWOptions(kLr).weight_decay(kWeightDecay)};
  fedshard_torch::batch b = make_batch();
  void operator()() {
    opt.zero_grad();
    mse(net, b).backward();
    opt.step();
  }
};

/// The same step through a fedshard trainer with algorithm A on a 1-rank mesh.
template <class A>
struct fedshard_step {
  using trainer_t = fedshard::trainer<model_t, A, fedshard::optim::adamw, comm_t>;
  fedshard::mesh<comm_t> mesh;
  std::unique_ptr<trainer_t> t;
  fedshard_torch::batch b = make_batch();

  explicit fedshard_step(comm_t& world, typename trainer_t::options o = {})
      : mesh(world, {.groups = 1, .replicas = 1, .shards = 1}) {
    t = std::make_unique<trainer_t>(
        mesh, model_t(make_net(), mse),
        fedshard::optim::adamw_config{.lr = kLr, .weight_decay = kWeightDecay}, std::move(o));
  }
  void operator()() { t->step(b); }
};

typename fedshard::trainer_options<fedshard::fl_hsdp> never_sync() {
  typename fedshard::trainer_options<fedshard::fl_hsdp> o;
  o.schedule.period = std::numeric_limits<int>::max() / 2;
  return o;
}

enum variant : int { plain, ddp, fsdp, fl_hsdp, num_variants };
constexpr std::array<const char*, num_variants> kNames = {"plain", "ddp", "fsdp", "fl_hsdp"};

/// Calls body(steps) on a 1-rank inproc mesh, steps[v] being a step of variant v.
template <class Body>
void with_steps(Body&& body) {
  fedshard::inproc::run(1, [&](comm_t& world) {
    torch::set_num_threads(1);
    auto p = std::make_shared<plain_step>();
    auto d = std::make_shared<fedshard_step<fedshard::ddp>>(world);
    auto f = std::make_shared<fedshard_step<fedshard::fsdp>>(world);
    auto h = std::make_shared<fedshard_step<fedshard::fl_hsdp>>(world, never_sync());
    std::array<step_fn, num_variants> steps = {[p] { (*p)(); }, [d] { (*d)(); }, [f] { (*f)(); },
                                               [h] { (*h)(); }};
    for (auto& s : steps) s();  // warm up: allocations, torch's first-call paths
    body(steps);
  });
}

/// Samples processed (steps_per_iteration steps of kBatch each) and the instruction set.
void set_common_counters(benchmark::State& state, std::int64_t steps_per_iteration) {
  state.SetItemsProcessed(state.iterations() * steps_per_iteration * kBatch);
  state.SetLabel(std::string("isa ") +
                 std::string(fedshard::kernels::to_string(fedshard::kernels::active_isa())));
}

/// One variant alone.
void BM_step(benchmark::State& state) {
  const auto v = static_cast<variant>(state.range(0));
  with_steps([&](std::array<step_fn, num_variants>& steps) {
    for (auto _ : state) steps[static_cast<std::size_t>(v)]();
  });
  set_common_counters(state, 1);
}
BENCHMARK(BM_step)
    ->ArgName("variant")
    ->DenseRange(0, num_variants - 1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? 0.0 : (n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

/// The median over rounds of ms[a][r] / ms[b][r]: each ratio compares two steps of one round,
/// run next to each other, so that a neighbour's load that comes and goes cancels out.
double median_ratio(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> r(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) r[i] = a[i] / b[i];
  return median(std::move(r));
}

/// Every variant once per iteration (a round), in an order that rotates; counters: the median
/// step time of each (ms) and the medians of the per-round ratios.
void BM_side_by_side(benchmark::State& state) {
  std::array<std::vector<double>, num_variants> ms;
  with_steps([&](std::array<step_fn, num_variants>& steps) {
    std::size_t round = 0;
    for (auto _ : state) {
      for (std::size_t k = 0; k < num_variants; ++k) {
        const std::size_t v = (round + k) % num_variants;
        const auto t0 = std::chrono::steady_clock::now();
        steps[v]();
        const auto t1 = std::chrono::steady_clock::now();
        ms[v].push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      }
      ++round;
    }
  });
  for (std::size_t v = 0; v < num_variants; ++v)
    state.counters[std::string(kNames[v]) + "_ms"] = median(ms[v]);
  state.counters["ddp/plain"] = median_ratio(ms[ddp], ms[plain]);
  state.counters["fsdp/plain"] = median_ratio(ms[fsdp], ms[plain]);
  state.counters["fl_hsdp/fsdp"] = median_ratio(ms[fl_hsdp], ms[fsdp]);
  state.counters["fl_hsdp/ddp"] = median_ratio(ms[fl_hsdp], ms[ddp]);
  set_common_counters(state, num_variants);
}
BENCHMARK(BM_side_by_side)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(40.0);

}  // namespace
