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
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "smddp/common/sha256.h"
#include "smddp/transport/tcp/tcp_wire.h"

namespace smddp {
using namespace tcp_wire;  // NOLINT(build/namespaces): the wire format both halves share

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
  attempt_ms_ = static_cast<int>(std::lround(settings.connect_attempt_s * 1000));
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
    PeerAddr pa;
    const bool port_ok = port >= 1 && port <= 65535 && end && *end == '\0';
    if (port_ok) {
      pa.host = endpoints[r].substr(0, bar);
      pa.port = static_cast<int>(port);
      pa.addr.sin_family = AF_INET;
      pa.addr.sin_port = htons(static_cast<uint16_t>(port));
    }
    if (!port_ok || inet_pton(AF_INET, pa.host.c_str(), &pa.addr.sin_addr) != 1) {
      throw CommError("smddp: malformed mesh record of rank " + std::to_string(r) + ": '" +
                      endpoints[r] + "' (expected IPv4-address|port)");
    }
    peers_[r] = pa;
  }
}

int TcpMesh::connect_to(int peer, const OpCtx& ctx, bool abortable) {
  const PeerAddr& pa = peers_.at(peer);
  if (pa.port == 0) fail_peer(peer, "it published no listener (a bug: no TCP to it expected)", ctx);
  const std::string port = std::to_string(pa.port);
  char admit_bytes[kAdmitBytes];
  fill_claim(admit_bytes, rank_, hmac_sha256(secret_, admit_message(rank_, peer)));
  // Note [Admission]: an attempt that ends without the listener's verdict (no challenge in
  // time, or the connection closed midway: a listener only slow, its process stopped or
  // without a core, or one that dropped the handshake; or a network that does not carry it
  // yet) is made again, after a growing pause, until the caller's deadline. Only the
  // listener's explicit refusal is final, and a peer that is gone refuses the connection at
  // once.
  std::string last = "its listener did not answer the handshake";
  using Clock = std::chrono::steady_clock;
  // The start of the first attempt the network did not carry: attempts end, and fail the
  // operation, kUnreachableMs after it.
  std::optional<Clock::time_point> unreachable_since;
  // Between attempts: the pause, unless the operation's deadline has passed.
  auto pause_or_fail = [&](int pause_ms) {
    if (ctx.deadline.expired() || (abortable && aborted_.load())) fail_peer(peer, last, ctx);
    std::this_thread::sleep_for(
        std::chrono::milliseconds(std::min(pause_ms, std::max(1, ctx.deadline.remaining_ms()))));
  };
  for (int pause_ms = kRetryFirstMs;; pause_ms = std::min(2 * pause_ms, kRetryMaxMs)) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      fail_peer(peer, std::string("cannot open a socket: ") + std::strerror(errno), ctx);
    }
    set_nonblocking(fd, true);
    int r = ::connect(fd, reinterpret_cast<const sockaddr*>(&pa.addr), sizeof(pa.addr));
    int err = r != 0 && errno != EINPROGRESS ? errno : 0;
    bool answered = err != 0, connected = false;
    // One attempt waits up to attempt_ms_ for the connection, in slices that see an abort
    // (where `abortable`), and not past the end of the unreachable window.
    const auto attempt_start = Clock::now();
    auto attempt_end = attempt_start + std::chrono::milliseconds(attempt_ms_);
    if (unreachable_since) {
      attempt_end =
          std::min(attempt_end, *unreachable_since + std::chrono::milliseconds(kUnreachableMs));
    }
    while (!answered && !(abortable && aborted_.load()) && Clock::now() < attempt_end &&
           !ctx.deadline.expired()) {
      pollfd pfd{fd, POLLOUT, 0};
      const int n = poll(&pfd, 1, std::max(1, std::min(kSliceMs, ctx.deadline.remaining_ms())));
      if (n == 1) {
        socklen_t elen = sizeof(err);
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen) != 0) err = errno;
        answered = true;
        connected = err == 0;
      } else if (n < 0 && errno != EINTR) {
        err = errno;
        answered = true;
      }
    }
    if (!connected) {
      close(fd);
      const std::string what = "cannot connect to " + pa.host + ":" + port + ": " +
                               (answered ? std::strerror(err) : "no answer");
      if (answered && !unreachable_for_now(err)) fail_peer(peer, what, ctx);
      // The kernel's own end of an unanswered request (ETIMEDOUT) is no answer too.
      const bool unanswered = !answered || err == ETIMEDOUT;
      (unanswered ? counts_.connects_unanswered : counts_.connects_unreachable)
          .fetch_add(1, std::memory_order_relaxed);
      // Note [Admission]: not a verdict; again after the pause, for kUnreachableMs at most.
      if (!unreachable_since) unreachable_since = attempt_start;
      last = what;
      if (Clock::now() - *unreachable_since >= std::chrono::milliseconds(kUnreachableMs)) {
        fail_peer(peer,
                  what + " (every attempt for " + std::to_string(kUnreachableMs / 1000) + " s)",
                  ctx);
      }
      pause_or_fail(pause_ms);
      continue;
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
    pause_or_fail(pause_ms);
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
        // Also after abort() (Note [Failure notices]): the notice's deadline bounds it.
        c.out_fd = connect_to(peer, notice, /*abortable=*/false);
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
