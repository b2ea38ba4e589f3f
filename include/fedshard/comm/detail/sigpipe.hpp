#pragma once
/// Writing to a socket whose peer has closed it raises SIGPIPE in the writing thread, and
/// SIGPIPE's default action ends the process. Gloo's TCP transport and hiredis write with
/// plain write()/writev(), so without care a group whose peer was killed would die with it,
/// silently, instead of getting the peer_failure the communicator promises.
///
/// sigpipe_shield blocks SIGPIPE in the calling thread for its lifetime; the write then fails
/// with EPIPE, which Gloo and hiredis report as errors. On destruction it takes back a SIGPIPE
/// that became pending in this thread meanwhile (one that was pending before is left alone)
/// and restores the thread's signal mask. It changes no process-wide disposition: a user's
/// own SIGPIPE handler, or default action, still applies to everything else. Threads started
/// while a shield is alive (Gloo's transport thread, started when a device is made) inherit
/// the blocked mask, so their writes fail with EPIPE too.
///
/// Cost: two pthread_sigmask calls per shielded call, plus a sigpending call; tiny against
/// a network operation.

#include <pthread.h>
#include <signal.h>
#include <time.h>

namespace fedshard::detail {

class sigpipe_shield {
 public:
  sigpipe_shield() noexcept {
    sigset_t pipe_only;
    sigemptyset(&pipe_only);
    sigaddset(&pipe_only, SIGPIPE);
    sigset_t pending;
    sigemptyset(&pending);
    was_pending_ = sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1;
    active_ = pthread_sigmask(SIG_BLOCK, &pipe_only, &saved_) == 0;
  }
  sigpipe_shield(const sigpipe_shield&) = delete;
  sigpipe_shield& operator=(const sigpipe_shield&) = delete;
  ~sigpipe_shield() {
    if (!active_) return;
    if (!was_pending_) {
      sigset_t pending;
      sigemptyset(&pending);
      if (sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1) {
        sigset_t pipe_only;
        sigemptyset(&pipe_only);
        sigaddset(&pipe_only, SIGPIPE);
        const timespec now{0, 0};
        (void)sigtimedwait(&pipe_only, nullptr, &now);  // consume it while it is blocked
      }
    }
    (void)pthread_sigmask(SIG_SETMASK, &saved_, nullptr);
  }

 private:
  sigset_t saved_{};
  bool was_pending_ = false;
  bool active_ = false;
};

}  // namespace fedshard::detail
