#pragma once
/// Test support: child processes for tests whose ranks or groups are processes of their own
/// (a group killed with SIGKILL must not take the test with it).

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <thread>

namespace fedshard::test {

/// Forks a process that runs body() and exits 0 (1 when it threw, after printing
/// "<what> failed: <why>" on stderr).
inline pid_t spawn(const std::function<void()>& body, const std::string& what = "child process") {
  std::fflush(nullptr);  // else the child would print the parent's buffered output again
  const pid_t pid = ::fork();
  if (pid == 0) {
    int rc = 0;
    try {
      body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s failed: %s\n", what.c_str(), e.what());
      rc = 1;
    }
    std::fflush(nullptr);
    ::_exit(rc);
  }
  return pid;
}

/// Waits for a child at most `seconds`; kills it then. Returns its wait status, -1 on timeout.
inline int wait_for(pid_t pid, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  for (;;) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) return status;
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

/// True for the wait status of a child that exited with status 0.
inline bool exited_ok(int status) {
  return status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

}  // namespace fedshard::test
