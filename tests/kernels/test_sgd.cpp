#include "fedshard/kernels/sgd.hpp"

#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using fedshard::kernels::make_sgd_scalars;
using fedshard::kernels::sgd_step;

using row = std::array<float, 6>;

// Values from torch 2.15.0 (CPU, AVX-512 kernels): torch.optim.SGD(foreach=False) with
// lr = 1e-3, 3e-3, 2e-3 on the three steps, hyper-parameters float32(...) of the ones named.
const row param0{-0x1.2ca2e8p-3f, 0x1.92811cp-1f, 0x1.e4c5cep-1f,
                 -0x1.1d45a6p0f,  0x1.b0d7ap0f,   -0x1.ca26e2p-1f};
const std::array<row, 3> grads{row{0x1.3f8a26p-11f, -0x1.7cda12p-8f, -0x1.1ba3dep-3f, 0x1.01d32p-1f,
                                   -0x1.abaa1ep-1f, -0x1.2c847ep1f},
                               row{0x1.6db11p-13f, 0x1.788f7ap-6f, 0x1.88077p-4f, -0x1.52e04ep-1f,
                                   0x1.bfa764p3f, 0x1.192bacp7f},
                               row{-0x1.6f545cp-10f, 0x1.a91c6ap-7f, 0x1.50102ap-3f, -0x1.0e82dap0f,
                                   -0x1.4ed4bcp1f, -0x1.903652p4f}};
const std::array<float, 3> lrs{1e-3f, 3e-3f, 2e-3f};

struct golden {
  float momentum, dampening, weight_decay;
  bool nesterov;
  row param, buf;
};

const golden cases[] = {
    {0.9f, 0.1f, 0.01f, false,
     row{-0x1.2c9adep-3f, 0x1.92694ep-1f, 0x1.e4bb46p-1f, -0x1.1cb4d4p0f, 0x1.a3aa3cp0f,
         -0x1.71cceep0f},
     row{-0x1.1b77cap-8f, 0x1.73e0eep-5f, 0x1.1859d4p-3f, -0x1.1b79cap0f, 0x1.0af73ep3f,
         0x1.65bdp6f}},
    {0.9f, 0.0f, 0.01f, true,
     row{-0x1.2c95ap-3f, 0x1.925796p-1f, 0x1.e46c54p-1f, -0x1.1bb3a4p0f, 0x1.9a566cp0f,
         -0x1.d0a9dcp0f},
     row{-0x1.35e5c4p-8f, 0x1.9baddcp-5f, 0x1.4f47ep-3f, -0x1.4650aap0f, 0x1.2af8f6p3f,
         0x1.8e5198p6f}},
    {0.0f, 0.0f, 0.01f, false,
     row{-0x1.2c9d6ap-3f, 0x1.926f42p-1f, 0x1.e47fdcp-1f, -0x1.1c55a4p0f, 0x1.a7a04p0f,
         -0x1.439f2cp0f},
     row{}},
};

}  // namespace

TEST_CASE("sgd_step reproduces torch.optim.SGD bit for bit") {
  for (const golden& c : cases) {
    CAPTURE(c.momentum);
    CAPTURE(c.nesterov);
    row param = param0;
    row buf{};
    for (int step = 0; step < 3; ++step) {
      const auto s = make_sgd_scalars(lrs[step], c.momentum, c.dampening, c.weight_decay,
                                      c.nesterov, step == 0);
      sgd_step(param, grads[step], buf, s);
    }
    for (int i = 0; i < 6; ++i) {
      CAPTURE(i);
      CHECK(param[i] == c.param[i]);
      CHECK(buf[i] == c.buf[i]);
    }
  }
}

TEST_CASE("make_sgd_scalars rounds torch's double scalars to float") {
  const auto s = make_sgd_scalars(0.1, 0.9, 0.1, 0.0, true, false);
  CHECK(s.neg_lr == -0.1f);
  CHECK(s.momentum == 0.9f);
  CHECK(s.one_minus_dampening == static_cast<float>(1.0 - 0.1));
  CHECK(s.weight_decay == 0.0f);
  CHECK(s.nesterov);
  CHECK_FALSE(s.first_step);
}

TEST_CASE("the rounding helpers: fma rounds once, add_rn never fuses with a product") {
  namespace d = fedshard::kernels::detail;
  // a * a = 1 + 2^-11 + 2^-24 is a tie in float and rounds to 1 + 2^-11.
  volatile float va = 1.0f + 0x1p-12f;
  volatile float vc = -(1.0f + 0x1p-11f);
  const float a = va;
  const float c = vc;
  CHECK(d::fma_rn(a, a, c) == 0x1p-24f);
  CHECK(d::add_rn(d::mul_rn(a, a), c) == 0.0f);
  CHECK(d::add_rn(0.1f, 0.2f) == 0.1f + 0.2f);
  CHECK(d::div_rn(1.0f, 3.0f) == 1.0f / 3.0f);
  CHECK(d::sqrt_rn(2.0f) == 0x1.6a09e6p0f);
  CHECK(d::add_scalar(1.0, -0x1p-60) == 1.0 - 0x1p-60);
  // The same in double: b * b = 1 + 2^-26 + 2^-54 ties and rounds to 1 + 2^-26.
  volatile double vb = 1.0 + 0x1p-27;
  volatile double ve = -(1.0 + 0x1p-26);
  const double b = vb;
  const double e = ve;
  CHECK(d::add_rn(d::mul_rn(b, b), e) == 0.0);
  CHECK(d::add_rn(0.1, 0.2) == 0.1 + 0.2);
  CHECK(std::signbit(d::add_rn(-0.0, -0.0)));
  CHECK(std::signbit(d::add_rn(-0.0f, -0.0f)));
  CHECK_FALSE(std::signbit(d::add_rn(-0.0f, 0.0f)));
}
