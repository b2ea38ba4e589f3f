#pragma once
/// Test support: compare a plan's ops with an op list written out by hand, and say which op
/// differs and how, so a failure reads as "op 1: got ..., want ..."; write a sync plan's op
/// on a line.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "fedshard/plan/comm_op.hpp"

namespace fedshard::test {

/// describe(op) plus the fields it leaves out (root, overlappable, members).
inline std::string describe_fully(const comm_op& op) {
  std::ostringstream s;
  s << describe(op) << " [root " << op.root << ", overlappable " << op.overlappable << ", members "
    << op.members << ']';
  return s.str();
}

/// Empty when `got` is exactly `want`, op by op; else every op that differs, and the counts.
inline std::string compare_ops(const std::vector<comm_op>& got, const std::vector<comm_op>& want) {
  std::ostringstream s;
  if (got.size() != want.size()) s << "\n  got " << got.size() << " ops, want " << want.size();
  for (std::size_t i = 0; i < got.size() || i < want.size(); ++i) {
    if (i < got.size() && i < want.size() && got[i] == want[i]) continue;
    s << "\n  op " << i << ":\n    got  "
      << (i < got.size() ? describe_fully(got[i]) : std::string("(none)")) << "\n    want "
      << (i < want.size() ? describe_fully(want[i]) : std::string("(none)"));
  }
  return s.str();
}

/// An op of a federation sync plan (phase sync, not overlappable), its fields given in
/// comm_op's order: what it does, on which axis, in which dtype, its bytes (nccl-tests S),
/// its ranks, the reduction (none for a gather or broadcast: root 0), the sync trigger that
/// starts it, the fragment, and the buffers it reads and writes.
inline comm_op sync_op(comm_kind kind, axis on, dtype type, std::int64_t bytes, int ranks,
                       std::optional<reduce_op> reduce, trigger when, int fragment, operand in,
                       operand out) {
  return {.kind = kind,
          .axis = on,
          .dtype = type,
          .bytes = bytes,
          .ranks = ranks,
          .reduce = reduce,
          .trigger = when,
          .phase = phase::sync,
          .fragment = fragment,
          .in = in,
          .out = out,
          .overlappable = false};
}

}  // namespace fedshard::test
