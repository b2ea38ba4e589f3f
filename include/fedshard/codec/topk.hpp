#pragma once
/// codec::topk: chunked top-k sparsification with error feedback, values quantised to Bits
/// bits (SparseLoCo, arXiv 2508.15706). Chunk, K and Bits are run-time settings
/// (config::chunk, k, bits: 4096, 64 and 2 by default), as is the residual decay beta.
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
/// Wire (indices as uint16 when Chunk <= 65536, else uint32; S = n elements' selections):
///   quantised:   ceil(n / Chunk) f32 scales | S indices | per chunk ceil(k * Bits / 8)
///                bytes of codes, code j of the chunk at bits [j * Bits, (j + 1) * Bits)
///                (bit b of the chunk's codes is bit b % 8 of byte b / 8; padding bits 0);
///   unquantised: S f32 values | S indices.
/// Indices are relative to the chunk; chunk c's selections are S-entries [c K, c K + k).
///
/// The selection runs without a sort: a lower bound L of the k-th largest |e| (the smallest
/// of K column maxima, each the largest of a distinct set of elements), the elements at or
/// above L as candidates, the k-th largest |e| T among them (nth_element), then one pass
/// in index order that takes every |e| > T and the first |e| = T until k are taken: the
/// same set and tie-break as sorting by (|e| descending, index ascending). All on the bits
/// of |e| (integers), so a NaN ranks above everything. The fold of delta and the column
/// maxima are compiled once per instruction set (kernels/dispatch.hpp); every version gives
/// the same bits.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "fedshard/codec/codec.hpp"
#include "fedshard/config.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/error.hpp"
#include "fedshard/kernels/dispatch.hpp"

#if FEDSHARD_DISPATCH
#include <immintrin.h>
#endif

namespace fedshard::codec {

/// The Bits of topk that sends values as f32, without quantisation.
inline constexpr unsigned topk_unquantised = 32;

namespace detail {

/// The sign-and-level quantiser of topk (see the file comment): Bits-bit codes (Bits in
/// 1..8) of values whose largest magnitude is s.
struct topk_quantiser {
  std::uint32_t levels;    ///< L = 2^(Bits-1)
  std::uint32_t sign_bit;  ///< the top bit of a code

  FEDSHARD_HOST_DEVICE explicit constexpr topk_quantiser(unsigned bits) noexcept
      : levels(1u << (bits - 1)), sign_bit(1u << (bits - 1)) {}

  /// The code of v (|v| <= s).
  FEDSHARD_HOST_DEVICE std::uint32_t encode(float v, float s) const noexcept {
    const float t =
        s > 0.0f ? std::floor(std::fabs(v) / s * static_cast<float>(levels) + 0.5f) : 1.0f;
    const float l = t >= 1.0f ? (t <= static_cast<float>(levels) ? t : static_cast<float>(levels))
                              : 1.0f;  // a NaN gives level 1
    return (std::signbit(v) ? sign_bit : 0u) | (static_cast<std::uint32_t>(l) - 1u);
  }
  /// The value of a code: sign * s * (level / L).
  FEDSHARD_HOST_DEVICE float decode(std::uint32_t code, float s) const noexcept {
    const float magnitude =
        s * (static_cast<float>((code & (sign_bit - 1u)) + 1u) / static_cast<float>(levels));
    return (code & sign_bit) ? -magnitude : magnitude;
  }
};

/// Writes a `bits`-bit code (bits <= 8) at bit position bit of bytes (which start zeroed).
FEDSHARD_HOST_DEVICE inline void put_code(std::uint8_t* bytes, std::size_t bit, std::uint32_t code,
                                          unsigned bits) noexcept {
  const std::size_t byte = bit / 8;
  const unsigned off = static_cast<unsigned>(bit % 8);
  const std::uint32_t v = code << off;
  bytes[byte] = static_cast<std::uint8_t>(bytes[byte] | (v & 0xffu));
  if (off + bits > 8) bytes[byte + 1] = static_cast<std::uint8_t>(bytes[byte + 1] | (v >> 8));
}

/// Reads the `bits`-bit code (bits <= 8) at bit position bit of bytes.
FEDSHARD_HOST_DEVICE inline std::uint32_t get_code(const std::uint8_t* bytes, std::size_t bit,
                                                   unsigned bits) noexcept {
  const std::size_t byte = bit / 8;
  const unsigned off = static_cast<unsigned>(bit % 8);
  std::uint32_t v = bytes[byte];
  if (off + bits > 8) v |= static_cast<std::uint32_t>(bytes[byte + 1]) << 8;
  return (v >> off) & ((1u << bits) - 1u);
}

/// The bits of |x|: ordered as |x| is, a NaN above every number.
FEDSHARD_HOST_DEVICE constexpr std::uint32_t magnitude_bits(float x) noexcept {
  return ::fedshard::detail::bit_cast<std::uint32_t>(x) & 0x7fffffffu;
}

#if FEDSHARD_DISPATCH
#define FEDSHARD_DETAIL_TOPK_BODY __attribute__((always_inline)) inline
#else
#define FEDSHARD_DETAIL_TOPK_BODY inline
#endif

/// e <- beta e + delta (Decay) or e <- e + delta over the m elements of a chunk; when
/// m >= 2 K, also returns the smallest of K column maxima of |e| bits (column j: the
/// elements r K + j), a lower bound of the K-th largest; else 0. K is `k`, or Fixed when
/// not 0 (the default's K, known at compile time).
template <std::size_t Fixed, bool Decay>
FEDSHARD_DETAIL_TOPK_BODY std::uint32_t topk_fold_body(float* __restrict e,
                                                       const float* __restrict delta, std::size_t m,
                                                       float beta, std::uint32_t* __restrict colmax,
                                                       std::size_t k) noexcept {
  const std::size_t K = Fixed != 0 ? Fixed : k;
  const auto fold = [beta](float ei, float di) {
    if constexpr (Decay) {
      return beta * ei + di;
    } else {
      (void)beta;  // used when Decay (clang's -Wunused-lambda-capture otherwise)
      return ei + di;
    }
  };
  const std::size_t full = m >= 2 * K ? m / K * K : 0;  // the elements in columns
  std::uint32_t lower = 0;
  if (full != 0) {
    for (std::size_t j = 0; j < K; ++j) colmax[j] = 0;
    for (std::size_t r = 0; r < full; r += K) {
      float* er = e + r;
      const float* dr = delta + r;
      for (std::size_t j = 0; j < K; ++j) {
        const float v = fold(er[j], dr[j]);
        er[j] = v;
        const std::uint32_t a = ::fedshard::detail::bit_cast<std::uint32_t>(v) & 0x7fffffffu;
        colmax[j] = a > colmax[j] ? a : colmax[j];
      }
    }
    lower = colmax[0];
    for (std::size_t j = 1; j < K; ++j) lower = colmax[j] < lower ? colmax[j] : lower;
  }
  for (std::size_t i = full; i < m; ++i) e[i] = fold(e[i], delta[i]);
  return lower;
}

/// The elements of the m of a chunk whose |e| bits are >= lower, in index order: their
/// indices to cand and their |e| bits to cmag (each with room for m + 16 entries); returns
/// how many.
FEDSHARD_TARGET_PORTABLE inline std::size_t topk_gather_from(const float* e, std::size_t i,
                                                             std::size_t m, std::uint32_t lower,
                                                             std::uint32_t* cand,
                                                             std::uint32_t* cmag,
                                                             std::size_t c) noexcept {
  for (; i < m; ++i) {  // branch-free compaction
    const std::uint32_t a = magnitude_bits(e[i]);
    cand[c] = static_cast<std::uint32_t>(i);
    cmag[c] = a;
    c += a >= lower ? 1u : 0u;
  }
  return c;
}
FEDSHARD_TARGET_PORTABLE inline std::size_t topk_gather_portable(const float* e, std::size_t m,
                                                                 std::uint32_t lower,
                                                                 std::uint32_t* cand,
                                                                 std::uint32_t* cmag) noexcept {
  return topk_gather_from(e, 0, m, lower, cand, cmag, 0);
}

/// The k-th largest of the c values v (all >= lower, k <= c), built bit by bit from the
/// top: the largest t with at least k values >= t. Each step is a count the compiler
/// vectorises (no data-dependent branches, unlike a partition).
FEDSHARD_DETAIL_TOPK_BODY std::uint32_t topk_kth_body(const std::uint32_t* __restrict v,
                                                      std::size_t c, std::size_t k,
                                                      std::uint32_t lower) noexcept {
  std::uint32_t largest = lower;
  for (std::size_t i = 0; i < c; ++i) largest = v[i] > largest ? v[i] : largest;
  // Every value lies in [lower, largest]: the bits above the highest bit where the two
  // differ are common to all, and to the answer.
  const std::uint32_t differ = lower ^ largest;
  if (differ == 0) return lower;
  std::uint32_t bit = 0x80000000u >> std::countl_zero(differ);
  std::uint32_t t = largest & ~((bit << 1) - 1u);
  for (; bit != 0; bit >>= 1) {
    const std::uint32_t probe = t | bit;
    std::uint32_t at_least = 0;
    for (std::size_t i = 0; i < c; ++i) at_least += v[i] >= probe ? 1u : 0u;
    if (at_least >= k) t = probe;
  }
  return t;
}

#if FEDSHARD_DISPATCH
/// The lanes of a mask of 8 in increasing order, one per byte (then zeros), for each mask.
inline constexpr auto topk_compress8 = [] {
  struct table {
    std::uint64_t lanes[256];
  } t{};
  for (unsigned mask = 0; mask < 256; ++mask) {
    std::uint64_t packed = 0;
    unsigned at = 0;
    for (unsigned lane = 0; lane < 8; ++lane)
      if (mask & (1u << lane)) packed |= static_cast<std::uint64_t>(lane) << (8 * at++);
    t.lanes[mask] = packed;
  }
  return t;
}();

/// topk_gather_portable with AVX2: 8 lanes compared at once, packed with a permutation.
FEDSHARD_TARGET_AVX2 inline std::size_t topk_gather_avx2(const float* e, std::size_t m,
                                                         std::uint32_t lower, std::uint32_t* cand,
                                                         std::uint32_t* cmag) noexcept {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  // |e| bits and lower are below 2^31: a >= lower is a signed a > lower - 1.
  const __m256i below = _mm256_set1_epi32(static_cast<int>(lower) - 1);
  __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  std::size_t c = 0, i = 0;
  for (; i + 8 <= m; i += 8) {
    const __m256i a =
        _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(e + i)), abs_mask);
    const auto mask = static_cast<unsigned>(
        _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(a, below))));
    const __m256i perm =
        _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(topk_compress8.lanes[mask])));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(cand + c),
                        _mm256_permutevar8x32_epi32(index, perm));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(cmag + c), _mm256_permutevar8x32_epi32(a, perm));
    c += static_cast<std::size_t>(__builtin_popcount(mask));
    index = _mm256_add_epi32(index, step);
  }
  return topk_gather_from(e, i, m, lower, cand, cmag, c);  // the tail
}

/// topk_gather_portable with AVX-512: 16 lanes compared and compressed at once.
FEDSHARD_TARGET_AVX512 inline std::size_t topk_gather_avx512(const float* e, std::size_t m,
                                                             std::uint32_t lower,
                                                             std::uint32_t* cand,
                                                             std::uint32_t* cmag) noexcept {
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i low = _mm512_set1_epi32(static_cast<int>(lower));
  __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  std::size_t c = 0, i = 0;
  for (; i + 16 <= m; i += 16) {
    const __m512i a = _mm512_and_si512(_mm512_loadu_si512(e + i), abs_mask);
    const __mmask16 mask = _mm512_cmpge_epu32_mask(a, low);
    // Compress in registers and store whole vectors (a compressing store is slow on some
    // CPUs); the lanes past the candidates are overwritten by the next store.
    _mm512_storeu_si512(cand + c, _mm512_maskz_compress_epi32(mask, index));
    _mm512_storeu_si512(cmag + c, _mm512_maskz_compress_epi32(mask, a));
    c += static_cast<std::size_t>(__builtin_popcount(mask));
    index = _mm512_add_epi32(index, step);
  }
  return topk_gather_from(e, i, m, lower, cand, cmag, c);  // the tail
}
#endif
#undef FEDSHARD_DETAIL_TOPK_BODY

/// topk_kth_body with the instruction set `which`.
inline std::uint32_t topk_kth_on(kernels::isa which, const std::uint32_t* v, std::size_t c,
                                 std::size_t k, std::uint32_t lower) noexcept {
  return kernels::call_on(which,
                          [=]() FEDSHARD_ALWAYS_INLINE { return topk_kth_body(v, c, k, lower); });
}

/// topk_gather_portable with the instruction set `which`.
inline std::size_t topk_gather_on(kernels::isa which, const float* e, std::size_t m,
                                  std::uint32_t lower, std::uint32_t* cand,
                                  std::uint32_t* cmag) noexcept {
#if FEDSHARD_DISPATCH
  if (which == kernels::isa::avx512 && kernels::detected_isa() >= kernels::isa::avx512)
    return topk_gather_avx512(e, m, lower, cand, cmag);
  if (which >= kernels::isa::avx2 && kernels::detected_isa() >= kernels::isa::avx2)
    return topk_gather_avx2(e, m, lower, cand, cmag);
#else
  (void)which;
#endif
  return topk_gather_portable(e, m, lower, cand, cmag);
}

/// topk_fold_body with the instruction set `which`.
template <std::size_t Fixed, bool Decay>
std::uint32_t topk_fold_isa(kernels::isa which, float* e, const float* delta, std::size_t m,
                            float beta, std::uint32_t* colmax, std::size_t k) noexcept {
  return kernels::call_on(which, [=]() FEDSHARD_ALWAYS_INLINE {
    return topk_fold_body<Fixed, Decay>(e, delta, m, beta, colmax, k);
  });
}

/// The K whose fold is compiled for it (topk's default).
inline constexpr std::size_t topk_fixed_k = 64;

/// topk_fold_body with K = k, beta = 1 folded as e + delta, with the instruction set `which`.
inline std::uint32_t topk_fold_on(kernels::isa which, float* e, const float* delta, std::size_t m,
                                  float beta, std::uint32_t* colmax, std::size_t k) noexcept {
  if (beta == 1.0f)
    return k == topk_fixed_k
               ? topk_fold_isa<topk_fixed_k, false>(which, e, delta, m, beta, colmax, k)
               : topk_fold_isa<0, false>(which, e, delta, m, beta, colmax, k);
  return k == topk_fixed_k ? topk_fold_isa<topk_fixed_k, true>(which, e, delta, m, beta, colmax, k)
                           : topk_fold_isa<0, true>(which, e, delta, m, beta, colmax, k);
}

/// The k (< m) elements of largest |e| bits among the m of a chunk, ties to the lower
/// index, written to order in increasing index order; every element with |e| bits >= lower
/// is a candidate and at least k are. cand and cmag: scratch of m + 16 entries; order:
/// room for k + 1.
template <class Index>
void topk_select(kernels::isa which, const float* e, std::size_t m, std::size_t k,
                 std::uint32_t lower, std::uint32_t* cand, std::uint32_t* cmag, Index* order) {
  const std::size_t c = topk_gather_on(which, e, m, lower, cand, cmag);
  // threshold: the k-th largest magnitude; gt of the candidates lie above it.
  const std::uint32_t threshold = topk_kth_on(which, cmag, c, k, lower);
  // Take every candidate above the threshold and the first ones equal to it, in index
  // order, until k: without branches on the data (order has room for k + 1 entries).
  std::size_t above = 0;
  for (std::size_t j = 0; j < c; ++j) above += cmag[j] > threshold ? 1u : 0u;
  std::size_t ties = k - above;
  std::size_t taken = 0;
  for (std::size_t j = 0; j < c; ++j) {
    const std::uint32_t a = cmag[j];
    const bool tie = a == threshold && ties > 0;
    order[taken] = static_cast<Index>(cand[j]);
    taken += (a > threshold || tie) ? 1u : 0u;
    ties -= tie ? 1u : 0u;
  }
}

}  // namespace detail

/// Chunked top-K with error feedback and Bits-bit values (topk_unquantised: f32 values),
/// Chunk, K and Bits set at run time (config); stateful: one residual per element of the
/// rank's buffer.
class topk {
 public:
  /// Run-time settings (the defaults: SparseLoCo's top-64 of 4096 in 2 bits, beta 0.95).
  struct config {
    /// Decay of the residual: e <- beta * e + delta; in [0, 1].
    float beta = 0.95f;
    /// Elements per chunk (Chunk); > 0 and at most 2^32.
    std::size_t chunk = 4096;
    /// Elements sent per chunk (K); in [1, chunk].
    std::size_t k = 64;
    /// Bits per value sent (Bits): 1..8, or topk_unquantised (f32 values).
    unsigned bits = 2;

    friend bool operator==(const config&, const config&) = default;
  };

  static constexpr std::string_view name = "topk";
  static constexpr bool stateful = true;
  /// Memory passes over the buffer (the simulator's price): fold delta into the residual,
  /// select per chunk, subtract what was sent; decoding scatters K of Chunk.
  static constexpr float encode_passes = 4.0f;
  static constexpr float decode_passes = 0.1f;

  /// A codec for a buffer of n elements, with a zero residual; invalid_argument for settings
  /// it cannot run with (see config).
  topk(config cfg, std::size_t n) : cfg_((check(cfg), cfg)) {
    const std::size_t m = std::min(n, cfg.chunk);
    e_.assign(n, 0.0f);
    order_.resize(m);
    cand_.resize(m + 16);
    cmag_.resize(std::max(m + 16, cfg.k));
  }

  /// Throws invalid_argument, saying what was expected and found, unless c's settings work.
  static void check(const config& c) {
    FEDSHARD_EXPECTS(c.chunk > 0 && c.chunk <= (std::size_t{1} << 32),
                     "topk: chunk must be in [1, 2^32], found ", c.chunk);
    FEDSHARD_EXPECTS(c.k >= 1 && c.k <= c.chunk, "topk: k must be in [1, chunk = ", c.chunk,
                     "], found ", c.k);
    FEDSHARD_EXPECTS((c.bits >= 1 && c.bits <= 8) || c.bits == topk_unquantised,
                     "topk: bits must be 1..8, or topk_unquantised (", topk_unquantised,
                     ": f32 values), found ", c.bits);
    FEDSHARD_EXPECTS(c.beta >= 0.0f && c.beta <= 1.0f, "topk: beta must be in [0, 1], found ",
                     c.beta);
  }

  /// Whether values are quantised (false: sent as f32).
  static constexpr bool quantised(const config& c) noexcept { return c.bits != topk_unquantised; }
  /// Bytes of an index within a chunk on the wire: 2 when chunk <= 65536, else 4.
  static constexpr std::size_t index_bytes(const config& c) noexcept {
    return c.chunk <= 65536 ? 2 : 4;
  }
  /// Number of chunks of n elements.
  static constexpr std::size_t chunks(const config& c, std::size_t n) noexcept {
    return detail::ceil_div(n, c.chunk);
  }
  /// Number of elements sent for n elements.
  static constexpr std::size_t selected(const config& c, std::size_t n) noexcept {
    return (n / c.chunk) * c.k + std::min(c.k, n % c.chunk);
  }
  /// Bytes of codes of a chunk that sends k_sent elements.
  static constexpr std::size_t code_bytes(const config& c, std::size_t k_sent) noexcept {
    return quantised(c) ? detail::ceil_div(k_sent * c.bits, 8) : 0;
  }
  /// The exact wire size for n elements with settings c (see the file comment).
  static constexpr std::size_t encoded_bytes(const config& c, std::size_t n) noexcept {
    if (!quantised(c)) return selected(c, n) * (sizeof(float) + index_bytes(c));
    return chunks(c, n) * sizeof(float) + selected(c, n) * index_bytes(c) +
           (n / c.chunk) * code_bytes(c, c.k) + code_bytes(c, std::min(c.k, n % c.chunk));
  }

  /// The settings (beta as set_beta last left it).
  const config& settings() const noexcept { return cfg_; }
  std::size_t chunk() const noexcept { return cfg_.chunk; }
  std::size_t k() const noexcept { return cfg_.k; }
  unsigned bits() const noexcept { return cfg_.bits; }
  bool quantised() const noexcept { return quantised(cfg_); }
  /// chunks, selected and encoded_bytes with this codec's settings.
  std::size_t chunks(std::size_t n) const noexcept { return chunks(cfg_, n); }
  std::size_t selected(std::size_t n) const noexcept { return selected(cfg_, n); }
  std::size_t encoded_bytes(std::size_t n) const noexcept { return encoded_bytes(cfg_, n); }

  /// The residual decay.
  float beta() const noexcept { return cfg_.beta; }
  /// Sets the residual decay (in [0, 1]); it applies from the next encode.
  void set_beta(float beta) {
    FEDSHARD_EXPECTS(beta >= 0.0f && beta <= 1.0f, "topk: beta must be in [0, 1], found ", beta);
    cfg_.beta = beta;
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
    if (index_bytes(cfg_) == 2)
      encode_as<std::uint16_t>(delta.data(), wire);
    else
      encode_as<std::uint32_t>(delta.data(), wire);
  }

  /// out[index] += value for every element of the wire (a wire of any rank, same n).
  void decode_add(std::span<const std::byte> wire, std::span<float> out) const {
    const std::size_t n = out.size();
    detail::check_wire(name, "decode_add", wire.data(), wire.size(), encoded_bytes(n), n);
    if (index_bytes(cfg_) == 2)
      decode_add_as<std::uint16_t>(wire, out);
    else
      decode_add_as<std::uint32_t>(wire, out);
  }

 private:
  /// Byte offsets of the sections of a wire for n elements.
  struct layout {
    std::size_t indices;  // after the scales (quantised) or the f32 values
    std::size_t codes;    // quantised: after the indices
  };
  layout sections(std::size_t n) const noexcept {
    const std::size_t floats = quantised() ? chunks(n) : selected(n);
    const std::size_t indices = floats * sizeof(float);
    return {.indices = indices, .codes = indices + selected(n) * index_bytes(cfg_)};
  }

  /// encode with indices of type Index on the wire.
  template <class Index>
  void encode_as(const float* delta, std::span<std::byte> wire) {
    const std::size_t n = e_.size(), K = cfg_.k;
    const kernels::isa which = kernels::active_isa();
    const layout at = sections(n);
    float* scales_or_values = reinterpret_cast<float*>(wire.data());
    Index* indices = reinterpret_cast<Index*>(wire.data() + at.indices);
    std::uint8_t* all_codes = reinterpret_cast<std::uint8_t*>(wire.data() + at.codes);
    if (quantised()) std::memset(all_codes, 0, wire.size() - at.codes);
    for (std::size_t c = 0, base = 0; base < n; ++c, base += cfg_.chunk) {
      const std::size_t m = std::min(cfg_.chunk, n - base);
      const std::size_t k_sent = std::min(K, m);
      float* ec = e_.data() + base;
      std::uint32_t* order = order_.data();
      const std::uint32_t lower =
          detail::topk_fold_on(which, ec, delta + base, m, cfg_.beta, cmag_.data(), K);
      if (k_sent < m)
        detail::topk_select(which, ec, m, k_sent, lower, cand_.data(), cmag_.data(), order);
      else
        std::iota(order, order + m, std::uint32_t{0});
      Index* idx = indices + c * K;
      for (std::size_t j = 0; j < k_sent; ++j) idx[j] = static_cast<Index>(order[j]);
      if (quantised())
        send_quantised(ec, k_sent, scales_or_values + c, all_codes + c * code_bytes(cfg_, K));
      else
        send_values(ec, k_sent, scales_or_values + c * K);
    }
  }

  /// A chunk's k_sent selections (order_) as a scale and codes; the residual keeps the rest.
  void send_quantised(float* ec, std::size_t k_sent, float* scale, std::uint8_t* codes) {
    const std::uint32_t* order = order_.data();
    float s = 0.0f;
    for (std::size_t j = 0; j < k_sent; ++j) s = std::max(s, std::fabs(ec[order[j]]));
    *scale = s;
    const detail::topk_quantiser q(cfg_.bits);
    for (std::size_t j = 0; j < k_sent; ++j) {
      float& v = ec[order[j]];
      const std::uint32_t code = q.encode(v, s);
      detail::put_code(codes, j * cfg_.bits, code, cfg_.bits);
      v -= q.decode(code, s);
    }
  }

  /// A chunk's k_sent selections (order_) as f32 values; the residual keeps v - v.
  void send_values(float* ec, std::size_t k_sent, float* values) {
    const std::uint32_t* order = order_.data();
    for (std::size_t j = 0; j < k_sent; ++j) {
      float& v = ec[order[j]];
      values[j] = v;
      v -= values[j];
    }
  }

  /// decode_add with indices of type Index on the wire.
  template <class Index>
  void decode_add_as(std::span<const std::byte> wire, std::span<float> out) const {
    const std::size_t n = out.size(), K = cfg_.k;
    const layout at = sections(n);
    const float* scales_or_values = reinterpret_cast<const float*>(wire.data());
    const Index* indices = reinterpret_cast<const Index*>(wire.data() + at.indices);
    const std::uint8_t* all_codes = reinterpret_cast<const std::uint8_t*>(wire.data() + at.codes);
    const detail::topk_quantiser q(quantised() ? cfg_.bits : 1u);
    for (std::size_t c = 0, base = 0; base < n; ++c, base += cfg_.chunk) {
      const std::size_t m = std::min(cfg_.chunk, n - base);
      const std::size_t k_sent = std::min(K, m);
      const Index* idx = indices + c * K;
      float* oc = out.data() + base;
      for (std::size_t j = 0; j < k_sent; ++j)
        FEDSHARD_EXPECTS(idx[j] < m, "topk::decode_add: index ", idx[j], " in chunk ", c, " of ", m,
                         " elements (corrupt wire?)");
      if (quantised()) {
        const float s = scales_or_values[c];
        const std::uint8_t* codes = all_codes + c * code_bytes(cfg_, K);
        for (std::size_t j = 0; j < k_sent; ++j)
          oc[idx[j]] += q.decode(detail::get_code(codes, j * cfg_.bits, cfg_.bits), s);
      } else {
        const float* values = scales_or_values + c * K;
        for (std::size_t j = 0; j < k_sent; ++j) oc[idx[j]] += values[j];
      }
    }
  }

  config cfg_;
  std::vector<float> e_;
  std::vector<std::uint32_t> order_;  // per-chunk scratch: the indices sent
  std::vector<std::uint32_t> cand_;   // per-chunk scratch: candidate indices
  std::vector<std::uint32_t> cmag_;   // per-chunk scratch: column maxima, candidates' |e| bits
};

}  // namespace fedshard::codec
