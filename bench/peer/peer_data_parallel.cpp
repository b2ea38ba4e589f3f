// fedshard's side of bench/peer/data_parallel.sh: ddp or fsdp of a LibTorch MLP on N inproc
// ranks (threads, one torch thread each), the model, data and optimizer of
// bench/peer/torch_data_parallel.py (torch DDP and FSDP2 over gloo), so that the two train the
// same parameters and their step times compare.
//
//   peer_data_parallel --algo ddp|fsdp [--ranks N] [--steps S] [--warmup W] [--out FILE]
//
// Model: 4 x Linear(1024, 1024) with ReLU between, torch's default initialisation after
// torch::manual_seed(0), built once and copied to every rank. Step s of rank r: input and
// target of 64 x 1024 from torch::randn with a CPU generator seeded 1000 s + r; MSE loss; SGD
// (lr 0.01). Prints "step_ms <median over the timed steps of rank 0's step>" and writes rank 0's
// parameters after the last step (module order, raw f32) to FILE.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <fedshard/comm/inproc.hpp>
#include <fedshard/mesh/mesh.hpp>
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
using comm_t = fedshard::inproc::communicator;

struct settings {
  std::string algo = "ddp";
  std::int64_t ranks = 2;
  std::int64_t steps = 30;
  std::int64_t warmup = 5;
  std::string out;
};

/// Trains on one rank; rank 0 fills `ms` (timed steps) and `params`.
template <class A>
void train(comm_t& world, const settings& s, const net_t& proto, fedshard::mesh_shape shape,
           std::vector<double>& ms, std::vector<float>& params) {
  torch::set_num_threads(1);
  fedshard::mesh m(world, shape);
  fedshard::trainer<model_t, A, fedshard::optim::sgd, comm_t> t(
      m, model_t(fedshard_torch::deep_copy(proto), mse), fedshard::optim::sgd_config{.lr = kLr});
  for (std::int64_t step = 0; step < s.warmup + s.steps; ++step) {
    const auto b = batch_of(step, world.rank());
    world.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    t.step(b);
    const double d =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (world.rank() == 0 && step >= s.warmup) ms.push_back(d);
  }
  std::vector<float> p = t.parameters();  // a collective
  if (world.rank() == 0) params = std::move(p);
}

}  // namespace

int main(int argc, char** argv) {
  return cli::run_main("peer_data_parallel", [&] {
    settings s;
    cli::parser p;
    p.custom("--algo",
             [&](const std::string& o, const std::string& v) {
               if (v != "ddp" && v != "fsdp") cli::fail(o + " expects ddp or fsdp, found " + v);
               s.algo = v;
             })
        .integer("--ranks", s.ranks, 1, 64)
        .integer("--steps", s.steps, 1, 100000)
        .integer("--warmup", s.warmup, 0, 100000)
        .text("--out", s.out);
    p.parse(argc, argv);
    const net_t proto = make_net();
    std::vector<double> ms;
    std::vector<float> params;
    const int n = static_cast<int>(s.ranks);
    fedshard::inproc::run(n, [&](comm_t& world) {
      if (s.algo == "ddp")
        train<fedshard::ddp>(world, s, proto, {.groups = 1, .replicas = n, .shards = 1}, ms,
                             params);
      else
        train<fedshard::fsdp>(world, s, proto, {.groups = 1, .replicas = 1, .shards = n}, ms,
                              params);
    });
    std::sort(ms.begin(), ms.end());
    std::printf("step_ms %.4f\n", ms[ms.size() / 2]);
    if (!s.out.empty()) {
      std::ofstream f(s.out, std::ios::binary);
      f.write(reinterpret_cast<const char*>(params.data()),
              static_cast<std::streamsize>(params.size() * sizeof(float)));
      if (!f) cli::fail("cannot write " + s.out);
    }
    return 0;
  });
}
