#pragma once
/// A codec as plan data: codec::spec names a Codec type and its settings, so that a comm_op
/// can carry it (plan/comm_op.hpp), the simulator can price it and the interpreter can make
/// the rank's codec object for the op's buffer (codec::erased, type-erased) when it first
/// runs the op.
///
/// spec_of<C>(config) describes Codec C with its run-time settings (held by the spec, so
/// that the op's codec objects, its wire size and its price follow them). The identity
/// codec's spec is the default spec: an op with it moves its dtype as is. Two specs are
/// equal when they describe the same codec type with the same settings.

#include <cstddef>
#include <memory>
#include <span>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include "fedshard/codec/codec.hpp"
#include "fedshard/codec/identity.hpp"
#include "fedshard/error.hpp"

namespace fedshard::codec {

/// One rank's codec object for one buffer, behind a virtual interface (see codec.hpp for
/// what encode and decode_add do).
class erased {
 public:
  virtual ~erased() = default;
  /// in: the buffer's n elements; wire: encoded_bytes(n) bytes, aligned.
  virtual void encode(std::span<const float> in, std::span<std::byte> wire) = 0;
  /// out[i] += decoded[i] for a wire of encoded_bytes(out.size()) bytes.
  virtual void decode_add(std::span<const std::byte> wire, std::span<float> out) const = 0;
  /// The codec's per-rank state (topk's residual), writable; empty when stateless.
  virtual std::span<float> state() noexcept = 0;
};

struct spec;

namespace detail {

template <class C>
class erased_impl final : public erased {
 public:
  erased_impl(typename C::config cfg, std::size_t n) : c_(cfg, n) {}
  void encode(std::span<const float> in, std::span<std::byte> wire) override {
    c_.encode(in, wire);
  }
  void decode_add(std::span<const std::byte> wire, std::span<float> out) const override {
    c_.decode_add(wire, out);
  }
  std::span<float> state() noexcept override {
    if constexpr (C::stateful)
      return c_.residual();
    else
      return {};
  }

 private:
  C c_;
};

/// The settings of Codec C held by a spec.
template <class C>
const typename C::config& settings_in(const void* settings) noexcept {
  return *static_cast<const typename C::config*>(settings);
}

}  // namespace detail

/// What a comm_op says of its codec. Default: the identity (the op moves its dtype as is).
struct spec {
  /// The codec's name ("identity", "bf16", "fp8_e4m3", "int8_block", "topk", ...).
  std::string_view name = identity::name;
  /// Whether the codec keeps per-rank state (an error-feedback residual).
  bool stateful = false;
  /// The codec's run-time settings (a C::config, read by the functions below); null for the
  /// identity.
  std::shared_ptr<const void> settings{};
  /// C::encoded_bytes with the settings; null for the identity.
  std::size_t (*encoded_bytes_fn)(const void* settings, std::size_t) = nullptr;
  /// Makes the rank's codec object for a buffer of n elements; null for the identity.
  std::unique_ptr<erased> (*make_fn)(const void* settings, std::size_t) = nullptr;
  /// True when two settings of this codec are equal.
  bool (*same_settings_fn)(const void*, const void*) = nullptr;
  /// Passes over the f32 buffer that encoding and decoding make (the simulator's price of
  /// the codec's kernels: passes x 4 bytes x elements at the device's memory bandwidth).
  float encode_passes = 0.0f;
  float decode_passes = 0.0f;

  /// True for the identity: no encoding.
  constexpr bool is_identity() const noexcept { return make_fn == nullptr; }
  /// The wire bytes of n elements (4 n for the identity, as f32).
  std::size_t encoded_bytes(std::size_t n) const {
    return is_identity() ? n * sizeof(float) : encoded_bytes_fn(settings.get(), n);
  }
  /// The rank's codec object for a buffer of n elements; invalid_argument for the identity.
  std::unique_ptr<erased> make(std::size_t n) const {
    FEDSHARD_EXPECTS(!is_identity(), "codec::spec::make: the identity has no codec object");
    return make_fn(settings.get(), n);
  }

  /// Equal when they describe the same codec type with equal settings.
  friend bool operator==(const spec& a, const spec& b) {
    if (a.name != b.name || a.stateful != b.stateful || a.encoded_bytes_fn != b.encoded_bytes_fn ||
        a.make_fn != b.make_fn || a.same_settings_fn != b.same_settings_fn ||
        a.encode_passes != b.encode_passes || a.decode_passes != b.decode_passes)
      return false;
    return a.is_identity() || a.settings == b.settings ||
           a.same_settings_fn(a.settings.get(), b.settings.get());
  }
};

/// The memory passes of a codec's kernels (requirement 7 of Codec).
template <class C>
constexpr std::pair<float, float> passes_of() noexcept {
  return codec_capabilities<C>::passes_or_default();
}

/// The spec of Codec C with settings cfg; invalid_argument when C refuses them (checked by
/// making a codec of 0 elements, so a plan never carries settings its codec cannot run).
template <Codec C>
spec spec_of(typename C::config cfg = {}) {
  if constexpr (std::is_same_v<C, identity>) {
    return {};
  } else {
    (void)C(cfg, 0);
    spec s;
    s.name = C::name;
    s.stateful = C::stateful;
    s.settings = std::make_shared<const typename C::config>(cfg);
    s.encoded_bytes_fn = [](const void* c, std::size_t n) {
      return C::encoded_bytes(detail::settings_in<C>(c), n);
    };
    s.make_fn = [](const void* c, std::size_t n) -> std::unique_ptr<erased> {
      return std::make_unique<detail::erased_impl<C>>(detail::settings_in<C>(c), n);
    };
    s.same_settings_fn = [](const void* a, const void* b) {
      return detail::settings_in<C>(a) == detail::settings_in<C>(b);
    };
    std::tie(s.encode_passes, s.decode_passes) = passes_of<C>();
    return s;
  }
}

}  // namespace fedshard::codec
