#pragma once
/// A caching allocator: memory blocks handed out by a system allocator are kept when freed
/// and handed out again for a later request of the same rounded size, so a training loop that
/// allocates the same buffers every step reaches the system allocator only in its first step.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "fedshard/core/member_names.hpp"
#include "fedshard/error.hpp"

namespace fedshard::space {

/// What caching_allocator needs of its System:
///  1. `void* allocate(std::size_t bytes)`: a new block (throws on failure);
///  2. `void release(void* p, std::size_t bytes) noexcept`: gives a block back;
///  3. optionally `void recycled(void* p, std::size_t bytes) noexcept`, called on every block
///     returned to the cache (e.g. to poison it; checked_space). Detected in
///     system_capabilities<System> alone, where a member `recycle` is a compile error.
template <class A>
concept SystemAllocator = requires(A& a, void* p, std::size_t n) {
  { a.allocate(n) } -> std::same_as<void*>;
  a.release(p, n);
};

namespace detail {
FEDSHARD_MEMBER_NAME(recycled)
FEDSHARD_MEMBER_NAME(recycle)
}  // namespace detail

/// The optional requirement 3 of SystemAllocator A.
template <class A>
struct system_capabilities {
  static constexpr bool recycled = requires(A & a, void* p, std::size_t n) { a.recycled(p, n); };
  static_assert(!detail::names_recycle<A>,
                "SystemAllocator: the allocator has a member `recycle`; did you mean `void "
                "recycled(void*, std::size_t) noexcept` (requirement 3, caching_allocator.hpp)?");
  static_assert(!detail::names_recycled<A> || recycled,
                "SystemAllocator: the allocator's `recycled` is not callable as `recycled(void*, "
                "std::size_t)` (requirement 3): blocks returned to the cache would not be seen");
};

/// A block of memory: its address and its (rounded) size in bytes.
struct block {
  void* ptr = nullptr;
  std::size_t bytes = 0;
};

/// Caches blocks of System (a SystemAllocator). Sizes are rounded up to a multiple of
/// `granularity` bytes.
/// Thread-safe. Every block must be returned before the allocator is destroyed; the
/// destructor gives the cached blocks back to System.
template <SystemAllocator System>
class caching_allocator {
 public:
  /// Requests are rounded up to a multiple of this many bytes.
  static constexpr std::size_t granularity = 512;

  explicit caching_allocator(System system = {}) : system_(std::move(system)) {}
  caching_allocator(const caching_allocator&) = delete;
  caching_allocator& operator=(const caching_allocator&) = delete;
  ~caching_allocator() {
    for (auto& [bytes, list] : free_)
      for (void* p : list) system_.release(p, bytes);
  }

  /// A block of at least `bytes` bytes (none for 0): a cached one of the same rounded size,
  /// else a new one from System.
  block allocate(std::size_t bytes) {
    if (bytes == 0) return {};
    FEDSHARD_EXPECTS(bytes <= ~std::size_t{0} - granularity, "caching_allocator: a request of ",
                     bytes, " bytes cannot be rounded up");
    const std::size_t rounded = (bytes + granularity - 1) / granularity * granularity;
    {
      std::lock_guard lock(mu_);
      auto it = free_.find(rounded);
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        cached_bytes_ -= rounded;
        return {p, rounded};
      }
      ++system_allocations_;
    }
    return {system_.allocate(rounded), rounded};
  }

  /// Returns a block to the cache.
  void release(block b) noexcept {
    if (b.ptr == nullptr) return;
    if constexpr (system_capabilities<System>::recycled) system_.recycled(b.ptr, b.bytes);
    std::lock_guard lock(mu_);
    try {
      free_[b.bytes].push_back(b.ptr);
      cached_bytes_ += b.bytes;
    } catch (...) {  // no memory for the free list: give the block back instead
      system_.release(b.ptr, b.bytes);
    }
  }

  /// How many blocks were requested from System so far.
  std::int64_t system_allocations() const {
    std::lock_guard lock(mu_);
    return system_allocations_;
  }
  /// Bytes held in the cache, ready to be handed out again.
  std::size_t cached_bytes() const {
    std::lock_guard lock(mu_);
    return cached_bytes_;
  }
  /// The system allocator.
  System& system() noexcept { return system_; }

 private:
  System system_;
  mutable std::mutex mu_;
  std::map<std::size_t, std::vector<void*>> free_;
  std::int64_t system_allocations_ = 0;
  std::size_t cached_bytes_ = 0;
};

}  // namespace fedshard::space
