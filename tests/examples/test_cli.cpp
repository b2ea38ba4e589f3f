// examples/common/cli.hpp, the strict option parsing of the example programs: whole numbers,
// finite reals, lists and unknown options, each refusal a fedshard::invalid_argument naming
// the option; and a seeded random-input test that feeds 2000 random argument vectors to the
// demo's parser (demo::parse, also fedshard-sim --predict-demo's) and to a parser of every
// kind of option: each is accepted with every value in its range, or refused with
// fedshard::invalid_argument, never anything else.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "demo/demo_run.hpp"
#include "support/sim.hpp"

using fedshard::test::error_of;

namespace {

/// demo::parse of args (after the program's name).
demo::settings demo_parse(const std::vector<std::string>& args) {
  std::vector<char*> argv{const_cast<char*>("fedshard-demo")};
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  return demo::parse(static_cast<int>(argv.size()), argv.data());
}

}  // namespace

TEST_CASE("whole numbers: digits only, in range, never truncated or wrapped") {
  CHECK(cli::parse_integer<int>("--steps", "480", 1, 1000) == 480);
  CHECK(cli::parse_integer<int>("--delay", "-3", -5, 5) == -3);
  CHECK(cli::parse_integer<std::uint64_t>("--seed", "18446744073709551615", 0,
                                          std::numeric_limits<std::uint64_t>::max()) ==
        std::numeric_limits<std::uint64_t>::max());
  for (const char* bad :
       {"2.5", "1e3", "8x", " 8", "8 ", "+8", "", "0x10", "abc", "1e10", "0", "1001", "-1"}) {
    CAPTURE(bad);
    CHECK(error_of([&] { cli::parse_integer<int>("--steps", bad, 1, 1000); }) ==
          std::string("--steps expects a whole number in [1, 1000], found '") + bad + "'");
  }
  // Beyond the type's range: the option's range, not an overflow.
  CHECK(error_of([] { cli::parse_integer<int>("--steps", "99999999999999999999", 1, 10); }) ==
        "--steps expects a whole number in [1, 10], found '99999999999999999999'");
  CHECK(error_of([] {
          cli::parse_integer<std::uint64_t>("--seed", "18446744073709551616", 0, 100);
        }).find("[0, 100]") != std::string::npos);
}

TEST_CASE("real numbers: finite, inside closed or open bounds") {
  CHECK(cli::parse_real("--lr", "3e-3", cli::closed(0, 10)) == 3e-3);
  CHECK(cli::parse_real("--lr", "0", cli::closed(0, 10)) == 0);
  CHECK(cli::parse_real("--d", "1", cli::above(0, 1)) == 1);
  CHECK(cli::parse_real("--d", "-0.25", cli::closed(-1, 1)) == -0.25);
  for (const char* bad : {"0", "5", "nan", "inf", "-inf", "", "0.5x", "1,5", " 0.5", "0x1p-1"}) {
    CAPTURE(bad);
    CHECK(error_of([&] { cli::parse_real("--scape-density", bad, cli::above(0, 1)); }) ==
          std::string("--scape-density expects a finite number in (0, 1], found '") + bad + "'");
  }
  CHECK(error_of([] { cli::parse_real("--x", "1e999", cli::closed(0, 1e9)); }) ==
        "--x expects a finite number in [0, 1e+09], found '1e999'");
  // Control characters are shown escaped, a long text cut.
  CHECK(error_of([] { cli::parse_real("--x", "1\n", cli::closed(0, 1)); }) ==
        "--x expects a finite number in [0, 1], found '1\\x0a'");
  CHECK(error_of([] {
          cli::parse_real("--x", std::string(100, '7'), cli::closed(0, 1));
        }).find("found '" + std::string(60, '7') + "...'") != std::string::npos);
}

TEST_CASE("lists: at least one item, none empty") {
  CHECK(cli::parse_items("--algorithms", "ddp") == std::vector<std::string>{"ddp"});
  CHECK(cli::parse_items("--algorithms", "ddp,fsdp") == std::vector<std::string>{"ddp", "fsdp"});
  for (const char* bad : {"", ",", "ddp,", ",ddp", "ddp,,fsdp"}) {
    CAPTURE(bad);
    CHECK(error_of([&] { cli::parse_items("--algorithms", bad); }) ==
          std::string("--algorithms expects a comma-separated list of non-empty items, found '") +
              bad + "'");
  }
}

TEST_CASE("a parser fills its targets and refuses missing values and unknown options") {
  int steps = 1;
  double lr = 0;
  float f = 0;
  std::optional<int> k;
  std::string out;
  bool quick = false;
  cli::parser p;
  p.integer("--steps", steps, 1, 100)
      .real("--lr", lr, cli::closed(0, 1))
      .real("--f", f, cli::closed(0, 2))
      .integer("--K", k, 1, 8)
      .alias("--k", "--K")
      .text("--out", out)
      .flag("--quick", quick);
  p.parse({"--steps", "7", "--lr", "0.5", "--f", "1.5", "--k", "4", "--out", "x", "--quick"});
  CHECK(steps == 7);
  CHECK(lr == 0.5);
  CHECK(f == 1.5f);
  CHECK(k == 4);
  CHECK(out == "x");
  CHECK(quick);
  p.parse({"--steps", "9", "--steps", "3"});  // the last one counts
  CHECK(steps == 3);
  CHECK(error_of([&] { p.parse({"--steps"}); }) == "--steps expects a value, found nothing");
  CHECK(error_of([&] {
          p.parse({"--out", "--steps", "3"});
        }) == "--out expects a value, found the option '--steps'");
  CHECK(error_of([&] {
          p.parse({"--out", ""});
        }) == "--out expects a value, found an empty argument");
  CHECK(error_of([&] {
          p.parse({"--stpes", "3"});
        }) == "unknown option '--stpes' (--help lists the options)");
  CHECK(error_of([&] { p.parse({"steps"}); }) ==
        "unknown option 'steps' (--help lists the options)");
  CHECK(error_of([&] {
          p.parse({"--k", "9"});
        }) == "--k expects a whole number in [1, 8], found '9'");
  // A custom handler's invalid_argument is prefixed with the option when it does not name it.
  p.custom("--shape", [](const std::string&, const std::string& v) {
    cli::fail("expected RxS, found '" + v + "'");
  });
  CHECK(error_of([&] { p.parse({"--shape", "2y2"}); }) == "--shape: expected RxS, found '2y2'");
}

TEST_CASE("run_main: bad input exits 2, a failure 1, success its own status") {
  CHECK(cli::run_main("p", [] { return 0; }) == 0);
  CHECK(cli::run_main("p", [] { return 7; }) == 7);
  CHECK(cli::run_main("p", []() -> int { cli::fail("--x expects 1, found 2"); }) == 2);
  CHECK(cli::run_main("p", []() -> int { throw fedshard::backend_error("disk full"); }) == 1);
  CHECK(cli::run_main("p", []() -> int { throw std::runtime_error("boom"); }) == 1);
  CHECK(cli::run_main("p", []() -> int { throw 42; }) == 1);
}

TEST_CASE("the demo's parser refuses the bad inputs of issue 28 and keeps its defaults") {
  const demo::settings d = demo_parse({});
  CHECK(d.steps == 480);
  CHECK(d.algorithms.size() == 8);
  CHECK(demo_parse({"--steps", "16", "--scape-density", "1", "--algorithms", "ddp,fl_scape_fsdp"})
            .steps == 16);
  const std::vector<std::pair<std::vector<std::string>, std::string>> bad{
      {{"--steps", "2.5"}, "--steps expects a whole number in [1, 10000000], found '2.5'"},
      {{"--steps", "1e10"}, "--steps expects a whole number in [1, 10000000], found '1e10'"},
      {{"--hidden", "1000000"}, "--hidden expects a whole number in [1, 4096], found '1000000'"},
      {{"--scape-density", "5"}, "--scape-density expects a finite number in (0, 1], found '5'"},
      {{"--algorithms", ""}, "--algorithms expects a value, found an empty argument"},
      {{"--algorithms", ","}, "--algorithms expects a comma-separated list"},
      {{"--algorithms", "ddp,nosuch"},
       "--algorithms expects names from ddp,zero2,fsdp,hsdp,fl_fsdp,fl_hsdp,fl_hsdp_int8,diloco,"
       "streaming_diloco,sparseloco,gasloc,fomoe,scape_fsdp,fl_scape_fsdp,hofl,lss,fcp,feast,"
       "collate, found "
       "'nosuch'"},
      {{"--algorithms", "scape"}, "--algorithms expects names from ddp,"},
      {{"--algorithms", "fomoe"}, "--algorithms fomoe needs the model's experts"},
      {{"--ranks", "6", "--groups", "4"}, "--ranks 6 do not split into --groups 4"},
      {{"--slow-site", "2"}, "--slow-site 2 is not one of the 2 sites"},
      {{"--eval-examples", "8", "--ranks", "16"}, "--eval-examples expects at least one example"},
      {{"--group-shapes", "200x2"}, "--group-shapes expects at most 256 ranks in all, found 400"},
      {{"--group-shapes", "2x"}, "--group-shapes: "},
      {{"--scape-per-tensor", "yes"}, "--scape-per-tensor expects a whole number in [0, 1]"},
  };
  for (const auto& [args, message] : bad) {
    CAPTURE(args.front());
    const std::string m = error_of([&] { demo_parse(args); });
    CHECK_MESSAGE(m.rfind(message, 0) == 0, m);
  }
}

TEST_CASE("2000 random argument vectors: accepted within range or refused, nothing else") {
  std::mt19937_64 rng(20250528);  // fixed: the same vectors on every run
  const std::vector<std::string> options{"--corpus",
                                         "--steps",
                                         "--batch",
                                         "--hidden",
                                         "--experts",
                                         "--expert-hidden",
                                         "--expert-copies",
                                         "--ranks",
                                         "--groups",
                                         "--group-shapes",
                                         "--slow-site",
                                         "--slow-factor",
                                         "--eval-every",
                                         "--eval-examples",
                                         "--bandwidth-gbit",
                                         "--latency-ms",
                                         "--lr",
                                         "--seed",
                                         "--out",
                                         "--k",
                                         "--h",
                                         "--fragments",
                                         "--delay",
                                         "--scape-density",
                                         "--scape-refresh",
                                         "--scape-dense-steps",
                                         "--scape-dense-every",
                                         "--scape-per-tensor",
                                         "--scape-dense-below",
                                         "--algorithms",
                                         "--bogus",
                                         "-",
                                         "--",
                                         "steps"};
  const std::vector<std::string> values{"0",
                                        "1",
                                        "2",
                                        "8",
                                        "-1",
                                        "2.5",
                                        "1e10",
                                        "1e-300",
                                        "nan",
                                        "inf",
                                        "-inf",
                                        "",
                                        " ",
                                        "8x",
                                        "x8",
                                        "0x10",
                                        "4096",
                                        "4097",
                                        "65536",
                                        "2147483647",
                                        "2147483648",
                                        "-2147483649",
                                        "18446744073709551615",
                                        "18446744073709551616",
                                        "99999999999999999999999",
                                        "0.05",
                                        "1e309",
                                        ",",
                                        "ddp",
                                        "ddp,fsdp",
                                        "ddp,,fsdp",
                                        "fomoe",
                                        "scape",
                                        "2x2,1x2",
                                        "0x1",
                                        "2x",
                                        "3x3,3x3",
                                        "\xff\xfe",
                                        "a\nb",
                                        std::string(300, '9'),
                                        "--steps",
                                        "-5e-1"};
  auto pick = [&](const std::vector<std::string>& v) {
    return v[static_cast<std::size_t>(rng() % v.size())];
  };
  auto random_text = [&] {
    std::string s(rng() % 12, ' ');
    for (char& c : s) c = static_cast<char>(rng() % 256);
    return s;
  };

  // A parser of every kind of option, next to the demo's own.
  int i = 0;
  std::int64_t big = 0;
  std::uint64_t u = 0;
  double r = 0.5;  // in range: only a value given changes it
  float f = 0;
  std::optional<int> oi;
  std::string text;
  std::vector<std::string> items;
  bool flag = false;
  cli::parser p;
  p.integer("--steps", i, -10, 1000)
      .integer("--k", big, 0, std::int64_t{1} << 40)
      .integer("--seed", u, 0, std::numeric_limits<std::uint64_t>::max())
      .real("--lr", r, cli::above(0, 1))
      .real("--hidden", f, cli::closed(-1, 1e30))
      .integer("--h", oi, 1, 8)
      .text("--out", text)
      .custom("--algorithms",
              [&](const std::string& o, const std::string& v) { items = cli::parse_items(o, v); })
      .flag("--bogus", flag)
      .alias("--ranks", "--steps");

  const auto start = std::chrono::steady_clock::now();
  int accepted = 0, refused = 0;
  for (int n = 0; n < 2000; ++n) {
    std::vector<std::string> args;
    const int count = static_cast<int>(rng() % 9);
    for (int a = 0; a < count; ++a) {
      const auto kind = rng() % 8;
      args.push_back(kind < 4 ? pick(options) : kind < 7 ? pick(values) : random_text());
    }
    std::string shown;
    for (const auto& a : args) shown += " '" + a + "'";
    CAPTURE(shown);
    try {
      const demo::settings s = demo_parse(args);
      ++accepted;
      CHECK((s.steps >= 1 && s.steps <= demo::max_steps));
      CHECK((s.hidden >= 1 && s.hidden <= demo::max_hidden));
      CHECK((s.ranks >= 1 && s.ranks <= demo::max_ranks));
      CHECK((s.scape_density > 0 && s.scape_density <= 1));
      CHECK((std::isfinite(s.lr) && s.lr >= 0));
      CHECK((std::isfinite(s.latency_ms) && s.bandwidth_gbit > 0));
      CHECK(!s.algorithms.empty());
      CHECK(s.eval_examples >= s.ranks);
      CHECK(s.ranks % s.groups == 0);
    } catch (const fedshard::invalid_argument& e) {
      ++refused;
      CHECK(std::string(e.what()).size() > 0);
    }  // anything else fails the test case
    try {
      p.parse(args);
      CHECK((i >= -10 && i <= 1000));
      CHECK((r > 0 && r <= 1));
      CHECK(std::isfinite(f));
      CHECK((!oi || (*oi >= 1 && *oi <= 8)));
      for (const auto& item : items) CHECK(!item.empty());
    } catch (const fedshard::invalid_argument&) {
    }
  }
  // Both outcomes occur; the whole run is bounded (it takes well under a second).
  CHECK(accepted > 20);
  CHECK(refused > 1000);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(60));
}
