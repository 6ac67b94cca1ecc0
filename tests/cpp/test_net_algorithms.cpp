// The inter-host algorithms taken where asked for (Note [Inter-host algorithms] in
// net_algorithm.h), on the checks of test_collectives.cpp (collective_checks.h):
// halving-doubling (Note [Halving and doubling between hosts]) and the tree (Note [A tree for
// small all-reduces]). For the tree also: its results against a model of its order of sums
// and an fp64 reference over random inputs, the same bits on every rank, and the per-call
// rule that sends small all_reduces by it under auto (Note [Auto by size and host count]).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "collective_checks.h"
#include "data.h"
#include "harness.h"
#include "smddp/algorithms/net_algorithm.h"

namespace smddp_test {
namespace {

using smddp::Communicator;
using smddp::DType;
using smddp::NetAlgo;
using smddp::RedOp;

// Recursive halving-doubling across hosts (Note [Halving and doubling between hosts] in
// net_halving_doubling.cpp), asked for: 2 to 9 hosts of one rank (powers of two, and the fold
// of 1 to 3 extra hosts), 3 and 4 hosts of 2 ranks (the shared-memory steps inside the first
// round), and 3 hosts of 2 with bf16 partials in fp32 on the wire.
constexpr smddp::NetAlgo kHd = smddp::NetAlgo::HALVING_DOUBLING;
const Topology kHd2{"hd2", 2, 1, 8 << 10, kHd};
const Topology kHd3{"hd3", 3, 1, 8 << 10, kHd};
const Topology kHd4{"hd4", 4, 1, 8 << 10, kHd};
const Topology kHd5{"hd5", 5, 1, 8 << 10, kHd};
const Topology kHd6{"hd6", 6, 1, 8 << 10, kHd};
const Topology kHd7{"hd7", 7, 1, 8 << 10, kHd};
const Topology kHd8{"hd8", 8, 1, 8 << 10, kHd};
const Topology kHd9{"hd9", 9, 1, 8 << 10, kHd};
const Topology kHd3x2{"hd3x2", 6, 2, 8 << 10, kHd};
const Topology kHd4x2{"hd4x2", 8, 2, 8 << 10, kHd};
const Topology kHd3x2Fp32{"hd3x2_fp32_wire", 6, 2, 8 << 10, kHd, {}, true};
// The tree (Note [A tree for small all-reduces] in net_tree.cpp), asked for: 2 to 5 hosts of
// one rank (3 and 5 fold an extra host into a core), 3 hosts of 2 (the shared-memory steps
// inside the fold), and 3 hosts of 2 with bf16 partials in fp32 on the wire. Under auto the
// all_reduces of every equal-hosts topology here take it too (Note [Auto by size and host count]).
constexpr smddp::NetAlgo kTree = smddp::NetAlgo::TREE;
const Topology kTree2{"tree2", 2, 1, 8 << 10, kTree};
const Topology kTree3{"tree3", 3, 1, 8 << 10, kTree};
const Topology kTree4{"tree4", 4, 1, 8 << 10, kTree};
const Topology kTree5{"tree5", 5, 1, 8 << 10, kTree};
const Topology kTree3x2{"tree3x2", 6, 2, 8 << 10, kTree};
const Topology kTree3x2Fp32{"tree3x2_fp32_wire", 6, 2, 8 << 10, kTree, {}, true};

smddp::CommConfig tree_config(const char* name, int force_local_size, NetAlgo algo) {
  smddp::CommConfig cfg;
  cfg.group_name = name;
  cfg.timeout_s = 60;
  smddp::Settings& s = cfg.settings;
  s.buffer_bytes = 16 << 10;
  s.pool_bytes = 4 << 20;
  s.p2p_bytes = 8 << 10;
  s.spin_us = 20;
  s.force_local_size = force_local_size;
  s.socket_addr = "127.0.0.1";
  s.net_chunk_bytes = (4 << 10) - 1;  // several messages a round, ending inside parts
  s.net_algo = algo;
  return cfg;
}

smddp::OpCtx sum_ctx(Communicator& c, DType t, size_t count, const char* name = "all_reduce") {
  smddp::CollDesc d;
  d.dtype_op = (static_cast<uint32_t>(t) << 8) | static_cast<uint32_t>(RedOp::SUM);
  d.count = count;
  smddp::OpArgs a;
  a.dtype = smddp::dtype_name(t);
  a.op = "SUM";
  a.numel = static_cast<int64_t>(count);
  return c.make_ctx(name, d, a, 0);
}

smddp::Reduction sum_of(DType t) {
  smddp::Reduction r;
  r.dtype = t;
  r.op = RedOp::SUM;
  return r;
}

constexpr size_t kRandomCount = 4099;  // not a multiple of the parts' alignment

// Rank `rank`'s random input (magnitudes over a few decades, signs mixed), as floats
// already in `t` (bf16 values for bf16).
std::vector<float> random_input(int rank, DType t) {
  std::mt19937 gen(1000u + static_cast<unsigned>(rank));
  std::normal_distribution<float> normal;
  std::vector<float> x(kRandomCount);
  for (float& v : x) {
    v = normal(gen) * std::exp(normal(gen));
    if (t == DType::BF16) v = from_bf16(to_bf16(v));
  }
  return x;
}

Bytes as_bytes(const std::vector<float>& x, DType t) {
  Bytes b(x.size() * smddp::dtype_size(t));
  for (size_t i = 0; i < x.size(); ++i) {
    if (t == DType::F32) {
      std::memcpy(b.data() + 4 * i, &x[i], 4);
    } else {
      const uint16_t v = to_bf16(x[i]);
      std::memcpy(b.data() + 2 * i, &v, 2);
    }
  }
  return b;
}

// The tree's result (Note [A tree for small all-reduces]), element by element: each host's
// partial is the fp32 sum of its ranks' inputs in rank order; core c adds its extra's partial,
// rounded to the wire type, to its own; then at d = 1, 2, ..., P/2 the running sums of cores
// c and c ^ d, each rounded to the wire type, are added lower core first; the last sum is
// rounded once to the dtype.
std::vector<float> tree_model(const std::vector<std::vector<float>>& xs, int local, DType t) {
  const int hosts = static_cast<int>(xs.size()) / local;
  int cores = 1;
  while (cores * 2 <= hosts) cores *= 2;
  auto wire = [&](float v) { return t == DType::BF16 ? from_bf16(to_bf16(v)) : v; };
  std::vector<float> out(kRandomCount);
  std::vector<float> partial(hosts), run(cores), next(cores);
  for (size_t i = 0; i < kRandomCount; ++i) {
    for (int h = 0; h < hosts; ++h) {
      partial[h] = xs[h * local][i];
      for (int l = 1; l < local; ++l) partial[h] += xs[h * local + l][i];
    }
    for (int c = 0; c < cores; ++c) {
      run[c] = wire(c + cores < hosts ? partial[c] + wire(partial[c + cores]) : partial[c]);
    }
    for (int d = 1; d < cores; d *= 2) {
      for (int c = 0; c < cores; ++c) next[c] = run[std::min(c, c ^ d)] + run[std::max(c, c ^ d)];
      for (int c = 0; c < cores; ++c) run[c] = 2 * d < cores ? wire(next[c]) : next[c];
    }
    out[i] = wire(run[0]);
  }
  return out;
}

// On `hosts` hosts of `local` ranks, fp32 and bf16 sums of random inputs with the tree asked
// for: every rank holds the same bits, those of tree_model, and each result is within the
// Note's bound of the exact (fp64) sum: u |r| + u ceil(log2 H) sum |P_h| + the fp32 sums
// (2 N 2^-24 sum |x|), 5% over it.
void check_tree_precision(int hosts, int local) {
  const int n = hosts * local;
  const std::string name = cat("tree_precision_", hosts, "x", local);
  for (DType t : {DType::F32, DType::BF16}) {
    std::vector<std::vector<float>> xs;
    for (int r = 0; r < n; ++r) xs.push_back(random_input(r, t));
    std::vector<Bytes> got(n);
    run_group(n, tree_config(name.c_str(), local, NetAlgo::TREE), [&](Communicator& c, int r) {
      Bytes buf = as_bytes(xs[r], t);
      c.allreduce(buf.data(), kRandomCount, sum_of(t), sum_ctx(c, t, kRandomCount));
      EXPECT(c.net_ops(NetAlgo::TREE) == 1, name, ": the tree was not taken");
      got[r] = std::move(buf);
    });
    for (int r = 1; r < n; ++r) {
      EXPECT(got[r] == got[0], name, " ", smddp::dtype_name(t), ": rank ", r,
             " holds other bits than rank 0");
    }
    const Bytes want = as_bytes(tree_model(xs, local, t), t);
    const std::string diff = compare(t, got[0].data(), want);
    EXPECT(diff.empty(), name, " ", smddp::dtype_name(t), ": not the model's bits: ", diff);
    const double u = t == DType::BF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -24);
    const double rounded = std::ceil(std::log2(static_cast<double>(hosts)));
    size_t over = 0;
    for (size_t i = 0; i < kRandomCount; ++i) {
      double exact = 0, spread = 0, inputs = 0;
      for (int h = 0; h < hosts; ++h) {
        double p = 0;
        for (int l = 0; l < local; ++l) {
          p += xs[h * local + l][i];
          inputs += std::fabs(xs[h * local + l][i]);
        }
        exact += p;
        spread += std::fabs(p);
      }
      double r = 0;
      if (t == DType::F32) {
        float v;
        std::memcpy(&v, got[0].data() + 4 * i, 4);
        r = v;
      } else {
        uint16_t v;
        std::memcpy(&v, got[0].data() + 2 * i, 2);
        r = from_bf16(v);
      }
      const double bound = 1.05 * (u * std::fabs(exact) + u * rounded * spread +
                                   2.0 * n * std::ldexp(1.0, -24) * inputs);
      over += std::fabs(r - exact) > bound;
    }
    EXPECT(over == 0, name, " ", smddp::dtype_name(t), ": ", over,
           " elements beyond the Note's bound");
  }
}

}  // namespace

TEST_CASE(allreduce_hd2) { check_allreduce(kHd2); }
TEST_CASE(allreduce_hd3) { check_allreduce(kHd3); }
TEST_CASE(allreduce_hd4) { check_allreduce(kHd4); }
TEST_CASE(allreduce_hd5) { check_allreduce(kHd5); }
TEST_CASE(allreduce_hd6) { check_allreduce(kHd6); }
TEST_CASE(allreduce_hd7) { check_allreduce(kHd7); }
TEST_CASE(allreduce_hd8) { check_allreduce(kHd8); }
TEST_CASE(allreduce_hd9) { check_allreduce(kHd9); }
TEST_CASE(allreduce_hd3x2) { check_allreduce(kHd3x2); }
TEST_CASE(allreduce_hd4x2) { check_allreduce(kHd4x2); }
TEST_CASE(allreduce_hd3x2_fp32_wire) { check_allreduce(kHd3x2Fp32); }
TEST_CASE(reduce_scatter_hd2) { check_reduce_scatter(kHd2); }
TEST_CASE(reduce_scatter_hd3) { check_reduce_scatter(kHd3); }
TEST_CASE(reduce_scatter_hd4) { check_reduce_scatter(kHd4); }
TEST_CASE(reduce_scatter_hd5) { check_reduce_scatter(kHd5); }
TEST_CASE(reduce_scatter_hd6) { check_reduce_scatter(kHd6); }
TEST_CASE(reduce_scatter_hd7) { check_reduce_scatter(kHd7); }
TEST_CASE(reduce_scatter_hd8) { check_reduce_scatter(kHd8); }
TEST_CASE(reduce_scatter_hd9) { check_reduce_scatter(kHd9); }
TEST_CASE(reduce_scatter_hd3x2) { check_reduce_scatter(kHd3x2); }
TEST_CASE(reduce_scatter_hd4x2) { check_reduce_scatter(kHd4x2); }
TEST_CASE(reduce_scatter_hd3x2_fp32_wire) { check_reduce_scatter(kHd3x2Fp32); }
TEST_CASE(allgather_hd2) { check_allgather(kHd2); }
TEST_CASE(allgather_hd3) { check_allgather(kHd3); }
TEST_CASE(allgather_hd4) { check_allgather(kHd4); }
TEST_CASE(allgather_hd5) { check_allgather(kHd5); }
TEST_CASE(allgather_hd6) { check_allgather(kHd6); }
TEST_CASE(allgather_hd7) { check_allgather(kHd7); }
TEST_CASE(allgather_hd8) { check_allgather(kHd8); }
TEST_CASE(allgather_hd9) { check_allgather(kHd9); }
TEST_CASE(allgather_hd3x2) { check_allgather(kHd3x2); }
TEST_CASE(allgather_hd4x2) { check_allgather(kHd4x2); }
TEST_CASE(rooted_hd3x2) { check_rooted(kHd3x2); }
TEST_CASE(rooted_hd5) { check_rooted(kHd5); }
TEST_CASE(allreduce_tree2) { check_allreduce(kTree2); }
TEST_CASE(allreduce_tree3) { check_allreduce(kTree3); }
TEST_CASE(allreduce_tree4) { check_allreduce(kTree4); }
TEST_CASE(allreduce_tree5) { check_allreduce(kTree5); }
TEST_CASE(allreduce_tree3x2) { check_allreduce(kTree3x2); }
TEST_CASE(allreduce_tree3x2_fp32_wire) { check_allreduce(kTree3x2Fp32); }
// The tree's group sends the other collectives as auto does (the ring on 3 hosts).
TEST_CASE(reduce_scatter_tree3x2) { check_reduce_scatter(kTree3x2); }
TEST_CASE(allgather_tree5) { check_allgather(kTree5); }

TEST_CASE(tree_precision_2_hosts) { check_tree_precision(2, 1); }
TEST_CASE(tree_precision_3_hosts) { check_tree_precision(3, 1); }
TEST_CASE(tree_precision_4_hosts) { check_tree_precision(4, 1); }
TEST_CASE(tree_precision_5_hosts) { check_tree_precision(5, 1); }
TEST_CASE(tree_precision_3_hosts_of_2) { check_tree_precision(3, 2); }

// Note [Auto by size and host count]: under auto, on the fewest hosts (of 3 to 8) where the
// rule has a tree, an all_reduce of the rule's size takes the tree and one element more the
// algorithm the rule names above it, in fp32 and bf16; a small reduce_scatter and all_gather
// take halving-doubling where the rule says so, else the ring. Every result exact (integer
// data).
TEST_CASE(auto_rule_picks_per_call) {
  int H = 3;
  while (H < 8 && smddp::auto_tree_max_bytes(H) == 0) ++H;
  const smddp::AutoBySize rule = smddp::auto_by_size(H);
  EXPECT(rule.tree_max_bytes > 0, "no tree on 3 to 8 hosts");
  // What a call of `bytes` (its S) of kind `op` should take, by the rule.
  auto expected = [&](smddp::NetOp op, size_t bytes) {
    if (op == smddp::NetOp::ALL_REDUCE && bytes <= rule.tree_max_bytes) return NetAlgo::TREE;
    if (bytes <= rule.doubling_max_bytes[static_cast<size_t>(op)]) {
      return NetAlgo::HALVING_DOUBLING;
    }
    return NetAlgo::RING;
  };
  const NetAlgo algos[] = {NetAlgo::RING, NetAlgo::HALVING_DOUBLING, NetAlgo::TREE};
  run_group(H, tree_config("auto_rule", 1, NetAlgo::AUTO), [&](Communicator& c, int rank) {
    EXPECT(c.net_tree_max_bytes() == rule.tree_max_bytes, "the group's tree takes up to ",
           c.net_tree_max_bytes(), " bytes, the rule ", rule.tree_max_bytes);
    EXPECT(std::string(c.net_algorithm()) == "ring", "the group's algorithm is ",
           c.net_algorithm());
    // One call of kind `op` and S `bytes` took `want` and nothing else.
    auto took = [&](const std::vector<uint64_t>& before, NetAlgo want, const std::string& what) {
      for (size_t i = 0; i < 3; ++i) {
        const uint64_t n = c.net_ops(algos[i]) - before[i];
        EXPECT(n == (algos[i] == want ? 1u : 0u), what, ": algorithm ", int(algos[i]), " took ", n,
               " calls, expected ", int(want));
      }
    };
    auto counts = [&] {
      std::vector<uint64_t> v;
      for (NetAlgo a : algos) v.push_back(c.net_ops(a));
      return v;
    };
    int salt = 700;
    for (DType t : {DType::F32, DType::BF16}) {
      const size_t at = rule.tree_max_bytes / smddp::dtype_size(t);
      for (size_t count : {at, at + 1}) {
        ++salt;
        const std::vector<uint64_t> before = counts();
        Bytes buf = make_input(t, rank, count, salt);
        c.allreduce(buf.data(), count, sum_of(t), sum_ctx(c, t, count));
        const std::string diff =
            compare(t, buf.data(), expected_reduction(t, sum_of(t), H, count, salt));
        EXPECT(diff.empty(), smddp::dtype_name(t), " all_reduce of ", count, ": ", diff);
        const size_t bytes = count * smddp::dtype_size(t);
        took(before, expected(smddp::NetOp::ALL_REDUCE, bytes),
             std::string(smddp::dtype_name(t)) + " all_reduce of " + std::to_string(bytes));
      }
    }
    std::vector<uint64_t> before = counts();
    Bytes in = make_input(DType::F32, rank, H * 7, 9), out(7 * 4);
    c.reduce_scatter(in.data(), out.data(), 7, sum_of(DType::F32),
                     sum_ctx(c, DType::F32, 7, "reduce_scatter"));
    EXPECT(compare(DType::F32, out.data(),
                   expected_reduction(DType::F32, sum_of(DType::F32), H, 7, 9, rank * 7))
               .empty(),
           "reduce_scatter of 7");
    took(before, expected(smddp::NetOp::REDUCE_SCATTER, H * 7 * 4), "reduce_scatter");
    before = counts();
    Bytes mine = make_bytes(rank, 5, 10), all(5 * H);
    smddp::CollDesc d;
    d.count = 5;
    smddp::OpArgs a;
    a.dtype = "uint8";
    a.numel = 5;
    c.allgather(mine.data(), all.data(), 5, c.make_ctx("all_gather", d, a, 0));
    for (int r = 0; r < H; ++r) {
      EXPECT(compare_bytes(all.data() + 5 * r, make_bytes(r, 5, 10)).empty(), "all_gather part ",
             r);
    }
    took(before, expected(smddp::NetOp::ALL_GATHER, 5 * H), "all_gather");
  });
}

// Note [Auto by size and host count]: on the fewest hosts where the rule sends a small
// reduce_scatter and all_gather by halving-doubling, a call of the rule's S takes it and one
// of twice that S the ring; each call's S is the whole input (reduce_scatter) or output
// (all_gather), the same on every rank. Every result exact.
TEST_CASE(auto_rule_takes_halving_doubling_per_call) {
  using smddp::NetOp;
  int H = 3;
  while (H < 32 && smddp::auto_by_size(H).doubling_max_bytes[1] == 0) ++H;
  const smddp::AutoBySize rule = smddp::auto_by_size(H);
  const size_t rs_max = rule.doubling_max_bytes[static_cast<size_t>(NetOp::REDUCE_SCATTER)];
  const size_t ag_max = rule.doubling_max_bytes[static_cast<size_t>(NetOp::ALL_GATHER)];
  EXPECT(rs_max > 0 && ag_max > 0, "no halving-doubling on 3 to 32 hosts");
  run_group(H, tree_config("auto_rule_hd", 1, NetAlgo::AUTO), [&](Communicator& c, int rank) {
    EXPECT(c.net_doubling_max_bytes(NetOp::REDUCE_SCATTER) == rs_max, "the group's rule");
    int salt = 900;
    // S = H * count * 4 bytes: count per rank at the rule's S, then twice it.
    for (size_t count : {rs_max / (4 * H), 2 * rs_max / (4 * H)}) {
      ++salt;
      const uint64_t hd = c.net_ops(NetAlgo::HALVING_DOUBLING), ring = c.net_ops(NetAlgo::RING);
      Bytes in = make_input(DType::F32, rank, H * count, salt), out(count * 4);
      c.reduce_scatter(in.data(), out.data(), count, sum_of(DType::F32),
                       sum_ctx(c, DType::F32, count, "reduce_scatter"));
      EXPECT(
          compare(DType::F32, out.data(),
                  expected_reduction(DType::F32, sum_of(DType::F32), H, count, salt, rank * count))
              .empty(),
          "reduce_scatter of ", count);
      const bool small = H * count * 4 <= rs_max;
      EXPECT(c.net_ops(NetAlgo::HALVING_DOUBLING) - hd == (small ? 1u : 0u) &&
                 c.net_ops(NetAlgo::RING) - ring == (small ? 0u : 1u),
             "reduce_scatter of S ", H * count * 4, ": expected ",
             small ? "halving-doubling" : "the ring");
    }
    for (size_t count : {ag_max / H, 2 * ag_max / H}) {
      const uint64_t hd = c.net_ops(NetAlgo::HALVING_DOUBLING), ring = c.net_ops(NetAlgo::RING);
      Bytes mine = make_bytes(rank, count, 11), all(count * H);
      smddp::CollDesc d;
      d.count = count;
      smddp::OpArgs a;
      a.dtype = "uint8";
      a.numel = static_cast<int64_t>(count);
      c.allgather(mine.data(), all.data(), count, c.make_ctx("all_gather", d, a, 0));
      for (int r = 0; r < H; ++r) {
        EXPECT(compare_bytes(all.data() + count * r, make_bytes(r, count, 11)).empty(),
               "all_gather part ", r);
      }
      const bool small = H * count <= ag_max;
      EXPECT(c.net_ops(NetAlgo::HALVING_DOUBLING) - hd == (small ? 1u : 0u) &&
                 c.net_ops(NetAlgo::RING) - ring == (small ? 0u : 1u),
             "all_gather of S ", H * count, ": expected ", small ? "halving-doubling" : "the ring");
    }
  });
}

}  // namespace smddp_test
