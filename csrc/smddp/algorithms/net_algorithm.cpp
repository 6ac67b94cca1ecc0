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
// 32 hosts does. What the model does choose by size is a tree for small all-reduces, which
// smddp does not have.

}  // namespace

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
  for (size_t k : leaving) leaves_[k] = 1;
  if (hp.type == wire) {
    for (size_t k : leaving) at_[k] = static_cast<char*>(hp.ptr[k]);
    return;
  }
  // Rounded into the staging buffer chunk by chunk as they leave.
  const size_t wsz = dtype_size(wire);
  size_t total = 0;
  for (size_t k : leaving) total += parts[mine[k]].len * wsz;
  char* at = group.staging(total);
  for (size_t k : leaving) {
    at_[k] = at;
    at += parts[mine[k]].len * wsz;
  }
}

char* WirePartials::chunk(size_t k, Span c) {
  SMDDP_CHECK(leaves_[k], "smddp: a partial that stays on its host was sent (a bug)");
  char* out = at_[k] + c.off * dtype_size(wire_);
  if (hp_.type != wire_) {
    const void* src = static_cast<const char*>(hp_.ptr[k]) + c.off * dtype_size(hp_.type);
    reduce(hp_.type, wire_, out, &src, 1, c.len, red_, false);
  }
  return out;
}

size_t NetAlgorithm::chunk_unit(const NetJob& job) const {
  return job.red ? dtype_size(wire_type(job.red->dtype, g_.settings())) : job.ag_unit;
}

std::unique_ptr<NetAlgorithm> choose_net_algorithm(NetGroup& group) {
  const Layout& l = group.layout();
  if (l.hosts < 2) return nullptr;
  // The ring and halving-doubling need rails: hosts of unequal size take the mesh (Note
  // [Unequal hosts] in comm_hier.cpp). A ring of 2 hosts is the mesh's one exchange; halving-
  // doubling there is one round each way, taken when asked for. Note [Rail rings], "When":
  // auto is the ring from 3 to 32 hosts; beyond, Note [Auto beyond 32 hosts].
  if (!l.uniform) return make_mesh(group);
  switch (group.settings().net_algo) {
    case NetAlgo::HALVING_DOUBLING:
      return make_halving_doubling(group);
    case NetAlgo::RING:
      return l.hosts >= 3 ? make_ring(group) : make_mesh(group);
    case NetAlgo::MESH:
      return make_mesh(group);
    case NetAlgo::AUTO:
      break;
  }
  if (l.hosts >= 3 && l.hosts <= kAutoRingMaxHosts) return make_ring(group);
  return make_mesh(group);  // Note [Auto beyond 32 hosts]
}

}  // namespace smddp
