#pragma once
/// Test support: a log callback that keeps every line, for tests to look at (thread-safe).

#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace fedshard::test {

/// Collects the lines given to fn() (e.g. elastic::options::log).
struct log_sink {
  std::mutex mu;
  std::vector<std::string> lines;
  /// A callback that appends its line.
  std::function<void(const std::string&)> fn() {
    return [this](const std::string& s) {
      std::lock_guard lock(mu);
      lines.push_back(s);
    };
  }
  /// How many lines contain `part`.
  int count(const std::string& part) {
    std::lock_guard lock(mu);
    int n = 0;
    for (const auto& l : lines) n += l.find(part) != std::string::npos;
    return n;
  }
  /// True when a line contains `part`.
  bool has(const std::string& part) { return count(part) > 0; }
};

}  // namespace fedshard::test
