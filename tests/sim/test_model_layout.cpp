// The units a transformer declares: one per decoder layer plus embedding and head.
#include <doctest/doctest.h>

#include "fedshard/sim/compute.hpp"
#include "fedshard/sim/model_layout.hpp"

using namespace fedshard;
using namespace fedshard::sim;

TEST_CASE("one unit per decoder layer plus embedding and head, holding every parameter") {
  for (const transformer_dims& m : {llama31_8b(), gpt2_small()}) {
    CAPTURE(m.name);
    const flat_layout l = transformer_layout(m, 4);
    REQUIRE(l.num_units() == static_cast<std::size_t>(m.layers + 2));
    CHECK(l.unit(0).name == "embed");
    CHECK(l.unit(1).name == "layer0");
    CHECK(l.unit(l.num_units() - 1).name == "head");
    CHECK(l.total_numel() == static_cast<std::size_t>(total_params(m)));
    CHECK(l.unit(1).numel == static_cast<std::size_t>(layer_params(m)));
    CHECK(l.unit(0).numel == static_cast<std::size_t>(embedding_params(m)));
    CHECK(l.unit(0).type == dtype::bf16);
    CHECK(l.shards() == 4);
  }
  // Tied embeddings: the head holds only the final norm (LayerNorm: weight and bias).
  CHECK(transformer_layout(gpt2_small(), 1).units().back().numel == 2 * 768u);
  // Grouped-query attention: K and V have kv_heads x head_dim rows.
  const auto units = transformer_units(llama31_8b());
  const auto& wk = units[1].tensors[2];
  CHECK(wk.name == "wk");
  CHECK(wk.shape == std::vector<std::int64_t>{1024, 4096});
}
