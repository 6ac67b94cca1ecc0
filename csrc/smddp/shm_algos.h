// Collective algorithms over the shared-memory step protocol (Note [Step protocol] in
// shm.h). All functions are called by every local rank of the group with matching
// arguments; pointers are plain host memory (the caller staged non-contiguous tensors).
#pragma once

#include <vector>

#include "smddp/shm.h"

namespace smddp {
namespace shm {

// In-place allreduce when the whole group is on this host. Up to `oneshot_bytes`: every
// rank copies its input into its buffer and reduces all buffers in rank order (one sync).
// Larger: chunked reduce-scatter + all-gather through the buffers, so every chunk is
// reduced once by its owner and stays in cache between the phases (two syncs per chunk).
void allreduce(ShmComm& c, void* data, size_t count, const Reduction& red, const OpCtx& ctx,
               size_t oneshot_bytes);

// Reduce-scatter over N "parts" of `in` (element spans indexed by group rank). Local rank i
// reduces, over all local ranks in local order, the parts listed in owned[i], writing part
// owned[me][k] to dst[k]: the final result (`finish`, element type red.dtype) or a partial
// sum in acc_type(red.dtype) for a later inter-host stage.
void reduce_scatter(ShmComm& c, const void* in, const std::vector<Span>& parts,
                    const std::vector<std::vector<int>>& owned, const std::vector<void*>& dst,
                    const Reduction& red, bool finish, const OpCtx& ctx);

// All-gather over parts given in bytes: local rank i contributes the parts owned[i], this
// rank reading its own from src[k] for owned[me][k]; every rank writes every part p to
// out + parts[p].off. A source that already is its place in `out` is not copied.
void allgather(ShmComm& c, const std::vector<const void*>& src, void* out,
               const std::vector<Span>& parts, const std::vector<std::vector<int>>& owned,
               const OpCtx& ctx);

// Broadcast `bytes` from local rank `root`.
void broadcast(ShmComm& c, void* data, size_t bytes, int root, const OpCtx& ctx);

void barrier(ShmComm& c, const OpCtx& ctx);

// All-to-all with byte spans: send[j] goes to local rank j, recv[j] comes from it. Split
// sizes are exchanged first and checked for consistency on every rank.
void alltoall(ShmComm& c, const void* in, const std::vector<Span>& send, void* out,
              const std::vector<Span>& recv, const OpCtx& ctx);

}  // namespace shm
}  // namespace smddp
