#pragma once
/// Packing a unit's tensors into a rank's shard of the unit's flat buffer, and back.
///
/// A unit's tensors live at element offsets inside one flat buffer (with gaps for
/// alignment and padding at the end); a rank's shard is the range
/// [shard_begin, shard_begin + shard.size()) of that flat buffer. pack fills the shard from
/// the tensors (zero where no tensor lies), unpack writes the shard back into the parts of
/// the tensors it covers. Both may convert the element type (e.g. f32 parameters to a bf16
/// wire buffer). The work is a list of segments (for_each_segment); on the host each
/// segment is one memcpy, memset or cast loop, and a device kernel runs copy_fn and zero_fn
/// over the same segments.

#include <cstddef>
#include <cstring>
#include <limits>
#include <span>
#include <type_traits>

#include "fedshard/config.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/error.hpp"
#include "fedshard/kernels/cast.hpp"

namespace fedshard::kernels {

/// One tensor of a unit: count elements at data, stored at element `offset` of the unit's
/// flat buffer. T is const for the tensors that pack reads.
template <class T>
struct tensor_ref {
  T* data = nullptr;
  std::size_t count = 0;
  std::size_t offset = 0;
};

/// A contiguous run of a shard: `count` elements from shard position `shard_pos` hold
/// tensor `tensor`'s elements from `tensor_pos` on, or padding when tensor == padding.
struct pack_segment {
  static constexpr std::size_t padding = std::numeric_limits<std::size_t>::max();
  std::size_t tensor = padding;
  std::size_t tensor_pos = 0;
  std::size_t shard_pos = 0;
  std::size_t count = 0;
};

/// Per-element body of a tensor segment: dst[i] = cast(src[i]).
template <class Src, class Dst>
struct copy_fn {
  const Src* src;
  Dst* dst;
  FEDSHARD_HOST_DEVICE void operator()(std::size_t i) const noexcept {
    dst[i] = cast_fn<Src, Dst>{}(src[i]);
  }
};

/// Per-element body of a padding segment: dst[i] = +0.
template <class T>
struct zero_fn {
  T* dst;
  FEDSHARD_HOST_DEVICE void operator()(std::size_t i) const noexcept { dst[i] = T{}; }
};

/// Checks that the tensors are sorted by offset, do not overlap, do not wrap around
/// std::size_t and have data when they have elements; throws invalid_argument naming the
/// offending tensors. `what` names the calling function in the message.
template <class T>
void check_tensor_layout(std::span<const tensor_ref<T>> tensors, const char* what) {
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const tensor_ref<T>& t = tensors[i];
    FEDSHARD_EXPECTS(t.count <= std::numeric_limits<std::size_t>::max() - t.offset, what,
                     ": tensor ", i, " (offset ", t.offset, ", count ", t.count,
                     ") ends beyond the largest std::size_t");
    FEDSHARD_EXPECTS(t.count == 0 || t.data != nullptr, what, ": tensor ", i, " has ", t.count,
                     " elements but a null data pointer");
    if (i == 0) continue;
    const tensor_ref<T>& p = tensors[i - 1];
    FEDSHARD_EXPECTS(t.offset >= p.offset + p.count, what, ": tensors must be sorted by offset ",
                     "and not overlap, but tensor ", i - 1, " covers [", p.offset, ", ",
                     p.offset + p.count, ") and tensor ", i, " starts at ", t.offset);
  }
}

namespace detail {

/// for_each_segment without the layout check.
template <class T, class F>
void for_each_segment_unchecked(std::span<const tensor_ref<T>> tensors, std::size_t shard_begin,
                                std::size_t shard_size, const char* what, F&& f) {
  FEDSHARD_EXPECTS(shard_size <= std::numeric_limits<std::size_t>::max() - shard_begin, what,
                   ": shard [", shard_begin, ", +", shard_size,
                   ") ends beyond the largest std::size_t");
  const std::size_t end = shard_begin + shard_size;
  std::size_t pos = shard_begin;
  for (std::size_t i = 0; i < tensors.size() && pos < end; ++i) {
    const tensor_ref<T>& t = tensors[i];
    const std::size_t t_end = t.offset + t.count;
    if (t.count == 0 || t_end <= pos) continue;
    if (t.offset >= end) break;
    const std::size_t lo = t.offset > pos ? t.offset : pos;
    const std::size_t hi = t_end < end ? t_end : end;
    if (lo > pos) f(pack_segment{pack_segment::padding, 0, pos - shard_begin, lo - pos});
    f(pack_segment{i, lo - t.offset, lo - shard_begin, hi - lo});
    pos = hi;
  }
  if (pos < end) f(pack_segment{pack_segment::padding, 0, pos - shard_begin, end - pos});
}

/// Checks that every tensor lies inside a flat buffer of flat_size elements.
template <class T>
void check_inside_flat(std::span<const tensor_ref<T>> tensors, std::size_t flat_size,
                       const char* what) {
  if (tensors.empty()) return;
  const tensor_ref<T>& last = tensors.back();  // sorted and disjoint: the last ends last
  FEDSHARD_EXPECTS(last.offset <= flat_size && last.count <= flat_size - last.offset, what,
                   ": tensor ", tensors.size() - 1, " covers [", last.offset, ", ",
                   last.offset + last.count, "), beyond the flat buffer of ", flat_size,
                   " elements");
}

/// pack of one shard once the layout is checked.
template <class Src, class Dst>
void pack_checked(std::span<const tensor_ref<Src>> tensors, std::size_t shard_begin,
                  std::span<Dst> shard) {
  using S = std::remove_const_t<Src>;
  Dst* out = shard.data();
  for_each_segment_unchecked(
      tensors, shard_begin, shard.size(), "pack", [&](const pack_segment& s) {
        if (s.tensor == pack_segment::padding)
          std::memset(static_cast<void*>(out + s.shard_pos), 0, s.count * sizeof(Dst));
        else
          cast_n<S, Dst>(tensors[s.tensor].data + s.tensor_pos, out + s.shard_pos, s.count);
      });
}

/// unpack of one shard once the layout is checked.
template <class Src, class Dst>
void unpack_checked(std::span<Src> shard, std::size_t shard_begin,
                    std::span<const tensor_ref<Dst>> tensors) {
  using S = std::remove_const_t<Src>;
  const S* in = shard.data();
  for_each_segment_unchecked(
      tensors, shard_begin, shard.size(), "unpack", [&](const pack_segment& s) {
        if (s.tensor != pack_segment::padding)
          cast_n<S, Dst>(in + s.shard_pos, tensors[s.tensor].data + s.tensor_pos, s.count);
      });
}

}  // namespace detail

/// Calls f(pack_segment) for each run of the flat range [shard_begin, shard_begin +
/// shard_size), in order: the parts of the tensors that fall in it and the padding between
/// and after them (tensors with no elements give no segment). Checks the layout first.
template <class T, class F>
void for_each_segment(std::span<const tensor_ref<T>> tensors, std::size_t shard_begin,
                      std::size_t shard_size, F&& f) {
  check_tensor_layout(tensors, "for_each_segment");
  detail::for_each_segment_unchecked(tensors, shard_begin, shard_size, "for_each_segment", f);
}

/// Fills shard, the flat range [shard_begin, shard_begin + shard.size()), from the tensors
/// (converted to Dst) and sets the elements that no tensor covers to zero. Tensors must be
/// sorted by offset and must not overlap; the shard must not overlap any tensor.
template <class Src, class Dst>
void pack(std::span<const tensor_ref<Src>> tensors, std::size_t shard_begin, std::span<Dst> shard) {
  static_assert(!std::is_const_v<Dst>, "fedshard::kernels::pack: the shard must be writable");
  check_tensor_layout(tensors, "pack");
  detail::pack_checked(tensors, shard_begin, shard);
}

/// Writes shard, the flat range [shard_begin, shard_begin + shard.size()), back into the
/// parts of the tensors it covers (converted to Dst); other tensor elements and the
/// shard's padding are not touched. Tensors must be sorted by offset and must not overlap.
template <class Src, class Dst>
void unpack(std::span<Src> shard, std::size_t shard_begin,
            std::span<const tensor_ref<Dst>> tensors) {
  static_assert(!std::is_const_v<Dst>, "fedshard::kernels::unpack: tensors must be writable");
  check_tensor_layout(tensors, "unpack");
  detail::unpack_checked(shard, shard_begin, tensors);
}

/// Fills the whole flat buffer from the tensors, zero elsewhere; every tensor must lie
/// inside it.
template <class Src, class Dst>
void pack(std::span<const tensor_ref<Src>> tensors, std::span<Dst> flat) {
  static_assert(!std::is_const_v<Dst>, "fedshard::kernels::pack: the buffer must be writable");
  check_tensor_layout(tensors, "pack");
  detail::check_inside_flat(tensors, flat.size(), "pack");
  detail::pack_checked(tensors, 0, flat);
}

/// Writes the whole flat buffer back into the tensors; every tensor must lie inside it.
template <class Src, class Dst>
void unpack(std::span<Src> flat, std::span<const tensor_ref<Dst>> tensors) {
  static_assert(!std::is_const_v<Dst>, "fedshard::kernels::unpack: tensors must be writable");
  check_tensor_layout(tensors, "unpack");
  detail::check_inside_flat(tensors, flat.size(), "unpack");
  detail::unpack_checked(flat, 0, tensors);
}

}  // namespace fedshard::kernels
