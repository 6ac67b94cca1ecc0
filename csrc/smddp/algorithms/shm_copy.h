// Copy helpers the shared-memory algorithms share (shm_algos.cpp, shm_alltoall.cpp,
// shm_rooted.cpp).
#pragma once

#include <algorithm>
#include <cstring>

#include "smddp/algorithms/kernels.h"
#include "smddp/common/common.h"

namespace smddp {
namespace shm {

// Copies into a user output; `stream`: see ShmComm::stream_output.
inline void copy_out(void* dst, const void* src, size_t bytes, bool stream) {
  if (stream) {
    copy_streaming(dst, src, bytes);
  } else if (bytes) {  // an empty tensor's pointer may be null, which memcpy must not get
    std::memcpy(dst, src, bytes);
  }
}

// Elements per chunk when `ways` pieces must share one buffer, rounded to 64 bytes.
inline size_t chunk_elems(size_t buffer_bytes, size_t ways, size_t esz) {
  size_t per = buffer_bytes / ways / esz;
  size_t aligned = per & ~static_cast<size_t>(64 / esz - 1);
  return aligned ? aligned : std::max<size_t>(per, 1);
}

// The piece [o, o + c) of a part, clipped to it (empty, at its end, past it).
inline Span clip(const Span& part, size_t o, size_t c) {
  if (o >= part.len) return {part.off + part.len, 0};
  return {part.off + o, std::min(c, part.len - o)};
}

}  // namespace shm
}  // namespace smddp
