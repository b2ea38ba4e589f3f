#pragma once
/// Type-erased buffer views and 64-byte-aligned host buffers.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <span>
#include <type_traits>
#include <utility>

#include "fedshard/config.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/error.hpp"

namespace fedshard {

/// A mutable (pointer, count, dtype) triple: how buffers cross the communicator boundary.
struct buffer_view {
  void* data = nullptr;
  std::size_t count = 0;
  dtype type = dtype::f32;

  constexpr std::size_t size_bytes() const noexcept { return count * size_of(type); }
  /// The elements as a typed span; T must match the dtype.
  template <class T>
  std::span<T> as() const {
    FEDSHARD_EXPECTS(dtype_of<T> == type, "buffer_view::as: view holds ", to_string(type),
                     ", asked for ", to_string(dtype_of<T>));
    return {static_cast<T*>(data), count};
  }
};

/// A read-only (pointer, count, dtype) triple.
struct const_buffer_view {
  const void* data = nullptr;
  std::size_t count = 0;
  dtype type = dtype::f32;

  constexpr const_buffer_view() = default;
  constexpr const_buffer_view(const void* d, std::size_t n, dtype t) : data(d), count(n), type(t) {}
  constexpr const_buffer_view(buffer_view v)
      : data(v.data), count(v.count), type(v.type) {}  // NOLINT

  constexpr std::size_t size_bytes() const noexcept { return count * size_of(type); }
  /// The elements as a typed span; T must match the dtype.
  template <class T>
  std::span<const T> as() const {
    FEDSHARD_EXPECTS(dtype_of<T> == type, "const_buffer_view::as: view holds ", to_string(type),
                     ", asked for ", to_string(dtype_of<T>));
    return {static_cast<const T*>(data), count};
  }
};

/// The type-erased view of a typed span.
template <class T>
buffer_view view(std::span<T> s) noexcept requires(!std::is_const_v<T>) {
  return {s.data(), s.size(), dtype_of<T>};
}

/// The read-only type-erased view of a typed span.
template <class T>
const_buffer_view cview(std::span<T> s) noexcept {
  return {s.data(), s.size(), dtype_of<T>};
}

/// An owning, zero-initialised, move-only array of T whose storage starts on a 64-byte
/// boundary (a cache line; also enough for AVX-512 and 16-byte vector loads).
template <class T>
class aligned_buffer {
  static_assert(std::is_trivially_copyable_v<T>, "aligned_buffer holds trivially copyable types");

 public:
  static constexpr std::size_t alignment = cache_line_bytes;

  aligned_buffer() = default;
  /// n zero elements.
  explicit aligned_buffer(std::size_t n) : size_(n) {
    FEDSHARD_EXPECTS(n <= std::numeric_limits<std::size_t>::max() / sizeof(T),
                     "aligned_buffer: n * sizeof(T) must fit in std::size_t, found n = ", n,
                     " elements of ", sizeof(T), " bytes");
    if (n == 0) return;
    data_ = static_cast<T*>(::operator new (n * sizeof(T), std::align_val_t{alignment}));
    std::memset(static_cast<void*>(data_), 0, n * sizeof(T));
  }
  aligned_buffer(const aligned_buffer&) = delete;
  aligned_buffer& operator=(const aligned_buffer&) = delete;
  aligned_buffer(aligned_buffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  aligned_buffer& operator=(aligned_buffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  ~aligned_buffer() { release(); }

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  T& operator[](std::size_t i) noexcept { return data_[i]; }
  const T& operator[](std::size_t i) const noexcept { return data_[i]; }
  T* begin() noexcept { return data_; }
  T* end() noexcept { return data_ + size_; }
  const T* begin() const noexcept { return data_; }
  const T* end() const noexcept { return data_ + size_; }
  std::span<T> span() noexcept { return {data_, size_}; }
  std::span<const T> span() const noexcept { return {data_, size_}; }
  operator std::span<T>() noexcept { return span(); }              // NOLINT
  operator std::span<const T>() const noexcept { return span(); }  // NOLINT

 private:
  void release() noexcept {
    if (data_ != nullptr)
      ::operator delete (static_cast<void*>(data_), std::align_val_t{alignment});
    data_ = nullptr;
    size_ = 0;
  }
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace fedshard
