#include "smddp/backend/work.h"

#include <c10/core/StreamGuard.h>

#include <algorithm>
#include <cctype>
#include <chrono>

#include "smddp/common/common.h"

namespace smddp {
namespace {

// Completes a SmddpWork for the scheduler (Completion in common/completion.h).
class WorkCompletion final : public Completion {
 public:
  explicit WorkCompletion(c10::intrusive_ptr<SmddpWork> work) : work_(std::move(work)) {}
  void complete(std::exception_ptr error) override { work_->complete(error); }
  std::string name() const override {
    std::string op = c10d::opTypeToString(work_->retrieveOpType());
    std::transform(op.begin(), op.end(), op.begin(),
                   [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
    return op;
  }

 private:
  c10::intrusive_ptr<SmddpWork> work_;
};

}  // namespace

CompletionPtr SmddpWork::completion(c10::intrusive_ptr<SmddpWork> work) {
  return std::make_unique<WorkCompletion>(std::move(work));
}

SmddpWork::SmddpWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type), outputs_(std::move(outputs)) {
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
}

SmddpWork::SmddpWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs,
                     c10::Device device, c10::Stream completion_stream)
    : c10d::Work(rank, type), outputs_(std::move(outputs)), completion_stream_(completion_stream) {
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                     std::vector<c10::Device>{device});
}

void SmddpWork::record_on(std::shared_ptr<Timeline> timeline, uint64_t call, int64_t issued_ns) {
  timeline_ = std::move(timeline);
  call_ = call;
  issued_ns_ = issued_ns;
}

void SmddpWork::complete(std::exception_ptr error) {
  const int64_t began = timeline_ ? Timeline::now_ns() : 0;
  // The future first: its callbacks (e.g. DDP's bucket division) have run when wait() returns.
  if (error) {
    future_->setError(error);
  } else {
    // A device future records its event on the current stream: the copies' stream.
    std::optional<c10::StreamGuard> on_copies;
    if (completion_stream_) on_copies.emplace(*completion_stream_);
    future_->markCompleted(c10::IValue(outputs_));
  }
  // Before finish(): a waiter may return, and record the end of the call, at once.
  if (timeline_) timeline_->record(call_, "complete", began);
  finish(error);
}

bool SmddpWork::wait(std::chrono::milliseconds timeout) {
  const int64_t began = timeline_ ? Timeline::now_ns() : 0;
  std::shared_ptr<Scheduler> exec = exec_.lock();
  // Without a timeout the waiting thread helps: it runs the lane's queued work itself (under
  // each operation's own timeout). With one it must return when it runs out, which a thread
  // inside a collective cannot, so it leaves the work to the pool and waits at most that
  // long; c10d::Work::wait then raises "Operation timed out!", as gloo's Work does.
  if (exec && timeout == ::kNoTimeout) {
    const c10d::OpType type = retrieveOpType();
    const Scheduler::Waited what =
        type == c10d::OpType::RECV || type == c10d::OpType::RECVANYSOURCE
            ? Scheduler::Waited::kReceive  // Note [Receives wait side by side]
        : type == c10d::OpType::SEND ? Scheduler::Waited::kSend
                                     : Scheduler::Waited::kMain;
    exec->help(what, [this] { return isCompleted(); });
  }
  const bool ok = c10d::Work::wait(timeout);
  if (exec) exec->release_finished();
  if (completion_stream_) future_->wait();     // the current stream waits, not the host
  if (timeline_ && !waited_.exchange(true)) {  // Note [Staging timeline]
    const int64_t end = Timeline::now_ns();
    timeline_->record_span(call_, "wait", began, end);
    timeline_->record_span(call_, "call", issued_ns_, end);
  }
  return ok;
}

CoalescedWork::CoalescedWork(std::vector<c10::intrusive_ptr<c10d::Work>> parts)
    : c10d::Work(-1, c10d::OpType::COALESCED) {
  for (auto& p : parts) {
    if (p) parts_.push_back(std::move(p));  // none: done in the caller's thread already
  }
}

bool CoalescedWork::isCompleted() {
  for (auto& p : parts_) {
    if (!p->isCompleted()) return false;
  }
  return true;
}

bool CoalescedWork::wait(std::chrono::milliseconds timeout) {
  if (timeout == ::kNoTimeout) {
    for (auto& p : parts_) p->wait(timeout);
    return true;
  }
  // One timeout for all the parts together.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (auto& p : parts_) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    p->wait(std::max(left, std::chrono::milliseconds(1)));  // 0 would mean no timeout
  }
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> CoalescedWork::getFuture() {
  std::vector<at::Tensor> all;
  c10::List<c10::intrusive_ptr<c10::ivalue::Future>> futures(
      c10::FutureType::create(c10::ListType::create(c10::TensorType::get())));
  for (auto& p : parts_) futures.push_back(p->getFuture());
  auto done = c10::collectAll(futures);
  return done->then(
      [futures](c10::ivalue::Future& f) -> c10::IValue {
        std::vector<at::Tensor> out;
        for (size_t i = 0; i < futures.size(); ++i) {
          auto list = futures.get(i)->value().toTensorVector();
          out.insert(out.end(), list.begin(), list.end());
        }
        return c10::IValue(out);
      },
      c10::ListType::create(c10::TensorType::get()));
}

ResultAsWork::ResultAsWork(c10::intrusive_ptr<c10d::Work> inner, std::vector<at::Tensor> outputs)
    : c10d::Work(-1, inner->retrieveOpType()),
      inner_(std::move(inner)),
      outputs_(std::move(outputs)) {}

c10::intrusive_ptr<c10::ivalue::Future> ResultAsWork::getFuture() {
  std::vector<at::Tensor> outputs = outputs_;
  return inner_->getFuture()->then(
      [outputs](c10::ivalue::Future&) -> c10::IValue { return c10::IValue(outputs); },
      c10::ListType::create(c10::TensorType::get()));
}

}  // namespace smddp
