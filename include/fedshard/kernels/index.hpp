#pragma once
/// Packing and unpacking by index (shard::sparse's masked elements): gather out[j] =
/// in[idx[j] - base] and scatter out[idx[j] - base] = in[j], for j < idx.size(). The
/// indices are 32-bit and relative to `base` (an index names an element of a larger array of
/// which `in` (gather) or `out` (scatter) is the part from `base` on). The per-element
/// bodies are FEDSHARD_HOST_DEVICE functors of j; the host loops here and the memory spaces'
/// gather_index / scatter_index (space/memory_space.hpp, requirement 5) run them.

#include <cstddef>
#include <cstdint>
#include <span>

#include "fedshard/config.hpp"
#include "fedshard/error.hpp"

namespace fedshard::kernels {

/// Element j of a gather by index: out[j] = in[idx[j] - base].
template <class T>
struct gather_index_fn {
  const T* in;
  const std::uint32_t* idx;
  std::uint32_t base;
  T* out;
  FEDSHARD_HOST_DEVICE void operator()(std::size_t j) const noexcept { out[j] = in[idx[j] - base]; }
};

/// Element j of a scatter by index: out[idx[j] - base] = in[j].
template <class T>
struct scatter_index_fn {
  const T* in;
  const std::uint32_t* idx;
  std::uint32_t base;
  T* out;
  FEDSHARD_HOST_DEVICE void operator()(std::size_t j) const noexcept { out[idx[j] - base] = in[j]; }
};

namespace detail {

/// invalid_argument unless `idx` (as many as `packed` holds) names elements base ..
/// base + whole - 1 only. `what` names the caller.
inline void check_indices(std::span<const std::uint32_t> idx, std::uint32_t base,
                          std::size_t packed, std::size_t whole, const char* what) {
  FEDSHARD_EXPECTS(idx.size() == packed, what, ": expected as many indices as packed elements (",
                   packed, "), found ", idx.size());
  for (std::size_t j = 0; j < idx.size(); ++j)
    FEDSHARD_EXPECTS(idx[j] >= base && idx[j] - base < whole, what, ": index ", j, " is ", idx[j],
                     ", expected one in [", base, ", ", std::size_t{base} + whole, ")");
}

}  // namespace detail

/// out[j] = in[idx[j] - base] for every j < out.size() (on the host); invalid_argument when
/// idx has another size than out or an index outside [base, base + in.size()).
template <class T>
void gather_index(std::span<const T> in, std::span<const std::uint32_t> idx, std::uint32_t base,
                  std::span<T> out) {
  detail::check_indices(idx, base, out.size(), in.size(), "kernels::gather_index");
  const gather_index_fn<T> f{in.data(), idx.data(), base, out.data()};
  for (std::size_t j = 0; j < out.size(); ++j) f(j);
}

/// out[idx[j] - base] = in[j] for every j < in.size() (on the host); invalid_argument when
/// idx has another size than in or an index outside [base, base + out.size()).
template <class T>
void scatter_index(std::span<const T> in, std::span<const std::uint32_t> idx, std::uint32_t base,
                   std::span<T> out) {
  detail::check_indices(idx, base, in.size(), out.size(), "kernels::scatter_index");
  const scatter_index_fn<T> f{in.data(), idx.data(), base, out.data()};
  for (std::size_t j = 0; j < in.size(); ++j) f(j);
}

}  // namespace fedshard::kernels
