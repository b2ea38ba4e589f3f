#pragma once
/// Test support: what every federation policy's suite checks first, in one place.

#include <doctest/doctest.h>

#include <string_view>

#include "fedshard/federation/federation_policy.hpp"

namespace fedshard::test {

/// P models FederationPolicy, is called `name`, and syncs (or, for `syncs` false, never does).
template <class P>
void check_federation_policy(std::string_view name, bool syncs) {
  CHECK(federation::FederationPolicy<P>);
  CHECK(P::name == name);
  CHECK(P::syncs == syncs);
}

}  // namespace fedshard::test
