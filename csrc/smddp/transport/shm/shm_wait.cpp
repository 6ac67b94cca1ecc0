// How a local rank waits for its peers' words (the waiting policy and Note [Spin only where
// it pays]), and what it checks while it waits: failures, exits, the deadline and mismatched
// collectives. The step protocol that publishes those words is in shm.cpp.

#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstring>

#include "smddp/transport/shm/shm.h"

namespace smddp {
namespace {

// Futexes on the low 32 bits of a progress word (x86-64 is little endian). The words are in
// memory shared between processes, so the non-private futex ops are used.
uint32_t* low_word(std::atomic<uint64_t>* w) { return reinterpret_cast<uint32_t*>(w); }

void futex_wait(uint32_t* addr, uint32_t expected, int timeout_us) {
  timespec ts{0, static_cast<long>(timeout_us) * 1000};
  syscall(SYS_futex, addr, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake(uint32_t* addr) {
  syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// Moves the calling thread off `cpu` by briefly excluding it from the thread's affinity
// mask; the kernel migrates the thread at once, and restoring the mask leaves it where it
// landed. Returns false (and changes nothing) when the mask leaves no other CPU.
bool move_off_cpu(int cpu) {
  cpu_set_t allowed;
  if (cpu < 0 || sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return false;
  if (!CPU_ISSET(cpu, &allowed) || CPU_COUNT(&allowed) < 2) return false;
  cpu_set_t others = allowed;
  CPU_CLR(cpu, &others);
  if (sched_setaffinity(0, sizeof(others), &others) != 0) return false;
  sched_setaffinity(0, sizeof(allowed), &allowed);
  return true;
}

// Throttles of the waits, per thread: point-to-point waits run on the send lane while
// collectives wait on the main lane.
thread_local Clock::time_point t_last_move{};       // last time a wait moved this thread
thread_local Clock::time_point t_last_pid_check{};  // last time a wait looked for dead peers

}  // namespace

// Waiting policy. When the peer runs on another core: a busy spin (sub-microsecond
// hand-offs), then a futex sleep. When there are more local ranks than cores (or more ranks
// of the group on this machine than its cores: Note [Hosts that share CPUs] in comm.cpp),
// the peer may need *our* core: sched_yield for a while (~4 us per hand-off on one core),
// then sleep.
// When there are enough cores but the scheduler stacked the peer on this CPU (its wake-up
// heuristics like to do that with processes that talk to each other, and a busy pair is
// then rarely split: measured 40 us per small all-reduce instead of 9 for whole benchmark
// cases), the waiter sleeps, which leaves the CPU to the peer; with SMDDP_MOVE_OFF_CPU=1 it
// steps onto another CPU instead (move_off_cpu, at most every few milliseconds so two ranks
// cannot chase each other) and spins on. Moving is opt-in: it changes the thread's CPU
// affinity for an instant, which a host that pins threads itself must not see.
// Futex sleeps are 1 ms slices so the deadline, the peers' failure flags and whether the
// peer process still exists are checked regularly.
//
// Note [Spin only where it pays]
// A busy spin wins a wake-up's latency when the peer comes within the budget, and burns the
// whole budget of a core when it does not. Inside a hierarchical collective a local peer's
// step often comes late: that peer is sending or receiving between its steps (Note [Pipelined
// exchanges] in comm_hier.cpp), and on a machine whose cores also carry the network stack
// each spin took CPU from the sockets the collective waited on. So a step's wait learns from
// the step waits before it (wait_progress; per ShmComm, so per group, and per budget, the
// caller thread's and the worker threads'): after kSpinMissesToStop waits in a row that
// lasted longer than the budget, they sleep at once, and the first that ends within the
// budget again (timed whether it spun or slept, or found the peer there already) turns the
// spin back on; at worst a short wait after two long ones pays one wake-up. Point-to-point
// and finish waits keep the fixed spin. Only groups that span hosts adapt
// (ShmConfig::spin_adapts). On one host nothing but the peers' own work delays a step, and
// there sleeping waits let the scheduler stack both ranks of a 2-rank group on one CPU (its
// wake-up heuristics, see the policy above): with every group adapting, bench collectives (2
// ranks, 1 KiB-64 MiB) ran 2-4x slower from 512 KiB in 3 of 8 runs, against none of 8 runs
// of the build before. On 4 simulated hosts of 2 ranks at 2 Gbit/s (bench multihost, cubic,
// alternating builds), the ratio of the medians of the fraction of the NIC bound, adapting over
// spinning, 16 and 64 MiB, in three sets of 4, 3 and 3 rounds: all_reduce 1.05 and 1.03, 1.01
// and 1.03, 0.99 and 0.98; reduce_scatter 1.03 and 1.04, 1.05 and 1.01, 1.01 and 1.01;
// all_gather 0.98-1.02. SMDDP_SPIN_US=0 in the first set matched adapting. A small gain in
// the noise of these runs, then; it is kept because a spin that outlasts its budget is lost
// work by construction, and here the sockets needed the core.
void ShmComm::wait_progress(int i, uint64_t target, const OpCtx& ctx) {
  RankControl* c = ctl(i);
  if (c->progress.load(std::memory_order_acquire) >= target) {
    // A wait that needed no time is a short one (Note [Spin only where it pays]).
    if (cfg_.spin_adapts) spin_misses_[on_worker_thread()].store(0, std::memory_order_relaxed);
    return;
  }
  wait_word(
      i, c->progress, c->sleepers, target, [&] { check_health(i, target, ctx); }, cfg_.spin_adapts);
}

void ShmComm::wait_word(int i, const std::atomic<uint64_t>& word, std::atomic<uint32_t>& sleepers,
                        uint64_t target, const std::function<void()>& health, bool adapt) {
  RankControl* c = ctl(i);
  if (word.load(std::memory_order_acquire) >= target) return;
  // Note [Spin only where it pays]: after kSpinMissesToStop step waits in a row that
  // outlasted the budget, step waits skip the busy spin until one is short again.
  const bool worker = on_worker_thread();
  const int budget = worker ? worker_spin_us_ : spin_us_;
  std::atomic<int>& misses = spin_misses_[worker];
  const auto began = Clock::now();
  const auto limit = std::chrono::microseconds(budget);
  auto learn = [&] {
    if (!adapt) return;
    if (Clock::now() - began < limit) {
      misses.store(0, std::memory_order_relaxed);
    } else if (misses.load(std::memory_order_relaxed) < kSpinMissesToStop) {
      misses.fetch_add(1, std::memory_order_relaxed);
    }
  };
  if (!oversubscribed_) {
    bool shared_core = false;
    const bool spin = !adapt || misses.load(std::memory_order_relaxed) < kSpinMissesToStop;
    auto spin_until = began + (spin ? limit : std::chrono::microseconds(0));
    do {
      for (int k = 0; k < 64; ++k) {
        cpu_relax();
        if (word.load(std::memory_order_acquire) >= target) {
          learn();
          return;
        }
      }
      int cpu = sched_getcpu();
      shared_core = c->cpu.load(std::memory_order_relaxed) == cpu;
      if (shared_core && cfg_.move_off_cpu &&
          Clock::now() - t_last_move > std::chrono::milliseconds(5)) {
        t_last_move = Clock::now();
        if (move_off_cpu(cpu)) {
          ctl(rank())->cpu.store(sched_getcpu(), std::memory_order_relaxed);
          shared_core = false;
        }
      }
    } while (!shared_core && Clock::now() < spin_until);
    health();
  } else {
    auto yield_until = Clock::now() + std::chrono::microseconds(2000);
    while (true) {
      for (int k = 0; k < 32; ++k) {
        sched_yield();
        if (word.load(std::memory_order_acquire) >= target) return;
      }
      health();
      if (Clock::now() > yield_until) break;
    }
  }
  while (true) {
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    uint64_t v = word.load(std::memory_order_seq_cst);
    if (v < target)
      futex_wait(low_word(const_cast<std::atomic<uint64_t>*>(&word)), static_cast<uint32_t>(v),
                 1000);
    sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (word.load(std::memory_order_acquire) >= target) {
      learn();
      return;
    }
    health();
  }
}

void ShmComm::publish(std::atomic<uint64_t>& word, std::atomic<uint32_t>& sleepers,
                      uint64_t value) {
  // The Dekker-style handshake of post().
  word.store(value, std::memory_order_seq_cst);
  if (sleepers.load(std::memory_order_seq_cst) != 0) futex_wake(low_word(&word));
}

void ShmComm::check_peer(int i, const OpCtx& ctx, const std::string& waiting_for) {
  const std::string where = "smddp: " + ctx.describe() + " on group '" + cfg_.group_name + "'";
  const std::string peer = "rank " + std::to_string(cfg_.group_ranks[i]);
  if (aborted_.load()) throw CommError(where + " was aborted: the process group was shut down");
  if (ctl(i)->failed.load(std::memory_order_acquire)) {
    throw CommError(where + " failed because " + peer + " failed: " + failure_message(i));
  }
  auto now = Clock::now();
  if (now - t_last_pid_check > std::chrono::milliseconds(20)) {
    t_last_pid_check = now;
    if (process_gone(i))
      throw CommError(where + " failed: " + peer + " exited (its process is gone)");
  }
  if (ctx.deadline.expired()) {
    char secs[32];
    snprintf(secs, sizeof(secs), "%.1f", ctx.deadline.seconds);
    throw CommError(where + " timed out after " + secs +
                    " s (the timeout of this group) waiting for " + peer + " " + waiting_for);
  }
}

bool ShmComm::process_gone(int i) const {
  // A peer in another PID namespace (a container sharing this IPC namespace) has a pid that
  // means nothing here: its death shows only through its failure flag or the timeout.
  const RankControl* c = ctl(i);
  if (strncmp(c->pid_ns, pid_namespace_id().c_str(), sizeof(c->pid_ns)) != 0) return false;
  return !process_alive(c->pid);
}

std::string ShmComm::failure_message(int i) const {
  const char* m = ctl(i)->message;
  return std::string(m, strnlen(m, sizeof(ctl(i)->message)));
}

std::string ShmComm::where(const OpCtx& ctx) const {
  return "smddp: " + ctx.describe() + " on group '" + cfg_.group_name + "' (collective #" +
         std::to_string(ctx.seq) + ")";
}

void ShmComm::check_local_peers(const OpCtx& ctx, std::optional<uint64_t> needed_progress) {
  if (aborted_.load())
    throw CommError(where(ctx) + " was aborted: the process group was shut down");
  for (int j = 0; j < size(); ++j) {
    if (j != rank() && ctl(j)->failed.load(std::memory_order_acquire)) {
      fail(where(ctx) + " failed because rank " + std::to_string(cfg_.group_ranks[j]) +
           " failed: " + failure_message(j));
    }
  }
  auto now = Clock::now();
  if (now - t_last_pid_check > std::chrono::milliseconds(20)) {
    t_last_pid_check = now;
    std::vector<int> dead;
    for (int j = 0; j < size(); ++j) {
      if (j == rank()) continue;
      // Note [Exits are not failures]: only a rank this wait still needs counts. Its words
      // are read after its exit was seen, so they hold everything it did before exiting.
      const RankControl* c = ctl(j);
      if (!process_gone(j)) continue;
      bool owes = needed_progress ? c->progress.load(std::memory_order_acquire) < *needed_progress
                                  : c->finished.load(std::memory_order_acquire) <= ctx.seq;
      if (owes) dead.push_back(cfg_.group_ranks[j]);
    }
    if (!dead.empty()) {
      fail(where(ctx) + " failed: ranks " + format_ranks(dead) +
           " exited (their processes are gone)");
    }
  }
}

void ShmComm::mark_finished(uint64_t seq) {
  RankControl* me = ctl(rank());
  publish(me->finished, me->sleepers, seq + 1);
}

void ShmComm::wait_finished(int i, uint64_t seq_plus1, const OpCtx& ctx) {
  RankControl* c = ctl(i);
  if (c->finished.load(std::memory_order_acquire) >= seq_plus1) return;
  wait_word(i, c->finished, c->sleepers, seq_plus1, [&] {
    check_local_peers(ctx);
    if (!ctx.deadline.expired()) return;
    char secs[32];
    snprintf(secs, sizeof(secs), "%.1f", ctx.deadline.seconds);
    fail(where(ctx) + " timed out after " + secs +
         " s (the timeout of this group) waiting for rank " + std::to_string(cfg_.group_ranks[i]) +
         " to finish collective #" + std::to_string(seq_plus1 - 1) +
         " (it is hung, slower, or issued a different sequence of collectives)");
  });
}

void ShmComm::check_health(int i, uint64_t target, const OpCtx& ctx) {
  check_local_peers(ctx, target);
  if (ctx.deadline.expired()) {
    std::vector<int> missing;
    for (int j = 0; j < size(); ++j) {
      if (j != rank() && ctl(j)->progress.load() < target) missing.push_back(cfg_.group_ranks[j]);
    }
    if (missing.empty()) missing.push_back(cfg_.group_ranks[i]);
    char secs[32];
    snprintf(secs, sizeof(secs), "%.1f", ctx.deadline.seconds);
    fail(where(ctx) + " timed out after " + secs +
         " s (the timeout of this group) waiting for ranks " + format_ranks(missing) +
         " (they did not reach this collective: hung, slower, or issued a different sequence "
         "of collectives)");
  }
}

void ShmComm::check_desc(int i, const OpCtx& ctx) {
  const DescSlot& d = ctl(i)->desc[ctx.seq & 1];
  uint64_t seq_plus1 = d.seq_plus1.load(std::memory_order_acquire);
  if (seq_plus1 == ctx.seq + 1 && d.first_step == first_step_ && d.desc == ctx.desc) {
    checked_[i] = 1;
    return;
  }
  // Describe what the peer is doing: the newest of its two descriptors.
  const DescSlot& other = ctl(i)->desc[(ctx.seq + 1) & 1];
  const DescSlot& newest = other.seq_plus1.load() > seq_plus1 ? other : d;
  uint64_t their_seq = newest.seq_plus1.load();
  fail(mismatch_message(cfg_.group_name, cfg_.group_ranks[rank()], ctx.describe(), ctx.seq,
                        cfg_.group_ranks[i], newest.call.describe(),
                        their_seq ? their_seq - 1 : 0));
}

void ShmComm::mark_failed(const std::string& message) {
  RankControl* me = ctl(rank());
  if (!me || failing_.exchange(true)) return;  // the first failure's message stays
  std::strncpy(me->message, message.c_str(), sizeof(me->message) - 1);
  me->failed.store(1, std::memory_order_release);
  futex_wake(low_word(&me->progress));
}

void ShmComm::fail(const std::string& message) {
  mark_failed(message);
  throw CommError(message);
}

}  // namespace smddp
