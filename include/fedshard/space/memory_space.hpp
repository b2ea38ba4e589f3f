#pragma once
/// The MemorySpace concept: where a rank's buffers live and how work on them is ordered.
///
/// A MemorySpace S provides:
///  1. `S::name` (std::string_view) and `S::host_accessible` (bool): whether the host may read
///     and write the space's memory directly (after synchronizing with the streams that use
///     it).
///  2. Buffers: `S::buffer<T>`, an owning, move-only array of n elements of T in the space's
///     memory, made by `s.allocate<T>(n)`: zeroed, and ready for work on any stream. Its
///     `data()`, `size()`, `span()` and `view()` address the space's memory (never
///     dereference them on the host unless host_accessible). A destroyed buffer goes back to
///     the space's caching allocator: every allocation after the first of its size is served
///     from the cache; `s.system_allocations()` counts the requests that reached the system.
///     A buffer must not be destroyed while a stream still uses it.
///  3. Streams and events: `S::stream` (move-only, `s.make_stream()`), an ordered queue of
///     work; `S::event` (copyable), a point in a stream: `s.record(st)` marks the work queued
///     on st so far, `s.wait(st, ev)` makes st's later work wait for it (the host does not
///     wait), `s.synchronize(ev)` and `s.synchronize(st)` make the host wait, `s.ready(ev)`
///     asks without waiting. A default-constructed event is complete.
///  4. Copies, queued on a stream: `s.copy(st, from, to)` between buffers of the space, and
///     `s.to_host(st, from, host)` / `s.from_host(st, host, to)` (the host buffer stays valid
///     and untouched until the stream passes the copy); the views have one dtype and count.
///  5. Kernels, queued on a stream: `s.cast(st, in, out)` (kernels/cast.hpp's conversion),
///     `s.fill(st, out, value)`, and `s.for_each(st, f, spans...)`: f(s0[i], s1[i], ...) for
///     every i, for an element functor of kernels/ (FEDSHARD_HOST_DEVICE; float& for the spans
///     it updates, float for the std::span<const float> it reads; every span of one size);
///     `s.gather_index(st, in, idx, base, out)` and `s.scatter_index(st, in, idx, base, out)`:
///     out[j] = in[idx[j] - base] and out[idx[j] - base] = in[j] for j < idx.size()
///     (kernels/index.hpp; in std::span<const float>, idx std::span<const std::uint32_t>, out
///     std::span<float>, all in the space's memory; idx as long as the packed side).
/// Errors are fedshard::invalid_argument for bad arguments, backend_error for failures of the
/// space's runtime.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>

#include "fedshard/config.hpp"
#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/space/caching_allocator.hpp"

namespace fedshard::space {

/// True for the element types of fedshard's dtypes (float, double, bf16, f16).
template <class T>
inline constexpr bool is_element_v =
    std::is_same_v<std::remove_cv_t<T>, float> || std::is_same_v<std::remove_cv_t<T>, double> ||
    std::is_same_v<std::remove_cv_t<T>, bf16> || std::is_same_v<std::remove_cv_t<T>, f16>;

/// n elements of T in the memory of Owner, a space that takes its block back with
/// `release_block(block)`; move-only. The space must outlive its buffers.
template <class T, class Owner>
class basic_buffer {
  static_assert(std::is_trivially_copyable_v<T>, "space buffers hold trivially copyable types");

 public:
  basic_buffer() = default;
  basic_buffer(Owner& owner, block b, std::size_t n) : owner_(&owner), block_(b), size_(n) {}
  basic_buffer(const basic_buffer&) = delete;
  basic_buffer& operator=(const basic_buffer&) = delete;
  basic_buffer(basic_buffer&& o) noexcept
      : owner_(std::exchange(o.owner_, nullptr)),
        block_(std::exchange(o.block_, block{})),
        size_(std::exchange(o.size_, 0)) {}
  basic_buffer& operator=(basic_buffer&& o) noexcept {
    if (this != &o) {
      reset();
      owner_ = std::exchange(o.owner_, nullptr);
      block_ = std::exchange(o.block_, block{});
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  ~basic_buffer() { reset(); }

  /// The first element's address in the space's memory (nullptr when empty).
  T* data() const noexcept { return static_cast<T*>(block_.ptr); }
  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  /// The elements (in the space's memory).
  std::span<T> span() const noexcept { return {data(), size_}; }
  /// The type-erased view (pointer, count, dtype) of a buffer of a fedshard dtype.
  buffer_view view() const noexcept requires is_element_v<T> {
    return {data(), size_, dtype_of<T>};
  }
  /// Gives the memory back to the space now; the buffer becomes empty.
  void reset() noexcept {
    if (owner_ != nullptr) owner_->release_block(block_);
    owner_ = nullptr;
    block_ = {};
    size_ = 0;
  }

 private:
  Owner* owner_ = nullptr;
  block block_{};
  std::size_t size_ = 0;
};

/// A space used by reference (owned by someone else) or owned: what an engine, interpreter
/// or optimizer built without a space uses. Move-only.
template <class S>
class space_ref {
 public:
  /// s outlives this reference.
  explicit space_ref(S& s) noexcept : p_(&s) {}
  /// Owns the space.
  explicit space_ref(std::unique_ptr<S> s) noexcept : own_(std::move(s)), p_(own_.get()) {}
  /// A space of its own (default-constructed S).
  static space_ref make() { return space_ref(std::make_unique<S>()); }

  S& operator*() const noexcept { return *p_; }
  S* operator->() const noexcept { return p_; }
  S* get() const noexcept { return p_; }

 private:
  std::unique_ptr<S> own_;
  S* p_;
};

/// An element functor the concept is checked with: s0[i] = s1[i].
struct assign_update {
  FEDSHARD_HOST_DEVICE void operator()(float& out, float in) const noexcept { out = in; }
};

/// See the numbered requirements above.
template <class S>
concept MemorySpace = requires(S& s, const S& cs, typename S::stream& st,
                               const typename S::event& ev, const_buffer_view in, buffer_view out,
                               std::size_t n, std::span<float> a, std::span<const float> b,
                               std::span<const std::uint32_t> ix) {
  { S::name } -> std::convertible_to<std::string_view>;
  { S::host_accessible } -> std::convertible_to<bool>;
  { s.template allocate<float>(n) } -> std::same_as<typename S::template buffer<float>>;
  { cs.system_allocations() } -> std::convertible_to<std::int64_t>;
  { s.make_stream() } -> std::same_as<typename S::stream>;
  { s.record(st) } -> std::same_as<typename S::event>;
  s.wait(st, ev);
  s.synchronize(ev);
  s.synchronize(st);
  { s.ready(ev) } -> std::convertible_to<bool>;
  s.copy(st, in, out);
  s.to_host(st, in, out);
  s.from_host(st, in, out);
  s.cast(st, in, out);
  s.fill(st, out, 0.0);
  s.for_each(st, assign_update{}, a, b);
  s.gather_index(st, b, ix, std::uint32_t{0}, a);
  s.scatter_index(st, b, ix, std::uint32_t{0}, a);
}
&&std::copyable<typename S::event>&& std::movable<typename S::stream>&&
    std::default_initializable<typename S::event>;

namespace detail {
/// Throws invalid_argument unless two views of a copy have the same dtype and count.
inline void check_copy(const const_buffer_view& from, const buffer_view& to, const char* what) {
  FEDSHARD_EXPECTS(from.type == to.type && from.count == to.count, what,
                   ": source and destination must have the same dtype and count, found ",
                   from.count, " x ", to_string(from.type), " and ", to.count, " x ",
                   to_string(to.type));
}
/// Throws invalid_argument unless every span of a for_each has the first's size.
template <class... T>
std::size_t common_size(const char* what, std::span<T>... spans) {
  const std::size_t sizes[] = {spans.size()...};
  for (std::size_t m : sizes)
    FEDSHARD_EXPECTS(m == sizes[0], what, ": every array must have ", sizes[0],
                     " elements (the first's), found ", m);
  return sizes[0];
}
}  // namespace detail

/// A base of class template X<S> over one memory space that declares X's rebinding to
/// another space (in_space<T> = X<T>): `class basic_sgd : public same_in_every_space<basic_sgd>`.
template <template <MemorySpace> class X>
struct same_in_every_space {
  template <MemorySpace T>
  using in_space = X<T>;
};

/// X::in_space<S> when X declares that member template, else Fallback::type (instantiated
/// only then): the one detection of the rebinding to another memory space that optimizers
/// (optim/optimizer.hpp, requirement 9) and federation policies (federation_policy.hpp,
/// requirement 10) declare; each concept says what its Fallback is.
template <class X, class S, class Fallback>
struct in_space_or {
  using type = typename Fallback::type;
};
template <class X, class S, class Fallback>
requires requires {
  typename X::template in_space<S>;
}
struct in_space_or<X, S, Fallback> {
  using type = typename X::template in_space<S>;
};

}  // namespace fedshard::space
