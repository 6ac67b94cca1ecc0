// Point-to-point messages between the ranks of one host, over the channels of Note
// [Shared-memory point-to-point] (shm.h).
#pragma once

#include <deque>
#include <mutex>
#include <vector>

#include "smddp/transport/shm/shm.h"
#include "smddp/transport/transport.h"

namespace smddp {

class ShmP2P {
 public:
  explicit ShmP2P(ShmComm& shm);

  // Sends `bytes` to local rank `to`, waiting for ring space as needed. Sends to one peer
  // are written in call order (one at a time per channel).
  void send(int to, uint32_t tag, const void* data, size_t bytes, const OpCtx& ctx);
  // Receives the oldest message from local rank `from` with `tag` into `data`; raises if
  // its size is not `bytes`.
  void recv(int from, uint32_t tag, void* data, size_t bytes, const OpCtx& ctx);

  // Non-blocking forms for the caller's thread: each completes the whole operation and
  // returns true, or does nothing and returns false (no ring space for the whole message,
  // message not fully there, or the channel is busy in another thread).
  bool try_send(int to, uint32_t tag, const void* data, size_t bytes);
  bool try_recv(int from, uint32_t tag, void* data, size_t bytes);

  // Whether a message with `tag` from local rank `from` is ready for recv() to take next
  // (Note [Receive from any rank] in backend_p2p.cpp): stashed, or the next one in the ring.
  // Messages with other tags that are in the way are stashed. Never waits for a message
  // to begin (but finishes reading one that has begun).
  bool probe(int from, uint32_t tag, const OpCtx& ctx);

  // The budget of each channel for messages nobody waits for yet (kStashBytes; Note [Stash
  // budget in shared memory] in shm_p2p.cpp). Tests set a smaller one before any traffic.
  void set_stash_budget(size_t bytes) { stash_budget_ = bytes; }

 private:
  struct Stashed {
    uint32_t tag;
    std::vector<char> data;
  };
  struct Inbox {
    std::mutex mu;              // one reader at a time
    std::deque<Stashed> stash;  // messages read past while looking for another tag
    // What the stashed messages count against the budget: their lengths and
    // kStashEntryBytes each (Note [Stash budget in shared memory]).
    size_t stash_bytes = 0;
  };
  struct Outbox {
    std::mutex mu;         // one writer at a time
    size_t committed = 0;  // ring bytes committed (ShmComm::commit_ring), under mu
  };
  // Commits the ring to `to` up to absolute byte position `end` before it is written.
  void reserve(int to, uint64_t end);

  // Copies the oldest stashed message with `tag` into `data`; with `ctx` a size mismatch
  // raises, without it the message stays and false is returned.
  bool take_stashed(Inbox& in, uint32_t tag, void* data, size_t bytes, const OpCtx* ctx);
  // Reads the next message from local rank `from` (inbox lock held): into `data` when its
  // tag is `tag` (returns true), into the stash otherwise (returns false). Raises, before
  // consuming the message, when it would not fit the stash budget.
  bool read_next(int from, uint32_t tag, void* data, size_t bytes, const OpCtx& ctx);
  [[noreturn]] static void size_mismatch(uint32_t tag, size_t got, size_t want, const OpCtx& ctx);
  [[noreturn]] void over_budget(int from, uint32_t tag, uint64_t got_bytes, uint32_t got_tag,
                                size_t held, const OpCtx& ctx) const;

  ShmComm& shm_;
  size_t cap_;  // ring bytes
  size_t stash_budget_ = kStashBytes;
  std::vector<Inbox> in_;
  std::vector<Outbox> out_;
};

}  // namespace smddp
