// The listener's side of the mesh's handshake (Note [Admission] in tcp.h): what the
// process's acceptor thread does for each listening mesh, under the acceptor's lock.
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <unordered_map>

#include "smddp/transport/tcp/tcp.h"
#include "smddp/transport/tcp/tcp_wire.h"

namespace smddp {
using namespace tcp_wire;  // NOLINT(build/namespaces): the wire format both halves share

void TcpMesh::add_poll_fds(std::vector<pollfd>& fds, Clock::time_point& next) const {
  // While accepting is paused (out of descriptors), the listener stays out of the poll set,
  // which would otherwise report it readable at once, and the thread would spin.
  const bool paused = Clock::now() < accept_paused_until_;
  fds.push_back({paused ? -1 : listen_fd_, POLLIN, 0});
  if (paused) next = std::min(next, accept_paused_until_);
  for (const Handshake& h : pending_) {
    fds.push_back({h.fd, static_cast<short>(POLLIN | (h.sent < kHelloBytes ? POLLOUT : 0)), 0});
    next = std::min(next, h.deadline);
  }
}

void TcpMesh::on_poll(const pollfd* fds) {
  // Expire the handshakes first, then progress the others (fds[1 + i] belongs to
  // pending_[i]). In this order a listener that was stopped or without a core past a
  // handshake's deadline never accepts it afterwards from bytes still buffered: the
  // connecting side gave up on it by then (it waits longer than the deadline) and connects
  // again, and accepting the abandoned one would refuse the new one as a duplicate.
  std::vector<Handshake> still;
  const auto now = Clock::now();
  for (size_t i = 0; i < pending_.size(); ++i) {
    Handshake& h = pending_[i];
    if (now >= h.deadline) {
      rejected_.fetch_add(1);
      close(h.fd);
      continue;
    }
    if (fds[1 + i].revents && !progress(h)) continue;  // finished either way
    still.push_back(h);
  }
  pending_.swap(still);
  if (fds[0].revents) accept_new(pending_);
  drop_superseded(pending_);
}

// Note [Admission]: the pending handshakes that have not proven knowledge of the secret are
// capped at kMaxHandshakes; the oldest of them makes room for a new one, after one last look
// at what it sent. Admitted ones are capped by the group (one per claimed rank) instead.
void TcpMesh::make_room(std::vector<Handshake>& pending) {
  size_t strangers = 0;
  for (const Handshake& h : pending) strangers += h.admitted < 0;
  if (strangers < kMaxHandshakes) return;
  for (size_t i = 0; i < pending.size(); ++i) {
    Handshake& h = pending[i];
    if (h.admitted >= 0) continue;
    const bool going = progress(h);
    if (going && h.admitted >= 0) continue;  // it proved itself just now: look further
    if (going) {                             // still nothing: it makes room
      rejected_.fetch_add(1);
      close(h.fd);
    }
    pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
    return;
  }
  // Every stranger proved itself during this look: there is room now.
}

void TcpMesh::accept_new(std::vector<Handshake>& pending) {
  // At most kAcceptsPerPass at a time: between passes the Acceptor progresses and expires
  // the pending handshakes, which a flood of connections must not hold up.
  for (size_t accepted = 0; accepted < kAcceptsPerPass; ++accepted) {
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      // Out of descriptors: the connection stays queued in the kernel, and the listener
      // stays readable; pause accepting for a moment rather than spin on it.
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        accept_paused_until_ = Clock::now() + std::chrono::milliseconds(kAcceptPauseMs);
      }
      return;  // EAGAIN: none left (or a transient error; poll says when to retry)
    }
    make_room(pending);
    Handshake h;
    h.fd = fd;
    h.deadline = Clock::now() + std::chrono::milliseconds(kHandshakeMs);
    std::memcpy(h.hello, kMagic, 8);
    if (getrandom(h.hello + 8, 32, 0) != 32) {
      close(fd);
      continue;
    }
    // A real rank's admission usually arrived with its connection: it is admitted here.
    if (progress(h)) pending.push_back(h);
  }
}

void TcpMesh::drop_superseded(std::vector<Handshake>& pending) {
  // One admitted handshake per claimed rank (Note [Admission]): an older one is that rank's
  // abandoned attempt (connect_to gave up on it and connected again), or a copy of its bytes.
  std::unordered_map<int, size_t> newest;
  std::vector<bool> drop(pending.size(), false);
  for (size_t i = 0; i < pending.size(); ++i) {
    if (pending[i].admitted < 0) continue;
    auto [it, fresh] = newest.emplace(pending[i].admitted, i);
    if (fresh) continue;
    const bool newer = pending[i].deadline >= pending[it->second].deadline;
    drop[newer ? it->second : i] = true;
    if (newer) it->second = i;
  }
  size_t kept = 0;
  for (size_t i = 0; i < pending.size(); ++i) {
    if (drop[i]) {
      close(pending[i].fd);
    } else {
      pending[kept++] = pending[i];
    }
  }
  pending.resize(kept);
}

bool TcpMesh::progress(Handshake& h) {
  auto refuse = [&] {
    // An explicit refusal, so that the connecting side stops trying (Note [Admission]).
    (void)!::send(h.fd, &kRefused, 1, MSG_NOSIGNAL);
    rejected_.fetch_add(1);
    close(h.fd);
    return false;
  };
  auto broken = [&] {
    rejected_.fetch_add(1);
    close(h.fd);
    return false;
  };
  // A client that hung up before its reply began gave up rather than failed: a port probe,
  // or our own connect_to abandoning a listener that was slow to answer. Not counted.
  auto gave_up = [&](ssize_t r) {
    return h.got == 0 && (r == 0 || errno == EPIPE || errno == ECONNRESET);
  };
  auto abandon = [&] {
    close(h.fd);
    return false;
  };
  // Reads up to `want` bytes into `buf` (`got` so far); false: no more for now, or the end.
  ssize_t last = 1;
  auto read_into = [&](char* buf, size_t& got, size_t want) {
    while (got < want) {
      last = ::recv(h.fd, buf + got, want - got, 0);
      if (last <= 0) return false;
      got += static_cast<size_t>(last);
    }
    return true;
  };
  auto would_block = [&] {
    return last < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR);
  };
  while (h.sent < kHelloBytes) {
    ssize_t r = ::send(h.fd, h.hello + h.sent, kHelloBytes - h.sent, MSG_NOSIGNAL);
    if (r > 0) {
      h.sent += static_cast<size_t>(r);
    } else if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      break;  // the admission may be read meanwhile
    } else {
      return gave_up(r) ? abandon() : broken();
    }
  }
  if (!read_into(h.admit, h.admit_got, kAdmitBytes)) {
    if (would_block()) return true;
    return gave_up(last) ? abandon() : broken();
  }
  if (h.admitted < 0) {
    const int32_t from = claim_of(h.admit);
    if (from < 0 || from >= size_ || from == rank_) return refuse();
    Digest expect = hmac_sha256(secret_, admit_message(from, rank_));
    Digest got;
    std::memcpy(got.data(), h.admit + 4, 32);
    if (!digest_equal(expect, got)) return refuse();
    h.admitted = from;
  }
  if (h.sent < kHelloBytes) return true;
  if (!read_into(h.reply, h.got, kReplyBytes)) {
    if (would_block()) return true;
    return gave_up(last) ? abandon() : broken();
  }
  const int32_t from = claim_of(h.reply);
  if (from != h.admitted) return refuse();
  Digest expect = hmac_sha256(secret_, mac_message(std::string(h.hello + 8, 32), from, rank_));
  Digest got;
  std::memcpy(got.data(), h.reply + 4, 32);
  if (!digest_equal(expect, got)) return refuse();
  accept_authenticated(h.fd, from);
  return false;
}

void TcpMesh::accept_authenticated(int fd, int from) {
  std::lock_guard<std::mutex> g(in_mu_);
  Conn& c = *conns_[from];
  // Note [TCP connections]: a live connection is never replaced.
  const char status = c.in_fd < 0 ? kAccepted : kDuplicate;
  if (::send(fd, &status, 1, MSG_NOSIGNAL) != 1 || status != kAccepted) {
    rejected_.fetch_add(1);
    close(fd);
    return;
  }
  set_nonblocking(fd, true);
  tune_socket(fd);
  c.in_fd = fd;
}

}  // namespace smddp
