// Transformer dimensions, parameter counts and the FLOPs of a training step.
#include <doctest/doctest.h>

#include "fedshard/error.hpp"
#include "fedshard/sim/compute.hpp"

using namespace fedshard;
using namespace fedshard::sim;

TEST_CASE("the presets have the published parameter counts") {
  CHECK(total_params(llama31_8b()) == 8'030'261'248);   // "8.03 B"
  CHECK(total_params(llama3_70b()) == 70'553'706'496);  // "70.6 B"
  CHECK(total_params(gpt2_small()) == 124'439'808);     // the released GPT-2 small checkpoint
  for (const auto& name : model_preset_names()) CHECK(model_preset(name).name == name);
  CHECK_THROWS_AS(model_preset("llama-9000"), invalid_argument);
}

TEST_CASE("FLOPs per token are 6N + 12 L H Q T, 8N + 16 L H Q T with recomputation") {
  const transformer_dims m = llama31_8b();
  // N excludes the input embedding table (a lookup), keeps the untied output projection.
  const double n = 8'030'261'248.0 - 128256.0 * 4096;
  CHECK(matmul_params(m) == static_cast<std::int64_t>(n));
  const double attn = 32.0 * 4096 * 2048;
  CHECK(train_flops_per_token(m, 2048) == doctest::Approx(6 * n + 12 * attn));
  CHECK(train_flops_per_token(m, 2048, true) == doctest::Approx(8 * n + 16 * attn));
  // A tied embedding is a matmul once (as the output projection); learned positions never.
  const transformer_dims g = gpt2_small();
  CHECK(matmul_params(g) == total_params(g) - 1024 * 768);
}

TEST_CASE("compute time = tokens x FLOPs per token / (peak x MFU)") {
  const transformer_dims m = llama31_8b();
  const compute_model cm{312e12, 0.5, false};
  const double f = train_flops_per_token(m, 2048);
  CHECK(cm.seconds(m, 4096, 2048) == doctest::Approx(4096 * f / 156e12));
  CHECK(compute_model{312e12, 0.25, false}.seconds(m, 4096, 2048) ==
        doctest::Approx(2 * cm.seconds(m, 4096, 2048)));
  CHECK_THROWS_AS((compute_model{312e12, 0.0, false}.seconds(m, 1, 1)), invalid_argument);
  CHECK_THROWS_AS((compute_model{312e12, 1.5, false}.seconds(m, 1, 1)), invalid_argument);
}

TEST_CASE("invalid dimensions are refused") {
  transformer_dims m = llama31_8b();
  m.heads = 7;  // does not divide 4096
  CHECK_THROWS_AS(m.check(), invalid_argument);
  m = llama31_8b();
  m.kv_heads = 0;
  CHECK_THROWS_AS(m.check(), invalid_argument);
  CHECK_THROWS_AS(train_flops_per_token(llama31_8b(), 0), invalid_argument);
}
