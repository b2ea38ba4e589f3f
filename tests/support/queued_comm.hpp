#pragma once
/// Test support: queued<C>, a communicator that behaves towards the library like NCCL does,
/// on a machine without a GPU.
///
/// It wraps a host communicator C (inproc) and names checked_space as its memory space. Its
/// calls are queued, in call order, on a stream of its own (a checked_space stream with its
/// own worker thread) and run there later, through C's blocking calls; after(ev) makes that
/// stream wait for an event of any checked_space and record() returns an event after the
/// calls queued so far. So it is stream-ordered (space/space_of.hpp): the interpreter takes
/// the path it takes with NCCL and gpu_inproc, queues whole chains with events and never
/// waits on the host, and a missing event wait in the engine, the optimizers or the
/// federation sync reads values that are not ready yet, and fails a test.
///
/// A call's error (a bad argument, a peer's failure) fails the stream: the request of that
/// call and of every later one rethrows it, as a CUDA stream fault does.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "fedshard/comm/blocking.hpp"
#include "fedshard/comm/communicator.hpp"
#include "fedshard/comm/detail/call.hpp"
#include "fedshard/comm/request.hpp"
#include "fedshard/space/checked_space.hpp"

namespace fedshard::test {

template <Communicator C>
class queued : public blocking_calls<queued<C>> {
 public:
  using memory_space = space::checked_space;

  /// Takes over a host communicator; the space of the trainer's buffers (make_space) and the
  /// communicator's own stream use the settings o.
  explicit queued(C inner, space::checked_options o = {})
      : queued(std::move(inner), o, std::make_shared<space::checked_space>(o)) {}

  int rank() const { return inner_->rank(); }
  int size() const { return inner_->size(); }
  /// Bytes moved by the calls queued so far: each counted when queued, as inner's moved_by
  /// says it will move when the stream runs it (NCCL's and gpu_inproc's figures are known at
  /// issue too).
  moved_bytes moved() const { return moved_; }
  /// The wrapped communicator's algorithm.
  wire_algorithm algorithm_of(collective k, std::int64_t n, dtype t) const {
    return inner_->algorithm_of(k, n, t);
  }

  /// A space for the buffers of this communicator's user, with the same settings.
  std::unique_ptr<space::checked_space> make_space() const {
    return std::make_unique<space::checked_space>(opts_);
  }
  /// Later calls wait for ev (on the stream; the host does not wait).
  void after(const space::checked_space::event& ev) { space_->wait(*stream_, ev); }
  /// The event after the calls queued so far.
  space::checked_space::event record() { return space_->record(*stream_); }

  request all_reduce_async(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    moved_ += inner_->moved_by(collective::all_reduce, n, t);
    return enqueue("all_reduce",
                   [c = inner_.get(), in, out, n, t, op] { c->all_reduce(in, out, n, t, op); });
  }
  request all_gather_async(const void* in, void* out, std::int64_t n, dtype t) {
    moved_ += inner_->moved_by(collective::all_gather, n, t);
    return enqueue("all_gather",
                   [c = inner_.get(), in, out, n, t] { c->all_gather(in, out, n, t); });
  }
  request reduce_scatter_async(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    moved_ += inner_->moved_by(collective::reduce_scatter, n, t);
    return enqueue("reduce_scatter",
                   [c = inner_.get(), in, out, n, t, op] { c->reduce_scatter(in, out, n, t, op); });
  }
  request broadcast_async(void* buf, std::int64_t n, dtype t, int root) {
    moved_ += inner_->moved_by(collective::broadcast, n, t, root);
    return enqueue("broadcast",
                   [c = inner_.get(), buf, n, t, root] { c->broadcast(buf, n, t, root); });
  }
  request send_async(const void* buf, std::int64_t n, dtype t, int peer, int tag = 0) {
    moved_ += fedshard::detail::p2p_moved(true, n, t, rank(), peer);
    return enqueue("send",
                   [c = inner_.get(), buf, n, t, peer, tag] { c->send(buf, n, t, peer, tag); });
  }
  request recv_async(void* buf, std::int64_t n, dtype t, int peer, int tag = 0) {
    moved_ += fedshard::detail::p2p_moved(false, n, t, rank(), peer);
    return enqueue("recv",
                   [c = inner_.get(), buf, n, t, peer, tag] { c->recv(buf, n, t, peer, tag); });
  }
  void barrier() {
    enqueue("barrier", [c = inner_.get()] { c->barrier(); }).wait();
  }

  /// Collective: the host waits for the queued calls, then splits the wrapped communicator;
  /// the child has a stream of its own.
  queued split(int color, int key) {
    space_->synchronize(*stream_);
    return queued(inner_->split(color, key), opts_, space_);
  }

 private:
  queued(C inner, space::checked_options o, std::shared_ptr<space::checked_space> s)
      : opts_(o),
        space_(std::move(s)),
        inner_(std::make_unique<C>(std::move(inner))),
        stream_(std::make_unique<space::checked_space::stream>(space_->make_stream(
            fedshard::detail::concat("comm of rank ", inner_->rank(), "/", inner_->size())))) {}

  /// Completes with an event of the communicator's stream.
  class event_request final : public fedshard::detail::request_state {
   public:
    event_request(std::shared_ptr<space::checked_space> s, space::checked_space::event e)
        : space_(std::move(s)), event_(std::move(e)) {}
    void wait() override { space_->synchronize(event_); }
    bool test() override { return space_->ready(event_); }

   private:
    std::shared_ptr<space::checked_space> space_;
    space::checked_space::event event_;
  };

  request enqueue(const char* what, std::function<void()> call) {
    space_->host_task(*stream_, std::move(call), what);
    return request(std::make_unique<event_request>(space_, space_->record(*stream_)));
  }

  space::checked_options opts_;
  moved_bytes moved_{};
  std::shared_ptr<space::checked_space> space_;           // shared with the split children
  std::unique_ptr<C> inner_;                              // stable address for the queued calls
  std::unique_ptr<space::checked_space::stream> stream_;  // last: joined before inner_ goes
};

}  // namespace fedshard::test
