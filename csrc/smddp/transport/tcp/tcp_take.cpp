// TcpMesh::take: a point-to-point receive over the mesh, from the stash of messages that
// arrived before it was posted or straight from its sender's socket.
#include <poll.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include "smddp/transport/tcp/tcp.h"
#include "smddp/transport/tcp/tcp_frames.h"

namespace smddp {

// Note [Direct receives over TCP]
// A receive that waits side by side is attempted without blocking, between other work
// (Note [Receives wait side by side] in receive_poller.cpp). Had it stashed its message and copied
// it out at the end, with a pause after every attempt that did not complete it, a 16 MiB
// ping-pong over TCP took 35-59 ms where a blocking receive took 10 ms. So a receive from
// one peer claims the first message with its tag that the connection brings (a later
// receive for the same peer and tag is not attempted before it: posting order), and its
// body is read straight into the receive's buffer, by this or any later read of the
// connection (a collective's exchange() continues a frame it finds begun). Once the
// message has begun, its sender is in the middle of writing it, so take() waits for the
// rest (holding exec_mu_, as a blocking receive held its lane), in slices of at most
// kDirectSliceMs without data, after which the caller checks its deadline and peers. The
// buffer must outlive the message, also when the receive ends without it (an error, or
// cancellation at shutdown, while queued collectives may still read the connection): the
// message's stash entry holds the buffer's owner until it is taken or the mesh is
// destroyed. A receive from any rank cannot claim that way (it could complete from
// another peer meanwhile), so it stashes.
bool TcpMesh::take(int peer, uint64_t tag, char* data, size_t len, const OpCtx& ctx,
                   const std::shared_ptr<void>& data_owner) {
  const bool direct = data_owner != nullptr;
  int fd = in_fd(peer);
  if (fd < 0) return false;
  Conn& c = *conns_[peer];
  rethrow_if_failed(c);
  auto find = [&]() -> int {
    size_t complete = c.stash.size() - (stash_in_flight(c) ? 1 : 0);
    for (size_t k = 0; k < complete; ++k) {
      if (c.stash[k].hdr.tag == tag) return static_cast<int>(k);
    }
    return -1;
  };
  auto check_length = [&](const Header& h) {
    if (h.len != len) {
      fail_peer(peer,
                "sent " + std::to_string(h.len) + " bytes with tag " + std::to_string(tag) +
                    " where this rank expects " + std::to_string(len) +
                    " (send and recv must use tensors of the same size and dtype)",
                ctx);
    }
  };
  // Reads until a message with the tag is complete or the socket has nothing more. The
  // first message with the tag is the one this receive gets (none with it is stashed yet,
  // or find() would have returned it): its length is checked before a byte is stored. A
  // message still arriving is this receive's only if it has the tag; one with another tag
  // (a later receive's, or nobody's yet) leaves the next header with the tag to be claimed.
  bool claimed = find() >= 0 || (stash_in_flight(c) && c.stash.back().hdr.tag == tag);
  struct Stashing {
    const decltype(find)& found;
    const decltype(check_length)& check;
    uint64_t tag;
    bool& claimed;
    char* direct;
    const std::shared_ptr<void>& data_owner;
    const char* claim_id;
    bool wants() { return found() < 0; }
    const std::shared_ptr<void>& owner() const { return data_owner; }
    const char* claimer() const { return claim_id; }
    char* target(const Header& h, int& op) {
      op = -1;
      if (h.tag == tag && !claimed) {
        check(h);
        claimed = true;
        op = direct ? kDirect : kAwaited;
        return direct;
      }
      return nullptr;
    }
    void delivered(int) {}
    void stashed() {}
  } route{find, check_length, tag, claimed, direct ? data : nullptr, data_owner, data};
  read_frames(peer, fd, route, ctx);
  while (direct && c.target_op == kDirect && c.body == data) {  // our message is arriving
    if (aborted_.load() || ctx.deadline.expired()) break;
    pollfd pfd{fd, POLLIN, 0};
    counts_.polls.fetch_add(1, std::memory_order_relaxed);
    if (::poll(&pfd, 1, std::min(kDirectSliceMs, ctx.deadline.remaining_ms() + 1)) <= 0) break;
    read_frames(peer, fd, route, ctx);
  }
  int k = find();
  if (k < 0) return false;
  const Stashed& m = c.stash[static_cast<size_t>(k)];
  check_length(m.hdr);
  // A direct entry whose receive ended without it stays (its owner with it); no later
  // receive may get it, and none asks: that receive's end broke the group or shut it down.
  if (m.direct_to && m.direct_to != data) {
    throw CommError(
        "smddp: internal error: a message over TCP was read into the buffer of "
        "another receive");
  }
  if (len && !m.direct_to) std::memcpy(data, m.data.data(), len);
  c.stash_bytes -= stash_cost(m);
  c.stash.erase(c.stash.begin() + k);
  return true;
}

// Note [Claims of a receive from any rank]
// A receive from any rank attempts take() on each peer in turn, with the same buffer. A
// message with its tag that one peer's take() finds arriving is claimed for it (stashed as
// awaited, outside the budget for messages nobody waits for, so a large receive is not
// refused for its own message), and the receive may then complete from another peer. The
// message it claimed is then awaited by nobody; left marked, it stayed outside the budget
// until some later receive took it, and each such receive could leave one per peer. So
// the receive, once complete, releases its claims: each message still marked with its
// buffer counts against the budget from then on, as a message that arrived before its
// receive does (an over-budget total then refuses the next such message, not this one).
// A later receive for it takes it as any stashed message.
void TcpMesh::release_claims(const char* data) {
  for (int peer = 0; peer < size_; ++peer) {
    if (!conns_[peer]) continue;
    Conn& c = *conns_[peer];
    for (Stashed& m : c.stash) {
      if (!m.awaited || m.direct_to || m.claimed_by != data) continue;
      m.awaited = false;
      m.claimed_by = nullptr;
      c.stash_bytes += stash_cost(m);
    }
  }
}

}  // namespace smddp
