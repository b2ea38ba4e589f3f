#pragma once
/// How the simulator prices a group's local rule (trainer/local_rule.hpp): zeroth-order units
/// whose records cross the federation link as seeds (HO-FL: trainer/local_zeroth_order.hpp,
/// optim/zeroth_order.hpp), and a local soup (LSS: trainer/local_soup.hpp, optim/soup.hpp).
/// Neither is on by default: an algorithm described without one is priced as before, bit for
/// bit.
///
/// Zeroth-order units (P probes; Z the rank's shard elements of those units):
///  - the step plan loses their backward gathers and gradient reductions, as the shard engine
///    drops them (shard::engine's without_backward_of_free);
///  - each step evaluates the group's loss 2P times (optim::spsa_probe: at +eps z and -eps z
///    per probe): each evaluation a forward pass of the whole model, which fires the step
///    plan's forward acquire ops again (the trainer's group_mean_loss runs the model's
///    evaluate through the engine), then a group all_reduce of one f64 (group_mean_op,
///    trainer/options.hpp; a call of no bytes on a group of one rank, as the trainer runs it);
///  - compute, from the plain step's C split as sim/timeline.hpp splits it (one third forward,
///    two thirds backward, over the units by their elements): the units' backward share is
///    not computed (exact when they are the model's lowest units, whose input gradient nothing
///    needs), and each evaluation costs the forward third, C / 3; plus zo_step_passes(P)
///    elementwise passes over the Z elements;
///  - at a sync, with seeds on the wire (and a federation that syncs), the units are left out
///    of the federation policy's sync plans (planned as if the group did not hold them, as the
///    synchronizer's left_out fragments leave them) and each applied sync exchanges the
///    records instead, as the rule's after_sync does (trainer/local_zeroth_order.hpp, through
///    the trainer's local_sync::all_gather): two exchanges, each group's record count (one
///    f64) and then its K P records of 24 bytes (optim::zo_record, 3 f64 words), K the steps
///    since the previous applied sync; each exchange an all_gather over the federation axis
///    by the group's rank 0 (replica 0, shard 0), G n f64 gathered, (G - 1) n received, then a
///    broadcast of the G n f64 to the group's R S ranks (none when R S = 1); every rank then
///    replays the G K P records onto the anchor on its Z elements (one hash and one fma each:
///    2 G K P passes) and copies the anchor in and out (4 passes), and the round's first step
///    saves the anchor (2 passes): 2 G K P + 6 passes per sync.
///
/// A soup of M members: the pool holds M members and the anchor, (M + 1) master shards; each
/// step adds soup_step_passes(M, diversity) elementwise passes over the master shard, and with
/// a diversity coefficient > 0 and M >= 2 the distances' sum over the group's shards: an
/// all_reduce of M (M - 1) / 2 + 1 f64 over the shard axis (shard_sum_op, trainer/options.hpp;
/// the pool's distance_count once full; none over one shard).
///
/// A pass reads or writes the 4-byte elements once, at the GPU's memory bandwidth
/// (cluster::memory_bandwidth; 0 prices them at nothing), as the codec kernels are priced.
///
/// Time (sim/price.hpp): the step itself is priced as without a rule from its reduced compute
/// (its timeline still splits that compute over every unit); the evaluations, passes and
/// replay are compute added after it; the evaluations' forward gathers run behind the
/// evaluations' compute (max(compute, gathers), as under step_overlap::channel) and the
/// blocking ops (the loss means, the distance sum) are exposed.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fedshard/core/dtype.hpp"
#include "fedshard/error.hpp"
#include "fedshard/mesh/axis.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/shard/flat_layout.hpp"
#include "fedshard/trainer/options.hpp"

namespace fedshard::sim {

/// Bytes of one zeroth-order record (optim::zo_record: seed, step, probe, scalar).
inline constexpr std::int64_t zo_record_bytes = 24;

/// The largest soup pool (optim::max_soup_pool).
inline constexpr int max_soup_members = 16;

/// Zeroth-order units of a local rule (trainer/local_zeroth_order.hpp).
struct zeroth_order_units {
  /// Names of the units trained without gradients (with the `lower` ones).
  std::vector<std::string> units{};
  /// The model's first `lower` units by position are zeroth-order too (HO-FL's lower part:
  /// zeroth_order_lower_rule); 0: none. No unit by name or position: no zeroth-order units.
  int lower = 0;
  /// P, probes per step (optim::zeroth_order_settings::probes), >= 1.
  int probes = 1;
  /// At a sync, the units' records cross the federation axis instead of their parameters.
  bool seeds_on_wire = true;
};

/// A local soup (trainer/local_soup.hpp).
struct soup_pool_size {
  /// M, the pool's members (optim::soup_config::pool_size); 0: no soup.
  int members = 0;
  /// The diversity coefficient is > 0 (the distances are summed over the shards every step).
  bool diversity = true;
  /// Local steps member 0 trains alone (optim::soup_config::first_steps), >= 0.
  std::int64_t first_steps = 8;
  /// Local steps each later member trains before the next joins (soup_config::add_every),
  /// >= 1.
  std::int64_t add_every = 1;
};

/// The members a soup has at local step `step` of its round (0 after each applied sync), as
/// optim::soup_pool::scheduled_members counts them.
constexpr int soup_members_at(const soup_pool_size& s, std::int64_t step) noexcept {
  if (step < s.first_steps) return 1;
  const std::int64_t later = 2 + (step - s.first_steps) / s.add_every;
  return static_cast<int>(later < s.members ? later : s.members);
}

/// The local rule an algorithm is priced with (one rule at most, as a trainer takes one).
struct local_rule_desc {
  zeroth_order_units zeroth_order{};
  soup_pool_size soup{};

  /// True when some unit is zeroth-order.
  bool zeroth_order_on() const noexcept {
    return !zeroth_order.units.empty() || zeroth_order.lower > 0;
  }
  /// True when a soup is kept.
  bool soup_on() const noexcept { return soup.members > 0; }
  /// True when either rule is on.
  bool active() const noexcept { return zeroth_order_on() || soup_on(); }

  /// invalid_argument naming the setting out of range, or when both rules are asked for.
  void check() const {
    FEDSHARD_EXPECTS(zeroth_order.lower >= 0,
                     "sim: the zeroth-order lower units must be >= 0 (0: none), found ",
                     zeroth_order.lower);
    FEDSHARD_EXPECTS(zeroth_order.probes >= 1,
                     "sim: zeroth-order units need probes >= 1 (optim::zeroth_order_settings), "
                     "found ",
                     zeroth_order.probes);
    FEDSHARD_EXPECTS(soup.first_steps >= 0 && soup.add_every >= 1,
                     "sim: the soup needs first_steps >= 0 and add_every >= 1, found ",
                     soup.first_steps, " and ", soup.add_every);
    FEDSHARD_EXPECTS(soup.members >= 0 && soup.members <= max_soup_members,
                     "sim: the soup's pool must have 0 (no soup) to ", max_soup_members,
                     " members, found ", soup.members);
    FEDSHARD_EXPECTS(!(zeroth_order_on() && soup_on()),
                     "sim: a trainer runs one local rule, found both zeroth-order units and a "
                     "soup of ",
                     soup.members, " members");
  }
};

/// By unit of l: true for the zeroth-order units of r; invalid_argument naming a unit l does
/// not have (and l's units), or when l has fewer units than r's lower ones.
inline std::vector<bool> zeroth_order_mask(const flat_layout& l, const local_rule_desc& r) {
  std::vector<bool> out(l.num_units(), false);
  const auto lower = static_cast<std::size_t>(r.zeroth_order.lower);
  FEDSHARD_EXPECTS(lower <= l.num_units(), "sim: ", lower,
                   " lower units are to be zeroth-order, but the model has ", l.num_units());
  for (std::size_t u = 0; u < lower; ++u) out[u] = true;
  for (const auto& n : r.zeroth_order.units) {
    bool found = false;
    for (std::size_t u = 0; u < l.num_units(); ++u)
      if (l.unit(u).name == n) out[u] = found = true;
    if (found) continue;
    std::string names;
    for (std::size_t u = 0; u < l.num_units(); ++u)
      names += (u > 0 ? ", '" : "'") + l.unit(u).name + "'";
    FEDSHARD_EXPECTS(false, "sim: no unit named '", n, "' for a zeroth-order unit; the units are ",
                     names);
  }
  return out;
}

/// p without the backward gathers and gradient reductions of the units `free` marks (the
/// shard engine's plan of gradient-free units).
inline plan without_backward_of(plan p, const std::vector<bool>& free) {
  return p.select([&](const comm_op& op) {
    const bool backward = (op.trigger == trigger::acquire && op.phase == phase::backward) ||
                          op.trigger == trigger::grads_ready;
    return !(backward && op.unit >= 0 && static_cast<std::size_t>(op.unit) < free.size() &&
             free[static_cast<std::size_t>(op.unit)]);
  });
}

/// Elementwise passes over the zeroth-order shard in a step of P probes, as
/// trainer/local_zeroth_order.hpp runs it: the copy saved (read, write: 2), each probe's
/// three perturbations (+eps z, -2 eps z, +eps z: 6), the two restores (4) and each probe's
/// update (2): 8 P + 6.
constexpr double zo_step_passes(int probes) noexcept {
  return 8.0 * probes + 6.0;
}

/// Elementwise passes over the master shard in a step of a soup of k members, as
/// trainer/local_soup.hpp runs it: the interpolation (k reads, 1 write), the regularisers'
/// gradient (the gradient read and written, the trained member, the anchor and the k - 1
/// others: k + 3), the trained member copied to master and back (4), the pool's average
/// (k + 1), and with the diversity and k >= 2 the distances (k (k - 1) / 2 pairs and the
/// anchor's, two reads each).
constexpr double soup_step_passes(int members, bool diversity) noexcept {
  const double m = members;
  return (m + 1) + (m + 3) + 4 + (m + 1) + (diversity && members >= 2 ? m * (m - 1) + 2 : 0.0);
}

/// The mean of soup_step_passes over a round of `round_steps` local steps (members joining
/// on s's schedule); over a round that never ends (round_steps 0), the full pool's.
inline double soup_mean_passes(const soup_pool_size& s, std::int64_t round_steps) {
  if (round_steps <= 0) return soup_step_passes(s.members, s.diversity);
  double sum = 0;
  for (std::int64_t j = 0; j < round_steps; ++j)
    sum += soup_step_passes(soup_members_at(s, j), s.diversity);
  return sum / static_cast<double>(round_steps);
}

/// f64 values of the soup's distance sum with k members: k (k - 1) / 2 + 1
/// (optim::soup_pool::distance_count).
constexpr std::int64_t soup_distance_count(int members) noexcept {
  return std::int64_t{members} * (members - 1) / 2 + 1;
}

/// The ops a step's local rule runs beyond the step plan `step` (already without the
/// zeroth-order units' backward) on mesh `shape` with `shards` layout shards, in order: for
/// zeroth-order units, 2P times the step plan's forward acquire ops and a group mean of one
/// f64 (on a group of one rank too); for a soup with diversity and two members or more, the
/// distances' sum over the shard axis (none over one shard, as the trainer skips it): at
/// local step `round_step` of the round when given, else the full pool's (an upper bound of
/// its bytes for the steps before it fills).
inline plan local_step_ops(const plan& step, const mesh_shape& shape, int shards,
                           const local_rule_desc& r, std::int64_t round_step = -1) {
  plan out;
  if (r.zeroth_order_on()) {
    const int group = shape.replicas * shape.shards;
    for (int e = 0; e < 2 * r.zeroth_order.probes; ++e) {
      for (const comm_op& op : step.ops)
        if (op.trigger == trigger::acquire && op.phase == phase::forward) out.ops.push_back(op);
      out.ops.push_back(group_mean_op(group));  // the trainer runs it on one rank too
    }
  }
  const int members = round_step >= 0 ? soup_members_at(r.soup, round_step) : r.soup.members;
  if (r.soup_on() && r.soup.diversity && members >= 2 && shards > 1)
    out.ops.push_back(shard_sum_op(shards, soup_distance_count(members)));
  return out;
}

/// The ops the rank at `coords` of mesh `shape` runs to exchange the groups' zeroth-order
/// records at an applied sync (see the file comment): for each group's record count (one
/// f64), then its K P records of zo_record_bytes (3 f64 words each), the federation
/// all_gather on the group's rank 0 and the group broadcast.
inline plan zo_records_ops(const mesh_shape& shape, const mesh_coords& coords, std::int64_t steps,
                           int probes) {
  plan out;
  const int group = shape.replicas * shape.shards;
  const bool first = coords.replica == 0 && coords.shard == 0;
  for (const std::int64_t n : {std::int64_t{1}, steps * probes * (zo_record_bytes / 8)}) {
    if (first) out.ops.push_back(federation_gather_op(shape.groups, n));
    if (group > 1) out.ops.push_back(group_broadcast_op(group, shape.groups * n));
  }
  return out;
}

/// Elementwise passes over the zeroth-order shard at an applied sync whose groups' records
/// cover K steps of P probes (see the file comment): 2 G K P + 6.
constexpr double zo_sync_passes(int groups, std::int64_t steps, int probes) noexcept {
  return 2.0 * groups * static_cast<double>(steps) * probes + 6.0;
}

/// What a local rule adds to one rank's memory, in bytes (f32 buffers).
struct local_memory {
  /// The full gradient buffers the zeroth-order units do without: each unit whose plain step
  /// plan reduces its gradient out of a full buffer (an op reads role grad into another
  /// role) loses its padded unit of f32.
  double gradient_saved = 0;
  /// The zeroth-order units' shards saved by each step (their values put back), and with
  /// seeds on the wire their anchor (their values at the previous sync): 1 or 2 copies of
  /// shard_numel f32 per unit (the shard's padding included).
  double zeroth_order_copy = 0;
  /// The soup's pool: (M + 1) x the master shard.
  double soup_pool = 0;

  /// Bytes added (negative: saved).
  double added() const noexcept { return zeroth_order_copy + soup_pool - gradient_saved; }
};

/// The memory rule r adds to a rank of layout l whose plain step plan is `step` (every unit
/// held).
inline local_memory local_memory_of(const flat_layout& l, const plan& step,
                                    const local_rule_desc& r) {
  local_memory out;
  if (r.zeroth_order_on()) {
    const std::vector<bool> zo = zeroth_order_mask(l, r);
    std::vector<bool> own_grad(l.num_units(), false);
    for (const comm_op& op : step.ops)
      if (op.unit >= 0 && op.in.role == role::grad && op.out.role != role::grad)
        own_grad[static_cast<std::size_t>(op.unit)] = true;
    for (std::size_t u = 0; u < l.num_units(); ++u) {
      if (!zo[u]) continue;
      const double copies = r.zeroth_order.seeds_on_wire ? 2.0 : 1.0;
      out.zeroth_order_copy += copies * 4.0 * static_cast<double>(l.unit(u).shard_numel);
      if (own_grad[u]) out.gradient_saved += 4.0 * static_cast<double>(l.unit(u).padded_numel);
    }
  }
  if (r.soup_on())
    out.soup_pool = (r.soup.members + 1) * 4.0 * static_cast<double>(l.total_shard_numel());
  return out;
}

/// The zeroth-order units' share of the model's elements (the compute split's).
inline double zeroth_order_share(const flat_layout& l, const local_rule_desc& r) {
  if (!r.zeroth_order_on()) return 0.0;
  const std::vector<bool> zo = zeroth_order_mask(l, r);
  double all = 0, free = 0;
  for (std::size_t u = 0; u < l.num_units(); ++u) {
    all += static_cast<double>(l.unit(u).numel);
    if (zo[u]) free += static_cast<double>(l.unit(u).numel);
  }
  return all > 0 ? free / all : 0.0;
}

/// The zeroth-order units' elements in one rank's shards (Z).
inline double zeroth_order_shard_elements(const flat_layout& l, const local_rule_desc& r) {
  if (!r.zeroth_order_on()) return 0.0;
  const std::vector<bool> zo = zeroth_order_mask(l, r);
  double z = 0;
  for (std::size_t u = 0; u < l.num_units(); ++u)
    if (zo[u]) z += static_cast<double>(l.unit(u).shard_numel);
  return z;
}

}  // namespace fedshard::sim
