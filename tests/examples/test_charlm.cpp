// The character-level LM of examples/charlm: its hand-written backward against finite
// differences, its data pipeline, and its use through the trainer.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "charlm/charlm.hpp"
#include "fedshard/comm/inproc.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/plan/wire_tap.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/plain_units.hpp"
#include "support/spawn_ranks.hpp"

namespace {

/// Unit hooks over plain full buffers (one rank, no sharding).
struct plain_hooks : fedshard::test::plain_units {
  using plain_units::plain_units;
  void zero_grads() {
    for (auto& x : g) std::fill(x.begin(), x.end(), 0.0f);
  }
};

std::string sample_text() {
  std::string t;
  for (int i = 0; i < 400; ++i)
    t += "the quick brown fox jumps over the lazy dog " + std::to_string(i % 7) + "\n";
  return t;
}

/// Trains charlm with dimensions d (seed 1) under algorithm A and AdamW (lr 0.01) on the
/// inproc ranks of shape: 30 steps of one 4-token sequence per rank, each step's batch drawn
/// for 8 ranks, after_step(trainer, rank) called after each. Every rank's eval loss (64
/// sequences) must end below 0.7 of where it began.
template <class A, class AfterStep>
void check_loss_drops(const charlm::corpus& data, fedshard::mesh_shape shape, charlm::dims d,
                      const fedshard::trainer_options<A>& o, AfterStep after_step) {
  std::vector<float> before(static_cast<std::size_t>(shape.size())), after(before.size());
  fedshard::test::spawn_ranks(shape.size(), [&](fedshard::inproc::communicator& w) {
    fedshard::mesh m(w, shape);
    fedshard::trainer<charlm::model, A, fedshard::optim::adamw, fedshard::inproc::communicator> t(
        m, charlm::model(d, 1), {.lr = 1e-2f}, o);
    const auto eval = charlm::model::eval_batch(data, 4, 64);
    const auto r = static_cast<std::size_t>(w.rank());
    before[r] = t.evaluate(eval);
    for (int s = 0; s < 30; ++s) {
      t.step(charlm::model::training_batch(data, 4, 1, s, w.rank(), 8));
      after_step(t, w.rank());
    }
    after[r] = t.evaluate(eval);
  });
  for (std::size_t r = 0; r < before.size(); ++r) CHECK(after[r] < 0.7f * before[r]);
}

}  // namespace

TEST_CASE("charlm gradients match central finite differences") {
  const auto data = charlm::corpus::from_text(sample_text());
  charlm::model m({data.vocab(), 4, 6, 12}, 3);
  plain_hooks h(m);
  const auto b = charlm::model::training_batch(data, 4, 5, 0, 0, 6);
  h.zero_grads();
  const float loss = m.forward_backward(h, b);
  CHECK(loss > 0);
  const auto analytic = h.g;
  int checked = 0;
  for (std::size_t u = 0; u < h.l.num_units(); ++u) {
    const auto& ul = h.l.unit(u);
    for (std::size_t k = 0; k < 12; ++k) {
      std::size_t i = (k * 7919 + u * 104729) % ul.numel;
      if (u == 0) {  // embedding rows of characters in the batch get non-zero gradients
        const std::size_t E = 6;
        i = static_cast<std::size_t>(b[k % b.size()].context[k % 4]) * E + k % E;
      }
      const float saved = h.p[u][i];
      const float eps = 1e-2f;
      h.p[u][i] = saved + eps;
      const double up = m.evaluate(h, b);
      h.p[u][i] = saved - eps;
      const double down = m.evaluate(h, b);
      h.p[u][i] = saved;
      const double numeric = (up - down) / (2.0 * eps);
      const double a = analytic[u][i];
      CHECK_MESSAGE(std::abs(numeric - a) <= 2e-2 * std::abs(numeric) + 2e-4, "unit ", ul.name,
                    " element ", i, ": analytic ", a, " numeric ", numeric);
      ++checked;
    }
  }
  CHECK(checked == 48);
  // padding never receives gradient
  for (std::size_t u = 0; u < h.l.num_units(); ++u)
    for (std::size_t i = h.l.unit(u).numel; i < h.l.unit(u).padded_numel; ++i)
      CHECK(analytic[u][i] == 0.0f);
}

TEST_CASE("charlm data: vocabulary, split by position, deterministic batches") {
  const auto data = charlm::corpus::from_text(sample_text());
  CHECK(data.train_end == data.ids.size() * 9 / 10);
  for (auto id : data.ids) CHECK(id < data.vocab());
  const auto a = charlm::model::training_batch(data, 4, 9, 3, 1, 10);
  const auto b = charlm::model::training_batch(data, 4, 9, 3, 1, 10);
  const auto c = charlm::model::training_batch(data, 4, 9, 3, 2, 10);
  REQUIRE(a.size() == 10);
  bool same = true, differs = false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    same = same && a[i].context == b[i].context && a[i].next == b[i].next;
    differs = differs || a[i].context != c[i].context;
  }
  CHECK(same);
  CHECK(differs);
  CHECK_THROWS_WITH_AS(charlm::corpus::from_text("too short"),
                       doctest::Contains("at least 1000 bytes, found 9"),
                       fedshard::invalid_argument);
  CHECK_THROWS_AS(charlm::corpus::load("/nonexistent/corpus.txt"), fedshard::invalid_argument);
}

TEST_CASE("charlm trains under fl_hsdp on 8 inproc ranks and its eval loss goes down") {
  const auto data = charlm::corpus::from_text(sample_text());
  check_loss_drops<fedshard::fl_hsdp>(data, {2, 2, 2}, {data.vocab(), 4, 8, 32},
                                      {.schedule = {.period = 4}}, [](auto&, int) {});
}

TEST_CASE(
    "charlm with a mixture of experts: units, placement, gradients match finite differences") {
  const auto data = charlm::corpus::from_text(sample_text());
  const charlm::dims d{.vocab = data.vocab(),
                       .context = 4,
                       .embed = 6,
                       .hidden = 12,
                       .experts = 4,
                       .expert_hidden = 10};
  charlm::model m(d, 3);
  // units: embed, hidden1, hidden2, router, expert0..3, head; the experts are marked
  const auto units = m.units();
  REQUIRE(units.size() == 9);
  CHECK(units[3].name == "router");
  CHECK(units[4].name == "expert0");
  CHECK(units[7].name == "expert3");
  CHECK(units[8].name == "head");
  CHECK(m.head_unit() == 8);
  for (std::size_t u = 0; u < units.size(); ++u)
    CHECK(m.expert_of(u) == (u >= 4 && u < 8 ? int(u) - 4 : -1));
  CHECK(m.placement(4) == std::vector<int>{-1, -1, -1, -1, 0, 1, 2, 3, -1});
  CHECK(m.placement(3) == std::vector<int>{-1, -1, -1, -1, 0, 1, 2, 0, -1});
  // without experts the model is the one of before, unit for unit
  charlm::model dense({data.vocab(), 4, 6, 12}, 3);
  CHECK(dense.units().size() == 4);
  CHECK(dense.head_unit() == 3);
  CHECK(dense.expert_of(3) == -1);
  CHECK(dense.placement(4) == std::vector<int>{-1, -1, -1, -1});

  plain_hooks h(m);
  const auto b = charlm::model::training_batch(data, 4, 5, 0, 0, 24);
  h.zero_grads();
  const float loss = m.forward_backward(h, b);
  CHECK(loss > 0);
  const auto routes = m.last_routes();
  REQUIRE(routes.size() == b.size());
  std::vector<int> per_expert(4, 0);
  for (int e : routes) ++per_expert[static_cast<std::size_t>(e)];
  CHECK(std::count_if(per_expert.begin(), per_expert.end(), [](int c) { return c > 0; }) >= 2);
  const auto analytic = h.g;
  int checked = 0, skipped = 0;
  for (std::size_t u = 1; u < h.l.num_units(); ++u) {  // the embedding is checked above
    const auto& ul = h.l.unit(u);
    for (std::size_t k = 0; k < 16; ++k) {
      const std::size_t i = (k * 7919 + u * 104729) % ul.numel;
      const float saved = h.p[u][i];
      const float eps = 1e-2f;
      h.p[u][i] = saved + eps;
      const double up = m.evaluate(h, b);
      const bool same_up = m.last_routes() == routes;
      h.p[u][i] = saved - eps;
      const double down = m.evaluate(h, b);
      const bool same_down = m.last_routes() == routes;
      h.p[u][i] = saved;
      if (!same_up || !same_down) {  // top-1 routing is not differentiable where it flips
        ++skipped;
        continue;
      }
      const double numeric = (up - down) / (2.0 * eps);
      const double a = analytic[u][i];
      CHECK_MESSAGE(std::abs(numeric - a) <= 2e-2 * std::abs(numeric) + 2e-4, "unit ", ul.name,
                    " element ", i, ": analytic ", a, " numeric ", numeric);
      ++checked;
    }
  }
  CHECK(checked >= 110);  // of 128; a flip of routing under +-eps skips an element
  MESSAGE("moe gradient check: ", checked, " elements checked, ", skipped, " skipped");
  // an expert no example was routed to has zero gradients
  for (int e = 0; e < 4; ++e)
    if (per_expert[static_cast<std::size_t>(e)] == 0)
      for (float g : analytic[m.unit_of_expert(e)]) CHECK(g == 0.0f);
  for (std::size_t u = 0; u < h.l.num_units(); ++u)
    for (std::size_t i = h.l.unit(u).numel; i < h.l.unit(u).padded_numel; ++i)
      CHECK(analytic[u][i] == 0.0f);
}

TEST_CASE("charlm with experts trains under fsdp on 8 inproc ranks (sharded experts)") {
  const auto data = charlm::corpus::from_text(sample_text());
  check_loss_drops<fedshard::fsdp>(data, {1, 1, 8},
                                   {.vocab = data.vocab(),
                                    .context = 4,
                                    .embed = 8,
                                    .hidden = 32,
                                    .experts = 4,
                                    .expert_hidden = 16},
                                   {}, [](auto&, int) {});
}

TEST_CASE("charlm under fomoe on 4 groups: each group routes to the expert it holds and trains") {
  const auto data = charlm::corpus::from_text(sample_text());
  const charlm::dims dims{.vocab = data.vocab(),
                          .context = 4,
                          .embed = 8,
                          .hidden = 32,
                          .experts = 4,
                          .expert_hidden = 16};
  const auto owners = charlm::model(dims, 1).ownership(4);
  REQUIRE(owners.holders.size() == 9);  // embed, hidden1, hidden2, router, 4 experts, head
  CHECK(owners.holders[4] == 1u);       // expert0 on group 0
  CHECK(owners.holders[7] == 8u);       // expert3 on group 3
  CHECK(owners.holders[8] == 15u);      // the head everywhere
  const auto three = charlm::model(dims, 1).ownership(4, 3);
  CHECK(three.holders[4] == 7u);   // expert0 on groups 0, 1, 2
  CHECK(three.holders[7] == 11u);  // expert3 on groups 3, 0, 1
  CHECK_THROWS_AS(charlm::model(dims, 1).ownership(4, 5), fedshard::invalid_argument);
  std::vector<int> other_routes(4, 0);
  fedshard::trainer_options<fedshard::fomoe> o;
  o.federation.owners = owners;
  o.schedule = {.period = 4};
  check_loss_drops<fedshard::fomoe>(data, {4, 1, 1}, dims, o, [&](auto& t, int rank) {
    for (int e : t.model().last_routes())  // group g holds expert g
      other_routes[static_cast<std::size_t>(rank)] += e != rank;
  });
  for (int r = 0; r < 4; ++r) CHECK(other_routes[r] == 0);
}

namespace {

/// Every rank's federation bytes (array bytes, as the wire tap records each call) over one
/// hofl sync on charlm, the embedding and hidden1 zeroth-order and crossing as `sync` says:
/// all_reduce bytes (the policy's) and all_gather bytes (the records') summed over the ranks.
struct federation_bytes {
  std::int64_t reduce = 0, gather = 0;
};
federation_bytes hofl_sync_bytes(const charlm::corpus& data, const charlm::dims& d,
                                 fedshard::zo_sync sync) {
  using namespace fedshard;
  const mesh_shape shape{2, 2, 2};
  std::vector<federation_bytes> per_rank(8);
  test::spawn_ranks(8, [&](inproc::communicator& world) {
    mesh m(world, shape);
    trainer_options<hofl> o;
    o.total_steps = 8;
    o.log = [](const std::string&) {};
    o.local_rule = zeroth_order_lower_rule({.eps = 1e-3f, .probes = 1, .seed = 0}, 2, sync);
    trainer<charlm::model, hofl, optim::adamw, inproc::communicator> t(m, charlm::model(d, 1),
                                                                       {.lr = 1e-2f}, o);
    auto& wire = t.engine().interp().wire();
    wire.keep_calls(true);
    for (int step = 0; step < 8; ++step)
      t.step(charlm::model::training_batch(data, d.context, 1, step, world.rank(), 4));
    CHECK(t.syncs_applied() == 1);
    auto& mine = per_rank[static_cast<std::size_t>(world.rank())];
    for (const auto& c : wire.take_calls()) {
      if (c.axis != axis::federation) continue;
      (c.kind == comm_kind::all_gather ? mine.gather : mine.reduce) += c.bytes;
    }
  });
  federation_bytes total;
  for (const auto& r : per_rank) {
    total.reduce += r.reduce;
    total.gather += r.gather;
  }
  return total;
}

}  // namespace

TEST_CASE("hofl on the demo's mesh and sizes: the zeroth-order units cross as 400 B of seeds") {
  // The demo's defaults: 2 groups of 2 replicas x 2 shards, K = 8, context 8, embed 16,
  // hidden 256, one probe per step. The zeroth-order units: embed (V x 16) and hidden1
  // (256 x 128 + 256 = 33024). With this corpus's V = 35: embed 560, 280 a shard rounded up
  // to 288 (a multiple of 16), hidden1 16512 a shard: 16800 floats, a replica's half of that
  // each on the federation link: 8400 floats, 33600 B an all_reduce on each of the 8 ranks,
  // 268800 B. As records: on each group's rank 0 only, the counts (2 x 8 B) and 8 steps x 1
  // probe of 24 B from each of the 2 groups (384 B): 400 B a group, 800 B in all, 336x fewer.
  const auto data = charlm::corpus::from_text(sample_text());
  REQUIRE(data.vocab() == 35);
  const charlm::dims d{.vocab = data.vocab(), .context = 8, .embed = 16, .hidden = 256};
  const auto seeds = hofl_sync_bytes(data, d, fedshard::zo_sync::records);
  const auto params = hofl_sync_bytes(data, d, fedshard::zo_sync::parameters);
  // weighted_average's own gather of the groups' tokens: 2 x 8 B on each of the 8 ranks.
  CHECK(params.gather == 128);
  const std::int64_t records = seeds.gather - params.gather;
  CHECK(records == 800);
  CHECK(params.reduce - seeds.reduce == 268800);
  CHECK(params.reduce - seeds.reduce >= 100 * records);
}
