#include "smddp/common/receive_poller.h"

#include <algorithm>
#include <stdexcept>
#include <thread>

#include "smddp/common/common.h"

namespace smddp {

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
// attempted under the scheduler's exclusive lock, like the main lane's work, because the
// mesh's read buffers are shared with the collectives (which set aside what they do not
// want, so a sender is never held up by them). A receive over shared memory is not: its
// ring is its own, and a collective waiting for a peer that is itself stuck sending a
// message larger than the ring would otherwise deadlock both. An attempt that finds a
// message begun in a ring reads it to its end; over TCP, a receive from one rank reads its
// message straight into its buffer and, once it has begun, waits for the rest (Note [Direct
// receives over TCP] in tcp_exchange.cpp). Between rounds that found nothing the thread
// polls for 20 us (SMDDP_WORKER_SPIN_US's default), then backs off to 200 us sleeps, so a
// receive that waits long costs little CPU and learns of its message at most that late. A
// thread that waits for a receive's Work runs the rounds itself meanwhile (as Note [Waiting
// runs the work] in scheduler.h has it for the main lane): it polls for 200 us, then sleeps
// for pauses that double from 10 us to 50 us, so a waited-for receive completes without a
// thread hand-off, and a long wait costs little CPU. (A waiting receive is not woken by its
// sender, as a blocking one in a ring was: a waiting thread cannot sleep on several rings at
// once.) Shutdown cancels the receives still waiting (gloo's destroy does not wait for an
// unmatched irecv either); queued collectives still run to their end.

ReceivePoller::ReceivePoller(const void* owner, std::mutex& exclusive, Post post, Retire retire)
    : owner_(owner), exclusive_(exclusive), post_(std::move(post)), retire_(std::move(retire)) {}

void ReceivePoller::submit(Attempt attempt, CompletionPtr done, int src, int64_t tag,
                           bool exclusive) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!stop_) {
      queue_.push_back(Receive{std::move(attempt), std::move(done), src, tag, exclusive});
      ++pending_;
      if (!scheduled_) {
        scheduled_ = true;
        post_([this] { drain(); });
      }
      return;
    }
  }
  // Outside the lock: the completion may run callbacks that call in again.
  done->complete(
      std::make_exception_ptr(std::runtime_error("smddp: the process group was shut down")));
  retire_(std::move(attempt), std::move(done));
}

void ReceivePoller::finish(Receive& r, std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    --pending_;
  }
  r.done->complete(error);
  // Note [Tensors are released in the caller's thread] in scheduler.h: the attempt holds the
  // tensors.
  retire_(std::move(r.attempt), std::move(r.done));
}

bool ReceivePoller::round() {
  bool stopping;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (busy_) return false;  // another thread is running a round
    busy_ = true;
    for (; !queue_.empty(); queue_.pop_front()) live_.push_back(std::move(queue_.front()));
    stopping = stop_;
  }
  // Completed after the round (Note [Receives complete after their round]).
  std::vector<std::pair<Receive, std::exception_ptr>> finished;
  if (stopping) {
    for (Receive& r : live_) {
      finished.emplace_back(std::move(r), std::make_exception_ptr(std::runtime_error(
                                              "smddp: a receive still waiting for its message "
                                              "was cancelled: the process group was shut down")));
    }
    live_.clear();
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
  for (size_t i = 0; i < live_.size();) {
    Receive& r = live_[i];
    bool done = false;
    std::exception_ptr error;
    if (!blocked(r)) {
      std::unique_lock<std::mutex> g(exclusive_, std::defer_lock);
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
    live_.erase(live_.begin() + static_cast<std::ptrdiff_t>(i));
  }
  const bool progress = !finished.empty();
  {
    std::lock_guard<std::mutex> lk(mu_);
    busy_ = false;
    for (auto& f : finished) done_.push_back(std::move(f));
    idle_cv_.notify_all();  // shutdown() waits for the round to end
  }
  // Note [Receives complete after their round]
  // Completing a receive runs its future's callbacks in the completing thread. A callback may
  // wait for another receive of the group: one still waiting needs a round, so the round
  // ends before any completion (run inside it, the wait found the rounds busy and polled
  // forever); one that finished in the same round is in done_, which a waiting thread
  // completes itself (help()), so it need not wait for the callback that waits for it.
  // shutdown() waits for the completions as it waits for a round.
  while (complete_one()) {
  }
  return progress;
}

bool ReceivePoller::complete_one() {
  std::pair<Receive, std::exception_ptr> next;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (done_.empty()) return false;
    next = std::move(done_.front());
    done_.pop_front();
    ++completing_;
  }
  struct Done {  // also when a callback throws
    ReceivePoller& p;
    ~Done() {
      std::lock_guard<std::mutex> lk(p.mu_);
      --p.completing_;
      p.idle_cv_.notify_all();
    }
  } done{*this};
  finish(next.first, next.second);
  return true;
}

void ReceivePoller::drain() {
  ActiveScope active(owner_);
  ReceiveBackoff backoff(std::chrono::microseconds(20), std::chrono::microseconds(200));
  while (true) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!busy_ && queue_.empty() && live_.empty() && done_.empty()) {
        // The last touch of this poller: shutdown() waits for it under mu_.
        scheduled_ = false;
        idle_cv_.notify_all();
        return;
      }
    }
    if (helpers_.load() > 0) {
      // A waiting thread polls (help()): two pollers would only take turns.
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      continue;
    }
    backoff.after(round());
  }
}

void ReceivePoller::help(const std::function<bool()>& done, const std::function<bool()>& other) {
  // The waiting thread has nothing else to do: it polls without sleeping for 200 us (the
  // default spin of a caller's wait on shared memory, SMDDP_SPIN_US), then sleeps in pauses
  // that double up to 50 us, so a long wait takes little of a core from the other ranks.
  ReceiveBackoff backoff(std::chrono::microseconds(200), std::chrono::microseconds(50));
  ActiveScope active(owner_);
  helpers_.fetch_add(1);
  struct Leave {  // also when a completion's callback throws
    std::atomic<int>& helpers;
    ~Leave() { helpers.fetch_sub(1); }
  } leave{helpers_};
  while (!done()) {
    if (complete_one() || other()) continue;
    backoff.after(round());
  }
}

void ReceivePoller::stop() {
  // The drain's next round cancels what waits (a receive waits only while scheduled_).
  std::lock_guard<std::mutex> lk(mu_);
  stop_ = true;
}

void ReceivePoller::shutdown() {
  stop();
  std::unique_lock<std::mutex> lk(mu_);
  idle_cv_.wait(lk, [&] { return !scheduled_ && !busy_ && done_.empty() && completing_ == 0; });
}

size_t ReceivePoller::pending() {
  std::lock_guard<std::mutex> lk(mu_);
  return pending_;
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

}  // namespace smddp
