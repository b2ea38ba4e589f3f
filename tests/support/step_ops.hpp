#pragma once
/// Test support: a shard policy's step op written out by hand (what each kind of step op
/// reads, writes and waits for), so policy tests compare plans with explicit expectations.

#include <cstdint>
#include <span>
#include <vector>

#include "fedshard/plan/comm_op.hpp"

namespace fedshard::test {

/// The step op of kind k: an all_gather rebuilds role params from param_shard when the unit
/// is acquired in `when`; a reduce_scatter averages role grad into grad_shard, an all_reduce
/// on the replica axis averages grad_shard in place, on the group axis grad in place, all
/// when the unit's gradients are ready.
inline comm_op step_op(comm_kind k, axis a, std::int64_t bytes, dtype t, int unit, phase when,
                       int ranks) {
  comm_op op{.kind = k, .axis = a, .dtype = t, .bytes = bytes, .ranks = ranks};
  op.phase = when;
  op.unit = unit;
  if (k == comm_kind::all_gather) {
    op.trigger = trigger::acquire;
    op.in = {.role = role::param_shard};
    op.out = {.role = role::params};
    return op;
  }
  op.trigger = trigger::grads_ready;
  op.reduce = reduce_op::avg;
  if (k == comm_kind::reduce_scatter) {
    op.in = {.role = role::grad};
    op.out = {.role = role::grad_shard};
  } else if (a == axis::replica) {
    op.in = op.out = {.role = role::grad_shard};
  } else {
    op.in = op.out = {.role = role::grad};
  }
  return op;
}

/// A step op in two settings of one plan test, side by side: its kind, axis, unit and phase,
/// then its bytes, dtype and ranks in setting 0 and in setting 1.
struct step_op_pair {
  comm_kind kind;
  axis a;
  int unit;
  phase when;
  std::int64_t bytes0;
  dtype type0;
  int ranks0;
  std::int64_t bytes1;
  dtype type1;
  int ranks1;
};

/// The step ops of setting k (0 or 1) of a table of step_op_pair, in order.
inline std::vector<comm_op> step_ops_of(std::span<const step_op_pair> rows, int k) {
  std::vector<comm_op> out;
  for (const step_op_pair& r : rows)
    out.push_back(k == 0 ? step_op(r.kind, r.a, r.bytes0, r.type0, r.unit, r.when, r.ranks0)
                         : step_op(r.kind, r.a, r.bytes1, r.type1, r.unit, r.when, r.ranks1));
  return out;
}

}  // namespace fedshard::test
