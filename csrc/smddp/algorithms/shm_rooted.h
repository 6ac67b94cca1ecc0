// Rooted collectives (reduce, gather, scatter) over the shared-memory step protocol (Note
// [Step protocol] in shm.h).
//
// Note [Rooted collectives]
// Only the root's result is wanted, so only the root reads what every rank contributes:
//   gather  - every rank writes its chunk into its own buffer; the root copies each peer's
//             chunk out. The others write S/n and read nothing (an all-gather would have
//             every rank read S).
//   scatter - the root writes every peer's chunk into its buffer; each rank copies out its
//             own. The others read S/n (a broadcast of the concatenation would have every
//             rank read S).
//   reduce  - a reduce-scatter (each rank reduces its slice of the chunk, in rank order,
//             as in all_reduce) followed by a gather of the reduced slices by the root; the
//             other ranks skip the all-gather half of an all_reduce. Up to the one-shot
//             threshold, every rank posts its input and the root alone reduces.
// Non-root inputs are never written. As everywhere, the first step waits for every peer's
// phase 1 so every rank checks every peer's descriptor (Note [Mismatch detection]); the
// double buffering keeps a rank from reusing a buffer the root may still be reading.
// Across hosts (comm_rooted.cpp) the ranks of other hosts talk to the root over TCP
// directly and the root's host runs these.
#pragma once

#include <vector>

#include "smddp/transport/shm/shm.h"

namespace smddp {
namespace shm {

// Gathers local rank i's lens[i] bytes (this rank's from `in`) to dst[i] on local rank
// `root`; `dst` is used on the root only. The root's own part is copied unless `in`
// already is its place.
void gather(ShmComm& c, const void* in, const std::vector<size_t>& lens,
            const std::vector<char*>& dst, int root, const OpCtx& ctx);

// Scatters src[i] (lens[i] bytes; `src` read on the root only) to local rank i's `out`.
void scatter(ShmComm& c, const std::vector<const char*>& src, const std::vector<size_t>& lens,
             void* out, int root, const OpCtx& ctx);

// Reduces `count` elements of every local rank's `data` into the root's `data` (in place
// there; read-only elsewhere), combining in local rank order like allreduce.
void reduce(ShmComm& c, void* data, size_t count, const Reduction& red, int root, const OpCtx& ctx,
            size_t oneshot_bytes);

}  // namespace shm
}  // namespace smddp
