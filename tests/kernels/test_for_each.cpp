#include "fedshard/kernels/for_each.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <vector>

namespace kernels = fedshard::kernels;

TEST_CASE("for_each_element applies the functor to element i of every array, in order") {
  std::vector<float> x{1, 2, 3, 4, 5};
  const std::vector<float> y{10, 20, 30, 40, 50};
  std::size_t calls = 0;
  float* next = x.data();
  kernels::for_each_element(
      [&next, &calls](float& xi, float yi) {
        CHECK(&xi == next++);  // index order
        xi += 0.5f * yi;
        ++calls;
      },
      x.size(), x.data(), y.data());
  CHECK(calls == 5);
  CHECK(x == std::vector<float>{6, 12, 18, 24, 30});
}

TEST_CASE("for_each_element updates every array the functor takes by reference") {
  std::vector<float> p{1, 2, 3}, m{0, 0, 0}, v{4, 4, 4};
  const std::vector<float> g{1, -1, 2};
  kernels::for_each_element(
      [](float& pi, float gi, float& mi, float& vi) {
        mi = mi + gi;
        vi = vi - gi;
        pi = pi - mi;
      },
      p.size(), p.data(), g.data(), m.data(), v.data());
  CHECK(m == std::vector<float>{1, -1, 2});
  CHECK(v == std::vector<float>{3, 5, 2});
  CHECK(p == std::vector<float>{0, 3, 1});
}

TEST_CASE("for_each_element: n = 0 touches nothing; a read array may be the updated one") {
  kernels::for_each_element([](float&, float) { FAIL("called on an empty range"); }, 0,
                            static_cast<float*>(nullptr), static_cast<const float*>(nullptr));
  std::vector<float> x{1, 2, 3};
  kernels::for_each_element([](float& xi, float yi) { xi = xi - 2 * yi; }, x.size(), x.data(),
                            static_cast<const float*>(x.data()));
  CHECK(x == std::vector<float>{-1, -2, -3});
  // The functor is a copy: its state is the caller's, unchanged by the loop.
  struct counter {
    int n = 0;
    void operator()(float&) { ++n; }
  };
  counter c;
  kernels::for_each_element(c, x.size(), x.data());
  CHECK(c.n == 0);
}
