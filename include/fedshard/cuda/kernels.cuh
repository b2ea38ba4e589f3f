#pragma once
/// CUDA kernels over device memory, each calling the FEDSHARD_HOST_DEVICE functor of
/// fedshard/kernels/ that the host loops call, so device results equal host results bit
/// for bit: dtype casts (cast_fn), pack and unpack of a unit's tensors into a flat shard
/// (copy_fn / zero_fn over the segments of kernels::for_each_segment), weighted
/// aggregation of K shards (weighted_sum_fn, one launch for all K), shard SGD and AdamW
/// (sgd_update, adamw_update) and the outer optimizers (outer_*_update: outer SGD,
/// Nesterov and FedMom hand their scalars to sgd_update).
///
/// Every function enqueues its work on the given stream and returns at once (plans upload
/// their segment table once, when built). Pointers and spans are device memory; arguments
/// are checked on the host before anything is enqueued (fedshard::invalid_argument).
///
/// Memory access. Threads move 16 bytes per load (int4 / uint4 vectors) where a range is
/// 16-byte aligned: a few leading elements are handled one by one up to the alignment, then
/// whole vectors, then the tail. Any element-aligned pointer works; when two ranges of one
/// operation sit at different offsets modulo 16 the loads stay vectorised and the stores
/// go element by element (casts, pack), the misaligned inputs are staged element by
/// element (weighted_sum), or the optimizer steps run element by element.

#include "fedshard/cuda/config.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/cuda/device_buffer.cuh"
#include "fedshard/cuda/error.cuh"
#include "fedshard/error.hpp"
#include "fedshard/kernels/adamw.hpp"
#include "fedshard/kernels/cast.hpp"
#include "fedshard/kernels/outer.hpp"
#include "fedshard/kernels/pack.hpp"
#include "fedshard/kernels/sgd.hpp"
#include "fedshard/kernels/weighted_sum.hpp"

namespace fedshard::gpu {

/// The most inputs one weighted_sum launch takes (their pointers and weights travel as
/// kernel parameters).
inline constexpr std::size_t max_weighted_sum_inputs = 64;

namespace detail {

// ---------------------------------------------------------------- vector access

/// N elements of T moved as one aligned access of N * sizeof(T) <= 16 bytes.
template <class T, int N>
struct alignas(N * sizeof(T)) vec {
  T v[N];
};

/// The raw integer vector type of a Bytes-wide access.
template <std::size_t Bytes>
struct raw_access;
template <>
struct raw_access<2> {
  using type = unsigned short;
};
template <>
struct raw_access<4> {
  using type = unsigned int;
};
template <>
struct raw_access<8> {
  using type = uint2;
};
template <>
struct raw_access<16> {
  using type = uint4;
};

/// Loads N elements from p, which is aligned to N * sizeof(T), as one access.
template <class T, int N>
__device__ __forceinline__ vec<T, N> load_vec(const T* p) {
  using raw = typename raw_access<N * sizeof(T)>::type;
  return ::fedshard::detail::bit_cast<vec<T, N>>(*reinterpret_cast<const raw*>(p));
}

/// Stores N elements to p, which is aligned to N * sizeof(T), as one access. A 16-byte
/// store is written as one st.v4.u32 (generic address: global or shared memory): nvcc 13
/// split the plain uint4 store into four 4-byte stores when the elements came from a cast
/// (bf16 -> f32 ran at 0.46 x memcpy on an H200; Nsight Compute: 8 of 32 bytes used per
/// store sector).
template <class T, int N>
__device__ __forceinline__ void store_vec(T* p, const vec<T, N>& x) {
  using raw = typename raw_access<N * sizeof(T)>::type;
  const raw r = ::fedshard::detail::bit_cast<raw>(x);
  if constexpr (sizeof(raw) == 16)
    asm volatile("st.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(r.x), "r"(r.y), "r"(r.z),
                 "r"(r.w)
                 : "memory");
  else
    *reinterpret_cast<raw*>(p) = r;
}

/// Elements per vector of a Src -> Dst pass: neither side's access exceeds 16 bytes.
template <class Src, class Dst>
inline constexpr int vec_elems =
    static_cast<int>(vector_bytes / (sizeof(Src) > sizeof(Dst) ? sizeof(Src) : sizeof(Dst)));

/// Vectors per thread in one tile of a copy pass.
inline constexpr int tile_vectors = 4;

/// Elements of one tile (the work of one block) of a Src -> Dst copy pass.
template <class Src, class Dst>
inline constexpr std::uint64_t tile_elems =
    std::uint64_t{block_threads} * tile_vectors* vec_elems<Src, Dst>;

inline std::uintptr_t address(const void* p) noexcept {
  return reinterpret_cast<std::uintptr_t>(p);
}

/// Checks that p is aligned for its element type (a precondition of every kernel here).
template <class T>
void check_element_aligned(const T* p, const char* what, const char* name) {
  FEDSHARD_EXPECTS(address(p) % alignof(T) == 0, what, ": ", name, " (",
                   static_cast<const void*>(p), ") is not aligned to its element size ",
                   alignof(T));
}

inline unsigned grid_for(std::uint64_t blocks) {
  return static_cast<unsigned>(std::clamp<std::uint64_t>(blocks, 1, max_grid_blocks));
}

// ---------------------------------------------------------------- segments: cast, pack, unpack

/// A contiguous run copied (src != nullptr) or zeroed (src == nullptr) by a copy pass.
/// `head` elements are done one by one before the first aligned vector; `vector_store` is 0
/// when dst is not aligned at that vector (stores then go element by element);
/// `first_tile` is the index of the segment's first tile in its launch.
struct segment {
  const void* src = nullptr;
  void* dst = nullptr;
  std::uint64_t count = 0;
  std::uint64_t first_tile = 0;
  std::uint32_t head = 0;
  std::uint32_t vector_store = 1;
};

/// A segment of count elements from src to dst (src null: zero fill) for a Src -> Dst pass.
template <class Src, class Dst>
segment make_segment(const Src* src, Dst* dst, std::uint64_t count) {
  constexpr int v = vec_elems<Src, Dst>;
  segment s;
  s.src = src;
  s.dst = dst;
  s.count = count;
  const std::uintptr_t anchor = src != nullptr ? address(src) : address(dst);
  const std::size_t elem = src != nullptr ? sizeof(Src) : sizeof(Dst);
  const std::uintptr_t align = v * elem;
  const std::uint64_t head = ((align - anchor % align) % align) / elem;
  s.head = static_cast<std::uint32_t>(std::min<std::uint64_t>(head, count));
  s.vector_store = (address(dst) + s.head * sizeof(Dst)) % (v * sizeof(Dst)) == 0 ? 1u : 0u;
  return s;
}

/// Tiles a segment takes in a Src -> Dst pass (at least one: it also does the head).
template <class Src, class Dst>
std::uint64_t tiles_of(const segment& s) {
  constexpr std::uint64_t t = tile_elems<Src, Dst>;
  const std::uint64_t body = s.count - s.head;
  return body == 0 ? 1 : (body + t - 1) / t;
}

/// Tile `tile` of a segment in a Src -> Dst pass, block_threads-wide: one(i) for the
/// segment's head (in tile 0) and for the tile's tail, body(lo, nvec) for its nvec whole
/// vectors from element lo.
template <class Src, class Dst, class One, class Body>
__device__ __forceinline__ void for_tile(const segment& s, std::uint64_t tile, const One& one,
                                         Body&& body) {
  constexpr int v = vec_elems<Src, Dst>;
  constexpr std::uint64_t t_elems = tile_elems<Src, Dst>;
  const unsigned t = threadIdx.x;
  if (tile == 0)
    for (std::uint64_t i = t; i < s.head; i += block_threads) one(i);
  const std::uint64_t lo = s.head + tile * t_elems;
  if (lo >= s.count) return;
  const std::uint64_t hi = lo + t_elems < s.count ? lo + t_elems : s.count;
  const std::uint64_t nvec = (hi - lo) / v;
  body(lo, nvec);
  for (std::uint64_t i = lo + nvec * v + t; i < hi; i += block_threads) one(i);
}

/// Tile `tile` of a copy segment: dst[i] = cast(src[i]) through kernels::cast_fn, the
/// vector body through 16-byte loads.
template <class Src, class Dst>
__device__ void copy_tile(const Src* src, Dst* dst, const segment& s, std::uint64_t tile) {
  constexpr int v = vec_elems<Src, Dst>;
  const kernels::cast_fn<Src, Dst> cast;
  const unsigned t = threadIdx.x;
  auto put = [&](std::uint64_t i, const vec<Src, v>& a) {
    if (s.vector_store != 0) {
      vec<Dst, v> b;
#pragma unroll
      for (int l = 0; l < v; ++l) b.v[l] = cast(a.v[l]);
      store_vec<Dst, v>(dst + i, b);
    } else {
#pragma unroll
      for (int l = 0; l < v; ++l) dst[i + l] = cast(a.v[l]);
    }
  };
  auto vectors = [&](std::uint64_t lo, std::uint64_t nvec) {
    if (nvec == std::uint64_t{block_threads} * tile_vectors) {  // a full tile: loads first
      vec<Src, v> a[tile_vectors];
#pragma unroll
      for (int k = 0; k < tile_vectors; ++k)
        a[k] = load_vec<Src, v>(src + lo + (k * block_threads + t) * v);
#pragma unroll
      for (int k = 0; k < tile_vectors; ++k) put(lo + (k * block_threads + t) * v, a[k]);
    } else {
      for (std::uint64_t j = t; j < nvec; j += block_threads)
        put(lo + j * v, load_vec<Src, v>(src + lo + j * v));
    }
  };
  for_tile<Src, Dst>(s, tile, kernels::copy_fn<Src, Dst>{src, dst}, vectors);
}

/// Tile `tile` of a padding segment: dst[i] = +0 through kernels::zero_fn and zero vectors.
template <class Src, class Dst>
__device__ void zero_tile(Dst* dst, const segment& s, std::uint64_t tile) {
  constexpr int v = vec_elems<Src, Dst>;
  auto vectors = [&](std::uint64_t lo, std::uint64_t nvec) {
    vec<Dst, v> z;
#pragma unroll
    for (int l = 0; l < v; ++l) z.v[l] = Dst{};
    for (std::uint64_t j = threadIdx.x; j < nvec; j += block_threads)
      store_vec<Dst, v>(dst + lo + j * v, z);
  };
  for_tile<Src, Dst>(s, tile, kernels::zero_fn<Dst>{dst}, vectors);
}

template <class Src, class Dst>
__device__ __forceinline__ void run_tile(const segment& s, std::uint64_t tile) {
  if (s.src == nullptr)
    zero_tile<Src, Dst>(static_cast<Dst*>(s.dst), s, tile);
  else
    copy_tile<Src, Dst>(static_cast<const Src*>(s.src), static_cast<Dst*>(s.dst), s, tile);
}

/// One segment (a cast): block b does tiles b, b + gridDim.x, ...
template <class Src, class Dst>
__global__ void __launch_bounds__(block_threads) segment_kernel(segment s, std::uint64_t tiles) {
  for (std::uint64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x)
    run_tile<Src, Dst>(s, tile);
}

/// All segments of a plan in one launch: each tile finds its segment by binary search on
/// first_tile (the same for every thread of the block).
template <class Src, class Dst>
__global__ void __launch_bounds__(block_threads)
    segments_kernel(const segment* table, std::uint32_t n, std::uint64_t tiles) {
  for (std::uint64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    std::uint32_t lo = 0, hi = n;
    while (hi - lo > 1) {
      const std::uint32_t mid = lo + (hi - lo) / 2;
      if (table[mid].first_tile <= tile)
        lo = mid;
      else
        hi = mid;
    }
    const segment s = table[lo];
    run_tile<Src, Dst>(s, tile - s.first_tile);
  }
}

/// Uploads segments (first_tile filled in here) and returns (table, total tiles).
template <class Src, class Dst>
std::pair<device_buffer<segment>, std::uint64_t> upload_segments(std::vector<segment>& segs) {
  std::uint64_t tiles = 0;
  for (segment& s : segs) {
    s.first_tile = tiles;
    tiles += tiles_of<Src, Dst>(s);
  }
  return {device_buffer<segment>::from_host(segs), tiles};
}

template <class Src, class Dst>
void launch_segments(const device_buffer<segment>& table, std::uint64_t tiles, cudaStream_t stream,
                     const char* what) {
  if (table.empty()) return;
  segments_kernel<Src, Dst><<<grid_for(tiles), block_threads, 0, stream>>>(
      table.data(), static_cast<std::uint32_t>(table.size()), tiles);
  check_launch(what);
}

}  // namespace detail

// ---------------------------------------------------------------- cast

/// out[i] = kernels::cast_fn<From, To>(in[i]) on the device, enqueued on stream. Sizes must
/// match; the spans must not overlap unless they are the same span of the same type (then
/// nothing is done). Same types are copied with cudaMemcpyAsync.
template <class From, class To>
void cast(std::span<From> in, std::span<To> out, cudaStream_t stream) {
  using F = std::remove_const_t<From>;
  static_assert(!std::is_const_v<To>, "fedshard::gpu::cast: the output must be writable");
  FEDSHARD_EXPECTS(in.size() == out.size(), "gpu::cast: input has ", in.size(),
                   " elements, output has ", out.size(), " (sizes must match)");
  if (in.empty()) return;
  detail::check_element_aligned(in.data(), "gpu::cast", "input");
  detail::check_element_aligned(out.data(), "gpu::cast", "output");
  if constexpr (std::is_same_v<F, To>) {
    if (static_cast<const void*>(in.data()) != static_cast<const void*>(out.data()))
      FEDSHARD_CUDA_TRY(cudaMemcpyAsync(out.data(), in.data(), in.size_bytes(),
                                        cudaMemcpyDeviceToDevice, stream));
  } else {
    const detail::segment s = detail::make_segment<F, To>(in.data(), out.data(), in.size());
    const std::uint64_t tiles = detail::tiles_of<F, To>(s);
    detail::segment_kernel<F, To><<<detail::grid_for(tiles), block_threads, 0, stream>>>(s, tiles);
    detail::check_launch("fedshard::gpu::cast");
  }
}

/// Converts a type-erased device buffer into another of any dtype (same dtype: a copy); the
/// checks and messages of kernels::cast.
inline void cast(const_buffer_view in, buffer_view out, cudaStream_t stream) {
  kernels::detail::check_cast_views(in, out, "gpu::cast");
  visit(in.type, out.type, [&](auto from, auto to) {
    using From = typename decltype(from)::type;
    using To = typename decltype(to)::type;
    cast(std::span<const From>(static_cast<const From*>(in.data), in.count),
         std::span<To>(static_cast<To*>(out.data), out.count), stream);
  });
}

// ---------------------------------------------------------------- pack and unpack

namespace detail {

/// A copy pass prepared once: segments uploaded with their first tiles when built, run as
/// one launch of segments_kernel<S, D>. What pack_plan and unpack_plan are.
template <class S, class D>
class segment_plan {
 public:
  /// Enqueues the whole pass on stream.
  void run(cudaStream_t stream) const { launch_segments<S, D>(table_, tiles_, stream, name_); }

  /// Segments of one run.
  std::size_t segments() const noexcept { return table_.size(); }

 protected:
  /// Uploads segs; name is the launch's in error messages.
  segment_plan(std::vector<segment> segs, const char* name) : name_(name) {
    std::tie(table_, tiles_) = upload_segments<S, D>(segs);
  }

 private:
  device_buffer<segment> table_;
  std::uint64_t tiles_ = 0;
  const char* name_;
};

/// The segments between a unit's tensors (device pointers) and shard, the flat range
/// [shard_begin, shard_begin + shard.size()), after the checks of kernels::pack (and, with
/// whole_flat, that every tensor lies inside the flat buffer shard): with ToShard (a pack)
/// the tensor parts and the padding runs into the shard, else (an unpack) the tensor parts
/// out of it. S and D are the source and destination element types; name starts messages.
template <bool ToShard, class S, class D, class T, class Shard>
std::vector<segment> unit_segments(std::span<const kernels::tensor_ref<T>> tensors,
                                   std::size_t shard_begin, std::span<Shard> shard, bool whole_flat,
                                   const char* name) {
  kernels::check_tensor_layout(tensors, name);
  if (whole_flat) kernels::detail::check_inside_flat(tensors, shard.size(), name);
  if (!shard.empty()) check_element_aligned(shard.data(), name, "shard");
  for (const auto& t : tensors)
    if (t.count != 0) check_element_aligned(t.data, name, "a tensor");
  std::vector<segment> segs;
  kernels::detail::for_each_segment_unchecked(
      tensors, shard_begin, shard.size(), name, [&](const kernels::pack_segment& p) {
        const bool padding = p.tensor == kernels::pack_segment::padding;
        if constexpr (ToShard) {  // padding: a zero fill (no source)
          const S* src = padding ? nullptr : tensors[p.tensor].data + p.tensor_pos;
          segs.push_back(make_segment<S, D>(src, shard.data() + p.shard_pos, p.count));
        } else if (!padding) {
          segs.push_back(make_segment<S, D>(shard.data() + p.shard_pos,
                                            tensors[p.tensor].data + p.tensor_pos, p.count));
        }
      });
  return segs;
}

}  // namespace detail

/// kernels::pack on the device, prepared once: the segments of a unit's tensors (device
/// pointers) and a shard are computed and uploaded when the plan is built, and run()
/// enqueues the whole pack as one launch; segments() counts the tensor parts and padding
/// runs of one run. Src is the tensors' element type (may be const), Dst the shard's. The
/// tensors and the shard must stay allocated while the plan is run.
template <class Src, class Dst>
class pack_plan : public detail::segment_plan<std::remove_const_t<Src>, Dst> {
  using S = std::remove_const_t<Src>;
  static_assert(!std::is_const_v<Dst>, "fedshard::gpu::pack_plan: the shard must be writable");

 public:
  /// Fills shard, the flat range [shard_begin, shard_begin + shard.size()), from the tensors
  /// and zero elsewhere; the layout rules of kernels::pack hold.
  pack_plan(std::span<const kernels::tensor_ref<Src>> tensors, std::size_t shard_begin,
            std::span<Dst> shard)
      : pack_plan(tensors, shard_begin, shard, false) {}
  /// Fills the whole flat buffer; every tensor must lie inside it.
  pack_plan(std::span<const kernels::tensor_ref<Src>> tensors, std::span<Dst> flat)
      : pack_plan(tensors, 0, flat, true) {}

 private:
  pack_plan(std::span<const kernels::tensor_ref<Src>> tensors, std::size_t shard_begin,
            std::span<Dst> shard, bool whole_flat)
      : detail::segment_plan<S, Dst>(detail::unit_segments<true, S, Dst>(
                                         tensors, shard_begin, shard, whole_flat, "gpu::pack_plan"),
                                     "fedshard::gpu::pack_plan") {}
};

/// kernels::unpack on the device, prepared once (see pack_plan): writes a shard back into
/// the parts of the tensors it covers; segments() counts the tensor parts written by one
/// run. Src is the shard's element type (may be const), Dst the tensors'.
template <class Src, class Dst>
class unpack_plan : public detail::segment_plan<std::remove_const_t<Src>, Dst> {
  using S = std::remove_const_t<Src>;
  static_assert(!std::is_const_v<Dst>, "fedshard::gpu::unpack_plan: tensors must be writable");

 public:
  /// Writes shard, the flat range [shard_begin, shard_begin + shard.size()), into the tensors;
  /// the layout rules of kernels::unpack hold.
  unpack_plan(std::span<Src> shard, std::size_t shard_begin,
              std::span<const kernels::tensor_ref<Dst>> tensors)
      : unpack_plan(shard, shard_begin, tensors, false) {}
  /// Writes the whole flat buffer into the tensors; every tensor must lie inside it.
  unpack_plan(std::span<Src> flat, std::span<const kernels::tensor_ref<Dst>> tensors)
      : unpack_plan(flat, 0, tensors, true) {}

 private:
  unpack_plan(std::span<Src> shard, std::size_t shard_begin,
              std::span<const kernels::tensor_ref<Dst>> tensors, bool whole_flat)
      : detail::segment_plan<S, Dst>(
            detail::unit_segments<false, S, Dst>(tensors, shard_begin, shard, whole_flat,
                                                 "gpu::unpack_plan"),
            "fedshard::gpu::unpack_plan") {}
};

// ---------------------------------------------------------------- weighted sum

namespace detail {

/// The arguments of one weighted_sum launch (kernel parameters, about 1 KiB).
template <class In, class Out>
struct weighted_sum_args {
  using accum = kernels::accum_t<In, Out>;
  const In* ins[max_weighted_sum_inputs];
  accum weights[max_weighted_sum_inputs];
  Out* out;
  std::uint64_t n;
  std::uint64_t head;     ///< elements before the first aligned vector (of input 0)
  std::uint64_t nvec;     ///< whole vectors after the head
  std::uint64_t aligned;  ///< bit j: input j is 16-byte aligned at element head
  std::uint32_t k;
};

/// Elements per vector of weighted_sum's input.
template <class In>
inline constexpr int ws_vec = static_cast<int>(vector_bytes / sizeof(In));

/// Elements of one weighted_sum tile: one vector per thread.
template <class In>
inline constexpr std::uint64_t ws_tile = std::uint64_t{block_threads} * ws_vec<In>;

/// Shared memory (bytes) a staged weighted_sum with k inputs needs beyond its static part.
template <class In>
constexpr std::size_t ws_stage_bytes(std::size_t k) {
  return k * ws_tile<In> * sizeof(In);
}

/// Copies the pointers and weights into shared memory; returns after a barrier.
template <class In, class Out>
__device__ __forceinline__ void load_ws_table(const weighted_sum_args<In, Out>& a, const In** ins,
                                              kernels::accum_t<In, Out>* w) {
  for (unsigned j = threadIdx.x; j < a.k; j += block_threads) {
    ins[j] = a.ins[j];
    w[j] = a.weights[j];
  }
  __syncthreads();
}

/// weighted_sum with the inputs staged tile by tile in shared memory: each thread loads one
/// 16-byte vector of every input with a non-zero weight, then every output element of the
/// tile is kernels::weighted_sum_fn over the staged copies. Block 0 also does the head and
/// tail elements straight from global memory. Inputs are read once, out written once.
template <class In, class Out>
__global__ void __launch_bounds__(block_threads)
    weighted_sum_staged_kernel(const weighted_sum_args<In, Out> a) {
  using accum = kernels::accum_t<In, Out>;
  constexpr int v = ws_vec<In>;
  constexpr std::uint64_t tile_n = ws_tile<In>;
  extern __shared__ uint4 stage_storage[];
  In* const stage = reinterpret_cast<In*>(stage_storage);
  __shared__ const In* ins[max_weighted_sum_inputs];
  __shared__ const In* staged[max_weighted_sum_inputs];
  __shared__ accum w[max_weighted_sum_inputs];
  for (unsigned j = threadIdx.x; j < a.k; j += block_threads) staged[j] = stage + j * tile_n;
  load_ws_table(a, ins, w);
  const unsigned t = threadIdx.x;
  if (blockIdx.x == 0) {
    const kernels::weighted_sum_fn<In, Out> direct{ins, w, a.k};
    for (std::uint64_t i = t; i < a.head; i += block_threads) a.out[i] = direct(i);
    for (std::uint64_t i = a.head + a.nvec * v + t; i < a.n; i += block_threads)
      a.out[i] = direct(i);
  }
  const kernels::weighted_sum_fn<In, Out> f{staged, w, a.k};
  const std::uint64_t tiles = (a.nvec + block_threads - 1) / block_threads;
  for (std::uint64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const std::uint64_t first = tile * block_threads;
    const std::uint64_t left = a.nvec - first;
    const unsigned vecs = left < block_threads ? static_cast<unsigned>(left) : block_threads;
    const std::uint64_t base = a.head + first * v;
    const unsigned elems = vecs * v;
    for (unsigned j = 0; j < a.k; ++j) {
      if (w[j] == 0) continue;  // weighted_sum_fn never reads it
      const In* src = ins[j] + base;
      In* dst = stage + j * tile_n;
      if ((a.aligned >> j) & 1u) {
        if (t < vecs) store_vec<In, v>(dst + t * v, load_vec<In, v>(src + t * v));
      } else {
#pragma unroll
        for (int l = 0; l < v; ++l) {
          const unsigned e = l * block_threads + t;
          if (e < elems) dst[e] = src[e];
        }
      }
    }
    __syncthreads();
#pragma unroll
    for (int l = 0; l < v; ++l) {
      const unsigned e = l * block_threads + t;
      if (e < elems) a.out[base + e] = f(e);
    }
    __syncthreads();
  }
}

/// weighted_sum straight from global memory, element by element (when the staged copies
/// of all inputs do not fit in shared memory).
template <class In, class Out>
__global__ void __launch_bounds__(block_threads)
    weighted_sum_direct_kernel(const weighted_sum_args<In, Out> a) {
  __shared__ const In* ins[max_weighted_sum_inputs];
  __shared__ kernels::accum_t<In, Out> w[max_weighted_sum_inputs];
  load_ws_table(a, ins, w);
  const kernels::weighted_sum_fn<In, Out> f{ins, w, a.k};
  const std::uint64_t stride = std::uint64_t{gridDim.x} * block_threads;
  for (std::uint64_t i = std::uint64_t{blockIdx.x} * block_threads + threadIdx.x; i < a.n;
       i += stride)
    a.out[i] = f(i);
}

/// Static shared memory of the staged kernel, an upper bound.
template <class In, class Out>
inline constexpr std::size_t ws_static_bytes =
    max_weighted_sum_inputs*(2 * sizeof(const In*) + sizeof(kernels::accum_t<In, Out>));

template <class In, class Out>
void launch_weighted_sum(const weighted_sum_args<In, Out>& a, cudaStream_t stream) {
  constexpr std::size_t default_limit = 48 * 1024;
  const std::size_t stage = ws_stage_bytes<In>(a.k);
  const std::size_t needed = stage + ws_static_bytes<In, Out>;
  bool staged = needed <= default_limit;
  if (!staged) {
    int device = 0, optin = 0;
    FEDSHARD_CUDA_TRY(cudaGetDevice(&device));
    FEDSHARD_CUDA_TRY(
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    if (needed <= static_cast<std::size_t>(optin)) {
      // The largest value any call needs, so that concurrent launches never see a smaller one.
      FEDSHARD_CUDA_TRY(cudaFuncSetAttribute(weighted_sum_staged_kernel<In, Out>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             optin - static_cast<int>(ws_static_bytes<In, Out>)));
      staged = true;
    }
  }
  if (staged) {
    const std::uint64_t tiles = (a.nvec + block_threads - 1) / block_threads;
    weighted_sum_staged_kernel<In, Out><<<grid_for(tiles), block_threads, stage, stream>>>(a);
  } else {
    const std::uint64_t blocks = (a.n + block_threads - 1) / block_threads;
    weighted_sum_direct_kernel<In, Out><<<grid_for(blocks), block_threads, 0, stream>>>(a);
  }
  check_launch("fedshard::gpu::weighted_sum");
}

}  // namespace detail

/// out[i] = sum over k of weights[k] * ins[k][i] on the device: kernels::weighted_sum_fn
/// (accumulation in accum_t<In, Out>, terms in k order, zero weights skipped), one launch
/// for all K <= max_weighted_sum_inputs inputs, each of out.size() elements. out may be
/// one of the inputs (same type) but must not partly overlap one.
template <class In, class Out>
void weighted_sum(std::span<const In* const> ins, std::span<const double> weights,
                  std::span<Out> out, cudaStream_t stream) {
  static_assert(!std::is_const_v<Out>, "fedshard::gpu::weighted_sum: out must be writable");
  FEDSHARD_EXPECTS(!ins.empty(), "gpu::weighted_sum: expected at least one input, got 0");
  FEDSHARD_EXPECTS(ins.size() <= max_weighted_sum_inputs, "gpu::weighted_sum: at most ",
                   max_weighted_sum_inputs, " inputs per call, got ", ins.size());
  FEDSHARD_EXPECTS(weights.size() == ins.size(),
                   "gpu::weighted_sum: expected one weight per input (", ins.size(),
                   " inputs), got ", weights.size(), " weights");
  if (out.empty()) return;
  detail::weighted_sum_args<In, Out> a{};
  a.k = static_cast<std::uint32_t>(ins.size());
  a.out = out.data();
  a.n = out.size();
  detail::check_element_aligned(out.data(), "gpu::weighted_sum", "output");
  for (std::size_t j = 0; j < ins.size(); ++j) {
    FEDSHARD_EXPECTS(ins[j] != nullptr, "gpu::weighted_sum: input ", j,
                     " has a null data pointer for ", out.size(), " elements");
    detail::check_element_aligned(ins[j], "gpu::weighted_sum", "an input");
    a.ins[j] = ins[j];
    a.weights[j] = static_cast<kernels::accum_t<In, Out>>(weights[j]);
  }
  constexpr std::uintptr_t align = vector_bytes;
  const std::uintptr_t first = detail::address(ins[0]);
  a.head = std::min<std::uint64_t>(a.n, ((align - first % align) % align) / sizeof(In));
  a.nvec = (a.n - a.head) / detail::ws_vec<In>;
  for (std::size_t j = 0; j < ins.size(); ++j)
    if ((detail::address(ins[j]) + a.head * sizeof(In)) % align == 0)
      a.aligned |= std::uint64_t{1} << j;
  detail::launch_weighted_sum(a, stream);
}

/// weighted_sum of type-erased device buffers: all inputs have the same count and dtype,
/// out has that count and any dtype; the checks and messages of kernels::weighted_sum.
inline void weighted_sum(std::span<const const_buffer_view> ins, std::span<const double> weights,
                         buffer_view out, cudaStream_t stream) {
  kernels::detail::check_weighted_sum_views(ins, weights, out, "gpu::weighted_sum");
  FEDSHARD_EXPECTS(ins.size() <= max_weighted_sum_inputs, "gpu::weighted_sum: at most ",
                   max_weighted_sum_inputs, " inputs per call, got ", ins.size());
  visit(ins[0].type, out.type, [&](auto it, auto ot) {
    using In = typename decltype(it)::type;
    using Out = typename decltype(ot)::type;
    std::vector<const In*> pointers(ins.size());
    for (std::size_t j = 0; j < ins.size(); ++j) pointers[j] = static_cast<const In*>(ins[j].data);
    weighted_sum<In, Out>(std::span<const In* const>(pointers), weights,
                          std::span<Out>(static_cast<Out*>(out.data), out.count), stream);
  });
}

// ---------------------------------------------------------------- optimizer steps

namespace detail {

template <class P>
__device__ __forceinline__ void store_if_writable(P p, const vec<float, 4>& x) {
  if constexpr (!std::is_const_v<std::remove_pointer_t<P>>) store_vec<float, 4>(p, x);
}

template <class F, std::size_t... I>
__device__ __forceinline__ void apply_lanes(const F& f, vec<float, 4> (&r)[sizeof...(I)],
                                            std::index_sequence<I...>) {
#pragma unroll
  for (int l = 0; l < 4; ++l) f(r[I].v[l]...);
}

/// f(p0[i], p1[i], ...) for every i < n, where f is an element functor of kernels/ taking
/// float& for the arrays it updates (float*) and float for those it reads (const float*).
/// Elements [head, head + 4 nvec) go as float4 vectors (every pointer is 16-byte aligned
/// there), the rest one by one.
template <class F, class... P>
__global__ void __launch_bounds__(block_threads)
    for_each_kernel(F f, std::uint64_t n, std::uint64_t head, std::uint64_t nvec, P... p) {
  const std::uint64_t stride = std::uint64_t{gridDim.x} * block_threads;
  const std::uint64_t first = std::uint64_t{blockIdx.x} * block_threads + threadIdx.x;
  for (std::uint64_t i = first; i < head; i += stride) f(p[i]...);
  for (std::uint64_t j = first; j < nvec; j += stride) {
    const std::uint64_t i = head + 4 * j;
    vec<float, 4> r[sizeof...(P)] = {load_vec<float, 4>(p + i)...};
    apply_lanes(f, r, std::index_sequence_for<P...>{});
    std::size_t k = 0;
    (store_if_writable(p + i, r[k++]), ...);
  }
  for (std::uint64_t i = head + 4 * nvec + first; i < n; i += stride) f(p[i]...);
}

/// Launches for_each_kernel over n elements of float arrays (device pointers); what names
/// the launch in messages.
template <class F, class... P>
void for_each(const char* what, cudaStream_t stream, std::size_t n, const F& f, P... p) {
  if (n == 0) return;
  (check_element_aligned(p, what, "an array"), ...);
  const std::uintptr_t offsets[] = {address(p) % vector_bytes...};
  const std::uintptr_t a0 = offsets[0];
  const bool coaligned = ((address(p) % vector_bytes == a0) && ...);
  std::uint64_t head = n, nvec = 0;
  if (coaligned) {
    head = std::min<std::uint64_t>(n, ((vector_bytes - a0) % vector_bytes) / sizeof(float));
    nvec = (n - head) / 4;
  }
  const std::uint64_t blocks = ((n + 3) / 4 + block_threads - 1) / block_threads;
  for_each_kernel<F, P...><<<grid_for(blocks), block_threads, 0, stream>>>(f, n, head, nvec, p...);
  check_launch(what);
}

/// One element-wise step on device spans: f(s0[i], s1[i], ...) for every i, after checking
/// that every span has the first's size; what ("gpu::<step>") names the step in messages.
template <class F, class... T>
void step_spans(const char* what, cudaStream_t stream, const F& f, std::span<T>... spans) {
  const std::size_t sizes[] = {spans.size()...};
  for (std::size_t m : sizes)
    FEDSHARD_EXPECTS(m == sizes[0], what, ": every array must have ", sizes[0],
                     " elements (the first's), found ", m);
  for_each(what, stream, sizes[0], f, spans.data()...);
}

}  // namespace detail

/// One SGD step on a device shard (kernels::sgd_update); buf is used only when
/// s.momentum != 0 and must then have param's size. The arrays do not overlap.
inline void sgd_step(std::span<float> param, std::span<const float> grad, std::span<float> buf,
                     const kernels::sgd_scalars& s, cudaStream_t stream) {
  if (s.momentum == 0.0f)
    detail::step_spans("gpu::sgd_step", stream, kernels::sgd_update{s}, param, grad);
  else
    detail::step_spans("gpu::sgd_step", stream, kernels::sgd_update{s}, param, grad, buf);
}

/// One AdamW step on a device shard (kernels::adamw_update); the arrays have the same size
/// and do not overlap.
inline void adamw_step(std::span<float> param, std::span<const float> grad,
                       std::span<float> exp_avg, std::span<float> exp_avg_sq,
                       const kernels::adamw_scalars& s, cudaStream_t stream) {
  detail::step_spans("gpu::adamw_step", stream, kernels::adamw_update{s}, param, grad, exp_avg,
                     exp_avg_sq);
}

/// One outer SGD step of a device anchor shard (kernels::outer_sgd_update). In every outer
/// step the arrays have anchor's size and do not overlap, except that d may be anchor.
inline void outer_sgd_step(std::span<float> anchor, std::span<const float> d,
                           const kernels::outer_sgd_scalars& s, cudaStream_t stream) {
  detail::step_spans("gpu::outer_sgd_step", stream, kernels::outer_sgd_update{s}, anchor, d);
}

/// One fused Nesterov (DiLoCo) step of a device anchor shard and its momentum.
inline void outer_nesterov_step(std::span<float> anchor, std::span<const float> d,
                                std::span<float> momentum, const kernels::outer_momentum_scalars& s,
                                cudaStream_t stream) {
  detail::step_spans("gpu::outer_nesterov_step", stream, kernels::outer_nesterov_update{s}, anchor,
                     d, momentum);
}

/// One fused FedMom step of a device anchor shard and its momentum.
inline void outer_fedmom_step(std::span<float> anchor, std::span<const float> d,
                              std::span<float> momentum, const kernels::outer_momentum_scalars& s,
                              cudaStream_t stream) {
  detail::step_spans("gpu::outer_fedmom_step", stream, kernels::outer_fedmom_update{s}, anchor, d,
                     momentum);
}

/// One fused FedAdam step of a device anchor shard and its moments m and v.
inline void outer_fedadam_step(std::span<float> anchor, std::span<const float> d,
                               std::span<float> m, std::span<float> v,
                               const kernels::outer_adaptive_scalars& s, cudaStream_t stream) {
  detail::step_spans("gpu::outer_fedadam_step", stream, kernels::outer_fedadam_update{s}, anchor, d,
                     m, v);
}

/// One fused FedYogi step of a device anchor shard and its moments m and v.
inline void outer_fedyogi_step(std::span<float> anchor, std::span<const float> d,
                               std::span<float> m, std::span<float> v,
                               const kernels::outer_adaptive_scalars& s, cudaStream_t stream) {
  detail::step_spans("gpu::outer_fedyogi_step", stream, kernels::outer_fedyogi_update{s}, anchor, d,
                     m, v);
}

}  // namespace fedshard::gpu
