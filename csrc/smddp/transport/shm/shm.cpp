#include "smddp/transport/shm/shm.h"

#include <fcntl.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <thread>

#include "smddp/transport/shm/shm_names.h"

namespace smddp {
namespace {

constexpr uint64_t kMagic = 0x736d646470763031ull;  // "smddpv01"
constexpr size_t kControlBytes = 4096;

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

int online_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::thread::hardware_concurrency());
}

ShmComm::ShmComm(ShmConfig cfg) : cfg_(std::move(cfg)) {
  int n = size();
  // The sizes come from settings: a wrapped-around sum would map less than the algorithms
  // then write to.
  const char* what =
      "the shared-memory segment size (SMDDP_BUFFER_BYTES, SMDDP_POOL_BYTES, SMDDP_P2P_BYTES)";
  main_bytes_ = checked_add(kControlBytes, checked_mul(2, cfg_.buffer_bytes, what), what);
  const size_t p2p_region =
      cfg_.p2p_bytes ? checked_mul(n, checked_add(4096, cfg_.p2p_bytes, what), what) : 0;
  seg_bytes_ = checked_add(checked_add(main_bytes_, cfg_.pool_bytes, what), p2p_region, what);
  if (seg_bytes_ > static_cast<size_t>(INT64_MAX)) {
    throw std::invalid_argument(std::string("smddp: ") + what + " of " +
                                std::to_string(seg_bytes_) +
                                " bytes is more than a file can hold (2^63 bytes)");
  }
  pool_base_.assign(n, nullptr);
  p2p_base_.assign(n, nullptr);
  ctl_.assign(n, nullptr);
  data_.assign(n, nullptr);
  maps_.assign(n, nullptr);
  checked_.assign(n, 0);
  oversubscribed_ = n > (cfg_.cpus > 0 ? cfg_.cpus : online_cpus());
  spin_us_ = cfg_.spin_us;
  worker_spin_us_ = cfg_.worker_spin_us;
  // Oversubscribed ranks pay a context switch per hand-off: fewer, larger steps.
  // 512 KiB measured 15-25% faster than 256 KiB for 1-4 MiB all-reduces on 2 ranks (fewer
  // syncs; a step's data still fits the 1 MiB L2 of these cores).
  size_t chunk_default = oversubscribed_ ? (1 << 20) : (512 << 10);
  chunk_bytes_ =
      std::min<size_t>(cfg_.buffer_bytes, cfg_.chunk_bytes ? cfg_.chunk_bytes : chunk_default);
  chunk_bytes_ = std::max<size_t>(chunk_bytes_, 256);
  long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  size_t cache = l3 > 0 ? static_cast<size_t>(l3) : (32u << 20);
  stream_bytes_ = cfg_.stream_bytes >= 0 ? static_cast<size_t>(cfg_.stream_bytes) : cache / 2 / n;
  static_assert(sizeof(RankControl) <= kControlBytes, "control block too large");
  lazy_ = can_commit_pages();
  while ((size_t(1) << granule_shift_) * 64 < cfg_.buffer_bytes) ++granule_shift_;
}

namespace {
std::string no_room(const std::string& group, size_t bytes, const char* what, int err) {
  // MADV_POPULATE_WRITE reports a page that tmpfs cannot back as EFAULT ("Bad address").
  return "smddp: group '" + group + "': /dev/shm has no room for " + std::to_string(bytes) +
         " more bytes of " + what + " (" + (err == EFAULT ? "it is full" : std::strerror(err)) +
         "); free space in /dev/shm or lower SMDDP_BUFFER_BYTES / SMDDP_POOL_BYTES / "
         "SMDDP_P2P_BYTES (SMDDP_P2P_BYTES=0 sends point-to-point messages over TCP instead)";
}
}  // namespace

void ShmComm::writable(uint64_t buffer, size_t off, size_t len) {
  const size_t first = off >> granule_shift_, last = (off + len - 1) >> granule_shift_;
  const uint64_t upto = last >= 63 ? ~uint64_t(0) : (uint64_t(1) << (last + 1)) - 1;
  const uint64_t want = upto & ~((uint64_t(1) << first) - 1);
  uint64_t& have = committed_[buffer];
  if ((have & want) == want) return;
  const size_t granule = size_t(1) << granule_shift_;
  char* base = data_[rank()] + buffer * cfg_.buffer_bytes;
  for (size_t g = first; g <= last; ++g) {
    if (have >> g & 1) continue;
    const size_t at = g * granule;
    if (!commit_pages(base + at, std::min(granule, cfg_.buffer_bytes - at))) {
      throw CommError(no_room(cfg_.group_name, granule, "this rank's data buffers", errno));
    }
    have |= uint64_t(1) << g;
  }
}

void ShmComm::commit_ring(int to, size_t off, size_t len) {
  if (!lazy_) return;  // the whole region was allocated at creation
  if (!commit_pages(ring(rank(), to) + off, len)) {
    throw CommError(no_room(cfg_.group_name, len, "this rank's point-to-point ring", errno));
  }
}

ShmComm::~ShmComm() {
  for (size_t i = 0; i < maps_.size(); ++i) {
    if (maps_[i]) munmap(maps_[i], main_bytes_);
    // My own pool mapping belongs to pool_, which tensors allocated from it keep alive.
    if (pool_base_[i] && static_cast<int>(i) != rank()) munmap(pool_base_[i], cfg_.pool_bytes);
    if (p2p_base_[i]) munmap(p2p_base_[i], p2p_region_bytes());
  }
  if (own_linked_) unlink_own();
}

namespace {
// Maps the pool or channel part of a segment: not pre-faulted, pages are committed as they
// are used.
char* map_lazy(int fd, size_t offset, size_t bytes) {
  void* p =
      mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(offset));
  return p == MAP_FAILED ? nullptr : static_cast<char*>(p);
}
}  // namespace

void ShmComm::create() {
  // Note [Segment lifetime]: segments of dead processes (a job killed during set-up) go
  // first; then mine, guarded against a SIGTERM until every peer mapped it.
  sweep_dead_segments();
  const std::string name = segment_name(cfg_.nonce, std::to_string(rank()));
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    throw CommError("smddp: cannot create shared memory segment " + name + ": " +
                    std::strerror(errno));
  }
  name_ = name;
  own_linked_ = true;
  term_guard_ = std::make_unique<UnlinkOnTerm>(name_);
  if (ftruncate(fd, static_cast<off_t>(seg_bytes_)) != 0) {
    int e = errno;
    close(fd);
    unlink_own();
    throw CommError("smddp: cannot size shared memory segment " + name + " to " +
                    std::to_string(seg_bytes_) +
                    " bytes (is /dev/shm large enough?): " + std::strerror(e));
  }
  // Note [One transport per process] in work.h: with lazy buffers only the control block
  // is committed now; without, everything is pre-faulted as it always was.
  void* p = mmap(nullptr, main_bytes_, PROT_READ | PROT_WRITE,
                 MAP_SHARED | (lazy_ ? 0 : MAP_POPULATE), fd, 0);
  if (p != MAP_FAILED && lazy_ && !commit_pages(static_cast<char*>(p), kControlBytes)) {
    munmap(p, main_bytes_);
    p = MAP_FAILED;
  }
  char* pool = nullptr;
  if (p != MAP_FAILED && cfg_.pool_bytes) pool = map_lazy(fd, main_bytes_, cfg_.pool_bytes);
  char* p2p = nullptr;
  if (p != MAP_FAILED && p2p_region_bytes()) {
    p2p = map_lazy(fd, main_bytes_ + cfg_.pool_bytes, p2p_region_bytes());
  }
  // Note [Shared-memory point-to-point]: the channels' control pages are written below, and
  // by the receivers; without lazy commits the whole region is allocated now.
  bool no_room_for_p2p = false;
  for (int to = 0; p2p && lazy_ && to < size() && !no_room_for_p2p; ++to) {
    no_room_for_p2p = !commit_pages(p2p + to * channel_slot(), 4096);
  }
  if (p2p && !lazy_) {
    const int e = posix_fallocate(fd, static_cast<off_t>(main_bytes_ + cfg_.pool_bytes),
                                  static_cast<off_t>(p2p_region_bytes()));
    no_room_for_p2p = e != 0;
    if (e) errno = e;
  }
  if (p == MAP_FAILED || (cfg_.pool_bytes && !pool) || (p2p_region_bytes() && !p2p) ||
      no_room_for_p2p) {
    int e = errno;
    if (p != MAP_FAILED) munmap(p, main_bytes_);
    if (pool) munmap(pool, cfg_.pool_bytes);
    if (p2p) munmap(p2p, p2p_region_bytes());
    close(fd);
    unlink_own();
    if (no_room_for_p2p) {
      throw CommError(
          no_room(cfg_.group_name, size() * size_t(4096), "point-to-point control pages", e));
    }
    throw CommError("smddp: cannot map shared memory segment " + name + ": " + std::strerror(e));
  }
  if (pool) {
    pool_ = std::make_shared<ShmPool>(fd, main_bytes_, pool, cfg_.pool_bytes);  // owns fd
    pool_base_[rank()] = pool;
  } else {
    close(fd);
  }
  maps_[rank()] = p;
  p2p_base_[rank()] = p2p;
  for (int to = 0; p2p && to < size(); ++to) new (p2p + to * channel_slot()) ChannelCtl();
  auto* c = new (p) RankControl();
  c->pid = getpid();
  std::strncpy(c->pid_ns, pid_namespace_id().c_str(), sizeof(c->pid_ns) - 1);
  ctl_[rank()] = c;
  data_[rank()] = static_cast<char*>(p) + kControlBytes;
  // The magic number is written last: a peer that maps the segment checks it.
  std::atomic_thread_fence(std::memory_order_release);
  c->magic = kMagic;
}

void ShmComm::attach(int peer, const std::string& name) {
  if (peer == rank()) return;
  if (name.rfind("/smddp_", 0) != 0 || name.find('/', 1) != std::string::npos) {
    throw CommError("smddp: rank " + std::to_string(cfg_.group_ranks[peer]) + " of group '" +
                    cfg_.group_name + "' published '" + name + "' as its segment name");
  }
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) {
    throw CommError("smddp: cannot open the shared memory segment of rank " +
                    std::to_string(cfg_.group_ranks[peer]) + " of group '" + cfg_.group_name +
                    "' (" + name + "): " + std::strerror(errno));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != seg_bytes_) {
    close(fd);
    throw CommError("smddp: shared memory segment of rank " +
                    std::to_string(cfg_.group_ranks[peer]) +
                    " has an unexpected size; do all ranks use the same SMDDP_BUFFER_BYTES and "
                    "SMDDP_POOL_BYTES and SMDDP_P2P_BYTES?");
  }
  // A peer's buffers are not pre-faulted: that would commit them all (lazy_).
  void* p = mmap(nullptr, main_bytes_, PROT_READ | PROT_WRITE,
                 MAP_SHARED | (lazy_ ? 0 : MAP_POPULATE), fd, 0);
  if (p != MAP_FAILED && cfg_.pool_bytes) {
    pool_base_[peer] = map_lazy(fd, main_bytes_, cfg_.pool_bytes);
    if (!pool_base_[peer]) {
      munmap(p, main_bytes_);
      p = MAP_FAILED;
    }
  }
  if (p != MAP_FAILED && p2p_region_bytes()) {
    p2p_base_[peer] = map_lazy(fd, main_bytes_ + cfg_.pool_bytes, p2p_region_bytes());
    if (!p2p_base_[peer]) {
      munmap(p, main_bytes_);
      if (pool_base_[peer]) munmap(pool_base_[peer], cfg_.pool_bytes);
      pool_base_[peer] = nullptr;
      p = MAP_FAILED;
    }
  }
  close(fd);
  if (p == MAP_FAILED) {
    throw CommError("smddp: cannot map the shared memory segment of rank " +
                    std::to_string(cfg_.group_ranks[peer]) + ": " + std::strerror(errno));
  }
  maps_[peer] = p;
  ctl_[peer] = static_cast<RankControl*>(p);
  data_[peer] = static_cast<char*>(p) + kControlBytes;
  if (ctl_[peer]->magic != kMagic) {
    throw CommError("smddp: shared memory segment of rank " +
                    std::to_string(cfg_.group_ranks[peer]) + " is not initialized");
  }
}

void ShmComm::unlink_own() {
  if (!own_linked_) return;
  shm_unlink(name_.c_str());
  own_linked_ = false;
  term_guard_.reset();
}

uint64_t ShmComm::begin_step(const OpCtx& ctx, bool first) {
  uint64_t s = next_step_++;
  // Buffer s % 2 was last used by step s - 2: wait until every peer finished it.
  if (s > 2) {
    for (int i = 0; i < size(); ++i) {
      if (i != rank()) wait_progress(i, 3 * (s - 2), ctx);
    }
  }
  // A collective may run several shm phases (hierarchical ones do); its descriptor is
  // published and checked once, at the first step of its first phase.
  if (first && ctx.seq + 1 != current_seq_plus1_) {
    // Note [Mismatch detection]: desc[seq % 2] last described collective `last - 1`; every
    // peer must have finished it (and so compared that descriptor) before it is overwritten.
    uint64_t last = slot_seq_plus1_[ctx.seq & 1];
    if (last != 0) {
      for (int i = 0; i < size(); ++i) {
        if (i != rank()) wait_finished(i, last, ctx);
      }
    }
    slot_seq_plus1_[ctx.seq & 1] = ctx.seq + 1;
    current_seq_plus1_ = ctx.seq + 1;
    first_step_ = s;
    std::fill(checked_.begin(), checked_.end(), 0);
    DescSlot& d = ctl(rank())->desc[ctx.seq & 1];
    d.first_step = s;
    d.desc = ctx.desc;
    d.call = CallSummary::of(ctx);  // copied, not formatted: check_desc formats
    d.seq_plus1.store(ctx.seq + 1, std::memory_order_release);
  }
  return s;
}

void ShmComm::publish_operand(const OpCtx& ctx, int64_t offset) {
  ctl(rank())->desc[ctx.seq & 1].pool_off = offset;
}

int64_t ShmComm::operand_of(int i, const OpCtx& ctx) const {
  return ctl(i)->desc[ctx.seq & 1].pool_off;
}

void ShmComm::post(uint64_t s, int phase) {
  RankControl* me = ctl(rank());
  me->cpu.store(sched_getcpu(), std::memory_order_relaxed);
  // seq_cst store, then seq_cst load of `sleepers`: either the sleeper sees the new value
  // before it sleeps, or we see its registration and wake it (Dekker-style handshake).
  me->progress.store(value(s, phase), std::memory_order_seq_cst);
  if (me->sleepers.load(std::memory_order_seq_cst) != 0) futex_wake(low_word(&me->progress));
}

bool ShmComm::step_open(const OpCtx& ctx, bool first) const {
  // The waits of begin_step, as tests.
  const uint64_t s = next_step_;
  for (int i = 0; i < size(); ++i) {
    if (i == rank()) continue;
    if (s > 2 && ctl(i)->progress.load(std::memory_order_acquire) < 3 * (s - 2)) return false;
    const uint64_t last = slot_seq_plus1_[ctx.seq & 1];
    if (first && ctx.seq + 1 != current_seq_plus1_ && last != 0 &&
        ctl(i)->finished.load(std::memory_order_acquire) < last) {
      return false;
    }
  }
  return true;
}

bool ShmComm::reached(int i, uint64_t s, int phase, const OpCtx& ctx) {
  if (i == rank()) return true;
  if (ctl(i)->progress.load(std::memory_order_acquire) < value(s, phase)) return false;
  if (!checked_[i] && s == first_step_) check_desc(i, ctx);
  return true;
}

void ShmComm::wait_one(int i, uint64_t s, int phase, const OpCtx& ctx) {
  if (i == rank()) return;
  wait_progress(i, value(s, phase), ctx);
  if (!checked_[i] && s == first_step_) check_desc(i, ctx);
}

void ShmComm::wait_all(uint64_t s, int phase, const OpCtx& ctx) {
  for (int i = 0; i < size(); ++i) wait_one(i, s, phase, ctx);
}

// Waiting policy. When the peer runs on another core: a busy spin (sub-microsecond
// hand-offs), then a futex sleep. When there are more local ranks than cores, the peer may
// need *our* core: sched_yield for a while (~4 us per hand-off on one core), then sleep.
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
  if (!me || me->failed.load()) return;
  std::strncpy(me->message, message.c_str(), sizeof(me->message) - 1);
  me->failed.store(1, std::memory_order_release);
  futex_wake(low_word(&me->progress));
}

void ShmComm::fail(const std::string& message) {
  mark_failed(message);
  throw CommError(message);
}

}  // namespace smddp
