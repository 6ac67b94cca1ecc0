// ProcessGroupSMDDP: construction, shutdown, shared helpers.
#include "smddp/backend/backend.h"

#include <Python.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <condition_variable>
#include <system_error>
#include <thread>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace smddp {
namespace {

// The group's c10d store as the communicator's key-value interface.
class StoreKV : public KeyValue {
 public:
  explicit StoreKV(c10::intrusive_ptr<c10d::Store> s) : store_(std::move(s)) {}
  void set(const std::string& k, const std::string& v) override {
    store_->set(k, std::vector<uint8_t>(v.begin(), v.end()));
  }
  std::string get(const std::string& k) override {
    auto v = store_->get(k);
    return std::string(v.begin(), v.end());
  }
  bool check(const std::string& k) override { return store_->check({k}); }
  void remove(const std::string& k) override { store_->deleteKey(k); }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

// Joining threads whose futures may run Python callbacks must not hold the GIL.
template <typename F>
void without_gil(F&& f) {
  if (Py_IsInitialized() && PyGILState_Check()) {
    pybind11::gil_scoped_release release;
    f();
  } else {
    f();
  }
}

}  // namespace

DType to_dtype(at::ScalarType t, const char* collective) {
  switch (t) {
    case at::kFloat:
      return DType::F32;
    case at::kDouble:
      return DType::F64;
    case at::kBFloat16:
      return DType::BF16;
    case at::kHalf:
      return DType::F16;
    case at::kChar:
      return DType::I8;
    case at::kByte:
      return DType::U8;
    case at::kShort:
      return DType::I16;
    case at::kInt:
      return DType::I32;
    case at::kLong:
      return DType::I64;
    case at::kBool:
      return DType::BOOL;
    default:
      TORCH_CHECK_TYPE(false, "smddp: ", collective, " does not support dtype ", t,
                       " for reductions; supported: float32, float64, bfloat16, float16, int8, "
                       "uint8, int16, int32, int64, bool");
  }
}

void check_cpu(const at::Tensor& t, const char* collective, const char* what) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "smddp: ", collective, " got ", what, " on device ",
                    t.device(),
                    "; this call takes CPU tensors only (torch.distributed's "
                    "collectives take device tensors)");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, "smddp: ", collective, " got a ", t.layout(),
                    " tensor as ", what, "; only dense (strided) tensors are supported");
}

ProcessGroupSMDDP::ProcessGroupSMDDP(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                     int size, std::chrono::duration<float> timeout,
                                     std::string group_name, std::vector<int64_t> global_ranks,
                                     const Settings& settings)
    : c10d::Backend(rank, size),
      timeout_s_(settings.timeout_s > 0 ? settings.timeout_s : timeout.count()),
      group_name_(std::move(group_name)) {
  CommConfig cfg;
  cfg.settings = settings;
  cfg.rank = rank;
  cfg.size = size;
  for (auto g : global_ranks) cfg.global_ranks.push_back(static_cast<int>(g));
  cfg.group_name = group_name_;
  cfg.timeout_s = timeout_s();
  StoreKV kv(store);
  comm_ = std::make_unique<Communicator>(kv, cfg);
  stager_ = std::make_unique<Stager>(settings, comm_->pool());
}

ProcessGroupSMDDP::~ProcessGroupSMDDP() {
  if (!shut_down_.exchange(true) || release_in_destructor_) release();
}

const Communicator& ProcessGroupSMDDP::comm() const {
  TORCH_CHECK(comm_, "smddp: group '", group_name_, "' was shut down");
  return *comm_;
}

std::vector<Timeline::Span> ProcessGroupSMDDP::take_timeline() {
  InUse use = enter();
  return live_comm().take_timeline();
}

// Note [Shutdown waits for the calls in flight]
// dist.destroy_process_group(group) may run while another thread is inside a call on the
// group: a synchronous collective running in the caller's thread (Note [Synchronous calls
// return no Work]), a Work.wait() running queued work (Note [Waiting runs the work]), an
// eager send. Each of them uses comm_, which shutdown() frees, so freeing it at once killed
// the process with SIGSEGV. gloo cannot crash there (its context lives as long as any
// reference) and finishes the call. So every entry point holds an InUse mark for its whole
// run, and shutdown() first refuses new calls (shut_down_), then waits until no mark is
// held and the executor is idle (which covers work a Work.wait() runs and receive attempts:
// they hold no mark), and only then frees the communicator. The wait is bounded:
// a call in flight ends by completing, by its peers' failure or at its timeout. Marks are a
// counter, not a lock, because entry points nest (a staged call issues the same collective
// on its host mirrors). The counter and the flag are sequentially consistent atomics, so an
// entry that raced with shutdown() either sees the flag and raises, or is counted and waited
// for.
ProcessGroupSMDDP::InUse ProcessGroupSMDDP::try_enter() {
  users_.fetch_add(1);
  if (shut_down_.load()) {
    leave();
    return InUse(nullptr);
  }
  return InUse(this);
}

ProcessGroupSMDDP::InUse ProcessGroupSMDDP::enter() {
  InUse use = try_enter();
  TORCH_CHECK(use, "smddp: group '", group_name_, "' was shut down");
  return use;
}

void ProcessGroupSMDDP::leave() {
  if (users_.fetch_sub(1) == 1 && shut_down_.load()) {
    std::lock_guard<std::mutex> g(users_mu_);
    users_cv_.notify_all();
  }
}

bool ProcessGroupSMDDP::supportsTensorAlloc(c10::DeviceIndex /*device_index*/) {
  // Only CPU tensors are dispatched to this backend, whatever index the caller passes. A
  // group that was shut down has no pool left (callers then allocate ordinary memory).
  InUse use = try_enter();
  return use && comm_->pool() != nullptr;
}

at::Tensor ProcessGroupSMDDP::allocateTensor(long size, at::TensorOptions options) {
  TORCH_CHECK_VALUE(size >= 0, "smddp: allocate_tensor: size must be >= 0, got ", size);
  TORCH_CHECK_VALUE(!options.has_device() || options.device().is_cpu(),
                    "smddp: allocate_tensor serves CPU tensors only, got device ",
                    options.device());
  options = options.device(at::kCPU);
  std::shared_ptr<ShmPool> pool;
  {
    InUse use = try_enter();
    TORCH_CHECK(use, "smddp: allocate_tensor on group '", group_name_, "', which was shut down");
    pool = comm_->pool();  // the pool outlives the group while its tensors live
  }
  size_t bytes = 0;
  TORCH_CHECK_VALUE(
      !__builtin_mul_overflow(static_cast<size_t>(size), options.dtype().itemsize(), &bytes) &&
          bytes <= static_cast<size_t>(INT64_MAX),
      "smddp: allocate_tensor: ", size, " elements of ", options.dtype().itemsize(), " bytes (",
      options.dtype().name(), ") is more than 2^63 bytes; ask for fewer elements");
  void* p = pool && bytes ? pool->allocate(bytes) : nullptr;
  // A full pool (or /dev/shm) is not an error: the collectives stage ordinary memory.
  if (!p) return at::empty({size}, options);
  return at::from_blob(p, {size}, [pool](void* q) { pool->release(q); }, options);
}

// Note [Shutdown from the group's own thread]
// A future callback runs in the thread that completes the Work: a pool thread running the
// group's lane or its receive rounds, or a thread whose wait() ran the work
// (Note [Waiting runs the work]). A callback that destroys the group it belongs to
// (dist.destroy_process_group, which calls shutdown(), or _abort_process_group) made
// shutdown() wait for the executor to go idle, i.e. for itself: the rank hung with no
// timeout, where gloo returns (its destroy leaves the threads and the transport to the last
// reference). So shutdown() from such a thread refuses new calls at once, as always, and
// hands the wait and the release to a thread of its own that holds a reference to the
// group: the transport is released once the callback has returned and the work queued
// behind it has run. The destructor never defers (nothing can hold the group any more); it
// cannot run inside the group's own thread while torch.distributed holds the group, which
// it does until destroy_process_group, whose shutdown() comes first. An exit hook waits for
// the release threads (wait_for_deferred_releases), so the interpreter does not finalize
// while one of them may still need the GIL.
// The release threads still running, for wait_for_deferred_releases (an exit hook: a thread
// that drops tensors with Python objects needs the GIL, which it cannot take once the
// interpreter is finalizing).
namespace {
std::mutex g_deferred_mu;
std::condition_variable g_deferred_cv;
int g_deferred = 0;
}  // namespace

bool wait_for_deferred_releases(double timeout_s) {
  std::unique_lock<std::mutex> lk(g_deferred_mu);
  return g_deferred_cv.wait_for(lk, std::chrono::duration<double>(timeout_s),
                                [] { return g_deferred == 0; });
}

void ProcessGroupSMDDP::shutdown() {
  if (shut_down_.exchange(true)) return;
  if (exec_->active_in_this_thread()) {
    // The caller holds a reference (only the destructor runs at zero, and it calls release).
    auto self = c10::intrusive_ptr<ProcessGroupSMDDP>::unsafe_reclaim_from_nonowning(this);
    {
      std::lock_guard<std::mutex> g(g_deferred_mu);
      ++g_deferred;
    }
    try {
      std::thread([self]() mutable {
        self->release();
        self.reset();  // may run the destructor, which drops what the group still holds
        std::lock_guard<std::mutex> g(g_deferred_mu);
        --g_deferred;
        g_deferred_cv.notify_all();
      }).detach();
    } catch (const std::system_error&) {  // no thread: the destructor releases instead
      std::lock_guard<std::mutex> g(g_deferred_mu);
      --g_deferred;
      release_in_destructor_ = true;
    }
    return;
  }
  release();
}

void ProcessGroupSMDDP::release() {
  // Note [Shutdown waits for the calls in flight].
  without_gil([&] {
    {
      std::unique_lock<std::mutex> lk(users_mu_);
      users_cv_.wait(lk, [&] { return users_.load() == 0; });
    }
    exec_->shutdown();
  });
  std::unique_ptr<Communicator> gone;
  {
    std::lock_guard<std::mutex> g(comm_mu_);
    gone = std::move(comm_);
  }
  gone.reset();  // unmaps the segments, closes sockets, joins the listener
}

void ProcessGroupSMDDP::abort() {
  exec_->abort();  // Note [Abort fails the queued work]; first, so none starts meanwhile
  {
    // Fails the calls in flight, which shutdown() then waits for; also while another
    // thread's shutdown() waits for them (after shut_down_ is set, so no InUse mark here).
    // Note [Abort tells the peers] in comm.cpp.
    std::lock_guard<std::mutex> g(comm_mu_);
    if (comm_) comm_->abort();
  }
  shutdown();
}

c10::intrusive_ptr<c10d::Backend::Options> ProcessGroupSMDDP::getBackendOptions() {
  // Bounded below 2^63 ms: a timeout of 1e300 s is legal (it never expires), its cast is not.
  const double ms = std::min(timeout_s() * 1e3, 9e18);
  auto options = c10::make_intrusive<Options>(getBackendName(),
                                              std::chrono::milliseconds(static_cast<int64_t>(ms)));
  options->group_name = group_name_;
  return options;
}

double ProcessGroupSMDDP::timeout_of(std::chrono::milliseconds t) const {
  return t.count() > 0 ? t.count() / 1e3 : timeout_s();
}

Reduction ProcessGroupSMDDP::reduction_of(const c10d::ReduceOp& op, const at::Tensor& t,
                                          const char* name) const {
  Reduction r;
  r.dtype = to_dtype(t.scalar_type(), name);
  r.op = static_cast<RedOp>(static_cast<int>(op.op_));
  TORCH_CHECK_VALUE(static_cast<int>(op.op_) <= static_cast<int>(c10d::ReduceOp::PREMUL_SUM),
                    "smddp: ", name, " got an unknown reduce op");
  try {
    check_reduction(r.dtype, r.op, name);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  r.divisor = size_;
  if (r.op == RedOp::PREMUL_SUM) {
    auto* sup = dynamic_cast<compat::PreMulSumSupplement*>(op.supplement_.get());
    TORCH_CHECK_VALUE(sup, "smddp: ", name, " got PREMUL_SUM without a factor");
    r.premul = sup->tensor_factor.defined() ? sup->tensor_factor.to(at::kDouble).item<double>()
                                            : sup->double_factor;
  }
  return r;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSMDDP::track(c10::intrusive_ptr<c10d::Work> w) {
  if (coalescing_) coalesced_.push_back(w);
  return w;
}

std::shared_ptr<StagedOp> ProcessGroupSMDDP::stage(const std::vector<const at::Tensor*>& tensors,
                                                   const char* collective) {
  if (pending_stage_) return nullptr;  // the mirrors of a staged call
  return stager_->begin(tensors, collective);
}

c10::intrusive_ptr<SmddpWork> ProcessGroupSMDDP::make_work(c10d::OpType type,
                                                           std::vector<at::Tensor> outputs) {
  if (!pending_stage_) return c10::make_intrusive<SmddpWork>(rank_, type, std::move(outputs));
  const StagedOp& op = *pending_stage_;
  outputs = op.device_of(outputs);
  c10::intrusive_ptr<SmddpWork> work;
  if (auto s = op.completion_stream()) {
    work = c10::make_intrusive<SmddpWork>(rank_, type, std::move(outputs), op.device(), *s);
  } else {
    work = c10::make_intrusive<SmddpWork>(rank_, type, std::move(outputs));
  }
  if (stager_->timeline()->enabled()) {  // Note [Staging timeline]
    work->record_on(stager_->timeline(), op.call(), op.issued_ns());
  }
  return work;
}

// Note [Synchronous calls return no Work]
// torch.distributed's synchronous collectives (async_op=False, the default of
// dist.all_reduce and the others) wait on the Work the backend returns, or on nothing when it
// returns none: "the backend has sync'ed at CPP level", a case every collective in
// distributed_c10d.py handles. A small all-reduce spends about 4 us in torch.distributed's
// Python and dispatch layers, of which the Work, its Future (and the Future's type), its
// Python wrapper and the wait() call are the part a backend controls. So a synchronous CPU
// collective that can run at once (nothing queued before it on the group's main lane: the
// inline case of Note [Execution order]) runs in the caller's thread, raises its error
// there, and returns no Work. Everything else keeps its Work: asynchronous calls (DDP, FSDP
// and functional collectives pass async), coalesced calls (endCoalescing collects the
// parts), staged device tensors (the caller's stream must wait on the Work), point-to-point,
// a synchronous call queued behind asynchronous ones, and calls made while
// torch._C._distributed_c10d._set_allow_inflight_collective_as_graph_input(True) is on (it
// registers the Work with the output tensor).
bool ProcessGroupSMDDP::completes_inline(c10d::OpType type, bool async_op) const {
  return !async_op && !coalescing_ && !pending_stage_ && type != c10d::OpType::SEND &&
         type != c10d::OpType::RECV && type != c10d::OpType::RECVANYSOURCE &&
         !c10d::allow_inflight_collective_as_graph_input();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSMDDP::submit(c10d::OpType type,
                                                         std::vector<at::Tensor> outputs,
                                                         bool async_op, std::function<void()> fn) {
  if (completes_inline(type, async_op) && exec_->try_now([&] {
        issued_.fetch_add(1);
        fn();
        return true;
      })) {
    return {};  // Note [Synchronous calls return no Work]
  }
  return submit(make_work(type, std::move(outputs)), async_op, std::move(fn));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSMDDP::submit(c10::intrusive_ptr<SmddpWork> work,
                                                         bool async_op, std::function<void()> fn) {
  if (std::shared_ptr<StagedOp> op = std::move(pending_stage_)) {
    fn = [op, inner = std::move(fn)] { op->run(inner); };
    op->queued();
  }
  const c10d::OpType type = work->retrieveOpType();
  work->set_executor(exec_);
  if (type != c10d::OpType::SEND && type != c10d::OpType::RECV &&
      type != c10d::OpType::RECVANYSOURCE) {
    issued_.fetch_add(1);
  }
  if (type == c10d::OpType::SEND) {
    exec_->submit_send(std::move(fn), SmddpWork::completion(work));
  } else {
    exec_->submit(std::move(fn), SmddpWork::completion(work), async_op || coalescing_);
  }
  return track(work);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSMDDP::completed(c10d::OpType type,
                                                            std::vector<at::Tensor> outputs) {
  auto work = make_work(type, std::move(outputs));
  if (std::shared_ptr<StagedOp> op = std::move(pending_stage_)) {
    op->copy_in();  // done already for sends
    op->copy_out();
  }
  work->complete(nullptr);
  return track(work);
}

void ProcessGroupSMDDP::startCoalescing() {
  coalescing_ = true;
  coalesced_.clear();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSMDDP::endCoalescing() {
  coalescing_ = false;
  auto parts = std::move(coalesced_);
  coalesced_.clear();
  return c10::make_intrusive<CoalescedWork>(std::move(parts));
}

}  // namespace smddp
