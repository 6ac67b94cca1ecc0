// Collective algorithms over the shared-memory step protocol (Note [Step protocol] in
// shm.h). All functions are called by every local rank of the group with matching
// arguments; pointers are plain host memory (the caller staged non-contiguous tensors).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "smddp/transport/shm/shm.h"

namespace smddp {
namespace shm {

// In-place allreduce when the whole group is on this host. Up to `oneshot_bytes`: every
// rank copies its input into its buffer and reduces all buffers in rank order (one sync).
// Larger: chunked reduce-scatter + all-gather through the buffers, so every chunk is
// reduced once by its owner and stays in cache between the phases (two syncs per chunk).
// Both reduce in rank order, so they give the same bits.
//
// Note [My slice stays home]
// In the two-shot algorithm each rank reduces one slice of the chunk, and no peer reads the
// owner's own input for that slice. So a rank stages only the other slices ((n-1)/n of
// the chunk) and reads its own contribution to its slice straight from its input: 1/n less
// copied into the segment per step, the same values reduced in the same order. A PREMUL_SUM
// with a factor other than 1 still stages the whole chunk, since the copy in is where the
// factor is applied. 2 ranks, all_reduce_direct, float32, alternating builds: 64 KiB
// 10.8 -> 10.0 us; 1 MiB and 4 MiB the same within the noise (67-69 and 270-284 us).
// ReduceScatterSteps does the same with the parts only this rank reduces: a hierarchical
// all-reduce or reduce-scatter with 2 ranks per host copies half its input into the segment
// instead of all of it. Reading the input there is safe for its callers: on one host the
// output may overlap the input only at this rank's own block (apart_from in op_helpers.h),
// so a step reads and writes the same elements; across hosts the steps write a scratch
// buffer, and whatever is later written into the input in place (reduced chunks, all-gather
// data) reaches a chunk only after the step that read it, since ready() passed it first.
// reduce_scatter_tensor on one host of 2 ranks, float32, alternating builds (bench collectives
// --repeat 3; three runs before, five after): 4 MiB 257-308 -> 159-205 us, other sizes from 64 KiB
// to 64 MiB level within the noise. On 4 hosts of 2 ranks (bench multihost, 2 Gbit/s, 64 MiB
// reduce_scatter, four rounds each) each rank's shared-memory steps were busy 62-64 ms instead of
// 72-80; the calls' times stayed within the noise.
//
// Note [One-shot threshold]
// The one-shot algorithm saves a sync but every rank reads all n buffers, (n-1)S bytes
// written by other cores, and reduces S elements n ways; the two-shot one reads 2(n-1)S/n
// and reduces S/n. Reads of lines another core just wrote are what small all-reduces cost
// here (a 64 KiB copy takes 1.2 us on one core; in a 2-rank 64 KiB all-reduce of 13.8 us,
// perf put 38% of the samples in the copy into the segment a peer read the step before),
// so the two-shot algorithm wins from a few KiB on. Measured with
// all_reduce_direct, float32, medians of 5-15 runs of 2000 calls, both thresholds in one
// process tree (2-core VM), oneshot_bytes 256K (the old default) -> 0:
//   2 ranks: 2K 1.17 -> 1.06 us, 4K 1.42 -> 1.18, 64K 11.8 -> 10.8, 256K 39.1 -> 32.1
//   4 ranks (more ranks than cores): 4K 8.5 -> 10.8, 16K 15.2 -> 11.5, 64K 41.6 -> 28.7,
//   256K 131 -> 63
// Below 1 KiB the one sync is worth more than the reads, and with more ranks than cores
// (where a sync is a hand-off between processes on one core) up to about 8 KiB; hence 4K.
void allreduce(ShmComm& c, void* data, size_t count, const Reduction& red, const OpCtx& ctx,
               size_t oneshot_bytes);

// Reduce-scatter over N "parts" of `in` (element spans indexed by group rank). Local rank i
// reduces, over all local ranks in local order, the parts listed in owned[i], writing part
// owned[me][k] to dst[k]: the final result (`finish`, element type red.dtype) or a partial
// sum in acc_type(red.dtype) for a later inter-host stage.
void reduce_scatter(ShmComm& c, const void* in, const std::vector<Span>& parts,
                    const std::vector<std::vector<int>>& owned, const std::vector<void*>& dst,
                    const Reduction& red, bool finish, const OpCtx& ctx);

// The phases of a collective's local steps (Note [Parts in the order the ring needs them] in
// net_ring.cpp): each part's phase, its slot in a step buffer, and what a phase's steps
// span. groups[g] lists parts whose slots one step buffer numbers together, in order: a
// rank's own parts for an all-gather; none (one group of every part, in order) for a
// reduce-scatter, whose buffers hold a chunk of every part. A phase's parts take
// consecutive slots. Without phases (phase_of empty) there is one phase of every part, each
// part's slot is its place in its group, and nothing per part is kept.
class StepPhases {
 public:
  StepPhases(std::vector<int> phase_of, const std::vector<Span>& parts,
             const std::vector<std::vector<int>>& groups, const char* collective);
  size_t phase(size_t part) const { return phase_of_.empty() ? 0 : phase_of_[part]; }
  // The slot of groups[g][k] in the step buffers of its phase.
  size_t slot(size_t g, size_t k) const { return slot_.empty() ? k : slot_[g][k]; }
  // The most slots one group takes in phase ph (at least 1), and its longest part.
  size_t ways(size_t ph) const { return std::max<size_t>(at(ph).ways, 1); }
  size_t maxlen(size_t ph) const { return at(ph).maxlen; }
  // The first phase to run, and the one after ph: empty phases are skipped, but a
  // collective of empty parts still runs its one step. count(): past the last.
  size_t first() const;
  size_t after(size_t ph) const;
  size_t count() const { return phase_of_.empty() ? 1 : phases_.size(); }

 private:
  struct Phase {
    size_t ways = 0, maxlen = 0;
  };
  // Without phases the one phase is kept inline: every local collective builds a
  // StepPhases, and the single-host ones should allocate nothing for it.
  const Phase& at(size_t ph) const { return phase_of_.empty() ? only_ : phases_[ph]; }

  std::vector<int> phase_of_;              // per part
  std::vector<std::vector<size_t>> slot_;  // per group and place in it
  std::vector<Phase> phases_;              // per phase, with phases
  Phase only_;                             // the one phase, without
};

// The same reduce-scatter one step at a time, for a caller that does other work between
// steps (Note [Pipelined exchanges] in comm_hier.cpp). Every local rank must run every
// step, in order; a step waits only for the other local ranks' same step. The arguments
// must outlive the object.
//
// phase_of, if not empty, gives each part a phase: the steps finish the parts of phase 0,
// then those of phase 1, and so on, each phase's steps carrying a chunk of each of its parts
// only (Note [Parts in the order the ring needs them] in net_ring.cpp). Every local rank
// must pass the same phases. Empty: one phase, every part.
class ReduceScatterSteps {
 public:
  ReduceScatterSteps(ShmComm& c, const void* in, const std::vector<Span>& parts,
                     const std::vector<std::vector<int>>& owned, const std::vector<void*>& dst,
                     const Reduction& red, bool finish, const OpCtx& ctx,
                     std::vector<int> phase_of = {});
  bool done() const { return done_; }
  // Elements from the start of part p, one this rank reduces (in owned[me]), that are final
  // in dst (all of them once done).
  size_t ready(int p) const;
  // Writes dst[k] (the k-th part of owned[me]) in type t instead of the accumulation type:
  // each element the sum in the accumulation type rounded once (Note [Partials made in the
  // wire type] in comm_hier.cpp). Before the first step.
  void set_out_type(size_t k, DType t);
  void step();
  // Note [Read from the pool]: waits until every peer ended my last step, where peers read
  // my input in my pool; at once otherwise. Before the input may change.
  void finish_reads();

 private:
  // Enters phase ph (its chunk and longest part), or ends the steps if ph is past the last.
  void enter(size_t ph);
  // Note [Read from the pool]: where each peer's input lies, once all posted the first step.
  void learn_sources();
  size_t phase(size_t p) const { return phases_.phase(p); }
  size_t slot(size_t p) const { return phases_.slot(0, p); }  // the one group: every part

  ShmComm& c_;
  const char* src_;
  const std::vector<Span>& parts_;
  const std::vector<std::vector<int>>& owned_;
  const std::vector<void*>& dst_;
  const Reduction& red_;
  bool finish_;
  const OpCtx& ctx_;
  size_t esz_, next_ = 0, chunk_ = 0, maxlen_ = 0;  // chunk_, maxlen_: the phase's
  std::vector<DType> out_t_;  // per part of owned[me]: the type dst[k] is written in
  bool first_ = true, done_ = false;
  std::vector<const void*> srcs_;
  // Per part: whether this rank copies it into its buffer: another local rank reduces it, or
  // a PREMUL_SUM factor is applied in the copy (Note [My slice stays home]).
  std::vector<uint8_t> staged_;
  StepPhases phases_;
  size_t phase_ = 0;  // the phase under way
  // Note [Read from the pool]: my input's offset in my pool (-1: staged), each peer's as it
  // published it, and my last step.
  int64_t pool_in_ = -1;
  std::vector<int64_t> peer_in_;
  uint64_t last_s_ = 0;
};

// All-gather over parts given in bytes: local rank i contributes the parts owned[i], this
// rank reading its own from src[k] for owned[me][k]; every rank writes every part p to
// out + parts[p].off. A source that already is its place in `out` is not copied.
void allgather(ShmComm& c, const std::vector<const void*>& src, void* out,
               const std::vector<Span>& parts, const std::vector<std::vector<int>>& owned,
               const OpCtx& ctx);

// The same all-gather's steps, for a caller whose own parts become readable piece by piece
// while it does other work (Note [Local all-gather during the exchange] in comm_hier.cpp).
// It writes the other ranks' parts into `out`; this rank's own parts are the caller's to
// put in place. Every local rank must run every step, in order. poll() runs what can run
// without waiting, one step at most, so that its caller gets back to its own work soon: a
// step starts once the step's pieces of my parts are ready (set_ready) and the buffers are
// free, and reads each peer as soon as that peer posted. finish() waits for the rest, once
// every part is ready, and must be called before `out` and the sources may change (Note
// [Read from the pool]). The arguments must outlive the object.
//
// Note [Read from the pool]
// A rank whose operand is in its tensor pool (FSDP2's all-gather output and reduce-scatter
// input are: Note [Zero-copy operands]) does not copy its pieces into its step buffer: its
// peers read them where they lie, through their mapping of its pool. For an all-gather the
// output must be there and its own part's source too (in place in the output, as FSDP2
// passes it); for a reduce-scatter (or an all-reduce's first half) the input, unless a
// PREMUL_SUM factor is applied in the copy. The steps, their order and their waits stay as
// they are (a step is still posted only once its pieces are ready), so only the copies into
// the segment go: on 2 ranks a host, half the user-space copies of a hierarchical
// all-gather, whose local step copied every part twice, and all of a reduce-scatter's.
// Each rank chooses alone, from its own operands, and publishes where its sources lie
// before the first step's phase 1 of the steps concerned (DescSlot::pooled); a peer reads
// that after waiting for the phase, so ranks of one host may mix both ways.
//
// What it costs: the rank may not return (and its caller may not change the operand)
// until every peer has read its last step, so finish()/finish_reads() wait for every peer's
// end of that step; and a peer that failed may have returned, and its caller reused the
// memory, while this rank still read it, so after reading a peer's pool this rank checks
// that the peer has not failed (a failing rank marks itself failed before its call
// returns), after a fence that keeps its reads before that check, and raises if it has. The copies
// and reductions read the same bytes as through the buffers, in the same order: results do not
// change. Not used below kZeroCopyMinBytes, where the extra wait would cost more than the copies.
//
// In place, an all-reduce's reduce-scatter reads a peer's input where the same
// collective later writes: a part p of a rank's data is read by p's handler on its host
// only, and written only by that handler's all-gather pieces of p or, where the rank
// handles p itself, by its own exchange, which no peer reads. A handler posts a piece of p
// only once that chunk of p is final, which needs its host partial of the chunk (the
// part's own rank's reduction, or another host's, waits for it), which its reduce-scatter
// step made after reading the chunk. So no piece is overwritten before it was read.
class AllGatherSteps {
 public:
  // phase_of as for ReduceScatterSteps: the steps gather the parts of phase 0 first, each
  // phase's steps carrying a chunk of its parts only (Note [Parts in the order the ring needs
  // them] in net_ring.cpp). Empty: one phase, every part.
  AllGatherSteps(ShmComm& c, std::vector<const void*> src, void* out,
                 const std::vector<Span>& parts, const std::vector<std::vector<int>>& owned,
                 const OpCtx& ctx, std::vector<int> phase_of = {});
  // The first `bytes` of my k-th part (owned[me][k]) may be read from src[k].
  void set_ready(size_t k, size_t bytes) { ready_[k] = std::max(ready_[k], bytes); }
  size_t ready(size_t k) const { return ready_[k]; }
  void set_all_ready();
  bool done() const { return done_; }
  // Runs what needs no wait; true when it moved anything.
  bool poll() { return advance(false); }
  // Whether the last poll() that moved nothing stopped for another local rank (a peer's
  // post, or buffers a peer still reads), not for my own parts.
  bool waiting_on_peers() const { return on_peers_; }
  void finish();

 private:
  bool advance(bool wait);
  // Enters phase ph (its chunk and longest part), or ends the steps if ph is past the last.
  void enter(size_t ph);
  // Note [Read from the pool]: where my parts lie in my pool, decided at construction.
  void choose_pool_sources();
  // Where local rank i's piece at offset o of its k-th part lies: its step buffer or its pool.
  const char* peer_piece(int i, size_t k, size_t o) const;
  // Learns where peer i's parts lie, once it posted the first step.
  void learn_sources(int i);

  ShmComm& c_;
  std::vector<const void*> src_;
  char* out_;
  const std::vector<Span>& parts_;
  const std::vector<std::vector<int>>& owned_;
  const OpCtx& ctx_;
  std::vector<size_t> ready_;
  size_t maxlen_ = 0, chunk_ = 0, o_ = 0;
  bool stream_ = false, first_ = true, done_ = false, on_peers_ = false;
  uint64_t s_ = 0;             // the step under way (0: none)
  std::vector<uint8_t> read_;  // peers whose pieces of step s_ were copied
  StepPhases phases_;          // groups: owned (each rank's buffer holds its own parts)
  size_t phase_ = 0;           // the phase under way
  // Note [Read from the pool]: my output's and my own part's offsets in my pool (-1:
  // my pieces go through my step buffers); each peer's as it published them (kUnknown
  // until read); the last step, which every peer must end before finish() returns.
  static constexpr int64_t kUnknown = -2;
  int64_t pool_out_ = -1, pool_own_ = -1;
  std::vector<int64_t> peer_out_, peer_own_;
  uint64_t last_s_ = 0;
};

// Note [Zero-copy operands]
// A tensor the backend allocated from a rank's pool (ProcessGroupSMDDP::allocateTensor;
// FSDP2 asks for its all-gather output and reduce-scatter input that way) lives in shared
// memory every local peer has mapped, so peers can read it where it is instead of through
// a staging copy. Each rank publishes its operand's pool offset (or -1) in the first step's
// descriptor slot; after phase 1 every rank has seen every offset and all take the same
// path: zero-copy when every operand is in a pool, the staged algorithm otherwise. Phase 2
// of the same step says "I finished reading your operand"; a rank returns only after every
// peer reached it, because the caller may free or overwrite the operand once the collective
// returns. The cost for operands outside the pools is that one extra step, so the
// handshake runs only from kZeroCopyMinBytes up.
constexpr size_t kZeroCopyMinBytes = 64 << 10;

// All-gather of equal `bytes`-sized parts, in rank order, with `in` possibly a view of this
// rank's part of `out`. Returns false, having changed nothing, when some operand is not in
// a pool (the caller then runs allgather()).
bool allgather_zero_copy(ShmComm& c, const void* in, void* out, size_t bytes, const OpCtx& ctx);

// Reduce-scatter of `count` elements per rank: this rank reduces, in rank order, block
// `rank` of every peer's `in` (read in place) into `out`. Returns false as above. Not for
// PREMUL_SUM with a factor (the factor is applied by the staging copy).
bool reduce_scatter_zero_copy(ShmComm& c, const void* in, void* out, size_t count,
                              const Reduction& red, const OpCtx& ctx);

// Broadcast `bytes` from local rank `root`.
void broadcast(ShmComm& c, void* data, size_t bytes, int root, const OpCtx& ctx);

void barrier(ShmComm& c, const OpCtx& ctx);

// All-to-all with byte spans: send[j] goes to local rank j, recv[j] comes from it. Split
// sizes are exchanged first and checked for consistency on every rank.
void alltoall(ShmComm& c, const void* in, const std::vector<Span>& send, void* out,
              const std::vector<Span>& recv, const OpCtx& ctx);

// Note [Step buffer minimum]
// A step buffer (SMDDP_BUFFER_BYTES rounded up to pages; a segment has two) must hold what
// one step of each shared-memory algorithm puts there, for L ranks on a host and N ranks in
// the group:
// - scatter: a slot of at least 64 bytes (a cache line) per local rank: 64 L;
// - all_to_all: its first step, a table of two 8-byte sizes per local rank: 16 L;
// - the reduce-scatter steps (reduce_scatter, and the local half of the hierarchical
//   collectives): one element, 8 bytes at most, of each part, and there is a part per rank
//   of the group, on every host: 8 N;
// - the all-gather steps: one byte of each part a local rank contributes: N at most;
// - the others (all_reduce on one host, reduce, gather, broadcast) move at most a pipeline
//   chunk per step, and a chunk is at most the buffer.
// Below that, scatter wrote its slots past the end of the buffer, all_to_all its table, and
// chunk_elems fell back to one element per part, whose slots then ended past it too: into the
// other step buffer, or beyond the mapping. So group creation refuses such a buffer
// (Communicator::discover) with L the most ranks any host has, which every rank of the group
// computes alike, so all of them raise; and the algorithms check again before they write (a
// failure there is a bug). The least value the settings allow (4K) is enough for 64 ranks on
// a host in a group of up to 512 ranks; the default (1M) for 16384 on a host.
constexpr size_t kScatterSlotMin = 64;      // bytes per local rank
constexpr size_t kAlltoallTableEntry = 16;  // bytes per local rank
constexpr size_t kLargestElement = 8;       // bytes (dtype_size's largest)
size_t min_buffer_bytes(size_t local_size, size_t group_size);

}  // namespace shm
}  // namespace smddp
