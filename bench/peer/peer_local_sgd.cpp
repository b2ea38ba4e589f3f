// fedshard's side of bench/peer/local_sgd.sh: one group (one process, one rank, one torch
// thread) of fl_fsdp (the parameters averaged over the groups every K steps) with the model,
// data and optimizer of bench/peer/torchft_local_sgd.py (torchft's LocalSGD), over a fixed Gloo
// link (gloo::communicator) or an elastic one (elastic::link), the groups meeting through a
// file store.
//
//   peer_local_sgd --group G --store DIR [--groups 2] [--link gloo|elastic] [--optim sgd|adamw]
//                  [--algo fl_fsdp|diloco] [--steps S] [--k K] [--warmup W] [--out FILE]
//
// --algo diloco: the groups' models combined every K steps by DiLoCo's outer Nesterov step
// (lr 0.7, momentum 0.9) on the mean pseudo-gradient, against torchft's DiLoCo.
//
// Model: 4 x Linear(1024, 1024) with ReLU between, torch's initialisation after
// torch::manual_seed(0), the layers made in order. Step s of group g: input and target of
// 64 x 1024 from torch::randn with a CPU generator seeded 1000 s + g; MSE; SGD (lr 0.01) or
// AdamW (torch's defaults: lr 1e-3, betas 0.9 and 0.999, eps 1e-8, weight decay 0.01).
// Group 0 prints "step_ms <the mean of the steps after the warm-up ones>" (syncs amortized)
// and writes its parameters after the last step (module order, raw f32) to FILE.
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <fedshard/comm/elastic.hpp>
#include <fedshard/comm/gloo.hpp>
#include <fedshard/comm/hybrid.hpp>
#include <fedshard/comm/inproc.hpp>
#include <fedshard/mesh/mesh.hpp>
#include <fedshard/optim/adamw.hpp>
#include <fedshard/optim/sgd.hpp>
#include <fedshard/trainer/algorithm.hpp>
#include <fedshard/trainer/trainer.hpp>

#include "../../examples/common/cli.hpp"
#include "peer_model.hpp"

namespace {

using peer::batch_of;
using peer::kLr;
using peer::make_net;
using peer::model_t;
using peer::mse;
using peer::net_t;

struct settings {
  std::int64_t group = -1;
  std::int64_t groups = 2;
  std::string store;
  std::string link = "gloo";
  std::string optim = "sgd";
  std::string algo = "fl_fsdp";
  std::int64_t steps = 40;
  std::int64_t k = 20;
  std::int64_t warmup = 20;
  std::string out;
};

/// Trains this group over world W (its federation side the link) with algorithm A and
/// optimizer O; returns the mean step.
template <class A, class O, class W>
double train(W& world, const settings& s, typename O::config cfg, std::vector<float>& params) {
  const int G = static_cast<int>(s.groups);
  fedshard::mesh m(world, {.groups = G, .replicas = 1, .shards = 1});
  fedshard::trainer_options<A> o;
  o.schedule.period = static_cast<int>(s.k);
  o.total_steps = s.warmup + s.steps;
  o.log = [](const std::string&) {};
  fedshard::trainer<model_t, A, O, W> t(m, model_t(make_net(), mse), cfg, o);
  std::chrono::steady_clock::time_point start;
  for (std::int64_t step = 0; step < s.warmup + s.steps; ++step) {
    if (step == s.warmup) start = std::chrono::steady_clock::now();
    t.step(batch_of(step, s.group));
  }
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  params = t.parameters();
  return ms / static_cast<double>(s.steps);
}

/// train() with the algorithm and optimizer s names.
template <class A, class W>
double run_optim(W& world, const settings& s, std::vector<float>& params) {
  if (s.optim == "adamw")
    return train<A, fedshard::optim::adamw>(world, s, fedshard::optim::adamw_config{}, params);
  return train<A, fedshard::optim::sgd>(world, s, fedshard::optim::sgd_config{.lr = kLr}, params);
}
template <class W>
double run_with(W& world, const settings& s, std::vector<float>& params) {
  if (s.algo == "diloco") return run_optim<fedshard::diloco>(world, s, params);
  return run_optim<fedshard::fl_fsdp>(world, s, params);
}

}  // namespace

int main(int argc, char** argv) {
  return cli::run_main("peer_local_sgd", [&] {
    settings s;
    cli::parser p;
    p.integer("--group", s.group, 0, 63)
        .integer("--groups", s.groups, 1, 64)
        .text("--store", s.store)
        .custom("--link",
                [&](const std::string& o, const std::string& v) {
                  if (v != "gloo" && v != "elastic")
                    cli::fail(o + " expects gloo or elastic, found " + v);
                  s.link = v;
                })
        .integer("--steps", s.steps, 1, 100000)
        .integer("--k", s.k, 1, 100000)
        .integer("--warmup", s.warmup, 0, 100000)
        .text("--out", s.out);
    p.custom("--optim", [&](const std::string& o, const std::string& v) {
      if (v != "sgd" && v != "adamw") cli::fail(o + " expects sgd or adamw, found " + v);
      s.optim = v;
    });
    p.custom("--algo", [&](const std::string& o, const std::string& v) {
      if (v != "fl_fsdp" && v != "diloco") cli::fail(o + " expects fl_fsdp or diloco, found " + v);
      s.algo = v;
    });
    p.parse(argc, argv);
    if (s.group < 0 || s.group >= s.groups || s.store.empty())
      cli::fail("--group (< --groups) and --store are needed");
    torch::set_num_threads(1);
    auto st = std::make_shared<fedshard::gloo::file_store>(s.store);
    const int G = static_cast<int>(s.groups), g = static_cast<int>(s.group);
    std::vector<float> params;
    double ms = 0;
    fedshard::inproc::run(1, [&](fedshard::inproc::communicator& c) {
      if (s.link == "gloo") {
        fedshard::gloo::communicator lk(st, "link", g, G);
        fedshard::hybrid<fedshard::inproc::communicator, fedshard::gloo::communicator> w(
            c.split(0, 0), std::move(lk));
        ms = run_with(w, s, params);
      } else {
        fedshard::elastic::options eo;
        eo.log = [](const std::string&) {};
        fedshard::elastic::link lk(st, G, g, 1, 0, eo);
        fedshard::hybrid<fedshard::inproc::communicator, fedshard::elastic::link> w(c.split(0, 0),
                                                                                    std::move(lk));
        ms = run_with(w, s, params);
      }
    });
    if (g != 0) return 0;
    std::printf("step_ms %.4f\n", ms);
    if (!s.out.empty()) {
      std::ofstream f(s.out, std::ios::binary);
      f.write(reinterpret_cast<const char*>(params.data()),
              static_cast<std::streamsize>(params.size() * sizeof(float)));
      if (!f) cli::fail("cannot write " + s.out);
    }
    return 0;
  });
}
