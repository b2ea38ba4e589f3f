#pragma once
// fedshard-sim --failures --check-multi-job EXE: the failure model's two costs of a dead
// group (sim/failures.hpp), predicted for the multi-job example on this machine and measured
// by running it, side by side.
//
//  - The stall: survivors lose the detection time once, in the round that leaves the dead
//    group out. Predicted: detect_s = the link's heartbeat bound (missed beats x beat period,
//    as the example prints them) plus one poll of the store (20 ms: comm/elastic.hpp).
//    Measured: the survivors' sync step in that round less the median of their other sync
//    steps.
//  - The heal: the restarted group takes a donor's state. Predicted: sim::heal_seconds with
//    this machine's constants, each measured here on its own: the loopback's TCP latency and
//    throughput (the network of a heal between two processes), and the host passes at the
//    heal's state size (trainer/state_io.hpp's serialize, cold as in a fresh process, and
//    deserialize). Measured: the heal's own time, as the trainer logs it.
#include <arpa/inet.h>
#include <malloc.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <regex>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fedshard/core/state_registry.hpp"
#include "fedshard/sim/failures.hpp"
#include "fedshard/trainer/state_io.hpp"

namespace multi_job_check {

using steady = std::chrono::steady_clock;
inline double seconds_since(steady::time_point t0) {
  return std::chrono::duration<double>(steady::now() - t0).count();
}

/// The example's run: 3 groups of one rank (one heal, one transfer), group 2 killed 5 steps
/// before a sync and restarted 1 s after it died.
inline std::string command_of(const std::string& exe) {
  return "'" + exe +
         "' --groups 3 --replicas 1 --shards 1 --hidden 512 --steps 200 --k 10 "
         "--kill-group 2 --kill-at-step 45 --join-timeout 2 --restart-after 1 --timeout 240 2>&1";
}

/// What the run printed and what it measured.
struct measured {
  std::string output;
  int missed_beats = 0;
  double beat_period = 0;
  double stall = 0;        ///< mean over the survivors
  double normal_sync = 0;  ///< the survivors' median sync step
  double heal = 0;         ///< the slowest rank's heal
  double heal_bytes = 0;   ///< the state one rank received
  int survivors = 0;
};

inline std::string run(const std::string& command) {
  FILE* p = ::popen(command.c_str(), "r");
  if (p == nullptr) throw std::runtime_error("cannot run " + command);
  std::string out;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  const int rc = ::pclose(p);
  if (rc != 0)
    throw std::runtime_error("the multi-job example failed (status " + std::to_string(rc) + "):\n" +
                             out);
  return out;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

/// The stall, heal and heartbeat figures of the example's output (`dead`: the killed group).
inline measured parse(std::string output, int dead) {
  measured m;
  m.output = std::move(output);
  const std::regex beats(R"(noticed after (\d+) missed beats of ([0-9.e+-]+) s)");
  const std::regex round(
      R"(\[group (\d+)\] round \d+ \(step \d+\): .*left out \{([0-9,]*)\}.*sync step ([0-9.]+) s)");
  const std::regex heal(
      R"(took the state of groups? [0-9, ]+ \((\d+) bytes\) in round \d+: heal ([0-9.e+-]+) s)");
  std::map<int, std::vector<double>> normal;
  std::map<int, double> stalled;
  std::istringstream in(m.output);
  std::smatch x;
  for (std::string line; std::getline(in, line);) {
    if (std::regex_search(line, x, beats)) {
      m.missed_beats = std::stoi(x[1]);
      m.beat_period = std::stod(x[2]);
    } else if (std::regex_search(line, x, round)) {
      const int g = std::stoi(x[1]);
      const double t = std::stod(x[3]);
      if (g == dead) continue;
      if (x[2].str().empty())
        normal[g].push_back(t);
      else if (x[2].str() == std::to_string(dead) && !stalled.count(g))
        stalled[g] = t;
    } else if (std::regex_search(line, x, heal)) {
      m.heal_bytes = std::stod(x[1]);
      m.heal = std::max(m.heal, std::stod(x[2]));
    }
  }
  if (m.missed_beats == 0 || stalled.empty() || m.heal == 0)
    throw std::runtime_error(
        "the multi-job example's output lacks its heartbeat line, a round that left group " +
        std::to_string(dead) + " out, or a heal line; it printed " +
        (m.output.empty() ? std::string("nothing") : ":\n" + m.output));
  std::vector<double> all;
  for (const auto& [g, t] : stalled) {
    m.stall += t - median(normal[g]);
    for (double v : normal[g]) all.push_back(v);
  }
  m.survivors = static_cast<int>(stalled.size());
  m.stall /= m.survivors;
  m.normal_sync = median(all);
  return m;
}

/// A connected TCP pair on the loopback: {client, server} descriptors.
inline std::pair<int, int> loopback_pair() {
  const int l = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (l < 0 || ::bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(l, 1) != 0 ||
      ::getsockname(l, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    throw std::runtime_error(std::string("loopback socket: ") + std::strerror(errno));
  const int c = ::socket(AF_INET, SOCK_STREAM, 0);
  if (c < 0 || ::connect(c, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
    throw std::runtime_error(std::string("loopback connect: ") + std::strerror(errno));
  const int s = ::accept(l, nullptr, nullptr);
  ::close(l);
  const int one = 1;
  ::setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  ::setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return {c, s};
}

inline void send_all(int fd, const char* p, std::size_t n) {
  while (n > 0) {
    const auto k = ::send(fd, p, n, 0);
    if (k <= 0) throw std::runtime_error("loopback send failed");
    p += k;
    n -= static_cast<std::size_t>(k);
  }
}
inline void recv_all(int fd, char* p, std::size_t n) {
  while (n > 0) {
    const auto k = ::recv(fd, p, n, 0);
    if (k <= 0) throw std::runtime_error("loopback recv failed");
    p += k;
    n -= static_cast<std::size_t>(k);
  }
}

/// The loopback as a heal's network: one-way latency (half an 8-byte round trip, median of
/// 200) and throughput (`bytes` sent one way, best of 3).
struct link_timing {
  double latency = 0;
  double bytes_per_s = 0;
};
inline link_timing time_loopback(std::size_t bytes) {
  auto [c, s] = loopback_pair();
  link_timing out;
  std::vector<double> rtt;
  std::thread echo([fd = s, bytes] {
    char w[8];
    for (int i = 0; i < 200; ++i) {
      recv_all(fd, w, 8);
      send_all(fd, w, 8);
    }
    std::vector<char> sink(bytes);
    for (int r = 0; r < 3; ++r) {
      recv_all(fd, sink.data(), bytes);
      send_all(fd, w, 1);
    }
  });
  char w[8] = {};
  for (int i = 0; i < 200; ++i) {
    const auto t0 = steady::now();
    send_all(c, w, 8);
    recv_all(c, w, 8);
    rtt.push_back(seconds_since(t0));
  }
  std::vector<char> data(bytes, 'x');
  double best = 1e30;
  for (int r = 0; r < 3; ++r) {
    const auto t0 = steady::now();
    send_all(c, data.data(), bytes);
    recv_all(c, w, 1);
    best = std::min(best, seconds_since(t0));
  }
  echo.join();
  ::close(c);
  ::close(s);
  out.latency = median(rtt) / 2;
  out.bytes_per_s = static_cast<double>(bytes) / best;
  return out;
}

/// A heal's host passes at `bytes` of state: a fresh registry of three entries (parameters
/// and two moments) serialized once and deserialized, every buffer on pages not touched
/// before (as in a process that heals once: large blocks are mapped afresh, not reused);
/// the mean of 3 fresh registries.
inline double time_host_passes(std::size_t bytes) {
  ::mallopt(M_MMAP_THRESHOLD, 1 << 20);  // a fixed threshold: freed large blocks are unmapped
  double total = 0;
  for (int r = 0; r < 3; ++r) {
    std::vector<std::vector<std::byte>> v(3, std::vector<std::byte>(bytes / 3, std::byte{1}));
    fedshard::state_registry reg;
    for (std::size_t i = 0; i < v.size(); ++i) {
      auto* d = &v[i];
      reg.add({.name = "entry" + std::to_string(i),
               .bytes = [d] { return d->size(); },
               .save = [d](std::span<std::byte> o) { std::memcpy(o.data(), d->data(), o.size()); },
               .load =
                   [d](std::span<const std::byte> in) {
                     std::memcpy(d->data(), in.data(), in.size());
                   }});
    }
    const auto t0 = steady::now();
    std::string blob = fedshard::checkpoint::serialize(reg);
    fedshard::checkpoint::deserialize(reg, std::move(blob), "the calibration's state",
                                      fedshard::checkpoint::state_geometry{});
    total += seconds_since(t0);
  }
  return total / 3;
}

/// Prints predicted against measured; returns the worst of the two ratios' distance from 1.
inline double check(const std::string& exe) {
  std::printf("Failures priced, checked on this machine (3 runs, medians): %s\n",
              command_of(exe).c_str());
  std::fflush(stdout);
  std::vector<measured> runs;
  for (int r = 0; r < 3; ++r) {
    runs.push_back(parse(run(command_of(exe)), 2));
    std::printf("run %d: stall %.4f s, heal %.4f s of %.0f bytes\n", r + 1, runs.back().stall,
                runs.back().heal, runs.back().heal_bytes);
    std::fflush(stdout);
  }
  auto median_of = [&](double measured::*field) {
    std::vector<double> v;
    for (const auto& x : runs) v.push_back(x.*field);
    return median(v);
  };
  measured m = runs.front();
  m.stall = median_of(&measured::stall);
  m.heal = median_of(&measured::heal);
  m.normal_sync = median_of(&measured::normal_sync);
  const auto bytes = static_cast<std::size_t>(m.heal_bytes);
  const link_timing link = time_loopback(bytes);
  const double passes = time_host_passes(bytes);
  fedshard::sim::failure_settings f;
  f.detect_s = m.missed_beats * m.beat_period + 0.020;
  fedshard::sim::failing_job j{.gpus = 3,
                               .gpus_per_node = 1,
                               .step_s = std::max(m.normal_sync, 1e-6),
                               .state_bytes_per_gpu = m.heal_bytes,
                               .groups = 3,
                               .steps_per_sync = 10,
                               .heal_bytes_per_s = link.bytes_per_s,
                               .heal_latency_s = link.latency,
                               .heal_host_bytes_per_s = m.heal_bytes / passes};
  const fedshard::sim::scheme_price p = fedshard::sim::elastic_groups(j, f);
  std::printf(
      "this machine: loopback %.1f us one way, %.2f GB/s; a heal's host passes %.1f ms for "
      "%.0f bytes (%.2f GB/s)\n",
      link.latency * 1e6, link.bytes_per_s / 1e9, passes * 1e3, m.heal_bytes,
      m.heal_bytes / passes / 1e9);
  std::printf("%-34s %12s %12s %8s\n", "", "predicted s", "measured s", "ratio");
  const double rs = f.detect_s / m.stall, rh = p.heal_s / m.heal;
  std::printf("%-34s %12.4f %12.4f %8.2f\n", "stall (survivors, once)", f.detect_s, m.stall, rs);
  std::printf("%-34s %12.4f %12.4f %8.2f\n", "heal (restarted group)", p.heal_s, m.heal, rh);
  std::printf(
      "stall: %d missed beats of %g s + one 20 ms poll, against the %d survivors' sync step "
      "less their median sync step (%.4f s); heal: latency + state / loopback + host passes\n",
      m.missed_beats, m.beat_period, m.survivors, m.normal_sync);
  return std::max(std::abs(rs - 1), std::abs(rh - 1));
}

}  // namespace multi_job_check
