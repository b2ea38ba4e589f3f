#pragma once
/// The exception hierarchy of fedshard and the argument-check macro.

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace fedshard {

/// Base of every exception fedshard throws.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// An argument, shape, configuration or state does not satisfy the API's requirements.
class invalid_argument : public error {
 public:
  using error::error;
};

/// Ranks called the same collective with different counts, dtypes, ops, roots or kinds.
class collective_mismatch : public error {
 public:
  using error::error;
};

/// A peer rank failed or left while this rank waited for it.
class peer_failure : public error {
 public:
  using error::error;
};

/// A collective did not complete within the configured timeout.
class timeout_error : public error {
 public:
  using error::error;
};

/// An error reported by an underlying backend (MPI, CUDA, NCCL, the file system).
class backend_error : public error {
 public:
  using error::error;
};

namespace detail {

/// Concatenates its arguments with operator<< into one string.
template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  ((os << std::forward<Args>(args)), ...);
  return os.str();
}

/// Throws invalid_argument for a failed FEDSHARD_EXPECTS check.
[[noreturn]] inline void expects_failed(const char* condition, const char* file, int line,
                                        const std::string& message) {
  throw invalid_argument(
      concat("fedshard: ", message, " [check '", condition, "' failed at ", file, ":", line, "]"));
}

}  // namespace detail
}  // namespace fedshard

/// Checks a precondition; on failure throws fedshard::invalid_argument whose message is
/// the concatenation of the remaining arguments (say what was expected and what was found).
#define FEDSHARD_EXPECTS(condition, ...)                                           \
  do {                                                                             \
    if (!(condition))                                                              \
      ::fedshard::detail::expects_failed(#condition, __FILE__, __LINE__,           \
                                         ::fedshard::detail::concat(__VA_ARGS__)); \
  } while (0)
