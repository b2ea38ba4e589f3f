// The simulator refuses settings that are not physical where they enter: cluster::check
// (run by placement, price and price_hetero_sync), link_level::check, workload::check and
// compute_model, each naming the setting, what it expects and what it found.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>

#include "fedshard/sim/compute.hpp"
#include "fedshard/sim/hetero.hpp"
#include "fedshard/sim/price.hpp"
#include "fedshard/sim/topology.hpp"
#include "support/sim.hpp"

using namespace fedshard;
using namespace fedshard::sim;
using namespace fedshard::test;  // the fixtures of support/sim.hpp

namespace {

constexpr double inf = std::numeric_limits<double>::infinity();
const double not_a_number = std::numeric_limits<double>::quiet_NaN();

/// True when f throws invalid_argument whose message holds every one of parts.
template <class F>
bool refused_with(F&& f, std::initializer_list<const char*> parts) {
  const std::string m = error_of(std::forward<F>(f));
  if (m.empty()) return false;
  for (const char* p : parts)
    if (m.find(p) == std::string::npos) {
      MESSAGE("message '", m, "' lacks '", p, "'");
      return false;
    }
  return true;
}

}  // namespace

TEST_CASE("the presets and a cluster whose links are free pass the checks") {
  CHECK_NOTHROW(a100_4gpu_node().check());
  CHECK_NOTHROW(h100_8gpu_node().check());
  CHECK_NOTHROW(free_links(a100_4gpu_node()).check());  // alpha 0, bandwidth inf
  cluster c = a100_4gpu_node();
  c.memory_bandwidth = 0;  // 0: codec passes priced at nothing
  c.peak_flops = 0;        // 0: unknown (sim::compute_model refuses it when used)
  CHECK_NOTHROW(c.check());
}

TEST_CASE("negative, zero and NaN bandwidths are refused, naming the level") {
  for (const double bad : {-1.0, 0.0, not_a_number}) {
    CAPTURE(bad);
    cluster c = a100_4gpu_node();
    c.intra.bandwidth = bad;
    CHECK(refused_with([&] { c.check(); }, {"sim::cluster 'a100-4gpu-node': intra.bandwidth",
                                            "expected a bandwidth > 0"}));
    c = a100_4gpu_node();
    c.nic_bandwidth = bad;
    CHECK(refused_with([&] { c.check(); }, {"nic_bandwidth: expected a bandwidth > 0"}));
    c = a100_4gpu_node();
    c.sites = 2;
    c.wan.bandwidth = bad;
    CHECK(refused_with([&] { c.check(); }, {"wan.bandwidth"}));
  }
  // The WAN is not checked while there is one site, nor NVLink with one GPU per node.
  cluster c = a100_4gpu_node();
  c.wan.bandwidth = -1;
  CHECK_NOTHROW(c.check());
  c.gpus_per_node = 1;
  c.nics_per_node = 1;
  c.intra.bandwidth = 0;
  CHECK_NOTHROW(c.check());
}

TEST_CASE("negative, infinite and NaN latencies are refused") {
  for (const double bad : {-1e-6, inf, not_a_number}) {
    CAPTURE(bad);
    cluster c = a100_4gpu_node();
    c.intra.alpha = bad;
    CHECK(refused_with([&] { c.check(); }, {"intra.alpha: expected a finite latency >= 0"}));
    c = a100_4gpu_node();
    c.inter.alpha = bad;
    CHECK(refused_with([&] { c.check(); }, {"inter.alpha"}));
    c = a100_4gpu_node();
    c.op_latency = bad;
    CHECK(refused_with([&] { c.check(); }, {"op_latency: expected a finite latency >= 0"}));
    c = a100_4gpu_node();
    c.sites = 4;
    c.wan.alpha = bad;
    CHECK(refused_with([&] { c.check(); }, {"wan.alpha"}));
  }
}

TEST_CASE("counts, FLOP rates, MFU and oversubscription out of range are refused") {
  cluster c = a100_4gpu_node();
  for (int bad : {0, -4}) {
    c = a100_4gpu_node();
    c.gpus_per_node = bad;
    CHECK(refused_with([&] { c.check(); }, {"gpus_per_node, nics_per_node and sites >= 1"}));
    c = a100_4gpu_node();
    c.sites = bad;
    CHECK(refused_with([&] { c.check(); }, {"sites >= 1"}));
    c = a100_4gpu_node();
    c.nics_per_node = bad;
    CHECK(refused_with([&] { c.check(); }, {"nics_per_node"}));
  }
  for (const double bad : {-312e12, inf, not_a_number}) {
    c = a100_4gpu_node();
    c.peak_flops = bad;
    CHECK(refused_with([&] { c.check(); }, {"peak_flops: expected a finite FLOP rate >= 0"}));
  }
  for (const double bad : {0.0, -0.5, 1.5, not_a_number}) {
    c = a100_4gpu_node();
    c.default_mfu = bad;
    CHECK(refused_with([&] { c.check(); }, {"default_mfu: expected a fraction in (0, 1]"}));
  }
  for (const double bad : {0.5, 0.0, -2.0, inf, not_a_number}) {
    c = a100_4gpu_node();
    c.inter.oversubscription = bad;
    CHECK(refused_with([&] { c.check(); },
                       {"inter.oversubscription: expected a finite factor >= 1"}));
  }
  c = a100_4gpu_node();
  c.memory_bandwidth = -1;
  CHECK(refused_with([&] { c.check(); }, {"memory_bandwidth"}));
  // A zero or NaN FLOP rate is refused where the FLOP model prices compute.
  CHECK(refused_with(
      [] {
        compute_model{0, 0.5}.seconds(gpt2_small(), 1, 8);
      },
      {"peak_flops > 0"}));
  CHECK(refused_with(
      [] {
        compute_model{not_a_number, 0.5}.seconds(gpt2_small(), 1, 8);
      },
      {"peak_flops"}));
  CHECK(refused_with([] { compute_model{inf, 0.5}.seconds(gpt2_small(), 1, 8); }, {"peak_flops"}));
}

TEST_CASE("pricing refuses a bad cluster before it prices anything") {
  cluster c = a100_4gpu_node();
  c.nic_bandwidth = -gbit_per_s(100);
  CHECK(refused_with([&] { (void)placement({2, 1, 4}, c); }, {"nic_bandwidth"}));
  CHECK(refused_with(
      [&] {
        price(algorithm_by_name("fsdp"), small_gpt(), {1, 1, 8}, c);
      },
      {"nic_bandwidth"}));
  c = a100_4gpu_node();
  c.wan.bandwidth = not_a_number;
  c.sites = 2;
  CHECK(refused_with(
      [&] {
        price(algorithm_by_name("fl_fsdp"), small_gpt(), {2, 1, 4}, c);
      },
      {"wan.bandwidth", "nan"}));
  CHECK(refused_with(
      [&] {
        price_hetero_sync(transformer_units(gpt2_small(), dtype::bf16), {{1, 4}, {1, 4}}, c);
      },
      {"wan.bandwidth"}));
}

TEST_CASE("a workload out of range is refused, naming the setting") {
  workload w = small_gpt();
  CHECK_NOTHROW(w.check());
  w.micro_batch = 0;
  CHECK(refused_with([&] { w.check(); }, {"micro_batch and seq must be >= 1, found 0"}));
  w = small_gpt();
  w.seq = -1;
  CHECK(refused_with([&] { w.check(); }, {"micro_batch and seq"}));
  for (const double bad : {-0.1, 1.5, not_a_number}) {
    w = small_gpt();
    w.mfu = bad;
    CHECK(refused_with([&] { w.check(); }, {"mfu must be in [0, 1]"}));
  }
  for (const double bad : {-1e-3, inf, not_a_number}) {
    w = small_gpt();
    w.seconds_per_token = bad;
    CHECK(refused_with([&] { w.check(); }, {"seconds_per_token must be a finite number >= 0"}));
    CHECK(refused_with(
        [&] {
          price(algorithm_by_name("fsdp"), w, {1, 1, 8}, a100_4gpu_node());
        },
        {"seconds_per_token"}));
  }
  w = small_gpt();
  w.model.heads = 5;  // does not divide d_model 768
  CHECK(refused_with([&] { w.check(); }, {"heads must divide d_model"}));
}

TEST_CASE("a local rule out of range is refused where the alias is described, naming both") {
  // algorithm_settings::local (fedshard-sim's --zo-* and --soup-*) is checked by
  // algorithm_by_name; an unknown unit name when the units are laid out (price).
  algorithm_settings s;
  s.local.zeroth_order = {.units = {"embed"}, .probes = 0};
  CHECK(refused_with([&] { algorithm_by_name("fl_fsdp", s); },
                     {"sim: fl_fsdp: sim: zeroth-order units need probes >= 1", "found 0"}));
  s.local = {.soup = {.members = 0}};
  CHECK_NOTHROW(algorithm_by_name("fl_fsdp", s));  // 0: no soup
  s.local.soup.members = 17;
  CHECK(refused_with([&] { algorithm_by_name("fl_fsdp", s); },
                     {"fl_fsdp", "0 (no soup) to 16 members, found 17"}));
  s.local = {.zeroth_order = {.units = {"layer99"}}};
  CHECK(refused_with(
      [&] {
        price(algorithm_by_name("fl_fsdp", s), small_gpt(), {2, 1, 4}, a100_4gpu_node());
      },
      {"no unit named 'layer99' for a zeroth-order unit", "'embed', 'layer0'"}));
}
