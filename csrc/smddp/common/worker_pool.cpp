#include "smddp/common/worker_pool.h"

#include <unistd.h>

#include <thread>

#include "smddp/common/common.h"

namespace smddp {

WorkerPool::~WorkerPool() {
  std::unique_lock<std::mutex> lk(mu_);
  stop_ = true;
  cv_.notify_all();
  gone_cv_.wait(lk, [&] { return threads_ == 0; });
}

WorkerPool& WorkerPool::instance() {
  // Never destroyed: detached pool threads may still be waiting at exit.
  static std::mutex mu;
  static WorkerPool* pool = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> g(mu);
  if (!pool || owner != getpid()) {
    pool = new WorkerPool();
    owner = getpid();
  }
  return *pool;
}

void WorkerPool::post(std::function<void()> task) {
  std::lock_guard<std::mutex> g(mu_);
  tasks_.push_back(std::move(task));
  if (tasks_.size() > static_cast<size_t>(idle_)) {
    // Every idle thread will take one of the tasks ahead: this one needs a new thread.
    ++threads_;
    try {
      std::thread([this] { loop(); }).detach();
    } catch (...) {  // no thread (EAGAIN): nothing posted, the caller learns why
      --threads_;
      tasks_.pop_back();
      throw;
    }
  } else {
    cv_.notify_one();
  }
}

int WorkerPool::threads() {
  std::lock_guard<std::mutex> g(mu_);
  return threads_;
}

int WorkerPool::idle_threads() {
  std::lock_guard<std::mutex> g(mu_);
  return idle_;
}

void WorkerPool::loop() {
  on_worker_thread() = true;
  std::unique_lock<std::mutex> lk(mu_);
  while (true) {
    if (tasks_.empty()) {
      if (stop_) break;
      ++idle_;
      cv_.wait_for(lk, linger_, [&] { return !tasks_.empty() || stop_; });
      --idle_;
      if (tasks_.empty()) break;  // idle for `linger`, or the pool is going away
    }
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    lk.unlock();
    task();
    task = nullptr;  // what it captured goes before the thread waits again
    lk.lock();
  }
  --threads_;
  gone_cv_.notify_all();
}

}  // namespace smddp
