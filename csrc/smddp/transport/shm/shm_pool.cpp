#include "smddp/transport/shm/shm_pool.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>

namespace smddp {

namespace {
constexpr size_t kCommitStep = 2 << 20;  // grow the committed region 2 MiB at a time
#ifndef MADV_POPULATE_WRITE
constexpr int MADV_POPULATE_WRITE = 23;  // Linux 5.14; older headers lack it
#endif
}  // namespace

bool commit_pages(char* p, size_t bytes, bool* unsupported) {
  if (unsupported) *unsupported = false;
  if (!bytes) return true;
  const uintptr_t page = 4096;
  uintptr_t start = reinterpret_cast<uintptr_t>(p) & ~(page - 1);
  uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes + page - 1) & ~(page - 1);
  while (madvise(reinterpret_cast<void*>(start), end - start, MADV_POPULATE_WRITE) != 0) {
    if (errno == EINTR || errno == EAGAIN) continue;
    if (errno == EINVAL && unsupported) *unsupported = true;
    return false;  // EFAULT/ENOMEM: touching would raise SIGBUS (/dev/shm is full)
  }
  return true;
}

bool can_commit_pages() {
  // An empty range is accepted exactly when the advice is known.
  static const bool ok = [] {
    static char probe[4096] __attribute__((aligned(4096)));
    return madvise(probe, 0, MADV_POPULATE_WRITE) == 0;
  }();
  return ok;
}

ShmPool::ShmPool(int fd, size_t file_offset, char* base, size_t bytes)
    : fd_(fd), file_offset_(file_offset), base_(base), bytes_(bytes) {
  if (bytes_) free_[0] = bytes_;
  if (fd_ >= 0 && can_commit_pages()) {
    close(fd_);
    fd_ = -1;
  }
}

ShmPool::~ShmPool() {
  if (base_) munmap(base_, bytes_);
  if (fd_ >= 0) close(fd_);
}

bool ShmPool::commit(size_t end) {
  if (end <= committed_) return true;
  size_t target = std::min(bytes_, (end + kCommitStep - 1) / kCommitStep * kCommitStep);
  const bool ok = fd_ < 0 ? commit_pages(base_ + committed_, target - committed_)
                          : posix_fallocate(fd_, static_cast<off_t>(file_offset_ + committed_),
                                            static_cast<off_t>(target - committed_)) == 0;
  if (!ok) return false;
  committed_ = target;
  return true;
}

void* ShmPool::allocate(size_t bytes) {
  size_t need = std::max<size_t>(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
  std::lock_guard<std::mutex> g(mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    size_t off = it->first, len = it->second;
    if (!commit(off + need)) return nullptr;
    free_.erase(it);
    if (len > need) free_[off + need] = len - need;
    live_[off] = need;
    live_bytes_ += need;
    return base_ + off;
  }
  return nullptr;
}

void ShmPool::release(void* p) {
  std::lock_guard<std::mutex> g(mu_);
  size_t off = static_cast<size_t>(static_cast<char*>(p) - base_);
  auto live = live_.find(off);
  if (live == live_.end()) return;
  size_t len = live->second;
  live_.erase(live);
  live_bytes_ -= len;
  // Coalesce with the free neighbours on both sides.
  auto next = free_.lower_bound(off);
  if (next != free_.end() && off + len == next->first) {
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      prev->second += len;
      return;
    }
  }
  free_[off] = len;
}

int64_t ShmPool::offset_of(const void* p, size_t bytes) const {
  const char* c = static_cast<const char*>(p);
  if (c < base_ || c + bytes > base_ + bytes_) return -1;
  return static_cast<int64_t>(c - base_);
}

size_t ShmPool::in_use() const {
  std::lock_guard<std::mutex> g(mu_);
  return live_bytes_;
}

}  // namespace smddp
