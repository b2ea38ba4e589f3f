#pragma once
/// host_space: buffers in host memory, every stream's work done at once, in order, on the
/// calling thread (kernels/ host loops), so events are always complete. It is the space of
/// the host communicators (inproc, shaped, mpi).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <span>
#include <string_view>

#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/kernels/cast.hpp"
#include "fedshard/kernels/for_each.hpp"
#include "fedshard/kernels/index.hpp"
#include "fedshard/space/caching_allocator.hpp"
#include "fedshard/space/memory_space.hpp"

namespace fedshard::space {

namespace detail {
/// 64-byte aligned host memory from operator new.
struct aligned_host_memory {
  void* allocate(std::size_t bytes) {
    return ::operator new (bytes, std::align_val_t{cache_line_bytes});
  }
  void release(void* p, std::size_t) noexcept {
    ::operator delete (p, std::align_val_t{cache_line_bytes});
  }
};

/// out = value (converted to out's dtype) in every element of a host view.
inline void fill_host(buffer_view out, double value) {
  visit(out.type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* p = static_cast<T*>(out.data);
    const T v = kernels::cast_fn<double, T>{}(value);
    for (std::size_t i = 0; i < out.count; ++i) p[i] = v;
  });
}
}  // namespace detail

/// The host MemorySpace (memory_space.hpp): work runs when it is queued.
class host_space {
 public:
  static constexpr std::string_view name = "host";
  static constexpr bool host_accessible = true;

  /// A stream of host_space: work queued on it has run by the time the call returns.
  struct stream {};
  /// An event of host_space: always complete.
  struct event {};
  template <class T>
  using buffer = basic_buffer<T, host_space>;

  host_space() = default;
  host_space(const host_space&) = delete;  // buffers point at their space
  host_space& operator=(const host_space&) = delete;

  /// n zero elements, 64-byte aligned.
  template <class T>
  buffer<T> allocate(std::size_t n) {
    FEDSHARD_EXPECTS(n <= ~std::size_t{0} / sizeof(T), "host_space::allocate: ", n, " elements of ",
                     sizeof(T), " bytes do not fit in std::size_t");
    const block b = alloc_.allocate(n * sizeof(T));
    if (b.ptr != nullptr) std::memset(b.ptr, 0, n * sizeof(T));
    return buffer<T>(*this, b, n);
  }
  /// Blocks requested from the system allocator so far.
  std::int64_t system_allocations() const { return alloc_.system_allocations(); }
  /// Takes a buffer's block back into the cache (called by the buffer).
  void release_block(block b) noexcept { alloc_.release(b); }

  stream make_stream() { return {}; }
  event record(stream&) { return {}; }
  void wait(stream&, const event&) {}
  void synchronize(const event&) {}
  void synchronize(stream&) {}
  bool ready(const event&) const { return true; }

  void copy(stream&, const_buffer_view from, buffer_view to) {
    space::detail::check_copy(from, to, "host_space::copy");
    if (to.count != 0 && from.data != to.data) std::memmove(to.data, from.data, to.size_bytes());
  }
  void to_host(stream& st, const_buffer_view from, buffer_view host) { copy(st, from, host); }
  void from_host(stream& st, const_buffer_view host, buffer_view to) { copy(st, host, to); }
  void cast(stream&, const_buffer_view in, buffer_view out) { kernels::cast(in, out); }
  void fill(stream&, buffer_view out, double value) { detail::fill_host(out, value); }
  template <class F, class... T>
  void for_each(stream&, F f, std::span<T>... spans) {
    const std::size_t n = space::detail::common_size("host_space::for_each", spans...);
    kernels::for_each_element(f, n, spans.data()...);
  }
  /// out[j] = in[idx[j] - base] for j < idx.size() (kernels::gather_index).
  void gather_index(stream&, std::span<const float> in, std::span<const std::uint32_t> idx,
                    std::uint32_t base, std::span<float> out) {
    kernels::gather_index(in, idx, base, out);
  }
  /// out[idx[j] - base] = in[j] for j < idx.size() (kernels::scatter_index).
  void scatter_index(stream&, std::span<const float> in, std::span<const std::uint32_t> idx,
                     std::uint32_t base, std::span<float> out) {
    kernels::scatter_index(in, idx, base, out);
  }

 private:
  caching_allocator<detail::aligned_host_memory> alloc_;
};

static_assert(MemorySpace<host_space>);

}  // namespace fedshard::space
