// The catalogue's element-mask aliases as a user gets them, with nothing set but the run's
// length: feast (HSDP, element_average, K = 8, group g of G holds the first (G - g) / G of
// every tensor's rows, fixed, token-weighted; AdamW on the held elements) and collate (the
// same with a random half of the 32-element blocks per group per round). tiny_mlp on
// 2 groups x 1 replica x 2 shards, 24 steps (syncs after steps 7, 15 and 23). After each sync
// every rank holds the same model; an element no group held in a round is the value of the
// sync before; feast's group 1 (capability 0.5) never changes a row beyond its half between
// syncs. The inner optimizer holds nothing (the rule owns its AdamW, with state for the held
// elements only), and a checkpoint taken mid-run resumes collate bit for bit.

#include <doctest/doctest.h>

#include <cstddef>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/files.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

namespace {

using namespace fedshard;
using test::mlp_model;

constexpr int kSteps = 24, kPeriod = 8;

struct rank_run {
  int group = 0;
  std::string rule;
  bool fixed = false, weighted = false;
  std::vector<std::vector<float>> after;  // after[k]: the whole model after k steps
  std::size_t inner = 0, held = 0;        // the inner optimizer's elements, the rule's
  std::vector<std::size_t> rule_state;    // the sizes of the rule's AdamW state buffers
};

template <class A>
std::vector<rank_run> run() {
  return test::collect_ranks(4, [&](inproc::communicator& world) {
    mesh m(world, {2, 1, 2});
    trainer_options<A> o;  // the alias's defaults: masks and local rule included
    o.total_steps = kSteps;
    o.log = [](const std::string&) {};
    rank_run r;
    r.fixed = o.federation.fixed;
    r.weighted = o.federation.weighted;
    trainer<mlp_model, A, optim::adamw, inproc::communicator> t(m, mlp_model{}, {.lr = 2e-2f}, o);
    const auto c = t.topology().coords();
    r.group = c.group;
    REQUIRE(t.local() != nullptr);
    r.rule = std::string(t.local()->name());
    r.inner = t.optimizer().size();
    r.after.push_back(t.parameters());
    for (int s = 0; s < kSteps; ++s) {
      t.step(t.model().batch(7, s, c.group, 2, c.shard, 2, 4));
      r.after.push_back(t.parameters());
    }
    const auto* rule = dynamic_cast<const local_element_mask<optim::adamw>*>(t.local());
    REQUIRE(rule != nullptr);
    auto& packed = const_cast<local_element_mask<optim::adamw>*>(rule)->optimizer();
    r.held = packed.size();
    for (const auto& st : packed.state()) r.rule_state.push_back(st.data.size());
    return r;
  });
}

/// After each sync every rank holds rank 0's model.
void check_one_model_after_syncs(const std::vector<rank_run>& runs) {
  for (int k = kPeriod; k <= kSteps; k += kPeriod)
    for (const rank_run& r : runs) {
      CAPTURE(k);
      CHECK(r.after[static_cast<std::size_t>(k)] == runs[0].after[static_cast<std::size_t>(k)]);
    }
}

// tiny_mlp (d 8, h 16, o 4), units back to back in parameters(): layer0 = w0 [16, 8] at 0,
// b0 [16] at 128; layer1 = w1 [16, 16] at 144, b1 [16] at 400; head = w2 [4, 16] at 416,
// b2 [4] at 480; 484 in all. Half the rows (ceil): w0 rows 0..7 = [0, 64), b0 [128, 136),
// w1 rows 0..7 = [144, 272), b1 [400, 408), w2 rows 0..1 = [416, 448), b2 [480, 482).
bool in_half(std::size_t i) {
  return i < 64 || (i >= 128 && i < 136) || (i >= 144 && i < 272) || (i >= 400 && i < 408) ||
         (i >= 416 && i < 448) || (i >= 480 && i < 482);
}

}  // namespace

TEST_CASE("feast: group 1 trains its half of every tensor's rows; one model after each sync") {
  const auto runs = run<feast>();
  REQUIRE(runs.size() == 4);
  for (const rank_run& r : runs) {
    CHECK(r.rule == "element_mask");
    CHECK(r.fixed);
    CHECK(r.weighted);
    REQUIRE(r.after.size() == kSteps + 1);
    REQUIRE(r.after[0].size() == 484);
  }
  check_one_model_after_syncs(runs);
  std::size_t half = 0;
  for (std::size_t i = 0; i < 484; ++i) half += in_half(i);
  CHECK(half == 242);
  int moved_inside = 0, moved_outside = 0;
  for (const rank_run& r : runs)
    for (int k = 1; k <= kSteps; ++k) {
      const auto& start = r.after[static_cast<std::size_t>((k - 1) / kPeriod * kPeriod)];
      const auto& now = r.after[static_cast<std::size_t>(k)];
      for (std::size_t i = 0; i < 484; ++i) {
        if (r.group == 1 && k % kPeriod != 0 && !in_half(i)) {
          CAPTURE(k);
          CAPTURE(i);
          CHECK(now[i] == start[i]);  // between syncs, beyond its rows: untouched
        }
        if (now[i] != start[i]) ++(in_half(i) ? moved_inside : moved_outside);
      }
    }
  CHECK(moved_inside > 0);
  CHECK(moved_outside > 0);  // group 0 trains every row, and the syncs carry them to group 1
  // Optimizer state: none in the inner optimizer; the rule's AdamW holds m and v for the held
  // elements: group 0's two shards hold all 484 together, group 1's half the rows, 242.
  std::size_t held[2] = {0, 0};
  for (const rank_run& r : runs) {
    CHECK(r.inner == 0);
    CHECK(r.rule_state == std::vector<std::size_t>{r.held, r.held});
    held[r.group] += r.held;
  }
  CHECK(held[0] == 484);
  CHECK(held[1] == 242);
}

TEST_CASE("collate: an element no group held keeps the previous sync's value") {
  const auto runs = run<collate>();
  REQUIRE(runs.size() == 4);
  for (const rank_run& r : runs) {
    CHECK(r.rule == "element_mask");
    CHECK_FALSE(r.fixed);
    CHECK(r.weighted);
    REQUIRE(r.after.size() == kSteps + 1);
  }
  check_one_model_after_syncs(runs);
  // The alias's masks: blocks of 32 of each unit, each held by a group with probability 0.5,
  // seed 0.
  const flat_layout l(mlp_model{}.units(), 1);
  const shard::collate_config c{.groups = 2, .fraction = 0.5, .seed = 0, .block = 32};
  const std::size_t base[] = {0, 144, 416};
  int nobody = 0, moved = 0;
  for (int round = 0; round < kSteps / kPeriod; ++round) {
    const auto o = shard::collate_masks(l, c, round);
    const auto& before = runs[0].after[static_cast<std::size_t>(round * kPeriod)];
    const auto& synced = runs[0].after[static_cast<std::size_t>((round + 1) * kPeriod)];
    for (std::size_t u = 0; u < 3; ++u)
      for (std::size_t e = 0; e < l.unit(u).numel; ++e) {
        const std::size_t i = base[u] + e;
        if (o.holds(0, u, e) || o.holds(1, u, e)) {
          moved += synced[i] != before[i];
          continue;
        }
        ++nobody;
        CAPTURE(round);
        CAPTURE(i);
        CHECK(synced[i] == before[i]);
      }
  }
  CHECK(nobody > 0);  // about a quarter of the blocks each round
  CHECK(moved > 0);
}

TEST_CASE("collate: a checkpoint mid-run resumes bit for bit (the rule's state, no inner state)") {
  // 24 steps straight against 12 steps, save, a new trainer, load, 12 steps: the masks change
  // each round, so the rule's held elements and packed AdamW state must come back.
  test::temp_dir dir("fedshard-collate");
  const auto trained = [&](bool resume) {
    return test::collect_ranks(4, [&](inproc::communicator& world) {
      mesh m(world, {2, 1, 2});
      trainer_options<collate> o;
      o.total_steps = kSteps;
      o.log = [](const std::string&) {};
      trainer<mlp_model, collate, optim::adamw, inproc::communicator> t(m, mlp_model{},
                                                                        {.lr = 2e-2f}, o);
      const auto c = t.topology().coords();
      int s = 0;
      if (resume) {
        t.load(dir.path);
        s = 12;
      }
      for (; s < kSteps; ++s) {
        t.step(t.model().batch(7, s, c.group, 2, c.shard, 2, 4));
        if (!resume && s == 11) t.save(dir.path);
      }
      return t.parameters();
    });
  };
  const auto straight = trained(false);
  const auto resumed = trained(true);
  REQUIRE(straight.size() == 4);
  for (std::size_t r = 0; r < 4; ++r) CHECK(resumed[r] == straight[r]);
}
