// Note [Device staging] and Note [Staging pipeline] in device_staging.h.
#include "smddp/backend/device_staging.h"

#include <ATen/DeviceAccelerator.h>
#include <ATen/MemoryOverlap.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "smddp/algorithms/comm.h"
#include "smddp/common/common.h"
#include "smddp/transport/shm/shm_pool.h"

namespace smddp {

// Note [Empty staged calls]
// A zero-element call is one empty chunk, not none: the plain path runs an empty collective
// for it, with its descriptor, and so must the pipeline. With no chunk it joined no
// collective at all, so a rank that passed an empty tensor where its peers passed elements
// returned at once, and its next call paired with theirs: a wrong result on that rank
// without an error, and a timeout on the others. Now its empty chunk meets their first
// chunk and the descriptors (count 0 against n) fail the cross-rank check on every rank.
std::vector<ChunkRange> plan_chunks(int64_t numel, int64_t chunk_elems) {
  TORCH_CHECK_VALUE(numel >= 0 && chunk_elems > 0, "smddp: plan_chunks(", numel, ", ", chunk_elems,
                    "): needs numel >= 0 and chunk_elems > 0");
  if (numel == 0) return {{0, 0}};
  std::vector<ChunkRange> out;
  for (int64_t b = 0; b < numel; b += std::min(chunk_elems, numel - b)) {
    out.push_back({b, std::min(chunk_elems, numel - b)});
  }
  return out;
}

std::pair<at::Tensor, at::Tensor> distinct_parts(const at::Tensor& dst, const at::Tensor& src) {
  if (at::has_internal_overlap(dst) != at::MemOverlap::Yes) return {dst, src};
  at::Tensor d = dst, s = src;
  for (int64_t k = 0; k < dst.dim(); ++k) {
    if (dst.stride(k) == 0 && dst.size(k) > 1) {
      d = d.narrow(k, dst.size(k) - 1, 1);
      s = s.narrow(k, dst.size(k) - 1, 1);
    }
  }
  return {d, s};
}

namespace {

uint64_t mix64(uint64_t x) {  // splitmix64's finalizer
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Note [Chunks carry the whole call]
// Every chunk of a pipelined call is its own numbered collective (Note [Staging pipeline]), and
// the cross-rank check compares one chunk's descriptor at a time. A chunk used to describe only
// itself (its count), so it matched any call of that size on another rank: rank 0's all_reduce
// of 2048 floats in two chunks of 1024 paired with two all_reduce calls of 1024 floats on rank
// 1, and both ranks returned mixed data without an error, where the plain path raises. So a
// chunk's descriptor keeps the whole call's (its count is the call's total, as in the plain
// path: ranks that disagree on the call fail at its first chunk), and where the chunk lies, its
// begin and length, is folded into `extra`, hashed as the name is: ranks that cut one call
// differently (another SMDDP_STAGING_CHUNK_BYTES) fail too instead of mixing chunks. A chunk
// that is the whole call adds nothing, so a call of one chunk has the plain path's descriptor.
OpCtx chunk_ctx(const OpCtx& call, const ChunkRange& c, int64_t numel) {
  OpCtx ctx = call;
  if (c.begin != 0 || c.count != numel) {
    ctx.desc.extra ^= mix64(mix64(static_cast<uint64_t>(c.begin)) ^ static_cast<uint64_t>(c.count));
  }
  return ctx;
}

}  // namespace

Stager::Stager(const Settings& settings, std::shared_ptr<ShmPool> pool)
    : stage_cpu_(settings.stage_cpu),
      chunk_bytes_(static_cast<int64_t>(settings.staging_chunk_bytes)),
      memory_(settings.staging_memory),
      has_accelerator_(at::getAccelerator(false).has_value()),
      pool_(std::move(pool)) {
  timeline_->enable(settings.timeline);
}

std::shared_ptr<StagedOp> Stager::begin(const std::vector<const at::Tensor*>& tensors,
                                        const char* collective) {
  std::optional<c10::Device> device;
  for (const at::Tensor* t : tensors) {
    if (!t->is_cpu()) {
      device = t->device();
      break;
    }
  }
  if (!device) {
    if (!stage_cpu_ || tensors.empty()) return nullptr;
    device = c10::Device(at::kCPU);
  }
  TORCH_CHECK_VALUE(device->is_cpu() || at::isAccelerator(device->type()), "smddp: ", collective,
                    " got a tensor on device ", *device,
                    "; smddp takes CPU tensors "
                    "and tensors of an accelerator (with streams and events), such as cuda");
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK_VALUE(t->device() == *device, "smddp: ", collective, " got tensors on ", *device,
                      " and on ", t->device(),
                      "; the tensors of one collective must "
                      "all be on one device");
    TORCH_CHECK_VALUE(t->layout() == at::kStrided, "smddp: ", collective, " got a ", t->layout(),
                      " tensor; only dense (strided) tensors are supported");
  }
  return std::make_shared<StagedOp>(*this, *device);
}

std::pair<c10::Stream, c10::Stream> Stager::streams(c10::Device device) {
  std::lock_guard<std::mutex> g(mu_);
  auto key = std::make_pair(static_cast<int>(device.type()), static_cast<int>(device.index()));
  auto it = streams_.find(key);
  if (it == streams_.end()) {
    c10::impl::VirtualGuardImpl impl(device.type());
    c10::Stream d2h = impl.getStreamFromGlobalPool(device);
    c10::Stream h2d = impl.getStreamFromGlobalPool(device);
    it = streams_.emplace(key, std::make_pair(d2h, h2d)).first;
  }
  return it->second;
}

void Stager::trace(const std::string& step) {
  std::lock_guard<std::mutex> g(mu_);
  trace_.push_back(step);
}

std::vector<std::string> Stager::take_trace() {
  std::lock_guard<std::mutex> g(mu_);
  return std::move(trace_);
}

StagedOp::StagedOp(Stager& stager, c10::Device device)
    : stager_(stager), device_(device), call_(stager.calls_.fetch_add(1)) {
  if (timeline().enabled()) issued_ns_ = Timeline::now_ns();
  if (on_device()) {
    if (device_.index() < 0) device_ = c10::Device(device_.type(), 0);
    auto s = stager_.streams(device_);
    d2h_ = s.first;
    h2d_ = s.second;
    c10::impl::VirtualGuardImpl impl(device_.type());
    issued_.emplace(device_.type());
    issued_->record(impl.getStream(device_));  // the caller's current stream, now
  }
  trace("issue");
}

void StagedOp::trace(const std::string& step) {
  if (!on_device()) stager_.trace(step);
}

Timeline& StagedOp::timeline() const { return *stager_.timeline_; }

void StagedOp::queued() {
  timeline().record(call_, "issue", issued_ns_);
  if (timeline().enabled()) queued_ns_ = Timeline::now_ns();
}

void StagedOp::run(const std::function<void()>& collective) {
  Timeline& tl = timeline();
  if (queued_ns_) tl.record(call_, "queued", queued_ns_);
  Timeline::Phase whole(
      tl, call_,
      std::this_thread::get_id() == issuer_ ? "run (caller's thread)" : "run (pool thread)");
  copy_in();
  if (mirrors_.empty()) {
    collective();  // a pipeline: its chunks are recorded one by one
  } else {
    int64_t bytes = 0;
    for (const Mirror& m : mirrors_) bytes += m.in ? m.host.nbytes() : 0;
    Timeline::Phase phase(tl, call_, "host collective", bytes);
    collective();
  }
  copy_out();
}

void StagedOp::wait_issue_event() {
  if (!timeline().enabled()) return;
  Timeline::Phase phase(timeline(), call_, "issue event wait");
  if (on_device()) issued_->synchronize();
}

at::Tensor StagedOp::host_like(const at::Tensor& t) {
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  Timeline::Phase phase(timeline(), call_, "host buffers", bytes);
  at::TensorOptions opts = t.options().device(at::kCPU);
  const bool pinned = stager_.memory_ == "pinned" || (stager_.memory_ == "auto" && on_device());
  // Without an accelerator there is no pinned allocator: asking would throw (and build an
  // error with its backtrace) on every call of a CPU test that asks for pinned memory.
  if (pinned && stager_.has_accelerator_) {
    try {
      return at::empty(t.sizes(), opts.pinned_memory(true));
    } catch (const c10::Error&) {
      // No pinned memory to be had: pageable memory below.
    }
  }
  pageable_ = true;
  std::shared_ptr<ShmPool> pool = stager_.pool_;
  if (pool && bytes && stager_.memory_ != "pinned") {
    if (void* p = pool->allocate(bytes)) {
      return at::from_blob(p, t.sizes(), [pool](void* q) { pool->release(q); }, opts);
    }
  }
  return at::empty(t.sizes(), opts);  // a full pool is not an error
}

at::Tensor StagedOp::mirror(const at::Tensor& t, bool in, bool out) {
  at::Tensor host = host_like(t);
  mirrors_.push_back({t, host, in, out});
  record_use(t);
  return host;
}

std::vector<at::Tensor> StagedOp::mirror(const std::vector<at::Tensor>& ts, bool in, bool out) {
  std::vector<at::Tensor> hs;
  for (const auto& t : ts) hs.push_back(mirror(t, in, out));
  return hs;
}

std::vector<at::Tensor> StagedOp::device_of(const std::vector<at::Tensor>& hosts) const {
  std::vector<at::Tensor> out;
  for (const at::Tensor& h : hosts) {
    at::Tensor d = h;
    for (const Mirror& m : mirrors_) {
      if (m.host.is_same(h)) d = m.dev;
    }
    out.push_back(d);
  }
  return out;
}

void StagedOp::record_use(const at::Tensor& dev) {
  if (!on_device() || !dev.defined() || !dev.has_storage()) return;
  c10::impl::VirtualGuardImpl impl(device_.type());
  impl.recordDataPtrOnStream(dev.storage().data_ptr(), *d2h_);
  impl.recordDataPtrOnStream(dev.storage().data_ptr(), *h2d_);
}

void StagedOp::copy(const at::Tensor& dst, const at::Tensor& src, const c10::Stream& s) {
  if (!on_device()) {
    dst.copy_(src);
    return;
  }
  c10::StreamGuard g(s);
  dst.copy_(src, /*non_blocking=*/true);
}

// Note [Pinned calls do not wait]
// The host waits for a call's copies (finish_copies) only when a host buffer is pageable:
// such a buffer goes back to the pool, or to the heap, when the call ends, while a copy
// from it may still be in flight. A pinned buffer needs no wait: the copy records an event
// for it in the caching host allocator (at::Tensor::copy_ with non_blocking), which reuses
// it only once that event has completed. Until this was fixed, `pageable_` started true and
// was never cleared, so every call, pinned too, ended with the host waiting for its last
// host->device copy: two more events, and the executor held until the copies landed, so
// the next queued collective could not start its device->host copies meanwhile, contrary
// to Note [Device staging]. Unmeasured on a GPU so far; tests/gpu/test_smddp_cuda.py checks
// with the timeline that pinned calls record no "copies wait" and pool calls do.
void StagedOp::finish_copies() {
  if (!on_device()) return;
  for (const c10::Stream& s : {*d2h_, *h2d_}) {
    c10::Event e(device_.type());
    e.record(s);
    e.synchronize();
  }
}

// Before its first copy, the d2h stream waits for the caller's issue event and for the
// host->device copies of the collectives before this one (which may have written what this
// one reads); the h2d stream waits for the issue event (the caller may still be reading, or
// writing, the outputs this one overwrites). Once per op: before its first copy in, or before
// its first copy out when it has none in (Note [Out-only ops wait for the caller's stream]).
void StagedOp::order_side_streams() {
  if (!on_device() || ordered_) return;
  ordered_ = true;
  issued_->block(*d2h_);
  issued_->block(*h2d_);
  c10::Event earlier(d2h_->device_type());
  earlier.record(*h2d_);
  earlier.block(*d2h_);
}

void StagedOp::copy_in() {
  if (copied_in_) return;
  copied_in_ = true;
  bool any = false;
  for (const Mirror& m : mirrors_) any = any || m.in;
  if (!any) return;
  Timeline& tl = timeline();
  try {
    order_side_streams();
    for (size_t k = 0; k < mirrors_.size(); ++k) {
      if (!mirrors_[k].in) continue;
      Timeline::Phase phase(tl, call_, "d2h queue", mirrors_[k].host.nbytes());
      copy(mirrors_[k].host, mirrors_[k].dev,
           d2h_.value_or(c10::Stream(c10::Stream::DEFAULT, device_)));
      trace("d2h mirror " + std::to_string(k));
    }
    wait_issue_event();
    Timeline::Phase phase(tl, call_, "d2h wait");
    if (on_device()) {
      c10::Event ready(device_.type());
      ready.record(*d2h_);
      ready.synchronize();
    }
  } catch (...) {
    finish_copies();
    throw;
  }
}

void StagedOp::copy_out() {
  bool any = false;
  for (const Mirror& m : mirrors_) any = any || m.out;
  if (!any) return;
  Timeline& tl = timeline();
  try {
    // Note [Out-only ops wait for the caller's stream]
    // A non-root broadcast or scatter, or a receive, copies nothing in, so nothing ordered
    // its side streams before: its host->device copy could land before a kernel the caller
    // queued earlier had written the tensor, and that kernel's write then won over the
    // result. Until this was fixed only copy_in ordered them. Found by reading the code
    // while adding the timeline; tests/gpu/test_smddp_cuda.py checks it on a GPU.
    order_side_streams();
    for (size_t k = 0; k < mirrors_.size(); ++k) {
      if (!mirrors_[k].out) continue;
      Timeline::Phase phase(tl, call_, "h2d queue", mirrors_[k].host.nbytes());
      // An expand()ed output takes the result as the plain path's copy_back gives it (Note
      // [Outputs that share memory] in op_helpers.h); Tensor::copy_ refused it, after the
      // collective had run, with a message that named neither smddp nor the rule.
      auto parts = distinct_parts(mirrors_[k].dev, mirrors_[k].host);
      copy(parts.first, parts.second, h2d_.value_or(c10::Stream(c10::Stream::DEFAULT, device_)));
      trace("h2d mirror " + std::to_string(k));
    }
  } catch (...) {
    finish_copies();
    throw;
  }
  if (pageable_) {
    Timeline::Phase phase(tl, call_, "copies wait");
    finish_copies();
  }
}

// Note [Staging pipeline]: all device->host copies queued at once (`in`, on the d2h
// stream), then per chunk: wait for its copies, run the CPU collective (`run`), queue its
// host->device copies (`out`, on the h2d stream). Note [Staging timeline] names the phases.
template <typename In, typename Run, typename Out>
void StagedOp::pipeline(const std::vector<ChunkRange>& chunks, const char* step, int64_t in_unit,
                        int64_t out_unit, In&& in, Run&& run, Out&& out) {
  const c10::Stream cpu(c10::Stream::DEFAULT, device_);
  auto tag = [](const char* what, const ChunkRange& c) {
    return std::string(what) + " " + std::to_string(c.begin) + "+" + std::to_string(c.count);
  };
  Timeline& tl = timeline();
  try {
    order_side_streams();
    std::vector<c10::Event> ready;
    for (const ChunkRange& c : chunks) {
      Timeline::Phase phase(tl, call_, "d2h queue", c.count * in_unit);
      in(c, d2h_.value_or(cpu));
      trace(tag("d2h", c));
      if (on_device()) {
        ready.emplace_back(device_.type());
        ready.back().record(*d2h_);
      }
    }
    if (!chunks.empty()) wait_issue_event();
    for (size_t i = 0; i < chunks.size(); ++i) {
      {
        Timeline::Phase phase(tl, call_, "d2h wait", chunks[i].count * in_unit);
        if (on_device()) ready[i].synchronize();
      }
      {
        Timeline::Phase phase(tl, call_, "host collective", chunks[i].count * in_unit);
        run(chunks[i]);
      }
      trace(tag(step, chunks[i]));
      Timeline::Phase phase(tl, call_, "h2d queue", chunks[i].count * out_unit);
      out(chunks[i], h2d_.value_or(cpu));
      trace(tag("h2d", chunks[i]));
    }
  } catch (...) {
    finish_copies();
    throw;
  }
  if (pageable_ && !chunks.empty()) {
    Timeline::Phase phase(tl, call_, "copies wait");
    finish_copies();
  }
}

int64_t StagedOp::chunk_elems(const at::Tensor& t) const {
  return std::max<int64_t>(1, stager_.chunk_bytes() / std::max<int64_t>(1, t.element_size()));
}

void StagedOp::allreduce(Communicator& comm, const at::Tensor& t, const Reduction& red,
                         const OpCtx& ctx) {
  TORCH_INTERNAL_ASSERT(t.is_contiguous(),
                        "smddp: the staged all-reduce needs a contiguous tensor");
  at::Tensor flat = t.view({-1});
  at::Tensor host = host_like(flat);
  char* base = static_cast<char*>(host.data_ptr());
  const int64_t esz = t.element_size();
  pipeline(
      plan_chunks(flat.numel(), chunk_elems(t)), "reduce", esz, esz,
      [&](const ChunkRange& c, const c10::Stream& s) {
        copy(host.narrow(0, c.begin, c.count), flat.narrow(0, c.begin, c.count), s);
      },
      [&](const ChunkRange& c) {
        comm.allreduce(base + c.begin * esz, static_cast<size_t>(c.count), red,
                       chunk_ctx(ctx, c, flat.numel()));
      },
      [&](const ChunkRange& c, const c10::Stream& s) {
        copy(flat.narrow(0, c.begin, c.count), host.narrow(0, c.begin, c.count), s);
      });
}

// Chunk c = [b, b + k) of every rank's part: the host buffer of the `world` x n side holds
// the chunks one after the other (chunk c at world * b, rank r's piece at world * b + r * k),
// so each chunk's collective reads or writes one contiguous block.
void StagedOp::allgather(Communicator& comm, const at::Tensor& input, const at::Tensor& output,
                         const OpCtx& ctx) {
  TORCH_INTERNAL_ASSERT(input.is_contiguous() && output.is_contiguous());
  const int64_t world = comm.config().size, n = input.numel(), esz = input.element_size();
  at::Tensor in = input.view({-1}), out = output.view({-1});
  at::Tensor host_in = host_like(in), host_out = host_like(out);
  char* hi = static_cast<char*>(host_in.data_ptr());
  char* ho = static_cast<char*>(host_out.data_ptr());
  pipeline(
      plan_chunks(n, chunk_elems(input)), "gather", esz, world * esz,
      [&](const ChunkRange& c, const c10::Stream& s) {
        copy(host_in.narrow(0, c.begin, c.count), in.narrow(0, c.begin, c.count), s);
      },
      [&](const ChunkRange& c) {
        comm.allgather(hi + c.begin * esz, ho + world * c.begin * esz,
                       static_cast<size_t>(c.count * esz), chunk_ctx(ctx, c, n));
      },
      [&](const ChunkRange& c, const c10::Stream& s) {
        for (int64_t r = 0; r < world; ++r) {
          copy(out.narrow(0, r * n + c.begin, c.count),
               host_out.narrow(0, world * c.begin + r * c.count, c.count), s);
        }
      });
}

void StagedOp::reduce_scatter(Communicator& comm, const at::Tensor& input, const at::Tensor& output,
                              const Reduction& red, const OpCtx& ctx) {
  TORCH_INTERNAL_ASSERT(input.is_contiguous() && output.is_contiguous());
  const int64_t world = comm.config().size, n = output.numel(), esz = output.element_size();
  at::Tensor in = input.view({-1}), out = output.view({-1});
  at::Tensor host_in = host_like(in), host_out = host_like(out);
  char* hi = static_cast<char*>(host_in.data_ptr());
  char* ho = static_cast<char*>(host_out.data_ptr());
  pipeline(
      plan_chunks(n, chunk_elems(output)), "reduce", world * esz, esz,
      [&](const ChunkRange& c, const c10::Stream& s) {
        for (int64_t r = 0; r < world; ++r) {
          copy(host_in.narrow(0, world * c.begin + r * c.count, c.count),
               in.narrow(0, r * n + c.begin, c.count), s);
        }
      },
      [&](const ChunkRange& c) {
        comm.reduce_scatter(hi + world * c.begin * esz, ho + c.begin * esz,
                            static_cast<size_t>(c.count), red, chunk_ctx(ctx, c, n));
      },
      [&](const ChunkRange& c, const c10::Stream& s) {
        copy(out.narrow(0, c.begin, c.count), host_out.narrow(0, c.begin, c.count), s);
      });
}

std::optional<c10::Stream> StagedOp::completion_stream() const { return h2d_; }

}  // namespace smddp
