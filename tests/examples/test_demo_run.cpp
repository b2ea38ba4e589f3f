// The demo's settings (examples/demo/demo_run.hpp): the flags of uneven links and experts,
// the rows table, the meshes on G groups and the emulated topology they run on.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "demo/demo_run.hpp"

namespace {
demo::settings parse(std::vector<std::string> args) {
  args.insert(args.begin(), "fedshard-demo");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return demo::parse(static_cast<int>(argv.size()), argv.data());
}
}  // namespace

TEST_CASE("demo defaults: 8 ranks on 2 sites, the meshes of before, no slow site, no experts") {
  const demo::settings s = parse({});
  CHECK(s.ranks == 8);
  CHECK(s.groups == 2);
  CHECK(s.slow_site == -1);
  CHECK(s.experts == 0);
  const auto same = [](fedshard::mesh_shape a, fedshard::mesh_shape b) {
    return a.groups == b.groups && a.replicas == b.replicas && a.shards == b.shards;
  };
  CHECK(same(demo::mesh_of("ddp", s), {1, 8, 1}));
  CHECK(same(demo::mesh_of("fsdp", s), {1, 1, 8}));
  CHECK(same(demo::mesh_of("zero2", s), {1, 1, 8}));
  CHECK(same(demo::mesh_of("hsdp", s), {1, 2, 4}));
  CHECK(same(demo::mesh_of("fl_fsdp", s), {2, 1, 4}));
  for (const char* a :
       {"fl_hsdp", "fl_hsdp_int8", "diloco", "streaming_diloco", "sparseloco", "some_new_alias"})
    CHECK(same(demo::mesh_of(a, s), {2, 2, 2}));
  const auto t = demo::topology_of(s);
  CHECK(t.site_links.empty());
  CHECK(t.site_of_rank == std::vector<int>{0, 0, 0, 0, 1, 1, 1, 1});
  // the cadences of before: averaging every K, outer optimizers every H
  CHECK(demo::options_of<fedshard::fl_hsdp>(s, "fl_hsdp").schedule.period == s.k);
  CHECK(demo::options_of<fedshard::diloco>(s, "diloco").schedule.period == s.h);
}

TEST_CASE("demo on 4 groups with a slow site and experts") {
  const demo::settings s =
      parse({"--groups", "4", "--slow-site", "3", "--slow-factor", "10", "--experts", "4"});
  CHECK(s.groups == 4);
  CHECK(s.slow_site == 3);
  CHECK(s.slow_factor == 10.0);
  CHECK(s.experts == 4);
  const auto fl = demo::mesh_of("fl_hsdp", s);
  CHECK((fl.groups == 4 && fl.replicas == 2 && fl.shards == 1));
  const auto ff = demo::mesh_of("fl_fsdp", s);
  CHECK((ff.groups == 4 && ff.replicas == 1 && ff.shards == 2));
  const auto t = demo::topology_of(s);
  CHECK(t.site_of_rank == std::vector<int>{0, 0, 1, 1, 2, 2, 3, 3});
  CHECK(t.transfer_seconds(1e6, {0, 3}) == doctest::Approx(10.0 * t.transfer_seconds(1e6, {0, 1})));
  // 16 ranks: the federated hybrid rows are hybrid inside each group
  const auto h16 = demo::mesh_of("diloco", parse({"--ranks", "16", "--groups", "4"}));
  CHECK((h16.groups == 4 && h16.replicas == 2 && h16.shards == 2));
  // a row is one line of the table; an unlisted alias gets the default row
  CHECK(demo::row_of("fl_fsdp").mesh == demo::mesh_kind::federated_shards);
  CHECK(demo::row_of("not_listed").mesh == demo::mesh_kind::federated_hybrid);
  CHECK(demo::row_of("not_listed").every == demo::cadence::by_policy);
  // issue 16's rows: fomoe syncs every K and needs the experts, gasloc every H
  CHECK(demo::row_of("fomoe").needs_experts);
  CHECK(demo::options_of<fedshard::fomoe>(s, "fomoe").schedule.period == s.k);
  CHECK(demo::options_of<fedshard::gasloc>(s, "gasloc").schedule.period == s.h);
  CHECK(!demo::row_of("gasloc").needs_experts);
  CHECK(demo::options_of<fedshard::gasloc>(s, "gasloc").federation.momentum == 0.5f);
  CHECK(demo::options_of<fedshard::diloco>(s, "diloco").federation.rule.momentum == 0.9f);
  // issue 17's row: fl_scape_fsdp runs SCAPE on fl_fsdp's mesh and cadence, at density 0.05;
  // scape_fsdp on fsdp's mesh
  CHECK(demo::row_of("fl_scape_fsdp").mesh == demo::row_of("fl_fsdp").mesh);
  CHECK(demo::row_of("scape_fsdp").mesh == demo::row_of("fsdp").mesh);
  const auto scape = demo::options_of<fedshard::fl_scape_fsdp>(s, "fl_scape_fsdp");
  CHECK(scape.schedule.period == s.k);
  CHECK(scape.shard.density == 0.05);
  CHECK(scape.shard.refresh_period == 1);
  // per-tensor quotas and the small tensors (embedding table, biases) dense by default
  CHECK(scape.shard.per_tensor);
  CHECK(scape.shard.dense_below == 2048);
  const auto tuned =
      parse({"--scape-density", "0.1", "--scape-refresh", "4", "--scape-dense-steps", "3",
             "--scape-dense-every", "8", "--scape-per-tensor", "0", "--scape-dense-below", "100"});
  const fedshard::shard::sparse_settings want{.density = 0.1,
                                              .refresh_period = 4,
                                              .dense_steps = 3,
                                              .dense_every = 8,
                                              .per_tensor = false,
                                              .dense_below = 100};
  CHECK(demo::options_of<fedshard::fl_scape_fsdp>(tuned, "fl_scape_fsdp").shard == want);
  CHECK(demo::options_of<fedshard::scape_fsdp>(tuned, "scape_fsdp").shard == want);
  CHECK(demo::expert_copies(s) == 3);  // G - 1 by default
  CHECK(demo::expert_copies(parse({"--groups", "4", "--expert-copies", "1"})) == 1);
  CHECK(demo::expert_copies(parse({})) == 1);  // 2 groups
}

TEST_CASE("the demo's rows are the catalogue's aliases") {
  // Every row of the table is an alias (the table is keyed by alias), and every alias is a
  // name the demo accepts, listed in its messages in the catalogue's order.
  for (const auto& r : demo::rows()) {
    CAPTURE(r.name);
    CHECK(fedshard::is_algorithm_name(r.name));
  }
  CHECK(demo::known_algorithms() ==
        "ddp,zero2,fsdp,hsdp,fl_fsdp,fl_hsdp,fl_hsdp_int8,diloco,streaming_diloco,sparseloco,"
        "gasloc,fomoe,scape_fsdp,fl_scape_fsdp,hofl,lss,fcp,feast,collate");
  for (const char* name : {"gasloc", "fomoe", "scape_fsdp", "fl_scape_fsdp"})
    CHECK(demo::known_algorithm(name));
  CHECK_FALSE(demo::known_algorithm("scape"));  // the row is called by its alias now
  // --help lists the catalogue and which rows take K, H and SCAPE's flags.
  std::string help = demo::usage_text();  // its lines joined: the lists wrap at 90 columns
  for (auto at = help.find("\n  "); at != std::string::npos; at = help.find("\n  ", at))
    help.replace(at, 3, " ");
  CHECK(help.find("algorithms (fedshard::for_each_algorithm): ddp, zero2, fsdp, hsdp, "
                  "fl_fsdp,") != std::string::npos);
  CHECK(help.find("--k: steps between syncs of fl_fsdp, fl_hsdp, fl_hsdp_int8, sparseloco, "
                  "fomoe, fl_scape_fsdp, hofl, lss, fcp, feast, collate (default 8)") !=
        std::string::npos);
  CHECK(help.find("--h: inner steps of diloco, streaming_diloco, gasloc (default 16)") !=
        std::string::npos);
  CHECK(help.find("SCAPE (shard::sparse) in the rows scape_fsdp, fl_scape_fsdp:") !=
        std::string::npos);
  CHECK(help.find("default copies G - 1, at least 1): fomoe") != std::string::npos);
}

TEST_CASE("demo on two sites of different sizes: --group-shapes") {
  const demo::settings s = parse({"--group-shapes", "2x2,1x2", "--slow-site", "1"});
  CHECK(s.ranks == 6);
  CHECK(s.groups == 2);
  CHECK(s.group_shapes == std::vector<fedshard::group_shape>{{2, 2}, {1, 2}});
  const auto t = demo::topology_of(s);
  CHECK(t.site_of_rank == std::vector<int>{0, 0, 0, 0, 1, 1});
  CHECK(t.transfer_seconds(1e6, {0, 1}) ==
        doctest::Approx(
            s.slow_factor *
            demo::topology_of(parse({"--group-shapes", "2x2,1x2"})).transfer_seconds(1e6, {0, 1})));
}
