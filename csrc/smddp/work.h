// Work objects and the per-group executor.
//
// Note [Execution order]
// Collectives of one group must run in the order they were issued (every rank issues the
// same order, and the shm step protocol relies on it). A synchronous call
// (opts.asyncOp == false) runs inline in the caller's thread when nothing is queued,
// avoiding a thread hand-off (a futex wake costs tens of microseconds on a VM); otherwise,
// and for every async call, the operation is queued to the group's worker thread, which
// runs the queue in FIFO order so communication overlaps the caller's computation. Sends
// (isend/send) run on a separate send lane so a large send never blocks a receive queued
// behind it. `exec_mu_` makes sure inline and worker executions never overlap.
//
// Note [Waiting runs the work]
// A caller that waits for an async work which has not started yet would otherwise sleep
// until the worker thread wakes up, runs it and wakes the caller again: two hand-offs of
// tens of microseconds each on these VMs, and with more ranks than cores the worker may not
// get a core for much longer. So SmddpWork::wait() runs main-lane works in the caller's
// thread, front first, until its own work is complete (it may be a send, which completes on
// the send lane once the peer's receive, queued here behind it, drains the ring). A work is
// taken only from the front of the main lane and only while no main-lane work is running
// (`main_busy_`, which also keeps the worker from starting the next one meanwhile), so the
// issue order of Note [Execution order] holds either way.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

namespace smddp {

class Executor;

class SmddpWork : public c10d::Work {
 public:
  SmddpWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs);
  // A work on device tensors (Note [Device staging] in device_staging.h): its future is a
  // device future whose event is recorded on `completion_stream` when it completes, and
  // wait() makes the caller's current stream wait on it.
  SmddpWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, c10::Device device,
            c10::Stream completion_stream);
  // Note [Waiting runs the work]: wait() runs queued works of `exec` (the executor this
  // work was submitted to) in the caller's thread until this one is complete.
  void set_executor(std::weak_ptr<Executor> exec) { exec_ = std::move(exec); }
  bool wait(std::chrono::milliseconds timeout) override;
  // The future's value is the list of output tensors (DDP and FSDP chain on it).
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }
  // The rank a receive from any rank got its message from (-1: not such a receive, or not
  // complete yet); set before the work completes.
  int sourceRank() const override { return source_rank_.load(); }
  void set_source_rank(int rank) { source_rank_.store(rank); }
  // Marks the work (and its future) completed, with an error if `error` is set.
  void complete(std::exception_ptr error);

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::weak_ptr<Executor> exec_;
  std::atomic<int> source_rank_{-1};
  std::optional<c10::Stream> completion_stream_;
};

// A Work that completes when all of its parts complete (endCoalescing).
class CoalescedWork : public c10d::Work {
 public:
  explicit CoalescedWork(std::vector<c10::intrusive_ptr<c10d::Work>> parts);
  bool isCompleted() override;
  bool wait(std::chrono::milliseconds timeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> parts_;
};

class Executor {
 public:
  using Fn = std::function<void()>;
  Executor() = default;
  ~Executor() { shutdown(); }

  // Note [Execution order].
  void submit(Fn fn, c10::intrusive_ptr<SmddpWork> work, bool async_op);
  void submit_send(Fn fn, c10::intrusive_ptr<SmddpWork> work);
  // Runs `fn` in the caller's thread once the queued collectives have finished (the order
  // of Note [Execution order]), without a Work; its exceptions propagate to the caller.
  template <class F>
  void run_now(F&& fn) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      idle_cv_.wait(lk, [&] { return main_.pending == 0 || stop_; });
      if (stop_) throw std::runtime_error("smddp: the process group was shut down");
    }
    std::lock_guard<std::mutex> g(exec_mu_);
    fn();
  }
  // Runs `attempt` (which must not block) in the caller's thread when nothing is queued on
  // the lane it would otherwise go to, so it cannot overtake earlier operations there;
  // returns what `attempt` returned, or false when it did not run. Sends hold mu_ while
  // they try, so nothing can be queued on the send lane meanwhile.
  template <class F>
  bool try_now(F&& attempt) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (main_.pending || stop_) return false;
    }
    std::lock_guard<std::mutex> g(exec_mu_);
    return attempt();
  }
  template <class F>
  bool try_send_now(F&& attempt) {
    std::lock_guard<std::mutex> lk(mu_);
    return !send_.pending && !stop_ && attempt();
  }
  // Note [Waiting runs the work]: runs the next work of the main lane in the caller's thread
  // if no main-lane work is running; returns whether it ran one.
  bool run_next();
  // Waits for all queued work, then joins the threads. Idempotent.
  void shutdown();

 private:
  struct Item {
    Fn fn;
    c10::intrusive_ptr<SmddpWork> work;
  };
  struct Lane {
    std::deque<Item> queue;
    std::thread thread;
    size_t pending = 0;  // queued or running
  };
  void run_lane(Lane& lane);
  Item take_front(Lane& lane);  // under mu_; marks the main lane busy
  void finished(Lane& lane);    // takes mu_; the work taken by take_front is done
  void run(Item& item);
  void enqueue(Lane& lane, Item item);

  std::mutex mu_;
  std::condition_variable cv_;       // new work or shutdown
  std::condition_variable idle_cv_;  // a lane became idle
  Lane main_, send_;
  bool main_busy_ = false;  // a main-lane work is running (worker or run_if_next)
  bool stop_ = false;
  std::mutex exec_mu_;
};

}  // namespace smddp
