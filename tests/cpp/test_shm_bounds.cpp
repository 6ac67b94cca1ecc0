// What a rank takes from its local peers through shared memory, and the bounds it keeps:
// the budget of a point-to-point channel for messages nobody waits for yet (Note [Stash
// budget in shared memory] in shm_p2p.cpp), and the pool offsets of the zero-copy
// collectives (Note [Read from the pool] in shm_algos.h). Ranks are threads, each with its
// own ShmComm, set up as Communicator::setup_shm does across processes; rings are 64 KiB.
#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "data.h"
#include "harness.h"
#include "smddp/algorithms/shm_algos.h"
#include "smddp/transport/shm/shm_p2p.h"

namespace smddp_test {
namespace {

constexpr size_t kRing = 64 << 10;
constexpr size_t kPool = 1 << 20;

std::unique_ptr<smddp::ShmComm> make_shm(MemKV& kv, int rank, const std::string& nonce) {
  smddp::ShmConfig sc;
  sc.nonce = nonce;
  sc.group_name = "bounds";
  sc.local_rank = rank;
  sc.group_ranks = {0, 1};
  sc.buffer_bytes = 16 << 10;
  sc.chunk_bytes = 4 << 10;
  sc.p2p_bytes = kRing;
  sc.pool_bytes = kPool;
  sc.spin_us = 20;
  auto shm = std::make_unique<smddp::ShmComm>(sc);
  shm->create();
  kv.set("shm" + std::to_string(rank), shm->name());
  const int peer = 1 - rank;
  shm->attach(peer, kv.get("shm" + std::to_string(peer)));
  kv.set("attached" + std::to_string(rank), "1");
  kv.get("attached" + std::to_string(peer));
  shm->unlink_own();
  return shm;
}

// A short deadline: without the budget, a receive behind a message nobody waits for waited
// for its own message until then.
smddp::OpCtx p2p_ctx(bool send) {
  smddp::OpCtx ctx;
  ctx.name = send ? "send" : "recv";
  ctx.deadline = smddp::Deadline::after(5);
  return ctx;
}

// Rank 0 sends `msgs` (tag, bytes) to rank 1 in order, on a thread of its own as the send
// lane does, while rank 1 runs `receive`; both keep their segments until both are done.
void run_pair(const std::string& nonce, const std::vector<std::pair<uint32_t, size_t>>& msgs,
              const std::function<void(smddp::ShmP2P&)>& receive) {
  MemKV kv;
  run_threads(2, [&](int rank) {
    auto shm = make_shm(kv, rank, nonce);
    smddp::ShmP2P p2p(*shm);
    if (rank == 0) {
      for (auto [tag, bytes] : msgs) {
        Bytes b = make_bytes(0, bytes, static_cast<int>(tag));
        p2p.send(1, tag, b.data(), bytes, p2p_ctx(true));
      }
    } else {
      receive(p2p);
    }
    kv.set("done" + std::to_string(rank), "1");
    kv.get("done" + std::to_string(1 - rank));
  });
}

// Receives the message with `tag` and `bytes` from rank 0 and checks its bytes.
void expect_message(smddp::ShmP2P& p2p, uint32_t tag, size_t bytes) {
  Bytes got(bytes + 1, '\x5a');
  p2p.recv(0, tag, got.data(), bytes, p2p_ctx(false));
  const std::string diff = compare_bytes(got.data(), make_bytes(0, bytes, static_cast<int>(tag)));
  EXPECT(diff.empty(), "tag ", tag, ": ", diff);
  EXPECT(got.back() == '\x5a', "tag ", tag, ": the receive wrote past its buffer");
}

}  // namespace

// A send whose tag the receiver has not posted, larger than the channel's budget, raises at
// the receiver, naming both tags, the sizes, the limit and what to do. Before, the receiver
// allocated the whole message at once from its header, and a large one got it OOM-killed.
// The header is left in the ring: the receive with its tag still gets it whole.
TEST_CASE(shm_message_nobody_waits_for_beyond_the_budget_raises) {
  run_pair("budget_over", {{1, 40000}}, [](smddp::ShmP2P& p2p) {
    p2p.set_stash_budget(16 << 10);
    Bytes small(8);
    EXPECT_THROW_WITH(p2p.recv(0, 2, small.data(), 8, p2p_ctx(false)),
                      "recv: rank 0 sent a message of 40000 bytes (tag 1) that no receive here "
                      "expects yet (this one waits for tag 2), while earlier such messages "
                      "waiting here count 0 bytes",
                      "a pair of ranks on one host holds at most 16384 bytes for receives not "
                      "yet posted, counting each message's length and 256 bytes for its keeping",
                      "post the receives in the order of the sends");
    expect_message(p2p, 1, 40000);
  });
}

// The messages waiting count against the budget until their receives take them, each with
// its length and 256 bytes; what is taken frees its share.
TEST_CASE(shm_messages_nobody_waits_for_count_until_taken) {
  const size_t len = 10000;
  run_pair("budget_count", {{1, len}, {3, len}, {4, len}, {2, 8}}, [&](smddp::ShmP2P& p2p) {
    p2p.set_stash_budget(2 * (len + 256));  // tags 1 and 3, exactly
    Bytes small(8);
    EXPECT_THROW_WITH(p2p.recv(0, 2, small.data(), 8, p2p_ctx(false)),
                      "10000 bytes (tag 4) that no receive here expects yet",
                      "earlier such messages waiting here count 20512 bytes",
                      "holds at most 20512 bytes");
    expect_message(p2p, 1, len);  // from the stash: frees room for tag 4
    expect_message(p2p, 2, 8);    // sets tag 4 aside on its way
    expect_message(p2p, 3, len);
    expect_message(p2p, 4, len);
  });
}

// A message set aside is read as its bytes arrive, into a buffer that grows with them: one
// larger than the ring streams through it while the sender writes it, and arrives whole.
TEST_CASE(shm_message_set_aside_streams_through_the_ring) {
  const size_t big = 5 * kRing + 12345;
  run_pair("budget_stream", {{1, big}, {2, 8}}, [&](smddp::ShmP2P& p2p) {
    expect_message(p2p, 2, 8);
    expect_message(p2p, 1, big);
  });
}

// Note [Read from the pool]: a zero-copy all-gather or reduce-scatter reads each peer's
// operand at the offset the peer published in shared memory. One that does not lie wholly
// in the peer's pool raises, naming it. Before, only a negative offset was refused, and the
// reads went past the pool.
TEST_CASE(zero_copy_operand_outside_the_peers_pool_raises) {
  const size_t bytes = 4096;
  struct Case {
    const char* name;
    int64_t offset;  // rank 1's
    bool gather;     // all-gather (or reduce-scatter)
  };
  const std::vector<Case> cases = {
      {"pool_tail", static_cast<int64_t>(kPool - 1024), true},  // starts inside, runs past
      {"pool_far", int64_t(1) << 40, false},                    // starts past the end
      {"pool_max", INT64_MAX, true},                            // overflows off + bytes
  };
  for (const Case& k : cases) {
    MemKV kv;
    run_threads(2, [&](int rank) {
      auto shm = make_shm(kv, rank, k.name);
      smddp::OpCtx ctx;
      ctx.name = k.gather ? "all_gather" : "reduce_scatter";
      ctx.desc.count = bytes;
      ctx.deadline = smddp::Deadline::after(10);
      if (rank == 1) {
        // What a peer with a wrong offset does in the handshake (exchange_operands).
        const uint64_t s = shm->begin_step(ctx, true);
        shm->publish_operand(ctx, k.offset);
        shm->post(s, 1);
      } else {
        char* in = static_cast<char*>(shm->pool()->allocate(2 * bytes));
        Bytes out(2 * bytes);
        const std::string want = "local rank 1 (group rank 1) published an operand of " +
                                 std::to_string(k.gather ? bytes : 2 * bytes) +
                                 " bytes at offset " + std::to_string(k.offset) +
                                 " of its tensor pool, which holds 1048576 bytes";
        if (k.gather) {
          EXPECT_THROW_WITH(smddp::shm::allgather_zero_copy(*shm, in, out.data(), bytes, ctx),
                            want);
        } else {
          smddp::Reduction red;
          red.dtype = smddp::DType::F32;
          red.op = smddp::RedOp::SUM;
          EXPECT_THROW_WITH(
              smddp::shm::reduce_scatter_zero_copy(*shm, in, out.data(), bytes / 4, red, ctx),
              want);
        }
        shm->pool()->release(in);
      }
      kv.set("done" + std::to_string(rank), "1");
      kv.get("done" + std::to_string(1 - rank));
    });
  }
}

}  // namespace smddp_test
