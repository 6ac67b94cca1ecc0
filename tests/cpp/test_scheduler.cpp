// The scheduler's lanes (common/scheduler.h): who runs a lane's front item (Note [Scheduler]),
// in what order, under which lock, and what abort and shutdown do. Each case sets up one of
// the interleavings that a fix of the executor was about, with ManualPost where the test must
// decide which thread runs the lane, and a WorkerPool where the race is the point.
#include <atomic>
#include <cerrno>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "harness.h"
#include "scheduler_fixtures.h"
#include "smddp/common/scheduler.h"
#include "smddp/common/worker_pool.h"

using smddp::Scheduler;
using smddp::WorkerPool;
using smddp_test::eventually;
using smddp_test::Gate;
using smddp_test::ManualPost;
using smddp_test::outcome;
using smddp_test::OutcomePtr;
using smddp_test::post_to;
using smddp_test::sink_for;
using Lane = smddp::Scheduler::LaneId;
using Waited = smddp::Scheduler::Waited;

namespace {

// The order in which items ran, from any thread (main-lane items run under the exclusive
// lock, but the test does not rely on it).
class Log {
 public:
  void add(int v) {
    std::lock_guard<std::mutex> g(mu_);
    v_.push_back(v);
  }
  std::vector<int> get() {
    std::lock_guard<std::mutex> g(mu_);
    return v_;
  }

 private:
  std::mutex mu_;
  std::vector<int> v_;
};

std::vector<int> iota(int n) {
  std::vector<int> v;
  for (int k = 0; k < n; ++k) v.push_back(k);
  return v;
}

}  // namespace

// Async items run in issue order on the pool thread; a synchronous call with nothing
// pending runs inline in the caller's thread, one with work queued before it is queued.
TEST_CASE(scheduler_runs_a_lane_in_issue_order) {
  WorkerPool pool;
  Scheduler s(post_to(pool));
  Log log;
  std::vector<OutcomePtr> outs;
  const auto me = std::this_thread::get_id();
  for (int k = 0; k < 200; ++k) {
    auto out = outcome();
    outs.push_back(out);
    s.submit([&log, k] { log.add(k); }, sink_for(out), /*async_op=*/k % 7 != 0);
  }
  for (auto& o : outs) EXPECT(o->wait(), "an item never completed");
  EXPECT(log.get() == iota(200), "items ran out of issue order");
  for (auto& o : outs) EXPECT(o->completions == 1 && o->error.empty(), o->error);
  // Now nothing is pending: a synchronous call runs in this thread.
  auto out = outcome();
  std::thread::id ran_on;
  s.submit([&] { ran_on = std::this_thread::get_id(); }, sink_for(out), false);
  EXPECT(out->is_done() && ran_on == me, "the idle lane's synchronous call was not inline");
  EXPECT(s.pending(Lane::kMain) == 0, "pending after the inline call: ", s.pending(Lane::kMain));
}

// Note [Scheduler]: an inline call claims only a lane with nothing pending, so it can never
// overtake a queued item, and it counts as pending while it runs.
TEST_CASE(scheduler_inline_call_never_overtakes_queued_work) {
  ManualPost posts;
  Scheduler s(posts.post());
  Log log;
  auto out_a = outcome();
  s.submit([&] { log.add(0); }, sink_for(out_a), true);
  EXPECT(posts.size() == 1, "the lane got no pool thread");
  auto out_b = outcome();
  s.submit([&] { log.add(1); }, sink_for(out_b), false);  // synchronous, but A is queued
  EXPECT(!out_b->is_done(), "the synchronous call ran before the queued item");
  EXPECT(!s.try_now([&] { return log.add(2), true; }), "try_now ran with an item queued");
  EXPECT(s.try_send_now([] { return true; }), "the main lane's queue held up the send lane");
  posts.run_one();  // the lane's pool thread: A, then B
  EXPECT(log.get() == std::vector<int>({0, 1}), "order");
  EXPECT(s.try_now([&] { return log.add(3), true; }), "try_now on an idle lane did not run");
  // While an inline call runs, the lane is claimed: nothing else may start or run inline.
  Gate inside, release;
  std::thread t([&] {
    s.try_now([&] {
      inside.open();
      release.wait();
      log.add(4);
      return true;
    });
  });
  EXPECT(inside.wait(), "the inline call never started");
  EXPECT(s.pending(Lane::kMain) == 1, "an inline call is not pending while it runs");
  EXPECT(!s.try_now([] { return true; }), "two inline calls overlapped");
  auto out_c = outcome();
  s.submit([&] { log.add(5); }, sink_for(out_c), false);  // queued behind the inline call
  EXPECT(!s.run_next(Lane::kMain), "a waiter claimed a lane an inline call holds");
  release.open();
  t.join();
  EXPECT(eventually([&] { return posts.run_one() || out_c->is_done(); }) && out_c->wait(),
         "the item queued behind the inline call never ran");
  EXPECT(log.get() == std::vector<int>({0, 1, 3, 4, 5}), "order with an inline call");
  posts.finish(s);
}

// A thread that waits runs the queued items itself, front first (Note [Waiting runs the
// work]), and the lane's pool thread, started later, finds nothing left.
TEST_CASE(scheduler_waiter_runs_the_work) {
  ManualPost posts;
  Scheduler s(posts.post());
  Log log;
  std::vector<OutcomePtr> outs;
  for (int k = 0; k < 3; ++k) {
    auto o = outcome();
    outs.push_back(o);
    s.submit([&log, k] { log.add(k); }, sink_for(o), true);
  }
  OutcomePtr second = outs[1];
  s.help(Waited::kMain, [&] { return second->is_done(); });
  EXPECT(log.get() == std::vector<int>({0, 1}), "the waiter ran more or less than it needed");
  for (int k = 0; k < 2; ++k) {
    EXPECT(outs[k]->completed_on == std::this_thread::get_id(), "item ", k, " ran elsewhere");
  }
  // The send lane's waiter runs the send lane first, then the main lane.
  auto out_snd = outcome("send");
  s.submit_send([&] { log.add(10); }, sink_for(out_snd));
  s.help(Waited::kSend, [&] { return out_snd->is_done(); });
  EXPECT(out_snd->is_done(), "the send's waiter did not run the send");
  s.help(Waited::kMain, [&] { return outs[2]->is_done(); });
  EXPECT(log.get() == std::vector<int>({0, 1, 10, 2}), "order");
  posts.finish(s);  // the pool tasks find their lanes empty
  EXPECT(s.pending(Lane::kMain) == 0 && s.pending(Lane::kSend) == 0, "pending after all");
}

// While the pool thread runs an item, a waiter must not start the next one (the lane is
// claimed); it returns to sleep on its Work, and the pool thread runs the rest in order.
TEST_CASE(scheduler_waiter_and_pool_thread_take_turns) {
  WorkerPool pool;
  Scheduler s(post_to(pool));
  Log log;
  Gate running, release;
  auto out_a = outcome();
  s.submit(
      [&] {
        running.open();
        release.wait();
        log.add(0);
      },
      sink_for(out_a), true);
  auto out_b = outcome();
  s.submit([&] { log.add(1); }, sink_for(out_b), true);
  EXPECT(running.wait(), "the pool thread never started");
  s.help(Waited::kMain, [&] { return out_b->is_done(); });  // returns: nothing it may run
  EXPECT(!out_b->is_done(), "the waiter ran an item while the lane was claimed");
  release.open();
  EXPECT(out_b->wait(), "the second item never ran");
  EXPECT(log.get() == std::vector<int>({0, 1}), "order");
}

// 2c8bc7e: a future callback on the lane's pool thread waits for a later item of the same
// lane (main and send): it runs that item itself instead of waiting for itself; run_now from
// such a callback runs the queued items first.
TEST_CASE(scheduler_callback_waits_for_later_work_of_its_lane) {
  WorkerPool pool;
  Scheduler s(post_to(pool));
  Log log;
  for (Lane lane : {Lane::kMain, Lane::kSend}) {
    auto out_a = outcome();
    auto out_b = outcome();
    OutcomePtr later = out_b;
    bool inside = false;
    std::thread::id callback_thread;
    out_a->on_complete = [&, later, lane] {
      inside = s.active_in_this_thread();
      callback_thread = std::this_thread::get_id();
      s.help(lane == Lane::kSend ? Waited::kSend : Waited::kMain, [&] { return later->is_done(); });
    };
    Gate release;
    auto fa = [&] { release.wait(); };
    if (lane == Lane::kSend) {
      s.submit_send(fa, sink_for(out_a));
      s.submit_send([] {}, sink_for(out_b));
    } else {
      s.submit(fa, sink_for(out_a), true);
      s.submit([] {}, sink_for(out_b), true);
    }
    release.open();
    EXPECT(out_a->wait(), "the callback waiting for the later item never returned");
    EXPECT(out_b->is_done() && out_b->completed_on == callback_thread,
           "the later item did not run in the callback's thread");
    EXPECT(inside, "a callback is not inside its scheduler");
  }
  // run_now in a callback: the queued collective before it runs first, in this thread.
  auto out_c = outcome();
  auto out_d = outcome();
  OutcomePtr queued = out_d;
  out_c->on_complete = [&, queued] { s.run_now([&] { log.add(queued->is_done() ? 1 : -1); }); };
  Gate release;
  s.submit([&] { release.wait(); }, sink_for(out_c), true);
  s.submit([&] { log.add(0); }, sink_for(out_d), true);
  release.open();
  EXPECT(out_c->wait(), "run_now in a callback never returned");
  EXPECT(log.get() == std::vector<int>({0, 1}), "run_now did not wait for the queued item");
  EXPECT(!s.active_in_this_thread(), "the test's thread is not inside the scheduler");
}

// c794141, Note [Finished before complete]: when an item completes, its lane is idle
// already, so the next eager call (made by a callback, or by the caller whose wait returned)
// runs inline instead of being queued.
TEST_CASE(scheduler_lane_is_idle_before_its_item_completes) {
  WorkerPool pool;
  Scheduler s(post_to(pool));
  for (Lane lane : {Lane::kMain, Lane::kSend}) {
    for (int k = 0; k < 20; ++k) {
      auto o = outcome();
      bool eager = false;
      size_t pending = 99;
      o->on_complete = [&] {
        pending = s.pending(lane);
        eager = lane == Lane::kMain ? s.try_now([] { return true; })
                                    : s.try_send_now([] { return true; });
      };
      if (lane == Lane::kMain) {
        s.submit([] {}, sink_for(o), true);
      } else {
        s.submit_send([] {}, sink_for(o));
      }
      EXPECT(o->wait(), "an item never completed");
      EXPECT(eager && pending == 0, "lane ", int(lane), ": pending ", pending,
             " when its item completed; eager call ran: ", eager);
    }
  }
}

// Main-lane items, inline calls and run_now never overlap each other (the exclusive lock and
// the claim); a send runs beside them.
TEST_CASE(scheduler_send_lane_runs_beside_the_main_lane) {
  WorkerPool pool;
  Scheduler s(post_to(pool));
  Gate main_running, send_ran;
  auto out_a = outcome();
  s.submit(
      [&] {
        main_running.open();
        EXPECT(send_ran.wait(5), "the send waited for the main lane");
      },
      sink_for(out_a), true);
  EXPECT(main_running.wait(), "the main item never started");
  auto out_b = outcome("send");
  s.submit_send([&] { send_ran.open(); }, sink_for(out_b));
  EXPECT(out_a->wait() && out_b->wait(), "the two lanes did not both finish");
  EXPECT(s.try_send_now([] { return true; }), "an idle send lane refused an eager send");
}

// dc3aca1 and a8fdd3e, Note [Abort fails the queued work]: items that have not started fail
// with an error naming the operation, also one that was waiting for the exclusive lock when
// the abort came; the running item finishes; run_now and the eager paths are the caller's.
TEST_CASE(scheduler_abort_fails_what_has_not_started) {
  WorkerPool pool;
  Scheduler s(post_to(pool));
  Gate running, release;
  bool ran_b = false;
  auto out_a = outcome("all_reduce");
  s.submit(
      [&] {
        running.open();
        release.wait();
      },
      sink_for(out_a), true);
  auto out_b = outcome("all_gather");
  s.submit([&] { ran_b = true; }, sink_for(out_b), true);
  EXPECT(running.wait(), "the first item never started");
  s.abort();
  release.open();
  EXPECT(out_a->wait() && out_b->wait(), "items never completed after the abort");
  EXPECT(out_a->error.empty(), "the running item failed: ", out_a->error);
  EXPECT(!ran_b, "an item queued behind the abort ran");
  EXPECT(out_b->error ==
             "smddp: all_gather was aborted before it started: the process group was aborted",
         out_b->error);
}

TEST_CASE(scheduler_abort_while_waiting_for_the_lock) {
  // An exclusive receive attempt holds the lock; an inline synchronous call waits for it;
  // the abort comes meanwhile: the call must fail, not run.
  WorkerPool pool;
  Scheduler s(post_to(pool));
  Gate attempting, release;
  auto out_r = outcome("recv");
  s.submit_receive(
      [&] {
        attempting.open();
        release.wait();
        return true;
      },
      sink_for(out_r), 1, 0, /*exclusive=*/true);
  EXPECT(attempting.wait(), "the receive was never attempted");
  auto out_c = outcome("broadcast");
  bool ran = false;
  std::thread t([&] { s.submit([&] { ran = true; }, sink_for(out_c), false); });
  // The call holds the claimed lane while it waits for the lock.
  EXPECT(eventually([&] { return s.pending(Lane::kMain) == 1; }), "the call never claimed");
  s.abort();
  release.open();
  t.join();
  EXPECT(out_c->is_done() && !ran, "the call ran after the abort");
  EXPECT(out_c->error.find("broadcast was aborted before it started") != std::string::npos,
         out_c->error);
  EXPECT(out_r->wait() && out_r->error.empty(), "the receive: ", out_r->error);
}

// 0c581bb: shutdown waits for queued items and for an item a waiter is running, refuses new
// work with a clear error, and cancels receives still waiting.
TEST_CASE(scheduler_shutdown_finishes_the_work_in_flight) {
  {
    ManualPost posts;  // the lane's pool thread runs only once shutdown has begun
    Scheduler s(posts.post());
    Gate running, release;
    std::atomic<bool> finished{false};
    auto out_w = outcome();
    s.submit(
        [&] {
          running.open();
          release.wait();
          finished = true;
        },
        sink_for(out_w), true);
    std::thread waiter([&] { s.help(Waited::kMain, [&] { return out_w->is_done(); }); });
    EXPECT(running.wait(), "the waiter never ran the item");
    std::atomic<bool> down{false};
    std::thread closer([&] {
      posts.finish(s);
      down = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT(!down.load(), "shutdown returned while a waiter was running an item");
    release.open();
    waiter.join();
    closer.join();
    EXPECT(finished.load() && out_w->error.empty(), "the waiter's item: ", out_w->error);
  }
  WorkerPool pool;
  Scheduler s(post_to(pool));
  std::vector<OutcomePtr> queued;
  // Queued items still run; receives still waiting are cancelled; what comes after fails.
  for (int k = 0; k < 5; ++k) {
    auto o = outcome();
    queued.push_back(o);
    s.submit([] { std::this_thread::sleep_for(std::chrono::milliseconds(2)); }, sink_for(o), true);
  }
  auto out_r = outcome("recv");
  s.submit_receive([] { return false; }, sink_for(out_r), 1, 0, false);
  s.shutdown();
  for (auto& o : queued) EXPECT(o->is_done() && o->error.empty(), "queued item: ", o->error);
  EXPECT(out_r->is_done() && out_r->error.find("cancelled") != std::string::npos, out_r->error);
  auto out_late = outcome();
  s.submit([] {}, sink_for(out_late), true);
  EXPECT(out_late->error == "smddp: the process group was shut down", out_late->error);
  EXPECT_THROW_WITH(s.run_now([] {}), "shut down");
  EXPECT(!s.try_now([] { return true; }), "try_now ran after shutdown");
}

// 04be0d5, Note [Tensors are released in the caller's thread]: a pool thread never destroys
// a finished item (its function and its sink); the caller's next call does.
TEST_CASE(scheduler_pool_threads_hand_finished_items_back) {
  WorkerPool pool;
  Scheduler s(post_to(pool));
  const auto me = std::this_thread::get_id();
  std::vector<OutcomePtr> outs;
  auto held = std::make_shared<int>(0);  // what an item's function holds, like its tensors
  for (int k = 0; k < 30; ++k) {
    auto o = outcome();
    outs.push_back(o);
    if (k % 3 == 2) {
      s.submit_send([held] {}, sink_for(o));
    } else {
      s.submit([held] {}, sink_for(o), true);
    }
  }
  for (auto& o : outs) EXPECT(o->wait(), "an item never completed");
  EXPECT(eventually([&] { return s.pending(Lane::kMain) == 0 && s.pending(Lane::kSend) == 0; }),
         "lanes not idle");
  // The pool threads are done with them. Items that finished before one of this thread's later
  // submits were destroyed by it; the last one finished after every submit, so it waits for
  // this thread's next call.
  EXPECT(eventually([&] { return pool.idle_threads() == pool.threads(); }), "pool busy");
  bool last_destroyed;
  {
    std::lock_guard<std::mutex> g(outs.back()->mu);
    last_destroyed = outs.back()->destroyed;
  }
  EXPECT(!last_destroyed, "the last item was destroyed before the caller's next call");
  s.release_finished();
  for (auto& o : outs) {
    std::lock_guard<std::mutex> g(o->mu);
    EXPECT(o->destroyed && o->destroyed_on == me, "an item was destroyed on another thread");
  }
  EXPECT(held.use_count() == 1, "functions still held: ", held.use_count() - 1);
}

// The inline call against the pool thread, many times over: issue order holds for one
// issuing thread, and no two main-lane items or inline calls ever overlap; another thread
// waits, runs run_now and tries eager calls meanwhile. Sized for a few seconds under TSan.
TEST_CASE(scheduler_stress_inline_pool_and_waiters) {
  WorkerPool pool;
  Scheduler s(post_to(pool));
  constexpr int kOps = 30000;
  std::atomic<int> inside{0};
  std::atomic<int> overlaps{0};
  std::atomic<int> eager{0};
  std::vector<int> order;  // appended under the exclusive section the check proves
  auto body = [&](int k) {
    if (inside.fetch_add(1) != 0) overlaps.fetch_add(1);
    if (k >= 0) order.push_back(k);
    inside.fetch_sub(1);
  };
  std::atomic<bool> stop{false};
  std::thread other([&] {
    while (!stop.load()) {
      if (s.try_now([&] { return body(-1), true; })) eager.fetch_add(1);
      s.run_now([&] { body(-1); });
      s.run_next(Lane::kMain);
      std::this_thread::yield();
    }
  });
  std::vector<OutcomePtr> outs;
  std::vector<OutcomePtr> sends;
  for (int k = 0; k < kOps; ++k) {
    auto o = outcome();
    outs.push_back(o);
    s.submit([&body, k] { body(k); }, sink_for(o), k % 3 != 0);
    if (k % 5 == 0) {
      auto so = outcome("send");
      sends.push_back(so);
      s.submit_send([] {}, sink_for(so));
    }
    if (k % 11 == 0) s.help(Waited::kMain, [o = o] { return o->is_done(); });
    if (k % 13 == 0) s.help(Waited::kSend, [so = sends.back()] { return so->is_done(); });
  }
  for (auto& o : outs) EXPECT(o->wait(), "an item never completed");
  for (auto& o : sends) EXPECT(o->wait(), "a send never completed");
  stop = true;
  other.join();
  s.shutdown();
  EXPECT(overlaps.load() == 0, overlaps.load(), " overlapping executions");
  EXPECT(order == iota(kOps), "the items ran out of issue order");
}

// Note [A lane whose thread could not start]: a post that throws (no thread could be
// started) fails its item with the reason and leaves the lane unscheduled, so the next item
// posts a drain again and shutdown returns.
TEST_CASE(scheduler_item_fails_when_no_thread_can_start) {
  WorkerPool pool;
  std::atomic<bool> refuse{true};
  Scheduler s([&](std::function<void()> task) {
    if (refuse.load()) {
      throw std::system_error(EAGAIN, std::generic_category(), "Resource temporarily unavailable");
    }
    pool.post(std::move(task));
  });
  auto refused = outcome();
  s.submit([] {}, sink_for(refused), true);
  EXPECT(refused->wait(), "the refused item never completed");
  EXPECT(refused->error_text().find("could not start a thread to run test_op") != std::string::npos,
         "error: ", refused->error_text());
  EXPECT(s.pending(Lane::kMain) == 0, "the refused item still counts as pending");
  refuse = false;
  bool ran = false;
  auto later = outcome();
  s.submit([&] { ran = true; }, sink_for(later), true);
  EXPECT(later->wait(), "the next item never ran: the lane stayed marked scheduled");
  EXPECT(ran && later->error_text().empty(), "the next item failed: ", later->error_text());
  s.shutdown();
}
