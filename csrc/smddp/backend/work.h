// The Works of ProcessGroupSMDDP: SmddpWork adapts an operation of the group's Scheduler
// (common/scheduler.h, which runs it; Note [Execution order] there) to c10d's Work and Future,
// and CoalescedWork and ResultAsWork combine or relabel Works.
//
// Note [One transport per process]
// A process may hold many groups (a device mesh's axes and flattened views, expert groups,
// every new_group), and each used to cost two lane threads, a pool descriptor and a pair
// of pre-faulted data buffers, whether it was busy or not (64 groups: 38 more threads, 38
// more fds and 200 MiB more /dev/shm per rank of 4). Groups now share what can be shared
// and pay for the rest only while they use it:
// - Threads: the lanes of every group's Scheduler (common/scheduler.h) are run by one
//   WorkerPool per process (common/worker_pool.h).
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
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <atomic>
#include <memory>
#include <optional>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "smddp/common/completion.h"
#include "smddp/common/scheduler.h"
#include "smddp/common/timeline.h"

namespace smddp {

class SmddpWork : public c10d::Work {
 public:
  SmddpWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs);
  // A work on device tensors (Note [Device staging] in device_staging.h): its future is a
  // device future whose event is recorded on `completion_stream` when it completes, and
  // wait() makes the caller's current stream wait on it.
  SmddpWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, c10::Device device,
            c10::Stream completion_stream);
  // Note [Waiting runs the work] in scheduler.h: wait() runs queued items of `exec` (the
  // scheduler this work was submitted to) in the caller's thread until this one is complete.
  void set_executor(std::weak_ptr<Scheduler> exec) { exec_ = std::move(exec); }
  // The completion sink through which the scheduler completes `work` (it holds the work).
  static CompletionPtr completion(c10::intrusive_ptr<SmddpWork> work);
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
  std::weak_ptr<Scheduler> exec_;
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

}  // namespace smddp
