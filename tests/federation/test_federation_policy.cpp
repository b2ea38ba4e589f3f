// The FederationPolicy concept: the library's policies model it, incomplete types do not.
#include "fedshard/federation/federation_policy.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <span>
#include <string_view>
#include <vector>

#include "fedshard/federation/average.hpp"
#include "fedshard/federation/none.hpp"
#include "fedshard/federation/outer_optimizer.hpp"
#include "fedshard/federation/outer_rules.hpp"
#include "fedshard/federation/weighted_average.hpp"

using namespace fedshard;
using namespace fedshard::federation;

namespace {

/// Everything a policy needs; the broken variants below each lose one piece.
struct complete {
  struct config {
    sync_mode sync = sync_mode::reference;
  };
  static constexpr std::string_view name = "complete";
  static constexpr bool syncs = true;
  complete(config, std::vector<std::size_t>) {}
  void begin(int, std::span<float>, const sync_info&, space::host_space::stream&) {}
  void end(int, std::span<float>, const sync_info&, space::host_space::stream&) {}
  void reset(int, std::span<const float>, space::host_space::stream&) {}
  std::vector<optim::state_tensor> state() { return {}; }
  plan sync_plan(const sync_context&) const { return {}; }
};

struct no_reset {
  struct config {
    sync_mode sync{};
  };
  static constexpr std::string_view name = "no_reset";
  static constexpr bool syncs = true;
  no_reset(config, std::vector<std::size_t>) {}
  void begin(int, std::span<float>, const sync_info&, space::host_space::stream&) {}
  void end(int, std::span<float>, const sync_info&, space::host_space::stream&) {}
  std::vector<optim::state_tensor> state() { return {}; }
  plan sync_plan(const sync_context&) const { return {}; }
};

struct config_without_sync {
  struct config {
    int rounds = 0;
  };
  static constexpr std::string_view name = "config_without_sync";
  static constexpr bool syncs = true;
  config_without_sync(config, std::vector<std::size_t>) {}
  void begin(int, std::span<float>, const sync_info&, space::host_space::stream&) {}
  void end(int, std::span<float>, const sync_info&, space::host_space::stream&) {}
  void reset(int, std::span<const float>, space::host_space::stream&) {}
  std::vector<optim::state_tensor> state() { return {}; }
  plan sync_plan(const sync_context&) const { return {}; }
};

struct not_constructible_from_sizes {
  struct config {
    sync_mode sync{};
  };
  static constexpr std::string_view name = "x";
  static constexpr bool syncs = true;
  explicit not_constructible_from_sizes(config) {}
  void begin(int, std::span<float>, const sync_info&, space::host_space::stream&) {}
  void end(int, std::span<float>, const sync_info&, space::host_space::stream&) {}
  void reset(int, std::span<const float>, space::host_space::stream&) {}
  std::vector<optim::state_tensor> state() { return {}; }
  plan sync_plan(const sync_context&) const { return {}; }
};

struct begin_takes_const_buffer {
  struct config {
    sync_mode sync{};
  };
  static constexpr std::string_view name = "x";
  static constexpr bool syncs = true;
  begin_takes_const_buffer(config, std::vector<std::size_t>) {}
  void begin(int, std::span<const float>, sync_info&, space::host_space::stream&) {
  }  // needs a mutable sync_info
  void end(int, std::span<float>, const sync_info&, space::host_space::stream&) {}
  void reset(int, std::span<const float>, space::host_space::stream&) {}
  std::vector<optim::state_tensor> state() { return {}; }
  plan sync_plan(const sync_context&) const { return {}; }
};

struct sync_plan_not_const {
  struct config {
    sync_mode sync{};
  };
  static constexpr std::string_view name = "x";
  static constexpr bool syncs = true;
  sync_plan_not_const(config, std::vector<std::size_t>) {}
  void begin(int, std::span<float>, const sync_info&, space::host_space::stream&) {}
  void end(int, std::span<float>, const sync_info&, space::host_space::stream&) {}
  void reset(int, std::span<const float>, space::host_space::stream&) {}
  std::vector<optim::state_tensor> state() { return {}; }
  plan sync_plan(const sync_context&) { return {}; }
};

struct no_sync_plan {
  struct config {
    sync_mode sync{};
  };
  static constexpr std::string_view name = "x";
  static constexpr bool syncs = true;
  no_sync_plan(config, std::vector<std::size_t>) {}
  void begin(int, std::span<float>, const sync_info&, space::host_space::stream&) {}
  void end(int, std::span<float>, const sync_info&, space::host_space::stream&) {}
  void reset(int, std::span<const float>, space::host_space::stream&) {}
  std::vector<optim::state_tensor> state() { return {}; }
};

}  // namespace

TEST_CASE("the library's policies model FederationPolicy") {
  CHECK(FederationPolicy<none>);
  CHECK(FederationPolicy<average>);
  CHECK(FederationPolicy<weighted_average>);
  CHECK(FederationPolicy<outer_optimizer<outer_sgd>>);
  CHECK(FederationPolicy<outer_optimizer<nesterov>>);
  CHECK(FederationPolicy<outer_optimizer<fedmom>>);
  CHECK(FederationPolicy<outer_optimizer<fedadam>>);
  CHECK(FederationPolicy<outer_optimizer<fedyogi>>);
  CHECK(FederationPolicy<complete>);
}

TEST_CASE("types missing a requirement do not model FederationPolicy") {
  CHECK_FALSE(FederationPolicy<no_reset>);
  CHECK_FALSE(FederationPolicy<config_without_sync>);
  CHECK_FALSE(FederationPolicy<not_constructible_from_sizes>);
  CHECK_FALSE(FederationPolicy<begin_takes_const_buffer>);
  CHECK_FALSE(FederationPolicy<sync_plan_not_const>);
  CHECK_FALSE(FederationPolicy<no_sync_plan>);
}

TEST_CASE("sync modes and sync_info") {
  CHECK(to_string(sync_mode::hierarchical) == "hierarchical");
  CHECK(to_string(sync_mode::reference) == "reference");
  const sync_info info{};
  CHECK(info.fragment == 0);
  CHECK(info.groups == 1);
  CHECK(info.group == 0);
  CHECK(info.group_tokens.empty());  // no weights exchanged
  // every library policy's config defaults to the hierarchical sync
  CHECK(none::config{}.sync == sync_mode::hierarchical);
  CHECK(average::config{}.sync == sync_mode::hierarchical);
  CHECK(weighted_average::config{}.sync == sync_mode::hierarchical);
  CHECK(outer_optimizer<nesterov>::config{}.sync == sync_mode::hierarchical);
}
