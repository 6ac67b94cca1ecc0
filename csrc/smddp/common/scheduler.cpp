#include "smddp/common/scheduler.h"

#include <stdexcept>
#include <utility>

#include "smddp/common/common.h"
#include "smddp/common/worker_pool.h"

namespace smddp {

Scheduler::Scheduler(Post post)
    : post_(post ? std::move(post) : Post([](std::function<void()> task) {
        WorkerPool::instance().post(std::move(task));
      })),
      receives_(this, exclusive_, post_, [this](Attempt attempt, CompletionPtr done) {
        retire(Item{[held = std::move(attempt)] {}, std::move(done)});
      }) {}

// Note [Abort fails the queued work]
// An abort (_abort_process_group) marks the transport aborted, which fails an operation
// only where it waits for a peer. Work queued behind the abort therefore ran, and completed
// or failed depending on whether its peers' parts had already arrived: a callback that
// aborted its own group saw the all_reduce queued behind it sometimes fail and sometimes
// succeed (a flaky test under load). Items that have not started when the group is aborted
// now always fail, as NCCL's abort fails every queued kernel (receives still waiting are
// cancelled by the shutdown that follows); destroy_process_group still lets them run (Note
// [Shutdown from the group's own thread] in backend.cpp). The flag is read once the claimer
// holds the exclusive lock: an abort may come while it waits for it. The peers are told
// (Note [Abort tells the peers] in comm.cpp).
std::exception_ptr Scheduler::execute(Item& item, bool exclusive) {
  std::unique_lock<std::mutex> g(exclusive_, std::defer_lock);
  if (exclusive) g.lock();
  if (aborted_.load()) {
    return std::make_exception_ptr(
        std::runtime_error("smddp: " + item.done->name() +
                           " was aborted before it started: the process group was aborted"));
  }
  try {
    item.fn();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

bool Scheduler::claim_inline(Lane& lane) {
  std::vector<Item> dead;  // destroyed after the lock (Note [Tensors are released in ...])
  std::lock_guard<std::mutex> lk(mu_);
  dead.swap(released_);
  return !stop_ && claim(lane, true);
}

void Scheduler::leave(Lane& lane) {
  std::lock_guard<std::mutex> lk(mu_);
  lane.busy = false;
  --lane.pending;
  cv_.notify_all();  // the lane's pool thread, held back by busy, may claim the next item
  idle_cv_.notify_all();
}

Scheduler::Item Scheduler::take_front(Lane& lane) {
  Item item = std::move(lane.queue.front());
  lane.queue.pop_front();
  return item;
}

void Scheduler::submit(Fn fn, CompletionPtr done, bool async_op) {
  Item item{std::move(fn), std::move(done)};
  if (!async_op && claim_inline(main_)) {
    std::exception_ptr error = execute(item, true);
    leave(main_);                // Note [Finished before complete]
    item.done->complete(error);  // no callbacks yet: the caller has not seen the Work
    return;
  }
  enqueue(main_, std::move(item));
}

void Scheduler::submit_send(Fn fn, CompletionPtr done) {
  enqueue(send_, Item{std::move(fn), std::move(done)});
}

// Note [A lane whose thread could not start]
// Posting the lane's drain can fail: the pool starts a thread when none is idle, and the
// system may refuse one (EAGAIN at the thread limit). The lane used to stay marked scheduled
// with the item queued: no later item posted a drain, and shutdown waited for the lane for
// ever. The post is now undone (the queue held only this item: an unscheduled lane has an
// empty queue) and the item fails with the reason, as a shut-down group's items do.
void Scheduler::enqueue(Lane& lane, Item item) {
  std::exception_ptr error;
  {
    std::vector<Item> dead;  // destroyed after the lock (Note [Tensors are released in ...])
    std::lock_guard<std::mutex> g(mu_);
    dead.swap(released_);
    if (!stop_) {
      lane.queue.push_back(std::move(item));
      ++lane.pending;
      if (lane.scheduled) return;
      lane.scheduled = true;
      try {
        post_([this, &lane] { drain(lane); });
        return;
      } catch (const std::exception& e) {
        item = std::move(lane.queue.back());  // the only item: the lane was not scheduled
        lane.queue.pop_back();
        --lane.pending;
        lane.scheduled = false;
        idle_cv_.notify_all();
        error = std::make_exception_ptr(std::runtime_error(
            std::string("smddp: could not start a thread to run ") + item.done->name() + ": " +
            e.what() +
            ". The process is at its thread limit (ulimit -u, or the container's "
            "pids limit); raise it or run fewer threads."));
      }
    } else {
      error = std::make_exception_ptr(std::runtime_error("smddp: the process group was shut down"));
    }
  }
  // Outside the lock: the completion may run callbacks that call in again.
  item.done->complete(error);
}

bool Scheduler::run_next(LaneId id) {
  Lane& lane = id == LaneId::kSend ? send_ : main_;
  Item item;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!claim(lane, false)) return false;
    item = take_front(lane);
  }
  ActiveScope active(this);
  // Async work keeps the worker's waiting policy (a short spin): while this thread waits
  // on a peer, the send lane of this process may need the core.
  const bool was_worker = on_worker_thread();
  on_worker_thread() = true;
  std::exception_ptr error = execute(item, id == LaneId::kMain);
  on_worker_thread() = was_worker;
  leave(lane);  // Note [Finished before complete]
  item.done->complete(error);
  return true;
}

void Scheduler::drain(Lane& lane) {
  ActiveScope active(this);
  const bool main = &lane == &main_;
  while (true) {
    Item item;
    {
      std::unique_lock<std::mutex> lk(mu_);
      // A waiter running one of the lane's items in its own thread (run_next) goes first.
      cv_.wait(lk, [&] { return !lane.busy || lane.queue.empty(); });
      if (!claim(lane, false)) {  // the queue is empty
        // The last touch of this scheduler: shutdown() waits for it under mu_.
        lane.scheduled = false;
        idle_cv_.notify_all();
        return;
      }
      item = take_front(lane);
    }
    std::exception_ptr error = execute(item, main);
    // Note [Finished before complete]: a caller whose wait() returns because this item
    // completed may issue the next operation at once, and the inline paths (try_now,
    // try_send_now, the inline synchronous call) claim the lane only while it has nothing
    // pending. Completing first left a window in which the finished item still counted as
    // pending, and the next small isend was queued instead of done at once (a flaky
    // test_p2p_matches_payload_bit_for_bit under load).
    leave(lane);
    // Note [Callbacks run on the lane's thread]
    // Completing the item runs its future's callbacks here, and the lane waits for them. A
    // callback that waits for later work of the lane through Work::wait() runs that work
    // itself (Note [Waiting runs the work]); one that blocks on a Future's wait() waits for
    // this thread, i.e. for itself (gloo, whose two worker threads run works side by side,
    // completes such a program). Leaving the lane to another pool thread before completing
    // every item whose future was taken fixed that, but cost one thread hand-off per
    // completion: 2 ranks x 8 async 1 MiB all_reduces with a then() callback each (DDP's
    // pattern) took 1780-1833 us per iteration instead of 1173-1387 us. Not worth it for a
    // callback that blocks, which the docs ask users not to do.
    item.done->complete(error);
    retire(std::move(item));  // Note [Tensors are released in the caller's thread]
  }
}

void Scheduler::retire(Item item) {
  std::lock_guard<std::mutex> lk(mu_);
  released_.push_back(std::move(item));
}

void Scheduler::sweep() {
  std::vector<Item> dead;  // destroyed after the lock
  std::lock_guard<std::mutex> lk(mu_);
  dead.swap(released_);
}

void Scheduler::submit_receive(Attempt attempt, CompletionPtr done, int src, int64_t tag,
                               bool exclusive) {
  sweep();
  receives_.submit(std::move(attempt), std::move(done), src, tag, exclusive);
}

void Scheduler::help(Waited what, const std::function<bool()>& done) {
  if (what == Waited::kReceive) {
    receives_.help(done, [this] { return run_next(LaneId::kMain); });
  }
  // A send's waiter runs the send lane too: it may be that lane's own pool thread, in a
  // future callback of the send before (Note [Waiting runs the work]).
  const bool send = what == Waited::kSend;
  while (!done() && ((send && run_next(LaneId::kSend)) || run_next(LaneId::kMain))) {
  }
}

void Scheduler::shutdown() {
  receives_.stop();  // the receives still waiting are cancelled while the lanes finish
  {
    std::unique_lock<std::mutex> lk(mu_);
    stop_ = true;
    cv_.notify_all();
    // Queued items still run (as before, when the lane threads drained them before joining),
    // and a waiter running one in its own thread (run_next: main-lane items, or a send for a
    // send's waiter) finishes it: the lane's thread leaves once the queue is empty, while
    // that item may still be running, hence the pending counts beside `scheduled`.
    idle_cv_.wait(lk, [&] {
      return !main_.scheduled && !send_.scheduled && main_.pending == 0 && send_.pending == 0;
    });
  }
  receives_.shutdown();
  sweep();
}

size_t Scheduler::pending(LaneId id) {
  std::lock_guard<std::mutex> lk(mu_);
  return (id == LaneId::kSend ? send_ : main_).pending;
}

}  // namespace smddp
