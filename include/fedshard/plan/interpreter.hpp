#pragma once
/// The interpreter: runs a plan's ops on a mesh when their triggers fire.
///
/// fire(plan, point, bind) takes the ops of `plan` that run at trigger point `point`, in
/// plan order, asks `bind(op, operand)` for the buffer of each operand's role (a
/// buffer_view in the buffer's own dtype), checks every size against the op, and starts the
/// first op; each further op of the same firing (a chain) starts once the previous one
/// completed. An op whose dtype differs from its buffers' dtype runs through staging buffers
/// (cast before, cast back after). The returned ticket is waited for with wait(); progress()
/// moves chains on without blocking.
///
/// Order across ranks: every rank must issue the collectives of a communicator in the same
/// order. Firings happen at the same points of every rank's program, so their first ops are
/// issued in the same order; follow-up ops are issued in firing order (a chain with a
/// follow-up pending holds back the follow-ups of later chains), and before a firing issues
/// its first op on an axis, every earlier chain's pending ops on that axis are issued first.
///
/// Every call goes through a wire_tap per axis, so traffic() counts what moved.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/comm/request.hpp"
#include "fedshard/core/buffer.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/error.hpp"
#include "fedshard/kernels/cast.hpp"
#include "fedshard/mesh/mesh.hpp"
#include "fedshard/plan/comm_op.hpp"
#include "fedshard/plan/start_op.hpp"
#include "fedshard/plan/traffic.hpp"
#include "fedshard/plan/wire_tap.hpp"

namespace fedshard {

/// A firing of the interpreter, to wait for. A default ticket is complete.
struct ticket {
  std::uint64_t id = 0;
  friend bool operator==(const ticket&, const ticket&) = default;
};

/// Runs plans on the communicators of a mesh over Communicator C; see the file comment.
template <Communicator C>
class interpreter {
 public:
  /// Taps every axis communicator of m (m outlives the interpreter).
  explicit interpreter(mesh<C>& m) : mesh_(&m) {
    for (axis a : all_axes) taps_[index(a)].emplace(m.comm(a), a, log_);
  }
  interpreter(const interpreter&) = delete;
  interpreter& operator=(const interpreter&) = delete;

  /// Starts the ops of p that run at point t (see the file comment); bind(op, operand)
  /// returns the buffer of an operand's role. The buffers must stay valid until the ticket
  /// completes.
  template <class Bind>
  ticket fire(const plan& p, const trigger_point& t, Bind&& bind) {
    chain c;
    for (const comm_op& op : p.ops)
      if (t.matches(op)) c.ops.push_back(prepare(op, bind));
    return launch(std::move(c));
  }

  /// Runs one op to completion; bind as for fire().
  template <class Bind>
  void run(const comm_op& op, Bind&& bind) {
    chain c;
    c.ops.push_back(prepare(op, bind));
    wait(launch(std::move(c)));
  }

  /// Blocks until the firing t completed (rethrows what its collectives threw).
  void wait(ticket t) {
    while (!done(t)) {
      progress();
      if (done(t)) return;
      chain& c = at(t);
      chain* blocker = &c;
      if (c.has_follow_up())
        for (auto& e : chains_) {
          if (&e == &c) break;
          if (!e.finished() && e.has_follow_up()) {
            blocker = &e;
            break;
          }
        }
      step(*blocker, /*block=*/true);
    }
  }

  /// True once the firing t completed.
  bool done(ticket t) const {
    if (t.id < first_id_) return true;
    const auto i = static_cast<std::size_t>(t.id - first_id_);
    return i >= chains_.size() || chains_[i].finished();
  }

  /// Moves every chain on as far as it goes without blocking (see the file comment).
  void progress() {
    bool fifo_open = true;
    for (auto& c : chains_) {
      if (c.finished()) continue;
      if (!c.has_follow_up()) {
        step(c, false);
        continue;
      }
      if (!fifo_open) continue;
      step(c, false);
      if (!c.finished() && c.has_follow_up()) fifo_open = false;
    }
    while (!chains_.empty() && chains_.front().finished()) {
      chains_.pop_front();
      ++first_id_;
    }
  }

  /// Blocks until every firing completed.
  void wait_all() {
    while (!chains_.empty()) {
      wait(ticket{first_id_});
      progress();
    }
  }

  /// What this rank's calls moved, per axis, as the wire taps recorded it.
  wire_log& wire() noexcept { return log_; }
  const wire_log& wire() const noexcept { return log_; }
  /// The per-axis totals of wire().
  traffic_counters& traffic() noexcept { return log_.traffic(); }
  /// The mesh the interpreter runs on.
  mesh<C>& topology() noexcept { return *mesh_; }
  const mesh<C>& topology() const noexcept { return *mesh_; }

 private:
  /// An op with its buffers bound.
  struct bound_op {
    comm_op op;
    buffer_view in;                 // the input in its own dtype (broadcast: none)
    buffer_view out;                // the output in its own dtype
    bool staged = false;            // a buffer's dtype differs from op.dtype: run through staging
    std::byte* stage_in = nullptr;  // the input in op.dtype (set when a staged op starts)
    std::byte* stage_out = nullptr;
    request req;
  };

  struct chain {
    std::vector<bound_op> ops;
    std::size_t next = 0;  // the op running (or, once finished, ops.size())
    bool finished() const { return next >= ops.size(); }
    bool has_follow_up() const { return next + 1 < ops.size(); }
  };

  static std::size_t index(axis a) { return static_cast<std::size_t>(a); }

  chain& at(ticket t) { return chains_[static_cast<std::size_t>(t.id - first_id_)]; }

  ticket launch(chain c) {
    if (c.ops.empty()) return {};
    settle(c.ops.front().op.axis);
    start(c.ops.front());
    chains_.push_back(std::move(c));
    const ticket t{first_id_ + chains_.size() - 1};
    progress();
    return t;
  }

  /// Issues every earlier chain's not yet started ops on axis a (blocking as needed).
  void settle(axis a) {
    for (;;) {
      chain* holder = nullptr;
      for (auto& c : chains_)
        for (std::size_t i = c.next + 1; i < c.ops.size() && !holder; ++i)
          if (c.ops[i].op.axis == a) holder = &c;
      if (!holder) return;
      chain* first = holder;
      for (auto& c : chains_) {
        if (&c == holder) break;
        if (!c.finished() && c.has_follow_up()) {
          first = &c;
          break;
        }
      }
      step(*first, true);
    }
  }

  /// Moves chain c on: completes its running op (blocking if asked) and starts the next.
  void step(chain& c, bool block) {
    while (!c.finished()) {
      bound_op& b = c.ops[c.next];
      if (!block && !b.req.test()) return;
      complete(b);
      ++c.next;
      if (c.finished()) return;
      start(c.ops[c.next]);
      block = false;
    }
  }

  template <class Bind>
  bound_op prepare(const comm_op& op, Bind& bind) {
    check(op);
    const int ranks = mesh_->axis_size(op.axis);
    FEDSHARD_EXPECTS(op.ranks == ranks, "interpreter: ", describe(op), " was planned for ",
                     op.ranks, " ranks but the mesh's ", to_string(op.axis), " axis has ", ranks);
    bound_op b;
    b.op = op;
    b.out = resolve(op, op.out, bind);
    if (op.kind != comm_kind::broadcast) b.in = resolve(op, op.in, bind);
    const auto n =
        static_cast<std::size_t>(op.bytes / static_cast<std::int64_t>(size_of(op.dtype)));
    const auto per = n / static_cast<std::size_t>(op.ranks);
    std::size_t want_in = n, want_out = n;
    if (op.kind == comm_kind::all_gather) want_in = per;
    if (op.kind == comm_kind::reduce_scatter) want_out = per;
    expect_size(op, "output", op.out, b.out.count, want_out);
    if (op.kind != comm_kind::broadcast) expect_size(op, "input", op.in, b.in.count, want_in);
    b.staged = b.out.type != op.dtype || (op.kind != comm_kind::broadcast && b.in.type != op.dtype);
    return b;
  }

  template <class Bind>
  buffer_view resolve(const comm_op& op, const operand& o, Bind& bind) {
    buffer_view v = bind(op, o);
    if (!o.piece) return v;
    const int n = mesh_->axis_size(*o.piece);
    const int k = mesh_->axis_rank(*o.piece);
    FEDSHARD_EXPECTS(v.count % static_cast<std::size_t>(n) == 0, "interpreter: ", describe(op),
                     ": the ", describe(o), " has ", v.count, " elements, which do not split into ",
                     n, " equal pieces");
    const std::size_t len = v.count / static_cast<std::size_t>(n);
    v.data = static_cast<std::byte*>(v.data) + len * static_cast<std::size_t>(k) * size_of(v.type);
    v.count = len;
    return v;
  }

  static void expect_size(const comm_op& op, const char* which, const operand& o, std::size_t have,
                          std::size_t want) {
    FEDSHARD_EXPECTS(have == want, "interpreter: ", describe(op), ": its ", which, " (",
                     describe(o), ") holds ", have, " elements, the op needs ", want);
  }

  /// Byte offset of `inner` inside `outer` (same dtype), or -1 when it does not lie inside.
  static std::ptrdiff_t offset_within(const buffer_view& inner, const buffer_view& outer) {
    if (inner.type != outer.type || inner.data == nullptr || outer.data == nullptr) return -1;
    const auto* i = static_cast<const std::byte*>(inner.data);
    const auto* o = static_cast<const std::byte*>(outer.data);
    if (i < o || i + inner.size_bytes() > o + outer.size_bytes()) return -1;
    return i - o;
  }

  /// A staging buffer of at least `bytes` for the buffer at `key`, kept for later steps.
  std::byte* staging(const void* key, std::size_t bytes) {
    auto& buf = staging_[key];
    if (buf.size() < bytes) buf = aligned_buffer<std::byte>(bytes);
    return buf.data();
  }

  /// Points the op at staging buffers in op.dtype (an input that lies inside the output, or
  /// the other way round, keeps its place there) and casts the input (a broadcast's buffer)
  /// into them. Done when the op starts: the previous op of its chain has completed, so a
  /// staging buffer it shares is free.
  void stage(bound_op& b) {
    const comm_op& op = b.op;
    const std::size_t esz = size_of(op.dtype);
    if (op.kind == comm_kind::broadcast) {
      b.stage_out = staging(b.out.data, b.out.count * esz);
      kernels::cast(const_buffer_view(b.out), buffer_view{b.stage_out, b.out.count, op.dtype});
      return;
    }
    const std::ptrdiff_t in_at = offset_within(b.in, b.out);
    const std::ptrdiff_t out_at = in_at < 0 ? offset_within(b.out, b.in) : -1;
    if (in_at >= 0) {
      b.stage_out = staging(b.out.data, b.out.count * esz);
      b.stage_in = b.stage_out + static_cast<std::size_t>(in_at) / size_of(b.out.type) * esz;
    } else if (out_at >= 0) {
      b.stage_in = staging(b.in.data, b.in.count * esz);
      b.stage_out = b.stage_in + static_cast<std::size_t>(out_at) / size_of(b.in.type) * esz;
    } else {
      b.stage_out = staging(b.out.data, b.out.count * esz);
      b.stage_in = staging(b.in.data, b.in.count * esz);
    }
    kernels::cast(const_buffer_view(b.in), buffer_view{b.stage_in, b.in.count, op.dtype});
  }

  void start(bound_op& b) {
    const comm_op& op = b.op;
    wire_tap<C>& c = *taps_[index(op.axis)];
    const void* in = b.in.data;
    void* out = b.out.data;
    if (b.staged) {
      stage(b);
      in = b.stage_in;
      out = b.stage_out;
    }
    b.req = start_op(c, op, in, out);
  }

  void complete(bound_op& b) {
    b.req.wait();
    if (b.staged) kernels::cast(const_buffer_view{b.stage_out, b.out.count, b.op.dtype}, b.out);
  }

  mesh<C>* mesh_;
  wire_log log_;
  std::optional<wire_tap<C>> taps_[5];
  std::deque<chain> chains_;
  std::uint64_t first_id_ = 1;  // the id of chains_.front(); ticket 0 is always complete
  std::map<const void*, aligned_buffer<std::byte>> staging_;
};

}  // namespace fedshard
