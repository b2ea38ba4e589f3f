#pragma once
/// HMAC-SHA256 (RFC 2104 over SHA-256) from OpenSSL's libcrypto (its EVP_MAC interface): the
/// tags of the signed store (comm/signed_store.hpp) and of anything else the groups of a
/// federation sign with their shared secret. Part of the Gloo component, which links
/// OpenSSL::Crypto.

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/params.h>

#include <array>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "fedshard/error.hpp"

namespace fedshard::detail {

/// An HMAC-SHA256 tag (32 bytes).
using hmac_tag = std::array<unsigned char, 32>;

/// Throws backend_error saying which OpenSSL call failed and OpenSSL's reason.
[[noreturn]] inline void openssl_failed(const char* what) {
  char reason[256] = "no reason given";
  if (const unsigned long e = ERR_get_error(); e != 0) ERR_error_string_n(e, reason, sizeof reason);
  throw backend_error(concat("fedshard: HMAC-SHA256: OpenSSL's ", what, " failed: ", reason));
}

/// An HMAC-SHA256 over data given in pieces: update() as often as needed, then finish() once.
class hmac_sha256_stream {
 public:
  /// Keyed by `key` (any length; RFC 2104 hashes keys longer than SHA-256's 64-byte block).
  explicit hmac_sha256_stream(std::string_view key) : ctx_(EVP_MAC_CTX_new(algorithm())) {
    if (!ctx_) openssl_failed("EVP_MAC_CTX_new");
    char digest[] = "SHA256";
    const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                                 OSSL_PARAM_END};
    static const unsigned char no_key = 0;  // a valid pointer for an empty key
    const auto* k = key.empty() ? &no_key : reinterpret_cast<const unsigned char*>(key.data());
    if (EVP_MAC_init(ctx_.get(), k, key.size(), params) != 1) openssl_failed("EVP_MAC_init");
  }
  /// Adds n bytes at data to the message.
  hmac_sha256_stream& update(const void* data, std::size_t n) {
    if (n > 0 && EVP_MAC_update(ctx_.get(), static_cast<const unsigned char*>(data), n) != 1)
      openssl_failed("EVP_MAC_update");
    return *this;
  }
  /// Adds the bytes of data to the message.
  hmac_sha256_stream& update(std::string_view data) { return update(data.data(), data.size()); }
  /// The tag of everything added (call once).
  hmac_tag finish() {
    hmac_tag t{};
    std::size_t n = 0;
    if (EVP_MAC_final(ctx_.get(), t.data(), &n, t.size()) != 1 || n != t.size())
      openssl_failed("EVP_MAC_final");
    return t;
  }

 private:
  /// OpenSSL's HMAC, fetched once per process (an EVP_MAC is shared between threads).
  static EVP_MAC* algorithm() {
    static EVP_MAC* const mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
    if (mac == nullptr) openssl_failed("EVP_MAC_fetch(HMAC)");
    return mac;
  }
  struct free_ctx {
    void operator()(EVP_MAC_CTX* c) const noexcept { EVP_MAC_CTX_free(c); }
  };
  std::unique_ptr<EVP_MAC_CTX, free_ctx> ctx_;
};

/// HMAC-SHA256(key, data).
inline hmac_tag hmac_sha256(std::string_view key, std::string_view data) {
  return hmac_sha256_stream(key).update(data).finish();
}

/// True when the n bytes at a and b are equal, in a time that does not depend on where they
/// differ (OpenSSL's CRYPTO_memcmp).
inline bool equal_in_constant_time(const void* a, const void* b, std::size_t n) noexcept {
  return CRYPTO_memcmp(a, b, n) == 0;
}

/// Lower-case hex of n bytes.
inline std::string hex_of(const unsigned char* bytes, std::size_t n) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s(2 * n, '0');
  for (std::size_t i = 0; i < n; ++i) {
    s[2 * i] = digits[bytes[i] >> 4];
    s[2 * i + 1] = digits[bytes[i] & 15];
  }
  return s;
}

}  // namespace fedshard::detail
