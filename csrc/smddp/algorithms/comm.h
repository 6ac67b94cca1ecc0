// One group's communicator: finds the hosts through the store, sets up the shared-memory
// transport among the ranks of this host and the TCP mesh between hosts, and composes
// them into the collectives.
//
// Note [Hierarchical collectives]
// Ranks of a host are ordered by group rank, hosts by their lowest group rank. On every host
// each part of the buffer (one per group rank) has a "handler", a rank of that host: the
// part's own rank on its host, and on the other hosts a rank chosen by Note [Unequal hosts]
// in comm_hier.cpp (with L ranks on every host, the rank with the part's local index: the
// ranks with one local index form a "rail"). Reduce-scatter: inside each host a shared-memory
// reduce-scatter gives each handler the host's partial sums of the parts it handles (in fp32
// for bf16/fp16), then every handler sends its partial of a part to the part's rank over TCP
// (one hop, a full mesh), which reduces them in host order. From 3 hosts with equal rank
// counts on, the rail may instead pass the partials around a ring (Note [Rail rings] in
// net_ring.cpp); the group's inter-host algorithm is chosen once (Note [Inter-host algorithms]
// in net_algorithm.h), and small all-reduces may cross by the tree and small collectives by
// halving-doubling instead, chosen per call (Note [Auto by size and host count] in
// net_algorithm.cpp). All-gather is the mirror image: each
// rank sends its part to the part's handlers on the other hosts over TCP, then a shared-memory
// all-gather inside the host.
// All-reduce = reduce-scatter + all-gather over N parts. The reduction order (local ranks in
// order, then hosts in an order fixed by the algorithm) is fixed, so every rank gets
// bit-identical results. SMDDP_FORCE_LOCAL_SIZE=k splits each real host into blocks of k
// consecutive global ranks, so the inter-host path runs on one machine.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "smddp/algorithms/net_algorithm.h"
#include "smddp/common/settings.h"
#include "smddp/common/timeline.h"
#include "smddp/transport/shm/shm.h"
#include "smddp/transport/shm/shm_p2p.h"
#include "smddp/transport/transport.h"

namespace smddp {

namespace shm {
class ReduceScatterSteps;  // algorithms/shm_algos.h
class AllGatherSteps;
}  // namespace shm

// Whether the ranks whose kernel boot_id is my_boot outnumber the CPUs in the union of their
// affinity masks (hex, CPUs 4k..4k+3 in digit k): Note [Hosts that share CPUs] in comm.cpp.
// boot_ids and masks are per group rank; an empty my_boot (unreadable) says no.
bool ranks_outnumber_cpus(const std::vector<std::string>& boot_ids,
                          const std::vector<std::string>& masks, const std::string& my_boot);

// The group's key-value store (c10d::Store in the backend).
class KeyValue {
 public:
  virtual ~KeyValue() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  virtual std::string get(const std::string& key) = 0;  // key known to exist
  virtual bool check(const std::string& key) = 0;
  virtual void remove(const std::string& key) = 0;
};

struct CommConfig {
  int rank = 0;
  int size = 1;
  std::vector<int> global_ranks;  // group rank -> global rank (identity for WORLD)
  std::string group_name;
  // Tests: group rank -> a host number that splits the real hosts further, as
  // SMDDP_FORCE_LOCAL_SIZE does but in any pattern (empty: not used).
  std::vector<int> force_hosts;
  double timeout_s = 1800;
  Settings settings;  // Note [Settings] in settings.h
};

// NetGroup: what the group's inter-host algorithm reads of it (net_algorithm.h).
class Communicator : private NetGroup {
 public:
  Communicator(KeyValue& kv, CommConfig cfg);
  ~Communicator() override;

  const Layout& layout() const override { return layout_; }
  // This group's ranks on this machine outnumber their CPUs (Note [Hosts that share CPUs]).
  bool machine_oversubscribed() const { return machine_oversubscribed_; }
  const CommConfig& config() const { return cfg_; }
  int listen_port() const { return net_->port(); }  // 0: this rank does not listen
  const std::string& listen_address() const { return net_->address(); }
  uint64_t rejected_connections() const { return net_->rejected_connections(); }
  TransportStats transport_stats() const { return net_->stats(); }

  // A context for the next collective: numbers it and sets its deadline.
  OpCtx make_ctx(const char* name, CollDesc desc, OpArgs args, double timeout_s);

  // Collectives. Each call is numbered (OpCtx::seq) and its deadline starts when it runs.
  void allreduce(void* data, size_t count, const Reduction& red, OpCtx ctx);
  void reduce_scatter(const void* in, void* out, size_t count, const Reduction& red, OpCtx ctx);
  // Reduce-scatter of parts of different sizes: counts[p] elements for group rank p, the parts
  // one after the other in `in`; `out` gets counts[rank]. The counts join the call's
  // descriptor (Note [Reduce-scatter of unequal parts] in comm_algos.cpp).
  void reduce_scatter(const void* in, void* out, const std::vector<size_t>& counts,
                      const Reduction& red, OpCtx ctx);
  void allgather(const void* in, void* out, size_t bytes, OpCtx ctx);
  void broadcast(void* data, size_t bytes, int root, OpCtx ctx);
  // Rooted collectives (Note [Rooted collectives] in shm_rooted.h). reduce: `data` is the
  // result on the root, read-only elsewhere. gather: every rank's `bytes` land at
  // outs[rank] on the root (`outs` empty elsewhere). scatter: ins[rank] (`ins` read on the
  // root only, empty elsewhere) lands in each rank's `out`.
  void reduce(void* data, size_t count, const Reduction& red, int root, OpCtx ctx);
  void gather(const void* in, size_t bytes, const std::vector<char*>& outs, int root, OpCtx ctx);
  void scatter(const std::vector<const char*>& ins, size_t bytes, void* out, int root, OpCtx ctx);
  void barrier(OpCtx ctx);
  void alltoall(const void* in, const std::vector<Span>& send, void* out,
                const std::vector<Span>& recv, OpCtx ctx);
  // Point-to-point (tags < 2^32); not numbered as collectives. Peers on this host go through
  // shared memory (Note [Shared-memory point-to-point] in shm.h), others over the mesh.
  void send(const void* data, size_t bytes, int peer, uint32_t tag, OpCtx ctx);
  void recv(void* data, size_t bytes, int peer, uint32_t tag, OpCtx ctx);
  // Receives the next message with `tag` from whichever peer has one first; returns that
  // peer's group rank (Note [Receive from any rank] in backend_p2p.cpp).
  int recv_any(void* data, size_t bytes, uint32_t tag, OpCtx ctx);
  // One attempt at a receive from `peer` (kAnyPeer: any rank), for receives that wait side
  // by side (Note [Receives wait side by side] in receive_poller.cpp): true when a message with
  // `tag` was there and was taken (read to its end, and its sender's rank put in `from`); false
  // when none has arrived yet. Raises when the receive's deadline passed, its peer failed,
  // the group was aborted or is broken (checked every 20 ms). Pass the same `ctx` and
  // `poll` to every attempt of one receive: its deadline starts at the first.
  struct RecvPoll {
    bool started = false;
    Clock::time_point next_check{};
    // Keeps `data` alive; when set, a message from a peer over TCP may be read straight
    // into it, and the mesh holds it until that message is whole (Note [Direct receives
    // over TCP] in tcp_exchange.cpp).
    std::shared_ptr<void> data_owner;
  };
  bool poll_recv(void* data, size_t bytes, int peer, uint32_t tag, OpCtx& ctx, RecvPoll& poll,
                 int* from);
  // Whether messages from `peer` (kAnyPeer: from every other rank) come through the
  // shared-memory rings, which only point-to-point uses (not the TCP mesh).
  bool p2p_in_shared_memory(int peer) const;
  // Non-blocking attempts for the caller's thread (shared-memory peers only): true when the
  // whole send or recv was done now, false when it must be queued.
  bool try_send_now(const void* data, size_t bytes, int peer, uint32_t tag);
  bool try_recv_now(void* data, size_t bytes, int peer, uint32_t tag);

  // Makes all waits fail promptly (shutdown/abort).
  void abort();

  // This rank's tensor pool (nullptr when the group has none: several hosts, or
  // SMDDP_POOL_BYTES=0).
  std::shared_ptr<ShmPool> pool() const { return shm_ ? shm_->pool() : nullptr; }
  // Collectives that read their operands in place from the pools (for tests and stats).
  uint64_t zero_copy_ops() const { return zero_copy_ops_.load(); }
  // Note [Read from the pool] in shm_algos.h: reads of a local peer's operand in its pool,
  // one per peer and step, in reduce-scatter (gather: all-gather) steps.
  uint64_t pool_reads(bool gather) const { return shm_ ? shm_->pool_reads(gather) : 0; }
  // How this group's collectives cross hosts ("mesh", "ring", "halving_doubling"; "none" on
  // one host), chosen once at creation (Note [Inter-host algorithms] in net_algorithm.h):
  // every collective but the small ones the tree or halving-doubling takes
  // (net_tree_max_bytes, net_doubling_max_bytes).
  const char* net_algorithm() const { return net_algos_.main ? net_algos_.main->name() : "none"; }
  // All-reduces of at most this many bytes cross hosts by the tree (0: none; Note [Auto by
  // size and host count] in net_algorithm.cpp).
  size_t net_tree_max_bytes() const { return net_algos_.tree ? net_algos_.tree_max_bytes : 0; }
  // Collectives of this kind of at most this S cross hosts by halving-doubling, where the
  // tree does not take them (0: none; the same Note).
  size_t net_doubling_max_bytes(NetOp op) const {
    return net_algos_.doubling ? net_algos_.doubling_max_bytes[static_cast<size_t>(op)] : 0;
  }
  // Collectives that crossed hosts: all of them, and those of one algorithm.
  uint64_t net_ops() const { return net_ops_.load(); }
  uint64_t net_ops(NetAlgo algorithm) const {
    return net_ops_by_[static_cast<size_t>(algorithm)].load();
  }
  // Network messages a collective received from a rank of this host (tests: the
  // hierarchical collectives keep those in shared memory; all_to_all does not).
  uint64_t local_net_messages() const { return local_net_messages_.load(); }
  // The phases of the collectives across hosts since the last call (SMDDP_TIMELINE=1).
  std::vector<Timeline::Span> take_timeline() { return timeline_.take(); }

 private:
  template <typename F>
  void guarded(OpCtx& ctx, bool numbered, F&& body);
  // guarded()'s halves: raise if an earlier error broke the group; record a failure (this
  // group is broken from now on) and tell the peers.
  void refuse_if_broken(const OpCtx& ctx);
  void mark_broken(const std::exception& e);
  // Set-up, in this order: host records, the mesh (only where needed), the segments.
  void discover(KeyValue& kv, const Deadline& dl);
  // The handlers of every part on every host, and who is told of a failure (Note [Unequal
  // hosts] in comm_hier.cpp); after the layout is known.
  void plan_handlers();
  void connect_mesh(KeyValue& kv, const Deadline& dl);
  void setup_shm(KeyValue& kv, const Deadline& dl);
  void check_local_peers_alive(const std::string& what);
  // Across hosts (comm_hier.cpp, Note [Pipelined exchanges] there). parts: one span per
  // group rank, in elements (reduce_scatter) or bytes (allgather).
  void hier_reduce_scatter(const void* in, const std::vector<Span>& parts, void* dst,
                           const Reduction& red, const OpCtx& ctx);
  void hier_allgather(const void* src, void* out, const std::vector<Span>& parts, const OpCtx& ctx);
  void hier_allreduce(void* data, size_t count, const Reduction& red, const OpCtx& ctx);
  // The algorithm of one collective across hosts (Note [Auto by size and host count] in
  // net_algorithm.cpp), counted, and made the one under way: `bytes` is the call's S.
  NetAlgorithm& start_net_op(NetOp op, size_t bytes);
  // The largest message of a part across hosts, in bytes (Note [A message per local step] in
  // comm_hier.cpp).
  size_t net_chunk_bytes() const;
  class LocalGather;  // below
  // Starts the shared-memory steps that make this host's partial sums of the parts I handle
  // (or points at the input, where it is them), in the phases the algorithm needs.
  void start_host_partials(HostPartials& hp, const void* in, const std::vector<Span>& parts,
                           const Reduction& red, const OpCtx& ctx, const NetAlgorithm& algo);
  // The shared-memory all-gather inside this host of the parts its ranks handle (spans in
  // bytes of `out`), stepped while those parts arrive (Note [Local all-gather during the
  // exchange] in comm_hier.cpp). With one rank per host it does nothing. `parts` and `ctx`
  // must outlive it.
  class LocalGather final : public PartSink {
   public:
    // `own`: where my own part is read from when it is all there now (an all-gather's
    // input); null when it is in its place in `out` and arrives there piece by piece.
    // phase_of: the algorithm's gather_phases() (empty: one phase).
    LocalGather(Communicator& comm, char* out, const std::vector<Span>& parts, const char* own,
                const OpCtx& ctx, std::vector<int> phase_of);
    ~LocalGather() override;
    void arrived(const char* at, size_t len) override;
    Exchange::Progress poll(const shm::ReduceScatterSteps* first) override;
    // The rest, waiting for the other local ranks; every part must have arrived.
    void finish();

   private:
    Communicator& comm_;
    char* out_;
    const std::vector<Span>& parts_;
    const OpCtx& ctx_;
    std::vector<std::vector<int>> owned_;  // handled()
    std::unique_ptr<shm::AllGatherSteps> steps_;
  };
  // Rooted gather/scatter of lens[r] bytes per group rank r (Note [Rooted collectives]);
  // dst / src: one pointer per group rank, on the root only.
  void rooted_gather(const void* in, const std::vector<size_t>& lens, const std::vector<char*>& dst,
                     int root, const OpCtx& ctx);
  void rooted_scatter(const std::vector<const char*>& src, const std::vector<size_t>& lens,
                      void* out, int root, const OpCtx& ctx);
  // The entries of this host's ranks, in local order (empty stays empty).
  template <typename T>
  std::vector<T> local_of(const std::vector<T>& by_rank) const {
    std::vector<T> local;
    if (by_rank.empty()) return local;
    for (int r : layout_.members[layout_.host]) local.push_back(by_rank[r]);
    return local;
  }
  // A collective's TCP exchange, which also ends when a rank of this host fails (it may be
  // the one that learned of a failure on another host).
  void exchange(const std::vector<TransportOp>& sends, const std::vector<TransportOp>& recvs,
                const OpCtx& ctx);
  static uint64_t check_of(const OpCtx& ctx);  // the collective's descriptor, for messages
  // The tag stage of a receiver's acknowledgement to a broadcast's or scatter's root (Note
  // [Roots that disagree across hosts] in comm_algos.cpp); stages 1-7 carry data.
  static constexpr int kRootAck = 8;
  char* scratch(size_t bytes);
  // NetGroup (net_algorithm.h).
  int group_rank() const override { return cfg_.rank; }
  int group_size() const override { return cfg_.size; }
  int handler(int host, int part) const override { return handler_[host][part]; }
  std::vector<std::vector<int>> handled() const override;  // local index -> parts it handles
  int host_of(int group_rank) const override;
  const std::vector<int>& rail() const override { return rail_; }
  std::vector<Span> net_chunks(size_t len, size_t unit) const override;
  uint64_t tag(const OpCtx& ctx, int stage) const override;
  uint64_t check(const OpCtx& ctx) const override { return check_of(ctx); }
  void exchange(Exchange& x, const OpCtx& ctx) override;
  char* incoming(size_t bytes) override;
  char* staging(size_t bytes) override;
  Timeline& timeline() override { return timeline_; }
  const Settings& settings() const override { return cfg_.settings; }

  // What a rank's peer record says (discover()).
  struct PeerInfo {
    std::string real_host;  // machine, boot and IPC namespace
    std::string pid_ns;     // PID namespace
    int pid = 0;
    int cpus = 1;  // CPUs it may run on
  };

  CommConfig cfg_;
  Layout layout_;
  std::vector<PeerInfo> peers_;  // by group rank
  size_t p2p_bytes_ = 0;         // ring per ordered pair of local ranks (0: none)
  int local_cpus_ = 0;           // the fewest CPUs any rank of this host may run on
  // Ranks of this group on this machine outnumber their CPUs (Note [Hosts that share CPUs]).
  bool machine_oversubscribed_ = false;
  Clock::time_point last_setup_check_{};
  std::vector<int> rail_;  // host -> group rank with my local index (uniform layouts only)
  // handler_[h][p]: the rank of host h that handles part p (Note [Unequal hosts]).
  std::vector<std::vector<int>> handler_;
  std::vector<int> host_index_;           // group rank -> host
  std::vector<int> tell_;                 // other hosts' ranks told of a failure
  int local_index(int group_rank) const;  // index on this host, or -1
  bool usable();                          // no earlier error broke the group

  std::unique_ptr<ShmComm> shm_;
  std::unique_ptr<ShmP2P> p2p_;     // nullptr: send/recv all go over the mesh
  std::unique_ptr<Transport> net_;  // between hosts (Note [Inter-host transports])
  std::string secret_, nonce_;
  uint64_t next_seq_ = 0;
  size_t oneshot_bytes_ = 0;
  bool zero_copy_ = false;  // every local rank has a pool: try zero-copy AG/RS
  std::atomic<uint64_t> zero_copy_ops_{0};
  NetAlgorithms net_algos_;  // Note [Inter-host algorithms]; none on one host
  // The algorithm of the collective across hosts under way (net_chunk_bytes reads it).
  const NetAlgorithm* net_now_ = nullptr;
  std::atomic<uint64_t> net_ops_{0};
  std::atomic<uint64_t> net_ops_by_[kNetAlgos] = {};  // by NetAlgo
  std::atomic<uint64_t> local_net_messages_{0};
  std::mutex broken_mu_;                 // guarded() runs on the executor and on the send lane
  std::atomic<uint32_t> poll_round_{0};  // rotates the first peer a receive from any polls
  std::string broken_;                   // first error; the group is unusable afterwards
  std::vector<char> scratch_;
  std::vector<char> incoming_;  // what arrives from other hosts (NetGroup::incoming)
  std::vector<char> staging_;   // partials rounded to the wire type (NetGroup::staging)
  Timeline timeline_;           // Note [Timeline]
};

}  // namespace smddp
