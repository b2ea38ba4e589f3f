#pragma once
/// Checkpoints: each rank's whole state as named sections with a checksum per chunk, a
/// manifest written last by world rank 0, and the collective protocol that saves and loads
/// them (checkpoint::save, checkpoint::load; trainer::save and trainer::load call these).
///
/// A file (rank file or manifest) is
///   header:   "FEDSHCK2" | u32 version | u32 chunk bytes C
///   data:     every section's bytes, back to back
///   contents: u32 section count | per section: u32 name length | name | u64 offset |
///             u64 byte size | u64 checksum64 of each C-byte chunk of its bytes
///   trailer:  u64 contents offset | u64 contents size | u64 checksum64 of the contents |
///             "FEDSHEND"
/// (little-endian, as written by the host). Opening a file reads only its header, trailer and
/// contents, and checks them: a truncated or torn file (the trailer is what is written last)
/// and a corrupt table of contents are refused before anything else is read. A read of any
/// byte range of a section reads the chunks that hold it and checks their checksums, so a rank
/// that reshards reads exactly the ranges it needs and still never uses a damaged byte.
///
/// A checkpoint directory holds one manifest.bin and, per rank, rank-RRRRR-ID.bin, where ID
/// is the save's identifier. Files are written to "<name>.tmp" and renamed; rank files carry
/// their save's ID in their name and the manifest, which names the ID, is written last. So a
/// save that stops at any point (a crash, a kill) leaves the previous checkpoint's manifest
/// and rank files in place, and loadable; the next complete save removes what is stale.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "fedshard/core/checksum.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/error.hpp"
#include "fedshard/mesh/axis.hpp"
#include "fedshard/plan/comm_op.hpp"

namespace fedshard::checkpoint {

inline constexpr char file_magic[9] = "FEDSHCK2";
inline constexpr char end_magic[9] = "FEDSHEND";
inline constexpr std::uint32_t format_version = 2;
/// Bytes per checksummed chunk of a section.
inline constexpr std::uint32_t default_chunk_bytes = 1u << 20;

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

using fedshard::checksum64;  // core/checksum.hpp: the chunks' and the contents' checksum

/// A file's name for itself in 8 bytes: the checksum of its table of contents in its trailer,
/// which covers every chunk's checksum (so a reader that checks the file checks that name);
/// checksum64 of all its bytes when it has no trailer. A heal from several donors names the
/// shared state with it (federation/heal.hpp) instead of hashing the whole file again.
inline std::uint64_t file_digest(const std::string& file) noexcept {
  constexpr std::size_t tail = 8 + sizeof end_magic - 1;  // the checksum, then "FEDSHEND"
  if (file.size() < tail + 16 ||
      file.compare(file.size() - (sizeof end_magic - 1), sizeof end_magic - 1, end_magic) != 0)
    return checksum64(file.data(), file.size());
  std::uint64_t d = 0;
  std::memcpy(&d, file.data() + file.size() - tail, sizeof d);
  return d;
}

/// "0123456789abcdef": 16 hex digits of a save id.
inline std::string id_text(std::uint64_t id) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(id));
  return buf;
}

/// The name of world rank r's file of the save `id` inside a checkpoint directory.
inline std::string rank_file_name(int rank, std::uint64_t id) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank-%05d-", rank);
  return buf + id_text(id) + ".bin";
}

/// The name of the manifest inside a checkpoint directory.
inline constexpr const char* manifest_file_name = "manifest.bin";

/// A fresh identifier for one save, below 2^53 so that it survives a trip through a double
/// (a world all_reduce): every file of a save carries it, so files of two saves are never
/// mixed (a save that stopped half-way leaves some ranks' files from an earlier one).
inline std::uint64_t new_save_id() {
  static std::atomic<std::uint64_t> counter{0};
  const auto now = std::chrono::system_clock::now().time_since_epoch().count();
  const std::uint64_t c = counter.fetch_add(1);
  return fnv1a(&c, sizeof c, fnv1a(&now, sizeof now)) >> 11;
}

namespace detail {
template <class T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}
}  // namespace detail

/// Collects named sections (copies of the bytes: a snapshot) and writes them as one file.
class file_writer {
 public:
  explicit file_writer(std::uint32_t chunk_bytes = default_chunk_bytes) : chunk_(chunk_bytes) {
    FEDSHARD_EXPECTS(chunk_bytes > 0, "checkpoint: the chunk size must be > 0");
  }

  /// Adds a section of `bytes` bytes and returns it, to be filled in place (what it holds
  /// until then is unspecified): one copy from where the values are, none through a
  /// temporary. A buffer recycle() kept under the same name, if as large, is reused (no
  /// allocation, no first-touch page faults).
  std::span<char> add_buffer(std::string name, std::size_t bytes) {
    FEDSHARD_EXPECTS(!index_.count(name), "checkpoint: section '", name, "' added twice");
    section s;
    if (auto it = spare_.find(name); it != spare_.end() && it->second.capacity >= bytes) {
      s = std::move(it->second);
      spare_.erase(it);
    } else {
      s.data.reset(new char[std::max<std::size_t>(bytes, 1)]);  // not value-initialised
      s.capacity = bytes;
    }
    s.size = bytes;
    index_.emplace(name, sections_.size());
    sections_.emplace_back(std::move(name), std::move(s));
    return {sections_.back().second.data.get(), bytes};
  }
  /// add_buffer() for `count` values of a trivially copyable T (aligned for any of them).
  template <class T>
  std::span<T> add_elements(std::string name, std::size_t count) {
    static_assert(std::is_trivially_copyable_v<T> && alignof(T) <= alignof(std::max_align_t));
    const auto b = add_buffer(std::move(name), count * sizeof(T));
    return {reinterpret_cast<T*>(b.data()), count};
  }
  /// Adds a section of raw bytes.
  void add(std::string name, const void* data, std::size_t bytes) {
    const auto b = add_buffer(std::move(name), bytes);
    if (bytes > 0) std::memcpy(b.data(), data, bytes);
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
  /// Bytes held so far (the sections' sizes).
  std::size_t size_bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& s : sections_) n += s.second.size;
    return n;
  }
  /// Keeps the section buffers of `used` (a writer done with) for add_buffer() to reuse by
  /// name: a trainer's next save_async snapshots into the same memory.
  void recycle(file_writer&& used) {
    for (auto& [name, s] : used.sections_) spare_[name] = std::move(s);
    for (auto& [name, s] : used.spare_) spare_.try_emplace(name, std::move(s));
    used.sections_.clear();
    used.index_.clear();
    used.spare_.clear();
  }

  /// The serialised file.
  /// The file's bytes in one string, with room for `spare` more (what travels with it: a
  /// heal's padding, seal or trailer; appending them then moves nothing).
  std::string bytes(std::size_t spare = 0) const {
    std::string out;
    out.reserve(file_bytes() + spare);
    emit([&](const char* p, std::size_t k) { out.append(p, k); });
    return out;
  }
  /// The size of the file emit() writes: header, sections, contents and trailer.
  std::size_t file_bytes() const noexcept {
    std::size_t n = 16 + 4 + 32;  // header, section count, trailer
    for (const auto& [name, sec] : sections_)
      n += sec.size + 4 + name.size() + 8 + 8 + 8 * ((sec.size + chunk_ - 1) / chunk_);
    return n;
  }

  /// Writes the file atomically (to path.tmp, then renamed over path).
  void write(const std::filesystem::path& path) const {
    const std::filesystem::path tmp = path.string() + ".tmp";
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      if (!f)
        throw backend_error(fedshard::detail::concat("fedshard: checkpoint: cannot open '",
                                                     tmp.string(), "' for writing"));
      emit([&](const char* p, std::size_t n) { f.write(p, static_cast<std::streamsize>(n)); });
      f.flush();
      if (!f)
        throw backend_error(
            fedshard::detail::concat("fedshard: checkpoint: writing '", tmp.string(), "' failed"));
    }
    std::error_code ec;
    std::filesystem::rename(tmp, path, ec);
    if (ec)
      throw backend_error(fedshard::detail::concat("fedshard: checkpoint: renaming '", tmp.string(),
                                                   "' to '", path.string(),
                                                   "' failed: ", ec.message()));
  }

 private:
  /// Passes the file's bytes, in order, to sink(pointer, count).
  template <class Sink>
  void emit(Sink&& sink) const {
    std::string head(file_magic, 8);
    detail::put(head, format_version);
    detail::put(head, chunk_);
    sink(head.data(), head.size());
    std::string contents;
    detail::put(contents, static_cast<std::uint32_t>(sections_.size()));
    std::uint64_t at = head.size();
    for (const auto& [name, sec] : sections_) {
      const char* data = sec.data.get();
      sink(data, sec.size);
      detail::put(contents, static_cast<std::uint32_t>(name.size()));
      contents += name;
      detail::put(contents, at);
      detail::put(contents, static_cast<std::uint64_t>(sec.size));
      for (std::size_t c = 0; c < sec.size; c += chunk_)
        detail::put(contents, checksum64(data + c, std::min<std::size_t>(chunk_, sec.size - c)));
      at += sec.size;
    }
    std::string tail;
    detail::put(tail, at);
    detail::put(tail, static_cast<std::uint64_t>(contents.size()));
    detail::put(tail, checksum64(contents.data(), contents.size()));
    tail.append(end_magic, 8);
    sink(contents.data(), contents.size());
    sink(tail.data(), tail.size());
  }

  struct section {
    std::unique_ptr<char[]> data;
    std::size_t size = 0;
    std::size_t capacity = 0;
  };
  std::uint32_t chunk_;
  std::vector<std::pair<std::string, section>> sections_;  // in the order added
  std::map<std::string, std::size_t, std::less<>> index_;
  std::map<std::string, section, std::less<>> spare_;  // recycled buffers, by section name
};

/// Reads a file written by file_writer, from memory or from disk. The constructor checks the
/// header, the trailer and the table of contents; every read checks the chunks it touches.
class file_reader {
 public:
  /// Parses bytes read from `what` (a path or a description, for messages).
  file_reader(std::string data, std::string what)
      : what_(std::move(what)), memory_(std::make_shared<std::string>(std::move(data))) {
    size_ = memory_->size();
    parse();
  }

  /// Opens and checks a file (reads its header, trailer and table of contents only).
  static file_reader open(const std::filesystem::path& path) { return file_reader(path); }
  /// Reads a whole file into memory and checks it as open() does.
  static file_reader read_whole(const std::filesystem::path& path) {
    std::ifstream f(path, std::ios::binary);
    if (!f)
      throw backend_error(
          fedshard::detail::concat("fedshard: checkpoint: cannot open '", path.string(), "'"));
    std::string data;
    f.seekg(0, std::ios::end);
    data.resize(static_cast<std::size_t>(f.tellg()));
    f.seekg(0);
    f.read(data.data(), static_cast<std::streamsize>(data.size()));
    if (!f)
      throw backend_error(
          fedshard::detail::concat("fedshard: checkpoint: reading '", path.string(), "' failed"));
    return file_reader(std::move(data), path.string());
  }

  /// The file's name or description.
  const std::string& what() const noexcept { return what_; }
  bool has(std::string_view name) const { return entries_.find(name) != entries_.end(); }
  /// The names of the sections.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& e : entries_) out.push_back(e.first);
    return out;
  }
  /// A section's size in bytes; a missing section is an error naming it.
  std::size_t section_size(std::string_view name) const { return entry(name).size; }
  /// A section's bytes, checked; a missing section is an error naming it.
  std::string section(std::string_view name) const {
    std::string out(entry(name).size, '\0');
    read_bytes(name, 0, std::span<char>(out));
    return out;
  }
  /// Bytes [offset, offset + out.size()) of a section into out, after checking the checksum
  /// of every chunk they touch.
  void read_bytes(std::string_view name, std::size_t offset, std::span<char> out) const {
    const auto& e = entry(name);
    if (offset > e.size || out.size() > e.size - offset)
      fail("section '", name, "' holds ", e.size, " bytes, asked for bytes [", offset, ", ",
           offset + out.size(), ")");
    if (out.empty()) return;
    const std::size_t first = offset / chunk_, last = (offset + out.size() - 1) / chunk_;
    std::string buf;
    for (std::size_t c = first; c <= last; ++c) {
      const std::size_t begin = c * chunk_, n = std::min<std::size_t>(chunk_, e.size - begin);
      buf.resize(n);
      raw(e.offset + begin, buf.data(), n);
      if (checksum64(buf.data(), n) != e.sums[c])
        fail("is corrupt: section '", name, "' fails the checksum of its bytes [", begin, ", ",
             begin + n, ")");
      const std::size_t from = std::max(offset, begin),
                        to = std::min(offset + out.size(), begin + n);
      std::memcpy(out.data() + (from - offset), buf.data() + (from - begin), to - from);
    }
  }
  /// Copies a section into values, which must have exactly its size.
  template <class T>
  void read_span(std::string_view name, std::span<T> values) const {
    static_assert(std::is_trivially_copyable_v<T>);
    const std::size_t n = section_size(name);
    if (n != values.size_bytes())
      fail("section '", name, "' holds ", n, " bytes, this run expects ", values.size_bytes());
    read_bytes(name, 0, std::span<char>(reinterpret_cast<char*>(values.data()), n));
  }
  /// Values [first, first + values.size()) of a section of T values.
  template <class T>
  void read_elements(std::string_view name, std::size_t first, std::span<T> values) const {
    static_assert(std::is_trivially_copyable_v<T>);
    read_bytes(name, first * sizeof(T),
               std::span<char>(reinterpret_cast<char*>(values.data()), values.size_bytes()));
  }
  /// One value from a section of exactly its size.
  template <class T>
  T read_value(std::string_view name) const {
    T v{};
    read_span(name, std::span<T>(&v, 1));
    return v;
  }

  /// Throws invalid_argument: "fedshard: checkpoint file '<what>' " and the rest.
  template <class... A>
  [[noreturn]] void fail(A&&... a) const {
    throw invalid_argument(fedshard::detail::concat("fedshard: checkpoint file '", what_, "' ",
                                                    std::forward<A>(a)...));
  }

 private:
  struct section_entry {
    std::uint64_t offset = 0;
    std::uint64_t size = 0;
    std::vector<std::uint64_t> sums;
  };

  explicit file_reader(const std::filesystem::path& path)
      : what_(path.string()), file_(std::make_shared<std::ifstream>(path, std::ios::binary)) {
    if (!*file_)
      throw backend_error(
          fedshard::detail::concat("fedshard: checkpoint: cannot open '", path.string(), "'"));
    file_->seekg(0, std::ios::end);
    size_ = static_cast<std::uint64_t>(file_->tellg());
    parse();
  }

  void raw(std::uint64_t at, char* out, std::size_t n) const {
    if (at > size_ || n > size_ - at) fail("is truncated: it ends before byte ", at + n);
    if (memory_) {
      std::memcpy(out, memory_->data() + at, n);
      return;
    }
    file_->clear();
    file_->seekg(static_cast<std::streamoff>(at));
    file_->read(out, static_cast<std::streamsize>(n));
    if (!*file_) fail("could not be read at bytes [", at, ", ", at + n, ")");
  }

  void parse() {
    constexpr std::uint64_t head = 16, tail = 32;
    if (size_ < head + tail)
      fail("is truncated: ", size_, " bytes, a checkpoint file has at least ", head + tail);
    char h[16];
    raw(0, h, 16);
    if (std::memcmp(h, "FEDSHCK", 7) != 0) fail("is not a fedshard checkpoint file (bad magic)");
    std::uint32_t version = 0;
    std::memcpy(&version, h + 8, 4);
    if (std::memcmp(h, file_magic, 8) != 0 || version != format_version)
      fail("has format version ", h[7] == '1' ? 1u : version, ", this fedshard reads version ",
           format_version, " only");
    std::memcpy(&chunk_, h + 12, 4);
    if (chunk_ == 0) fail("is corrupt: its chunk size is 0");
    char t[32];
    raw(size_ - tail, t, 32);
    if (std::memcmp(t + 24, end_magic, 8) != 0)
      fail("is truncated or torn: its end marker is missing");
    std::uint64_t at = 0, n = 0, sum = 0;
    std::memcpy(&at, t, 8);
    std::memcpy(&n, t + 8, 8);
    std::memcpy(&sum, t + 16, 8);
    if (at < head || at > size_ - tail || n != size_ - tail - at)
      fail("is corrupt: its table of contents is not where its trailer says");
    std::string c(static_cast<std::size_t>(n), '\0');
    raw(at, c.data(), c.size());
    if (checksum64(c.data(), c.size()) != sum)
      fail("is corrupt: its table of contents fails its checksum");
    std::size_t p = 0;
    const auto count = get<std::uint32_t>(c, p);
    for (std::uint32_t i = 0; i < count; ++i) {
      const auto len = get<std::uint32_t>(c, p);
      if (len > c.size() - p) fail("is corrupt: a section name runs past the end");
      std::string name = c.substr(p, len);
      p += len;
      section_entry e;
      e.offset = get<std::uint64_t>(c, p);
      e.size = get<std::uint64_t>(c, p);
      if (e.offset < head || e.offset > at || e.size > at - e.offset)
        fail("is corrupt: section '", name, "' runs past the end of the data");
      const std::uint64_t chunks = (e.size + chunk_ - 1) / chunk_;
      if (chunks > (c.size() - p) / 8) fail("is corrupt: section '", name, "' lacks checksums");
      for (std::uint64_t k = 0; k < chunks; ++k) e.sums.push_back(get<std::uint64_t>(c, p));
      if (entries_.count(name)) fail("is corrupt: section '", name, "' appears twice");
      entries_.emplace(std::move(name), std::move(e));
    }
    if (p != c.size()) fail("is corrupt: ", c.size() - p, " unexpected bytes after the sections");
  }

  template <class T>
  T get(const std::string& d, std::size_t& at) const {
    T v{};
    if (sizeof v > d.size() - at) fail("is corrupt: its table of contents runs past the end");
    std::memcpy(&v, d.data() + at, sizeof v);
    at += sizeof v;
    return v;
  }
  const section_entry& entry(std::string_view name) const {
    auto it = entries_.find(name);
    if (it == entries_.end()) fail("has no section '", name, "'");
    return it->second;
  }

  std::string what_;
  std::shared_ptr<std::string> memory_;  // the bytes, for a file read from memory
  std::shared_ptr<std::ifstream> file_;  // the open file, otherwise
  std::uint64_t size_ = 0;
  std::uint32_t chunk_ = 1;
  std::map<std::string, section_entry, std::less<>> entries_;
};

/// What a checkpoint was taken from, as "key=value" fields: a run whose fields are all equal
/// restores every rank from its own file; another run reshards (trainer::load).
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
  /// "key: checkpoint has 'a', this run has 'b'; ..." for every field of this (the run
  /// restoring) where `saved` (the checkpoint) differs; empty when there is none.
  std::string differences(const manifest& saved) const {
    std::string diffs;
    for (const auto& [k, v] : fields) {
      auto it = saved.fields.find(k);
      const std::string got = it == saved.fields.end() ? std::string("(missing)") : it->second;
      if (got != v)
        diffs += fedshard::detail::concat(diffs.empty() ? "" : "; ", k, ": checkpoint has '", got,
                                          "', this run has '", v, "'");
    }
    return diffs;
  }
  /// Throws invalid_argument naming every field where `saved` differs from this.
  void require_same(const manifest& saved, std::string_view where) const {
    const std::string diffs = differences(saved);
    if (!diffs.empty())
      throw invalid_argument(fedshard::detail::concat(
          "fedshard: checkpoint '", where, "' was taken from a different setup: ", diffs));
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

/// Removes the files of saves other than `id` (rank files, temporaries, failure notes) from
/// dir, once its manifest names `id`; what cannot be removed stays (it is never read: names
/// carry the id).
inline void remove_stale(const std::filesystem::path& dir, std::uint64_t id) {
  const std::string keep = "-" + id_text(id) + ".bin";
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const bool ours = name.rfind("rank-", 0) == 0;
    const bool tmp = name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0;
    if ((ours && !(name.size() > keep.size() &&
                   name.compare(name.size() - keep.size(), keep.size(), keep) == 0)) ||
        tmp)
      std::filesystem::remove(e.path(), ec);
  }
}

/// The note a rank leaves when writing its file of save `id` failed (save_async: world rank 0
/// stops waiting for it).
inline std::string failure_note_name(int rank, std::uint64_t id) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank-%05d-", rank);
  return buf + id_text(id) + ".failed";
}

}  // namespace detail

/// One rank's part of a save that has its state: the file, then (world rank 0) the manifest.
/// save() runs it in place; trainer::save_async on a thread of its own.
struct save_job {
  std::filesystem::path dir;
  std::uint64_t id = 0;
  int rank = 0;
  int size = 1;
  file_writer rank_file;  // this rank's state (a snapshot)
  file_writer manifest;   // world rank 0's manifest (empty elsewhere)
  /// How long world rank 0 waits for the other ranks' files (save_async only).
  std::chrono::milliseconds wait_for_peers{std::chrono::minutes(10)};

  /// Writes this rank's file; world rank 0 then waits (when `wait` is set) until every rank's
  /// file is there, writes the manifest and removes the files of earlier saves.
  void run(bool wait) {
    try {
      rank_file.write(dir / rank_file_name(rank, id));
    } catch (...) {
      std::ofstream(dir / detail::failure_note_name(rank, id)) << "failed\n";
      throw;
    }
    if (rank != 0) return;
    if (wait) await_peers();
    manifest.write(dir / manifest_file_name);
    detail::remove_stale(dir, id);
  }

 private:
  void await_peers() const {
    const auto deadline = std::chrono::steady_clock::now() + wait_for_peers;
    for (int r = 1; r < size; ++r) {
      auto pause = std::chrono::microseconds(200);
      while (!std::filesystem::exists(dir / rank_file_name(r, id))) {
        if (std::filesystem::exists(dir / detail::failure_note_name(r, id)))
          throw backend_error(detail::concat("fedshard: checkpoint: world rank ", r,
                                             " could not write its file of the save into '",
                                             dir.string(), "' (that rank reports why)"));
        if (std::chrono::steady_clock::now() > deadline)
          throw timeout_error(detail::concat("fedshard: checkpoint: world rank ", r, "'s file ",
                                             rank_file_name(r, id), " did not appear in '",
                                             dir.string(), "' within ", wait_for_peers.count(),
                                             " ms; save_async needs a directory every rank sees"));
        std::this_thread::sleep_for(pause);
        pause = std::min(pause * 2, std::chrono::microseconds(20000));
      }
    }
  }
};

/// Collective: the first half of a save over a world of `size` ranks (this one is `rank`):
/// creates dir, agrees on a save id, snapshots this rank's state (`write_state(w)` adds its
/// sections to a file_writer, into the buffers of `reuse` when given) and world rank 0's
/// manifest (`m`, plus the sections `describe(w)` adds). Any rank's failure throws on every
/// rank.
template <class Agree, class WriteState, class Describe>
save_job prepare_save(const std::filesystem::path& dir, int rank, int size, const manifest& m,
                      Agree&& agree, WriteState&& write_state, Describe&& describe,
                      file_writer* reuse = nullptr) {
  std::exception_ptr error;
  if (rank == 0) error = detail::attempt([&] { std::filesystem::create_directories(dir); });
  detail::all_ok(error, "creating the checkpoint directory", rank, size, agree);
  save_job job;
  job.dir = dir;
  job.rank = rank;
  job.size = size;
  job.id = static_cast<std::uint64_t>(
      agree(rank == 0 ? static_cast<double>(new_save_id()) : 0.0, reduce_op::max));
  if (reuse != nullptr) job.rank_file.recycle(std::move(*reuse));
  error = detail::attempt([&] {
    job.rank_file.add_text("manifest", m.text());
    job.rank_file.add_value("save_id", job.id);
    write_state(job.rank_file);
    if (rank != 0) return;
    job.manifest.add_text("manifest", m.text());
    job.manifest.add_value("save_id", job.id);
    job.manifest.add_value("world_size", size);
    describe(job.manifest);
  });
  detail::all_ok(error, "taking the state to save", rank, size, agree);
  return job;
}

/// Collective: writes every rank's state into directory dir (prepare_save, then the files,
/// agreed). Every file carries one save id, so files of two saves are never mixed; a rank that
/// fails makes every rank throw, and the previous checkpoint in dir stays loadable. The
/// snapshot's buffers go back to `reuse`, when given, for the next save.
template <class Agree, class WriteState, class Describe>
void save(const std::filesystem::path& dir, int rank, int size, const manifest& m, Agree&& agree,
          WriteState&& write_state, Describe&& describe, file_writer* reuse = nullptr) {
  save_job job = prepare_save(dir, rank, size, m, agree, write_state, describe, reuse);
  std::exception_ptr error =
      detail::attempt([&] { job.rank_file.write(dir / rank_file_name(rank, job.id)); });
  detail::all_ok(error, "writing the rank files", rank, size, agree);
  if (rank == 0)
    error = detail::attempt([&] {
      job.manifest.write(dir / manifest_file_name);
      detail::remove_stale(dir, job.id);
    });
  if (reuse != nullptr) reuse->recycle(std::move(job.rank_file));
  detail::all_ok(error, "writing the manifest", rank, size, agree);
}

/// A saved checkpoint as a loading rank sees it: its manifest and its rank files.
class saved_checkpoint {
 public:
  /// Opens and checks dir's manifest.
  static saved_checkpoint open(const std::filesystem::path& dir) {
    saved_checkpoint s(dir, file_reader::open(dir / manifest_file_name));
    return s;
  }
  const std::filesystem::path& dir() const noexcept { return dir_; }
  std::uint64_t id() const noexcept { return id_; }
  /// The saver's world size.
  int world_size() const noexcept { return world_size_; }
  /// The manifest file (its sections describe the saver's layout).
  const file_reader& manifest_file() const noexcept { return manifest_file_; }
  /// The saver's fields.
  const checkpoint::manifest& fields() const noexcept { return fields_; }
  /// World rank r's file, opened and checked: it belongs to this save and this setup.
  /// Opened once and kept.
  const file_reader& rank_file(int r) const {
    FEDSHARD_EXPECTS(r >= 0 && r < world_size_, "checkpoint '", dir_.string(), "' has ranks [0, ",
                     world_size_, "), asked for rank ", r);
    auto it = files_.find(r);
    if (it != files_.end()) return it->second;
    file_reader f = file_reader::open(dir_ / rank_file_name(r, id_));
    check(f);
    return files_.emplace(r, std::move(f)).first->second;
  }
  /// World rank r's file, read whole into memory and checked as rank_file() does.
  file_reader rank_file_in_memory(int r) const {
    FEDSHARD_EXPECTS(r >= 0 && r < world_size_, "checkpoint '", dir_.string(), "' has ranks [0, ",
                     world_size_, "), asked for rank ", r);
    file_reader f = file_reader::read_whole(dir_ / rank_file_name(r, id_));
    check(f);
    return f;
  }

 private:
  saved_checkpoint(std::filesystem::path dir, file_reader m)
      : dir_(std::move(dir)), manifest_file_(std::move(m)) {
    for (const auto& n : manifest_file_.names()) (void)manifest_file_.section(n);  // all checked
    fields_ = manifest::parse(manifest_file_.section("manifest"));
    id_ = manifest_file_.read_value<std::uint64_t>("save_id");
    world_size_ = manifest_file_.read_value<int>("world_size");
    if (world_size_ < 1) manifest_file_.fail("is corrupt: world size ", world_size_);
  }
  /// A rank file belongs to this save and this setup.
  void check(const file_reader& f) const {
    fields_.require_same(manifest::parse(f.section("manifest")), f.what());
    const auto file_id = f.read_value<std::uint64_t>("save_id");
    if (file_id != id_)
      throw invalid_argument(
          detail::concat("fedshard: checkpoint file '", f.what(), "' belongs to another save (id ",
                         file_id, ") than its manifest '", (dir_ / manifest_file_name).string(),
                         "' (id ", id_, "): a save stopped half-way"));
  }

  std::filesystem::path dir_;
  file_reader manifest_file_;
  checkpoint::manifest fields_;
  std::uint64_t id_ = 0;
  int world_size_ = 1;
  mutable std::map<int, file_reader> files_;
};

/// Collective: restores a checkpoint of directory dir. `prepare(saved)` reads and checks
/// everything this rank needs from the saved_checkpoint without changing any state, and
/// returns what commits it; the commits run once every rank prepared. A checkpoint that
/// cannot be read (a missing, torn, truncated or corrupt file; a file of another save or
/// setup; another model) is refused on every rank and nothing is changed.
template <class Agree, class Prepare>
void load(const std::filesystem::path& dir, int rank, int size, Agree&& agree, Prepare&& prepare) {
  std::function<void()> commit;
  const std::exception_ptr error = detail::attempt([&] {
    const auto saved = saved_checkpoint::open(dir);
    commit = prepare(saved);
  });
  detail::all_ok(error, "reading the checkpoint", rank, size, agree);
  commit();
}

}  // namespace fedshard::checkpoint
