#pragma once
/// Test support: the steps after which a sync schedule syncs, asked as a synchronizer asks
/// it, step by step; every answer other than start_and_apply must be none.

#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "fedshard/schedule/sync_schedule.hpp"

namespace fedshard::test {

/// Steps, 0-based.
using steps = std::vector<std::int64_t>;

/// The steps in [0, n) after which fragment 0 of s syncs in a run of `total` steps (a
/// schedule that counts steps).
template <class S>
steps sync_steps(const S& s, std::int64_t total, std::int64_t n) {
  steps out;
  for (std::int64_t step = 0; step < n; ++step) {
    const schedule::sync_action a = s.action(0, step, total);
    if (a == schedule::sync_action::start_and_apply)
      out.push_back(step);
    else
      CHECK(a == schedule::sync_action::none);
  }
  return out;
}

/// The steps in [0, n) after which fragment 0 of s syncs (a schedule that reads the group's
/// progress): feed(step, p) adds the step's tokens to p or sets its clock; a sync zeroes the
/// tokens since the last one and counts itself, as the synchronizer does.
template <class S, class Feed>
steps progress_sync_steps(const S& s, std::int64_t n, Feed feed) {
  steps out;
  schedule::sync_progress p;
  for (std::int64_t step = 0; step < n; ++step) {
    p.step = step;
    feed(step, p);
    const schedule::sync_action a = s.action(0, p);
    if (a == schedule::sync_action::start_and_apply) {
      out.push_back(step);
      p.tokens = 0;
      ++p.syncs;
    } else {
      CHECK(a == schedule::sync_action::none);
    }
  }
  return out;
}

/// The steps in [0, n) after which a group whose step carries tokens(step) tokens syncs.
template <class S, class Tokens>
steps token_sync_steps(const S& s, std::int64_t n, Tokens tokens) {
  return progress_sync_steps(
      s, n, [&](std::int64_t step, schedule::sync_progress& p) { p.tokens += tokens(step); });
}

/// The steps in [0, n) after which a group whose step `step` ends at seconds(step) syncs.
template <class S, class Clock>
steps clock_sync_steps(const S& s, std::int64_t n, Clock seconds) {
  return progress_sync_steps(
      s, n, [&](std::int64_t step, schedule::sync_progress& p) { p.seconds = seconds(step); });
}

}  // namespace fedshard::test
