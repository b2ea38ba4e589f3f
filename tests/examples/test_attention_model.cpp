// charlm::attention_model (charlm/attention_model.hpp): its hand-written backward against
// finite differences, and a training step with each batch spread over 1 to 4 ranks of a group
// (context parallelism through step_context::exchange) against the same step on one rank;
// ranks of a group given different batches are refused on every rank.
#include "charlm/attention_model.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fedshard/fedshard.hpp"
#include "support/error_of.hpp"
#include "support/spawn_ranks.hpp"

using namespace fedshard;

namespace {

/// A corpus of 4000 bytes over 12 letters (a fixed pseudo-random text).
charlm::corpus letters() {
  std::string text;
  std::uint64_t z = 7;
  for (int i = 0; i < 4000; ++i) {
    z = mix64(z);
    text.push_back(static_cast<char>('a' + z % 12));
  }
  return charlm::corpus::from_text(text);
}

/// Unit hooks over whole buffers on one rank (no mesh: the model's plans have no ops).
struct full_hooks final : detail::unit_hooks<> {
  flat_layout l;
  std::vector<std::vector<float>> p, g;
  space::host_space host;
  space::host_space::stream st;

  explicit full_hooks(const charlm::attention_model& m) : l(m.units(), 1) {
    for (std::size_t u = 0; u < l.num_units(); ++u) {
      std::vector<float> v = m.initial_values(l, u);
      v.resize(l.unit(u).padded_numel);
      p.push_back(v);
      g.emplace_back(v.size(), 0.0f);
    }
  }
  const flat_layout& layout() const override { return l; }
  space::host_space& space() override { return host; }
  space::host_space::stream& compute_stream() override { return st; }
  std::span<const float> acquire(std::size_t u, phase) override { return p.at(u); }
  std::span<const float> params(std::size_t u) override { return p.at(u); }
  void release(std::size_t) override {}
  std::span<float> grad_buffer(std::size_t u) override { return g.at(u); }
  void grads_ready(std::size_t) override {}
  const_buffer_view acquire_as(std::size_t u, phase ph, dtype) override {
    return cview(acquire(u, ph));
  }
  buffer_view grad_buffer_as(std::size_t u, dtype) override { return view(grad_buffer(u)); }
};

/// FSDP whose groups' ranks share each batch (context parallelism over the group).
struct context_defaults {
  static constexpr schedule::every_step::config schedule{};
  static constexpr std::optional<axis> context_axis = axis::group;
};
using context_fsdp =
    algorithm<shard::full_shard, federation::none, schedule::every_step, context_defaults>;

const charlm::attention_dims small{
    .vocab = 12, .embed = 6, .head = 4, .max_length = 64, .block_tokens = 8};

}  // namespace

TEST_CASE("the attention model's gradients match finite differences") {
  const charlm::corpus data = letters();
  charlm::attention_model m(small, 3);
  full_hooks h(m);
  const charlm::sequence_batch b = charlm::draw_sequences(data, 64, 5, 0, 0, 8);
  step_context train(h, true, 0, 0);
  (void)m.forward_backward(train, b);
  step_context eval(h, false, 0, 0);
  // One element of every tensor (embed's table and pos: rows the batch uses).
  const std::vector<std::pair<std::size_t, std::size_t>> at{{0, 6 * b.sequences[0][0] + 1},
                                                            {0, 12 * 6 + 6 * 1 + 2},
                                                            {1, 5},
                                                            {1, 24 + 7},
                                                            {1, 48 + 3},
                                                            {1, 72 + 11},
                                                            {2, 17},
                                                            {2, 72 + 4}};
  for (const auto& [u, i] : at) {
    CAPTURE(u);
    CAPTURE(i);
    const float keep = h.p[u][i], step = 1e-2f;
    h.p[u][i] = keep + step;
    const double up = m.evaluate(eval, b);
    h.p[u][i] = keep - step;
    const double down = m.evaluate(eval, b);
    h.p[u][i] = keep;
    const double fd = (up - down) / (2.0 * step), g = h.g[u][i];
    CHECK(std::abs(fd - g) <= 1e-3 + 2e-2 * std::abs(g));
    CHECK(g != 0.0);  // every probed element takes part
  }
}

TEST_CASE("a step with each batch spread over 1 to 4 ranks equals the step on one rank") {
  const charlm::corpus data = letters();
  // Two steps of two batches of 8 sequences (one long one each: skewed), SGD.
  const std::vector<charlm::sequence_batch> batches{charlm::draw_sequences(data, 64, 5, 0, 0, 8),
                                                    charlm::draw_sequences(data, 64, 5, 1, 0, 8)};
  std::vector<float> one;  // the parameters after the steps on one rank
  double one_loss = 0;
  for (int P = 1; P <= 4; ++P) {
    CAPTURE(P);
    test::spawn_ranks(P, [&](inproc::communicator& c) {
      mesh m(c, mesh_shape{1, 1, P});
      trainer<charlm::attention_model, context_fsdp, optim::sgd, inproc::communicator> t(
          m, charlm::attention_model(small, 3), {.lr = 0.5f});
      double loss = 0;
      for (const auto& b : batches) {
        const auto before = t.traffic()[axis::group];
        loss = t.mean_over_world(t.step(b));
        // The group axis carries the batch check (one all_reduce of 32 bytes, P > 1) and the
        // plan's key/value exchanges, nothing else.
        std::vector<std::int64_t> lengths;
        for (const auto& s : b.sequences) lengths.push_back(std::int64_t(s.size()) - 1);
        const context_settings cs{.block_tokens = 8, .ranks = P, .kv_dim = 4, .element_bytes = 4};
        const context_plan plan(fcp_placement(lengths, cs), cs, axis::group);
        std::int64_t calls = P > 1 ? 1 : 0, bytes = P > 1 ? 32 : 0;
        for (const fedshard::plan& ops : {plan.forward(c.rank()), plan.backward(c.rank())})
          for (const comm_op& op : ops.ops)
            if (op.kind != comm_kind::recv) {
              ++calls;
              bytes += op.bytes;
            }
        CHECK(t.traffic()[axis::group].calls - before.calls == calls);
        CHECK(t.traffic()[axis::group].payload_bytes - before.payload_bytes == bytes);
        if (P > 1) CHECK(bytes > 32);
      }
      const std::vector<float> params = t.parameters();
      if (c.rank() != 0) return;
      if (P == 1) {
        one = params;
        one_loss = loss;
        return;
      }
      // The same sums in another order (the ranks' partial gradients, then their average):
      // within 1e-5 (the parameters are O(1); seen: at most a few 1e-7).
      REQUIRE(params.size() == one.size());
      int off = 0;
      for (std::size_t i = 0; i < params.size(); ++i)
        off += std::abs(params[i] - one[i]) > 1e-5f ? 1 : 0;
      CHECK(off == 0);
      CHECK(std::abs(loss - one_loss) <= 1e-5 * one_loss);
    });
  }
}

TEST_CASE("ranks of a group given different batches are refused on every rank, never hang") {
  const charlm::corpus data = letters();
  for (const int P : {2, 3}) {
    CAPTURE(P);
    // Rank 1 draws the next step's batch: other lengths, so another placement.
    test::spawn_ranks(P, [&](inproc::communicator& c) {
      mesh m(c, mesh_shape{1, 1, P});
      trainer<charlm::attention_model, context_fsdp, optim::sgd, inproc::communicator> t(
          m, charlm::attention_model(small, 3), {.lr = 0.5f});
      const auto b = charlm::draw_sequences(data, 64, 5, c.rank() == 1 ? 1 : 0, 0, 8);
      CHECK(test::error_of([&] { (void)t.step(b); })
                .find("context parallelism: the ranks of the group axis made their plans from "
                      "different batches") != std::string::npos);
    });
  }
}

TEST_CASE("context parallelism runs inside a group: the federation axis is refused") {
  test::spawn_ranks(2, [&](inproc::communicator& c) {
    mesh m(c, mesh_shape{2, 1, 1});
    trainer_options<fcp> o;
    CHECK(o.context_axis == axis::group);  // fcp's default
    o.context_axis = axis::federation;
    CHECK(test::error_of([&] {
            trainer<charlm::attention_model, fcp, optim::sgd, inproc::communicator> t(
                m, charlm::attention_model(small, 3), {.lr = 0.5f}, o);
          })
              .find("context parallelism runs inside a group (the shard, replica or group axis), "
                    "found the federation axis") != std::string::npos);
  });
}

TEST_CASE("the attention model refuses sequences longer than its positions") {
  const charlm::corpus data = letters();
  charlm::attention_model m(small, 3);
  full_hooks h(m);
  charlm::sequence_batch b{{std::vector<std::uint8_t>(66, 1)}};
  step_context train(h, true, 0, 0);
  CHECK(test::error_of([&] {
          (void)m.forward_backward(train, b);
        }).find("a sequence of 66 ids; expected 2 to max_length + 1 = 65") != std::string::npos);
  CHECK(test::error_of([&] {
          (void)charlm::draw_sequences(data, 32, 1, 0, 0, 1);
        }).find("need max_length >= 64") != std::string::npos);
}
