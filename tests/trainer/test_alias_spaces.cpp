// Every alias of the catalogue (fedshard::for_each_algorithm) with its defaults on the three
// test spaces (support/spaces.hpp): host memory, a checked_space in hold mode (work queued on
// a stream runs only when something waits for it, recycled blocks NaN-filled) and a
// stream-ordered communicator on it (the interpreter's NCCL path). tiny_mlp on 2 groups x 1
// replica x 2 shards, 8 steps of AdamW with syncs every 2 steps where the schedule has a
// period: on each space every rank's parameters are bit-equal to host memory's, each step put
// on the wire the calls it put there on host memory, and each axis moved host's bytes; on host
// memory each step's calls are its plans' (support/plan_checks.hpp) where the plans hold them
// all (not under a local rule or SCAPE, whose own collectives other tests count).
// A missing wait between streams shows as a NaN, a stale value or a hang (the held spaces'
// timeout) on the CPU, before any GPU runs the same code.

#include <doctest/doctest.h>

#include <cstring>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/plan_checks.hpp"
#include "support/spaces.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

namespace {

using namespace fedshard;
using test::mlp_model;

constexpr int kSteps = 8;
constexpr mesh_shape kShape{2, 1, 2};

/// What a run left on every rank.
struct run_result {
  std::vector<std::vector<float>> params;  // per world rank
  std::vector<traffic_counters> traffic;   // per world rank
  std::vector<std::string> wire;           // steps whose wire differed from the plans
  std::vector<std::vector<std::vector<wire_call>>> calls;  // per rank, per step
  std::int64_t syncs = 0;                                  // rank 0's applied syncs
  std::vector<float> initial;  // rank 0's parameters before the first step
};

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

/// True when A's shard policy has run-time state (SCAPE: shard/sparse.hpp).
template <class A>
constexpr bool has_runtime =
    shard::runtime_of<typename A::shard_policy, space::host_space>::stateful;

template <class A, class Sp>
run_result run() {
  run_result out;
  out.params.resize(kShape.size());
  out.traffic.resize(kShape.size());
  out.calls.resize(kShape.size());
  std::mutex mu;
  test::spawn_ranks(kShape.size(), [&](inproc::communicator& world) {
    auto comm = Sp::wrap(world);
    mesh m(comm, kShape);
    trainer_options<A> o;  // the alias's defaults
    o.total_steps = kSteps;
    o.log = [](const std::string&) {};
    if constexpr (requires { o.schedule.period; }) o.schedule.period = 2;
    trainer<mlp_model, A, optim::adamw, typename Sp::comm, typename Sp::space> t(m, mlp_model{},
                                                                                 {.lr = 1e-2f}, o);
    const auto c = m.coords();
    const std::vector<float> initial = t.parameters();  // a collective: every rank
    if (world.rank() == 0) out.initial = initial;
    t.traffic().reset();
    t.wire().keep_calls(true);
    t.wire().take_calls();
    for (int s = 0; s < kSteps; ++s) {
      t.step(t.model().batch(3, s, c.group, kShape.groups, c.shard, kShape.shards, 4));
      auto& calls = out.calls[static_cast<std::size_t>(world.rank())];
      calls.push_back(t.wire().take_calls());
      // The plans' ops, where they are all of a step's: a local rule's own collectives
      // (hofl's loss means and records) and SCAPE's runtime's are not in them.
      if (t.local() != nullptr || has_runtime<A>) continue;
      const std::string diff =
          test::compare_calls(calls.back(), test::expected_step_calls(t, s, kSteps));
      if (!diff.empty()) {
        std::lock_guard lock(mu);
        out.wire.push_back(
            fedshard::detail::concat("rank ", world.rank(), ", step ", s, ": ", diff));
      }
    }
    t.wire().keep_calls(false);
    const auto r = static_cast<std::size_t>(world.rank());
    out.params[r] = t.parameters();
    out.traffic[r] = t.traffic();
    if (r == 0) out.syncs = t.syncs_applied();
  });
  return out;
}

template <class A, class Sp>
void check_against_host(std::string_view alias, const run_result& host) {
  const run_result got = run<A, Sp>();
  CAPTURE(alias);
  CAPTURE(Sp::name);
  CHECK(got.wire.empty());
  for (const std::string& w : got.wire) MESSAGE(w);
  CHECK(got.syncs == host.syncs);
  REQUIRE(got.calls.size() == host.calls.size());
  for (std::size_t r = 0; r < got.calls.size(); ++r)
    for (std::size_t s = 0; s < got.calls[r].size(); ++s) {
      CAPTURE(r);
      CAPTURE(s);
      CHECK(test::compare_calls(got.calls[r][s], host.calls[r].at(s)).empty());
    }
  for (std::size_t r = 0; r < got.params.size(); ++r) {
    CAPTURE(r);
    CHECK(bit_equal(got.params[r], host.params[r]));
    for (const axis a : {axis::shard, axis::replica, axis::group, axis::federation}) {
      CAPTURE(a);
      CHECK(got.traffic[r][a].calls == host.traffic[r][a].calls);
      CHECK(got.traffic[r][a].payload_bytes == host.traffic[r][a].payload_bytes);
    }
  }
}

}  // namespace

TEST_CASE("every alias on checked and stream-ordered spaces equals host memory bit for bit") {
  int aliases = 0, host_only = 0;
  for_each_algorithm([&]<class A>(std::string_view alias) {
    ++aliases;
    const run_result host = run<A, test::on_host>();
    CAPTURE(alias);
    CHECK(host.wire.empty());
    CHECK_FALSE(bit_equal(host.params[0], host.initial));  // it trained
    // SCAPE's runtime runs on host memory only, refused at compile time (shard/sparse.hpp's
    // static_assert: no device kernels for its mask, pack and unpack yet).
    if constexpr (!has_runtime<A>) {
      check_against_host<A, test::on_checked>(alias, host);
      check_against_host<A, test::on_queued>(alias, host);
    } else {
      ++host_only;
    }
  });
  CHECK(aliases == 19);
  CHECK(host_only == 2);  // scape_fsdp, fl_scape_fsdp
}
