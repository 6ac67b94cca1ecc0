// The per-group scheduler of operations: two lanes run in issue order by pool threads, by the
// caller inline, or by a thread that waits; receives wait in a ReceivePoller beside them.
// Nothing here knows torch: an operation reports to a Completion the backend supplies
// (SmddpWork in backend/work.h is the adapter), so tests/cpp runs it under the sanitizers.
//
// Note [Execution order]
// Collectives of one group must run in the order they were issued (every rank issues the
// same order, and the shm step protocol relies on it). A synchronous call
// (opts.asyncOp == false) runs inline in the caller's thread when nothing is pending on the
// main lane, avoiding a thread hand-off (a futex wake costs tens of microseconds on a VM);
// otherwise, and for every async call, the operation is queued to the group's main lane,
// which a worker thread (Note [One transport per process] in backend/work.h) runs in FIFO
// order so communication overlaps the caller's computation. Sends (isend/send) run on a
// separate send lane so a large send never blocks a receive, and receives that must wait do
// so beside the lanes (Note [Receives wait side by side] in receive_poller.cpp). The
// exclusive lock (Note [Scheduler]) makes sure main-lane work and the receive attempts that
// share the collectives' buffers never overlap.
//
// Note [Scheduler]
// One rule decides who runs a lane's front item: the thread that *claims* the lane, under
// mu_, while no item of the lane runs (`Lane::busy` false). A claim marks the lane busy; the
// claimer runs one item, then leaves the lane (busy false, pending one less) and only then
// completes the item (Note [Finished before complete]). The claimers are:
// - a pool thread the lane was given when its first item was queued (drain), which claims
//   the front again and again until the queue is empty, waiting while another thread holds
//   the lane;
// - a thread that waits for a Work (Note [Waiting runs the work]) and claims the front
//   instead of sleeping (run_next);
// - an inline call (submit of a synchronous call, try_now, try_send_now, run_now), which
//   claims a lane that has nothing pending at all: its item was never queued, and it counts
//   as pending while it runs, so nothing queued after it can start first.
// Main-lane items run under the exclusive lock `exclusive_`, as do the receive attempts over
// TCP (Note [Receives wait side by side]); send-lane items do not (they only write sockets or
// their own shared-memory rings). An abort (Note [Abort fails the queued work]) fails every
// item that has not started, checked once the claimer holds the exclusive lock. So at most one
// item of a lane runs at a time, items start in their lane's queue order, and an inline call
// starts only when everything issued before it has finished.
// The outcome of an item goes to the Completion (completion.h) the backend supplied with it:
// the claimer calls complete() once, with no lock of the scheduler held (callbacks may call in
// again), and the sink is destroyed later in the caller's thread (Note [Tensors are released
// in the caller's thread]). Receives are not lane items: they wait in a ReceivePoller (Note
// [Receives wait side by side] in receive_poller.cpp), polled in rounds by a pool thread of
// its own or by a thread that waits for a receive, which take the exclusive lock only for the
// receives that share the collectives' buffers.
//
// Note [Waiting runs the work]
// A caller that waits for an async work which has not started yet would otherwise sleep
// until the worker thread wakes up, runs it and wakes the caller again: two hand-offs of
// tens of microseconds each on these VMs, and with more ranks than cores the worker may not
// get a core for much longer. So a waiter (help()) runs main-lane items in its own thread,
// front first, until its own item is complete; the waiter of a send runs the send lane's
// items first, then the main lane's. It claims the lane like any other claimer (Note
// [Scheduler]), so the issue order of Note [Execution order] holds either way. It also
// means a future callback, which runs in the thread that completed its Work (possibly the
// lane's pool thread), can wait for a later item of the same lane: it runs that item itself
// instead of waiting for itself.
//
// Note [Tensors are released in the caller's thread]
// A tensor that has a Python object takes the GIL when its C++ reference count falls from 2 to 1
// (torch 2.13 keeps the Python object alive while C++ holds a reference, and gives it back then). A
// queued work holds its tensors in its function and in its Work, so the pool thread that ran it
// would drop the last C++ references to tensors the caller still holds (the input of an all-gather
// or a reduce-scatter; everything, once the caller has dropped the Work) and wait for the GIL.
// While the caller's thread runs Python, that wait is up to a switch interval (5 ms), and every
// later work of the lane waits behind it; while the interpreter shuts down, a thread that asks for
// the GIL is ended, which aborts the process ("terminate called without an active exception", as a
// gloo rank of a benchmark did at exit: gloo's worker threads drop tensors the same way). So a pool
// thread never drops a finished item: it hands it to `released_`, and the caller's thread destroys
// what is there when it next calls into the scheduler (submit, wait, the synchronous paths) or
// shuts it down. The cost is that a finished item's tensors live until that call: at most what the
// caller queued since its previous call into the group.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "smddp/common/receive_poller.h"

namespace smddp {

class Scheduler {
 public:
  using Fn = std::function<void()>;
  using Attempt = ReceivePoller::Attempt;
  // Starts a task on some thread; the default is the process's WorkerPool. Tests pass their
  // own to choose which thread runs a lane when.
  using Post = std::function<void(std::function<void()>)>;
  enum class LaneId { kMain, kSend };

  explicit Scheduler(Post post = {});
  ~Scheduler() { shutdown(); }
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Note [Execution order]: `fn` runs on the main lane, inline when `async_op` is false and
  // nothing is pending there; `done` learns the outcome.
  void submit(Fn fn, CompletionPtr done, bool async_op);
  void submit_send(Fn fn, CompletionPtr done);
  // Runs `fn` in the caller's thread once the queued collectives have finished (the order
  // of Note [Execution order]), without a Completion; its exceptions propagate to the caller.
  // The caller runs queued collectives itself while no other thread does (Note [Waiting
  // runs the work]): it may be the lane's own pool thread, in a future callback.
  template <class F>
  void run_now(F&& fn) {
    std::vector<Item> dead;  // destroyed after the locks (Note [Tensors are released in ...])
    {
      std::unique_lock<std::mutex> lk(mu_);
      dead.swap(released_);
      while (!stop_ && !claim(main_, true)) {
        if (main_.busy || main_.queue.empty()) {
          idle_cv_.wait(lk);
          continue;
        }
        lk.unlock();
        run_next(LaneId::kMain);
        lk.lock();
      }
      if (stop_) throw std::runtime_error("smddp: the process group was shut down");
    }
    Leave leave{*this, main_};
    std::lock_guard<std::mutex> g(exclusive_);
    fn();
  }
  // Runs `attempt` (which must not block) in the caller's thread when nothing is pending on
  // the main lane, so it cannot overtake earlier operations there; returns what `attempt`
  // returned, or false when it did not run.
  template <class F>
  bool try_now(F&& attempt) {
    if (!claim_inline(main_)) return false;
    Leave leave{*this, main_};
    std::lock_guard<std::mutex> g(exclusive_);
    return attempt();
  }
  // The same on the send lane, outside the exclusive lock.
  template <class F>
  bool try_send_now(F&& attempt) {
    if (!claim_inline(send_)) return false;
    Leave leave{*this, send_};
    return attempt();
  }
  // Note [Receives wait side by side]: queues a receive, which completes `done` when
  // `attempt` (one non-blocking try: Communicator::poll_recv) returns true, or raises.
  void submit_receive(Attempt attempt, CompletionPtr done, int src, int64_t tag, bool exclusive);
  // Runs `attempt` (a receive that does not block) in the caller's thread when no receive
  // waits, so that it cannot take a message an earlier receive is owed, and no collective
  // is running; returns what it returned, or false when it did not run.
  template <class F>
  bool try_receive_now(F&& attempt) {
    sweep();
    return receives_.try_now(attempt);
  }
  // What a waiter waits for: an item of the main lane, of the send lane, or a receive.
  enum class Waited { kMain, kSend, kReceive };
  // Note [Waiting runs the work]: runs what the wait needs in the caller's thread until
  // done() is true or nothing is left it could run (the caller then sleeps on its Work).
  void help(Waited what, const std::function<bool()>& done);
  // Runs the front item of a lane in the caller's thread if no item of the lane is running;
  // returns whether it ran one.
  bool run_next(LaneId lane);
  // Waits for all queued and running items and for the pool threads to leave the lanes;
  // cancels the receives still waiting. Idempotent. Not from a thread
  // active_in_this_thread(): it would wait for itself.
  void shutdown();
  // Note [Abort fails the queued work]: items that have not started fail instead of running.
  void abort() { aborted_.store(true); }
  // Whether the calling thread is inside this scheduler: running a lane or receive rounds,
  // running queued items for a waiter, or completing one of its items (future callbacks run
  // there). Note [Shutdown from the group's own thread] in backend.cpp.
  bool active_in_this_thread() const { return ActiveScope::inside(this); }
  // Destroys the items pool threads finished (Note [Tensors are released in the caller's
  // thread]). Call from the caller's side only, never from a pool thread.
  void release_finished() { sweep(); }
  // Items queued or running on a lane (for tests).
  size_t pending(LaneId lane);

 private:
  struct Item {
    Fn fn;
    CompletionPtr done;
  };
  struct Lane {
    std::deque<Item> queue;
    bool scheduled = false;  // a pool thread drains this lane (until its queue is empty)
    bool busy = false;       // a claimer runs one of its items (Note [Scheduler])
    size_t pending = 0;      // queued, or claimed and running
  };
  // Note [Scheduler], under mu_: claims `lane` for its front item, or with `inline_call` for
  // an item that was never queued, which needs the lane to have nothing pending at all.
  bool claim(Lane& lane, bool inline_call) {
    if (lane.busy || (inline_call ? lane.pending != 0 : lane.queue.empty())) return false;
    lane.busy = true;
    if (inline_call) ++lane.pending;
    return true;
  }
  // Takes mu_; sweeps the hand-back and claims `lane` for an inline call unless stopped.
  bool claim_inline(Lane& lane);
  void leave(Lane& lane);  // takes mu_; the claimer's item is done
  struct Leave {           // leave() at the end of a scope, also when the item throws
    Scheduler& s;
    Lane& lane;
    ~Leave() { s.leave(lane); }
  };
  Item take_front(Lane& lane);  // under mu_, after claim(lane, false)
  // Runs the item's function, under the exclusive lock when `exclusive` (main-lane items);
  // returns its error (nullptr: none). Note [Abort fails the queued work].
  std::exception_ptr execute(Item& item, bool exclusive);
  void enqueue(Lane& lane, Item item);
  void drain(Lane& lane);  // on a pool thread: runs the lane's queue, then returns
  void retire(Item item);  // takes mu_: to released_
  void sweep();            // takes mu_: destroys released_ after the lock

  Post post_;
  std::mutex mu_;
  std::condition_variable cv_;       // a lane's busy went false
  std::condition_variable idle_cv_;  // a lane became idle or unscheduled
  Lane main_, send_;
  std::vector<Item> released_;  // finished on a pool thread, destroyed by sweep()
  bool stop_ = false;
  std::atomic<bool> aborted_{false};
  std::mutex exclusive_;
  ReceivePoller receives_;  // last: its threads use the members above until shutdown()
};

}  // namespace smddp
