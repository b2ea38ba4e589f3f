// The interpreter on Gloo ranks (threads meeting through a file store): vouching (capability 12
// of comm/communicator.hpp). In gloo's checked mode a firing's first call on a communicator
// exchanges its arguments with the fingerprint of the firing's calls there; once every rank
// sent the same fingerprint, the firing's other calls are not exchanged. Plans that agree on
// their first call but not after it are still refused on every rank, and
// FEDSHARD_GLOO_CHECKED=always (options::every_call) exchanges every call.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fedshard/comm/gloo.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/interpreter.hpp"
#include "support/gloo_support.hpp"

using namespace fedshard;
namespace gl = fedshard::gloo;
namespace ft = fedshard::test;

namespace {

std::shared_ptr<gl::file_store> shared_store() {
  static ft::temp_dir dir("fedshard-interpreter-gloo");
  static auto st = std::make_shared<gl::file_store>(dir.path());
  return st;
}
std::string next_prefix() {
  static std::atomic<int> n{0};
  return detail::concat("world", n++);
}

/// An f32 all_reduce (sum) of `count` elements on axis a over 2 ranks, reading value 2i and
/// writing value 2i + 1.
comm_op sum_of(axis a, std::int64_t count, int i) {
  return comm_op{.kind = comm_kind::all_reduce,
                 .axis = a,
                 .dtype = dtype::f32,
                 .bytes = count * 4,
                 .ranks = 2,
                 .reduce = reduce_op::sum,
                 .in = {.role = role::value, .index = 2 * i},
                 .out = {.role = role::value, .index = 2 * i + 1}};
}

/// What a rank saw: its checked exchanges on the federation and world communicators while
/// it fired, the sums it got, and the error it threw (empty: none).
struct seen {
  std::int64_t federation = 0;
  std::int64_t world = 0;
  std::vector<float> sums;
  std::string error;
};

/// Two Gloo ranks (2 groups of one rank) fire `plan_of(rank)` `firings` times; value 2i of
/// rank r is r + 1 + 10 i in every element.
template <class PlanOf>
std::vector<seen> fire_on_two(gl::options o, int firings, PlanOf&& plan_of) {
  const auto prefix = next_prefix();
  return ft::on_threads(2, [&](int r) {
    gl::communicator world(shared_store(), prefix, r, 2, o);
    mesh<gl::communicator> m(world, mesh_shape{.groups = 2});
    interpreter<gl::communicator> in(m);
    const plan p = plan_of(r);
    std::vector<std::vector<float>> values(2 * p.ops.size());
    for (std::size_t i = 0; i < p.ops.size(); ++i) {
      const auto n = static_cast<std::size_t>(p.ops[i].bytes / 4);
      values[2 * i].assign(n, static_cast<float>(r + 1 + 10 * static_cast<int>(i)));
      values[2 * i + 1].assign(n, -1.0f);
    }
    const auto bind = [&](const comm_op&, const operand& o) {
      auto& v = values[static_cast<std::size_t>(o.index)];
      return buffer_view{v.data(), v.size(), dtype::f32};
    };
    seen s;
    const std::int64_t f0 = m.comm(axis::federation).exchanges();
    const std::int64_t w0 = m.comm(axis::world).exchanges();
    try {
      for (int k = 0; k < firings; ++k) in.wait(in.fire(p, {}, bind));
    } catch (const collective_mismatch& e) {
      s.error = e.what();
    }
    s.federation = m.comm(axis::federation).exchanges() - f0;
    s.world = m.comm(axis::world).exchanges() - w0;
    for (std::size_t i = 0; i < p.ops.size(); ++i) s.sums.push_back(values[2 * i + 1].front());
    return s;
  });
}

/// Three sums on the federation axis with one on the world axis between them.
plan mixed(int) {
  return plan{{sum_of(axis::federation, 4, 0), sum_of(axis::world, 4, 1),
               sum_of(axis::federation, 8, 2), sum_of(axis::federation, 70000, 3)}};
}

}  // namespace

TEST_CASE("gloo checked mode: a firing's calls are exchanged once per communicator it uses") {
  // Per firing: the federation axis's first call (4 elements) and the world's first call;
  // the federation's 8- and 70000-element sums (the second above the all-gather limit, so
  // another algorithm) follow from the fingerprint agreed with the first.
  for (const seen& s : fire_on_two(ft::gloo_timeout(60), 3, mixed)) {
    CHECK(s.error.empty());
    CHECK(s.federation == 3);
    CHECK(s.world == 3);
    CHECK(s.sums == std::vector<float>{3, 23, 43, 63});  // (1 + 10 i) + (2 + 10 i)
  }
}

TEST_CASE("gloo checked mode: options::every_call (FEDSHARD_GLOO_CHECKED=always) exchanges all") {
  gl::options o = ft::gloo_timeout(60);
  o.every_call = true;
  for (const seen& s : fire_on_two(o, 3, mixed)) {
    CHECK(s.error.empty());
    CHECK(s.federation == 9);
    CHECK(s.world == 3);
    CHECK(s.sums == std::vector<float>{3, 23, 43, 63});
  }
  o = ft::gloo_timeout(60);
  o.checked = false;
  for (const seen& s : fire_on_two(o, 2, mixed)) {
    CHECK(s.federation == 0);
    CHECK(s.world == 0);
  }
}

TEST_CASE("gloo checked mode: plans that agree on their first call only are refused everywhere") {
  // Rank 1's third sum has 16 elements where rank 0's has 8: the fingerprints differ, so no
  // call is trusted and the third exchange finds the mismatch on both ranks.
  const auto differing = [](int r) {
    return plan{{sum_of(axis::federation, 4, 0), sum_of(axis::federation, 8, 1),
                 sum_of(axis::federation, r == 0 ? 8 : 16, 2)}};
  };
  for (const seen& s : fire_on_two(ft::gloo_timeout(60), 1, differing)) {
    CHECK(s.federation == 3);
    CHECK(s.error.find("collective_mismatch at call #") != std::string::npos);
    CHECK(s.error.find("count=8,") != std::string::npos);
    CHECK(s.error.find("count=16,") != std::string::npos);
    CHECK(s.sums == std::vector<float>{3, 23, -1});  // the first two ran
  }
}
