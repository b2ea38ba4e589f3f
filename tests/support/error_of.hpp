#pragma once
/// Test support: the message of the invalid_argument a call throws, for checks that read it.

#include <string>

#include "fedshard/error.hpp"

namespace fedshard::test {

/// The message of the invalid_argument f throws ("" when it throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace fedshard::test
