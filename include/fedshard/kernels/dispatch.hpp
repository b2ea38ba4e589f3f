#pragma once
/// Run-time choice of the instruction set of the hot host loops.
///
/// A header-only library cannot choose its users' compiler flags. With the default x86-64
/// flags (SSE2), `std::fma` is a library call per element and loops run 4 floats wide. The
/// hot host kernels (optimizers, outer rules, casts, codecs, reductions) therefore compile
/// their loops once per instruction set, with GCC/Clang `target` attributes, and call the
/// widest one the CPU supports (`active_isa()`). Tests and benchmarks lower the choice with
/// `isa_limit_guard` or the environment variable FEDSHARD_ISA (portable, avx2 or avx512).
///
/// Every version must give the same bits as the portable one. Each version runs the same
/// operations in the same order, so what can differ is only what the compiler adds:
///  - no contraction: GCC contracts `a * b + c` into an fma wherever the target has one
///    (C++ defaults to -ffp-contract=fast), so every dispatched loop is compiled with
///    fp-contract off (FEDSHARD_TARGET_*); a kernel that wants an fma writes std::fma, which
///    is exact in every version (an instruction where the target has FMA, a library call
///    otherwise);
///  - no reassociation: reductions keep their order (the compiler does not reorder float
///    sums without -ffast-math, which a user must not combine with bit-identical claims).
/// Tests run every version the machine supports and compare the bits (tests/kernels/).
///
/// Vector width: the loops of kernels without a square root vectorise in every version
/// (16 floats wide in the AVX-512 one). A square root keeps GCC's loop scalar under its
/// default -fmath-errno (`std::sqrt` of a negative number must set errno), and a
/// per-function `optimize("no-math-errno")` does not help (GCC 12 keeps the errno branch of
/// a sqrt inlined into such a loop). AdamW's loop therefore runs hand-vectorised blocks
/// (kernels::vector_blocks, kernels/adamw.hpp) in the AVX2 and AVX-512 versions, with the
/// same bits; the outer rules with a square root (fedadam, fedyogi) still run sqrtss one
/// element at a time unless the user compiles with -fno-math-errno.
///
/// On other architectures, with other compilers than GCC, in CUDA translation units or with
/// FEDSHARD_NO_DISPATCH defined, only the portable version exists.

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

#include "fedshard/error.hpp"

// GCC only: Clang decides contraction per expression in the functor's own source, which a
// target attribute on the loop cannot turn off, so under Clang the portable loop runs.
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__CUDACC__) && !defined(FEDSHARD_NO_DISPATCH)
#define FEDSHARD_DISPATCH 1
#else
#define FEDSHARD_DISPATCH 0
#endif

#if FEDSHARD_DISPATCH
// GCC: contraction is a per-function optimisation setting, and a functor inlined into the
// loop follows the loop's.
#define FEDSHARD_DETAIL_NO_CONTRACT , optimize("fp-contract=off")
#define FEDSHARD_TARGET_PORTABLE __attribute__((optimize("fp-contract=off")))
#else
#define FEDSHARD_DETAIL_NO_CONTRACT
#define FEDSHARD_TARGET_PORTABLE
#endif

#if FEDSHARD_DISPATCH
/// Attributes of a loop compiled for AVX2 + FMA (Haswell, Zen and later), fp-contract off.
#define FEDSHARD_TARGET_AVX2 __attribute__((target("avx2,fma") FEDSHARD_DETAIL_NO_CONTRACT))
/// Attributes of a loop compiled for AVX-512 F/BW/DQ/VL (Skylake-SP, Zen 4 and later).
#define FEDSHARD_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma") FEDSHARD_DETAIL_NO_CONTRACT))
#else
#define FEDSHARD_TARGET_AVX2
#define FEDSHARD_TARGET_AVX512
#endif
/// FEDSHARD_TARGET_PORTABLE: the attributes of the portable loop: the user's flags with
/// fp-contract off, so that a build with -march=native gives the same bits too.

namespace fedshard::kernels {

/// The instruction sets a dispatched loop is compiled for, narrowest first.
enum class isa : std::uint8_t { portable, avx2, avx512 };

constexpr std::string_view to_string(isa i) noexcept {
  switch (i) {
    case isa::portable: return "portable";
    case isa::avx2: return "avx2";
    case isa::avx512: return "avx512";
  }
  return "unknown-isa";
}

/// Parses "portable", "avx2" or "avx512"; invalid_argument naming the accepted values.
inline isa parse_isa(std::string_view s) {
  for (isa i : {isa::portable, isa::avx2, isa::avx512})
    if (s == to_string(i)) return i;
  throw invalid_argument(fedshard::detail::concat("fedshard: unknown instruction set '", s,
                                                  "', expected portable, avx2 or avx512"));
}

/// The widest instruction set this CPU (and OS) supports, detected once.
inline isa detected_isa() noexcept {
#if FEDSHARD_DISPATCH
  static const isa best = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
      return isa::avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return isa::avx2;
    return isa::portable;
  }();
  return best;
#else
  return isa::portable;
#endif
}

namespace detail {
/// The limit FEDSHARD_ISA sets (the widest when unset); invalid_argument for other values.
inline isa env_isa_limit() {
  const char* v = std::getenv("FEDSHARD_ISA");
  return (v == nullptr || *v == '\0') ? isa::avx512 : parse_isa(v);
}
/// The process-wide limit: FEDSHARD_ISA at first use, then what isa_limit_guard sets.
inline std::atomic<isa>& isa_limit() {
  static std::atomic<isa> limit{env_isa_limit()};
  return limit;
}
}  // namespace detail

/// The instruction set dispatched loops use now: the detected one, lowered to the limit.
inline isa active_isa() noexcept {
  const isa limit = detail::isa_limit().load(std::memory_order_relaxed);
  const isa best = detected_isa();
  return limit < best ? limit : best;
}

/// Every instruction set this machine can run, narrowest first (tests compare them).
inline std::vector<isa> supported_isas() {
  std::vector<isa> out;
  for (isa i : {isa::portable, isa::avx2, isa::avx512})
    if (i <= detected_isa()) out.push_back(i);
  return out;
}

#if FEDSHARD_DISPATCH
/// On a lambda or function: always inlined, so that its body is compiled into the
/// dispatched copy that calls it (call_on).
#define FEDSHARD_ALWAYS_INLINE __attribute__((always_inline))
#else
#define FEDSHARD_ALWAYS_INLINE
#endif

namespace detail {
template <class F>
FEDSHARD_TARGET_PORTABLE inline auto call_portable(F f) noexcept {
  return f();
}
#if FEDSHARD_DISPATCH
template <class F>
FEDSHARD_TARGET_AVX2 inline auto call_avx2(F f) noexcept {
  return f();
}
template <class F>
FEDSHARD_TARGET_AVX512 inline auto call_avx512(F f) noexcept {
  return f();
}
#endif
}  // namespace detail

/// f() compiled for the instruction set `which` (or the widest narrower one this CPU runs).
/// f's call operator, and what it calls, must be FEDSHARD_ALWAYS_INLINE: then they are
/// compiled into each dispatched copy with its instruction set.
template <class F>
inline auto call_on(isa which, F f) noexcept {
#if FEDSHARD_DISPATCH
  if (which == isa::avx512 && detected_isa() >= isa::avx512) return detail::call_avx512(f);
  if (which >= isa::avx2 && detected_isa() >= isa::avx2) return detail::call_avx2(f);
#else
  (void)which;
#endif
  return detail::call_portable(f);
}

/// Lowers the process-wide limit for its lifetime (tests and benchmarks; not thread-safe
/// against kernels running on other threads at the moment it changes).
class isa_limit_guard {
 public:
  explicit isa_limit_guard(isa limit) : previous_(detail::isa_limit().exchange(limit)) {}
  ~isa_limit_guard() { detail::isa_limit().store(previous_); }
  isa_limit_guard(const isa_limit_guard&) = delete;
  isa_limit_guard& operator=(const isa_limit_guard&) = delete;

 private:
  isa previous_;
};

}  // namespace fedshard::kernels
