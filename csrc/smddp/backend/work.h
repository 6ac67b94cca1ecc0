// Work objects, the per-group executor and the per-process worker pool.
//
// Note [Execution order]
// Collectives of one group must run in the order they were issued (every rank issues the
// same order, and the shm step protocol relies on it). A synchronous call
// (opts.asyncOp == false) runs inline in the caller's thread when nothing is queued,
// avoiding a thread hand-off (a futex wake costs tens of microseconds on a VM); otherwise,
// and for every async call, the operation is queued to the group's main lane, which a
// worker thread (Note [One transport per process]) runs in FIFO order so communication
// overlaps the caller's computation. Sends (isend/send) run on a separate send lane so a
// large send never blocks a receive, and receives that must wait do so beside the lanes
// (Note [Receives wait side by side] in work.cpp). `exec_mu_` makes sure inline and worker
// executions, and receive attempts, never overlap.
//
// Note [Waiting runs the work]
// A caller that waits for an async work which has not started yet would otherwise sleep
// until the worker thread wakes up, runs it and wakes the caller again: two hand-offs of
// tens of microseconds each on these VMs, and with more ranks than cores the worker may not
// get a core for much longer. So SmddpWork::wait() runs main-lane works in the caller's
// thread, front first, until its own work is complete; the waiter of a send runs the send
// lane's works first, then the main lane's. A work is taken only from the front of its lane
// and only while none of the lane's works is running (`Lane::busy`, which also keeps the
// lane's pool thread from starting the next one meanwhile), so the issue order of
// Note [Execution order] holds either way. It also means a future callback, which runs in
// the thread that completed its Work (possibly the lane's pool thread), can wait for a
// later work of the same lane: it runs that work itself instead of waiting for itself.
//
// Note [One transport per process]
// A process may hold many groups (a device mesh's axes and flattened views, expert groups,
// every new_group), and each used to cost two lane threads, a pool descriptor and a pair
// of pre-faulted data buffers, whether it was busy or not (64 groups: 38 more threads, 38
// more fds and 200 MiB more /dev/shm per rank of 4). Groups now share what can be shared
// and pay for the rest only while they use it:
// - Threads: the lanes of every group's Executor are run by one WorkerPool per process
//   (common/worker_pool.h).
//   A lane with queued work holds one pool thread until its queue is empty, then gives it
//   back; a thread idle for kLinger exits. The pool is not of a fixed size on purpose: a
//   lane's work blocks while it waits for the same group on other ranks, and the ranks may
//   run their groups in different orders (rank 0 waits in group A for rank 1, whose only
//   thread waits in group B for rank 0), so a fixed pool smaller than the number of groups
//   with work could deadlock. A pool that lends every busy lane a thread cannot: each
//   group progresses as if it had its own thread. The thread count is therefore bounded by
//   the groups with work *at the same moment* (plus idle threads for up to kLinger), not
//   by the groups that exist; the order of one group's work is its lane's FIFO order, as
//   before (Note [Execution order]). Groups that listen for TCP connections (several
//   hosts, or SMDDP_P2P_BYTES=0) share one acceptor thread per process (Acceptor in
//   tcp.cpp), which exists only while some group listens; each group keeps its own port,
//   secret and handshake limits, and its sockets.
// - Descriptors: a segment's descriptor is closed once it is mapped, the tensor pool's too
//   (ShmPool commits pages with MADV_POPULATE_WRITE on its mapping instead of fallocate on
//   the descriptor; kernels older than 5.14 keep the descriptor as before).
// - /dev/shm: a segment's data buffers are committed in granules as the algorithms first
//   write to them (ShmComm::writable), not pre-faulted whole at creation, so a group that
//   only carries small messages costs its control page and a few granules.
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
// thread never drops a finished work: it hands it to `released_`, and the caller's thread destroys
// what is there when it next calls into the executor (submit, wait, the synchronous paths) or shuts
// it down. The cost is that a finished work's tensors live until that call: at most what the caller
// queued since its previous call into the group.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "smddp/common/timeline.h"
#include "smddp/common/worker_pool.h"

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
  // Records the completion and the caller's first wait() on `timeline` as phases of the
  // staged call `call`, issued at `issued_ns` (Note [Staging timeline] in device_staging.h).
  void record_on(std::shared_ptr<Timeline> timeline, uint64_t call, int64_t issued_ns);

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::weak_ptr<Executor> exec_;
  std::atomic<int> source_rank_{-1};
  std::optional<c10::Stream> completion_stream_;
  std::shared_ptr<Timeline> timeline_;  // null: not recorded
  uint64_t call_ = 0;
  int64_t issued_ns_ = 0;
  std::atomic<bool> waited_{false};
};

// A Work that completes when all of its parts complete (endCoalescing, the *_coalesced
// collectives). A part may be none: a synchronous call that completed before it returned
// (Note [Synchronous calls return no Work] in backend.cpp).
class CoalescedWork : public c10d::Work {
 public:
  explicit CoalescedWork(std::vector<c10::intrusive_ptr<c10d::Work>> parts);
  bool isCompleted() override;
  bool wait(std::chrono::milliseconds timeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> parts_;
};

// Another work's progress, reported with other tensors as its outputs: the caller's complex
// tensors when the backend reduced their real views (Note [Complex reductions] in
// op_helpers.h). The outputs share storage with the inner work's, so they hold its result
// once it completes.
class ResultAsWork : public c10d::Work {
 public:
  ResultAsWork(c10::intrusive_ptr<c10d::Work> inner, std::vector<at::Tensor> outputs);
  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  bool wait(std::chrono::milliseconds timeout) override { return inner_->wait(timeout); }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::vector<at::Tensor> outputs_;
};

// Pacing of rounds of receive attempts: after a round that found nothing, yield for
// `spin` since the last progress, then sleep for doubling pauses from 10 us up to `longest`.
class ReceiveBackoff {
 public:
  ReceiveBackoff(std::chrono::microseconds spin, std::chrono::microseconds longest);
  void after(bool progress);  // call after each round

 private:
  std::chrono::microseconds spin_, longest_;
  std::chrono::steady_clock::time_point idle_since_{};
  std::chrono::microseconds pause_{0};
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
  // The caller runs queued collectives itself while no other thread does (Note [Waiting
  // runs the work]): it may be the lane's own pool thread, in a future callback.
  template <class F>
  void run_now(F&& fn) {
    std::vector<Item> dead;
    {
      std::unique_lock<std::mutex> lk(mu_);
      while (main_.pending != 0 && !stop_) {
        if (main_.busy || main_.queue.empty()) {
          idle_cv_.wait(lk);
          continue;
        }
        lk.unlock();
        run_next(LaneId::kMain);
        lk.lock();
      }
      if (stop_) throw std::runtime_error("smddp: the process group was shut down");
      dead.swap(released_);
    }
    std::lock_guard<std::mutex> g(exec_mu_);
    fn();
  }
  // Runs receive rounds (and main-lane work) in the caller's thread until `work`, a
  // receive's, is complete (Note [Receives wait side by side]).
  bool help_receive(SmddpWork& work);
  // Note [Receives wait side by side]: queues a receive, which completes its work when
  // `attempt` (one non-blocking try: Communicator::poll_recv) returns true, or raises.
  // `src` (or kAnyPeer) and `tag` say which messages the receive may take; `exclusive`:
  // its attempts must not overlap the collectives (see the note).
  using Attempt = std::function<bool()>;
  void submit_receive(Attempt attempt, c10::intrusive_ptr<SmddpWork> work, int src, int64_t tag,
                      bool exclusive);
  // Runs `attempt` (a receive that does not block) in the caller's thread when no receive
  // waits, so that it cannot take a message an earlier receive is owed, and no collective
  // is running; returns what it returned, or false when it did not run.
  template <class F>
  bool try_receive_now(F&& attempt) {
    return try_inline(recv_.pending, false, attempt);
  }
  // Runs `attempt` (which must not block) in the caller's thread when nothing is queued on
  // the lane it would otherwise go to, so it cannot overtake earlier operations there;
  // returns what `attempt` returned, or false when it did not run. Sends hold mu_ while
  // they try, so nothing can be queued on the send lane meanwhile.
  template <class F>
  bool try_now(F&& attempt) {
    return try_inline(main_.pending, true, attempt);
  }
  template <class F>
  bool try_send_now(F&& attempt) {
    std::lock_guard<std::mutex> lk(mu_);
    return !send_.pending && !stop_ && attempt();
  }
  // Note [Waiting runs the work]: runs the next work of a lane in the caller's thread if
  // none of the lane's work is running; returns whether it ran one.
  enum class LaneId { kMain, kSend };
  bool run_next(LaneId lane);
  // Waits for all queued and running work and for the pool threads to leave the lanes.
  // Idempotent. Not from a thread active_in_this_thread(): it would wait for itself.
  void shutdown();
  // Note [Abort fails the queued work]: work that has not started fails instead of running.
  void abort() { aborted_.store(true); }
  // Whether the calling thread is inside this executor: running a lane or receive rounds,
  // running queued work for a waiter, or completing one of its Works (future callbacks run
  // there). Note [Shutdown from the group's own thread] in backend.cpp.
  bool active_in_this_thread() const;
  // Destroys the works pool threads finished (Note [Tensors are released in the caller's
  // thread]). Call from the caller's side only, never from a pool thread.
  void release_finished();

 private:
  // try_now and try_receive_now: runs `attempt` unless `pending` (a count under mu_) is not
  // zero or the executor stopped; waits for exec_mu_ or, without `wait_for_exec`, gives up
  // when another execution holds it.
  template <class F>
  bool try_inline(const size_t& pending, bool wait_for_exec, F& attempt) {
    std::vector<Item> dead;  // destroyed after the locks (Note [Tensors are released in ...])
    {
      std::lock_guard<std::mutex> lk(mu_);
      dead.swap(released_);
      if (pending || stop_) return false;
    }
    std::unique_lock<std::mutex> g(exec_mu_, std::defer_lock);
    if (wait_for_exec) {
      g.lock();
    } else if (!g.try_lock()) {
      return false;
    }
    return attempt();
  }
  struct Item {
    Fn fn;
    c10::intrusive_ptr<SmddpWork> work;
  };
  struct Lane {
    std::deque<Item> queue;
    bool scheduled = false;  // a pool thread runs this lane (until its queue is empty)
    bool busy = false;       // one of its works is running (its pool thread or run_next)
    size_t pending = 0;      // queued or running
  };
  struct Receive {
    Attempt attempt;
    c10::intrusive_ptr<SmddpWork> work;
    int src;  // group rank, or kAnyPeer
    int64_t tag;
    bool exclusive;  // attempts take exec_mu_ (a peer over TCP: the mesh's read buffers)
  };
  struct Receives {
    std::deque<Receive> queue;  // submitted, not yet taken by drain_receives
    bool scheduled = false;     // a pool thread runs drain_receives
    // Finished in a round, to be completed (Note [Receives complete after their round]).
    std::deque<std::pair<Receive, std::exception_ptr>> done;
    int completing = 0;  // threads completing one of `done`
    size_t pending = 0;  // queued or being attempted
  };
  void drain_receives();  // on a pool thread: attempts the receives until none is left
  // One attempt at every waiting receive, in posting order, unless another thread is
  // running a round; returns whether a receive completed (or was cancelled).
  bool receive_round();
  void finish_receive(Receive& r, std::exception_ptr error);
  bool complete_one_receive();  // completes the front of recv_.done; false when empty
  void drain(Lane& lane);       // on a pool thread: runs the lane's queue, then returns
  Item take_front(Lane& lane);  // under mu_; marks the lane busy
  void finished(Lane& lane);    // takes mu_; the work taken by take_front is done
  // Runs the item's function, under exec_mu_ when `exclusive` (main-lane work); returns its
  // error (nullptr: none).
  std::exception_ptr execute(Item& item, bool exclusive);
  void run(Item& item);
  void enqueue(Lane& lane, Item item);

  std::mutex mu_;
  std::condition_variable cv_;       // a lane's busy went false
  std::condition_variable idle_cv_;  // a lane became idle or unscheduled
  Lane main_, send_;
  Receives recv_;
  std::vector<Receive> recv_live_;    // taken from recv_.queue; only the round's runner uses it
  bool recv_busy_ = false;            // a thread is running receive_round
  std::atomic<int> recv_helpers_{0};  // threads in help_receive
  std::vector<Item> released_;        // finished on a pool thread, destroyed by release_finished
  bool stop_ = false;
  std::atomic<bool> aborted_{false};
  std::mutex exec_mu_;
};

}  // namespace smddp
