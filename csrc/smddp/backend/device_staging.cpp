// Note [Device staging] and Note [Staging pipeline] in device_staging.h.
#include "smddp/backend/device_staging.h"

#include <ATen/DeviceAccelerator.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "smddp/algorithms/comm.h"
#include "smddp/common/common.h"
#include "smddp/transport/shm/shm_pool.h"

namespace smddp {

std::vector<ChunkRange> plan_chunks(int64_t numel, int64_t chunk_elems) {
  TORCH_CHECK_VALUE(numel >= 0 && chunk_elems > 0, "smddp: plan_chunks(", numel, ", ", chunk_elems,
                    "): needs numel >= 0 and chunk_elems > 0");
  std::vector<ChunkRange> out;
  for (int64_t b = 0; b < numel; b += std::min(chunk_elems, numel - b)) {
    out.push_back({b, std::min(chunk_elems, numel - b)});
  }
  return out;
}

Stager::Stager(const Settings& settings, std::shared_ptr<ShmPool> pool)
    : stage_cpu_(settings.stage_cpu),
      chunk_bytes_(static_cast<int64_t>(settings.staging_chunk_bytes)),
      memory_(settings.staging_memory),
      pool_(std::move(pool)) {}

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

StagedOp::StagedOp(Stager& stager, c10::Device device) : stager_(stager), device_(device) {
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

at::Tensor StagedOp::host_like(const at::Tensor& t) {
  at::TensorOptions opts = t.options().device(at::kCPU);
  const bool pinned = stager_.memory_ == "pinned" || (stager_.memory_ == "auto" && on_device());
  if (pinned) {
    try {
      return at::empty(t.sizes(), opts.pinned_memory(true));
    } catch (const c10::Error&) {
      // No pinned allocator (CPU-only torch): pageable memory below.
    }
  }
  pageable_ = true;
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
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

void StagedOp::finish_copies() {
  if (!on_device()) return;
  for (const c10::Stream& s : {*d2h_, *h2d_}) {
    c10::Event e(device_.type());
    e.record(s);
    e.synchronize();
  }
}

// Before its first device->host copy, the d2h stream waits for the caller's issue event and
// for the host->device copies of the collectives before this one (which may have written
// what this one reads); the h2d stream waits for the issue event (the caller may still be
// reading the outputs this one overwrites).
static void order_side_streams(const std::optional<c10::Event>& issued, const c10::Stream& d2h,
                               const c10::Stream& h2d) {
  issued->block(d2h);
  issued->block(h2d);
  c10::Event earlier(d2h.device_type());
  earlier.record(h2d);
  earlier.block(d2h);
}

void StagedOp::copy_in() {
  if (copied_in_) return;
  copied_in_ = true;
  bool any = false;
  for (const Mirror& m : mirrors_) any = any || m.in;
  if (!any) return;
  try {
    if (on_device()) order_side_streams(issued_, *d2h_, *h2d_);
    for (size_t k = 0; k < mirrors_.size(); ++k) {
      if (!mirrors_[k].in) continue;
      copy(mirrors_[k].host, mirrors_[k].dev,
           d2h_.value_or(c10::Stream(c10::Stream::DEFAULT, device_)));
      trace("d2h mirror " + std::to_string(k));
    }
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
  try {
    for (size_t k = 0; k < mirrors_.size(); ++k) {
      if (!mirrors_[k].out) continue;
      copy(mirrors_[k].dev, mirrors_[k].host,
           h2d_.value_or(c10::Stream(c10::Stream::DEFAULT, device_)));
      trace("h2d mirror " + std::to_string(k));
    }
  } catch (...) {
    finish_copies();
    throw;
  }
  if (pageable_) finish_copies();
}

// Note [Staging pipeline]: all device->host copies queued at once (`in`, on the d2h
// stream), then per chunk: wait for its copies, run the CPU collective (`run`), queue its
// host->device copies (`out`, on the h2d stream).
template <typename In, typename Run, typename Out>
void StagedOp::pipeline(const std::vector<ChunkRange>& chunks, const char* step, In&& in, Run&& run,
                        Out&& out) {
  const c10::Stream cpu(c10::Stream::DEFAULT, device_);
  auto tag = [](const char* what, const ChunkRange& c) {
    return std::string(what) + " " + std::to_string(c.begin) + "+" + std::to_string(c.count);
  };
  try {
    if (on_device()) order_side_streams(issued_, *d2h_, *h2d_);
    std::vector<c10::Event> ready;
    for (const ChunkRange& c : chunks) {
      in(c, d2h_.value_or(cpu));
      trace(tag("d2h", c));
      if (on_device()) {
        ready.emplace_back(device_.type());
        ready.back().record(*d2h_);
      }
    }
    for (size_t i = 0; i < chunks.size(); ++i) {
      if (on_device()) ready[i].synchronize();
      run(chunks[i]);
      trace(tag(step, chunks[i]));
      out(chunks[i], h2d_.value_or(cpu));
      trace(tag("h2d", chunks[i]));
    }
  } catch (...) {
    finish_copies();
    throw;
  }
  if (pageable_) finish_copies();
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
      plan_chunks(flat.numel(), chunk_elems(t)), "reduce",
      [&](const ChunkRange& c, const c10::Stream& s) {
        copy(host.narrow(0, c.begin, c.count), flat.narrow(0, c.begin, c.count), s);
      },
      [&](const ChunkRange& c) {
        OpCtx chunk_ctx = ctx;
        chunk_ctx.desc.count = static_cast<uint64_t>(c.count);
        comm.allreduce(base + c.begin * esz, static_cast<size_t>(c.count), red, chunk_ctx);
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
      plan_chunks(n, chunk_elems(input)), "gather",
      [&](const ChunkRange& c, const c10::Stream& s) {
        copy(host_in.narrow(0, c.begin, c.count), in.narrow(0, c.begin, c.count), s);
      },
      [&](const ChunkRange& c) {
        OpCtx chunk_ctx = ctx;
        chunk_ctx.desc.count = static_cast<uint64_t>(c.count * esz);
        comm.allgather(hi + c.begin * esz, ho + world * c.begin * esz,
                       static_cast<size_t>(c.count * esz), chunk_ctx);
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
      plan_chunks(n, chunk_elems(output)), "reduce",
      [&](const ChunkRange& c, const c10::Stream& s) {
        for (int64_t r = 0; r < world; ++r) {
          copy(host_in.narrow(0, world * c.begin + r * c.count, c.count),
               in.narrow(0, r * n + c.begin, c.count), s);
        }
      },
      [&](const ChunkRange& c) {
        OpCtx chunk_ctx = ctx;
        chunk_ctx.desc.count = static_cast<uint64_t>(c.count);
        comm.reduce_scatter(hi + world * c.begin * esz, ho + c.begin * esz,
                            static_cast<size_t>(c.count), red, chunk_ctx);
      },
      [&](const ChunkRange& c, const c10::Stream& s) {
        copy(out.narrow(0, c.begin, c.count), host_out.narrow(0, c.begin, c.count), s);
      });
}

std::optional<c10::Stream> StagedOp::completion_stream() const { return h2d_; }

}  // namespace smddp
