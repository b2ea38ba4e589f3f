#pragma once
/// Builders of the ops a federation policy's sync plan is made of, for one rank.

#include <cstddef>
#include <cstdint>

#include "fedshard/error.hpp"
#include "fedshard/federation/federation_policy.hpp"
#include "fedshard/federation/overlap.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/comm_op.hpp"

namespace fedshard::federation {

/// Elements a fragment buffer of `numel` parameters is padded to: a multiple of 16 * R, so
/// each of the R replicas owns an equal, 64-byte aligned piece (hierarchical sync).
inline std::size_t padded_fragment_numel(std::size_t numel, int replicas) {
  const std::size_t q = 16 * static_cast<std::size_t>(replicas);
  return (numel + q - 1) / q * q;
}

/// Appends to p the ops that average `across` (an all_reduce of operand across.in over the
/// federation axis) and share the result with the group's R replicas at `finish`:
/// hierarchical, each replica averages its 1/R piece and the replicas all-gather the pieces;
/// otherwise replica 0 averages the whole and broadcasts it.
inline void append_average(plan& p, const comm_op& across, bool hierarchical, int replica, int R,
                           trigger finish) {
  comm_op within = across;
  within.axis = axis::replica;
  within.ranks = R;
  within.reduce.reset();
  within.members = 0;
  within.trigger = finish;
  if (hierarchical) {
    operand piece = across.in;
    piece.piece = axis::replica;
    comm_op ar = across;
    ar.bytes = across.bytes / R;
    ar.in = ar.out = piece;
    p.ops.push_back(ar);
    if (R > 1) {
      within.kind = comm_kind::all_gather;
      within.in = piece;
      p.ops.push_back(within);
    }
    return;
  }
  if (replica == 0) p.ops.push_back(across);
  if (R > 1) {
    within.kind = comm_kind::broadcast;
    within.in = {};
    p.ops.push_back(within);
  }
}

/// The ops that average the f32 buffer `what` (a fragment or a moment, ctx.numel elements)
/// over the federation axis for this rank: the cross-group average runs at trigger
/// `start`, sharing it with the group's other replicas at trigger `finish`. Both ops are in
/// ctx.reduce (staged by the interpreter when narrower than f32: the sharing moves the
/// average's own narrow values, exactly).
///  - hierarchical: every replica all-reduces its 1/R piece over the groups, then the
///    replicas all-gather the pieces;
///  - reference: replica 0 all-reduces the whole buffer over the groups, then broadcasts it
///    to the other replicas (which only receive).
/// On a heterogeneous mesh (ctx.overlap), whatever the mode: overlap_average_ops.
inline plan average_ops(const sync_context& ctx, sync_mode mode, operand what, trigger start,
                        trigger finish) {
  if (ctx.overlap)
    return overlap_average_ops(*ctx.overlap, unit_ids(ctx.units), ctx.fragment, ctx.numel, what,
                               start, finish);
  plan p;
  const auto bytes = static_cast<std::int64_t>(ctx.numel * size_of(ctx.reduce));
  const int G = ctx.shape.groups, R = ctx.shape.replicas;
  FEDSHARD_EXPECTS(mode != sync_mode::hierarchical || ctx.numel % static_cast<std::size_t>(R) == 0,
                   "average_ops: a hierarchical sync splits the fragment over ", R,
                   " replicas, but its ", ctx.numel,
                   " elements do not divide evenly (pad it with padded_fragment_numel)");
  const comm_op across{.kind = comm_kind::all_reduce,
                       .axis = axis::federation,
                       .dtype = ctx.reduce,
                       .bytes = bytes,
                       .ranks = G,
                       .reduce = reduce_op::avg,
                       .trigger = start,
                       .phase = phase::sync,
                       .fragment = ctx.fragment,
                       .in = what,
                       .out = what,
                       .overlappable = false};
  append_average(p, across, mode == sync_mode::hierarchical, ctx.coords.replica, R, finish);
  return p;
}

/// The ops that exchange the groups' weights (tokens since the fragment's last sync) at
/// sync_prepare: this rank's tokens summed over the group, then every group's sum gathered
/// over the federation axis (role group_tokens, ordered by group). On a heterogeneous mesh
/// (ctx.overlap): overlap_weights_ops.
inline plan weights_ops(const sync_context& ctx) {
  if (ctx.overlap) return overlap_weights_ops(*ctx.overlap, ctx.fragment);
  plan p;
  const mesh_shape& s = ctx.shape;
  p.ops.push_back({.kind = comm_kind::all_reduce,
                   .axis = axis::group,
                   .dtype = dtype::f64,
                   .bytes = 8,
                   .ranks = s.replicas * s.shards,
                   .reduce = reduce_op::sum,
                   .trigger = trigger::sync_prepare,
                   .phase = phase::sync,
                   .fragment = ctx.fragment,
                   .in = {.role = role::tokens},
                   .out = {.role = role::tokens},
                   .overlappable = false});
  p.ops.push_back({.kind = comm_kind::all_gather,
                   .axis = axis::federation,
                   .dtype = dtype::f64,
                   .bytes = 8 * static_cast<std::int64_t>(s.groups),
                   .ranks = s.groups,
                   .trigger = trigger::sync_prepare,
                   .phase = phase::sync,
                   .fragment = ctx.fragment,
                   .in = {.role = role::tokens},
                   .out = {.role = role::group_tokens},
                   .overlappable = false});
  return p;
}

/// The ops that average the fragment's parameters: average_ops on role fragment, started
/// at sync_exchange and finished at sync_finish.
inline plan parameter_average_ops(const sync_context& ctx, sync_mode mode) {
  return average_ops(ctx, mode, {.role = role::fragment}, trigger::sync_exchange,
                     trigger::sync_finish);
}

/// The op that gathers every group's copy of the fragment, on every replica, for a policy
/// that combines the copies itself in end() (robust_mean.hpp): an all_gather over the
/// federation axis from role fragment into role gathered (G x ctx.numel f32, ordered by
/// group) at sync_exchange. Nothing is shared inside the group afterwards: see robust_mean.hpp
/// for why, and for what it costs.
inline plan fragment_gather_ops(const sync_context& ctx) {
  plan p;
  const int G = ctx.shape.groups;
  p.ops.push_back({.kind = comm_kind::all_gather,
                   .axis = axis::federation,
                   .dtype = dtype::f32,
                   .bytes = static_cast<std::int64_t>(ctx.numel * sizeof(float)) * G,
                   .ranks = G,
                   .trigger = trigger::sync_exchange,
                   .phase = phase::sync,
                   .fragment = ctx.fragment,
                   .in = {.role = role::fragment},
                   .out = {.role = role::gathered},
                   .overlappable = false});
  return p;
}

/// The ops that average every inner-optimizer state buffer of the fragment (Photon), after
/// the parameters are applied (trigger sync_after).
inline plan moment_average_ops(const sync_context& ctx, sync_mode mode) {
  plan p;
  for (int k = 0; k < ctx.inner_state_buffers; ++k)
    p.append(average_ops(ctx, mode, {.role = role::moment, .index = k}, trigger::sync_after,
                         trigger::sync_after));
  return p;
}

}  // namespace fedshard::federation
