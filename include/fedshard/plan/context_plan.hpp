#pragma once
/// The per-batch plan of context parallelism (FCP, arXiv 2602.21788): from a block placement
/// (plan/context_blocks.hpp), which key/value blocks each rank of the context-parallel group
/// sends to which, as point-to-point ops on the group's axis; and a cache of plans by the
/// tuple of sequence lengths.
///
/// Transfers. Rank d needs from rank s every block of s that a later block of the same
/// sequence on d attends to (its keys and values: causal attention reads every earlier
/// position). The blocks of one pair (s, d) travel as one message, in block order, each block
/// its keys (tokens x kv_dim) then its values (the same): 2 x kv_dim x tokens elements. The
/// bytes of each pair are the placement's kv_bytes(s, d).
///
/// Order: rounds of a round-robin tournament (the circle method: with P' = P rounded up to
/// even, round k in [0, P' - 1) pairs rank P' - 1 with rank k and every other rank r with
/// (2k - r) mod (P' - 1); a rank paired with P' - 1 = P, for odd P, sits the round out). Every
/// pair meets in exactly one round. In its round a pair moves what each needs from the
/// other: one send_recv op when both directions carry the same bytes (start_exchange), else a
/// send and a recv op, the lower rank sending first and the higher receiving first; a pair
/// with nothing to move in either direction has no ops. Deadlock-free on blocking backends:
/// a round pairs each rank with at most one other, both ranks of a pair list the rounds in
/// the same order and skip the same ones (each computes the whole plan from the lengths),
/// and within a pair one side's first call is the other's first call's match.
///
/// Operands (role value): index 0 is the rank's send area, its outgoing messages back to back
/// in op order; index 1 its receive area, its incoming messages back to back in op order;
/// offset and count select one message (elements of the op's dtype). The backward pass runs
/// the same rounds with the directions swapped: each rank sends the key and value gradients
/// of the blocks it received (laid out as its receive area) back to their owners, who receive
/// them laid out as their send area and add them to their own.
///
/// One batch on every rank: each rank computes the plan from the lengths it was given, so
/// ranks given different batches would run different ops (a hang or silent garbage).
/// check_same_batch refuses that, on every rank alike, with one all_reduce of 32 bytes on
/// the plan's axis per call (a model calls it once per step, before its first exchange:
/// examples/charlm/attention_model.hpp).
///
/// Not yet: a relay (tree or chain) for the first blocks of a long sequence, which every
/// later chunk's rank needs: one rank sends them k - 1 times (sim/context.hpp's P = 64 row).

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/core/mix.hpp"
#include "fedshard/error.hpp"
#include "fedshard/mesh/axis.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/plan/context_blocks.hpp"
#include "fedshard/plan/start_op.hpp"

namespace fedshard {

/// The blocks rank dst needs from rank src (indices into placement.blocks, ascending).
struct context_transfer {
  int src = 0;
  int dst = 0;
  std::vector<int> blocks;
  std::int64_t tokens = 0;  ///< the blocks' tokens
  friend bool operator==(const context_transfer&, const context_transfer&) = default;
};

/// The partner of `rank` in round k of the header's round-robin over `ranks` ranks (P' - 1
/// rounds); -1 when it sits the round out.
inline int context_partner(int rank, int k, int ranks) {
  const int n = ranks + ranks % 2;  // P'
  FEDSHARD_EXPECTS(rank >= 0 && rank < ranks && k >= 0 && k < n - 1,
                   "context_partner: expected a rank in [0, ", ranks, ") and a round in [0, ",
                   n - 1, "), found rank ", rank, ", round ", k);
  const int p = rank == n - 1 ? k
                : rank == k   ? n - 1
                              : ((2 * k - rank) % (n - 1) + n - 1) % (n - 1);
  return p < ranks ? p : -1;
}

/// A batch's placement, its transfers, and every rank's ops; see the file comment.
class context_plan {
 public:
  /// The plan of placement p (made with settings s) on axis a.
  context_plan(context_placement p, const context_settings& s, fedshard::axis a)
      : placement_(std::move(p)), settings_(s), axis_(a), dtype_(dtype_of(s.element_bytes)) {
    const int n = placement_.ranks;
    transfers_.resize(static_cast<std::size_t>(n) * static_cast<std::size_t>(n));
    for (int src = 0; src < n; ++src)
      for (int dst = 0; dst < n; ++dst) at(src, dst) = {src, dst, {}, 0};
    add_transfers();
  }

  const context_placement& placement() const noexcept { return placement_; }
  const context_settings& settings() const noexcept { return settings_; }
  /// What rank dst needs from rank src.
  const context_transfer& transfer(int src, int dst) const {
    FEDSHARD_EXPECTS(src >= 0 && src < ranks() && dst >= 0 && dst < ranks(),
                     "context_plan::transfer: expected ranks in [0, ", ranks(), "), found ", src,
                     " and ", dst);
    return transfers_[index(src, dst)];
  }
  int ranks() const noexcept { return placement_.ranks; }
  /// The axis of the plan's ops.
  fedshard::axis axis() const noexcept { return axis_; }
  /// A fingerprint of the settings and every block (sequence, index, first token, tokens,
  /// rank): plans of different batches differ in it (but for a chance of 2^-64).
  std::uint64_t fingerprint() const noexcept {
    std::uint64_t h = mix64(static_cast<std::uint64_t>(settings_.block_tokens));
    for (const std::int64_t x :
         {std::int64_t{placement_.ranks}, settings_.kv_dim, settings_.element_bytes,
          static_cast<std::int64_t>(placement_.blocks.size())})
      h = mix64(h ^ static_cast<std::uint64_t>(x));
    for (const context_block& b : placement_.blocks)
      for (const std::int64_t x : {std::int64_t{b.sequence}, std::int64_t{b.index}, b.first_token,
                                   b.tokens, std::int64_t{b.rank}})
        h = mix64(h ^ static_cast<std::uint64_t>(x));
    return h;
  }
  /// Elements of one token's keys and values together (2 kv_dim).
  std::int64_t elements_per_token() const noexcept { return 2 * settings_.kv_dim; }

  /// The forward ops of `rank` (its key/value exchanges), in the order it runs them.
  plan forward(int rank) const { return ops(rank, false); }
  /// The backward ops of `rank` (the key/value gradients sent back), in run order.
  plan backward(int rank) const { return ops(rank, true); }

  /// The transfers `rank` sends (forward), in op order: its send area's messages.
  std::vector<const context_transfer*> sent_by(int rank) const { return partners(rank, true); }
  /// The transfers `rank` receives (forward), in op order: its receive area's messages.
  std::vector<const context_transfer*> received_by(int rank) const { return partners(rank, false); }

 private:
  static fedshard::dtype dtype_of(std::int64_t element_bytes) {
    FEDSHARD_EXPECTS(element_bytes == 4 || element_bytes == 2,
                     "context_plan: keys and values travel as f32 (4 bytes) or bf16 (2 bytes); "
                     "found element_bytes ",
                     element_bytes);
    return element_bytes == 4 ? fedshard::dtype::f32 : fedshard::dtype::bf16;
  }
  std::size_t index(int src, int dst) const {
    return static_cast<std::size_t>(src) * static_cast<std::size_t>(ranks()) +
           static_cast<std::size_t>(dst);
  }
  context_transfer& at(int src, int dst) { return transfers_[index(src, dst)]; }

  /// Each block goes to every other rank holding a later block of its sequence, once.
  void add_transfers() {
    const auto& blocks = placement_.blocks;
    std::vector<int> later;  // ranks holding a later block of the current sequence
    for (std::size_t end = blocks.size(); end > 0;) {
      const int seq = blocks[end - 1].sequence;
      later.clear();
      std::size_t k = end;
      for (; k > 0 && blocks[k - 1].sequence == seq; --k) {
        const context_block& b = blocks[k - 1];
        for (int d : later)
          if (d != b.rank) {
            at(b.rank, d).blocks.push_back(static_cast<int>(k - 1));
            at(b.rank, d).tokens += b.tokens;
          }
        if (std::find(later.begin(), later.end(), b.rank) == later.end()) later.push_back(b.rank);
      }
      end = k;
    }
    for (auto& t : transfers_) std::sort(t.blocks.begin(), t.blocks.end());
  }

  /// rank's partners round by round (those it exchanges something with).
  std::vector<int> partner_order(int rank) const {
    std::vector<int> out;
    const int n = ranks() + ranks() % 2;
    for (int k = 0; k + 1 < n; ++k) {
      const int p = context_partner(rank, k, ranks());
      if (p >= 0 && (transfer(rank, p).tokens > 0 || transfer(p, rank).tokens > 0))
        out.push_back(p);
    }
    return out;
  }

  std::vector<const context_transfer*> partners(int rank, bool sending) const {
    std::vector<const context_transfer*> out;
    for (int p : partner_order(rank)) {
      const context_transfer& t = sending ? transfer(rank, p) : transfer(p, rank);
      if (t.tokens > 0) out.push_back(&t);
    }
    return out;
  }

  plan ops(int rank, bool backward) const;

  context_placement placement_;
  context_settings settings_;
  fedshard::axis axis_;
  fedshard::dtype dtype_;
  std::vector<context_transfer> transfers_;  // P x P, [src * P + dst]
};

inline plan context_plan::ops(int rank, bool backward) const {
  FEDSHARD_EXPECTS(rank >= 0 && rank < ranks(), "context_plan: expected a rank in [0, ", ranks(),
                   "), found ", rank);
  const std::int64_t per = elements_per_token(), size = size_of(dtype_);
  std::int64_t sent = 0, received = 0;  // elements so far in the send and receive areas
  plan out;
  for (int p : partner_order(rank)) {
    const std::int64_t send = transfer(rank, p).tokens * per, recv = transfer(p, rank).tokens * per;
    comm_op base{.kind = comm_kind::send_recv,
                 .axis = axis_,
                 .dtype = dtype_,
                 .ranks = ranks(),
                 .peer = p,
                 .phase = backward ? phase::backward : phase::forward};
    // Forward: send from area 0, receive into area 1; backward: the reverse.
    const operand mine{.role = role::value, .index = backward ? 1 : 0};
    const operand theirs{.role = role::value, .index = backward ? 0 : 1};
    // What this rank sends and receives in this pass, and where in its areas.
    const std::int64_t out_n = backward ? recv : send, in_n = backward ? send : recv;
    const std::int64_t out_at = backward ? received : sent, in_at = backward ? sent : received;
    comm_op tx = base, rx = base;
    tx.kind = comm_kind::send;
    tx.bytes = out_n * size;
    tx.in = {.role = mine.role, .index = mine.index, .offset = out_at, .count = out_n};
    rx.kind = comm_kind::recv;
    rx.bytes = in_n * size;
    rx.out = {.role = theirs.role, .index = theirs.index, .offset = in_at, .count = in_n};
    if (out_n == in_n) {
      comm_op x = base;
      x.bytes = out_n * size;
      x.in = tx.in;
      x.out = rx.out;
      out.ops.push_back(x);
    } else if (rank < p) {
      if (out_n > 0) out.ops.push_back(tx);
      if (in_n > 0) out.ops.push_back(rx);
    } else {
      if (in_n > 0) out.ops.push_back(rx);
      if (out_n > 0) out.ops.push_back(tx);
    }
    sent += send;
    received += recv;
  }
  return out;
}

/// Runs `ops` (a context_plan's forward or backward ops of this rank) on c, the communicator
/// of their axis, each after the previous one completed, with area 0 and area 1 (the
/// operands' role value, index 0 and 1; bytes); invalid_argument (before anything moves)
/// when an op's range does not fit its area.
template <Communicator C>
void run_context_ops(C& c, const plan& ops, std::span<std::byte> area0,
                     std::span<std::byte> area1) {
  auto range = [&](const operand& o, const comm_op& op) -> std::byte* {
    const std::span<std::byte> area = o.index == 0 ? area0 : area1;
    const auto size = static_cast<std::int64_t>(size_of(op.dtype));
    FEDSHARD_EXPECTS(o.role == role::value && (o.index == 0 || o.index == 1) && o.count >= 0 &&
                         (o.offset + o.count) * size <= static_cast<std::int64_t>(area.size()),
                     "run_context_ops: ", describe(op), " needs elements [", o.offset, ", ",
                     o.offset + o.count, ") of area ", o.index, ", which holds ",
                     static_cast<std::int64_t>(area.size()) / size);
    return area.data() + o.offset * size;
  };
  for (const comm_op& op : ops.ops) {
    if (has_input(op.kind)) (void)range(op.in, op);
    if (has_output(op.kind)) (void)range(op.out, op);
  }
  for (const comm_op& op : ops.ops) {
    const std::byte* in = has_input(op.kind) ? range(op.in, op) : nullptr;
    std::byte* out = has_output(op.kind) ? range(op.out, op) : nullptr;
    start_op(c, op, in, out).wait();
  }
}

/// The op of check_same_batch on a plan of `ranks` ranks on axis a: a max all_reduce of 4 f64
/// (role value).
inline comm_op batch_agreement_op(fedshard::axis a, int ranks) {
  return {.kind = comm_kind::all_reduce,
          .axis = a,
          .dtype = dtype::f64,
          .bytes = 32,
          .ranks = ranks,
          .reduce = reduce_op::max,
          .in = {.role = role::value},
          .out = {.role = role::value},
          .overlappable = false};
}

/// Refuses, on every rank of p's axis alike, ranks that made their plans from different
/// batches (the file comment): agree(v) runs batch_agreement_op(p.axis(), p.ranks()) on the 4
/// values v (a model passes step_context::agree), the halves of p.fingerprint() and their
/// negations, whose maxima then say whether every rank's halves are equal. invalid_argument
/// when they are not; nothing runs with one rank.
template <class Agree>
void check_same_batch(const context_plan& p, Agree&& agree) {
  if (p.ranks() == 1) return;
  const std::uint64_t f = p.fingerprint();
  const auto hi = static_cast<double>(f >> 32), lo = static_cast<double>(f & 0xffffffffu);
  std::array<double, 4> v{hi, lo, -hi, -lo};
  agree(std::span<double>(v));
  FEDSHARD_EXPECTS(v[0] == -v[2] && v[1] == -v[3], "context parallelism: the ranks of the ",
                   to_string(p.axis()),
                   " axis made their plans from different batches (this rank's plan has "
                   "fingerprint ",
                   f, " over ", p.placement().blocks.size(),
                   " blocks); expected every rank of a context-parallel group to be given the "
                   "same batch (the same sequence lengths in the same order)");
}

/// The plans of the batches seen, by their tuple of lengths, each made once (fcp_placement
/// and the plan: microseconds, bench/bench_context.cpp) and kept until `capacity` other
/// tuples were used since it was last used (least recently used first out).
class context_plan_cache {
 public:
  /// Plans with settings s on axis a; invalid_argument unless capacity >= 1.
  context_plan_cache(const context_settings& s, fedshard::axis a, std::size_t capacity = 64)
      : settings_(s), axis_(a), capacity_(capacity) {
    FEDSHARD_EXPECTS(capacity >= 1, "context_plan_cache: expected a capacity >= 1, found 0");
  }

  /// The plan of a batch of sequences of these lengths (made on first use).
  std::shared_ptr<const context_plan> get(std::span<const std::int64_t> lengths) {
    std::vector<std::int64_t> key(lengths.begin(), lengths.end());
    ++clock_;
    if (auto it = plans_.find(key); it != plans_.end()) {
      ++hits_;
      it->second.used = clock_;
      return it->second.plan;
    }
    auto made =
        std::make_shared<const context_plan>(fcp_placement(lengths, settings_), settings_, axis_);
    if (plans_.size() >= capacity_) {
      auto oldest = plans_.begin();
      for (auto it = plans_.begin(); it != plans_.end(); ++it)
        if (it->second.used < oldest->second.used) oldest = it;
      plans_.erase(oldest);
    }
    plans_.emplace(std::move(key), entry{made, clock_});
    return made;
  }
  /// Calls of get() that found their plan, and the plans kept now.
  std::size_t hits() const noexcept { return hits_; }
  std::size_t size() const noexcept { return plans_.size(); }

 private:
  struct entry {
    std::shared_ptr<const context_plan> plan;
    std::uint64_t used = 0;
  };
  context_settings settings_;
  fedshard::axis axis_;
  std::size_t capacity_;
  std::map<std::vector<std::int64_t>, entry> plans_;
  std::uint64_t clock_ = 0;
  std::size_t hits_ = 0;
};

}  // namespace fedshard
