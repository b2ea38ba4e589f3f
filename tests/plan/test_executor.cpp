// The executor on inproc ranks: every kind on every axis gives the collective's result and
// records exactly the op; ops that do not fit the mesh are refused before anything moves.
#include "fedshard/plan/executor.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "support/spawn_ranks.hpp"

using namespace fedshard;
using fedshard::inproc::communicator;

namespace {

/// Element i of axis rank r's contribution (small integers: exact in every dtype).
float value(int r, std::int64_t i) {
  return 4.0f * static_cast<float>(r + 1) + static_cast<float>(i);
}

/// The accumulation type of a reduction in T (the communicators accumulate in f32 or f64).
template <class T>
using accum_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <class T>
double as_double(T x) {
  if constexpr (std::is_same_v<T, double>)
    return x;
  else
    return static_cast<float>(x);
}

/// The sum (or mean) over n ranks of value(r, i) in T, accumulated in rank order.
template <class T>
double reduced(int n, std::int64_t i, bool mean) {
  accum_t<T> s = 0;
  for (int r = 0; r < n; ++r) s += static_cast<accum_t<T>>(as_double(T(value(r, i))));
  if (mean) s /= static_cast<accum_t<T>>(n);
  return as_double(T(s));
}

comm_op make(comm_kind k, axis a, std::int64_t bytes, int ranks, dtype t = dtype::f32,
             reduce_op op = reduce_op::sum) {
  comm_op c;
  c.kind = k;
  c.on = a;
  c.bytes = bytes;
  c.type = t;
  c.ranks = ranks;
  c.op = op;
  c.unit = 0;
  c.when = phase::backward;
  return c;
}

/// Runs op either with run() or with start() + wait().
void execute(executor<communicator>& ex, const comm_op& op, const void* in, void* out, bool async) {
  if (!async) {
    ex.run(op, in, out);
    return;
  }
  pending_op p = ex.start(op, in, out);
  CHECK(p.on == op.on);
  ex.wait(p);
  CHECK_FALSE(p.req.pending());
  ex.wait(p);  // a second wait returns at once
}

/// Every kind on axis a, in T; checks results and that the counters equal what ran.
template <class T>
void check_axis(executor<communicator>& ex, axis a, bool async, plan& ran) {
  auto& m = ex.topology();
  const int n = m.axis_size(a);
  const int me = m.axis_rank(a);
  const dtype t = dtype_of<T>;
  const auto esz = static_cast<std::int64_t>(sizeof(T));
  constexpr std::int64_t k = 3;  // elements per rank
  CAPTURE(to_string(a));
  CAPTURE(async);
  CAPTURE(to_string(t));

  {  // all_gather: k elements in, n * k out in axis-rank order
    std::vector<T> in(k), out(static_cast<std::size_t>(n * k));
    for (std::int64_t i = 0; i < k; ++i) in[i] = T(value(me, i));
    const comm_op op = make(comm_kind::all_gather, a, n * k * esz, n, t);
    execute(ex, op, in.data(), out.data(), async);
    ran.ops.push_back(op);
    for (int r = 0; r < n; ++r)
      for (std::int64_t i = 0; i < k; ++i)
        CHECK(as_double(out[static_cast<std::size_t>(r * k + i)]) == value(r, i));
    CHECK(ex.traffic().same_traffic(traffic_counters::of(ran)));
  }
  {  // reduce_scatter (sum): n * k elements in, block `me` of the sum out
    std::vector<T> in(static_cast<std::size_t>(n * k)), out(k);
    for (std::int64_t j = 0; j < n * k; ++j) in[static_cast<std::size_t>(j)] = T(value(me, j));
    const comm_op op = make(comm_kind::reduce_scatter, a, n * k * esz, n, t);
    execute(ex, op, in.data(), out.data(), async);
    ran.ops.push_back(op);
    for (std::int64_t i = 0; i < k; ++i)
      CHECK(as_double(out[static_cast<std::size_t>(i)]) == reduced<T>(n, me * k + i, false));
    CHECK(ex.traffic().same_traffic(traffic_counters::of(ran)));
  }
  {  // all_reduce (sum, in place) of 5 elements: need not divide by the ranks
    std::vector<T> buf(5);
    for (std::int64_t i = 0; i < 5; ++i) buf[static_cast<std::size_t>(i)] = T(value(me, i));
    const comm_op op = make(comm_kind::all_reduce, a, 5 * esz, n, t);
    execute(ex, op, buf.data(), buf.data(), async);
    ran.ops.push_back(op);
    for (std::int64_t i = 0; i < 5; ++i)
      CHECK(as_double(buf[static_cast<std::size_t>(i)]) == reduced<T>(n, i, false));
    CHECK(ex.traffic().same_traffic(traffic_counters::of(ran)));
  }
  {  // all_reduce (avg), out of place: in is left alone
    std::vector<T> in(4), out(4);
    for (std::int64_t i = 0; i < 4; ++i) in[static_cast<std::size_t>(i)] = T(value(me, 2 * i));
    const comm_op op = make(comm_kind::all_reduce, a, 4 * esz, n, t, reduce_op::avg);
    execute(ex, op, in.data(), out.data(), async);
    ran.ops.push_back(op);
    for (std::int64_t i = 0; i < 4; ++i) {
      CHECK(as_double(out[static_cast<std::size_t>(i)]) == reduced<T>(n, 2 * i, true));
      CHECK(as_double(in[static_cast<std::size_t>(i)]) == value(me, 2 * i));
    }
  }
  {  // broadcast from axis rank 0, through `out` only
    std::vector<T> buf(7);
    for (std::int64_t i = 0; i < 7; ++i) buf[static_cast<std::size_t>(i)] = T(value(me, i));
    const comm_op op = make(comm_kind::broadcast, a, 7 * esz, n, t);
    execute(ex, op, nullptr, buf.data(), async);
    ran.ops.push_back(op);
    for (std::int64_t i = 0; i < 7; ++i)
      CHECK(as_double(buf[static_cast<std::size_t>(i)]) == value(0, i));
    CHECK(ex.traffic().same_traffic(traffic_counters::of(ran)));
  }
}

/// A plan ran on a world of `ranks` ranks, seen from each rank.
template <class F>
std::vector<std::string> errors_on_each_rank(int ranks, mesh_shape shape, F&& body) {
  std::vector<std::string> errors(static_cast<std::size_t>(ranks));
  test::spawn_ranks(ranks, [&](communicator& world) {
    mesh m(world, shape);
    executor<communicator> ex(m);
    try {
      body(ex);
    } catch (const invalid_argument& e) {
      errors[static_cast<std::size_t>(world.rank())] = e.what();
    }
    CHECK(ex.traffic().total() == axis_traffic{});  // nothing was counted
  });
  return errors;
}

}  // namespace

TEST_CASE("every kind on every axis of a 2x2x2 mesh, blocking and started") {
  test::spawn_ranks(8, [](communicator& world) {
    mesh m(world, {2, 2, 2});
    executor<communicator> ex(m);
    CHECK(&ex.topology() == &m);
    plan ran;
    for (bool async : {false, true})
      for (axis a : all_axes) check_axis<float>(ex, a, async, ran);
    // per axis: 2 modes x 5 ops
    for (axis a : all_axes) CHECK(ex.traffic()[a].calls == 10);
    CHECK(ex.traffic().same_traffic(traffic_counters::of(ran)));
  });
}

TEST_CASE("element counts follow the op's dtype (f64, bf16, f16) on an odd-sized axis") {
  test::spawn_ranks(3, [](communicator& world) {
    mesh m(world, {1, 1, 3});
    executor<communicator> ex(m);
    plan ran;
    check_axis<double>(ex, axis::shard, false, ran);
    check_axis<bf16>(ex, axis::group, true, ran);
    check_axis<f16>(ex, axis::world, false, ran);
    CHECK(ex.traffic()[axis::shard].payload_bytes == ex.traffic()[axis::group].payload_bytes * 4);
    CHECK(ex.traffic().same_traffic(traffic_counters::of(ran)));
  });
}

TEST_CASE("ops started on several axes complete in any wait order, counted once") {
  test::spawn_ranks(4, [](communicator& world) {
    mesh m(world, {1, 2, 2});
    executor<communicator> ex(m);
    std::vector<float> a(4, float(m.axis_rank(axis::shard) + 1));
    std::vector<float> b(4, float(m.axis_rank(axis::replica) + 10));
    std::vector<float> c(4, float(world.rank()));
    const comm_op on_shard = make(comm_kind::all_reduce, axis::shard, 16, 2);
    const comm_op on_replica = make(comm_kind::all_reduce, axis::replica, 16, 2);
    const comm_op on_group = make(comm_kind::all_reduce, axis::group, 16, 4);
    pending_op p1 = ex.start(on_shard, a.data(), a.data());
    pending_op p2 = ex.start(on_replica, b.data(), b.data());
    pending_op p3 = ex.start(on_group, c.data(), c.data());
    CHECK(ex.traffic().same_traffic(traffic_counters::of(plan{{on_shard, on_replica, on_group}})));
    ex.wait(p3);
    ex.wait(p1);
    ex.wait(p2);
    for (float x : a) CHECK(x == 3.0f);   // 1 + 2
    for (float x : b) CHECK(x == 21.0f);  // 10 + 11
    for (float x : c) CHECK(x == 6.0f);   // 0 + 1 + 2 + 3
    CHECK(ex.traffic().same_traffic(traffic_counters::of(plan{{on_shard, on_replica, on_group}})));
    pending_op none;
    ex.wait(none);  // nothing started: nothing to wait for
    CHECK(ex.traffic().total().calls == 3);
  });
}

TEST_CASE("an op planned for another rank count is refused, naming both counts") {
  for (bool async : {false, true}) {
    CAPTURE(async);
    const auto errors = errors_on_each_rank(4, {1, 2, 2}, [&](executor<communicator>& ex) {
      std::vector<float> buf(12);
      const comm_op op = make(comm_kind::all_reduce, axis::replica, 48, 3);
      if (async)
        ex.start(op, buf.data(), buf.data());
      else
        ex.run(op, buf.data(), buf.data());
    });
    for (const auto& e : errors) {
      CHECK(e.find("planned for 3 ranks") != std::string::npos);
      CHECK(e.find("replica axis has 2") != std::string::npos);
      CHECK(e.find("all_reduce") != std::string::npos);
    }
  }
}

TEST_CASE("bytes that are not whole elements, or not whole blocks per rank, are refused") {
  SUBCASE("not a multiple of the element size") {
    for (dtype t : {dtype::f32, dtype::f64, dtype::bf16}) {
      CAPTURE(to_string(t));
      const auto errors = errors_on_each_rank(2, {1, 1, 2}, [&](executor<communicator>& ex) {
        std::vector<double> buf(8);
        ex.run(make(comm_kind::all_reduce, axis::shard, 7, 2, t), buf.data(), buf.data());
      });
      for (const auto& e : errors) {
        CHECK(e.find(detail::concat("multiple of the element size ", size_of(t))) !=
              std::string::npos);
        CHECK(e.find("7 B") != std::string::npos);
      }
    }
  }
  SUBCASE("negative bytes") {
    const auto errors = errors_on_each_rank(2, {1, 1, 2}, [&](executor<communicator>& ex) {
      float x = 0;
      ex.run(make(comm_kind::broadcast, axis::shard, -4, 2), nullptr, &x);
    });
    for (const auto& e : errors) CHECK(e.find("-4 B") != std::string::npos);
  }
  SUBCASE("all_gather and reduce_scatter of elements that do not split over the ranks") {
    for (comm_kind k : {comm_kind::all_gather, comm_kind::reduce_scatter})
      for (bool async : {false, true}) {
        CAPTURE(to_string(k));
        const auto errors = errors_on_each_rank(2, {1, 1, 2}, [&](executor<communicator>& ex) {
          std::vector<float> in(6), out(6);
          const comm_op op = make(k, axis::shard, 12, 2);
          if (async)
            ex.start(op, in.data(), out.data());
          else
            ex.run(op, in.data(), out.data());
        });
        for (const auto& e : errors) {
          CHECK(e.find("3 elements do not split evenly over 2 ranks") != std::string::npos);
          CHECK(e.find(to_string(k)) != std::string::npos);
        }
      }
  }
}

TEST_CASE("send_recv is not an executor op") {
  for (bool async : {false, true}) {
    const auto errors = errors_on_each_rank(2, {2, 1, 1}, [&](executor<communicator>& ex) {
      std::vector<float> buf(2);
      const comm_op op = make(comm_kind::send_recv, axis::federation, 8, 2);
      if (async)
        ex.start(op, buf.data(), buf.data());
      else
        ex.run(op, buf.data(), buf.data());
    });
    for (const auto& e : errors) {
      CHECK(e.find("send_recv on federation") != std::string::npos);
      CHECK(e.find("not supported") != std::string::npos);
    }
  }
}

TEST_CASE("a refused op leaves the executor usable") {
  test::spawn_ranks(2, [](communicator& world) {
    mesh m(world, {1, 1, 2});
    executor<communicator> ex(m);
    std::vector<float> buf(2, 1.0f);
    CHECK_THROWS_AS(ex.run(make(comm_kind::all_reduce, axis::shard, 8, 4), buf.data(), buf.data()),
                    invalid_argument);
    const comm_op ok = make(comm_kind::all_reduce, axis::shard, 8, 2);
    ex.run(ok, buf.data(), buf.data());
    CHECK(buf[0] == 2.0f);
    CHECK(buf[1] == 2.0f);
    CHECK(ex.traffic().same_traffic(traffic_counters::of(plan{{ok}})));
  });
}
