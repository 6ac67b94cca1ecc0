#include "smddp/backend/work.h"

#include <c10/core/StreamGuard.h>

#include <algorithm>
#include <cctype>
#include <chrono>

#include "smddp/common/common.h"

namespace smddp {
namespace {

// The executors whose activity the calling thread is inside, innermost last (a callback
// may wait for a Work of another group, which runs that group's work here too).
thread_local std::vector<const Executor*> t_active;

// Marks the calling thread inside `exec` for the scope (Executor::active_in_this_thread).
class ActiveIn {
 public:
  explicit ActiveIn(const Executor* exec) { t_active.push_back(exec); }
  ~ActiveIn() { t_active.pop_back(); }
  ActiveIn(const ActiveIn&) = delete;
  ActiveIn& operator=(const ActiveIn&) = delete;
};

}  // namespace

bool Executor::active_in_this_thread() const {
  return std::find(t_active.begin(), t_active.end(), this) != t_active.end();
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
  std::shared_ptr<Executor> exec = exec_.lock();
  // Without a timeout the waiting thread helps: it runs the lane's queued work itself (under
  // each operation's own timeout). With one it must return when it runs out, which a thread
  // inside a collective cannot, so it leaves the work to the pool and waits at most that
  // long; c10d::Work::wait then raises "Operation timed out!", as gloo's Work does.
  if (exec && timeout == ::kNoTimeout) {
    const c10d::OpType type = retrieveOpType();
    if (type == c10d::OpType::RECV || type == c10d::OpType::RECVANYSOURCE) {
      exec->help_receive(*this);  // Note [Receives wait side by side]
    }
    // A send's waiter runs the send lane too: it may be that lane's own pool thread, in a
    // future callback of the send before (Note [Waiting runs the work]).
    const bool send = type == c10d::OpType::SEND;
    while (!isCompleted() && ((send && exec->run_next(Executor::LaneId::kSend)) ||
                              exec->run_next(Executor::LaneId::kMain))) {
    }
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

// Note [Abort fails the queued work]
// An abort (_abort_process_group) marks the transport aborted, which fails an operation
// only where it waits for a peer. Work queued behind the abort therefore ran, and completed
// or failed depending on whether its peers' parts had already arrived: a callback that
// aborted its own group saw the all_reduce queued behind it sometimes fail and sometimes
// succeed (a flaky test under load). Work that has not started when the group is aborted
// now always fails, as NCCL's abort fails every queued kernel (receives still waiting are
// cancelled by the shutdown that follows); destroy_process_group still lets it run (Note
// [Shutdown from the group's own thread]). The peers are told (Note [Abort tells the
// peers] in comm.cpp).
std::exception_ptr Executor::execute(Item& item, bool exclusive) {
  // Sends are not exclusive: they only write sockets (see Note [TCP connections]) or their
  // own shared-memory rings.
  std::unique_lock<std::mutex> g(exec_mu_, std::defer_lock);
  if (exclusive) g.lock();
  if (aborted_.load()) {  // after the lock: an abort may come while this waits for it
    std::string op = c10d::opTypeToString(item.work->retrieveOpType());
    std::transform(op.begin(), op.end(), op.begin(),
                   [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
    return std::make_exception_ptr(std::runtime_error(
        "smddp: " + op + " was aborted before it started: the process group was aborted"));
  }
  try {
    item.fn();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

void Executor::run(Item& item) { item.work->complete(execute(item, true)); }

void Executor::submit(Fn fn, c10::intrusive_ptr<SmddpWork> work, bool async_op) {
  Item item{std::move(fn), std::move(work)};
  if (!async_op) {
    std::vector<Item> dead;  // destroyed after the lock (Note [Tensors are released in ...])
    std::unique_lock<std::mutex> lk(mu_);
    dead.swap(released_);
    if (main_.pending == 0 && !stop_) {
      lk.unlock();
      run(item);  // no callbacks yet: the caller has not seen the Work
      return;
    }
  }
  enqueue(main_, std::move(item));
}

void Executor::submit_send(Fn fn, c10::intrusive_ptr<SmddpWork> work) {
  enqueue(send_, Item{std::move(fn), std::move(work)});
}

void Executor::enqueue(Lane& lane, Item item) {
  std::vector<Item> dead;  // destroyed after the lock (Note [Tensors are released in ...])
  std::lock_guard<std::mutex> g(mu_);
  dead.swap(released_);
  if (stop_) {
    item.work->complete(
        std::make_exception_ptr(std::runtime_error("smddp: the process group was shut down")));
    return;
  }
  lane.queue.push_back(std::move(item));
  ++lane.pending;
  if (!lane.scheduled) {
    lane.scheduled = true;
    WorkerPool::instance().post([this, &lane] { drain(lane); });
  }
}

bool Executor::run_next(LaneId id) {
  Lane& lane = id == LaneId::kSend ? send_ : main_;
  Item item;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (lane.busy || lane.queue.empty()) return false;
    item = take_front(lane);
  }
  ActiveIn active(this);
  // Async work keeps the worker's waiting policy (a short spin): while this thread waits
  // on a peer, the send lane of this process may need the core.
  bool was_worker = on_worker_thread();
  on_worker_thread() = true;
  std::exception_ptr error = execute(item, id == LaneId::kMain);
  on_worker_thread() = was_worker;
  // Note [Finished before complete]: the lane is idle again before anyone can see the work
  // complete.
  finished(lane);
  cv_.notify_all();  // the lane's pool thread, held back by lane.busy, may start the next one
  item.work->complete(error);
  return true;
}

Executor::Item Executor::take_front(Lane& lane) {
  Item item = std::move(lane.queue.front());
  lane.queue.pop_front();
  lane.busy = true;
  return item;
}

void Executor::finished(Lane& lane) {
  std::lock_guard<std::mutex> lk(mu_);
  lane.busy = false;
  --lane.pending;
  idle_cv_.notify_all();
}

void Executor::drain(Lane& lane) {
  ActiveIn active(this);
  const bool main = &lane == &main_;
  while (true) {
    Item item;
    {
      std::unique_lock<std::mutex> lk(mu_);
      // A waiter running the lane's work in its own thread (run_next) goes first.
      cv_.wait(lk, [&] { return !lane.busy || lane.queue.empty(); });
      if (lane.queue.empty()) {
        // The last touch of this executor: shutdown() waits for it under mu_.
        lane.scheduled = false;
        idle_cv_.notify_all();
        return;
      }
      item = take_front(lane);
    }
    std::exception_ptr error = execute(item, main);
    // Note [Finished before complete]: a caller whose wait() returns because this work
    // completed may issue the next operation at once, and the eager paths (try_now,
    // try_send_now, the inline synchronous call) take it only while the lane has nothing
    // pending. Completing first left a window in which the finished work still counted as
    // pending, and the next small isend was queued instead of done at once (a flaky
    // test_p2p_matches_payload_bit_for_bit under load).
    finished(lane);
    // Note [Callbacks run on the lane's thread]
    // Completing the work runs its future's callbacks here, and the lane waits for them. A
    // callback that waits for later work of the lane through Work::wait() runs that work
    // itself (Note [Waiting runs the work]); one that blocks on a Future's wait() waits for
    // this thread, i.e. for itself (gloo, whose two worker threads run works side by side,
    // completes such a program). Leaving the lane to another pool thread before completing
    // every work whose future was taken fixed that, but cost one thread hand-off per
    // completion: 2 ranks x 8 async 1 MiB all_reduces with a then() callback each (DDP's
    // pattern) took 1780-1833 us per iteration instead of 1173-1387 us. Not worth it for a
    // callback that blocks, which the docs ask users not to do.
    item.work->complete(error);
    // Note [Tensors are released in the caller's thread].
    std::lock_guard<std::mutex> lk(mu_);
    released_.push_back(std::move(item));
  }
}

void Executor::release_finished() {
  std::vector<Item> dead;
  std::lock_guard<std::mutex> lk(mu_);
  dead.swap(released_);
}

// Note [Receives wait side by side]
// A receive waits for its message, which may come much later, and after messages that
// later receives want. Queued on the main lane, a waiting irecv held up everything behind
// it: a recv with another tag or from another rank whose message was already there (gloo
// completes it; smddp timed out, a deadlock of a valid program), the group's collectives,
// and destroy_process_group, which waited for the queue for the whole group timeout. So
// receives that cannot complete at once wait together, apart from the lanes: one pool
// thread attempts each of them in the order they were posted, without blocking
// (Communicator::poll_recv: a message with the receive's tag is taken if it has arrived,
// messages with other tags that are in the way are set aside), and completes those that
// got their message. Posting order decides which of two receives for the same source and
// tag gets the earlier message, as MPI's non-overtaking rule and gloo have it: in a round,
// a receive is not attempted after an earlier one that could take the same message found
// nothing (the message may have arrived in between). A receive from a rank over TCP is
// attempted under exec_mu_, like the lanes' work, because the mesh's read buffers are
// shared with the collectives (which set aside what they do not want, so a sender is never
// held up by them). A receive over shared memory is not: its ring is its own, and a
// collective waiting for a peer that is itself stuck sending a message larger than the
// ring would otherwise deadlock both. An attempt that finds a message begun in a ring
// reads it to its end; over TCP, a receive from one rank reads its message straight into
// its buffer and, once it has begun, waits for the rest (Note [Direct receives over TCP]
// in tcp_exchange.cpp). Between rounds
// that found nothing the thread polls for 20 us (SMDDP_WORKER_SPIN_US's default), then backs
// off to 200 us sleeps, so a receive that waits long costs little CPU and learns of its
// message at most that late. A thread that waits for a receive's Work runs the rounds
// itself meanwhile (as Note [Waiting runs the work] has it for the main lane): it polls for
// 200 us, then sleeps for pauses that double from 10 us to 50 us, so a waited-for receive
// completes without a thread hand-off, and a long wait costs little CPU. (A waiting
// receive is not woken by its sender, as a blocking one in a ring was: a waiting thread
// cannot sleep on several rings at once.) Shutdown cancels the
// receives still waiting (gloo's destroy does not wait for an unmatched irecv either);
// queued collectives still run to their end.
void Executor::submit_receive(Attempt attempt, c10::intrusive_ptr<SmddpWork> work, int src,
                              int64_t tag, bool exclusive) {
  std::vector<Item> dead;  // destroyed after the lock (Note [Tensors are released in ...])
  std::lock_guard<std::mutex> g(mu_);
  dead.swap(released_);
  if (stop_) {
    work->complete(
        std::make_exception_ptr(std::runtime_error("smddp: the process group was shut down")));
    return;
  }
  recv_.queue.push_back(Receive{std::move(attempt), std::move(work), src, tag, exclusive});
  ++recv_.pending;
  if (!recv_.scheduled) {
    recv_.scheduled = true;
    WorkerPool::instance().post([this] { drain_receives(); });
  }
}

void Executor::finish_receive(Receive& r, std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    --recv_.pending;
  }
  r.work->complete(error);
  // Note [Tensors are released in the caller's thread]: the attempt holds the tensors.
  std::lock_guard<std::mutex> lk(mu_);
  released_.push_back(Item{[held = std::move(r.attempt)] {}, std::move(r.work)});
}

bool Executor::receive_round() {
  bool stopping;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (recv_busy_) return false;  // another thread is running a round
    recv_busy_ = true;
    for (; !recv_.queue.empty(); recv_.queue.pop_front()) {
      recv_live_.push_back(std::move(recv_.queue.front()));
    }
    stopping = stop_;
  }
  // Completed after the round (Note [Receives complete after their round]).
  std::vector<std::pair<Receive, std::exception_ptr>> finished;
  if (stopping) {
    for (Receive& r : recv_live_) {
      finished.emplace_back(std::move(r), std::make_exception_ptr(std::runtime_error(
                                              "smddp: a receive still waiting for its message "
                                              "was cancelled: the process group was shut down")));
    }
    recv_live_.clear();
  }
  // Receives that found nothing in this round: a later receive that could take the same
  // message (same tag, same source or either from any rank) must not try before them,
  // or a message that arrived meanwhile would go to it first.
  std::vector<std::pair<int, int64_t>> empty_handed;  // (source, tag)
  auto blocked = [&](const Receive& r) {
    for (const auto& [src, tag] : empty_handed) {
      if (tag == r.tag && (src == r.src || src == kAnyPeer || r.src == kAnyPeer)) return true;
    }
    return false;
  };
  for (size_t i = 0; i < recv_live_.size();) {
    Receive& r = recv_live_[i];
    bool done = false;
    std::exception_ptr error;
    if (!blocked(r)) {
      std::unique_lock<std::mutex> g(exec_mu_, std::defer_lock);
      if (r.exclusive) g.lock();
      try {
        done = r.attempt();
      } catch (...) {
        error = std::current_exception();
        done = true;
      }
    }
    if (!done) {
      empty_handed.emplace_back(r.src, r.tag);
      ++i;
      continue;
    }
    finished.emplace_back(std::move(r), error);
    recv_live_.erase(recv_live_.begin() + static_cast<std::ptrdiff_t>(i));
  }
  const bool progress = !finished.empty();
  {
    std::lock_guard<std::mutex> lk(mu_);
    recv_busy_ = false;
    for (auto& f : finished) recv_.done.push_back(std::move(f));
    idle_cv_.notify_all();  // shutdown() waits for the round to end
  }
  // Note [Receives complete after their round]
  // Completing a work runs its future's callbacks in the completing thread. A callback may
  // wait for another receive of the group: one still waiting needs a round, so the round
  // ends before any completion (run inside it, the wait found the rounds busy and polled
  // forever); one that finished in the same round is in recv_.done, which a waiting thread
  // completes itself (help_receive), so it need not wait for the callback that waits for it.
  // shutdown() waits for the completions as it waits for a round.
  while (complete_one_receive()) {
  }
  return progress;
}

bool Executor::complete_one_receive() {
  std::pair<Receive, std::exception_ptr> next;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (recv_.done.empty()) return false;
    next = std::move(recv_.done.front());
    recv_.done.pop_front();
    ++recv_.completing;
  }
  struct Done {  // also when a callback throws
    Executor& e;
    ~Done() {
      std::lock_guard<std::mutex> lk(e.mu_);
      --e.recv_.completing;
      e.idle_cv_.notify_all();
    }
  } done{*this};
  finish_receive(next.first, next.second);
  return true;
}

void Executor::drain_receives() {
  ActiveIn active(this);
  ReceiveBackoff backoff(std::chrono::microseconds(20), std::chrono::microseconds(200));
  while (true) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!recv_busy_ && recv_.queue.empty() && recv_live_.empty() && recv_.done.empty()) {
        // The last touch of this executor: shutdown() waits for it under mu_.
        recv_.scheduled = false;
        idle_cv_.notify_all();
        return;
      }
    }
    if (recv_helpers_.load() > 0) {
      // A waiting thread polls (help_receive): two pollers would only take turns.
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      continue;
    }
    backoff.after(receive_round());
  }
}

bool Executor::help_receive(SmddpWork& work) {
  // The waiting thread has nothing else to do: it polls without sleeping for 200 us (the
  // default spin of a caller's wait on shared memory, SMDDP_SPIN_US), then sleeps in pauses
  // that double up to 50 us, so a long wait takes little of a core from the other ranks.
  ReceiveBackoff backoff(std::chrono::microseconds(200), std::chrono::microseconds(50));
  ActiveIn active(this);
  recv_helpers_.fetch_add(1);
  while (!work.isCompleted()) {
    if (complete_one_receive() || run_next(LaneId::kMain)) continue;
    backoff.after(receive_round());
  }
  recv_helpers_.fetch_sub(1);
  return true;
}

ReceiveBackoff::ReceiveBackoff(std::chrono::microseconds spin, std::chrono::microseconds longest)
    : spin_(spin), longest_(longest) {}

void ReceiveBackoff::after(bool progress) {
  const auto now = std::chrono::steady_clock::now();
  if (progress || idle_since_ == std::chrono::steady_clock::time_point{}) {
    idle_since_ = now;
    pause_ = std::chrono::microseconds(0);
    return;
  }
  if (now - idle_since_ < spin_) {
    std::this_thread::yield();
    return;
  }
  pause_ = std::min(std::max(pause_ * 2, std::chrono::microseconds(10)), longest_);
  std::this_thread::sleep_for(pause_);
}

void Executor::shutdown() {
  std::unique_lock<std::mutex> lk(mu_);
  stop_ = true;
  cv_.notify_all();
  // Queued work still runs (as before, when the lane threads drained it before joining),
  // and a waiter running one in its own thread (run_next: main-lane work, or a send for a
  // send's waiter) finishes it: the lane's thread leaves once the queue is empty, while that
  // work may still be running, hence the pending counts beside `scheduled`.
  idle_cv_.wait(lk, [&] {
    return !main_.scheduled && !send_.scheduled && main_.pending == 0 && send_.pending == 0 &&
           !recv_.scheduled && !recv_busy_ && recv_.done.empty() && recv_.completing == 0;
  });
  std::vector<Item> dead;
  dead.swap(released_);
  lk.unlock();
}

}  // namespace smddp
