#include "fedshard/kernels/adamw.hpp"

#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstdint>

namespace {

using fedshard::kernels::adamw_step;
using fedshard::kernels::adamw_update;
using fedshard::kernels::make_adamw_scalars;

using row = std::array<float, 6>;

// Values from torch 2.15.0 (CPU, AVX-512 kernels): torch.optim.AdamW(foreach=False,
// fused=False) with lr = 1e-3, 3e-3, 2e-3 on the three steps, hyper-parameters float32(...)
// of the ones named. torch's CPU sqrt (MKL) is not always correctly rounded; these inputs
// were picked so that it agreed with the IEEE sqrt at every step.
struct golden {
  float beta1, beta2, eps, weight_decay;
  row param0;
  std::array<row, 3> grads;
  row param, exp_avg, exp_avg_sq;
};

const std::array<float, 3> lrs{1e-3f, 3e-3f, 2e-3f};

const golden cases[] = {
    {0.9f,
     0.95f,
     1e-8f,
     0.1f,
     row{-0x1.0df998p-3f, 0x1.10568ap-1f, 0x1.349d2cp0f, 0x1.3f0638p-2f, 0x1.db6344p-2f,
         0x1.0323c6p0f},
     {row{0x1.5a887ap-9f, -0x1.79524ap-9f, -0x1.a0586p-5f, -0x1.51c898p1f, 0x1.a68be2p1f,
          -0x1.c5fc7cp5f},
      row{0x1.3b948p-13f, 0x1.20ee32p-14f, 0x1.9b611ep-7f, 0x1.29998ap-1f, -0x1.31c28ep4f,
          -0x1.4e618p3f},
      row{0x1.6e303ap-10f, 0x1.4ce132p-7f, -0x1.70099ep-4f, 0x1.ab741cp0f, 0x1.e67ad8p1f,
          -0x1.265d0ep2f}},
     row{-0x1.178b34p-3f, 0x1.1138d6p-1f, 0x1.356c4cp0f, 0x1.415e7p-2f, 0x1.dcab64p-2f,
         0x1.04345cp0f},
     row{0x1.813ae2p-12f, 0x1.9d9b1cp-11f, -0x1.884d46p-7f, 0x1.6a99bep-8f, -0x1.128bc2p0f,
         -0x1.7fcedep2f},
     row{0x1.bc97fcp-22f, 0x1.736382p-18f, 0x1.14adbcp-11f, 0x1.e0f8c4p-2f, 0x1.28f848p4f,
         0x1.2f2074p7f}},
    // beta1 = 0.3: the lerp weight 0.7 takes torch's other lerp branch.
    {0.3f,
     0.5f,
     1e-6f,
     0.0f,
     row{-0x1.2ca2e8p-3f, 0x1.92811cp-1f, 0x1.e4c5cep-1f, -0x1.1d45a6p0f, 0x1.b0d7ap0f,
         -0x1.ca26e2p-1f},
     {row{0x1.3f8a26p-11f, -0x1.7cda12p-8f, -0x1.1ba3dep-3f, 0x1.01d32p-1f, -0x1.abaa1ep-1f,
          -0x1.2c847ep1f},
      row{0x1.6db11p-13f, 0x1.788f7ap-6f, 0x1.88077p-4f, -0x1.52e04ep-1f, 0x1.bfa764p3f,
          0x1.192bacp7f},
      row{-0x1.6f545cp-10f, 0x1.a91c6ap-7f, 0x1.50102ap-3f, -0x1.0e82dap0f, -0x1.4ed4bcp1f,
          -0x1.903652p4f}},
     row{-0x1.2f9d7cp-3f, 0x1.90cd52p-1f, 0x1.e3ca36p-1f, -0x1.1c89b2p0f, 0x1.b05112p0f,
         -0x1.cb3da2p-1f},
     row{-0x1.daee78p-11f, 0x1.bbbc7cp-7f, 0x1.0289b6p-3f, -0x1.b1a2fap-1f, 0x1.0dd2dap0f,
         0x1.7bb3f8p3f},
     row{0x1.160aacp-20f, 0x1.ce491ap-13f, 0x1.29631ap-6f, 0x1.662582p-1f, 0x1.a37696p5f,
         0x1.48693cp12f}},
};

}  // namespace

TEST_CASE("adamw_step reproduces torch.optim.AdamW bit for bit") {
  for (const golden& c : cases) {
    CAPTURE(c.beta1);
    row param = c.param0;
    row exp_avg{};
    row exp_avg_sq{};
    for (int step = 0; step < 3; ++step) {
      const auto s =
          make_adamw_scalars(lrs[step], c.beta1, c.beta2, c.eps, c.weight_decay, step + 1);
      adamw_step(param, c.grads[step], exp_avg, exp_avg_sq, s);
    }
    for (int i = 0; i < 6; ++i) {
      CAPTURE(i);
      CHECK(param[i] == c.param[i]);
      CHECK(exp_avg[i] == c.exp_avg[i]);
      CHECK(exp_avg_sq[i] == c.exp_avg_sq[i]);
    }
  }
}

TEST_CASE("make_adamw_scalars computes torch's scalars in double and rounds them to float") {
  const double lr = 3e-4;
  const double beta1 = 0.9;
  const double beta2 = 0.95;
  const auto s = make_adamw_scalars(lr, beta1, beta2, 1e-8, 0.1, 3);
  CHECK(s.decay == static_cast<float>(1 - lr * 0.1));
  CHECK(s.lerp_weight == static_cast<float>(1 - beta1));
  CHECK(s.beta2 == 0.95f);
  CHECK(s.one_minus_beta2 == static_cast<float>(1 - beta2));
  CHECK(s.eps == 1e-8f);
  CHECK(s.neg_step_size == static_cast<float>(-(lr / (1 - 0.9 * 0.9 * 0.9))));
  CHECK(s.bias_correction2_sqrt == doctest::Approx(std::sqrt(1 - 0.95 * 0.95 * 0.95)));

  CHECK(make_adamw_scalars(lr, beta1, beta2, 1e-8, 0.0, 1).decay == 1.0f);
  CHECK(make_adamw_scalars(lr, beta1, beta2, 1e-8, 0.0, 1).neg_step_size ==
        static_cast<float>(-(lr / (1 - beta1))));
}

TEST_CASE("adamw_update on one element: zero gradient decays the moments and keeps param") {
  const auto s = make_adamw_scalars(1e-3, 0.5, 0.75, 0.0, 0.0, 2);
  float param = 2.0f;
  float exp_avg = 0.5f;
  float exp_avg_sq = 0.25f;
  adamw_update{s}(param, 0.0f, exp_avg, exp_avg_sq);
  CHECK(exp_avg == 0.25f);       // lerp(0.5, 0, 0.5)
  CHECK(exp_avg_sq == 0.1875f);  // 0.25 * 0.75
  CHECK(param < 2.0f);           // the first moment still moves it
  CHECK(param > 2.0f - 2e-3f);
}
