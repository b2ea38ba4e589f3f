// Causal attention spread over a context-parallel group by FCP's placement
// (charlm/context_attention.hpp): outputs and gradients on 1, 2, 3 and 4 ranks against a plain
// single-sequence loop of the same arithmetic, and the bytes at the wire against the plan.
#include "charlm/context_attention.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "fedshard/comm/inproc.hpp"
#include "fedshard/core/mix.hpp"
#include "fedshard/plan/wire_tap.hpp"
#include "support/error_of.hpp"
#include "support/spawn_ranks.hpp"

using namespace fedshard;

namespace {

constexpr std::size_t d = 4;

/// A value in [-1, 1) for (what, sequence, position, element), from mix64.
float draw(int what, std::size_t seq, std::size_t pos, std::size_t e) {
  const std::uint64_t z = mix64((static_cast<std::uint64_t>(what) << 56) ^ (seq << 40) ^
                                (pos << 8) ^ static_cast<std::uint64_t>(e));
  return static_cast<float>(static_cast<double>(z >> 40) / static_cast<double>(1 << 23)) - 1.0f;
}

/// One sequence's rows (L x d) of q, k, v, g (the outputs' gradient) and what the plain loop
/// gives: out, dq, dk, dv, and for dk and dv the sum of their terms' magnitudes.
struct sequence_result {
  std::vector<float> q, k, v, g, out, dq, dk, dv, dk_mag, dv_mag;
};

/// The header's arithmetic, written as the plain loop over one whole sequence.
sequence_result reference(std::size_t seq, std::size_t L) {
  sequence_result r;
  for (auto* x : {&r.q, &r.k, &r.v, &r.g, &r.out, &r.dq, &r.dk, &r.dv, &r.dk_mag, &r.dv_mag})
    x->assign(L * d, 0.0f);
  for (std::size_t t = 0; t < L; ++t)
    for (std::size_t e = 0; e < d; ++e) {
      r.q[t * d + e] = draw(0, seq, t, e);
      r.k[t * d + e] = draw(1, seq, t, e);
      r.v[t * d + e] = draw(2, seq, t, e);
      r.g[t * d + e] = draw(3, seq, t, e);
    }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (std::size_t t = 0; t < L; ++t) {
    std::vector<float> p(t + 1), dp(t + 1);
    float m = -std::numeric_limits<float>::infinity();
    for (std::size_t i = 0; i <= t; ++i) {
      float s = 0.0f;
      for (std::size_t e = 0; e < d; ++e) s += r.q[t * d + e] * r.k[i * d + e];
      p[i] = scale * s;
      m = std::max(m, p[i]);
    }
    float z = 0.0f;
    for (std::size_t i = 0; i <= t; ++i) {
      p[i] = std::exp(p[i] - m);
      z += p[i];
    }
    for (std::size_t i = 0; i <= t; ++i) p[i] /= z;
    for (std::size_t i = 0; i <= t; ++i)
      for (std::size_t e = 0; e < d; ++e) r.out[t * d + e] += p[i] * r.v[i * d + e];
    float D = 0.0f;
    for (std::size_t i = 0; i <= t; ++i) {
      float x = 0.0f;
      for (std::size_t e = 0; e < d; ++e) x += r.g[t * d + e] * r.v[i * d + e];
      dp[i] = x;
      D += p[i] * x;
    }
    for (std::size_t i = 0; i <= t; ++i) {
      const float ds = p[i] * (dp[i] - D);
      for (std::size_t e = 0; e < d; ++e) {
        r.dq[t * d + e] += scale * ds * r.k[i * d + e];
        r.dk[i * d + e] += scale * ds * r.q[t * d + e];
        r.dv[i * d + e] += p[i] * r.g[t * d + e];
        r.dk_mag[i * d + e] += std::abs(scale * ds * r.q[t * d + e]);
        r.dv_mag[i * d + e] += std::abs(p[i] * r.g[t * d + e]);
      }
    }
  }
  return r;
}

/// The rows of `rank` (its blocks in placement order) taken from the sequences' arrays.
std::vector<float> rows_of(const context_plan& plan, int rank,
                           const std::vector<sequence_result>& seqs,
                           std::vector<float> sequence_result::*field) {
  std::vector<float> out;
  for (const context_block& b : plan.placement().blocks) {
    if (b.rank != rank) continue;
    const auto& src = seqs[static_cast<std::size_t>(b.sequence)].*field;
    const auto first = static_cast<std::size_t>(b.first_token) * d;
    out.insert(
        out.end(), src.begin() + static_cast<std::ptrdiff_t>(first),
        src.begin() + static_cast<std::ptrdiff_t>(first + static_cast<std::size_t>(b.tokens) * d));
  }
  return out;
}

}  // namespace

TEST_CASE("attention spread over 1 to 4 ranks equals the plain loop; bytes equal the plan") {
  // Skewed: two long sequences among short ones; blocks of 8 tokens.
  const std::vector<std::int64_t> lengths{37, 5, 120, 12, 3, 50, 9};
  std::vector<sequence_result> seqs;
  for (std::size_t i = 0; i < lengths.size(); ++i)
    seqs.push_back(reference(i, static_cast<std::size_t>(lengths[i])));
  for (int P = 1; P <= 4; ++P) {
    CAPTURE(P);
    const context_settings s{.block_tokens = 8, .ranks = P, .kv_dim = d, .element_bytes = 4};
    const context_plan plan(fcp_placement(lengths, s), s, axis::group);
    if (P > 1) CHECK(plan.placement().total_bytes() > 0);  // some sequence is split
    fedshard::test::spawn_ranks(P, [&](inproc::communicator& c) {
      const int me = c.rank();
      wire_log log;
      log.keep_calls(true);
      wire_tap<inproc::communicator> tap(c, axis::group, log);
      charlm::context_attention att(plan, me);
      auto exchange = [&](const fedshard::plan& ops, std::span<std::byte> a0,
                          std::span<std::byte> a1) { run_context_ops(tap, ops, a0, a1); };
      const std::size_t n = att.rows() * d;
      std::vector<float> out(n), dq(n), dk(n), dv(n);
      att.forward(exchange, rows_of(plan, me, seqs, &sequence_result::q),
                  rows_of(plan, me, seqs, &sequence_result::k),
                  rows_of(plan, me, seqs, &sequence_result::v), out);
      att.backward(exchange, rows_of(plan, me, seqs, &sequence_result::g), dq, dk, dv);
      // Outputs and query gradients: bit for bit.
      CHECK(out == rows_of(plan, me, seqs, &sequence_result::out));
      CHECK(dq == rows_of(plan, me, seqs, &sequence_result::dq));
      // Key and value gradients: bit for bit on one rank; else within 1e-5 of the sum of
      // their terms' magnitudes (the same terms, summed in another order: at most n eps
      // x that sum for n <= 120 terms, eps 6e-8; seen: 1.9e-7 at worst).
      const auto ref_dk = rows_of(plan, me, seqs, &sequence_result::dk);
      const auto ref_dv = rows_of(plan, me, seqs, &sequence_result::dv);
      if (P == 1) {
        CHECK(dk == ref_dk);
        CHECK(dv == ref_dv);
      }
      const auto mag_k = rows_of(plan, me, seqs, &sequence_result::dk_mag);
      const auto mag_v = rows_of(plan, me, seqs, &sequence_result::dv_mag);
      int off = 0;
      for (std::size_t i = 0; i < n; ++i) {
        off += std::abs(dk[i] - ref_dk[i]) > 1e-5f * mag_k[i] ? 1 : 0;
        off += std::abs(dv[i] - ref_dv[i]) > 1e-5f * mag_v[i] ? 1 : 0;
      }
      CHECK(off == 0);
      // The wire: every message the plan's ops send, in order (forward, then backward).
      std::vector<wire_call> want;
      for (const fedshard::plan& ops : {plan.forward(me), plan.backward(me)})
        for (const comm_op& op : ops.ops)
          if (op.kind != comm_kind::recv) want.push_back(wire_call::of(op));
      CHECK(log.calls() == want);
    });
  }
}

TEST_CASE("context_attention refuses rows of the wrong size and a bf16 plan") {
  const std::vector<std::int64_t> lengths{10};
  const context_settings s{.block_tokens = 4, .ranks = 1, .kv_dim = d, .element_bytes = 4};
  const context_plan plan(fcp_placement(lengths, s), s, axis::group);
  fedshard::test::spawn_ranks(1, [&](inproc::communicator& c) {
    charlm::context_attention att(plan, 0);
    auto exchange = [&](const fedshard::plan& ops, std::span<std::byte> a0,
                        std::span<std::byte> a1) { run_context_ops(c, ops, a0, a1); };
    std::vector<float> ok(40), short_one(39);
    CHECK(fedshard::test::error_of([&] {
            att.forward(exchange, ok, short_one, ok, ok);
          }).find("k holds 39 floats, expected rows x d = 10 x 4") != std::string::npos);
  });
  const context_settings half{.block_tokens = 4, .ranks = 1, .kv_dim = d, .element_bytes = 2};
  const context_plan bf16(fcp_placement(lengths, half), half, axis::group);
  CHECK(fedshard::test::error_of([&] {
          charlm::context_attention(bf16, 0);
        }).find("computes in f32 (element_bytes 4), the plan has 2") != std::string::npos);
}
