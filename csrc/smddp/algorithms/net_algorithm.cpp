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
// Past the ring's measured range the group's algorithm stays the mesh, for every size that
// Note [Auto by size and host count] leaves to it. That rule itself reaches beyond 32 hosts:
// derived with the ranks' crowding of the cores held at the 32 hosts measured, the cost
// model has halving-doubling take ever larger collectives from the mesh as its H-1 flows
// grow (on 32 hosts halving-doubling was measured faster than the mesh at every size and
// kind, docs/multi_node.md, "16 and 32 hosts"), up to every size the rule considers (1 TiB)
// from 235 hosts. Nothing beyond 32 hosts is measured: the group's algorithm does not
// follow the model there yet.

// Note [Auto by size and host count]
// Under SMDDP_NET_ALGO=auto a group of hosts with equal rank counts keeps up to three
// algorithms: its own (the ring or the mesh, above), the tree (Note [A tree for small
// all-reduces] in net_tree.cpp) and halving-doubling (Note [Halving and doubling between
// hosts] in net_halving_doubling.cpp). Each call picks among them (NetAlgorithms::pick) by
// its kind, its size S (nccl-tests': an all_reduce's tensor, a reduce_scatter's input, an
// all_gather's output) and the host count: an all_reduce takes the tree up to
// auto_by_size(H).tree_max_bytes; any collective the tree does not take goes by
// halving-doubling up to that kind's doubling_max_bytes; the rest by the group's
// algorithm. Every rank of a call passes the same S (its count, dtype and parts are the
// call's, checked in every message) and sees the same layout, so every rank picks the same.
// net_algo=tree sends every all_reduce by the tree and the rest as auto does; mesh, ring and
// halving_doubling force theirs for every collective. A rooted reduce crosses hosts as a
// reduce_scatter of the whole tensor (comm_algos.cpp), and so picks as one.
//
// The sizes are the cost model's (torch_sagemaker/planner/auto_rule.py, Note [The auto rule
// from the model] there): for each H from 2 to 1024, per kind, the largest power of two up
// to which it predicts the tree (then halving-doubling) faster than every algorithm that
// would otherwise take the call, at every power of two from 1 KiB, at the costs fitted on
// the recorded runs (tests/data/multihost, the staged rounds of 16 and 32 hosts among them)
// on the hosts the 16- and 32-host runs simulate: one rank per host at 1 Gbit/s, all ranks on
// the machine's 2 cores (beyond 32 hosts, as crowded as 32 were), the cables' 96 KiB burst. `bench
// multihost --fit tests/data/multihost/*.json` prints the table below, and
// tests/unit/test_cost_model.py holds it to that: a refit changes the numbers here and nowhere
// else. Measured against it on 16 and 32 such hosts: docs/multi_node.md, "16 and 32 hosts". On
// these hosts every wait of a rank costs it a turn at the shared cores, which the tree's and
// halving-doubling's few rounds save, and each of their rounds adds its CPU time to its NIC time
// where the pipelined ring overlaps them (Note [Staged algorithms]), which is what ends their
// range.
struct AutoRule {
  int hosts;                           // from this many hosts up to the next entry's
  size_t tree_max_bytes;               // all_reduces of at most this many bytes take the tree
  size_t doubling_max_bytes[kNetOps];  // all_reduce, reduce_scatter, all_gather
};
constexpr AutoRule kAutoRule[] = {
    {2, 0, {0, 0, 0}},
    {3, 16384, {0, 0, 0}},
    {4, 32768, {65536, 131072, 131072}},
    {5, 16384, {0, 0, 0}},
    {6, 16384, {65536, 65536, 65536}},
    {7, 32768, {65536, 131072, 131072}},
    {8, 32768, {131072, 131072, 131072}},
    {9, 32768, {0, 65536, 65536}},
    {10, 32768, {65536, 131072, 131072}},
    {11, 32768, {131072, 131072, 131072}},
    {14, 65536, {262144, 262144, 262144}},
    {16, 131072, {262144, 262144, 262144}},
    {17, 65536, {0, 131072, 131072}},
    {18, 65536, {131072, 131072, 131072}},
    {21, 65536, {262144, 262144, 262144}},
    {22, 131072, {262144, 262144, 262144}},
    {27, 131072, {262144, 524288, 524288}},
    {28, 131072, {524288, 524288, 524288}},
    {32, 262144, {524288, 524288, 524288}},
    {33, 16384, {0, 524288, 524288}},
    {34, 32768, {0, 524288, 1048576}},
    {35, 32768, {0, 1048576, 1048576}},
    {37, 65536, {0, 1048576, 1048576}},
    {39, 65536, {0, 1048576, 2097152}},
    {42, 65536, {0, 2097152, 2097152}},
    {44, 131072, {0, 2097152, 2097152}},
    {49, 131072, {0, 2097152, 4194304}},
    {54, 131072, {0, 4194304, 4194304}},
    {55, 131072, {262144, 4194304, 4194304}},
    {58, 131072, {524288, 4194304, 4194304}},
    {64, 262144, {1048576, 4194304, 4194304}},
    {65, 131072, {262144, 4194304, 4194304}},
    {66, 131072, {524288, 4194304, 4194304}},
    {70, 131072, {524288, 4194304, 8388608}},
    {72, 131072, {1048576, 4194304, 8388608}},
    {78, 131072, {1048576, 8388608, 8388608}},
    {81, 131072, {2097152, 8388608, 8388608}},
    {94, 131072, {2097152, 8388608, 16777216}},
    {96, 131072, {4194304, 8388608, 16777216}},
    {108, 131072, {4194304, 16777216, 16777216}},
    {118, 131072, {8388608, 16777216, 16777216}},
    {122, 131072, {8388608, 16777216, 33554432}},
    {128, 262144, {8388608, 16777216, 33554432}},
    {129, 131072, {8388608, 16777216, 33554432}},
    {144, 131072, {8388608, 33554432, 33554432}},
    {148, 131072, {16777216, 33554432, 33554432}},
    {150, 131072, {16777216, 33554432, 67108864}},
    {170, 131072, {16777216, 33554432, 134217728}},
    {172, 131072, {33554432, 33554432, 134217728}},
    {176, 131072, {33554432, 67108864, 134217728}},
    {183, 131072, {33554432, 67108864, 268435456}},
    {189, 131072, {67108864, 67108864, 268435456}},
    {190, 131072, {67108864, 67108864, 536870912}},
    {194, 131072, {67108864, 67108864, 1073741824}},
    {196, 131072, {67108864, 67108864, 2147483648}},
    {197, 131072, {67108864, 67108864, 17179869184}},
    {198, 131072, {67108864, 67108864, 1099511627776}},
    {200, 131072, {67108864, 134217728, 1099511627776}},
    {201, 131072, {134217728, 134217728, 1099511627776}},
    {207, 131072, {268435456, 134217728, 1099511627776}},
    {211, 131072, {536870912, 134217728, 1099511627776}},
    {212, 131072, {1073741824, 134217728, 1099511627776}},
    {213, 131072, {2147483648, 134217728, 1099511627776}},
    {214, 131072, {1099511627776, 134217728, 1099511627776}},
    {216, 131072, {1099511627776, 268435456, 1099511627776}},
    {225, 131072, {1099511627776, 536870912, 1099511627776}},
    {230, 131072, {1099511627776, 1073741824, 1099511627776}},
    {232, 131072, {1099511627776, 2147483648, 1099511627776}},
    {233, 131072, {1099511627776, 4294967296, 1099511627776}},
    {234, 131072, {1099511627776, 137438953472, 1099511627776}},
    {235, 131072, {1099511627776, 1099511627776, 1099511627776}},
    {256, 262144, {1099511627776, 1099511627776, 1099511627776}},
    {257, 131072, {1099511627776, 1099511627776, 1099511627776}},
    {512, 262144, {1099511627776, 1099511627776, 1099511627776}},
    {513, 131072, {1099511627776, 1099511627776, 1099511627776}},
    {1024, 262144, {1099511627776, 1099511627776, 1099511627776}},
};

}  // namespace

AutoBySize auto_by_size(int hosts) {
  AutoBySize out;
  for (const AutoRule& r : kAutoRule) {
    if (r.hosts > hosts) break;
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
  // halving-doubling there is one round each way, taken when asked for. Note [Rail rings],
  // "When": auto is the ring from 3 to 32 hosts; beyond, Note [Auto beyond 32 hosts]; small
  // collectives, Note [Auto by size and host count].
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
  const AutoBySize rule = auto_by_size(l.hosts);
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
