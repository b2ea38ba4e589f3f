// The catalogue's local-rule aliases as a user gets them, with nothing set but the run's
// length: hofl (HSDP, weighted_average, K = 8, the model's two lowest units zeroth-order and
// sent as records) and lss (HSDP, weighted_average, K = 8, a soup of 3: members joining after
// local steps 4 and 6). tiny_mlp on 2 groups x 2 replicas x 2 shards, 16 steps (syncs after
// steps 7 and 15): every space of FEDSHARD_TEST_SPACES gives the host's bits; a run saved
// after step 12 (local step 5 of round 1: the soup holds 2 members) and loaded into fresh
// trainers ends bit-identical to the straight run; the eval loss falls; every rank holds one
// model after the last sync. Saved on 2x2x2 and loaded on 2x1x4, they reshard and train on.

#include <doctest/doctest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/trainer/local_soup.hpp"
#include "fedshard/trainer/local_zeroth_order.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/files.hpp"
#include "support/spaces.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

namespace {

using namespace fedshard;
using test::bit_equal;
using test::mlp_model;
namespace fs = std::filesystem;

const mesh_shape kShape{2, 2, 2};

struct rank_result {
  std::vector<float> params, loaded;
  double first_eval = 0, last_eval = 0;
  std::string rule;
  std::vector<std::string> gradient_free;
};

/// Fresh trainers of alias A on the communicator and space of Sp: load(from) when given,
/// steps [first, last), save(to) when given.
template <class A, class Sp = test::on_host>
std::vector<rank_result> leg(int first, int last, const fs::path& from = {},
                             const fs::path& to = {}, mesh_shape shape = kShape) {
  return test::collect_ranks(shape.size(), [&](inproc::communicator& world) {
    auto comm = Sp::wrap(world);
    mesh m(comm, shape);
    trainer_options<A> o;  // the alias's defaults: its local rule included
    o.total_steps = 16;
    o.log = [](const std::string&) {};
    trainer<mlp_model, A, optim::adamw, typename Sp::comm, typename Sp::space> t(m, mlp_model{},
                                                                                 {.lr = 2e-2f}, o);
    if (!from.empty()) t.load(from);
    const auto c = t.topology().coords();
    const int local = c.replica * shape.shards + c.shard;
    const int locals = shape.replicas * shape.shards;
    auto batch = [&](int s) { return t.model().batch(7, s, c.group, 2, local, locals, 4); };
    rank_result r;
    if (!from.empty()) r.loaded = t.parameters();
    REQUIRE(t.local() != nullptr);
    r.rule = std::string(t.local()->name());
    r.gradient_free = t.local()->gradient_free_units();
    const auto held = batch(1000);
    r.first_eval = t.mean_over_world(t.evaluate(held));
    for (int s = first; s < last; ++s) t.step(batch(s));
    r.last_eval = t.mean_over_world(t.evaluate(held));
    if (!to.empty()) t.save(to);
    r.params = t.parameters();
    return r;
  });
}

}  // namespace

TEST_CASE_TEMPLATE("the hofl and lss aliases: every test space gives the host's bits", Sp,
                   FEDSHARD_TEST_SPACES) {
  const auto hofl_host = leg<hofl>(0, 16);
  const auto hofl_here = leg<hofl, Sp>(0, 16);
  const auto lss_host = leg<lss>(0, 16);
  const auto lss_here = leg<lss, Sp>(0, 16);
  for (std::size_t r = 0; r < hofl_host.size(); ++r) {
    CAPTURE(r);
    CHECK(hofl_host[r].rule == "zeroth_order");
    CHECK(hofl_host[r].gradient_free == std::vector<std::string>{"layer0", "layer1"});
    CHECK(lss_host[r].rule == "local_soup");
    CHECK(bit_equal(hofl_here[r].params, hofl_host[r].params));
    CHECK(bit_equal(lss_here[r].params, lss_host[r].params));
    CHECK(bit_equal(hofl_host[r].params, hofl_host[0].params));  // step 15 synced
    CHECK(bit_equal(lss_host[r].params, lss_host[0].params));
    CHECK(hofl_host[r].last_eval < hofl_host[r].first_eval);
    CHECK(lss_host[r].last_eval < 0.8 * lss_host[r].first_eval);
  }
}

TEST_CASE("the hofl and lss aliases: saved mid-round and loaded, they resume bit-exactly") {
  for (int alias = 0; alias < 2; ++alias) {
    CAPTURE(alias);
    test::temp_dir dir("fedshard-local-aliases");
    const auto straight = alias == 0 ? leg<hofl>(0, 16) : leg<lss>(0, 16);
    if (alias == 0) {
      (void)leg<hofl>(0, 13, {}, dir.path);
    } else {
      (void)leg<lss>(0, 13, {}, dir.path);
    }
    const auto resumed = alias == 0 ? leg<hofl>(13, 16, dir.path) : leg<lss>(13, 16, dir.path);
    for (std::size_t r = 0; r < straight.size(); ++r) {
      CAPTURE(r);
      CHECK(bit_equal(resumed[r].params, straight[r].params));
    }
  }
}

TEST_CASE("the hofl and lss aliases: saved on 2x2x2 mid-round, they load on 2x1x4 and train on") {
  // The same 2 groups cut into 4 shards instead of 2 replicas x 2 shards: each group's
  // parameters load bit for bit (the records of hofl's round and the soup's pool reshard
  // with them), and the run goes on to its sync after step 15: one model on every rank.
  const mesh_shape to{2, 1, 4};
  for (int alias = 0; alias < 2; ++alias) {
    CAPTURE(alias);
    test::temp_dir dir("fedshard-local-aliases-reshard");
    const auto saved = alias == 0 ? leg<hofl>(0, 13, {}, dir.path) : leg<lss>(0, 13, {}, dir.path);
    const auto loaded =
        alias == 0 ? leg<hofl>(13, 16, dir.path, {}, to) : leg<lss>(13, 16, dir.path, {}, to);
    REQUIRE_FALSE(bit_equal(saved[0].params, saved[4].params));  // the groups differ mid-round
    for (std::size_t r = 0; r < loaded.size(); ++r) {
      CAPTURE(r);
      CHECK(bit_equal(loaded[r].loaded, saved[r < 4 ? 0 : 4].params));
      CHECK(bit_equal(loaded[r].params, loaded[0].params));  // step 15 synced
      CHECK(loaded[r].last_eval < loaded[r].first_eval * 1.01);
    }
  }
}
