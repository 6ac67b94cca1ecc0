// Inter-host transport: a TCP full mesh (one hop to every peer), authenticated with a
// per-group secret from the store.
//
// Note [TCP connections]
// A rank listens only where a peer needs it: when its group spans several hosts (or sends
// point-to-point messages over TCP inside a host, SMDDP_P2P_BYTES=0), on one port bound to
// the address it publishes through the store (the configured interface; loopback for
// traffic inside a host), never on every interface. Connections are one-directional and
// made lazily: the sender of the first message to a peer connects to it and that socket
// carries only sender -> receiver traffic, so there is never a race about who connects.
// The process's one acceptor thread (shared by every group that listens, and only while one
// does) authenticates each connection with a challenge/response
// (HMAC-SHA-256 over a fresh random challenge, the claimed rank and the listener's rank,
// keyed with the group secret). Handshakes run concurrently, each with its own deadline
// (kHandshakeMs), and read a fixed number of bytes: a connection that says nothing, or a
// flood of them, can slow a real rank's handshake but never fail it (Note [Admission]). A stranger
// or a wrong secret is refused and counted, and the job carries on. The first authenticated
// connection of a peer stays: a second one claiming the same rank is refused, so a live connection
// is never replaced.
//
// Note [Admission]
// A listener must bound what strangers cost it, yet no number of strangers may fail a real
// rank's connection. An earlier design kept at most 64 handshakes and dropped the oldest
// for each new connection: a flood of idle connections (thousands a second) then dropped
// real ranks' handshakes after their challenge had arrived, and the connecting rank read
// the closed socket as refused credentials, failing the job; 65 real peers connecting at once
// could do the same. So:
// - A connecting rank sends, before anything else, its rank and an admission token,
//   HMAC(secret, "smddp-tcp-admit/<from>-><to>"); it usually arrives with the connection
//   itself, so the listener reads it in the same pass as the accept(). A handshake with a
//   valid token is admitted: it is never dropped to make room, and admitted handshakes are
//   bounded by the group (one per claimed rank; the newest of two claiming one rank stays,
//   the other is that rank's abandoned attempt). The challenge/response still follows: the
//   token is the same for every connection of the pair, so it proves only that its sender
//   holds the secret or has seen this pair's traffic, and a connection is accepted only
//   with a fresh response.
// - The handshakes not admitted are capped at kMaxHandshakes; the oldest makes room, after
//   one last read of what it sent (an admission that just arrived keeps it). The listener
//   accepts at most kAcceptsPerPass connections between two passes over the pending
//   handshakes, so a flood cannot hold up admitted ones, and it pauses accepting for a
//   moment when the process runs out of descriptors instead of spinning on the listener.
// - The listener ends every handshake it judges with one status byte: accepted, refused
//   (wrong token or response) or duplicate (the rank is connected). Only those two
//   refusals, and a connect() the network answered with anything but unreachable_for_now's
//   errors (a refusal, above all), are final for the connecting rank. Any other end (no challenge
//   within kHandshakeMs, a connection closed midway) makes it connect again after a pause that
//   doubles from 10 ms to 500 ms, until its operation's deadline: a listener that is only
//   slow (its process stopped or without a core) or that dropped the attempt must not fail
//   the operation. A network that does not carry the attempt yet is no verdict either
//   (unreachable_for_now: no route, a link that is down, no answer to neighbour discovery
//   or to the connection request within SMDDP_CONNECT_ATTEMPT_TIMEOUT, 20 s by default):
//   on 48 simulated hosts at 1 Gbit/s, connections made in a job's first collective failed
//   with EHOSTUNREACH (address resolution unanswered after the kernel's three probes, in a
//   storm of them) or had no answer to their SYNs for the 60 s one attempt then waited, and
//   either failed the job. A fresh attempt sends its SYN at once, where the kernel's own
//   retransmissions of an unanswered one back off (1, 2, 4, 8, 16 s apart).
//   Such attempts are made again for kUnreachableMs (60 s) at most, or to the deadline if
//   it comes first: a host that is gone or cut off for good fails the operation then,
//   where a refusal (its process gone, its host up) fails it at once. The connecting rank
//   waits longer for a verdict than the listener's deadline for the handshake, and the
//   listener expires handshakes past their deadline before it reads them: a listener that
//   resumes after a stall never accepts an attempt its peer has abandoned (which would
//   make the peer's next attempt a duplicate, a final refusal).
// What remains: a stranger can slow a real rank's connection by keeping the listener busy,
// never fail it. On a network where strangers can also read the job's traffic, the
// tokens can be replayed to occupy a rank's admitted place, which a real rank's retry
// takes back: such networks need the private network of Note [TCP trust model] anyway.
//
// Note [TCP trust model]
// As in every c10d backend, the store is trusted: whoever can read it during group creation
// can join the group. The secret travels through it (rank 0 deletes it once every rank
// has read it, so a later reader finds nothing; stores that cannot delete keys, such as
// FileStore, keep it), and a holder of the secret can do what a
// rank can: send messages and failure notices. What the mesh guarantees beyond that is
// that no input crashes or exhausts a rank: nothing is allocated before authentication;
// a message for a posted receive must have exactly the expected length, checked before a
// byte of it is stored; a message nobody waits for yet is stored only as its bytes arrive
// and only up to a per-connection budget (kStashBytes in transport.h, as for the shared-memory
// rings), so a header claiming a huge length costs nothing. Each such message counts against
// the budget with its length and a fixed kStashEntryBytes (256) for its keeping (its stash
// entry, 168 bytes, and the allocator's share): counting the length alone let a flood of empty
// messages grow the stash without bound. Without a trusted store, use a private network.
//
// Note [Failure notices]
// A rank whose group failed (a peer died, a timeout, a mismatch) sends each peer it has a
// connection to a notice with its error in place of the next message, then closes its
// sending side. A peer waiting for data from it raises at once with that reason, instead
// of waiting out the timeout for a rank that is alive but has left the group. A connection
// that carries a partly written message cannot frame a notice; it is only closed.
// The notices go out also after abort() (Note [Abort tells the peers] in comm.cpp), which
// sets the flag that ends this rank's waits before the group is marked failed: the
// connections made for notices ignore that flag; they share the notice's deadline (kNoticeMs)
// and each notice's write has as long, so an abort still returns promptly. Before, a rank that
// aborted before it had a connection to a peer told it nothing, and the peer waited out
// the group timeout.
//
// Note [Mismatches across hosts]
// A message header carries, besides tag, length and check, a summary of the call that sent
// it (CallSummary). Collective tags hold the collective's sequence number and stage, and
// one connection carries a sender's collectives in sequence order, so while a rank waits
// for a collective message from a peer, the next collective message on that connection is
// the one it waits for, or the peer is running something else. The receiver then raises
// naming both calls: a different tag (another collective, or the same one at another
// point of its algorithm) or a different check (dtype, op, size, root). A rank that fails
// tells its rail peers on other hosts even where it never opened a connection to them
// (Note [Failure notices]): hierarchical collectives talk across hosts only along rails,
// so a peer stuck because of a mismatch is most likely one of them.
//
// Messages are framed as a Header + payload. Only the thread that executes
// collectives reads sockets (so no reader locking; Note [Receive state belongs to the
// reader] in tcp_exchange.cpp); a message that arrives for a tag nobody waits for yet (e.g. a
// user send overtaking a collective) is stashed. Writers (collectives, and the send lane for
// isend) take the connection's write lock per message.
#pragma once

#include <netinet/in.h>
#include <poll.h>

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "smddp/common/common.h"
#include "smddp/common/settings.h"
#include "smddp/transport/transport.h"

namespace smddp {

class Acceptor;

// A peer's listener as its mesh record published it: a numeric IPv4 address (listen() resolves
// any name once, on its own host), so connecting never waits on a name resolver.
struct PeerAddr {
  std::string host;  // for messages
  int port = 0;
  sockaddr_in addr{};
};

class TcpMesh final : public Transport {
 public:
  using Op = TransportOp;

  // What precedes every message's payload on the wire.
  struct Header {
    uint64_t tag = 0, len = 0, check = 0;
    // Bytes the sender expects back from the receiver under the same tag (kNoReply: none),
    // so a pair exchanging messages both finds a size mismatch, not only its receiver.
    uint64_t expect = kNoReply;
    CallSummary call;  // Note [Mismatches across hosts]
  };
  static constexpr uint64_t kNoReply = ~0ull;

  TcpMesh(int rank, int size, std::string secret, std::string group_name);
  ~TcpMesh() override;

  // Binds an ephemeral port on this host's address for other hosts (local_address()) or on
  // loopback, and registers it with the process's acceptor thread; the endpoint is
  // "address|port".
  std::string listen(bool across_hosts, const Settings& settings) override;
  int port() const override { return port_; }  // 0: not listening
  const std::string& address() const override { return address_; }
  void set_peers(const std::vector<std::string>& endpoints) override;

  // Progresses all sends and receives concurrently until done, with the sends that
  // `x.on_received` adds; throws CommError on timeout (naming the peers still missing), a
  // closed connection, a peer's failure notice or a size mismatch. `x.health`, when given,
  // runs between polls and may throw to end the wait (the collectives pass a check of the
  // local ranks' failure flags).
  void exchange(Exchange& x, const OpCtx& ctx) override;
  using Transport::exchange;

  // Takes the next message with `tag` from `peer` into `data` if it has fully arrived,
  // reading what the connection holds (messages with other tags are stashed). Raises, as
  // soon as its header is read, if its length is not `len`. For the receives that wait side
  // by side (Note [Receives wait side by side] in receive_poller.cpp): a message with `tag` is
  // awaited by a posted receive, so it is stored outside the budget for messages nobody
  // waits for (Note [TCP trust model]); its length is that receive's. With `data_owner`
  // (which keeps `data` alive; a receive from this one peer, attempted with the same `data`
  // until it completes), the message is read straight into `data`, and once it has begun
  // take() waits for the rest (Note [Direct receives over TCP]); otherwise it never waits.
  bool take(int peer, uint64_t tag, char* data, size_t len, const OpCtx& ctx,
            const std::shared_ptr<void>& data_owner) override;
  // Note [Claims of a receive from any rank] in tcp_take.cpp: the messages take() calls with
  // `data` claimed and did not take count against the budget from now on.
  void release_claims(const char* data) override;

  // Sends the failure notice (Note [Failure notices]) on every outgoing connection and on
  // new ones to `also_tell` (ranks without one yet), then closes them; the first call does
  // it, later ones return.
  void announce_failure(const std::string& why, const std::vector<int>& also_tell) override;

  void shutdown() override;
  void abort() override { aborted_.store(true); }
  // Incoming connections refused: a wrong or late reply, a stranger dropped to make room
  // (Note [Admission]), or a second connection for a connected rank. Clients that hang up
  // before replying are not counted (TcpMesh::progress).
  uint64_t rejected_connections() const override { return rejected_.load(); }
  TransportStats stats() const override;
  // The budget of each connection for messages nobody waits for yet (kStashBytes; tests set a
  // smaller one before any traffic).
  void set_stash_budget(size_t bytes) { stash_budget_ = bytes; }

 private:
  static constexpr uint64_t kFailureTag = ~0ull;  // no collective or user tag reaches it
  static constexpr size_t kMaxNotice = 1024;
  static constexpr int kHandshakeMs = 2000;      // Note [TCP connections]
  static constexpr size_t kMaxHandshakes = 64;   // not admitted (Note [Admission])
  static constexpr size_t kAcceptsPerPass = 64;  // accept4 calls between handshake progress
  static constexpr int kAcceptPauseMs = 100;     // no accept4 after running out of descriptors
  static constexpr int kDirectSliceMs = 20;      // Note [Direct receives over TCP]
  static constexpr int kNotice = -2;             // Conn::target_op of a notice being read
  static constexpr int kAwaited = -3;  // Route::target: stash it, a posted receive awaits it
  static constexpr int kDirect = -4;   // Route::target: into the awaiting receive's buffer
  struct Stashed {
    Header hdr;
    std::vector<char> data;
    bool awaited = false;                // a posted receive's (take): not in Conn::stash_bytes
    char* direct_to = nullptr;           // kDirect: its body went there, `data` is empty
    std::shared_ptr<void> direct_owner;  // keeps direct_to alive
    const char* claimed_by = nullptr;    // awaited, not direct: the claiming take()'s `data`
  };
  struct Conn {
    std::mutex write_mu;   // held by the writer of one whole message
    int out_fd = -1;       // I connected: I write
    bool partial = false;  // a message is partly written to out_fd (under write_mu)
    int in_fd = -1;        // peer connected: I read (exec thread only)
    // Receive state of the message being read from in_fd (persists across exchanges).
    Header hdr;
    size_t hdr_got = 0;
    size_t body_got = 0;
    char* body = nullptr;      // destination of the current message
    int target_op = -1;        // index of the recv op it belongs to, -1 (stash), kNotice, kDirect
    std::vector<char> notice;  // body of a failure notice being read
    std::deque<Stashed> stash;
    // What the stashed messages nobody awaits count against the budget: their declared
    // lengths and kStashEntryBytes each (Note [TCP trust model]).
    size_t stash_bytes = 0;
    // The error that ended a read of this connection midway (a refused header, a closed
    // socket, a failure notice, or an exchange that failed while a message for one of its
    // receives was arriving: Note [A failed exchange's frames] in tcp_exchange.cpp): the frame
    // state above is then inconsistent, so every later use raises it again
    // (rethrow_if_failed).
    std::exception_ptr failure;
  };
  struct Handshake;  // an incoming connection being authenticated (tcp.cpp)

  // exchange() without its clean-up of a failure (Note [A failed exchange's frames]).
  void exchange_rounds(Exchange& x, const OpCtx& ctx);
  template <class Route>
  void read_frames(int peer, int fd, Route& route, const OpCtx& ctx);
  template <class Route>
  void read_frames_of(Conn& c, int peer, int fd, Route& route, const OpCtx& ctx);
  static bool stash_in_flight(const Conn& c);  // the last stash entry is still arriving
  // What a stashed message counts against the budget (Note [TCP trust model]).
  static size_t stash_cost(const Stashed& m) {
    return m.awaited ? 0 : m.hdr.len + kStashEntryBytes;
  }
  static void rethrow_if_failed(const Conn& c);
  friend class Acceptor;
  // For the process's Acceptor thread (Note [One transport per process] in work.h): the
  // descriptors to poll (listener, then the pending handshakes), and the work their events
  // call for; both run under the Acceptor's lock, never concurrently with shutdown().
  void add_poll_fds(std::vector<pollfd>& fds, Clock::time_point& next) const;
  void on_poll(const pollfd* fds);
  void accept_new(std::vector<Handshake>& pending);
  // Advances one handshake; returns false when it is over (accepted or refused).
  bool progress(Handshake& h);
  // Makes room for one more handshake that has not been admitted (Note [Admission]).
  void make_room(std::vector<Handshake>& pending);
  // Keeps the newest of the admitted handshakes that claim the same rank.
  static void drop_superseded(std::vector<Handshake>& pending);
  void accept_authenticated(int fd, int from);
  // Connects to `peer` by ctx's deadline; an abort() ends the attempts unless !abortable (a
  // failure notice's, which its own short deadline bounds: Note [Failure notices]).
  int connect_to(int peer, const OpCtx& ctx, bool abortable = true);
  int in_fd(int peer);
  [[noreturn]] void fail_peer(int peer, const std::string& what, const OpCtx& ctx);
  // Throws for a message from `peer` that belongs to another collective, or to another
  // variant of this one (Note [Mismatches across hosts]).
  [[noreturn]] void fail_mismatch(int peer, const Header& theirs, const OpCtx& ctx);

  int rank_, size_;
  std::string secret_, group_name_;
  std::vector<PeerAddr> peers_;
  std::vector<std::unique_ptr<Conn>> conns_;
  std::mutex in_mu_;  // guards Conn::in_fd (set by the listener thread)
  int listen_fd_ = -1, port_ = 0;
  // Settings::connect_attempt_s in ms, set by listen().
  int attempt_ms_ = static_cast<int>(Settings{}.connect_attempt_s * 1000);
  std::string address_;
  std::vector<Handshake> pending_;           // connections being authenticated (Acceptor thread)
  Clock::time_point accept_paused_until_{};  // Acceptor thread: see accept_new()
  bool registered_ = false;                  // with the Acceptor
  size_t stash_budget_ = kStashBytes;
  std::atomic<bool> aborted_{false};
  std::atomic<bool> announced_{false};
  std::atomic<uint64_t> rejected_{0};
  // stats(): relaxed counts; a message's sender and receiver may be different threads.
  struct Counts {
    std::atomic<uint64_t> sent{0}, received{0}, send_calls{0}, recv_calls{0}, polls{0};
    std::atomic<uint64_t> bytes_received{0}, stashed_bytes{0};
    std::atomic<uint64_t> connects_unreachable{0}, connects_unanswered{0};
  };
  mutable Counts counts_;
};

// Address other hosts can reach this one at: settings.socket_addr (resolved), else the IPv4
// address of settings.socket_ifname, else the first non-loopback IPv4 address, else
// 127.0.0.1.
std::string local_address(const Settings& settings);

}  // namespace smddp
