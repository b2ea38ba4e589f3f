#pragma once
/// Calibration of the simulator from measured collectives.
///
/// What is measured: the time of one collective of S bytes (S the whole array, nccl-tests'
/// convention: the all_reduce and broadcast buffer, the all_gather output, the reduce_scatter
/// input) over n ranks, on one communicator alone, at several sizes. Three inputs are read:
///  - nccl-tests' text output (all_reduce_perf, all_gather_perf, reduce_scatter_perf,
///    broadcast_perf): the out-of-place time of each data row; the kind from the
///    "# Collective test starting:" header or the file name, the ranks from the
///    "#  Rank N ... on HOST device ..." header lines, the level from their hosts;
///  - Google Benchmark JSON (--benchmark_out) of bench/bench_collectives.cpp: benchmarks named
///    ".../<kind>/bytes:S/ranks:n/...", their real_time;
///  - the CSV of bench/bench_collectives_mpi.cpp (impl,op,bytes,ranks,...,seconds_per_iter,...).
///
/// The model, per (kind, ranks, level): t = latency + bus_factor(kind, n) x S / busbw, with
/// bus_factor as nccl-tests (2(n-1)/n for all_reduce, (n-1)/n for all_gather and
/// reduce_scatter, 1 for broadcast), so busbw is the figure nccl-tests prints for large S.
/// latency and 1 / busbw are fitted by least squares on relative errors (the sizes span
/// decades, so each point counts alike), with latency >= 0 (when the free fit's intercept
/// is negative, the slope alone is fitted through the origin).
///
/// The fitted constants price collectives when installed in cluster::measured (see
/// price_collective in collective_cost.hpp).

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <istream>
#include <iterator>
#include <limits>
#include <optional>
#include <ostream>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/sim/detail/json.hpp"
#include "fedshard/sim/topology.hpp"

namespace fedshard::sim {

/// One measured time of a collective.
struct measured_point {
  comm_kind kind = comm_kind::all_reduce;
  int ranks = 1;
  level_kind level = level_kind::intra;
  double bytes = 0;      ///< S: the whole array (nccl-tests' size column)
  double seconds = 0;    ///< one call
  std::string source{};  ///< "file:line" or "file: benchmark name"
};

/// Settings that replace what a file says (or does not say) about its measurements.
struct measurement_overrides {
  std::optional<comm_kind> kind{};
  std::optional<int> ranks{};
  std::optional<level_kind> level{};
};

/// One point of a fit with the model's time and its relative residual (model - t) / t.
struct fitted_point {
  double bytes = 0;
  double seconds = 0;  ///< measured
  double model = 0;    ///< latency + bus_factor x bytes / bus_bandwidth
  double residual = 0;
  std::string source{};
};

/// The constants of one (kind, ranks, level) and how well they fit.
struct fitted_collective {
  comm_kind kind = comm_kind::all_reduce;
  int ranks = 1;
  level_kind level = level_kind::intra;
  double latency = 0;            ///< seconds, >= 0
  double bus_bandwidth = 0;      ///< bytes/s (nccl-tests busbw)
  bool latency_clamped = false;  ///< the free fit's latency was negative: fitted through 0
  double rms_residual = 0;       ///< root mean square of the relative residuals
  double max_residual = 0;       ///< largest |relative residual|
  std::vector<fitted_point> points{};

  /// The model's time for S = bytes.
  double seconds(double bytes) const noexcept {
    return latency + bus_factor(kind, ranks) * bytes / bus_bandwidth;
  }
};

/// Fitted constants of every measured (kind, ranks, level).
struct calibration {
  std::vector<fitted_collective> collectives;  ///< sorted by level, kind, ranks

  /// The fit of exactly (kind, level, ranks), or nullptr.
  const fitted_collective* find(comm_kind k, level_kind l, int ranks) const noexcept {
    for (const auto& f : collectives)
      if (f.kind == k && f.level == l && f.ranks == ranks) return &f;
    return nullptr;
  }
  /// The fit of (kind, level) whose rank count is nearest to ranks (the larger on a tie), or
  /// nullptr when that kind and level were not measured.
  const fitted_collective* nearest(comm_kind k, level_kind l, int ranks) const noexcept {
    const fitted_collective* best = nullptr;
    for (const auto& f : collectives) {
      if (f.kind != k || f.level != l) continue;
      const int d = std::abs(f.ranks - ranks);
      const int bd = best ? std::abs(best->ranks - ranks) : 0;
      if (!best || d < bd || (d == bd && f.ranks > best->ranks)) best = &f;
    }
    return best;
  }
  /// "all_reduce nvlink (8 ranks), all_gather network (16 ranks)": what was measured.
  std::string summary() const {
    std::string s;
    for (const auto& f : collectives)
      s += (s.empty() ? "" : ", ") + std::string(to_string(f.kind)) + " " +
           std::string(to_string(f.level)) + " (" + std::to_string(f.ranks) + " ranks)";
    return s;
  }
};

/// The level called name: intra (or nvlink), inter (or network), wan; invalid_argument
/// otherwise.
inline level_kind parse_level_kind(std::string_view name) {
  if (name == "intra" || name == "nvlink") return level_kind::intra;
  if (name == "inter" || name == "network") return level_kind::inter;
  if (name == "wan") return level_kind::wan;
  FEDSHARD_EXPECTS(false, "sim: unknown level '", name, "', expected intra, inter or wan");
  return level_kind::intra;
}

/// The collective called name: all_reduce, all_gather, reduce_scatter or broadcast;
/// invalid_argument otherwise.
inline comm_kind parse_measured_kind(std::string_view name) {
  for (auto k : {comm_kind::all_reduce, comm_kind::all_gather, comm_kind::reduce_scatter,
                 comm_kind::broadcast})
    if (name == to_string(k)) return k;
  FEDSHARD_EXPECTS(false, "sim: unknown collective '", name,
                   "', expected all_reduce, all_gather, reduce_scatter or broadcast");
  return comm_kind::all_reduce;
}

namespace detail {

inline std::vector<std::string> split_words(std::string_view line) {
  std::vector<std::string> out;
  std::istringstream is{std::string(line)};
  for (std::string w; is >> w;) out.push_back(w);
  return out;
}

inline std::vector<std::string> split_on(std::string_view s, char sep) {
  std::vector<std::string> out;
  std::size_t from = 0;
  for (;;) {
    const std::size_t at = s.find(sep, from);
    out.emplace_back(s.substr(from, at == std::string_view::npos ? s.npos : at - from));
    if (at == std::string_view::npos) return out;
    from = at + 1;
  }
}

/// The whole of word as a finite number, or nothing.
inline std::optional<double> number_of(const std::string& word) {
  if (word.empty()) return std::nullopt;
  char* end = nullptr;
  const double d = std::strtod(word.c_str(), &end);
  if (*end != '\0' || !std::isfinite(d)) return std::nullopt;
  return d;
}

/// True when word is digits only.
inline bool is_count(std::string_view word) {
  return !word.empty() &&
         std::all_of(word.begin(), word.end(), [](char c) { return c >= '0' && c <= '9'; });
}

/// The collective a name mentions (all_reduce_perf, allreduce, bm_inproc/all_gather/...).
inline std::optional<comm_kind> kind_in_name(std::string_view name) {
  std::string s(name);
  for (char& c : s)
    c = c == '-' ? '_' : static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const std::pair<std::string_view, comm_kind> names[] = {
      {"all_reduce", comm_kind::all_reduce},
      {"allreduce", comm_kind::all_reduce},
      {"all_gather", comm_kind::all_gather},
      {"allgather", comm_kind::all_gather},
      {"reduce_scatter", comm_kind::reduce_scatter},
      {"reducescatter", comm_kind::reduce_scatter},
      {"broadcast", comm_kind::broadcast}};
  for (const auto& [n, k] : names)
    if (s.find(n) != std::string::npos) return k;
  return std::nullopt;
}

/// The collective a benchmark-name component is exactly, or nothing.
inline std::optional<comm_kind> kind_named(std::string_view word) {
  for (auto k : {comm_kind::all_reduce, comm_kind::all_gather, comm_kind::reduce_scatter,
                 comm_kind::broadcast})
    if (word == to_string(k)) return k;
  return std::nullopt;
}

inline std::string read_all(std::istream& in) {
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// What parse_nccl_tests gathers from nccl-tests' output line by line.
struct nccl_tests_scan {
  /// A data row: the size in bytes, the out-of-place seconds, and where it was read.
  struct row {
    double bytes, seconds;
    int line;
  };
  std::optional<comm_kind> header_kind;  ///< from "# Collective test starting: <name>"
  std::set<int> ranks_seen;              ///< from "#  Rank N ... on HOST device D"
  std::set<std::string> hosts;
  std::size_t time_column = 5;  ///< size count type redop root time
  std::vector<row> rows;
};

/// Reads the comment line `line` (line number `number`; its '#' at `first`) into scan: the
/// collective tested, a rank and its host, or the column header.
inline void read_nccl_comment(nccl_tests_scan& scan, const std::string& line, std::size_t first,
                              const std::string& source, int number,
                              const measurement_overrides& o) {
  const std::string body = line.substr(first + 1);
  const auto words = split_words(body);
  if (words.empty()) return;
  const std::size_t starting = body.find("Collective test starting:");
  if (starting != std::string::npos) {
    scan.header_kind = kind_in_name(body.substr(starting));
    FEDSHARD_EXPECTS(scan.header_kind || o.kind, "sim: ", source, ":", number,
                     ": expected a test of all_reduce, all_gather, reduce_scatter or "
                     "broadcast, found '",
                     body.substr(starting + 25), "'");
  } else if (words[0] == "Rank" && words.size() >= 2 && is_count(words[1])) {
    scan.ranks_seen.insert(std::atoi(words[1].c_str()));
    const auto on = std::find(words.begin(), words.end(), "on");
    FEDSHARD_EXPECTS(on != words.end() && on + 1 != words.end(), "sim: ", source, ":", number,
                     ": expected a rank line '#  Rank N ... on HOST device D ...', found '", line,
                     "'");
    scan.hosts.insert(*(on + 1));
  } else if (words[0] == "size") {
    const auto t = std::find(words.begin(), words.end(), "time");
    FEDSHARD_EXPECTS(t != words.end(), "sim: ", source, ":", number,
                     ": expected a 'time' column in the header, found '", line, "'");
    scan.time_column = static_cast<std::size_t>(t - words.begin());
  }
}

/// Reads the line `line` (not a comment) into scan's rows when it is a data row: its first
/// word is a number.
inline void read_nccl_row(nccl_tests_scan& scan, const std::string& line, const std::string& source,
                          int number) {
  const auto words = split_words(line);
  if (!number_of(words[0])) return;  // a log line, not a data row
  const std::size_t time_column = scan.time_column;
  FEDSHARD_EXPECTS(is_count(words[0]), "sim: ", source, ":", number,
                   ": expected the size in bytes (a whole number) in the first column, found '",
                   words[0], "'");
  FEDSHARD_EXPECTS(words.size() >= time_column + 3, "sim: ", source, ":", number,
                   ": expected a data row of at least ", time_column + 3,
                   " columns (size, count, type, redop, root, time(us), algbw, busbw, ...), "
                   "found ",
                   words.size(), ": '", line, "'");
  const auto us = number_of(words[time_column]);
  FEDSHARD_EXPECTS(us && *us > 0, "sim: ", source, ":", number,
                   ": expected the out-of-place time in us (a positive number) in column ",
                   time_column + 1, ", found '", words[time_column], "'");
  scan.rows.push_back({std::strtod(words[0].c_str(), nullptr), *us * 1e-6, number});
}

/// The measured points of a whole scan: its rows with the kind, ranks and level the output
/// says (or o sets).
inline std::vector<measured_point> points_of(const nccl_tests_scan& scan, const std::string& source,
                                             const measurement_overrides& o) {
  FEDSHARD_EXPECTS(!scan.rows.empty(), "sim: ", source,
                   ": expected nccl-tests data rows (size count type redop root time algbw "
                   "busbw ...), found none");
  const std::optional<comm_kind> kind =
      o.kind             ? o.kind
      : scan.header_kind ? scan.header_kind
                         : kind_in_name(source.substr(source.find_last_of("/\\") + 1));
  FEDSHARD_EXPECTS(kind.has_value(), "sim: ", source,
                   ": cannot tell which collective was measured (no '# Collective test "
                   "starting: <name>_perf' header, and the file name does not say all_reduce, "
                   "all_gather, reduce_scatter or broadcast); say which explicitly "
                   "(measurement_overrides::kind, "
                   "fedshard-sim --calibrate-kind)");
  const int ranks = o.ranks ? *o.ranks : static_cast<int>(scan.ranks_seen.size());
  FEDSHARD_EXPECTS(ranks >= 2, "sim: ", source, ": expected ",
                   o.ranks ? "a rank count >= 2" : "'#  Rank N ... on HOST device D' header lines",
                   " for at least 2 ranks, found ", ranks,
                   o.ranks ? ""
                           : "; give the rank count explicitly (measurement_overrides::ranks, "
                             "fedshard-sim --calibrate-ranks)");
  const level_kind level = o.level                 ? *o.level
                           : scan.hosts.size() > 1 ? level_kind::inter
                                                   : level_kind::intra;
  std::vector<measured_point> out;
  for (const nccl_tests_scan::row& r : scan.rows)
    out.push_back({.kind = *kind,
                   .ranks = ranks,
                   .level = level,
                   .bytes = r.bytes,
                   .seconds = r.seconds,
                   .source = source + ":" + std::to_string(r.line)});
  return out;
}

}  // namespace detail

/// The measurements in nccl-tests' text output read from in (source names it in errors and
/// in each point). Data rows are lines whose first word is a number: size, count, type,
/// redop, root, time (us), algbw, busbw, #wrong, then the in-place repeat; the time column is
/// found from the "#  size count ... time" header when there is one (older nccl-tests have
/// no redop or root column for some collectives). Lines whose first word is not a number
/// (headers, NCCL or MPI log lines) are skipped. invalid_argument naming source:line for a
/// malformed row, and when the kind or the ranks cannot be told (set them in o).
inline std::vector<measured_point> parse_nccl_tests(std::istream& in, const std::string& source,
                                                    const measurement_overrides& o = {}) {
  detail::nccl_tests_scan scan;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const std::size_t first = line.find_first_not_of(" \t");
    if (first == std::string::npos) continue;
    if (line[first] == '#')
      detail::read_nccl_comment(scan, line, first, source, number, o);
    else
      detail::read_nccl_row(scan, line, source, number);
  }
  return detail::points_of(scan, source, o);
}

/// The measurements in Google Benchmark JSON (--benchmark_out) read from in: every
/// benchmark whose name has a collective component and "bytes:S" and "ranks:n" components
/// (bench/bench_collectives.cpp: "bm_inproc/all_reduce/bytes:4096/ranks:2/manual_time"),
/// timed by real_time in time_unit. Aggregates (run_type other than "iteration") and errored
/// or skipped runs are left out, and so are benchmarks that are not collectives (bm_memcpy).
/// invalid_argument naming source:line for malformed JSON or a collective benchmark without
/// its sizes or time.
inline std::vector<measured_point> parse_benchmark_json(std::istream& in, const std::string& source,
                                                        level_kind level = level_kind::intra) {
  const std::string text = detail::read_all(in);
  const detail::json_value doc = detail::parse_json(text, source);
  const detail::json_value* list = doc.find("benchmarks");
  FEDSHARD_EXPECTS(list && list->as_array(), "sim: ", source,
                   ": expected Google Benchmark JSON (an object with a \"benchmarks\" array), "
                   "found none");
  std::vector<measured_point> out;
  for (const detail::json_value& b : *list->as_array()) {
    const auto where = [&] { return source + ":" + std::to_string(b.line); };
    const detail::json_value* name = b.find("name");
    FEDSHARD_EXPECTS(name && name->as_string(), "sim: ", where(),
                     ": expected a benchmark with a \"name\" string");
    const std::string& n = *name->as_string();
    std::optional<comm_kind> kind;
    std::optional<double> bytes, ranks;
    for (const std::string& part : detail::split_on(n, '/')) {
      if (auto k = detail::kind_named(part)) kind = k;
      if (part.rfind("bytes:", 0) == 0) bytes = detail::number_of(part.substr(6));
      if (part.rfind("ranks:", 0) == 0) ranks = detail::number_of(part.substr(6));
    }
    if (!kind) continue;  // not a collective (bm_memcpy)
    if (const auto* r = b.find("run_type"); r && r->as_string() && *r->as_string() != "iteration")
      continue;
    if (const auto* e = b.find("error_occurred"); e && e->as_bool() && *e->as_bool()) continue;
    if (const auto* s = b.find("skipped"); s && s->as_bool() && *s->as_bool()) continue;
    FEDSHARD_EXPECTS(bytes && *bytes >= 0 && ranks && *ranks >= 2, "sim: ", where(), ": ", n,
                     ": expected 'bytes:S' and 'ranks:n' (n >= 2) in the name of a collective "
                     "benchmark");
    const detail::json_value* time = b.find("real_time");
    const detail::json_value* unit = b.find("time_unit");
    FEDSHARD_EXPECTS(time && time->as_number() && *time->as_number() > 0, "sim: ", where(), ": ", n,
                     ": expected a positive \"real_time\"");
    double scale = 1e-9;  // Google Benchmark's default unit
    if (unit) {
      const std::string* u = unit->as_string();
      FEDSHARD_EXPECTS(u && (*u == "ns" || *u == "us" || *u == "ms" || *u == "s"), "sim: ", where(),
                       ": ", n, ": expected \"time_unit\" ns, us, ms or s");
      scale = *u == "ns" ? 1e-9 : *u == "us" ? 1e-6 : *u == "ms" ? 1e-3 : 1.0;
    }
    out.push_back({.kind = *kind,
                   .ranks = static_cast<int>(*ranks),
                   .level = level,
                   .bytes = *bytes,
                   .seconds = *time->as_number() * scale,
                   .source = source + ": " + n});
  }
  return out;
}

/// The measurements in the CSV bench/bench_collectives_mpi.cpp prints (a header line
/// "impl,op,bytes,ranks,iters,seconds_per_iter,algbw_GBps,busbw_GBps", then one line per
/// case). invalid_argument naming source:line for a malformed line.
inline std::vector<measured_point> parse_benchmark_csv(std::istream& in, const std::string& source,
                                                       level_kind level = level_kind::intra) {
  std::vector<std::string> header;
  std::vector<measured_point> out;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    const auto cells = detail::split_on(line, ',');
    if (header.empty()) {
      header = cells;
      continue;
    }
    const auto column = [&](std::string_view name) -> const std::string& {
      const auto at = std::find(header.begin(), header.end(), name);
      FEDSHARD_EXPECTS(at != header.end(), "sim: ", source,
                       ":1: expected a header with the columns op, bytes, ranks and "
                       "seconds_per_iter, found no '",
                       name, "'");
      const auto i = static_cast<std::size_t>(at - header.begin());
      FEDSHARD_EXPECTS(i < cells.size(), "sim: ", source, ":", number, ": expected ", header.size(),
                       " comma-separated cells, found ", cells.size());
      return cells[i];
    };
    const auto kind = detail::kind_named(column("op"));
    FEDSHARD_EXPECTS(kind.has_value(), "sim: ", source, ":", number,
                     ": expected op all_reduce, all_gather, reduce_scatter or broadcast, found '",
                     column("op"), "'");
    const auto bytes = detail::number_of(column("bytes"));
    const auto ranks = detail::number_of(column("ranks"));
    const auto seconds = detail::number_of(column("seconds_per_iter"));
    FEDSHARD_EXPECTS(bytes && *bytes >= 0 && ranks && *ranks >= 2 && seconds && *seconds > 0,
                     "sim: ", source, ":", number,
                     ": expected bytes >= 0, ranks >= 2 and seconds_per_iter > 0, found '", line,
                     "'");
    out.push_back({.kind = *kind,
                   .ranks = static_cast<int>(*ranks),
                   .level = level,
                   .bytes = *bytes,
                   .seconds = *seconds,
                   .source = source + ":" + std::to_string(number)});
  }
  FEDSHARD_EXPECTS(!out.empty(), "sim: ", source,
                   ": expected CSV rows of bench_collectives_mpi (impl,op,bytes,ranks,...), "
                   "found none");
  return out;
}

/// The measurements in the file at path: Google Benchmark JSON when its name ends in .json,
/// bench_collectives_mpi's CSV when its first line starts with "impl,op,", nccl-tests' text
/// otherwise. o.level applies to every format (default: intra for the benchmarks, from the
/// hosts for nccl-tests); o.kind and o.ranks to nccl-tests' text.
inline std::vector<measured_point> read_measurements(const std::string& path,
                                                     const measurement_overrides& o = {}) {
  std::ifstream file(path, std::ios::binary);
  FEDSHARD_EXPECTS(file.good(), "sim: cannot read calibration file '", path, "'");
  const level_kind level = o.level.value_or(level_kind::intra);
  if (path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0)
    return parse_benchmark_json(file, path, level);
  std::string first;
  std::getline(file, first);
  file.clear();
  file.seekg(0);
  if (first.rfind("impl,op,", 0) == 0) return parse_benchmark_csv(file, path, level);
  return parse_nccl_tests(file, path, o);
}

/// Fits t = latency + bus_factor(kind, n) x S / busbw per (kind, ranks, level) of points (see
/// the file comment). invalid_argument when a group has fewer than 2 distinct sizes, or its
/// times do not grow with the size.
inline calibration fit_collectives(const std::vector<measured_point>& points) {
  using key = std::tuple<level_kind, comm_kind, int>;
  std::vector<key> keys;
  for (const auto& p : points) {
    FEDSHARD_EXPECTS(p.ranks >= 2 && p.bytes >= 0 && std::isfinite(p.bytes) && p.seconds > 0 &&
                         std::isfinite(p.seconds),
                     "sim: ", p.source,
                     ": expected ranks >= 2, finite bytes >= 0 and finite seconds > 0, found ",
                     p.ranks, ", ", p.bytes, ", ", p.seconds);
    FEDSHARD_EXPECTS(!point_to_point(p.kind), "sim: ", p.source, ": ", to_string(p.kind),
                     " cannot be calibrated, expected a collective");
    keys.emplace_back(p.level, p.kind, p.ranks);
  }
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  calibration cal;
  for (const auto& [level, kind, ranks] : keys) {
    fitted_collective f{.kind = kind, .ranks = ranks, .level = level};
    std::set<double> sizes;
    for (const auto& p : points)
      if (p.level == level && p.kind == kind && p.ranks == ranks) {
        f.points.push_back({.bytes = p.bytes, .seconds = p.seconds, .source = p.source});
        sizes.insert(p.bytes);
      }
    const std::string what = std::string(to_string(kind)) + " over " + std::to_string(ranks) +
                             " ranks (" + std::string(to_string(level)) + ")";
    FEDSHARD_EXPECTS(sizes.size() >= 2, "sim: ", what,
                     ": expected measurements at >= 2 distinct sizes to fit latency and bus "
                     "bandwidth, found ",
                     sizes.size(), " (", f.points.front().source, ")");
    // Relative residual of point i: (a + b x_i) / t_i - 1 = a v_i + b u_i - 1 with
    // v = 1 / t, u = x / t, x = bus_factor S. Least squares on the columns v and u, each
    // scaled to unit length so that the 2 x 2 normal equations are well conditioned.
    const double bf = bus_factor(kind, ranks);
    double vv = 0, uu = 0;
    for (const auto& p : f.points) {
      const double v = 1 / p.seconds, u = bf * p.bytes / p.seconds;
      vv += v * v;
      uu += u * u;
    }
    const double nv = std::sqrt(vv), nu = std::sqrt(uu);
    double cvu = 0, sv = 0, su = 0;
    for (const auto& p : f.points) {
      const double v = 1 / p.seconds / nv, u = bf * p.bytes / p.seconds / nu;
      cvu += v * u;
      sv += v;
      su += u;
    }
    const double det = 1 - cvu * cvu;
    double a = (sv - cvu * su) / det / nv;
    double b = (su - cvu * sv) / det / nu;
    if (!(a >= 0)) {
      f.latency_clamped = true;
      a = 0;
      b = su / nu;  // minimises sum (b u_i - 1)^2 with unit-length u: b' = sum u'_i
    }
    FEDSHARD_EXPECTS(b > 0 && std::isfinite(b), "sim: ", what,
                     ": expected times that grow with the size, found a fitted slope of ", b,
                     " s/byte (measure larger sizes)");
    f.latency = a;
    f.bus_bandwidth = 1 / b;
    double sum2 = 0;
    for (auto& p : f.points) {
      p.model = f.seconds(p.bytes);
      p.residual = (p.model - p.seconds) / p.seconds;
      sum2 += p.residual * p.residual;
      f.max_residual = std::max(f.max_residual, std::abs(p.residual));
    }
    f.rms_residual = std::sqrt(sum2 / static_cast<double>(f.points.size()));
    cal.collectives.push_back(std::move(f));
  }
  return cal;
}

namespace detail {

/// "8 B", "4 KiB", "1.5 MiB".
inline std::string size_string(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) bytes /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g %s", bytes, units[u]);
  return buf;
}

}  // namespace detail

/// Prints the fitted constants of cal (latency in us, busbw in GB/s = 1e9 bytes/s) and their
/// relative residuals (rms and max); the residual of every point too for fits of at most 16
/// points, or always with every_point.
inline void print_calibration(std::ostream& os, const calibration& cal, bool every_point = false) {
  char buf[256];
  os << "measured collectives: t = latency + bus_factor x S / busbw, fitted on relative "
        "errors\n";
  std::snprintf(buf, sizeof buf, "  %-15s %-8s %5s %6s %-19s %11s %11s %7s %7s\n", "kind", "level",
                "ranks", "points", "sizes", "latency us", "busbw GB/s", "rms %", "max %");
  os << buf;
  for (const auto& f : cal.collectives) {
    if (f.points.empty()) {  // constants given, not fitted (a link's specification)
      std::snprintf(buf, sizeof buf, "  %-15s %-8s %5d %6s %-19s %11.2f %11.2f %7s %7s\n",
                    std::string(to_string(f.kind)).c_str(), std::string(to_string(f.level)).c_str(),
                    f.ranks, "-", "given, not fitted", f.latency * 1e6, f.bus_bandwidth / 1e9, "-",
                    "-");
      os << buf;
      continue;
    }
    double lo = std::numeric_limits<double>::infinity(), hi = 0;
    for (const auto& p : f.points) lo = std::min(lo, p.bytes), hi = std::max(hi, p.bytes);
    const std::string sizes = detail::size_string(lo) + " - " + detail::size_string(hi);
    std::snprintf(buf, sizeof buf, "  %-15s %-8s %5d %6zu %-19s %11.2f %11.2f %7.2f %7.2f%s\n",
                  std::string(to_string(f.kind)).c_str(), std::string(to_string(f.level)).c_str(),
                  f.ranks, f.points.size(), sizes.c_str(), f.latency * 1e6, f.bus_bandwidth / 1e9,
                  100 * f.rms_residual, 100 * f.max_residual,
                  f.latency_clamped ? "  (latency clamped to 0)" : "");
    os << buf;
  }
  for (const auto& f : cal.collectives) {
    if (f.points.empty() || (!every_point && f.points.size() > 16)) continue;
    std::snprintf(buf, sizeof buf, "\n  %s, %d ranks, %s: every point\n  %12s %14s %14s %9s  %s\n",
                  std::string(to_string(f.kind)).c_str(), f.ranks,
                  std::string(to_string(f.level)).c_str(), "size", "measured us", "model us",
                  "resid %", "source");
    os << buf;
    for (const auto& p : f.points) {
      std::snprintf(buf, sizeof buf, "  %12s %14.3f %14.3f %9.2f  ",
                    detail::size_string(p.bytes).c_str(), p.seconds * 1e6, p.model * 1e6,
                    100 * p.residual);
      os << buf << p.source << "\n";
    }
  }
}

}  // namespace fedshard::sim
