#include "fedshard/core/reduce_op.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string_view>
#include <vector>

using fedshard::combine;
using fedshard::reduce_op;

static_assert(combine(reduce_op::sum, 2.0f, 3.0f) == 5.0f);
static_assert(combine(reduce_op::max, 2, 3) == 3);

TEST_CASE_TEMPLATE("combine applies each reduce_op", A, float, double) {
  const A a = A(1.5), b = A(-4.25);
  CHECK(combine(reduce_op::sum, a, b) == A(-2.75));
  CHECK(combine(reduce_op::sum, b, a) == A(-2.75));
  CHECK(combine(reduce_op::avg, a, b) == A(-2.75));  // avg adds; the caller divides at the end
  CHECK(combine(reduce_op::min, a, b) == b);
  CHECK(combine(reduce_op::min, b, a) == b);
  CHECK(combine(reduce_op::max, a, b) == a);
  CHECK(combine(reduce_op::max, b, a) == a);
  CHECK(combine(reduce_op::min, a, a) == a);
  CHECK(combine(reduce_op::max, b, b) == b);

  const A inf = std::numeric_limits<A>::infinity();
  CHECK(combine(reduce_op::min, -inf, a) == -inf);
  CHECK(combine(reduce_op::max, a, inf) == inf);
  CHECK(combine(reduce_op::sum, inf, a) == inf);
}

TEST_CASE("avg accumulates like sum over many values") {
  double sum = 0, avg = 0;
  for (int i = 1; i <= 10; ++i) {
    sum = combine(reduce_op::sum, sum, double(i));
    avg = combine(reduce_op::avg, avg, double(i));
  }
  CHECK(sum == 55.0);
  CHECK(avg == sum);
}

TEST_CASE_TEMPLATE("min and max propagate NaN from either argument", A, float, double) {
  const A nan = std::numeric_limits<A>::quiet_NaN();
  const A inf = std::numeric_limits<A>::infinity();
  for (reduce_op op : fedshard::all_reduce_ops) {
    CAPTURE(fedshard::to_string(op));
    for (A x : {A(0), A(-1), A(7.5), inf, -inf}) {
      CAPTURE(x);
      CHECK(std::isnan(combine(op, nan, x)));
      CHECK(std::isnan(combine(op, x, nan)));
    }
    CHECK(std::isnan(combine(op, nan, nan)));
  }
  // A chain keeps the NaN whatever comes after it.
  A m = A(3);
  for (A x : {A(1), nan, A(-5), A(0)}) m = combine(reduce_op::min, m, x);
  CHECK(std::isnan(m));
  A M = A(3);
  for (A x : {A(1), nan, A(50), A(0)}) M = combine(reduce_op::max, M, x);
  CHECK(std::isnan(M));
}

TEST_CASE("to_string and is_valid of every reduce_op") {
  CHECK(fedshard::to_string(reduce_op::sum) == "sum");
  CHECK(fedshard::to_string(reduce_op::avg) == "avg");
  CHECK(fedshard::to_string(reduce_op::min) == "min");
  CHECK(fedshard::to_string(reduce_op::max) == "max");
  std::vector<std::string_view> names;
  for (reduce_op op : fedshard::all_reduce_ops) {
    CHECK(fedshard::is_valid(op));
    names.push_back(fedshard::to_string(op));
  }
  std::sort(names.begin(), names.end());
  CHECK(names.size() == 4);
  CHECK(std::adjacent_find(names.begin(), names.end()) == names.end());
  const auto bad = static_cast<reduce_op>(9);
  CHECK_FALSE(fedshard::is_valid(bad));
  CHECK(fedshard::to_string(bad) == "unknown-op");
}
