#pragma once
/// The default deadline of anything that waits for a peer (communicators, checked streams).

#include <chrono>
#include <cstdlib>

namespace fedshard::detail {

/// The backends' default timeout: FEDSHARD_TIMEOUT_S from the environment, else 300 seconds.
inline std::chrono::duration<double> default_timeout() {
  if (const char* s = std::getenv("FEDSHARD_TIMEOUT_S")) {
    char* end = nullptr;
    const double v = std::strtod(s, &end);
    if (end != s && v > 0) return std::chrono::duration<double>(v);
  }
  return std::chrono::duration<double>(300.0);
}

}  // namespace fedshard::detail
