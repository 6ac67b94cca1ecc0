// The checks of test_collectives.cpp that other files run on their own topologies: each
// runs a group of ranks as threads and compares every result exactly with data.h's reference.
#pragma once

#include <cstddef>
#include <vector>

#include "smddp/common/settings.h"

namespace smddp_test {

struct Topology {
  const char* name;
  int ranks;
  int force_local_size;
  size_t p2p_bytes;
  smddp::NetAlgo net_algo = smddp::NetAlgo::AUTO;
  std::vector<int> force_hosts = {};  // rank -> host (CommConfig::force_hosts)
  bool fp32_wire = false;             // bf16 partials cross in fp32 (SMDDP_NET_REDUCE_DTYPE=fp32)
};

// Every reduction over sizes from empty to several buffers; also that each call crossed hosts
// by the algorithm the topology says (the tree per call, Note [Auto by size and host count]).
void check_allreduce(const Topology& topo);
void check_reduce_scatter(const Topology& topo);
void check_allgather(const Topology& topo);  // also in place
void check_rooted(const Topology& topo);     // reduce, gather and scatter from every root

}  // namespace smddp_test
