// TcpMesh::exchange: progresses a set of sends and receives over the mesh with poll(),
// so two ranks sending large messages to each other never deadlock on full socket buffers.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <utility>

#include "smddp/transport/tcp/tcp.h"
#include "smddp/transport/tcp/tcp_frames.h"

namespace smddp {
namespace {

// The longest a round sleeps while Exchange::background waits for other local ranks (which
// no socket reports): a local rank's step is about one network chunk apart (512 KiB: 2 ms at
// 2 Gbit/s), and a shorter sleep costs wake-ups that oversubscribed cores feel (a 50 us sleep
// lost 5% of a 1 MiB all_reduce on 2 hosts of 2 ranks; docs/log/multi_node.md, build 5ce19af).
constexpr int kBesideWaitMs = 1;

struct SendState {
  char hdr[sizeof(TcpMesh::Header)];
  size_t done = 0;  // bytes of header + payload written
  bool locked = false, finished = false;
};

}  // namespace

void TcpMesh::rethrow_if_failed(const Conn& c) {
  if (c.failure) std::rethrow_exception(c.failure);
}

bool TcpMesh::stash_in_flight(const Conn& c) {
  return c.hdr_got == sizeof(c.hdr) && (c.target_op == -1 || c.target_op == kDirect) &&
         c.body_got < c.hdr.len;
}

// Note [A failed exchange's frames]
// exchange() reads a message for one of its receives straight into that receive's buffer,
// and a frame may span reads: the connection remembers where its body goes (Conn::body,
// Conn::target_op). When exchange() leaves by an exception that no read of that connection
// raised (the deadline, an abort, health(), another peer's failure, the algorithm's
// callbacks), the frame is still arriving, and its destination is a buffer of a call that
// has ended: the caller may free it, and the next read of the connection (a receive that
// waits side by side, TcpMesh::take) would write the rest of the message there and report it
// delivered to a receive of another call. So such a connection fails for good: its
// remaining bytes cannot be skipped without reading them, and the group is broken anyway
// (the caller marks it so). Every later use of it raises this error (Conn::failure), which
// also covers a take() that runs before the group is marked broken.
//
// Note [Receive state belongs to the reader]
// A connection's receive state (Conn::hdr_got, body, target_op, stash, failure) has no lock:
// only the thread that reads sockets touches it (tcp.h), that is an exchange with receives
// (a collective, on the main lane) or a take() (a receive waiting side by side), both under
// the scheduler's exclusive lock (Note [Scheduler] in scheduler.h). A send (isend) runs its
// exchange on the send lane, outside that lock, while a collective may be reading the same
// connections. So the clean-up above is done only by an exchange with receives, and only
// on the connections it reads: a frame can be arriving for one of its receives only from a
// peer it receives from. Before, a send that failed (its deadline, a dead peer, an abort)
// walked every connection: it raced with the collective's reads of that state, and could
// mark unusable a connection whose message was arriving for the collective, failing it.
void TcpMesh::exchange(Exchange& x, const OpCtx& ctx) {
  try {
    exchange_rounds(x, ctx);
  } catch (...) {
    // Note [Receive state belongs to the reader]: a send-only exchange reads no connection.
    if (x.recvs.empty()) throw;
    std::string why = "an unknown error";
    try {
      throw;
    } catch (const std::exception& e) {
      why = e.what();
    } catch (...) {
    }
    std::vector<uint8_t> reads_from(static_cast<size_t>(size_), 0);
    for (const Op& r : x.recvs) reads_from[r.peer] = 1;
    for (int peer = 0; peer < size_; ++peer) {
      if (!reads_from[peer]) continue;
      Conn& c = *conns_[peer];
      // A frame whose body goes to one of this call's receives (target_op >= 0) is arriving.
      if (c.failure || c.hdr_got != sizeof(c.hdr) || c.target_op < 0) continue;
      c.failure = std::make_exception_ptr(CommError(
          "smddp: group '" + group_name_ + "': the connection from rank " + std::to_string(peer) +
          " is unusable: a message from it was arriving into the buffer of " + ctx.describe() +
          " when that call failed: " + why));
    }
    throw;
  }
}

void TcpMesh::exchange_rounds(Exchange& x, const OpCtx& ctx) {
  std::vector<Op>& sends = x.sends;
  const std::vector<Op>& recvs = x.recvs;
  const std::function<void()>& health = x.health;
  std::vector<SendState> ss;
  std::vector<uint8_t> rdone(recvs.size(), 0), rtargeted(recvs.size(), 0);
  size_t pending = recvs.size();
  // Receives not yet done, per peer, and the peers with any: one read pass and one poll
  // entry per peer and round, however many messages it sends (a pipelined exchange posts
  // hundreds per peer).
  std::vector<size_t> awaited(static_cast<size_t>(size_), 0);
  std::vector<int> from_peers;
  for (const Op& r : recvs) {
    if (awaited[r.peer]++ == 0) from_peers.push_back(r.peer);
  }
  // How many sends and receives each (peer, tag) has: a header says how many bytes its
  // sender expects back (Header::expect) only where the pair exchanges one message each.
  auto count_of = [](const std::vector<Op>& ops, int peer, uint64_t tag) {
    size_t n = 0;
    for (const Op& o : ops) n += o.peer == peer && o.tag == tag;
    return n;
  };
  std::map<std::pair<int, uint64_t>, std::pair<size_t, size_t>> recv_of;  // count, length
  for (const Op& r : recvs) {
    auto& e = recv_of[{r.peer, r.tag}];
    ++e.first;
    e.second = r.len;
  }
  // Gives the sends appended since the last call (by x.on_received) their headers.
  bool fresh_sends = false;  // adopted since the sends were last pumped
  auto adopt_sends = [&] {
    const size_t first = ss.size();
    if (first == sends.size()) return;
    fresh_sends = true;
    ss.resize(sends.size());
    pending += sends.size() - first;
    Header h;
    h.call = CallSummary::of(ctx);
    for (size_t i = first; i < sends.size(); ++i) {
      h.tag = sends[i].tag;
      h.len = sends[i].len;
      h.check = sends[i].check;
      h.expect = kNoReply;
      auto it = recv_of.find({sends[i].peer, sends[i].tag});
      if (it != recv_of.end() && it->second.first == 1) h.expect = it->second.second;
      std::memcpy(ss[i].hdr, &h, sizeof(h));
    }
  };
  adopt_sends();

  // A message with the tag `r` waits for must also agree on size and check.
  auto check_match = [&](int peer, const Op& r, const Header& h) {
    if (h.check != r.check) fail_mismatch(peer, h, ctx);
    if (h.len != r.len) {
      fail_peer(peer,
                "sent " + std::to_string(h.len) + " bytes where this rank expects " +
                    std::to_string(r.len) + " (split or tensor sizes differ across ranks)",
                ctx);
    }
    if (h.expect == kNoReply || count_of(sends, peer, h.tag) != 1) return;
    for (const Op& s : sends) {
      if (s.peer == peer && s.tag == h.tag && s.len != h.expect) {
        fail_peer(peer,
                  "expects " + std::to_string(h.expect) +
                      " bytes from this rank, which "
                      "sends it " +
                      std::to_string(s.len) + " (split or tensor sizes differ across ranks)",
                  ctx);
      }
    }
  };
  auto finish_recv = [&](size_t i) {
    rdone[i] = 1;
    --pending;
    --awaited[recvs[i].peer];
    if (x.on_received) {
      x.on_received(i);
      adopt_sends();
    }
  };
  // A complete stashed message satisfies the oldest matching receive; returns whether the
  // k-th entry of the peer's stash did (and is gone).
  auto match_entry = [&](int peer, size_t k) {
    Conn& c = *conns_[peer];
    const Stashed& m = c.stash[k];
    if (m.direct_to) return false;
    for (size_t i = 0; i < recvs.size(); ++i) {
      const Op& r = recvs[i];
      if (rdone[i] || rtargeted[i] || r.peer != peer || r.tag != m.hdr.tag) continue;
      check_match(peer, r, m.hdr);
      if (r.len) std::memcpy(r.data, m.data.data(), r.len);
      finish_recv(i);
      c.stash_bytes -= stash_cost(m);
      c.stash.erase(c.stash.begin() + static_cast<std::ptrdiff_t>(k));
      return true;
    }
    return false;
  };
  // Once, at the start. Receives are only ever completed during the exchange, never added,
  // so an entry that matches none now never will: each message that completes into the
  // stash later is matched on its own (Route::stashed), and n queued messages cost O(n), not
  // a rescan of the stash for each (O(n^2)).
  auto match_stash = [&](int peer) {
    Conn& c = *conns_[peer];
    rethrow_if_failed(c);
    // The last entry may still be arriving (a frame started in an earlier exchange).
    size_t complete = c.stash.size() - (stash_in_flight(c) ? 1 : 0);
    for (size_t k = 0; k < complete;) {
      if (match_entry(peer, k)) {
        --complete;
      } else {
        ++k;
      }
    }
  };
  for (int peer : from_peers) match_stash(peer);

  auto wants_from = [&](int peer) { return awaited[peer] > 0; };

  // Where exchange() sends the frames of one peer.
  struct Route {
    int peer;
    const std::vector<Op>& recvs;
    std::vector<uint8_t>& rdone;
    std::vector<uint8_t>& rtargeted;
    const decltype(wants_from)& wants_peer;
    const decltype(check_match)& check;
    const decltype(finish_recv)& finish;
    const decltype(match_entry)& match;
    const OpCtx& ctx;
    TcpMesh& mesh;
    bool wants() { return wants_peer(peer); }
    char* target(const Header& h, int& op) {
      bool awaits_collective = false;
      for (size_t i = 0; i < recvs.size(); ++i) {
        if (rdone[i] || rtargeted[i] || recvs[i].peer != peer) continue;
        awaits_collective |= is_collective_tag(recvs[i].tag);
        if (recvs[i].tag != h.tag) continue;
        check(peer, recvs[i], h);
        op = static_cast<int>(i);
        rtargeted[i] = 1;
        return recvs[i].data;
      }
      // Note [Mismatches across hosts]: the next collective message is the awaited one.
      if (awaits_collective && is_collective_tag(h.tag)) mesh.fail_mismatch(peer, h, ctx);
      op = -1;
      return nullptr;
    }
    void delivered(int op) { finish(static_cast<size_t>(op)); }
    // The message that just completed is the stash's last entry.
    void stashed() { match(peer, mesh.conns_[peer]->stash.size() - 1); }
    std::shared_ptr<void> owner() const { return nullptr; }  // it claims no frame directly
    const char* claimer() const { return nullptr; }          // nor for a receive
  };
  auto pump_in = [&](int peer, int fd) {
    Route route{peer,        recvs,       rdone,       rtargeted, wants_from,
                check_match, finish_recv, match_entry, ctx,       *this};
    read_frames(peer, fd, route, ctx);
  };

  auto pump_out = [&](size_t i) {
    const Op& s = sends[i];
    SendState& st = ss[i];
    Conn& c = *conns_[s.peer];
    const size_t total = sizeof(st.hdr) + s.len;
    while (st.done < total) {
      ssize_t r;
      if (st.done < sizeof(st.hdr)) {
        r = ::send(c.out_fd, st.hdr + st.done, sizeof(st.hdr) - st.done, MSG_NOSIGNAL);
      } else {
        size_t o = st.done - sizeof(st.hdr);
        r = ::send(c.out_fd, s.data + o, s.len - o, MSG_NOSIGNAL);
      }
      counts_.send_calls.fetch_add(1, std::memory_order_relaxed);
      if (r < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
        fail_peer(s.peer,
                  std::string("send failed: ") + std::strerror(errno) + " (process exited?)", ctx);
      }
      st.done += static_cast<size_t>(r);
      c.partial = true;  // until its last byte is written: no notice can follow it
    }
    counts_.sent.fetch_add(1, std::memory_order_relaxed);
    st.finished = true;
    st.locked = false;
    c.partial = false;
    c.write_mu.unlock();
    --pending;
  };

  // Releases write locks held by unfinished sends if we leave with an error. A partly
  // written message leaves that connection unusable, which is fine: the group is broken.
  struct Unlock {
    std::vector<SendState>& ss;
    const std::vector<Op>& sends;
    std::vector<std::unique_ptr<Conn>>& conns;
    ~Unlock() {
      for (size_t i = 0; i < ss.size(); ++i) {
        if (ss[i].locked) conns[sends[i].peer]->write_mu.unlock();
      }
    }
  } unlock{ss, sends, conns_};

  std::vector<pollfd> fds;
  std::vector<uint8_t> blocked(static_cast<size_t>(size_), 0);
  bool working = static_cast<bool>(x.work);
  using Progress = Exchange::Progress;
  Progress beside = x.background ? Progress::kMoved : Progress::kDone;
  while (pending || working) {
    bool waiting_for_something = false;
    if (working) {
      working = x.work();
      adopt_sends();
    }
    if (beside != Progress::kDone) beside = x.background();
    // A peer gets its messages in posting order: after an unfinished send to a peer, its
    // later sends wait for the next round.
    std::fill(blocked.begin(), blocked.end(), 0);
    fresh_sends = false;
    for (size_t i = 0; i < sends.size(); ++i) {
      if (ss[i].finished) continue;
      const int peer = sends[i].peer;
      if (blocked[peer]) continue;
      Conn& c = *conns_[peer];
      if (!ss[i].locked) {
        if (!c.write_mu.try_lock()) {  // the send lane is writing a message to this peer
          waiting_for_something = true;
          blocked[peer] = 1;
          continue;
        }
        ss[i].locked = true;
        if (c.out_fd < 0) c.out_fd = connect_to(peer, ctx);
      }
      pump_out(i);
      if (!ss[i].finished) blocked[peer] = 1;
    }
    for (int peer : from_peers) {
      if (!awaited[peer]) continue;
      int fd = in_fd(peer);
      if (fd < 0) {
        waiting_for_something = true;  // the peer has not connected yet
        continue;
      }
      pump_in(peer, fd);
    }
    if (!pending && !working) break;
    if (aborted_.load()) {
      throw CommError("smddp: " + ctx.describe() + " on group '" + group_name_ +
                      "' was aborted: the process group was shut down");
    }
    if (ctx.deadline.expired()) {
      std::vector<int> missing;
      for (size_t i = 0; i < recvs.size(); ++i) {
        if (!rdone[i]) missing.push_back(recvs[i].peer);
      }
      for (size_t i = 0; i < sends.size(); ++i) {
        if (!ss[i].finished) missing.push_back(sends[i].peer);
      }
      std::sort(missing.begin(), missing.end());
      missing.erase(std::unique(missing.begin(), missing.end()), missing.end());
      char secs[32];
      snprintf(secs, sizeof(secs), "%.1f", ctx.deadline.seconds);
      throw CommError("smddp: " + ctx.describe() + " on group '" + group_name_ +
                      "' timed out after " + secs +
                      " s (the timeout of this group) waiting for ranks " + format_ranks(missing) +
                      " (over TCP)");
    }
    if (health) health();
    // Sends that a receive just added go out now: the peer may wait for them before it
    // sends anything this rank could wake up for.
    if (fresh_sends || working || beside == Progress::kMoved) continue;
    fds.clear();
    for (size_t i = 0; i < sends.size(); ++i) {
      if (ss[i].locked && !ss[i].finished)
        fds.push_back({conns_[sends[i].peer]->out_fd, POLLOUT, 0});
    }
    for (int peer : from_peers) {
      if (!awaited[peer]) continue;
      int fd = in_fd(peer);
      if (fd >= 0) fds.push_back({fd, POLLIN, 0});
    }
    // Background work that waits for other local ranks looks again at the next socket event,
    // or after kBesideWaitMs.
    int wait_ms = std::min(100, ctx.deadline.remaining_ms() + 1);
    if (waiting_for_something) wait_ms = 1;
    if (beside == Progress::kWaiting) wait_ms = std::min(wait_ms, kBesideWaitMs);
    poll(fds.data(), fds.size(), wait_ms);
    counts_.polls.fetch_add(1, std::memory_order_relaxed);
  }
}

}  // namespace smddp

namespace smddp {

TransportStats TcpMesh::stats() const {
  constexpr auto kRelaxed = std::memory_order_relaxed;
  TransportStats out;
  out.messages_sent = counts_.sent.load(kRelaxed);
  out.messages_received = counts_.received.load(kRelaxed);
  out.send_calls = counts_.send_calls.load(kRelaxed);
  out.recv_calls = counts_.recv_calls.load(kRelaxed);
  out.polls = counts_.polls.load(kRelaxed);
  out.bytes_received = counts_.bytes_received.load(kRelaxed);
  out.stashed_bytes = counts_.stashed_bytes.load(kRelaxed);
  out.connects_unreachable = counts_.connects_unreachable.load(kRelaxed);
  out.connects_unanswered = counts_.connects_unanswered.load(kRelaxed);
  return out;
}

}  // namespace smddp
