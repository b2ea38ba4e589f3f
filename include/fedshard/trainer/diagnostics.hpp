#pragma once
/// The trainer's designed diagnostics: what a user who put the wrong kind of type where an
/// algorithm belongs reads, and the catalogue's aliases printed in the compiler's note.
///
/// The lists are generated from for_each_algorithm at compile time (catalogue_text), never
/// typed: a static_assert's message must be a literal in C++20, so the list travels as the
/// template argument of a check that is false, which the compiler prints in full.

#include <cstddef>
#include <string_view>

#include "fedshard/federation/federation_policy.hpp"
#include "fedshard/schedule/sync_schedule.hpp"
#include "fedshard/shard/shard_policy.hpp"
#include "fedshard/trainer/algorithm.hpp"

namespace fedshard::detail {

/// Characters of algorithm_list(", ") plus its terminating zero.
constexpr std::size_t catalogue_text_size() {
  std::size_t n = 0;
  for_each_algorithm([&]<class>(std::string_view name) { n += name.size() + 2; });
  return n - 1;  // one separator fewer than names, one '\0'
}

/// The catalogue's aliases, ", "-separated, as a constant of a structural type (so that it
/// can be a template argument, which diagnostics print).
struct catalogue_text {
  char text[catalogue_text_size()]{};
};

/// catalogue_text filled from for_each_algorithm. Dependent on A only so that it is computed
/// where a diagnostic fires, not where this header is read.
template <class A>
constexpr catalogue_text catalogue_text_for() {
  catalogue_text out{};
  std::size_t k = 0;
  for_each_algorithm([&]<class>(std::string_view name) {
    if (k != 0) {
      out.text[k++] = ',';
      out.text[k++] = ' ';
    }
    for (char c : name) out.text[k++] = c;
  });
  return out;
}

/// False for every list: the note of a failed check built on it reads
/// `choose_one_of<catalogue_text{"ddp, zero2, ..."}>::value evaluates to false`.
template <catalogue_text Names>
struct choose_one_of {
  static constexpr bool value = false;
};

/// The trainer's algorithm parameter: A itself when it models Algorithm.
template <class A>
struct trainer_algorithm {
  using type = A;
};

/// A that is not an Algorithm: a message for each kind of type a user may have put there
/// instead, and a stand-in algorithm so that the trainer's other declarations raise nothing
/// more.
template <class A>
requires(!Algorithm<A>) struct trainer_algorithm<A> {
  static constexpr bool shard = shard::ShardPolicy<A>;
  static constexpr bool federation = !shard && federation::FederationPolicy<A>;
  static constexpr bool schedule = !shard && !federation && schedule::SyncSchedule<A>;
  static_assert(!shard || choose_one_of<catalogue_text_for<A>()>::value,
                "fedshard::trainer<Model, A, Optimizer, Communicator>: A is a shard policy, but "
                "the trainer takes an algorithm (a shard policy, a federation policy and a sync "
                "schedule). Write fedshard::algorithm<A, federation::none, schedule::every_step> "
                "to shard without federating, or name one of the catalogue's aliases (the note "
                "below lists them)");
  static_assert(!federation || choose_one_of<catalogue_text_for<A>()>::value,
                "fedshard::trainer<Model, A, Optimizer, Communicator>: A is a federation "
                "policy, but the trainer takes an algorithm (a shard policy, a federation "
                "policy and a sync schedule). Write fedshard::algorithm<shard::full_shard, A, "
                "schedule::periodic> (or another shard policy and schedule), or name one of the "
                "catalogue's aliases (the note below lists them)");
  static_assert(!schedule || choose_one_of<catalogue_text_for<A>()>::value,
                "fedshard::trainer<Model, A, Optimizer, Communicator>: A is a sync schedule, "
                "but the trainer takes an algorithm (a shard policy, a federation policy and a "
                "sync schedule). Write fedshard::algorithm<ShardPolicy, FederationPolicy, A>, "
                "or name one of the catalogue's aliases (the note below lists them)");
  static_assert(shard || federation || schedule || choose_one_of<catalogue_text_for<A>()>::value,
                "fedshard::trainer<Model, A, Optimizer, Communicator>: A is not an algorithm: "
                "it must name shard_policy, federation_policy and sync_schedule, each modelling "
                "its concept, and default_schedule() (fedshard::algorithm<...> does). Name one "
                "of the catalogue's aliases (the note below lists them) or write "
                "fedshard::algorithm<ShardPolicy, FederationPolicy, SyncSchedule>");
  using type = ddp;
};

}  // namespace fedshard::detail
