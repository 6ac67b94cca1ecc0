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
  // A ring needs rails: hosts of unequal size take the mesh (Note [Unequal hosts] in
  // comm_hier.cpp), and so do 2 hosts, where the two are one exchange. Note [Rail rings],
  // "When": auto is the ring from 3 to 32 hosts.
  bool ring = false;
  if (l.uniform && l.hosts >= 3) {
    switch (group.settings().net_algo) {
      case NetAlgo::RING:
        ring = true;
        break;
      case NetAlgo::MESH:
        break;
      case NetAlgo::AUTO:
        ring = l.hosts <= kAutoRingMaxHosts;
        break;
    }
  }
  return ring ? make_ring(group) : make_mesh(group);
}

}  // namespace smddp
