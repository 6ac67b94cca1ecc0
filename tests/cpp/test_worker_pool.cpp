// The process's worker threads (common/worker_pool.h; Note [One transport per process] in
// backend/work.h): a task never waits for another, idle threads are reused and leave.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "harness.h"
#include "smddp/common/worker_pool.h"

using smddp::WorkerPool;
using smddp_test::seconds_since;

namespace {

// Waits up to `seconds` for pred(); returns its last value.
template <class P>
bool eventually(P pred, double seconds = 5.0) {
  auto t0 = std::chrono::steady_clock::now();
  while (!pred()) {
    if (seconds_since(t0) > seconds) return pred();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

}  // namespace

// Every task blocks until all of them run at once, as lanes of groups that wait for each
// other across ranks do: a pool of fewer threads than tasks would never get there.
TEST_CASE(worker_pool_lends_every_blocked_task_a_thread) {
  constexpr int kTasks = 8;
  WorkerPool pool;
  std::mutex mu;
  std::condition_variable cv;
  int started = 0, met = 0;
  for (int k = 0; k < kTasks; ++k) {
    pool.post([&] {
      std::unique_lock<std::mutex> lk(mu);
      ++started;
      cv.notify_all();
      if (cv.wait_for(lk, std::chrono::seconds(5), [&] { return started == kTasks; })) ++met;
    });
  }
  EXPECT(eventually([&] {
           std::lock_guard<std::mutex> g(mu);
           return met == kTasks;
         }),
         "tasks that met the others: ", met, " of ", kTasks);
  EXPECT(pool.threads() == kTasks, "threads: ", pool.threads());
}

// Tasks posted one after another, each once the last one's thread is idle again, share one
// thread.
TEST_CASE(worker_pool_reuses_idle_threads) {
  WorkerPool pool;
  std::atomic<int> done{0};
  for (int k = 0; k < 50; ++k) {
    pool.post([&] { ++done; });
    EXPECT(eventually([&] { return done.load() == k + 1 && pool.idle_threads() == 1; }), "task ", k,
           " done and its thread idle");
  }
  EXPECT(pool.threads() == 1, "threads after 50 tasks in turn: ", pool.threads());
}

// Idle threads leave after the linger time; the pool then starts new ones as needed.
TEST_CASE(worker_pool_threads_leave_after_linger) {
  WorkerPool pool(std::chrono::milliseconds(30));
  std::atomic<bool> release{false};
  std::atomic<int> done{0};
  for (int k = 0; k < 4; ++k) {
    pool.post([&] {
      while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      ++done;
    });
  }
  EXPECT(eventually([&] { return pool.threads() == 4; }), "threads: ", pool.threads());
  release = true;
  EXPECT(eventually([&] { return pool.threads() == 0; }), "threads left: ", pool.threads());
  EXPECT(done.load() == 4, "tasks done: ", done.load());
  pool.post([&] { ++done; });
  EXPECT(eventually([&] { return done.load() == 5; }), "a task after the threads left ran");
}

// Destroying a pool runs what was queued and waits for its threads.
TEST_CASE(worker_pool_destructor_waits_for_its_tasks) {
  std::atomic<int> done{0};
  {
    WorkerPool pool;
    for (int k = 0; k < 3; ++k) {
      pool.post([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        ++done;
      });
    }
  }
  EXPECT(done.load() == 3, "tasks done when the pool was gone: ", done.load());
}
