// What every inter-host algorithm shares (Note [Inter-host algorithms] in net_algorithm.h).
#include "smddp/algorithms/net_algorithm.h"

#include "smddp/algorithms/comm.h"
#include "smddp/algorithms/kernels.h"
#include "smddp/algorithms/shm_algos.h"

namespace smddp {
namespace {

// Note [The group's algorithm under auto]
// Under SMDDP_NET_ALGO=auto a group of hosts with equal rank counts sends by its own
// algorithm every collective that Note [Auto by size and host count] leaves to it: the large
// ones. Which one is the cost model's too (auto_rule.py: group_algorithm), per host count, in
// kAutoRule below: the mesh on 2 hosts, where a ring is the mesh's one exchange; from 3 hosts,
// whichever of the ring and the mesh the model predicts faster for one 64 MiB call of each
// kind. On every host count from 3 to 1024 that is the ring, at every size from 16 MiB to
// 1 GiB: its one flow per NIC keeps the link's rate where the mesh's H-1 flows share it unevenly
// (flow_skew, flow_latency). Measured, the ring took 0.64-0.88 of the mesh's time from 4 MiB on 16
// and 32 hosts, and 0.66-0.92 from 1 MiB on 48 (docs/log/multi_node.md, "16 and 32 hosts", "48
// hosts"), where the mesh's incast dropped hundreds to thousands of packets per 16 MiB case; beyond
// 48 hosts nothing is measured, and what the ring's 2(H-1) steps cost there is the model's (its
// step latency is not resolved by these runs, so it prices a step by the wake-ups of the crowded
// cores: Note [Staged algorithms]). Until 2026-11-30 auto kept the ring to 32 hosts only, the last
// host count then measured, and the mesh beyond. The rule's hosts leave out the simulated cables'
// own CPU (benchmarks/cost_model_report.py: rule_cluster says why: with it the model would pick the
// mesh on 23 to 148 hosts, against the 32 and 48 measured).

// Note [Auto by size and host count]
// Under SMDDP_NET_ALGO=auto a group of hosts with equal rank counts keeps up to three
// algorithms: its own (the ring or the mesh, Note [The group's algorithm under auto]), the tree
// (Note [A tree for small all-reduces] in net_tree.cpp) and halving-doubling (Note [Halving and
// doubling between hosts] in net_halving_doubling.cpp). Each call picks among them
// (NetAlgorithms::pick) by its kind, its size S (nccl-tests': an all_reduce's tensor, a
// reduce_scatter's input, an all_gather's output) and the host count: an all_reduce takes the tree
// up to auto_by_size(H).tree_max_bytes; any collective the tree does not take goes by
// halving-doubling up to that kind's doubling_max_bytes; the rest by the group's
// algorithm. Every rank of a call passes the same S (its count, dtype and parts are the
// call's, checked in every message) and sees the same layout, so every rank picks the same.
// net_algo=tree sends every all_reduce by the tree and the rest as auto does; mesh, ring and
// halving_doubling force theirs for every collective. A rooted reduce crosses hosts as a
// reduce_scatter of the whole tensor (comm_algos.cpp), and so picks as one.
//
// The group's algorithm and the sizes are the cost model's (torch_sagemaker/planner/auto_rule.py,
// Note [The auto rule from the model] there): for each H from 2 to 1024, per kind, the largest
// power of two up to which it predicts the tree (then halving-doubling) faster than every algorithm
// that would otherwise take the call, at every power of two from 1 KiB, at the costs fitted on the
// recorded runs (tests/data/multihost, the staged rounds of 16 and 32 hosts among them) on the
// hosts the 16- and 32-host runs simulate: one rank per host at 1 Gbit/s, all ranks on the
// machine's 2 cores (beyond 32 hosts, as crowded as 32 were), the cables' 96 KiB burst. `bench
// multihost --fit tests/data/multihost/*.json` prints the table below, and
// tests/unit/test_cost_model.py holds it to that: a refit changes the numbers here and nowhere
// else. Measured against it on 16, 32 and 48 such hosts: docs/multi_node.md, "16 and 32 hosts". On
// these hosts every wait of a rank costs it a turn at the shared cores, which the tree's and
// halving-doubling's few rounds save, and each of their rounds adds its CPU time to its NIC time
// where the pipelined ring overlaps them (Note [Staged algorithms]), which is what ends their
// range.
struct AutoRule {
  int hosts;                           // from this many hosts up to the next entry's
  NetAlgo main;                        // the group's algorithm: MESH or RING
  size_t tree_max_bytes;               // all_reduces of at most this many bytes take the tree
  size_t doubling_max_bytes[kNetOps];  // all_reduce, reduce_scatter, all_gather
};
constexpr AutoRule kAutoRule[] = {
    {2, NetAlgo::MESH, 0, {0, 0, 0}},
    {3, NetAlgo::RING, 8192, {0, 0, 0}},
    {4, NetAlgo::RING, 32768, {65536, 131072, 131072}},
    {5, NetAlgo::RING, 16384, {0, 0, 0}},
    {6, NetAlgo::RING, 16384, {32768, 65536, 65536}},
    {7, NetAlgo::RING, 32768, {65536, 131072, 131072}},
    {8, NetAlgo::RING, 32768, {131072, 131072, 131072}},
    {9, NetAlgo::RING, 32768, {0, 0, 0}},
    {11, NetAlgo::RING, 32768, {65536, 65536, 65536}},
    {12, NetAlgo::RING, 32768, {65536, 131072, 131072}},
    {13, NetAlgo::RING, 32768, {131072, 131072, 131072}},
    {14, NetAlgo::RING, 65536, {262144, 131072, 262144}},
    {15, NetAlgo::RING, 65536, {262144, 262144, 262144}},
    {16, NetAlgo::RING, 131072, {262144, 262144, 262144}},
    {17, NetAlgo::RING, 65536, {0, 0, 0}},
    {21, NetAlgo::RING, 131072, {0, 65536, 65536}},
    {22, NetAlgo::RING, 131072, {0, 131072, 131072}},
    {26, NetAlgo::RING, 131072, {0, 262144, 262144}},
    {27, NetAlgo::RING, 131072, {262144, 262144, 262144}},
    {30, NetAlgo::RING, 262144, {0, 262144, 262144}},
    {31, NetAlgo::RING, 262144, {0, 524288, 524288}},
    {32, NetAlgo::RING, 262144, {524288, 524288, 524288}},
    {33, NetAlgo::RING, 131072, {0, 0, 0}},
    {35, NetAlgo::RING, 262144, {0, 0, 0}},
    {36, NetAlgo::RING, 262144, {0, 131072, 131072}},
    {37, NetAlgo::RING, 262144, {0, 262144, 262144}},
    {38, NetAlgo::RING, 262144, {524288, 524288, 524288}},
    {41, NetAlgo::RING, 262144, {1048576, 1048576, 1048576}},
    {46, NetAlgo::RING, 262144, {1048576, 2097152, 2097152}},
    {47, NetAlgo::RING, 262144, {2097152, 2097152, 2097152}},
    {57, NetAlgo::RING, 262144, {2097152, 4194304, 4194304}},
    {58, NetAlgo::RING, 262144, {4194304, 4194304, 4194304}},
    {85, NetAlgo::RING, 262144, {4194304, 4194304, 8388608}},
    {86, NetAlgo::RING, 262144, {8388608, 8388608, 8388608}},
    {128, NetAlgo::RING, 262144, {8388608, 8388608, 16777216}},
    {129, NetAlgo::RING, 262144, {8388608, 8388608, 8388608}},
    {134, NetAlgo::RING, 262144, {8388608, 8388608, 16777216}},
    {137, NetAlgo::RING, 262144, {16777216, 16777216, 16777216}},
    {221, NetAlgo::RING, 262144, {16777216, 16777216, 33554432}},
    {228, NetAlgo::RING, 262144, {33554432, 33554432, 33554432}},
    {400, NetAlgo::RING, 262144, {33554432, 33554432, 67108864}},
    {415, NetAlgo::RING, 262144, {67108864, 67108864, 67108864}},
    {754, NetAlgo::RING, 262144, {67108864, 67108864, 134217728}},
    {785, NetAlgo::RING, 262144, {134217728, 134217728, 134217728}},
};

}  // namespace

AutoBySize auto_by_size(int hosts) {
  AutoBySize out;
  for (const AutoRule& r : kAutoRule) {
    if (r.hosts > hosts) break;
    out.main = r.main;
    out.tree_max_bytes = r.tree_max_bytes;
    for (size_t k = 0; k < kNetOps; ++k) out.doubling_max_bytes[k] = r.doubling_max_bytes[k];
  }
  return out;
}

size_t auto_tree_max_bytes(int hosts) { return auto_by_size(hosts).tree_max_bytes; }

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
  // halving-doubling there is one round each way, taken when asked for. Under auto the
  // group's algorithm is Note [The group's algorithm under auto]'s; small collectives, Note
  // [Auto by size and host count].
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
  const AutoBySize rule = auto_by_size(l.hosts);
  a.main = rule.main == NetAlgo::RING && l.hosts >= 3 ? make_ring(group) : make_mesh(group);
  a.tree_max_bytes = asked == NetAlgo::TREE ? SIZE_MAX : rule.tree_max_bytes;
  if (a.tree_max_bytes) a.tree = make_tree(group);
  bool doubling = false;
  for (size_t k = 0; k < kNetOps; ++k) {
    // net_algo=tree takes every all_reduce: none is left for halving-doubling.
    const bool all_reduce = k == static_cast<size_t>(NetOp::ALL_REDUCE);
    a.doubling_max_bytes[k] = asked == NetAlgo::TREE && all_reduce ? 0 : rule.doubling_max_bytes[k];
    doubling = doubling || a.doubling_max_bytes[k];
  }
  if (doubling) a.doubling = make_halving_doubling(group);
  return a;
}

}  // namespace smddp
