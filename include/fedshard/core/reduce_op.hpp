#pragma once
/// Reduction operators of the collectives.

#include <cmath>
#include <cstdint>
#include <string_view>

#include "fedshard/config.hpp"

namespace fedshard {

/// How all_reduce and reduce_scatter combine the ranks' elements. `avg` is the sum divided
/// by the number of ranks. min and max propagate NaN.
enum class reduce_op : std::uint8_t { sum, avg, min, max };

/// Every reduce_op, for tests.
inline constexpr reduce_op all_reduce_ops[] = {reduce_op::sum, reduce_op::avg, reduce_op::min,
                                               reduce_op::max};

/// The name of a reduce_op.
constexpr std::string_view to_string(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return "sum";
    case reduce_op::avg: return "avg";
    case reduce_op::min: return "min";
    case reduce_op::max: return "max";
  }
  return "unknown-op";
}

/// True for the four values of the enum.
constexpr bool is_valid(reduce_op op) noexcept {
  return op == reduce_op::sum || op == reduce_op::avg || op == reduce_op::min ||
         op == reduce_op::max;
}

/// Combines two accumulated values with op; avg combines like sum (divide afterwards).
template <class A>
FEDSHARD_HOST_DEVICE constexpr A combine(reduce_op op, A a, A b) noexcept {
  switch (op) {
    case reduce_op::min: return (a != a || a < b) ? a : b;  // a != a: NaN propagates
    case reduce_op::max: return (a != a || a > b) ? a : b;
    default: return a + b;
  }
}

}  // namespace fedshard
