// host_space: the MemorySpace requirements (tests/space/space_checks.hpp), and its streams
// run their work at once.
#include "fedshard/space/host_space.hpp"

#include <doctest/doctest.h>

#include "space/space_checks.hpp"

using namespace fedshard;
using space::host_space;

static_assert(space::MemorySpace<host_space>);

TEST_CASE("host_space meets the MemorySpace requirements") {
  host_space s;
  CHECK(host_space::name == "host");
  CHECK(host_space::host_accessible);
  test::check_allocation(s);
  test::check_kernels(s);
  test::check_streams(s);
}

TEST_CASE("host_space runs queued work before the call returns") {
  host_space s;
  auto st = s.make_stream();
  auto b = s.allocate<float>(8);
  s.fill(st, b.view(), 3.0);
  for (float x : b.span()) CHECK(x == 3.0f);  // no synchronize needed
}

TEST_CASE("caching_allocator: rounded sizes, recycled blocks, counters") {
  struct counting_memory {
    int* live;
    void* allocate(std::size_t bytes) {
      ++*live;
      return ::operator new(bytes);
    }
    void release(void* p, std::size_t) noexcept {
      --*live;
      ::operator delete(p);
    }
  };
  int live = 0;
  {
    space::caching_allocator<counting_memory> a(counting_memory{&live});
    const space::block b1 = a.allocate(100);
    CHECK(b1.bytes == 512);
    const space::block b2 = a.allocate(512);
    CHECK(a.system_allocations() == 2);
    a.release(b1);
    CHECK(a.cached_bytes() == 512);
    const space::block b3 = a.allocate(300);  // same rounded size: the cached block
    CHECK(b3.ptr == b1.ptr);
    CHECK(a.system_allocations() == 2);
    CHECK(a.allocate(0).ptr == nullptr);
    a.release(b2);
    a.release(b3);
    CHECK(live == 2);
  }
  CHECK(live == 0);  // the destructor gave the cached blocks back
}
