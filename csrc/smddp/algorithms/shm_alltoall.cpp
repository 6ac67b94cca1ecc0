// All-to-all over the shared-memory step protocol (declared in shm_algos.h).
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "smddp/algorithms/shm_algos.h"
#include "smddp/algorithms/shm_copy.h"

namespace smddp {
namespace shm {

void alltoall(ShmComm& c, const void* in, const std::vector<Span>& send, void* out,
              const std::vector<Span>& recv, const OpCtx& ctx) {
  const int n = c.size(), me = c.rank();
  // Note [Step buffer minimum] in shm_algos.h makes room for the table of sizes.
  SMDDP_CHECK(c.buffer_bytes() / n >= kAlltoallTableEntry, "smddp: ", ctx.describe(),
              ": a step buffer of ", c.buffer_bytes(), " bytes cannot hold the split sizes of ", n,
              " local ranks (a bug: group creation should have refused this "
              "SMDDP_BUFFER_BYTES)");
  // Step 1: publish my send and receive sizes; every rank reads the whole matrix.
  uint64_t s = c.begin_step(ctx, true);
  auto* sizes = reinterpret_cast<uint64_t*>(c.mine(s, 0, 2 * n * sizeof(uint64_t)));
  for (int j = 0; j < n; ++j) {
    sizes[j] = send[j].len;
    sizes[n + j] = recv[j].len;
  }
  c.post(s, 1);
  c.wait_all(s, 1, ctx);
  std::vector<uint64_t> matrix(static_cast<size_t>(n) * n);  // matrix[i * n + j]: i sends to j
  for (int i = 0; i < n; ++i) {
    auto* ps = reinterpret_cast<const uint64_t*>(c.peer(i, s));
    for (int j = 0; j < n; ++j) matrix[i * n + j] = ps[j];
  }
  std::string problem;
  for (int i = 0; i < n && problem.empty(); ++i) {
    auto* ps = reinterpret_cast<const uint64_t*>(c.peer(i, s));
    for (int j = 0; j < n; ++j) {
      if (ps[n + j] != matrix[j * n + i]) {  // i expects from j what j sends to i
        problem = "rank " + std::to_string(c.group_rank(i)) + " expects " +
                  std::to_string(ps[n + j]) + " bytes from rank " +
                  std::to_string(c.group_rank(j)) + ", which sends it " +
                  std::to_string(matrix[j * n + i]);
        break;
      }
    }
  }
  c.end_step(s);
  if (!problem.empty()) {
    throw CommError("smddp: " + ctx.describe() + " on group '" + c.group_name() +
                    "': input and output split sizes do not match across ranks: " + problem +
                    " (rank i's output split j must equal rank j's input split i)");
  }
  const size_t region = chunk_elems(c.buffer_bytes(), n, 1);
  uint64_t most = 0;
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (i != j) most = std::max(most, matrix[i * n + j]);
    }
  }
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  size_t total = 0;
  for (const Span& r : recv) total += r.len;
  const bool stream = c.stream_output(total);
  if (recv[me].len) std::memmove(dst + recv[me].off, src + send[me].off, recv[me].len);
  // Region j of my buffer carries the next piece of what I send to local rank j.
  for (uint64_t o = 0; o < most; o += region) {
    s = c.begin_step(ctx, false);
    for (int j = 0; j < n; ++j) {
      Span piece = clip(send[j], o, region);
      if (j != me && piece.len)
        std::memcpy(c.mine(s, j * region, piece.len), src + piece.off, piece.len);
    }
    c.post(s, 1);
    for (int step = 1; step < n; ++step) {
      int i = (me + step) % n;
      Span piece = clip(recv[i], o, region);
      if (o >= matrix[i * n + me] && o > 0) continue;
      c.wait_one(i, s, 1, ctx);
      if (piece.len) copy_out(dst + piece.off, c.peer(i, s) + me * region, piece.len, stream);
    }
    c.end_step(s);
  }
}

}  // namespace shm
}  // namespace smddp
