// The receives that wait beside the lanes (common/receive_poller.h; Note [Receives wait side
// by side]): posting order within a round, no receive holding up another or the lanes, the
// exclusive lock only where asked, completions after the round, and the hand-back. Messages
// come from a Mailbox the test fills, as a peer's messages arrive in a ring.
#include <atomic>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "harness.h"
#include "scheduler_fixtures.h"
#include "smddp/common/common.h"
#include "smddp/common/receive_poller.h"
#include "smddp/common/scheduler.h"

using smddp::kAnyPeer;
using smddp::ReceivePoller;
using smddp::Scheduler;
using smddp::WorkerPool;
using smddp_test::eventually;
using smddp_test::Gate;
using smddp_test::ManualPost;
using smddp_test::outcome;
using smddp_test::OutcomePtr;
using smddp_test::post_to;
using smddp_test::sink_for;
using Waited = smddp::Scheduler::Waited;

namespace {

// Messages that arrived, per (source, tag), oldest first.
class Mailbox {
 public:
  void deliver(int src, int64_t tag, int value) {
    std::lock_guard<std::mutex> g(mu_);
    boxes_[{src, tag}].push_back(value);
  }
  // Takes the oldest message for (src, tag), from any source with kAnyPeer; false if none.
  bool take(int src, int64_t tag, int* value, int* from = nullptr) {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& [key, box] : boxes_) {
      if (key.second != tag || (src != kAnyPeer && key.first != src) || box.empty()) continue;
      *value = box.front();
      box.erase(box.begin());
      if (from) *from = key.first;
      return true;
    }
    return false;
  }

 private:
  std::mutex mu_;
  std::map<std::pair<int, int64_t>, std::vector<int>> boxes_;
};

// A receive's attempt: takes its message from `box` into `*got`, counting its attempts.
ReceivePoller::Attempt receive_into(Mailbox& box, int src, int64_t tag, int* got,
                                    std::atomic<int>* attempts = nullptr) {
  return [&box, src, tag, got, attempts] {
    if (attempts) attempts->fetch_add(1);
    return box.take(src, tag, got);
  };
}

// A ReceivePoller driven by hand: its pool task is never run; the test calls round().
struct Poller {
  std::mutex exclusive;
  ManualPost posts;
  std::mutex retired_mu;
  std::vector<std::pair<ReceivePoller::Attempt, smddp::CompletionPtr>> retired;
  ReceivePoller p{this, exclusive, posts.post(),
                  [this](ReceivePoller::Attempt a, smddp::CompletionPtr d) {
                    std::lock_guard<std::mutex> g(retired_mu);
                    retired.emplace_back(std::move(a), std::move(d));
                  }};
  ~Poller() {
    p.stop();
    while (posts.run_one()) {
    }
    p.shutdown();
  }
};

}  // namespace

// 6f20d00: a receive that found nothing keeps later receives that could take the same
// message (same source and tag, or from any rank) from trying in the same round: a message
// that arrives between their attempts goes to the earlier receive. Others are not held up.
TEST_CASE(poller_keeps_posting_order_within_a_round) {
  Poller t;
  Mailbox box;
  int got1 = -1, got2 = -1, got3 = -1, got4 = -1;
  std::atomic<int> tries2{0}, tries4{0};
  auto o1 = outcome("recv"), o2 = outcome("recv"), o3 = outcome("recv"), o4 = outcome("recv");
  // The first message for (1, 0) arrives while the first receive is being attempted, just
  // after it looked.
  bool arrived = false;
  t.p.submit(
      [&] {
        if (box.take(1, 0, &got1)) return true;
        if (!arrived) box.deliver(1, 0, 100);
        arrived = true;
        return false;
      },
      sink_for(o1), 1, 0, false);
  t.p.submit(receive_into(box, 1, 0, &got2, &tries2), sink_for(o2), 1, 0, false);
  t.p.submit(receive_into(box, 1, 7, &got3), sink_for(o3), 1, 7, false);
  t.p.submit(receive_into(box, kAnyPeer, 0, &got4, &tries4), sink_for(o4), kAnyPeer, 0, false);
  box.deliver(1, 7, 300);
  EXPECT(t.p.round(), "the round completed nothing");
  EXPECT(tries2.load() == 0 && tries4.load() == 0,
         "a receive was attempted after an earlier one for the same message found nothing");
  EXPECT(o3->is_done() && got3 == 300, "the receive with another tag was held up");
  EXPECT(!o1->is_done() && !o2->is_done(), "done too early");
  box.deliver(1, 0, 200);
  box.deliver(2, 0, 400);
  EXPECT(t.p.round(), "the second round completed nothing");
  EXPECT(o1->is_done() && o2->is_done() && o4->is_done(), "receives left waiting");
  EXPECT(got1 == 100 && got2 == 200 && got4 == 400, "messages swapped: ", got1, " ", got2, " ",
         got4);
  EXPECT(t.p.pending() == 0, "pending: ", t.p.pending());
  EXPECT(!t.p.round(), "an empty round reported progress");
}

// aea9b7e: a receive whose message never comes holds up neither a later receive nor the
// group's collectives; its waiter's wait for another receive returns; shutdown cancels it.
TEST_CASE(poller_a_waiting_receive_holds_up_nothing) {
  WorkerPool pool;
  Scheduler s(post_to(pool));
  Mailbox box;
  int never = -1, got = -1;
  auto waiting = outcome("recv"), later = outcome("recv"), collective = outcome("all_reduce");
  s.submit_receive(receive_into(box, 1, 0, &never), sink_for(waiting), 1, 0, true);
  s.submit_receive(receive_into(box, 1, 5, &got), sink_for(later), 1, 5, true);
  s.submit([] {}, sink_for(collective), true);
  EXPECT(collective->wait(), "a waiting receive held up the main lane");
  box.deliver(1, 5, 55);
  s.help(Waited::kReceive, [&] { return later->is_done(); });
  EXPECT(later->is_done() && got == 55, "the later receive: ", got);
  EXPECT(!waiting->is_done(), "the first receive completed without a message");
  s.shutdown();
  EXPECT(waiting->is_done() && waiting->error.find("was cancelled") != std::string::npos,
         waiting->error);
}

// 1816147, Note [Receives complete after their round]: a receive's callback may wait for
// another receive that finished in the same round (the waiter completes it) or one that is
// still waiting (the waiter runs rounds; the round that completed the first has ended).
TEST_CASE(poller_callback_waits_for_another_receive) {
  WorkerPool pool;
  Scheduler s(post_to(pool));
  Mailbox box;
  int g1 = -1, g2 = -1, g3 = -1;
  auto o1 = outcome("recv"), o2 = outcome("recv"), o3 = outcome("recv");
  bool saw2 = false, saw3 = false;
  o1->on_complete = [&] {
    s.help(Waited::kReceive, [&] { return o2->is_done(); });
    saw2 = o2->is_done();
    std::thread late([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      box.deliver(1, 3, 3);
    });
    s.help(Waited::kReceive, [&] { return o3->is_done(); });
    saw3 = o3->is_done();
    late.join();
  };
  box.deliver(1, 1, 1);
  box.deliver(1, 2, 2);
  s.submit_receive(receive_into(box, 1, 1, &g1), sink_for(o1), 1, 1, false);
  s.submit_receive(receive_into(box, 1, 2, &g2), sink_for(o2), 1, 2, false);
  s.submit_receive(receive_into(box, 1, 3, &g3), sink_for(o3), 1, 3, false);
  EXPECT(o1->wait(), "the callback waiting for other receives never returned");
  EXPECT(saw2 && saw3 && g1 == 1 && g2 == 2 && g3 == 3, "values ", g1, g2, g3);
}

// 6f20d00: only exclusive receives take the exclusive lock. A collective that waits for a
// shared-memory receive to make progress (its peer is stuck sending into a full ring) must
// not deadlock; an exclusive receive (over TCP: the collectives' read buffers) must never
// run during a main-lane item.
TEST_CASE(poller_takes_the_exclusive_lock_only_when_asked) {
  WorkerPool pool;
  Scheduler s(post_to(pool));
  std::atomic<bool> attempted{false};
  std::atomic<bool> in_item{false};
  std::atomic<int> overlaps{0};
  auto shm = outcome("recv"), item = outcome("all_reduce");
  s.submit(
      [&] {
        in_item = true;
        EXPECT(eventually([&] { return attempted.load(); }, 5),
               "a shared-memory receive waited for the collective");
        in_item = false;
      },
      sink_for(item), true);
  s.submit_receive(
      [&] {
        attempted = true;
        return true;
      },
      sink_for(shm), 1, 0, /*exclusive=*/false);
  EXPECT(item->wait() && shm->wait(), "the collective or the receive never finished");
  std::vector<OutcomePtr> outs;
  for (int k = 0; k < 50; ++k) {
    auto c = outcome("all_reduce"), r = outcome("recv");
    outs.push_back(c);
    outs.push_back(r);
    s.submit(
        [&] {
          in_item = true;
          std::this_thread::yield();
          in_item = false;
        },
        sink_for(c), true);
    s.submit_receive(
        [&] {
          if (in_item.load()) overlaps.fetch_add(1);
          return true;
        },
        sink_for(r), 1, k, /*exclusive=*/true);
  }
  for (auto& o : outs) EXPECT(o->wait(), "never finished");
  EXPECT(overlaps.load() == 0, overlaps.load(), " exclusive attempts during a collective");
}

// try_receive_now runs only while no receive waits (it could take an earlier receive's
// message) and gives up, rather than wait, while the exclusive lock is held.
TEST_CASE(poller_eager_receive_only_when_nothing_waits) {
  ManualPost posts;
  Scheduler s(posts.post());
  Mailbox box;
  int got = -1;
  auto o = outcome("recv");
  s.submit_receive(receive_into(box, 1, 0, &got), sink_for(o), 1, 0, false);
  box.deliver(1, 0, 1);
  int eager = -1;
  EXPECT(!s.try_receive_now([&] { return box.take(1, 0, &eager); }),
         "an eager receive ran while another waited");
  s.help(Waited::kReceive, [&] { return o->is_done(); });
  EXPECT(got == 1 && eager == -1, "the waiting receive lost its message");
  box.deliver(1, 0, 2);
  Gate running, release;
  auto c = outcome("all_reduce");
  std::thread t([&] {
    s.submit(
        [&] {
          running.open();
          release.wait();
        },
        sink_for(c), false);
  });
  EXPECT(running.wait(), "the collective never started");
  EXPECT(!s.try_receive_now([&] { return box.take(1, 0, &eager); }),
         "an eager receive ran during a collective");
  release.open();
  t.join();
  EXPECT(s.try_receive_now([&] { return box.take(1, 0, &eager); }) && eager == 2,
         "an eager receive did not run on an idle group");
  posts.finish(s);
}

// Note [Tensors are released in the caller's thread]: a finished receive's attempt (which
// holds the tensors) and its sink are destroyed by the caller's next call, never by the pool
// thread that polled it.
TEST_CASE(poller_hands_finished_receives_back) {
  WorkerPool pool;
  Scheduler s(post_to(pool));
  Mailbox box;
  auto held = std::make_shared<int>(0);
  std::vector<OutcomePtr> outs;
  std::vector<int> got(20, -1);
  for (int k = 0; k < 20; ++k) {
    auto o = outcome("recv");
    outs.push_back(o);
    int* into = &got[k];
    s.submit_receive([&box, k, into, held] { return box.take(1, k, into); }, sink_for(o), 1, k,
                     false);
  }
  for (int k = 0; k < 20; ++k) box.deliver(1, k, k);
  for (auto& o : outs) EXPECT(o->wait(), "a receive never completed");
  EXPECT(eventually([&] { return pool.idle_threads() == pool.threads(); }), "pool busy");
  int destroyed = 0;
  for (auto& o : outs) destroyed += o->destroyed ? 1 : 0;
  EXPECT(destroyed == 0, destroyed, " receives destroyed before the caller's next call");
  s.release_finished();
  for (auto& o : outs) {
    EXPECT(o->destroyed && o->destroyed_on == std::this_thread::get_id(), "destroyed elsewhere");
  }
  EXPECT(held.use_count() == 1, "attempts still held: ", held.use_count() - 1);
}

// Receives, collectives and a sender thread at once, many times over: every receive gets the
// messages of its (source, tag) in posting order, and collectives finish in issue order.
// Sized for a few seconds under TSan.
TEST_CASE(poller_stress_receives_beside_the_lanes) {
  WorkerPool pool;
  Scheduler s(post_to(pool));
  Mailbox box;
  constexpr int kPerTag = 2000;
  constexpr int kTags = 3;
  std::vector<std::vector<int>> got(kTags, std::vector<int>(kPerTag, -1));
  std::vector<OutcomePtr> receives, collectives;
  std::vector<int> order;  // main-lane items run under the exclusive lock
  std::thread sender([&] {
    for (int k = 0; k < kPerTag; ++k) {
      for (int tag = 0; tag < kTags; ++tag) box.deliver(1, tag, k);
      if (k % 16 == 0) std::this_thread::yield();
    }
  });
  for (int k = 0; k < kPerTag; ++k) {
    for (int tag = 0; tag < kTags; ++tag) {
      auto o = outcome("recv");
      receives.push_back(o);
      int* into = &got[tag][k];
      if (!s.try_receive_now([&] { return box.take(1, tag, into); })) {
        s.submit_receive(receive_into(box, 1, tag, into), sink_for(o), 1, tag, tag == 0);
      } else {
        sink_for(o)->complete(nullptr);
      }
    }
    auto c = outcome("all_reduce");
    collectives.push_back(c);
    s.submit([&order, k] { order.push_back(k); }, sink_for(c), k % 2 == 0);
    if (k % 7 == 0) s.help(Waited::kReceive, [o = receives.back()] { return o->is_done(); });
  }
  sender.join();
  for (auto& o : receives) EXPECT(o->wait(), "a receive never completed");
  for (auto& o : collectives) EXPECT(o->wait(), "a collective never completed");
  s.shutdown();
  for (int tag = 0; tag < kTags; ++tag) {
    for (int k = 0; k < kPerTag; ++k) {
      if (got[tag][k] != k) {
        EXPECT(false, "tag ", tag, " receive ", k, " got message ", got[tag][k]);
        break;
      }
    }
  }
  std::vector<int> want;
  for (int k = 0; k < kPerTag; ++k) want.push_back(k);
  EXPECT(order == want, "collectives out of issue order");
}
