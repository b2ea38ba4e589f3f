// Federation averages in a narrow dtype (shard::precision::sync, sync_context::reduce): each
// group's f32 values are rounded to bf16 or f16 (round to nearest even), summed in f32 in
// group order, divided by G and rounded once more; the federation and replica axes move
// half of f32's bytes. The reference is written here from IEEE rounding (the bf16 rounding
// by hand, f16 through _Float16), not from the library's casts.

#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/federation/average.hpp"
#include "fedshard/federation/robust_mean.hpp"
#include "fedshard/federation/sync.hpp"
#include "fedshard/federation/weighted_average.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/interpreter.hpp"
#include "fedshard/schedule/periodic.hpp"
#include "support/error_of.hpp"
#include "support/spawn_ranks.hpp"

namespace {

using namespace fedshard;
using namespace fedshard::federation;

/// x rounded to bf16 (to nearest, ties to even), as f32; x finite.
float bf16_round(float x) {
  std::uint32_t b = std::bit_cast<std::uint32_t>(x);
  b += 0x7fffu + ((b >> 16) & 1u);
  return std::bit_cast<float>(b & 0xffff0000u);
}
/// x rounded to f16 (IEEE binary16, to nearest even), as f32.
float f16_round(float x) {
  return static_cast<float>(static_cast<_Float16>(x));
}

float narrow(dtype t, float x) {
  if (t == dtype::bf16) return bf16_round(x);
  if (t == dtype::f16) return f16_round(x);
  return x;
}

/// Group g's value of element i: not representable in bf16 or f16, of both signs.
float value(int g, std::size_t i) {
  return (1.0f + 0.3f * static_cast<float>(g)) * (static_cast<float>(i % 7) - 2.9f) / 3.0f +
         1e-3f * static_cast<float>(i);
}

const flat_layout& layout() {
  static const flat_layout l({{"a", {{"w", {6, 4}}}}, {"b", {{"w", {10}}}}}, 1);
  return l;
}

struct outcome {
  std::vector<std::vector<float>> master;                // per world rank, after the sync
  std::int64_t federation_bytes = 0, replica_bytes = 0;  // rank 0's, at the wire
};

template <class F>
outcome sync_once(const mesh_shape& shape, dtype reduce, typename F::config cfg = {}) {
  outcome out;
  out.master.resize(static_cast<std::size_t>(shape.size()));
  test::spawn_ranks(shape.size(), [&](inproc::communicator& world) {
    mesh m(world, shape);
    interpreter<inproc::communicator> in(m);
    synchronizer<F, schedule::periodic> s(cfg, {.period = 1}, layout(), shape, m.coords(), 0,
                                          in.space(), nullptr, {}, reduce);
    std::vector<float> master(layout().total_shard_numel(), 0.0f);
    s.reset(master);
    for (std::size_t i = 0; i < master.size(); ++i) master[i] = value(m.coords().group, i);
    s.after_step(in, 0, 0, master, {});
    in.wait_all();
    out.master[static_cast<std::size_t>(world.rank())] = master;
    if (world.rank() == 0) {
      out.federation_bytes = in.traffic()[axis::federation].payload_bytes;
      out.replica_bytes = in.traffic()[axis::replica].payload_bytes;
    }
  });
  return out;
}

}  // namespace

TEST_CASE("average in bf16 and f16: inputs and the mean rounded once each, half the bytes") {
  const mesh_shape shape{3, 2, 1};  // hierarchical: each replica averages half, then gathers
  const outcome f32 = sync_once<average>(shape, dtype::f32);
  const std::size_t n = layout().total_shard_numel();
  // One fragment, padded for 2 replicas: each replica's piece crosses the groups once and is
  // gathered by the other replica, 4 bytes an element in f32.
  const auto fr = fragments_of(schedule::periodic({.period = 1}), layout(), shape.replicas);
  REQUIRE(fr.size() == 1);
  const auto piece = static_cast<std::int64_t>(fr[0].padded / 2);
  CHECK(f32.federation_bytes == piece * 4);
  for (const dtype t : {dtype::bf16, dtype::f16}) {
    CAPTURE(t);
    const outcome got = sync_once<average>(shape, t);
    CHECK(got.federation_bytes * 2 == f32.federation_bytes);
    CHECK(got.replica_bytes * 2 == f32.replica_bytes);
    CHECK(got.federation_bytes == piece * 2);
    int off_f32 = 0;
    for (std::size_t i = 0; i < n; ++i) {
      float acc = narrow(t, value(0, i));
      for (int g = 1; g < 3; ++g) acc += narrow(t, value(g, i));
      const float want = narrow(t, acc / 3.0f);
      for (std::size_t r = 0; r < got.master.size(); ++r) {
        CAPTURE(i);
        CAPTURE(r);
        CHECK(std::bit_cast<std::uint32_t>(got.master[r][i]) == std::bit_cast<std::uint32_t>(want));
      }
      // Against f32's mean: two roundings of a value of magnitude < 2 (the inputs' and the
      // mean's), each at most half an ulp: 2^-8 (bf16) or 2^-11 (f16) relative, plus the
      // inputs' error carried through the mean.
      const float bound = (t == dtype::bf16 ? 0x1p-8f : 0x1p-11f) * 2.0f;
      off_f32 += std::abs(got.master[0][i] - f32.master[0][i]) > bound ? 1 : 0;
    }
    CHECK(off_f32 == 0);
  }
}

TEST_CASE("reference mode (replica 0 averages, then broadcasts): the same bits on every rank") {
  // Replica 1's plan has no federation op, only the broadcast: it must not be refused while
  // replica 0 goes on (the refusal is decided alike on every rank).
  const mesh_shape shape{3, 2, 1};
  for (const dtype t : {dtype::bf16, dtype::f16}) {
    CAPTURE(t);
    const outcome hier = sync_once<average>(shape, t);
    const outcome ref = sync_once<average>(shape, t, {.sync = sync_mode::reference});
    for (std::size_t r = 0; r < ref.master.size(); ++r) {
      CAPTURE(r);
      CHECK(std::memcmp(ref.master[r].data(), hier.master[r].data(),
                        ref.master[r].size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("the narrow sync dtype in weighted_average's plan; refused where nothing averages") {
  // weighted_average averages through average_ops: its cross-group op is in bf16.
  const mesh_shape shape{2, 1, 1};
  const auto plans = sync_plans_of(weighted_average{}, schedule::periodic({.period = 1}), layout(),
                                   shape, {0, 0, 0}, 0, {}, 0, nullptr, {}, dtype::bf16);
  REQUIRE(plans.size() == 1);
  int narrow_ops = 0;
  for (const comm_op& op : plans[0].ops)
    if (op.axis == axis::federation && op.dtype == dtype::bf16) {
      ++narrow_ops;
      CHECK(op.bytes ==
            static_cast<std::int64_t>(
                fragments_of(schedule::periodic({.period = 1}), layout(), 1)[0].padded * 2));
    }
  CHECK(narrow_ops == 1);
  // median combines gathered f32 copies on the host: a bf16 sync dtype would be a silent
  // no-op there, so it is refused, on every rank.
  test::spawn_ranks(2, [&](inproc::communicator& world) {
    mesh m(world, shape);
    interpreter<inproc::communicator> in(m);
    const std::string e = test::error_of([&] {
      synchronizer<median, schedule::periodic> s({}, {.period = 1}, layout(), shape, m.coords(), 0,
                                                 in.space(), nullptr, {}, dtype::bf16);
    });
    CHECK(e.find("precision.sync = bf16, but federation policy median averages nothing in it") !=
          std::string::npos);
  });
}
