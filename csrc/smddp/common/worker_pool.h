// The threads that run the lanes of every process group's executor in this process (Note [One
// transport per process] in backend/work.h).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>

namespace smddp {

// A task gets an idle thread or a new one, never waits for another task: a lane's task blocks
// while its group waits for other ranks, so a pool of fixed size could deadlock (the Note
// says how). Threads idle for `linger` exit.
class WorkerPool {
 public:
  static constexpr std::chrono::milliseconds kLinger{1000};
  explicit WorkerPool(std::chrono::milliseconds linger = kLinger) : linger_(linger) {}
  // Runs what is queued, then waits for every thread to leave. The process's pool (instance())
  // is never destroyed; pools of tests are.
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // The pool of this process (a forked child gets a new one: it inherits no threads).
  static WorkerPool& instance();
  // Runs `task` on a pool thread. Throws std::system_error when it needs a new thread and the
  // system refuses one; nothing is queued then.
  void post(std::function<void()> task);
  // Threads the pool holds now (busy or idle), and those of them waiting for a task.
  int threads();
  int idle_threads();

 private:
  void loop();
  const std::chrono::milliseconds linger_;
  std::mutex mu_;
  std::condition_variable cv_;       // a task was posted, or the pool is going away
  std::condition_variable gone_cv_;  // a thread left
  std::deque<std::function<void()>> tasks_;
  int idle_ = 0;     // threads waiting for a task
  int threads_ = 0;  // threads alive
  bool stop_ = false;
};

}  // namespace smddp
