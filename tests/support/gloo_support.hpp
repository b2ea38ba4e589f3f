#pragma once
/// Test support for the Gloo communicator: a fresh temporary directory, worlds of thread
/// ranks meeting through one store, and a Redis server on the loopback that lives as long as
/// the object (started and stopped by the test itself).

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fedshard/comm/gloo.hpp"
#include "fedshard/error.hpp"

namespace fedshard::test {

/// A directory under the system's temporary folder, removed with everything in it.
class temp_dir {
 public:
  explicit temp_dir(const std::string& tag = "fedshard") {
    std::random_device rd;
    for (int attempt = 0; attempt < 100; ++attempt) {
      auto p = std::filesystem::temp_directory_path() /
               fedshard::detail::concat(tag, '-', ::getpid(), '-', rd());
      if (std::filesystem::create_directory(p)) {
        path_ = p;
        return;
      }
    }
    throw backend_error("temp_dir: cannot make a temporary directory");
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const noexcept { return path_; }

 private:
  std::filesystem::path path_;
};

/// Runs body(rank) on n threads; returns what each returned. When ranks fail, throws
/// backend_error naming every failed rank with its message, so the rank that failed first
/// (whose closed sockets the others then report) is never hidden behind rank 0's error.
template <class F>
auto on_threads(int n, F&& body) {
  using R = decltype(body(0));
  std::vector<R> results(static_cast<std::size_t>(n));
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        results[static_cast<std::size_t>(r)] = body(r);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = "a non-standard exception";
      }
    });
  for (auto& t : threads) t.join();
  std::string all;
  for (int r = 0; r < n; ++r)
    if (!errors[static_cast<std::size_t>(r)].empty())
      all += fedshard::detail::concat(all.empty() ? "" : "\n", "rank ", r, " of ", n, ": ",
                                      errors[static_cast<std::size_t>(r)]);
  if (!all.empty()) throw backend_error(all);
  return results;
}

/// Options with a timeout of `seconds`.
inline gloo::options gloo_timeout(double seconds) {
  gloo::options o;
  o.timeout = std::chrono::duration<double>(seconds);
  return o;
}

/// A Redis server on the loopback for a test: the one .ci/run started when FEDSHARD_TEST_REDIS
/// names its port on 127.0.0.1, else a redis-server of the test's own at a free port, without
/// persistence, stopped (SIGTERM, then SIGKILL) by the destructor. available() is false when
/// neither is there.
class redis_server {
 public:
  /// The server a test may share (FEDSHARD_TEST_REDIS's when set), or one of its own.
  explicit redis_server(std::string binary) : binary_(std::move(binary)) {
    if (const char* env = std::getenv("FEDSHARD_TEST_REDIS"); env != nullptr && *env != '\0') {
      port_ = std::atoi(env);
      shared_ = port_ > 0;
      return;
    }
    start_anywhere();
  }
  /// A server of the test's own even when a shared one exists: for tests that kill it. With
  /// `aof_dir`, it persists every write there (append-only file, fsync'd on every write), so
  /// start_again() finds the keys it held.
  struct own_t {};
  redis_server(std::string binary, own_t, std::filesystem::path aof_dir = {})
      : binary_(std::move(binary)), aof_dir_(std::move(aof_dir)) {
    start_anywhere();
  }
  redis_server(const redis_server&) = delete;
  redis_server& operator=(const redis_server&) = delete;
  ~redis_server() { stop(SIGTERM); }
  bool available() const noexcept { return shared_ || pid_ > 0; }
  int port() const noexcept { return port_; }
  /// Kills the server at once (SIGKILL), as a crash would (its own server only).
  void kill() { stop(SIGKILL); }
  /// Starts it again on the same port (empty, or with what its aof_dir kept); true when up.
  bool start_again() {
    if (shared_ || port_ <= 0) return false;
    return launch();
  }

 private:
  void start_anywhere() {
    if (binary_.empty() || !std::filesystem::exists(binary_)) return;
    std::random_device rd;
    for (int attempt = 0; attempt < 20 && pid_ <= 0; ++attempt) {
      port_ = 20000 + static_cast<int>(rd() % 30000);
      (void)launch();
    }
  }
  /// Starts redis-server on port_; up when a store can connect (a port taken by someone else
  /// makes the server exit).
  bool launch() {
    const std::string port = std::to_string(port_);
    const pid_t pid = ::fork();
    if (pid == 0) {
      if (FILE* quiet = std::fopen("/dev/null", "w")) {  // the server's banner stays out of logs
        ::dup2(::fileno(quiet), 1);
        ::dup2(::fileno(quiet), 2);
      }
      const std::string dir = aof_dir_.empty() ? std::string(".") : aof_dir_.string();
      if (aof_dir_.empty())
        ::execl(binary_.c_str(), binary_.c_str(), "--port", port.c_str(), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--protected-mode", "yes", "--loglevel",
                "warning", static_cast<char*>(nullptr));
      else
        ::execl(binary_.c_str(), binary_.c_str(), "--port", port.c_str(), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "yes", "--appendfsync", "always", "--dir",
                dir.c_str(), "--protected-mode", "yes", "--loglevel", "warning",
                static_cast<char*>(nullptr));
      ::_exit(127);
    }
    for (int i = 0; i < 200; ++i) {
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == pid) break;
      try {
        gloo::redis_store probe("127.0.0.1", port_);
        pid_ = pid;
        return true;
      } catch (const backend_error&) {
        std::this_thread::sleep_for(std::chrono::milliseconds(25));
      }
    }
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    return false;
  }
  void stop(int sig) {
    if (shared_ || pid_ <= 0) return;
    ::kill(pid_, sig);
    for (int i = 0; i < 200; ++i) {
      if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  std::string binary_;
  std::filesystem::path aof_dir_;
  pid_t pid_ = -1;
  int port_ = 0;
  bool shared_ = false;  // .ci/run's server: not ours to stop
};

}  // namespace fedshard::test
