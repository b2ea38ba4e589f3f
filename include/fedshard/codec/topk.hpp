#pragma once
/// codec::topk<Chunk, K, Bits>: chunked top-k sparsification with error feedback, values
/// quantised to Bits bits (SparseLoCo, arXiv 2508.15706).
///
/// Each rank keeps a residual e (f32, one per element of its buffer). encode(delta):
///   1. e <- beta * e + delta  (beta = 1: e <- e + delta);
///   2. per chunk of Chunk elements (the last may be shorter, m elements): the k = min(K, m)
///      elements of largest |e|, ties to the lower index (a NaN ranks above everything);
///      sent in increasing index order;
///   3. quantisation (Bits in 1..8): s = the largest |e| of the chunk (always among those
///      sent), L = 2^(Bits-1) magnitude levels; an element v is sent as its sign bit (the
///      top bit of the code) and level l = clamp(floor(|v| / s * L + 1/2), 1, L) (code bits
///      below the sign: l - 1); its value is sign * s * (l / L). There is no zero level:
///      every element sent is among the largest. Bits = 2: +-s/2, +-s. A chunk with s = 0
///      sends zeros. Bits = topk_unquantised (32): values sent as f32, exactly;
///   4. e <- e - value sent, at each index sent (0 exactly when values are sent as f32).
/// So sum_t beta^(T-t) (delta_t - sent_t) = e_T: nothing is lost, only delayed.
/// decode_add(wire, out) scatter-adds the values sent: out[index] += value.
///
/// Wire (index_t = uint16 when Chunk <= 65536, else uint32; S = n elements' selections):
///   quantised:   ceil(n / Chunk) f32 scales | S indices | per chunk ceil(k * Bits / 8)
///                bytes of codes, code j of the chunk at bits [j * Bits, (j + 1) * Bits)
///                (bit b of the chunk's codes is bit b % 8 of byte b / 8; padding bits 0);
///   unquantised: S f32 values | S indices.
/// Indices are relative to the chunk; chunk c's selections are S-entries [c K, c K + k).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "fedshard/codec/codec.hpp"
#include "fedshard/config.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/error.hpp"

namespace fedshard::codec {

/// The Bits of topk that sends values as f32, without quantisation.
inline constexpr unsigned topk_unquantised = 32;

namespace detail {

/// The sign-and-level quantiser of topk (see the file comment): Bits-bit codes of values
/// whose largest magnitude is s.
template <unsigned Bits>
struct topk_quantiser {
  static_assert(Bits >= 1 && Bits <= 8);
  static constexpr std::uint32_t levels = 1u << (Bits - 1);
  static constexpr std::uint32_t sign_bit = 1u << (Bits - 1);

  /// The code of v (|v| <= s).
  FEDSHARD_HOST_DEVICE static std::uint32_t encode(float v, float s) noexcept {
    const float t =
        s > 0.0f ? std::floor(std::fabs(v) / s * static_cast<float>(levels) + 0.5f) : 1.0f;
    const float l = t >= 1.0f ? (t <= static_cast<float>(levels) ? t : static_cast<float>(levels))
                              : 1.0f;  // a NaN gives level 1
    return (std::signbit(v) ? sign_bit : 0u) | (static_cast<std::uint32_t>(l) - 1u);
  }
  /// The value of a code: sign * s * (level / L).
  FEDSHARD_HOST_DEVICE static float decode(std::uint32_t code, float s) noexcept {
    const float magnitude =
        s * (static_cast<float>((code & (sign_bit - 1u)) + 1u) / static_cast<float>(levels));
    return (code & sign_bit) ? -magnitude : magnitude;
  }
};

/// Writes a Bits-bit code at bit position bit of bytes (which start zeroed).
template <unsigned Bits>
FEDSHARD_HOST_DEVICE inline void put_code(std::uint8_t* bytes, std::size_t bit,
                                          std::uint32_t code) noexcept {
  const std::size_t byte = bit / 8;
  const unsigned off = static_cast<unsigned>(bit % 8);
  const std::uint32_t v = code << off;
  bytes[byte] = static_cast<std::uint8_t>(bytes[byte] | (v & 0xffu));
  if (off + Bits > 8) bytes[byte + 1] = static_cast<std::uint8_t>(bytes[byte + 1] | (v >> 8));
}

/// Reads the Bits-bit code at bit position bit of bytes.
template <unsigned Bits>
FEDSHARD_HOST_DEVICE inline std::uint32_t get_code(const std::uint8_t* bytes,
                                                   std::size_t bit) noexcept {
  const std::size_t byte = bit / 8;
  const unsigned off = static_cast<unsigned>(bit % 8);
  std::uint32_t v = bytes[byte];
  if (off + Bits > 8) v |= static_cast<std::uint32_t>(bytes[byte + 1]) << 8;
  return (v >> off) & ((1u << Bits) - 1u);
}

/// The bits of |x|: ordered as |x| is, a NaN above every number.
FEDSHARD_HOST_DEVICE constexpr std::uint32_t magnitude_bits(float x) noexcept {
  return ::fedshard::detail::bit_cast<std::uint32_t>(x) & 0x7fffffffu;
}

}  // namespace detail

/// Chunked top-K with error feedback and Bits-bit values (topk_unquantised: f32 values);
/// stateful: one residual per element of the rank's buffer.
template <std::size_t Chunk = 4096, std::size_t K = 64, unsigned Bits = 2>
class topk {
  static_assert(Chunk > 0 && K > 0 && K <= Chunk, "fedshard::codec::topk: need 0 < K <= Chunk");
  static_assert((Bits >= 1 && Bits <= 8) || Bits == topk_unquantised,
                "fedshard::codec::topk: Bits must be 1..8, or topk_unquantised (f32 values)");

 public:
  /// Run-time settings.
  struct config {
    /// Decay of the residual: e <- beta * e + delta; in [0, 1].
    float beta = 0.95f;
  };

  static constexpr std::string_view name = "topk";
  static constexpr bool stateful = true;
  /// Memory passes over the buffer (the simulator's price): fold delta into the residual,
  /// select per chunk, subtract what was sent; decoding scatters K of Chunk.
  static constexpr float encode_passes = 4.0f;
  static constexpr float decode_passes = 0.1f;
  static constexpr std::size_t chunk = Chunk;
  static constexpr std::size_t k = K;
  static constexpr unsigned bits = Bits;
  /// Whether values are quantised (false: sent as f32).
  static constexpr bool quantised = Bits != topk_unquantised;
  /// The type of an index within a chunk on the wire.
  using index_t = std::conditional_t<(Chunk <= 65536), std::uint16_t, std::uint32_t>;

  /// A codec for a buffer of n elements, with a zero residual.
  topk(config cfg, std::size_t n)
      : e_(n, 0.0f), order_(std::min(n, Chunk)), keys_(std::min(n, Chunk)) {
    set_beta(cfg.beta);
  }

  /// Number of chunks of n elements.
  static constexpr std::size_t chunks(std::size_t n) noexcept { return detail::ceil_div(n, Chunk); }
  /// Number of elements sent for n elements.
  static constexpr std::size_t selected(std::size_t n) noexcept {
    return (n / Chunk) * K + std::min(K, n % Chunk);
  }
  /// Bytes of codes of a chunk that sends k elements.
  static constexpr std::size_t code_bytes(std::size_t k_sent) noexcept {
    return quantised ? detail::ceil_div(k_sent * Bits, 8) : 0;
  }
  /// The exact wire size for n elements (see the file comment).
  static constexpr std::size_t encoded_bytes(std::size_t n) noexcept {
    if constexpr (quantised)
      return chunks(n) * sizeof(float) + selected(n) * sizeof(index_t) +
             (n / Chunk) * code_bytes(K) + code_bytes(std::min(K, n % Chunk));
    else
      return selected(n) * (sizeof(float) + sizeof(index_t));
  }

  /// The residual decay.
  float beta() const noexcept { return beta_; }
  /// Sets the residual decay (in [0, 1]); it applies from the next encode.
  void set_beta(float beta) {
    FEDSHARD_EXPECTS(beta >= 0.0f && beta <= 1.0f, "topk: beta must be in [0, 1], found ", beta);
    beta_ = beta;
  }
  /// The error-feedback residual e, one element per element of the buffer.
  std::span<const float> residual() const noexcept { return e_; }
  /// The residual, writable (a checkpoint restores it).
  std::span<float> residual() noexcept { return e_; }
  /// Zeroes the residual.
  void reset() noexcept { std::fill(e_.begin(), e_.end(), 0.0f); }

  /// Folds delta into the residual, sends each chunk's top-k of it, and keeps what was not
  /// sent (see the file comment).
  void encode(std::span<const float> delta, std::span<std::byte> wire) {
    const std::size_t n = e_.size();
    FEDSHARD_EXPECTS(delta.size() == n, "topk::encode: input of ", delta.size(),
                     " elements, the codec was built for ", n);
    detail::check_wire(name, "encode", wire.data(), wire.size(), encoded_bytes(n), n);
    float* e = e_.data();
    if (beta_ == 1.0f) {
      for (std::size_t i = 0; i < n; ++i) e[i] += delta[i];
    } else {
      const float beta = beta_;
      for (std::size_t i = 0; i < n; ++i) e[i] = beta * e[i] + delta[i];
    }

    const layout at = sections(n);
    float* scales_or_values = reinterpret_cast<float*>(wire.data());
    index_t* indices = reinterpret_cast<index_t*>(wire.data() + at.indices);
    std::uint8_t* all_codes = reinterpret_cast<std::uint8_t*>(wire.data() + at.codes);
    if constexpr (quantised) std::memset(all_codes, 0, wire.size() - at.codes);
    for (std::size_t c = 0, base = 0; base < n; ++c, base += Chunk) {
      const std::size_t m = std::min(Chunk, n - base);
      const std::size_t k_sent = std::min(K, m);
      float* ec = e + base;
      index_t* order = order_.data();
      if (k_sent < m) {
        // One 64-bit key per element, larger for a larger |e| (the bits of a non-negative
        // float order as its value; a NaN's lie above infinity's), then for a lower index:
        // the selection compares integers and never reads e again.
        std::uint64_t* keys = keys_.data();
        for (std::size_t i = 0; i < m; ++i)
          keys[i] = (static_cast<std::uint64_t>(detail::magnitude_bits(ec[i])) << 32) |
                    (0xffffffffu - static_cast<std::uint32_t>(i));
        std::nth_element(keys, keys + k_sent, keys + m, std::greater<>{});
        for (std::size_t j = 0; j < k_sent; ++j)
          order[j] = static_cast<index_t>(0xffffffffu - static_cast<std::uint32_t>(keys[j]));
        std::sort(order, order + k_sent);
      } else {
        std::iota(order, order + m, index_t{0});
      }
      index_t* idx = indices + c * K;
      std::memcpy(idx, order, k_sent * sizeof(index_t));
      if constexpr (quantised) {
        float s = 0.0f;
        for (std::size_t j = 0; j < k_sent; ++j) s = std::max(s, std::fabs(ec[order[j]]));
        scales_or_values[c] = s;
        std::uint8_t* codes = all_codes + c * code_bytes(K);
        using q = detail::topk_quantiser<Bits>;
        for (std::size_t j = 0; j < k_sent; ++j) {
          float& v = ec[order[j]];
          const std::uint32_t code = q::encode(v, s);
          detail::put_code<Bits>(codes, j * Bits, code);
          v -= q::decode(code, s);
        }
      } else {
        float* values = scales_or_values + c * K;
        for (std::size_t j = 0; j < k_sent; ++j) {
          float& v = ec[order[j]];
          values[j] = v;
          v -= values[j];
        }
      }
    }
  }

  /// out[index] += value for every element of the wire (a wire of any rank, same n).
  void decode_add(std::span<const std::byte> wire, std::span<float> out) const {
    const std::size_t n = out.size();
    detail::check_wire(name, "decode_add", wire.data(), wire.size(), encoded_bytes(n), n);
    const layout at = sections(n);
    const float* scales_or_values = reinterpret_cast<const float*>(wire.data());
    const index_t* indices = reinterpret_cast<const index_t*>(wire.data() + at.indices);
    const std::uint8_t* all_codes = reinterpret_cast<const std::uint8_t*>(wire.data() + at.codes);
    for (std::size_t c = 0, base = 0; base < n; ++c, base += Chunk) {
      const std::size_t m = std::min(Chunk, n - base);
      const std::size_t k_sent = std::min(K, m);
      const index_t* idx = indices + c * K;
      float* oc = out.data() + base;
      for (std::size_t j = 0; j < k_sent; ++j)
        FEDSHARD_EXPECTS(idx[j] < m, "topk::decode_add: index ", idx[j], " in chunk ", c, " of ", m,
                         " elements (corrupt wire?)");
      if constexpr (quantised) {
        const float s = scales_or_values[c];
        const std::uint8_t* codes = all_codes + c * code_bytes(K);
        using q = detail::topk_quantiser<Bits>;
        for (std::size_t j = 0; j < k_sent; ++j)
          oc[idx[j]] += q::decode(detail::get_code<Bits>(codes, j * Bits), s);
      } else {
        const float* values = scales_or_values + c * K;
        for (std::size_t j = 0; j < k_sent; ++j) oc[idx[j]] += values[j];
      }
    }
  }

 private:
  /// Byte offsets of the sections of a wire for n elements.
  struct layout {
    std::size_t indices;  // after the scales (quantised) or the f32 values
    std::size_t codes;    // quantised: after the indices
  };
  static constexpr layout sections(std::size_t n) noexcept {
    const std::size_t floats = quantised ? chunks(n) : selected(n);
    const std::size_t indices = floats * sizeof(float);
    return {.indices = indices, .codes = indices + selected(n) * sizeof(index_t)};
  }

  std::vector<float> e_;
  std::vector<index_t> order_;       // per-chunk scratch: the indices sent
  std::vector<std::uint64_t> keys_;  // per-chunk scratch: selection keys
  float beta_ = 0.95f;
};

}  // namespace fedshard::codec
