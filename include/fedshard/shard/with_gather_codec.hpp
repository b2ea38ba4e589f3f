#pragma once
/// with_gather_codec<P, Codec>: ShardPolicy P whose parameter gathers travel encoded
/// (ZeRO++'s qwZ with codec::int8_block).
///
/// Every all_gather of P's step plan that rebuilds a unit for compute (role params, at an
/// acquire in forward or backward) carries Codec: each rank encodes its f32 master shard,
/// the wires are all-gathered, and every rank decodes every shard, its own too, so all ranks
/// compute with the same values. The master parameters, the gradient reductions and every
/// on-demand read (evaluation, checkpoints) stay exact f32. The codec reads the f32 master
/// shard, so an encoded gather is an f32 op; with precision::param bf16 or f16 the decoded
/// f32 values are cast into the unit's parameters (ZeRO++: int8 on the wire, half precision
/// in compute). The codec's run-time settings (int8_block's block size) are the policy's
/// settings (trainer_options::shard.codec), checked when the plan is made.

#include <cstdint>
#include <string>
#include <string_view>

#include "fedshard/codec/codec.hpp"
#include "fedshard/codec/spec.hpp"
#include "fedshard/shard/shard_policy.hpp"

namespace fedshard::shard {

/// The run-time settings of with_gather_codec: its codec's.
template <class CodecConfig>
struct gather_codec_settings {
  /// The codec's settings (its defaults unless set).
  CodecConfig codec{};

  friend bool operator==(const gather_codec_settings&, const gather_codec_settings&) = default;
};

/// P with its compute gathers encoded by Codec.
template <ShardPolicy P, codec::Codec Codec>
struct with_gather_codec {
  using base_policy = P;
  using gather_codec = Codec;
  using settings = gather_codec_settings<typename Codec::config>;
  static constexpr std::string_view name = P::name;
  static int layout_shards(const mesh_shape& s) { return P::layout_shards(s); }
  static void check(const mesh_shape& s) { P::check(s); }
  /// P's plan, its compute gathers encoded with the codec's default settings.
  static plan step_plan(const flat_layout& l, const mesh_shape& s, const precision& p) {
    return step_plan(l, s, p, settings{});
  }
  /// P's plan, its compute gathers encoded with the codec settings c.codec; invalid_argument
  /// when the codec refuses them.
  static plan step_plan(const flat_layout& l, const mesh_shape& s, const precision& p,
                        const settings& c) {
    const codec::spec spec = codec::spec_of<Codec>(c.codec);
    plan out = P::step_plan(l, s, p);
    for (comm_op& op : out.ops) {
      if (op.kind != comm_kind::all_gather || op.out.role != role::params ||
          op.trigger != trigger::acquire)
        continue;
      op.bytes = op.bytes / static_cast<std::int64_t>(size_of(op.dtype)) *
                 static_cast<std::int64_t>(sizeof(float));
      op.dtype = dtype::f32;
      op.codec = spec;
    }
    return out;
  }
};

}  // namespace fedshard::shard
