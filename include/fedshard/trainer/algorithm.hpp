#pragma once
/// The policy triple and the named algorithms built from it.
///
///   algorithm<ShardPolicy, FederationPolicy, SyncSchedule>
///
/// ShardPolicy acts inside a group every step, FederationPolicy combines the groups at sync
/// points, SyncSchedule says when (and which fragment). DDP, FSDP, HSDP, FL+FSDP, FL+HSDP and
/// DiLoCo are aliases, not new code.

#include <string_view>
#include <type_traits>

#include "fedshard/federation/average.hpp"
#include "fedshard/federation/federation_policy.hpp"
#include "fedshard/federation/none.hpp"
#include "fedshard/federation/outer_optimizer.hpp"
#include "fedshard/federation/outer_rules.hpp"
#include "fedshard/federation/weighted_average.hpp"
#include "fedshard/schedule/every_step.hpp"
#include "fedshard/schedule/periodic.hpp"
#include "fedshard/schedule/post_local.hpp"
#include "fedshard/schedule/streaming.hpp"
#include "fedshard/schedule/sync_schedule.hpp"
#include "fedshard/shard/full_shard.hpp"
#include "fedshard/shard/hybrid_shard.hpp"
#include "fedshard/shard/replicate.hpp"
#include "fedshard/shard/shard_grad_op.hpp"
#include "fedshard/shard/shard_policy.hpp"

namespace fedshard {

/// A training algorithm: how a group shards (Shard), how groups combine (Federation), and
/// when (Schedule).
template <class Shard, class Federation, class Schedule>
struct algorithm {
  static_assert(shard::ShardPolicy<Shard>,
                "fedshard::algorithm: the first parameter must model ShardPolicy "
                "(shard::replicate, shard_grad_op, full_shard, hybrid_shard or your own)");
  static_assert(federation::FederationPolicy<Federation>,
                "fedshard::algorithm: the second parameter must model FederationPolicy "
                "(federation::none, average, weighted_average, outer_optimizer<Rule>)");
  static_assert(schedule::SyncSchedule<Schedule>,
                "fedshard::algorithm: the third parameter must model SyncSchedule "
                "(schedule::every_step, periodic<K>, post_local, streaming)");
  static_assert(Federation::syncs || !std::is_same_v<Schedule, schedule::streaming>,
                "fedshard::algorithm: a streaming schedule syncs fragments, which needs a "
                "federation policy that communicates (not federation::none)");

  using shard_policy = Shard;
  using federation_policy = Federation;
  using sync_schedule = Schedule;
};

/// DDP: replicated parameters, gradient all_reduce.
using ddp = algorithm<shard::replicate, federation::none, schedule::every_step>;
/// ZeRO-2: gather once per step, reduce_scatter gradients, sharded optimizer state.
using zero2 = algorithm<shard::shard_grad_op, federation::none, schedule::every_step>;
/// FSDP FULL_SHARD.
using fsdp = algorithm<shard::full_shard, federation::none, schedule::every_step>;
/// HSDP: FSDP over S, gradient all_reduce over R.
using hsdp = algorithm<shard::hybrid_shard, federation::none, schedule::every_step>;
/// FL+FSDP: FSDP inside each group, parameters averaged across groups every K steps.
template <int K>
using fl_fsdp = algorithm<shard::full_shard, federation::average, schedule::periodic<K>>;
/// FL+HSDP: HSDP inside each group, parameters averaged across groups every K steps.
template <int K>
using fl_hsdp = algorithm<shard::hybrid_shard, federation::average, schedule::periodic<K>>;
/// DiLoCo: H inner steps, then an outer Nesterov step on the mean pseudo-gradient. Inside a
/// worker it runs HSDP (FSDP when R = 1).
template <int H>
using diloco = algorithm<shard::hybrid_shard, federation::outer_optimizer<federation::nesterov>,
                         schedule::periodic<H>>;
/// Streaming DiLoCo: fragments synced at their own offsets, with delay and mixing.
using streaming_diloco =
    algorithm<shard::hybrid_shard, federation::outer_optimizer<federation::nesterov>,
              schedule::streaming>;

}  // namespace fedshard
