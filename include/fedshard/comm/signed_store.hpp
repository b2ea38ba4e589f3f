#pragma once
/// gloo::signed_store: a store (comm/gloo.hpp) whose keys and values are signed with a secret
/// the groups of a federation share, so that a process without it cannot join a cross-job
/// federation (comm/elastic.hpp), forge a round's decision or stall a round with fake arrivals.
/// It wraps another store (a file_store or redis_store) and is what the groups' links, and the
/// Gloo contexts they make, meet through.
///
/// Every store operation on the logical key k touches one physical key of the inner store:
///  - the physical key is k + "#" + the first 16 bytes of HMAC-SHA256(secret, "key:" + k) in
///    hex (32 characters). Without the secret nobody can compute where the groups write or
///    read: a key written under a logical name (an arrival, a decision) is never read, and a
///    create-if-absent key (a round's decision) cannot be taken before the groups write it;
///  - the physical value is a 32-byte tag, HMAC-SHA256(secret, "val:" + |k| + ":" + k + v),
///    then the value v. On read the tag is checked in constant time (CRYPTO_memcmp); a value
///    whose tag is missing or wrong is absent (found = false, so waits go on waiting), counted
///    by rejected(), and the first refusal of each key writes one log line naming the key.
/// The secret never appears in a message. HMAC-SHA256 is OpenSSL's (comm/detail/hmac.hpp).
/// tag_of / verify sign other data (a heal blob) under the same secret ("blob:" domain).
///
/// Limits: values are signed, not encrypted: whoever can read the store reads them (they hold
/// round decisions and the Gloo contexts' addresses, never model state). Whoever can write the
/// store and see its key names (a directory listing, Redis KEYS) can overwrite a key it saw
/// with garbage (refused: the key reads as absent) or with an older signed value of the same
/// key (a replay; keys that are written once, as arrivals and decisions are, are safe from it).
/// The Gloo transport's TCP connections are not authenticated by the store.

#include <sys/stat.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fedshard/comm/detail/hmac.hpp"
#include "fedshard/comm/gloo.hpp"
#include "fedshard/error.hpp"

namespace fedshard::gloo {

namespace detail {
using fedshard::detail::equal_in_constant_time;
using fedshard::detail::hmac_sha256;
using fedshard::detail::hmac_sha256_stream;
using fedshard::detail::hmac_tag;

/// Throws invalid_argument unless a secret from `source` is long enough (its length is
/// named, never its bytes).
inline void check_secret(std::string_view secret, std::string_view source, std::size_t min) {
  if (secret.size() < min)
    throw invalid_argument(concat("fedshard: signed_store: the shared secret from ", source, " is ",
                                  secret.size(), " bytes; at least ", min,
                                  " are needed (for example 64 hex digits from "
                                  "`openssl rand -hex 32`)"));
}

/// The secret in the file at `path` (named by `var`): a regular file of at most 64 KiB that
/// only its owner may read or write; one line end at its end is not part of the secret.
inline std::string read_secret_file(const std::string& path, const char* var) {
  const auto source = concat("the file '", path, "' named by ", var);
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw invalid_argument(
        concat("fedshard: signed_store: cannot read ", source, ": ", std::strerror(errno)));
  if (!S_ISREG(st.st_mode))
    throw invalid_argument(concat("fedshard: signed_store: ", source, " is not a regular file"));
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    throw invalid_argument(concat("fedshard: signed_store: ", source,
                                  " may be read or written by group or others (mode ", mode,
                                  "); make it private to its owner: chmod 600 '", path, "'"));
  }
  if (st.st_size > 65536)
    throw invalid_argument(concat("fedshard: signed_store: ", source, " holds ", st.st_size,
                                  " bytes; a secret of at most 65536 bytes was expected"));
  std::ifstream in(path, std::ios::binary);
  std::string secret{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  if (!in.good() && !in.eof())
    throw invalid_argument(concat("fedshard: signed_store: cannot read ", source));
  if (!secret.empty() && secret.back() == '\n') secret.pop_back();
  if (!secret.empty() && secret.back() == '\r') secret.pop_back();
  return secret;
}
}  // namespace detail

/// A store whose keys and values are signed with a shared secret (see the file comment).
/// Thread-safe when the inner store is.
class signed_store final : public store {
 public:
  /// A tag of HMAC-SHA256.
  using tag = detail::hmac_tag;
  /// Where refusals are logged.
  using log_function = std::function<void(const std::string&)>;
  /// The shortest secret accepted, in bytes.
  static constexpr std::size_t min_secret_bytes = 16;
  /// The bytes of a tag, before every value in the inner store.
  static constexpr std::size_t tag_bytes = 32;

  /// Signs the keys and values of `inner` with `secret` (at least min_secret_bytes bytes,
  /// else invalid_argument). Refusals are logged through `log` (default: stderr). The get()
  /// and wait() timeout is the inner store's.
  signed_store(std::shared_ptr<store> inner, std::string secret, log_function log = {})
      : inner_(std::move(inner)), secret_(std::move(secret)), log_(std::move(log)) {
    FEDSHARD_EXPECTS(inner_ != nullptr, "signed_store: the inner store is null");
    detail::check_secret(secret_, "the constructor's argument", min_secret_bytes);
    set_timeout(inner_->timeout());
  }
  signed_store(const signed_store&) = delete;
  signed_store& operator=(const signed_store&) = delete;
  ~signed_store() override { OPENSSL_cleanse(secret_.data(), secret_.size()); }

  /// Sets the physical key of `key` to the tagged value.
  void set(const std::string& key, const std::vector<char>& value) override {
    inner_->set(physical_key(key), sealed(key, value));
  }
  /// Creates the physical key of `key` with the tagged value unless it exists.
  bool try_set(const std::string& key, const std::vector<char>& value) override {
    return inner_->try_set(physical_key(key), sealed(key, value));
  }
  /// The value of `key` if its physical key holds a value with a valid tag; a value with a
  /// missing or wrong tag is absent (and counted, see rejected()).
  std::vector<char> try_get(const std::string& key, bool& found) override {
    auto physical = inner_->try_get(physical_key(key), found);
    if (!found) return {};
    constexpr std::size_t t = tag_bytes;
    const char* why = nullptr;
    if (physical.size() < t) {
      why = "it is shorter than a tag";
    } else {
      const auto want = value_tag(key, std::string_view(physical.data() + t, physical.size() - t));
      if (!detail::equal_in_constant_time(want.data(), physical.data(), t))
        why = "its tag is wrong";
    }
    if (why != nullptr) {
      found = false;
      refuse(key, physical, why);
      return {};
    }
    return {physical.begin() + static_cast<std::ptrdiff_t>(t), physical.end()};
  }
  /// "signed(" + the inner store's name + ")".
  std::string name() const override { return "signed(" + inner_->name() + ")"; }

  /// How many values were refused (a value read again at the same key counts once).
  std::int64_t rejected() const {
    std::lock_guard lock(mu_);
    return rejected_;
  }
  /// Where the value of logical key `key` lives in the inner store (see the file comment).
  std::string physical_key(std::string_view key) const {
    const auto mac = detail::hmac_sha256_stream(secret_).update("key:").update(key).finish();
    return std::string(key) + "#" + fedshard::detail::hex_of(mac.data(), 16);
  }
  /// The tag of `data` under this store's secret, for data kept outside the store (a heal
  /// blob): HMAC-SHA256(secret, "blob:" + data).
  tag tag_of(std::string_view data) const { return blob_mac().update(data).finish(); }
  /// The same tag over data given in pieces: update() with each, then finish().
  detail::hmac_sha256_stream blob_mac() const {
    detail::hmac_sha256_stream s(secret_);
    s.update("blob:");
    return s;
  }
  /// True when `t` is tag_of(data) (compared in constant time).
  bool verify(std::string_view data, const tag& t) const {
    const auto want = tag_of(data);
    return detail::equal_in_constant_time(want.data(), t.data(), want.size());
  }
  /// The store this one signs for.
  const std::shared_ptr<store>& inner() const noexcept { return inner_; }

  /// The shared secret from the environment: the value of `env_var`, or the contents of the
  /// file named by `file_var` (a regular file only its owner may read or write; one line end
  /// at its end is dropped); nothing when neither is set. invalid_argument naming the source
  /// (never the secret) when both are set, or the secret is shorter than min_secret_bytes, or
  /// the file cannot be read or is open to group or others.
  static std::optional<std::string> secret_from_env_or_file(
      const char* env_var = "FEDSHARD_SECRET", const char* file_var = "FEDSHARD_SECRET_FILE") {
    const char* value = std::getenv(env_var);
    const char* file = std::getenv(file_var);
    if (value != nullptr && file != nullptr)
      throw invalid_argument(detail::concat("fedshard: signed_store: both ", env_var, " and ",
                                            file_var, " are set; set only one of them"));
    if (value != nullptr) {
      detail::check_secret(value, detail::concat("environment variable ", env_var),
                           min_secret_bytes);
      return std::string(value);
    }
    if (file == nullptr) return std::nullopt;
    if (*file == '\0')
      throw invalid_argument(
          detail::concat("fedshard: signed_store: ", file_var, " is set but names no file"));
    auto secret = detail::read_secret_file(file, file_var);
    detail::check_secret(secret, detail::concat("the file '", file, "' named by ", file_var),
                         min_secret_bytes);
    return secret;
  }

  /// `inner` signed with the secret of secret_from_env_or_file() when one is set; else
  /// `inner` itself, after one log line saying that the store is not signed.
  static std::shared_ptr<store> from_env(std::shared_ptr<store> inner, log_function log = {}) {
    FEDSHARD_EXPECTS(inner != nullptr, "signed_store: the inner store is null");
    if (auto secret = secret_from_env_or_file())
      return std::make_shared<signed_store>(std::move(inner), std::move(*secret), std::move(log));
    emit(log, detail::concat("fedshard: ", inner->name(),
                             " is not signed (neither FEDSHARD_SECRET nor FEDSHARD_SECRET_FILE "
                             "is set): any process that can write it can join the federation"));
    return inner;
  }

 private:
  static void emit(const log_function& log, const std::string& line) {
    if (log)
      log(line);
    else
      std::fprintf(stderr, "%s\n", line.c_str());
  }
  tag value_tag(std::string_view key, std::string_view value) const {
    return detail::hmac_sha256_stream(secret_)
        .update("val:")
        .update(std::to_string(key.size()))
        .update(":")
        .update(key)
        .update(value)
        .finish();
  }
  std::vector<char> sealed(std::string_view key, const std::vector<char>& value) const {
    const auto t = value_tag(key, std::string_view(value.data(), value.size()));
    std::vector<char> out(t.begin(), t.end());
    out.insert(out.end(), value.begin(), value.end());
    return out;
  }
  /// Counts a refused value (once per key and value) and logs the first refusal of a key.
  void refuse(const std::string& key, const std::vector<char>& physical, const char* why) {
    const auto seen =
        std::hash<std::string_view>{}(std::string_view(physical.data(), physical.size()));
    bool first = false;
    {
      std::lock_guard lock(mu_);
      const auto [it, fresh] = refused_.try_emplace(key, seen);
      if (!fresh && it->second == seen) return;
      it->second = seen;
      ++rejected_;
      first = fresh;
    }
    if (first)
      emit(log_,
           detail::concat("fedshard: ", name(), ": refused the value of key '", key, "' (", why,
                          "): it reads as absent. Was it written by a process "
                          "without this federation's secret (FEDSHARD_SECRET / "
                          "FEDSHARD_SECRET_FILE)?"));
  }

  std::shared_ptr<store> inner_;
  std::string secret_;
  log_function log_;
  mutable std::mutex mu_;
  std::map<std::string, std::size_t> refused_;  ///< key -> hash of the last value refused
  std::int64_t rejected_ = 0;
};

}  // namespace fedshard::gloo
