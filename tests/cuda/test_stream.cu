#include "fedshard/cuda/stream.cuh"

#include <doctest/doctest.h>

#include <cstddef>
#include <utility>
#include <vector>

#include "fedshard/cuda/device_buffer.cuh"
#include "fedshard/cuda/error.cuh"

namespace {

namespace gpu = fedshard::gpu;

TEST_CASE("there is a device, and device_guard restores the current one") {
  REQUIRE(gpu::device_count() >= 1);
  const int before = gpu::current_device();
  {
    gpu::device_guard g(gpu::device_count() - 1);
    CHECK(gpu::current_device() == gpu::device_count() - 1);
  }
  CHECK(gpu::current_device() == before);
}

TEST_CASE("events capture stream work; another stream can wait for them") {
  const std::size_t n = std::size_t{64} << 20;
  gpu::device_buffer<unsigned char> buf = gpu::device_buffer<unsigned char>::uninitialized(n);
  gpu::stream producer, consumer;
  gpu::event start(cudaEventDefault), done(cudaEventDefault);
  start.record(producer);
  FEDSHARD_CUDA_TRY(cudaMemsetAsync(buf.data(), 0x11, n, producer));
  done.record(producer);
  gpu::wait(consumer, done);
  std::vector<unsigned char> host(n);
  FEDSHARD_CUDA_TRY(cudaMemcpyAsync(host.data(), buf.data(), n, cudaMemcpyDeviceToHost, consumer));
  consumer.synchronize();
  CHECK(done.ready());
  CHECK(consumer.ready());
  for (std::size_t i = 0; i < n; i += 4099) REQUIRE(host[i] == 0x11);
  CHECK(host[n - 1] == 0x11);
  CHECK(gpu::event::elapsed_ms(start, done) > 0.0f);
}

TEST_CASE("streams and events move; the source releases its handle") {
  gpu::stream a;
  cudaStream_t raw = a.get();
  REQUIRE(raw != nullptr);
  gpu::stream b(std::move(a));
  CHECK(a.get() == nullptr);
  CHECK(b.get() == raw);
  gpu::event e;
  cudaEvent_t ev = e.get();
  gpu::event f;
  f = std::move(e);
  CHECK(e.get() == nullptr);
  CHECK(f.get() == ev);
  f.record(b);
  f.synchronize();
  CHECK(f.ready());
}

}  // namespace
