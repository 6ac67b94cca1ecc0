// A rank's tensor pool: the tail of its shared-memory segment, handed out to tensors that
// the group's collectives can then read without staging copies (Note [Zero-copy operands]
// in shm_algos.h). Every local peer maps the pool; only the owner allocates from it.
//
// The region is created sparse (ftruncate) and committed as the high-water mark grows
// (commit_pages(): MADV_POPULATE_WRITE on the mapping, or fallocate on the segment's
// descriptor where the kernel lacks it), so an oversized pool costs nothing until used and
// a full /dev/shm shows up as a failed allocation (the caller falls back to ordinary
// memory) instead of a SIGBUS when a page is first touched. Freed blocks are reused first-fit; like
// a caching allocator, committed pages are kept until the group is destroyed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>

namespace smddp {

// Commits (allocates in /dev/shm) the pages of [p, p + bytes) of a shared mapping, so that
// touching them later cannot raise SIGBUS; false when /dev/shm has no room. Kernels
// without MADV_POPULATE_WRITE (before 5.14): returns false and sets `unsupported`.
bool commit_pages(char* p, size_t bytes, bool* unsupported = nullptr);
// Whether commit_pages works on this kernel.
bool can_commit_pages();

class ShmPool {
 public:
  // `fd` is the owner's segment; the pool occupies [file_offset, file_offset + bytes) of
  // it, mapped at `base`. The pool takes `fd`: it closes it at once where the kernel can
  // commit pages through the mapping (Note [One transport per process] in work.h), else
  // keeps it for fallocate and closes it in the destructor.
  ShmPool(int fd, size_t file_offset, char* base, size_t bytes);
  ~ShmPool();
  ShmPool(const ShmPool&) = delete;
  ShmPool& operator=(const ShmPool&) = delete;

  // A block of at least `bytes` bytes, aligned to kAlign, or nullptr when the pool (or
  // /dev/shm) has no room.
  void* allocate(size_t bytes);
  void release(void* p);
  // Offset of [p, p + bytes) inside the pool, or -1 when the range is not entirely in it.
  int64_t offset_of(const void* p, size_t bytes) const;
  size_t bytes() const { return bytes_; }
  size_t in_use() const;

  static constexpr size_t kAlign = 256;

 private:
  bool commit(size_t end);

  int fd_;  // -1: pages are committed through the mapping
  size_t file_offset_;
  char* base_;
  size_t bytes_;
  size_t committed_ = 0;  // [0, committed_) is backed by fallocate'd pages
  mutable std::mutex mu_;
  std::map<size_t, size_t> free_;            // offset -> length, coalesced
  std::unordered_map<size_t, size_t> live_;  // offset -> length
  size_t live_bytes_ = 0;
};

}  // namespace smddp
