// Fixtures of the scheduler's tests (test_scheduler.cpp, test_receive_poller.cpp): a
// completion sink that records what it was told, and a way to run the scheduler's pool tasks
// when and where a test says, so an interleaving can be set up exactly.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "harness.h"
#include "smddp/common/common.h"
#include "smddp/common/scheduler.h"
#include "smddp/common/worker_pool.h"

namespace smddp_test {

// Waits up to `seconds` for pred(); returns its last value.
template <class P>
bool eventually(P pred, double seconds = 10.0) {
  auto t0 = std::chrono::steady_clock::now();
  while (!pred()) {
    if (seconds_since(t0) > seconds) return pred();
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

// A one-way latch: wait() returns once open() was called (false after `seconds`).
class Gate {
 public:
  void open() {
    {
      std::lock_guard<std::mutex> g(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  bool wait(double seconds = 10.0) {
    std::unique_lock<std::mutex> lk(mu_);
    return cv_.wait_for(lk, std::chrono::duration<double>(seconds), [&] { return open_; });
  }
  bool is_open() {
    std::lock_guard<std::mutex> g(mu_);
    return open_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// What the scheduler told one sink; outlives the sink, which the scheduler destroys.
struct Outcome {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;  // set after on_complete ran, as a c10d Work completes after its future
  int completions = 0;
  std::string error;  // "" when it succeeded
  std::thread::id completed_on, destroyed_on;
  bool destroyed = false;
  std::function<void()> on_complete;  // a future callback: runs inside complete()
  std::string name = "test_op";       // the sink's name()

  bool is_done() {
    std::lock_guard<std::mutex> g(mu);
    return done;
  }
  bool wait(double seconds = 10.0) {
    std::unique_lock<std::mutex> lk(mu);
    return cv.wait_for(lk, std::chrono::duration<double>(seconds), [&] { return done; });
  }
  std::string error_text() {
    std::lock_guard<std::mutex> g(mu);
    return error;
  }
};
using OutcomePtr = std::shared_ptr<Outcome>;

class RecordingSink : public smddp::Completion {
 public:
  RecordingSink(OutcomePtr out, std::string name) : out_(std::move(out)), name_(std::move(name)) {}
  ~RecordingSink() override {
    std::lock_guard<std::mutex> g(out_->mu);
    out_->destroyed = true;
    out_->destroyed_on = std::this_thread::get_id();
  }
  void complete(std::exception_ptr error) override {
    std::string what;
    if (error) {
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        what = e.what();
        if (what.empty()) what = "(empty error)";
      }
    }
    {
      std::lock_guard<std::mutex> g(out_->mu);
      ++out_->completions;
      out_->error = what;
      out_->completed_on = std::this_thread::get_id();
    }
    if (out_->on_complete) out_->on_complete();
    {
      std::lock_guard<std::mutex> g(out_->mu);
      out_->done = true;
    }
    out_->cv.notify_all();
  }
  std::string name() const override { return name_; }

 private:
  OutcomePtr out_;
  std::string name_;
};

// An Outcome for an operation named `name`, and a sink that reports to it.
inline OutcomePtr outcome(std::string name = "test_op") {
  auto out = std::make_shared<Outcome>();
  out->name = std::move(name);
  return out;
}
inline smddp::CompletionPtr sink_for(const OutcomePtr& out) {
  return std::make_unique<RecordingSink>(out, out->name);
}

// The scheduler's pool tasks, kept until the test runs them (Scheduler::Post).
class ManualPost {
 public:
  smddp::Scheduler::Post post() {
    return [this](std::function<void()> task) {
      std::lock_guard<std::mutex> g(mu_);
      tasks_.push_back(std::move(task));
    };
  }
  size_t size() {
    std::lock_guard<std::mutex> g(mu_);
    return tasks_.size();
  }
  // Runs the oldest task in the calling thread; false when there is none.
  bool run_one() {
    std::function<void()> task;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (tasks_.empty()) return false;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    smddp::on_worker_thread() = true;  // as WorkerPool's threads
    task();
    smddp::on_worker_thread() = false;
    return true;
  }
  // Shuts `s` down while running the tasks it posts, until it is down.
  void finish(smddp::Scheduler& s) {
    std::atomic<bool> down{false};
    std::thread t([&] {
      s.shutdown();
      down = true;
    });
    while (!down.load()) {
      if (!run_one()) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    t.join();
  }

 private:
  std::mutex mu_;
  std::deque<std::function<void()>> tasks_;
};

// Scheduler::Post onto `pool` (tests own their pool: it is destroyed, so threads are joined).
inline smddp::Scheduler::Post post_to(smddp::WorkerPool& pool) {
  return [&pool](std::function<void()> task) { pool.post(std::move(task)); };
}

}  // namespace smddp_test
