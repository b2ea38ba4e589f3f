#pragma once
/// Test support: extra_copy<C>, a communicator that moves more than its plan says.
///
/// Before every collective it sends one extra copy of the call's input (the buffer of a
/// broadcast) to the next rank and receives the previous rank's, through C's own send and
/// recv, and throws the copy away; then it runs the call on C. Results are C's, bit for bit,
/// and moved() is C's, so the extra bytes are reported honestly: a wire-equals-plan check
/// (plan/traffic.hpp, moved_mismatch) must catch it, while the calls as issued (kinds, sizes,
/// counts) are exactly the plan's.

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/comm/request.hpp"
#include "fedshard/space/space_of.hpp"

namespace fedshard::test {

template <Communicator C>
class extra_copy {
 public:
  using memory_space = space::space_of_t<C>;
  /// The tag of the extra copies.
  static constexpr int copy_tag = 0x7e57;

  explicit extra_copy(C inner) : inner_(std::move(inner)) {}

  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  moved_bytes moved() const { return inner_.moved(); }
  wire_algorithm algorithm_of(collective k, std::int64_t n, dtype t) const {
    return inner_.algorithm_of(k, n, t);
  }

  void all_reduce(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    copy(in, n, t);
    inner_.all_reduce(in, out, n, t, op);
  }
  void all_gather(const void* in, void* out, std::int64_t n, dtype t) {
    copy(in, n, t);
    inner_.all_gather(in, out, n, t);
  }
  void reduce_scatter(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    copy(in, n * size(), t);
    inner_.reduce_scatter(in, out, n, t, op);
  }
  void broadcast(void* buf, std::int64_t n, dtype t, int root) {
    copy(buf, n, t);
    inner_.broadcast(buf, n, t, root);
  }
  void send(const void* in, std::int64_t n, dtype t, int peer, int tag = 0) {
    inner_.send(in, n, t, peer, tag);
  }
  void recv(void* out, std::int64_t n, dtype t, int peer, int tag = 0) {
    inner_.recv(out, n, t, peer, tag);
  }
  void barrier() { inner_.barrier(); }
  extra_copy split(int color, int key) { return extra_copy(inner_.split(color, key)); }

  request all_reduce_async(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    copy(in, n, t);
    return inner_.all_reduce_async(in, out, n, t, op);
  }
  request all_gather_async(const void* in, void* out, std::int64_t n, dtype t) {
    copy(in, n, t);
    return inner_.all_gather_async(in, out, n, t);
  }
  request reduce_scatter_async(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    copy(in, n * size(), t);
    return inner_.reduce_scatter_async(in, out, n, t, op);
  }
  request broadcast_async(void* buf, std::int64_t n, dtype t, int root) {
    copy(buf, n, t);
    return inner_.broadcast_async(buf, n, t, root);
  }
  request send_async(const void* in, std::int64_t n, dtype t, int peer, int tag = 0) {
    return inner_.send_async(in, n, t, peer, tag);
  }
  request recv_async(void* out, std::int64_t n, dtype t, int peer, int tag = 0) {
    return inner_.recv_async(out, n, t, peer, tag);
  }

 private:
  /// The extra copy: n elements of `in` to the next rank, the previous rank's into scratch.
  void copy(const void* in, std::int64_t n, dtype t) {
    if (size() < 2 || n <= 0) return;
    scratch_.resize(static_cast<std::size_t>(n) * size_of(t));
    request s = inner_.send_async(in, n, t, (rank() + 1) % size(), copy_tag);
    inner_.recv(scratch_.data(), n, t, (rank() + size() - 1) % size(), copy_tag);
    s.wait();
  }

  C inner_;
  std::vector<std::byte> scratch_;
};

}  // namespace fedshard::test
