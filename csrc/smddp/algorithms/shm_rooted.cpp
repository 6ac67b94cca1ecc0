#include "smddp/algorithms/shm_rooted.h"

#include <algorithm>
#include <cstring>

#include "smddp/algorithms/kernels.h"
#include "smddp/algorithms/shm_algos.h"
#include "smddp/algorithms/shm_copy.h"

namespace smddp {
namespace shm {
namespace {

// Bytes [o, o + c) of a part of `len` bytes, clipped to it.
size_t piece_len(size_t len, size_t o, size_t c) { return o >= len ? 0 : std::min(c, len - o); }

void copy_in(void* dst, const void* src, size_t n, const Reduction& red) {
  if (red.op == RedOp::PREMUL_SUM && red.premul != 1.0) {
    scale_copy(red.dtype, dst, src, n, red.premul);
  } else {
    std::memcpy(dst, src, n * dtype_size(red.dtype));
  }
}

size_t max_len(const std::vector<size_t>& lens) {
  size_t m = 0;
  for (size_t l : lens) m = std::max(m, l);
  return m;
}

size_t total_len(const std::vector<size_t>& lens) {
  size_t t = 0;
  for (size_t l : lens) t += l;
  return t;
}

}  // namespace

void gather(ShmComm& c, const void* in, const std::vector<size_t>& lens,
            const std::vector<char*>& dst, int root, const OpCtx& ctx) {
  const int n = c.size(), me = c.rank();
  const char* src = static_cast<const char*>(in);
  const size_t chunk = c.chunk_bytes(), longest = max_len(lens);
  const bool stream = me == root && c.stream_output(total_len(lens));
  if (me == root && lens[me] && src != dst[me]) copy_out(dst[me], src, lens[me], stream);
  bool first = true;
  for (size_t o = 0; o < longest || first; o += chunk) {
    uint64_t s = c.begin_step(ctx, first);
    if (me != root && lens[me]) {
      const size_t len = piece_len(lens[me], o, chunk);
      std::memcpy(c.mine(s, 0, len), src + o, len);
    }
    c.post(s, 1);
    if (first) c.wait_all(s, 1, ctx);  // every rank checks every descriptor once
    first = false;
    if (me == root) {
      for (int k = 1; k < n; ++k) {
        int i = (me + k) % n;
        c.wait_one(i, s, 1, ctx);
        copy_out(dst[i] + o, c.peer(i, s), piece_len(lens[i], o, chunk), stream);
      }
    }
    c.end_step(s);
  }
}

void scatter(ShmComm& c, const std::vector<const char*>& src, const std::vector<size_t>& lens,
             void* out, int root, const OpCtx& ctx) {
  const int n = c.size(), me = c.rank();
  char* dst = static_cast<char*>(out);
  // One chunk of every peer's part per step, in slots of the root's buffer, of at least a
  // cache line each: Note [Step buffer minimum] in shm_algos.h makes room for them.
  SMDDP_CHECK(c.buffer_bytes() / n >= kScatterSlotMin, "smddp: ", ctx.describe(),
              ": a step buffer of ", c.buffer_bytes(), " bytes cannot hold a ", kScatterSlotMin,
              "-byte slot for each of ", n,
              " local ranks (a bug: group creation should have refused this "
              "SMDDP_BUFFER_BYTES)");
  const size_t slot = std::min(c.buffer_bytes() / n, c.chunk_bytes()) & ~(kScatterSlotMin - 1);
  const size_t longest = max_len(lens);
  const bool stream = c.stream_output(lens[me]);
  if (me == root && lens[me] && src[me] != dst) copy_out(dst, src[me], lens[me], stream);
  bool first = true;
  for (size_t o = 0; o < longest || first; o += slot) {
    uint64_t s = c.begin_step(ctx, first);
    if (me == root) {
      for (int i = 0; i < n; ++i) {
        if (i == me || !lens[i]) continue;
        const size_t len = piece_len(lens[i], o, slot);
        std::memcpy(c.mine(s, i * slot, len), src[i] + o, len);
      }
    }
    c.post(s, 1);
    if (first) c.wait_all(s, 1, ctx);
    first = false;
    if (me != root) {
      c.wait_one(root, s, 1, ctx);
      copy_out(dst + o, c.peer(root, s) + me * slot, piece_len(lens[me], o, slot), stream);
    }
    c.end_step(s);
  }
}

void reduce(ShmComm& c, void* data, size_t count, const Reduction& red, int root, const OpCtx& ctx,
            size_t oneshot_bytes) {
  const int n = c.size(), me = c.rank();
  const size_t esz = dtype_size(red.dtype);
  char* buf = static_cast<char*>(data);
  std::vector<const void*> srcs(n);
  if (count * esz <= std::min(oneshot_bytes, c.buffer_bytes())) {
    uint64_t s = c.begin_step(ctx, true);
    copy_in(c.mine(s, 0, count * esz), buf, count, red);
    c.post(s, 1);
    c.wait_all(s, 1, ctx);
    if (me == root) {
      for (int i = 0; i < n; ++i) srcs[i] = c.peer(i, s);
      smddp::reduce(red.dtype, red.dtype, buf, srcs.data(), n, count, red, true);
    }
    c.end_step(s);
    return;
  }
  size_t chunk = c.chunk_bytes() / esz;
  chunk = std::max<size_t>(chunk & ~static_cast<size_t>(64 / esz - 1), 1);
  const bool stream = me == root && c.stream_output(count * esz);
  bool first = true;
  for (size_t o = 0; o < count || first; o += chunk) {
    const size_t m = std::min(chunk, count - o);
    uint64_t s = c.begin_step(ctx, first);
    first = false;
    copy_in(c.mine(s, 0, m * esz), buf + o * esz, m, red);
    c.post(s, 1);
    c.wait_all(s, 1, ctx);
    // My slice of the chunk, reduced in rank order in place in my buffer (as allreduce).
    Span mine = partition(m, n, me, 64 / esz);
    for (int i = 0; i < n; ++i) srcs[i] = c.peer(i, s) + mine.off * esz;
    smddp::reduce(red.dtype, red.dtype, c.mine(s) + mine.off * esz, srcs.data(), n, mine.len, red,
                  true);
    c.post(s, 2);
    if (me == root) {
      for (int k = 0; k < n; ++k) {
        int i = (me + k) % n;
        Span sl = partition(m, n, i, 64 / esz);
        if (i != me) c.wait_one(i, s, 2, ctx);
        copy_out(buf + (o + sl.off) * esz, c.peer(i, s) + sl.off * esz, sl.len * esz, stream);
      }
    }
    c.end_step(s);
    if (m == 0) break;
  }
}

}  // namespace shm
}  // namespace smddp
