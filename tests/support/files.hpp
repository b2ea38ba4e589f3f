#pragma once
/// Test support for the file formats' tests (checkpoints, safetensors): a temporary
/// directory, whole-file reads and writes, and bit-exact comparison of float vectors.

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "fedshard/error.hpp"

namespace fedshard::test {

/// A fresh, empty directory under the system temp directory ("<tag>-<pid>-<n>"), removed
/// with everything in it at scope exit.
struct temp_dir {
  std::filesystem::path path;
  explicit temp_dir(std::string_view tag = "fedshard-files") {
    static std::atomic<int> counter{0};
    path = std::filesystem::temp_directory_path() /
           fedshard::detail::concat(tag, "-", ::getpid(), "-", counter++);
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

/// A whole file's bytes ("" when it cannot be read).
inline std::string read_all(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

/// Replaces a file's bytes; throws backend_error when it cannot.
inline void write_all(const std::filesystem::path& p, std::string_view data) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(data.data(), static_cast<std::streamsize>(data.size()));
  if (!f)
    throw backend_error(fedshard::detail::concat("write_all: cannot write '", p.string(), "'"));
}

/// Equal sizes and equal bits (so -0 differs from 0 and a NaN equals the same NaN).
inline bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

inline bool contains(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

}  // namespace fedshard::test
