// What the TCP mesh's two halves share (tcp.cpp: connecting, the acceptor, teardown;
// tcp_handshake.cpp: the listener's side of the handshake): the handshake's wire format
// (Note [Admission] in tcp.h), socket helpers, and the pending handshake's state.
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "smddp/common/sha256.h"
#include "smddp/transport/tcp/tcp.h"

namespace smddp {
namespace tcp_wire {

inline constexpr char kMagic[8] = {'s', 'm', 'd', 'd', 'p', 't', 'c', '2'};
inline constexpr int kNoticeMs = 200;      // time allowed to write a failure notice
inline constexpr size_t kAdmitBytes = 36;  // claimed rank + admission token (Note [Admission])
inline constexpr size_t kHelloBytes = 40;  // magic + challenge
inline constexpr size_t kReplyBytes = 36;  // claimed rank + HMAC
// The listener's last byte (Note [Admission]): only kRefused and kDuplicate are refusals.
inline constexpr char kAccepted = 1, kRefused = 0, kDuplicate = 2;
inline constexpr int kRetryFirstMs = 10,
                     kRetryMaxMs = 500;  // connect_to's backoff between attempts

// connect_to's attempts (Note [Admission]): one waits Settings::connect_attempt_s at most for
// the connection, in polls of kSliceMs that see an abort; attempts the network does not carry
// are made again, and end, kUnreachableMs after the first of them began.
inline constexpr int kSliceMs = 200, kUnreachableMs = 60000;

// Whether connect() failing with `err` says only that the network does not carry the attempt
// yet (Note [Admission]): no route, a link that is down, no answer to neighbour discovery or
// to the connection request (ETIMEDOUT). A refusal (ECONNREFUSED) or anything else is final.
inline bool unreachable_for_now(int err) {
  return err == ETIMEDOUT || err == EHOSTUNREACH || err == ENETUNREACH || err == EHOSTDOWN ||
         err == ENETDOWN;
}

inline void set_nonblocking(int fd, bool on) {
  int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

// Note [Kernel-sized socket buffers]
// The mesh's sockets keep the buffer sizes the kernel picks and grows (tcp_wmem, tcp_rmem
// autotuning); only Nagle is turned off. They used to be fixed at 4 MiB, which also turns
// autotuning off. On 4 simulated hosts of one rank at 2 Gbit/s (bench multihost, ring, 16
// and 64 MiB all_reduce), a job then ran in one of two modes, chosen when it started and
// kept for all its calls: at 0.93 of the NIC bound, or at 0.75-0.81. With the kernel's
// sizes, all six jobs ran at 0.90-0.94, as gloo's ring does (it sets no sizes either). The
// kernel grows a connection's buffers with its window, up to tcp_wmem[2] and tcp_rmem[2].
inline void tune_socket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Blocking-style I/O with a time limit on a non-blocking socket.
inline bool io_all(int fd, char* p, size_t n, bool write, int timeout_ms) {
  auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (n) {
    ssize_t r = write ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
      continue;
    }
    if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return false;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    pollfd pfd{fd, static_cast<short>(write ? POLLOUT : POLLIN), 0};
    poll(&pfd, 1, static_cast<int>(left.count()));
  }
  return true;
}

inline std::string format_names(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out.empty() ? "none" : out;
}

inline std::string mac_message(const std::string& challenge, int from, int to) {
  return "smddp-tcp-hello/" + challenge + "/" + std::to_string(from) + "->" + std::to_string(to);
}

// Note [Admission]: what a connecting rank sends before anything else. Only a holder of the
// group secret can make it; it is the same for every connection from `from` to `to`.
inline std::string admit_message(int from, int to) {
  return "smddp-tcp-admit/" + std::to_string(from) + "->" + std::to_string(to);
}

inline void fill_claim(char* out, int from, const Digest& mac) {
  const int32_t claim = from;
  std::memcpy(out, &claim, 4);
  std::memcpy(out + 4, mac.data(), 32);
}

inline int32_t claim_of(const char* bytes) {
  int32_t claim = -1;
  std::memcpy(&claim, bytes, 4);
  return claim;
}

}  // namespace tcp_wire

// An incoming connection between accept() and the end of its handshake (Note [TCP
// connections], Note [Admission]): the listener writes `hello` while it reads exactly `admit`,
// then exactly `reply`, and answers with one status byte.
struct TcpMesh::Handshake {
  int fd = -1;
  char admit[tcp_wire::kAdmitBytes];
  size_t admit_got = 0;
  char hello[tcp_wire::kHelloBytes];
  size_t sent = 0;
  char reply[tcp_wire::kReplyBytes];
  size_t got = 0;
  int admitted = -1;  // the claimed rank, once its admission token checked out
  Clock::time_point deadline;
};

}  // namespace smddp
