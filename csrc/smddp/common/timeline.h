// Where a collective's time goes: the phases of each call on one rank, with their times.
//
// Note [Timeline]
// With SMDDP_TIMELINE=1 a group records when each collective began and ended on this rank,
// and for those that cross hosts when each of their phases did: the shared-memory steps,
// the exchanges over the network, the reductions of what arrived (bench multihost --timeline prints
// them side by side for every rank). Times are CLOCK_MONOTONIC nanoseconds, one clock for every
// process on a machine, so the simulated hosts of the benchmark, which share the machine,
// line up without any clock alignment. Off (the default), recording is one branch per
// phase. The record keeps the newest kCapacity spans. Staged calls on device tensors record
// their own phases on a timeline of their group's Stager (Note [Staging timeline] in
// backend/device_staging.h; bench gpu --timeline prints them).
#pragma once

#include <time.h>

#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

namespace smddp {

class Timeline {
 public:
  struct Span {
    uint64_t seq = 0;        // the collective's sequence number in its group
    const char* phase = "";  // a string literal
    int64_t begin_ns = 0, end_ns = 0;
    uint64_t bytes = 0;  // what the phase moved or reduced (0: not counted)
  };
  static constexpr size_t kCapacity = 1 << 16;

  void enable(bool on) { on_ = on; }
  bool enabled() const { return on_; }

  static int64_t now_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
  }

  // Records [begin_ns, now) as `phase` of collective `seq`.
  void record(uint64_t seq, const char* phase, int64_t begin_ns, uint64_t bytes = 0) {
    if (!on_) return;
    record_span(seq, phase, begin_ns, now_ns(), bytes);
  }
  // Records [begin_ns, end_ns) (spans that must end together take one reading of the clock).
  void record_span(uint64_t seq, const char* phase, int64_t begin_ns, int64_t end_ns,
                   uint64_t bytes = 0) {
    if (!on_) return;
    std::lock_guard<std::mutex> g(mu_);
    if (spans_.size() == kCapacity) spans_.pop_front();
    spans_.push_back({seq, phase, begin_ns, end_ns, bytes});
  }

  // Records the time from its construction to its end.
  class Phase {
   public:
    Phase(Timeline& t, uint64_t seq, const char* phase, uint64_t bytes = 0)
        : t_(t), seq_(seq), phase_(phase), bytes_(bytes), begin_(t.on_ ? now_ns() : 0) {}
    ~Phase() { t_.record(seq_, phase_, begin_, bytes_); }
    Phase(const Phase&) = delete;
    Phase& operator=(const Phase&) = delete;

   private:
    Timeline& t_;
    uint64_t seq_;
    const char* phase_;
    uint64_t bytes_;
    int64_t begin_;
  };

  // The spans recorded since the last call, oldest first.
  std::vector<Span> take() {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<Span> out(spans_.begin(), spans_.end());
    spans_.clear();
    return out;
  }

 private:
  bool on_ = false;
  std::mutex mu_;
  std::deque<Span> spans_;
};

}  // namespace smddp
