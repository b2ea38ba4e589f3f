/// Tests of fedshard::request and wait_all.

#include "fedshard/comm/request.hpp"

#include <doctest/doctest.h>

#include <array>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using fedshard::request;

/// What the fake operations saw: the ids of the states waited for, in order.
struct wait_log {
  std::vector<int> waited;
  int tests = 0;
};

/// A fake operation: complete or not, failing with `error` (if set) when waited for.
class fake_state final : public fedshard::detail::request_state {
 public:
  fake_state(wait_log& log, int id, bool done, std::string error = "")
      : log_(log), id_(id), done_(done), error_(std::move(error)) {}
  void wait() override {
    log_.waited.push_back(id_);
    if (!error_.empty()) throw std::runtime_error(error_);
  }
  bool test() override {
    ++log_.tests;
    return done_;
  }

 private:
  wait_log& log_;
  int id_;
  bool done_;
  std::string error_;
};

request make(wait_log& log, int id, bool done = false, std::string error = "") {
  return request(std::make_unique<fake_state>(log, id, done, std::move(error)));
}

}  // namespace

TEST_CASE("request: a default request is complete") {
  request r;
  CHECK(r.test());
  CHECK_FALSE(r.pending());
  CHECK_NOTHROW(r.wait());
  CHECK(r.test());
}

TEST_CASE("request: test() asks the operation until wait() consumed it") {
  wait_log log;
  request busy = make(log, 1, false);
  request done = make(log, 2, true);
  CHECK(busy.pending());
  CHECK_FALSE(busy.test());
  CHECK(done.test());
  CHECK(log.tests == 2);
  CHECK(log.waited.empty());  // test() never waits
  done.wait();
  CHECK_FALSE(done.pending());
  CHECK(done.test());
  CHECK(log.tests == 2);  // a consumed request no longer asks
}

TEST_CASE("request: wait() waits once and rethrows the operation's error once") {
  wait_log log;
  request ok = make(log, 1);
  ok.wait();
  ok.wait();
  CHECK(log.waited == std::vector<int>{1});

  request bad = make(log, 2, false, "operation failed");
  CHECK_THROWS_WITH_AS(bad.wait(), "operation failed", std::runtime_error);
  CHECK_FALSE(bad.pending());
  CHECK_NOTHROW(bad.wait());
  CHECK(log.waited == std::vector<int>{1, 2});
}

TEST_CASE("request: destroying an unfinished request waits for it and drops its error") {
  wait_log log;
  CHECK_NOTHROW([&] {
    request ok = make(log, 1);
    request bad = make(log, 2, false, "dropped");
  }());
  CHECK(log.waited == std::vector<int>{2, 1});  // destroyed in reverse order
  {
    request consumed = make(log, 3);
    consumed.wait();
  }
  CHECK(log.waited == std::vector<int>{2, 1, 3});
}

TEST_CASE("request: moving transfers the operation; move-assigning waits for the old one") {
  wait_log log;
  request a = make(log, 1);
  request b(std::move(a));
  CHECK_FALSE(a.pending());  // NOLINT(bugprone-use-after-move): the moved-from state is specified
  CHECK(b.pending());

  request c = make(log, 2, false, "old one failed");
  CHECK_NOTHROW(c = std::move(b));
  CHECK(log.waited == std::vector<int>{2});
  CHECK(c.pending());
  request& alias = c;
  c = std::move(alias);  // self-move keeps the operation
  CHECK(c.pending());
  CHECK(log.waited == std::vector<int>{2});
  c.wait();
  CHECK(log.waited == std::vector<int>{2, 1});
}

TEST_CASE("wait_all: waits for every request, then rethrows the first error") {
  wait_log log;
  std::vector<request> rs;
  rs.push_back(make(log, 1));
  rs.push_back(make(log, 2, false, "first error"));
  rs.push_back(make(log, 3));
  rs.push_back(make(log, 4, false, "second error"));
  rs.push_back(request());
  CHECK_THROWS_WITH_AS(fedshard::wait_all(rs), "first error", std::runtime_error);
  CHECK(log.waited == std::vector<int>{1, 2, 3, 4});
  for (const request& r : rs) CHECK_FALSE(r.pending());
}

TEST_CASE("wait_all: no error, an empty range, any range of requests") {
  wait_log log;
  std::array<request, 3> rs = {make(log, 1), make(log, 2), make(log, 3)};
  CHECK_NOTHROW(fedshard::wait_all(rs));
  CHECK(log.waited == std::vector<int>{1, 2, 3});
  std::vector<request> none;
  CHECK_NOTHROW(fedshard::wait_all(none));
  CHECK_NOTHROW(fedshard::wait_all(rs));  // already consumed
  CHECK(log.waited == std::vector<int>{1, 2, 3});
}
