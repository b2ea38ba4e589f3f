#pragma once
/// The policy triple and the named algorithms built from it.
///
///   algorithm<ShardPolicy, FederationPolicy, SyncSchedule[, Defaults]>
///
/// ShardPolicy acts inside a group every step, FederationPolicy combines the groups at sync
/// points, SyncSchedule says when (and which fragment). Structure is in the types; numbers
/// (K, H, fragments, delay, mixing, learning rates) are run-time settings of
/// trainer_options, starting from the algorithm's defaults. DDP, FSDP, HSDP, FL+FSDP,
/// FL+HSDP and DiLoCo are aliases, not new code.

#include <concepts>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "fedshard/codec/int8_block.hpp"
#include "fedshard/codec/topk.hpp"
#include "fedshard/federation/average.hpp"
#include "fedshard/federation/element_average.hpp"
#include "fedshard/federation/federation_policy.hpp"
#include "fedshard/federation/gossip.hpp"
#include "fedshard/federation/holder_average.hpp"
#include "fedshard/federation/none.hpp"
#include "fedshard/federation/outer_optimizer.hpp"
#include "fedshard/federation/outer_rules.hpp"
#include "fedshard/federation/weighted_average.hpp"
#include "fedshard/federation/with_codec.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/schedule/every_step.hpp"
#include "fedshard/schedule/periodic.hpp"
#include "fedshard/schedule/post_local.hpp"
#include "fedshard/schedule/streaming.hpp"
#include "fedshard/schedule/sync_schedule.hpp"
#include "fedshard/schedule/token_budget.hpp"
#include "fedshard/schedule/wall_clock.hpp"
#include "fedshard/shard/full_shard.hpp"
#include "fedshard/shard/hybrid_shard.hpp"
#include "fedshard/shard/replicate.hpp"
#include "fedshard/shard/shard_grad_op.hpp"
#include "fedshard/shard/shard_policy.hpp"
#include "fedshard/shard/sparse.hpp"
#include "fedshard/shard/with_gather_codec.hpp"
#include "fedshard/trainer/local_element_mask.hpp"
#include "fedshard/trainer/local_rule.hpp"
#include "fedshard/trainer/local_soup.hpp"
#include "fedshard/trainer/local_zeroth_order.hpp"

namespace fedshard {

/// An algorithm's default schedule settings: `defaults<schedule::periodic::config{.period =
/// 8}>` makes trainer_options start from K = 8.
template <auto Schedule>
struct defaults {
  static constexpr auto schedule = Schedule;
};

/// Defaults that are the schedule config's own.
struct no_defaults {};

/// A training algorithm: how a group shards (Shard), how groups combine (Federation), when
/// (Schedule), and the schedule settings a trainer starts from (Defaults: defaults<config>
/// or no_defaults).
template <class Shard, class Federation, class Schedule, class Defaults = no_defaults>
struct algorithm {
  static_assert(shard::ShardPolicy<Shard>,
                "fedshard::algorithm: the first parameter must model ShardPolicy (the "
                "shard_policy of an alias of fedshard::for_each_algorithm, or your own)");
  static_assert(federation::FederationPolicy<Federation>,
                "fedshard::algorithm: the second parameter must model FederationPolicy (the "
                "federation_policy of an alias of fedshard::for_each_algorithm, or your own)");
  static_assert(schedule::SyncSchedule<Schedule>,
                "fedshard::algorithm: the third parameter must model SyncSchedule (the "
                "sync_schedule of an alias of fedshard::for_each_algorithm, "
                "schedule::post_local, token_budget, wall_clock, or your own)");
  static_assert(Federation::syncs || std::is_same_v<Schedule, schedule::every_step>,
                "fedshard::algorithm: federation::none never syncs, so this schedule would "
                "have nothing to schedule; use schedule::every_step with federation::none (as the "
                "aliases of fedshard::for_each_algorithm that do not federate do), or a "
                "federation policy that syncs");
  static_assert(
      std::is_same_v<Defaults, no_defaults> ||
          requires {
            { Defaults::schedule } -> std::convertible_to<typename Schedule::config>;
          },
      "fedshard::algorithm: the fourth parameter must be no_defaults or "
      "defaults<S::config{...}> with the third parameter's config type");

  using shard_policy = Shard;
  using federation_policy = Federation;
  using sync_schedule = Schedule;

  /// The schedule settings trainer_options starts from.
  static constexpr typename Schedule::config default_schedule() {
    if constexpr (std::is_same_v<Defaults, no_defaults>)
      return typename Schedule::config{};
    else
      return Defaults::schedule;
  }
  /// The axis trainer_options::context_axis starts from: Defaults::context_axis where the
  /// defaults name one (fcp: the group's), else none (no context parallelism).
  static constexpr std::optional<axis> default_context_axis() {
    if constexpr (requires {
                    { Defaults::context_axis } -> std::convertible_to<std::optional<axis>>;
                  })
      return Defaults::context_axis;
    else
      return std::nullopt;
  }
  /// The local rule trainer_options starts from: Defaults::local_rule() where the defaults
  /// name one (hofl, lss), else none (the plain step).
  static local_rule_factory default_local_rule() {
    if constexpr (requires {
                    { Defaults::local_rule() } -> std::convertible_to<local_rule_factory>;
                  })
      return Defaults::local_rule();
    else
      return {};
  }
  /// The federation settings trainer_options starts from: Defaults::federation() where the
  /// defaults name them (feast, collate: their masks), else the config's default.
  static typename Federation::config default_federation() {
    if constexpr (requires {
                    { Defaults::federation() } -> std::convertible_to<typename Federation::config>;
                  })
      return Defaults::federation();
    else
      return typename Federation::config{};
  }
};

/// What trainer needs of its Algorithm parameter: the three policy types, each modelling its
/// concept, and default schedule settings (algorithm<...> models it).
template <class A>
concept Algorithm = requires {
  typename A::shard_policy;
  typename A::federation_policy;
  typename A::sync_schedule;
  { A::default_schedule() } -> std::convertible_to<typename A::sync_schedule::config>;
}
&&shard::ShardPolicy<typename A::shard_policy>&& federation::FederationPolicy<
    typename A::federation_policy>&& schedule::SyncSchedule<typename A::sync_schedule>;

/// DDP: replicated parameters, gradient all_reduce.
using ddp = algorithm<shard::replicate, federation::none, schedule::every_step>;
/// ZeRO-2: gather once per step, reduce_scatter gradients, sharded optimizer state.
using zero2 = algorithm<shard::shard_grad_op, federation::none, schedule::every_step>;
/// FSDP FULL_SHARD.
using fsdp = algorithm<shard::full_shard, federation::none, schedule::every_step>;
/// HSDP: FSDP over S, gradient all_reduce over R.
using hsdp = algorithm<shard::hybrid_shard, federation::none, schedule::every_step>;
/// FL+FSDP: FSDP inside each group, parameters averaged across groups every K steps (K = 8
/// unless trainer_options::schedule says otherwise).
using fl_fsdp = algorithm<shard::full_shard, federation::average, schedule::periodic,
                          defaults<schedule::periodic::config{.period = 8}>>;
/// FL+HSDP: HSDP inside each group, parameters averaged across groups every K steps (K = 8
/// unless told otherwise).
using fl_hsdp = algorithm<shard::hybrid_shard, federation::average, schedule::periodic,
                          defaults<schedule::periodic::config{.period = 8}>>;
/// DiLoCo: H inner steps (H = 500 unless told otherwise), then an outer Nesterov step on the
/// mean pseudo-gradient. Inside a worker it runs HSDP (FSDP when R = 1).
using diloco = algorithm<shard::hybrid_shard, federation::outer_optimizer<federation::nesterov>,
                         schedule::periodic, defaults<schedule::periodic::config{.period = 500}>>;
/// FoMoE (arXiv 2606.19025): HSDP inside each group; every K steps (8 unless told otherwise)
/// each unit is averaged over the groups that hold it: dense units everywhere, each expert
/// only over the groups it is placed on (trainer_options::federation.owners; unheld units
/// are not allocated).
using fomoe = algorithm<shard::hybrid_shard, federation::holder_average, schedule::periodic,
                        defaults<schedule::periodic::config{.period = 8}>>;
/// Streaming DiLoCo: fragments synced at their own offsets, with delay and mixing (the
/// streaming schedule's defaults: H = 100, 2 fragments, no delay, α = 1).
using streaming_diloco =
    algorithm<shard::hybrid_shard, federation::outer_optimizer<federation::nesterov>,
              schedule::streaming>;

/// SparseLoCo (arXiv 2508.15706): H inner steps (H = 30 unless told otherwise), then each
/// group's pseudo-gradient goes through an error-feedback top-64-of-4096, 2-bit codec
/// (codec::topk, β = 0.95; chunk, k, bits and β in trainer_options::federation.codec); the
/// decoded mean drives an outer SGD step with lr 1.
using sparseloco = algorithm<
    shard::hybrid_shard,
    federation::with_codec<federation::outer_optimizer<federation::outer_sgd>, codec::topk>,
    schedule::periodic, defaults<schedule::periodic::config{.period = 30}>>;
/// GASLoC (arXiv 2606.11081): H inner steps (H = 500 unless told otherwise, as diloco),
/// then each group exchanges its pseudo-gradient with one random peer (federation::gossip:
/// degree, α, seed and the outer Nesterov step's lr and γ in its config), mixes and takes
/// the outer step on its own anchor. Inside a worker it runs HSDP.
using gasloc = algorithm<shard::hybrid_shard, federation::gossip, schedule::periodic,
                         defaults<schedule::periodic::config{.period = 500}>>;
/// FL+HSDP whose parameter gathers travel as int8 with one scale per 256 values (ZeRO++'s
/// qwZ; the block size in trainer_options::shard.codec): about 4x fewer gather bytes inside
/// a group; K = 8 unless told otherwise.
using fl_hsdp_int8 =
    algorithm<shard::with_gather_codec<shard::hybrid_shard, codec::int8_block>, federation::average,
              schedule::periodic, defaults<schedule::periodic::config{.period = 8}>>;

/// SCAPE (arXiv 2607.01678): FSDP whose reduce_scatters carry only the elements of a mask
/// agreed from the optimizer's first moments (shard::sparse; density, refresh period and
/// dense warm-up in trainer_options::shard); its gathers are FSDP's (no gathered copy is kept
/// between steps). Host memory only. Its steps run different
/// plans by its settings, so the simulator prices a run of it (sim::price_sparse), not a step.
using scape_fsdp =
    algorithm<shard::sparse<shard::full_shard>, federation::none, schedule::every_step>;
/// SCAPE inside each group of FL+FSDP: parameters averaged across groups every K steps (K = 8
/// unless told otherwise).
using fl_scape_fsdp =
    algorithm<shard::sparse<shard::full_shard>, federation::average, schedule::periodic,
              defaults<schedule::periodic::config{.period = 8}>>;

/// HO-FL's defaults: K = 8, and the model's two lowest units (charlm: the embedding and the
/// first hidden layer) trained zeroth-order, one probe per step, their updates crossing the
/// federation link as seeds (zo_sync::records).
struct hofl_defaults {
  static constexpr schedule::periodic::config schedule{.period = 8};
  static local_rule_factory local_rule() {
    return zeroth_order_lower_rule({.eps = 1e-3f, .probes = 1, .seed = 0}, 2);
  }
};
/// HO-FL (arXiv 2609.39074): HSDP inside each group with the lower units trained
/// zeroth-order (forward only: no gradient buffers, no backward gathers; their updates sent
/// as 24-byte records, trainer/local_zeroth_order.hpp) and the upper ones by backprop;
/// token-weighted averaging every K steps; clients sampled per sync through
/// trainer_options::participation (default: every group).
using hofl =
    algorithm<shard::hybrid_shard, federation::weighted_average, schedule::periodic, hofl_defaults>;

/// Local Superior Soups' defaults: K = 8, a soup of 3 members per round (member 0 trains 4
/// local steps alone, the second joins then, the third 2 steps later), the regularisers'
/// coefficients soup_config's (optim/soup.hpp).
struct lss_defaults {
  static constexpr schedule::periodic::config schedule{.period = 8};
  static local_rule_factory local_rule() {
    return local_soup_rule({.pool_size = 3, .first_steps = 4, .add_every = 2});
  }
};
/// Local Superior Soups (LSS, arXiv 2410.23660): HSDP inside each group, each group training
/// a pool of models by random interpolation (trainer/local_soup.hpp), their average
/// token-weighted every K steps.
using lss =
    algorithm<shard::hybrid_shard, federation::weighted_average, schedule::periodic, lss_defaults>;

/// FCP's defaults: K = 8, and context parallelism over each group's ranks.
struct fcp_defaults {
  static constexpr schedule::periodic::config schedule{.period = 8};
  static constexpr std::optional<axis> context_axis = axis::group;
};
/// FCP (arXiv 2602.21788) inside FL+HSDP: every rank of a group is given the same batch of
/// sequences, and a model that computes attention over blocks (step_context::context_axis
/// says over which axis) spreads it over the group's ranks by FCP's placement, exchanging
/// key/value blocks point to point (plan/context_plan.hpp; examples/charlm/attention_model.hpp);
/// parameters averaged across groups every K steps, as fl_hsdp.
using fcp = algorithm<shard::hybrid_shard, federation::average, schedule::periodic, fcp_defaults>;

/// FEAST's masks: group g of G has capability (G - g) / G (G = 2: {1, 0.5}) and holds the
/// first ceil(capability x rows) rows of every tensor (shard::feast_slices), every round.
inline shard::element_ownership feast_masks(const flat_layout& layout, int groups, std::int64_t) {
  std::vector<double> capability;
  for (int g = 0; g < groups; ++g)
    capability.push_back(static_cast<double>(groups - g) / static_cast<double>(groups));
  return shard::feast_slices(layout, capability);
}
/// FEAST's defaults: K = 8, feast_masks (fixed), token-weighted averages, and the held rows
/// stepped by a packed AdamW without weight decay (an element a group does not hold keeps
/// its global value).
struct feast_defaults {
  static constexpr schedule::periodic::config schedule{.period = 8};
  static federation::element_average::config federation() {
    return {.masks = feast_masks, .fixed = true, .weighted = true};
  }
  static local_rule_factory local_rule() {
    return element_mask_rule<optim::adamw>(feast_masks, {.weight_decay = 0});
  }
};
/// FEAST: HSDP inside each group; group g trains the width slice its capability affords
/// (the first rows of every tensor, feast_masks), each element averaged every K steps over
/// the groups that hold it (federation/element_average.hpp, trainer/local_element_mask.hpp).
using feast =
    algorithm<shard::hybrid_shard, federation::element_average, schedule::periodic, feast_defaults>;

/// Collate's masks: in each round each group holds each block of 32 consecutive elements of
/// a unit with probability 0.5, seed 0 (shard::collate_masks: the same on every rank).
inline shard::element_ownership collate_round_masks(const flat_layout& layout, int groups,
                                                    std::int64_t round) {
  return shard::collate_masks(layout, {.groups = groups, .fraction = 0.5, .seed = 0, .block = 32},
                              round);
}
/// Collate's defaults: as feast's with collate_round_masks, which change every round.
struct collate_defaults {
  static constexpr schedule::periodic::config schedule{.period = 8};
  static federation::element_average::config federation() {
    return {.masks = collate_round_masks, .fixed = false, .weighted = true};
  }
  static local_rule_factory local_rule() {
    return element_mask_rule<optim::adamw>(collate_round_masks, {.weight_decay = 0});
  }
};
/// Collate: HSDP inside each group; each round every group trains a fresh random half of
/// the model's blocks (collate_round_masks), each element averaged every K steps over the
/// groups that held it; an element nobody held keeps its value.
using collate = algorithm<shard::hybrid_shard, federation::element_average, schedule::periodic,
                          collate_defaults>;

/// The catalogue: calls `f.template operator()<A>(name)` for every named algorithm above (every
/// number in them a run-time setting of trainer_options, from the alias's default), in the
/// order ddp, zero2, fsdp, hsdp, fl_fsdp, fl_hsdp, fl_hsdp_int8, diloco, streaming_diloco,
/// sparseloco, gasloc, fomoe, scape_fsdp, fl_scape_fsdp, hofl, lss, fcp, feast, collate. It is the
/// one list that tools (the simulator's names, the demo's rows, the lists in their messages) read,
/// so a new alias is added here once.
template <class F>
constexpr void for_each_algorithm(F&& f) {
  f.template operator()<ddp>(std::string_view("ddp"));
  f.template operator()<zero2>(std::string_view("zero2"));
  f.template operator()<fsdp>(std::string_view("fsdp"));
  f.template operator()<hsdp>(std::string_view("hsdp"));
  f.template operator()<fl_fsdp>(std::string_view("fl_fsdp"));
  f.template operator()<fl_hsdp>(std::string_view("fl_hsdp"));
  f.template operator()<fl_hsdp_int8>(std::string_view("fl_hsdp_int8"));
  f.template operator()<diloco>(std::string_view("diloco"));
  f.template operator()<streaming_diloco>(std::string_view("streaming_diloco"));
  f.template operator()<sparseloco>(std::string_view("sparseloco"));
  f.template operator()<gasloc>(std::string_view("gasloc"));
  f.template operator()<fomoe>(std::string_view("fomoe"));
  f.template operator()<scape_fsdp>(std::string_view("scape_fsdp"));
  f.template operator()<fl_scape_fsdp>(std::string_view("fl_scape_fsdp"));
  f.template operator()<hofl>(std::string_view("hofl"));
  f.template operator()<lss>(std::string_view("lss"));
  f.template operator()<fcp>(std::string_view("fcp"));
  f.template operator()<feast>(std::string_view("feast"));
  f.template operator()<collate>(std::string_view("collate"));
}

/// The aliases of for_each_algorithm in its order, joined by `separator`: the list that
/// messages naming the known algorithms print.
inline std::string algorithm_list(std::string_view separator = ", ") {
  std::string out;
  for_each_algorithm([&]<class A>(std::string_view name) {
    if (!out.empty()) out += separator;
    out += name;
  });
  return out;
}

/// True when `name` is an alias of for_each_algorithm.
inline bool is_algorithm_name(std::string_view name) {
  bool found = false;
  for_each_algorithm([&]<class A>(std::string_view alias) { found = found || alias == name; });
  return found;
}

}  // namespace fedshard
