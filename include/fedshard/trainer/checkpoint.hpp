#pragma once
/// Checkpoints: each rank's whole state as named, checksummed sections, plus a manifest of
/// the mesh and layout written by rank 0, and the collective protocol that saves and loads
/// them (checkpoint::save, checkpoint::load; trainer::save and trainer::load call these).
///
/// A rank file is
///   "FEDSHCK1" | u32 version | u32 section count |
///   per section: u32 name length | name | u64 byte size | bytes | u64 FNV-1a of bytes |
///   u64 FNV-1a of everything before | "FEDSHEND"
/// (little-endian, as written by the host). Files are written to "<name>.tmp" and renamed, so
/// a crash leaves the previous file or none. A reader checks the size, both magics and the
/// whole-file checksum before it parses anything, so a torn or truncated file is refused,
/// never half-read.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/error.hpp"
#include "fedshard/mesh/axis.hpp"
#include "fedshard/plan/comm_op.hpp"

namespace fedshard::checkpoint {

inline constexpr char file_magic[9] = "FEDSHCK1";
inline constexpr char end_magic[9] = "FEDSHEND";
inline constexpr std::uint32_t format_version = 1;

/// FNV-1a 64 of a byte range (continuing from `h`).
inline std::uint64_t fnv1a(const void* data, std::size_t n,
                           std::uint64_t h = 0xcbf29ce484222325ull) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

/// The name of rank r's file inside a checkpoint directory.
inline std::string rank_file_name(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank-%05d.bin", rank);
  return buf;
}

/// A fresh identifier for one save, below 2^53 so that it survives a trip through a double
/// (a world all_reduce): every file of a save carries it, so files of two saves are never
/// mixed (a save that stopped half-way leaves some ranks' files from an earlier one).
inline std::uint64_t new_save_id() {
  static std::atomic<std::uint64_t> counter{0};
  const auto now = std::chrono::system_clock::now().time_since_epoch().count();
  const std::uint64_t c = counter.fetch_add(1);
  return fnv1a(&c, sizeof c, fnv1a(&now, sizeof now)) >> 11;
}

/// Collects named sections and writes them as one checksummed file.
class file_writer {
 public:
  /// Adds a section of raw bytes.
  void add(std::string name, const void* data, std::size_t bytes) {
    FEDSHARD_EXPECTS(!sections_.count(name), "checkpoint: section '", name, "' added twice");
    const auto* p = static_cast<const char*>(data);
    sections_.emplace(std::move(name), std::string(p, p + bytes));
  }
  /// Adds a section holding a span of trivially copyable values.
  template <class T>
  void add_span(std::string name, std::span<const T> values) {
    static_assert(std::is_trivially_copyable_v<T>);
    add(std::move(name), values.data(), values.size_bytes());
  }
  /// Adds a section holding one trivially copyable value.
  template <class T>
  void add_value(std::string name, const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    add(std::move(name), &v, sizeof v);
  }
  /// Adds a text section.
  void add_text(std::string name, std::string_view text) {
    add(std::move(name), text.data(), text.size());
  }

  /// The serialised file.
  std::string bytes() const {
    std::string out(file_magic, 8);
    put(out, format_version);
    put(out, static_cast<std::uint32_t>(sections_.size()));
    for (const auto& [name, data] : sections_) {
      put(out, static_cast<std::uint32_t>(name.size()));
      out += name;
      put(out, static_cast<std::uint64_t>(data.size()));
      out += data;
      put(out, fnv1a(data.data(), data.size()));
    }
    put(out, fnv1a(out.data(), out.size()));
    out.append(end_magic, 8);
    return out;
  }

  /// Writes the file atomically (to path.tmp, then renamed over path).
  void write(const std::filesystem::path& path) const {
    const std::string data = bytes();
    const std::filesystem::path tmp = path.string() + ".tmp";
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      if (!f)
        throw backend_error(
            detail::concat("fedshard: checkpoint: cannot open '", tmp.string(), "' for writing"));
      f.write(data.data(), static_cast<std::streamsize>(data.size()));
      f.flush();
      if (!f)
        throw backend_error(
            detail::concat("fedshard: checkpoint: writing '", tmp.string(), "' failed"));
    }
    std::error_code ec;
    std::filesystem::rename(tmp, path, ec);
    if (ec)
      throw backend_error(detail::concat("fedshard: checkpoint: renaming '", tmp.string(), "' to '",
                                         path.string(), "' failed: ", ec.message()));
  }

 private:
  template <class T>
  static void put(std::string& out, T v) {
    out.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  std::map<std::string, std::string> sections_;
};

/// Reads and verifies a file written by file_writer; all checks happen in the constructor.
class file_reader {
 public:
  /// Parses bytes read from `what` (a path, for messages).
  file_reader(std::string data, std::string what) : what_(std::move(what)) {
    const std::size_t min_size = 8 + 4 + 4 + 8 + 8;
    if (data.size() < min_size)
      fail("is truncated: ", data.size(), " bytes, a checkpoint file has at least ", min_size);
    if (std::memcmp(data.data(), file_magic, 8) != 0)
      fail("is not a fedshard checkpoint file (bad magic)");
    if (std::memcmp(data.data() + data.size() - 8, end_magic, 8) != 0)
      fail("is truncated or torn: its end marker is missing");
    const std::size_t body = data.size() - 16;
    std::uint64_t stored = 0;
    std::memcpy(&stored, data.data() + body, 8);
    if (fnv1a(data.data(), body) != stored)
      fail("is corrupt: its checksum does not match its contents");
    std::size_t at = 8;
    const auto version = get<std::uint32_t>(data, at);
    if (version != format_version)
      fail("has format version ", version, ", expected ", format_version);
    const auto count = get<std::uint32_t>(data, at);
    for (std::uint32_t i = 0; i < count; ++i) {
      const auto name_len = get<std::uint32_t>(data, at);
      std::string name = take(data, at, name_len);
      const auto size = get<std::uint64_t>(data, at);
      std::string bytes = take(data, at, size);
      const auto sum = get<std::uint64_t>(data, at);
      if (fnv1a(bytes.data(), bytes.size()) != sum)
        fail("is corrupt: section '", name, "' fails its checksum");
      if (sections_.count(name)) fail("is corrupt: section '", name, "' appears twice");
      sections_.emplace(std::move(name), std::move(bytes));
    }
    if (at != body) fail("is corrupt: ", body - at, " unexpected bytes after the sections");
  }

  /// Reads and verifies a file.
  static file_reader open(const std::filesystem::path& path) {
    std::ifstream f(path, std::ios::binary);
    if (!f)
      throw backend_error(
          detail::concat("fedshard: checkpoint: cannot open '", path.string(), "'"));
    std::ostringstream ss;
    ss << f.rdbuf();
    return file_reader(ss.str(), path.string());
  }

  bool has(const std::string& name) const { return sections_.count(name) != 0; }
  /// A section's bytes; a missing section is an error naming it.
  const std::string& section(const std::string& name) const {
    auto it = sections_.find(name);
    if (it == sections_.end()) fail("has no section '", name, "'");
    return it->second;
  }
  /// Copies a section into values, which must have exactly its size.
  template <class T>
  void read_span(const std::string& name, std::span<T> values) const {
    const std::string& s = section(name);
    if (s.size() != values.size_bytes())
      fail("section '", name, "' holds ", s.size(), " bytes, this run expects ",
           values.size_bytes());
    if (!s.empty()) std::memcpy(values.data(), s.data(), s.size());  // data() may be null
  }
  /// One value from a section of exactly its size.
  template <class T>
  T read_value(const std::string& name) const {
    T v{};
    read_span(name, std::span<T>(&v, 1));
    return v;
  }
  const std::map<std::string, std::string>& sections() const noexcept { return sections_; }

 private:
  template <class... A>
  [[noreturn]] void fail(A&&... a) const {
    throw invalid_argument(
        detail::concat("fedshard: checkpoint file '", what_, "' ", std::forward<A>(a)...));
  }
  template <class T>
  T get(const std::string& d, std::size_t& at) const {
    T v{};
    if (at + sizeof v > d.size() - 16) fail("is corrupt: a section header runs past the end");
    std::memcpy(&v, d.data() + at, sizeof v);
    at += sizeof v;
    return v;
  }
  std::string take(const std::string& d, std::size_t& at, std::uint64_t n) const {
    if (n > d.size() - 16 - at) fail("is corrupt: a section runs past the end");
    std::string s = d.substr(at, static_cast<std::size_t>(n));
    at += static_cast<std::size_t>(n);
    return s;
  }
  std::string what_;
  std::map<std::string, std::string> sections_;
};

/// What a checkpoint was taken from: refused unless it matches the run restoring it.
struct manifest {
  std::map<std::string, std::string> fields;

  /// "key=value" lines, sorted by key.
  std::string text() const {
    std::string s;
    for (const auto& [k, v] : fields) s += k + "=" + v + "\n";
    return s;
  }
  static manifest parse(std::string_view text) {
    manifest m;
    std::size_t at = 0;
    while (at < text.size()) {
      std::size_t nl = text.find('\n', at);
      if (nl == std::string_view::npos) nl = text.size();
      const std::string_view line = text.substr(at, nl - at);
      const std::size_t eq = line.find('=');
      if (eq != std::string_view::npos)
        m.fields.emplace(std::string(line.substr(0, eq)), std::string(line.substr(eq + 1)));
      at = nl + 1;
    }
    return m;
  }
  /// Throws invalid_argument naming every field where `saved` (the checkpoint) differs from
  /// this (the run restoring it).
  void require_same(const manifest& saved, std::string_view where) const {
    std::string diffs;
    for (const auto& [k, v] : fields) {
      auto it = saved.fields.find(k);
      const std::string got = it == saved.fields.end() ? std::string("(missing)") : it->second;
      if (got != v)
        diffs += detail::concat(diffs.empty() ? "" : "; ", k, ": checkpoint has '", got,
                                "', this run has '", v, "'");
    }
    if (!diffs.empty())
      throw invalid_argument(detail::concat("fedshard: checkpoint '", where,
                                            "' was taken from a different setup: ", diffs));
  }
};

/// The op a checkpoint's agreement runs: a min or max all_reduce of one f64 (role value)
/// over the world of `world_size` ranks.
inline comm_op agreement_op(reduce_op op, int world_size) {
  return {.kind = comm_kind::all_reduce,
          .axis = axis::world,
          .dtype = dtype::f64,
          .bytes = 8,
          .ranks = world_size,
          .reduce = op,
          .in = {.role = role::value},
          .out = {.role = role::value},
          .overlappable = false};
}

namespace detail {

using fedshard::detail::concat;

/// Runs f; returns what it threw, or null when it succeeded.
template <class F>
std::exception_ptr attempt(F&& f) {
  try {
    f();
    return nullptr;
  } catch (...) {
    return std::current_exception();
  }
}

/// Collective: throws on every rank unless no rank has an `error`; agree(x, op) is the
/// op-reduction of x over the world.
template <class Agree>
void all_ok(const std::exception_ptr& error, const char* what, int rank, int size, Agree& agree) {
  const double ok =
      agree(error ? static_cast<double>(rank) : static_cast<double>(size), reduce_op::min);
  if (error) std::rethrow_exception(error);
  if (ok < size)
    throw invalid_argument(detail::concat("fedshard: checkpoint: ", what, " failed on world rank ",
                                          static_cast<int>(ok),
                                          " (that rank reports why); no state was changed on "
                                          "this rank"));
}

}  // namespace detail

/// Collective over a world of `size` ranks (this one is `rank`): writes every rank's state
/// into directory dir, with rank 0's manifest. `agree(x, op)` returns the op-reduction of the
/// double x over the world (run agreement_op); `write_state(w)` adds this rank's sections to
/// a file_writer. Every file carries one save id, so files of two saves are never mixed; a
/// rank that fails makes every rank throw.
template <class Agree, class WriteState>
void save(const std::filesystem::path& dir, int rank, int size, const manifest& m, Agree&& agree,
          WriteState&& write_state) {
  std::exception_ptr error;
  if (rank == 0) error = detail::attempt([&] { std::filesystem::create_directories(dir); });
  detail::all_ok(error, "creating the checkpoint directory", rank, size, agree);
  const auto id = static_cast<std::uint64_t>(
      agree(rank == 0 ? static_cast<double>(new_save_id()) : 0.0, reduce_op::max));
  error = detail::attempt([&] {
    file_writer w;
    w.add_text("manifest", m.text());
    write_state(w);
    w.add_value("save_id", id);
    w.write(dir / rank_file_name(rank));
  });
  detail::all_ok(error, "writing the rank files", rank, size, agree);
  if (rank == 0) {
    error = detail::attempt([&] {
      file_writer w;
      w.add_text("manifest", m.text());
      w.add_value("save_id", id);
      w.write(dir / "manifest.bin");
    });
  }
  detail::all_ok(error, "writing the manifest", rank, size, agree);
}

/// Collective: restores the state save() wrote into dir. A checkpoint from another setup
/// (manifest m differs) is refused with an error naming the difference, and a torn or
/// truncated file, or files of different saves, on every rank; `restore_state(r, commit)`
/// reads this rank's sections from a file_reader, first with commit = false (only checks
/// that everything is there), then, once every rank checked its whole state, with commit =
/// true (changes the live state).
template <class Agree, class RestoreState>
void load(const std::filesystem::path& dir, int rank, int size, const manifest& m, Agree&& agree,
          RestoreState&& restore_state) {
  std::optional<file_reader> file;
  const std::exception_ptr error = detail::attempt([&] {
    const auto saved = file_reader::open(dir / "manifest.bin");
    m.require_same(manifest::parse(saved.section("manifest")), dir.string());
    const auto path = dir / rank_file_name(rank);
    file.emplace(file_reader::open(path));
    m.require_same(manifest::parse(file->section("manifest")), path.string());
    const auto id = saved.read_value<std::uint64_t>("save_id");
    const auto file_id = file->read_value<std::uint64_t>("save_id");
    if (file_id != id)
      throw invalid_argument(detail::concat(
          "fedshard: checkpoint file '", path.string(), "' belongs to another save (id ", file_id,
          ") than its manifest '", (dir / "manifest.bin").string(), "' (id ", id,
          "): a save stopped half-way"));
    restore_state(*file, false);
  });
  detail::all_ok(error, "reading the checkpoint", rank, size, agree);
  restore_state(*file, true);
}

}  // namespace fedshard::checkpoint
