// Consumer of fedshard: 4 in-process ranks all_reduce a vector; exit 0 when every rank
// holds the expected sum.
#include <fedshard/comm/communicator.hpp>
#include <fedshard/comm/inproc.hpp>
#include <fedshard/version.hpp>

#include <atomic>
#include <cstdio>
#include <exception>
#include <span>
#include <vector>

int main() {
  constexpr int ranks = 4;
  constexpr double expected = 1.0 + 2.0 + 3.0 + 4.0;
  std::atomic<int> wrong{0};
  try {
    fedshard::inproc::run(ranks, [&](fedshard::inproc::communicator& world) {
      std::vector<double> values(5, world.rank() + 1.0);
      fedshard::all_reduce(world, std::span<double>(values), fedshard::reduce_op::sum);
      for (double v : values) {
        if (v != expected) ++wrong;
      }
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
  if (wrong != 0) {
    std::fprintf(stderr, "consumer: %d elements differ from %g\n", wrong.load(), expected);
    return 1;
  }
  std::printf("consumer: fedshard %s, %d ranks all_reduce ok\n", fedshard::version_string, ranks);
  return 0;
}
