// Four ranks, each a thread of this process, sum a vector with all_reduce; rank 0 prints
// the result and checks it against the closed form.
#include <fedshard/comm/communicator.hpp>
#include <fedshard/comm/inproc.hpp>

#include <atomic>
#include <cstdio>
#include <exception>
#include <span>
#include <vector>

int main() {
  constexpr int ranks = 4;
  constexpr int n = 8;
  std::atomic<bool> ok{false};
  try {
    fedshard::inproc::run(ranks, [&](fedshard::inproc::communicator& world) {
      // Rank r contributes (r + 1) * (i + 1) at index i.
      std::vector<float> values(n);
      for (int i = 0; i < n; ++i) values[i] = static_cast<float>((world.rank() + 1) * (i + 1));

      fedshard::all_reduce(world, std::span<float>(values), fedshard::reduce_op::sum);

      if (world.rank() != 0) return;
      const int rank_sum = world.size() * (world.size() + 1) / 2;
      bool all_match = true;
      std::printf("all_reduce(sum) over %d ranks:", world.size());
      for (int i = 0; i < n; ++i) {
        std::printf(" %g", values[i]);
        all_match = all_match && values[i] == static_cast<float>(rank_sum * (i + 1));
      }
      std::printf("\nrank 0 check (element i == %d * (i + 1)): %s\n", rank_sum,
                  all_match ? "ok" : "MISMATCH");
      ok = all_match;
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "allreduce_inproc: %s\n", e.what());
    return 1;
  }
  return ok ? 0 : 1;
}
