// optim::masked: the masked step updates the elements at the indices bit for bit as a full
// step of the same optimizer would, and leaves every other element's parameter and state
// untouched; on host memory and on the stream-checking space.
#include "fedshard/optim/masked.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "fedshard/error.hpp"
#include "fedshard/optim/adamw.hpp"
#include "fedshard/optim/sgd.hpp"
#include "fedshard/space/checked_space.hpp"
#include "fedshard/space/host_space.hpp"

using namespace fedshard;

namespace {

template <class S>
struct adamw_case {
  using space = S;
  using opt = optim::basic_adamw<S>;
  static typename opt::config config() { return {.lr = 1e-2f, .weight_decay = 0.1f}; }
};
template <class S>
struct sgd_case {
  using space = S;
  using opt = optim::basic_sgd<S>;
  static typename opt::config config() {
    return {.lr = 1e-2f, .momentum = 0.9f, .weight_decay = 0.1f};
  }
};

template <class S>
std::vector<float> host_copy(S& s, typename S::stream& st, std::span<const float> d) {
  std::vector<float> h(d.size());
  s.to_host(st, cview(d), view(std::span<float>(h)));
  s.synchronize(st);
  return h;
}

template <class S>
typename S::template buffer<float> make(S& s, typename S::stream& st, const std::vector<float>& v) {
  auto b = s.template allocate<float>(v.size());
  s.from_host(st, cview(std::span<const float>(v)), b.view());
  return b;
}

bool same_bits(float a, float b) {
  return std::memcmp(&a, &b, sizeof a) == 0;
}

}  // namespace

TEST_CASE_TEMPLATE("optim::masked steps the masked elements as a full step and keeps the rest", C,
                   adamw_case<space::host_space>, sgd_case<space::host_space>,
                   adamw_case<space::checked_space>, sgd_case<space::checked_space>) {
  using S = typename C::space;
  using O = typename C::opt;
  constexpr std::size_t n = 40;
  S s;
  auto st = s.make_stream();
  std::vector<float> p0(n), g1(n), g2(n);
  for (std::size_t i = 0; i < n; ++i) {
    p0[i] = 0.05f * float(i) - 1.0f;
    g1[i] = 0.01f * float(i % 7) - 0.03f;
    g2[i] = 0.02f * float(i % 5) - 0.04f;
  }
  // Both optimizers take one dense step first (non-zero state, step count 1).
  O full(C::config(), n, s), main(C::config(), n, s);
  auto pf = make(s, st, p0), pm = make(s, st, p0);
  auto gf = make(s, st, g1);
  full.step(pf.span(), std::span<const float>(gf.span()), 1e-2f, st);
  main.step(pm.span(), std::span<const float>(gf.span()), 1e-2f, st);
  const std::vector<float> before = host_copy(s, st, std::span<const float>(pm.span()));
  std::vector<std::vector<float>> state_before;
  for (const auto& t : main.state())
    state_before.push_back(host_copy(s, st, std::span<const float>(t.data)));
  // Then a full step of g2 against a masked step at 5 elements (g2's values there, packed).
  const std::vector<std::uint32_t> mask{1, 8, 9, 23, 39};
  std::vector<float> packed;
  for (std::uint32_t i : mask) packed.push_back(g2[i]);
  auto g2f = make(s, st, g2);
  full.step(pf.span(), std::span<const float>(g2f.span()), 1e-2f, st);
  auto idx = s.template allocate<std::uint32_t>(mask.size());
  s.from_host(st, const_buffer_view{mask.data(), mask.size(), dtype::f32},
              buffer_view{idx.data(), idx.size(), dtype::f32});  // bit patterns, copied
  auto gp = make(s, st, packed);
  optim::masked<O, S> m(C::config(), mask.size(), s);
  CHECK(m.size() == 5);
  m.step(main, pm.span(), std::span<const float>(gp.span()),
         std::span<const std::uint32_t>(idx.span()), 1e-2f, st);
  CHECK(main.step_count() == 2);
  const auto after = host_copy(s, st, std::span<const float>(pm.span()));
  const auto want = host_copy(s, st, std::span<const float>(pf.span()));
  const auto ms = main.state(), fs = full.state();
  REQUIRE(ms.size() == fs.size());
  std::vector<bool> in_mask(n, false);
  for (std::uint32_t i : mask) in_mask[i] = true;
  for (std::size_t i = 0; i < n; ++i) {
    CAPTURE(i);
    CHECK(same_bits(after[i], in_mask[i] ? want[i] : before[i]));
  }
  for (std::size_t t = 0; t < ms.size(); ++t) {
    const auto mt = host_copy(s, st, std::span<const float>(ms[t].data));
    const auto ft = host_copy(s, st, std::span<const float>(fs[t].data));
    for (std::size_t i = 0; i < n; ++i) {
      CAPTURE(t);
      CAPTURE(i);
      CHECK(same_bits(mt[i], in_mask[i] ? ft[i] : state_before[t][i]));
    }
  }
}

TEST_CASE("optim::masked refuses indices or gradients of another count than its size") {
  space::host_space s;
  auto st = s.make_stream();
  optim::adamw main({}, 8, s);
  optim::masked<optim::adamw> m({}, 2, s);
  std::vector<float> p(8), g(2), g3(3);
  const std::vector<std::uint32_t> two{0, 5}, three{0, 1, 2};
  CHECK_THROWS_WITH_AS(m.step(main, p, g, three, 0.1f, st),
                       doctest::Contains("expected 2 indices and packed gradients, found 3 and 2"),
                       invalid_argument);
  CHECK_THROWS_AS(m.step(main, p, g3, two, 0.1f, st), invalid_argument);
  CHECK(main.step_count() == 0);
}
