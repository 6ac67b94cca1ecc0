// The receives of one group that wait for their message, polled beside the scheduler's lanes
// (Note [Receives wait side by side] in receive_poller.cpp).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

#include "smddp/common/completion.h"

namespace smddp {

// Pacing of rounds of receive attempts: after a round that found nothing, yield for
// `spin` since the last progress, then sleep for doubling pauses from 10 us up to `longest`.
class ReceiveBackoff {
 public:
  ReceiveBackoff(std::chrono::microseconds spin, std::chrono::microseconds longest);
  void after(bool progress);  // call after each round

 private:
  std::chrono::microseconds spin_, longest_;
  std::chrono::steady_clock::time_point idle_since_{};
  std::chrono::microseconds pause_{0};
};

class ReceivePoller {
 public:
  // One non-blocking try at a receive: true once its message is in, or raises.
  using Attempt = std::function<bool()>;
  using Post = std::function<void(std::function<void()>)>;
  // Takes a finished receive's attempt and sink, to be destroyed in the caller's thread.
  using Retire = std::function<void(Attempt, CompletionPtr)>;

  // `owner`: the scheduler, for ActiveScope; `exclusive`: its exclusive lock, which the
  // attempts of exclusive receives take.
  ReceivePoller(const void* owner, std::mutex& exclusive, Post post, Retire retire);

  // Queues a receive. `src` (or kAnyPeer) and `tag` say which messages it may take;
  // `exclusive`: its attempts must not overlap the main lane (see the note).
  void submit(Attempt attempt, CompletionPtr done, int src, int64_t tag, bool exclusive);
  // Runs `attempt` now when no receive waits and the exclusive lock is free; returns what
  // it returned, or false when it did not run.
  template <class F>
  bool try_now(F& attempt) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (pending_ || stop_) return false;
    }
    std::unique_lock<std::mutex> g(exclusive_, std::try_to_lock);
    return g.owns_lock() && attempt();
  }
  // One attempt at every waiting receive, in posting order, unless another thread is
  // running a round, then the completion of what finished; returns whether a receive
  // finished (or was cancelled).
  bool round();
  // Completes the first receive a round finished; false when there is none.
  bool complete_one();
  // The waiting thread's loop (Note [Receives wait side by side]): until done(), completes
  // what rounds finished, else runs `other` (a main-lane item), else runs a round.
  void help(const std::function<bool()>& done, const std::function<bool()>& other);
  // Cancels the receives still waiting (at the next round) and refuses new ones.
  void stop();
  // stop(), then waits until no thread runs a round or completes a receive and the pool
  // thread has left.
  void shutdown();
  size_t pending();  // queued or being attempted (for tests)

 private:
  struct Receive {
    Attempt attempt;
    CompletionPtr done;
    int src;  // group rank, or kAnyPeer
    int64_t tag;
    bool exclusive;  // attempts take the exclusive lock
  };
  void drain();  // on a pool thread: rounds until no receive is left
  void finish(Receive& r, std::exception_ptr error);

  const void* owner_;
  std::mutex& exclusive_;
  Post post_;
  Retire retire_;
  std::mutex mu_;
  std::condition_variable idle_cv_;  // a round or a completion ended, or the drain left
  std::deque<Receive> queue_;        // submitted, not yet taken by a round
  std::vector<Receive> live_;        // taken from queue_; only the round's runner uses it
  bool busy_ = false;                // a thread is running a round
  bool scheduled_ = false;           // a pool thread runs drain()
  // Finished in a round, to be completed (Note [Receives complete after their round]).
  std::deque<std::pair<Receive, std::exception_ptr>> done_;
  int completing_ = 0;  // threads completing one of done_
  size_t pending_ = 0;  // queued or being attempted
  bool stop_ = false;
  std::atomic<int> helpers_{0};  // threads in help()
};

}  // namespace smddp
