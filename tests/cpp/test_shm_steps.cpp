// The shared-memory all-gather run step by step while its input arrives (shm::AllGatherSteps;
// Note [Local all-gather during the exchange] in comm_hier.cpp), on ShmComm segments of
// ranks as threads. Each rank reveals its parts' bytes a piece at a time, writing them into
// its source only when it declares them ready, so a step that read past what was ready would
// copy garbage into the others' outputs. Buffers are small (16K, 4K chunks) so that parts
// span many steps.
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "data.h"
#include "harness.h"
#include "smddp/algorithms/shm_algos.h"

namespace smddp_test {
namespace {

using smddp::Span;

constexpr int kRanks = 3;

// Each rank's ShmComm, set up as Communicator::setup_shm does across processes.
std::unique_ptr<smddp::ShmComm> make_shm(MemKV& kv, int rank, const std::string& nonce) {
  smddp::ShmConfig sc;
  sc.nonce = nonce;
  sc.group_name = "steps";
  sc.local_rank = rank;
  for (int r = 0; r < kRanks; ++r) sc.group_ranks.push_back(r);
  sc.buffer_bytes = 16 << 10;
  sc.chunk_bytes = 4 << 10;
  sc.spin_us = 20;
  auto shm = std::make_unique<smddp::ShmComm>(sc);
  shm->create();
  kv.set("shm" + std::to_string(rank), shm->name());
  for (int r = 0; r < kRanks; ++r) {
    if (r != rank) shm->attach(r, kv.get("shm" + std::to_string(r)));
  }
  kv.set("attached" + std::to_string(rank), "1");
  for (int r = 0; r < kRanks; ++r) kv.get("attached" + std::to_string(r));
  shm->unlink_own();
  return shm;
}

smddp::OpCtx ctx_of(uint64_t seq) {
  smddp::OpCtx ctx;
  ctx.name = "all_gather";
  ctx.seq = seq;
  ctx.desc.count = seq;
  ctx.deadline = smddp::Deadline::after(60);
  return ctx;
}

// Parts of these lengths (bytes) laid end to end; rank i contributes parts i and i + 3, as a
// rank of a 3-rank host does in a 2-host all-gather.
void check_steps(bool finish_at_end) {
  const std::vector<size_t> lens = {0, 1, 5000, 20003, 4099, 70001};
  std::vector<Span> parts;
  size_t total = 0;
  for (size_t len : lens) {
    parts.push_back({total, len});
    total += len;
  }
  const std::vector<std::vector<int>> owned = {{0, 3}, {1, 4}, {2, 5}};
  Bytes want = make_bytes(0, total, 7);
  MemKV kv;
  const std::string nonce = finish_at_end ? "steps_finish" : "steps_poll";
  run_threads(kRanks, [&](int rank) {
    auto shm = make_shm(kv, rank, nonce);
    for (uint64_t seq = 0; seq < 3; ++seq) {
      const smddp::OpCtx ctx = ctx_of(seq);
      Bytes out(total + 1, '\x5a');  // one guard byte
      std::vector<Bytes> src;
      std::vector<const void*> from;
      for (int p : owned[rank]) {
        src.emplace_back(parts[p].len + 1, '\x77');  // garbage until revealed
        from.push_back(src.back().data());
      }
      smddp::shm::AllGatherSteps steps(*shm, from, out.data(), parts, owned, ctx);
      std::vector<size_t> shown(owned[rank].size(), 0);
      // Ranks reveal at different paces, so each waits for the others in turn; paces of one
      // byte and of one byte short of a chunk stop one byte short of a step's pieces.
      const size_t paces[3][kRanks] = {{1, 4095, 3700}, {4095, 1500, 1}, {2200, 5000, 4096}};
      const size_t pace = paces[seq][rank];
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      bool all_shown = false;
      while (!steps.done() && std::chrono::steady_clock::now() < deadline) {
        all_shown = true;
        for (size_t k = 0; k < shown.size(); ++k) {
          const Span& p = parts[owned[rank][k]];
          const size_t n = std::min(pace, p.len - shown[k]);
          if (n) std::memcpy(src[k].data() + shown[k], want.data() + p.off + shown[k], n);
          shown[k] += n;
          steps.set_ready(k, shown[k]);
          all_shown = all_shown && shown[k] == p.len;
        }
        if (finish_at_end && all_shown) {
          steps.finish();
          break;
        }
        steps.poll();
      }
      EXPECT(steps.done(), "rank ", rank, " seq ", seq, ": the steps did not finish");
      shm->mark_finished(seq);  // as Communicator does after every collective
      // The caller puts its own parts in place; the steps wrote everyone else's.
      for (size_t k = 0; k < shown.size(); ++k) {
        const Span& p = parts[owned[rank][k]];
        if (p.len) std::memcpy(out.data() + p.off, src[k].data(), p.len);
      }
      EXPECT(out.back() == '\x5a', "rank ", rank, ": wrote past the output");
      out.pop_back();
      std::string diff = compare_bytes(out.data(), want);
      EXPECT(diff.empty(), "rank ", rank, " seq ", seq, ": ", diff);
    }
  });
}

// A step that is not ready moves nothing: with none of its input ready, polling a rank
// whose peers have everything ready does not start a step, and the peers' own polls do not
// get past their first step's reads.
void check_nothing_ready() {
  const std::vector<Span> parts = {{0, 100}, {100, 100}, {200, 100}};
  const std::vector<std::vector<int>> owned = {{0}, {1}, {2}};
  Bytes want = make_bytes(0, 300, 9);
  MemKV kv;
  std::atomic<int> polled{0};
  run_threads(kRanks, [&](int rank) {
    auto shm = make_shm(kv, rank, "steps_idle");
    const smddp::OpCtx ctx = ctx_of(0);
    Bytes out(300, '\0');
    Bytes src(want.begin() + rank * 100, want.begin() + rank * 100 + 100);
    smddp::shm::AllGatherSteps steps(*shm, {src.data()}, out.data(), parts, owned, ctx);
    if (rank != 0) steps.set_all_ready();
    for (int i = 0; i < 200; ++i) steps.poll();
    EXPECT(!steps.done(), "rank ", rank, ": finished while rank 0 had nothing ready");
    ++polled;
    while (polled.load() < kRanks) std::this_thread::yield();
    steps.set_all_ready();
    steps.finish();
    std::memcpy(out.data() + rank * 100, src.data(), 100);
    std::string diff = compare_bytes(out.data(), want);
    EXPECT(diff.empty(), "rank ", rank, ": ", diff);
  });
}

// A poll never waits: while a local peer has yet to finish the collective whose descriptor
// slot the next one reuses (Note [Mismatch detection] in shm.h), polling starts no step and
// returns at once, where begin_step would wait for that peer.
void check_poll_never_waits() {
  const std::vector<Span> parts = {{0, 100}, {100, 100}, {200, 100}};
  const std::vector<std::vector<int>> owned = {{0}, {1}, {2}};
  Bytes want = make_bytes(0, 300, 11);
  MemKV kv;
  std::atomic<bool> polled{false};
  run_threads(kRanks, [&](int rank) {
    auto shm = make_shm(kv, rank, "steps_never_wait");
    Bytes src(want.begin() + rank * 100, want.begin() + rank * 100 + 100);
    for (uint64_t seq = 0; seq < 3; ++seq) {
      // Collective #1 has no shared-memory step on this host (a gather rooted elsewhere).
      if (seq != 1) {
        const smddp::OpCtx ctx = ctx_of(seq);
        Bytes out(300, '\0');
        smddp::shm::AllGatherSteps steps(*shm, {src.data()}, out.data(), parts, owned, ctx);
        steps.set_all_ready();
        if (seq == 2 && rank == 0) {
          // Rank 1 has not marked #0 finished: for 200 ms every poll returns at once.
          const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
          while (std::chrono::steady_clock::now() < until) {
            const auto t0 = std::chrono::steady_clock::now();
            steps.poll();
            // A poll that waited would wait for rank 1, which holds #0 open until it sees a
            // poll or 5 s pass: seconds. 1 s leaves room for a busy machine's scheduling
            // (0.10-0.16 s seen at a load of 20 on 2 cores) without hiding a wait.
            EXPECT(seconds_since(t0) < 1.0, "a poll waited ", seconds_since(t0), " s");
            EXPECT(!steps.done(), "a step ran before rank 1 finished collective #0");
          }
          EXPECT(steps.waiting_on_peers(), "the poll did not say it waits for a peer");
          polled = true;
        }
        steps.finish();
        std::memcpy(out.data() + rank * 100, src.data(), 100);
        std::string diff = compare_bytes(out.data(), want);
        EXPECT(diff.empty(), "rank ", rank, " seq ", seq, ": ", diff);
      }
      if (seq == 0 && rank == 1) {  // a few seconds at most, should a poll wait after all
        const auto t0 = std::chrono::steady_clock::now();
        while (!polled.load() && seconds_since(t0) < 5) std::this_thread::yield();
      }
      shm->mark_finished(seq);
    }
  });
}

}  // namespace

TEST_CASE(allgather_steps_poll) { check_steps(false); }
TEST_CASE(allgather_steps_poll_then_finish) { check_steps(true); }
TEST_CASE(allgather_steps_nothing_ready) { check_nothing_ready(); }
TEST_CASE(allgather_steps_poll_never_waits) { check_poll_never_waits(); }

}  // namespace smddp_test
