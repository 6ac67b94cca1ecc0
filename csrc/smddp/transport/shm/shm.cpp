#include "smddp/transport/shm/shm.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "smddp/transport/shm/shm_names.h"

namespace smddp {
namespace {

constexpr uint64_t kMagic = 0x736d646470763031ull;  // "smddpv01"
constexpr size_t kControlBytes = 4096;

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
  // A rank alone on its host never waits for a local peer: only its chunk size would change.
  oversubscribed_ =
      n > (cfg_.cpus > 0 ? cfg_.cpus : online_cpus()) || (n > 1 && cfg_.machine_oversubscribed);
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
  publish(me->progress, me->sleepers, value(s, phase));
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

}  // namespace smddp
