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
#include "support/gpu_runs.cuh"

#if defined(FEDSHARD_HAS_NCCL)
#include "fedshard/cuda/nccl.cuh"
#endif

namespace {

namespace gpu = fedshard::gpu;
namespace gpu_inproc = fedshard::gpu_inproc;
using namespace fedshard;
using namespace fedshard::test::gpu_runs;

static_assert(std::is_same_v<
              trainer<tiny_device_mlp, ddp, optim::adamw, gpu_inproc::communicator>::space_type,
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
    std::is_same_v<trainer<tiny_device_mlp, fsdp, optim::adamw, nccl::communicator>::space_type,
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
