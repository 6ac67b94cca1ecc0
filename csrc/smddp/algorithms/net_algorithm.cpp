// What every inter-host algorithm shares (Note [Inter-host algorithms] in net_algorithm.h).
#include "smddp/algorithms/net_algorithm.h"

#include "smddp/algorithms/comm.h"
#include "smddp/algorithms/kernels.h"
#include "smddp/algorithms/shm_algos.h"

namespace smddp {
namespace {

// The most hosts SMDDP_NET_ALGO=auto passes around a ring (Note [Rail rings] in net_ring.cpp,
// "When").
constexpr int kAutoRingMaxHosts = 32;

// Note [Auto beyond 32 hosts]
// Past the ring's measured range auto keeps the mesh, and halving-doubling (Note [Halving
// and doubling between hosts] in net_halving_doubling.cpp) is chosen only when asked for
// (net_algo=halving_doubling). The cost model (torch_sagemaker/planner/cost_model.py, fitted
// costs of docs/multi_node.md, a 20 us step latency) ranks "doubling" first among the mesh,
// the ring and doubling for 64 to 1024 hosts of 8 ranks and 96 cores at 4 x 100 Gbit/s at
// every size from 64 KiB to 256 MiB and every op, for step latencies of 0 to 1 ms: it moves
// the ring's bytes in log2 H steps where the ring takes 2 (H-1), in fewer messages, with none
// of the mesh's H-1 flows per NIC. But the first measurement disagrees where it can be
// checked: on 16 simulated hosts at 1 Gbit/s, 16 MiB, halving-doubling reached 0.51-0.55 of
// the NIC bound where the ring reached 0.75-0.86 (docs/collectives.md; a loaded machine, one
// run each). The model counts no fold and no straggler per round, and nothing beyond 32 hosts
// is measured, so the default does not follow the model until a quiet measurement on 16 and
// 32 hosts does. What the model does choose by size is a tree for small all-reduces: Note
// [When the tree runs].

// Note [When the tree runs]
// Under SMDDP_NET_ALGO=auto a group of hosts with equal rank counts keeps two algorithms:
// its own (the ring or the mesh, above) and the tree (Note [A tree for small all-reduces] in
// net_tree.cpp). Each all_reduce picks between them (NetAlgorithms::pick) by its tensor's
// bytes and the host count: the tree up to auto_tree_max_bytes(H), the group's algorithm
// above; every other collective takes the group's. Every rank of a call passes the same
// count and dtype (the call's descriptor, checked in every message) and sees the same
// layout, so every rank picks the same. net_algo=tree sends every all_reduce by the tree and
// the rest as auto does; mesh, ring and halving_doubling force theirs for every collective.
//
// The sizes are the cost model's (torch_sagemaker/planner/tree_rule.py, Note [The tree
// rule from the model] there): for each H from 2 to 1024 the largest power of two up to
// which it predicts the tree faster than the group's algorithm (the ring from 3 to 32 hosts,
// the mesh on 2 and beyond 32) at every power of two from 1 KiB, at the costs fitted on the
// recorded runs (tests/data/multihost), on the hosts those runs simulate and the 16- and
// 32-host runs use: one rank per host at 1 Gbit/s, all ranks on the machine's 2 cores, the
// cables' 96 KiB burst. `bench multihost --fit tests/data/multihost/*.json` prints the
// table below, and tests/unit/test_cost_model.py holds it to that: a refit changes the
// numbers here and nowhere else. What they say: none on 2 hosts (the tree's one round saves
// nothing the model sees over the mesh's exchange); 32 to 64 KiB on 3 to 7 hosts, rising to
// 1 MiB at 31 and 32 (the ring's 2 (H-1) waits against the tree's log2 H, and the fold's two
// stages off powers of two); against the mesh beyond 32 hosts, 128 to 512 KiB. On these
// hosts every wait of a rank costs it a turn at the shared cores (the fitted wake times the
// ranks per core), and that is what the tree saves. The fit resolves no step latency and no
// cost per message (both fit to 0: the recorded rows start at 1 MiB), so on hosts with a
// core per rank the model sees nothing the tree saves below 33 hosts and never takes it
// there, at 1 or 4 x 100 Gbit/s alike, while against the mesh beyond 32 it would take it up
// to 0.5 to 256 MiB. The rule is the simulated hosts' until a fit with smaller sizes
// resolves a step's latency, and a model's choice until the tree is measured against the
// mesh and the ring (bench multihost --backends smddp-tree; docs/collectives.md).
struct TreeRule {
  int hosts;         // from this many hosts up to the next entry's
  size_t max_bytes;  // all_reduces of at most this many bytes take the tree
};
constexpr TreeRule kTreeRule[] = {
    {2, 0},       {3, 32768},   {4, 65536},   {5, 32768},    {8, 131072},  {9, 65536},
    {12, 131072}, {16, 262144}, {17, 131072}, {18, 262144},  {24, 524288}, {31, 1048576},
    {33, 262144}, {64, 524288}, {65, 262144}, {513, 131072},
};

}  // namespace

size_t auto_tree_max_bytes(int hosts) {
  size_t bytes = 0;
  for (const TreeRule& r : kTreeRule) {
    if (r.hosts <= hosts) bytes = r.max_bytes;
  }
  return bytes;
}

DType wire_type(DType t, const Settings& s) { return s.net_reduce_fp32 ? acc_type(t) : t; }

HostPartials::~HostPartials() = default;

size_t HostPartials::ready(int part) const { return steps ? steps->ready(part) : SIZE_MAX; }

WirePartials::WirePartials(const HostPartials& hp, DType wire, const Reduction& red,
                           const std::vector<Span>& parts, const std::vector<size_t>& leaving,
                           NetGroup& group)
    : hp_(hp), wire_(wire), red_(red) {
  const std::vector<int>& mine = hp.owned[group.layout().local_rank];
  at_.assign(mine.size(), nullptr);
  leaves_.assign(mine.size(), 0);
  round_.assign(mine.size(), 0);
  std::vector<size_t> rounded;
  for (size_t k : leaving) {
    leaves_[k] = 1;
    if (hp.type == wire || (!hp.in_wire.empty() && hp.in_wire[k])) {
      at_[k] = static_cast<char*>(hp.ptr[k]);  // already in the wire type: sent as it is
    } else {
      rounded.push_back(k);
    }
  }
  // The others are rounded into the staging buffer chunk by chunk as they leave.
  const size_t wsz = dtype_size(wire);
  size_t total = 0;
  for (size_t k : rounded) total += parts[mine[k]].len * wsz;
  char* at = rounded.empty() ? nullptr : group.staging(total);
  for (size_t k : rounded) {
    round_[k] = 1;
    at_[k] = at;
    at += parts[mine[k]].len * wsz;
  }
}

char* WirePartials::chunk(size_t k, Span c) {
  SMDDP_CHECK(leaves_[k], "smddp: a partial that stays on its host was sent (a bug)");
  char* out = at_[k] + c.off * dtype_size(wire_);
  if (round_[k]) {
    const void* src = static_cast<const char*>(hp_.ptr[k]) + c.off * dtype_size(hp_.type);
    reduce(hp_.type, wire_, out, &src, 1, c.len, red_, false);
  }
  return out;
}

size_t NetAlgorithm::chunk_unit(const NetJob& job) const {
  return job.red ? dtype_size(wire_type(job.red->dtype, g_.settings())) : job.ag_unit;
}

NetAlgorithms choose_net_algorithms(NetGroup& group) {
  NetAlgorithms a;
  const Layout& l = group.layout();
  if (l.hosts < 2) return a;
  // The ring, halving-doubling and the tree need rails: hosts of unequal size take the mesh
  // (Note [Unequal hosts] in comm_hier.cpp). A ring of 2 hosts is the mesh's one exchange;
  // halving-doubling there is one round each way, taken when asked for. Note [Rail rings],
  // "When": auto is the ring from 3 to 32 hosts; beyond, Note [Auto beyond 32 hosts]; small
  // all-reduces, Note [When the tree runs].
  if (!l.uniform) {
    a.main = make_mesh(group);
    return a;
  }
  const NetAlgo asked = group.settings().net_algo;
  switch (asked) {
    case NetAlgo::HALVING_DOUBLING:
      a.main = make_halving_doubling(group);
      return a;
    case NetAlgo::RING:
      a.main = l.hosts >= 3 ? make_ring(group) : make_mesh(group);
      return a;
    case NetAlgo::MESH:
      a.main = make_mesh(group);
      return a;
    case NetAlgo::TREE:
    case NetAlgo::AUTO:
      break;
  }
  const bool ring = l.hosts >= 3 && l.hosts <= kAutoRingMaxHosts;
  a.main = ring ? make_ring(group) : make_mesh(group);  // Note [Auto beyond 32 hosts]
  a.tree_max_bytes = asked == NetAlgo::TREE ? SIZE_MAX : auto_tree_max_bytes(l.hosts);
  if (a.tree_max_bytes) a.tree = make_tree(group);
  return a;
}

}  // namespace smddp
