// Local Superior Soups through the trainer's local rule (trainer/local_soup.hpp) on fl_fsdp,
// 2 groups of 2 shards (inproc): a pool of one member without regularisers is the plain step
// bit for bit; a pool of three with both regularisers trains (its diversity distances summed
// over the group's shards), gives every rank of the world the same model after a sync, and
// moves at the wire exactly the distance sums the plan adds (worked below); the soup's state
// is saved and loaded bit-exactly; bad settings are refused.

#include <doctest/doctest.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/federation/average.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/trainer/local_soup.hpp"
#include "fedshard/trainer/state_io.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/files.hpp"
#include "support/local_rule_settings.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

namespace {

using namespace fedshard;
using test::mlp_model;
namespace fs = std::filesystem;

using trainer_t = trainer<mlp_model, fl_fsdp, optim::adamw, inproc::communicator>;
const mesh_shape shape{2, 1, 2};  // 2 groups x 2 shards
constexpr std::uint64_t kData = 5;
/// A pool of three with both regularisers: member 1 joins after 1 local step, member 2 after 2.
const optim::soup_config cfg = test::soup_of_three;

/// Every rank's parameters, eval losses and bytes moved on the shard axis after a leg.
struct leg_result {
  std::vector<std::vector<float>> params;
  std::vector<double> first_eval, last_eval;
  std::vector<std::int64_t> shard_bytes;
};

/// Fresh trainers (with the soup `soup`, or the plain step): load(from) when given, train
/// steps [first, last) syncing every 3, save(to) when given.
leg_result leg(const std::optional<optim::soup_config>& soup, int first, int last,
               const fs::path& from = {}, const fs::path& to = {}) {
  const auto n = static_cast<std::size_t>(shape.size());
  leg_result out{std::vector<std::vector<float>>(n), std::vector<double>(n), std::vector<double>(n),
                 std::vector<std::int64_t>(n)};
  test::spawn_ranks(shape.size(), [&](inproc::communicator& world) {
    mesh m(world, shape);
    trainer_options<fl_fsdp> o;
    o.total_steps = 30;
    o.schedule.period = 3;
    o.log = [](const std::string&) {};
    if (soup) o.local_rule = local_soup_rule(*soup);
    trainer_t t(m, mlp_model{}, {.lr = 2e-2f}, o);
    if (!from.empty()) t.load(from);
    const auto c = t.topology().coords();
    auto batch = [&](int s) {
      return t.model().batch(kData, s, c.group, shape.groups, c.shard, shape.shards, 4);
    };
    const auto held = batch(1000);  // an evaluation batch no step trains on
    const auto r = static_cast<std::size_t>(world.rank());
    out.first_eval[r] = t.mean_over_world(t.evaluate(held));
    const auto before = t.traffic()[axis::shard].payload_bytes;
    for (int s = first; s < last; ++s) t.step(batch(s));
    out.shard_bytes[r] = t.traffic()[axis::shard].payload_bytes - before;
    out.last_eval[r] = t.mean_over_world(t.evaluate(held));
    if (!to.empty()) t.save(to);
    out.params[r] = t.parameters();
  });
  return out;
}

}  // namespace

TEST_CASE("local soup: one member without regularisers is the plain step, bit for bit") {
  const auto plain = leg(std::nullopt, 0, 9);
  const auto soup = leg(optim::soup_config{.pool_size = 1, .affinity = 0, .diversity = 0}, 0, 9);
  for (std::size_t r = 0; r < plain.params.size(); ++r) {
    CAPTURE(r);
    CHECK(test::bit_equal(soup.params[r], plain.params[r]));
  }
  // Without diversity no distances cross the shard axis: the same bytes as the plain run.
  CHECK(soup.shard_bytes == plain.shard_bytes);
}

TEST_CASE("local soup: a pool of three trains, and every rank holds the soup after a sync") {
  // 9 steps syncing every 3 (after steps 2, 5, 8): a round of 3 local steps, the second
  // member joining after 1 step and the third after 2 (first_steps 1, add_every 1).
  const auto plain = leg(std::nullopt, 0, 9);
  const auto soup = leg(cfg, 0, 9);
  for (std::size_t r = 0; r < soup.params.size(); ++r) {
    CAPTURE(r);
    CHECK(test::bit_equal(soup.params[r], soup.params[0]));  // one model after the last sync
    CHECK_FALSE(test::bit_equal(soup.params[r], plain.params[r]));
    CHECK(soup.last_eval[r] < 0.8 * soup.first_eval[r]);
  }
  // The distances summed over the 2 shards, per step with 2 or 3 members (steps 1 and 2 of
  // each round; a pool of one member has none): k (k - 1) / 2 + 1 doubles: 2 for k = 2,
  // 4 for k = 3, so (2 + 4) x 8 B = 48 B a round, 144 B over 3 rounds, on top of what the
  // plain run's shard axis carried (payload: the calls' array bytes).
  for (std::size_t r = 0; r < soup.params.size(); ++r) {
    CAPTURE(r);
    CHECK(soup.shard_bytes[r] - plain.shard_bytes[r] == 144);
  }
}

TEST_CASE("local soup: the soup's state is saved and loaded bit-exactly, mid-round") {
  test::temp_dir dir("fedshard-soup");
  const auto straight = leg(cfg, 0, 10);
  (void)leg(cfg, 0, 4, {}, dir.path);  // stops after step 3: round 1's first local step
  const auto resumed = leg(cfg, 4, 10, dir.path);
  for (std::size_t r = 0; r < straight.params.size(); ++r) {
    CAPTURE(r);
    CHECK(test::bit_equal(resumed.params[r], straight.params[r]));
  }
  const auto saved = checkpoint::saved_checkpoint::open(dir.path);
  for (const char* s : {"soup.member0", "soup.member2", "soup.anchor", "soup.round"})
    CHECK(saved.rank_file(0).has(s));
}

TEST_CASE("local soup: bad settings are refused with what was expected") {
  CHECK_THROWS_WITH_AS(local_soup_rule({.pool_size = 0}),
                       doctest::Contains("pool_size must be in [1, 16], found 0"),
                       fedshard::invalid_argument);
  CHECK_THROWS_WITH_AS(local_soup_rule({.diversity = -1.0f}),
                       doctest::Contains("diversity must be finite and >= 0, found -1"),
                       fedshard::invalid_argument);
}
