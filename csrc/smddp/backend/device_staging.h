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
//  - Run (the executor, Note [Execution order] in work.h): device->host copies are queued on
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
// reduction of chunk i+1. Every chunk is its own numbered collective with its own count
// (ranks with different chunk sizes fail the cross-rank check instead of mixing chunks).
//
// CPU tensors take this same code when SMDDP_STAGE_CPU=1 (tests): "streams" are no-ops, the
// copies are memcpys, and each step is appended to a trace the tests read back.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "smddp/common/settings.h"

namespace smddp {

class Communicator;
class ShmPool;
struct Reduction;
struct OpCtx;

struct ChunkRange {
  int64_t begin = 0;
  int64_t count = 0;
};

// [0, numel) in chunks of `chunk_elems` (the last one shorter); none for numel == 0.
std::vector<ChunkRange> plan_chunks(int64_t numel, int64_t chunk_elems);

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

 private:
  struct Mirror {
    at::Tensor dev, host;
    bool in, out;
  };
  at::Tensor host_like(const at::Tensor& t);
  int64_t chunk_elems(const at::Tensor& t) const;
  template <typename In, typename Run, typename Out>
  void pipeline(const std::vector<ChunkRange>& chunks, const char* step, In&& in, Run&& run,
                Out&& out);
  void copy(const at::Tensor& dst, const at::Tensor& src, const c10::Stream& s);
  void record_use(const at::Tensor& dev);
  void finish_copies();  // after an error or before pageable buffers are released
  void trace(const std::string& step);

  Stager& stager_;
  c10::Device device_;
  std::optional<c10::Event> issued_;  // on the caller's current stream
  std::optional<c10::Stream> d2h_, h2d_;
  std::vector<Mirror> mirrors_;
  bool pageable_ = true;  // host buffers not pinned: wait for copies before release
  bool copied_in_ = false;
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

 private:
  friend class StagedOp;
  std::pair<c10::Stream, c10::Stream> streams(c10::Device device);
  void trace(const std::string& step);

  const bool stage_cpu_;
  const int64_t chunk_bytes_;
  const std::string memory_;  // "auto", "pinned" or "pool"
  std::shared_ptr<ShmPool> pool_;
  std::mutex mu_;
  std::map<std::pair<int, int>, std::pair<c10::Stream, c10::Stream>> streams_;  // (type, index)
  std::vector<std::string> trace_;
};

}  // namespace smddp
