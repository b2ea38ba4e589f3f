#include "fedshard/version.hpp"

#include <doctest/doctest.h>

#include <string>

static_assert(FEDSHARD_VERSION_MAJOR >= 0 && FEDSHARD_VERSION_MINOR >= 0 &&
              FEDSHARD_VERSION_PATCH >= 0);
static_assert(FEDSHARD_VERSION_MINOR < 100 && FEDSHARD_VERSION_PATCH < 100);

TEST_CASE("version_string and version_number match the version macros") {
  const std::string expected = std::to_string(FEDSHARD_VERSION_MAJOR) + "." +
                               std::to_string(FEDSHARD_VERSION_MINOR) + "." +
                               std::to_string(FEDSHARD_VERSION_PATCH);
  CHECK(std::string(fedshard::version_string) == expected);
  CHECK(fedshard::version_number ==
        FEDSHARD_VERSION_MAJOR * 10000 + FEDSHARD_VERSION_MINOR * 100 + FEDSHARD_VERSION_PATCH);
}
