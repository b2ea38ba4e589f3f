#pragma once
/// Safetensors files: a trainer's model exported for other frameworks (PyTorch, JAX, numpy
/// through the `safetensors` package), and a pretrained model imported as a trainer's initial
/// parameters. Component fedshard::safetensors (needs nlohmann_json).
///
/// The format: a u64 little-endian N, then N bytes of JSON, then the data. The JSON is an
/// object mapping each tensor's name to {"dtype": "F32" | "BF16" | ..., "shape": [...],
/// "data_offsets": [begin, end]} (bytes, relative to the first byte after the header, end
/// exclusive), plus an optional "__metadata__" object of strings. Elements are row-major and
/// little-endian. fedshard pads the JSON with spaces to a multiple of 8 bytes, so the data
/// starts 8-byte aligned.
///
/// A trainer's tensors are named "unit.tensor" (the layout's qualified names). export and
/// import are collective over the trainer's world, and no rank ever holds the whole model:
/// each rank writes, or reads, only the byte ranges of its own master shard.
///
/// Errors: a file that does not follow the format, or does not fit the trainer, is refused
/// with fedshard::invalid_argument naming the file, the tensor, what was expected and what
/// was found; an I/O failure is a fedshard::backend_error. In the collective calls, an error
/// on any rank is raised on every rank, with the message of the lowest failing rank.

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/reduce_op.hpp"
#include "fedshard/core/state_registry.hpp"
#include "fedshard/error.hpp"
#include "fedshard/kernels/cast.hpp"
#include "fedshard/mesh/axis.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/shard/flat_layout.hpp"
#include "fedshard/trainer/checkpoint.hpp"

namespace fedshard::safetensors {

static_assert(std::endian::native == std::endian::little,
              "fedshard::safetensors reads and writes the host's bytes as the format's "
              "little-endian elements; a big-endian host would need byte swaps");

/// The largest JSON header accepted (the reference implementation's limit is 100 MB).
inline constexpr std::uint64_t max_header_bytes = 100'000'000;
/// The most entries a header may have, "__metadata__" included (a 405B-parameter model has
/// under 2,000 tensors).
inline constexpr std::size_t max_tensors = 1'000'000;
/// The deepest nesting a header may have: the object of tensors (1), a tensor's entry or
/// "__metadata__" (2), its shape and data_offsets arrays (3).
inline constexpr int max_header_depth = 3;

/// An element type of the format: its name in the header, its size in bytes, and the
/// fedshard dtype that holds it when there is one (F64, F32, BF16, F16).
struct dtype_info {
  std::string_view name;
  std::size_t size = 0;
  std::optional<dtype> type;
};

/// Every element type of the format fedshard knows (it reads any of them; it converts only
/// those with a fedshard dtype).
inline constexpr std::array<dtype_info, 16> known_dtypes = {{
    {"F64", 8, dtype::f64},
    {"F32", 4, dtype::f32},
    {"BF16", 2, dtype::bf16},
    {"F16", 2, dtype::f16},
    {"F8_E4M3", 1, std::nullopt},
    {"F8_E5M2", 1, std::nullopt},
    {"I64", 8, std::nullopt},
    {"U64", 8, std::nullopt},
    {"I32", 4, std::nullopt},
    {"U32", 4, std::nullopt},
    {"I16", 2, std::nullopt},
    {"U16", 2, std::nullopt},
    {"I8", 1, std::nullopt},
    {"U8", 1, std::nullopt},
    {"BOOL", 1, std::nullopt},
    {"C64", 8, std::nullopt},
}};

/// The element type named `name` in a header, or nullopt for a name the format lacks.
inline std::optional<dtype_info> find_dtype(std::string_view name) {
  for (const dtype_info& d : known_dtypes)
    if (d.name == name) return d;
  return std::nullopt;
}

/// The header name of a fedshard dtype ("F32", "F64", "BF16", "F16").
inline std::string_view name_of(dtype t) {
  FEDSHARD_EXPECTS(is_valid(t), "safetensors: invalid dtype value ", static_cast<int>(t));
  for (const dtype_info& d : known_dtypes)
    if (d.type == t) return d.name;
  return "F32";  // unreachable: every fedshard dtype is in the table
}

/// One tensor of a file, as its header describes it (already validated).
struct tensor_info {
  std::string name;
  std::string dtype;  ///< the header's name: "F32", "BF16", ...
  std::size_t element_size = 0;
  std::optional<fedshard::dtype> type;  ///< set for F64, F32, BF16 and F16
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;  ///< data_offsets[0], from the start of the data
  std::uint64_t end = 0;    ///< data_offsets[1] (exclusive)

  std::uint64_t numel() const noexcept {
    std::uint64_t n = 1;
    for (std::int64_t d : shape) n *= static_cast<std::uint64_t>(d);
    return n;
  }
};

/// A file's header, validated against the file: read_info() refuses a header length beyond
/// the file or above max_header_bytes, JSON that does not parse or is not an object, a key
/// given twice, an entry without a string dtype, an array shape of integers >= 0 or two
/// data_offsets, an unknown dtype, a byte size other than shape product * dtype size, data
/// beyond the end of the file, tensors whose data overlap, holes (bytes of the data that no
/// tensor covers, trailing bytes included: the format indexes the whole buffer), more than
/// max_tensors entries, and nesting deeper than max_header_depth.
struct file_info {
  std::filesystem::path path;
  std::uint64_t file_size = 0;
  std::uint64_t header_size = 0;  ///< N, the JSON's length (padding included)
  /// The tensors, in the order of their data.
  std::vector<tensor_info> tensors;
  /// The "__metadata__" object (empty when the file has none).
  std::map<std::string, std::string> metadata;

  /// Where the data starts in the file: 8 + N.
  std::uint64_t data_start() const noexcept { return 8 + header_size; }
  /// The tensor named `name`, or null.
  const tensor_info* find(std::string_view name) const {
    for (const tensor_info& t : tensors)
      if (t.name == name) return &t;
    return nullptr;
  }
};

namespace detail {

using fedshard::detail::concat;

/// invalid_argument "fedshard: safetensors file '<path>': <what>".
template <class... A>
[[noreturn]] void refuse(const std::filesystem::path& path, A&&... what) {
  throw invalid_argument(
      concat("fedshard: safetensors file '", path.string(), "': ", std::forward<A>(what)...));
}

/// backend_error "fedshard: safetensors file '<path>': <what>".
template <class... A>
[[noreturn]] void io_failed(const std::filesystem::path& path, A&&... what) {
  throw backend_error(
      concat("fedshard: safetensors file '", path.string(), "': ", std::forward<A>(what)...));
}

/// "[d0, d1, ...]".
inline std::string shape_string(std::span<const std::int64_t> shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += concat(i ? ", " : "", shape[i]);
  return s + "]";
}

/// The JSON value's kind, for messages.
inline std::string kind_of(const nlohmann::ordered_json& j) {
  if (j.is_number_unsigned()) return concat("the number ", j.get<std::uint64_t>());
  if (j.is_number_integer()) return concat("the number ", j.get<std::int64_t>());
  if (j.is_number_float()) return concat("the number ", j.dump());
  if (j.is_string()) return concat("the string ", j.dump());
  return concat("a JSON ", j.type_name());
}

/// The entries of a header, in the file's order: (name, value) of each top-level key.
using header_entries = std::vector<std::pair<std::string, nlohmann::ordered_json>>;

/// Parses the header text into its entries, refusing text that is not JSON, is not an
/// object, or names a key twice. Each entry is moved out of the parser as soon as it is
/// complete, so the top-level object stays empty: an ordered_json object finds a key by
/// scanning its keys, which made parsing quadratic in the number of tensors.
inline header_entries parse_entries(const std::filesystem::path& path, std::string_view text) {
  using event = nlohmann::ordered_json::parse_event_t;
  header_entries entries;
  bool object_root = false;
  // The callback sees every key; the parser itself would keep the last of two equal ones.
  std::set<std::string> keys;
  std::string duplicate;
  // Why parsing stopped early: nesting too deep, too many entries, or an entry that is not
  // an object. The last is refused at once because the parser keeps a placeholder in the
  // top-level object for every discarded value that is not an object, and finding keys
  // among those placeholders would make parsing quadratic again.
  std::string early;
  const auto stop = [&](auto&&... why) {
    early = fedshard::detail::concat(why...);
    throw std::length_error(early);
  };
  const auto take_entries = [&](int depth, event e, nlohmann::ordered_json& parsed) {
    if (depth >= max_header_depth && (e == event::object_start || e == event::array_start))
      stop("the header nests deeper than ", max_header_depth,
           " levels (an object of tensors whose shape and data_offsets are arrays of numbers)");
    if (depth == 1 && e == event::key && entries.size() >= max_tensors)
      stop("the header has more than ", max_tensors,
           " entries, the limit (safetensors::max_tensors)");
    if (depth == 1 && object_root && (e == event::value || e == event::array_start)) {
      const std::string found = e == event::value ? kind_of(parsed) : "a JSON array";
      if (entries.back().first == "__metadata__")
        stop("'__metadata__' must be an object of strings, found ", found);
      stop("tensor '", entries.back().first,
           "': expected an object {\"dtype\", \"shape\", \"data_offsets\"}, found ", found);
    }
    if (depth == 0) {
      object_root = object_root || e == event::object_start;
      return true;
    }
    if (depth != 1 || !object_root) return true;
    if (e == event::key) {
      entries.emplace_back(parsed.get<std::string>(), nlohmann::ordered_json{});
      if (duplicate.empty() && !keys.insert(entries.back().first).second)
        duplicate = entries.back().first;
      return true;
    }
    if (e != event::object_end && e != event::array_end && e != event::value) return true;
    entries.back().second = std::move(parsed);  // an entry is complete: keep it here
    return false;
  };
  nlohmann::ordered_json header;
  try {
    header = nlohmann::ordered_json::parse(text.begin(), text.end(), take_entries);
  } catch (const nlohmann::json::exception& e) {
    refuse(path, "the header (", text.size(),
           " bytes after the length) is not valid JSON: ", e.what());
  } catch (const std::length_error&) {
    if (early.empty()) throw;
    refuse(path, early);
  }
  if (!header.is_object())
    refuse(path, "the header must be a JSON object of tensors, found ", kind_of(header));
  if (!duplicate.empty())
    refuse(path, "the header names '", duplicate, "' twice, expected each key once");
  return entries;
}

/// The "__metadata__" entry into info.metadata: an object of strings.
inline void read_metadata(const std::filesystem::path& path, const nlohmann::ordered_json& entry,
                          file_info& info) {
  if (!entry.is_object())
    refuse(path, "'__metadata__' must be an object of strings, found ", kind_of(entry));
  for (const auto& [key, value] : entry.items()) {
    if (!value.is_string())
      refuse(path, "'__metadata__' entry '", key, "' must be a string, found ", kind_of(value));
    info.metadata.emplace(key, value.get<std::string>());
  }
}

/// invalid_argument "... tensor '<name>': <what>" for the tensor entry being read.
struct tensor_refusal {
  const std::filesystem::path& path;
  const std::string& name;

  template <class... A>
  [[noreturn]] void operator()(A&&... what) const {
    refuse(path, "tensor '", name, "': ", std::forward<A>(what)...);
  }
};

/// t.dtype, element_size and type from a tensor entry's "dtype".
inline void read_dtype(const tensor_refusal& bad, const nlohmann::ordered_json& dt,
                       tensor_info& t) {
  if (!dt.is_string()) bad("dtype must be a string, found ", kind_of(dt));
  t.dtype = dt.get<std::string>();
  const auto known = find_dtype(t.dtype);
  if (!known) {
    std::string names;
    for (const dtype_info& d : known_dtypes) names += concat(names.empty() ? "" : ", ", d.name);
    bad("unknown dtype '", t.dtype, "', expected one of ", names);
  }
  t.element_size = known->size;
  t.type = known->type;
}

/// t.shape from a tensor entry's "shape"; returns its bytes (t.dtype set).
inline std::uint64_t read_shape(const tensor_refusal& bad, const nlohmann::ordered_json& shape,
                                tensor_info& t) {
  if (!shape.is_array()) bad("shape must be an array of integers >= 0, found ", kind_of(shape));
  std::uint64_t numel = 1;
  bool overflow = false;
  for (const auto& d : shape) {
    if (!d.is_number_unsigned() ||
        d.get<std::uint64_t>() >
            static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      bad("every dimension of shape must be an integer >= 0, found ", kind_of(d));
    const auto n = d.get<std::uint64_t>();
    if (n != 0 && numel > std::numeric_limits<std::uint64_t>::max() / n) overflow = true;
    numel *= n;
    t.shape.push_back(static_cast<std::int64_t>(n));
  }
  if (overflow ||
      (numel != 0 && numel > std::numeric_limits<std::uint64_t>::max() / t.element_size))
    bad("shape ", shape_string(t.shape), " of ", t.dtype, " holds more bytes than fit in 64 bits");
  return numel * t.element_size;
}

/// t.begin and t.end from a tensor entry's "data_offsets", which must hold `bytes` bytes
/// inside info's data.
inline void read_offsets(const tensor_refusal& bad, const nlohmann::ordered_json& offsets,
                         std::uint64_t bytes, const file_info& info, tensor_info& t) {
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned())
    bad("data_offsets must be [begin, end], two integers >= 0, found ", offsets.dump());
  t.begin = offsets[0].get<std::uint64_t>();
  t.end = offsets[1].get<std::uint64_t>();
  if (t.end < t.begin) bad("data_offsets [", t.begin, ", ", t.end, "] end before they begin");
  if (t.end - t.begin != bytes)
    bad("shape ", shape_string(t.shape), " of ", t.dtype, " needs ", bytes,
        " bytes, data_offsets [", t.begin, ", ", t.end, "] hold ", t.end - t.begin);
  const std::uint64_t data_size = info.file_size - info.data_start();
  if (t.end > data_size)
    bad("data_offsets [", t.begin, ", ", t.end, "] run past the end of the data: the file has ",
        data_size, " data bytes after its ", info.header_size, "-byte header (", info.file_size,
        " bytes in all; truncated?)");
}

/// The tensor of header entry (name, entry) of a file described by info.
inline tensor_info read_tensor(const std::string& name, const nlohmann::ordered_json& entry,
                               const file_info& info) {
  const tensor_refusal bad{info.path, name};
  if (!entry.is_object())
    bad("expected an object {\"dtype\", \"shape\", \"data_offsets\"}, found ", kind_of(entry));
  for (const auto& [key, value] : entry.items())
    if (key != "dtype" && key != "shape" && key != "data_offsets")
      bad("unexpected key '", key, "', expected only dtype, shape and data_offsets");
  for (const char* key : {"dtype", "shape", "data_offsets"})
    if (!entry.contains(key)) bad("has no '", key, "'");
  tensor_info t;
  t.name = name;
  read_dtype(bad, entry["dtype"], t);
  const std::uint64_t bytes = read_shape(bad, entry["shape"], t);
  read_offsets(bad, entry["data_offsets"], bytes, info, t);
  return t;
}

/// Sorts the tensors by where their data begins and refuses two whose data overlap, and
/// data bytes (of data_bytes) that no tensor covers.
inline void sort_disjoint(const std::filesystem::path& path, std::vector<tensor_info>& tensors,
                          std::uint64_t data_bytes) {
  std::stable_sort(tensors.begin(), tensors.end(),
                   [](const tensor_info& a, const tensor_info& b) { return a.begin < b.begin; });
  const tensor_info* last = nullptr;  // the non-empty tensor ending last so far
  for (const tensor_info& t : tensors) {
    if (t.begin == t.end) continue;
    if (last != nullptr && t.begin < last->end)
      refuse(path, "tensor '", t.name, "': data_offsets [", t.begin, ", ", t.end,
             "] overlap those of tensor '", last->name, "' [", last->begin, ", ", last->end,
             "], expected disjoint ranges");
    const std::uint64_t covered = last == nullptr ? 0 : last->end;
    if (t.begin > covered)
      refuse(path, "tensor '", t.name, "': data_offsets [", t.begin, ", ", t.end, "] leave bytes [",
             covered, ", ", t.begin,
             ") of the data unused, expected every byte to belong to a tensor (no holes)");
    if (last == nullptr || t.end > last->end) last = &t;
  }
  const std::uint64_t covered = last == nullptr ? 0 : last->end;
  if (covered != data_bytes)
    refuse(path, "the tensors cover ", covered, " bytes of data but the file holds ", data_bytes,
           " after its header: ", data_bytes - covered,
           " trailing byte(s) belong to no tensor, expected none");
}

/// Parses and validates the header text of a file of file_size bytes.
inline file_info parse_header(const std::filesystem::path& path, std::string_view text,
                              std::uint64_t file_size) {
  file_info info;
  info.path = path;
  info.file_size = file_size;
  info.header_size = text.size();
  for (const auto& [name, entry] : parse_entries(path, text)) {
    if (name == "__metadata__")
      read_metadata(path, entry, info);
    else
      info.tensors.push_back(read_tensor(name, entry, info));
  }
  sort_disjoint(path, info.tensors, file_size - info.data_start());
  return info;
}

}  // namespace detail

/// Reads and validates the header of a safetensors file (not its data); see file_info.
inline file_info read_info(const std::filesystem::path& path) {
  std::error_code ec;
  const std::uint64_t size = std::filesystem::file_size(path, ec);
  if (ec) detail::refuse(path, "cannot be read: ", ec.message());
  if (size < 8)
    detail::refuse(path, "is truncated: ", size,
                   " bytes, a safetensors file has at least the 8 bytes of its header length");
  std::ifstream f(path, std::ios::binary);
  if (!f) detail::io_failed(path, "cannot be opened for reading");
  std::array<unsigned char, 8> length{};
  f.read(reinterpret_cast<char*>(length.data()), 8);
  if (f.gcount() != 8) detail::io_failed(path, "reading the header length failed");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | length[static_cast<std::size_t>(i)];
  if (n > size - 8)
    detail::refuse(path, "header length ", n, " is larger than the file: expected at most ",
                   size - 8, " (the file has ", size,
                   " bytes; truncated or not a safetensors file?)");
  if (n > max_header_bytes)
    detail::refuse(path, "header length ", n, " is above the limit of ", max_header_bytes,
                   " bytes");
  std::string text(static_cast<std::size_t>(n), '\0');
  f.read(text.data(), static_cast<std::streamsize>(n));
  if (static_cast<std::uint64_t>(f.gcount()) != n)
    detail::io_failed(path, "reading the ", n, "-byte header failed");
  return detail::parse_header(path, text, size);
}

namespace detail {

/// Reads `count` elements of tensor t from element `first` on, converted to f32, into out.
inline void read_elements(std::ifstream& f, const file_info& info, const tensor_info& t,
                          std::uint64_t first, std::size_t count, std::span<float> out,
                          std::vector<std::byte>& scratch) {
  if (count == 0) return;
  const std::uint64_t at = info.data_start() + t.begin + first * t.element_size;
  scratch.resize(count * t.element_size);
  f.seekg(static_cast<std::streamoff>(at));
  f.read(reinterpret_cast<char*>(scratch.data()), static_cast<std::streamsize>(scratch.size()));
  if (!f || static_cast<std::size_t>(f.gcount()) != scratch.size())
    io_failed(info.path, "tensor '", t.name, "': reading ", scratch.size(), " bytes at offset ", at,
              " failed");
  kernels::cast(const_buffer_view{scratch.data(), count, *t.type},
                buffer_view{out.data(), count, dtype::f32});
}

/// The non-finite values met while importing: how many, and where the first was.
struct nonfinite_count {
  std::uint64_t n = 0;
  std::string first_tensor;
  std::uint64_t first_element = 0;

  /// Counts the non-finite values of `values`, elements [from, from + size) of tensor t.
  void add(const tensor_info& t, std::uint64_t from, std::span<const float> values) {
    for (std::size_t i = 0; i < values.size(); ++i)
      if (!std::isfinite(values[i]) && n++ == 0) {
        first_tensor = t.name;
        first_element = from + i;
      }
  }
  /// Refuses them (invalid_argument naming the first), or with `allow` says on stderr how
  /// many were imported.
  void report(const std::filesystem::path& path, bool allow) const {
    if (n == 0) return;
    if (!allow)
      refuse(path, n, " non-finite value(s) (NaN or infinity) in the part of the file this rank ",
             "reads, the first in tensor '", first_tensor, "' at element ", first_element,
             ", expected finite values (import_options::allow_nonfinite imports them)");
    std::fprintf(stderr,
                 "fedshard: import_safetensors: '%s': imported %llu non-finite value(s), the "
                 "first in tensor '%s' at element %llu (import_options::allow_nonfinite)\n",
                 path.string().c_str(), static_cast<unsigned long long>(n), first_tensor.c_str(),
                 static_cast<unsigned long long>(first_element));
  }
};

/// Refuses a tensor whose dtype fedshard cannot convert to f32.
inline void require_float(const file_info& info, const tensor_info& t) {
  if (!t.type)
    refuse(info.path, "tensor '", t.name, "': dtype ", t.dtype,
           " cannot be converted to f32, expected F64, F32, BF16 or F16");
}

}  // namespace detail

/// Every element of tensor `name` of a file read with read_info, converted to f32 (one
/// process, no collective; the whole tensor is read).
inline std::vector<float> read_f32(const file_info& info, std::string_view name) {
  const tensor_info* t = info.find(name);
  if (t == nullptr) detail::refuse(info.path, "has no tensor '", name, "'");
  detail::require_float(info, *t);
  std::ifstream f(info.path, std::ios::binary);
  if (!f) detail::io_failed(info.path, "cannot be opened for reading");
  std::vector<float> out(static_cast<std::size_t>(t->numel()));
  std::vector<std::byte> scratch;
  detail::read_elements(f, info, *t, 0, out.size(), out, scratch);
  return out;
}

/// A tensor for write_file: its bytes (little-endian elements) in the named dtype.
struct tensor_data {
  std::string name;
  std::string dtype;  ///< "F32", "BF16", ... (any of known_dtypes)
  std::vector<std::int64_t> shape;
  std::vector<std::byte> bytes;
};

namespace detail {

/// One entry of a header being written: a tensor's name, dtype, shape and byte size.
struct header_entry {
  std::string name;
  std::string_view dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t bytes = 0;
};

/// A header to write: the JSON padded with spaces to a multiple of 8 bytes, where each entry
/// begins in the data, and the data's size (entries are laid out back to back, in order).
struct header_plan {
  std::string text;
  std::vector<std::uint64_t> begins;
  std::uint64_t data_bytes = 0;

  /// The 8-byte little-endian length N followed by the JSON.
  std::string prefix() const {
    std::string out(8, '\0');
    const std::uint64_t n = text.size();
    for (std::size_t i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xffu);
    return out + text;
  }
  std::uint64_t file_size() const noexcept { return 8 + text.size() + data_bytes; }
};

inline header_plan plan_header(std::span<const header_entry> entries,
                               const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    auto& m = j["__metadata__"] = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
  }
  header_plan p;
  for (const header_entry& e : entries) {
    FEDSHARD_EXPECTS(e.name != "__metadata__" && !j.contains(e.name), "safetensors: tensor name '",
                     e.name, "' is used twice or reserved");
    p.begins.push_back(p.data_bytes);
    j[e.name] = {{"dtype", e.dtype},
                 {"shape", e.shape},
                 {"data_offsets", {p.data_bytes, p.data_bytes + e.bytes}}};
    p.data_bytes += e.bytes;
  }
  p.text = j.dump();
  p.text.resize((p.text.size() + 7) / 8 * 8, ' ');
  return p;
}

/// Writes bytes at byte offset `at` of an existing file, through a handle of its own.
inline void write_at(const std::filesystem::path& path, std::uint64_t at, const void* data,
                     std::size_t n, std::string_view what) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  if (!f) io_failed(path, "cannot be opened for writing ", what);
  f.seekp(static_cast<std::streamoff>(at));
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
  f.flush();
  if (!f) io_failed(path, "writing ", what, " (", n, " bytes at offset ", at, ") failed");
}

/// Creates (or truncates) `path` holding the header, sized for the whole file.
inline void create_sized(const std::filesystem::path& path, const header_plan& p) {
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    if (!f) io_failed(path, "cannot be created");
    const std::string prefix = p.prefix();
    f.write(prefix.data(), static_cast<std::streamsize>(prefix.size()));
    f.flush();
    if (!f) io_failed(path, "writing the header failed");
  }
  std::error_code ec;
  std::filesystem::resize_file(path, p.file_size(), ec);
  if (ec) io_failed(path, "sizing the file to ", p.file_size(), " bytes failed: ", ec.message());
}

/// Renames from to to (replacing to).
inline void rename_over(const std::filesystem::path& from, const std::filesystem::path& to) {
  std::error_code ec;
  std::filesystem::rename(from, to, ec);
  if (ec) io_failed(to, "renaming '", from.string(), "' to it failed: ", ec.message());
}

}  // namespace detail

/// Writes a whole safetensors file from one process (to path + ".tmp", then renamed): the
/// tensors in the given order, back to back, and the metadata. Each tensor's bytes must be
/// its shape's element count times its dtype's size.
inline void write_file(const std::filesystem::path& path, std::span<const tensor_data> tensors,
                       const std::map<std::string, std::string>& metadata = {}) {
  std::vector<detail::header_entry> entries;
  for (const tensor_data& t : tensors) {
    const auto d = find_dtype(t.dtype);
    FEDSHARD_EXPECTS(d.has_value(), "safetensors::write_file: tensor '", t.name,
                     "' has unknown dtype '", t.dtype, "'");
    std::uint64_t numel = 1;
    for (std::int64_t n : t.shape) {
      FEDSHARD_EXPECTS(n >= 0, "safetensors::write_file: tensor '", t.name, "' has shape ",
                       detail::shape_string(t.shape), ", expected dimensions >= 0");
      numel *= static_cast<std::uint64_t>(n);
    }
    FEDSHARD_EXPECTS(numel * d->size == t.bytes.size(), "safetensors::write_file: tensor '", t.name,
                     "' of shape ", detail::shape_string(t.shape), " and dtype ", t.dtype,
                     " needs ", numel * d->size, " bytes, found ", t.bytes.size());
    entries.push_back({t.name, d->name, t.shape, t.bytes.size()});
  }
  const detail::header_plan p = detail::plan_header(entries, metadata);
  const std::filesystem::path tmp = path.string() + ".tmp";
  detail::create_sized(tmp, p);
  for (std::size_t i = 0; i < tensors.size(); ++i)
    if (!tensors[i].bytes.empty())
      detail::write_at(tmp, 8 + p.text.size() + p.begins[i], tensors[i].bytes.data(),
                       tensors[i].bytes.size(),
                       fedshard::detail::concat("tensor '", tensors[i].name, "'"));
  detail::rename_over(tmp, path);
}

/// A hex fingerprint of a layout's units, tensor names, shapes and dtypes that does not
/// depend on the number of shards (flat_layout::fingerprint of the same units over 1 shard):
/// the same for every mesh a model is trained on. export_safetensors records it in the
/// metadata as "fedshard_layout".
inline std::string layout_fingerprint(const flat_layout& l) {
  std::vector<unit_spec> units;
  for (const unit_layout& u : l.units()) {
    unit_spec s{u.name, {}};
    for (const tensor_slot& t : u.tensors) s.tensors.push_back({t.name, t.shape, u.type});
    units.push_back(std::move(s));
  }
  return fedshard::detail::hex64(flat_layout(std::move(units), 1).fingerprint());
}

/// Settings of import_safetensors.
struct import_options {
  /// Tensors of the file that the layout lacks are ignored instead of refused (e.g. the
  /// buffers or the head of a larger pretrained model).
  bool ignore_extra_tensors = false;
  /// NaN and infinities in the file are imported (one line on stderr per rank that read any
  /// says how many) instead of refused. A model that starts with them trains to NaN.
  bool allow_nonfinite = false;
};

namespace detail {

/// The op of an agreement: a `op` all_reduce of `count` f64 (role value) over the world.
inline comm_op agreement_op(reduce_op op, int world_size, std::size_t count = 1) {
  return {.kind = comm_kind::all_reduce,
          .axis = axis::world,
          .dtype = dtype::f64,
          .bytes = static_cast<std::int64_t>(8 * count),
          .ranks = world_size,
          .reduce = op,
          .in = {.role = role::value},
          .out = {.role = role::value},
          .overlappable = false};
}

using checkpoint::detail::attempt;  // runs f; returns what it threw, or null

/// Longest message another rank's error is passed on with.
inline constexpr std::size_t max_message = 2000;

/// The kind and message of an exception, for passing it to the other ranks.
inline std::pair<int, std::string> kind_and_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const invalid_argument& x) {
    return {1, x.what()};
  } catch (const backend_error& x) {
    return {2, x.what()};
  } catch (const std::exception& x) {
    return {3, x.what()};
  } catch (...) {
    return {3, "an exception that is not a std::exception"};
  }
}

/// Collective over the trainer's world: returns when no rank has an error; otherwise every
/// rank throws: the failing ranks their own error, the others the lowest failing rank's,
/// of the same kind (invalid_argument, backend_error, else fedshard::error), naming that rank.
template <class Trainer>
void all_ok(Trainer& t, const std::exception_ptr& error) {
  auto& e = t.engine();
  const int rank = e.topology().rank();
  const int size = e.topology().size();
  double first = error ? static_cast<double>(rank) : static_cast<double>(size);
  e.run(agreement_op(reduce_op::min, size), buffer_view{&first, 1, dtype::f64});
  if (first >= size) return;
  // The lowest failing rank passes on its error: a kind, then one character per f64.
  std::vector<double> note(2 + max_message, 0.0);
  if (rank == static_cast<int>(first)) {
    const auto [kind, text] = kind_and_text(error);
    note[0] = kind;
    note[1] = static_cast<double>(std::min(text.size(), max_message));
    for (std::size_t i = 0; i < text.size() && i < max_message; ++i)
      note[2 + i] = static_cast<unsigned char>(text[i]);
  }
  e.run(agreement_op(reduce_op::sum, size, note.size()),
        buffer_view{note.data(), note.size(), dtype::f64});
  if (error) std::rethrow_exception(error);
  std::string text(static_cast<std::size_t>(note[1]), '\0');
  for (std::size_t i = 0; i < text.size(); ++i)
    text[i] = static_cast<char>(static_cast<unsigned char>(note[2 + i]));
  text = concat(text, " [raised on world rank ", static_cast<int>(first),
                "; nothing was changed on this rank]");
  if (note[0] == 1) throw invalid_argument(text);
  if (note[0] == 2) throw backend_error(text);
  throw fedshard::error(text);
}

/// Index inside unit u of the first element this rank's master holds (the engine's rule).
template <class Trainer>
std::size_t first_element(Trainer& t, std::size_t u) {
  const flat_layout& l = t.engine().layout();
  return l.shards() > 1 ? l.shard_of(u, t.engine().topology().coords().shard).begin : 0;
}

/// This rank's master parameters (each unit's shard back to back), read through the
/// trainer's state registry (the entry holding the parameters).
template <class Trainer>
std::vector<float> parameters_of(Trainer& t) {
  FEDSHARD_EXPECTS(t.engine().owners().everyone(),
                   "safetensors: the trainer's group holds only some units (ownership masks); "
                   "export and import need every unit");
  const state_entry& p = t.state().parameters();
  std::vector<float> master(p.bytes() / sizeof(float));
  p.save(std::as_writable_bytes(std::span<float>(master)));
  return master;
}

/// The overlap of this rank's elements [first, first + count) of a unit with a tensor at
/// [offset, offset + numel) of it, as (first element of the tensor, count).
inline std::pair<std::size_t, std::size_t> overlap(std::size_t first, std::size_t count,
                                                   const tensor_slot& s) {
  const std::size_t lo = std::max(first, s.offset);
  const std::size_t hi = std::min(first + count, s.offset + s.numel);
  return lo < hi ? std::pair{lo - s.offset, hi - lo} : std::pair{std::size_t{0}, std::size_t{0}};
}

}  // namespace detail

/// Collective over the trainer's world: writes the trainer's model (group 0's, the master
/// parameters as they are now) to a safetensors file at `path`, every tensor of the layout
/// as "unit.tensor" with its shape, in layout order, converted to `type` (f32, f64, bf16 or
/// f16; rounding to nearest even). "__metadata__" holds {"format": "pt", "fedshard_layout":
/// layout_fingerprint(...), "fedshard_step": the step count}.
///
/// World rank 0 creates path + ".tmp" with the header, sized for the whole file; then each
/// rank of group 0, replica 0 writes the part of every tensor that its master shard holds, at
/// its place; then rank 0 renames the file to `path`. No rank holds more than its own shard.
/// An error on any rank is raised on every rank, and the .tmp file is removed.
template <class Trainer>
void export_safetensors(Trainer& t, const std::filesystem::path& path, dtype type = dtype::f32) {
  FEDSHARD_EXPECTS(is_valid(type), "export_safetensors: invalid dtype value ",
                   static_cast<int>(type));
  auto& e = t.engine();
  const flat_layout& l = e.layout();
  const auto& coords = e.topology().coords();
  const int rank = e.topology().rank();
  const std::size_t esize = size_of(type);

  std::vector<detail::header_entry> entries;
  for (const unit_layout& u : l.units())
    for (const tensor_slot& s : u.tensors)
      entries.push_back({u.name + "." + s.name, name_of(type), s.shape, s.numel * esize});
  const detail::header_plan plan =
      detail::plan_header(entries, {{"format", "pt"},
                                    {"fedshard_layout", layout_fingerprint(l)},
                                    {"fedshard_step", std::to_string(t.step_count())}});
  const std::filesystem::path tmp = path.string() + ".tmp";
  const std::uint64_t data_start = 8 + plan.text.size();

  try {
    std::exception_ptr error;
    if (rank == 0) error = detail::attempt([&] { detail::create_sized(tmp, plan); });
    detail::all_ok(t, error);

    const bool writer =
        coords.group == 0 && coords.replica == 0 && (l.shards() > 1 || coords.shard == 0);
    if (writer) {
      error = detail::attempt([&] {
        std::vector<std::byte> bytes;
        const std::vector<float> master = detail::parameters_of(t);
        std::size_t k = 0;  // the entry of the tensor
        for (std::size_t u = 0; u < l.num_units(); ++u) {
          const unit_layout& ul = l.unit(u);
          const std::span<const float> mine(master.data() + l.shard_offset(u), ul.shard_numel);
          const std::size_t first = detail::first_element(t, u);
          for (const tensor_slot& s : ul.tensors) {
            const auto [from, count] = detail::overlap(first, mine.size(), s);
            if (count != 0) {
              bytes.resize(count * esize);
              kernels::cast(
                  const_buffer_view{mine.data() + (s.offset + from - first), count, dtype::f32},
                  buffer_view{bytes.data(), count, type});
              detail::write_at(tmp, data_start + plan.begins[k] + from * esize, bytes.data(),
                               bytes.size(),
                               fedshard::detail::concat("tensor '", entries[k].name, "'"));
            }
            ++k;
          }
        }
      });
    }
    detail::all_ok(t, error);

    if (rank == 0) error = detail::attempt([&] { detail::rename_over(tmp, path); });
    detail::all_ok(t, error);
  } catch (...) {
    if (rank == 0) {
      std::error_code ec;
      std::filesystem::remove(tmp, ec);
    }
    throw;
  }
}

/// Collective over the trainer's world: sets the trainer's parameters from a safetensors
/// file (a pretrained model, or one export_safetensors wrote from any mesh); only before the
/// first step. Every tensor of the layout must be in the file as "unit.tensor" with the same
/// shape, in F64, F32, BF16 or F16 (converted to f32, rounding to nearest even); tensors the
/// layout lacks are refused, listed, unless options.ignore_extra_tensors.
///
/// Every rank checks the whole header, reads only the bytes of its own master shard, and
/// converts them into scratch; once every rank succeeded, each writes its master. On an
/// error nothing is changed on any rank, and every rank raises it.
template <class Trainer>
void import_safetensors(Trainer& t, const std::filesystem::path& path, import_options o = {}) {
  FEDSHARD_EXPECTS(t.step_count() == 0, "import_safetensors: '", path.string(),
                   "': parameters can only be set before the first step, the trainer took ",
                   t.step_count());
  auto& e = t.engine();
  const flat_layout& l = e.layout();
  std::vector<std::vector<float>> staged(l.num_units());
  const std::exception_ptr error = detail::attempt([&] {
    const file_info info = read_info(path);
    std::vector<const tensor_info*> found;
    std::set<std::string> expected;
    for (const unit_layout& ul : l.units())
      for (const tensor_slot& s : ul.tensors) {
        const std::string name = ul.name + "." + s.name;
        const tensor_info* ti = info.find(name);
        if (ti == nullptr)
          detail::refuse(path, "tensor '", name, "' of shape ", detail::shape_string(s.shape),
                         " is missing: the file has ", info.tensors.size(),
                         " tensor(s), none of that name");
        if (ti->shape != s.shape)
          detail::refuse(path, "tensor '", name, "' has shape ", detail::shape_string(ti->shape),
                         ", expected ", detail::shape_string(s.shape));
        detail::require_float(info, *ti);
        found.push_back(ti);
        expected.insert(name);
      }
    if (!o.ignore_extra_tensors) {
      std::string extra;
      std::size_t n = 0;
      for (const tensor_info& ti : info.tensors)
        if (!expected.count(ti.name)) {
          if (n < 20) extra += fedshard::detail::concat(n ? ", '" : "'", ti.name, "'");
          ++n;
        }
      if (n != 0)
        detail::refuse(path, n, " tensor(s) the trainer's layout lacks: ", extra,
                       n > 20 ? ", ..." : "",
                       " (import_options::ignore_extra_tensors ignores them)");
    }

    std::ifstream f(path, std::ios::binary);
    if (!f) detail::io_failed(path, "cannot be opened for reading");
    std::vector<std::byte> scratch;
    detail::nonfinite_count bad;
    std::size_t k = 0;
    for (std::size_t u = 0; u < l.num_units(); ++u) {
      const unit_layout& ul = l.unit(u);
      std::vector<float>& mine = staged[u];
      mine.assign(ul.shard_numel, 0.0f);  // padding stays zero
      const std::size_t first = detail::first_element(t, u);
      for (const tensor_slot& s : ul.tensors) {
        const auto [from, count] = detail::overlap(first, mine.size(), s);
        if (count != 0) {
          const auto into = std::span<float>(mine).subspan(s.offset + from - first, count);
          detail::read_elements(f, info, *found[k], from, count, into, scratch);
          bad.add(*found[k], from, into);
        }
        ++k;
      }
    }
    bad.report(path, o.allow_nonfinite);
  });
  detail::all_ok(t, error);
  std::vector<float> master = detail::parameters_of(t);
  for (std::size_t u = 0; u < l.num_units(); ++u)
    std::copy(staged[u].begin(), staged[u].end(),
              master.begin() + static_cast<std::ptrdiff_t>(l.shard_offset(u)));
  t.state().parameters().load(std::as_bytes(std::span<const float>(master)));
}

}  // namespace fedshard::safetensors
