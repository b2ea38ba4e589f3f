/// The main() of the GPU test executables (tests/cuda/, ctest label "gpu").
///
/// With a CUDA device it runs every test case. Without one (no device, no driver) it runs
/// only the test cases of the test suite "no_device" (argument checks and error texts that
/// need no device) and then exits with 77, which CMake registers as SKIP_RETURN_CODE: ctest
/// reports the test as skipped, not failed, unless a no_device case failed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <cstdio>

int main(int argc, char** argv) {
  doctest::Context context;
  context.applyCommandLine(argc, argv);
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    context.addFilter("test-suite", "no_device");
    const int result = context.run();
    if (result != 0 || context.shouldExit()) return result;
    std::printf("fedshard: no CUDA device (%s); the device test cases were skipped\n",
                status != cudaSuccess ? cudaGetErrorString(status) : "device count is 0");
    return 77;
  }
  return context.run();
}
