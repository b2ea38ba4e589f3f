// The trainer on GPUs: with gpu_inproc (4 and 8 ranks sharing one GPU) it trains exactly as
// the host inproc run does, for ddp, fsdp, hsdp, fl_hsdp (K = 4) and diloco; with
// nccl::communicator (one rank per GPU present) it trains as the host run does up to NCCL's
// reduction order. The model is a small MLP whose compute, on a device, is CUDA kernels on
// the step context's stream, and on the host the same functions in loops: every float
// operation is an explicitly rounded one (__fadd_rn, __fmul_rn, ...), in the same order, so
// the two compute the same bits.
#include "fedshard/cuda/gpu_inproc.cuh"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <thread>
#include <type_traits>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/cuda/cuda_space.cuh"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/tiny_mlp.hpp"

#if defined(FEDSHARD_HAS_NCCL)
#include "fedshard/cuda/nccl.cuh"
#endif

namespace {

namespace gpu = fedshard::gpu;
namespace gpu_inproc = fedshard::gpu_inproc;
using namespace fedshard;
using test::sample;

// ---------------------------------------------------------------- the model's arithmetic

/// Rounded float operations, the same on the host and the device (no FMA contraction).
FEDSHARD_HOST_DEVICE inline float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
FEDSHARD_HOST_DEVICE inline float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
FEDSHARD_HOST_DEVICE inline float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
FEDSHARD_HOST_DEVICE inline float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
/// softsign(z) = z / (1 + |z|), and its derivative 1 / (1 + |z|)^2.
FEDSHARD_HOST_DEVICE inline float softsign(float z) {
  return div(z, add(1.0f, fabsf(z)));
}
FEDSHARD_HOST_DEVICE inline float softsign_grad(float z) {
  const float r = div(1.0f, add(1.0f, fabsf(z)));
  return mul(r, r);
}

/// z[n, i] = b[i] + sum_j w[i, j] x[n, j] (j in order), a = softsign(z) (or z): idx = n * out + i.
struct dense_forward {
  const float *w, *b, *x;
  float *z, *a;
  int in, out;
  bool act;
  FEDSHARD_HOST_DEVICE void operator()(int idx) const {
    const int n = idx / out, i = idx % out;
    float acc = b[i];
    for (int j = 0; j < in; ++j) acc = add(acc, mul(w[i * in + j], x[n * in + j]));
    z[idx] = acc;
    a[idx] = act ? softsign(acc) : acc;
  }
};
/// dy = (y - t) / B: idx = n * out + k.
struct loss_grad {
  const float *y, *t;
  float* dy;
  int batch;
  FEDSHARD_HOST_DEVICE void operator()(int idx) const {
    dy[idx] = div(sub(y[idx], t[idx]), static_cast<float>(batch));
  }
};
/// loss = (sum over elements of 0.5 (y - t)^2) / B, one thread.
struct loss_value {
  const float *y, *t;
  float* loss;
  int elems, batch;
  FEDSHARD_HOST_DEVICE void operator()(int) const {
    float acc = 0.0f;
    for (int e = 0; e < elems; ++e) {
      const float d = sub(y[e], t[e]);
      acc = add(acc, mul(0.5f, mul(d, d)));
    }
    *loss = div(acc, static_cast<float>(batch));
  }
};
/// gw[i, j] += sum_n dz[n, i] x[n, j], gb[i] += sum_n dz[n, i] (n in order): idx over
/// out * in weights then out biases.
struct dense_param_grad {
  const float *dz, *x;
  float *gw, *gb;
  int in, out, batch;
  FEDSHARD_HOST_DEVICE void operator()(int idx) const {
    if (idx < in * out) {
      const int i = idx / in, j = idx % in;
      float acc = gw[idx];
      for (int n = 0; n < batch; ++n) acc = add(acc, mul(dz[n * out + i], x[n * in + j]));
      gw[idx] = acc;
    } else {
      const int i = idx - in * out;
      float acc = gb[i];
      for (int n = 0; n < batch; ++n) acc = add(acc, dz[n * out + i]);
      gb[i] = acc;
    }
  }
};
/// dx[n, j] = sum_i dz[n, i] w[i, j] (i in order), times softsign'(zin[n, j]) when zin is
/// given: idx = n * in + j.
struct dense_input_grad {
  const float *dz, *w, *zin;
  float* dx;
  int in, out;
  FEDSHARD_HOST_DEVICE void operator()(int idx) const {
    const int n = idx / in, j = idx % in;
    float acc = 0.0f;
    for (int i = 0; i < out; ++i) acc = add(acc, mul(dz[n * out + i], w[i * in + j]));
    dx[idx] = zin != nullptr ? mul(acc, softsign_grad(zin[idx])) : acc;
  }
};

template <class F>
__global__ void range_kernel(F f, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) f(i);
}

/// f(0), ..., f(n - 1): on the host for a host-accessible space, else a kernel on st.
template <class S, class F>
void run_range(typename S::stream& st, int n, const F& f) {
  if (n <= 0) return;
  if constexpr (S::host_accessible) {
    for (int i = 0; i < n; ++i) f(i);
  } else {
    range_kernel<<<(n + 127) / 128, 128, 0, st.get()>>>(f, n);
    gpu::detail::check_launch("test_trainer_gpu range_kernel");
  }
}

// ---------------------------------------------------------------- the model

/// y = W2 s(W1 s(W0 x + b0) + b1) + b2 with s = softsign, loss = mean of 0.5 |y - t|^2; the
/// units of tiny_mlp ("layer0", "layer1", "head") and its samples.
struct device_mlp {
  test::tiny_mlp net;

  std::vector<unit_spec> units() const { return net.units(); }
  std::vector<float> initial_values(const flat_layout& l, std::size_t u) const {
    return net.init_unit(l, u, 7);
  }

  template <class Ctx>
  float forward_backward(Ctx& ctx, const std::vector<sample>& batch) {
    using S = typename Ctx::space_type;
    S& sp = ctx.space();
    auto& st = ctx.stream();
    const flat_layout& l = ctx.layout();
    const int B = static_cast<int>(batch.size()), D = net.d, H = net.h, O = net.o;
    std::vector<float> hx, ht;
    for (const sample& s : batch) {
      hx.insert(hx.end(), s.x.begin(), s.x.end());
      ht.insert(ht.end(), s.t.begin(), s.t.end());
    }
    auto buf = [&](int n) { return sp.template allocate<float>(static_cast<std::size_t>(n)); };
    auto x = buf(B * D), t = buf(B * O), z0 = buf(B * H), a0 = buf(B * H), z1 = buf(B * H),
         a1 = buf(B * H), y = buf(B * O), dy = buf(B * O), d1 = buf(B * H), d0 = buf(B * H),
         loss = buf(1);
    sp.from_host(st, cview(std::span<const float>(hx)), x.view());
    sp.from_host(st, cview(std::span<const float>(ht)), t.view());
    {
      auto p = ctx.acquire(0);
      run_range<S>(st, B * H,
                   dense_forward{l.tensor_view(p, 0, 0).data(), l.tensor_view(p, 0, 1).data(),
                                 x.data(), z0.data(), a0.data(), D, H, true});
      ctx.release(0);
    }
    {
      auto p = ctx.acquire(1);
      run_range<S>(st, B * H,
                   dense_forward{l.tensor_view(p, 1, 0).data(), l.tensor_view(p, 1, 1).data(),
                                 a0.data(), z1.data(), a1.data(), H, H, true});
      ctx.release(1);
    }
    {
      auto p = ctx.acquire(2);
      run_range<S>(st, B * O,
                   dense_forward{l.tensor_view(p, 2, 0).data(), l.tensor_view(p, 2, 1).data(),
                                 a1.data(), y.data(), y.data(), H, O, false});
      run_range<S>(st, B * O, loss_grad{y.data(), t.data(), dy.data(), B});
      run_range<S>(st, 1, loss_value{y.data(), t.data(), loss.data(), B * O, B});
      ctx.release(2);
      p = ctx.acquire(2, phase::backward);
      auto g = ctx.grad_buffer(2);
      run_range<S>(st, O * H + O,
                   dense_param_grad{dy.data(), a1.data(), l.tensor_view(g, 2, 0).data(),
                                    l.tensor_view(g, 2, 1).data(), H, O, B});
      run_range<S>(
          st, B * H,
          dense_input_grad{dy.data(), l.tensor_view(p, 2, 0).data(), z1.data(), d1.data(), H, O});
      ctx.release(2);
      ctx.grads_ready(2);
    }
    {
      auto p = ctx.acquire(1, phase::backward);
      auto g = ctx.grad_buffer(1);
      run_range<S>(st, H * H + H,
                   dense_param_grad{d1.data(), a0.data(), l.tensor_view(g, 1, 0).data(),
                                    l.tensor_view(g, 1, 1).data(), H, H, B});
      run_range<S>(
          st, B * H,
          dense_input_grad{d1.data(), l.tensor_view(p, 1, 0).data(), z0.data(), d0.data(), H, H});
      ctx.release(1);
      ctx.grads_ready(1);
    }
    {
      ctx.acquire(0, phase::backward);
      auto g = ctx.grad_buffer(0);
      run_range<S>(st, H * D + H,
                   dense_param_grad{d0.data(), x.data(), l.tensor_view(g, 0, 0).data(),
                                    l.tensor_view(g, 0, 1).data(), D, H, B});
      ctx.release(0);
      ctx.grads_ready(0);
    }
    float value = 0.0f;
    sp.to_host(st, loss.view(), view(std::span<float>(&value, 1)));
    sp.synchronize(st);  // the loss, and the scratch buffers above may go
    return value;
  }

  /// Rank `local` of group `group`'s batch at step `step` (tiny_mlp's stream).
  std::vector<sample> batch(int step, int group, int groups, int local, int group_size) const {
    test::mlp_model m{net, 7};
    return m.batch(11, step, group, groups, local, group_size, 3);
  }
};

// ---------------------------------------------------------------- runs

/// Every rank's final parameters and losses.
struct outcome {
  std::vector<std::vector<float>> params, losses;
};

/// Trains device_mlp for `steps` on one rank of a mesh over `world` (any communicator).
template <class A, class C>
void train_rank(C& world, mesh_shape shape, int steps, trainer_options<A> opts, outcome& out) {
  mesh m(world, shape);
  trainer<device_mlp, A, optim::adamw, C> t(m, device_mlp{}, {.lr = 0.01f}, opts);
  const int g = m.coords().group;
  const int gs = shape.replicas * shape.shards;
  const int local = m.coords().replica * shape.shards + m.coords().shard;
  std::vector<float> losses;
  for (int s = 0; s < steps; ++s)
    losses.push_back(t.step(t.model().batch(s, g, shape.groups, local, gs)));
  const auto r = static_cast<std::size_t>(world.rank());
  out.params[r] = t.parameters();
  out.losses[r] = losses;
}

template <class A>
trainer_options<A> options_of(int period, int steps) {
  trainer_options<A> o;
  if constexpr (requires { o.schedule.period; }) o.schedule.period = period;
  o.total_steps = steps;
  return o;
}

template <class A>
outcome on_host(mesh_shape shape, int steps, int period) {
  outcome out;
  out.params.resize(static_cast<std::size_t>(shape.size()));
  out.losses.resize(out.params.size());
  inproc::run(shape.size(), [&](inproc::communicator& world) {
    train_rank<A>(world, shape, steps, options_of<A>(period, steps), out);
  });
  return out;
}

template <class A>
outcome on_gpu_inproc(mesh_shape shape, int steps, int period) {
  outcome out;
  out.params.resize(static_cast<std::size_t>(shape.size()));
  out.losses.resize(out.params.size());
  gpu_inproc::options o;
  o.devices = {0};
  o.timeout = std::chrono::seconds(120);
  gpu_inproc::run(
      shape.size(),
      [&](gpu_inproc::communicator& world) {
        train_rank<A>(world, shape, steps, options_of<A>(period, steps), out);
      },
      o);
  return out;
}

double max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::abs(double(a[i]) - b[i]) / std::max(1e-2, std::abs(double(b[i]))));
  return worst;
}

template <class A>
void check_same(const char* name, mesh_shape shape, int period = 4) {
  const int steps = 6;
  const outcome want = on_host<A>(shape, steps, period);
  const outcome got = on_gpu_inproc<A>(shape, steps, period);
  for (int r = 0; r < shape.size(); ++r) {
    const auto u = static_cast<std::size_t>(r);
    INFO(name, " on ", shape.size(), " ranks (", shape.groups, " x ", shape.replicas, " x ",
         shape.shards, "), rank ", r);
    REQUIRE(!got.params[u].empty());
    CHECK(max_rel(got.params[u], want.params[u]) <= 1e-6);
    CHECK(max_rel(got.losses[u], want.losses[u]) <= 1e-6);
  }
}

static_assert(
    std::is_same_v<trainer<device_mlp, ddp, optim::adamw, gpu_inproc::communicator>::space_type,
                   gpu::cuda_space>);

TEST_CASE("the trainer on gpu_inproc (4 ranks on one GPU) equals the host inproc run") {
  check_same<ddp>("ddp", {1, 4, 1});
  check_same<fsdp>("fsdp", {1, 1, 4});
  check_same<hsdp>("hsdp", {1, 2, 2});
  check_same<fl_hsdp>("fl_hsdp, K = 4", {2, 1, 2}, 4);
  check_same<diloco>("diloco, H = 3", {2, 1, 2}, 3);
}

TEST_CASE("the trainer on gpu_inproc (8 ranks on one GPU) equals the host inproc run") {
  check_same<ddp>("ddp", {1, 8, 1});
  check_same<fsdp>("fsdp", {1, 1, 8});
  check_same<hsdp>("hsdp", {1, 2, 4});
  check_same<fl_hsdp>("fl_hsdp, K = 4", {2, 2, 2}, 4);
  check_same<diloco>("diloco, H = 3", {2, 2, 2}, 3);
}

#if defined(FEDSHARD_HAS_NCCL)
static_assert(
    std::is_same_v<trainer<device_mlp, fsdp, optim::adamw, nccl::communicator>::space_type,
                   gpu::cuda_space>);

/// Runs A on one NCCL rank per GPU (one thread each) and compares with the host run; NCCL
/// reduces in its own order, so within 1e-5.
template <class A>
void check_nccl(const char* name, mesh_shape shape) {
  const int steps = 4;
  const outcome want = on_host<A>(shape, steps, 4);
  std::vector<int> devices(static_cast<std::size_t>(shape.size()));
  for (int i = 0; i < shape.size(); ++i) devices[static_cast<std::size_t>(i)] = i;
  auto comms = nccl::communicator::init_all(devices);
  outcome got;
  got.params.resize(devices.size());
  got.losses.resize(devices.size());
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(devices.size());
  for (std::size_t r = 0; r < devices.size(); ++r)
    threads.emplace_back([&, r] {
      try {
        FEDSHARD_CUDA_TRY(cudaSetDevice(devices[r]));
        train_rank<A>(comms[r], shape, steps, options_of<A>(4, steps), got);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& th : threads) th.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  for (std::size_t r = 0; r < devices.size(); ++r) {
    INFO(name, " on ", devices.size(), " NCCL ranks, rank ", r);
    CHECK(max_rel(got.params[r], want.params[r]) <= 1e-5);
  }
}

TEST_CASE("the trainer on nccl::communicator (one rank per GPU) trains as the host run does") {
  const int n = gpu::device_count();
  if (n < 1) return;
  check_nccl<ddp>("ddp", {1, n, 1});
  check_nccl<fsdp>("fsdp", {1, 1, n});
}
#endif

}  // namespace
