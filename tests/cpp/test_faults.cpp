// Faults with ranks as threads: a rank that never joins the group or a collective (an error
// naming what timed out, within the deadline), a step buffer too small for the group,
// abort() from another thread, mismatched collectives, and the zero-copy path of the tensor
// pools.
//
// Not covered here: a rank whose process dies. Ranks as threads share one pid, so the
// liveness checks (Note [Exits are not failures] in shm.h) cannot see a thread end; the
// spawned-process tests in tests/distributed cover them.
#include <atomic>

#include "data.h"
#include "harness.h"
#include "smddp/algorithms/shm_algos.h"
#include "smddp/algorithms/shm_copy.h"
#include "smddp/algorithms/shm_rooted.h"

namespace smddp_test {
namespace {

using smddp::Communicator;
using smddp::DType;
using smddp::RedOp;
using std::chrono::steady_clock;

smddp::CommConfig small_config(const char* name, int force_local_size) {
  smddp::CommConfig cfg;
  cfg.group_name = name;
  cfg.timeout_s = 60;
  cfg.settings.buffer_bytes = 16 << 10;
  cfg.settings.pool_bytes = 4 << 20;
  cfg.settings.p2p_bytes = 8 << 10;
  cfg.settings.spin_us = 20;
  cfg.settings.force_local_size = force_local_size;
  cfg.settings.socket_addr = "127.0.0.1";
  return cfg;
}

smddp::OpCtx allreduce_ctx(Communicator& c, size_t count, double timeout_s) {
  smddp::CollDesc d;
  d.dtype_op = (static_cast<uint32_t>(DType::F32) << 8) | static_cast<uint32_t>(RedOp::SUM);
  d.count = count;
  smddp::OpArgs a;
  a.dtype = "float32";
  a.op = "SUM";
  a.numel = static_cast<int64_t>(count);
  return c.make_ctx("all_reduce", d, a, timeout_s);
}

smddp::Reduction sum_f32() {
  smddp::Reduction r;
  r.dtype = DType::F32;
  r.op = RedOp::SUM;
  return r;
}

}  // namespace

TEST_CASE(group_creation_times_out_naming_the_missing_rank) {
  // Rank 1 never arrives; rank 0's set-up gives up at the group's timeout.
  MemKV kv;
  smddp::CommConfig cfg = small_config("never_joined", 0);
  cfg.rank = 0;
  cfg.size = 2;
  cfg.timeout_s = 0.5;
  auto t0 = steady_clock::now();
  EXPECT_THROW_WITH(Communicator comm(kv, cfg), "creating group 'never_joined'",
                    "timed out after 0.5 s", "ranks [1] never arrived");
  const double took = seconds_since(t0);
  EXPECT(took >= 0.45 && took < 2.5, "gave up after ", took, " s");
}

// A peer record whose process id is not a positive integer (a rank of another smddp version,
// or something else writing the group's keys) raises at creation, naming the rank, the field
// and the record. Before, std::stoi raised a bare "stoi" for some, and took "12x" as pid 12.
TEST_CASE(a_peer_record_with_a_malformed_pid_is_refused_at_creation) {
  for (const char* pid : {"12x", "", "0", "-5", "99999999999"}) {
    MemKV kv;
    smddp::CommConfig cfg = small_config("bad_pid", 0);
    cfg.rank = 0;
    cfg.size = 2;
    cfg.timeout_s = 3;  // without the check, "12x" and "0" waited for rank 1 until then
    std::thread fake([&] {
      // Rank 1's record: rank 0's, with the pid replaced.
      std::string record = kv.get("smddp/peer/0");
      size_t at = 0;
      for (int k = 0; k < 3; ++k) at = record.find('|', at) + 1;
      record.replace(at, record.find('|', at) - at, pid);
      kv.set("smddp/peer/1", record);
    });
    EXPECT_THROW_WITH(Communicator comm(kv, cfg), "creating group 'bad_pid'",
                      "the peer record of rank 1 (store key smddp/peer/1) has the process id '" +
                          std::string(pid) + "', not a positive integer",
                      "every rank must run the same version of smddp");
    fake.join();
  }
}

// Note [Step buffer minimum] in shm_algos.h: 65 ranks on one host need 65 scatter slots of 64
// bytes, more than the least buffer the settings allow (4K). Before, the group was created,
// and a scatter's root wrote its last slot past the end of its buffer.
TEST_CASE(a_buffer_too_small_for_the_ranks_on_a_host_is_refused_at_creation) {
  constexpr int kRanks = 65;
  smddp::CommConfig cfg = small_config("small_buffer", 0);
  cfg.settings.buffer_bytes = 4 << 10;
  cfg.settings.pool_bytes = 0;
  cfg.settings.p2p_bytes = 0;
  MemKV kv;
  std::atomic<int> refused{0};
  run_threads(kRanks, [&](int rank) {
    smddp::CommConfig c = cfg;
    c.rank = rank;
    c.size = kRanks;
    try {
      Communicator comm(kv, c);
      EXPECT(false, "rank ", rank, " created the group");
    } catch (const std::invalid_argument& e) {
      ++refused;
      const std::string m = e.what();
      for (const char* part : {"creating group 'small_buffer'",
                               "SMDDP_BUFFER_BYTES (SMDDPOptions buffer_bytes) is "
                               "4096 bytes, too small for a group of 65 ranks with 65 on one host",
                               "at least 4160 bytes", "set SMDDP_BUFFER_BYTES to 8192 or more"}) {
        EXPECT(m.find(part) != std::string::npos, "rank ", rank, ": '", m, "' lacks '", part, "'");
      }
    }
  });
  EXPECT(refused.load() == kRanks, refused.load(), " of ", kRanks, " ranks refused the group");
}

TEST_CASE(step_buffer_minimum_and_the_algorithms_checks) {
  using smddp::shm::min_buffer_bytes;
  EXPECT(min_buffer_bytes(4, 4) == 256, min_buffer_bytes(4, 4));         // 64 per local rank
  EXPECT(min_buffer_bytes(64, 512) == 4096, min_buffer_bytes(64, 512));  // the settings' least
  EXPECT(min_buffer_bytes(1, 1024) == 8192, min_buffer_bytes(1, 1024));  // 8 per group rank
  EXPECT(min_buffer_bytes(65, 65) == 4160, min_buffer_bytes(65, 65));
  // The backstops behind the creation check: a buffer without room for what one step puts
  // there raises instead of writing past its end.
  EXPECT(smddp::shm::chunk_elems(160, 20, 8) == 1, smddp::shm::chunk_elems(160, 20, 8));
  EXPECT_THROW_WITH(smddp::shm::chunk_elems(159, 20, 8),
                    "a step buffer of 159 bytes cannot hold 20 pieces of 8-byte elements");
  smddp::ShmConfig sc;  // never created: the checks come before any step
  sc.group_name = "backstop";
  sc.group_ranks = {0, 1, 2};
  sc.buffer_bytes = 191;
  smddp::ShmComm three(sc);
  smddp::OpCtx ctx;
  ctx.name = "scatter";
  EXPECT_THROW_WITH(
      smddp::shm::scatter(three, {}, {1, 1, 1}, nullptr, 0, ctx),
      "a step buffer of 191 bytes cannot hold a 64-byte slot for each of 3 local ranks");
  sc.buffer_bytes = 47;
  smddp::ShmComm tiny(sc);
  ctx.name = "all_to_all";
  EXPECT_THROW_WITH(smddp::shm::alltoall(tiny, nullptr, {}, nullptr, {}, ctx),
                    "a step buffer of 47 bytes cannot hold the split sizes of 3 local ranks");
}

static void collective_timeout(int force_local_size) {
  std::atomic<bool> rank0_done{false};
  run_group(2, small_config("hang", force_local_size), [&](Communicator& c, int rank) {
    std::vector<float> buf(100, 1.0f);
    if (rank == 1) {
      // Joined the group but never calls the collective until rank 0 gave up.
      while (!rank0_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      // Rank 0's failure reaches it instead of its own timeout (60 s). Its first call may
      // still complete: rank 0 posted its input before it gave up (then the sum is right);
      // the next one cannot.
      auto t0 = steady_clock::now();
      std::string error;
      for (int call = 0; call < 2 && error.empty(); ++call) {
        std::fill(buf.begin(), buf.end(), 1.0f);
        try {
          c.allreduce(buf.data(), buf.size(), sum_f32(), allreduce_ctx(c, 100, 0));
          EXPECT(call == 0 && buf[0] == 2.0f && buf[99] == 2.0f, "call ", call, " returned ",
                 buf[0]);
        } catch (const std::exception& e) {
          error = e.what();
        }
      }
      EXPECT(error.find("all_reduce") != std::string::npos &&
                 error.find("rank 0") != std::string::npos,
             "rank 1's error does not name the collective and rank 0: '", error, "'");
      EXPECT(seconds_since(t0) < 2.5, "rank 1 learned of rank 0's failure after ",
             seconds_since(t0), " s");
      return;
    }
    auto t0 = steady_clock::now();
    EXPECT_THROW_WITH(c.allreduce(buf.data(), buf.size(), sum_f32(), allreduce_ctx(c, 100, 0.5)),
                      "all_reduce (float32, SUM, 100 elements) on group 'hang'",
                      "timed out after 0.5 s");
    const double took = seconds_since(t0);
    EXPECT(took >= 0.45 && took < 2.5, "gave up after ", took, " s");
    // The group is unusable afterwards, and says why.
    EXPECT_THROW_WITH(c.allreduce(buf.data(), buf.size(), sum_f32(), allreduce_ctx(c, 100, 0.5)),
                      "unusable after an earlier error", "timed out");
    rank0_done.store(true);
  });
}

TEST_CASE(collective_timeout_shm) { collective_timeout(0); }
TEST_CASE(collective_timeout_tcp) { collective_timeout(1); }

// Halving-doubling and the tree on 3 hosts (Note [Halving and doubling between hosts] in
// net_halving_doubling.cpp, Note [A tree for small all-reduces] in net_tree.cpp): host 2 folds
// into host 0, which pairs with host 1. Rank 2 never calls until the others gave up: rank 0
// times out naming rank 2, the one it waits for in the fold; rank 1, which waits for rank 0
// in the first round, fails naming rank 0 (its failure notice, or its own timeout); and rank
// 2, when it calls, learns of rank 0's.
static void fold_timeout_names_the_peer(smddp::NetAlgo algo, const char* group) {
  smddp::CommConfig cfg = small_config(group, 1);
  cfg.settings.net_algo = algo;
  std::atomic<int> gave_up{0};
  run_group(3, cfg, [&](Communicator& c, int rank) {
    std::vector<float> buf(100, 1.0f);
    if (rank == 2) {
      while (gave_up.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      EXPECT_THROW_WITH(c.allreduce(buf.data(), buf.size(), sum_f32(), allreduce_ctx(c, 100, 5)),
                        "all_reduce", "rank 0");
      return;
    }
    const double timeout = rank == 0 ? 0.5 : 1.5;
    const std::string message = EXPECT_THROW_WITH(
        c.allreduce(buf.data(), buf.size(), sum_f32(), allreduce_ctx(c, 100, timeout)),
        cat("all_reduce (float32, SUM, 100 elements) on group '", group, "'"));
    EXPECT(c.net_ops(algo) == 1, group, ": the all_reduce did not take the algorithm asked for");
    if (rank == 0) {
      EXPECT(message.find("timed out after 0.5 s") != std::string::npos &&
                 message.find("waiting for ranks [2]") != std::string::npos,
             "rank 0's error does not name rank 2: '", message, "'");
    } else {
      EXPECT(message.find("rank 0") != std::string::npos ||
                 message.find("ranks [0]") != std::string::npos,
             "rank 1's error does not name rank 0: '", message, "'");
    }
    gave_up.fetch_add(1);
  });
}

TEST_CASE(halving_doubling_timeout_names_the_peer) {
  fold_timeout_names_the_peer(smddp::NetAlgo::HALVING_DOUBLING, "hd_hang");
}
TEST_CASE(tree_timeout_names_the_peer) {
  fold_timeout_names_the_peer(smddp::NetAlgo::TREE, "tree_hang");
}

static void abort_from_another_thread(int force_local_size) {
  std::atomic<Communicator*> rank0{nullptr};
  std::atomic<bool> abort_returned{false};
  run_group(2, small_config("aborted", force_local_size), [&](Communicator& c, int rank) {
    std::vector<float> buf(100, 1.0f);
    if (rank == 1) {
      // Never joins the collective; aborts rank 0's group (as a shutdown would) instead.
      while (!rank0.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      rank0.load()->abort();
      abort_returned.store(true);
      return;
    }
    rank0.store(&c);
    auto t0 = steady_clock::now();
    EXPECT_THROW_WITH(c.allreduce(buf.data(), buf.size(), sum_f32(), allreduce_ctx(c, 100, 0)),
                      "all_reduce", "was aborted");
    const double took = seconds_since(t0);
    EXPECT(took >= 0.15 && took < 2.0, "the abort took ", took, " s");
    // abort() may still be running on rank 1's thread: the Communicator must outlive it.
    while (!abort_returned.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
}

TEST_CASE(abort_shm) { abort_from_another_thread(0); }
TEST_CASE(abort_tcp) { abort_from_another_thread(1); }

// Note [Abort tells the peers] (comm.cpp): a rank on its own host aborts before it has a
// connection to anyone; the notices of its abort still reach the ranks on the other hosts
// (Note [Failure notices] in tcp.h), whose all_reduce fails at once. Before, the abort's flag
// ended the notices' connection attempts, and the peers waited out their timeout.
TEST_CASE(abort_tells_peers_it_has_no_connection_to) {
  std::atomic<bool> aborted{false};
  std::atomic<int> peers_done{0};
  run_group(3, small_config("aborted_unconnected", 1), [&](Communicator& c, int rank) {
    if (rank == 0) {
      auto t0 = steady_clock::now();
      c.abort();
      EXPECT(seconds_since(t0) < 1.0, "the abort took ", seconds_since(t0), " s");
      aborted.store(true);
      // Stays in the group until the peers are done: its closing sockets must not tell them.
      while (peers_done.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      return;
    }
    while (!aborted.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::vector<float> buf(100, 1.0f);
    auto t0 = steady_clock::now();
    EXPECT_THROW_WITH(c.allreduce(buf.data(), buf.size(), sum_f32(), allreduce_ctx(c, 100, 5)),
                      "all_reduce", "aborted on rank 0");
    EXPECT(seconds_since(t0) < 2.0, "rank ", rank, " learned of the abort after ",
           seconds_since(t0), " s");
    peers_done.fetch_add(1);
  });
}

static void mismatch(int force_local_size) {
  run_group(2, small_config("mismatch", force_local_size), [&](Communicator& c, int rank) {
    const size_t count = rank == 0 ? 10 : 11;
    std::vector<float> buf(count, 1.0f);
    auto t0 = steady_clock::now();
    EXPECT_THROW_WITH(c.allreduce(buf.data(), count, sum_f32(), allreduce_ctx(c, count, 0)),
                      "mismatched collectives on group 'mismatch'", "10 elements", "11 elements");
    EXPECT(seconds_since(t0) < 2.0, "the mismatch was found after ", seconds_since(t0), " s");
  });
}

TEST_CASE(mismatch_shm) { mismatch(0); }
TEST_CASE(mismatch_tcp) { mismatch(1); }

// Note [Reduce-scatter of unequal parts] in comm_algos.cpp: ranks that disagree on a part's
// size raise, though their calls' descriptors are otherwise the same: rank 0 says rank 1's
// part has 5 elements and rank 1 says 6; then parts [4, 6] against [6, 4] (the same total,
// each rank's own part 4); then [0, 0] against [0, 1].
static void unequal_parts_mismatch(int force_local_size) {
  const std::vector<std::vector<std::vector<size_t>>> cases = {
      {{4, 5}, {4, 6}}, {{4, 6}, {6, 4}}, {{0, 0}, {0, 1}}};
  for (size_t k = 0; k < cases.size(); ++k) {
    const std::string group = "unequal_mismatch_" + std::to_string(k);
    run_group(2, small_config(group.c_str(), force_local_size), [&](Communicator& c, int rank) {
      const std::vector<size_t>& counts = cases[k][rank];
      std::vector<float> in(counts[0] + counts[1], 1.0f), out(counts[rank] + 1);
      smddp::CollDesc d;
      d.dtype_op = (static_cast<uint32_t>(DType::F32) << 8) | static_cast<uint32_t>(RedOp::SUM);
      auto t0 = steady_clock::now();
      EXPECT_THROW_WITH(c.reduce_scatter(in.data(), out.data(), counts, sum_f32(),
                                         c.make_ctx("reduce_scatter", d, smddp::OpArgs{}, 0)),
                        "mismatched collectives on group '" + group + "'");
      EXPECT(seconds_since(t0) < 2.0, "case ", k, ": the mismatch was found after ",
             seconds_since(t0), " s");
    });
  }
}

TEST_CASE(unequal_parts_mismatch_shm) { unequal_parts_mismatch(0); }
TEST_CASE(unequal_parts_mismatch_tcp) { unequal_parts_mismatch(1); }

TEST_CASE(zero_copy_from_the_pools) {
  // Note [Zero-copy operands] in shm_algos.h: operands allocated from every rank's pool are
  // read in place; one rank with an operand outside its pool makes all take the staged path.
  const int n = 3;
  run_group(n, small_config("pools", 0), [&](Communicator& c, int rank) {
    auto pool = c.pool();
    EXPECT(pool != nullptr, "no pool");
    if (!pool) return;
    for (int round = 0; round < 2; ++round) {
      const bool all_in_pool = round == 0;
      const uint64_t before = c.zero_copy_ops();
      const size_t bytes = 32 << 10, count = 8192;  // n x 32K >= kZeroCopyMinBytes
      const bool mine_in_pool = all_in_pool || rank != 1;
      Bytes heap_in(bytes * n), heap_out(bytes * n);
      char* in = mine_in_pool ? static_cast<char*>(pool->allocate(bytes * n)) : heap_in.data();
      char* out = mine_in_pool ? static_cast<char*>(pool->allocate(bytes * n)) : heap_out.data();
      // all_gather
      Bytes part = make_bytes(rank, bytes, 600 + round);
      std::memcpy(in, part.data(), bytes);
      smddp::CollDesc d;
      d.count = bytes;
      c.allgather(in, out, bytes, c.make_ctx("all_gather", d, smddp::OpArgs{}, 0));
      for (int r = 0; r < n; ++r) {
        std::string diff = compare_bytes(out + r * bytes, make_bytes(r, bytes, 600 + round));
        EXPECT(diff.empty(), "all_gather round ", round, " part ", r, ": ", diff);
      }
      // reduce_scatter
      Bytes input = make_input(DType::F32, rank, count * n, 700 + round);
      std::memcpy(in, input.data(), input.size());
      smddp::Reduction red = sum_f32();
      red.divisor = n;
      smddp::CollDesc rd;
      rd.count = count;
      c.reduce_scatter(in, out, count, red, c.make_ctx("reduce_scatter", rd, smddp::OpArgs{}, 0));
      std::string diff =
          compare(DType::F32, out,
                  expected_reduction(DType::F32, red, n, count, 700 + round, rank * count));
      EXPECT(diff.empty(), "reduce_scatter round ", round, ": ", diff);
      const uint64_t zero_copy = c.zero_copy_ops() - before;
      EXPECT(zero_copy == (all_in_pool ? 2u : 0u), "round ", round, ": ", zero_copy,
             " zero-copy collectives");
      if (mine_in_pool) {
        pool->release(in);
        pool->release(out);
      }
    }
    EXPECT(pool->in_use() == 0, "pool still holds ", pool->in_use(), " bytes");
  });
}

}  // namespace smddp_test
