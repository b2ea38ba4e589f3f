#pragma once
/// Umbrella header: everything host-side a training program needs (the MPI communicator,
/// the CUDA/NCCL parts and the simulator have their own headers).

#include "fedshard/config.hpp"
#include "fedshard/error.hpp"
#include "fedshard/version.hpp"

#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"

#include "fedshard/comm/communicator.hpp"
#include "fedshard/comm/inproc.hpp"
#include "fedshard/comm/request.hpp"
#include "fedshard/comm/shaped.hpp"

#include "fedshard/mesh/axis.hpp"
#include "fedshard/mesh/mesh.hpp"

#include "fedshard/plan/comm_op.hpp"
#include "fedshard/plan/context_blocks.hpp"
#include "fedshard/plan/context_plan.hpp"
#include "fedshard/plan/interpreter.hpp"
#include "fedshard/plan/traffic.hpp"
#include "fedshard/plan/wire_tap.hpp"

#include "fedshard/shard/element_ownership.hpp"
#include "fedshard/shard/engine.hpp"
#include "fedshard/shard/flat_layout.hpp"
#include "fedshard/shard/full_shard.hpp"
#include "fedshard/shard/hybrid_shard.hpp"
#include "fedshard/shard/ownership.hpp"
#include "fedshard/shard/replicate.hpp"
#include "fedshard/shard/shard_grad_op.hpp"
#include "fedshard/shard/shard_policy.hpp"
#include "fedshard/shard/sparse.hpp"

#include "fedshard/optim/adamw.hpp"
#include "fedshard/optim/lr_schedule.hpp"
#include "fedshard/optim/optimizer.hpp"
#include "fedshard/optim/sgd.hpp"

#include "fedshard/federation/average.hpp"
#include "fedshard/federation/element_average.hpp"
#include "fedshard/federation/federation_policy.hpp"
#include "fedshard/federation/gossip.hpp"
#include "fedshard/federation/holder_average.hpp"
#include "fedshard/federation/none.hpp"
#include "fedshard/federation/outer_optimizer.hpp"
#include "fedshard/federation/outer_rules.hpp"
#include "fedshard/federation/overlap.hpp"
#include "fedshard/federation/robust_mean.hpp"
#include "fedshard/federation/sync.hpp"
#include "fedshard/federation/sync_plan.hpp"
#include "fedshard/federation/weighted_average.hpp"

#include "fedshard/schedule/every_step.hpp"
#include "fedshard/schedule/periodic.hpp"
#include "fedshard/schedule/post_local.hpp"
#include "fedshard/schedule/streaming.hpp"
#include "fedshard/schedule/sync_schedule.hpp"
#include "fedshard/schedule/token_budget.hpp"
#include "fedshard/schedule/wall_clock.hpp"

#include "fedshard/trainer/algorithm.hpp"
#include "fedshard/trainer/checkpoint.hpp"
#include "fedshard/trainer/model.hpp"
#include "fedshard/trainer/trainer.hpp"
