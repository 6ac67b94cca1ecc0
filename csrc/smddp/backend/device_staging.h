// Device (accelerator) tensors in smddp: staged through host memory around the CPU
// algorithms, on the device-generic c10 API only (no CUDA headers: the extension builds
// against a CPU-only torch and against an accelerator torch without its compiler).
//
// Note [Device staging]
// SMDDP reduces on the host so that the device's compute units stay with the model: a
// collective on device tensors copies its operands device->host, runs the same CPU
// algorithm as for CPU tensors, and copies the results host->device. Only copies run on the
// device; no reduction kernel is launched.
//
// Stream semantics are those of NCCL:
//  - Issue (caller's thread): an event is recorded on the caller's current stream. Both side
//    streams (one per copy direction, so device->host and host->device copies run on both
//    copy engines) wait on it, so the collective sees every kernel queued before it.
//  - Run (the executor, Note [Execution order] in scheduler.h): device->host copies are queued on
//    the d2h stream; the host waits on the event after each chunk, reduces it, and queues
//    its host->device copy on the h2d stream.
//  - Completion: the work's future is a device future whose event is recorded on the h2d
//    stream (SmddpWork's completion stream), so `Work.wait()` and the future's callbacks
//    make the *current stream* wait for the copies; the host waits only for the CPU part,
//    which is inherent to a host algorithm (a stream cannot wait for a host value through
//    the device-generic API).
//  - Memory: device tensors are recorded on the side streams (the caching allocator does
//    not reuse them early); host buffers come from the accelerator's pinned allocator (so
//    the copies are asynchronous DMA; the caching host allocator keeps a buffer until its
//    copies finish) or from the group's shared-memory pool (the CPU algorithm reads it in
//    place, Note [Zero-copy operands] in shm_algos.h, but the memory is pageable, so the
//    copies are synchronous and the host waits for the last one before the block is
//    released). SMDDP_STAGING_MEMORY chooses; auto = pinned where the device has a pinned
//    allocator, else the pool.
//
// Note [Staging pipeline]
// A large all-reduce (and all_gather_into_tensor / reduce_scatter_tensor, chunked over each
// rank's part) is cut into chunks of SMDDP_STAGING_CHUNK_BYTES (plan_chunks): all
// device->host copies are queued at once, each followed by an event; then chunk i is
// reduced as soon as its event completes and its host->device copy is queued, so the copy of
// chunk i+1 overlaps the reduction of chunk i, and the copy back of chunk i overlaps the
// reduction of chunk i+1. Every chunk is its own numbered collective; its descriptor names the
// whole call and the chunk's place in it (Note [Chunks carry the whole call] in
// device_staging.cpp), so ranks that disagree on the call, or cut it into other chunks, fail
// the cross-rank check on every rank instead of mixing chunks. A zero-element call is one
// empty chunk, which still joins one collective (Note [Empty staged calls] there).
//
// CPU tensors take this same code when SMDDP_STAGE_CPU=1 (tests): "streams" are no-ops, the
// copies are memcpys, and each step is appended to a trace the tests read back.
//
// Note [Staging timeline]
// With SMDDP_TIMELINE=1 (Note [Timeline] in timeline.h) a group also records where each
// staged call's time goes, on a timeline of its own (Stager::take_timeline; `_staging_timeline()`
// in Python). A span's seq is the call's number among the group's staged calls, counted at
// issue, so one call has one number on every rank. The phases, in the order they happen:
//   issue                    the caller's thread, from the collective's entry (the op built,
//                            the issue event recorded) to the moment its work is queued;
//   queued                   from then until the executor starts it: the thread hand-off;
//   run (caller's thread),   the executor's part, in the thread that ran it: the caller's
//   run (pool thread)        when its wait() took the work first (Note [Waiting runs the
//                            work] in scheduler.h), else a pool thread. Inside it:
//     host buffers           allocating a host buffer, with its bytes (the mirrors of the
//                            whole-message collectives allocate theirs during the issue);
//     d2h queue              queueing one chunk's device->host copy (one mirror's for the
//                            whole-message collectives), per chunk, all before any wait;
//     issue event wait       the host waits until the caller's stream has reached the issue
//                            event. Recorded only with the timeline on: without it the host
//                            waits for that inside the first d2h wait. The copies are queued
//                            before it, so the device's schedule is the same either way;
//     d2h wait               the host waits for one chunk's copy to land, per chunk;
//     host collective        the CPU collective on the host buffer, per chunk (the
//                            whole-message collectives: once, on every mirror);
//     h2d queue              queueing one chunk's host->device copy, per chunk;
//     copies wait            pageable host memory only: the host waits for every copy;
//   complete                 marking the work complete (the device future's event, its
//                            callbacks), in the thread that ran it;
//   wait                     the caller's Work.wait(), its first call only;
//   call                     from the collective's entry to the end of that wait.
// Each span carries the bytes it moved or reduced (0: not counted). With CPU tensors
// (SMDDP_STAGE_CPU=1) streams and events are no-ops: a d2h queue is the copy itself and the
// event waits are empty spans; the phases and their order are those of a device, which is what
// the CPU tests check (tests/distributed/test_smddp_staging.py). `bench gpu --timeline`
// prints one call's phases per rank; docs/gpu.md says what each hypothesis about the fixed
// cost of a call would look like there.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "smddp/common/settings.h"
#include "smddp/common/timeline.h"

namespace smddp {

class Communicator;
class ShmPool;
struct Reduction;
struct OpCtx;

struct ChunkRange {
  int64_t begin = 0;
  int64_t count = 0;
};

// [0, numel) in chunks of `chunk_elems` (the last one shorter); one empty chunk for numel == 0
// (Note [Empty staged calls] in device_staging.cpp).
std::vector<ChunkRange> plan_chunks(int64_t numel, int64_t chunk_elems);

// Note [Outputs that share memory] in op_helpers.h: `dst` and `src` narrowed to the last index
// along every dimension where `dst` repeats one location (stride 0, size > 1), so a copy from
// `src` into `dst` writes each location once, with the value an element-by-element write
// leaves there; both as they are when `dst` has no such dimension. The plain path's copy_back
// and the staging copies out both copy through it.
std::pair<at::Tensor, at::Tensor> distinct_parts(const at::Tensor& dst, const at::Tensor& src);

class Stager;

// One staged collective: its device, the caller's issue event, the host mirrors of its
// device tensors, and the copies between them. Built on the caller's thread, run by the
// executor.
class StagedOp {
 public:
  StagedOp(Stager& stager, c10::Device device);

  c10::Device device() const { return device_; }
  bool on_device() const { return !device_.is_cpu(); }
  // A host tensor shaped like `t` whose contents are copied from `t` before the collective
  // (`in`) and into `t` after it (`out`).
  at::Tensor mirror(const at::Tensor& t, bool in, bool out);
  std::vector<at::Tensor> mirror(const std::vector<at::Tensor>& ts, bool in, bool out);
  // The device tensors whose mirrors are `hosts` (a host tensor that is no mirror is kept):
  // the work's outputs are the caller's tensors, not their mirrors.
  std::vector<at::Tensor> device_of(const std::vector<at::Tensor>& hosts) const;

  // Device->host copies of every `in` mirror; returns once they are in host memory.
  void copy_in();
  // Host->device copies of every `out` mirror (queued; see Note [Device staging]).
  void copy_out();
  // The pipelined in-place all-reduce of contiguous `t` (Note [Staging pipeline]).
  void allreduce(Communicator& comm, const at::Tensor& t, const Reduction& red, const OpCtx& ctx);
  // The pipelined all_gather_into_tensor and reduce_scatter_tensor of contiguous tensors.
  void allgather(Communicator& comm, const at::Tensor& input, const at::Tensor& output,
                 const OpCtx& ctx);
  void reduce_scatter(Communicator& comm, const at::Tensor& input, const at::Tensor& output,
                      const Reduction& red, const OpCtx& ctx);
  // The stream the work's completion event goes on (nullopt for CPU tensors).
  std::optional<c10::Stream> completion_stream() const;
  // copy_in already ran on the caller's thread (eager sends).
  void set_copied_in() { copied_in_ = true; }
  bool copied_in() const { return copied_in_; }

  // Note [Staging timeline]: this call's number, and when it was issued (0: not recorded).
  uint64_t call() const { return call_; }
  int64_t issued_ns() const { return issued_ns_; }
  // The caller's thread is about to queue the work: the end of the issue.
  void queued();
  // The executor's part: copy_in, `collective` (the CPU collective on the mirrors, or one of
  // the pipelines above, which record their own chunks), copy_out.
  void run(const std::function<void()>& collective);

 private:
  struct Mirror {
    at::Tensor dev, host;
    bool in, out;
  };
  at::Tensor host_like(const at::Tensor& t);
  int64_t chunk_elems(const at::Tensor& t) const;
  // in_unit, out_unit: bytes copied in and out per element of a chunk (the timeline's bytes).
  template <typename In, typename Run, typename Out>
  void pipeline(const std::vector<ChunkRange>& chunks, const char* step, int64_t in_unit,
                int64_t out_unit, In&& in, Run&& run, Out&& out);
  void copy(const at::Tensor& dst, const at::Tensor& src, const c10::Stream& s);
  void record_use(const at::Tensor& dev);
  void finish_copies();       // after an error or before pageable buffers are released
  void order_side_streams();  // once per op, before its first copy (device tensors only)
  void trace(const std::string& step);
  Timeline& timeline() const;
  // The host waits for the caller's stream to reach the issue event, only while the
  // timeline records (Note [Staging timeline]).
  void wait_issue_event();

  Stager& stager_;
  c10::Device device_;
  const uint64_t call_;
  const std::thread::id issuer_ = std::this_thread::get_id();
  int64_t issued_ns_ = 0, queued_ns_ = 0;
  std::optional<c10::Event> issued_;  // on the caller's current stream
  std::optional<c10::Stream> d2h_, h2d_;
  std::vector<Mirror> mirrors_;
  // Some host buffer is not pinned: the host waits for the copies before it is released
  // (Note [Device staging]). Set by host_like; pinned buffers leave it false, since the caching
  // host allocator keeps them until their copies finish (Note [Pinned calls do not wait]).
  bool pageable_ = false;
  bool copied_in_ = false;
  bool ordered_ = false;  // order_side_streams ran
};

// The per-group state of staging: settings, side streams per device, the trace.
class Stager {
 public:
  Stager(const Settings& settings, std::shared_ptr<ShmPool> pool);

  // Whether a collective on `tensors` is staged: any of them on a device (they must then
  // all be on that one device), or CPU tensors with SMDDP_STAGE_CPU=1. Returns the op with
  // the caller's issue event recorded, or nullptr for the plain CPU path.
  std::shared_ptr<StagedOp> begin(const std::vector<const at::Tensor*>& tensors,
                                  const char* collective);
  int64_t chunk_bytes() const { return chunk_bytes_; }
  // Steps of staged CPU collectives since the last call (SMDDP_STAGE_CPU=1 only).
  std::vector<std::string> take_trace();
  // The phases of staged calls (Note [Staging timeline]); the works record into it too, and
  // may outlive the group.
  const std::shared_ptr<Timeline>& timeline() const { return timeline_; }
  std::vector<Timeline::Span> take_timeline() { return timeline_->take(); }

 private:
  friend class StagedOp;
  std::pair<c10::Stream, c10::Stream> streams(c10::Device device);
  void trace(const std::string& step);

  const bool stage_cpu_;
  const int64_t chunk_bytes_;
  const std::string memory_;  // "auto", "pinned" or "pool"
  // Whether this torch has an accelerator, so a pinned host allocator, at all (host_like).
  const bool has_accelerator_;
  std::shared_ptr<ShmPool> pool_;
  std::shared_ptr<Timeline> timeline_ = std::make_shared<Timeline>();
  std::atomic<uint64_t> calls_{0};  // staged calls issued: Note [Staging timeline]
  std::mutex mu_;
  std::map<std::pair<int, int>, std::pair<c10::Stream, c10::Stream>> streams_;  // (type, index)
  std::vector<std::string> trace_;
};

}  // namespace smddp
