// TcpMesh::read_frames: reading the frames of one connection, for the exchange and for
// take() (tcp_exchange.cpp, tcp_take.cpp); templates on where each frame goes.
#pragma once

#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "smddp/transport/tcp/tcp.h"

namespace smddp {
namespace tcp_frames {

inline constexpr const char* kClosed =
    "closed its connection (its process exited, or it left the group after an error)";

}  // namespace tcp_frames

// Reads the frames available on `peer`'s connection while `route.wants()`, one at a time,
// and returns when the socket has nothing more. A frame goes where `route.target` says (an
// operation's buffer, after it checked the header), to a waiting receive's buffer, which
// `route.owner()` keeps alive (Note [Direct receives over TCP]), or to the stash (Note [TCP
// trust model]), awaited by the receive `route.claimer()` names or by nobody yet; failure
// notices end the wait with the peer's reason. A frame may span
// calls: its state lives in the connection.
template <class Route>
void TcpMesh::read_frames(int peer, int fd, Route& route, const OpCtx& ctx) {
  Conn& c = *conns_[peer];
  rethrow_if_failed(c);
  try {
    read_frames_of(c, peer, fd, route, ctx);
  } catch (...) {
    c.failure = std::current_exception();
    throw;
  }
}

template <class Route>
void TcpMesh::read_frames_of(Conn& c, int peer, int fd, Route& route, const OpCtx& ctx) {
  auto read_some = [&](char* dst, size_t n) -> bool {
    ssize_t r = ::recv(fd, dst, n, 0);
    counts_.recv_calls.fetch_add(1, std::memory_order_relaxed);
    if (r == 0) fail_peer(peer, tcp_frames::kClosed, ctx);
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return false;
      fail_peer(peer, std::string("connection error: ") + std::strerror(errno), ctx);
    }
    (c.hdr_got < sizeof(c.hdr) ? c.hdr_got : c.body_got) += static_cast<size_t>(r);
    return true;
  };
  while (route.wants()) {
    if (c.hdr_got < sizeof(c.hdr)) {
      if (!read_some(reinterpret_cast<char*>(&c.hdr) + c.hdr_got, sizeof(c.hdr) - c.hdr_got))
        return;
      if (c.hdr_got < sizeof(c.hdr)) continue;
      c.body_got = 0;
      c.target_op = -1;
      c.body = nullptr;
      if (c.hdr.tag == kFailureTag) {  // Note [Failure notices]
        c.target_op = kNotice;
        c.notice.assign(std::min<uint64_t>(c.hdr.len, kMaxNotice), 0);
        c.hdr.len = c.notice.size();
        c.body = c.notice.data();
      } else {
        c.body = route.target(c.hdr, c.target_op);
      }
      const bool claimed = c.target_op == kAwaited;
      const bool awaited = claimed || c.target_op == kDirect;
      if (claimed) c.target_op = -1;
      if (c.target_op == -1 || c.target_op == kDirect) {
        // Note [TCP trust model]: a message nobody waits for yet is kept within a budget,
        // and its buffer grows only as its bytes arrive.
        const size_t room = stash_budget_ - std::min(stash_budget_, c.stash_bytes);
        if (!awaited && (c.hdr.len > room || room - c.hdr.len < kStashEntryBytes)) {
          fail_peer(peer,
                    "sent a message of " + std::to_string(c.hdr.len) + " bytes (tag " +
                        std::to_string(c.hdr.tag) +
                        ") that no receive here expects yet, while earlier such messages "
                        "waiting here count " +
                        std::to_string(c.stash_bytes) + " bytes; a connection holds at most " +
                        std::to_string(stash_budget_) +
                        " bytes for receives not yet posted, counting each message's length "
                        "and " +
                        std::to_string(kStashEntryBytes) +
                        " bytes for its keeping (post the receives in the order of the sends)",
                    ctx);
        }
        c.stash.push_back(
            {c.hdr, {}, awaited, nullptr, nullptr, claimed ? route.claimer() : nullptr});
        c.stash_bytes += stash_cost(c.stash.back());
        if (c.target_op == kDirect) {
          c.stash.back().direct_to = c.body;
          c.stash.back().direct_owner = route.owner();
        }
      }
    }
    if (c.body_got < c.hdr.len) {
      char* dst = nullptr;
      size_t room = c.hdr.len - c.body_got;
      if (c.target_op != -1) {
        dst = c.body + c.body_got;
      } else {
        std::vector<char>& data = c.stash.back().data;
        if (data.size() == c.body_got) {
          data.resize(std::min<size_t>(c.hdr.len, std::max<size_t>(2 * data.size(), 64 << 10)));
        }
        dst = data.data() + c.body_got;
        room = data.size() - c.body_got;
      }
      const size_t before = c.body_got;
      if (!read_some(dst, room)) return;
      counts_.bytes_received.fetch_add(c.body_got - before, std::memory_order_relaxed);
      if (c.target_op == -1) {
        counts_.stashed_bytes.fetch_add(c.body_got - before, std::memory_order_relaxed);
      }
      if (c.body_got < c.hdr.len) continue;
    }
    // Frame complete.
    counts_.received.fetch_add(1, std::memory_order_relaxed);
    c.hdr_got = 0;
    const int op = c.target_op;
    c.target_op = -1;
    if (op == kNotice) {
      fail_peer(
          peer,
          "left the group after its own error: " + std::string(c.notice.begin(), c.notice.end()),
          ctx);
    }
    if (op >= 0) {
      route.delivered(op);
    } else {
      route.stashed();
    }
  }
}

}  // namespace smddp
