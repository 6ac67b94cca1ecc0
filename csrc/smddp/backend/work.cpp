#include "smddp/backend/work.h"

#include <c10/core/StreamGuard.h>

#include "smddp/common/common.h"

namespace smddp {

SmddpWork::SmddpWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type), outputs_(std::move(outputs)) {
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
}

SmddpWork::SmddpWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs,
                     c10::Device device, c10::Stream completion_stream)
    : c10d::Work(rank, type), outputs_(std::move(outputs)), completion_stream_(completion_stream) {
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                     std::vector<c10::Device>{device});
}

void SmddpWork::complete(std::exception_ptr error) {
  // The future first: its callbacks (e.g. DDP's bucket division) have run when wait() returns.
  if (error) {
    future_->setError(error);
  } else {
    // A device future records its event on the current stream: the copies' stream.
    std::optional<c10::StreamGuard> on_copies;
    if (completion_stream_) on_copies.emplace(*completion_stream_);
    future_->markCompleted(c10::IValue(outputs_));
  }
  finish(error);
}

bool SmddpWork::wait(std::chrono::milliseconds timeout) {
  std::shared_ptr<Executor> exec = exec_.lock();
  // Without a timeout the waiting thread helps: it runs the lane's queued work itself (under
  // each operation's own timeout). With one it must return when it runs out, which a thread
  // inside a collective cannot, so it leaves the work to the pool and waits at most that
  // long; c10d::Work::wait then raises "Operation timed out!", as gloo's Work does.
  if (exec && timeout == ::kNoTimeout) {
    while (!isCompleted() && exec->run_next()) {
    }
  }
  const bool ok = c10d::Work::wait(timeout);
  if (exec) exec->release_finished();
  if (completion_stream_) future_->wait();  // the current stream waits, not the host
  return ok;
}

CoalescedWork::CoalescedWork(std::vector<c10::intrusive_ptr<c10d::Work>> parts)
    : c10d::Work(-1, c10d::OpType::COALESCED) {
  for (auto& p : parts) {
    if (p) parts_.push_back(std::move(p));  // none: done in the caller's thread already
  }
}

bool CoalescedWork::isCompleted() {
  for (auto& p : parts_) {
    if (!p->isCompleted()) return false;
  }
  return true;
}

bool CoalescedWork::wait(std::chrono::milliseconds timeout) {
  if (timeout == ::kNoTimeout) {
    for (auto& p : parts_) p->wait(timeout);
    return true;
  }
  // One timeout for all the parts together.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (auto& p : parts_) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    p->wait(std::max(left, std::chrono::milliseconds(1)));  // 0 would mean no timeout
  }
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> CoalescedWork::getFuture() {
  std::vector<at::Tensor> all;
  c10::List<c10::intrusive_ptr<c10::ivalue::Future>> futures(
      c10::FutureType::create(c10::ListType::create(c10::TensorType::get())));
  for (auto& p : parts_) futures.push_back(p->getFuture());
  auto done = c10::collectAll(futures);
  return done->then(
      [futures](c10::ivalue::Future& f) -> c10::IValue {
        std::vector<at::Tensor> out;
        for (size_t i = 0; i < futures.size(); ++i) {
          auto list = futures.get(i)->value().toTensorVector();
          out.insert(out.end(), list.begin(), list.end());
        }
        return c10::IValue(out);
      },
      c10::ListType::create(c10::TensorType::get()));
}

std::exception_ptr Executor::execute(Item& item) {
  std::lock_guard<std::mutex> g(exec_mu_);
  try {
    item.fn();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

void Executor::run(Item& item) { item.work->complete(execute(item)); }

void Executor::submit(Fn fn, c10::intrusive_ptr<SmddpWork> work, bool async_op) {
  Item item{std::move(fn), std::move(work)};
  if (!async_op) {
    std::vector<Item> dead;  // destroyed after the lock (Note [Tensors are released in ...])
    std::unique_lock<std::mutex> lk(mu_);
    dead.swap(released_);
    if (main_.pending == 0 && !stop_) {
      lk.unlock();
      run(item);
      return;
    }
  }
  enqueue(main_, std::move(item));
}

void Executor::submit_send(Fn fn, c10::intrusive_ptr<SmddpWork> work) {
  enqueue(send_, Item{std::move(fn), std::move(work)});
}

void Executor::enqueue(Lane& lane, Item item) {
  std::vector<Item> dead;  // destroyed after the lock (Note [Tensors are released in ...])
  std::lock_guard<std::mutex> g(mu_);
  dead.swap(released_);
  if (stop_) {
    item.work->complete(
        std::make_exception_ptr(std::runtime_error("smddp: the process group was shut down")));
    return;
  }
  lane.queue.push_back(std::move(item));
  ++lane.pending;
  if (!lane.scheduled) {
    lane.scheduled = true;
    WorkerPool::instance().post([this, &lane] { drain(lane); });
  }
}

bool Executor::run_next() {
  Item item;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (main_busy_ || main_.queue.empty()) return false;
    item = take_front(main_);
  }
  // Async work keeps the worker's waiting policy (a short spin): while this thread waits
  // on a peer, the send lane of this process may need the core.
  bool was_worker = on_worker_thread();
  on_worker_thread() = true;
  std::exception_ptr error = execute(item);
  on_worker_thread() = was_worker;
  // Note [Finished before complete]: the lane is idle again before anyone can see the work
  // complete.
  finished(main_);
  cv_.notify_all();  // the worker, held back by main_busy_, may start the next one
  item.work->complete(error);
  return true;
}

Executor::Item Executor::take_front(Lane& lane) {
  Item item = std::move(lane.queue.front());
  lane.queue.pop_front();
  if (&lane == &main_) main_busy_ = true;
  return item;
}

void Executor::finished(Lane& lane) {
  std::lock_guard<std::mutex> lk(mu_);
  if (&lane == &main_) main_busy_ = false;
  --lane.pending;
  idle_cv_.notify_all();
}

void Executor::drain(Lane& lane) {
  const bool main = &lane == &main_;
  while (true) {
    Item item;
    {
      std::unique_lock<std::mutex> lk(mu_);
      // A waiter running main-lane work in its own thread (run_next) goes first.
      cv_.wait(lk, [&] { return !(main && main_busy_) || lane.queue.empty(); });
      if (lane.queue.empty()) {
        // The last touch of this executor: shutdown() waits for it under mu_.
        lane.scheduled = false;
        idle_cv_.notify_all();
        return;
      }
      item = take_front(lane);
    }
    std::exception_ptr error;
    if (!main) {
      // Sends do not take exec_mu_: they only write sockets (see Note [TCP connections])
      // or their own shared-memory rings.
      try {
        item.fn();
      } catch (...) {
        error = std::current_exception();
      }
    } else {
      error = execute(item);
    }
    // Note [Finished before complete]: a caller whose wait() returns because this work
    // completed may issue the next operation at once, and the eager paths (try_now,
    // try_send_now, the inline synchronous call) take it only while the lane has nothing
    // pending. Completing first left a window in which the finished work still counted as
    // pending, and the next small isend was queued instead of done at once (a flaky
    // test_p2p_matches_payload_bit_for_bit under load).
    finished(lane);
    item.work->complete(error);
    // Note [Tensors are released in the caller's thread].
    std::lock_guard<std::mutex> lk(mu_);
    released_.push_back(std::move(item));
  }
}

void Executor::release_finished() {
  std::vector<Item> dead;
  std::lock_guard<std::mutex> lk(mu_);
  dead.swap(released_);
}

void Executor::shutdown() {
  std::unique_lock<std::mutex> lk(mu_);
  stop_ = true;
  cv_.notify_all();
  // Queued work still runs (as before, when the lane threads drained it before joining),
  // and a waiter running one in its own thread (run_next) finishes it: the lane's thread
  // leaves once the queue is empty, while that work may still be running.
  idle_cv_.wait(lk, [&] { return !main_.scheduled && !send_.scheduled && main_.pending == 0; });
  std::vector<Item> dead;
  dead.swap(released_);
  lk.unlock();
}

}  // namespace smddp
