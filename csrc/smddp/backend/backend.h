// ProcessGroupSMDDP: the c10d::Backend registered as "smddp" for CPU and device tensors.
//
// This layer validates tensors (device, dtype, sizes) on the caller's thread, stages
// non-contiguous tensors, and hands raw pointers to the Communicator through the
// group's Scheduler (Note [Execution order] in scheduler.h). Device tensors go through host mirrors
// (Note [Device staging] in device_staging.h): each collective's first lines hand them to
// the Stager, then call the same collective again on the mirrors.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <utility>

#include "smddp/algorithms/comm.h"
#include "smddp/backend/device_staging.h"
#include "smddp/backend/torch_compat.h"
#include "smddp/backend/work.h"

namespace smddp {

class ProcessGroupSMDDP : public c10d::Backend {
 public:
  // `settings`: Note [Settings] in settings.h (its timeout, when set, replaces `timeout`).
  ProcessGroupSMDDP(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                    std::chrono::duration<float> timeout, std::string group_name,
                    std::vector<int64_t> global_ranks, const Settings& settings);
  ~ProcessGroupSMDDP() override;

  const std::string getBackendName() const override { return "smddp"; }
  void setTimeout(std::chrono::milliseconds timeout) override {
    timeout_s_.store(timeout.count() / 1e3, std::memory_order_relaxed);
  }
  // The group's timeout (what setTimeout set last, else the constructor's), read from Python
  // as `backend.options._timeout`, where torch keeps gloo's and NCCL's: callers that must wait
  // as long as a group does (the async-save group, tsm.init's groups) ask every backend alike.
  c10::intrusive_ptr<Options> getBackendOptions() override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  // Synchronous in-place all-reduce without a Work or Future, for the direct call path
  // (torch_sagemaker.smddp.direct.all_reduce_direct); ordered after every collective
  // issued before it, like a synchronous allreduce.
  void allreduce_direct(const at::Tensor& tensor, const c10d::ReduceOp& op);
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // c10d's sequence number of the group: collectives issued on it so far (point-to-point
  // excluded), counted from 0 on every rank, as gloo counts. TORCH_DISTRIBUTED_DEBUG=DETAIL
  // wraps every backend in a ProcessGroupWrapper that compares it across ranks before each
  // collective; without it, every group creation failed in that mode.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return issued_.load(); }

  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  // Tensors from the group's shared-memory pool, which the collectives read in place
  // (Note [Zero-copy operands] in shm_algos.h). FSDP2 uses them after
  // `set_allocate_memory_from_process_group_for_comm(True)`.
  bool supportsTensorAlloc(c10::DeviceIndex device_index) override;
  at::Tensor allocateTensor(long size, at::TensorOptions options = {}) override;

  void shutdown() override;
  void abort() override;

  // Introspection for tests and the benchmark.
  // The group's communicator, for inspection; raises once the group was shut down (the
  // communicator is gone then).
  const Communicator& comm() const;
  // Steps of the staged CPU collectives since the last call (SMDDP_STAGE_CPU=1).
  std::vector<std::string> staging_trace() { return stager_->take_trace(); }
  // The phases of staged calls since the last call (SMDDP_TIMELINE=1, Note [Staging timeline]).
  std::vector<Timeline::Span> take_staging_timeline() { return stager_->take_timeline(); }
  // The collectives' phases since the last call (SMDDP_TIMELINE=1, Note [Timeline]).
  std::vector<Timeline::Span> take_timeline();

 private:
  // Submits `fn` (run on raw pointers) and returns its Work, or runs it at once and returns
  // none (Note [Synchronous calls return no Work] in backend.cpp).
  c10::intrusive_ptr<c10d::Work> submit(c10d::OpType type, std::vector<at::Tensor> outputs,
                                        bool async_op, std::function<void()> fn);
  c10::intrusive_ptr<c10d::Work> submit(c10::intrusive_ptr<SmddpWork> work, bool async_op,
                                        std::function<void()> fn);
  // Marks the group in use by one call until destroyed; shutdown() waits for every mark to
  // go (Note [Shutdown waits for the calls in flight] in backend.cpp). Empty (false) once the
  // group was shut down.
  class InUse {
   public:
    explicit InUse(ProcessGroupSMDDP* pg) : pg_(pg) {}
    InUse(InUse&& other) noexcept : pg_(std::exchange(other.pg_, nullptr)) {}
    InUse(const InUse&) = delete;
    InUse& operator=(const InUse&) = delete;
    InUse& operator=(InUse&&) = delete;
    ~InUse() {
      if (pg_) pg_->leave();
    }
    explicit operator bool() const { return pg_ != nullptr; }

   private:
    ProcessGroupSMDDP* pg_;
  };
  // Every entry point takes one before it touches comm_ and holds it to the end of the call:
  // `enter` raises once the group was shut down, `try_enter` returns an empty one.
  InUse enter();
  InUse try_enter();
  void leave();
  // The communicator; only while an InUse is held.
  Communicator& live_comm() { return *comm_; }
  // Queues a receive into `t` from `src` (kAnyPeer: any rank), which waits beside the
  // others (Note [Receives wait side by side] in receive_poller.cpp); returns its work.
  c10::intrusive_ptr<c10d::Work> submit_receive(c10::intrusive_ptr<SmddpWork> work,
                                                const at::Tensor& t, int src, int tag,
                                                const OpCtx& ctx);
  bool completes_inline(c10d::OpType type, bool async_op) const;
  // Note [Sparse all-reduce] in backend_sparse.cpp.
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(const at::Tensor& t,
                                                  const c10d::AllreduceOptions& opts);
  // reduce_scatter's list form when the parts differ in size (Note [Reduce-scatter of unequal
  // parts] in comm_algos.cpp); the inputs are checked CPU tensors of the output's dtype.
  c10::intrusive_ptr<c10d::Work> reduce_scatter_unequal(const at::Tensor& out,
                                                        const std::vector<at::Tensor>& ins,
                                                        const Reduction& red,
                                                        const c10d::ReduceScatterOptions& opts);
  double timeout_of(std::chrono::milliseconds t) const;
  Reduction reduction_of(const c10d::ReduceOp& op, const at::Tensor& t, const char* name) const;
  // Records works issued between startCoalescing and endCoalescing.
  c10::intrusive_ptr<c10d::Work> track(c10::intrusive_ptr<c10d::Work> w);
  // A Work already completed (Note [Eager point-to-point] in backend_p2p.cpp).
  c10::intrusive_ptr<c10d::Work> completed(c10d::OpType type, std::vector<at::Tensor> outputs);

  // Device staging (Note [Device staging]): `stage` returns the staged op for `tensors`, or
  // nullptr when they take the CPU path (also while a staged call is being issued).
  // `staged` issues `call` (the collective on the mirrors) with `op` pending: the Work that
  // call creates reports the caller's tensors and its function is wrapped in the copies.
  std::shared_ptr<StagedOp> stage(const std::vector<const at::Tensor*>& tensors,
                                  const char* collective);
  template <typename F>
  c10::intrusive_ptr<c10d::Work> staged(std::shared_ptr<StagedOp> op, F&& call) {
    pending_stage_ = std::move(op);
    try {
      auto w = call();
      pending_stage_.reset();
      return w;
    } catch (...) {
      pending_stage_.reset();
      throw;
    }
  }
  c10::intrusive_ptr<SmddpWork> make_work(c10d::OpType type, std::vector<at::Tensor> outputs);

  // shutdown()'s work: waits for the calls in flight and the executor, frees the transport.
  void release();
  bool release_in_destructor_ = false;  // shutdown() could not start its release thread

  std::unique_ptr<Communicator> comm_;
  std::shared_ptr<Scheduler> exec_ = std::make_shared<Scheduler>();  // works hold weak refs
  // Atomic: Python may call setTimeout on one thread while another enqueues a collective,
  // which reads it (a value on its own: nothing else is published with it, hence relaxed).
  std::atomic<double> timeout_s_;
  double timeout_s() const { return timeout_s_.load(std::memory_order_relaxed); }
  std::string group_name_;
  bool coalescing_ = false;
  std::vector<c10::intrusive_ptr<c10d::Work>> coalesced_;
  std::atomic<bool> shut_down_{false};
  std::atomic<int> users_{0};  // InUse marks held
  std::mutex users_mu_;
  std::mutex comm_mu_;  // held while abort() uses comm_ and while shutdown() takes it away
  std::condition_variable users_cv_;  // users_ reached 0 after shut_down_ was set
  std::atomic<uint64_t> issued_{0};   // getSequenceNumberForGroup
  std::unique_ptr<Stager> stager_;
  std::shared_ptr<StagedOp> pending_stage_;
};

// Waits up to `timeout_s` until the release threads of groups shut down from their own
// thread have finished (Note [Shutdown from the group's own thread]); false on timeout.
bool wait_for_deferred_releases(double timeout_s);

// Maps an ATen dtype to ours; throws TypeError naming the collective for unsupported ones.
DType to_dtype(at::ScalarType t, const char* collective);

// Throws unless `t` is a dense CPU tensor (device tensors are staged before this check).
void check_cpu(const at::Tensor& t, const char* collective, const char* what);

}  // namespace smddp
