#pragma once
/// The handle of an asynchronous communication operation.

#include <exception>
#include <memory>
#include <utility>

namespace fedshard {

namespace detail {
/// What a backend implements behind a request.
class request_state {
 public:
  virtual ~request_state() = default;
  /// Blocks until the operation completed; rethrows its error.
  virtual void wait() = 0;
  /// True once the operation completed (its error, if any, is thrown by wait()).
  virtual bool test() = 0;
};
}  // namespace detail

/// Completion handle of an async operation: wait() blocks until it is done and rethrows its
/// error; test() polls. The buffers passed to the operation must stay alive and untouched
/// until it completes. A default-constructed request is already complete. Destroying an
/// unfinished request waits for it (errors are then dropped: call wait() to see them).
class request {
 public:
  request() = default;
  explicit request(std::unique_ptr<detail::request_state> s) : state_(std::move(s)) {}
  request(request&&) noexcept = default;
  request& operator=(request&& o) noexcept {
    if (this != &o) {
      drain();
      state_ = std::move(o.state_);
    }
    return *this;
  }
  request(const request&) = delete;
  request& operator=(const request&) = delete;
  ~request() { drain(); }

  /// Blocks until the operation is complete; throws what the operation threw.
  void wait() {
    if (!state_) return;
    auto s = std::move(state_);
    s->wait();
  }
  /// True when the operation has completed (then wait() returns at once).
  bool test() { return !state_ || state_->test(); }
  /// True while the request refers to an operation that wait() has not consumed.
  bool pending() const noexcept { return static_cast<bool>(state_); }

 private:
  void drain() noexcept {
    if (!state_) return;
    try {
      state_->wait();
    } catch (...) {  // destructors never throw
    }
    state_.reset();
  }
  std::unique_ptr<detail::request_state> state_;
};

namespace detail {
/// A request that completed when it was made: wait() rethrows its error, if any.
class completed_request final : public request_state {
 public:
  explicit completed_request(std::exception_ptr e) : e_(std::move(e)) {}
  void wait() override {
    if (e_) std::rethrow_exception(std::exchange(e_, nullptr));
  }
  bool test() override { return true; }

 private:
  std::exception_ptr e_;
};
}  // namespace detail

/// Runs f() now and returns its request: complete, or rethrowing in wait() what f threw (the
/// *_async calls of a backend whose collectives run when called).
template <class F>
request run_now(F&& f) {
  try {
    std::forward<F>(f)();
  } catch (...) {
    return request(std::make_unique<detail::completed_request>(std::current_exception()));
  }
  return {};
}

/// Waits for every request in a range, then rethrows the first error met.
template <class Range>
void wait_all(Range& requests) {
  std::exception_ptr first;
  for (request& r : requests) {
    try {
      r.wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace fedshard
