// Resharding loads: a checkpoint saved on one mesh, shard policy and algorithm, loaded on
// another. The gathered parameters and optimizer state equal the saved ones bit for bit,
// training goes on exactly as a run started by hand from those values, what has no meaning is
// dropped and what is missing starts fresh (each logged), and a rank reads only the ranges it
// owns.
#include <doctest/doctest.h>

#include <unistd.h>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <vector>

#include "fedshard/codec/topk.hpp"
#include "fedshard/comm/inproc.hpp"
#include "fedshard/error.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/trainer/checkpoint.hpp"
#include "fedshard/trainer/trainer.hpp"
#include "support/files.hpp"
#include "support/spawn_ranks.hpp"
#include "support/tiny_mlp.hpp"

using namespace fedshard;
using test::mlp_model;
namespace fs = std::filesystem;
namespace ck = fedshard::checkpoint;

namespace {

constexpr std::uint64_t kData = 7;

struct temp_dir : test::temp_dir {
  temp_dir() : test::temp_dir("fedshard-reshard") {}
};
using test::bit_equal;
using test::contains;

/// What one rank holds: its coordinates, its group's full parameters, its shards of the inner
/// optimizer's and of the federation policy's state, and what it logged.
struct rank_state {
  mesh_coords coords;
  int layout_shards = 1;
  std::vector<float> params;
  std::vector<std::vector<float>> inner;  // optimizer().state(), master-shaped
  std::vector<std::vector<float>> outer;  // federation().state(), fragment-shaped
  std::vector<std::vector<float>> codec;  // the sync plan's codec residuals
  std::int64_t inner_steps = -1, step = -1, syncs = -1;
  std::vector<float> losses;  // of the steps after the state was taken
  std::vector<float> final_params;
  std::vector<std::string> log;
  std::string error;
};

template <class T>
rank_state state_of(T& t) {
  rank_state r;
  r.coords = t.topology().coords();
  r.layout_shards = t.layout().shards();
  r.params = t.parameters();
  for (const auto& s : t.optimizer().state()) r.inner.push_back(t.engine().download(s.data));
  for (const auto& s : t.federation().state()) r.outer.push_back(t.engine().download(s.data));
  for (const auto& op : t.sync_plan(0).ops)
    if (encoded(op) && op.codec.stateful) {
      const auto st = t.engine().interp().codec_state(op);
      r.codec.emplace_back(st.begin(), st.end());
    }
  r.inner_steps = t.optimizer().step_count();
  r.step = t.step_count();
  r.syncs = t.syncs_applied();
  return r;
}

/// The full values (numel per unit, units back to back) of buffer k of `which` (inner or
/// outer state; both hold each unit's shard back to back for a single fragment) of group g,
/// assembled from the shards of its replica 0.
std::vector<float> full_state(const std::vector<rank_state>& ranks, mesh_shape shape, int g,
                              std::vector<std::vector<float>> rank_state::*which, std::size_t k) {
  const int s_layout = ranks.front().layout_shards;
  const flat_layout layout(mlp_model{}.units(), s_layout);
  std::vector<float> out;
  for (std::size_t u = 0; u < layout.num_units(); ++u) {
    std::vector<float> unit;
    for (int s = 0; s < s_layout; ++s) {
      const auto& rs = ranks[static_cast<std::size_t>(rank_of(shape, {g, 0, s}))];
      const auto& buf = (rs.*which).at(k);
      const auto from = buf.begin() + static_cast<std::ptrdiff_t>(layout.shard_offset(u));
      unit.insert(unit.end(), from, from + static_cast<std::ptrdiff_t>(layout.unit(u).shard_numel));
    }
    unit.resize(layout.unit(u).numel);
    out.insert(out.end(), unit.begin(), unit.end());
  }
  return out;
}

/// SparseLoCo-like: top-k with error feedback on the outer SGD's pseudo-gradients.
using sloco = algorithm<
    shard::hybrid_shard,
    federation::with_codec<federation::outer_optimizer<federation::outer_sgd>, codec::topk>,
    schedule::periodic, defaults<schedule::periodic::config{.period = 2}>>;

/// The federation settings Alg runs with here: its defaults, sloco's topk with chunk 16,
/// k 2, 2 bits (sparse even on the test model's small shards).
template <class Alg>
typename Alg::federation_policy::config federation_for() {
  typename Alg::federation_policy::config c{};
  if constexpr (std::is_same_v<Alg, sloco>) c.codec = {.chunk = 16, .k = 2, .bits = 2};
  return c;
}

template <class Alg>
trainer_options<Alg> options_for(int total, std::vector<std::string>* log = nullptr,
                                 std::mutex* mu = nullptr) {
  trainer_options<Alg> o;
  o.federation = federation_for<Alg>();
  o.total_steps = total;
  if constexpr (requires { o.schedule.period; }) o.schedule.period = 3;
  if (log != nullptr)
    o.log = [log, mu](const std::string& line) {
      std::lock_guard lock(*mu);
      log->push_back(line);
    };
  return o;
}

template <class Alg, class Opt = optim::adamw>
using trainer_t = trainer<mlp_model, Alg, Opt, inproc::communicator>;

template <class T>
std::vector<test::sample> batch_at(T& t, mesh_shape shape, int step) {
  const auto c = t.topology().coords();
  return t.model().batch(kData, step, c.group, shape.groups, c.replica * shape.shards + c.shard,
                         shape.replicas * shape.shards, 2);
}

/// fl_hsdp on 2x2x2 (8 ranks) with AdamW, 4 steps (a sync after step 2, so the groups hold
/// different parameters again at the save), saved into dir; returns every rank's state.
std::vector<rank_state> save_fl_hsdp(const fs::path& dir) {
  const mesh_shape shape{2, 2, 2};
  return test::collect_ranks(shape.size(), [&](inproc::communicator& world) {
    mesh m(world, shape);
    trainer_t<fl_hsdp> t(m, mlp_model{}, {.lr = 1e-2f}, options_for<fl_hsdp>(8));
    for (int s = 0; s < 4; ++s) t.step(batch_at(t, shape, s));
    t.save(dir);
    return state_of(t);
  });
}

/// Loads dir into Alg on `shape` (optimizer Opt), records the state right after, then trains
/// `more` steps from the saved step on.
template <class Alg, class Opt = optim::adamw>
std::vector<rank_state> load_into(const fs::path& dir, mesh_shape shape, int more,
                                  typename Opt::config oc = {.lr = 1e-2f}) {
  std::mutex mu;
  return test::collect_ranks(shape.size(), [&](inproc::communicator& world) {
    mesh m(world, shape);
    std::vector<std::string> log;
    trainer_t<Alg, Opt> t(m, mlp_model{}, oc, options_for<Alg>(12, &log, &mu));
    for (int s = 0; s < 2; ++s) t.step(batch_at(t, shape, 100 + s));  // a state of its own
    rank_state r;
    try {
      t.load(dir);
    } catch (const std::exception& e) {
      r = state_of(t);
      r.error = e.what();
      return r;
    }
    r = state_of(t);
    r.log = log;
    for (int s = 0; s < more; ++s) {
      const auto step = static_cast<int>(t.step_count());
      r.losses.push_back(t.step(batch_at(t, shape, step)));
    }
    r.final_params = t.parameters();
    return r;
  });
}

}  // namespace

TEST_CASE(
    "fl_hsdp saved on 2x2x2 loads as fsdp on 1x1x4 and as fl_hsdp on 3x1x2: parameters and "
    "AdamW moments bit for bit, and fsdp trains on exactly as if started from them") {
  temp_dir dir;
  const mesh_shape saved_shape{2, 2, 2};
  const auto saved = save_fl_hsdp(dir.path);
  REQUIRE_FALSE(bit_equal(saved[0].params, saved[4].params));  // the groups differ

  SUBCASE("fsdp on 1x1x4") {
    const mesh_shape shape{1, 1, 4};
    const auto loaded = load_into<fsdp>(dir.path, shape, 3);
    for (const auto& r : loaded) {
      CAPTURE(r.error);
      REQUIRE(r.error.empty());
      CHECK(bit_equal(r.params, saved[0].params));
      CHECK(r.inner_steps == 4);
      CHECK(r.step == 4);
    }
    for (std::size_t k = 0; k < 2; ++k)
      CHECK(bit_equal(full_state(loaded, shape, 0, &rank_state::inner, k),
                      full_state(saved, saved_shape, 0, &rank_state::inner, k)));
    // The log says where the state came from (only what is in both runs moved: nothing was
    // dropped or started fresh).
    REQUIRE(loaded[0].log.size() == 1);
    CHECK(contains(loaded[0].log[0], "of 2x2x2 resharded onto 1x1x4 (full_shard, none)"));

    // The reference: fsdp on 1x1x4 whose master and moments are set by hand from the saved
    // group 0's full values, trained on the same batches.
    const auto reference = test::collect_ranks(shape.size(), [&](inproc::communicator& world) {
      mesh m(world, shape);
      trainer_t<fsdp> t(m, mlp_model{}, {.lr = 1e-2f}, options_for<fsdp>(12));
      const auto& l = t.layout();
      std::vector<std::vector<float>> full{
          saved[0].params, full_state(saved, saved_shape, 0, &rank_state::inner, 0),
          full_state(saved, saved_shape, 0, &rank_state::inner, 1)};
      auto put = [&](const std::vector<float>& values, std::span<float> buffer) {
        std::vector<float> mine(buffer.size(), 0.0f);
        std::size_t unit_start = 0;
        for (std::size_t u = 0; u < l.num_units(); ++u) {
          const auto range = l.shard_of(u, m.coords().shard);
          for (std::size_t e = range.begin; e < std::min(range.end, l.unit(u).numel); ++e)
            mine[l.shard_offset(u) + (e - range.begin)] = values[unit_start + e];
          unit_start += l.unit(u).numel;
        }
        t.engine().upload(mine, buffer);
      };
      put(full[0], t.engine().master());
      put(full[1], t.optimizer().state()[0].data);
      put(full[2], t.optimizer().state()[1].data);
      t.optimizer().set_step_count(4);
      rank_state r;
      for (int s = 4; s < 7; ++s) r.losses.push_back(t.step(batch_at(t, shape, s)));
      r.final_params = t.parameters();
      return r;
    });
    for (std::size_t i = 0; i < loaded.size(); ++i) {
      CAPTURE(i);
      CHECK(loaded[i].losses == reference[i].losses);
      CHECK(bit_equal(loaded[i].final_params, reference[i].final_params));
    }
  }

  SUBCASE("fl_hsdp on 3x1x2: group g from the saved group g mod 2") {
    const mesh_shape shape{3, 1, 2};
    const auto loaded = load_into<fl_hsdp>(dir.path, shape, 2);
    for (const auto& r : loaded) {
      CAPTURE(r.error);
      REQUIRE(r.error.empty());
      const auto& want =
          saved[static_cast<std::size_t>(rank_of(saved_shape, {r.coords.group % 2, 0, 0}))];
      CHECK(bit_equal(r.params, want.params));
      CHECK(r.inner_steps == 4);
      CHECK(r.syncs == 1);
    }
    for (int g = 0; g < 3; ++g)
      for (std::size_t k = 0; k < 2; ++k)
        CHECK(bit_equal(full_state(loaded, shape, g, &rank_state::inner, k),
                        full_state(saved, saved_shape, g % 2, &rank_state::inner, k)));
    // The next sync (after step 5) averages the three groups: they agree again.
    CHECK(bit_equal(loaded[0].final_params, loaded[2].final_params));
    CHECK(bit_equal(loaded[0].final_params, loaded[4].final_params));
  }
}

TEST_CASE(
    "DiLoCo's anchors and outer momentum reshard from 2x2x1 to 2x1x2; state another "
    "algorithm or optimizer has no use for is dropped, what it lacks starts fresh, both logged") {
  temp_dir dir;
  const mesh_shape saved_shape{2, 2, 1};
  const auto saved = test::collect_ranks(saved_shape.size(), [&](inproc::communicator& world) {
    mesh m(world, saved_shape);
    trainer_t<diloco> t(m, mlp_model{}, {.lr = 1e-2f}, options_for<diloco>(12));
    for (int s = 0; s < 5; ++s) t.step(batch_at(t, saved_shape, s));  // outer step after 2
    t.save(dir.path);
    return state_of(t);
  });
  REQUIRE(saved[0].outer.size() == 2);  // anchor, momentum

  SUBCASE("diloco on 2x1x2") {
    const mesh_shape shape{2, 1, 2};
    const auto loaded = load_into<diloco>(dir.path, shape, 2);
    for (const auto& r : loaded) {
      CAPTURE(r.error);
      REQUIRE(r.error.empty());
      CHECK(bit_equal(r.params, saved[static_cast<std::size_t>(r.coords.group * 2)].params));
    }
    for (int g = 0; g < 2; ++g)
      for (std::size_t k = 0; k < 2; ++k) {
        CAPTURE(k);
        CHECK(bit_equal(full_state(loaded, shape, g, &rank_state::outer, k),
                        full_state(saved, saved_shape, g, &rank_state::outer, k)));
      }
    CHECK(loaded[0].log.size() == 1);
  }
  SUBCASE("fsdp with momentum SGD on 1x1x2") {
    const auto loaded =
        load_into<fsdp, optim::sgd>(dir.path, {1, 1, 2}, 1, {.lr = 1e-2f, .momentum = 0.9f});
    REQUIRE(loaded[0].error.empty());
    REQUIRE(loaded[0].log.size() == 3);
    CHECK(contains(loaded[0].log[1],
                   "dropped what this run has no use for: optimizer state 'exp_avg', optimizer "
                   "state 'exp_avg_sq', federation state 'fragment0.anchor', federation state "
                   "'fragment0.momentum'"));
    CHECK(contains(loaded[0].log[2],
                   "started as at a fresh start (not in the checkpoint): "
                   "optimizer state 'momentum_buffer'"));
    CHECK(bit_equal(loaded[1].params, saved[0].params));
    for (const auto& r : loaded) {
      CHECK(r.inner_steps == 0);
      for (float x : r.inner.at(0)) REQUIRE(x == 0.0f);
    }
  }
}

TEST_CASE("fsdp's checkpoint loaded by DiLoCo: the anchors start from the loaded parameters") {
  temp_dir dir;
  const mesh_shape fsdp_shape{1, 1, 2};
  const auto saved = test::collect_ranks(2, [&](inproc::communicator& world) {
    mesh m(world, fsdp_shape);
    trainer_t<fsdp> t(m, mlp_model{}, {.lr = 1e-2f}, options_for<fsdp>(12));
    for (int s = 0; s < 3; ++s) t.step(batch_at(t, fsdp_shape, s));
    t.save(dir.path);
    return state_of(t);
  });
  const mesh_shape shape{2, 1, 2};
  const auto loaded = load_into<diloco>(dir.path, shape, 1);
  REQUIRE(loaded[0].error.empty());
  REQUIRE(loaded[0].log.size() == 2);
  CHECK(contains(loaded[0].log[1],
                 "federation state 'fragment0.anchor', federation state "
                 "'fragment0.momentum'"));
  for (const auto& r : loaded) CHECK(bit_equal(r.params, saved[0].params));
  // After one step the anchors are the parameters as loaded, as at a fresh start.
  const auto anchors = test::collect_ranks(4, [&](inproc::communicator& world) {
    mesh m(world, shape);
    trainer_t<diloco> t(m, mlp_model{}, {.lr = 1e-2f}, options_for<diloco>(12));
    t.load(dir.path);
    t.step(batch_at(t, shape, 3));
    return state_of(t);
  });
  for (int g = 0; g < 2; ++g)
    CHECK(bit_equal(full_state(anchors, shape, g, &rank_state::outer, 0), saved[0].params));
}

TEST_CASE(
    "a resharding rank reads only the ranges it owns: a damaged range fails exactly the loads "
    "that need it, on every rank, and changes nothing") {
  temp_dir dir;
  save_fl_hsdp(dir.path);
  // Damage one byte of saved rank 4's master (group 1, replica 0, shard 0): the sections
  // follow the 16-byte header in the order written (manifest, save_id, master, ...).
  const auto saved = ck::saved_checkpoint::open(dir.path);
  const fs::path victim = dir.path / ck::rank_file_name(4, saved.id());
  const std::size_t master_at = 16 + saved.rank_file(4).section_size("manifest") + 8;
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(master_at + 4 * 10));
    char b = 0x7f;
    f.write(&b, 1);
  }
  // One group reads saved group 0 only: it loads.
  for (const auto& r : load_into<fsdp>(dir.path, {1, 1, 4}, 0)) CHECK(r.error.empty());
  // Two groups: group 1 reads saved rank 4's damaged chunk.
  const auto two = load_into<fl_fsdp>(dir.path, {2, 1, 4}, 0);
  for (std::size_t r = 0; r < two.size(); ++r) {
    CAPTURE(r);
    CAPTURE(two[r].error);
    CHECK_FALSE(two[r].error.empty());
    CHECK(two[r].step == 2);  // its own two steps, nothing loaded
    // The whole section is one checksummed chunk here, so every rank of group 1 that reads
    // saved rank 4 finds the damage; the others hear of it.
    if (r == 4) {
      CHECK(contains(two[r].error, victim.string()));
      CHECK(contains(two[r].error, "section 'master' fails the checksum"));
    } else {
      CHECK((contains(two[r].error, "failed on world rank 4") ||
             (r > 4 && contains(two[r].error, victim.string()))));
    }
  }
}

TEST_CASE(
    "SparseLoCo's error-feedback residuals reshard from 2x2x1 (a piece per replica) to 2x1x2") {
  temp_dir dir;
  const mesh_shape saved_shape{2, 2, 1};
  const auto saved = test::collect_ranks(saved_shape.size(), [&](inproc::communicator& world) {
    mesh m(world, saved_shape);
    trainer_t<sloco> t(m, mlp_model{}, {.lr = 1e-2f}, options_for<sloco>(12));
    for (int s = 0; s < 4; ++s) t.step(batch_at(t, saved_shape, s));
    t.save(dir.path);
    return state_of(t);
  });
  REQUIRE(saved[0].codec.size() == 1);
  const mesh_shape shape{2, 1, 2};
  const auto loaded = load_into<sloco>(dir.path, shape, 1);
  REQUIRE(loaded[0].error.empty());
  CHECK(loaded[0].log.size() == 1);  // nothing dropped, nothing fresh
  const flat_layout old(mlp_model{}.units(), 1);
  for (int g = 0; g < 2; ++g) {
    // The saved group's fragment buffer: replica r's residual is its r-th half.
    std::vector<float> fragment;
    for (int r = 0; r < 2; ++r) {
      const auto& res = saved[static_cast<std::size_t>(rank_of(saved_shape, {g, r, 0}))].codec[0];
      fragment.insert(fragment.end(), res.begin(), res.end());
    }
    std::vector<float> want;
    for (std::size_t u = 0; u < old.num_units(); ++u) {
      const auto from = fragment.begin() + static_cast<std::ptrdiff_t>(old.shard_offset(u));
      want.insert(want.end(), from, from + static_cast<std::ptrdiff_t>(old.unit(u).numel));
    }
    bool nonzero = false;
    for (float x : want) nonzero = nonzero || x != 0.0f;
    CHECK(nonzero);  // a real residual, not the zeros of a fresh start
    CHECK(bit_equal(full_state(loaded, shape, g, &rank_state::codec, 0), want));
  }
}

namespace {
/// The test MLP with one more tensor in its head (variant 0) or its head in bf16 (variant 1):
/// another model, for loads that must be refused (it is never stepped).
struct variant_model {
  int variant = 0;
  mlp_model base{};
  std::vector<unit_spec> units() const {
    auto u = base.units();
    if (variant == 0)
      u[2].tensors.push_back({"extra", {3}});
    else
      for (auto& t : u[2].tensors) t.type = dtype::bf16;
    return u;
  }
};
}  // namespace

TEST_CASE("a checkpoint of another model is refused on every rank, naming the tensor") {
  temp_dir dir;
  const mesh_shape shape{1, 1, 2};
  test::spawn_ranks(2, [&](inproc::communicator& world) {
    mesh m(world, shape);
    trainer_t<fsdp> t(m, mlp_model{}, {.lr = 1e-2f}, options_for<fsdp>(4));
    t.step(batch_at(t, shape, 0));
    t.save(dir.path);
  });
  for (int variant : {0, 1}) {
    CAPTURE(variant);
    const auto errors = test::collect_ranks(2, [&](inproc::communicator& world) {
      mesh m(world, shape);  // another layout: the resharding path reads the saved model
      trainer<variant_model, fsdp, optim::adamw, inproc::communicator> t(m, {variant});
      const auto before = t.parameters();
      std::string error;
      try {
        t.load(dir.path);
      } catch (const invalid_argument& e) {
        error = e.what();
      }
      CHECK(bit_equal(t.parameters(), before));
      CHECK(t.step_count() == 0);
      return error;
    });
    for (const auto& e : errors) {
      CAPTURE(e);
      CHECK(contains(e, dir.path.string()));
      CHECK(contains(e, variant == 0 ? "tensor 'head.extra' is missing from the checkpoint"
                                     : "tensor 'head.w2' has dtype f32 in the checkpoint, bf16 "
                                       "in this run"));
    }
  }
}
