// The interpreter on inproc ranks: every kind on every axis gives the collective's result with
// buffers bound by role, ops in another dtype run through staging, pieces and in-place ops
// keep their places, chains run in order and in the same order on every rank, and ops that do
// not fit the mesh or their buffers are refused before anything moves.
#include "fedshard/plan/interpreter.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
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

/// An on-demand op reading value 0 and writing value 1.
comm_op make(comm_kind k, axis a, std::int64_t bytes, int ranks, dtype t = dtype::f32,
             reduce_op op = reduce_op::sum) {
  comm_op c{.kind = k,
            .axis = a,
            .dtype = t,
            .bytes = bytes,
            .ranks = ranks,
            .in = {.role = role::value, .index = 0},
            .out = {.role = role::value, .index = 1}};
  if (reduces(k)) c.reduce = op;
  return c;
}

/// Binds value 0 to `in` and value 1 to `out`.
template <class T>
auto values(std::vector<T>& in, std::vector<T>& out) {
  return [&](const comm_op&, const operand& o) {
    auto& v = o.index == 0 ? in : out;
    return buffer_view{v.data(), v.size(), dtype_of<T>};
  };
}

/// Runs op with run() or with fire() + wait().
template <class Bind>
void execute(interpreter<communicator>& in, const comm_op& op, Bind&& bind, bool fired) {
  if (!fired) {
    in.run(op, bind);
    return;
  }
  plan p{{op}};
  const ticket t = in.fire(p, {}, bind);
  in.wait(t);
  CHECK(in.done(t));
  in.wait(t);  // a second wait returns at once
}

/// Every kind on axis a with buffers of T (the op in T too); checks results and that the wire
/// counted exactly the ops.
template <class T>
void check_axis(interpreter<communicator>& in, axis a, bool fired, plan& ran) {
  auto& m = in.topology();
  const int n = m.axis_size(a);
  const int me = m.axis_rank(a);
  const dtype t = dtype_of<T>;
  const auto esz = static_cast<std::int64_t>(sizeof(T));
  constexpr std::int64_t k = 3;  // elements per rank
  CAPTURE(to_string(a));
  CAPTURE(fired);
  CAPTURE(to_string(t));
  {  // all_gather: k elements in, n * k out in axis-rank order
    std::vector<T> x(k), y(static_cast<std::size_t>(n * k));
    for (std::int64_t i = 0; i < k; ++i) x[i] = T(value(me, i));
    const comm_op op = make(comm_kind::all_gather, a, n * k * esz, n, t);
    execute(in, op, values(x, y), fired);
    ran.ops.push_back(op);
    for (int r = 0; r < n; ++r)
      for (std::int64_t i = 0; i < k; ++i)
        CHECK(as_double(y[static_cast<std::size_t>(r * k + i)]) == value(r, i));
  }
  {  // reduce_scatter (sum): n * k elements in, block `me` of the sum out
    std::vector<T> x(static_cast<std::size_t>(n * k)), y(k);
    for (std::int64_t j = 0; j < n * k; ++j) x[static_cast<std::size_t>(j)] = T(value(me, j));
    const comm_op op = make(comm_kind::reduce_scatter, a, n * k * esz, n, t);
    execute(in, op, values(x, y), fired);
    ran.ops.push_back(op);
    for (std::int64_t i = 0; i < k; ++i)
      CHECK(as_double(y[static_cast<std::size_t>(i)]) == reduced<T>(n, me * k + i, false));
  }
  {  // all_reduce (avg) of 5 elements, in place (both operands bound to one buffer)
    std::vector<T> x(5);
    for (std::int64_t i = 0; i < 5; ++i) x[static_cast<std::size_t>(i)] = T(value(me, i));
    const comm_op op = make(comm_kind::all_reduce, a, 5 * esz, n, t, reduce_op::avg);
    execute(in, op, values(x, x), fired);
    ran.ops.push_back(op);
    for (std::int64_t i = 0; i < 5; ++i)
      CHECK(as_double(x[static_cast<std::size_t>(i)]) == reduced<T>(n, i, true));
  }
  {  // broadcast from axis rank `root`, through the output only
    std::vector<T> unused, y(7);
    for (std::int64_t i = 0; i < 7; ++i) y[static_cast<std::size_t>(i)] = T(value(me, i));
    comm_op op = make(comm_kind::broadcast, a, 7 * esz, n, t);
    op.root = n - 1;
    op.in = {};
    execute(in, op, values(unused, y), fired);
    ran.ops.push_back(op);
    for (std::int64_t i = 0; i < 7; ++i)
      CHECK(as_double(y[static_cast<std::size_t>(i)]) == value(n - 1, i));
  }
  if (n >= 2 && n - 1 - me != me) {  // send_recv with the mirror rank (the middle one waits)
    std::vector<T> x(6), y(6);
    for (std::int64_t i = 0; i < 6; ++i) x[static_cast<std::size_t>(i)] = T(value(me, i));
    comm_op op = make(comm_kind::send_recv, a, 6 * esz, n, t);
    op.peer = n - 1 - me;
    execute(in, op, values(x, y), fired);
    ran.ops.push_back(op);
    for (std::int64_t i = 0; i < 6; ++i)
      CHECK(as_double(y[static_cast<std::size_t>(i)]) == value(n - 1 - me, i));
  }
  CHECK(in.traffic().same_traffic(traffic_counters::of(ran)));
}

/// What each rank saw when body(interpreter) threw invalid_argument.
template <class F>
std::vector<std::string> errors_on_each_rank(mesh_shape shape, F&& body) {
  std::vector<std::string> errors(static_cast<std::size_t>(shape.size()));
  test::spawn_ranks(shape.size(), [&](communicator& world) {
    mesh m(world, shape);
    interpreter<communicator> in(m);
    try {
      body(in);
    } catch (const invalid_argument& e) {
      errors[static_cast<std::size_t>(world.rank())] = e.what();
    }
    CHECK(in.traffic().total() == axis_traffic{});  // nothing moved
  });
  return errors;
}

}  // namespace

TEST_CASE("every kind on every axis of a 2x2x2 mesh, run and fired") {
  test::spawn_ranks(8, [](communicator& world) {
    mesh m(world, {2, 2, 2});
    interpreter<communicator> in(m);
    CHECK(&in.topology() == &m);
    plan ran;
    for (bool fired : {false, true})
      for (axis a : all_axes) check_axis<float>(in, a, fired, ran);
    for (axis a : all_axes) CHECK(in.traffic()[a].calls == 10);  // 2 modes x 5 ops
  });
}

TEST_CASE("element counts follow the op's dtype (f64, bf16, f16) on an odd-sized axis") {
  test::spawn_ranks(3, [](communicator& world) {
    mesh m(world, {1, 1, 3});
    interpreter<communicator> in(m);
    plan ran;
    check_axis<double>(in, axis::shard, false, ran);
    check_axis<bf16>(in, axis::group, true, ran);
    check_axis<f16>(in, axis::world, false, ran);
    CHECK(in.traffic()[axis::shard].payload_bytes == in.traffic()[axis::group].payload_bytes * 4);
  });
}

TEST_CASE("an op in another dtype than its buffers runs through staging: rounded once, in place") {
  test::spawn_ranks(4, [](communicator& world) {
    mesh m(world, {1, 1, 4});
    interpreter<communicator> in(m);
    const int me = world.rank();
    // f32 buffers, bf16 on the wire: x = 1 + r / 1024 is not a bf16 value; the result is the
    // bf16 sum (in float) of the bf16-rounded inputs, rounded to bf16, widened back.
    std::vector<float> x(6), y(6);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = 1.0f + float(me) / 1024.0f + float(i);
    const comm_op ar = make(comm_kind::all_reduce, axis::shard, 6 * 2, 4, dtype::bf16);
    in.run(ar, values(x, y));
    for (std::size_t i = 0; i < y.size(); ++i) {
      float s = 0;
      for (int r = 0; r < 4; ++r) s += float(bf16(1.0f + float(r) / 1024.0f + float(i)));
      CHECK(y[i] == float(bf16(s)));
    }
    // all_gather from a piece of its own output (in place): the piece keeps its place
    std::vector<float> whole(8, -1.0f);
    for (int j = 0; j < 2; ++j) whole[static_cast<std::size_t>(2 * me + j)] = float(10 * me + j);
    comm_op ag = make(comm_kind::all_gather, axis::shard, 8 * 2, 4, dtype::bf16);
    ag.in = {.role = role::value, .index = 1, .piece = axis::shard};
    in.run(ag, values(whole, whole));
    for (int r = 0; r < 4; ++r)
      for (int j = 0; j < 2; ++j) CHECK(whole[static_cast<std::size_t>(2 * r + j)] == 10 * r + j);
    // the wire saw bf16 calls of the planned sizes
    CHECK(in.traffic().same_traffic(traffic_counters::of(plan{{ar, ag}})));
  });
}

TEST_CASE(
    "a one-way transfer binds only the sender's input and the receiver's output; staged "
    "in another dtype it is rounded once") {
  // Axis rank 0 sends 3 f32 values as bf16 (6 B) to axis rank 1, whose f32 buffer receives
  // them widened back: 1 + 1/1024 rounds to 1 in bf16, 3.5 and -2 are exact.
  test::spawn_ranks(2, [](communicator& world) {
    mesh m(world, {1, 1, 2});
    interpreter<communicator> in(m);
    const int me = m.axis_rank(axis::shard);
    std::vector<float> buf = me == 0 ? std::vector<float>{1.0f + 1.0f / 1024.0f, 3.5f, -2.0f}
                                     : std::vector<float>(3, -1.0f);
    comm_op op{.kind = me == 0 ? comm_kind::send : comm_kind::recv,
               .axis = axis::shard,
               .dtype = dtype::bf16,
               .bytes = 6,
               .ranks = 2,
               .peer = 1 - me};
    (me == 0 ? op.in : op.out).role = role::value;
    std::vector<role> bound;
    in.run(op, [&](const comm_op&, const operand& o) {
      bound.push_back(o.role);
      return buffer_view{buf.data(), buf.size(), dtype::f32};
    });
    CHECK(bound == std::vector<role>{role::value});  // one operand only
    if (me == 1) CHECK(buf == std::vector<float>{1.0f, 3.5f, -2.0f});
    if (me == 0) CHECK(buf[0] == 1.0f + 1.0f / 1024.0f);  // the sender's buffer is untouched
    // the sender sent 6 B in one call; the receiver sent nothing
    CHECK(in.traffic()[axis::shard].payload_bytes == (me == 0 ? 6 : 0));
    CHECK(in.traffic().same_traffic(traffic_counters::of(plan{{op}})));
  });
}

TEST_CASE("a chain runs its ops in order, each after the previous, and ranks agree on the order") {
  // A firing of [reduce_scatter on shard, all_reduce on replica] leaves a follow-up on the
  // replica axis; a later firing whose first op is on the replica axis must be issued after
  // it on every rank, whatever the timing (otherwise inproc would pair calls of different
  // sizes and throw collective_mismatch).
  test::spawn_ranks(4, [](communicator& world) {
    mesh m(world, {1, 2, 2});
    interpreter<communicator> in(m);
    const int s = m.axis_rank(axis::shard), r = m.axis_rank(axis::replica);
    for (int round = 0; round < 20; ++round) {
      std::vector<float> full(8), shard(4), other(3);
      for (std::size_t i = 0; i < full.size(); ++i) full[i] = value(2 * r + s, std::int64_t(i));
      for (std::size_t i = 0; i < other.size(); ++i) other[i] = float(r + 1);
      comm_op rs = make(comm_kind::reduce_scatter, axis::shard, 32, 2, dtype::f32, reduce_op::avg);
      rs.trigger = trigger::grads_ready;
      rs.unit = 0;
      rs.phase = phase::backward;
      comm_op ar = make(comm_kind::all_reduce, axis::replica, 16, 2, dtype::f32, reduce_op::avg);
      ar.trigger = trigger::grads_ready;
      ar.unit = 0;
      ar.phase = phase::backward;
      ar.in = ar.out = {.role = role::value, .index = 1};
      comm_op later = make(comm_kind::all_reduce, axis::replica, 12, 2);
      later.in = later.out = {.role = role::value, .index = 2};
      const plan p{{rs, ar}};
      auto bind = [&](const comm_op&, const operand& o) {
        if (o.index == 0) return buffer_view{full.data(), full.size(), dtype::f32};
        if (o.index == 1) return buffer_view{shard.data(), shard.size(), dtype::f32};
        return buffer_view{other.data(), other.size(), dtype::f32};
      };
      const ticket t =
          in.fire(p, {.trigger = trigger::grads_ready, .phase = phase::backward, .unit = 0}, bind);
      if ((round + world.rank()) % 2 == 0) {  // let the reduce_scatter finish here first
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        in.progress();
      }
      in.run(later, bind);
      in.wait(t);
      // the two-stage average over all four ranks of element (s * 4 + i)
      for (std::size_t i = 0; i < shard.size(); ++i) {
        const auto e = static_cast<std::int64_t>(4 * s) + std::int64_t(i);
        const float r0 = (value(0, e) + value(1, e)) / 2.0f;  // replica 0: ranks 0, 1
        const float r1 = (value(2, e) + value(3, e)) / 2.0f;  // replica 1: ranks 2, 3
        CHECK(shard[i] == (r0 + r1) / 2.0f);
      }
      for (float x : other) CHECK(x == 3.0f);
    }
  });
}

TEST_CASE("fired ops overlap: several in flight, waited in any order, progress never blocks") {
  test::spawn_ranks(4, [](communicator& world) {
    mesh m(world, {1, 2, 2});
    interpreter<communicator> in(m);
    std::vector<float> a(4, float(m.axis_rank(axis::shard) + 1));
    std::vector<float> b(4, float(m.axis_rank(axis::replica) + 10));
    std::vector<float> c(4, float(world.rank()));
    auto on = [](axis x, int n) {
      comm_op op = make(comm_kind::all_reduce, x, 16, n);
      op.in = op.out = {.role = role::value};
      return op;
    };
    const plan p{{on(axis::shard, 2)}}, q{{on(axis::replica, 2)}}, g{{on(axis::group, 4)}};
    auto to = [](std::vector<float>& v) {
      return [&v](const comm_op&, const operand&) {
        return buffer_view{v.data(), v.size(), dtype::f32};
      };
    };
    const ticket t1 = in.fire(p, {}, to(a));
    const ticket t2 = in.fire(q, {}, to(b));
    const ticket t3 = in.fire(g, {}, to(c));
    in.progress();
    in.wait(t3);
    in.wait(t1);
    in.wait(t2);
    for (float x : a) CHECK(x == 3.0f);          // 1 + 2
    for (float x : b) CHECK(x == 21.0f);         // 10 + 11
    for (float x : c) CHECK(x == 6.0f);          // 0 + 1 + 2 + 3
    CHECK(in.done(ticket{}));                    // the default ticket is complete
    CHECK(in.done(in.fire(plan{}, {}, to(a))));  // so is a firing of no ops
    in.wait_all();
    CHECK(in.traffic().total().calls == 3);
  });
}

TEST_CASE("an op planned for another rank count is refused, naming both counts") {
  const auto errors = errors_on_each_rank({1, 2, 2}, [&](interpreter<communicator>& in) {
    std::vector<float> buf(12);
    in.run(make(comm_kind::all_reduce, axis::replica, 48, 3), values(buf, buf));
  });
  for (const auto& e : errors) {
    CHECK(e.find("planned for 3 ranks") != std::string::npos);
    CHECK(e.find("replica axis has 2") != std::string::npos);
    CHECK(e.find("all_reduce") != std::string::npos);
  }
}

TEST_CASE("buffers that do not fit the op are refused, naming the role and both sizes") {
  SUBCASE("output too small") {
    const auto errors = errors_on_each_rank({1, 1, 2}, [&](interpreter<communicator>& in) {
      std::vector<float> x(3), y(5);
      in.run(make(comm_kind::all_gather, axis::shard, 6 * 4, 2), values(x, y));
    });
    for (const auto& e : errors)
      CHECK(e.find("its output (value) holds 5 elements, the op needs 6") != std::string::npos);
  }
  SUBCASE("input of a reduce_scatter") {
    const auto errors = errors_on_each_rank({1, 1, 2}, [&](interpreter<communicator>& in) {
      std::vector<float> x(4), y(3);
      in.run(make(comm_kind::reduce_scatter, axis::shard, 6 * 4, 2), values(x, y));
    });
    for (const auto& e : errors)
      CHECK(e.find("its input (value) holds 4 elements, the op needs 6") != std::string::npos);
  }
  SUBCASE("a piece that does not divide") {
    const auto errors = errors_on_each_rank({1, 1, 2}, [&](interpreter<communicator>& in) {
      std::vector<float> x(5);
      comm_op op = make(comm_kind::all_reduce, axis::shard, 4, 2);
      op.in = op.out = {.role = role::value, .piece = axis::shard};
      in.run(op, values(x, x));
    });
    for (const auto& e : errors)
      CHECK(e.find("has 5 elements, which do not split into 2 equal pieces") != std::string::npos);
  }
  SUBCASE("fields that cannot work") {
    const auto errors = errors_on_each_rank({1, 1, 2}, [&](interpreter<communicator>& in) {
      std::vector<float> x(8);
      in.run(make(comm_kind::all_reduce, axis::shard, 7, 2), values(x, x));
    });
    for (const auto& e : errors)
      CHECK(e.find("bytes must be a whole number of 4-byte elements") != std::string::npos);
  }
}

TEST_CASE(
    "a send_recv op with itself as peer, or overlapping buffers, is refused before it moves") {
  SUBCASE("itself as peer") {
    const auto errors = errors_on_each_rank({1, 1, 2}, [&](interpreter<communicator>& in) {
      std::vector<float> x(2), y(2);
      comm_op op = make(comm_kind::send_recv, axis::shard, 8, 2);
      op.peer = in.topology().axis_rank(axis::shard);
      in.run(op, values(x, y));
    });
    for (const auto& e : errors)
      CHECK(e.find("a rank cannot exchange with itself") != std::string::npos);
  }
  SUBCASE("in place") {
    const auto errors = errors_on_each_rank({1, 1, 2}, [&](interpreter<communicator>& in) {
      std::vector<float> x(2);
      comm_op op = make(comm_kind::send_recv, axis::shard, 8, 2);
      op.peer = 1 - in.topology().axis_rank(axis::shard);
      in.run(op, values(x, x));
    });
    for (const auto& e : errors)
      CHECK(e.find("its input (value) and output (value) overlap") != std::string::npos);
  }
}

TEST_CASE("exchanges in a chain with different peers each round run in order on every rank") {
  // Round k pairs axis rank r with r ^ (k + 1) on 4 ranks: three perfect matchings, so each
  // rank's chain meets every other rank once, all in the same order.
  test::spawn_ranks(4, [](communicator& world) {
    mesh m(world, {4, 1, 1});
    interpreter<communicator> in(m);
    const int me = m.axis_rank(axis::federation);
    std::vector<float> x(4, static_cast<float>(me));
    std::vector<std::vector<float>> got(3, std::vector<float>(4, -1.0f));
    plan p;
    for (int k = 0; k < 3; ++k) {
      comm_op op = make(comm_kind::send_recv, axis::federation, 16, 4);
      op.trigger = trigger::sync_exchange;
      op.phase = phase::sync;
      op.fragment = 0;
      op.peer = me ^ (k + 1);
      op.out.index = k + 1;
      p.ops.push_back(op);
    }
    auto bind = [&](const comm_op&, const operand& o) {
      auto& v = o.index == 0 ? x : got[static_cast<std::size_t>(o.index - 1)];
      return buffer_view{v.data(), v.size(), dtype::f32};
    };
    in.wait(
        in.fire(p, {.trigger = trigger::sync_exchange, .phase = phase::sync, .fragment = 0}, bind));
    for (int k = 0; k < 3; ++k)
      for (float v : got[static_cast<std::size_t>(k)]) CHECK(v == static_cast<float>(me ^ (k + 1)));
    CHECK(in.traffic().same_traffic(traffic_counters::of(p)));
    CHECK(in.traffic()[axis::federation].wire_bytes == 3 * 16);
  });
}

TEST_CASE("a refused op leaves the interpreter usable") {
  test::spawn_ranks(2, [](communicator& world) {
    mesh m(world, {1, 1, 2});
    interpreter<communicator> in(m);
    std::vector<float> buf(2, 1.0f);
    CHECK_THROWS_AS(in.run(make(comm_kind::all_reduce, axis::shard, 8, 4), values(buf, buf)),
                    invalid_argument);
    const comm_op ok = make(comm_kind::all_reduce, axis::shard, 8, 2);
    in.run(ok, values(buf, buf));
    CHECK(buf[0] == 2.0f);
    CHECK(buf[1] == 2.0f);
    CHECK(in.traffic().same_traffic(traffic_counters::of(plan{{ok}})));
  });
}

TEST_CASE("local ops: a pack, a gather of the packed values, an unpack and a zero run as a chain") {
  // Two ranks of the shard axis. Rank r's master is {10r, 10r + 1, ..., 10r + 5}; it packs its
  // elements {4, 1} (pack by value 3's indices), the two ranks gather their packed pairs
  // into {4, 1, 14, 11}, which unpack writes at indices {0, 5, 6, 11} of a 12-element buffer
  // of -1s; zero clears value 5. Nothing local is counted as a call.
  test::spawn_ranks(2, [](communicator& world) {
    mesh m(world, {1, 1, 2});
    interpreter<communicator> in(m);
    const int r = m.axis_rank(axis::shard);
    std::vector<float> master(6), packed(2), gathered(4), params(12, -1.0f), cleared(3, 7.0f);
    for (std::size_t i = 0; i < master.size(); ++i) master[i] = float(10 * r) + float(i);
    const std::vector<std::uint32_t> own{4, 1}, unit{0, 5, 6, 11};
    auto local = [](comm_kind k, int from, int to, int idx, std::int64_t bytes) {
      comm_op op{.kind = k,
                 .axis = axis::shard,
                 .bytes = bytes,
                 .ranks = 2,
                 .in = {.role = from < 0 ? role::none : role::value, .index = std::max(from, 0)},
                 .out = {.role = role::value, .index = to}};
      if (idx >= 0) op.index = {.role = role::mask, .index = idx};
      return op;
    };
    comm_op gather = make(comm_kind::all_gather, axis::shard, 16, 2);
    gather.in = {.role = role::value, .index = 1};
    gather.out = {.role = role::value, .index = 2};
    const plan p{{local(comm_kind::pack, 0, 1, 3, 8), gather, local(comm_kind::unpack, 2, 4, 6, 16),
                  local(comm_kind::zero, -1, 5, -1, 12)}};
    p.check();
    auto bind = [&](const comm_op&, const operand& o) {
      auto idx = [](const std::vector<std::uint32_t>& v) {
        return buffer_view{const_cast<std::uint32_t*>(v.data()), v.size(), dtype::f32};
      };
      if (o.role == role::mask) return idx(o.index == 3 ? own : unit);
      std::vector<float>* b[] = {&master, &packed, &gathered, nullptr, &params, &cleared};
      auto& v = *b[o.index];
      return buffer_view{v.data(), v.size(), dtype::f32};
    };
    in.wait(in.fire(p, {}, bind));
    CHECK(packed == std::vector<float>{float(10 * r + 4), float(10 * r + 1)});
    CHECK(gathered == std::vector<float>{4, 1, 14, 11});
    CHECK(params == std::vector<float>{4, -1, -1, -1, -1, 1, 14, -1, -1, -1, -1, 11});
    CHECK(cleared == std::vector<float>{0, 0, 0});
    CHECK(in.traffic()[axis::shard].calls == 1);  // the gather only
    CHECK(p.calls_on(axis::shard) == 1);
    // a pack without indices is refused by the plan check
    comm_op bad = local(comm_kind::pack, 0, 1, -1, 8);
    CHECK_THROWS_WITH_AS(check(bad), doctest::Contains("a pack or unpack op needs indices"),
                         invalid_argument);
  });
}
