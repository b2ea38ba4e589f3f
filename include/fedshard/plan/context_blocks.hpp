#pragma once
/// Block placement for context parallelism (FCP, arXiv 2602.21788): a batch of sequences,
/// given by their lengths in tokens, is cut into blocks of B tokens, and the blocks are placed
/// on the P ranks of a context-parallel group (any P >= 1) so that every rank's causal
/// attention work is balanced; the placement implies which key/value blocks each rank needs
/// from which. ring_placement is the baseline: ring context parallelism without load
/// balancing, every sequence split evenly into P contiguous chunks.
///
/// Cost model (one for both placements). Causal attention: the query token at position t of a
/// sequence attends to the keys at positions 0..t, so it costs t + 1 (query, key) pairs. A
/// contiguous run of a sequence's tokens [a, b) costs the pairs of its queries:
///     work(a, b) = sum_{t=a}^{b-1} (t + 1) = (b - a)(a + b + 1) / 2   (an integer).
/// Block j (0-based) of a sequence of length L holds [jB, min((j+1)B, L)): it attends to
/// blocks 0..j, and a full block costs B^2 j + B(B+1)/2 pairs: j + 1/2 block pairs of B^2,
/// plus B/2 (the diagonal block counted as its causal half); a partial last block costs its own
/// tokens' pairs by the same formula. A sequence costs L(L+1)/2 however it is cut, so both
/// placements share the batch's total work W, and max/mean compares them directly.
///
/// Placement (fcp_placement), a pure function of (lengths, settings) with deterministic ties,
/// so every rank computes the same one from the lengths alone:
///  1. the target per rank is T = ceil(W / P);
///  2. sequences are taken by work, largest first (ties: the lower sequence index first);
///  3. a sequence goes whole onto the least loaded rank (ties: the lowest rank) when it fits
///     there under T: it then needs no key/value exchange at all;
///  4. otherwise it is split: its blocks are taken from the last (the costliest) to the
///     first; each goes onto the current rank while it fits there under T; when it does not
///     (and for the last block, the first taken) the current rank becomes the one `rule`
///     names: least_loaded, the rank with the most room; or best_fit, the fullest rank that
///     has room for the block (ties: the lowest rank, for both). When no rank has room, both take
///     the least loaded rank (the block then exceeds T there);
///  5. the placement is made with both rules, and the one kept is the one with the smaller
///     max work, then the fewer bytes received by the busiest receiver, then the fewer bytes
///     in all, then least_loaded's. Max works less than B(B+1)/2 apart (the work of a
///     sequence's first full block, the finest step a block placement takes) count as equal.
/// A short sequence therefore stays on one rank whenever some rank has room for it, and a long
/// one is cut into as few contiguous chunks as the ranks' room allows (earlier blocks cost
/// less, so earlier chunks hold more blocks). Costliest first, as in LPT scheduling, so that
/// the cheap head blocks come last and fill what room is left: forwards, the costly tail
/// blocks would come last and overshoot (lengths {8}, B = 2, P = 2 gives work 25/11
/// forwards, 18/18 backwards). Two rules because neither wins everywhere: least_loaded puts
/// each chunk in the largest room, so chunks are few and large; best_fit puts it in the
/// smallest room that holds its first block, which keeps large rooms for the large tail
/// blocks of later sequences and wins where blocks are coarse against T (on the benchmark's
/// batch at P = 64, max/mean 1.004 and 8.4 GB against 1.10 and 13.4 GB), but cuts sequences
/// into more chunks where room is plentiful (at P = 8, 975 MB against 749 MB, equal balance).
/// Both together take 8 us at P = 8 and 36 us at P = 64 on that batch (bench/bench_context.cpp).
///
/// Why contiguous chunks and not the zigzag (head-tail) pairing or a greedy over single
/// blocks: the rank holding a sequence's block j needs the keys and values of blocks 0..j-1.
/// A contiguous chunk starting at token s needs only the s tokens before it, so a sequence cut
/// into k equal-work chunks moves about L sum_{i<k} sqrt(i/k) ~ (2/3) k L tokens, against
/// (k - 1) L for zigzag pairs or a ring (a rank holding a tail block needs almost every
/// earlier block), and k is only as large as the sequence's work requires, not P. The price
/// is granularity: a chunk ends on a block boundary, which the bound below accounts for.
///
/// Balance bound: a block or sequence lands on a rank either under T, or on the least loaded
/// rank, whose load is at most the mean so far <= W / P <= T; so every rank's work is at most
///     T + w_max,   max / mean <= 1 + (1 + w_max) P / W,
/// w_max the largest single block's work in the batch (at most B x the longest length).
///
/// Exchange. A block on rank r attending to an earlier block of the same sequence held by
/// rank s != r needs that block's keys and values: 2 x tokens x kv_dim x element_bytes. A rank
/// receives each such block once however many of its blocks attend to it, so bytes(s, d) is
/// the sum, over the blocks on s, of that size for each block that some later block of the
/// same sequence on d attends to. The forward pass only; the backward pass sends the key and
/// value gradients back over the same pairs (the same bytes, d to s).
///
/// ring_placement: sequence i of length L is cut into P chunks, chunk c = [floor(cL/P),
/// floor((c+1)L/P)) on rank c (empty chunks, when L < P, are left out of `blocks`). A ring
/// passes every chunk of a sequence once around the ranks: rank r receives from rank r - 1
/// (mod P) the P - 1 chunks that are not its own, L - |chunk r| tokens per sequence, whatever
/// the causal mask needs; (P - 1) sum L tokens of keys and values in all.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "fedshard/error.hpp"

namespace fedshard {

/// What a placement needs besides the sequence lengths.
struct context_settings {
  std::int64_t block_tokens = 512;  ///< B, tokens per block (fcp_placement only)
  int ranks = 1;                    ///< P, ranks of the context-parallel group
  std::int64_t kv_dim = 1;          ///< elements of one token's key (and of its value)
  std::int64_t element_bytes = 2;   ///< bytes of one key or value element (2: bf16)
};

/// One block (fcp_placement) or chunk (ring_placement) of a sequence, and where it runs.
struct context_block {
  int sequence = 0;              ///< index of the sequence in the batch
  int index = 0;                 ///< block (chunk) index within the sequence
  std::int64_t first_token = 0;  ///< position of its first token in the sequence
  std::int64_t tokens = 0;       ///< its tokens
  std::int64_t work = 0;         ///< causal (query, key) pairs: causal_work(first_token, tokens)
  int rank = 0;                  ///< the rank that computes its attention
  friend bool operator==(const context_block&, const context_block&) = default;
};

/// A placement: the blocks, each rank's work, and the key/value bytes between every pair.
struct context_placement {
  int ranks = 1;                       ///< P
  std::vector<context_block> blocks;   ///< by sequence, then by index
  std::vector<std::int64_t> work;      ///< per rank: the sum of its blocks' work
  std::vector<std::int64_t> kv_bytes;  ///< P x P, row-major: [src * P + dst]

  /// Bytes of keys and values rank dst receives from rank src.
  std::int64_t bytes(int src, int dst) const {
    FEDSHARD_EXPECTS(src >= 0 && src < ranks && dst >= 0 && dst < ranks,
                     "context_placement::bytes: expected ranks in [0, ", ranks, "), found src ",
                     src, ", dst ", dst);
    return kv_bytes[static_cast<std::size_t>(src) * static_cast<std::size_t>(ranks) +
                    static_cast<std::size_t>(dst)];
  }
  /// Bytes moved between all ranks together.
  std::int64_t total_bytes() const {
    std::int64_t s = 0;
    for (std::int64_t b : kv_bytes) s += b;
    return s;
  }
  /// The most bytes one rank receives.
  std::int64_t max_received_bytes() const {
    std::int64_t most = 0;
    for (int d = 0; d < ranks; ++d) {
      std::int64_t in = 0;
      for (int s = 0; s < ranks; ++s) in += bytes(s, d);
      most = std::max(most, in);
    }
    return most;
  }
  /// W, the work of the whole batch.
  std::int64_t total_work() const {
    std::int64_t s = 0;
    for (std::int64_t w : work) s += w;
    return s;
  }
  /// The most work one rank has.
  std::int64_t max_work() const {
    std::int64_t m = 0;
    for (std::int64_t w : work) m = std::max(m, w);
    return m;
  }
  /// max / mean work per rank (1: perfectly balanced).
  double imbalance() const {
    const double mean = static_cast<double>(total_work()) / static_cast<double>(ranks);
    return mean > 0.0 ? static_cast<double>(max_work()) / mean : 1.0;
  }
  friend bool operator==(const context_placement&, const context_placement&) = default;
};

/// The causal (query, key) pairs of the tokens [first, first + tokens) of one sequence:
/// tokens (2 first + tokens + 1) / 2.
constexpr std::int64_t causal_work(std::int64_t first, std::int64_t tokens) noexcept {
  return tokens * (2 * first + tokens + 1) / 2;
}

namespace detail {

/// Longest sequence accepted: its work L(L+1)/2 stays far inside int64.
inline constexpr std::int64_t max_context_length = std::int64_t{1} << 31;

/// Checks the lengths and the settings a placement uses; returns the total tokens.
inline std::int64_t check_context_input(std::span<const std::int64_t> lengths,
                                        const context_settings& s, bool uses_blocks) {
  FEDSHARD_EXPECTS(!lengths.empty(),
                   "context placement: expected at least one sequence, found "
                   "an empty batch");
  FEDSHARD_EXPECTS(lengths.size() <= static_cast<std::size_t>(std::numeric_limits<int>::max()),
                   "context placement: expected at most 2^31 - 1 sequences, found ",
                   lengths.size());
  FEDSHARD_EXPECTS(!uses_blocks || s.block_tokens > 0,
                   "context placement: expected block_tokens > 0, found ", s.block_tokens);
  FEDSHARD_EXPECTS(s.ranks > 0, "context placement: expected ranks > 0, found ", s.ranks);
  FEDSHARD_EXPECTS(s.kv_dim > 0, "context placement: expected kv_dim > 0, found ", s.kv_dim);
  FEDSHARD_EXPECTS(s.element_bytes > 0, "context placement: expected element_bytes > 0, found ",
                   s.element_bytes);
  std::int64_t tokens = 0;
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    FEDSHARD_EXPECTS(lengths[i] > 0 && lengths[i] <= max_context_length,
                     "context placement: expected every length in [1, 2^31], found ", lengths[i],
                     " at sequence ", i);
    FEDSHARD_EXPECTS(tokens <= std::numeric_limits<std::int64_t>::max() / 4 - lengths[i],
                     "context placement: the batch's tokens overflow at sequence ", i);
    tokens += lengths[i];
  }
  const std::int64_t limit = std::numeric_limits<std::int64_t>::max() / std::max(1, s.ranks - 1);
  FEDSHARD_EXPECTS(
      s.kv_dim <= limit / 2 / s.element_bytes && tokens <= limit / (2 * s.kv_dim * s.element_bytes),
      "context placement: expected the key/value bytes to fit in int64, found ", tokens,
      " tokens of 2 x ", s.kv_dim, " x ", s.element_bytes, " bytes over ", s.ranks, " ranks");
  return tokens;
}

/// The placement's empty shell: P ranks, no work, no bytes.
inline context_placement empty_context_placement(int ranks) {
  context_placement p;
  p.ranks = ranks;
  p.work.assign(static_cast<std::size_t>(ranks), 0);
  p.kv_bytes.assign(static_cast<std::size_t>(ranks) * static_cast<std::size_t>(ranks), 0);
  return p;
}

/// Cuts every sequence into blocks of b tokens (rank unset); first[i] is the index of
/// sequence i's first block in the result, first[n] the number of blocks.
inline std::vector<context_block> cut_blocks(std::span<const std::int64_t> lengths, std::int64_t b,
                                             std::vector<std::size_t>& first) {
  std::vector<context_block> blocks;
  first.assign(lengths.size() + 1, 0);
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    first[i] = blocks.size();
    int index = 0;
    for (std::int64_t a = 0; a < lengths[i]; a += b, ++index) {
      const std::int64_t n = std::min(b, lengths[i] - a);
      blocks.push_back({static_cast<int>(i), index, a, n, causal_work(a, n), -1});
    }
  }
  first[lengths.size()] = blocks.size();
  return blocks;
}

/// How a split sequence chooses the rank of a new chunk (step 4 of the header's placement).
enum class chunk_rule {
  least_loaded,  ///< the rank with the most room
  best_fit,      ///< the fullest rank with room for the block; the least loaded if none has
};

/// The least loaded rank (ties: the lowest).
inline int least_loaded_rank(const std::vector<std::int64_t>& load) {
  std::size_t best = 0;
  for (std::size_t r = 1; r < load.size(); ++r)
    if (load[r] < load[best]) best = r;
  return static_cast<int>(best);
}

/// The rank a new chunk starting with a block of work w goes to, by rule.
inline int chunk_rank(const std::vector<std::int64_t>& load, std::int64_t w, std::int64_t target,
                      chunk_rule rule) {
  int best = -1;
  if (rule == chunk_rule::best_fit)
    for (std::size_t r = 0; r < load.size(); ++r)
      if (load[r] + w <= target && (best < 0 || load[r] > load[static_cast<std::size_t>(best)]))
        best = static_cast<int>(r);
  return best >= 0 ? best : least_loaded_rank(load);
}

/// Places the blocks of one sequence of work w (steps 3 and 4 of the header's placement).
inline void place_sequence(std::span<context_block> seq, std::int64_t w, std::int64_t target,
                           std::vector<std::int64_t>& load, chunk_rule rule) {
  const int least = least_loaded_rank(load);
  if (load[static_cast<std::size_t>(least)] + w <= target) {
    for (context_block& blk : seq) blk.rank = least;
    load[static_cast<std::size_t>(least)] += w;
    return;
  }
  int c = -1;
  for (auto blk = seq.rbegin(); blk != seq.rend(); ++blk) {
    if (c < 0 || load[static_cast<std::size_t>(c)] + blk->work > target)
      c = chunk_rank(load, blk->work, target, rule);
    blk->rank = c;
    load[static_cast<std::size_t>(c)] += blk->work;
  }
}

/// Adds the key/value bytes fcp's placement implies to p.kv_bytes: walking each sequence's
/// blocks from the last, every block is sent to each other rank holding a later block.
inline void add_block_exchange(context_placement& p, const std::vector<std::size_t>& first,
                               std::int64_t bytes_per_token) {
  const auto n = static_cast<std::size_t>(p.ranks);
  std::vector<std::size_t> seen(n, 0);  // the sequence (+1) that last marked a rank
  std::vector<int> later;               // the ranks holding a later block of this sequence
  for (std::size_t i = 0; i + 1 < first.size(); ++i) {
    later.clear();
    for (std::size_t k = first[i + 1]; k-- > first[i];) {
      const context_block& blk = p.blocks[k];
      const auto s = static_cast<std::size_t>(blk.rank);
      for (int d : later)
        if (static_cast<std::size_t>(d) != s)
          p.kv_bytes[s * n + static_cast<std::size_t>(d)] += blk.tokens * bytes_per_token;
      if (seen[s] != i + 1) {
        seen[s] = i + 1;
        later.push_back(blk.rank);
      }
    }
  }
}

}  // namespace detail

namespace detail {

/// Steps 1 to 4 of the header's placement with one chunk rule, and the exchange it implies.
inline context_placement pack_blocks(std::span<const std::int64_t> lengths,
                                     const context_settings& s, chunk_rule rule) {
  context_placement p = empty_context_placement(s.ranks);
  std::vector<std::size_t> first;
  p.blocks = cut_blocks(lengths, s.block_tokens, first);

  std::vector<std::int64_t> seq_work(lengths.size());
  std::int64_t total = 0;
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    seq_work[i] = causal_work(0, lengths[i]);
    FEDSHARD_EXPECTS(total <= std::numeric_limits<std::int64_t>::max() / 2 - seq_work[i],
                     "fcp_placement: the batch's work overflows int64 at sequence ", i);
    total += seq_work[i];
  }
  std::vector<std::size_t> order(lengths.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return seq_work[a] > seq_work[b]; });

  const std::int64_t target = (total + s.ranks - 1) / s.ranks;
  for (std::size_t i : order) {
    std::span<context_block> seq(p.blocks.data() + first[i], first[i + 1] - first[i]);
    place_sequence(seq, seq_work[i], target, p.work, rule);
  }
  add_block_exchange(p, first, 2 * s.kv_dim * s.element_bytes);
  return p;
}

/// Whether placement a beats b (step 5): less max work (by `step` or more), then fewer bytes
/// into the busiest receiver, then fewer bytes in all.
inline bool better_placement(const context_placement& a, const context_placement& b,
                             std::int64_t step) {
  const std::int64_t wa = a.max_work(), wb = b.max_work();
  if (wa <= wb - step || wb <= wa - step) return wa < wb;
  if (a.max_received_bytes() != b.max_received_bytes())
    return a.max_received_bytes() < b.max_received_bytes();
  return a.total_bytes() < b.total_bytes();
}

}  // namespace detail

/// FCP's placement of the blocks of a batch (the header's algorithm): short sequences whole on
/// one rank, long ones cut into contiguous chunks filling the ranks to ceil(W / P); every
/// rank's work, and the key/value bytes between every pair of ranks.
inline context_placement fcp_placement(std::span<const std::int64_t> lengths,
                                       const context_settings& s) {
  detail::check_context_input(lengths, s, true);
  context_placement least = detail::pack_blocks(lengths, s, detail::chunk_rule::least_loaded);
  context_placement fit = detail::pack_blocks(lengths, s, detail::chunk_rule::best_fit);
  const bool fit_wins = detail::better_placement(fit, least, causal_work(0, s.block_tokens));
  return fit_wins ? fit : least;
}

/// Ring context parallelism without load balancing (the header's baseline): every sequence
/// cut evenly into P contiguous chunks, chunk c on rank c; every rank's work, and the bytes a
/// ring moves: rank r receives from rank r - 1 every chunk but its own. block_tokens unused.
inline context_placement ring_placement(std::span<const std::int64_t> lengths,
                                        const context_settings& s) {
  detail::check_context_input(lengths, s, false);
  context_placement p = detail::empty_context_placement(s.ranks);
  const std::int64_t per_token = 2 * s.kv_dim * s.element_bytes;
  const auto n = static_cast<std::size_t>(s.ranks);
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    const std::int64_t len = lengths[i];
    for (int c = 0; c < s.ranks; ++c) {
      const std::int64_t a = c * len / s.ranks, b = (c + 1) * len / s.ranks;
      const auto cs = static_cast<std::size_t>(c);
      if (b > a) {
        p.blocks.push_back({static_cast<int>(i), c, a, b - a, causal_work(a, b - a), c});
        p.work[cs] += causal_work(a, b - a);
      }
      if (s.ranks > 1) p.kv_bytes[((cs + n - 1) % n) * n + cs] += (len - (b - a)) * per_token;
    }
  }
  return p;
}

}  // namespace fedshard
