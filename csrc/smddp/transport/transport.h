// The inter-host transport the collectives talk to, whatever carries the bytes.
//
// Note [Inter-host transports]
// The hierarchical collectives (Note [Hierarchical collectives] in algorithms/comm.h) move
// data between hosts only through this interface: a group makes its rank reachable
// (listen, returning an endpoint that the store hands to the peers), learns the peers'
// endpoints (set_peers), then each collective step posts a set of sends and receives of
// byte spans and progresses them together until all are done (exchange); point-to-point
// receives poll for one message (take). A group that fails tells its peers (announce_failure)
// and stops (abort, shutdown). Every message carries a tag (a collective's sequence number
// and stage, or a user's send/recv tag) and a check (the collective's descriptor): the
// transport must deliver a message only to the receive with its tag, and raise when a
// peer's message for this collective has another check or another tag, naming both calls.
//
// The TCP mesh (transport/tcp/) is the first implementation. A fabric such as libfabric
// over EFA is one new directory, transport/<fabric>/, with a class that implements
// Transport, and one case in make_transport() (transport.cpp): the algorithms do not change.
// It must keep what the algorithms rely on: a send's span may be reused once exchange()
// returns; messages between a pair of ranks with the same tag arrive in order, and a
// peer's sends leave in the order they were posted, also those posted while the exchange
// runs (Note [Pipelined exchanges] in algorithms/comm_hier.cpp); exchange()
// ends with CommError by the operation's deadline naming the peers still missing; and the
// `health` callback runs while it waits (the local ranks' failure flags). Authentication
// (Note [TCP trust model] in tcp/tcp.h) is the transport's own: the group secret is its
// to use.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "smddp/common/common.h"
#include "smddp/common/settings.h"

namespace smddp {

// One message to send or receive. `check` must match on both sides (the collective's
// descriptor hash) or the receiver raises.
struct TransportOp {
  int peer = 0;
  uint64_t tag = 0;
  char* data = nullptr;
  size_t len = 0;
  uint64_t check = 0;
};

// A set of sends and receives a collective step progresses together (Transport::exchange).
// Note [Pipelined exchanges]: the algorithm may post more sends while it runs, from
// `on_received`, so that what arrived is reduced and sent on while the rest still arrives.
struct Exchange {
  std::vector<TransportOp> sends, recvs;
  // Runs, on the exchanging thread, once recvs[i] is whole; may append to `sends`. A peer
  // gets the sends meant for it in the order they were appended; receives with the same
  // peer and tag take that peer's messages with the tag in the order the receives were
  // posted.
  std::function<void(size_t i)> on_received;
  // Work this rank interleaves with the exchange (a shared-memory step of the collective),
  // run between rounds while it returns true (more remains); the exchange does not end
  // before it returned false. It may append to `sends`, and must never wait for this
  // exchange's messages (only for this host's ranks doing the same work).
  std::function<bool()> work;
  // Work that runs beside the exchange without holding it open (Note [Local all-gather
  // during the exchange] in algorithms/comm_hier.cpp): run between rounds until it says
  // kDone; its caller finishes what remains once the exchange returned. It must never wait
  // itself, nor post sends. What it says of the rest: kMoved, it did something (the next
  // round comes at once); kIdle, it waits for this exchange's messages (the exchange sleeps
  // until a socket is ready, as it would without it); kWaiting, it waits for something no
  // socket reports (other local ranks), so the exchange sleeps at most kBesideWaitMs.
  enum class Progress { kMoved, kIdle, kWaiting, kDone };
  std::function<Progress()> background;
  // Runs while the exchange waits and may throw to end it (the local ranks' failure flags).
  std::function<void()> health;
};

// Tags of collective messages: bit 63 set (user send/recv tags are 32-bit), then the
// collective's sequence number, then its stage (0-15) in the algorithm.
inline uint64_t collective_tag(uint64_t seq, int stage) {
  return (1ull << 63) | (seq << 4) | static_cast<uint64_t>(stage);
}
inline bool is_collective_tag(uint64_t tag) { return tag >> 63; }
inline uint64_t seq_of_tag(uint64_t tag) { return (tag & ~(1ull << 63)) >> 4; }

// The budget for messages that arrive before anyone waits for them (a send whose tag no
// posted receive has yet), per pair of ranks: kStashBytes, of which each such message counts
// its length and kStashEntryBytes for its keeping. The TCP mesh applies it per connection
// (Note [TCP trust model] in tcp/tcp.h), the shared-memory rings per channel (Note [Stash
// budget in shared memory] in shm/shm_p2p.cpp): one rule and one limit on either path.
constexpr size_t kStashBytes = size_t(1) << 30;
constexpr size_t kStashEntryBytes = 256;

// What a transport did, counted from its creation: the messages it moved and the system calls
// that moved them, for benchmarks (bench multihost's CPU columns, Note [CPU per byte] in
// benchmarks/multihost_rank.py). Read between calls; each count is exact once the
// calls that made it returned.
struct TransportStats {
  uint64_t messages_sent = 0, messages_received = 0;
  uint64_t send_calls = 0, recv_calls = 0, polls = 0;  // send(2), recv(2), poll(2) in exchanges
  uint64_t bytes_received = 0;                         // message bodies
  uint64_t stashed_bytes = 0;  // bodies read before their receive was posted: copied again
  // Connection attempts the network did not carry, made again (Note [Admission] in tcp.h):
  // connect() answered "unreachable" (no route, address resolution unanswered), or the
  // request had no answer (within the attempt's time, or before the kernel gave up on it).
  uint64_t connects_unreachable = 0, connects_unanswered = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  // Makes this rank reachable: for other hosts when `across_hosts` (where, the transport
  // decides from `settings`), else only for this host's ranks; returns the endpoint the
  // peers need, as one line for the store.
  virtual std::string listen(bool across_hosts, const Settings& settings) = 0;
  // The peers' endpoints by group rank ("" for a rank that does not listen); raises for a
  // malformed one, naming its rank.
  virtual void set_peers(const std::vector<std::string>& endpoints) = 0;

  // Posts every send and receive of `x` and progresses them together until all are done,
  // the sends that `x.on_received` adds included; throws CommError on the deadline (naming
  // the peers still missing), a peer's failure notice, or a mismatch.
  virtual void exchange(Exchange& x, const OpCtx& ctx) = 0;
  // The same for a fixed set of sends and receives.
  void exchange(std::vector<TransportOp> sends, std::vector<TransportOp> recvs, const OpCtx& ctx,
                std::function<void()> health = {}) {
    Exchange x;
    x.sends = std::move(sends);
    x.recvs = std::move(recvs);
    x.health = std::move(health);
    exchange(x, ctx);
  }
  // Takes the next message with `tag` from `peer` into `data` if it has arrived; never
  // blocks past what one message's arrival needs (TcpMesh::take in tcp/tcp.h).
  virtual bool take(int peer, uint64_t tag, char* data, size_t len, const OpCtx& ctx,
                    const std::shared_ptr<void>& data_owner) = 0;
  // A receive from any rank that took its message: what its take() calls claimed from the
  // other peers (those called with `data`) is awaited by nobody now (TcpMesh::release_claims).
  virtual void release_claims(const char* data) { (void)data; }

  // Tells the peers this rank's group failed (Note [Failure notices] in tcp/tcp.h): those it
  // has talked to, and `also_tell`. The first call does it; later ones return.
  virtual void announce_failure(const std::string& why, const std::vector<int>& also_tell) = 0;
  virtual void abort() = 0;     // ends the waits of exchange() and take() at once
  virtual void shutdown() = 0;  // releases connections; idempotent

  // For diagnostics and tests: where this rank listens ("" and 0: it does not), and how
  // many incoming connections it refused.
  virtual const std::string& address() const = 0;
  virtual int port() const = 0;
  virtual uint64_t rejected_connections() const = 0;
  virtual TransportStats stats() const = 0;
};

// The transport for a group's rank (Note [Inter-host transports]): today the TCP mesh.
std::unique_ptr<Transport> make_transport(int rank, int size, std::string secret,
                                          std::string group_name);

}  // namespace smddp
