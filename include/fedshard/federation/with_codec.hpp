#pragma once
/// with_codec<F, Codec>: FederationPolicy F whose cross-group average travels encoded.
///
/// Every op of F's sync plan that averages (or sums) the fragment over the federation axis
/// carries Codec (plan/comm_op.hpp: each group's contribution is encoded, the wires are
/// all-gathered and decoded in group order into f32). Everything else of F is unchanged: its
/// begin/end transforms, its state, the averages inside a group and of inner moments.
/// It declares `sync_codec` (FederationPolicy capability 17).
///
/// Its config is F's with one more member, `codec`: the codec's run-time settings (topk's
/// chunk, k, bits and beta; the codec's defaults unless set), checked when the policy is
/// built.
///
///   with_codec<average, codec::cast<fp8_e4m3>>          fp8 parameter averaging
///   with_codec<outer_optimizer<outer_sgd>, codec::topk>  SparseLoCo (see sparseloco)

#include <concepts>
#include <cstddef>
#include <string_view>
#include <utility>
#include <vector>

#include "fedshard/codec/codec.hpp"
#include "fedshard/codec/identity.hpp"
#include "fedshard/codec/spec.hpp"
#include "fedshard/federation/federation_policy.hpp"
#include "fedshard/plan/comm_op.hpp"

namespace fedshard::federation {

/// True for the ops with_codec encodes: a sum or average of the fragment over the groups.
inline bool averages_fragment_across_groups(const comm_op& op) {
  return op.axis == axis::federation && op.kind == comm_kind::all_reduce &&
         op.in.role == role::fragment && op.out.role == role::fragment;
}

/// The settings of with_codec: those of the policy (FConfig) and the codec's (`codec`).
template <class FConfig, class CodecConfig>
struct with_codec_config : FConfig {
  /// The codec's run-time settings.
  CodecConfig codec{};
};

/// F with its fragment's cross-group average encoded by Codec, with the codec settings of
/// its config.
template <class F, codec::Codec Codec>
class with_codec : public F {
 public:
  using config = with_codec_config<typename F::config, typename Codec::config>;
  using sync_codec = Codec;
  /// The same in memory space S (F's in_space).
  template <class S>
  using in_space = with_codec<in_space_t<F, S>, Codec>;

  /// A codec runs on the whole federation axis, not among a heterogeneous mesh's holders.
  static constexpr bool heterogeneous_groups = false;

  /// F built from c and fragment sizes (and space s), its codec from c.codec;
  /// invalid_argument when the codec refuses c.codec.
  with_codec(const config& c, std::vector<std::size_t> sizes)
      : F(base_config(c), std::move(sizes)), codec_(codec::spec_of<Codec>(c.codec)) {}
  template <class S>
  requires std::constructible_from<F, const typename F::config&, std::vector<std::size_t>, S&>
  with_codec(const config& c, std::vector<std::size_t> sizes, S& s)
      : F(base_config(c), std::move(sizes), s), codec_(codec::spec_of<Codec>(c.codec)) {}
  with_codec() : codec_(codec::spec_of<Codec>()) {}

  /// F's sync plan, its cross-group fragment averages encoded; invalid_argument for a narrow
  /// sync dtype (sync_context::reduce): the codec decides what the average carries.
  plan sync_plan(const sync_context& ctx) const {
    FEDSHARD_EXPECTS(ctx.reduce == dtype::f32, "fedshard: precision.sync = ", to_string(ctx.reduce),
                     ", but federation policy ", F::name,
                     " sends its average encoded (the codec sets what travels); expected "
                     "precision.sync f32 with a codec");
    plan p = F::sync_plan(ctx);
    for (comm_op& op : p.ops)
      if (averages_fragment_across_groups(op)) op.codec = codec_;
    return p;
  }

 private:
  static const typename F::config& base_config(const config& c) noexcept { return c; }

  codec::spec codec_;
};

}  // namespace fedshard::federation
