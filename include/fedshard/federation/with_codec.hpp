#pragma once
/// with_codec<F, Codec>: FederationPolicy F whose cross-group average travels encoded.
///
/// Every op of F's sync plan that averages (or sums) the fragment over the federation axis
/// carries Codec (plan/comm_op.hpp: each group's contribution is encoded, the wires are
/// all-gathered and decoded in group order into f32). Everything else of F is unchanged: its
/// begin/end transforms, its state, the averages inside a group and of inner moments.
/// `sync_codec_t<F>` names a policy's codec (identity for policies without one).
///
///   with_codec<average, codec::cast<fp8_e4m3>>            fp8 parameter averaging
///   with_codec<outer_optimizer<outer_sgd>, codec::topk<>>  SparseLoCo (see sparseloco)

#include <string_view>
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

/// F with its fragment's cross-group average encoded by Codec (settings: Codec's defaults).
template <class F, codec::Codec Codec>
class with_codec : public F {
 public:
  using config = typename F::config;
  using sync_codec = Codec;
  /// The same in memory space S (F's in_space).
  template <class S>
  using in_space = with_codec<in_space_t<F, S>, Codec>;

  /// A codec runs on the whole federation axis, not among a heterogeneous mesh's holders.
  static constexpr bool heterogeneous_groups = false;

  using F::F;
  with_codec() = default;

  /// F's sync plan, its cross-group fragment averages encoded.
  plan sync_plan(const sync_context& ctx) const {
    plan p = F::sync_plan(ctx);
    for (comm_op& op : p.ops)
      if (averages_fragment_across_groups(op)) op.codec = codec::spec_of<Codec>();
    return p;
  }
};

/// The codec of FederationPolicy F's cross-group average: F::sync_codec, else the identity.
template <class F>
struct sync_codec {
  using type = codec::identity;
};
template <class F>
requires requires {
  typename F::sync_codec;
}
struct sync_codec<F> {
  using type = typename F::sync_codec;
};
template <class F>
using sync_codec_t = typename sync_codec<F>::type;

}  // namespace fedshard::federation
