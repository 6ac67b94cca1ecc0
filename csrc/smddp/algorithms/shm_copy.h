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

// Elements per chunk when `ways` pieces must share one buffer, rounded to 64 bytes where
// the buffer has room for that.
inline size_t chunk_elems(size_t buffer_bytes, size_t ways, size_t esz) {
  size_t per = buffer_bytes / ways / esz;
  // Note [Step buffer minimum] in shm_algos.h: group creation makes room for an element of
  // each piece; one element anyway would put the last pieces past the buffer's end.
  SMDDP_CHECK(per > 0, "smddp: a step buffer of ", buffer_bytes, " bytes cannot hold ", ways,
              " pieces of ", esz,
              "-byte elements (a bug: group creation should have refused this "
              "SMDDP_BUFFER_BYTES)");
  size_t aligned = per & ~static_cast<size_t>(64 / esz - 1);
  return aligned ? aligned : per;
}

// The piece [o, o + c) of a part, clipped to it (empty, at its end, past it).
inline Span clip(const Span& part, size_t o, size_t c) {
  if (o >= part.len) return {part.off + part.len, 0};
  return {part.off + o, std::min(c, part.len - o)};
}

}  // namespace shm
}  // namespace smddp
