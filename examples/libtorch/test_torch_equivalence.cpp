// examples/libtorch: a LibTorch module trained by fedshard through torch_model equals the same
// training done by plain LibTorch, computes in fedshard's buffers, carries the plan at the wire
// (backward re-gathers included) within max_live_units, and learns.
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
#include <atomic>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/plan/wire_tap.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/plan_checks.hpp"
#include "support/spawn_ranks.hpp"
#include "torch_model.hpp"

using namespace fedshard;
using fedshard_torch::batch;
using net_t = torch::nn::Sequential;
using model_t = fedshard_torch::torch_model<net_t>;

namespace {

template <class Algorithm, class Opt>
using torch_trainer = trainer<model_t, Algorithm, Opt, inproc::communicator>;

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

/// A parameter-free module that, in training, overwrites with NaN the memory the given
/// parameters point at. Appended to the Sequential, it runs after every unit's forward, when
/// fedshard has released the units: only a backward that gathers each unit again into that
/// memory computes finite gradients.
class poison_impl : public torch::nn::Module {
 public:
  poison_impl(std::vector<torch::Tensor> params, std::shared_ptr<std::atomic<int>> runs)
      : params_(std::move(params)), runs_(std::move(runs)) {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (!torch::GradMode::is_enabled()) return x;
    for (const auto& p : params_)
      torch::from_blob(p.data_ptr(), p.sizes(), torch::kFloat32)
          .fill_(std::numeric_limits<float>::quiet_NaN());
    ++*runs_;
    return x;
  }

 private:
  std::vector<torch::Tensor> params_;
  std::shared_ptr<std::atomic<int>> runs_;
};
TORCH_MODULE_IMPL(poison, poison_impl);

/// Where a unit's parameters and their gradients pointed when a pointer_probe ran.
struct bound_pointers {
  std::vector<const void*> data, grad;
};

/// A parameter-free module that records where the watched parameters (the unit before it)
/// and their .grad point when it runs.
class pointer_probe_impl : public torch::nn::Module {
 public:
  pointer_probe_impl(std::vector<torch::Tensor> watched,
                     std::shared_ptr<std::vector<bound_pointers>> log)
      : watched_(std::move(watched)), log_(std::move(log)) {}
  torch::Tensor forward(const torch::Tensor& x) {
    bound_pointers b;
    for (const auto& t : watched_) {
      b.data.push_back(t.data_ptr());
      b.grad.push_back(t.grad().defined() ? t.grad().data_ptr() : nullptr);
    }
    log_->push_back(std::move(b));
    return x;
  }

 private:
  std::vector<torch::Tensor> watched_;
  std::shared_ptr<std::vector<bound_pointers>> log_;
};
TORCH_MODULE_IMPL(pointer_probe, pointer_probe_impl);

/// A deep copy of proto with a pointer_probe after each child that has parameters.
net_t with_probes(const net_t& proto, const std::shared_ptr<std::vector<bound_pointers>>& log) {
  net_t src = fedshard_torch::deep_copy(proto);
  net_t out;
  const auto names = src->named_children();
  std::size_t i = 0;
  for (const auto& any : *src) {
    const std::string name = names[i++].key();
    out->push_back(std::string(name), any);
    const auto params = any.ptr()->parameters();
    if (!params.empty()) out->push_back(name + "_probe", pointer_probe(params, log));
  }
  return out;
}

/// The calls of a, less one of each call of b (multisets).
std::vector<wire_call> without(std::vector<wire_call> a, std::vector<wire_call> b) {
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  std::vector<wire_call> out;
  std::set_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return out;
}

/// "3 all_gather on shard, 1 all_reduce on federation".
std::string count_calls(const std::vector<wire_call>& calls) {
  std::map<std::pair<comm_kind, axis>, int> n;
  for (const auto& c : calls) ++n[{c.kind, c.axis}];
  std::string s;
  for (const auto& [k, count] : n)
    s += fedshard::detail::concat(s.empty() ? "" : ", ", count, " ", to_string(k.first), " on ",
                                  to_string(k.second));
  return s.empty() ? "none" : s;
}

}  // namespace

// With K = 1 and plain SGD, fl_hsdp averages the groups' (θ - lr g_g) after every step, which
// is θ - lr * (mean of all ranks' gradients); with equal batch sizes that is the gradient of
// the mean loss over the concatenated batch, i.e. one SGD step of plain LibTorch. The two
// differ only in float rounding (fedshard averages per-rank gradients in two stages, torch
// sums over the whole batch at once), so within 1e-6 relative. With `poison`, every gathered
// parameter is overwritten with NaN at the end of forward: the result stays the same only
// because each unit's backward gathers it again into the memory its saved tensors alias. On
// one shard (2x2x1) nothing is gathered (a one-rank gather changes nothing, so the step plan
// has none: the parameters are the master itself, as DDP's), so there is no gathered copy to
// poison and the poisoned run is on 2x1x2 only.
TEST_CASE(
    "fl_hsdp with K = 1 and plain SGD on 4 ranks equals LibTorch SGD on the concatenated "
    "batch") {
  torch::set_num_threads(1);
  constexpr int kSteps = 10;
  constexpr float kLr = 0.1f;
  net_t proto = make_net(7);
  const auto data = make_data(kSteps, 3);
  const std::vector<float> start = flatten(proto);
  const std::vector<float> expected = train_plain(proto, data, kLr);
  REQUIRE(max_rel(start, expected) > 1e-3);  // training moved the parameters

  for (const mesh_shape shape : {mesh_shape{2, 1, 2}, mesh_shape{2, 2, 1}})
    for (const bool poisoned : {false, true}) {
      if (poisoned && shape.shards == 1) continue;
      const std::string run =
          to_string(shape) + (poisoned ? ", gathered parameters poisoned after forward" : "");
      INFO("mesh ", run);
      std::vector<net_t> nets;
      auto poisonings = std::make_shared<std::atomic<int>>(0);
      for (int r = 0; r < kRanks; ++r) {
        nets.push_back(fedshard_torch::deep_copy(proto));
        if (poisoned)
          nets.back()->push_back("poison", poison(nets.back()->parameters(), poisonings));
      }
      std::vector<std::vector<float>> initial(kRanks), trained(kRanks), loaded(kRanks);
      std::vector<std::int64_t> copies(kRanks);
      test::spawn_ranks(kRanks, [&](inproc::communicator& world) {
        const auto r = static_cast<std::size_t>(world.rank());
        mesh m(world, shape);
        torch_trainer<fl_hsdp, optim::sgd> t(m, model_t(nets[r], mse), {.lr = kLr},
                                             {.total_steps = kSteps, .schedule = {.period = 1}});
        initial[r] = t.parameters();
        for (const auto& step : data) t.step(step[r]);
        trained[r] = t.parameters();
        copies[r] = t.model().grad_copies();
        t.model().load_from(t);
        loaded[r] = flatten(t.model().net());
      });
      if (poisoned) CHECK(poisonings->load() == kRanks * kSteps);  // once per rank and step
      for (int r = 0; r < kRanks; ++r) {
        CHECK(initial[r] == start);  // fedshard starts from the module's own initialisation
        const double rel = max_rel(trained[r], expected);
        MESSAGE("mesh ", run, ", rank ", r, ": max relative difference to plain LibTorch ", rel);
        CHECK(rel <= 1e-6);
        CHECK(loaded[r] == trained[r]);  // load_from hands the trained values to the module
        CHECK(copies[r] == 0);           // autograd accumulated into fedshard's buffers
      }
    }
}

TEST_CASE("units follow the module's children and parameters are fedshard's buffers, no copy") {
  torch::set_num_threads(1);
  constexpr int kSteps = 3;
  net_t proto = make_net(5);
  const auto data = make_data(kSteps, 4);

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

  std::vector<std::shared_ptr<std::vector<bound_pointers>>> logs;
  std::vector<net_t> nets;
  for (int r = 0; r < kRanks; ++r) {
    logs.push_back(std::make_shared<std::vector<bound_pointers>>());
    nets.push_back(with_probes(proto, logs.back()));
  }
  const std::vector<float> start = flatten(nets[0]);
  std::vector<std::vector<const void*>> home_before(kRanks), home_after(kRanks);
  std::vector<std::vector<float>> module_after(kRanks);
  std::vector<int> checked(kRanks), outside(kRanks);
  std::vector<std::int64_t> copies(kRanks);

  test::spawn_ranks(kRanks, [&](inproc::communicator& world) {
    const auto r = static_cast<std::size_t>(world.rank());
    mesh m(world, {2, 1, 2});
    for (const auto& p : nets[r]->parameters()) home_before[r].push_back(p.data_ptr());
    torch_trainer<fl_hsdp, optim::sgd> t(m, model_t(nets[r], mse), {.lr = 0.1f});
    REQUIRE(t.layout().num_units() == 3);  // the probes have no parameters
    const flat_layout& l = t.layout();
    for (int s = 0; s < kSteps; ++s) {
      t.step(data[static_cast<std::size_t>(s)][r]);
      // The engine keeps each unit's buffers at one address: where are they?
      t.engine().begin_step();
      std::vector<const float*> gathered, grads;
      for (std::size_t u = 0; u < l.num_units(); ++u) {
        gathered.push_back(t.engine().params(u).data());
        grads.push_back(t.engine().grad_buffer(u).data());
      }
      t.engine().begin_step();
      const auto& log = *logs[r];
      REQUIRE(log.size() == (static_cast<std::size_t>(s) + 1) * l.num_units());
      for (std::size_t u = 0; u < l.num_units(); ++u) {
        const bound_pointers& seen = log[static_cast<std::size_t>(s) * l.num_units() + u];
        for (std::size_t k = 0; k < l.unit(u).tensors.size(); ++k) {
          const std::size_t at = l.unit(u).tensors[k].offset;
          ++checked[r];
          if (seen.data[k] != static_cast<const void*>(gathered[u] + at) ||
              seen.grad[k] != static_cast<const void*>(grads[u] + at))
            ++outside[r];
        }
      }
    }
    copies[r] = t.model().grad_copies();
    for (const auto& p : nets[r]->parameters()) home_after[r].push_back(p.data_ptr());
    module_after[r] = flatten(nets[r]);
  });

  for (int r = 0; r < kRanks; ++r) {
    CHECK(checked[r] == kSteps * 6);  // 3 steps x 6 parameters
    CHECK(outside[r] == 0);           // each unit ran on views of its gathered buffer
    CHECK(copies[r] == 0);            // and its gradients accumulated in its gradient buffer
    // Between steps the module is back on its own storage, untouched by training.
    CHECK(home_after[r] == home_before[r]);
    CHECK(module_after[r] == start);
  }
}

namespace {
/// What the loss function saw of the wire: calls recorded when it returned (end of forward).
struct wire_probe {
  const wire_log* log = nullptr;
  std::size_t at_loss = 0;
};
}  // namespace

// The trainer's hooks fire from autograd: every unit is gathered for forward before the loss
// function returns, gathered again for backward after it (the plan's backward-phase
// all_gathers, counted at the wire), and the step carries exactly the plans, step by step, with
// no more than max_live_units gathered units live. Evaluation gathers each unit for forward
// only.
TEST_CASE_TEMPLATE("under FSDP-like algorithms the LibTorch path carries the plan at the wire", A,
                   fl_hsdp, fsdp) {
  torch::set_num_threads(1);
  constexpr int kSteps = 6;
  const mesh_shape shape = std::is_same_v<A, fsdp> ? mesh_shape{1, 1, 4} : mesh_shape{2, 1, 2};
  net_t proto = make_net(13);
  const auto data = make_data(kSteps, 14);
  torch::manual_seed(98);
  const batch held_out = make_batch(64);
  auto forward_gather = [](const comm_op& op) {
    return op.trigger == trigger::acquire && op.phase == phase::forward;
  };
  auto backward_gather = [](const comm_op& op) {
    return op.trigger == trigger::acquire && op.phase == phase::backward;
  };

  for (const int max_live : {1, 2}) {
    INFO("mesh ", to_string(shape), ", max_live_units ", max_live);
    std::vector<net_t> nets;
    for (int r = 0; r < kRanks; ++r) nets.push_back(fedshard_torch::deep_copy(proto));
    std::mutex mu;
    std::vector<std::string> mismatches, observed;
    std::vector<int> peak(kRanks), live_after(kRanks);
    std::vector<std::size_t> planned_backward(kRanks), counted_backward(kRanks);
    std::vector<std::int64_t> copies(kRanks);

    test::spawn_ranks(kRanks, [&](inproc::communicator& world) {
      const auto r = static_cast<std::size_t>(world.rank());
      mesh m(world, shape);
      auto probe = std::make_shared<wire_probe>();
      auto loss = [probe](net_t& net, const batch& b) {
        torch::Tensor l = mse(net, b);
        probe->at_loss = probe->log->calls().size();
        return l;
      };
      trainer_options<A> o;
      o.total_steps = kSteps;
      o.max_live_units = max_live;
      if constexpr (std::is_same_v<A, fl_hsdp>) o.schedule = {.period = 2};
      torch_trainer<A, optim::adamw> t(m, model_t(nets[r], loss), {.lr = 1e-2f}, o);
      probe->log = &t.wire();
      const auto forward_calls = test::calls_of(t.step_plan(), forward_gather);
      planned_backward[r] = test::calls_of(t.step_plan(), backward_gather).size();
      auto report = [&](const std::string& what) {
        std::lock_guard lock(mu);
        mismatches.push_back(fedshard::detail::concat("rank ", r, ", ", what));
      };

      t.wire().keep_calls(true);
      t.wire().take_calls();
      for (int s = 0; s < kSteps; ++s) {
        t.step(data[static_cast<std::size_t>(s)][r]);
        const std::vector<wire_call> calls = t.wire().take_calls();
        const auto expected = test::expected_step_calls(t, s, kSteps);
        if (const auto d = test::compare_calls(calls, expected); !d.empty())
          report(fedshard::detail::concat("step ", s, ": ", d));
        const auto split = calls.begin() + static_cast<std::ptrdiff_t>(probe->at_loss);
        const std::vector<wire_call> before(calls.begin(), split), after(split, calls.end());
        if (const auto d = test::compare_calls(before, forward_calls); !d.empty())
          report(fedshard::detail::concat("step ", s, ", until the loss returned: ", d));
        if (const auto d = test::compare_calls(after, without(expected, forward_calls)); !d.empty())
          report(fedshard::detail::concat("step ", s, ", after the loss returned: ", d));
        for (const auto& c : after)
          counted_backward[r] += c.kind == comm_kind::all_gather && c.axis == axis::shard;
        if (r == 0) {
          std::lock_guard lock(mu);
          observed.push_back(fedshard::detail::concat("step ", s, ": forward ", count_calls(before),
                                                      "; backward and sync ", count_calls(after)));
        }
      }
      t.evaluate(held_out);
      if (const auto d = test::compare_calls(t.wire().take_calls(), forward_calls); !d.empty())
        report("evaluate: " + d);
      peak[r] = t.engine().peak_live_units();
      live_after[r] = t.engine().live_units();
      copies[r] = t.model().grad_copies();
    });

    for (const auto& m : mismatches) FAIL_CHECK(m);
    CHECK(mismatches.empty());
    for (const auto& line : observed) MESSAGE("rank 0, max_live_units ", max_live, ", ", line);
    for (int r = 0; r < kRanks; ++r) {
      CAPTURE(r);
      CHECK(planned_backward[r] == 3);  // the plan gathers every unit again for backward ...
      CHECK(counted_backward[r] == kSteps * planned_backward[r]);  // ... and the wire saw it
      CHECK(peak[r] >= 1);
      CHECK(peak[r] <= max_live);
      CHECK(live_after[r] == 0);
      CHECK(copies[r] == 0);
    }
    MESSAGE("mesh ", to_string(shape), ", max_live_units ", max_live, ": peak live units ", peak[0],
            " on rank 0");
  }
}

TEST_CASE("fl_hsdp with K = 4 trains the LibTorch module: the loss goes down") {
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
    torch_trainer<fl_hsdp, optim::adamw> t(m, model_t(nets[r], mse), {.lr = 0.02f},
                                           {.total_steps = kSteps, .schedule = {.period = 4}});
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
