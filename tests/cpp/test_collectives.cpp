// The collectives of smddp::Communicator with ranks as threads, on three transports:
//   shm   - one host: the shared-memory algorithms (Note [Step protocol] in shm.h);
//   tcp   - SMDDP_FORCE_LOCAL_SIZE=1: every rank its own "host", pure TCP mesh;
//   hier  - SMDDP_FORCE_LOCAL_SIZE=2 with 4 ranks: 2 "hosts" of 2, the hierarchical
//           algorithms (Note [Hierarchical collectives] in comm.h);
//   uneven - hosts of unequal rank counts (CommConfig::force_hosts), the same algorithms
//           with parts dealt out per host (Note [Unequal hosts] in comm_hier.cpp).
// Buffers are small (16K data buffers, 4K chunks and network messages, 8K point-to-point
// rings) so that the sizes below cross every boundary: empty, one element, odd, larger than
// a chunk and larger than a buffer. Every result is compared exactly with data.h's reference.
// The checks of one collective on a topology are shared with test_net_algorithms.cpp
// (collective_checks.h), which runs them on the inter-host algorithms taken when asked for.
#include <atomic>
#include <map>
#include <set>

#include "collective_checks.h"
#include "data.h"
#include "harness.h"

namespace smddp_test {
namespace {

using smddp::Communicator;
using smddp::DType;
using smddp::RedOp;
using smddp::Reduction;
using smddp::Span;

smddp::CommConfig config_of(const Topology& t) {
  smddp::CommConfig cfg;
  cfg.group_name = std::string("test_") + t.name;
  cfg.timeout_s = 60;
  smddp::Settings& s = cfg.settings;
  s.buffer_bytes = 16 << 10;
  s.chunk_bytes = 4 << 10;
  s.oneshot_bytes = 2 << 10;
  s.p2p_bytes = t.p2p_bytes;
  s.pool_bytes = 4 << 20;
  s.spin_us = 20;
  s.worker_spin_us = 5;
  s.force_local_size = t.force_local_size;
  s.socket_addr = "127.0.0.1";
  // The smallest messages across hosts: a part crosses in several of them, the last shorter
  // (Note [Pipelined exchanges] in comm_hier.cpp). One byte short of the shared-memory chunk,
  // so a part arrives in pieces that end inside a step's chunk: the local all-gather's steps
  // must wait for the rest (Note [Local all-gather during the exchange]).
  s.net_chunk_bytes = (4 << 10) - 1;
  s.net_algo = t.net_algo;
  s.net_reduce_fp32 = t.fp32_wire;
  cfg.force_hosts = t.force_hosts;
  return cfg;
}

// The hosts a topology must make: ranks in order, hosts by their lowest rank.
std::vector<std::vector<int>> expected_hosts(const Topology& t) {
  std::vector<std::vector<int>> hosts;
  std::map<int, size_t> index;
  for (int r = 0; r < t.ranks; ++r) {
    int label = t.force_local_size ? r / t.force_local_size : 0;
    if (!t.force_hosts.empty()) label = label * t.ranks + t.force_hosts[r];
    auto it = index.find(label);
    if (it == index.end()) {
      it = index.emplace(label, hosts.size()).first;
      hosts.emplace_back();
    }
    hosts[it->second].push_back(r);
  }
  return hosts;
}

const Topology kShm2{"shm2", 2, 0, 8 << 10};
const Topology kShm3{"shm3", 3, 0, 8 << 10};
// 3 hosts of one rank with the mesh asked for (auto would take the ring there).
const Topology kTcp3{"tcp3", 3, 1, 8 << 10, smddp::NetAlgo::MESH};
const Topology kHier4{"hier4", 4, 2, 8 << 10};  // auto: small all_reduces as the rule says
const Topology kHier4Mesh{"hier4_mesh", 4, 2, 8 << 10, smddp::NetAlgo::MESH};
// The ring across hosts (Note [Rail rings] in net_ring.cpp): 3 hosts of 1 rank, asked
// for, and of 2 ranks, where auto takes it.
const Topology kRing3{"ring3", 3, 1, 8 << 10, smddp::NetAlgo::RING};
const Topology kRing6{"ring6", 6, 2, 8 << 10, smddp::NetAlgo::AUTO};
const Topology kRing6Forced{"ring6_forced", 6, 2, 8 << 10, smddp::NetAlgo::RING};
// Hosts of unequal rank counts take the mesh even when halving-doubling is asked for.
const Topology kUneven312Hd{"uneven312_hd",    6, 0, 8 << 10, smddp::NetAlgo::HALVING_DOUBLING,
                            {0, 0, 0, 1, 2, 2}};
const Topology kShmTcpP2P{"shm2_p2p_tcp", 2, 0, 0};  // send/recv over loopback TCP
// bf16 partials in fp32 between hosts (Note [Half precision on the wire] in net_algorithm.h),
// on the mesh and the ring.
const Topology kHier4Fp32{"hier4_fp32_wire", 4, 2, 8 << 10, smddp::NetAlgo::AUTO, {}, true};
const Topology kHier4Fp32Mesh{"hier4_fp32_wire_mesh", 4,  2,   8 << 10,
                              smddp::NetAlgo::MESH,   {}, true};
const Topology kRing6Fp32{"ring6_fp32_wire", 6, 2, 8 << 10, smddp::NetAlgo::AUTO, {}, true};
// Hosts of unequal rank counts (Note [Unequal hosts] in comm_hier.cpp): 2+1, 1+2, 3+1+2,
// hosts whose ranks interleave ({0,2} and {1,3,4}), and 3+1+2 with the ring asked for
// (unequal hosts take the mesh).
const Topology kUneven21{"uneven21", 3, 0, 8 << 10, smddp::NetAlgo::AUTO, {0, 0, 1}};
const Topology kUneven12{"uneven12", 3, 0, 8 << 10, smddp::NetAlgo::AUTO, {0, 1, 1}};
const Topology kUneven312{"uneven312", 6, 0, 8 << 10, smddp::NetAlgo::AUTO, {0, 0, 0, 1, 2, 2}};
const Topology kUnevenMixed{"uneven_mixed", 5, 0, 8 << 10, smddp::NetAlgo::AUTO, {0, 1, 0, 1, 1}};
const Topology kUneven312Ring{"uneven312_ring",  6, 0, 8 << 10, smddp::NetAlgo::RING,
                              {0, 0, 0, 1, 2, 2}};

smddp::OpArgs args(DType t, const char* op, size_t numel) {
  smddp::OpArgs a;
  a.dtype = smddp::dtype_name(t);
  a.op = op;
  a.numel = static_cast<int64_t>(numel);
  return a;
}

// The context the backend builds for a collective (backend_ops.cpp: desc_of, args_of).
smddp::OpCtx ctx_of(Communicator& c, const char* name, DType t, int op, size_t count,
                    uint64_t extra = 0, double timeout_s = 0) {
  smddp::CollDesc d;
  d.dtype_op = (static_cast<uint32_t>(t) << 8) | static_cast<uint32_t>(op);
  d.count = count;
  d.extra = extra;
  smddp::OpArgs a = args(t, op >= 0 ? smddp::redop_name(static_cast<RedOp>(op)) : nullptr, count);
  if (extra) a.root = static_cast<int64_t>(extra) - 1;
  return c.make_ctx(name, d, a, timeout_s);
}

Reduction reduction(DType t, RedOp op, int nranks, double premul = 1.0) {
  Reduction r;
  r.dtype = t;
  r.op = op;
  r.divisor = nranks;
  r.premul = premul;
  return r;
}

struct RedCase {
  DType t;
  RedOp op;
  double premul;
};
const std::vector<RedCase> kReductions = {
    {DType::F32, RedOp::SUM, 1.0},        {DType::F32, RedOp::AVG, 1.0},
    {DType::F32, RedOp::MAX, 1.0},        {DType::F32, RedOp::MIN, 1.0},
    {DType::F32, RedOp::PREMUL_SUM, 0.5}, {DType::BF16, RedOp::SUM, 1.0},
    {DType::BF16, RedOp::AVG, 1.0},       {DType::BF16, RedOp::MAX, 1.0},
    {DType::I64, RedOp::SUM, 1.0},        {DType::I64, RedOp::MIN, 1.0},
    {DType::I64, RedOp::MAX, 1.0},        {DType::I64, RedOp::BXOR, 1.0},
};

// 0, 1, odd, several chunks (4K), several buffers (16K) for every element size.
const std::vector<size_t> kCounts = {0, 1, 7, 1001, 5003};

std::string where(const Topology& topo, const char* what, int rank, DType t, RedOp op,
                  size_t count) {
  return cat(topo.name, " ", what, " rank ", rank, " ", smddp::dtype_name(t), " ",
             smddp::redop_name(op), " count ", count, ": ");
}

// The algorithm a topology's collectives across hosts must take (choose_net_algorithms) but
// for the all_reduces the tree takes: equal hosts take halving-doubling where asked for, the
// ring where asked for, or under auto (or tree) where the rule's group algorithm is the ring
// (Note [The group's algorithm under auto]); other layouts (unequal hosts, the mesh asked
// for, 2 hosts) the mesh.
std::string expected_algorithm(const Topology& topo, const smddp::Layout& l) {
  if (!l.uniform) return "mesh";
  if (topo.net_algo == smddp::NetAlgo::HALVING_DOUBLING) return "halving_doubling";
  if (l.hosts < 3) return "mesh";
  const bool ring = topo.net_algo == smddp::NetAlgo::RING ||
                    (topo.net_algo != smddp::NetAlgo::MESH &&
                     smddp::auto_by_size(l.hosts).main == smddp::NetAlgo::RING);
  return ring ? "ring" : "mesh";
}

// The largest all_reduce (bytes) the topology sends by the tree (Note [Auto by size and host
// count]): every one asked for, up to the rule's size under auto, none otherwise or on unequal
// hosts.
size_t expected_tree_bytes(const Topology& topo, const smddp::Layout& l) {
  if (!l.uniform || l.hosts < 2) return 0;
  if (topo.net_algo == smddp::NetAlgo::TREE) return SIZE_MAX;
  return topo.net_algo == smddp::NetAlgo::AUTO ? smddp::auto_tree_max_bytes(l.hosts) : 0;
}

// The calls that crossed hosts took the algorithm expected_algorithm names.
void expect_ring_used(const Topology& topo, const Communicator& c) {
  const std::string algo = c.net_algorithm();
  if (c.layout().hosts < 2) {
    EXPECT(algo == "none", topo.name, ": one host crosses nothing, but the algorithm is ", algo);
    return;
  }
  EXPECT(c.net_ops() > 0, topo.name, ": no collective crossed hosts");
  EXPECT(c.net_tree_max_bytes() == expected_tree_bytes(topo, c.layout()), topo.name,
         ": all_reduces up to ", c.net_tree_max_bytes(), " bytes take the tree");
  const std::string want = expected_algorithm(topo, c.layout());
  EXPECT(algo == want, topo.name, ": collectives crossed hosts by the ", algo, ", expected the ",
         want);
}

// The layout is the topology's hosts (unequal ones included: no flat fallback), and the
// collectives so far sent nothing over the network between ranks of one host.
void expect_hierarchy(const Topology& topo, const Communicator& c) {
  const auto want = expected_hosts(topo);
  const smddp::Layout& l = c.layout();
  EXPECT(l.members == want, topo.name, ": ", l.hosts, " hosts, want ", want.size());
  EXPECT(l.local_size == static_cast<int>(l.members.at(l.host).size()), topo.name, ": local_size ",
         l.local_size);
  EXPECT(c.local_net_messages() == 0, topo.name, ": ", c.local_net_messages(),
         " messages over the network inside a host");
}

void check_broadcast(const Topology& topo) {
  const int n = topo.ranks;
  run_group(n, config_of(topo), [&](Communicator& c, int rank) {
    int salt = 300;
    for (int root = 0; root < n; ++root) {
      for (size_t bytes : {size_t(0), size_t(1), size_t(40005)}) {
        ++salt;
        Bytes buf = rank == root ? make_bytes(root, bytes, salt) : Bytes(bytes, '\0');
        c.broadcast(buf.data(), bytes, root,
                    ctx_of(c, "broadcast", DType::U8, -1, bytes, uint64_t(root) + 1));
        std::string diff = compare_bytes(buf.data(), make_bytes(root, bytes, salt));
        EXPECT(diff.empty(), topo.name, " broadcast root ", root, " rank ", rank, " bytes ", bytes,
               ": ", diff);
      }
    }
    expect_hierarchy(topo, c);
  });
}

// Bytes rank i sends to rank j: uneven, some pairs nothing, some more than a buffer.
size_t a2a_len(int i, int j, int round) {
  size_t base = static_cast<size_t>((i * 3 + j * 5 + round) % 7);
  return base * 3001 + static_cast<size_t>((i + j) % 3);
}

void check_alltoall(const Topology& topo) {
  const int n = topo.ranks;
  run_group(n, config_of(topo), [&](Communicator& c, int rank) {
    for (int round = 0; round < 3; ++round) {
      const int salt = 400 + round;
      std::vector<Span> send(n), recv(n);
      size_t so = 0, ro = 0;
      for (int j = 0; j < n; ++j) {
        send[j] = {so, a2a_len(rank, j, round)};
        recv[j] = {ro, a2a_len(j, rank, round)};
        so += send[j].len;
        ro += recv[j].len;
      }
      Bytes in(so), out(ro + 1, '\x5a');
      for (int j = 0; j < n; ++j) {
        Bytes part = make_bytes(rank * n + j, send[j].len, salt);
        if (!part.empty()) std::memcpy(in.data() + send[j].off, part.data(), part.size());
      }
      c.alltoall(in.data(), send, out.data(), recv,
                 ctx_of(c, "all_to_all_single", DType::U8, -1, 0));
      for (int j = 0; j < n; ++j) {
        std::string diff =
            compare_bytes(out.data() + recv[j].off, make_bytes(j * n + rank, recv[j].len, salt));
        EXPECT(diff.empty(), topo.name, " all_to_all round ", round, " rank ", rank, " from ", j,
               ": ", diff);
      }
      EXPECT(out.back() == '\x5a', topo.name, " all_to_all wrote past its output");
    }
  });
}

void check_barrier(const Topology& topo) {
  const int n = topo.ranks;
  std::atomic<int> arrived{0};
  run_group(n, config_of(topo), [&](Communicator& c, int rank) {
    for (int round = 1; round <= 5; ++round) {
      // The last rank arrives late: nobody may leave the barrier before it came.
      if (rank == n - 1) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      arrived.fetch_add(1);
      c.barrier(c.make_ctx("barrier", smddp::CollDesc{}, smddp::OpArgs{}, 0));
      EXPECT(arrived.load() >= n * round, topo.name, " rank ", rank, " left barrier ", round,
             " after only ", arrived.load(), " arrivals");
    }
    expect_hierarchy(topo, c);
  });
}

smddp::OpCtx p2p_ctx(Communicator& c, size_t bytes, int peer, bool to_peer, double timeout_s = 0) {
  smddp::OpArgs a = args(DType::U8, nullptr, bytes);
  a.peer = peer;
  a.to_peer = to_peer;
  smddp::CollDesc d;
  d.count = bytes;
  return c.make_ctx(to_peer ? "send" : "recv", d, a, timeout_s);
}

void check_send_recv(const Topology& topo) {
  const int n = topo.ranks;
  run_group(n, config_of(topo), [&](Communicator& c, int rank) {
    // A ring: each rank sends tags 1, 2, 3 to the next rank (on its own thread, as the
    // backend's send lane does) and receives them from the previous one in the order 3, 1,
    // 2, so messages are read past and stashed. The 30000-byte message streams through the
    // 8K ring.
    const int next = (rank + 1) % n, prev = (rank + n - 1) % n;
    const std::vector<std::pair<uint32_t, size_t>> msgs = {{1, 30000}, {2, 0}, {3, 100}};
    std::thread sender([&] {
      try {
        for (auto [tag, bytes] : msgs) {
          Bytes b = make_bytes(rank, bytes, static_cast<int>(tag));
          c.send(b.data(), bytes, next, tag, p2p_ctx(c, bytes, next, true));
        }
      } catch (const std::exception& e) {
        EXPECT(false, topo.name, " send of rank ", rank, " raised: ", e.what());
      }
    });
    for (int k : {2, 0, 1}) {
      auto [tag, bytes] = msgs[k];
      Bytes b(bytes + 1, '\x5a');
      c.recv(b.data(), bytes, prev, tag, p2p_ctx(c, bytes, prev, false));
      std::string diff = compare_bytes(b.data(), make_bytes(prev, bytes, static_cast<int>(tag)));
      EXPECT(diff.empty(), topo.name, " recv of rank ", rank, " tag ", tag, ": ", diff);
      EXPECT(b.back() == '\x5a', topo.name, " recv wrote past its buffer");
    }
    sender.join();
    // Receive from any rank: every other rank sends rank 0 one message with tag 7.
    if (rank == 0) {
      std::set<int> seen;
      for (int k = 1; k < n; ++k) {
        Bytes b(64, '\0');
        smddp::OpCtx ctx = p2p_ctx(c, 64, smddp::kAnyPeer, false);
        int from = c.recv_any(b.data(), 64, 7, ctx);
        EXPECT(from > 0 && from < n, topo.name, " recv_any returned rank ", from);
        EXPECT(seen.insert(from).second, topo.name, " recv_any returned rank ", from, " twice");
        std::string diff = compare_bytes(b.data(), make_bytes(from, 64, 7));
        EXPECT(diff.empty(), topo.name, " recv_any from ", from, ": ", diff);
      }
    } else {
      Bytes b = make_bytes(rank, 64, 7);
      c.send(b.data(), 64, 0, 7, p2p_ctx(c, 64, 0, true));
    }
    // Collectives still line up after point-to-point traffic.
    Bytes buf = make_input(DType::F32, rank, 33, 9);
    Reduction red = reduction(DType::F32, RedOp::SUM, n);
    c.allreduce(buf.data(), 33, red, ctx_of(c, "all_reduce", DType::F32, int(RedOp::SUM), 33));
    EXPECT(compare(DType::F32, buf.data(), expected_reduction(DType::F32, red, n, 33, 9)).empty(),
           topo.name, " all_reduce after send/recv");
    expect_hierarchy(topo, c);
  });
}

}  // namespace

void check_rooted(const Topology& topo) {
  const int n = topo.ranks;
  run_group(n, config_of(topo), [&](Communicator& c, int rank) {
    int salt = 500;
    for (int root = 0; root < n; ++root) {
      const uint64_t extra = uint64_t(root) + 1;
      // reduce: the root gets the reduction, the others' data is unchanged.
      for (const RedCase& rc :
           {RedCase{DType::F32, RedOp::SUM, 1.0}, RedCase{DType::I64, RedOp::MIN, 1.0},
            RedCase{DType::BF16, RedOp::AVG, 1.0}}) {
        for (size_t count : {size_t(1), size_t(7), size_t(5003)}) {
          ++salt;
          Bytes buf = make_input(rc.t, rank, count, salt);
          Reduction red = reduction(rc.t, rc.op, n);
          c.reduce(buf.data(), count, red, root,
                   ctx_of(c, "reduce", rc.t, int(rc.op), count, extra));
          Bytes want = rank == root ? expected_reduction(rc.t, red, n, count, salt)
                                    : make_input(rc.t, rank, count, salt);
          std::string diff = compare(rc.t, buf.data(), want);
          EXPECT(diff.empty(), where(topo, "reduce", rank, rc.t, rc.op, count), "root ", root, ": ",
                 diff);
        }
      }
      // gather and scatter.
      for (size_t bytes : {size_t(0), size_t(5), size_t(20011)}) {
        ++salt;
        Bytes in = make_bytes(rank, bytes, salt);
        std::vector<Bytes> outs(rank == root ? n : 0, Bytes(bytes, '\0'));
        std::vector<char*> dst;
        for (auto& o : outs) dst.push_back(o.data());
        c.gather(in.data(), bytes, dst, root, ctx_of(c, "gather", DType::U8, -1, bytes, extra));
        for (size_t r = 0; r < outs.size(); ++r) {
          std::string diff =
              compare_bytes(outs[r].data(), make_bytes(static_cast<int>(r), bytes, salt));
          EXPECT(diff.empty(), topo.name, " gather root ", root, " part ", r, ": ", diff);
        }
        ++salt;
        std::vector<Bytes> ins;
        std::vector<const char*> src;
        if (rank == root) {
          for (int r = 0; r < n; ++r) ins.push_back(make_bytes(r, bytes, salt));
          for (auto& b : ins) src.push_back(b.data());
        }
        Bytes out(bytes + 1, '\x5a');
        c.scatter(src, bytes, out.data(), root, ctx_of(c, "scatter", DType::U8, -1, bytes, extra));
        std::string diff = compare_bytes(out.data(), make_bytes(rank, bytes, salt));
        EXPECT(diff.empty(), topo.name, " scatter root ", root, " rank ", rank, ": ", diff);
        EXPECT(out.back() == '\x5a', topo.name, " scatter wrote past its output");
      }
    }
    expect_ring_used(topo, c);
    expect_hierarchy(topo, c);
  });
}

void check_allreduce(const Topology& topo) {
  const int n = topo.ranks;
  run_group(n, config_of(topo), [&](Communicator& c, int rank) {
    // The path under test: one host, one host per rank, or the topology's forced hosts.
    expect_hierarchy(topo, c);
    int salt = 0;
    for (const RedCase& rc : kReductions) {
      for (size_t count : kCounts) {
        ++salt;
        Bytes buf = make_input(rc.t, rank, count, salt);
        Reduction red = reduction(rc.t, rc.op, n, rc.premul);
        const uint64_t trees = c.net_ops(smddp::NetAlgo::TREE);
        c.allreduce(buf.data(), count, red, ctx_of(c, "all_reduce", rc.t, int(rc.op), count));
        std::string diff = compare(rc.t, buf.data(), expected_reduction(rc.t, red, n, count, salt));
        EXPECT(diff.empty(), where(topo, "all_reduce", rank, rc.t, rc.op, count), diff);
        // Each call took the tree exactly where the rule says (Note [Auto by size and host count]).
        const size_t tree_bytes = expected_tree_bytes(topo, c.layout());
        const bool tree = tree_bytes > 0 && count * smddp::dtype_size(rc.t) <= tree_bytes;
        EXPECT(c.net_ops(smddp::NetAlgo::TREE) - trees == (tree ? 1u : 0u),
               where(topo, "all_reduce", rank, rc.t, rc.op, count), "the tree ",
               tree ? "not taken" : "taken");
      }
    }
    expect_ring_used(topo, c);
    expect_hierarchy(topo, c);
  });
}

void check_reduce_scatter(const Topology& topo) {
  const int n = topo.ranks;
  const std::vector<RedCase> cases = {
      {DType::F32, RedOp::SUM, 1.0}, {DType::BF16, RedOp::AVG, 1.0}, {DType::I64, RedOp::MAX, 1.0}};
  run_group(n, config_of(topo), [&](Communicator& c, int rank) {
    int salt = 100;
    for (const RedCase& rc : cases) {
      for (size_t count : {size_t(0), size_t(1), size_t(7), size_t(1001), size_t(2500)}) {
        ++salt;
        const size_t esz = smddp::dtype_size(rc.t);
        Bytes in = make_input(rc.t, rank, count * n, salt);
        Bytes out(count * esz + 1, '\x5a');  // one guard byte
        Reduction red = reduction(rc.t, rc.op, n);
        c.reduce_scatter(in.data(), out.data(), count, red,
                         ctx_of(c, "reduce_scatter", rc.t, int(rc.op), count));
        Bytes want = expected_reduction(rc.t, red, n, count, salt, rank * count);
        std::string diff = compare(rc.t, out.data(), want);
        EXPECT(diff.empty(), where(topo, "reduce_scatter", rank, rc.t, rc.op, count), diff);
        EXPECT(out.back() == '\x5a', where(topo, "reduce_scatter", rank, rc.t, rc.op, count),
               "wrote past its output");
        EXPECT(compare(rc.t, in.data(), make_input(rc.t, rank, count * n, salt)).empty(),
               where(topo, "reduce_scatter", rank, rc.t, rc.op, count), "changed its input");
      }
      // Parts of different sizes (Note [Reduce-scatter of unequal parts] in comm_algos.cpp):
      // empty, one element, odd, and longer than a buffer, each rank's part differing by round.
      const size_t kinds[] = {0, 1, 7, 1001, 5003};
      for (int round = 0; round < 2; ++round) {
        ++salt;
        std::vector<size_t> counts(n);
        size_t total = 0, first = 0;
        for (int p = 0; p < n; ++p) {
          counts[p] = kinds[(p * 2 + round + salt) % 5];
          if (p < rank) first += counts[p];
          total += counts[p];
        }
        const size_t count = counts[rank], esz = smddp::dtype_size(rc.t);
        Bytes in = make_input(rc.t, rank, total, salt);
        Bytes out(count * esz + 1, '\x5a');
        Reduction red = reduction(rc.t, rc.op, n);
        c.reduce_scatter(in.data(), out.data(), counts, red,
                         ctx_of(c, "reduce_scatter (unequal parts)", rc.t, int(rc.op), total));
        std::string diff =
            compare(rc.t, out.data(), expected_reduction(rc.t, red, n, count, salt, first));
        EXPECT(diff.empty(), where(topo, "unequal reduce_scatter", rank, rc.t, rc.op, count), diff);
        EXPECT(out.back() == '\x5a',
               where(topo, "unequal reduce_scatter", rank, rc.t, rc.op, count),
               "wrote past its output");
      }
    }
    expect_ring_used(topo, c);
    expect_hierarchy(topo, c);
  });
}

void check_allgather(const Topology& topo) {
  const int n = topo.ranks;
  run_group(n, config_of(topo), [&](Communicator& c, int rank) {
    int salt = 200;
    for (size_t bytes : {size_t(0), size_t(1), size_t(13), size_t(4099), size_t(20003)}) {
      ++salt;
      Bytes in = make_bytes(rank, bytes, salt);
      Bytes out(bytes * n + 1, '\x5a');
      c.allgather(in.data(), out.data(), bytes, ctx_of(c, "all_gather", DType::U8, -1, bytes));
      for (int r = 0; r < n; ++r) {
        std::string diff = compare_bytes(out.data() + r * bytes, make_bytes(r, bytes, salt));
        EXPECT(diff.empty(), topo.name, " all_gather rank ", rank, " bytes ", bytes, " part ", r,
               ": ", diff);
      }
      EXPECT(out.back() == '\x5a', topo.name, " all_gather wrote past its output");
      // In place: the input is this rank's part of the output (FSDP's all_gather_into_tensor).
      Bytes inplace(bytes * n, '\0');
      if (bytes) std::memcpy(inplace.data() + rank * bytes, in.data(), bytes);
      c.allgather(inplace.data() + rank * bytes, inplace.data(), bytes,
                  ctx_of(c, "all_gather", DType::U8, -1, bytes));
      for (int r = 0; r < n; ++r) {
        std::string diff = compare_bytes(inplace.data() + r * bytes, make_bytes(r, bytes, salt));
        EXPECT(diff.empty(), topo.name, " in-place all_gather rank ", rank, " bytes ", bytes,
               " part ", r, ": ", diff);
      }
    }
    expect_ring_used(topo, c);
    expect_hierarchy(topo, c);
  });
}

TEST_CASE(allreduce_shm2) { check_allreduce(kShm2); }
TEST_CASE(allreduce_shm3) { check_allreduce(kShm3); }
TEST_CASE(allreduce_tcp3) { check_allreduce(kTcp3); }
TEST_CASE(allreduce_hier4) { check_allreduce(kHier4); }
TEST_CASE(allreduce_hier4_mesh) { check_allreduce(kHier4Mesh); }
TEST_CASE(allreduce_ring3) { check_allreduce(kRing3); }
TEST_CASE(allreduce_ring6) { check_allreduce(kRing6); }
TEST_CASE(allreduce_ring6_forced) { check_allreduce(kRing6Forced); }
TEST_CASE(reduce_scatter_shm3) { check_reduce_scatter(kShm3); }
TEST_CASE(reduce_scatter_tcp3) { check_reduce_scatter(kTcp3); }
TEST_CASE(reduce_scatter_hier4) { check_reduce_scatter(kHier4); }
TEST_CASE(allreduce_hier4_fp32_wire) { check_allreduce(kHier4Fp32); }
TEST_CASE(allreduce_hier4_fp32_wire_mesh) { check_allreduce(kHier4Fp32Mesh); }
TEST_CASE(reduce_scatter_ring6_fp32_wire) { check_reduce_scatter(kRing6Fp32); }
TEST_CASE(rooted_ring6_fp32_wire) { check_rooted(kRing6Fp32); }
TEST_CASE(reduce_scatter_ring3) { check_reduce_scatter(kRing3); }
TEST_CASE(reduce_scatter_ring6) { check_reduce_scatter(kRing6); }
TEST_CASE(allgather_shm3) { check_allgather(kShm3); }
TEST_CASE(allgather_tcp3) { check_allgather(kTcp3); }
TEST_CASE(allgather_hier4) { check_allgather(kHier4); }
TEST_CASE(allgather_ring3) { check_allgather(kRing3); }
TEST_CASE(allgather_ring6) { check_allgather(kRing6); }
TEST_CASE(broadcast_shm3) { check_broadcast(kShm3); }
TEST_CASE(broadcast_tcp3) { check_broadcast(kTcp3); }
TEST_CASE(broadcast_hier4) { check_broadcast(kHier4); }
TEST_CASE(alltoall_shm3) { check_alltoall(kShm3); }
TEST_CASE(alltoall_tcp3) { check_alltoall(kTcp3); }
TEST_CASE(alltoall_hier4) { check_alltoall(kHier4); }
TEST_CASE(rooted_shm3) { check_rooted(kShm3); }
TEST_CASE(rooted_tcp3) { check_rooted(kTcp3); }
TEST_CASE(rooted_hier4) { check_rooted(kHier4); }
TEST_CASE(rooted_ring6) { check_rooted(kRing6); }
TEST_CASE(barrier_shm3) { check_barrier(kShm3); }
TEST_CASE(barrier_tcp3) { check_barrier(kTcp3); }
TEST_CASE(barrier_hier4) { check_barrier(kHier4); }
TEST_CASE(send_recv_shm3) { check_send_recv(kShm3); }
TEST_CASE(send_recv_tcp3) { check_send_recv(kTcp3); }
TEST_CASE(send_recv_hier4) { check_send_recv(kHier4); }
TEST_CASE(send_recv_shm2_over_tcp) { check_send_recv(kShmTcpP2P); }
TEST_CASE(allreduce_uneven312_hd) { check_allreduce(kUneven312Hd); }
TEST_CASE(allreduce_uneven21) { check_allreduce(kUneven21); }
TEST_CASE(allreduce_uneven12) { check_allreduce(kUneven12); }
TEST_CASE(allreduce_uneven312) { check_allreduce(kUneven312); }
TEST_CASE(allreduce_uneven_mixed) { check_allreduce(kUnevenMixed); }
TEST_CASE(allreduce_uneven312_ring) { check_allreduce(kUneven312Ring); }
TEST_CASE(reduce_scatter_uneven21) { check_reduce_scatter(kUneven21); }
TEST_CASE(reduce_scatter_uneven12) { check_reduce_scatter(kUneven12); }
TEST_CASE(reduce_scatter_uneven312) { check_reduce_scatter(kUneven312); }
TEST_CASE(reduce_scatter_uneven_mixed) { check_reduce_scatter(kUnevenMixed); }
TEST_CASE(reduce_scatter_uneven312_ring) { check_reduce_scatter(kUneven312Ring); }
TEST_CASE(allgather_uneven21) { check_allgather(kUneven21); }
TEST_CASE(allgather_uneven12) { check_allgather(kUneven12); }
TEST_CASE(allgather_uneven312) { check_allgather(kUneven312); }
TEST_CASE(allgather_uneven_mixed) { check_allgather(kUnevenMixed); }
TEST_CASE(allgather_uneven312_ring) { check_allgather(kUneven312Ring); }
TEST_CASE(rooted_uneven21) { check_rooted(kUneven21); }
TEST_CASE(rooted_uneven12) { check_rooted(kUneven12); }
TEST_CASE(rooted_uneven312) { check_rooted(kUneven312); }
TEST_CASE(broadcast_uneven12) { check_broadcast(kUneven12); }
TEST_CASE(broadcast_uneven312) { check_broadcast(kUneven312); }
TEST_CASE(barrier_uneven12) { check_barrier(kUneven12); }
TEST_CASE(barrier_uneven312) { check_barrier(kUneven312); }
TEST_CASE(alltoall_uneven312) { check_alltoall(kUneven312); }
TEST_CASE(send_recv_uneven312) { check_send_recv(kUneven312); }

// Note [Hosts that share CPUs]: ranks of every host on one kernel count against the union of
// their CPU masks (hex, CPUs 0-3 in the first digit).
TEST_CASE(machine_oversubscribed_counts_ranks_of_one_kernel) {
  using smddp::ranks_outnumber_cpus;
  const std::vector<std::string> one_kernel(4, "boot-a");
  EXPECT(ranks_outnumber_cpus(one_kernel, {"3", "3", "3", "3"}, "boot-a"),
         "4 ranks (2 hosts of 2) on CPUs 0-1");
  EXPECT(!ranks_outnumber_cpus(one_kernel, {"f", "f", "f", "f"}, "boot-a"), "4 ranks, 4 CPUs");
  EXPECT(!ranks_outnumber_cpus(one_kernel, {"3", "3", "c", "c"}, "boot-a"),
         "two pods of 2 ranks with 2 CPUs each: 4 CPUs in all");
  EXPECT(ranks_outnumber_cpus(one_kernel, {"1", "1", "01", "01"}, "boot-a"),
         "4 ranks on CPUs 0 and 4");
  EXPECT(ranks_outnumber_cpus({"boot-a", "boot-a", "boot-b", "boot-b"}, {"1", "1", "1", "1"},
                              "boot-a"),
         "2 ranks of this kernel on CPU 0 outnumber it; the other kernel's do not count");
  EXPECT(!ranks_outnumber_cpus({"boot-a", "boot-b", "boot-c"}, {"1", "1", "1"}, "boot-a"),
         "one rank per kernel");
  EXPECT(!ranks_outnumber_cpus(one_kernel, {"3", "3", "3", "3"}, ""), "unknown kernel");
  EXPECT(!ranks_outnumber_cpus(one_kernel, {"", "", "", ""}, "boot-a"), "unknown masks");
}

}  // namespace smddp_test
