// The two local rules end to end (issue 29's "done when"): zeroth-order units
// (trainer/local_zeroth_order.hpp, tiny_mlp's first unit "layer0" gradient-free) and Local
// Superior Soups (trainer/local_soup.hpp, a pool of three with both regularisers) on fl_fsdp,
// 2 groups x 2 shards, syncing every 3 steps (after steps 2, 5, 8):
//  - on the checked space (hold mode: a missing wait reads stale values), with the inproc
//    communicator or a stream-ordered one (support/spaces.hpp), a run gives the host's bits,
//    rank by rank;
//  - a checkpoint saved mid-round (after step 4: the round's second local step, the soup
//    holding two members, the second trained once) and loaded into fresh trainers continues
//    bit-identically to the uninterrupted run, in the space it was saved in and on the host;
//  - resharded: the checkpoint of 2x1x2 loads as fl_hsdp on 2x2x1 (each group's parameters,
//    pool members, anchor and round counters bit for bit, and the run continues exactly as
//    the uninterrupted one: both meshes reduce over the same two ranks in the same order) and
//    as fl_fsdp on 3x1x2 (group g from saved group g mod 2; the next sync gives every group
//    one model).

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/federation/average.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/optim/zeroth_order.hpp"
#include "fedshard/trainer/local_soup.hpp"
#include "fedshard/trainer/local_zeroth_order.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/files.hpp"
#include "support/local_rule_settings.hpp"
#include "support/spaces.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

namespace {

using namespace fedshard;
using test::bit_equal;
using test::mlp_model;
namespace fs = std::filesystem;

constexpr std::uint64_t kData = 5;
constexpr float kLr = 2e-2f;
const mesh_shape kShape{2, 1, 2};  // 2 groups x 2 shards
const optim::zeroth_order_settings kZo = test::zo_two_probes;
const optim::soup_config kSoup = test::soup_of_three;

enum class rule_kind { zeroth_order, soup };

std::string name_of(rule_kind k) {
  return k == rule_kind::zeroth_order ? "zeroth order" : "soup";
}

template <class Alg>
trainer_options<Alg> options_for(rule_kind k) {
  trainer_options<Alg> o;
  o.total_steps = 30;
  o.schedule.period = 3;
  o.log = [](const std::string&) {};
  o.local_rule =
      k == rule_kind::zeroth_order ? zeroth_order_rule(kZo, {"layer0"}) : local_soup_rule(kSoup);
  return o;
}

/// Every "soup." section of a trainer's state, as its save callable writes it.
using section_map = std::map<std::string, std::vector<std::byte>>;

template <class T>
section_map soup_sections(T& t) {
  section_map out;
  for (const auto& e : t.state())
    if (e.name.rfind("soup.", 0) == 0) {
      std::vector<std::byte> bytes(e.bytes());
      e.save(bytes);
      out[e.name] = std::move(bytes);
    }
  return out;
}

/// What one rank holds after loading (when a leg loads) and at the leg's end.
struct rank_result {
  mesh_coords coords;
  int layout_shards = 1;
  std::vector<float> loaded_params;
  section_map loaded_soup;
  std::int64_t loaded_step = -1;
  std::vector<float> params;
  section_map soup;
  std::vector<float> losses;
};

/// Fresh trainers running Alg on `shape` with rule k, on the communicator and memory space
/// of Sp (support/spaces.hpp): load(from) when given, steps [first, last), save(to) when
/// given. Rank (g, r, s) trains on the stream's part g, r x shards + s (the same samples on
/// 2x1x2 and 2x2x1).
template <class Sp = test::on_host, class Alg = fl_fsdp>
std::vector<rank_result> leg(rule_kind k, mesh_shape shape, int first, int last,
                             const fs::path& from = {}, const fs::path& to = {}) {
  return test::collect_ranks(shape.size(), [&](inproc::communicator& world) {
    auto comm = Sp::wrap(world);
    mesh m(comm, shape);
    trainer<mlp_model, Alg, optim::adamw, typename Sp::comm, typename Sp::space> t(
        m, mlp_model{}, {.lr = kLr}, options_for<Alg>(k));
    rank_result r;
    r.coords = t.topology().coords();
    r.layout_shards = static_cast<int>(t.layout().shards());
    if (!from.empty()) {
      t.load(from);
      r.loaded_params = t.parameters();
      r.loaded_soup = soup_sections(t);
      r.loaded_step = t.step_count();
    }
    const int local = r.coords.replica * shape.shards + r.coords.shard;
    for (int s = first; s < last; ++s)
      r.losses.push_back(t.step(t.model().batch(kData, s, r.coords.group, shape.groups, local,
                                                shape.replicas * shape.shards, 4)));
    if (!to.empty()) t.save(to);
    r.params = t.parameters();
    r.soup = soup_sections(t);
    return r;
  });
}

std::vector<float> floats_of(const std::vector<std::byte>& b) {
  std::vector<float> out(b.size() / sizeof(float));
  std::memcpy(out.data(), b.data(), out.size() * sizeof(float));
  return out;
}

/// Group g's full values of master-shaped soup section `name` (numel per unit, units back to
/// back), assembled from the shards of its replica 0 (`loaded`: as loaded, else at the end).
std::vector<float> full_section(const std::vector<rank_result>& ranks, mesh_shape shape, int g,
                                const std::string& name, bool loaded) {
  const int shards = ranks.front().layout_shards;
  const flat_layout layout(mlp_model{}.units(), shards);
  std::vector<float> out;
  for (std::size_t u = 0; u < layout.num_units(); ++u) {
    std::vector<float> unit;
    for (int s = 0; s < shards; ++s) {
      const auto& rr = ranks[static_cast<std::size_t>(rank_of(shape, {g, 0, s}))];
      const auto buf = floats_of((loaded ? rr.loaded_soup : rr.soup).at(name));
      const auto at = buf.begin() + static_cast<std::ptrdiff_t>(layout.shard_offset(u));
      unit.insert(unit.end(), at, at + static_cast<std::ptrdiff_t>(layout.unit(u).shard_numel));
    }
    unit.resize(layout.unit(u).numel);
    out.insert(out.end(), unit.begin(), unit.end());
  }
  return out;
}

const char* const kPoolSections[] = {"soup.member0", "soup.member1", "soup.member2", "soup.anchor"};
const char* const kCounterSections[] = {"soup.round", "soup.local_step", "soup.started"};

}  // namespace

// On the test spaces the rules' hooks read and write master through the host: a missing
// wait for the compute stream (before the hooks, after the inner optimizer's step, around
// the zeroth-order rule's loss evaluations) would read or leave stale values there.
TEST_CASE_TEMPLATE(
    "local rules: every test space gives the host's bits, and a checkpoint saved mid-round "
    "resumes bit-exactly in its space and on the host",
    Sp, FEDSHARD_TEST_SPACES) {
  for (rule_kind k : {rule_kind::zeroth_order, rule_kind::soup}) {
    CAPTURE(name_of(k));
    test::temp_dir dir("fedshard-local-rules");
    const auto host = leg(k, kShape, 0, 10);
    const auto straight = leg<Sp>(k, kShape, 0, 10);
    (void)leg<Sp>(k, kShape, 0, 5, {}, dir.path);  // saved after step 4: mid-round
    const auto resumed = leg<Sp>(k, kShape, 5, 10, dir.path);
    const auto resumed_on_host = leg(k, kShape, 5, 10, dir.path);
    for (std::size_t r = 0; r < host.size(); ++r) {
      CAPTURE(r);
      CHECK(bit_equal(straight[r].params, host[r].params));
      CHECK(straight[r].losses == host[r].losses);
      CHECK(resumed[r].loaded_step == 5);
      CHECK(bit_equal(resumed[r].params, straight[r].params));
      CHECK(bit_equal(resumed_on_host[r].params, straight[r].params));
      // The losses of steps 5..9 are the last five of the uninterrupted run's ten.
      CHECK(resumed[r].losses ==
            std::vector<float>(straight[r].losses.begin() + 5, straight[r].losses.end()));
      CHECK(straight[r].losses.back() < 0.8f * straight[r].losses.front());
      // Step 9 is local (the last sync was after step 8): the groups differ again.
      CHECK_FALSE(bit_equal(straight[r].params, straight[(r + 2) % 4].params));
    }
  }
}

TEST_CASE("local rules reshard: 2x1x2 saved mid-round loads on 2x2x1 and continues bit for bit") {
  // fl_hsdp on 2x2x1 reduces each step's gradients over the group's 2 replicas where fl_fsdp
  // on 2x1x2 reduce-scatters them over its 2 shards: the same two ranks' values summed in
  // rank order, on the same samples. The zeroth-order rule's loss is the same 2-rank mean and
  // its directions are keyed by element. The soup's squared distances are one rank's sum over
  // the whole model instead of two shards' sums added, in double: here that difference does
  // not reach the float coefficients of the regularisers' gradients.
  const mesh_shape to{2, 2, 1};
  for (rule_kind k : {rule_kind::zeroth_order, rule_kind::soup}) {
    CAPTURE(name_of(k));
    test::temp_dir dir("fedshard-local-rules-reshard");
    const auto straight = leg(k, kShape, 0, 10);
    const auto saved = leg(k, kShape, 0, 5, {}, dir.path);
    const auto loaded = leg<test::on_host, fl_hsdp>(k, to, 5, 10, dir.path);
    REQUIRE_FALSE(bit_equal(saved[0].params, saved[2].params));  // the groups differ at the save
    for (const auto& r : loaded) {
      const auto& was = saved[static_cast<std::size_t>(rank_of(kShape, {r.coords.group, 0, 0}))];
      CAPTURE(r.coords.group);
      CAPTURE(r.coords.replica);
      CHECK(r.loaded_step == 5);
      CHECK(bit_equal(r.loaded_params, was.params));
      for (const char* c : kCounterSections) {
        CAPTURE(c);
        if (k == rule_kind::soup) CHECK(r.loaded_soup.at(c) == was.soup.at(c));
      }
      const auto& want =
          straight[static_cast<std::size_t>(rank_of(kShape, {r.coords.group, 0, 0}))];
      CHECK(bit_equal(r.params, want.params));
    }
    if (k == rule_kind::soup) {
      // Mid-round at the save: round 1 (its local steps 0 and 1 were steps 3 and 4), two
      // members in the pool (the second joined before step 4); the third joins at step 5.
      std::int64_t counters[2] = {};
      std::memcpy(counters, saved[0].soup.at("soup.round").data(), sizeof(counters));
      CHECK(counters[0] == 1);
      CHECK(counters[1] == 2);
      std::int64_t local_step = -1;
      std::memcpy(&local_step, saved[0].soup.at("soup.local_step").data(), sizeof(local_step));
      CHECK(local_step == 2);
      CHECK_FALSE(bit_equal(full_section(saved, kShape, 0, "soup.member0", false),
                            full_section(saved, kShape, 0, "soup.member1", false)));
      for (int g = 0; g < 2; ++g)
        for (const char* s : kPoolSections) {
          CAPTURE(g);
          CAPTURE(s);
          CHECK(bit_equal(full_section(loaded, to, g, s, true),
                          full_section(saved, kShape, g, s, false)));
        }
    }
  }
}

TEST_CASE("local rules reshard: 2x1x2 saved mid-round loads on 3x1x2, and the next sync agrees") {
  const mesh_shape to{3, 1, 2};
  for (rule_kind k : {rule_kind::zeroth_order, rule_kind::soup}) {
    CAPTURE(name_of(k));
    test::temp_dir dir("fedshard-local-rules-reshard3");
    const auto saved = leg(k, kShape, 0, 5, {}, dir.path);
    // Step 5, the sync after it averages the three groups.
    const auto loaded = leg(k, to, 5, 6, dir.path);
    for (const auto& r : loaded) {
      const int g = r.coords.group;
      CAPTURE(g);
      const auto& was =
          saved[static_cast<std::size_t>(rank_of(kShape, {g % 2, 0, r.coords.shard}))];
      CHECK(bit_equal(r.loaded_params, was.params));
      if (k == rule_kind::soup)
        for (const char* c : kCounterSections) CHECK(r.loaded_soup.at(c) == was.soup.at(c));
      CHECK(bit_equal(r.params, loaded[0].params));
    }
    if (k == rule_kind::soup)
      for (int g = 0; g < 3; ++g)
        for (const char* s : kPoolSections) {
          CAPTURE(g);
          CAPTURE(s);
          CHECK(bit_equal(full_section(loaded, to, g, s, true),
                          full_section(saved, kShape, g % 2, s, false)));
        }
  }
}
