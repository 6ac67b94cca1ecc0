// Intra-host transport: one POSIX shared-memory segment per local rank, mapped by every
// local rank of the group, driven by sequence-numbered progress words.
//
// Note [Step protocol]
// Every collective runs as one or more *steps*; all local ranks run the same steps in the
// same order, numbered 1, 2, 3, ... for the life of the group. Step s uses data buffer
// s % 2 of every segment (double buffering) and has up to three phases. A rank publishes
// its progress as one monotonically increasing 64-bit word:
//     progress = 3 * (s - 1) + phase        phase 1: my data for step s is in my buffer
//                                           phase 2: my reduced slice is in my buffer
//                                           phase 3: I am done reading peers' buffers
// "peer reached (s, phase)" is then one comparison, and a lagging or leading peer is
// unambiguous. Before a rank writes into buffer s % 2 it waits until every peer finished
// step s - 2 (progress >= 3 * (s - 2)), the last step that used that buffer; no trailing
// barrier is needed and a rank can run at most one step ahead of the slowest peer.
// Progress words are stored with release semantics after the data; readers load them with
// acquire semantics before reading the data.
//
// Note [Mismatch detection]
// At the first step of collective number `seq` a rank writes a descriptor (kind, dtype, op,
// count, first step) into desc[seq % 2] of its control block before posting phase 1. Every
// first-step wait then compares the peer's descriptor with its own; a difference raises on
// every rank (each rank checks every peer). Two slots are enough because a rank does not
// overwrite desc[seq % 2] before every peer finished the collective that slot described last
// (RankControl::finished; ShmComm::begin_step). When consecutive collectives all run shm
// steps the buffer wait nearly implies it; a collective that runs none on this rank (a
// gather whose root is on another host, in a multi-host group) would otherwise let a rank
// run two collectives ahead and overwrite a descriptor its peer has yet to compare. Waiting
// for a peer to finish collective seq - 2 cannot deadlock: that only needs what this rank
// did in collectives it has already finished.
//
// Note [Shared-memory point-to-point]
// send/recv between ranks of one host go through a byte ring per ordered pair, in the
// sender's segment (slot `to` of its channel region): a control page with two counters,
// `head` (bytes the sender has written, stored by the sender) and `tail` (bytes the
// receiver has consumed, stored by the receiver), then the ring. A message is a 64-byte
// header {length, tag} followed by its payload, padded to 64 bytes, written in pieces so a
// message larger than the ring streams through it and the receiver copies one piece while
// the sender writes the next. Messages of one pair are read in the order they were sent; a
// receive for another tag moves the message at the head aside (into private memory) and
// reads on, as torch.distributed's tag matching requires. Counters only grow and are
// published with release semantics after the bytes they cover; waits use the same
// spin/yield/futex policy as collectives (ShmComm::wait_word) with their own sleeper words.
// The region is mapped without pre-faulting: a pair that never talks costs no memory (on
// kernels without MADV_POPULATE_WRITE, before 5.14, it is allocated whole at creation). Its
// pages are committed before they are first written (the control pages at creation, the
// ring page by page, a whole message at a time, ShmComm::commit_ring): a write to
// a page that a full /dev/shm cannot back kills the process with SIGBUS, where a commit
// fails and raises.
//
// Note [Segment lifetime]
// A segment is the control block, two data buffers (committed as they are first written,
// Note [One transport per process] in work.h) and, optionally, a tensor pool
// (shm_pool.h). Names are "/smddp_<pid namespace>_<pid>_<nonce>_<host>_<local rank>"
// (segment_name() in shm_names.h) with a 128-bit random nonce from the group's store,
// created O_EXCL with mode 0600; each rank publishes its name through the store. Each rank
// unlinks its own segment as soon as every local rank has mapped it (or on any failure
// during set-up), so nothing stays in /dev/shm after a crash; the mappings live until the
// group is destroyed. A rank killed inside that window (set-up takes milliseconds once all
// ranks arrived) is covered three ways: a SIGTERM with the default disposition unlinks the
// segment before the process dies (UnlinkOnTerm); a local peer that sees it die during
// set-up removes it; and every segment creation first removes the segments of dead
// creators of this PID namespace and user (sweep_dead_segments), which the creator's pid
// in the name makes possible without opening them.
//
// Note [Exits are not failures]
// A waiting rank also checks (every 20 ms) whether its local peers' processes still exist,
// so a rank that died is reported at once instead of at the timeout. But a rank may exit
// normally as soon as its own part of the last collective is done (the last rank out of a
// barrier; the end of a job), while a peer is still inside that collective. So an exited
// peer counts as failed only while the wait still needs something from it: in a
// shared-memory wait, a progress word below the target; in a TCP wait (hierarchical
// collectives, whose last exchange between hosts can outlast a local peer's whole
// collective), that it had not finished the collective (RankControl::finished). A peer that
// exited owing data to another host is still caught: that host sees its connection close.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "smddp/common/common.h"
#include "smddp/transport/shm/shm_names.h"
#include "smddp/transport/shm/shm_pool.h"

namespace smddp {

// Note [Read from the pool] in shm_algos.h: where a rank's step sources of the current
// collective lie in its pool (-1: in its step buffers).
struct PoolSources {
  int64_t reduce_in = -1;   // a reduce-scatter's input
  int64_t gather_out = -1;  // an all-gather's output
  int64_t gather_own = -1;  // an all-gather's own part's source
};

struct alignas(64) DescSlot {
  std::atomic<uint64_t> seq_plus1{0};  // collective seq + 1 (0 = never written); stored last
  uint64_t first_step = 0;
  CollDesc desc;
  int64_t pool_off = -1;  // Note [Zero-copy operands]: the operand's offset in my pool
  PoolSources pooled;     // Note [Read from the pool] in shm_algos.h
  CallSummary call;       // what the peer called, for error messages
};

// Control block at offset 0 of each rank's segment; one cache line per field that another
// rank polls, so pollers never share a line with unrelated writes.
struct RankControl {
  alignas(64) std::atomic<uint64_t> progress{0};  // Note [Step protocol]; written by owner only
  std::atomic<int32_t> cpu{-1};  // CPU the owner last posted from (same writer, same line)
  alignas(64) std::atomic<uint32_t> sleepers{0};  // peers about to sleep on progress/finished
  alignas(64) DescSlot desc[2];                   // Note [Mismatch detection]
  alignas(64) std::atomic<uint32_t> failed{0};    // owner hit an error: message is valid
  char message[480] = {0};
  int32_t pid = 0;
  char pid_ns[24] = {0};  // the owner's PID namespace (pid_namespace_id())
  uint64_t magic = 0;
  // Numbered collectives the owner finished: read by the peers' process checks (Note [Exits
  // are not failures]) and before a descriptor slot is reused (Note [Mismatch detection]).
  // Published like progress (futex on this word, `sleepers` counts its waiters too).
  std::atomic<uint64_t> finished{0};
};

// Note [Shared-memory point-to-point]: one page per channel, one cache line per polled word.
struct ChannelCtl {
  alignas(64) std::atomic<uint64_t> head{0};           // written by the sender
  alignas(64) std::atomic<uint32_t> head_sleepers{0};  // receivers about to sleep on head
  alignas(64) std::atomic<uint64_t> tail{0};           // written by the receiver
  alignas(64) std::atomic<uint32_t> tail_sleepers{0};  // senders about to sleep on tail
};

struct ShmConfig {
  std::string nonce;       // random, from the group's store
  std::string group_name;  // for messages
  int local_rank = 0;
  std::vector<int> group_ranks;  // local index -> rank in the group (for messages)
  size_t buffer_bytes = 0;       // size of each of the two data buffers of a segment
  size_t p2p_bytes = 0;          // ring of each point-to-point channel (0: send/recv use TCP)
  size_t pool_bytes = 0;         // tensor pool at the end of the segment (0: none)
  // Note [Settings] in settings.h:
  size_t chunk_bytes = 0;     // 0: automatic
  int64_t stream_bytes = -1;  // -1: automatic
  int spin_us = 200;
  int worker_spin_us = 20;
  // Waits stop spinning while they keep outlasting the budget (Note [Spin only where it
  // pays] in shm_wait.cpp): for a group whose ranks also serve the network between steps.
  bool spin_adapts = false;
  bool move_off_cpu = false;
  // CPUs the host's ranks may run on: the fewest any of them may use (0: this process's).
  // It chooses the automatic chunk size, which every rank of the segment must agree on.
  int cpus = 0;
  // The group's ranks on this machine, of this host and others, outnumber the CPUs they
  // may run on (Note [Hosts that share CPUs] in comm.cpp): wait as if oversubscribed. Every
  // rank of the segment must agree on it, as on `cpus`.
  bool machine_oversubscribed = false;
};

// CPUs this process may run on (its affinity mask).
int online_cpus();

class ShmComm {
 public:
  explicit ShmComm(ShmConfig cfg);
  ~ShmComm();
  ShmComm(const ShmComm&) = delete;
  ShmComm& operator=(const ShmComm&) = delete;

  // Set-up, in this order across ranks: create() on all, attach() on all (with the names
  // the peers' create() chose), unlink_own().
  void create();
  const std::string& name() const { return name_; }
  void attach(int peer, const std::string& name);
  void unlink_own();

  int rank() const { return cfg_.local_rank; }
  int size() const { return static_cast<int>(cfg_.group_ranks.size()); }
  int group_rank(int local) const { return cfg_.group_ranks[local]; }
  const std::string& group_name() const { return cfg_.group_name; }
  size_t buffer_bytes() const { return cfg_.buffer_bytes; }
  // Bytes one rank moves per pipelined step: small enough that a step's data stays in cache.
  size_t chunk_bytes() const { return chunk_bytes_; }
  // Whether copies into a user output of `bytes` per rank should bypass the cache
  // (copy_streaming): when the local ranks' outputs together exceed about half the shared
  // cache they would be evicted before anyone reads them (SMDDP_STREAM_BYTES overrides the
  // per-rank threshold; 0 turns streaming off).
  bool stream_output(size_t bytes) const { return stream_bytes_ && bytes >= stream_bytes_; }

  // Note [Step protocol]. begin_step waits until buffer s % 2 may be reused and, for the
  // first step of a collective, publishes this rank's descriptor.
  uint64_t begin_step(const OpCtx& ctx, bool first);
  char* mine(uint64_t s) { return data_[rank()] + (s & 1) * cfg_.buffer_bytes; }
  // My buffer of step s at `off`, where the caller writes `len` bytes that no step wrote
  // before: the granules they cover are committed first (Note [One transport per
  // process] in work.h). Raises a CommError when /dev/shm has no room for them.
  char* mine(uint64_t s, size_t off, size_t len) {
    if (len && lazy_) writable(s & 1, off, len);
    return mine(s) + off;
  }
  const char* peer(int i, uint64_t s) const { return data_[i] + (s & 1) * cfg_.buffer_bytes; }
  void post(uint64_t s, int phase);
  void wait_one(int i, uint64_t s, int phase, const OpCtx& ctx);
  // Without waiting (Note [Local all-gather during the exchange] in comm_hier.cpp): whether
  // begin_step(ctx, first) would return at once, and whether local rank i reached (s, phase)
  // (checking its descriptor on the first step, as wait_one does). The caller checks the
  // peers' health and the deadline itself while it polls.
  bool step_open(const OpCtx& ctx, bool first) const;
  bool reached(int i, uint64_t s, int phase, const OpCtx& ctx);
  void wait_all(uint64_t s, int phase, const OpCtx& ctx);
  void end_step(uint64_t s) { post(s, 3); }

  // Tensor pools (Note [Zero-copy operands] in shm_algos.h): this rank's allocator, and
  // every local rank's pool as mapped here (nullptr when the group has no pools).
  const std::shared_ptr<ShmPool>& pool() const { return pool_; }
  const char* pool_base(int i) const { return pool_base_[i]; }
  // The pool offset of this rank's operand of the current collective (-1: not in the
  // pool), published with the first step's phase 1; peers read it after waiting for it.
  void publish_operand(const OpCtx& ctx, int64_t offset);
  int64_t operand_of(int i, const OpCtx& ctx) const;
  size_t pool_bytes() const { return cfg_.pool_bytes; }
  // Note [Read from the pool] in shm_algos.h: where this rank's steps of the current
  // collective leave their sources in its pool, written before the first step's phase 1 of
  // the steps concerned; peers read them after waiting for it.
  PoolSources& my_sources(const OpCtx& ctx) { return ctl(rank())->desc[ctx.seq & 1].pooled; }
  const PoolSources& sources_of(int i, const OpCtx& ctx) const {
    return ctl(i)->desc[ctx.seq & 1].pooled;
  }
  // Reads of a local peer's sources in its pool, one per peer and step, for stats: [0] in
  // reduce-scatter steps, [1] in all-gather steps.
  void count_pool_read(bool gather) { pool_reads_[gather].fetch_add(1, std::memory_order_relaxed); }
  uint64_t pool_reads(bool gather) const {
    return pool_reads_[gather].load(std::memory_order_relaxed);
  }

  // Note [Shared-memory point-to-point]: the channel from local rank `from` to `to` (in
  // `from`'s segment) and its ring; only when p2p_bytes() > 0.
  size_t p2p_bytes() const { return cfg_.p2p_bytes; }
  ChannelCtl* channel(int from, int to) const {
    return reinterpret_cast<ChannelCtl*>(p2p_base_[from] + to * channel_slot());
  }
  char* ring(int from, int to) const { return p2p_base_[from] + to * channel_slot() + 4096; }
  // Commits bytes [off, off + len) of this rank's ring to local rank `to` before they are
  // first written; throws a CommError naming /dev/shm when it has no room for them.
  void commit_ring(int to, size_t off, size_t len);
  // Waits until `word` (owned by local rank i) reaches `target`, with the waiting policy of
  // collectives; `health` runs now and then and throws to end the wait (peer gone,
  // deadline, shutdown). `adapt`: a collective step's wait, whose spin may adapt (Note [Spin
  // only where it pays] in shm_wait.cpp).
  void wait_word(int i, const std::atomic<uint64_t>& word, std::atomic<uint32_t>& sleepers,
                 uint64_t target, const std::function<void()>& health, bool adapt = false);
  // Stores `value` into `word` and wakes whoever sleeps on it.
  static void publish(std::atomic<uint64_t>& word, std::atomic<uint32_t>& sleepers, uint64_t value);
  // Throws a CommError if this group was aborted, or local rank i failed or exited, or the
  // deadline of `ctx` passed; `waiting_for` ends the timeout message.
  void check_peer(int i, const OpCtx& ctx, const std::string& waiting_for);

  // Throws a CommError (after marking this rank failed) if this group was aborted, or any
  // local rank failed, or exited while the caller's wait still needs it (Note [Exits are
  // not failures]): in a shared-memory wait, before its progress reached `needed_progress`;
  // in a TCP wait (no `needed_progress`), before it finished collective `ctx.seq`.
  void check_local_peers(const OpCtx& ctx, std::optional<uint64_t> needed_progress = std::nullopt);

  // Records that this rank finished numbered collective `seq`.
  void mark_finished(uint64_t seq);
  // Waits until local rank i finished numbered collective seq_plus1 - 1.
  void wait_finished(int i, uint64_t seq_plus1, const OpCtx& ctx);

  // Tells the local peers that this rank failed (they raise instead of waiting).
  void mark_failed(const std::string& message);
  // Makes every wait of this rank throw promptly (group shutdown/abort).
  void abort() { aborted_.store(true); }
  bool aborted() const { return aborted_.load(); }
  // Local rank i failed (its flag) or its process is gone (when that can be judged).
  bool peer_failed(int i) const { return ctl(i)->failed.load(std::memory_order_acquire); }
  bool peer_lost(int i) const {
    return ctl(i)->failed.load(std::memory_order_acquire) || process_gone(i);
  }

 private:
  static uint64_t value(uint64_t s, int phase) { return 3 * (s - 1) + phase; }
  void wait_progress(int i, uint64_t target, const OpCtx& ctx);
  void check_health(int i, uint64_t target, const OpCtx& ctx);
  std::string where(
      const OpCtx& ctx) const;               // "smddp: <collective> on group '<g>' (collective #N)"
  std::string failure_message(int i) const;  // what local rank i wrote when it failed
  bool process_gone(int i) const;            // local rank i's process exited (if judgeable)
  void check_desc(int i, const OpCtx& ctx);
  [[noreturn]] void fail(const std::string& message);
  RankControl* ctl(int i) const { return ctl_[i]; }
  void writable(uint64_t buffer, size_t off, size_t len);
  size_t channel_slot() const { return 4096 + cfg_.p2p_bytes; }
  size_t p2p_region_bytes() const { return cfg_.p2p_bytes ? size() * channel_slot() : 0; }

  ShmConfig cfg_;
  size_t seg_bytes_ = 0;   // whole segment: control block, data buffers, pool
  size_t main_bytes_ = 0;  // control block and data buffers (mapped pre-faulted)
  std::shared_ptr<ShmPool> pool_;
  std::vector<char*> pool_base_;
  std::vector<char*> p2p_base_;  // every local rank's channel region as mapped here
  std::vector<RankControl*> ctl_;
  std::vector<char*> data_;
  std::vector<void*> maps_;
  std::string name_;  // of my segment
  bool own_linked_ = false;
  std::unique_ptr<UnlinkOnTerm> term_guard_;  // while my segment is linked
  // Data buffers committed lazily, in 64 granules each (Note [One transport per process]
  // in work.h); false on kernels that cannot (the buffers are then pre-faulted whole).
  bool lazy_ = false;
  int granule_shift_ = 12;
  uint64_t committed_[2] = {0, 0};  // bit g: granule g of buffer 0 / 1 is committed
  uint64_t next_step_ = 1;
  uint64_t first_step_ = 0;  // first step of the current collective
  // seq + 1 of the collective that desc[i] describes (0: none yet).
  uint64_t slot_seq_plus1_[2] = {0, 0};
  uint64_t current_seq_plus1_ = 0;  // collective whose descriptor was published last
  std::vector<uint8_t> checked_;    // peers whose descriptor matched in this collective
  std::atomic<bool> aborted_{false};
  // mark_failed() claimed my control block's message: threads of this rank that fail at once
  // (a collective and a receive) must not write it together while a peer may read it.
  std::atomic<bool> failing_{false};
  std::atomic<uint64_t> pool_reads_[2] = {0, 0};  // count_pool_read()
  bool oversubscribed_ = false;  // more ranks than CPUs here, or on the machine: no busy spin
  int spin_us_ = 200;            // busy-spin budget per wait, caller thread
  int worker_spin_us_ = 20;      // same on worker threads
  // Waits in a row that outlasted their spin budget (Note [Spin only where it pays]).
  // Per budget: [0] the caller thread's, [1] worker threads'.
  static constexpr int kSpinMissesToStop = 2;
  std::atomic<int> spin_misses_[2] = {0, 0};
  size_t chunk_bytes_ = 0;   // pipeline chunk, <= buffer_bytes
  size_t stream_bytes_ = 0;  // see stream_output()
};

}  // namespace smddp
