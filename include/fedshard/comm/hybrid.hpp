#pragma once
/// hybrid<C, F>: a world whose groups talk over one communicator type and whose federation
/// axis talks over another, e.g. inproc or mpi inside each group (one job per group) and gloo
/// between the groups (comm/gloo.hpp).
///
/// A hybrid is a Communicator, so a mesh, the interpreter and the trainer run on it as on any
/// other (mesh<hybrid<C, F>>). Each hybrid is one of:
///  - a group-side communicator: a C (the job's world or a split of it);
///  - a federation-side communicator: an F;
///  - the world: built by each rank from its job's world `group_world` (a C of the group's
///    R*S ranks, rank l = r*S + s) and its federation link `link` (an F of the G ranks with
///    local rank l in every group, rank g). Its rank is g*R*S + l, as in a mesh's world.
///
/// The world's collectives are made of the group's and the link's: an all_gather gathers
/// inside the group, then the groups' blocks over the link, so every rank holds every
/// world rank's input in world-rank order; all_reduce and reduce_scatter reduce that in rank
/// order (comm/detail/reduction.hpp), bit-identical to one inproc world of G*R*S ranks (meant
/// for the world's small collectives: the trainer's means and checkpoint agreement; it moves
/// G*R*S inputs to every rank: algorithm_of says gather_all). broadcast goes through the
/// root's group, then every link (what a ring moves: the root's group gets it once, every
/// other group once per local rank).
///
/// Bytes moved (moved()): each side's communicator's; the world's are its group's and its
/// link's together, both levels of its collectives.
/// send and recv reach ranks of the same group (over C) or the same local rank (over F).
/// With a link whose groups come and go (elastic::link), the world's reductions combine
/// the groups the link includes at the time (the group alone outside its rounds).
///
/// A mesh over a hybrid world makes its axes with group_split (the group, shard and replica
/// axes: splits of the group's communicator by color and key) and federation_link (the
/// federation axis), no exchange across groups (so it works before a link's groups have met);
/// the hybrid knows colors and keys, the mesh maps its axes to them (mesh/mesh.hpp).
/// split on the world (other uses): the ranks exchange (color, key) over the world; a color whose
/// ranks all lie in one group becomes a split of the group's C, a color made of local rank l of
/// every group (ordered by group) is the link itself (shared); any other color is refused on
/// every rank (invalid_argument naming it). A mesh's four splits are of these kinds.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fedshard/comm/communicator.hpp"
#include "fedshard/comm/detail/reduction.hpp"
#include "fedshard/comm/request.hpp"
#include "fedshard/core/dtype.hpp"
#include "fedshard/error.hpp"
#include "fedshard/space/space_of.hpp"

namespace fedshard {

/// See the file comment.
template <Communicator C, Communicator F>
class hybrid {
  static_assert(std::is_same_v<space::space_of_t<C>, space::space_of_t<F>>,
                "fedshard::hybrid: both communicators must use the same memory space");

 public:
  using memory_space = space::space_of_t<C>;
  using group_comm = C;
  using federation_comm = F;
  /// Which side a hybrid is.
  enum class side : std::uint8_t { group, federation, world };

  /// The world of rank (g, l): `group_world` is the job's world (R*S ranks, rank l) and
  /// `link` its federation link (G ranks, rank g = the group). Not collective.
  hybrid(C group_world, F link)
      : side_(side::world),
        group_(std::make_shared<C>(std::move(group_world))),
        link_(std::make_shared<F>(std::move(link))) {}
  /// A group-side communicator.
  explicit hybrid(C c) : side_(side::group), group_(std::make_shared<C>(std::move(c))) {}

  side which() const noexcept { return side_; }
  /// The group-side communicator (the job's world on the world side).
  C& group_side() { return *group_; }
  /// The federation-side communicator (the link on the world side).
  F& federation_side() { return *link_; }

  /// On the federation side of a link whose groups come and go (elastic::link): which groups
  /// its collectives combine now (a mask over the groups); empty otherwise (all of them).
  std::vector<std::uint8_t> included() const {
    if constexpr (comm_capabilities<F>::included) {
      if (side_ == side::federation) return link_->included();
    }
    return {};
  }

  /// Capability 12: passed on to the side's communicator (the world's: both) where it has it.
  void vouch(std::uint64_t fingerprint, bool first) {
    if constexpr (comm_capabilities<C>::vouch) {
      if (side_ != side::federation && group_) group_->vouch(fingerprint, first);
    }
    if constexpr (comm_capabilities<F>::vouch) {
      if (side_ != side::group && link_) link_->vouch(fingerprint, first);
    }
  }

  /// Bytes moved: the side's communicator's; the world's group and link together.
  moved_bytes moved() const {
    switch (side_) {
      case side::group: return group_->moved();
      case side::federation: return link_->moved();
      case side::world: break;
    }
    return group_->moved() + link_->moved();
  }
  /// The side's communicator's algorithm; the world's reductions gather every input.
  wire_algorithm algorithm_of(collective k, std::int64_t n, dtype t) const {
    switch (side_) {
      case side::group: return group_->algorithm_of(k, n, t);
      case side::federation: return link_->algorithm_of(k, n, t);
      case side::world: break;
    }
    const bool reduces = k == collective::all_reduce || k == collective::reduce_scatter;
    return reduces && size() > 1 ? wire_algorithm::gather_all : wire_algorithm::ring;
  }

  int rank() const {
    switch (side_) {
      case side::group: return group_->rank();
      case side::federation: return link_->rank();
      case side::world: break;
    }
    return link_->rank() * group_->size() + group_->rank();
  }
  int size() const {
    switch (side_) {
      case side::group: return group_->size();
      case side::federation: return link_->size();
      case side::world: break;
    }
    return link_->size() * group_->size();
  }

  void all_reduce(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    if (side_ == side::group) return group_->all_reduce(in, out, n, t, op);
    if (side_ == side::federation) return link_->all_reduce(in, out, n, t, op);
    expect_count("all_reduce", n, t);
    if (n == 0) return;
    const auto bytes = static_cast<std::size_t>(n) * size_of(t);
    std::vector<std::byte> all(bytes * static_cast<std::size_t>(size()));
    gather_world(in, all.data(), n, t);
    const int used = keep_included(all, bytes * static_cast<std::size_t>(group_->size()));
    detail::reduce_blocks(t, op, all.data(), bytes, used * group_->size(), out, n);
  }
  void all_gather(const void* in, void* out, std::int64_t n, dtype t) {
    if (side_ == side::group) return group_->all_gather(in, out, n, t);
    if (side_ == side::federation) return link_->all_gather(in, out, n, t);
    expect_count("all_gather", n, t);
    if (n == 0) return;
    const auto bytes = static_cast<std::size_t>(n) * size_of(t);
    std::vector<std::byte> mine(static_cast<const std::byte*>(in),
                                static_cast<const std::byte*>(in) + bytes);
    gather_world(mine.data(), out, n, t);
  }
  void reduce_scatter(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    if (side_ == side::group) return group_->reduce_scatter(in, out, n, t, op);
    if (side_ == side::federation) return link_->reduce_scatter(in, out, n, t, op);
    expect_count("reduce_scatter", n, t);
    if (n == 0) return;
    const auto bytes = static_cast<std::size_t>(n) * size_of(t);
    const auto W = static_cast<std::size_t>(size());
    std::vector<std::byte> mine(static_cast<const std::byte*>(in),
                                static_cast<const std::byte*>(in) + bytes * W);
    std::vector<std::byte> all(bytes * W * W);
    gather_world(mine.data(), all.data(), n * size(), t);
    const int used = keep_included(all, bytes * W * static_cast<std::size_t>(group_->size()));
    // Block rank() of every (combined) rank's input, in rank order.
    detail::reduce_blocks(t, op, all.data() + bytes * static_cast<std::size_t>(rank()), bytes * W,
                          used * group_->size(), out, n);
  }
  void broadcast(void* buf, std::int64_t n, dtype t, int root) {
    if (side_ == side::group) return group_->broadcast(buf, n, t, root);
    if (side_ == side::federation) return link_->broadcast(buf, n, t, root);
    FEDSHARD_EXPECTS(root >= 0 && root < size(), "hybrid: broadcast root must be in [0, ", size(),
                     "), found ", root);
    const int rs = group_->size();
    if (link_->rank() == root / rs)
      group_->broadcast(buf, n, t, root % rs);  // the root's group has its value everywhere
    link_->broadcast(buf, n, t, root / rs);     // every link carries it to the other groups
  }
  void barrier() {
    if (side_ == side::group) return group_->barrier();
    if (side_ == side::federation) return link_->barrier();
    group_->barrier();
    link_->barrier();
    group_->barrier();
  }
  void send(const void* in, std::int64_t n, dtype t, int peer, int tag = 0) {
    if (side_ == side::group) return group_->send(in, n, t, peer, tag);
    if (side_ == side::federation) return link_->send(in, n, t, peer, tag);
    route(peer, [&](auto& c, int p) { c.send(in, n, t, p, tag); });
  }
  void recv(void* out, std::int64_t n, dtype t, int peer, int tag = 0) {
    if (side_ == side::group) return group_->recv(out, n, t, peer, tag);
    if (side_ == side::federation) return link_->recv(out, n, t, peer, tag);
    route(peer, [&](auto& c, int p) { c.recv(out, n, t, p, tag); });
  }

  request all_reduce_async(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    if (side_ == side::group) return group_->all_reduce_async(in, out, n, t, op);
    if (side_ == side::federation) return link_->all_reduce_async(in, out, n, t, op);
    all_reduce(in, out, n, t, op);
    return {};
  }
  request all_gather_async(const void* in, void* out, std::int64_t n, dtype t) {
    if (side_ == side::group) return group_->all_gather_async(in, out, n, t);
    if (side_ == side::federation) return link_->all_gather_async(in, out, n, t);
    all_gather(in, out, n, t);
    return {};
  }
  request reduce_scatter_async(const void* in, void* out, std::int64_t n, dtype t, reduce_op op) {
    if (side_ == side::group) return group_->reduce_scatter_async(in, out, n, t, op);
    if (side_ == side::federation) return link_->reduce_scatter_async(in, out, n, t, op);
    reduce_scatter(in, out, n, t, op);
    return {};
  }
  request broadcast_async(void* buf, std::int64_t n, dtype t, int root) {
    if (side_ == side::group) return group_->broadcast_async(buf, n, t, root);
    if (side_ == side::federation) return link_->broadcast_async(buf, n, t, root);
    broadcast(buf, n, t, root);
    return {};
  }
  request send_async(const void* in, std::int64_t n, dtype t, int peer, int tag = 0) {
    if (side_ == side::group) return group_->send_async(in, n, t, peer, tag);
    if (side_ == side::federation) return link_->send_async(in, n, t, peer, tag);
    request r;
    route(peer, [&](auto& c, int p) { r = c.send_async(in, n, t, p, tag); });
    return r;
  }
  request recv_async(void* out, std::int64_t n, dtype t, int peer, int tag = 0) {
    if (side_ == side::group) return group_->recv_async(out, n, t, peer, tag);
    if (side_ == side::federation) return link_->recv_async(out, n, t, peer, tag);
    request r;
    route(peer, [&](auto& c, int p) { r = c.recv_async(out, n, t, p, tag); });
    return r;
  }

  /// A split of the world's group communicator by color and key, collective over the group
  /// only (a mesh's group, shard and replica axes); on another side, split(color, key).
  hybrid group_split(int color, int key) {
    if (side_ != side::world) return split(color, key);
    return hybrid(group_->split(color, key));
  }
  /// The federation side over the world's link (shared, not collective): a mesh's federation
  /// axis. invalid_argument on another side.
  hybrid federation_link() {
    FEDSHARD_EXPECTS(side_ == side::world,
                     "hybrid::federation_link: only the world has a link; this is its ",
                     side_ == side::group ? "group" : "federation", " side");
    return hybrid(federation_tag{}, link_);
  }

  /// See the file comment.
  hybrid split(int color, int key) {
    if (side_ == side::group) return hybrid(group_->split(color, key));
    if (side_ == side::federation) return hybrid(federation_tag{}, link_->split(color, key));
    const int W = size(), rs = group_->size(), me = rank();
    const std::int64_t mine[2] = {color, key};
    std::vector<std::int64_t> all(2 * static_cast<std::size_t>(W));
    all_gather(mine, all.data(), 2, dtype::f64);  // 8-byte words, moved as they are
    auto color_of = [&](int p) { return all[2 * static_cast<std::size_t>(p)]; };
    auto key_of = [&](int p) { return all[2 * static_cast<std::size_t>(p) + 1]; };
    // Judge every color the same way on every rank, so all throw or none.
    enum class kind { in_group, link, bad };
    auto judge = [&](std::int64_t c) {
      std::vector<int> members;
      for (int p = 0; p < W; ++p)
        if (color_of(p) == c) members.push_back(p);
      const int g0 = members.front() / rs;
      if (std::all_of(members.begin(), members.end(), [&](int p) { return p / rs == g0; }))
        return kind::in_group;
      if (static_cast<int>(members.size()) != W / rs) return kind::bad;
      std::vector<int> sorted = members;
      std::stable_sort(sorted.begin(), sorted.end(),
                       [&](int a, int b) { return key_of(a) < key_of(b); });
      for (int g = 0; g < W / rs; ++g)
        if (sorted[static_cast<std::size_t>(g)] != g * rs + members.front() % rs) return kind::bad;
      return kind::link;
    };
    for (int p = 0; p < W; ++p) {
      FEDSHARD_EXPECTS(color_of(p) >= 0, "hybrid::split: color must be >= 0, found ", color_of(p),
                       " on world rank ", p);
      FEDSHARD_EXPECTS(judge(color_of(p)) != kind::bad, "hybrid::split: color ", color_of(p),
                       " (world rank ", p,
                       ") mixes ranks of several groups in a way that is neither one group's "
                       "ranks nor one local rank of every group ordered by group; a hybrid world "
                       "splits only into those");
    }
    // Every rank of the group takes part in the group's split, whatever its color's kind.
    const int local_color = judge(color) == kind::in_group ? color : 0;
    const int local_key = judge(color) == kind::in_group ? key : rank();
    // Colors of the link kind must not share a local split with in-group colors: give them a
    // color of their own that no in-group color uses.
    std::int64_t spare = 0;
    for (int p = 0; p < W; ++p) spare = std::max(spare, color_of(p) + 1);
    const int group_color = judge(color) == kind::in_group
                                ? local_color
                                : static_cast<int>(spare + me % rs);  // alone in its group
    C part = group_->split(group_color, local_key);
    if (judge(color) == kind::in_group) return hybrid(std::move(part));
    hybrid h(federation_tag{}, link_);
    return h;
  }

 private:
  struct federation_tag {};
  hybrid(federation_tag, F link)
      : side_(side::federation), link_(std::make_shared<F>(std::move(link))) {}
  hybrid(federation_tag, std::shared_ptr<F> link)
      : side_(side::federation), link_(std::move(link)) {}

  static void expect_count(const char* what, std::int64_t n, dtype t) {
    FEDSHARD_EXPECTS(n >= 0, "hybrid: ", what, ": count must be >= 0, found ", n);
    FEDSHARD_EXPECTS(is_valid(t), "hybrid: ", what, ": invalid dtype code ", static_cast<int>(t));
  }

  /// out (n * size() elements) = every world rank's in, in world-rank order: the group's
  /// inputs gathered into this group's block, then the blocks over the link.
  void gather_world(const void* in, void* out, std::int64_t n, dtype t) {
    const auto block =
        static_cast<std::size_t>(n) * size_of(t) * static_cast<std::size_t>(group_->size());
    auto* mine = static_cast<std::byte*>(out) + block * static_cast<std::size_t>(link_->rank());
    group_->all_gather(in, mine, n, t);
    link_->all_gather(mine, out, n * group_->size(), t);
  }

  /// A link whose groups come and go (elastic::link) combines only the groups it includes:
  /// moves their blocks (`block` bytes per group) to the front of `all`; returns how many.
  int keep_included(std::vector<std::byte>& all, std::size_t block) {
    if constexpr (comm_capabilities<F>::included) {
      const auto mask = link_->included();
      int used = 0;
      for (std::size_t g = 0; g < mask.size(); ++g) {
        if (mask[g] == 0) continue;
        if (static_cast<std::size_t>(used) != g)
          std::memmove(all.data() + block * static_cast<std::size_t>(used), all.data() + block * g,
                       block);
        ++used;
      }
      return used;
    } else {
      (void)all;
      (void)block;
      return link_->size();
    }
  }

  /// f(communicator, its rank of world peer) for a peer in this rank's group or link.
  template <class Fn>
  void route(int peer, Fn&& f) {
    const int rs = group_->size();
    FEDSHARD_EXPECTS(peer >= 0 && peer < size(), "hybrid: peer must be in [0, ", size(),
                     "), found ", peer);
    if (peer / rs == link_->rank()) return f(*group_, peer % rs);
    FEDSHARD_EXPECTS(peer % rs == group_->rank(), "hybrid: world rank ", rank(),
                     " can message only ranks of its group or its local rank ", group_->rank(),
                     " of another group, found peer ", peer);
    f(*link_, peer / rs);
  }

  side side_;
  std::shared_ptr<C> group_;
  std::shared_ptr<F> link_;
};

}  // namespace fedshard
