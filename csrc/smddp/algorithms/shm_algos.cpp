#include "smddp/algorithms/shm_algos.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>

#include "smddp/algorithms/kernels.h"
#include "smddp/algorithms/shm_copy.h"

namespace smddp {
namespace shm {
namespace {

// Copies n elements into a staging buffer, applying the PREMUL_SUM factor if any.
void copy_in(void* dst, const void* src, size_t n, const Reduction& red) {
  if (red.op == RedOp::PREMUL_SUM && red.premul != 1.0) {
    scale_copy(red.dtype, dst, src, n, red.premul);
  } else if (n) {  // an empty tensor's pointer may be null, which memcpy must not get
    std::memcpy(dst, src, n * dtype_size(red.dtype));
  }
}

// Where the parts end: the extent of the buffer they lie in, in their unit.
size_t extent(const std::vector<Span>& parts) {
  size_t end = 0;
  for (const Span& p : parts) end = std::max(end, p.off + p.len);
  return end;
}

// Whether [off, off + len) lies in local rank i's pool (Note [Read from the pool]: a peer's
// offsets come from shared memory, and a wrong one must not send a read astray).
bool in_pool(const ShmComm& c, int i, int64_t off, size_t len) {
  const size_t cap = c.pool_bytes();
  return c.pool_base(i) && off >= 0 && static_cast<size_t>(off) <= cap &&
         len <= cap - static_cast<size_t>(off);
}

}  // namespace

size_t min_buffer_bytes(size_t local_size, size_t group_size) {
  // Note [Step buffer minimum]; the all-gather steps' N bytes are within 8 N.
  return std::max({kScatterSlotMin * local_size, kAlltoallTableEntry * local_size,
                   kLargestElement * group_size});
}

void allreduce(ShmComm& c, void* data, size_t count, const Reduction& red, const OpCtx& ctx,
               size_t oneshot_bytes) {
  const int n = c.size(), me = c.rank();
  const size_t esz = dtype_size(red.dtype);
  char* out = static_cast<char*>(data);
  std::vector<const void*> srcs(n);
  if (count * esz <= std::min(oneshot_bytes, c.buffer_bytes())) {
    uint64_t s = c.begin_step(ctx, true);
    copy_in(c.mine(s, 0, count * esz), out, count, red);
    c.post(s, 1);
    c.wait_all(s, 1, ctx);
    for (int i = 0; i < n; ++i) srcs[i] = c.peer(i, s);
    reduce(red.dtype, red.dtype, out, srcs.data(), n, count, red, true);
    c.end_step(s);
    return;
  }
  const size_t chunk = chunk_elems(c.chunk_bytes(), 1, esz);
  const bool stream = c.stream_output(count * esz);
  // Note [My slice stays home] in shm_algos.h.
  const bool stage_mine = red.op == RedOp::PREMUL_SUM && red.premul != 1.0;
  bool first = true;
  for (size_t o = 0; o < count || first; o += chunk) {
    size_t m = std::min(chunk, count - o);
    uint64_t s = c.begin_step(ctx, first);
    first = false;
    Span mine = partition(m, n, me, 64 / esz);
    if (stage_mine) {
      copy_in(c.mine(s, 0, m * esz), out + o * esz, m, red);
    } else {
      copy_in(c.mine(s, 0, mine.off * esz), out + o * esz, mine.off, red);
      const size_t after = mine.off + mine.len;
      copy_in(c.mine(s, after * esz, (m - after) * esz), out + (o + after) * esz, m - after, red);
    }
    c.post(s, 1);
    c.wait_all(s, 1, ctx);
    // Reduce my slice of the chunk, in rank order, in place in my own buffer.
    for (int i = 0; i < n; ++i) srcs[i] = c.peer(i, s) + mine.off * esz;
    if (!stage_mine) srcs[me] = out + (o + mine.off) * esz;
    reduce(red.dtype, red.dtype, c.mine(s, mine.off * esz, mine.len * esz), srcs.data(), n,
           mine.len, red, true);
    c.post(s, 2);
    // Gather the reduced slices, starting after my own rank to spread the reads.
    for (int k = 0; k < n; ++k) {
      int i = (me + k) % n;
      Span sl = partition(m, n, i, 64 / esz);
      if (i != me) c.wait_one(i, s, 2, ctx);
      copy_out(out + (o + sl.off) * esz, c.peer(i, s) + sl.off * esz, sl.len * esz, stream);
    }
    c.end_step(s);
    if (m == 0) break;
  }
}

StepPhases::StepPhases(std::vector<int> phase_of, const std::vector<Span>& parts,
                       const std::vector<std::vector<int>>& groups, const char* collective)
    : phase_of_(std::move(phase_of)) {
  // No groups: one group of every part, in order.
  const size_t n_groups = groups.empty() ? 1 : groups.size();
  auto group_size = [&](size_t g) { return groups.empty() ? parts.size() : groups[g].size(); };
  auto part = [&](size_t g, size_t k) { return groups.empty() ? k : size_t(groups[g][k]); };
  if (phase_of_.empty()) {
    size_t ways = 0, maxlen = 0;
    for (size_t g = 0; g < n_groups; ++g) ways = std::max(ways, group_size(g));
    for (const Span& p : parts) maxlen = std::max(maxlen, p.len);
    only_ = {ways, maxlen};
    return;
  }
  SMDDP_CHECK(phase_of_.size() == parts.size(), "smddp: ", collective,
              " steps got phases for another number of parts (a bug)");
  slot_.resize(n_groups);
  for (size_t g = 0; g < n_groups; ++g) {
    std::vector<size_t> taken;  // per phase: the slots this group's parts took so far
    for (size_t k = 0; k < group_size(g); ++k) {
      const size_t p = part(g, k);
      SMDDP_CHECK(phase_of_[p] >= 0, "smddp: a ", collective, " phase is negative (a bug)");
      const size_t ph = static_cast<size_t>(phase_of_[p]);
      if (ph >= phases_.size()) phases_.resize(ph + 1);
      if (ph >= taken.size()) taken.resize(ph + 1, 0);
      slot_[g].push_back(taken[ph]++);
      Phase& at = phases_[ph];
      at.ways = std::max(at.ways, taken[ph]);
      at.maxlen = std::max(at.maxlen, parts[p].len);
    }
  }
  if (phases_.empty()) phases_.resize(1);  // no part at all: one empty phase
}

size_t StepPhases::first() const {
  size_t ph = 0;
  while (ph + 1 < count() && maxlen(ph) == 0) ++ph;
  return ph;
}

size_t StepPhases::after(size_t ph) const {
  ++ph;
  while (ph < count() && maxlen(ph) == 0) ++ph;
  return ph;
}

ReduceScatterSteps::ReduceScatterSteps(ShmComm& c, const void* in, const std::vector<Span>& parts,
                                       const std::vector<std::vector<int>>& owned,
                                       const std::vector<void*>& dst, const Reduction& red,
                                       bool finish, const OpCtx& ctx, std::vector<int> phase_of)
    : c_(c),
      src_(static_cast<const char*>(in)),
      parts_(parts),
      owned_(owned),
      dst_(dst),
      red_(red),
      finish_(finish),
      ctx_(ctx),
      esz_(dtype_size(red.dtype)),
      out_t_(owned[c.rank()].size(), finish ? red.dtype : acc_type(red.dtype)),
      srcs_(c.size()),
      staged_(parts.size(), 0),
      phases_(std::move(phase_of), parts, {}, "reduce-scatter"),
      peer_in_(c.size(), -1) {
  const bool scaled = red.op == RedOp::PREMUL_SUM && red.premul != 1.0;
  // Note [Read from the pool]: an input in my pool is read there by the peers.
  const size_t bytes = extent(parts) * esz_;
  if (!scaled && c.pool() && c.size() > 1 && bytes >= kZeroCopyMinBytes) {
    pool_in_ = c.pool()->offset_of(in, bytes);
  }
  // Note [My slice stays home] in shm_algos.h: a part only this rank reduces stays in its
  // input, unless the copy in is where a PREMUL_SUM's factor is applied.
  for (int i = 0; i < c.size() && pool_in_ < 0; ++i) {
    for (int p : owned[i]) {
      if (i != c.rank() || scaled) staged_[p] = 1;
    }
  }
  enter(phases_.first());
}

void ReduceScatterSteps::enter(size_t ph) {
  if (ph >= phases_.count()) {
    done_ = true;
    return;
  }
  phase_ = ph;
  next_ = 0;
  maxlen_ = phases_.maxlen(ph);
  // Each step carries one chunk of every part of its phase: bounded by the buffer, and by
  // the pipeline chunk per part so the step's reads stay in cache.
  chunk_ = std::min(chunk_elems(c_.buffer_bytes(), phases_.ways(ph), esz_),
                    chunk_elems(c_.chunk_bytes(), 1, esz_));
}

void ReduceScatterSteps::set_out_type(size_t k, DType t) {
  SMDDP_CHECK(!done_ && first_ && k < out_t_.size(),
              "smddp: a reduce-scatter's output type set after its first step (a bug)");
  out_t_[k] = t;
}

size_t ReduceScatterSteps::ready(int p) const {
  if (done_) return SIZE_MAX;
  const size_t ph = phase(static_cast<size_t>(p));
  if (ph < phase_) return SIZE_MAX;
  return ph == phase_ ? next_ : 0;
}

void ReduceScatterSteps::step() {
  if (done_) return;
  const int n = c_.size(), me = c_.rank();
  const size_t o = next_;
  uint64_t s = c_.begin_step(ctx_, first_);
  const bool first_step = first_;
  first_ = false;
  if (first_step) c_.my_sources(ctx_).reduce_in = pool_in_;  // Note [Read from the pool]
  // My buffer holds the same chunk of every part of the phase, each at its slot.
  for (size_t p = 0; p < parts_.size(); ++p) {
    if (!staged_[p] || phase(p) != phase_) continue;
    Span piece = clip(parts_[p], o, chunk_);
    copy_in(c_.mine(s, slot(p) * chunk_ * esz_, piece.len * esz_), src_ + piece.off * esz_,
            piece.len, red_);
  }
  c_.post(s, 1);
  c_.wait_all(s, 1, ctx_);
  if (first_step) learn_sources();
  for (size_t k = 0; k < owned_[me].size(); ++k) {
    const size_t p = static_cast<size_t>(owned_[me][k]);
    if (phase(p) != phase_) continue;
    Span piece = clip(parts_[p], o, chunk_);
    for (int i = 0; i < n; ++i) {
      srcs_[i] = peer_in_[i] >= 0 ? c_.pool_base(i) + peer_in_[i] + piece.off * esz_
                                  : c_.peer(i, s) + slot(p) * chunk_ * esz_;
    }
    if (!staged_[p]) srcs_[me] = src_ + piece.off * esz_;
    const DType out = out_t_[k];
    reduce(red_.dtype, out, static_cast<char*>(dst_[k]) + o * dtype_size(out), srcs_.data(), n,
           piece.len, red_, finish_);
  }
  for (int i = 0; i < n; ++i) {
    if (i == me || peer_in_[i] < 0) continue;
    // Note [Read from the pool]: a peer that failed may have reused what was read. The fence
    // keeps the reads above before the flag's load (x86 keeps loads in order; Arm does not).
    std::atomic_thread_fence(std::memory_order_acquire);
    if (c_.peer_failed(i)) c_.check_peer(i, ctx_, "its reduce-scatter input");  // throws
    c_.count_pool_read(false);
  }
  c_.end_step(s);
  last_s_ = s;
  next_ = o + chunk_;
  if (next_ < maxlen_) return;
  enter(phases_.after(phase_));
}

void ReduceScatterSteps::learn_sources() {
  const size_t bytes = extent(parts_) * esz_;
  for (int i = 0; i < c_.size(); ++i) {
    if (i == c_.rank()) continue;
    peer_in_[i] = c_.sources_of(i, ctx_).reduce_in;
    SMDDP_CHECK(peer_in_[i] == -1 || in_pool(c_, i, peer_in_[i], bytes),
                "smddp: a local peer published a reduce-scatter input outside its pool (a bug)");
  }
}

void ReduceScatterSteps::finish_reads() {
  if (pool_in_ >= 0 && last_s_) c_.wait_all(last_s_, 3, ctx_);
  last_s_ = 0;
}

void reduce_scatter(ShmComm& c, const void* in, const std::vector<Span>& parts,
                    const std::vector<std::vector<int>>& owned, const std::vector<void*>& dst,
                    const Reduction& red, bool finish, const OpCtx& ctx) {
  ReduceScatterSteps steps(c, in, parts, owned, dst, red, finish, ctx);
  while (!steps.done()) steps.step();
  steps.finish_reads();
}

AllGatherSteps::AllGatherSteps(ShmComm& c, std::vector<const void*> src, void* out,
                               const std::vector<Span>& parts,
                               const std::vector<std::vector<int>>& owned, const OpCtx& ctx,
                               std::vector<int> phase_of)
    : c_(c),
      src_(std::move(src)),
      out_(static_cast<char*>(out)),
      parts_(parts),
      owned_(owned),
      ctx_(ctx),
      ready_(src_.size(), 0),
      read_(c.size(), 0),
      phases_(std::move(phase_of), parts, owned, "all-gather"),
      peer_out_(c.size(), kUnknown),
      peer_own_(c.size(), kUnknown) {
  size_t total = 0;
  for (const Span& p : parts) total += p.len;
  stream_ = c.stream_output(total);
  choose_pool_sources();
  enter(phases_.first());
}

void AllGatherSteps::choose_pool_sources() {
  const ShmPool* pool = c_.pool().get();
  const size_t bytes = extent(parts_);
  if (!pool || c_.size() < 2 || bytes < kZeroCopyMinBytes) return;
  const int64_t out = pool->offset_of(out_, bytes);
  if (out < 0) return;
  int64_t own = -1;
  const int me = c_.rank();
  for (size_t k = 0; k < owned_[me].size(); ++k) {
    const int p = owned_[me][k];
    const Span& part = parts_[p];
    const char* at = static_cast<const char*>(src_[k]);
    const bool in_place = at == out_ + part.off || !part.len;
    if (p == c_.group_rank(me)) {
      own = in_place ? out + static_cast<int64_t>(part.off) : pool->offset_of(at, part.len);
      if (own < 0) return;
    } else if (!in_place) {
      return;  // another rank's part that is not in place: through the buffers
    }
  }
  pool_out_ = out;
  pool_own_ = own;
}

void AllGatherSteps::learn_sources(int i) {
  if (peer_out_[i] != kUnknown) return;
  const PoolSources& theirs = c_.sources_of(i, ctx_);
  peer_out_[i] = theirs.gather_out;
  peer_own_[i] = theirs.gather_own;
  if (peer_out_[i] < 0) return;
  // A peer's offsets come from shared memory: a wrong one must not send a read astray.
  const Span& own = parts_[c_.group_rank(i)];
  SMDDP_CHECK(in_pool(c_, i, peer_out_[i], extent(parts_)) &&
                  (peer_own_[i] == -1 || in_pool(c_, i, peer_own_[i], own.len)),
              "smddp: a local peer published all-gather sources outside its pool (a bug)");
}

const char* AllGatherSteps::peer_piece(int i, size_t k, size_t o) const {
  const int p = owned_[i][k];
  if (peer_out_[i] < 0) return c_.peer(i, s_) + phases_.slot(i, k) * chunk_;
  const Span& part = parts_[p];
  if (p == c_.group_rank(i)) {
    SMDDP_CHECK(peer_own_[i] >= 0, "smddp: a local peer's own part has no source (a bug)");
    return c_.pool_base(i) + peer_own_[i] + o;
  }
  return c_.pool_base(i) + peer_out_[i] + part.off + o;
}

void AllGatherSteps::finish() {
  advance(true);
  // Note [Read from the pool]: my parts were read where they lie; they may change once
  // every peer has ended my last step.
  if (pool_out_ >= 0 && last_s_) {
    c_.wait_all(last_s_, 3, ctx_);
    last_s_ = 0;
  }
}

void AllGatherSteps::enter(size_t ph) {
  if (ph >= phases_.count()) {
    done_ = true;
    return;
  }
  phase_ = ph;
  o_ = 0;
  maxlen_ = phases_.maxlen(ph);
  chunk_ = std::min(chunk_elems(c_.buffer_bytes(), phases_.ways(ph), 1), c_.chunk_bytes());
}

void AllGatherSteps::set_all_ready() {
  for (size_t k = 0; k < ready_.size(); ++k) ready_[k] = parts_[owned_[c_.rank()][k]].len;
}

bool AllGatherSteps::advance(bool wait) {
  const int n = c_.size(), me = c_.rank();
  // Where local rank i's k-th part sits in its step buffer, and whether it is in this phase.
  auto slot = [&](int i, size_t k) { return phases_.slot(i, k); };
  auto in_phase = [&](int i, size_t k) { return phases_.phase(owned_[i][k]) == phase_; };
  bool moved = false;
  while (!done_) {
    if (!s_) {
      // A step carries the pieces at offset o_ of every part of the phase; mine must be ready.
      for (size_t k = 0; k < owned_[me].size(); ++k) {
        if (!in_phase(me, k)) continue;
        const Span& p = parts_[owned_[me][k]];
        if (ready_[k] < std::min(p.len, o_ + chunk_)) {
          SMDDP_CHECK(!wait, "smddp: a shared-memory all-gather finished before its input (a bug)");
          on_peers_ = false;
          return moved;
        }
      }
      if (!wait && !c_.step_open(ctx_, first_)) {
        on_peers_ = true;
        return moved;
      }
      s_ = c_.begin_step(ctx_, first_);
      const bool first_step = first_;
      first_ = false;
      if (first_step) {
        PoolSources& mine = c_.my_sources(ctx_);
        mine.gather_out = pool_out_;
        mine.gather_own = pool_own_;
      }
      for (size_t k = 0; k < owned_[me].size() && pool_out_ < 0; ++k) {
        if (!in_phase(me, k)) continue;
        const Span piece = clip(parts_[owned_[me][k]], o_, chunk_);
        if (piece.len) {
          std::memcpy(c_.mine(s_, slot(me, k) * chunk_, piece.len),
                      static_cast<const char*>(src_[k]) + o_, piece.len);
        }
      }
      c_.post(s_, 1);
      std::fill(read_.begin(), read_.end(), 0);
      read_[me] = 1;
      moved = true;
    }
    int left = 0;
    for (int step = 1; step < n; ++step) {
      const int i = (me + step) % n;  // start after my own rank to spread the reads
      if (read_[i]) continue;
      if (wait) {
        c_.wait_one(i, s_, 1, ctx_);
      } else if (!c_.reached(i, s_, 1, ctx_)) {
        ++left;
        continue;
      }
      learn_sources(i);
      for (size_t k = 0; k < owned_[i].size(); ++k) {
        if (!in_phase(i, k)) continue;
        const Span piece = clip(parts_[owned_[i][k]], o_, chunk_);
        if (piece.len) copy_out(out_ + piece.off, peer_piece(i, k, o_), piece.len, stream_);
      }
      // Note [Read from the pool]: a peer that failed may have returned, and its caller
      // reused what was read (one that died cannot reuse it: the mapping stays).
      if (peer_out_[i] >= 0) {
        std::atomic_thread_fence(std::memory_order_acquire);  // as in ReduceScatterSteps::step
        if (c_.peer_failed(i)) c_.check_peer(i, ctx_, "its all-gather parts");  // throws
        c_.count_pool_read(true);
      }
      read_[i] = 1;
      moved = true;
    }
    if (left) {
      on_peers_ = true;
      return moved;
    }
    c_.end_step(s_);
    last_s_ = s_;
    s_ = 0;
    o_ += chunk_;
    if (o_ >= maxlen_) enter(phases_.after(phase_));  // one step at least, even with nothing
    if (!wait) return true;                           // one step per poll
  }
  return moved;
}

void allgather(ShmComm& c, const std::vector<const void*>& src, void* out,
               const std::vector<Span>& parts, const std::vector<std::vector<int>>& owned,
               const OpCtx& ctx) {
  const int me = c.rank();
  char* dst = static_cast<char*>(out);
  size_t total = 0;
  for (const Span& p : parts) total += p.len;
  const bool stream = c.stream_output(total);
  // My own parts go straight to their place (FSDP2 passes an input that already is it).
  for (size_t k = 0; k < owned[me].size(); ++k) {
    const Span& p = parts[owned[me][k]];
    if (src[k] != dst + p.off && p.len) copy_out(dst + p.off, src[k], p.len, stream);
  }
  AllGatherSteps steps(c, src, out, parts, owned, ctx);
  steps.set_all_ready();
  steps.finish();
}

namespace {

// Handshake of Note [Zero-copy operands]: publishes this rank's operand and returns the
// step with every rank's operand offset in `offsets`, or 0 (step already ended) when some
// operand is outside the pools.
uint64_t exchange_operands(ShmComm& c, const void* operand, size_t bytes, const OpCtx& ctx,
                           std::vector<int64_t>& offsets) {
  uint64_t s = c.begin_step(ctx, true);
  c.publish_operand(ctx, c.pool() ? c.pool()->offset_of(operand, bytes) : -1);
  c.post(s, 1);
  c.wait_all(s, 1, ctx);
  offsets.resize(c.size());
  for (int i = 0; i < c.size(); ++i) {
    offsets[i] = c.operand_of(i, ctx);
    if (offsets[i] < 0 || !c.pool_base(i)) {
      c.end_step(s);
      return 0;
    }
    // Note [Read from the pool]: the offset comes from shared memory, and the callers read
    // `bytes` from it, so one outside the peer's pool must not send those reads astray.
    SMDDP_CHECK(in_pool(c, i, offsets[i], bytes), "smddp: ", ctx.describe(), ": local rank ", i,
                " (group rank ", c.group_rank(i), ") published an operand of ", bytes,
                " bytes at offset ", offsets[i], " of its tensor pool, which holds ",
                c.pool_bytes(), " bytes (a bug: an operand in the pool lies wholly inside it; ",
                "please report it)");
  }
  return s;
}

// Phase 2 of the handshake step: done reading the peers' operands; wait until they are
// done reading mine.
void finish_reading(ShmComm& c, uint64_t s, const OpCtx& ctx) {
  c.post(s, 2);
  c.wait_all(s, 2, ctx);
  c.end_step(s);
}

}  // namespace

bool allgather_zero_copy(ShmComm& c, const void* in, void* out, size_t bytes, const OpCtx& ctx) {
  const int n = c.size(), me = c.rank();
  std::vector<int64_t> off;
  uint64_t s = exchange_operands(c, in, bytes, ctx, off);
  if (!s) return false;
  char* dst = static_cast<char*>(out);
  const bool stream = c.stream_output(bytes * n);
  if (in != dst + me * bytes) copy_out(dst + me * bytes, in, bytes, stream);
  for (int k = 1; k < n; ++k) {
    int i = (me + k) % n;  // start after my own rank to spread the reads
    copy_out(dst + i * bytes, c.pool_base(i) + off[i], bytes, stream);
  }
  finish_reading(c, s, ctx);
  return true;
}

bool reduce_scatter_zero_copy(ShmComm& c, const void* in, void* out, size_t count,
                              const Reduction& red, const OpCtx& ctx) {
  const int n = c.size(), me = c.rank();
  const size_t esz = dtype_size(red.dtype);
  std::vector<int64_t> off;
  uint64_t s = exchange_operands(c, in, count * n * esz, ctx, off);
  if (!s) return false;
  std::vector<const void*> srcs(n);
  for (int i = 0; i < n; ++i) srcs[i] = c.pool_base(i) + off[i] + me * count * esz;
  reduce(red.dtype, red.dtype, out, srcs.data(), n, count, red, true);
  finish_reading(c, s, ctx);
  return true;
}

void broadcast(ShmComm& c, void* data, size_t bytes, int root, const OpCtx& ctx) {
  char* buf = static_cast<char*>(data);
  const size_t chunk = c.chunk_bytes();
  const bool stream = c.stream_output(bytes);
  bool first = true;
  for (size_t o = 0; o < bytes || first; o += chunk) {
    size_t m = std::min(chunk, bytes - o);
    uint64_t s = c.begin_step(ctx, first);
    if (c.rank() == root && m) std::memcpy(c.mine(s, 0, m), buf + o, m);
    c.post(s, 1);
    if (first) c.wait_all(s, 1, ctx);  // every rank checks every descriptor once
    first = false;
    if (c.rank() != root) {
      c.wait_one(root, s, 1, ctx);
      copy_out(buf + o, c.peer(root, s), m, stream);
    }
    c.end_step(s);
    if (m == 0) break;
  }
}

void barrier(ShmComm& c, const OpCtx& ctx) {
  uint64_t s = c.begin_step(ctx, true);
  c.post(s, 1);
  c.wait_all(s, 1, ctx);
  c.end_step(s);
}

}  // namespace shm
}  // namespace smddp
