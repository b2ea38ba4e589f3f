#include "fedshard/error.hpp"

#include <doctest/doctest.h>

#include <stdexcept>
#include <string>
#include <type_traits>

namespace {

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

/// Uses FEDSHARD_EXPECTS as the single statement of both branches of an if without braces.
int checked_sign(int x, bool strict) {
  if (strict)
    FEDSHARD_EXPECTS(x != 0, "strict sign of zero");
  else
    FEDSHARD_EXPECTS(x > -1000, "x too small: ", x);
  return x > 0 ? 1 : (x < 0 ? -1 : 0);
}

}  // namespace

TEST_CASE_TEMPLATE("every fedshard exception is a fedshard::error and a std::runtime_error", E,
                   fedshard::invalid_argument, fedshard::collective_mismatch,
                   fedshard::peer_failure, fedshard::timeout_error, fedshard::backend_error) {
  static_assert(std::is_base_of_v<fedshard::error, E>);
  static_assert(std::is_base_of_v<std::runtime_error, E>);
  static_assert(!std::is_same_v<fedshard::error, E>);
  bool caught = false;
  try {
    throw E("boom 42");
  } catch (const fedshard::error& e) {
    caught = true;
    CHECK(std::string(e.what()) == "boom 42");
    CHECK(dynamic_cast<const E*>(&e) != nullptr);
  }
  CHECK(caught);
  CHECK_THROWS_WITH_AS(throw E(std::string("as string")), "as string", std::runtime_error);
}

TEST_CASE("the subclasses are distinct types") {
  bool wrong_handler = false;
  try {
    throw fedshard::peer_failure("rank 3 failed");
  } catch (const fedshard::timeout_error&) {
    wrong_handler = true;
  } catch (const fedshard::collective_mismatch&) {
    wrong_handler = true;
  } catch (const fedshard::invalid_argument&) {
    wrong_handler = true;
  } catch (const fedshard::backend_error&) {
    wrong_handler = true;
  } catch (const fedshard::peer_failure& e) {
    CHECK(std::string(e.what()) == "rank 3 failed");
  }
  CHECK_FALSE(wrong_handler);
  CHECK_THROWS_AS(throw fedshard::error("base"), std::runtime_error);
}

TEST_CASE("FEDSHARD_EXPECTS throws invalid_argument with message, condition and location") {
  const int n = 3;
  std::string what;
  int line = 0;
  try {
    line = __LINE__ + 1;
    FEDSHARD_EXPECTS(n % 2 == 0, "n must be even, found ", n);
  } catch (const fedshard::invalid_argument& e) {
    what = e.what();
  }
  CAPTURE(what);
  CHECK(contains(what, "n must be even, found 3"));
  CHECK(contains(what, "n % 2 == 0"));
  CHECK(contains(what, std::string(__FILE__) + ":" + std::to_string(line)));
}

TEST_CASE("FEDSHARD_EXPECTS does nothing when the condition holds") {
  int evaluations = 0;
  int message_parts = 0;
  auto part = [&] {
    ++message_parts;
    return "x";
  };
  CHECK_NOTHROW(FEDSHARD_EXPECTS(++evaluations > 0, "never built ", part()));
  CHECK(evaluations == 1);
  CHECK(message_parts == 0);  // the message is only built on failure

  CHECK_THROWS_AS(FEDSHARD_EXPECTS(++evaluations < 0, "built ", part()),
                  fedshard::invalid_argument);
  CHECK(evaluations == 2);
  CHECK(message_parts == 1);
}

TEST_CASE("FEDSHARD_EXPECTS is one statement in an if/else without braces") {
  CHECK(checked_sign(5, true) == 1);
  CHECK(checked_sign(-5, false) == -1);
  CHECK(checked_sign(0, false) == 0);
  CHECK_THROWS_WITH_AS(checked_sign(0, true), doctest::Contains("strict sign of zero"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(checked_sign(-2000, false), doctest::Contains("x too small: -2000"),
                       fedshard::invalid_argument);
}

TEST_CASE("FEDSHARD_EXPECTS accepts a condition with no message") {
  CHECK_THROWS_WITH_AS(FEDSHARD_EXPECTS(1 + 1 == 3), doctest::Contains("1 + 1 == 3"),
                       fedshard::invalid_argument);
}

TEST_CASE("detail::concat streams its arguments in order") {
  CHECK(fedshard::detail::concat("a", 1, ' ', 2.5, std::string("s")) == "a1 2.5s");
  CHECK(fedshard::detail::concat().empty());
}
