#include "smddp/transport/tcp/tcp.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "smddp/common/sha256.h"

namespace smddp {
namespace {

constexpr char kMagic[8] = {'s', 'm', 'd', 'd', 'p', 't', 'c', '2'};
constexpr int kNoticeMs = 200;      // time allowed to write a failure notice
constexpr size_t kAdmitBytes = 36;  // claimed rank + admission token (Note [Admission])
constexpr size_t kHelloBytes = 40;  // magic + challenge
constexpr size_t kReplyBytes = 36;  // claimed rank + HMAC
// The listener's last byte (Note [Admission]): only kRefused and kDuplicate are refusals.
constexpr char kAccepted = 1, kRefused = 0, kDuplicate = 2;
constexpr int kRetryFirstMs = 10, kRetryMaxMs = 500;  // connect_to's backoff between attempts

void set_nonblocking(int fd, bool on) {
  int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

void tune_socket(int fd) {
  int one = 1, buf = 4 << 20;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
}

// Blocking-style I/O with a time limit on a non-blocking socket.
bool io_all(int fd, char* p, size_t n, bool write, int timeout_ms) {
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

std::string format_names(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out.empty() ? "none" : out;
}

std::string mac_message(const std::string& challenge, int from, int to) {
  return "smddp-tcp-hello/" + challenge + "/" + std::to_string(from) + "->" + std::to_string(to);
}

// Note [Admission]: what a connecting rank sends before anything else. Only a holder of the
// group secret can make it; it is the same for every connection from `from` to `to`.
std::string admit_message(int from, int to) {
  return "smddp-tcp-admit/" + std::to_string(from) + "->" + std::to_string(to);
}

void fill_claim(char* out, int from, const Digest& mac) {
  const int32_t claim = from;
  std::memcpy(out, &claim, 4);
  std::memcpy(out + 4, mac.data(), 32);
}

int32_t claim_of(const char* bytes) {
  int32_t claim = -1;
  std::memcpy(&claim, bytes, 4);
  return claim;
}

}  // namespace

// Note [One transport per process] (work.h): one thread per process accepts and
// authenticates the connections of every listening group, each group on its own port with
// its own secret, pending handshakes and limits (Note [TCP connections]). It exists only
// while some group listens. Registration changes happen under `mu_`, and the thread touches
// a mesh only under `mu_` too, so once remove() returns, the mesh is the caller's alone.
class Acceptor {
 public:
  static Acceptor& instance() {
    // Never destroyed (its thread is detached); a forked child starts afresh.
    static std::mutex mu;
    static Acceptor* one = nullptr;
    static pid_t owner = 0;
    std::lock_guard<std::mutex> g(mu);
    if (!one || owner != getpid()) {
      one = new Acceptor();
      owner = getpid();
    }
    return *one;
  }

  void add(TcpMesh* mesh) {
    std::lock_guard<std::mutex> g(mu_);
    if (wake_[0] < 0 && pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
      throw CommError("smddp: pipe() failed");
    }
    meshes_.push_back(mesh);
    ++generation_;
    if (!running_) {
      running_ = true;
      std::thread([this] { loop(); }).detach();
    }
    wake();
  }

  void remove(TcpMesh* mesh) {
    std::lock_guard<std::mutex> g(mu_);
    meshes_.erase(std::remove(meshes_.begin(), meshes_.end(), mesh), meshes_.end());
    ++generation_;
    wake();
  }

 private:
  void wake() {
    char x = 1;
    (void)!write(wake_[1], &x, 1);
  }

  void loop() {
    std::vector<pollfd> fds;
    std::vector<size_t> first;  // index of each mesh's first descriptor in fds
    std::unique_lock<std::mutex> lk(mu_);
    while (true) {
      if (meshes_.empty()) {
        running_ = false;
        return;
      }
      fds.assign({{wake_[0], POLLIN, 0}});
      first.clear();
      auto next = Clock::now() + std::chrono::milliseconds(TcpMesh::kHandshakeMs);
      for (TcpMesh* m : meshes_) {
        first.push_back(fds.size());
        m->add_poll_fds(fds, next);
      }
      const uint64_t gen = generation_;
      lk.unlock();
      auto wait =
          std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()).count();
      poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(1, wait + 1)));
      if (fds[0].revents) {
        char buf[64];
        while (read(wake_[0], buf, sizeof(buf)) > 0) {
        }
      }
      lk.lock();
      // A mesh added or removed meanwhile: the descriptors may be stale; poll afresh.
      if (gen != generation_) continue;
      for (size_t i = 0; i < meshes_.size(); ++i) meshes_[i]->on_poll(&fds[first[i]]);
    }
  }

  std::mutex mu_;
  std::vector<TcpMesh*> meshes_;
  uint64_t generation_ = 0;
  bool running_ = false;
  int wake_[2] = {-1, -1};
};

std::string local_address(const Settings& settings) {
  const std::string& forced = settings.socket_addr;
  if (!forced.empty()) {
    // A name is resolved here: the listener binds to exactly this address.
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(forced.c_str(), nullptr, &hints, &res) != 0 || !res) {
      throw std::invalid_argument("smddp: SMDDP_SOCKET_ADDR=" + forced +
                                  " is neither an IPv4 address nor a name of one");
    }
    char buf[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr, buf, sizeof(buf));
    freeaddrinfo(res);
    return buf;
  }
  const std::string& ifname = settings.socket_ifname;
  ifaddrs* list = nullptr;
  std::string found = ifname.empty() ? "127.0.0.1" : "";
  std::vector<std::string> names;
  if (getifaddrs(&list) == 0) {
    for (ifaddrs* a = list; a; a = a->ifa_next) {
      if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET) continue;
      auto* in = reinterpret_cast<sockaddr_in*>(a->ifa_addr);
      char buf[INET_ADDRSTRLEN];
      inet_ntop(AF_INET, &in->sin_addr, buf, sizeof(buf));
      names.push_back(a->ifa_name);
      if (ifname.empty() ? std::string(buf).rfind("127.", 0) == 0 : ifname != a->ifa_name) continue;
      found = buf;
      break;
    }
    freeifaddrs(list);
  }
  if (found.empty()) {
    throw std::invalid_argument("smddp: SMDDP_SOCKET_IFNAME=" + ifname +
                                " names no interface with an IPv4 address here (interfaces with "
                                "one: " +
                                format_names(names) + ")");
  }
  return found;
}

TcpMesh::TcpMesh(int rank, int size, std::string secret, std::string group_name)
    : rank_(rank), size_(size), secret_(std::move(secret)), group_name_(std::move(group_name)) {
  for (int i = 0; i < size; ++i) conns_.emplace_back(std::make_unique<Conn>());
}

TcpMesh::~TcpMesh() { shutdown(); }

std::string TcpMesh::listen(bool across_hosts, const Settings& settings) {
  const std::string address = across_hosts ? local_address(settings) : "127.0.0.1";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  if (inet_pton(AF_INET, address.c_str(), &addr.sin_addr) != 1) {
    throw CommError("smddp: cannot listen for mesh connections on '" + address +
                    "': not an IPv4 address (set SMDDP_SOCKET_ADDR to this host's address)");
  }
  listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listen_fd_ < 0) throw CommError(std::string("smddp: socket(): ") + std::strerror(errno));
  if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(listen_fd_, SOMAXCONN) != 0) {
    throw CommError("smddp: cannot listen for mesh connections on " + address + ": " +
                    std::strerror(errno));
  }
  socklen_t len = sizeof(addr);
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.sin_port);
  address_ = address;
  Acceptor::instance().add(this);
  registered_ = true;
  return address_ + "|" + std::to_string(port_);
}

void TcpMesh::set_peers(const std::vector<std::string>& endpoints) {
  peers_.assign(endpoints.size(), PeerAddr{});
  for (size_t r = 0; r < endpoints.size(); ++r) {
    if (endpoints[r].empty()) continue;  // it does not listen
    const size_t bar = endpoints[r].rfind('|');
    char* end = nullptr;
    const long port =
        bar == std::string::npos ? 0 : std::strtol(endpoints[r].c_str() + bar + 1, &end, 10);
    if (port < 1 || port > 65535 || !end || *end != '\0') {
      throw CommError("smddp: malformed mesh record of rank " + std::to_string(r) + ": '" +
                      endpoints[r] + "' (expected address|port)");
    }
    peers_[r] = {endpoints[r].substr(0, bar), static_cast<int>(port)};
  }
}

// An incoming connection between accept() and the end of its handshake (Note [TCP
// connections], Note [Admission]): the listener writes `hello` while it reads exactly `admit`,
// then exactly `reply`, and answers with one status byte.
struct TcpMesh::Handshake {
  int fd = -1;
  char admit[kAdmitBytes];
  size_t admit_got = 0;
  char hello[kHelloBytes];
  size_t sent = 0;
  char reply[kReplyBytes];
  size_t got = 0;
  int admitted = -1;  // the claimed rank, once its admission token checked out
  Clock::time_point deadline;
};

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

int TcpMesh::connect_to(int peer, const OpCtx& ctx) {
  const PeerAddr& pa = peers_.at(peer);
  const std::string port = std::to_string(pa.port);
  char admit_bytes[kAdmitBytes];
  fill_claim(admit_bytes, rank_, hmac_sha256(secret_, admit_message(rank_, peer)));
  // Note [Admission]: an attempt that ends without the listener's verdict (no challenge in
  // time, or the connection closed midway: a listener only slow, its process stopped or
  // without a core, or one that dropped the handshake) is made again, after a growing pause,
  // until the caller's deadline. Only the listener's explicit refusal is final, and a peer
  // that is gone refuses the connection at once.
  std::string last = "its listener did not answer the handshake";
  for (int pause_ms = kRetryFirstMs;; pause_ms = std::min(2 * pause_ms, kRetryMaxMs)) {
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(pa.host.c_str(), port.c_str(), &hints, &res) != 0 || !res) {
      fail_peer(peer, "cannot resolve its address " + pa.host, ctx);
    }
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      const int e = errno;
      freeaddrinfo(res);
      fail_peer(peer, std::string("cannot open a socket: ") + std::strerror(e), ctx);
    }
    set_nonblocking(fd, true);
    int r = ::connect(fd, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    if (r != 0 && errno != EINPROGRESS) {
      int e = errno;
      close(fd);
      fail_peer(peer, "cannot connect to " + pa.host + ":" + port + ": " + std::strerror(e), ctx);
    }
    pollfd pfd{fd, POLLOUT, 0};
    int limit = std::min(ctx.deadline.remaining_ms(), 60000);
    int err = 0;
    socklen_t elen = sizeof(err);
    if (poll(&pfd, 1, limit) != 1 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen) != 0 ||
        err) {
      close(fd);
      fail_peer(peer,
                "cannot connect to " + pa.host + ":" + port + ": " +
                    (err ? std::strerror(err) : "timed out"),
                ctx);
    }
    // Each step also ends with the caller's deadline (a failure notice allows 200 ms).
    auto step_ms = [&] { return std::max(1, std::min(kHandshakeMs, ctx.deadline.remaining_ms())); };
    char hello[kHelloBytes];
    char status = kRefused;
    bool verdict = false;
    if (!io_all(fd, admit_bytes, sizeof(admit_bytes), true, step_ms()) ||
        !io_all(fd, hello, sizeof(hello), false, step_ms())) {
      last = "its listener did not answer the handshake";
    } else if (std::memcmp(hello, kMagic, 8) != 0) {
      close(fd);
      fail_peer(peer, "its listener does not speak this version of the mesh protocol", ctx);
    } else {
      char reply[kReplyBytes];
      fill_claim(reply, rank_,
                 hmac_sha256(secret_, mac_message(std::string(hello + 8, 32), rank_, peer)));
      verdict = io_all(fd, reply, sizeof(reply), true, step_ms()) &&
                io_all(fd, &status, 1, false, step_ms());
      if (!verdict) last = "its listener closed the connection during the handshake";
    }
    if (verdict && status == kAccepted) {
      tune_socket(fd);
      return fd;
    }
    close(fd);
    if (verdict && status == kDuplicate) {
      fail_peer(peer,
                "it already holds a connection from rank " + std::to_string(rank_) +
                    " of this group (two processes claim this rank?)",
                ctx);
    }
    if (verdict) fail_peer(peer, "it refused our credentials (different job secret?)", ctx);
    if (ctx.deadline.expired() || aborted_.load()) fail_peer(peer, last, ctx);
    std::this_thread::sleep_for(
        std::chrono::milliseconds(std::min(pause_ms, std::max(1, ctx.deadline.remaining_ms()))));
  }
}

int TcpMesh::in_fd(int peer) {
  std::lock_guard<std::mutex> g(in_mu_);
  return conns_[peer]->in_fd;
}

void TcpMesh::fail_peer(int peer, const std::string& what, const OpCtx& ctx) {
  throw CommError("smddp: " + ctx.describe() + " on group '" + group_name_ + "' failed: rank " +
                  std::to_string(peer) + ": " + what);
}

void TcpMesh::fail_mismatch(int peer, const Header& theirs, const OpCtx& ctx) {
  throw CommError(mismatch_message(group_name_, rank_, ctx.describe(), ctx.seq, peer,
                                   theirs.call.describe(), seq_of_tag(theirs.tag)));
}

void TcpMesh::announce_failure(const std::string& why, const std::vector<int>& also_tell) {
  if (announced_.exchange(true)) return;
  const std::string text = why.substr(0, kMaxNotice);
  Header h;
  h.tag = kFailureTag;
  h.len = text.size();
  char hdr[sizeof(Header)];
  std::memcpy(hdr, &h, sizeof(h));
  OpCtx notice;  // for connect_to's messages and time limit only
  notice.name = "failure notice";
  notice.deadline = Deadline::after(kNoticeMs / 1000.0);
  for (int peer = 0; peer < size_; ++peer) {
    Conn& c = *conns_[peer];
    // A connection another thread is writing to stays with it (its write fails or ends).
    std::unique_lock<std::mutex> lock(c.write_mu, std::try_to_lock);
    if (!lock.owns_lock()) continue;
    if (c.out_fd < 0 && peer != rank_ &&
        std::find(also_tell.begin(), also_tell.end(), peer) != also_tell.end()) {
      try {
        c.out_fd = connect_to(peer, notice);
      } catch (const std::exception&) {  // best effort: the peer may be gone
      }
    }
    if (c.out_fd < 0) continue;
    // Best effort, briefly: a peer that stopped reading must not hold up this error.
    if (!c.partial && io_all(c.out_fd, hdr, sizeof(hdr), true, kNoticeMs)) {
      io_all(c.out_fd, const_cast<char*>(text.data()), text.size(), true, kNoticeMs);
    }
    ::shutdown(c.out_fd, SHUT_WR);
  }
}

void TcpMesh::shutdown() {
  if (registered_) {
    Acceptor::instance().remove(this);
    registered_ = false;
  }
  for (Handshake& h : pending_) close(h.fd);
  pending_.clear();
  if (listen_fd_ >= 0) close(listen_fd_);
  listen_fd_ = -1;
  for (auto& c : conns_) {
    if (c->out_fd >= 0) close(c->out_fd);
    if (c->in_fd >= 0) close(c->in_fd);
    c->out_fd = c->in_fd = -1;
  }
}

}  // namespace smddp
