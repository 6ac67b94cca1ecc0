// How a group's collectives cross hosts: one interface, one file per algorithm.
//
// Note [Inter-host algorithms]
// A collective across hosts is shared memory inside each host and an exchange between hosts
// (Note [Hierarchical collectives] in comm.h). comm_hier.cpp does what every algorithm
// shares: it cuts the buffer into parts, starts the shared-memory steps that make this host's
// partial sums (HostPartials) and the shared-memory all-gather that spreads what arrives
// (PartSink), and hands the exchange to the group's NetAlgorithm as one NetJob:
//   - reduce-scatter: `partials` set, `dst` the result of my part;
//   - all-gather: `ag_out` set, the parts arriving into it;
//   - all-reduce: both, and each reduced chunk of my part goes on as the all-gather's data.
// The algorithm decides which messages cross and in what order the partials are reduced; it
// reads the group through NetGroup and nothing else. choose_net_algorithms picks, when the
// group is created, from the layout and settings every rank shares, the group's algorithm
// (every collective's, for its whole life) and whether small collectives take the tree or
// halving-doubling instead; NetAlgorithms::pick then chooses per call from what every rank
// of the call shares (Note [Auto by size and host count] in net_algorithm.cpp), so every
// rank picks the same. Today: the
// mesh (net_mesh.cpp, every host to every other in one hop), the ring (net_ring.cpp, each
// host to the next), recursive halving-doubling (net_halving_doubling.cpp, log2 H rounds of
// one peer each) and the tree (net_tree.cpp, all-reduces only: log2 H rounds of the whole
// data). Another is one new file: a NetAlgorithm subclass, its make_* declared below, and
// its line in choose_net_algorithms.
//
// Note [Half precision on the wire]
// bf16 and fp16 reductions used to send their partial sums between hosts in fp32, the
// accumulation type: twice the bytes of the tensor's own dtype, so the NIC carried a bf16
// all_reduce at half its rate (0.58-0.61 of the bound of the bf16 bytes on 2 Gbit/s simulated
// hosts, where fp32 reached 0.89-0.94). Now they cross in the tensor's dtype (the wire type,
// wire_type()), and everything else still accumulates in fp32:
//   - inside a host, the shared-memory reduce-scatter sums the L local ranks' inputs in fp32;
//   - each host partial is rounded once to the wire type where it leaves for another host
//     (with one rank per host it is the input itself, nothing is rounded);
//   - the part's owner (the mesh) or each ring step sums what arrived in fp32, with this
//     host's own partial unrounded, and rounds once where it stores: the result, or the ring's
//     running sum that goes on.
// So with unit roundoff u (2^-8 for bf16, 2^-11 for fp16), a result r = sum over hosts of
// partials P_h carries at most the error of H-1 rounded partials (|P_h| u each, the own one
// exact), of the ring's H-2 rounded running sums (the mesh has none), of the fp32 sums
// (about N 2^-24 of the sum of magnitudes), and one final rounding of r (|r| u). NCCL's ring
// over N = H L ranks rounds its running sum at every hop: N-1 roundings, each of a sum of
// up to N-1 inputs. Ours rounds H-1 partials on the mesh, plus H-2 sums on the ring, so
// never more often, and each of our rounded values is a sum of L inputs at most where a
// hop's is up to N-1. Halving-doubling and the tree round each partial inside at most
// ceil(log2 H) values (Note [Halving and doubling between hosts], Note [A tree for small
// all-reduces]). tests/distributed/test_smddp_net_precision.py measures them against an fp64
// reference. Results stay bit-identical on every rank: the owner's result is what
// every rank gets, and the order of every sum is fixed as before.
// fp16 partials can overflow (65504) where fp32 ones would not, as NCCL's fp16 sums can: a
// sum of L large gradients before an AVG's division. SMDDP_NET_REDUCE_DTYPE=fp32
// (SMDDPOptions(net_reduce_dtype="fp32")) keeps fp32 on the wire for such jobs, at twice the
// bytes; every rank must share it, since it sets every message's length.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "smddp/common/common.h"
#include "smddp/common/settings.h"
#include "smddp/common/timeline.h"
#include "smddp/transport/transport.h"

namespace smddp {

namespace shm {
class ReduceScatterSteps;  // algorithms/shm_algos.h
}  // namespace shm

class NetGroup;

struct Layout {
  int hosts = 1, host = 0, local_rank = 0;
  int local_size = 1;                     // ranks on this rank's host
  std::vector<std::vector<int>> members;  // host -> group ranks on it (ascending)
  bool forced = false;                    // SMDDP_FORCE_LOCAL_SIZE (or force_hosts) in effect
  bool uniform = true;                    // every host has as many ranks (Note [Unequal hosts])
};

// Copies `len` bytes a slice per call and says whether more remain: an exchange's work
// (Exchange::work; Note [Own part during the exchange] in comm_hier.cpp).
struct SliceCopy {
  char* dst = nullptr;
  const char* src = nullptr;
  size_t len = 0;
  size_t done = 0;
  bool operator()();
};

// The element type bf16/fp16 partial sums cross hosts in (Note [Half precision on the wire]):
// the tensor's own unless the settings keep fp32; other dtypes cross as they are.
DType wire_type(DType t, const Settings& s);

// This host's partial sums of the parts a rank handles (Note [Pipelined exchanges] in
// comm_hier.cpp): the input itself, or made by shared-memory steps during the exchange.
struct HostPartials {
  DType type = DType::F32;  // of ptr's elements
  std::vector<void*> ptr;   // by position in owned[local rank]
  // By the same position: made in the wire type instead of `type`, already rounded (Note
  // [Partials made in the wire type] in comm_hier.cpp); empty: none.
  std::vector<uint8_t> in_wire;
  std::vector<std::vector<int>> owned;             // local index -> parts it handles
  std::unique_ptr<shm::ReduceScatterSteps> steps;  // null: ptr holds them all already
  // Elements from the start of part `part` (a group rank's part, one this rank handles; not
  // an index into ptr) that are final here.
  size_t ready(int part) const;
  ~HostPartials();
};

// A rank's partials as they leave for other hosts: in the wire type, each chunk rounded once
// from the partial where the two types differ (Note [Half precision on the wire]).
class WirePartials {
 public:
  // `leaving`: the partials (indices into hp.ptr) that leave this host. Takes the room for
  // their rounded copies from group.staging() where it needs them.
  WirePartials(const HostPartials& hp, DType wire, const Reduction& red,
               const std::vector<Span>& parts, const std::vector<size_t>& leaving, NetGroup& group);
  // Chunk `c` (elements) of partial `k` (an index into hp.ptr) in the wire type. Call it
  // once per chunk, once the chunk is final (hp.ready).
  char* chunk(size_t k, Span c);

 private:
  const HostPartials& hp_;
  DType wire_;
  const Reduction& red_;
  std::vector<char*> at_;        // per partial: where its chunks leave from
  std::vector<uint8_t> leaves_;  // per partial: whether it leaves (`leaving`)
  std::vector<uint8_t> round_;   // per partial: whether its chunks are rounded as they leave
};

// Learns of the parts of an all-gather as they arrive, and spreads them inside the host
// beside the exchange (Communicator::LocalGather, Note [Local all-gather during the exchange]
// in comm_hier.cpp).
class PartSink {
 public:
  virtual ~PartSink() = default;
  // `len` bytes at `at` in the output are in place: the next piece of a part this rank
  // handles.
  virtual void arrived(const char* at, size_t len) = 0;
  // Exchange::background: the steps that need no wait, once `first` (this host's
  // reduce-scatter steps of an all-reduce, if any) are done.
  virtual Exchange::Progress poll(const shm::ReduceScatterSteps* first) = 0;
};

// What an inter-host algorithm may use of its group.
class NetGroup {
 public:
  virtual ~NetGroup() = default;
  virtual const Layout& layout() const = 0;
  virtual int group_rank() const = 0;
  virtual int group_size() const = 0;
  // The rank of host h that handles part p (Note [Unequal hosts] in comm_hier.cpp).
  virtual int handler(int host, int part) const = 0;
  // Local index -> the parts that rank handles, in host then local order.
  virtual std::vector<std::vector<int>> handled() const = 0;
  virtual int host_of(int group_rank) const = 0;
  // Host -> the rank there with my local index (equal hosts only; else empty).
  virtual const std::vector<int>& rail() const = 0;
  // The messages a part of `len` units of `unit` bytes crosses the network in.
  virtual std::vector<Span> net_chunks(size_t len, size_t unit) const = 0;
  virtual uint64_t tag(const OpCtx& ctx, int stage) const = 0;
  virtual uint64_t check(const OpCtx& ctx) const = 0;  // the collective's descriptor
  // Runs the exchange (which also ends when a rank of this host fails).
  virtual void exchange(Exchange& x, const OpCtx& ctx) = 0;
  // A buffer for what arrives from other hosts, valid until the next call.
  virtual char* incoming(size_t bytes) = 0;
  // A buffer for the partials' wire copies (WirePartials), valid until the next call.
  virtual char* staging(size_t bytes) = 0;
  virtual Timeline& timeline() = 0;
  virtual const Settings& settings() const = 0;
};

// One collective's exchange between hosts (Note [Inter-host algorithms]). Spans are in
// elements of the reduction for the reduce-scatter, in units of ag_unit bytes for the
// all-gather.
struct NetJob {
  const std::vector<Span>* parts = nullptr;  // one per group rank
  // Reduce-scatter: this host's partials, the reduction, and my part's result.
  HostPartials* partials = nullptr;
  const Reduction* red = nullptr;
  void* dst = nullptr;
  // All-gather: the output, and the size of a unit of `parts` in it.
  char* ag_out = nullptr;
  size_t ag_unit = 1;
  // All-gather: where my part is sent from and copied into place during the exchange (Note
  // [Own part during the exchange] in comm_hier.cpp); null: it is in place already (or, in
  // an all-reduce, arrives there as it is reduced).
  const char* ag_own = nullptr;
  // Learns of each part that arrives in `ag_out` and of each reduced chunk of my part.
  PartSink* gather = nullptr;
};

class NetAlgorithm {
 public:
  explicit NetAlgorithm(NetGroup& group) : g_(group) {}
  virtual ~NetAlgorithm() = default;
  virtual const char* name() const = 0;
  virtual NetAlgo kind() const = 0;  // the net_algo value that names it
  // Per group rank's part, the phase in which this host's shared-memory steps make its
  // partial (reduce-scatter) or spread it (all-gather); empty: one phase, every part (Note
  // [Parts in the order the ring needs them] in net_ring.cpp).
  virtual std::vector<int> partial_phases() const { return {}; }
  virtual std::vector<int> gather_phases() const { return {}; }
  // How many parts one shared-memory step carries a chunk of (Note [A message per local
  // step] in comm_hier.cpp).
  virtual size_t parts_per_step() const = 0;
  // Whether a reduce-scatter sends the host partials of the parts this rank handles, but
  // its own, as they are made (nothing added on the way), so the shared-memory steps may make
  // them in the wire type (Note [Partials made in the wire type] in comm_hier.cpp).
  virtual bool sends_partials_as_made() const { return false; }
  // Runs the job's exchange: every message of it, and the reductions of what arrived.
  virtual void run(const NetJob& job, const OpCtx& ctx) = 0;

 protected:
  // The unit a job's reduce-scatter messages are cut in (bytes of one wire element), which an
  // all-reduce's all-gather cuts by too, so that each reduced chunk goes on as one message.
  size_t chunk_unit(const NetJob& job) const;

  NetGroup& g_;
};

std::unique_ptr<NetAlgorithm> make_mesh(NetGroup& group);  // net_mesh.cpp
std::unique_ptr<NetAlgorithm> make_ring(NetGroup& group);  // net_ring.cpp
// net_halving_doubling.cpp (Note [Halving and doubling between hosts]).
std::unique_ptr<NetAlgorithm> make_halving_doubling(NetGroup& group);
// net_tree.cpp (Note [A tree for small all-reduces]): all-reduces only.
std::unique_ptr<NetAlgorithm> make_tree(NetGroup& group);

// The collectives that cross hosts, as auto tells them apart (Note [Auto by size and host
// count] in net_algorithm.cpp).
enum class NetOp { ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER };
constexpr size_t kNetOps = 3;

// What SMDDP_NET_ALGO=auto sends collectives by between `hosts` hosts of equal rank counts:
// the group's algorithm (Note [The group's algorithm under auto]) and, by size, the tree and
// halving-doubling (Note [Auto by size and host count]).
// Sizes are nccl-tests' S: an all_reduce's tensor, a reduce_scatter's input, an
// all_gather's output, in bytes; 0: never.
struct AutoBySize {
  NetAlgo main = NetAlgo::MESH;             // the group's algorithm: MESH or RING
  size_t tree_max_bytes = 0;                // all-reduces of at most this take the tree
  size_t doubling_max_bytes[kNetOps] = {};  // the others of at most this, halving-doubling
};
AutoBySize auto_by_size(int hosts);
// auto_by_size(hosts).tree_max_bytes.
size_t auto_tree_max_bytes(int hosts);

// What a group may send its collectives across hosts by, chosen once at its creation.
struct NetAlgorithms {
  std::unique_ptr<NetAlgorithm> main;  // every collective the others do not take; null: one host
  std::unique_ptr<NetAlgorithm> tree;  // all-reduces of at most tree_max_bytes; null: none
  size_t tree_max_bytes = 0;
  // Collectives of at most doubling_max_bytes[op] the tree does not take; null: none.
  std::unique_ptr<NetAlgorithm> doubling;
  size_t doubling_max_bytes[kNetOps] = {};
  // The algorithm of one collective across hosts: `bytes` is its S (as for AutoBySize), the
  // same on every rank of the call (Note [Auto by size and host count]).
  NetAlgorithm& pick(NetOp op, size_t bytes) const {
    if (tree && op == NetOp::ALL_REDUCE && bytes <= tree_max_bytes) return *tree;
    const size_t dmax = doubling_max_bytes[static_cast<size_t>(op)];
    if (doubling && dmax && bytes <= dmax) return *doubling;
    return *main;
  }
};

// The group's algorithms, from its layout and settings (Note [Inter-host algorithms]).
NetAlgorithms choose_net_algorithms(NetGroup& group);

}  // namespace smddp
