// The nvcc side of torch_device_bridge.hpp: fedshard's trainer on gpu_inproc ranks (buffers
// in cuda_space) driving a bridge::device_model, which the host-compiler unit implements with
// torch_model. No LibTorch header here (see torch_device_bridge.hpp for why).
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "fedshard/cuda/gpu_inproc.cuh"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/trainer/algorithm.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "torch_device_bridge.hpp"

namespace fedshard_torch::bridge {

namespace {

/// A batch of the bridged model: its index.
struct bridged_batch {
  std::int64_t index = 0;
};

/// The trainer's step context seen through device_step.
template <class Ctx>
class context_step final : public device_step {
 public:
  explicit context_step(Ctx& ctx) : ctx_(&ctx) {}
  const fedshard::flat_layout& layout() const override { return ctx_->layout(); }
  std::span<const float> acquire(std::size_t u, fedshard::phase ph) override {
    return ctx_->acquire(u, ph);
  }
  void release(std::size_t u) override { ctx_->release(u); }
  std::span<float> grad_buffer(std::size_t u) override { return ctx_->grad_buffer(u); }
  void grads_ready(std::size_t u) override { ctx_->grads_ready(u); }
  int device() const override { return ctx_->space().device(); }
  void* stream() const override { return static_cast<void*>(ctx_->stream().get()); }

 private:
  Ctx* ctx_;
};

/// A fedshard Model forwarding to a device_model.
class bridged_model {
 public:
  using context = fedshard::basic_step_context<fedshard::gpu::cuda_space>;

  explicit bridged_model(std::shared_ptr<device_model> m) : m_(std::move(m)) {}
  std::vector<fedshard::unit_spec> units() const { return m_->units(); }
  std::vector<float> initial_values(const fedshard::flat_layout& l, std::size_t u) const {
    return m_->initial_values(l, u);
  }
  std::int64_t tokens(const bridged_batch& b) const { return m_->tokens(b.index); }
  float forward_backward(context& ctx, const bridged_batch& b) {
    context_step<context> step(ctx);
    return m_->forward_backward(step, b.index);
  }
  device_model& get() const { return *m_; }

 private:
  std::shared_ptr<device_model> m_;
};

template <class Opt>
run_result run_with(const run_options& o,
                    const std::function<std::shared_ptr<device_model>(int)>& model) {
  const int ranks = o.shape.size();
  run_result out;
  out.parameters.resize(static_cast<std::size_t>(ranks));
  out.losses.resize(static_cast<std::size_t>(ranks));
  out.peak_live_units.resize(static_cast<std::size_t>(ranks));
  fedshard::gpu_inproc::options go;
  go.devices = {o.device};
  go.timeout = o.timeout;
  fedshard::gpu_inproc::run(
      ranks,
      [&](fedshard::gpu_inproc::communicator& world) {
        const int rank = world.rank();
        const auto r = static_cast<std::size_t>(rank);
        fedshard::mesh m(world, o.shape);
        fedshard::trainer_options<fedshard::fl_hsdp> opts;
        opts.total_steps = o.steps;
        opts.schedule.period = o.period;
        fedshard::trainer<bridged_model, fedshard::fl_hsdp, Opt, fedshard::gpu_inproc::communicator>
            t(m, bridged_model(model(rank)), {.lr = o.lr}, opts);
        for (int s = 0; s < o.steps; ++s)
          out.losses[r].push_back(t.step(bridged_batch{std::int64_t{s} * ranks + rank}));
        out.parameters[r] = t.parameters();
        out.peak_live_units[r] = t.engine().peak_live_units();
        for (std::size_t u = 0; u < t.layout().num_units(); ++u)
          t.model().get().load_unit(t.layout(), u, t.unit_parameters(u));
      },
      go);
  return out;
}

}  // namespace

run_result run_fl_hsdp(const run_options& o,
                       const std::function<std::shared_ptr<device_model>(int)>& model) {
  return o.opt == optimizer::sgd ? run_with<fedshard::optim::sgd>(o, model)
                                 : run_with<fedshard::optim::adamw>(o, model);
}

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace fedshard_torch::bridge
